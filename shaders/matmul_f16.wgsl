// f16 storage, f32 arithmetic: C[M,N] (f32) = op(A) · op(B) with A and B
// stored as f16, and the f32 <-> f16 conversions that make and read such
// operands. Needs the SHADER_F16 feature (`enable f16`); the Rust side
// refuses an adapter without it before this file is ever compiled.
//   op(A) = A [M,K], or Aᵀ with A stored [K,M] when TRANS_A;
//   op(B) = B [K,N], or Bᵀ with B stored [N,K] when TRANS_B.
// An f16 tensor of `len` values is bound as ceil(len / 2) 4-byte words
// (element 2i in the low half of word i), so it binds like any other
// buffer; the high half of an odd-length tensor's last word is 0 and never
// read as data.
// Every f16 value is exactly an f32 and the product of two is exact in f32
// (11 + 11 significant bits ≤ 24), so the only roundings are the inputs'
// (done once, when they were converted to f16) and the f32 accumulation:
// the error does not grow like an f16 accumulator's would with K.

enable f16;

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

@group(0) @binding(0) var<storage, read> a: array<f16>;
@group(0) @binding(1) var<storage, read> b: array<f16>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> p: MatmulParams;

const TILE: u32 = 64u;

// The loads matmul_register.wgsl's block calls: each f16 widened to f32.
fn load_a(i: u32) -> f32 {
    return f32(a[i]);
}

fn load_b(i: u32) -> f32 {
    return f32(b[i]);
}

// The store matmul_rows.wgsl's mm_store_row calls: C[row, col] = product.
fn write_c(row: u32, col: u32, product: f32) {
    c[row * p.n + col] = product;
}

// The layout of matmul.wgsl's register kernel (fastest on llvmpipe, where
// storage loads are issued lane by lane and multiply-adds per load decide
// speed): 8-wide workgroups, one 64×64 tile of C each; invocation x owns
// rows 32·(x / 4) + 0..31 and columns x % 4 + 4·j, j in 0..15, in 32
// mat4x4 accumulators. Edge rows and columns are clamped on load (no branch
// in the k loop) and masked on store. Each f16 is widened to f32 as it is
// loaded.
@compute @workgroup_size(8, 1, 1)
fn matmul_f16_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * TILE + (lid.x / 4u) * 32u;
    let col0 = (tile % p.tiles_n) * TILE + lid.x % 4u;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    // Element (row, kk) of op(A) is a[row * sa_row + kk * sa_k]; element
    // (kk, col) of op(B) is b[col * sb_col + kk * sb_k].
    let sa_row = select(p.k, 1u, TRANS_A);
    let sa_k = select(1u, p.m, TRANS_A);
    let sb_col = select(1u, p.k, TRANS_B);
    let sb_k = select(p.n, 1u, TRANS_B);
    mm_register_block(row0, col0, sa_row, sa_k, sb_col, sb_k, 0u, 0u);
}

struct ConvertParams {
    // Values in the tensor, and 4-byte words (= ceil(len / 2)).
    len: u32,
    words: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(4) var<storage, read> convert_src_f32: array<f32>;
@group(0) @binding(5) var<storage, read_write> convert_dst_f16: array<vec2<f16>>;
@group(0) @binding(6) var<storage, read> convert_src_f16: array<vec2<f16>>;
@group(0) @binding(7) var<storage, read_write> convert_dst_f32: array<f32>;
@group(0) @binding(8) var<uniform> cp: ConvertParams;

// The conversions index words with flat_index (common.wgsl, composed after
// this file by Family::source so `enable f16` stays first).

// One invocation per 4-byte word (two values), so no two invocations write
// the same word. f32 -> f16 rounds as the driver's conversion does (WGSL
// allows either neighbour of an inexact value; round-to-nearest-even on
// lavapipe); magnitudes past 65504 are outside f16's range.
@compute @workgroup_size(256, 1, 1)
fn f32_to_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let w = flat_index(wid, nwg, lid);
    if w >= cp.words {
        return;
    }
    let lo = convert_src_f32[2u * w];
    let has_hi = 2u * w + 1u < cp.len;
    let hi = select(0.0, convert_src_f32[min(2u * w + 1u, cp.len - 1u)], has_hi);
    convert_dst_f16[w] = vec2<f16>(f16(lo), f16(hi));
}

// Exact: every f16 value is an f32 value.
@compute @workgroup_size(256, 1, 1)
fn f16_to_f32(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let w = flat_index(wid, nwg, lid);
    if w >= cp.words {
        return;
    }
    let pair = convert_src_f16[w];
    convert_dst_f32[2u * w] = f32(pair.x);
    if 2u * w + 1u < cp.len {
        convert_dst_f32[2u * w + 1u] = f32(pair.y);
    }
}
