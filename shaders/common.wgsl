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

// The lowest finite f32, written exactly (-3.40282347e38 rounds past f32's
// range as an abstract float, which Tint rejects): a running maximum's start,
// whose exp-weight is 0, so it never shows in a result.
const LOWEST: f32 = -0x1.fffffep+127f;

// A quiet NaN, the result of an invalid input (an id outside the vocabulary,
// a position past the context). From a run-time value: a constant expression
// that evaluates to NaN is a shader-creation error in WGSL (Tint enforces it).
fn quiet_nan() -> f32 {
    var bits = 0x7fc00000u;
    return bitcast<f32>(bits);
}
