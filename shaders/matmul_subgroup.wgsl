// Subgroup matrix multiply, f32: C[M,N] = epilogue(op(A) · op(B)), the
// forms and epilogues of matmul.wgsl. Needs the SUBGROUP feature and a
// subgroup of exactly 8 invocations: the Rust side checks the adapter's
// subgroup size range before this file is ever compiled.
//
// This file is not a module on its own: the registry (Family::source)
// appends it to the matmul family's source (matmul.wgsl and the shared
// activations.wgsl), so the epilogue overrides (ACCUMULATE,
// HAS_BIAS, ACTIVATION_*, STORE_PRE), the MatmulParams block with its strides,
// the bindings, the batch offsets (set_batch) and write_c are matmul.wgsl's own, and one binding layout
// and one MatmulEpilogue serve every matmul variant. matmul.wgsl itself
// never sees a subgroup builtin, so it still validates without SUBGROUP
// (e.g. on GL).
//
// Why: in matmul.wgsl's register kernel every invocation loads each A and B
// value it multiplies, so the 8 invocations of a workgroup load the same A
// row values 4 times and the same B values twice; on llvmpipe storage loads
// are issued lane by lane and dominate. Here one workgroup is one subgroup
// of 8 lanes and one 64×64 tile of C. Lane L owns columns L + 8·j, j in
// 0..7, of all 64 rows (64 mat2x4 accumulators, 512 values as before).
// For each k, lane L loads 8 values of op(B) (its own columns) and 8 of
// op(A) (rows 8·L + 0..7), and gets the other 56 A values from their
// owners with subgroupBroadcast: 16 storage loads per lane per k instead of
// 48, for the same 512 multiply-adds.
// Edge rows and columns are clamped on load and masked on store; no lane
// returns before the k loop ends, so every broadcast has all 8 lanes.

// Lanes per subgroup this kernel is written for.
const LANES: u32 = 8u;

// fma_row8 and store_row8 (8 columns col0 + 8·j per row, in a mat2x4) are
// matmul.wgsl's, shared with its small kernel.

@compute @workgroup_size(8, 1, 1)
fn matmul_subgroup_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    // Uniform per workgroup (= subgroup), so returning keeps the
    // broadcasts' lanes together.
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    set_batch(wid.z);
    let row0 = (tile / p.tiles_n) * TILE;
    let col0 = (tile % p.tiles_n) * TILE + lane;
    let row_own = row0 + LANES * lane;
    // Element (row, kk) of op(A) is a[row * sa_row + kk * sa_k]; element
    // (kk, col) of op(B) is b[col * sb_col + kk * sb_k].
    let sa_row = p.sa_row;
    let sa_k = p.sa_k;
    let sb_col = p.sb_col;
    let sb_k = p.sb_k;
    let last_row = p.m - 1u;
    let last_col = p.n - 1u;
    let ra0 = min(row_own + 0u, last_row) * sa_row;
    let ra1 = min(row_own + 1u, last_row) * sa_row;
    let ra2 = min(row_own + 2u, last_row) * sa_row;
    let ra3 = min(row_own + 3u, last_row) * sa_row;
    let ra4 = min(row_own + 4u, last_row) * sa_row;
    let ra5 = min(row_own + 5u, last_row) * sa_row;
    let ra6 = min(row_own + 6u, last_row) * sa_row;
    let ra7 = min(row_own + 7u, last_row) * sa_row;
    let cb0 = min(col0 + 0u, last_col) * sb_col;
    let cb1 = min(col0 + 8u, last_col) * sb_col;
    let cb2 = min(col0 + 16u, last_col) * sb_col;
    let cb3 = min(col0 + 24u, last_col) * sb_col;
    let cb4 = min(col0 + 32u, last_col) * sb_col;
    let cb5 = min(col0 + 40u, last_col) * sb_col;
    let cb6 = min(col0 + 48u, last_col) * sb_col;
    let cb7 = min(col0 + 56u, last_col) * sb_col;
    var acc0: mat2x4<f32>;
    var acc1: mat2x4<f32>;
    var acc2: mat2x4<f32>;
    var acc3: mat2x4<f32>;
    var acc4: mat2x4<f32>;
    var acc5: mat2x4<f32>;
    var acc6: mat2x4<f32>;
    var acc7: mat2x4<f32>;
    var acc8: mat2x4<f32>;
    var acc9: mat2x4<f32>;
    var acc10: mat2x4<f32>;
    var acc11: mat2x4<f32>;
    var acc12: mat2x4<f32>;
    var acc13: mat2x4<f32>;
    var acc14: mat2x4<f32>;
    var acc15: mat2x4<f32>;
    var acc16: mat2x4<f32>;
    var acc17: mat2x4<f32>;
    var acc18: mat2x4<f32>;
    var acc19: mat2x4<f32>;
    var acc20: mat2x4<f32>;
    var acc21: mat2x4<f32>;
    var acc22: mat2x4<f32>;
    var acc23: mat2x4<f32>;
    var acc24: mat2x4<f32>;
    var acc25: mat2x4<f32>;
    var acc26: mat2x4<f32>;
    var acc27: mat2x4<f32>;
    var acc28: mat2x4<f32>;
    var acc29: mat2x4<f32>;
    var acc30: mat2x4<f32>;
    var acc31: mat2x4<f32>;
    var acc32: mat2x4<f32>;
    var acc33: mat2x4<f32>;
    var acc34: mat2x4<f32>;
    var acc35: mat2x4<f32>;
    var acc36: mat2x4<f32>;
    var acc37: mat2x4<f32>;
    var acc38: mat2x4<f32>;
    var acc39: mat2x4<f32>;
    var acc40: mat2x4<f32>;
    var acc41: mat2x4<f32>;
    var acc42: mat2x4<f32>;
    var acc43: mat2x4<f32>;
    var acc44: mat2x4<f32>;
    var acc45: mat2x4<f32>;
    var acc46: mat2x4<f32>;
    var acc47: mat2x4<f32>;
    var acc48: mat2x4<f32>;
    var acc49: mat2x4<f32>;
    var acc50: mat2x4<f32>;
    var acc51: mat2x4<f32>;
    var acc52: mat2x4<f32>;
    var acc53: mat2x4<f32>;
    var acc54: mat2x4<f32>;
    var acc55: mat2x4<f32>;
    var acc56: mat2x4<f32>;
    var acc57: mat2x4<f32>;
    var acc58: mat2x4<f32>;
    var acc59: mat2x4<f32>;
    var acc60: mat2x4<f32>;
    var acc61: mat2x4<f32>;
    var acc62: mat2x4<f32>;
    var acc63: mat2x4<f32>;
    var oa = a_off;
    var ob = b_off;
    for (var kk = 0u; kk < p.k; kk++) {
        let b_lo = vec4<f32>(b[cb0 + ob], b[cb1 + ob], b[cb2 + ob], b[cb3 + ob]);
        let b_hi = vec4<f32>(b[cb4 + ob], b[cb5 + ob], b[cb6 + ob], b[cb7 + ob]);
        let a0 = a[ra0 + oa];
        let a1 = a[ra1 + oa];
        let a2 = a[ra2 + oa];
        let a3 = a[ra3 + oa];
        let a4 = a[ra4 + oa];
        let a5 = a[ra5 + oa];
        let a6 = a[ra6 + oa];
        let a7 = a[ra7 + oa];
        // Row 8·q + i of the tile is lane q's a_i.
        acc0 = fma_row8(acc0, subgroupBroadcast(a0, 0u), b_lo, b_hi);
        acc1 = fma_row8(acc1, subgroupBroadcast(a1, 0u), b_lo, b_hi);
        acc2 = fma_row8(acc2, subgroupBroadcast(a2, 0u), b_lo, b_hi);
        acc3 = fma_row8(acc3, subgroupBroadcast(a3, 0u), b_lo, b_hi);
        acc4 = fma_row8(acc4, subgroupBroadcast(a4, 0u), b_lo, b_hi);
        acc5 = fma_row8(acc5, subgroupBroadcast(a5, 0u), b_lo, b_hi);
        acc6 = fma_row8(acc6, subgroupBroadcast(a6, 0u), b_lo, b_hi);
        acc7 = fma_row8(acc7, subgroupBroadcast(a7, 0u), b_lo, b_hi);
        acc8 = fma_row8(acc8, subgroupBroadcast(a0, 1u), b_lo, b_hi);
        acc9 = fma_row8(acc9, subgroupBroadcast(a1, 1u), b_lo, b_hi);
        acc10 = fma_row8(acc10, subgroupBroadcast(a2, 1u), b_lo, b_hi);
        acc11 = fma_row8(acc11, subgroupBroadcast(a3, 1u), b_lo, b_hi);
        acc12 = fma_row8(acc12, subgroupBroadcast(a4, 1u), b_lo, b_hi);
        acc13 = fma_row8(acc13, subgroupBroadcast(a5, 1u), b_lo, b_hi);
        acc14 = fma_row8(acc14, subgroupBroadcast(a6, 1u), b_lo, b_hi);
        acc15 = fma_row8(acc15, subgroupBroadcast(a7, 1u), b_lo, b_hi);
        acc16 = fma_row8(acc16, subgroupBroadcast(a0, 2u), b_lo, b_hi);
        acc17 = fma_row8(acc17, subgroupBroadcast(a1, 2u), b_lo, b_hi);
        acc18 = fma_row8(acc18, subgroupBroadcast(a2, 2u), b_lo, b_hi);
        acc19 = fma_row8(acc19, subgroupBroadcast(a3, 2u), b_lo, b_hi);
        acc20 = fma_row8(acc20, subgroupBroadcast(a4, 2u), b_lo, b_hi);
        acc21 = fma_row8(acc21, subgroupBroadcast(a5, 2u), b_lo, b_hi);
        acc22 = fma_row8(acc22, subgroupBroadcast(a6, 2u), b_lo, b_hi);
        acc23 = fma_row8(acc23, subgroupBroadcast(a7, 2u), b_lo, b_hi);
        acc24 = fma_row8(acc24, subgroupBroadcast(a0, 3u), b_lo, b_hi);
        acc25 = fma_row8(acc25, subgroupBroadcast(a1, 3u), b_lo, b_hi);
        acc26 = fma_row8(acc26, subgroupBroadcast(a2, 3u), b_lo, b_hi);
        acc27 = fma_row8(acc27, subgroupBroadcast(a3, 3u), b_lo, b_hi);
        acc28 = fma_row8(acc28, subgroupBroadcast(a4, 3u), b_lo, b_hi);
        acc29 = fma_row8(acc29, subgroupBroadcast(a5, 3u), b_lo, b_hi);
        acc30 = fma_row8(acc30, subgroupBroadcast(a6, 3u), b_lo, b_hi);
        acc31 = fma_row8(acc31, subgroupBroadcast(a7, 3u), b_lo, b_hi);
        acc32 = fma_row8(acc32, subgroupBroadcast(a0, 4u), b_lo, b_hi);
        acc33 = fma_row8(acc33, subgroupBroadcast(a1, 4u), b_lo, b_hi);
        acc34 = fma_row8(acc34, subgroupBroadcast(a2, 4u), b_lo, b_hi);
        acc35 = fma_row8(acc35, subgroupBroadcast(a3, 4u), b_lo, b_hi);
        acc36 = fma_row8(acc36, subgroupBroadcast(a4, 4u), b_lo, b_hi);
        acc37 = fma_row8(acc37, subgroupBroadcast(a5, 4u), b_lo, b_hi);
        acc38 = fma_row8(acc38, subgroupBroadcast(a6, 4u), b_lo, b_hi);
        acc39 = fma_row8(acc39, subgroupBroadcast(a7, 4u), b_lo, b_hi);
        acc40 = fma_row8(acc40, subgroupBroadcast(a0, 5u), b_lo, b_hi);
        acc41 = fma_row8(acc41, subgroupBroadcast(a1, 5u), b_lo, b_hi);
        acc42 = fma_row8(acc42, subgroupBroadcast(a2, 5u), b_lo, b_hi);
        acc43 = fma_row8(acc43, subgroupBroadcast(a3, 5u), b_lo, b_hi);
        acc44 = fma_row8(acc44, subgroupBroadcast(a4, 5u), b_lo, b_hi);
        acc45 = fma_row8(acc45, subgroupBroadcast(a5, 5u), b_lo, b_hi);
        acc46 = fma_row8(acc46, subgroupBroadcast(a6, 5u), b_lo, b_hi);
        acc47 = fma_row8(acc47, subgroupBroadcast(a7, 5u), b_lo, b_hi);
        acc48 = fma_row8(acc48, subgroupBroadcast(a0, 6u), b_lo, b_hi);
        acc49 = fma_row8(acc49, subgroupBroadcast(a1, 6u), b_lo, b_hi);
        acc50 = fma_row8(acc50, subgroupBroadcast(a2, 6u), b_lo, b_hi);
        acc51 = fma_row8(acc51, subgroupBroadcast(a3, 6u), b_lo, b_hi);
        acc52 = fma_row8(acc52, subgroupBroadcast(a4, 6u), b_lo, b_hi);
        acc53 = fma_row8(acc53, subgroupBroadcast(a5, 6u), b_lo, b_hi);
        acc54 = fma_row8(acc54, subgroupBroadcast(a6, 6u), b_lo, b_hi);
        acc55 = fma_row8(acc55, subgroupBroadcast(a7, 6u), b_lo, b_hi);
        acc56 = fma_row8(acc56, subgroupBroadcast(a0, 7u), b_lo, b_hi);
        acc57 = fma_row8(acc57, subgroupBroadcast(a1, 7u), b_lo, b_hi);
        acc58 = fma_row8(acc58, subgroupBroadcast(a2, 7u), b_lo, b_hi);
        acc59 = fma_row8(acc59, subgroupBroadcast(a3, 7u), b_lo, b_hi);
        acc60 = fma_row8(acc60, subgroupBroadcast(a4, 7u), b_lo, b_hi);
        acc61 = fma_row8(acc61, subgroupBroadcast(a5, 7u), b_lo, b_hi);
        acc62 = fma_row8(acc62, subgroupBroadcast(a6, 7u), b_lo, b_hi);
        acc63 = fma_row8(acc63, subgroupBroadcast(a7, 7u), b_lo, b_hi);
        oa += sa_k;
        ob += sb_k;
    }
    store_row8(row0 + 0u, col0, acc0);
    store_row8(row0 + 1u, col0, acc1);
    store_row8(row0 + 2u, col0, acc2);
    store_row8(row0 + 3u, col0, acc3);
    store_row8(row0 + 4u, col0, acc4);
    store_row8(row0 + 5u, col0, acc5);
    store_row8(row0 + 6u, col0, acc6);
    store_row8(row0 + 7u, col0, acc7);
    store_row8(row0 + 8u, col0, acc8);
    store_row8(row0 + 9u, col0, acc9);
    store_row8(row0 + 10u, col0, acc10);
    store_row8(row0 + 11u, col0, acc11);
    store_row8(row0 + 12u, col0, acc12);
    store_row8(row0 + 13u, col0, acc13);
    store_row8(row0 + 14u, col0, acc14);
    store_row8(row0 + 15u, col0, acc15);
    store_row8(row0 + 16u, col0, acc16);
    store_row8(row0 + 17u, col0, acc17);
    store_row8(row0 + 18u, col0, acc18);
    store_row8(row0 + 19u, col0, acc19);
    store_row8(row0 + 20u, col0, acc20);
    store_row8(row0 + 21u, col0, acc21);
    store_row8(row0 + 22u, col0, acc22);
    store_row8(row0 + 23u, col0, acc23);
    store_row8(row0 + 24u, col0, acc24);
    store_row8(row0 + 25u, col0, acc25);
    store_row8(row0 + 26u, col0, acc26);
    store_row8(row0 + 27u, col0, acc27);
    store_row8(row0 + 28u, col0, acc28);
    store_row8(row0 + 29u, col0, acc29);
    store_row8(row0 + 30u, col0, acc30);
    store_row8(row0 + 31u, col0, acc31);
    store_row8(row0 + 32u, col0, acc32);
    store_row8(row0 + 33u, col0, acc33);
    store_row8(row0 + 34u, col0, acc34);
    store_row8(row0 + 35u, col0, acc35);
    store_row8(row0 + 36u, col0, acc36);
    store_row8(row0 + 37u, col0, acc37);
    store_row8(row0 + 38u, col0, acc38);
    store_row8(row0 + 39u, col0, acc39);
    store_row8(row0 + 40u, col0, acc40);
    store_row8(row0 + 41u, col0, acc41);
    store_row8(row0 + 42u, col0, acc42);
    store_row8(row0 + 43u, col0, acc43);
    store_row8(row0 + 44u, col0, acc44);
    store_row8(row0 + 45u, col0, acc45);
    store_row8(row0 + 46u, col0, acc46);
    store_row8(row0 + 47u, col0, acc47);
    store_row8(row0 + 48u, col0, acc48);
    store_row8(row0 + 49u, col0, acc49);
    store_row8(row0 + 50u, col0, acc50);
    store_row8(row0 + 51u, col0, acc51);
    store_row8(row0 + 52u, col0, acc52);
    store_row8(row0 + 53u, col0, acc53);
    store_row8(row0 + 54u, col0, acc54);
    store_row8(row0 + 55u, col0, acc55);
    store_row8(row0 + 56u, col0, acc56);
    store_row8(row0 + 57u, col0, acc57);
    store_row8(row0 + 58u, col0, acc58);
    store_row8(row0 + 59u, col0, acc59);
    store_row8(row0 + 60u, col0, acc60);
    store_row8(row0 + 61u, col0, acc61);
    store_row8(row0 + 62u, col0, acc62);
    store_row8(row0 + 63u, col0, acc63);
}
