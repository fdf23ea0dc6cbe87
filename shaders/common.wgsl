// Shared by every family with one-invocation-per-element kernels; no entry
// points. Composed into those families by Family::source (after the
// family's own file: WGSL declarations may come in any order) and listed in
// Family::shared, which tests/shaders.rs checks against what each file uses.

// Invocations per workgroup of the flat kernels (kernels::FLAT_WORKGROUP on
// the Rust side, which sizes their grids).
const WG: u32 = 256u;

// Invocations per workgroup of the column kernels, one invocation per column
// summing its rows (kernels::COLUMN_WORKGROUP sizes their grids). Narrower
// than WG so a transformer's 128 columns fill two workgroups, not half of
// one: a CPU adapter runs a workgroup on one thread.
const COLUMN_WG: u32 = 64u;

// The column of a COLUMN_WG-wide invocation in a grid spread over x and y.
fn column_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * COLUMN_WG + lid.x;
}

// The element of a 256-wide invocation in a grid spread over x and y, so
// that no dimension passes the 65,535-workgroup limit; the Rust side
// (Kernels::grid) may overshoot, so callers check the index against n.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}
