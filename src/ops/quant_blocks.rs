//! GGUF's block formats beyond Q8_0/Q4_0/Q4_1: Q5_0, Q5_1, IQ4_NL (32-value
//! blocks) and the k-quants Q2_K…Q6_K (256-value super-blocks of 16- or
//! 32-value sub-blocks). Each has its decoder to f32, bit-exact against
//! gguf-py's `dequantize` (the same f32 operations in the same order), and
//! its conversion to and from the kernels' layout: per 32-value block four
//! words of nibbles (ggml's order: byte b holds value b in its low nibble,
//! value 16 + b in its high one) and [`QuantFormat::side_words`] words of
//! scales and high bits (see [`super::pack_quantized`]).

use super::{f16_from_le, QuantFormat};

/// Values per k-quant super-block.
pub const QK_K: usize = 256;

/// IQ4_NL's 16 levels (ggml's `kvalues_iq4nl`).
pub const IQ4_NL_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

fn f16_at(block: &[u8], i: usize) -> f32 {
    f16_from_le(block[i], block[i + 1])
}

fn u16_at(block: &[u8], i: usize) -> u32 {
    u32::from(u16::from_le_bytes([block[i], block[i + 1]]))
}

fn u32_at(block: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]])
}

/// The 32 nibbles of a Q4_0-style byte run (value b low, 16 + b high).
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for (b, &byte) in qs.iter().take(16).enumerate() {
        q[b] = byte & 0x0f;
        q[16 + b] = byte >> 4;
    }
    q
}

/// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, unpacked
/// (gguf-py's `Q4_K.get_scale_min`).
pub fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        m[j] = s[4 + j] & 0x3f;
        sc[4 + j] = (s[8 + j] & 0x0f) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

/// [`k_scale_min`]'s inverse (every 12 bytes are some 8 scales and mins).
fn k_scale_min_bytes(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 0x3f) | ((sc[4 + j] & 0x30) << 2);
        s[4 + j] = (m[j] & 0x3f) | ((m[4 + j] & 0x30) << 2);
        s[8 + j] = (sc[4 + j] & 0x0f) | ((m[4 + j] & 0x0f) << 4);
    }
    s
}

/// Q3_K's 16 6-bit scales (unsigned, before the − 32) from its 12 bytes.
pub fn q3_k_scales(s: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (sb, o) in out.iter_mut().enumerate() {
        let low = if sb < 8 { s[sb] & 0x0f } else { s[sb - 8] >> 4 };
        let high = (s[8 + sb % 4] >> (2 * (sb / 4))) & 0x03;
        *o = low | (high << 4);
    }
    out
}

fn q3_k_scale_bytes(sc: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (sb, &v) in sc.iter().enumerate() {
        s[sb % 8] |= (v & 0x0f) << (4 * (sb / 8));
        s[8 + sb % 4] |= ((v >> 4) & 0x03) << (2 * (sb / 4));
    }
    s
}

/// A k-quant super-block's integers (before any offset: Q2_K's 2 bits,
/// Q3_K's 3 (low 2 | high bit << 2), Q4_K's 4, Q5_K's 5, Q6_K's 6), in
/// value order.
fn k_ints(format: QuantFormat, block: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (v, o) in q.iter_mut().enumerate() {
        let (h, r) = (v / 128, v % 128);
        *o = match format {
            QuantFormat::Q2_K => (block[16 + 32 * h + r % 32] >> (2 * (r / 32))) & 3,
            QuantFormat::Q3_K => {
                let low = (block[32 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
                low | (((block[v % 32] >> (v / 32)) & 1) << 2)
            }
            QuantFormat::Q4_K => (block[16 + 32 * (v / 64) + v % 32] >> (4 * ((v / 32) % 2))) & 0x0f,
            QuantFormat::Q5_K => {
                let low = (block[48 + 32 * (v / 64) + v % 32] >> (4 * ((v / 32) % 2))) & 0x0f;
                low | (((block[16 + v % 32] >> (v / 32)) & 1) << 4)
            }
            QuantFormat::Q6_K => {
                let low = (block[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
                low | (((block[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4)
            }
            _ => 0,
        };
    }
    q
}

/// [`k_ints`]' inverse: writes the integers' bytes into `block` (whose
/// scale bytes are written by the caller).
fn k_ints_bytes(format: QuantFormat, q: &[u8; QK_K], block: &mut [u8]) {
    for (v, &x) in q.iter().enumerate() {
        let (h, r) = (v / 128, v % 128);
        match format {
            QuantFormat::Q2_K => block[16 + 32 * h + r % 32] |= (x & 3) << (2 * (r / 32)),
            QuantFormat::Q3_K => {
                block[32 + 32 * h + r % 32] |= (x & 3) << (2 * (r / 32));
                block[v % 32] |= ((x >> 2) & 1) << (v / 32);
            }
            QuantFormat::Q4_K => block[16 + 32 * (v / 64) + v % 32] |= (x & 0x0f) << (4 * ((v / 32) % 2)),
            QuantFormat::Q5_K => {
                block[48 + 32 * (v / 64) + v % 32] |= (x & 0x0f) << (4 * ((v / 32) % 2));
                block[16 + v % 32] |= ((x >> 4) & 1) << (v / 32);
            }
            QuantFormat::Q6_K => {
                block[64 * h + r % 64] |= (x & 0x0f) << (4 * (r / 64));
                block[128 + 32 * h + r % 32] |= ((x >> 4) & 3) << (2 * (r / 32));
            }
            _ => {}
        }
    }
}

/// One block of a format of this module decoded into `out` (32 or 256
/// values), with gguf-py's f32 operations and rounding order.
pub(crate) fn decode(format: QuantFormat, block: &[u8], out: &mut [f32]) {
    match format {
        QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
            let (m, qh_at) = if format == QuantFormat::Q5_0 {
                (0.0, 2)
            } else {
                (f16_at(block, 2), 4)
            };
            let d = f16_at(block, 0);
            let (qh, q) = (u32_at(block, qh_at), nibbles(&block[qh_at + 4..]));
            for (i, o) in out.iter_mut().enumerate() {
                let q = u32::from(q[i]) | (((qh >> i) & 1) << 4);
                *o = if format == QuantFormat::Q5_0 {
                    d * (q as f32 - 16.0)
                } else {
                    d * q as f32 + m
                };
            }
        }
        QuantFormat::IQ4_NL => {
            let (d, q) = (f16_at(block, 0), nibbles(&block[2..]));
            for (o, &q) in out.iter_mut().zip(&q) {
                *o = d * f32::from(IQ4_NL_LEVELS[usize::from(q)]);
            }
        }
        QuantFormat::Q2_K => {
            let (d, dmin, q) = (f16_at(block, 80), f16_at(block, 82), k_ints(format, block));
            for (v, o) in out.iter_mut().enumerate() {
                let s = block[v / 16];
                let (dl, ml) = (d * f32::from(s & 0x0f), dmin * f32::from(s >> 4));
                *o = dl * f32::from(q[v]) - ml;
            }
        }
        QuantFormat::Q3_K => {
            let (d, sc, q) = (f16_at(block, 108), q3_k_scales(&block[96..108]), k_ints(format, block));
            for (v, o) in out.iter_mut().enumerate() {
                let dl = d * (i32::from(sc[v / 16]) - 32) as f32;
                *o = dl * (i32::from(q[v]) - 4) as f32;
            }
        }
        QuantFormat::Q4_K | QuantFormat::Q5_K => {
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let ((sc, m), q) = (k_scale_min(&block[4..16]), k_ints(format, block));
            for (v, o) in out.iter_mut().enumerate() {
                let (dl, ml) = (d * f32::from(sc[v / 32]), dmin * f32::from(m[v / 32]));
                *o = dl * f32::from(q[v]) - ml;
            }
        }
        QuantFormat::Q6_K => {
            let (d, q) = (f16_at(block, 208), k_ints(format, block));
            for (v, o) in out.iter_mut().enumerate() {
                let dl = d * f32::from(block[192 + v / 16] as i8);
                *o = dl * (i32::from(q[v]) - 32) as f32;
            }
        }
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 => {}
    }
}

/// The nibble words of 32 integers (their low 4 bits).
fn nibble_words(q: &[u8]) -> [u32; 4] {
    let mut w = [0u32; 4];
    for b in 0..16 {
        w[b / 4] |= u32::from((q[b] & 0x0f) | ((q[16 + b] & 0x0f) << 4)) << (8 * (b % 4));
    }
    w
}

/// [`nibble_words`]' inverse.
fn word_nibbles(w: &[u32]) -> [u8; 32] {
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    nibbles(&bytes)
}

/// One GGUF block of a format of this module in the kernels' layout: for
/// each of its 32-value blocks, its 4 nibble words into `quants` and its
/// side words into `side` (see [`super::pack_quantized`]).
pub(crate) fn split(format: QuantFormat, block: &[u8], quants: &mut [u32], side: &mut [u32]) {
    match format {
        QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::IQ4_NL => {
            let at = match format {
                QuantFormat::Q5_0 => 6,
                QuantFormat::Q5_1 => 8,
                _ => 2,
            };
            quants.copy_from_slice(&nibble_words(&nibbles(&block[at..])));
            let m = if format == QuantFormat::Q5_1 {
                u16_at(block, 2)
            } else {
                0
            };
            side[0] = u16_at(block, 0) | m << 16;
            if format != QuantFormat::IQ4_NL {
                side[1] = u32_at(block, at - 4);
            }
        }
        _ => split_k(format, block, quants, side),
    }
}

fn split_k(format: QuantFormat, block: &[u8], quants: &mut [u32], side: &mut [u32]) {
    let q = k_ints(format, block);
    let s = format.side_words();
    for j in 0..QK_K / 32 {
        let sub = &q[32 * j..32 * j + 32];
        quants[4 * j..4 * j + 4].copy_from_slice(&nibble_words(sub));
        let side = &mut side[s * j..s * j + s];
        match format {
            QuantFormat::Q2_K => {
                side[0] = u16_at(block, 80) | u16_at(block, 82) << 16;
                side[1] = u32::from(block[2 * j]) | u32::from(block[2 * j + 1]) << 8;
            }
            QuantFormat::Q3_K => {
                let sc = q3_k_scales(&block[96..108]);
                side[0] = u16_at(block, 108) | u32::from(sc[2 * j]) << 16 | u32::from(sc[2 * j + 1]) << 24;
            }
            QuantFormat::Q4_K | QuantFormat::Q5_K => {
                let (sc, m) = k_scale_min(&block[4..16]);
                side[0] = u16_at(block, 0) | u16_at(block, 2) << 16;
                side[1] = u32::from(sc[j]) | u32::from(m[j]) << 8;
                if format == QuantFormat::Q5_K {
                    side[2] = (0..32).map(|i| u32::from((sub[i] >> 4) & 1) << i).sum();
                }
            }
            QuantFormat::Q6_K => {
                let sc = |i: usize| u32::from(block[192 + i]);
                side[0] = u16_at(block, 208) | sc(2 * j) << 16 | sc(2 * j + 1) << 24;
                for (h, w) in side[1..3].iter_mut().enumerate() {
                    *w = (0..16).map(|i| u32::from((sub[16 * h + i] >> 4) & 3) << (2 * i)).sum();
                }
            }
            _ => {}
        }
    }
}

/// [`split`]'s inverse: the GGUF block of a format of this module, appended
/// to `out`.
pub(crate) fn join(format: QuantFormat, quants: &[u32], side: &[u32], out: &mut Vec<u8>) {
    let le16 = |x: u32| [(x & 0xff) as u8, ((x >> 8) & 0xff) as u8];
    match format {
        QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::IQ4_NL => {
            out.extend_from_slice(&le16(side[0]));
            if format == QuantFormat::Q5_1 {
                out.extend_from_slice(&le16(side[0] >> 16));
            }
            if format != QuantFormat::IQ4_NL {
                out.extend_from_slice(&side[1].to_le_bytes());
            }
            quants.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        }
        _ => join_k(format, quants, side, out),
    }
}

fn join_k(format: QuantFormat, quants: &[u32], side: &[u32], out: &mut Vec<u8>) {
    let s = format.side_words();
    let mut q = [0u8; QK_K];
    let mut sc16 = [0u8; 16];
    for j in 0..QK_K / 32 {
        let (side, sub) = (&side[s * j..s * j + s], &mut q[32 * j..32 * j + 32]);
        sub.copy_from_slice(&word_nibbles(&quants[4 * j..4 * j + 4]));
        match format {
            QuantFormat::Q5_K => sub
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x |= (((side[2] >> i) & 1) as u8) << 4),
            QuantFormat::Q6_K => {
                let top = |i: usize| (((side[1 + i / 16] >> (2 * (i % 16))) & 3) as u8) << 4;
                sub.iter_mut().enumerate().for_each(|(i, x)| *x |= top(i));
            }
            _ => {}
        }
        let pair = if format == QuantFormat::Q6_K || format == QuantFormat::Q3_K {
            side[0] >> 16
        } else {
            side[1]
        };
        (sc16[2 * j], sc16[2 * j + 1]) = ((pair & 0xff) as u8, ((pair >> 8) & 0xff) as u8);
    }
    let mut block = vec![0u8; format.block_bytes()];
    k_ints_bytes(format, &q, &mut block);
    let head = side[0];
    let [d0, d1, m0, m1] = head.to_le_bytes();
    let (d, dmin) = ([d0, d1], [m0, m1]);
    match format {
        QuantFormat::Q2_K => {
            block[..16].copy_from_slice(&sc16);
            block[80..82].copy_from_slice(&d);
            block[82..84].copy_from_slice(&dmin);
        }
        QuantFormat::Q3_K => {
            block[96..108].copy_from_slice(&q3_k_scale_bytes(&sc16));
            block[108..110].copy_from_slice(&d);
        }
        QuantFormat::Q4_K | QuantFormat::Q5_K => {
            // The scale and min sit in the second side word (Q5_K's third
            // holds high bits).
            let (mut sc8, mut m8) = ([0u8; 8], [0u8; 8]);
            for j in 0..8 {
                let w = side[s * j + 1];
                (sc8[j], m8[j]) = ((w & 0xff) as u8, ((w >> 8) & 0xff) as u8);
            }
            block[..2].copy_from_slice(&d);
            block[2..4].copy_from_slice(&dmin);
            block[4..16].copy_from_slice(&k_scale_min_bytes(&sc8, &m8));
        }
        QuantFormat::Q6_K => {
            block[192..208].copy_from_slice(&sc16);
            block[208..210].copy_from_slice(&d);
        }
        _ => {}
    }
    out.extend_from_slice(&block);
}

/// The byte offsets of a GGUF block's f16 scales (d, and m or dmin where
/// the format has one).
pub(crate) fn scale_offsets(format: QuantFormat) -> &'static [usize] {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::IQ4_NL => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4_K | QuantFormat::Q5_K => &[0, 2],
        QuantFormat::Q2_K => &[80, 82],
        QuantFormat::Q3_K => &[108],
        QuantFormat::Q6_K => &[208],
    }
}

/// The f16 scales of one GGUF block, which must be finite.
pub(crate) fn block_scales(format: QuantFormat, block: &[u8]) -> impl Iterator<Item = f32> + '_ {
    scale_offsets(format).iter().map(move |&at| f16_at(block, at))
}
