// f32 activations, f16 weights, f32 arithmetic: the generation kernels of a
// model whose weights are stored in f16 (`Generator` with `WeightDtype::F16`,
// `wgrad generate --dtype f16`): halving the weights' bytes halves what a
// decode step reads. Needs the SHADER_F16 feature (`enable f16`); the Rust
// side refuses an adapter without it before this file is ever compiled.
//   matvec_f16w_forward:           C[M,N] = A[M,K] · B[N,K]ᵀ, M ≤ 4 (decode)
//   matmul_f16w_forward_small:     the same for any M, products ≤ 2^20 MACs
//   matmul_f16w_forward_register:  the same for larger products (prefill)
//                                  on a CPU adapter
//   matmul_f16w_forward_shared:    the same on a GPU (workgroup memory),
//   matmul_f16w_forward_shared_vec   with scalar or vector loads
//   embedding_f16w_forward:        out[n,C] = table[ids[n], :]
// A, C, bias and pre are f32; B and the table are f16, bound as 4-byte words
// (value 2i in the low half of word i, as kernels::F16Tensor). Each f16 is
// widened to f32 (exactly) as it is loaded, so these kernels compute what
// the f32 kernels compute on the weights rounded to f16.
// Only ABt: a Linear layer's weight and the tied head are stored [out, in].
// The epilogue is matmul.wgsl's forward one (bias, activation, the
// pre-activation kept) with the same activations.wgsl; training's
// accumulate and activation-gradient epilogues have no use here.

enable f16;

override HAS_BIAS: bool = false;
override ACTIVATION_FORWARD: bool = false;
override STORE_PRE: bool = false;

struct F16wParams {
    m: u32,
    n: u32,
    k: u32,
    // Number of 64-wide column tiles, and all tiles (guards grid overshoot).
    tiles_n: u32,
    tiles_total: u32,
    // An ACT_* code of activations.wgsl; read only by the epilogue.
    activation: u32,
    // Elements between rows of C and pre: the whole product's n when this
    // launch computes a block of its columns (B too large for one binding).
    ldc: u32,
    // The launch's first column in the whole product: where it reads bias.
    bias_base: u32,
    // Where the launch's B starts in its binding, in f16 values, and its C
    // (and pre) in theirs, in f32 values: a block of a large operand is
    // bound from the nearest storage-offset-aligned word before it.
    b_base: u32,
    c_base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(0) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> b: array<f16>;
// The matrix-vector kernel's view of B: 8 f16 values per element.
@group(0) @binding(1) var<storage, read> b8: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> p: F16wParams;

// matmul_tiles.wgsl's staging reads A through this (matmul.wgsl's may be f16).
fn load_a(i: u32) -> f32 {
    return a[i];
}
// Unused slots hold placeholders (`pre` C itself: a writable slot cannot
// share the read-only placeholder) and are never touched.
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> pre: array<f32>;

const F16W_TILE: u32 = 64u;

// The epilogue: C[row, col] (of this launch) = act(product + bias); named
// as matmul.wgsl's, for matvec_row.
fn write_c(row: u32, col: u32, product: f32) {
    let i = p.c_base + row * p.ldc + col;
    var v = product;
    if HAS_BIAS {
        v += bias[p.bias_base + col];
    }
    if STORE_PRE {
        pre[i] = v;
    }
    if ACTIVATION_FORWARD {
        v = activation_forward(p.activation, v);
    }
    c[i] = v;
}

// Decode's products: M ≤ 4 rows (one new token per sequence), K a multiple
// of 8, A and B starting 16-byte aligned (the Rust side checks, and picks
// the tiled kernels otherwise). matmul.wgsl's matmul_forward_matvec with B
// read 8 weights per load, a vec4<u32> of packed pairs widened by
// unpack2x16float: lavapipe issues storage loads lane by lane, so a step
// costs what its loads do, and this halves them per weight against the f32
// kernel's vec4<f32> (vec4<f16> loads, 4 weights each, measured no faster
// than f32 there; bitcast<vec2<f16>> of the words gave wrong values on
// lavapipe, Mesa 22.3). unpack2x16float needs wgpu's SHADER_F16_IN_F32,
// which every backend offering SHADER_F16 has. A workgroup of MATVEC_WG lanes owns
// MATVEC_COLS columns of C; lane l sums the 8-wide steps k8 = l,
// l + MATVEC_WG, … of its columns' rows of B against the same of each
// row of A; a fixed tree over the lanes in workgroup memory sums them, and
// lane c stores column c. A bucket of rows and lanes are overrides (a
// pipeline per bucket, the launch's rows at run time; 8 lanes on a CPU adapter, 64 on a GPU); the accumulators are
// unrolled by hand (a private array indexed in a loop becomes per-lane
// memory on llvmpipe).
// MATVEC_ROWS, MATVEC_WG, MATVEC_COLS, matvec_sizes and the lane reduction
// are matvec.wgsl's, as for matmul_forward_matvec.
@compute @workgroup_size(MATVEC_WG, 1, 1)
fn matvec_f16w_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    // n, k through workgroup memory: lavapipe inlines uniform values that
    // bound loops and re-optimizes the shader on every dispatch (loss.wgsl).
    if lid.x == 0u {
        matvec_sizes = vec3<u32>(p.n, p.k, p.m);
    }
    let sizes = workgroupUniformLoad(&matvec_sizes);
    let n = sizes.x;
    let k4 = sizes.y / 4u;
    let k8 = sizes.y / 8u;
    let col0 = (wid.y * nwg.x + wid.x) * MATVEC_COLS;
    if col0 >= n {
        return;
    }
    let lane = lid.x;
    // Offsets of B in 8-value units, of A in vec4s; columns past n and rows
    // past M are clamped (read, never stored).
    let last_col = n - 1u;
    let b8o = p.b_base / 8u;
    let rows = sizes.z;
    let last_row = rows - 1u;
    let rb0 = b8o + min(col0 + 0u, last_col) * k8;
    let rb1 = b8o + min(col0 + 1u, last_col) * k8;
    let rb2 = b8o + min(col0 + 2u, last_col) * k8;
    let rb3 = b8o + min(col0 + 3u, last_col) * k8;
    let rb4 = b8o + min(col0 + 4u, last_col) * k8;
    let rb5 = b8o + min(col0 + 5u, last_col) * k8;
    let rb6 = b8o + min(col0 + 6u, last_col) * k8;
    let rb7 = b8o + min(col0 + 7u, last_col) * k8;
    let ra0 = min(0u, last_row) * k4;
    let ra1 = min(1u, last_row) * k4;
    let ra2 = min(2u, last_row) * k4;
    let ra3 = min(3u, last_row) * k4;
    var acc00 = vec4<f32>(0.0);
    var acc01 = vec4<f32>(0.0);
    var acc02 = vec4<f32>(0.0);
    var acc03 = vec4<f32>(0.0);
    var acc04 = vec4<f32>(0.0);
    var acc05 = vec4<f32>(0.0);
    var acc06 = vec4<f32>(0.0);
    var acc07 = vec4<f32>(0.0);
    var acc10 = vec4<f32>(0.0);
    var acc11 = vec4<f32>(0.0);
    var acc12 = vec4<f32>(0.0);
    var acc13 = vec4<f32>(0.0);
    var acc14 = vec4<f32>(0.0);
    var acc15 = vec4<f32>(0.0);
    var acc16 = vec4<f32>(0.0);
    var acc17 = vec4<f32>(0.0);
    var acc20 = vec4<f32>(0.0);
    var acc21 = vec4<f32>(0.0);
    var acc22 = vec4<f32>(0.0);
    var acc23 = vec4<f32>(0.0);
    var acc24 = vec4<f32>(0.0);
    var acc25 = vec4<f32>(0.0);
    var acc26 = vec4<f32>(0.0);
    var acc27 = vec4<f32>(0.0);
    var acc30 = vec4<f32>(0.0);
    var acc31 = vec4<f32>(0.0);
    var acc32 = vec4<f32>(0.0);
    var acc33 = vec4<f32>(0.0);
    var acc34 = vec4<f32>(0.0);
    var acc35 = vec4<f32>(0.0);
    var acc36 = vec4<f32>(0.0);
    var acc37 = vec4<f32>(0.0);
    for (var kk = lane; kk < k8; kk += MATVEC_WG) {
        let p0 = b8[rb0 + kk];
        let w0l = vec4<f32>(unpack2x16float(p0.x), unpack2x16float(p0.y));
        let w0h = vec4<f32>(unpack2x16float(p0.z), unpack2x16float(p0.w));
        let p1 = b8[rb1 + kk];
        let w1l = vec4<f32>(unpack2x16float(p1.x), unpack2x16float(p1.y));
        let w1h = vec4<f32>(unpack2x16float(p1.z), unpack2x16float(p1.w));
        let p2 = b8[rb2 + kk];
        let w2l = vec4<f32>(unpack2x16float(p2.x), unpack2x16float(p2.y));
        let w2h = vec4<f32>(unpack2x16float(p2.z), unpack2x16float(p2.w));
        let p3 = b8[rb3 + kk];
        let w3l = vec4<f32>(unpack2x16float(p3.x), unpack2x16float(p3.y));
        let w3h = vec4<f32>(unpack2x16float(p3.z), unpack2x16float(p3.w));
        let p4 = b8[rb4 + kk];
        let w4l = vec4<f32>(unpack2x16float(p4.x), unpack2x16float(p4.y));
        let w4h = vec4<f32>(unpack2x16float(p4.z), unpack2x16float(p4.w));
        let p5 = b8[rb5 + kk];
        let w5l = vec4<f32>(unpack2x16float(p5.x), unpack2x16float(p5.y));
        let w5h = vec4<f32>(unpack2x16float(p5.z), unpack2x16float(p5.w));
        let p6 = b8[rb6 + kk];
        let w6l = vec4<f32>(unpack2x16float(p6.x), unpack2x16float(p6.y));
        let w6h = vec4<f32>(unpack2x16float(p6.z), unpack2x16float(p6.w));
        let p7 = b8[rb7 + kk];
        let w7l = vec4<f32>(unpack2x16float(p7.x), unpack2x16float(p7.y));
        let w7h = vec4<f32>(unpack2x16float(p7.z), unpack2x16float(p7.w));
        let x0l = a4[ra0 + 2u * kk];
        let x0h = a4[ra0 + 2u * kk + 1u];
        acc00 = fma(w0h, x0h, fma(w0l, x0l, acc00));
        acc01 = fma(w1h, x0h, fma(w1l, x0l, acc01));
        acc02 = fma(w2h, x0h, fma(w2l, x0l, acc02));
        acc03 = fma(w3h, x0h, fma(w3l, x0l, acc03));
        acc04 = fma(w4h, x0h, fma(w4l, x0l, acc04));
        acc05 = fma(w5h, x0h, fma(w5l, x0l, acc05));
        acc06 = fma(w6h, x0h, fma(w6l, x0l, acc06));
        acc07 = fma(w7h, x0h, fma(w7l, x0l, acc07));
        if MATVEC_ROWS > 1u {
            let x1l = a4[ra1 + 2u * kk];
            let x1h = a4[ra1 + 2u * kk + 1u];
            acc10 = fma(w0h, x1h, fma(w0l, x1l, acc10));
            acc11 = fma(w1h, x1h, fma(w1l, x1l, acc11));
            acc12 = fma(w2h, x1h, fma(w2l, x1l, acc12));
            acc13 = fma(w3h, x1h, fma(w3l, x1l, acc13));
            acc14 = fma(w4h, x1h, fma(w4l, x1l, acc14));
            acc15 = fma(w5h, x1h, fma(w5l, x1l, acc15));
            acc16 = fma(w6h, x1h, fma(w6l, x1l, acc16));
            acc17 = fma(w7h, x1h, fma(w7l, x1l, acc17));
        }
        if MATVEC_ROWS > 2u {
            let x2l = a4[ra2 + 2u * kk];
            let x2h = a4[ra2 + 2u * kk + 1u];
            acc20 = fma(w0h, x2h, fma(w0l, x2l, acc20));
            acc21 = fma(w1h, x2h, fma(w1l, x2l, acc21));
            acc22 = fma(w2h, x2h, fma(w2l, x2l, acc22));
            acc23 = fma(w3h, x2h, fma(w3l, x2l, acc23));
            acc24 = fma(w4h, x2h, fma(w4l, x2l, acc24));
            acc25 = fma(w5h, x2h, fma(w5l, x2l, acc25));
            acc26 = fma(w6h, x2h, fma(w6l, x2l, acc26));
            acc27 = fma(w7h, x2h, fma(w7l, x2l, acc27));
        }
        if MATVEC_ROWS > 3u {
            let x3l = a4[ra3 + 2u * kk];
            let x3h = a4[ra3 + 2u * kk + 1u];
            acc30 = fma(w0h, x3h, fma(w0l, x3l, acc30));
            acc31 = fma(w1h, x3h, fma(w1l, x3l, acc31));
            acc32 = fma(w2h, x3h, fma(w2l, x3l, acc32));
            acc33 = fma(w3h, x3h, fma(w3l, x3l, acc33));
            acc34 = fma(w4h, x3h, fma(w4l, x3l, acc34));
            acc35 = fma(w5h, x3h, fma(w5l, x3l, acc35));
            acc36 = fma(w6h, x3h, fma(w6l, x3l, acc36));
            acc37 = fma(w7h, x3h, fma(w7l, x3l, acc37));
        }
    }
    matvec_row(lane, col0, n, 0u, array<vec4<f32>, 8>(acc00, acc01, acc02, acc03, acc04, acc05, acc06, acc07));
    if MATVEC_ROWS > 1u && rows > 1u {
        matvec_row(lane, col0, n, 1u, array<vec4<f32>, 8>(acc10, acc11, acc12, acc13, acc14, acc15, acc16, acc17));
    }
    if MATVEC_ROWS > 2u && rows > 2u {
        matvec_row(lane, col0, n, 2u, array<vec4<f32>, 8>(acc20, acc21, acc22, acc23, acc24, acc25, acc26, acc27));
    }
    if MATVEC_ROWS > 3u && rows > 3u {
        matvec_row(lane, col0, n, 3u, array<vec4<f32>, 8>(acc30, acc31, acc32, acc33, acc34, acc35, acc36, acc37));
    }
}

// Small products (≤ 2^20 multiply-adds; the Rust side picks by shape, as
// for matmul.wgsl's matmul_forward_small, which this follows): a workgroup
// of 8×8 invocations computes one 64×64 tile of C, invocation (x, y) the
// 8×8 block of rows 8·y + 0..7 and columns x + 8·j, j in 0..7, in 8 mat2x4
// accumulators. It compiles in tens of milliseconds. Edges are clamped on
// load and masked on store (fma_row8, store_row8: matmul_rows.wgsl's).

@compute @workgroup_size(8, 8, 1)
fn matmul_f16w_forward_small(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * F16W_TILE + lid.y * 8u;
    let col0 = (tile % p.tiles_n) * F16W_TILE + lid.x;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    let k = p.k;
    let last_row = vec4<u32>(p.m - 1u);
    let last_col = vec4<u32>(p.n - 1u);
    let ra_lo = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), last_row) * k;
    let ra_hi = min(vec4<u32>(row0) + vec4<u32>(4u, 5u, 6u, 7u), last_row) * k;
    let cb_lo = min(vec4<u32>(col0) + vec4<u32>(0u, 8u, 16u, 24u), last_col) * k + vec4<u32>(p.b_base);
    let cb_hi = min(vec4<u32>(col0) + vec4<u32>(32u, 40u, 48u, 56u), last_col) * k + vec4<u32>(p.b_base);
    // acc_i[j / 4][j % 4]: row row0 + i, column col0 + 8·j.
    var acc0 = mat2x4<f32>();
    var acc1 = mat2x4<f32>();
    var acc2 = mat2x4<f32>();
    var acc3 = mat2x4<f32>();
    var acc4 = mat2x4<f32>();
    var acc5 = mat2x4<f32>();
    var acc6 = mat2x4<f32>();
    var acc7 = mat2x4<f32>();
    for (var kk = 0u; kk < k; kk++) {
        let b_lo = vec4<f32>(f32(b[cb_lo.x + kk]), f32(b[cb_lo.y + kk]), f32(b[cb_lo.z + kk]), f32(b[cb_lo.w + kk]));
        let b_hi = vec4<f32>(f32(b[cb_hi.x + kk]), f32(b[cb_hi.y + kk]), f32(b[cb_hi.z + kk]), f32(b[cb_hi.w + kk]));
        acc0 = fma_row8(acc0, a[ra_lo.x + kk], b_lo, b_hi);
        acc1 = fma_row8(acc1, a[ra_lo.y + kk], b_lo, b_hi);
        acc2 = fma_row8(acc2, a[ra_lo.z + kk], b_lo, b_hi);
        acc3 = fma_row8(acc3, a[ra_lo.w + kk], b_lo, b_hi);
        acc4 = fma_row8(acc4, a[ra_hi.x + kk], b_lo, b_hi);
        acc5 = fma_row8(acc5, a[ra_hi.y + kk], b_lo, b_hi);
        acc6 = fma_row8(acc6, a[ra_hi.z + kk], b_lo, b_hi);
        acc7 = fma_row8(acc7, a[ra_hi.w + kk], b_lo, b_hi);
    }
    store_row8(row0 + 0u, col0, acc0);
    store_row8(row0 + 1u, col0, acc1);
    store_row8(row0 + 2u, col0, acc2);
    store_row8(row0 + 3u, col0, acc3);
    store_row8(row0 + 4u, col0, acc4);
    store_row8(row0 + 5u, col0, acc5);
    store_row8(row0 + 6u, col0, acc6);
    store_row8(row0 + 7u, col0, acc7);
}

// Larger products (a prompt's projections): matmul.wgsl's register-blocked
// layout, fastest on llvmpipe, where storage loads are issued lane by lane
// and multiply-adds per load decide speed: 8-wide workgroups, one 64×64
// tile of C each; invocation x owns rows 32·(x / 4) + 0..31 and columns
// x % 4 + 4·j, j in 0..15, in 32 mat4x4 accumulators: per step of k, 32
// loads of A, 16 of B and 512 multiply-adds. Edge rows and columns are
// clamped on load (no branch in the k loop) and masked on store. The cost
// is compile time: seconds per pipeline on a CPU adapter. mm_row_fma and
// mm_store_row are matmul_rows.wgsl's.

@compute @workgroup_size(8, 1, 1)
fn matmul_f16w_forward_register(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * F16W_TILE + (lid.x / 4u) * 32u;
    let col0 = (tile % p.tiles_n) * F16W_TILE + lid.x % 4u;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    let k = p.k;
    let last_row = p.m - 1u;
    let last_col = p.n - 1u;
    let ra0 = min(row0 + 0u, last_row) * k;
    let ra1 = min(row0 + 1u, last_row) * k;
    let ra2 = min(row0 + 2u, last_row) * k;
    let ra3 = min(row0 + 3u, last_row) * k;
    let ra4 = min(row0 + 4u, last_row) * k;
    let ra5 = min(row0 + 5u, last_row) * k;
    let ra6 = min(row0 + 6u, last_row) * k;
    let ra7 = min(row0 + 7u, last_row) * k;
    let ra8 = min(row0 + 8u, last_row) * k;
    let ra9 = min(row0 + 9u, last_row) * k;
    let ra10 = min(row0 + 10u, last_row) * k;
    let ra11 = min(row0 + 11u, last_row) * k;
    let ra12 = min(row0 + 12u, last_row) * k;
    let ra13 = min(row0 + 13u, last_row) * k;
    let ra14 = min(row0 + 14u, last_row) * k;
    let ra15 = min(row0 + 15u, last_row) * k;
    let ra16 = min(row0 + 16u, last_row) * k;
    let ra17 = min(row0 + 17u, last_row) * k;
    let ra18 = min(row0 + 18u, last_row) * k;
    let ra19 = min(row0 + 19u, last_row) * k;
    let ra20 = min(row0 + 20u, last_row) * k;
    let ra21 = min(row0 + 21u, last_row) * k;
    let ra22 = min(row0 + 22u, last_row) * k;
    let ra23 = min(row0 + 23u, last_row) * k;
    let ra24 = min(row0 + 24u, last_row) * k;
    let ra25 = min(row0 + 25u, last_row) * k;
    let ra26 = min(row0 + 26u, last_row) * k;
    let ra27 = min(row0 + 27u, last_row) * k;
    let ra28 = min(row0 + 28u, last_row) * k;
    let ra29 = min(row0 + 29u, last_row) * k;
    let ra30 = min(row0 + 30u, last_row) * k;
    let ra31 = min(row0 + 31u, last_row) * k;
    let cb0 = p.b_base + min(col0 + 0u, last_col) * k;
    let cb1 = p.b_base + min(col0 + 4u, last_col) * k;
    let cb2 = p.b_base + min(col0 + 8u, last_col) * k;
    let cb3 = p.b_base + min(col0 + 12u, last_col) * k;
    let cb4 = p.b_base + min(col0 + 16u, last_col) * k;
    let cb5 = p.b_base + min(col0 + 20u, last_col) * k;
    let cb6 = p.b_base + min(col0 + 24u, last_col) * k;
    let cb7 = p.b_base + min(col0 + 28u, last_col) * k;
    let cb8 = p.b_base + min(col0 + 32u, last_col) * k;
    let cb9 = p.b_base + min(col0 + 36u, last_col) * k;
    let cb10 = p.b_base + min(col0 + 40u, last_col) * k;
    let cb11 = p.b_base + min(col0 + 44u, last_col) * k;
    let cb12 = p.b_base + min(col0 + 48u, last_col) * k;
    let cb13 = p.b_base + min(col0 + 52u, last_col) * k;
    let cb14 = p.b_base + min(col0 + 56u, last_col) * k;
    let cb15 = p.b_base + min(col0 + 60u, last_col) * k;
    var acc0: mat4x4<f32>;
    var acc1: mat4x4<f32>;
    var acc2: mat4x4<f32>;
    var acc3: mat4x4<f32>;
    var acc4: mat4x4<f32>;
    var acc5: mat4x4<f32>;
    var acc6: mat4x4<f32>;
    var acc7: mat4x4<f32>;
    var acc8: mat4x4<f32>;
    var acc9: mat4x4<f32>;
    var acc10: mat4x4<f32>;
    var acc11: mat4x4<f32>;
    var acc12: mat4x4<f32>;
    var acc13: mat4x4<f32>;
    var acc14: mat4x4<f32>;
    var acc15: mat4x4<f32>;
    var acc16: mat4x4<f32>;
    var acc17: mat4x4<f32>;
    var acc18: mat4x4<f32>;
    var acc19: mat4x4<f32>;
    var acc20: mat4x4<f32>;
    var acc21: mat4x4<f32>;
    var acc22: mat4x4<f32>;
    var acc23: mat4x4<f32>;
    var acc24: mat4x4<f32>;
    var acc25: mat4x4<f32>;
    var acc26: mat4x4<f32>;
    var acc27: mat4x4<f32>;
    var acc28: mat4x4<f32>;
    var acc29: mat4x4<f32>;
    var acc30: mat4x4<f32>;
    var acc31: mat4x4<f32>;
    for (var kk = 0u; kk < k; kk++) {
        let bm = mat4x4<f32>(
            vec4<f32>(f32(b[cb0 + kk]), f32(b[cb1 + kk]), f32(b[cb2 + kk]), f32(b[cb3 + kk])),
            vec4<f32>(f32(b[cb4 + kk]), f32(b[cb5 + kk]), f32(b[cb6 + kk]), f32(b[cb7 + kk])),
            vec4<f32>(f32(b[cb8 + kk]), f32(b[cb9 + kk]), f32(b[cb10 + kk]), f32(b[cb11 + kk])),
            vec4<f32>(f32(b[cb12 + kk]), f32(b[cb13 + kk]), f32(b[cb14 + kk]), f32(b[cb15 + kk])),
        );
        acc0 = mm_row_fma(acc0, a[ra0 + kk], bm);
        acc1 = mm_row_fma(acc1, a[ra1 + kk], bm);
        acc2 = mm_row_fma(acc2, a[ra2 + kk], bm);
        acc3 = mm_row_fma(acc3, a[ra3 + kk], bm);
        acc4 = mm_row_fma(acc4, a[ra4 + kk], bm);
        acc5 = mm_row_fma(acc5, a[ra5 + kk], bm);
        acc6 = mm_row_fma(acc6, a[ra6 + kk], bm);
        acc7 = mm_row_fma(acc7, a[ra7 + kk], bm);
        acc8 = mm_row_fma(acc8, a[ra8 + kk], bm);
        acc9 = mm_row_fma(acc9, a[ra9 + kk], bm);
        acc10 = mm_row_fma(acc10, a[ra10 + kk], bm);
        acc11 = mm_row_fma(acc11, a[ra11 + kk], bm);
        acc12 = mm_row_fma(acc12, a[ra12 + kk], bm);
        acc13 = mm_row_fma(acc13, a[ra13 + kk], bm);
        acc14 = mm_row_fma(acc14, a[ra14 + kk], bm);
        acc15 = mm_row_fma(acc15, a[ra15 + kk], bm);
        acc16 = mm_row_fma(acc16, a[ra16 + kk], bm);
        acc17 = mm_row_fma(acc17, a[ra17 + kk], bm);
        acc18 = mm_row_fma(acc18, a[ra18 + kk], bm);
        acc19 = mm_row_fma(acc19, a[ra19 + kk], bm);
        acc20 = mm_row_fma(acc20, a[ra20 + kk], bm);
        acc21 = mm_row_fma(acc21, a[ra21 + kk], bm);
        acc22 = mm_row_fma(acc22, a[ra22 + kk], bm);
        acc23 = mm_row_fma(acc23, a[ra23 + kk], bm);
        acc24 = mm_row_fma(acc24, a[ra24 + kk], bm);
        acc25 = mm_row_fma(acc25, a[ra25 + kk], bm);
        acc26 = mm_row_fma(acc26, a[ra26 + kk], bm);
        acc27 = mm_row_fma(acc27, a[ra27 + kk], bm);
        acc28 = mm_row_fma(acc28, a[ra28 + kk], bm);
        acc29 = mm_row_fma(acc29, a[ra29 + kk], bm);
        acc30 = mm_row_fma(acc30, a[ra30 + kk], bm);
        acc31 = mm_row_fma(acc31, a[ra31 + kk], bm);
    }
    mm_store_row(row0 + 0u, col0, acc0);
    mm_store_row(row0 + 1u, col0, acc1);
    mm_store_row(row0 + 2u, col0, acc2);
    mm_store_row(row0 + 3u, col0, acc3);
    mm_store_row(row0 + 4u, col0, acc4);
    mm_store_row(row0 + 5u, col0, acc5);
    mm_store_row(row0 + 6u, col0, acc6);
    mm_store_row(row0 + 7u, col0, acc7);
    mm_store_row(row0 + 8u, col0, acc8);
    mm_store_row(row0 + 9u, col0, acc9);
    mm_store_row(row0 + 10u, col0, acc10);
    mm_store_row(row0 + 11u, col0, acc11);
    mm_store_row(row0 + 12u, col0, acc12);
    mm_store_row(row0 + 13u, col0, acc13);
    mm_store_row(row0 + 14u, col0, acc14);
    mm_store_row(row0 + 15u, col0, acc15);
    mm_store_row(row0 + 16u, col0, acc16);
    mm_store_row(row0 + 17u, col0, acc17);
    mm_store_row(row0 + 18u, col0, acc18);
    mm_store_row(row0 + 19u, col0, acc19);
    mm_store_row(row0 + 20u, col0, acc20);
    mm_store_row(row0 + 21u, col0, acc21);
    mm_store_row(row0 + 22u, col0, acc22);
    mm_store_row(row0 + 23u, col0, acc23);
    mm_store_row(row0 + 24u, col0, acc24);
    mm_store_row(row0 + 25u, col0, acc25);
    mm_store_row(row0 + 26u, col0, acc26);
    mm_store_row(row0 + 27u, col0, acc27);
    mm_store_row(row0 + 28u, col0, acc28);
    mm_store_row(row0 + 29u, col0, acc29);
    mm_store_row(row0 + 30u, col0, acc30);
    mm_store_row(row0 + 31u, col0, acc31);
}

// Stages B[col0.., k0..] (C's columns, steps of k) from p.b_base into
// mt_b's cols layout, widened to f32: consecutive invocations read
// consecutive steps of a row of B.
fn f16w_stage_b(t: u32, col0: u32, k0: u32) {
    let n = p.n;
    let k = p.k;
    for (var l = 0u; l < 8u; l++) {
        // 1024 values: column e / 16, step e % 16.
        let e = t + MT_INVOCATIONS * l;
        let col = col0 + e / 16u;
        let kk = k0 + e % 16u;
        let v = f32(b[p.b_base + min(col, n - 1u) * k + min(kk, k - 1u)]);
        mt_b[(e / 16u) * MT_B_COL + (e % 16u) / 4u][e % 4u] = select(0.0, v, col < n && kk < k);
    }
}

// f16w_stage_b 8 weights a load (a vec4<u32> of packed pairs, one load per
// invocation), for K and p.b_base multiples of 8, so that a load is wholly
// inside or outside K.
fn f16w_stage_b8(t: u32, col0: u32, k0: u32) {
    let n = p.n;
    let k = p.k;
    // 64 columns × 2 loads: column t / 2, steps 8·(t % 2) + 0..7.
    let col = col0 + t / 2u;
    let kk = k0 + 8u * (t % 2u);
    let w = b8[(p.b_base + min(col, n - 1u) * k + min(kk, k - 8u)) / 8u];
    let keep = col < n && kk < k;
    let i = (t / 2u) * MT_B_COL + 2u * (t % 2u);
    mt_b[i] = select(vec4<f32>(0.0), vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)), keep);
    mt_b[i + 1u] = select(vec4<f32>(0.0), vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)), keep);
}

// C[M,N] = A[M,K] · B[N,K]ᵀ, B in f16, for larger products on a GPU, where
// the register-blocked layout's 512 accumulators per invocation would
// spill: matmul.wgsl's workgroup-memory tiled layout (matmul_tiles.wgsl).
// 16×8 invocations compute one 64×64 tile of C in slices of MT_DEPTH steps
// of k, each invocation an 8×4 block; A's rows and B's rows (C's columns)
// are staged in workgroup memory by loads in which consecutive invocations
// read consecutive addresses. This entry loads scalars;
// matmul_f16w_forward_shared_vec below loads vec4s of A and 8 weights at a
// time where the layout allows. The staging of A, the multiply-adds and
// the stores are matmul_tiles.wgsl's.
@compute @workgroup_size(16, 8, 1)
fn matmul_f16w_forward_shared(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) lindex: u32,
) {
    // Uniform per workgroup, so returning before the barriers is allowed.
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * F16W_TILE;
    let col0 = (tile % p.tiles_n) * F16W_TILE;
    var acc: MtBlock;
    for (var k0 = 0u; k0 < p.k; k0 += MT_DEPTH) {
        mt_stage_a_rows(lindex, row0, k0, 0u);
        f16w_stage_b(lindex, col0, k0);
        workgroupBarrier();
        acc = mt_multiply(acc, lid.x, lid.y, true, false);
        workgroupBarrier();
    }
    mt_store(row0, col0, lid.x, lid.y, false, acc);
}

// C[M,N] = A[M,K] · B[N,K]ᵀ: matmul_f16w_forward_shared with vec4 loads of
// A and 8-weight loads of B, for K and p.b_base multiples of 8 and A and B
// bound 16-byte aligned (the Rust side checks). An entry of its own because
// WebGPU refuses an entry point that uses both views of a binding.
@compute @workgroup_size(16, 8, 1)
fn matmul_f16w_forward_shared_vec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) lindex: u32,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * F16W_TILE;
    let col0 = (tile % p.tiles_n) * F16W_TILE;
    var acc: MtBlock;
    for (var k0 = 0u; k0 < p.k; k0 += MT_DEPTH) {
        mt_stage_a_rows4(lindex, row0, k0, 0u);
        f16w_stage_b8(lindex, col0, k0);
        workgroupBarrier();
        acc = mt_multiply(acc, lid.x, lid.y, true, false);
        workgroupBarrier();
    }
    mt_store(row0, col0, lid.x, lid.y, false, acc);
}

struct EmbeddingParams {
    // Ids, channels, vocabulary.
    n: u32,
    cols: u32,
    vocab: u32,
    // The table rows this launch covers (a table too large for one binding
    // is looked up in several launches), and where row_start begins in the
    // table's binding, in f16 values.
    row_start: u32,
    row_end: u32,
    table_base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(6) var<storage, read> emb_table: array<f16>;
@group(0) @binding(7) var<storage, read> emb_ids: array<u32>;
@group(0) @binding(8) var<storage, read_write> emb_out: array<f32>;
@group(0) @binding(9) var<uniform> ep: EmbeddingParams;

// out[n, C] (f32) = table[ids[n], :] for an f16 table [V, C] and u32 ids,
// one invocation per output element, as rowwise.wgsl's embedding_forward:
// an id ≥ V writes a row of NaN (no out-of-bounds read; the Rust side
// checks ids on the host where it has them), in the launch that covers the
// table's last rows.
@compute @workgroup_size(256, 1, 1)
fn embedding_f16w_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let i = flat_index(wid, nwg, lid);
    if i >= ep.n * ep.cols {
        return;
    }
    let id = emb_ids[i / ep.cols];
    let col = i % ep.cols;
    if id >= ep.vocab {
        if ep.row_end == ep.vocab {
            emb_out[i] = quiet_nan();
        }
        return;
    }
    if id < ep.row_start || id >= ep.row_end {
        return;
    }
    emb_out[i] = f32(emb_table[ep.table_base + (id - ep.row_start) * ep.cols + col]);
}
