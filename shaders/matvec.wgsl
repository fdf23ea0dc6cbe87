// The matrix-vector kernels' workgroup layout and lane reduction, shared by
// matmul.wgsl's matmul_forward_matvec (f32 weights) and f16_weights.wgsl's
// matvec_f16w_forward (f16 weights), which differ only in how they load B.
// A workgroup of MATVEC_WG lanes owns MATVEC_COLS columns of C and
// MATVEC_ROWS rows (≤ 4); each lane sums its share of k for every column in
// a vec4 per (row, column), and matvec_reduce adds them over the lanes.
// Rows and lanes are overrides: a pipeline per row count, 8 lanes (one SIMD
// row) on a CPU adapter, 64 on a GPU.
override MATVEC_ROWS: u32 = 1u;
override MATVEC_WG: u32 = 64u;
const MATVEC_COLS: u32 = 8u;
// [MATVEC_COLS][MATVEC_WG], MATVEC_WG ≤ 64.
var<workgroup> matvec_partial: array<vec4<f32>, 512>;
// n and k, for the kernels to pass through workgroup memory: lavapipe
// inlines uniform values that bound loops and re-optimizes the shader on
// every dispatch (loss.wgsl); a value from workgroupUniformLoad is not.
var<workgroup> matvec_sizes: vec2<u32>;

// One row of a workgroup's block: each lane's sums (acc[c] for column c)
// into workgroup memory, then a fixed tree over the lanes; returns column
// `lane`'s total to lanes < MATVEC_COLS (lanes past them get column
// MATVEC_COLS - 1's, to be ignored). Call from uniform control flow.
fn matvec_reduce(lane: u32, acc: array<vec4<f32>, 8>) -> f32 {
    // The previous row's sums have been read.
    workgroupBarrier();
    for (var c = 0u; c < MATVEC_COLS; c++) {
        matvec_partial[c * MATVEC_WG + lane] = acc[c];
    }
    for (var stride = MATVEC_WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lane < stride {
            for (var c = 0u; c < MATVEC_COLS; c++) {
                matvec_partial[c * MATVEC_WG + lane] += matvec_partial[c * MATVEC_WG + lane + stride];
            }
        }
    }
    workgroupBarrier();
    return dot(matvec_partial[min(lane, MATVEC_COLS - 1u) * MATVEC_WG], vec4<f32>(1.0));
}
