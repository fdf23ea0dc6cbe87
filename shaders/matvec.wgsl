// The matrix-vector kernels' workgroup layout and lane reduction, shared by
// matmul.wgsl's matmul_forward_matvec (f32 weights) and f16_weights.wgsl's
// matvec_f16w_forward (f16 weights), which differ only in how they load B.
// A workgroup of MATVEC_WG lanes owns MATVEC_COLS columns of C and
// up to MATVEC_ROWS rows (≤ 4); each lane sums its share of k for every
// column in a vec4 per (row, column), and matvec_reduce adds them over the
// lanes. MATVEC_ROWS is a bucket of row counts (the Rust side's
// matvec_rows_bucket), not the rows: a pipeline serves every row count up
// to it, the launch's rows (p.m) coming at run time, so a server's batches
// of each size do not each compile one. Rows past p.m are clamped on load
// and never stored. Lanes are an override: 8 (one SIMD row) on a CPU
// adapter, 64 on a GPU.
override MATVEC_ROWS: u32 = 1u;
override MATVEC_WG: u32 = 64u;
const MATVEC_COLS: u32 = 8u;
// [MATVEC_COLS][MATVEC_WG], MATVEC_WG ≤ 64.
var<workgroup> matvec_partial: array<vec4<f32>, 512>;
// n, k and the launch's rows, for the kernels to pass through workgroup
// memory: lavapipe inlines uniform values that bound loops and
// re-optimizes the shader on every dispatch (loss.wgsl); a value from
// workgroupUniformLoad is not.
var<workgroup> matvec_sizes: vec3<u32>;

// Row `row` of a matvec workgroup's block: each lane's sums (acc[c] for
// column col0 + c) into workgroup memory, a fixed tree over the lanes, and
// lane c stores column col0 + c through write_c, the composing family's
// epilogue (`fn write_c(row: u32, col: u32, product: f32)`). Called from
// uniform control flow (MATVEC_ROWS is an override).
fn matvec_row(lane: u32, col0: u32, n: u32, row: u32, acc: array<vec4<f32>, 8>) {
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
    let col = col0 + lane;
    if lane < MATVEC_COLS && col < n {
        write_c(row, col, dot(matvec_partial[lane * MATVEC_WG], vec4<f32>(1.0)));
    }
}
