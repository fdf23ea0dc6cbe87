// Matrix multiply, row-major f32: C[M,N] = op(A) · op(B) (+ bias[N]) (+= C).
//   op(A) = A [M,K], or Aᵀ with A stored [K,M] when TRANS_A;
//   op(B) = B [K,N], or Bᵀ with B stored [N,K] when TRANS_B.
// The three forms training needs are (TRANS_A, TRANS_B) = (false, false)
// for the forward pass, (true, false) for dW = Xᵀ·dY, (false, true) for
// dX = dY·Wᵀ. Each workgroup computes one 64×64 tile of C; tiles are
// numbered linearly and spread over a 2-D grid so huge matrices never exceed
// the 65,535 workgroups-per-dimension limit. A batch of products (the
// attention's [B·H] matrices) runs as workgroup_id.z: each operand is
// `batch` contiguous matrices, `p.batch_*` elements apart (see set_batch).

// Only the shared and vec4 kernels read these;
// the other kernels take the form from the strides in MatmulParams.
override TRANS_A: bool = false;
override TRANS_B: bool = false;
// The epilogue: what happens to each product before it is stored. These are
// overrides, not uniform flags: the register kernels inline the store at
// each of their 512 outputs per invocation, and the general store compiled
// into every pipeline made the training step ~20-30% slower on lavapipe.
// C += op(A)·op(B) instead of C = …: a gradient accumulated straight into
// its parameter's gradient buffer, with no separate add.
override ACCUMULATE: bool = false;
// C = op(A)·op(B) + bias[N] broadcast over rows: a Linear layer's forward
// in one dispatch. Without it `bias` is bound to a placeholder and unread.
override HAS_BIAS: bool = false;
// Fused activation epilogue, so a Linear + activation forward and the
// activation's backward inside the input-gradient matmul cost no extra
// dispatch. Forward (ACTIVATION_FORWARD): result = act(product [+ bias]);
// with STORE_PRE the pre-activation value is also written to `pre` ([M,N]),
// which the backward needs. Backward (ACTIVATION_BACKWARD): result =
// product · act'(act_input[i]), act_input being the forward's input [M,N].
// Which activation is a uniform (`p.activation`), not an override: the
// branch runs once per stored element, noise beside k multiply-adds, and it
// saves compiling a multi-second pipeline per activation. The formulas are
// activations.wgsl's, which Family::source composes into this family and
// the elementwise one alike, so fused and unfused results agree bit for bit.
override ACTIVATION_FORWARD: bool = false;
override ACTIVATION_BACKWARD: bool = false;
override STORE_PRE: bool = false;

struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    // Number of 64-wide column tiles, and all tiles (guards grid overshoot).
    tiles_n: u32,
    tiles_total: u32,
    // An ACT_* code of activations.wgsl (ops::Activation::code); read only
    // by the epilogue.
    activation: u32,
    // Elements between rows of C (and of pre, act_input): n, or the whole
    // product's n when this launch computes a block of its columns (an
    // operand too large for one storage binding splits the product).
    ldc: u32,
    // The block's first column in the whole product: where it reads bias.
    bias_base: u32,
    // Strides of the stored operands, which say the form to the kernels that
    // take it at run time (small, register, subgroup: one pipeline for all
    // three forms, since each costs seconds of LLVM on a CPU adapter):
    // element (row, kk) of op(A) is a[row * sa_row + kk * sa_k], element
    // (kk, col) of op(B) is b[col * sb_col + kk * sb_k]. The workgroup-memory
    // and vec4 kernels, whose loops differ per form, take TRANS_A / TRANS_B.
    sa_row: u32,
    sa_k: u32,
    sb_col: u32,
    sb_k: u32,
    // Elements between consecutive matrices of a batch (m·k, k·n, m·n);
    // multiplied by workgroup_id.z, which is 0 when the batch is 1.
    batch_a: u32,
    batch_b: u32,
    batch_c: u32,
    // Where this launch's matrices start in its a, b and c bindings (in
    // f32 elements): a block of a large operand is bound from the nearest
    // storage-offset-aligned element before it. 0 when nothing is split.
    a_base: u32,
    b_base: u32,
    c_base: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> p: MatmulParams;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
// Unused slots are bound to placeholders (`pre` to C itself: a writable slot
// cannot share the read-only placeholder) and never touched.
@group(0) @binding(5) var<storage, read_write> pre: array<f32>;
@group(0) @binding(6) var<storage, read> act_input: array<f32>;
// Operands stored in f16 (the activations a training step saves in f16,
// graph/precision.rs): with A_F16 (B_F16) op(A) (op(B)) is read from a_h
// (b_h), two values a 4-byte word, value 2i in the low half (F16View's
// packing), and widened to f32 in registers, so no widened f32 copy is
// ever stored; the products and sums stay f32. The widening is bit
// arithmetic, not unpack2x16float, which naga allows only with
// SHADER_FLOAT16_IN_FLOAT32 (not on GL): this family runs everywhere. The
// operand's other binding holds a placeholder. Offsets and strides count
// values, not words. The small, register and shared kernels read through
// load_a / load_b; the vec4 and matrix-vector kernels read f32 only (the
// Rust side picks).
override A_F16: bool = false;
override B_F16: bool = false;
@group(0) @binding(7) var<storage, read> a_h: array<u32>;
@group(0) @binding(8) var<storage, read> b_h: array<u32>;

// Value i of an f16 operand (its word holds values i & ~1 and i | 1),
// exactly as f32: normal numbers rebias the exponent, subnormals are
// mantissa·2^-24, infinities and NaNs keep the all-ones exponent.
fn f16_value(word: u32, i: u32) -> f32 {
    let h = (word >> (16u * (i & 1u))) & 0xffffu;
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    let normal = bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
    let special = bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    let tiny = ldexp(f32(m), -24);
    let subnormal = select(tiny, -tiny, sign != 0u);
    return select(select(normal, special, e == 31u), subnormal, e == 0u);
}

fn load_a(i: u32) -> f32 {
    if A_F16 {
        return f16_value(a_h[i >> 1u], i);
    }
    return a[i];
}

fn load_b(i: u32) -> f32 {
    if B_F16 {
        return f16_value(b_h[i >> 1u], i);
    }
    return b[i];
}

const TILE: u32 = 64u;

// Where this invocation's matrices of the batch start in a, b and c (in
// f32 elements). Private (per invocation) so write_c sees
// them without every store helper taking three more arguments; the
// kernels fold a_off / b_off into offsets computed once before the k loop.
var<private> a_off: u32;
var<private> b_off: u32;
var<private> c_off: u32;

// Every entry point calls this first with workgroup_id.z.
fn set_batch(z: u32) {
    a_off = p.a_base + z * p.batch_a;
    b_off = p.b_base + z * p.batch_b;
    c_off = p.c_base + z * p.batch_c;
}

// pre and act_input are [batch, M, N] like C, bound like C.
fn write_c(row: u32, col: u32, product: f32) {
    let i = c_off + row * p.ldc + col;
    var v = product;
    if HAS_BIAS {
        v += bias[p.bias_base + col];
    }
    if ACTIVATION_BACKWARD {
        v = activation_backward(p.activation, act_input[i], v);
    }
    if STORE_PRE {
        pre[i] = v;
    }
    if ACTIVATION_FORWARD {
        v = activation_forward(p.activation, v);
    }
    if ACCUMULATE {
        c[i] = c[i] + v;
    } else {
        c[i] = v;
    }
}

// Small-shape form, for products of at most 2^20 multiply-adds (the Rust
// side picks it by shape): a workgroup of 8×8 invocations computes one
// 64×64 tile of C, invocation (x, y) the 8×8 block of rows 8·y + 0..7 and
// columns x + 8·j, j in 0..7 (interleaved, so neighbouring invocations read
// neighbouring columns of B): 16 loads for 64 multiply-adds per step of k,
// in 8 mat2x4 accumulators. LLVM compiles it in tens of milliseconds,
// where the 32×16 register kernel below takes seconds per pipeline, and at
// these sizes a dispatch costs as much as the arithmetic. Edges are clamped
// on load and masked on store. fma_row8 and store_row8 are matmul_rows.wgsl's.

@compute @workgroup_size(8, 8, 1)
fn matmul_forward_small(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE + lid.y * 8u;
    let col0 = (tile % p.tiles_n) * TILE + lid.x;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    let sa_row = p.sa_row;
    let sa_k = p.sa_k;
    let sb_col = p.sb_col;
    let sb_k = p.sb_k;
    let last_row = vec4<u32>(p.m - 1u);
    let last_col = vec4<u32>(p.n - 1u);
    let ra_lo = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), last_row) * sa_row + vec4<u32>(a_off);
    let ra_hi = min(vec4<u32>(row0) + vec4<u32>(4u, 5u, 6u, 7u), last_row) * sa_row + vec4<u32>(a_off);
    let cb_lo = min(vec4<u32>(col0) + vec4<u32>(0u, 8u, 16u, 24u), last_col) * sb_col + vec4<u32>(b_off);
    let cb_hi = min(vec4<u32>(col0) + vec4<u32>(32u, 40u, 48u, 56u), last_col) * sb_col + vec4<u32>(b_off);
    // acc_i[j / 4][j % 4]: row row0 + i, column col0 + 8·j.
    var acc0 = mat2x4<f32>();
    var acc1 = mat2x4<f32>();
    var acc2 = mat2x4<f32>();
    var acc3 = mat2x4<f32>();
    var acc4 = mat2x4<f32>();
    var acc5 = mat2x4<f32>();
    var acc6 = mat2x4<f32>();
    var acc7 = mat2x4<f32>();
    for (var kk = 0u; kk < p.k; kk++) {
        let ka = kk * sa_k;
        let kb = kk * sb_k;
        let b_lo = vec4<f32>(load_b(cb_lo.x + kb), load_b(cb_lo.y + kb), load_b(cb_lo.z + kb), load_b(cb_lo.w + kb));
        let b_hi = vec4<f32>(load_b(cb_hi.x + kb), load_b(cb_hi.y + kb), load_b(cb_hi.z + kb), load_b(cb_hi.w + kb));
        acc0 = fma_row8(acc0, load_a(ra_lo.x + ka), b_lo, b_hi);
        acc1 = fma_row8(acc1, load_a(ra_lo.y + ka), b_lo, b_hi);
        acc2 = fma_row8(acc2, load_a(ra_lo.z + ka), b_lo, b_hi);
        acc3 = fma_row8(acc3, load_a(ra_lo.w + ka), b_lo, b_hi);
        acc4 = fma_row8(acc4, load_a(ra_hi.x + ka), b_lo, b_hi);
        acc5 = fma_row8(acc5, load_a(ra_hi.y + ka), b_lo, b_hi);
        acc6 = fma_row8(acc6, load_a(ra_hi.z + ka), b_lo, b_hi);
        acc7 = fma_row8(acc7, load_a(ra_hi.w + ka), b_lo, b_hi);
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

// Register-blocked form, no workgroup memory and no barriers: fastest on CPU
// adapters (llvmpipe/lavapipe), where barriers are expensive and every
// storage load is issued lane by lane, so what counts is multiply-adds per
// load. llvmpipe runs the x dimension of a workgroup as 8-wide SIMD rows,
// so the workgroup is exactly one such row: 8 invocations, one 64×64 tile
// of C (the TILE the Rust side grids by). Invocation x owns a 32×16 block:
// rows 32·(x / 4) + 0..31 (contiguous) and columns x % 4 + 4·j, j in 0..15
// (interleaved, so neighbouring invocations read neighbouring columns of
// B). Each step of k makes 32 + 16 loads and 512 multiply-adds into 32
// mat4x4 accumulators (acc_i holds row i: columns 4·q + r in acc_i[q][r]).
// Rows and columns past the edge are clamped on load, so every load is in
// bounds with no branch in the k loop, and masked on store.
// Same-run comparisons on lavapipe, 2 threads, n=1024 (absolute numbers
// swing ±40% on a shared machine): 8×8 per invocation in loops over
// private arrays ≈ 3.5 GFLOPS, 8×8 unrolled ≈ 7, 16×16 ≈ 11, this 32×16
// ≈ 15. 64×8 and 64×16 spill and lose, unrolling k by 2 loses, and
// workgroups narrower than 8 in x idle SIMD lanes. The cost is compile
// time: ≈ 3–5 s per pipeline on a cold Mesa shader cache (16×16: ≈ 1 s).
// mm_row_fma and mm_store_row are matmul_rows.wgsl's.

@compute @workgroup_size(8, 1, 1)
fn matmul_forward_register(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE + (lid.x / 4u) * 32u;
    let col0 = (tile % p.tiles_n) * TILE + lid.x % 4u;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    // Element (row, kk) of op(A) is a[row * sa_row + kk * sa_k]; element
    // (kk, col) of op(B) is b[col * sb_col + kk * sb_k].
    let sa_row = p.sa_row;
    let sa_k = p.sa_k;
    let sb_col = p.sb_col;
    let sb_k = p.sb_k;
    mm_register_block(row0, col0, sa_row, sa_k, sb_col, sb_k, a_off, b_off);
}

// Register-blocked form with vec4 loads, for M, N and K all multiples of 4
// (the Rust side checks, and picks `matmul_forward_register` otherwise).
// Same 64×64 tile and 8-wide workgroup as above, but invocation x owns rows
// 32·(x / 4) + 0..31 and 16 *contiguous* columns 16·(x % 4) + 0..15, so
// every operand read is a vec4 along its stored rows: per 4 steps of k,
// 32 vec4 loads of op(A) and 16 of op(B) instead of 192 scalar loads (loads
// are issued lane by lane on llvmpipe, so this is what decides speed).
// Per form: AB reads A rows along k and B rows along n; AtB reads Aᵀ as rows
// of A along m (8 vec4 per step, transposed in registers); ABt reads B
// rows along k (one vec4 per column, transposed in registers). Edge rows and
// columns are clamped once before the k loop (no branch inside it) and
// masked on store.
@group(0) @binding(0) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> b4: array<vec4<f32>>;

// Four steps of k for one row: acc += av[t] · bt for t in 0..3.
fn mm_row_fma4(acc: mat4x4<f32>, av: vec4<f32>, b0: mat4x4<f32>, b1: mat4x4<f32>, b2: mat4x4<f32>, b3: mat4x4<f32>) -> mat4x4<f32> {
    return mm_row_fma(mm_row_fma(mm_row_fma(mm_row_fma(acc, av.x, b0), av.y, b1), av.z, b2), av.w, b3);
}

// Stores row `row` of an invocation's block: columns col0 + j, j in 0..15,
// held as acc[j / 4][j % 4].
fn mm_store_row_contiguous(row: u32, col0: u32, acc: mat4x4<f32>) {
    if row >= p.m {
        return;
    }
    for (var j = 0u; j < 16u; j++) {
        let col = col0 + j;
        if col < p.n {
            write_c(row, col, acc[j / 4u][j % 4u]);
        }
    }
}

@compute @workgroup_size(8, 1, 1)
fn matmul_forward_register_vec4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE + (lid.x / 4u) * 32u;
    let col0 = (tile % p.tiles_n) * TILE + (lid.x % 4u) * 16u;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    let m4 = p.m / 4u;
    let n4 = p.n / 4u;
    let k4 = p.k / 4u;
    // The batch offsets in vec4 units (m, n, k are multiples of 4 here).
    let a4_off = a_off / 4u;
    let b4_off = b_off / 4u;
    let last_row = p.m - 1u;
    let last_col = p.n - 1u;
    // op(A) row offsets in vec4 units: row·k4 (AB, ABt: A rows along k), or
    // row-group indices (AtB: A stored [K,M], 8 groups of 4 rows).
    let ra0 = min(row0 + 0u, last_row) * k4;
    let ra1 = min(row0 + 1u, last_row) * k4;
    let ra2 = min(row0 + 2u, last_row) * k4;
    let ra3 = min(row0 + 3u, last_row) * k4;
    let ra4 = min(row0 + 4u, last_row) * k4;
    let ra5 = min(row0 + 5u, last_row) * k4;
    let ra6 = min(row0 + 6u, last_row) * k4;
    let ra7 = min(row0 + 7u, last_row) * k4;
    let ra8 = min(row0 + 8u, last_row) * k4;
    let ra9 = min(row0 + 9u, last_row) * k4;
    let ra10 = min(row0 + 10u, last_row) * k4;
    let ra11 = min(row0 + 11u, last_row) * k4;
    let ra12 = min(row0 + 12u, last_row) * k4;
    let ra13 = min(row0 + 13u, last_row) * k4;
    let ra14 = min(row0 + 14u, last_row) * k4;
    let ra15 = min(row0 + 15u, last_row) * k4;
    let ra16 = min(row0 + 16u, last_row) * k4;
    let ra17 = min(row0 + 17u, last_row) * k4;
    let ra18 = min(row0 + 18u, last_row) * k4;
    let ra19 = min(row0 + 19u, last_row) * k4;
    let ra20 = min(row0 + 20u, last_row) * k4;
    let ra21 = min(row0 + 21u, last_row) * k4;
    let ra22 = min(row0 + 22u, last_row) * k4;
    let ra23 = min(row0 + 23u, last_row) * k4;
    let ra24 = min(row0 + 24u, last_row) * k4;
    let ra25 = min(row0 + 25u, last_row) * k4;
    let ra26 = min(row0 + 26u, last_row) * k4;
    let ra27 = min(row0 + 27u, last_row) * k4;
    let ra28 = min(row0 + 28u, last_row) * k4;
    let ra29 = min(row0 + 29u, last_row) * k4;
    let ra30 = min(row0 + 30u, last_row) * k4;
    let ra31 = min(row0 + 31u, last_row) * k4;
    let rg0 = min(row0 / 4u + 0u, m4 - 1u);
    let rg1 = min(row0 / 4u + 1u, m4 - 1u);
    let rg2 = min(row0 / 4u + 2u, m4 - 1u);
    let rg3 = min(row0 / 4u + 3u, m4 - 1u);
    let rg4 = min(row0 / 4u + 4u, m4 - 1u);
    let rg5 = min(row0 / 4u + 5u, m4 - 1u);
    let rg6 = min(row0 / 4u + 6u, m4 - 1u);
    let rg7 = min(row0 / 4u + 7u, m4 - 1u);
    // op(B) column offsets: column-group indices (AB, AtB: B rows along n),
    // or column·k4 (ABt: B stored [N,K], rows along k).
    let cg0 = min(col0 / 4u + 0u, n4 - 1u);
    let cg1 = min(col0 / 4u + 1u, n4 - 1u);
    let cg2 = min(col0 / 4u + 2u, n4 - 1u);
    let cg3 = min(col0 / 4u + 3u, n4 - 1u);
    let cb0 = min(col0 + 0u, last_col) * k4;
    let cb1 = min(col0 + 1u, last_col) * k4;
    let cb2 = min(col0 + 2u, last_col) * k4;
    let cb3 = min(col0 + 3u, last_col) * k4;
    let cb4 = min(col0 + 4u, last_col) * k4;
    let cb5 = min(col0 + 5u, last_col) * k4;
    let cb6 = min(col0 + 6u, last_col) * k4;
    let cb7 = min(col0 + 7u, last_col) * k4;
    let cb8 = min(col0 + 8u, last_col) * k4;
    let cb9 = min(col0 + 9u, last_col) * k4;
    let cb10 = min(col0 + 10u, last_col) * k4;
    let cb11 = min(col0 + 11u, last_col) * k4;
    let cb12 = min(col0 + 12u, last_col) * k4;
    let cb13 = min(col0 + 13u, last_col) * k4;
    let cb14 = min(col0 + 14u, last_col) * k4;
    let cb15 = min(col0 + 15u, last_col) * k4;
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
    var av0: vec4<f32>;
    var av1: vec4<f32>;
    var av2: vec4<f32>;
    var av3: vec4<f32>;
    var av4: vec4<f32>;
    var av5: vec4<f32>;
    var av6: vec4<f32>;
    var av7: vec4<f32>;
    var av8: vec4<f32>;
    var av9: vec4<f32>;
    var av10: vec4<f32>;
    var av11: vec4<f32>;
    var av12: vec4<f32>;
    var av13: vec4<f32>;
    var av14: vec4<f32>;
    var av15: vec4<f32>;
    var av16: vec4<f32>;
    var av17: vec4<f32>;
    var av18: vec4<f32>;
    var av19: vec4<f32>;
    var av20: vec4<f32>;
    var av21: vec4<f32>;
    var av22: vec4<f32>;
    var av23: vec4<f32>;
    var av24: vec4<f32>;
    var av25: vec4<f32>;
    var av26: vec4<f32>;
    var av27: vec4<f32>;
    var av28: vec4<f32>;
    var av29: vec4<f32>;
    var av30: vec4<f32>;
    var av31: vec4<f32>;
    var bm0: mat4x4<f32>;
    var bm1: mat4x4<f32>;
    var bm2: mat4x4<f32>;
    var bm3: mat4x4<f32>;
    for (var kc = 0u; kc < k4; kc++) {
        let kca = a4_off + kc;
        let kcb = b4_off + kc;
        if TRANS_A {
            let oa = a4_off + 4u * kc * m4;
            let a0_0 = a4[oa + 0u * m4 + rg0];
            let a0_1 = a4[oa + 0u * m4 + rg1];
            let a0_2 = a4[oa + 0u * m4 + rg2];
            let a0_3 = a4[oa + 0u * m4 + rg3];
            let a0_4 = a4[oa + 0u * m4 + rg4];
            let a0_5 = a4[oa + 0u * m4 + rg5];
            let a0_6 = a4[oa + 0u * m4 + rg6];
            let a0_7 = a4[oa + 0u * m4 + rg7];
            let a1_0 = a4[oa + 1u * m4 + rg0];
            let a1_1 = a4[oa + 1u * m4 + rg1];
            let a1_2 = a4[oa + 1u * m4 + rg2];
            let a1_3 = a4[oa + 1u * m4 + rg3];
            let a1_4 = a4[oa + 1u * m4 + rg4];
            let a1_5 = a4[oa + 1u * m4 + rg5];
            let a1_6 = a4[oa + 1u * m4 + rg6];
            let a1_7 = a4[oa + 1u * m4 + rg7];
            let a2_0 = a4[oa + 2u * m4 + rg0];
            let a2_1 = a4[oa + 2u * m4 + rg1];
            let a2_2 = a4[oa + 2u * m4 + rg2];
            let a2_3 = a4[oa + 2u * m4 + rg3];
            let a2_4 = a4[oa + 2u * m4 + rg4];
            let a2_5 = a4[oa + 2u * m4 + rg5];
            let a2_6 = a4[oa + 2u * m4 + rg6];
            let a2_7 = a4[oa + 2u * m4 + rg7];
            let a3_0 = a4[oa + 3u * m4 + rg0];
            let a3_1 = a4[oa + 3u * m4 + rg1];
            let a3_2 = a4[oa + 3u * m4 + rg2];
            let a3_3 = a4[oa + 3u * m4 + rg3];
            let a3_4 = a4[oa + 3u * m4 + rg4];
            let a3_5 = a4[oa + 3u * m4 + rg5];
            let a3_6 = a4[oa + 3u * m4 + rg6];
            let a3_7 = a4[oa + 3u * m4 + rg7];
            av0 = vec4<f32>(a0_0.x, a1_0.x, a2_0.x, a3_0.x);
            av1 = vec4<f32>(a0_0.y, a1_0.y, a2_0.y, a3_0.y);
            av2 = vec4<f32>(a0_0.z, a1_0.z, a2_0.z, a3_0.z);
            av3 = vec4<f32>(a0_0.w, a1_0.w, a2_0.w, a3_0.w);
            av4 = vec4<f32>(a0_1.x, a1_1.x, a2_1.x, a3_1.x);
            av5 = vec4<f32>(a0_1.y, a1_1.y, a2_1.y, a3_1.y);
            av6 = vec4<f32>(a0_1.z, a1_1.z, a2_1.z, a3_1.z);
            av7 = vec4<f32>(a0_1.w, a1_1.w, a2_1.w, a3_1.w);
            av8 = vec4<f32>(a0_2.x, a1_2.x, a2_2.x, a3_2.x);
            av9 = vec4<f32>(a0_2.y, a1_2.y, a2_2.y, a3_2.y);
            av10 = vec4<f32>(a0_2.z, a1_2.z, a2_2.z, a3_2.z);
            av11 = vec4<f32>(a0_2.w, a1_2.w, a2_2.w, a3_2.w);
            av12 = vec4<f32>(a0_3.x, a1_3.x, a2_3.x, a3_3.x);
            av13 = vec4<f32>(a0_3.y, a1_3.y, a2_3.y, a3_3.y);
            av14 = vec4<f32>(a0_3.z, a1_3.z, a2_3.z, a3_3.z);
            av15 = vec4<f32>(a0_3.w, a1_3.w, a2_3.w, a3_3.w);
            av16 = vec4<f32>(a0_4.x, a1_4.x, a2_4.x, a3_4.x);
            av17 = vec4<f32>(a0_4.y, a1_4.y, a2_4.y, a3_4.y);
            av18 = vec4<f32>(a0_4.z, a1_4.z, a2_4.z, a3_4.z);
            av19 = vec4<f32>(a0_4.w, a1_4.w, a2_4.w, a3_4.w);
            av20 = vec4<f32>(a0_5.x, a1_5.x, a2_5.x, a3_5.x);
            av21 = vec4<f32>(a0_5.y, a1_5.y, a2_5.y, a3_5.y);
            av22 = vec4<f32>(a0_5.z, a1_5.z, a2_5.z, a3_5.z);
            av23 = vec4<f32>(a0_5.w, a1_5.w, a2_5.w, a3_5.w);
            av24 = vec4<f32>(a0_6.x, a1_6.x, a2_6.x, a3_6.x);
            av25 = vec4<f32>(a0_6.y, a1_6.y, a2_6.y, a3_6.y);
            av26 = vec4<f32>(a0_6.z, a1_6.z, a2_6.z, a3_6.z);
            av27 = vec4<f32>(a0_6.w, a1_6.w, a2_6.w, a3_6.w);
            av28 = vec4<f32>(a0_7.x, a1_7.x, a2_7.x, a3_7.x);
            av29 = vec4<f32>(a0_7.y, a1_7.y, a2_7.y, a3_7.y);
            av30 = vec4<f32>(a0_7.z, a1_7.z, a2_7.z, a3_7.z);
            av31 = vec4<f32>(a0_7.w, a1_7.w, a2_7.w, a3_7.w);
        } else {
            av0 = a4[ra0 + kca];
            av1 = a4[ra1 + kca];
            av2 = a4[ra2 + kca];
            av3 = a4[ra3 + kca];
            av4 = a4[ra4 + kca];
            av5 = a4[ra5 + kca];
            av6 = a4[ra6 + kca];
            av7 = a4[ra7 + kca];
            av8 = a4[ra8 + kca];
            av9 = a4[ra9 + kca];
            av10 = a4[ra10 + kca];
            av11 = a4[ra11 + kca];
            av12 = a4[ra12 + kca];
            av13 = a4[ra13 + kca];
            av14 = a4[ra14 + kca];
            av15 = a4[ra15 + kca];
            av16 = a4[ra16 + kca];
            av17 = a4[ra17 + kca];
            av18 = a4[ra18 + kca];
            av19 = a4[ra19 + kca];
            av20 = a4[ra20 + kca];
            av21 = a4[ra21 + kca];
            av22 = a4[ra22 + kca];
            av23 = a4[ra23 + kca];
            av24 = a4[ra24 + kca];
            av25 = a4[ra25 + kca];
            av26 = a4[ra26 + kca];
            av27 = a4[ra27 + kca];
            av28 = a4[ra28 + kca];
            av29 = a4[ra29 + kca];
            av30 = a4[ra30 + kca];
            av31 = a4[ra31 + kca];
        }
        if TRANS_B {
            let bc0 = b4[cb0 + kcb];
            let bc1 = b4[cb1 + kcb];
            let bc2 = b4[cb2 + kcb];
            let bc3 = b4[cb3 + kcb];
            let bc4 = b4[cb4 + kcb];
            let bc5 = b4[cb5 + kcb];
            let bc6 = b4[cb6 + kcb];
            let bc7 = b4[cb7 + kcb];
            let bc8 = b4[cb8 + kcb];
            let bc9 = b4[cb9 + kcb];
            let bc10 = b4[cb10 + kcb];
            let bc11 = b4[cb11 + kcb];
            let bc12 = b4[cb12 + kcb];
            let bc13 = b4[cb13 + kcb];
            let bc14 = b4[cb14 + kcb];
            let bc15 = b4[cb15 + kcb];
            bm0 = mat4x4<f32>(vec4<f32>(bc0.x, bc1.x, bc2.x, bc3.x), vec4<f32>(bc4.x, bc5.x, bc6.x, bc7.x), vec4<f32>(bc8.x, bc9.x, bc10.x, bc11.x), vec4<f32>(bc12.x, bc13.x, bc14.x, bc15.x));
            bm1 = mat4x4<f32>(vec4<f32>(bc0.y, bc1.y, bc2.y, bc3.y), vec4<f32>(bc4.y, bc5.y, bc6.y, bc7.y), vec4<f32>(bc8.y, bc9.y, bc10.y, bc11.y), vec4<f32>(bc12.y, bc13.y, bc14.y, bc15.y));
            bm2 = mat4x4<f32>(vec4<f32>(bc0.z, bc1.z, bc2.z, bc3.z), vec4<f32>(bc4.z, bc5.z, bc6.z, bc7.z), vec4<f32>(bc8.z, bc9.z, bc10.z, bc11.z), vec4<f32>(bc12.z, bc13.z, bc14.z, bc15.z));
            bm3 = mat4x4<f32>(vec4<f32>(bc0.w, bc1.w, bc2.w, bc3.w), vec4<f32>(bc4.w, bc5.w, bc6.w, bc7.w), vec4<f32>(bc8.w, bc9.w, bc10.w, bc11.w), vec4<f32>(bc12.w, bc13.w, bc14.w, bc15.w));
        } else {
            let ob = b4_off + 4u * kc * n4;
            bm0 = mat4x4<f32>(b4[ob + 0u * n4 + cg0], b4[ob + 0u * n4 + cg1], b4[ob + 0u * n4 + cg2], b4[ob + 0u * n4 + cg3]);
            bm1 = mat4x4<f32>(b4[ob + 1u * n4 + cg0], b4[ob + 1u * n4 + cg1], b4[ob + 1u * n4 + cg2], b4[ob + 1u * n4 + cg3]);
            bm2 = mat4x4<f32>(b4[ob + 2u * n4 + cg0], b4[ob + 2u * n4 + cg1], b4[ob + 2u * n4 + cg2], b4[ob + 2u * n4 + cg3]);
            bm3 = mat4x4<f32>(b4[ob + 3u * n4 + cg0], b4[ob + 3u * n4 + cg1], b4[ob + 3u * n4 + cg2], b4[ob + 3u * n4 + cg3]);
        }
        acc0 = mm_row_fma4(acc0, av0, bm0, bm1, bm2, bm3);
        acc1 = mm_row_fma4(acc1, av1, bm0, bm1, bm2, bm3);
        acc2 = mm_row_fma4(acc2, av2, bm0, bm1, bm2, bm3);
        acc3 = mm_row_fma4(acc3, av3, bm0, bm1, bm2, bm3);
        acc4 = mm_row_fma4(acc4, av4, bm0, bm1, bm2, bm3);
        acc5 = mm_row_fma4(acc5, av5, bm0, bm1, bm2, bm3);
        acc6 = mm_row_fma4(acc6, av6, bm0, bm1, bm2, bm3);
        acc7 = mm_row_fma4(acc7, av7, bm0, bm1, bm2, bm3);
        acc8 = mm_row_fma4(acc8, av8, bm0, bm1, bm2, bm3);
        acc9 = mm_row_fma4(acc9, av9, bm0, bm1, bm2, bm3);
        acc10 = mm_row_fma4(acc10, av10, bm0, bm1, bm2, bm3);
        acc11 = mm_row_fma4(acc11, av11, bm0, bm1, bm2, bm3);
        acc12 = mm_row_fma4(acc12, av12, bm0, bm1, bm2, bm3);
        acc13 = mm_row_fma4(acc13, av13, bm0, bm1, bm2, bm3);
        acc14 = mm_row_fma4(acc14, av14, bm0, bm1, bm2, bm3);
        acc15 = mm_row_fma4(acc15, av15, bm0, bm1, bm2, bm3);
        acc16 = mm_row_fma4(acc16, av16, bm0, bm1, bm2, bm3);
        acc17 = mm_row_fma4(acc17, av17, bm0, bm1, bm2, bm3);
        acc18 = mm_row_fma4(acc18, av18, bm0, bm1, bm2, bm3);
        acc19 = mm_row_fma4(acc19, av19, bm0, bm1, bm2, bm3);
        acc20 = mm_row_fma4(acc20, av20, bm0, bm1, bm2, bm3);
        acc21 = mm_row_fma4(acc21, av21, bm0, bm1, bm2, bm3);
        acc22 = mm_row_fma4(acc22, av22, bm0, bm1, bm2, bm3);
        acc23 = mm_row_fma4(acc23, av23, bm0, bm1, bm2, bm3);
        acc24 = mm_row_fma4(acc24, av24, bm0, bm1, bm2, bm3);
        acc25 = mm_row_fma4(acc25, av25, bm0, bm1, bm2, bm3);
        acc26 = mm_row_fma4(acc26, av26, bm0, bm1, bm2, bm3);
        acc27 = mm_row_fma4(acc27, av27, bm0, bm1, bm2, bm3);
        acc28 = mm_row_fma4(acc28, av28, bm0, bm1, bm2, bm3);
        acc29 = mm_row_fma4(acc29, av29, bm0, bm1, bm2, bm3);
        acc30 = mm_row_fma4(acc30, av30, bm0, bm1, bm2, bm3);
        acc31 = mm_row_fma4(acc31, av31, bm0, bm1, bm2, bm3);
    }
    mm_store_row_contiguous(row0 + 0u, col0, acc0);
    mm_store_row_contiguous(row0 + 1u, col0, acc1);
    mm_store_row_contiguous(row0 + 2u, col0, acc2);
    mm_store_row_contiguous(row0 + 3u, col0, acc3);
    mm_store_row_contiguous(row0 + 4u, col0, acc4);
    mm_store_row_contiguous(row0 + 5u, col0, acc5);
    mm_store_row_contiguous(row0 + 6u, col0, acc6);
    mm_store_row_contiguous(row0 + 7u, col0, acc7);
    mm_store_row_contiguous(row0 + 8u, col0, acc8);
    mm_store_row_contiguous(row0 + 9u, col0, acc9);
    mm_store_row_contiguous(row0 + 10u, col0, acc10);
    mm_store_row_contiguous(row0 + 11u, col0, acc11);
    mm_store_row_contiguous(row0 + 12u, col0, acc12);
    mm_store_row_contiguous(row0 + 13u, col0, acc13);
    mm_store_row_contiguous(row0 + 14u, col0, acc14);
    mm_store_row_contiguous(row0 + 15u, col0, acc15);
    mm_store_row_contiguous(row0 + 16u, col0, acc16);
    mm_store_row_contiguous(row0 + 17u, col0, acc17);
    mm_store_row_contiguous(row0 + 18u, col0, acc18);
    mm_store_row_contiguous(row0 + 19u, col0, acc19);
    mm_store_row_contiguous(row0 + 20u, col0, acc20);
    mm_store_row_contiguous(row0 + 21u, col0, acc21);
    mm_store_row_contiguous(row0 + 22u, col0, acc22);
    mm_store_row_contiguous(row0 + 23u, col0, acc23);
    mm_store_row_contiguous(row0 + 24u, col0, acc24);
    mm_store_row_contiguous(row0 + 25u, col0, acc25);
    mm_store_row_contiguous(row0 + 26u, col0, acc26);
    mm_store_row_contiguous(row0 + 27u, col0, acc27);
    mm_store_row_contiguous(row0 + 28u, col0, acc28);
    mm_store_row_contiguous(row0 + 29u, col0, acc29);
    mm_store_row_contiguous(row0 + 30u, col0, acc30);
    mm_store_row_contiguous(row0 + 31u, col0, acc31);
}

// Stages op(B)[k0.., col0..] for B stored [K,N] (op(B) = B) from element
// `off`: consecutive invocations read consecutive columns at one step.
fn shared_stage_b_rows(t: u32, col0: u32, k0: u32, off: u32) {
    let n = p.n;
    let k = p.k;
    for (var l = 0u; l < 8u; l++) {
        // 1024 values: step e / 64, column e % 64.
        let e = t + MT_INVOCATIONS * l;
        let kk = k0 + e / 64u;
        let col = col0 + e % 64u;
        let v = load_b(off + min(kk, k - 1u) * n + min(col, n - 1u));
        mt_b[e / 4u][e % 4u] = select(0.0, v, col < n && kk < k);
    }
}

// shared_stage_b_rows in vec4s, for N and `off` multiples of 4.
fn shared_stage_b_rows4(t: u32, col0: u32, k0: u32, off: u32) {
    let n = p.n;
    let k = p.k;
    for (var l = 0u; l < 2u; l++) {
        // 256 vec4s: step e / 16, columns 4·(e % 16) + 0..3.
        let e = t + MT_INVOCATIONS * l;
        let kk = k0 + e / 16u;
        let col = col0 + 4u * (e % 16u);
        let v = b4[(off + min(kk, k - 1u) * n + min(col, n - 4u)) / 4u];
        mt_b[e] = select(vec4<f32>(0.0), v, col < n && kk < k);
    }
}

// As shared_stage_b_rows for B stored [N,K] (op(B) = Bᵀ): consecutive
// invocations read consecutive steps of a stored row.
fn shared_stage_b_cols(t: u32, col0: u32, k0: u32, off: u32) {
    let n = p.n;
    let k = p.k;
    for (var l = 0u; l < 8u; l++) {
        // 1024 values: column e / 16, step e % 16.
        let e = t + MT_INVOCATIONS * l;
        let col = col0 + e / 16u;
        let kk = k0 + e % 16u;
        let v = load_b(off + min(col, n - 1u) * k + min(kk, k - 1u));
        mt_b[(e / 16u) * MT_B_COL + (e % 16u) / 4u][e % 4u] = select(0.0, v, col < n && kk < k);
    }
}

// shared_stage_b_cols in vec4s, for K and `off` multiples of 4.
fn shared_stage_b_cols4(t: u32, col0: u32, k0: u32, off: u32) {
    let n = p.n;
    let k = p.k;
    for (var l = 0u; l < 2u; l++) {
        // 256 vec4s: column e / 4, steps 4·(e % 4) + 0..3.
        let e = t + MT_INVOCATIONS * l;
        let col = col0 + e / 4u;
        let kk = k0 + 4u * (e % 4u);
        let v = b4[(off + min(col, n - 1u) * k + min(kk, k - 4u)) / 4u];
        mt_b[(e / 4u) * MT_B_COL + e % 4u] = select(vec4<f32>(0.0), v, col < n && kk < k);
    }
}

// C[M,N] = op(A)·op(B), workgroup-memory tiled: the default on real GPUs
// (any adapter that is not a CPU, untuned). 16×8 invocations compute one
// 64×64 tile of C in slices of MT_DEPTH steps of k, each invocation an 8×4
// block. The slices of A and B are staged in workgroup memory in the
// layout they are stored in, so that in every form consecutive invocations
// load consecutive addresses (coalesced), not rows K apart. This entry
// loads scalars; matmul_forward_shared_vec4 below loads vec4s where the
// Rust side finds both operands' stored rows a multiple of 4 long and
// their matrices 16-byte aligned. Rows, columns and steps past the edges
// are staged as 0 and not stored. The staging of A, the multiply-adds and
// the stores are matmul_tiles.wgsl's (shared with f16_weights.wgsl).
@compute @workgroup_size(16, 8, 1)
fn matmul_forward_shared(
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
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE;
    let col0 = (tile % p.tiles_n) * TILE;
    var acc: MtBlock;
    for (var k0 = 0u; k0 < p.k; k0 += MT_DEPTH) {
        if TRANS_A {
            mt_stage_a_cols(lindex, row0, k0, a_off);
        } else {
            mt_stage_a_rows(lindex, row0, k0, a_off);
        }
        if TRANS_B {
            shared_stage_b_cols(lindex, col0, k0, b_off);
        } else {
            shared_stage_b_rows(lindex, col0, k0, b_off);
        }
        workgroupBarrier();
        acc = mt_multiply(acc, lid.x, lid.y, !TRANS_A, !TRANS_B);
        workgroupBarrier();
    }
    mt_store(row0, col0, lid.x, lid.y, !TRANS_B, acc);
}

// C[M,N] = op(A)·op(B): matmul_forward_shared with vec4 loads, for A's
// stored rows (K, or M when TRANS_A) and B's (N, or K when TRANS_B)
// multiples of 4 long and every matrix 16-byte aligned (the Rust side
// checks). An entry of its own because WebGPU refuses an entry point that
// uses both views of a binding (a and a4).
@compute @workgroup_size(16, 8, 1)
fn matmul_forward_shared_vec4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) lindex: u32,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE;
    let col0 = (tile % p.tiles_n) * TILE;
    var acc: MtBlock;
    for (var k0 = 0u; k0 < p.k; k0 += MT_DEPTH) {
        if TRANS_A {
            mt_stage_a_cols4(lindex, row0, k0, a_off);
        } else {
            mt_stage_a_rows4(lindex, row0, k0, a_off);
        }
        if TRANS_B {
            shared_stage_b_cols4(lindex, col0, k0, b_off);
        } else {
            shared_stage_b_rows4(lindex, col0, k0, b_off);
        }
        workgroupBarrier();
        acc = mt_multiply(acc, lid.x, lid.y, !TRANS_A, !TRANS_B);
        workgroupBarrier();
    }
    mt_store(row0, col0, lid.x, lid.y, !TRANS_B, acc);
}

// Matrix-vector form for decoding: C[M,N] = A[M,K] · B[N,K]ᵀ (ABt) with
// M ≤ 4 rows (one new token per sequence), K a multiple of 4 and the
// operands 16-byte aligned (the Rust side checks, and picks the tiled
// kernels otherwise). The tiled kernels compute 32 or 64 rows per block
// and would repeat one row's work 32 times; here each weight is read once.
// A workgroup of MATVEC_WG lanes owns MATVEC_COLS columns of C: lane l
// sums the vec4s k4 = l, l + MATVEC_WG, … of its columns' rows of B
// against the same of each row of A, so the lanes read consecutive vec4s
// of a row at a time (whole vectors on a CPU adapter, coalesced on a GPU);
// then, row by row, a tree over the lanes in workgroup memory sums them in
// a fixed order, and lane c stores column c through write_c (the
// epilogue). MATVEC_ROWS (a bucket of M, the launch's M at run time) and
// MATVEC_WG are overrides: a pipeline per bucket, and 8 lanes (one SIMD row) on a CPU adapter, where more lanes
// along k leave each so few steps that the tree costs more than the loads,
// 64 on a GPU. The accumulators are unrolled by hand: a private array
// indexed in a loop becomes per-lane memory on llvmpipe.
// MATVEC_ROWS, MATVEC_WG, MATVEC_COLS, matvec_sizes and the lane reduction
// are matvec.wgsl's (shared with f16_weights.wgsl's matvec_f16w_forward).

@compute @workgroup_size(MATVEC_WG, 1, 1)
fn matmul_forward_matvec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    // n, k through workgroup memory: lavapipe inlines uniform values that
    // bound loops and re-optimizes the shader on every dispatch (loss.wgsl);
    // a value from workgroupUniformLoad is not inlined.
    if lid.x == 0u {
        matvec_sizes = vec3<u32>(p.n, p.k, p.m);
    }
    let sizes = workgroupUniformLoad(&matvec_sizes);
    let n = sizes.x;
    let k4 = sizes.y / 4u;
    set_batch(0u);
    let col0 = (wid.y * nwg.x + wid.x) * MATVEC_COLS;
    if col0 >= n {
        return;
    }
    let lane = lid.x;
    // Offsets in vec4 units; rows of A past M clamped (never stored).
    let last_col = n - 1u;
    let b4o = b_off / 4u;
    let rows = sizes.z;
    let last_row = rows - 1u;
    let rb0 = b4o + min(col0 + 0u, last_col) * k4;
    let rb1 = b4o + min(col0 + 1u, last_col) * k4;
    let rb2 = b4o + min(col0 + 2u, last_col) * k4;
    let rb3 = b4o + min(col0 + 3u, last_col) * k4;
    let rb4 = b4o + min(col0 + 4u, last_col) * k4;
    let rb5 = b4o + min(col0 + 5u, last_col) * k4;
    let rb6 = b4o + min(col0 + 6u, last_col) * k4;
    let rb7 = b4o + min(col0 + 7u, last_col) * k4;
    let ra0 = a_off / 4u + min(0u, last_row) * k4;
    let ra1 = a_off / 4u + min(1u, last_row) * k4;
    let ra2 = a_off / 4u + min(2u, last_row) * k4;
    let ra3 = a_off / 4u + min(3u, last_row) * k4;
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
    for (var kk = lane; kk < k4; kk += MATVEC_WG) {
        let w0 = b4[rb0 + kk];
        let w1 = b4[rb1 + kk];
        let w2 = b4[rb2 + kk];
        let w3 = b4[rb3 + kk];
        let w4 = b4[rb4 + kk];
        let w5 = b4[rb5 + kk];
        let w6 = b4[rb6 + kk];
        let w7 = b4[rb7 + kk];
        let x0 = a4[ra0 + kk];
        acc00 = fma(w0, x0, acc00);
        acc01 = fma(w1, x0, acc01);
        acc02 = fma(w2, x0, acc02);
        acc03 = fma(w3, x0, acc03);
        acc04 = fma(w4, x0, acc04);
        acc05 = fma(w5, x0, acc05);
        acc06 = fma(w6, x0, acc06);
        acc07 = fma(w7, x0, acc07);
        if MATVEC_ROWS > 1u {
            let x1 = a4[ra1 + kk];
            acc10 = fma(w0, x1, acc10);
            acc11 = fma(w1, x1, acc11);
            acc12 = fma(w2, x1, acc12);
            acc13 = fma(w3, x1, acc13);
            acc14 = fma(w4, x1, acc14);
            acc15 = fma(w5, x1, acc15);
            acc16 = fma(w6, x1, acc16);
            acc17 = fma(w7, x1, acc17);
        }
        if MATVEC_ROWS > 2u {
            let x2 = a4[ra2 + kk];
            acc20 = fma(w0, x2, acc20);
            acc21 = fma(w1, x2, acc21);
            acc22 = fma(w2, x2, acc22);
            acc23 = fma(w3, x2, acc23);
            acc24 = fma(w4, x2, acc24);
            acc25 = fma(w5, x2, acc25);
            acc26 = fma(w6, x2, acc26);
            acc27 = fma(w7, x2, acc27);
        }
        if MATVEC_ROWS > 3u {
            let x3 = a4[ra3 + kk];
            acc30 = fma(w0, x3, acc30);
            acc31 = fma(w1, x3, acc31);
            acc32 = fma(w2, x3, acc32);
            acc33 = fma(w3, x3, acc33);
            acc34 = fma(w4, x3, acc34);
            acc35 = fma(w5, x3, acc35);
            acc36 = fma(w6, x3, acc36);
            acc37 = fma(w7, x3, acc37);
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
