// f32 activations, block-quantized weights (ggml's Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, IQ4_NL and the k-quants Q2_K..Q6_K) decoded inside the kernels, f32 arithmetic: the generation kernels of a
// model whose weights stay quantized in GPU memory (a GGUF file's).
//   matvec_quant_forward:     C[M,N] = A[M,K] · B[N,K]ᵀ, M ≤ 4 (decode)
//   matmul_quant_forward:     the same for any M (a prompt's prefill)
//   embedding_quant_forward:  out[n,C] = table[ids[n], :]
//   matmul_quant_transposed:  C[M,N] = A[M,K] · B[K,N] (a frozen weight's
//                             backward, dX = dY·W)
// A, C, bias and pre are f32; B and the table are [rows, K] with K a
// multiple of 32, in blocks of 32 consecutive values of a row (block j of
// row r is block r·K/32 + j), laid out as ops::pack_quantized writes them:
// first every block's quantized values (quant_words() words each), then
// quant_side_words() words per block: the f16 scale d in the low half of
// the first and Q4_1's f16 minimum m in its high half, widened by bit
// operations (quant_unpack_f16x2), so these kernels need no device feature
// and run on every adapter; the other formats' side words are listed at
// quant_side_of (a k-quant super-block is 8 blocks here, each with its own
// side words).
//   Q8_0: word i of a block holds values 4i..4i+3, an i8 per byte from the
//         low byte up; value = q·d.
//   Q4_0, Q4_1: ggml's nibble order: byte i of the block (byte i % 4 of
//         word i / 4) holds value i in its low nibble and value 16 + i in
//         its high one; value = (q − 8)·d, or q·d + m.
//   Q5_0 .. Q6_K: nibbles as Q4_0's (the low 4 bits of each integer; the
//         fifth bits, or Q6_K's top two, are side words).
// The format is an override (a pipeline per format), so its branches fold
// away. ABt, and AB on matmul_quant_transposed only: a Linear layer's
// weight and the tied head are stored [out, in]. The epilogue is f16_weights.wgsl's (bias, activation, the
// pre-activation kept), on activations.wgsl.

override QUANT_FORMAT: u32 = 0u;
override HAS_BIAS: bool = false;
override ACTIVATION_FORWARD: bool = false;
override STORE_PRE: bool = false;
// The epilogue multiplies what C holds by the result (the second launch
// of a gated product where one launch cannot read both matrices).
override MULTIPLY_C: bool = false;
// matvec_quant_forward_columns as a gated product (SwiGLU's): C[M, N] =
// silu(A·Gᵀ) ⊙ (A·Uᵀ) for parts G and U of B, each [N, K]; a lane's 8
// accumulators are 4 columns of G and the same 4 of U.
override GATED: bool = false;

// QuantFormat::code.
const QUANT_Q8_0: u32 = 0u;
const QUANT_Q4_0: u32 = 1u;
const QUANT_Q4_1: u32 = 2u;
const QUANT_Q5_0: u32 = 3u;
const QUANT_Q5_1: u32 = 4u;
const QUANT_IQ4_NL: u32 = 5u;
const QUANT_Q2_K: u32 = 6u;
const QUANT_Q3_K: u32 = 7u;
const QUANT_Q4_K: u32 = 8u;
const QUANT_Q5_K: u32 = 9u;
const QUANT_Q6_K: u32 = 10u;

// Rows and columns of C per workgroup of matmul_quant_forward.
const QUANT_TILE: u32 = 64u;

struct QuantParams {
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
    // Where the launch's first block starts in its bindings: its quantized
    // words in qw's (in words), its scale word in qs's, and C (and pre) in
    // theirs, in f32 values. A part of a large operand is bound from the
    // nearest storage-offset-aligned word before it.
    q_base: u32,
    s_base: u32,
    c_base: u32,
    _pad0: u32,
    // The matrix-vector kernels' B as up to 4 matrices [n_i, K] side by
    // side (a product over q, k and v, or gate and up, in one launch):
    // part i gives columns part_end[i − 1] .. part_end[i] of the product
    // (from 0 for part 0; unused parts end where the last does), its row
    // r's block j being block part_q[i] + r·K/32 + j from q_base, its side
    // words from word part_s[i] + S·(r·K/32 + j) from s_base (S side
    // words a block). One matrix: (n, n, n, n), zeros.
    part_end: vec4<u32>,
    part_q: vec4<u32>,
    part_s: vec4<u32>,
}

@group(0) @binding(0) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> qw: array<u32>;
// The matrix-vector kernel's view of the quantized words: a block of Q4
// in one load, of Q8_0 in two.
@group(0) @binding(1) var<storage, read> qw4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<uniform> p: QuantParams;
// Unused slots hold placeholders (`pre` one of its own: a writable slot
// cannot share the read-only placeholder) and are never touched.
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> pre: array<f32>;

// Words of one block's quantized values.
fn quant_words() -> u32 {
    return select(4u, 8u, QUANT_FORMAT == QUANT_Q8_0);
}

// The word of a block holding its values 4g..4g+3 (g in 0..7).
fn quant_word_of(g: u32) -> u32 {
    return select(g % 4u, g, QUANT_FORMAT == QUANT_Q8_0);
}

// The integers of values 4g..4g+3 of a block, from the word holding them,
// as f32 (exact): Q8_0's i8s, or Q4's nibbles (unsigned, before the − 8).
fn quant_ints(word: u32, g: u32) -> vec4<f32> {
    if QUANT_FORMAT == QUANT_Q8_0 {
        // Each byte to the top, then an arithmetic shift back: sign-extended.
        return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(word) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
    }
    let shift = vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(4u * (g / 4u));
    return vec4<f32>((vec4<u32>(word) >> shift) & vec4<u32>(15u));
}

// Values 4g..4g+3 from their integers (quant_group_ints) and the block's
// side.
fn quant_values(q: vec4<f32>, side: QuantSide, g: u32) -> vec4<f32> {
    if !quant_legacy() {
        let half = g >= 4u;
        let d = select(side.scale.x, side.scale.y, half);
        let m = select(side.scale.z, side.scale.w, half);
        return fma(q, vec4<f32>(d), vec4<f32>(m));
    }
    let dm = side.scale.xz;
    if QUANT_FORMAT == QUANT_Q4_1 {
        return fma(q, vec4<f32>(dm.x), vec4<f32>(dm.y));
    }
    if QUANT_FORMAT == QUANT_Q4_0 {
        return (q - vec4<f32>(8.0)) * dm.x;
    }
    return q * dm.x;
}

// The epilogue: C[row, col] (of this launch) = act(product + bias); named
// as matmul.wgsl's, for matvec_row and store_row8.
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
    if MULTIPLY_C {
        v *= c[i];
    }
    c[i] = v;
}

// Block `block`'s 32 integers (counted in blocks from q_base), in 8 vec4s
// of values 4g..4g+3, from one (Q4) or two (Q8_0) 16-byte loads; with
// `scaled`, as quant_scaled_ints gives them (the columns kernel's).
fn quant_block_ints(block: u32, hi: vec2<u32>, scaled: bool) -> array<vec4<f32>, 8> {
    if !quant_legacy() {
        let w = qw4[p.q_base / 4u + block];
        return array<vec4<f32>, 8>(
            quant_ints_new(w.x, 0u, hi), quant_ints_new(w.y, 1u, hi),
            quant_ints_new(w.z, 2u, hi), quant_ints_new(w.w, 3u, hi),
            quant_ints_new(w.x, 4u, hi), quant_ints_new(w.y, 5u, hi),
            quant_ints_new(w.z, 6u, hi), quant_ints_new(w.w, 7u, hi),
        );
    }
    if QUANT_FORMAT == QUANT_Q8_0 {
        let w0 = qw4[p.q_base / 4u + 2u * block];
        let w1 = qw4[p.q_base / 4u + 2u * block + 1u];
        return array<vec4<f32>, 8>(
            quant_word_ints(w0.x, 0u, scaled), quant_word_ints(w0.y, 1u, scaled), quant_word_ints(w0.z, 2u, scaled), quant_word_ints(w0.w, 3u, scaled),
            quant_word_ints(w1.x, 4u, scaled), quant_word_ints(w1.y, 5u, scaled), quant_word_ints(w1.z, 6u, scaled), quant_word_ints(w1.w, 7u, scaled),
        );
    }
    let w = qw4[p.q_base / 4u + block];
    return array<vec4<f32>, 8>(
        quant_word_ints(w.x, 0u, scaled), quant_word_ints(w.y, 1u, scaled), quant_word_ints(w.z, 2u, scaled), quant_word_ints(w.w, 3u, scaled),
        quant_word_ints(w.x, 4u, scaled), quant_word_ints(w.y, 5u, scaled), quant_word_ints(w.z, 6u, scaled), quant_word_ints(w.w, 7u, scaled),
    );
}

// quant_ints, or quant_scaled_ints with `scaled` (a constant at every
// call: the branch folds away).
fn quant_word_ints(word: u32, g: u32, scaled: bool) -> vec4<f32> {
    if scaled {
        return quant_scaled_ints(word, g);
    }
    return quant_ints(word, g);
}

// 32 values of a row of A from vec4 index `i`.
fn quant_a_block(i: u32) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(a4[i], a4[i + 1u], a4[i + 2u], a4[i + 3u], a4[i + 4u], a4[i + 5u], a4[i + 6u], a4[i + 7u]);
}

// acc plus one block's products with a row's 32 values x (xs: their sums
// Σ_g x[g], for the formats with an offset; xs_lo: those of values 0..15,
// for Q2_K): the scale (and minimum) is applied once to the sum of the
// integers' products, not per weight, d·Σ q·x (− 8·d·Σ x, or + m·Σ x),
// per 16-value half where the halves' scales differ.
fn quant_block_fma(
    acc: vec4<f32>,
    q: array<vec4<f32>, 8>,
    side: QuantSide,
    x: array<vec4<f32>, 8>,
    xs: vec4<f32>,
    xs_lo: vec4<f32>,
) -> vec4<f32> {
    if !quant_legacy() {
        return quant_block_fma_new(acc, q, side, x, xs, xs_lo);
    }
    let dm = side.scale.xz;
    let t = quant_block_products(q, x);
    if QUANT_FORMAT == QUANT_Q4_1 {
        return fma(vec4<f32>(dm.x), t, fma(vec4<f32>(dm.y), xs, acc));
    }
    if QUANT_FORMAT == QUANT_Q4_0 {
        return fma(vec4<f32>(dm.x), fma(vec4<f32>(-8.0), xs, t), acc);
    }
    return fma(vec4<f32>(dm.x), t, acc);
}

// Σ_g q[g]·x[g], four partial sums.
fn quant_block_products(q: array<vec4<f32>, 8>, x: array<vec4<f32>, 8>) -> vec4<f32> {
    var t = q[0] * x[0];
    t = fma(q[1], x[1], t);
    t = fma(q[2], x[2], t);
    t = fma(q[3], x[3], t);
    t = fma(q[4], x[4], t);
    t = fma(q[5], x[5], t);
    t = fma(q[6], x[6], t);
    t = fma(q[7], x[7], t);
    return t;
}

fn quant_block_sum(x: array<vec4<f32>, 8>) -> vec4<f32> {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// unpack2x16float's result by bit operations, exact for every f16
// (subnormals included; inf and NaN stay so). unpack2x16float is core
// WGSL, but wgpu allows it only with DownlevelFlags::SHADER_F16_IN_F32,
// which lavapipe withholds without SHADER_F16; this costs a few integer
// operations per block.
fn quant_unpack_f16x2(word: u32) -> vec2<f32> {
    let h = vec2<u32>(word & 0xffffu, word >> 16u);
    let sign = (h & vec2<u32>(0x8000u)) << vec2<u32>(16u);
    let e = (h >> vec2<u32>(10u)) & vec2<u32>(0x1fu);
    let mant = h & vec2<u32>(0x3ffu);
    // Normal: the exponent rebiased (15 to 127); inf and NaN: all ones.
    let e32 = select(e + vec2<u32>(112u), vec2<u32>(255u), e == vec2<u32>(31u));
    let normal = bitcast<vec2<f32>>(sign | (e32 << vec2<u32>(23u)) | (mant << vec2<u32>(13u)));
    // Zero and subnormal: mant · 2^-24, exact in f32.
    let tiny = bitcast<vec2<f32>>(sign | bitcast<vec2<u32>>(vec2<f32>(mant) * 0x1p-24f));
    return select(normal, tiny, e == vec2<u32>(0u));
}

// Whether the format is one of the first three (Q8_0, Q4_0, Q4_1), whose
// kernels keep their own arithmetic (pre-scaled integers, − 8 folded).
fn quant_legacy() -> bool {
    return QUANT_FORMAT <= QUANT_Q4_1;
}

// Side words per block (QuantFormat::side_words).
fn quant_side_words() -> u32 {
    if QUANT_FORMAT == QUANT_Q5_K || QUANT_FORMAT == QUANT_Q6_K {
        return 3u;
    }
    let two = QUANT_FORMAT == QUANT_Q5_0 || QUANT_FORMAT == QUANT_Q5_1;
    if two || QUANT_FORMAT == QUANT_Q2_K || QUANT_FORMAT == QUANT_Q4_K {
        return 2u;
    }
    return 1u;
}

// A block's scales and high bits. For the formats after Q4_1, value =
// q·d + m with (d, m) = (scale.x, scale.z) for values 0..15 and (scale.y,
// scale.w) for 16..31, q the signed integer of quant_ints_new; for the
// first three, scale.xz is the block's (d, m) as their kernels use it.
// hi: the fifth bits (x, bit i: value i), or Q6_K's top two bits (value
// i's at bit 2·(i % 16) of x for i < 16, of y after).
struct QuantSide {
    scale: vec4<f32>,
    hi: vec2<u32>,
}

// A block's side words (ops::pack_quantized's), decoded:
//   Q8_0, Q4_0, IQ4_NL: d | 0; Q4_1: d | m << 16 (f16 halves).
//   Q5_0: d, fifth bits; Q5_1: d | m << 16, fifth bits.
//   Q4_K: d | dmin << 16, s | m << 8 (6-bit); Q5_K: those, fifth bits.
//   Q6_K: d | s0 << 16 | s1 << 24 (i8 scales of the halves), 2 words of
//         top bits.
//   Q2_K: d | dmin << 16, s0 | m0 << 4 | s1 << 8 | m1 << 12 (4-bit).
//   Q3_K: d | s0 << 16 | s1 << 24 (6-bit, value s − 32).
fn quant_side_of(w: vec3<u32>) -> QuantSide {
    let f = quant_unpack_f16x2(w.x);
    if QUANT_FORMAT == QUANT_Q4_K || QUANT_FORMAT == QUANT_Q5_K {
        let d = f.x * f32(w.y & 63u);
        let m = -(f.y * f32((w.y >> 8u) & 63u));
        return QuantSide(vec4<f32>(d, d, m, m), vec2<u32>(w.z, 0u));
    }
    if QUANT_FORMAT == QUANT_Q6_K {
        let s = vec2<f32>(vec2<i32>(bitcast<i32>(w.x << 8u), bitcast<i32>(w.x)) >> vec2<u32>(24u));
        return QuantSide(vec4<f32>(f.x * s.x, f.x * s.y, 0.0, 0.0), w.yz);
    }
    if QUANT_FORMAT == QUANT_Q2_K {
        let b = (vec4<u32>(w.y) >> vec4<u32>(0u, 8u, 4u, 12u)) & vec4<u32>(15u);
        return QuantSide(vec4<f32>(f.x, f.x, -f.y, -f.y) * vec4<f32>(b), vec2<u32>(0u));
    }
    if QUANT_FORMAT == QUANT_Q3_K {
        let s = vec2<f32>(vec2<i32>((vec2<u32>(w.x) >> vec2<u32>(16u, 24u)) & vec2<u32>(63u)) - vec2<i32>(32));
        return QuantSide(vec4<f32>(f.x * s.x, f.x * s.y, 0.0, 0.0), vec2<u32>(0u));
    }
    // Q5_0, Q5_1 (their fifth bits in the second word) and the first
    // three formats and IQ4_NL (whose minimum half is zero but Q4_1's).
    return QuantSide(vec4<f32>(f.x, f.x, f.y, f.y), vec2<u32>(w.y, 0u));
}

// IQ4_NL's 16 i8 levels (ggml's kvalues_iq4nl), 4 per word.
const QUANT_IQ4_NL_LEVELS: vec4<u32> = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);

fn quant_iq4_nl(nib: vec4<u32>) -> vec4<f32> {
    let odd = (nib & vec4<u32>(4u)) != vec4<u32>(0u);
    let low = select(vec4<u32>(QUANT_IQ4_NL_LEVELS.x), vec4<u32>(QUANT_IQ4_NL_LEVELS.y), odd);
    let high = select(vec4<u32>(QUANT_IQ4_NL_LEVELS.z), vec4<u32>(QUANT_IQ4_NL_LEVELS.w), odd);
    let word = select(low, high, nib >= vec4<u32>(8u));
    // The byte to the top, then an arithmetic shift back: sign-extended.
    let top = word << (vec4<u32>(24u) - vec4<u32>(8u) * (nib & vec4<u32>(3u)));
    return vec4<f32>(bitcast<vec4<i32>>(top) >> vec4<u32>(24u));
}

// The signed integers of values 4g..4g+3 of a block of a format after
// Q4_1, from the nibble word holding them and the block's high bits.
fn quant_ints_new(word: u32, g: u32, hi: vec2<u32>) -> vec4<f32> {
    let nib = (vec4<u32>(word) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(4u * (g / 4u)))) & vec4<u32>(15u);
    let v = vec4<u32>(4u * g) + vec4<u32>(0u, 1u, 2u, 3u);
    if QUANT_FORMAT == QUANT_Q5_0 || QUANT_FORMAT == QUANT_Q5_1 || QUANT_FORMAT == QUANT_Q5_K {
        let q = vec4<f32>(nib | (((vec4<u32>(hi.x) >> v) & vec4<u32>(1u)) << vec4<u32>(4u)));
        return select(q, q - vec4<f32>(16.0), QUANT_FORMAT == QUANT_Q5_0);
    }
    if QUANT_FORMAT == QUANT_Q6_K {
        let top = (vec4<u32>(select(hi.x, hi.y, g >= 4u)) >> (vec4<u32>(2u) * (v % vec4<u32>(16u)))) & vec4<u32>(3u);
        return vec4<f32>(nib | (top << vec4<u32>(4u))) - vec4<f32>(32.0);
    }
    if QUANT_FORMAT == QUANT_Q3_K {
        return vec4<f32>(nib) - vec4<f32>(4.0);
    }
    if QUANT_FORMAT == QUANT_IQ4_NL {
        return quant_iq4_nl(nib);
    }
    // Q4_K, Q2_K: the nibble as it is.
    return vec4<f32>(nib);
}

// quant_ints (the first three formats) or quant_ints_new.
fn quant_group_ints(word: u32, g: u32, hi: vec2<u32>) -> vec4<f32> {
    if quant_legacy() {
        return quant_ints(word, g);
    }
    return quant_ints_new(word, g, hi);
}

// Σ of values 0..15 of a row's block, four partial sums.
fn quant_half_sum(x: array<vec4<f32>, 8>) -> vec4<f32> {
    return (x[0] + x[1]) + (x[2] + x[3]);
}

// quant_block_fma for the formats after Q4_1: d per 16-value half times
// its products, plus the minimum times Σ x (per half for Q2_K).
fn quant_block_fma_new(
    acc: vec4<f32>,
    q: array<vec4<f32>, 8>,
    side: QuantSide,
    x: array<vec4<f32>, 8>,
    xs: vec4<f32>,
    xs_lo: vec4<f32>,
) -> vec4<f32> {
    var lo = q[0] * x[0];
    lo = fma(q[1], x[1], lo);
    lo = fma(q[2], x[2], lo);
    lo = fma(q[3], x[3], lo);
    var hi = q[4] * x[4];
    hi = fma(q[5], x[5], hi);
    hi = fma(q[6], x[6], hi);
    hi = fma(q[7], x[7], hi);
    var r = fma(vec4<f32>(side.scale.x), lo, fma(vec4<f32>(side.scale.y), hi, acc));
    if QUANT_FORMAT == QUANT_Q5_1 || QUANT_FORMAT == QUANT_Q4_K || QUANT_FORMAT == QUANT_Q5_K {
        r = fma(vec4<f32>(side.scale.z), xs, r);
    }
    if QUANT_FORMAT == QUANT_Q2_K {
        r = fma(vec4<f32>(side.scale.z), xs_lo, fma(vec4<f32>(side.scale.w), xs - xs_lo, r));
    }
    return r;
}

// Block `block`'s side words, decoded.
fn quant_side(block: u32) -> QuantSide {
    return quant_side_at(quant_side_words() * block);
}

// The side words from word `word` on (counted from s_base), decoded.
fn quant_side_at(word: u32) -> QuantSide {
    let at = p.s_base + word;
    var w = vec3<u32>(qs[at], 0u, 0u);
    if quant_side_words() > 1u {
        w.y = qs[at + 1u];
    }
    if quant_side_words() > 2u {
        w.z = qs[at + 2u];
    }
    return quant_side_of(w);
}

// Block j of each row of A (rows past M repeat row 0 and are never
// stored; ra: each row's first vec4) and each block's Σ x: what one step
// of the matrix-vector kernels multiplies every column's block by.
struct QuantRowsA {
    x0: array<vec4<f32>, 8>,
    x1: array<vec4<f32>, 8>,
    x2: array<vec4<f32>, 8>,
    x3: array<vec4<f32>, 8>,
    // Column r: row r's sums; s_lo: those of values 0..15 (Q2_K's, whose
    // halves have their own minimum; zero for the other formats).
    s: mat4x4<f32>,
    s_lo: mat4x4<f32>,
}

// QuantRowsA of 4 rows' blocks.
fn quant_rows_a_of(
    x0: array<vec4<f32>, 8>,
    x1: array<vec4<f32>, 8>,
    x2: array<vec4<f32>, 8>,
    x3: array<vec4<f32>, 8>,
) -> QuantRowsA {
    let s = mat4x4<f32>(quant_block_sum(x0), quant_block_sum(x1), quant_block_sum(x2), quant_block_sum(x3));
    var s_lo = mat4x4<f32>();
    if QUANT_FORMAT == QUANT_Q2_K {
        s_lo = mat4x4<f32>(quant_half_sum(x0), quant_half_sum(x1), quant_half_sum(x2), quant_half_sum(x3));
    }
    return QuantRowsA(x0, x1, x2, x3, s, s_lo);
}

fn quant_rows_a(ra: vec4<u32>, j: u32) -> QuantRowsA {
    let x0 = quant_a_block(ra.x + 8u * j);
    var x1 = x0;
    var x2 = x0;
    var x3 = x0;
    if MATVEC_ROWS > 1u {
        x1 = quant_a_block(ra.y + 8u * j);
    }
    if MATVEC_ROWS > 2u {
        x2 = quant_a_block(ra.z + 8u * j);
    }
    if MATVEC_ROWS > 3u {
        x3 = quant_a_block(ra.w + 8u * j);
    }
    return quant_rows_a_of(x0, x1, x2, x3);
}

// acc (column r: row r's partial sums of one column of C) plus block
// `block` of that column of B against each row's block of A.
fn quant_column_fma(acc: mat4x4<f32>, block: vec2<u32>, a: QuantRowsA) -> mat4x4<f32> {
    let side = quant_side_at(block.y);
    let q = quant_block_ints(block.x, side.hi, false);
    var next = acc;
    next[0] = quant_block_fma(acc[0], q, side, a.x0, a.s[0], a.s_lo[0]);
    if MATVEC_ROWS > 1u {
        next[1] = quant_block_fma(acc[1], q, side, a.x1, a.s[1], a.s_lo[1]);
    }
    if MATVEC_ROWS > 2u {
        next[2] = quant_block_fma(acc[2], q, side, a.x2, a.s[2], a.s_lo[2]);
    }
    if MATVEC_ROWS > 3u {
        next[3] = quant_block_fma(acc[3], q, side, a.x3, a.s[3], a.s_lo[3]);
    }
    return next;
}

// Virtual column v's block 0: its quantized block index and its first
// side word (from s_base): its part's row v − part start (see
// QuantParams' parts). Block j of the column is j blocks and
// quant_side_words()·j side words on (quant_block_step).
fn quant_column_blocks(v: u32, kb: u32) -> vec2<u32> {
    let part = u32(v >= p.part_end.x) + u32(v >= p.part_end.y) + u32(v >= p.part_end.z);
    var first = 0u;
    if part > 0u {
        first = p.part_end[part - 1u];
    }
    let row = (v - first) * kb;
    return vec2<u32>(p.part_q[part] + row, p.part_s[part] + quant_side_words() * row);
}

// What quant_column_blocks' result moves by over j blocks.
fn quant_block_step(j: u32) -> vec2<u32> {
    return vec2<u32>(j, quant_side_words() * j);
}

// The matrix-vector kernels' loop: element c of the result holds the
// partial sums of virtual column (lo, hi)[c] (clamped by the caller: read,
// never stored) over blocks j0, j0 + j_step, … of k, its column r row r's
// (rows past the launch's `rows` repeat its last: read, never stored).
// The 8 accumulators are unrolled by hand: a private array indexed in a
// loop becomes per-lane memory on llvmpipe.
fn quant_matvec_sums(lo: vec4<u32>, hi: vec4<u32>, j0: u32, j_step: u32, k: u32, rows: u32) -> array<mat4x4<f32>, 8> {
    let kb = k / 32u;
    let cb0 = quant_column_blocks(lo.x, kb);
    let cb1 = quant_column_blocks(lo.y, kb);
    let cb2 = quant_column_blocks(lo.z, kb);
    let cb3 = quant_column_blocks(lo.w, kb);
    let cb4 = quant_column_blocks(hi.x, kb);
    let cb5 = quant_column_blocks(hi.y, kb);
    let cb6 = quant_column_blocks(hi.z, kb);
    let cb7 = quant_column_blocks(hi.w, kb);
    let ra = min(vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(rows - 1u)) * (k / 4u);
    var acc0 = mat4x4<f32>();
    var acc1 = mat4x4<f32>();
    var acc2 = mat4x4<f32>();
    var acc3 = mat4x4<f32>();
    var acc4 = mat4x4<f32>();
    var acc5 = mat4x4<f32>();
    var acc6 = mat4x4<f32>();
    var acc7 = mat4x4<f32>();
    for (var j = j0; j < kb; j += j_step) {
        let a = quant_rows_a(ra, j);
        let step = quant_block_step(j);
        acc0 = quant_column_fma(acc0, cb0 + step, a);
        acc1 = quant_column_fma(acc1, cb1 + step, a);
        acc2 = quant_column_fma(acc2, cb2 + step, a);
        acc3 = quant_column_fma(acc3, cb3 + step, a);
        acc4 = quant_column_fma(acc4, cb4 + step, a);
        acc5 = quant_column_fma(acc5, cb5 + step, a);
        acc6 = quant_column_fma(acc6, cb6 + step, a);
        acc7 = quant_column_fma(acc7, cb7 + step, a);
    }
    return array<mat4x4<f32>, 8>(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7);
}

// Row r of quant_matvec_sums' result: the 8 columns' sums.
fn quant_row_sums(sums: array<mat4x4<f32>, 8>, r: u32) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(sums[0][r], sums[1][r], sums[2][r], sums[3][r], sums[4][r], sums[5][r], sums[6][r], sums[7][r]);
}

// Decode's products: M ≤ 4 rows (one new token per sequence), A and the
// quantized words bound 16-byte aligned (the Rust side checks, and picks
// matmul_quant_forward otherwise). matmul.wgsl's matmul_forward_matvec
// with B read a block at a time: a workgroup of MATVEC_WG lanes owns
// MATVEC_COLS columns of C; lane l takes blocks l, l + MATVEC_WG, … of its
// columns' rows of B against the same of each row of A (so a step reads
// 16 or 32 bytes of weights and one scale word per column: lavapipe issues
// storage loads lane by lane, so a step costs what its loads do); a fixed
// tree over the lanes in workgroup memory sums them, and lane c stores
// column c. A bucket of rows (the launch's at run time) and lanes are
// overrides, as for the f32 kernel.
// MATVEC_ROWS, MATVEC_WG,
// MATVEC_COLS, matvec_sizes and the lane reduction are matvec.wgsl's.
@compute @workgroup_size(MATVEC_WG, 1, 1)
fn matvec_quant_forward(
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
    let col0 = (wid.y * nwg.x + wid.x) * MATVEC_COLS;
    if col0 >= n {
        return;
    }
    let lane = lid.x;
    let cols = min(vec4<u32>(col0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(n - 1u));
    let cols_hi = min(vec4<u32>(col0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(n - 1u));
    let sums = quant_matvec_sums(cols, cols_hi, lane, MATVEC_WG, sizes.y, sizes.z);
    // A constant bound (unrolled, so each row's sums are indexed by a
    // constant) and the launch's rows as a guard.
    for (var r = 0u; r < MATVEC_ROWS; r++) {
        if r < sizes.z {
            matvec_row(lane, col0, n, r, quant_row_sums(sums, r));
        }
    }
}

// Decode's products on a CPU adapter (llvmpipe runs a workgroup's lanes
// as the lanes of one SIMD row, and issues a storage load lane by lane).
// matvec_quant_forward splits k over the lanes, so each lane loads its own
// blocks of A and a sum over the lanes follows; here the workgroup's 8
// lanes own 128 columns of C, lane l the columns col0 + l + 8·c (c in
// 0..15), and each lane sums all of k: a step loads one block of each row
// of A for 16 blocks of weights (A's f32 block is 128 bytes to a Q4
// block's 20: with a lane per column, loading A for each block of
// weights ran at a third of this speed). No workgroup memory, no barrier.
// What a lane keeps across steps is one f32 per (row, column): each
// block's 32 products are summed within the step, so 16 columns fit
// where 8 columns of vec4 partial sums spilled (SoA: a vec4 is 4
// registers per lane group). On lavapipe (this kernel against the one
// with 8 columns of vec4 sums, process CPU time per launch, interleaved
// rounds, load ~10): the Q8_0 head 49152×576 18.6 → 16.7 ms, SmolLM2's
// gated 2×1536×576 0.80 → 0.73, its Q4_1 products of 576 and 960
// columns within 5%. Storage loads, not arithmetic, bound it: lavapipe
// loads lane by lane, ~2.2 ns per load and lane plus ~1.1 per word.
@compute @workgroup_size(8, 1, 1)
fn matvec_quant_forward_columns(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    if lid.x == 0u {
        matvec_sizes = vec3<u32>(p.n, p.k, p.m);
    }
    let sizes = workgroupUniformLoad(&matvec_sizes);
    let n = sizes.x;
    let last = vec4<u32>(n - 1u);
    let steps = vec4<u32>(0u, 8u, 16u, 24u);
    if GATED {
        // Output columns col0 + 8c (c in 0..7): G's rows in accumulators
        // 0..7, U's (virtual columns n and on) in 8..15.
        let col0 = (wid.y * nwg.x + wid.x) * QUANT_GATED_COLUMNS_PER_GROUP + lid.x;
        if col0 >= n {
            return;
        }
        let g_lo = min(vec4<u32>(col0) + steps, last);
        let g_hi = min(vec4<u32>(col0 + 32u) + steps, last);
        let sums = quant_columns_sums(array<vec4<u32>, 4>(g_lo, g_hi, g_lo + vec4<u32>(n), g_hi + vec4<u32>(n)), sizes.y, sizes.z);
        for (var c = 0u; c < 8u; c++) {
            let col = col0 + 8u * c;
            if col < n {
                for (var r = 0u; r < MATVEC_ROWS; r++) {
                    if r < sizes.z {
                        c_gated(r, col, activation_forward(ACT_SILU, sums[c][r]) * sums[c + 8u][r]);
                    }
                }
            }
        }
        return;
    }
    let col0 = (wid.y * nwg.x + wid.x) * QUANT_COLUMNS_PER_GROUP + lid.x;
    if col0 >= n {
        return;
    }
    var cols: array<vec4<u32>, 4>;
    for (var q = 0u; q < 4u; q++) {
        cols[q] = min(vec4<u32>(col0 + 32u * q) + steps, last);
    }
    let sums = quant_columns_sums(cols, sizes.y, sizes.z);
    for (var c = 0u; c < 16u; c++) {
        let col = col0 + 8u * c;
        if col < n {
            // A constant bound, as matvec_quant_forward's (a row index
            // known at compile time keeps the sums in registers).
            for (var r = 0u; r < MATVEC_ROWS; r++) {
                if r < sizes.z {
                    write_c(r, col, sums[c][r]);
                }
            }
        }
    }
}

// Output columns per workgroup of the gated matvec_quant_forward_columns:
// 8 per lane.
const QUANT_GATED_COLUMNS_PER_GROUP: u32 = 64u;

// A gated product's C[row, col] (no bias, no activation of its own).
fn c_gated(row: u32, col: u32, v: f32) {
    c[p.c_base + row * p.ldc + col] = v;
}

// Columns of C per workgroup of matvec_quant_forward_columns: 16 per lane.
const QUANT_COLUMNS_PER_GROUP: u32 = 128u;

// The columns kernel reads a block's integers already multiplied by a
// power of two per component, and A's values divided by it, so that the
// products are the same and the decoding costs fewer operations: a Q4
// nibble is masked in place (value 4g + i lies at bit 8i of word g, or
// of word g − 4 shifted right by 4: q·2^(8i)), a Q8_0 byte moved to the
// top and the rest cleared (q·2^24). Both are exact in f32 (at most 8
// significant bits), and so is dividing A by a power of two short of f32's
// smallest normals (|x| below 2^-102 may lose bits: nothing a product of
// weights of order one notices).
const QUANT_NIBBLE_MASKS: vec4<u32> = vec4<u32>(0xfu, 0xf00u, 0xf0000u, 0xf000000u);
const QUANT_NIBBLE_UNSCALE: vec4<f32> = vec4<f32>(1.0, 0x1p-8f, 0x1p-16f, 0x1p-24f);
const QUANT_BYTE_TO_TOP: vec4<u32> = vec4<u32>(24u, 16u, 8u, 0u);

fn quant_scaled_ints(word: u32, g: u32) -> vec4<f32> {
    if QUANT_FORMAT == QUANT_Q8_0 {
        return vec4<f32>(bitcast<vec4<i32>>((vec4<u32>(word) << QUANT_BYTE_TO_TOP) & vec4<u32>(0xff000000u)));
    }
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(4u * (g / 4u))) & QUANT_NIBBLE_MASKS);
}

// A block of A divided as the integers it meets are multiplied.
fn quant_unscale_a(x: array<vec4<f32>, 8>) -> array<vec4<f32>, 8> {
    // The other formats' integers are not pre-scaled (quant_block_ints).
    if !quant_legacy() {
        return x;
    }
    var unscale = QUANT_NIBBLE_UNSCALE;
    if QUANT_FORMAT == QUANT_Q8_0 {
        unscale = vec4<f32>(0x1p-24f);
    }
    return array<vec4<f32>, 8>(x[0] * unscale, x[1] * unscale, x[2] * unscale, x[3] * unscale, x[4] * unscale, x[5] * unscale, x[6] * unscale, x[7] * unscale);
}

// Block j of each row of A for the columns kernel (quant_rows_a's),
// divided as quant_unscale_a does; the sums stay those of the values.
fn quant_columns_a(ra: vec4<u32>, j: u32) -> QuantRowsA {
    let a = quant_rows_a(ra, j);
    let x0 = quant_unscale_a(a.x0);
    let x1 = quant_unscale_a(a.x1);
    return QuantRowsA(x0, x1, quant_unscale_a(a.x2), quant_unscale_a(a.x3), a.s, a.s_lo);
}

// Σ q·x over one block (scaled integers, unscaled A).
fn quant_block_dot(q: array<vec4<f32>, 8>, x: array<vec4<f32>, 8>) -> f32 {
    let t = quant_block_products(q, x);
    return (t.x + t.y) + (t.z + t.w);
}

// acc (component r: row r's sum of one column of C) plus block `block`
// of that column of B against each row's block of A: d·Σ q·x, and
// + m·Σ x (Q4_1) or − 8·d·Σ x (Q4_0).
fn quant_column_step(acc: vec4<f32>, block: vec2<u32>, a: QuantRowsA) -> vec4<f32> {
    let side = quant_side_at(block.y);
    let q = quant_block_ints(block.x, side.hi, true);
    if !quant_legacy() {
        return acc + quant_rows4_dot(q, side, a, 0u);
    }
    let dm = side.scale.xz;
    // Each row's Σ x (the same for every column: computed once a step).
    let ones = vec4<f32>(1.0);
    let xs = vec4<f32>(dot(a.s[0], ones), dot(a.s[1], ones), dot(a.s[2], ones), dot(a.s[3], ones));
    var t = vec4<f32>(quant_block_dot(q, a.x0), 0.0, 0.0, 0.0);
    if MATVEC_ROWS > 1u {
        t.y = quant_block_dot(q, a.x1);
    }
    if MATVEC_ROWS > 2u {
        t.z = quant_block_dot(q, a.x2);
    }
    if MATVEC_ROWS > 3u {
        t.w = quant_block_dot(q, a.x3);
    }
    if QUANT_FORMAT == QUANT_Q4_1 {
        return fma(vec4<f32>(dm.x), t, fma(vec4<f32>(dm.y), xs, acc));
    }
    if QUANT_FORMAT == QUANT_Q4_0 {
        return fma(vec4<f32>(dm.x), fma(vec4<f32>(-8.0), xs, t), acc);
    }
    return fma(vec4<f32>(dm.x), t, acc);
}

// The columns kernel's loop: element c of the result holds, in component
// r, row r's sum over all of k of virtual column v[c / 4][c % 4] (clamped
// by the caller: read, never stored). The 16 accumulators are unrolled by
// hand: a private array indexed in a loop becomes per-lane memory on
// llvmpipe. Rows past `rows` repeat its last (read, never stored).
fn quant_columns_sums(v: array<vec4<u32>, 4>, k: u32, rows: u32) -> array<vec4<f32>, 16> {
    let kb = k / 32u;
    let b0 = quant_column_blocks(v[0].x, kb);
    let b1 = quant_column_blocks(v[0].y, kb);
    let b2 = quant_column_blocks(v[0].z, kb);
    let b3 = quant_column_blocks(v[0].w, kb);
    let b4 = quant_column_blocks(v[1].x, kb);
    let b5 = quant_column_blocks(v[1].y, kb);
    let b6 = quant_column_blocks(v[1].z, kb);
    let b7 = quant_column_blocks(v[1].w, kb);
    let b8 = quant_column_blocks(v[2].x, kb);
    let b9 = quant_column_blocks(v[2].y, kb);
    let b10 = quant_column_blocks(v[2].z, kb);
    let b11 = quant_column_blocks(v[2].w, kb);
    let b12 = quant_column_blocks(v[3].x, kb);
    let b13 = quant_column_blocks(v[3].y, kb);
    let b14 = quant_column_blocks(v[3].z, kb);
    let b15 = quant_column_blocks(v[3].w, kb);
    let ra = min(vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(rows - 1u)) * (k / 4u);
    var acc0 = vec4<f32>();
    var acc1 = vec4<f32>();
    var acc2 = vec4<f32>();
    var acc3 = vec4<f32>();
    var acc4 = vec4<f32>();
    var acc5 = vec4<f32>();
    var acc6 = vec4<f32>();
    var acc7 = vec4<f32>();
    var acc8 = vec4<f32>();
    var acc9 = vec4<f32>();
    var acc10 = vec4<f32>();
    var acc11 = vec4<f32>();
    var acc12 = vec4<f32>();
    var acc13 = vec4<f32>();
    var acc14 = vec4<f32>();
    var acc15 = vec4<f32>();
    for (var j = 0u; j < kb; j++) {
        let a = quant_columns_a(ra, j);
        let step = quant_block_step(j);
        acc0 = quant_column_step(acc0, b0 + step, a);
        acc1 = quant_column_step(acc1, b1 + step, a);
        acc2 = quant_column_step(acc2, b2 + step, a);
        acc3 = quant_column_step(acc3, b3 + step, a);
        acc4 = quant_column_step(acc4, b4 + step, a);
        acc5 = quant_column_step(acc5, b5 + step, a);
        acc6 = quant_column_step(acc6, b6 + step, a);
        acc7 = quant_column_step(acc7, b7 + step, a);
        acc8 = quant_column_step(acc8, b8 + step, a);
        acc9 = quant_column_step(acc9, b9 + step, a);
        acc10 = quant_column_step(acc10, b10 + step, a);
        acc11 = quant_column_step(acc11, b11 + step, a);
        acc12 = quant_column_step(acc12, b12 + step, a);
        acc13 = quant_column_step(acc13, b13 + step, a);
        acc14 = quant_column_step(acc14, b14 + step, a);
        acc15 = quant_column_step(acc15, b15 + step, a);
    }
    return array<vec4<f32>, 16>(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15);
}

// Four steps of k (a vec4 xa of one row of A) times the weights of 8
// columns at those steps (lo: columns 0..3, hi: 4..7, column t of each
// holding step t): one row of the tiled kernel's block.
fn quant_row_fma(acc: mat2x4<f32>, xa: vec4<f32>, lo: mat4x4<f32>, hi: mat4x4<f32>) -> mat2x4<f32> {
    return fma_row8(fma_row8(fma_row8(fma_row8(acc, xa.x, lo[0], hi[0]), xa.y, lo[1], hi[1]), xa.z, lo[2], hi[2]), xa.w, lo[3], hi[3]);
}

// Values 4g..4g+3 of block `block` (its side given).
fn quant_group(block: u32, g: u32, side: QuantSide) -> vec4<f32> {
    let word = qw[p.q_base + block * quant_words() + quant_word_of(g)];
    return quant_values(quant_group_ints(word, g, side.hi), side, g);
}

// Any M (a prompt's prefill, or decode where the matrix-vector kernel
// cannot run), as f16_weights.wgsl's matmul_f16w_forward_small: a
// workgroup of 8×8 invocations computes one 64×64 tile of C, invocation
// (x, y) the 8×8 block of rows 8·y + 0..7 and columns x + 8·j, j in 0..7,
// in 8 mat2x4 accumulators. Per block of k it reads its 8 columns' scale
// words; per 4 steps of k, 8 words of weights (each decoded once for the
// 8 rows) and 8 vec4s of A, for 256 multiply-adds. Edges are clamped on
// load and masked on store (fma_row8, store_row8: matmul_rows.wgsl's).
// A is read in vec4s: A bound 16-byte aligned (the Rust side checks).
@compute @workgroup_size(8, 8, 1)
fn matmul_quant_forward(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * QUANT_TILE + lid.y * 8u;
    let col0 = (tile % p.tiles_n) * QUANT_TILE + lid.x;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    let kb = p.k / 32u;
    let k4 = p.k / 4u;
    let last_row = vec4<u32>(p.m - 1u);
    let last_col = vec4<u32>(p.n - 1u);
    // Rows' first vec4 of A; columns' first block.
    let ra_lo = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), last_row) * k4;
    let ra_hi = min(vec4<u32>(row0) + vec4<u32>(4u, 5u, 6u, 7u), last_row) * k4;
    let cb_lo = min(vec4<u32>(col0) + vec4<u32>(0u, 8u, 16u, 24u), last_col) * kb;
    let cb_hi = min(vec4<u32>(col0) + vec4<u32>(32u, 40u, 48u, 56u), last_col) * kb;
    // acc_i[j / 4][j % 4]: row row0 + i, column col0 + 8·j.
    var acc0 = mat2x4<f32>();
    var acc1 = mat2x4<f32>();
    var acc2 = mat2x4<f32>();
    var acc3 = mat2x4<f32>();
    var acc4 = mat2x4<f32>();
    var acc5 = mat2x4<f32>();
    var acc6 = mat2x4<f32>();
    var acc7 = mat2x4<f32>();
    for (var jb = 0u; jb < kb; jb++) {
        let bl = cb_lo + vec4<u32>(jb);
        let bh = cb_hi + vec4<u32>(jb);
        let dm0 = quant_side(bl.x);
        let dm1 = quant_side(bl.y);
        let dm2 = quant_side(bl.z);
        let dm3 = quant_side(bl.w);
        let dm4 = quant_side(bh.x);
        let dm5 = quant_side(bh.y);
        let dm6 = quant_side(bh.z);
        let dm7 = quant_side(bh.w);
        for (var g = 0u; g < 8u; g++) {
            // Column t of lo (hi): step 4·g + t of columns 0..3 (4..7).
            let lo = transpose(mat4x4<f32>(quant_group(bl.x, g, dm0), quant_group(bl.y, g, dm1), quant_group(bl.z, g, dm2), quant_group(bl.w, g, dm3)));
            let hi = transpose(mat4x4<f32>(quant_group(bh.x, g, dm4), quant_group(bh.y, g, dm5), quant_group(bh.z, g, dm6), quant_group(bh.w, g, dm7)));
            let s = 8u * jb + g;
            acc0 = quant_row_fma(acc0, a4[ra_lo.x + s], lo, hi);
            acc1 = quant_row_fma(acc1, a4[ra_lo.y + s], lo, hi);
            acc2 = quant_row_fma(acc2, a4[ra_lo.z + s], lo, hi);
            acc3 = quant_row_fma(acc3, a4[ra_lo.w + s], lo, hi);
            acc4 = quant_row_fma(acc4, a4[ra_hi.x + s], lo, hi);
            acc5 = quant_row_fma(acc5, a4[ra_hi.y + s], lo, hi);
            acc6 = quant_row_fma(acc6, a4[ra_hi.z + s], lo, hi);
            acc7 = quant_row_fma(acc7, a4[ra_hi.w + s], lo, hi);
        }
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

struct QuantEmbeddingParams {
    // Ids, channels, vocabulary.
    n: u32,
    cols: u32,
    vocab: u32,
    // The table rows this launch covers (a table too large for one binding
    // is looked up in several launches), and where row_start's first block
    // begins in the bindings: its quantized words in emb_qw's, its scale
    // word in emb_qs's.
    row_start: u32,
    row_end: u32,
    q_base: u32,
    s_base: u32,
    _pad0: u32,
}

@group(0) @binding(7) var<storage, read> emb_qw: array<u32>;
@group(0) @binding(8) var<storage, read> emb_qs: array<u32>;
@group(0) @binding(9) var<storage, read> emb_ids: array<u32>;
@group(0) @binding(10) var<storage, read_write> emb_out: array<f32>;
@group(0) @binding(11) var<uniform> ep: QuantEmbeddingParams;

// out[n, C] (f32) = table[ids[n], :] for a quantized table [V, C] and u32
// ids, one invocation per output element, as rowwise.wgsl's
// embedding_forward: an id ≥ V writes a row of NaN (no out-of-bounds read;
// the Rust side checks ids on the host where it has them), in the launch
// that covers the table's last rows.
@compute @workgroup_size(256, 1, 1)
fn embedding_quant_forward(
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
    let block = (id - ep.row_start) * (ep.cols / 32u) + col / 32u;
    let g = (col % 32u) / 4u;
    let word = emb_qw[ep.q_base + block * quant_words() + quant_word_of(g)];
    let at = ep.s_base + quant_side_words() * block;
    var w = vec3<u32>(emb_qs[at], 0u, 0u);
    if quant_side_words() > 1u {
        w.y = emb_qs[at + 1u];
    }
    if quant_side_words() > 2u {
        w.z = emb_qs[at + 2u];
    }
    let side = quant_side_of(w);
    emb_out[i] = quant_values(quant_group_ints(word, g, side.hi), side, g)[col % 4u];
}

// ---------------------------------------------------------------------
// matvec_quant_forward_rows: decode's products over 1 to 16 rows (a
// continuous batch's requests) on a CPU adapter. The columns kernel's
// layout (8 lanes, lane l the virtual columns col0 + l + 8·c, c in 0..7,
// each summing all of k; GATED as there), but each block of weights is
// decoded once per step and applied to every row, in groups of 4 rows
// (QuantRowsA), rather than once per launch of 4 rows. Nothing divergent
// comes before the k loop (columns are clamped, not returned from), so the
// loads of A, whose addresses are the same for every lane, are uniform
// loads: llvmpipe issues one load for the workgroup rather than one per
// lane. Each (column, row) sums a block's products before adding them to
// its scalar accumulator, so 8 columns × 16 rows fit 32 vec4s.
// MATVEC_ROWS (matvec.wgsl's override) is the bucket of rows, 2 or a
// multiple of 4 up to 16 (the Rust side's quant_rows_bucket): a pipeline per group
// count, the launch's rows (≤ MATVEC_ROWS) at run time. Rows of the last
// group past them repeat its last row on load and are never stored.

// Rows of A per group of matvec_quant_forward_rows.
const QUANT_ROW_GROUP: u32 = 4u;

// The lane's 8 columns' block j, decoded.
struct QuantColumns8 {
    q0: array<vec4<f32>, 8>,
    q1: array<vec4<f32>, 8>,
    q2: array<vec4<f32>, 8>,
    q3: array<vec4<f32>, 8>,
    q4: array<vec4<f32>, 8>,
    q5: array<vec4<f32>, 8>,
    q6: array<vec4<f32>, 8>,
    q7: array<vec4<f32>, 8>,
    side: array<QuantSide, 8>,
}

// Element c: column c's 4 rows of a group (row 4·group + i in element i).
struct QuantRowSums {
    c0: vec4<f32>,
    c1: vec4<f32>,
    c2: vec4<f32>,
    c3: vec4<f32>,
    c4: vec4<f32>,
    c5: vec4<f32>,
    c6: vec4<f32>,
    c7: vec4<f32>,
}

fn quant_columns8(lo: vec4<u32>, hi: vec4<u32>, j: u32, kb: u32) -> QuantColumns8 {
    let step = quant_block_step(j);
    let b0 = quant_column_blocks(lo.x, kb) + step;
    let b1 = quant_column_blocks(lo.y, kb) + step;
    let b2 = quant_column_blocks(lo.z, kb) + step;
    let b3 = quant_column_blocks(lo.w, kb) + step;
    let b4 = quant_column_blocks(hi.x, kb) + step;
    let b5 = quant_column_blocks(hi.y, kb) + step;
    let b6 = quant_column_blocks(hi.z, kb) + step;
    let b7 = quant_column_blocks(hi.w, kb) + step;
    let side = array<QuantSide, 8>(
        quant_side_at(b0.y), quant_side_at(b1.y), quant_side_at(b2.y), quant_side_at(b3.y),
        quant_side_at(b4.y), quant_side_at(b5.y), quant_side_at(b6.y), quant_side_at(b7.y),
    );
    return QuantColumns8(
        quant_block_ints(b0.x, side[0].hi, false), quant_block_ints(b1.x, side[1].hi, false),
        quant_block_ints(b2.x, side[2].hi, false), quant_block_ints(b3.x, side[3].hi, false),
        quant_block_ints(b4.x, side[4].hi, false), quant_block_ints(b5.x, side[5].hi, false),
        quant_block_ints(b6.x, side[6].hi, false), quant_block_ints(b7.x, side[7].hi, false),
        side,
    );
}

// Block j of rows 4·group + 0..3 of A (rows past the bucket repeat the
// group's first, rows past the launch's `rows` its last row; neither is
// stored). `group` is a literal at every call, so the bucket checks fold
// away.
fn quant_rows_a_group(group: u32, j: u32, k4: u32, rows: u32) -> QuantRowsA {
    let r0 = QUANT_ROW_GROUP * group;
    let ra = quant_rows_group_starts(r0, k4, rows) + vec4<u32>(8u * j);
    let x0 = quant_a_block(ra.x);
    var x1 = x0;
    var x2 = x0;
    var x3 = x0;
    if MATVEC_ROWS > r0 + 1u {
        x1 = quant_a_block(ra.y);
    }
    if MATVEC_ROWS > r0 + 2u {
        x2 = quant_a_block(ra.z);
    }
    if MATVEC_ROWS > r0 + 3u {
        x3 = quant_a_block(ra.w);
    }
    return quant_rows_a_of(x0, x1, x2, x3);
}

// Where rows r0 + 0..3 of A start (in vec4s), clamped to the launch's
// last row.
fn quant_rows_group_starts(r0: u32, k4: u32, rows: u32) -> vec4<u32> {
    return min(vec4<u32>(r0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(rows - 1u)) * k4;
}

// One column's block against a group's 4 rows (the group's first row r0,
// a literal): each row's sum of products; rows past the bucket get none.
fn quant_rows4_dot(q: array<vec4<f32>, 8>, side: QuantSide, a: QuantRowsA, r0: u32) -> vec4<f32> {
    let zero = vec4<f32>(0.0);
    let one = vec4<f32>(1.0);
    var sums = vec4<f32>(dot(quant_block_fma(zero, q, side, a.x0, a.s[0], a.s_lo[0]), one), 0.0, 0.0, 0.0);
    if MATVEC_ROWS > r0 + 1u {
        sums.y = dot(quant_block_fma(zero, q, side, a.x1, a.s[1], a.s_lo[1]), one);
    }
    if MATVEC_ROWS > r0 + 2u {
        sums.z = dot(quant_block_fma(zero, q, side, a.x2, a.s[2], a.s_lo[2]), one);
    }
    if MATVEC_ROWS > r0 + 3u {
        sums.w = dot(quant_block_fma(zero, q, side, a.x3, a.s[3], a.s_lo[3]), one);
    }
    return sums;
}

// acc plus block j of the lane's columns (w) against a group's rows a (its
// first row r0, a literal).
fn quant_rows_group_fma(acc: QuantRowSums, w: QuantColumns8, a: QuantRowsA, r0: u32) -> QuantRowSums {
    return QuantRowSums(
        acc.c0 + quant_rows4_dot(w.q0, w.side[0], a, r0),
        acc.c1 + quant_rows4_dot(w.q1, w.side[1], a, r0),
        acc.c2 + quant_rows4_dot(w.q2, w.side[2], a, r0),
        acc.c3 + quant_rows4_dot(w.q3, w.side[3], a, r0),
        acc.c4 + quant_rows4_dot(w.q4, w.side[4], a, r0),
        acc.c5 + quant_rows4_dot(w.q5, w.side[5], a, r0),
        acc.c6 + quant_rows4_dot(w.q6, w.side[6], a, r0),
        acc.c7 + quant_rows4_dot(w.q7, w.side[7], a, r0),
    );
}

// Column c's sum for row i of a group.
fn quant_row_sum(acc: QuantRowSums, c: u32, i: u32) -> f32 {
    let sums = array<vec4<f32>, 8>(acc.c0, acc.c1, acc.c2, acc.c3, acc.c4, acc.c5, acc.c6, acc.c7);
    return sums[c][i];
}

// Stores row `row` (row i of group acc) of the lane's columns: plain, the
// columns col0 + 8·c; gated, output columns col0 + 8·c (c in 0..3) from G's
// sums in c and U's in c + 4.
fn quant_rows_store(acc: QuantRowSums, row: u32, i: u32, col0: u32, n: u32) {
    if GATED {
        for (var c = 0u; c < 4u; c++) {
            let col = col0 + 8u * c;
            if col < n {
                c_gated(row, col, activation_forward(ACT_SILU, quant_row_sum(acc, c, i)) * quant_row_sum(acc, c + 4u, i));
            }
        }
        return;
    }
    for (var c = 0u; c < 8u; c++) {
        let col = col0 + 8u * c;
        if col < n {
            write_c(row, col, quant_row_sum(acc, c, i));
        }
    }
}

// Columns of C per workgroup of the rows kernels: 8 per lane (gated: 4,
// each with its gate and up column), as many sums as a lane's registers
// hold for 16 rows.
const QUANT_ROWS_COLUMNS_PER_GROUP: u32 = 64u;
const QUANT_ROWS_GATED_COLUMNS_PER_GROUP: u32 = 32u;

// The lane's virtual columns (clamped into 0..n, so every lane runs the k
// loop) and its first column.
struct QuantRowsLane {
    lo: vec4<u32>,
    hi: vec4<u32>,
    col0: u32,
}

fn quant_rows_lane(wid: vec3<u32>, nwg: vec3<u32>, lane: u32, n: u32) -> QuantRowsLane {
    let group = wid.y * nwg.x + wid.x;
    let last = vec4<u32>(n - 1u);
    if GATED {
        let col0 = group * QUANT_ROWS_GATED_COLUMNS_PER_GROUP + lane;
        let lo = min(vec4<u32>(col0) + vec4<u32>(0u, 8u, 16u, 24u), last);
        return QuantRowsLane(lo, lo + vec4<u32>(n), col0);
    }
    let col0 = group * QUANT_ROWS_COLUMNS_PER_GROUP + lane;
    return QuantRowsLane(min(vec4<u32>(col0) + vec4<u32>(0u, 8u, 16u, 24u), last), min(vec4<u32>(col0) + vec4<u32>(32u, 40u, 48u, 56u), last), col0);
}

// (n, k, rows) through workgroup memory, as matvec_quant_forward reads
// them (lavapipe re-optimizes a shader whose loops a uniform value bounds).
fn quant_rows_sizes(lane: u32) -> vec3<u32> {
    if lane == 0u {
        matvec_sizes = vec3<u32>(p.n, p.k, p.m);
    }
    return workgroupUniformLoad(&matvec_sizes);
}

// Stores the launch's `rows` rows of sums (group g's rows in acc_g).
fn quant_rows_store_all(acc0: QuantRowSums, acc1: QuantRowSums, acc2: QuantRowSums, acc3: QuantRowSums, col0: u32, n: u32, rows: u32) {
    if col0 >= n {
        return;
    }
    for (var i = 0u; i < QUANT_ROW_GROUP; i++) {
        if i < rows {
            quant_rows_store(acc0, i, i, col0, n);
        }
        if MATVEC_ROWS > 4u && i + 4u < rows {
            quant_rows_store(acc1, i + 4u, i, col0, n);
        }
        if MATVEC_ROWS > 8u && i + 8u < rows {
            quant_rows_store(acc2, i + 8u, i, col0, n);
        }
        if MATVEC_ROWS > 12u && i + 12u < rows {
            quant_rows_store(acc3, i + 12u, i, col0, n);
        }
    }
}

@compute @workgroup_size(MATVEC_COLS, 1, 1)
fn matvec_quant_forward_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let sizes = quant_rows_sizes(lid.x);
    let n = sizes.x;
    let kb = sizes.y / 32u;
    let k4 = sizes.y / 4u;
    let rows = sizes.z;
    let lane = quant_rows_lane(wid, nwg, lid.x, n);
    var acc0 = QuantRowSums();
    var acc1 = QuantRowSums();
    var acc2 = QuantRowSums();
    var acc3 = QuantRowSums();
    for (var j = 0u; j < kb; j++) {
        let w = quant_columns8(lane.lo, lane.hi, j, kb);
        acc0 = quant_rows_group_fma(acc0, w, quant_rows_a_group(0u, j, k4, rows), 0u);
        if MATVEC_ROWS > 4u {
            acc1 = quant_rows_group_fma(acc1, w, quant_rows_a_group(1u, j, k4, rows), 4u);
        }
        if MATVEC_ROWS > 8u {
            acc2 = quant_rows_group_fma(acc2, w, quant_rows_a_group(2u, j, k4, rows), 8u);
        }
        if MATVEC_ROWS > 12u {
            acc3 = quant_rows_group_fma(acc3, w, quant_rows_a_group(3u, j, k4, rows), 12u);
        }
    }
    quant_rows_store_all(acc0, acc1, acc2, acc3, lane.col0, n, rows);
}

// ---------------------------------------------------------------------
// matmul_quant_transposed: C[M, N] = A[M, K] · B[K, N] for a quantized B
// stored as its K rows of N values: a frozen Linear weight W [out, in]
// read by its backward, dX = dY·W (K = out, N = in), each block decoded in
// registers and never expanded into a dense copy of W. The forward kernels
// sum along a row of B; here a row of B is one step of the sum, and the
// columns of C are the values along it. The launch's uniform: p.m rows and
// p.n columns of C (a multiple of 32: B's row length), p.k rows of B this
// launch sums over, the first of them row p.bias_base of B and so column
// p.bias_base of A, whose rows are p.ldc long; C's rows are p.n long. A
// 64×64 tile of C per workgroup of 8×8 invocations, invocation (x, y) its
// rows 8·y + 0..7 and its 8 consecutive columns 8·x + 0..7, which one
// block of each row of B holds: per row of B, one side decode and two
// words (quant_group) for 64 multiply-adds, in 8 mat2x4 accumulators (A
// read per value: K need not be a multiple of 4). Edges: rows clamped on
// load and masked on store; a column block lies wholly inside or outside
// C. ACCUMULATE adds into C (a B split over bindings by rows: the
// launches after the first).
override ACCUMULATE: bool = false;

// The transposed kernel's view of A: one value at a time.
@group(0) @binding(0) var<storage, read> a1: array<f32>;

// Row `row` of an invocation's 8 consecutive columns col0 .. col0 + 7.
fn quant_store_cols8(row: u32, col0: u32, acc: mat2x4<f32>) {
    if row >= p.m {
        return;
    }
    let i = p.c_base + row * p.n + col0;
    for (var j = 0u; j < 8u; j++) {
        var v = select(acc[0][j & 3u], acc[1][j & 3u], j >= 4u);
        if ACCUMULATE {
            v += c[i + j];
        }
        c[i + j] = v;
    }
}

@compute @workgroup_size(8, 8, 1)
fn matmul_quant_transposed(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let tile = wid.y * nwg.x + wid.x;
    if tile >= p.tiles_total {
        return;
    }
    let row0 = (tile / p.tiles_n) * QUANT_TILE + lid.y * 8u;
    let col0 = (tile % p.tiles_n) * QUANT_TILE + lid.x * 8u;
    if row0 >= p.m || col0 >= p.n {
        return;
    }
    // Row r of B's block holding the columns, and their groups of 4 in it.
    let kb = p.n / 32u;
    let jb = col0 / 32u;
    let g = (col0 % 32u) / 4u;
    // Each row's first value of A this launch reads.
    let last_row = vec4<u32>(p.m - 1u);
    let ra_lo = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), last_row) * p.ldc + vec4<u32>(p.bias_base);
    let ra_hi = min(vec4<u32>(row0) + vec4<u32>(4u, 5u, 6u, 7u), last_row) * p.ldc + vec4<u32>(p.bias_base);
    var acc0 = mat2x4<f32>();
    var acc1 = mat2x4<f32>();
    var acc2 = mat2x4<f32>();
    var acc3 = mat2x4<f32>();
    var acc4 = mat2x4<f32>();
    var acc5 = mat2x4<f32>();
    var acc6 = mat2x4<f32>();
    var acc7 = mat2x4<f32>();
    for (var r = 0u; r < p.k; r++) {
        let block = r * kb + jb;
        let side = quant_side(block);
        let lo = quant_group(block, g, side);
        let hi = quant_group(block, g + 1u, side);
        acc0 = fma_row8(acc0, a1[ra_lo.x + r], lo, hi);
        acc1 = fma_row8(acc1, a1[ra_lo.y + r], lo, hi);
        acc2 = fma_row8(acc2, a1[ra_lo.z + r], lo, hi);
        acc3 = fma_row8(acc3, a1[ra_lo.w + r], lo, hi);
        acc4 = fma_row8(acc4, a1[ra_hi.x + r], lo, hi);
        acc5 = fma_row8(acc5, a1[ra_hi.y + r], lo, hi);
        acc6 = fma_row8(acc6, a1[ra_hi.z + r], lo, hi);
        acc7 = fma_row8(acc7, a1[ra_hi.w + r], lo, hi);
    }
    quant_store_cols8(row0 + 0u, col0, acc0);
    quant_store_cols8(row0 + 1u, col0, acc1);
    quant_store_cols8(row0 + 2u, col0, acc2);
    quant_store_cols8(row0 + 3u, col0, acc3);
    quant_store_cols8(row0 + 4u, col0, acc4);
    quant_store_cols8(row0 + 5u, col0, acc5);
    quant_store_cols8(row0 + 6u, col0, acc6);
    quant_store_cols8(row0 + 7u, col0, acc7);
}
