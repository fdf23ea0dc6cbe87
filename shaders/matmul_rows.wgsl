// The tiled forward kernels' row helpers, shared by matmul.wgsl (and
// matmul_subgroup.wgsl, built on it), f16_weights.wgsl and matmul_f16.wgsl.
// The stores go through the composing family's epilogue,
// `fn write_c(row: u32, col: u32, product: f32)`, and mask rows and columns
// past its `p.m` and `p.n`.

// acc += x · (b_lo, b_hi): one row of 8 columns (the small kernels').
fn fma_row8(acc: mat2x4<f32>, x: f32, b_lo: vec4<f32>, b_hi: vec4<f32>) -> mat2x4<f32> {
    let s = vec4<f32>(x);
    return mat2x4<f32>(fma(s, b_lo, acc[0]), fma(s, b_hi, acc[1]));
}

// Stores row `row` of a block whose columns are col0 + 8·j, j in 0..7, held
// as acc[j / 4][j % 4] (the small kernel's; also matmul_subgroup.wgsl's).
// The loop runs over the columns inside C, a count the compiler cannot
// know, so it stays a loop: with the constant 8 Mesa unrolled it, and the
// 512 inlined epilogues of the 64-row kernels made lavapipe spend 1.2-1.8 s
// of NIR passes per pipeline at every start (Mesa's disk cache keeps only
// the LLVM work); as a loop, 0.3-0.6 s, and training steps no slower. The
// value comes through a select: acc[j / 4u] would index the matrix at run
// time, which spills it to memory (steps 25-30% slower on lavapipe).
fn store_row8(row: u32, col0: u32, acc: mat2x4<f32>) {
    if row >= p.m || col0 >= p.n {
        return;
    }
    let cols = min((p.n - col0 + 7u) / 8u, 8u);
    for (var j = 0u; j < cols; j++) {
        write_c(row, col0 + 8u * j, select(acc[0][j & 3u], acc[1][j & 3u], j >= 4u));
    }
}

// acc += x · bm: one row of 16 columns (the register-blocked kernels').
fn mm_row_fma(acc: mat4x4<f32>, x: f32, bm: mat4x4<f32>) -> mat4x4<f32> {
    let s = vec4<f32>(x);
    return mat4x4<f32>(fma(s, bm[0], acc[0]), fma(s, bm[1], acc[1]), fma(s, bm[2], acc[2]), fma(s, bm[3], acc[3]));
}

// Stores row `row` of an invocation's block: columns col0 + 4·j, j in 0..15,
// held as acc[j / 4][j % 4].
fn mm_store_row(row: u32, col0: u32, acc: mat4x4<f32>) {
    if row >= p.m {
        return;
    }
    for (var j = 0u; j < 16u; j++) {
        let col = col0 + 4u * j;
        if col < p.n {
            write_c(row, col, acc[j / 4u][j % 4u]);
        }
    }
}
