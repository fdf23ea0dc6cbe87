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
    let last_row = p.m - 1u;
    let last_col = p.n - 1u;
    let ra0 = min(row0 + 0u, last_row) * sa_row;
    let ra1 = min(row0 + 1u, last_row) * sa_row;
    let ra2 = min(row0 + 2u, last_row) * sa_row;
    let ra3 = min(row0 + 3u, last_row) * sa_row;
    let ra4 = min(row0 + 4u, last_row) * sa_row;
    let ra5 = min(row0 + 5u, last_row) * sa_row;
    let ra6 = min(row0 + 6u, last_row) * sa_row;
    let ra7 = min(row0 + 7u, last_row) * sa_row;
    let ra8 = min(row0 + 8u, last_row) * sa_row;
    let ra9 = min(row0 + 9u, last_row) * sa_row;
    let ra10 = min(row0 + 10u, last_row) * sa_row;
    let ra11 = min(row0 + 11u, last_row) * sa_row;
    let ra12 = min(row0 + 12u, last_row) * sa_row;
    let ra13 = min(row0 + 13u, last_row) * sa_row;
    let ra14 = min(row0 + 14u, last_row) * sa_row;
    let ra15 = min(row0 + 15u, last_row) * sa_row;
    let ra16 = min(row0 + 16u, last_row) * sa_row;
    let ra17 = min(row0 + 17u, last_row) * sa_row;
    let ra18 = min(row0 + 18u, last_row) * sa_row;
    let ra19 = min(row0 + 19u, last_row) * sa_row;
    let ra20 = min(row0 + 20u, last_row) * sa_row;
    let ra21 = min(row0 + 21u, last_row) * sa_row;
    let ra22 = min(row0 + 22u, last_row) * sa_row;
    let ra23 = min(row0 + 23u, last_row) * sa_row;
    let ra24 = min(row0 + 24u, last_row) * sa_row;
    let ra25 = min(row0 + 25u, last_row) * sa_row;
    let ra26 = min(row0 + 26u, last_row) * sa_row;
    let ra27 = min(row0 + 27u, last_row) * sa_row;
    let ra28 = min(row0 + 28u, last_row) * sa_row;
    let ra29 = min(row0 + 29u, last_row) * sa_row;
    let ra30 = min(row0 + 30u, last_row) * sa_row;
    let ra31 = min(row0 + 31u, last_row) * sa_row;
    let cb0 = min(col0 + 0u, last_col) * sb_col;
    let cb1 = min(col0 + 4u, last_col) * sb_col;
    let cb2 = min(col0 + 8u, last_col) * sb_col;
    let cb3 = min(col0 + 12u, last_col) * sb_col;
    let cb4 = min(col0 + 16u, last_col) * sb_col;
    let cb5 = min(col0 + 20u, last_col) * sb_col;
    let cb6 = min(col0 + 24u, last_col) * sb_col;
    let cb7 = min(col0 + 28u, last_col) * sb_col;
    let cb8 = min(col0 + 32u, last_col) * sb_col;
    let cb9 = min(col0 + 36u, last_col) * sb_col;
    let cb10 = min(col0 + 40u, last_col) * sb_col;
    let cb11 = min(col0 + 44u, last_col) * sb_col;
    let cb12 = min(col0 + 48u, last_col) * sb_col;
    let cb13 = min(col0 + 52u, last_col) * sb_col;
    let cb14 = min(col0 + 56u, last_col) * sb_col;
    let cb15 = min(col0 + 60u, last_col) * sb_col;
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
    var oa = 0u;
    var ob = 0u;
    for (var kk = 0u; kk < p.k; kk++) {
        let bm = mat4x4<f32>(
            vec4<f32>(f32(b[cb0 + ob]), f32(b[cb1 + ob]), f32(b[cb2 + ob]), f32(b[cb3 + ob])),
            vec4<f32>(f32(b[cb4 + ob]), f32(b[cb5 + ob]), f32(b[cb6 + ob]), f32(b[cb7 + ob])),
            vec4<f32>(f32(b[cb8 + ob]), f32(b[cb9 + ob]), f32(b[cb10 + ob]), f32(b[cb11 + ob])),
            vec4<f32>(f32(b[cb12 + ob]), f32(b[cb13 + ob]), f32(b[cb14 + ob]), f32(b[cb15 + ob])),
        );
        acc0 = mm_row_fma(acc0, f32(a[ra0 + oa]), bm);
        acc1 = mm_row_fma(acc1, f32(a[ra1 + oa]), bm);
        acc2 = mm_row_fma(acc2, f32(a[ra2 + oa]), bm);
        acc3 = mm_row_fma(acc3, f32(a[ra3 + oa]), bm);
        acc4 = mm_row_fma(acc4, f32(a[ra4 + oa]), bm);
        acc5 = mm_row_fma(acc5, f32(a[ra5 + oa]), bm);
        acc6 = mm_row_fma(acc6, f32(a[ra6 + oa]), bm);
        acc7 = mm_row_fma(acc7, f32(a[ra7 + oa]), bm);
        acc8 = mm_row_fma(acc8, f32(a[ra8 + oa]), bm);
        acc9 = mm_row_fma(acc9, f32(a[ra9 + oa]), bm);
        acc10 = mm_row_fma(acc10, f32(a[ra10 + oa]), bm);
        acc11 = mm_row_fma(acc11, f32(a[ra11 + oa]), bm);
        acc12 = mm_row_fma(acc12, f32(a[ra12 + oa]), bm);
        acc13 = mm_row_fma(acc13, f32(a[ra13 + oa]), bm);
        acc14 = mm_row_fma(acc14, f32(a[ra14 + oa]), bm);
        acc15 = mm_row_fma(acc15, f32(a[ra15 + oa]), bm);
        acc16 = mm_row_fma(acc16, f32(a[ra16 + oa]), bm);
        acc17 = mm_row_fma(acc17, f32(a[ra17 + oa]), bm);
        acc18 = mm_row_fma(acc18, f32(a[ra18 + oa]), bm);
        acc19 = mm_row_fma(acc19, f32(a[ra19 + oa]), bm);
        acc20 = mm_row_fma(acc20, f32(a[ra20 + oa]), bm);
        acc21 = mm_row_fma(acc21, f32(a[ra21 + oa]), bm);
        acc22 = mm_row_fma(acc22, f32(a[ra22 + oa]), bm);
        acc23 = mm_row_fma(acc23, f32(a[ra23 + oa]), bm);
        acc24 = mm_row_fma(acc24, f32(a[ra24 + oa]), bm);
        acc25 = mm_row_fma(acc25, f32(a[ra25 + oa]), bm);
        acc26 = mm_row_fma(acc26, f32(a[ra26 + oa]), bm);
        acc27 = mm_row_fma(acc27, f32(a[ra27 + oa]), bm);
        acc28 = mm_row_fma(acc28, f32(a[ra28 + oa]), bm);
        acc29 = mm_row_fma(acc29, f32(a[ra29 + oa]), bm);
        acc30 = mm_row_fma(acc30, f32(a[ra30 + oa]), bm);
        acc31 = mm_row_fma(acc31, f32(a[ra31 + oa]), bm);
        oa += sa_k;
        ob += sb_k;
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
