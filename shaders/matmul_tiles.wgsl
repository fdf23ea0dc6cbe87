// The workgroup-memory tiled kernels' staging, multiply-adds and stores,
// shared by matmul.wgsl's matmul_forward_shared (f32, every form) and
// f16_weights.wgsl's matmul_f16w_forward_shared (f16 weights, A·Bᵀ): the
// layout for real GPUs (the register-blocked kernels' 512 accumulators per
// invocation would spill there).
// A workgroup of 16×8 invocations computes one 64×64 tile of C in slices of
// MT_DEPTH steps of k. Each slice of op(A) and op(B) is staged in workgroup
// memory by loads in which consecutive invocations read consecutive
// addresses of the operand as it is stored (vec4s in the entry points for
// layouts that allow them, scalars in the others), whatever the form; the
// staged layout follows the stored one, so the stores into workgroup memory
// are consecutive too. Invocation (x, y) then accumulates an 8×4 block of
// C: rows 8·y + 0..7, and columns 4·x + 0..3 when B is stored [K,N] or
// x + 16·j, j in 0..3, when it is stored [N,K] (so that the invocations of
// a quarter warp read the staged B from distinct banks). Per 4 steps of k
// it reads 8 vec4s of staged A (broadcast: a quarter warp shares y) and 4
// of staged B for 128 multiply-adds.
// An entry point may read `a` or `a4`, not both (WebGPU refuses an entry
// point using two variables of one binding), so each staging function has
// a scalar and a vec4 form.
// Uses the composing family's `fn load_a(i: u32) -> f32` (element i of
// the stored A as f32, widened where the family stores it in f16) and
// `a4` (f32, binding 0), `p.m`, `p.n`, `p.k`, and its epilogue `fn write_c(row: u32, col: u32, product: f32)`.

const MT_DEPTH: u32 = 16u;
// Invocations per workgroup: the entry points' @workgroup_size(16, 8, 1).
const MT_INVOCATIONS: u32 = 128u;
// vec4s per staged column of a B stored [N,K]: MT_DEPTH / 4 and one of
// padding, so columns x + 16·j of invocations x = 0..7 fall in distinct banks.
const MT_B_COL: u32 = 5u;
// Staged op(A), 64 rows × MT_DEPTH steps: A stored [M,K] ("rows"):
// mt_a[r * 4 + k4] = A[row0 + r, k0 + 4·k4 + 0..3]; stored [K,M] ("cols"):
// mt_a[kk * 16 + r4] = A[row0 + 4·r4 + 0..3, k0 + kk]. 4 KiB.
var<workgroup> mt_a: array<vec4<f32>, 256>;
// Staged op(B), MT_DEPTH steps × 64 columns: B stored [K,N] ("rows"):
// mt_b[kk * 16 + c4] = B[k0 + kk, col0 + 4·c4 + 0..3]; stored [N,K]
// ("cols"): mt_b[c * MT_B_COL + k4] = B[k0 + 4·k4 + 0..3, col0 + c]. 5 KiB.
var<workgroup> mt_b: array<vec4<f32>, 320>;

// An invocation's 8×4 block: column i of lo holds row i's four columns,
// column i of hi row 4 + i's.
struct MtBlock {
    lo: mat4x4<f32>,
    hi: mat4x4<f32>,
}

// Stages op(A)[row0.., k0..] for A stored [M,K] from element `off` of `a`:
// consecutive invocations read consecutive steps of a row. Rows past M and
// steps past K are staged as 0 (read clamped, never out of bounds).
fn mt_stage_a_rows(t: u32, row0: u32, k0: u32, off: u32) {
    let m = p.m;
    let k = p.k;
    for (var l = 0u; l < 8u; l++) {
        // 1024 values: row e / 16, step e % 16.
        let e = t + MT_INVOCATIONS * l;
        let row = row0 + e / 16u;
        let kk = k0 + e % 16u;
        let v = load_a(off + min(row, m - 1u) * k + min(kk, k - 1u));
        mt_a[e / 4u][e % 4u] = select(0.0, v, row < m && kk < k);
    }
}

// mt_stage_a_rows in vec4s of `a4`, for K and `off` multiples of 4 (the
// Rust side checks, with the binding's 16-byte alignment), so that a vec4
// is wholly inside or outside K.
fn mt_stage_a_rows4(t: u32, row0: u32, k0: u32, off: u32) {
    let m = p.m;
    let k = p.k;
    for (var l = 0u; l < 2u; l++) {
        // 256 vec4s: row e / 4, steps 4·(e % 4) + 0..3.
        let e = t + MT_INVOCATIONS * l;
        let row = row0 + e / 4u;
        let kk = k0 + 4u * (e % 4u);
        let v = a4[(off + min(row, m - 1u) * k + min(kk, k - 4u)) / 4u];
        mt_a[e] = select(vec4<f32>(0.0), v, row < m && kk < k);
    }
}

// As mt_stage_a_rows for A stored [K,M] (op(A) = Aᵀ): consecutive
// invocations read consecutive rows of op(A) at one step.
fn mt_stage_a_cols(t: u32, row0: u32, k0: u32, off: u32) {
    let m = p.m;
    let k = p.k;
    for (var l = 0u; l < 8u; l++) {
        // 1024 values: step e / 64, row e % 64.
        let e = t + MT_INVOCATIONS * l;
        let kk = k0 + e / 64u;
        let row = row0 + e % 64u;
        let v = load_a(off + min(kk, k - 1u) * m + min(row, m - 1u));
        mt_a[e / 4u][e % 4u] = select(0.0, v, row < m && kk < k);
    }
}

// mt_stage_a_cols in vec4s, for M and `off` multiples of 4.
fn mt_stage_a_cols4(t: u32, row0: u32, k0: u32, off: u32) {
    let m = p.m;
    let k = p.k;
    for (var l = 0u; l < 2u; l++) {
        // 256 vec4s: step e / 16, rows 4·(e % 16) + 0..3.
        let e = t + MT_INVOCATIONS * l;
        let kk = k0 + e / 16u;
        let row = row0 + 4u * (e % 16u);
        let v = a4[(off + min(kk, k - 1u) * m + min(row, m - 4u)) / 4u];
        mt_a[e] = select(vec4<f32>(0.0), v, row < m && kk < k);
    }
}

// acc + Σ_j av[j] · bm[j]: one row's four steps (av) times the steps' four
// columns (bm[j]), one step after another as the k loop.
fn mt_fma_row(acc: vec4<f32>, av: vec4<f32>, bm: mat4x4<f32>) -> vec4<f32> {
    return fma(vec4<f32>(av.w), bm[3], fma(vec4<f32>(av.z), bm[2], fma(vec4<f32>(av.y), bm[1], fma(vec4<f32>(av.x), bm[0], acc))));
}

// Four rows (column i of av: row i's four steps) into their accumulators;
// unrolled, since a matrix indexed in a loop can become memory.
fn mt_fma(acc: mat4x4<f32>, av: mat4x4<f32>, bm: mat4x4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(mt_fma_row(acc[0], av[0], bm), mt_fma_row(acc[1], av[1], bm), mt_fma_row(acc[2], av[2], bm), mt_fma_row(acc[3], av[3], bm));
}

// acc plus invocation (x, y)'s products over the staged slice. `a_rows`:
// mt_a holds the rows layout (A stored [M,K]), else cols; `b_rows`: mt_b
// holds the rows layout (B stored [K,N]), else cols. Both are constants at
// every call, so each branch folds away.
fn mt_multiply(acc_in: MtBlock, x: u32, y: u32, a_rows: bool, b_rows: bool) -> MtBlock {
    var acc = acc_in;
    for (var k4 = 0u; k4 < MT_DEPTH / 4u; k4++) {
        // Column j of bm: the invocation's four columns at step 4·k4 + j.
        var bm: mat4x4<f32>;
        if b_rows {
            let s = 64u * k4 + x;
            bm = mat4x4<f32>(mt_b[s], mt_b[s + 16u], mt_b[s + 32u], mt_b[s + 48u]);
        } else {
            let s = x * MT_B_COL + k4;
            let d = 16u * MT_B_COL;
            bm = transpose(mat4x4<f32>(mt_b[s], mt_b[s + d], mt_b[s + 2u * d], mt_b[s + 3u * d]));
        }
        // Column i of al (ah): row i's (4 + i's) four steps.
        var al: mat4x4<f32>;
        var ah: mat4x4<f32>;
        if a_rows {
            let s = 32u * y + k4;
            al = mat4x4<f32>(mt_a[s], mt_a[s + 4u], mt_a[s + 8u], mt_a[s + 12u]);
            ah = mat4x4<f32>(mt_a[s + 16u], mt_a[s + 20u], mt_a[s + 24u], mt_a[s + 28u]);
        } else {
            let s = 64u * k4 + 2u * y;
            al = transpose(mat4x4<f32>(mt_a[s], mt_a[s + 16u], mt_a[s + 32u], mt_a[s + 48u]));
            ah = transpose(mat4x4<f32>(mt_a[s + 1u], mt_a[s + 17u], mt_a[s + 33u], mt_a[s + 49u]));
        }
        acc.lo = mt_fma(acc.lo, al, bm);
        acc.hi = mt_fma(acc.hi, ah, bm);
    }
    return acc;
}

// One row of an invocation's block, columns `cols`, through write_c;
// rows and columns past the edge are not stored.
fn mt_store_row(row: u32, cols: vec4<u32>, v: vec4<f32>) {
    if row >= p.m {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        if cols[j] < p.n {
            write_c(row, cols[j], v[j]);
        }
    }
}

// Stores invocation (x, y)'s block of the tile at (row0, col0); `b_rows`
// as for mt_multiply (it says which columns the invocation owns).
fn mt_store(row0: u32, col0: u32, x: u32, y: u32, b_rows: bool, acc: MtBlock) {
    let cols = select(vec4<u32>(col0 + x) + vec4<u32>(0u, 16u, 32u, 48u), vec4<u32>(col0 + 4u * x) + vec4<u32>(0u, 1u, 2u, 3u), b_rows);
    let r = row0 + 8u * y;
    mt_store_row(r + 0u, cols, acc.lo[0]);
    mt_store_row(r + 1u, cols, acc.lo[1]);
    mt_store_row(r + 2u, cols, acc.lo[2]);
    mt_store_row(r + 3u, cols, acc.lo[3]);
    mt_store_row(r + 4u, cols, acc.hi[0]);
    mt_store_row(r + 5u, cols, acc.hi[1]);
    mt_store_row(r + 6u, cols, acc.hi[2]);
    mt_store_row(r + 7u, cols, acc.hi[3]);
}
