// The register-blocked kernel's block, shared by matmul.wgsl's
// matmul_forward_register (f32, or f16 widened by its load_a / load_b) and
// matmul_f16.wgsl's matmul_f16_forward (f16 read with SHADER_F16): the
// 32×16 block of C at (row0, col0) that one invocation owns (matmul.wgsl
// says why this layout). Element (row, kk) of op(A) is
// load_a(a_start + row * sa_row + kk * sa_k); element (kk, col) of op(B) is
// load_b(b_start + col * sb_col + kk * sb_k). Calls the composing family's
// `fn load_a(i: u32) -> f32`, `fn load_b(i: u32) -> f32` and its `p.m`,
// `p.n`, `p.k`, and stores through matmul_rows.wgsl's mm_store_row.
fn mm_register_block(row0: u32, col0: u32, sa_row: u32, sa_k: u32, sb_col: u32, sb_k: u32, a_start: u32, b_start: u32) {
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
    var oa = a_start;
    var ob = b_start;
    for (var kk = 0u; kk < p.k; kk++) {
        let bm = mat4x4<f32>(
            vec4<f32>(load_b(cb0 + ob), load_b(cb1 + ob), load_b(cb2 + ob), load_b(cb3 + ob)),
            vec4<f32>(load_b(cb4 + ob), load_b(cb5 + ob), load_b(cb6 + ob), load_b(cb7 + ob)),
            vec4<f32>(load_b(cb8 + ob), load_b(cb9 + ob), load_b(cb10 + ob), load_b(cb11 + ob)),
            vec4<f32>(load_b(cb12 + ob), load_b(cb13 + ob), load_b(cb14 + ob), load_b(cb15 + ob)),
        );
        acc0 = mm_row_fma(acc0, load_a(ra0 + oa), bm);
        acc1 = mm_row_fma(acc1, load_a(ra1 + oa), bm);
        acc2 = mm_row_fma(acc2, load_a(ra2 + oa), bm);
        acc3 = mm_row_fma(acc3, load_a(ra3 + oa), bm);
        acc4 = mm_row_fma(acc4, load_a(ra4 + oa), bm);
        acc5 = mm_row_fma(acc5, load_a(ra5 + oa), bm);
        acc6 = mm_row_fma(acc6, load_a(ra6 + oa), bm);
        acc7 = mm_row_fma(acc7, load_a(ra7 + oa), bm);
        acc8 = mm_row_fma(acc8, load_a(ra8 + oa), bm);
        acc9 = mm_row_fma(acc9, load_a(ra9 + oa), bm);
        acc10 = mm_row_fma(acc10, load_a(ra10 + oa), bm);
        acc11 = mm_row_fma(acc11, load_a(ra11 + oa), bm);
        acc12 = mm_row_fma(acc12, load_a(ra12 + oa), bm);
        acc13 = mm_row_fma(acc13, load_a(ra13 + oa), bm);
        acc14 = mm_row_fma(acc14, load_a(ra14 + oa), bm);
        acc15 = mm_row_fma(acc15, load_a(ra15 + oa), bm);
        acc16 = mm_row_fma(acc16, load_a(ra16 + oa), bm);
        acc17 = mm_row_fma(acc17, load_a(ra17 + oa), bm);
        acc18 = mm_row_fma(acc18, load_a(ra18 + oa), bm);
        acc19 = mm_row_fma(acc19, load_a(ra19 + oa), bm);
        acc20 = mm_row_fma(acc20, load_a(ra20 + oa), bm);
        acc21 = mm_row_fma(acc21, load_a(ra21 + oa), bm);
        acc22 = mm_row_fma(acc22, load_a(ra22 + oa), bm);
        acc23 = mm_row_fma(acc23, load_a(ra23 + oa), bm);
        acc24 = mm_row_fma(acc24, load_a(ra24 + oa), bm);
        acc25 = mm_row_fma(acc25, load_a(ra25 + oa), bm);
        acc26 = mm_row_fma(acc26, load_a(ra26 + oa), bm);
        acc27 = mm_row_fma(acc27, load_a(ra27 + oa), bm);
        acc28 = mm_row_fma(acc28, load_a(ra28 + oa), bm);
        acc29 = mm_row_fma(acc29, load_a(ra29 + oa), bm);
        acc30 = mm_row_fma(acc30, load_a(ra30 + oa), bm);
        acc31 = mm_row_fma(acc31, load_a(ra31 + oa), bm);
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
