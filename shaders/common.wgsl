// Shared by every family with one-invocation-per-element kernels; no entry
// points. Composed into those families by Family::source (after the
// family's own file: WGSL declarations may come in any order) and listed in
// Family::shared, which tests/shaders.rs checks against what each file uses.

// Invocations per workgroup of the flat kernels (kernels::FLAT_WORKGROUP on
// the Rust side, which sizes their grids).
const WG: u32 = 256u;

// The element of a 256-wide invocation in a grid spread over x and y, so
// that no dimension passes the 65,535-workgroup limit; the Rust side
// (Kernels::grid) may overshoot, so callers check the index against n.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}
