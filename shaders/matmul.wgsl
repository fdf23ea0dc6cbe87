// Matrix multiply, row-major f32: C[M,N] = op(A) · op(B).
//   op(A) = A [M,K], or Aᵀ with A stored [K,M] when TRANS_A;
//   op(B) = B [K,N], or Bᵀ with B stored [N,K] when TRANS_B.
// The three forms training needs are (TRANS_A, TRANS_B) = (false, false)
// for the forward pass, (true, false) for dW = Xᵀ·dY, (false, true) for
// dX = dY·Wᵀ. Each workgroup computes one 64×64 tile of C; tiles are
// numbered linearly and spread over a 2-D grid so huge matrices never exceed
// the 65,535 workgroups-per-dimension limit.

override TRANS_A: bool = false;
override TRANS_B: bool = false;

struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    // Number of 64-wide column tiles, and all tiles (guards grid overshoot).
    tiles_n: u32,
    tiles_total: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> p: MatmulParams;

const TILE: u32 = 64u;

fn a_at(row: u32, kk: u32) -> f32 {
    if TRANS_A {
        return a[kk * p.m + row];
    }
    return a[row * p.k + kk];
}

fn b_at(kk: u32, col: u32) -> f32 {
    if TRANS_B {
        return b[col * p.k + kk];
    }
    return b[kk * p.n + col];
}

// Register-blocked form, no workgroup memory and no barriers: fastest on CPU
// adapters (llvmpipe), where barriers are expensive and registers plentiful.
// 8×8 threads, each owning an 8×8 block of outputs interleaved with stride 8
// so neighbouring invocations read neighbouring columns of B. Edge rows and
// columns are clamped on load (every load stays in bounds without a branch in
// the k loop) and masked on store.
@compute @workgroup_size(8, 8, 1)
fn matmul_forward_register(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row_base = (tile / p.tiles_n) * TILE + lid.y;
    let col_base = (tile % p.tiles_n) * TILE + lid.x;
    if row_base >= p.m || col_base >= p.n {
        return;
    }
    var rows: array<u32, 8>;
    var cols: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        rows[i] = min(row_base + 8u * i, p.m - 1u);
        cols[i] = min(col_base + 8u * i, p.n - 1u);
    }
    // acc[2i] holds columns 0..3 of row i, acc[2i+1] columns 4..7.
    var acc: array<vec4<f32>, 16>;
    for (var kk = 0u; kk < p.k; kk++) {
        let b_lo = vec4<f32>(b_at(kk, cols[0]), b_at(kk, cols[1]), b_at(kk, cols[2]), b_at(kk, cols[3]));
        let b_hi = vec4<f32>(b_at(kk, cols[4]), b_at(kk, cols[5]), b_at(kk, cols[6]), b_at(kk, cols[7]));
        for (var i = 0u; i < 8u; i++) {
            let a_val = a_at(rows[i], kk);
            acc[2u * i] = fma(vec4<f32>(a_val), b_lo, acc[2u * i]);
            acc[2u * i + 1u] = fma(vec4<f32>(a_val), b_hi, acc[2u * i + 1u]);
        }
    }
    for (var i = 0u; i < 8u; i++) {
        let row = row_base + 8u * i;
        if row >= p.m {
            break;
        }
        for (var j = 0u; j < 8u; j++) {
            let col = col_base + 8u * j;
            if col < p.n {
                c[row * p.n + col] = acc[2u * i + j / 4u][j % 4u];
            }
        }
    }
}

// Workgroup-memory tiled form: the usual choice on real GPUs. 16×16 threads
// stage 64×16 slices of op(A) and 16×64 slices of op(B) in workgroup memory;
// each thread accumulates a 4×4 register block (rows and columns interleaved
// with stride 16 so that reads of the staged tiles are conflict-free).
const DEPTH: u32 = 16u;
var<workgroup> a_tile: array<f32, 1024>; // [DEPTH][TILE]
var<workgroup> b_tile: array<f32, 1024>; // [DEPTH][TILE]

@compute @workgroup_size(16, 16, 1)
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
    let row0 = (tile / p.tiles_n) * TILE;
    let col0 = (tile % p.tiles_n) * TILE;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += DEPTH) {
        for (var l = 0u; l < 4u; l++) {
            let e = lindex + 256u * l;
            let kk = k0 + e / TILE;
            let off = e % TILE;
            let in_k = kk < p.k;
            let row = row0 + off;
            let col = col0 + off;
            let ka = min(kk, p.k - 1u);
            a_tile[e] = select(0.0, a_at(min(row, p.m - 1u), ka), in_k && row < p.m);
            b_tile[e] = select(0.0, b_at(ka, min(col, p.n - 1u)), in_k && col < p.n);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < DEPTH; kk++) {
            var a_reg: array<f32, 4>;
            var b_reg: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a_reg[i] = a_tile[kk * TILE + lid.y + 16u * i];
                b_reg[i] = b_tile[kk * TILE + lid.x + 16u * i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(a_reg[i], b_reg[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x + 16u * j;
            if row < p.m && col < p.n {
                c[row * p.n + col] = acc[i * 4u + j];
            }
        }
    }
}
