//! `quant_weights.wgsl`: products with f32 activations and block-quantized
//! weights (every GGUF format wgrad reads: Q8_0, Q4_0, Q4_1 at every shape
//! below, Q5_0, Q5_1, IQ4_NL and the k-quants in `new_format_*`, as a GGUF
//! file stores them, re-packed by
//! `pack_quantized`) on the matrix-vector and tiled kernels, and the lookup
//! from a quantized table, against their CPU twins (which decode each block
//! with the GGUF reader's `decode_*`), on every adapter; split over small
//! bindings; the layout's round trip; and a graph with a quantized
//! parameter. Tolerance: `|gpu - cpu| <= atol + rtol·|cpu|`, beside each
//! check.

use crate::common;

use common::{assert_close, for_each_adapter, for_each_shaping, limited_kernels, random_vec, read, rng};
use half::f16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use wgrad::kernels::{
    pack_quantized, unpack_quantized, Activation, LimitOverrides, MatmulEpilogue, QuantFormat, QuantView,
    QuantWeightsKernel, MATVEC_MAX_ROWS, QUANT_ROWS_MAX_ROWS,
};
use wgrad::kernels::{MatmulForm, MatmulKernel, MatmulOperand, MatmulRequest};
use wgrad::{cpu, Error, Kernels};

/// The formats the long-standing cases run at every shape (rows of 32
/// values and more); [`NEW`] the others.
const LEGACY: [QuantFormat; 3] = [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Q4_1];

/// The formats after Q4_1 (the k-quants' rows whole 256-value super-blocks).
const NEW: [QuantFormat; 8] = [
    QuantFormat::Q5_0,
    QuantFormat::Q5_1,
    QuantFormat::IQ4_NL,
    QuantFormat::Q2_K,
    QuantFormat::Q3_K,
    QuantFormat::Q4_K,
    QuantFormat::Q5_K,
    QuantFormat::Q6_K,
];

/// Each f16 scale of a block of a [`NEW`] format: its byte offset and a
/// range that keeps the weights within about ±1 whatever the integers and
/// sub-scales (random bytes).
fn new_format_scales(format: QuantFormat) -> Vec<(usize, std::ops::Range<f32>)> {
    match format {
        QuantFormat::Q5_0 => vec![(0, 0.02..0.06)],
        QuantFormat::Q5_1 => vec![(0, 0.01..0.03), (2, -0.5..0.0)],
        QuantFormat::IQ4_NL => vec![(0, 0.002..0.008)],
        QuantFormat::Q2_K => vec![(80, 0.005..0.02), (82, 0.005..0.02)],
        QuantFormat::Q3_K => vec![(108, 0.002..0.008)],
        QuantFormat::Q4_K => vec![(0, 0.0005..0.001), (2, 0.002..0.008)],
        QuantFormat::Q5_K => vec![(0, 0.0003..0.0005), (2, 0.002..0.008)],
        _ => vec![(208, 0.0001..0.0002)],
    }
}

/// A [rows, cols] matrix in `format` as a GGUF file stores it: random
/// integers, and scales (and minimums) that keep the weights within about
/// ±1, as a trained model's are.
fn random_blocks(r: &mut ChaCha8Rng, format: QuantFormat, rows: usize, cols: usize) -> Vec<u8> {
    let blocks = rows * cols / format.super_block();
    if !LEGACY.contains(&format) {
        let mut raw: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| r.random()).collect();
        for block in raw.chunks_exact_mut(format.block_bytes()) {
            for (at, range) in new_format_scales(format) {
                block[at..at + 2].copy_from_slice(&f16::from_f32(r.random_range(range)).to_le_bytes());
            }
        }
        return raw;
    }
    let mut raw = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        let (d, m) = match format {
            QuantFormat::Q8_0 => (r.random_range(0.002..0.008), 0.0),
            QuantFormat::Q4_0 => (r.random_range(0.03..0.12), 0.0),
            _ => (r.random_range(0.02..0.06), r.random_range(-0.5..0.0)),
        };
        raw.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        if format == QuantFormat::Q4_1 {
            raw.extend_from_slice(&f16::from_f32(m).to_le_bytes());
        }
        raw.extend((0..format.quant_words() * 4).map(|_| r.random::<u8>()));
    }
    raw
}

#[test]
fn the_packed_layout_round_trips_and_keeps_ggml_order() {
    for format in LEGACY {
        let (rows, cols) = (3, 64);
        let raw = random_blocks(&mut rng(2500), format, rows, cols);
        let words = pack_quantized(format, &raw, rows, cols).unwrap();
        assert_eq!(words.len(), format.stored_words(rows * cols));
        assert_eq!(unpack_quantized(format, &words, rows, cols).unwrap(), raw, "{format:?}");
        // Block 1's quantized bytes are its file bytes in order, and its
        // scale word holds d (and Q4_1's m) as the file's f16 bits.
        let (bytes, header) = (format.block_bytes(), format.block_bytes() - 4 * format.quant_words());
        let block = &raw[bytes..2 * bytes];
        let q = &words[format.quant_words()..2 * format.quant_words()];
        assert_eq!(
            q[0].to_le_bytes(),
            block[header..header + 4],
            "{format:?}: first word of block 1"
        );
        let scale = words[rows * cols / 32 * format.quant_words() + 1];
        assert_eq!(
            scale & 0xffff,
            u32::from(u16::from_le_bytes([block[0], block[1]])),
            "{format:?}: d"
        );
        let m = if format == QuantFormat::Q4_1 {
            u32::from(u16::from_le_bytes([block[2], block[3]]))
        } else {
            0
        };
        assert_eq!(scale >> 16, m, "{format:?}: m");
    }
    // Rows must hold whole blocks, and the bytes whole rows.
    let err = pack_quantized(QuantFormat::Q8_0, &[0; 34], 1, 33).unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("multiple of 32"),
        "{err}"
    );
    let err = pack_quantized(QuantFormat::Q4_0, &[0; 18], 2, 32).unwrap_err();
    assert!(err.to_string().contains("18 bytes"), "{err}");
    let err = unpack_quantized(QuantFormat::Q4_1, &[0; 4], 1, 32).unwrap_err();
    assert!(err.to_string().contains("4 words"), "{err}");
}

/// What a case fuses into its store.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Plain,
    Bias,
    /// Bias, GELU and the pre-activation kept.
    BiasGeluPre,
}

/// Sums of ≤ 576 products of activations in [-1, 1] with weights within
/// about ±1, f32 against the twin's f64: tests/suite/matvec.rs's 1e-4 for
/// the f32 kernels, widened because the kernels sum each block's integers'
/// products before scaling (d·Σq·x, − 8·d·Σx for Q4_0), whose terms reach
/// 15 times the weights', so their rounding does too; then GELU (slope ≤
/// 1.13).
const ATOL: f32 = 2e-3;
const RTOL: f32 = 1e-4;

/// The epilogue a product of `format` over m rows takes in the products
/// test: a Latin square over (format, row class: 1, 2, more), so each
/// kernel (picked by m) meets each epilogue and each format without their
/// full product of pipelines. The epilogue is one function (`write_c`)
/// whatever the format and kernel, so pairs cover its paths.
fn store_for(format: QuantFormat, m: usize) -> Store {
    let format_index = QuantFormat::ALL.iter().position(|&f| f == format).unwrap_or(0);
    [Store::Plain, Store::Bias, Store::BiasGeluPre][(format_index + m.min(3) - 1) % 3]
}

/// Runs one product on `k` with `kernel` (the shape-selected one when
/// None) and checks C (and pre) against the twin; returns the dispatch's
/// entry and launches.
fn check_product(
    k: &Kernels,
    kernel: Option<QuantWeightsKernel>,
    format: QuantFormat,
    store: Store,
    (m, n, kk): (usize, usize, usize),
    seed: u64,
) -> wgrad::Result<(&'static str, usize)> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
    let raw = random_blocks(&mut r, format, n, kk);
    let bias_host = random_vec(&mut r, n, -1.0, 1.0);
    let words = k.upload(&pack_quantized(format, &raw, n, kk)?)?;
    let (a, c, pre, bias) = (
        k.upload(&a_host)?,
        k.upload(&vec![f32::NAN; m * n])?,
        k.zeros(m * n)?,
        k.upload(&bias_host)?,
    );
    let b = QuantView::new(words.view(), format, n, kk)?;
    let epilogue = match store {
        Store::Plain => MatmulEpilogue::default(),
        Store::Bias => MatmulEpilogue {
            bias: Some(bias.view()),
            ..MatmulEpilogue::default()
        },
        Store::BiasGeluPre => MatmulEpilogue {
            bias: Some(bias.view()),
            activation: Some((Activation::Gelu, Some(pre.view()))),
            ..MatmulEpilogue::default()
        },
    };
    let d = match kernel {
        Some(kernel) => k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk)
                .with_kernel(MatmulKernel::Quant(kernel))
                .with_epilogue(epilogue),
            c.view(),
            a.view(),
            b,
        )?,
        None => k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
            c.view(),
            a.view(),
            b,
        )?,
    };
    k.run(&[&d])?;
    let e = cpu::Epilogue {
        bias: (store != Store::Plain).then_some(&bias_host[..]),
        activation: (store == Store::BiasGeluPre).then_some(Activation::Gelu),
        ..cpu::Epilogue::default()
    };
    let (want, want_pre) = cpu::matmul_quant_weights(e, &a_host, format, &raw, m, n, kk)?;
    let what = format!("{} {format:?} m={m} n={n} k={kk} {store:?}", d.kernel().entry);
    assert_close(&what, &read(k, &c)?, &want, ATOL, RTOL);
    if store == Store::BiasGeluPre {
        assert_close(&format!("{what} pre"), &read(k, &pre)?, &want_pre, ATOL, RTOL);
    }
    Ok((d.kernel().entry, d.launches()))
}

#[test]
fn quantized_products_match_the_cpu_on_each_kernel() {
    for_each_adapter("quantized weights: products", |k| {
        let mut case = 0u64;
        for format in LEGACY {
            // Every shape on every format; the epilogue by (format, m) (see
            // store_for): a pipeline per (kernel, format, row bucket), not
            // also per epilogue.
            // One block per row, three (fewer than the 8 lanes), and
            // SmolLM2's 576 (18 blocks: not a multiple of the lanes); 1,
            // primes and non-multiples of the 8 columns and 64×64 tiles.
            for kk in [32, 96, 576] {
                for n in [1, 3, 37, 256] {
                    for m in [1, 2, 7, 33, 128] {
                        case += 1;
                        let store = store_for(format, m);
                        let (entry, _) = check_product(k, None, format, store, (m, n, kk), 2600 + case)?;
                        let want = match (k.gpu_shaped(), m) {
                            (true, ..=MATVEC_MAX_ROWS) => "matvec_quant_forward",
                            (false, 1) => "matvec_quant_forward_columns",
                            (false, ..=QUANT_ROWS_MAX_ROWS) if k.supports_quant_rows_subgroup() => {
                                "matvec_quant_forward_rows_subgroup"
                            }
                            (false, ..=QUANT_ROWS_MAX_ROWS) => "matvec_quant_forward_rows",
                            _ => "matmul_quant_forward",
                        };
                        assert_eq!(entry, want, "m={m}");
                        // Decode's rows on the other adapters' matrix-vector
                        // kernel, and on the tiled one (the choice where the
                        // vector loads cannot run).
                        if m <= MATVEC_MAX_ROWS {
                            let other = if k.gpu_shaped() {
                                QuantWeightsKernel::MatvecColumns
                            } else {
                                QuantWeightsKernel::Matvec { lanes: 8 }
                            };
                            check_product(k, Some(other), format, store, (m, n, kk), 2600 + case)?;
                            check_product(
                                k,
                                Some(QuantWeightsKernel::Tiled),
                                format,
                                store,
                                (m, n, kk),
                                2600 + case,
                            )?;
                        }
                    }
                }
            }
            // Every row count of the matrix-vector kernels (3 and 4 rows
            // share the bucket of 4, which the loop above does not reach),
            // and GPU lanes: 8 and 64 each on some format, as lanes and
            // format are independent; 128 columns and more for the CPU
            // one's workgroup of 128.
            let lanes = if format == QuantFormat::Q4_0 { 8 } else { 64 };
            for rows in [3, MATVEC_MAX_ROWS] {
                check_product(
                    k,
                    Some(QuantWeightsKernel::Matvec { lanes }),
                    format,
                    store_for(format, rows),
                    (rows, 37, 96),
                    2590 + rows as u64,
                )?;
            }
            for (rows, n) in [(1, 128), (2, 131), (3, 129), (MATVEC_MAX_ROWS, 263)] {
                check_product(
                    k,
                    Some(QuantWeightsKernel::MatvecColumns),
                    format,
                    store_for(format, rows),
                    (rows, n, 96),
                    2595 + rows as u64,
                )?;
            }
            // The rows kernel on every adapter: every row count of a bucket
            // (partial and whole groups of 4), columns 1, primes and past
            // its 64 per workgroup, k of 1 block and non-powers of 2.
            // The subgroup one where the adapter has 8-lane subgroups.
            let mut rows_kernels = vec![QuantWeightsKernel::MatvecRows];
            if k.supports_quant_rows_subgroup() {
                rows_kernels.push(QuantWeightsKernel::MatvecRowsSubgroup);
            }
            // A pipeline per (format, bucket of rows, epilogue), each
            // compiled in a second or more on lavapipe: each format at two
            // buckets and two epilogues, so each of the 5 buckets (2, 4, 8,
            // 12, 16), formats and epilogues comes on each kernel (the loop
            // above adds 2 and 7 rows on every format for the selected
            // one), and each bucket's row counts on it.
            let (format_buckets, stores) = match format {
                QuantFormat::Q8_0 => ([4, 16], [Store::Plain, Store::Bias]),
                QuantFormat::Q4_0 => ([8, 12], [Store::Bias, Store::BiasGeluPre]),
                _ => ([2, 16], [Store::BiasGeluPre, Store::Plain]),
            };
            for (bucket, store) in format_buckets.into_iter().zip(stores) {
                let first = match bucket {
                    2 => 1,
                    4 => 3,
                    _ => bucket - 3,
                };
                for m in first..=bucket {
                    for (j, (n, kk)) in [(1, 96), (37, 32), (131, 576), (67, 96)].into_iter().enumerate() {
                        for &kernel in &rows_kernels {
                            check_product(
                                k,
                                Some(kernel),
                                format,
                                store,
                                (m, n, kk),
                                2900 + 4 * m as u64 + j as u64,
                            )?;
                        }
                    }
                }
            }
        }
        Ok(())
    });
}

/// One `matmul_quant_parts` product against its twin: `rows` matrices
/// [rows_i, kk] packed one after another into one buffer (each at a
/// 256-byte offset, as the parameter arena aligns them), or each in a
/// buffer of its own (`together` false: one launch per part).
fn check_parts(
    k: &Kernels,
    format: QuantFormat,
    rows: &[usize],
    (m, kk): (usize, usize),
    gated: bool,
    together: bool,
    seed: u64,
) -> wgrad::Result<usize> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
    let raws: Vec<Vec<u8>> = rows.iter().map(|&n| random_blocks(&mut r, format, n, kk)).collect();
    let packed = raws
        .iter()
        .zip(rows)
        .map(|(raw, &n)| pack_quantized(format, raw, n, kk))
        .collect::<wgrad::Result<Vec<_>>>()?;
    let n: usize = if gated { rows[0] } else { rows.iter().sum() };
    let (a, c) = (k.upload(&a_host)?, k.upload(&vec![f32::NAN; m * n])?);
    let mut arena = Vec::new();
    let mut offsets = Vec::new();
    for words in &packed {
        offsets.push(arena.len());
        arena.extend_from_slice(words);
        arena.resize(arena.len().next_multiple_of(64), 0);
    }
    let (joint, apart) = (
        k.upload(&arena)?,
        packed.iter().map(|w| k.upload(w)).collect::<wgrad::Result<Vec<_>>>()?,
    );
    let views = if together {
        offsets
            .iter()
            .zip(&packed)
            .map(|(&at, words)| joint.slice(at, words.len()))
            .collect::<wgrad::Result<Vec<_>>>()?
    } else {
        apart.iter().map(|t| t.view()).collect()
    };
    let parts = views
        .into_iter()
        .zip(rows)
        .map(|(v, &n)| QuantView::new(v, format, n, kk))
        .collect::<wgrad::Result<Vec<_>>>()?;
    let n = if gated { rows[0] } else { rows.iter().sum() };
    let request = MatmulRequest::new(MatmulForm::ABt, m, n, kk);
    let d = k.matmul(
        &request,
        c.view(),
        a.view(),
        MatmulOperand::QuantParts { parts: &parts, gated },
    )?;
    k.run(&[&d])?;
    let twin_parts: Vec<(&[u8], usize)> = raws.iter().map(Vec::as_slice).zip(rows.iter().copied()).collect();
    let want = cpu::matmul_quant_parts(&a_host, format, &twin_parts, m, kk, gated)?;
    let what = format!(
        "{} {format:?} m={m} rows={rows:?} k={kk} gated={gated} together={together}, GPU shaping {}",
        d.kernel().entry,
        k.gpu_shaped()
    );
    assert_close(&what, &read(k, &c)?, &want, ATOL, RTOL);
    Ok(d.launches())
}

/// A product over several quantized matrices side by side (q, k and v)
/// and a gated one (SwiGLU's gate and up) against the per-matrix twin:
/// one launch for decode's rows (1 and 4) when the matrices lie in one
/// buffer — except gated on a GPU's kernel, two — and one per matrix (or
/// two gated) for 5 rows or matrices in separate buffers; 1 to 4 matrices
/// of 1, prime and SmolLM2-like (9 : 3 : 3 heads) rows (240 and 67: two
/// workgroups of the columns kernel's 128 and of the gated one's 64),
/// k of 1 and 18 blocks.
#[test]
fn quantized_parts_match_the_cpu() {
    for_each_shaping("quantized weights: parts", |k| {
        let mut seed = 3100;
        // A pipeline per (format, kernel and row bucket by m, gated, one
        // launch or one per part); the format decodes blocks the same way
        // whichever parts, gating and launches it serves, so it varies with
        // (m, gated, together) as a Latin square: each format meets each m,
        // gating and launching, and every shape runs on each pipeline it
        // compiles, without the product of formats and pipelines.
        for kk in [32, 576] {
            for (rows, gated) in [
                (&[1][..], false),
                (&[5, 1, 37, 2], false),
                (&[144, 48, 48], false),
                (&[1, 1], true),
                (&[67, 67], true),
            ] {
                for (m_index, m) in [1, MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, QUANT_ROWS_MAX_ROWS + 1]
                    .into_iter()
                    .enumerate()
                {
                    for together in [true, false] {
                        let format = LEGACY[(m_index + usize::from(gated) + usize::from(together)) % 3];
                        seed += 1;
                        let launches = check_parts(k, format, rows, (m, kk), gated, together, seed)?;
                        // A CPU adapter's rows kernel takes up to 16 rows.
                        let matvec_rows = if k.gpu_shaped() {
                            MATVEC_MAX_ROWS
                        } else {
                            QUANT_ROWS_MAX_ROWS
                        };
                        let one = together && m <= matvec_rows && !(gated && k.gpu_shaped());
                        let per_part = if gated { 2 } else { rows.len() };
                        assert_eq!(
                            launches,
                            if one { 1 } else { per_part },
                            "{format:?} rows {rows:?} m={m} k={kk} together={together}"
                        );
                    }
                }
            }
        }
        // Matrices of different formats or widths, a gated pair of unequal
        // rows, five matrices: refused.
        let words = k.upload(&vec![0u32; 4096])?;
        let q = |format: QuantFormat, rows: usize, cols: usize| {
            QuantView::new(
                words.slice(0, format.stored_words(rows * cols)).unwrap(),
                format,
                rows,
                cols,
            )
            .unwrap()
        };
        let (a, c) = (k.zeros(64)?, k.zeros(4096)?);
        for (parts, gated) in [
            (vec![q(QuantFormat::Q4_0, 2, 32), q(QuantFormat::Q4_1, 2, 32)], false),
            (vec![q(QuantFormat::Q8_0, 2, 32), q(QuantFormat::Q8_0, 2, 64)], false),
            (vec![q(QuantFormat::Q4_1, 2, 32), q(QuantFormat::Q4_1, 3, 32)], true),
            (vec![q(QuantFormat::Q4_1, 1, 32); 5], false),
        ] {
            let n = if gated {
                2
            } else {
                parts.iter().map(QuantView::rows).sum()
            };
            let err = k
                .matmul(
                    &MatmulRequest::new(MatmulForm::ABt, 2, n, 32),
                    c.slice(0, 2 * n)?,
                    a.slice(0, 64)?,
                    MatmulOperand::QuantParts { parts: &parts, gated },
                )
                .unwrap_err();
            assert!(matches!(err, Error::Shape { .. }), "{err}");
        }
        Ok(())
    });
}

#[test]
fn quantized_products_refuse_what_they_cannot_run() {
    for_each_adapter("quantized weights: refusals", |k| {
        // Rows of B must hold whole blocks (k = 33).
        let words = k.zeros(QuantFormat::Q8_0.stored_words(64))?;
        let err = QuantView::new(words.view(), QuantFormat::Q8_0, 2, 33).unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("multiple of 32"),
            "{err}"
        );
        let err = QuantView::new(words.view(), QuantFormat::Q4_0, 2, 32).unwrap_err();
        assert!(err.to_string().contains("words"), "{err}");
        let b = QuantView::new(words.view(), QuantFormat::Q8_0, 2, 32)?;
        let (a, c) = (k.zeros(5 * 32)?, k.zeros(5 * 2)?);
        // Five rows are past the matrix-vector kernel; shapes must agree;
        // training's epilogues are refused.
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 5, 2, 32)
                    .with_kernel(MatmulKernel::Quant(QuantWeightsKernel::Matvec { lanes: 8 })),
                c.view(),
                a.view(),
                b,
            )
            .unwrap_err();
        assert!(err.to_string().contains("m=5"), "{err}");
        let rows = if k.supports_quant_rows_subgroup() {
            QuantWeightsKernel::MatvecRowsSubgroup
        } else {
            QuantWeightsKernel::MatvecRows
        };
        let (five, decode) = if k.gpu_shaped() {
            (
                QuantWeightsKernel::Tiled,
                QuantWeightsKernel::Matvec {
                    lanes: k.matvec_lanes(),
                },
            )
        } else {
            (rows, rows)
        };
        assert_eq!(k.quant_weights_kernel_for(5, &a.view(), &b), five);
        assert_eq!(k.quant_weights_kernel_for(MATVEC_MAX_ROWS, &a.view(), &b), decode);
        let one = if k.gpu_shaped() {
            QuantWeightsKernel::Matvec {
                lanes: k.matvec_lanes(),
            }
        } else {
            QuantWeightsKernel::MatvecColumns
        };
        assert_eq!(k.quant_weights_kernel_for(1, &a.view(), &b), one);
        // Past the rows kernel's 16 rows: the tiled one, and refused by it.
        let (a17, c17) = (k.zeros(17 * 32)?, k.zeros(17 * 2)?);
        assert_eq!(
            k.quant_weights_kernel_for(17, &a17.view(), &b),
            QuantWeightsKernel::Tiled
        );
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 17, 2, 32)
                    .with_kernel(MatmulKernel::Quant(QuantWeightsKernel::MatvecRows)),
                c17.view(),
                a17.view(),
                b,
            )
            .unwrap_err();
        assert!(err.to_string().contains("m=17"), "{err}");
        // The subgroup kernel without 8-lane subgroups: refused by name.
        if !k.supports_quant_rows_subgroup() {
            let err = k
                .matmul(
                    &MatmulRequest::new(MatmulForm::ABt, 5, 2, 32)
                        .with_kernel(MatmulKernel::Quant(QuantWeightsKernel::MatvecRowsSubgroup)),
                    c.view(),
                    a.view(),
                    b,
                )
                .unwrap_err();
            assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        }
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 5, 2, 32)
                    .with_kernel(MatmulKernel::Quant(QuantWeightsKernel::MatvecColumns)),
                c.view(),
                a.view(),
                b,
            )
            .unwrap_err();
        assert!(err.to_string().contains("m=5"), "{err}");
        let err = k
            .matmul(&MatmulRequest::new(MatmulForm::ABt, 5, 2, 64), c.view(), a.view(), b)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("k=64"),
            "{err}"
        );
        let accumulate = MatmulEpilogue {
            accumulate: true,
            ..MatmulEpilogue::default()
        };
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 5, 2, 32).with_epilogue(accumulate),
                c.view(),
                a.view(),
                b,
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        Ok(())
    });
}

#[test]
fn quantized_embedding_matches_the_cpu() {
    for_each_adapter("quantized weights: embedding", |k| {
        for format in LEGACY {
            // (n, vocab, channels): one of each, a prime vocabulary, more
            // outputs than a workgroup, SmolLM2's 576 channels.
            for (case, &(n, vocab, channels)) in [(1, 1, 32), (5, 7, 96), (40, 11, 64), (3, 50, 576)].iter().enumerate()
            {
                let mut r = rng(2700 + case as u64);
                let raw = random_blocks(&mut r, format, vocab, channels);
                let mut ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
                // An id past the vocabulary gives a row of NaN, as in f32.
                ids[n - 1] = vocab as u32 + 3;
                let words = k.upload(&pack_quantized(format, &raw, vocab, channels)?)?;
                let (i, out) = (k.upload(&ids)?, k.zeros(n * channels)?);
                let table = QuantView::new(words.view(), format, vocab, channels)?;
                k.run(&[&k.embedding_quant_weights(out.view(), table, i.view(), n)?])?;
                // Exact: each value is q·d (+ m) rounded once, on both sides
                // (q·d is exact in f32: ≤ 8 bits times an f16).
                let want = cpu::embedding_quant_weights(format, &raw, &ids, vocab, channels)?;
                assert_close(
                    &format!("embedding {format:?} n={n} vocab={vocab} channels={channels}"),
                    &read(k, &out)?,
                    &want,
                    0.0,
                    0.0,
                );
            }
        }
        // Scales and minimums at f16's edges, which the kernels widen by
        // bit operations: subnormal, zero, negative, the largest finite.
        let halves = [
            (f16::from_bits(0x0001), f16::from_bits(0x8201)),
            (f16::ZERO, f16::NEG_ZERO),
            (f16::from_f32(-0.75), f16::from_f32(3.0)),
            (f16::MAX, f16::MIN),
        ];
        let mut raw = Vec::new();
        for (i, (d, m)) in halves.iter().enumerate() {
            raw.extend(d.to_le_bytes().into_iter().chain(m.to_le_bytes()));
            raw.extend((0..16).map(|j| (17 * (i + j)) as u8));
        }
        let ids = [0, 1, 2, 3];
        let words = k.upload(&pack_quantized(QuantFormat::Q4_1, &raw, 4, 32)?)?;
        let (i, out) = (k.upload(&ids)?, k.zeros(4 * 32)?);
        k.run(&[&k.embedding_quant_weights(
            out.view(),
            QuantView::new(words.view(), QuantFormat::Q4_1, 4, 32)?,
            i.view(),
            4,
        )?])?;
        // Exact, as above (f16::MAX · 15 + f16::MIN is finite in f32).
        assert_close(
            "embedding at f16's edges",
            &read(k, &out)?,
            &cpu::embedding_quant_weights(QuantFormat::Q4_1, &raw, &ids, 4, 32)?,
            0.0,
            0.0,
        );
        Ok(())
    });
}

#[test]
fn quantized_weights_over_small_bindings_equal_the_twins() {
    for_each_adapter("quantized weights: split bindings", |k| {
        // 1 KiB bindings: 256 words, so B and the table take several
        // launches (Q8_0 at k = 32: 32 rows a part).
        // A part may start up to one offset alignment before its first
        // word, so the limit grows with the alignment to keep 256 words a
        // part (WebGPU's 256-byte alignment included).
        let align = u64::from(k.device().limits().min_storage_buffer_offset_alignment);
        let limit = 1024 + align.saturating_sub(4);
        let lim = limited_kernels(
            k,
            LimitOverrides {
                max_storage_buffer_binding_size: Some(limit),
                ..LimitOverrides::default()
            },
        );
        for (i, &(kernel, format, store, shape)) in [
            (
                QuantWeightsKernel::Matvec { lanes: 8 },
                QuantFormat::Q8_0,
                Store::Plain,
                (1, 300, 32),
            ),
            (
                QuantWeightsKernel::Matvec { lanes: 8 },
                QuantFormat::Q4_1,
                Store::Bias,
                (2, 150, 64),
            ),
            (
                QuantWeightsKernel::MatvecColumns,
                QuantFormat::Q4_0,
                Store::BiasGeluPre,
                (1, 200, 32),
            ),
            (
                QuantWeightsKernel::MatvecRows,
                QuantFormat::Q8_0,
                Store::BiasGeluPre,
                (6, 40, 32),
            ),
            (
                QuantWeightsKernel::Tiled,
                QuantFormat::Q4_0,
                Store::BiasGeluPre,
                (3, 100, 64),
            ),
            (QuantWeightsKernel::Tiled, QuantFormat::Q8_0, Store::Bias, (2, 200, 32)),
        ]
        .iter()
        .enumerate()
        {
            let (_, launches) = check_product(&lim, Some(kernel), format, store, shape, 2800 + i as u64)?;
            assert!(launches > 1, "{kernel:?} {format:?} {shape:?} ran in one launch");
        }
        if lim.supports_quant_rows_subgroup() {
            let (_, launches) = check_product(
                &lim,
                Some(QuantWeightsKernel::MatvecRowsSubgroup),
                QuantFormat::Q8_0,
                Store::Bias,
                (7, 36, 32),
                2809,
            )?;
            assert!(launches > 1, "the subgroup rows kernel ran in one launch");
        }
        // 7 ids of 32 channels: the output fits one binding.
        let (vocab, channels) = (100, 32);
        for format in LEGACY {
            let mut r = rng(2810);
            let raw = random_blocks(&mut r, format, vocab, channels);
            let ids: Vec<u32> = (0..5)
                .map(|_| r.random_range(0..vocab as u32))
                .chain([0, vocab as u32 - 1])
                .collect();
            let words = lim.upload(&pack_quantized(format, &raw, vocab, channels)?)?;
            let (i, out) = (lim.upload(&ids)?, lim.zeros(ids.len() * channels)?);
            let d = lim.embedding_quant_weights(
                out.view(),
                QuantView::new(words.view(), format, vocab, channels)?,
                i.view(),
                ids.len(),
            )?;
            assert!(d.launches() > 1, "the table in one launch");
            lim.run(&[&d])?;
            // A copy: exact (see quantized_embedding_matches_the_cpu).
            assert_close(
                &format!("split embedding {format:?}"),
                &read(&lim, &out)?,
                &cpu::embedding_quant_weights(format, &raw, &ids, vocab, channels)?,
                0.0,
                0.0,
            );
        }
        // What cannot split is a clear error: the activations, a row of B.
        let words = lim.zeros(QuantFormat::Q8_0.stored_words(2 * 1024))?;
        let b = QuantView::new(words.view(), QuantFormat::Q8_0, 2, 1024)?;
        let (a, c) = (lim.zeros(1024)?, lim.zeros(2)?);
        let err = lim
            .matmul(&MatmulRequest::new(MatmulForm::ABt, 1, 2, 1024), c.view(), a.view(), b)
            .unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. }) && err.to_string().contains("activations"),
            "{err}"
        );
        let words = lim.zeros(QuantFormat::Q8_0.stored_words(2048))?;
        let table = QuantView::new(words.view(), QuantFormat::Q8_0, 1, 2048)?;
        let (ids, out) = (lim.zeros(1)?, lim.zeros(2048)?);
        let err = lim
            .embedding_quant_weights(out.view(), table, ids.view(), 1)
            .unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. }) && err.to_string().contains("one row"),
            "{err}"
        );
        Ok(())
    });
}

/// A graph with quantized parameters: a Linear over a token embedding,
/// both quantized (the table in Q8_0, the weight in Q4_1), on the GPU
/// against `Graph::evaluate_f64` (the twins); refused by every other op
/// and by training.
/// Generation's fused graph ops against the graph's f64 reference: q, k
/// and v as one product (`matmul_quant_parts`) whose row, seen as heads,
/// rotates its q and k heads only (`rope_heads`; the v heads pass
/// through), and a gated product; for a decode row (one launch) and 5 rows
/// (one launch per matrix), at positions 3.. of a 16-position table.
#[test]
fn fused_generation_ops_match_the_graph_reference() {
    use wgrad::graph::{Executor, Graph};
    use wgrad::nn::RopeLayout;
    let (channels, head_dim, heads, kv_heads, hidden) = (64, 8, 4, 2, 40);
    for (rows, seed) in [(1, 3300), (5, 3301)] {
        let mut r = rng(seed);
        let mut g = Graph::new();
        let x = g.input("x", &[rows, channels]).unwrap();
        let starts = g.ids("starts", &[1]).unwrap();
        let mut weight = |g: &mut Graph, name: &str, n: usize| {
            let raw = random_blocks(&mut r, QuantFormat::Q4_1, n, channels);
            g.parameter_quantized(name, &[n, channels], QuantFormat::Q4_1, &raw)
                .unwrap()
        };
        let qkv_weights = [
            weight(&mut g, "q", heads * head_dim),
            weight(&mut g, "k", kv_heads * head_dim),
            weight(&mut g, "v", kv_heads * head_dim),
        ];
        let gate_up = [weight(&mut g, "gate", hidden), weight(&mut g, "up", hidden)];
        let qkv = g.matmul_quant_parts(x, &qkv_weights, false).unwrap();
        let as_heads = g.reshape(qkv, &[1, rows, heads + 2 * kv_heads, head_dim]).unwrap();
        let rotated = g
            .rope_heads(
                as_heads,
                Some(starts),
                RopeLayout::HalfSplit,
                10000.0,
                head_dim,
                16,
                heads + kv_heads,
            )
            .unwrap();
        let gated = g.matmul_quant_parts(x, &gate_up, true).unwrap();
        let err = g
            .rope_heads(
                as_heads,
                Some(starts),
                RopeLayout::HalfSplit,
                10000.0,
                head_dim,
                16,
                heads + 2 * kv_heads + 1,
            )
            .unwrap_err();
        assert!(err.to_string().contains("rotated heads"), "{err}");
        let x_h = random_vec(&mut r, rows * channels, -1.0, 1.0);
        let feeds = [
            (x, x_h.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>()),
            (starts, vec![3.0]),
        ];
        let want = g.evaluate_f64(&[qkv, rotated, gated], &feeds).unwrap();
        for_each_adapter("quantized weights: fused generation ops", |k| {
            let mut exec = Executor::new(k.clone(), g.clone(), &[qkv, rotated, gated], None, None)?;
            exec.set_input(x, &x_h)?;
            exec.set_labels(starts, &[3])?;
            exec.run(&[qkv, rotated, gated])?;
            let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
            // Products as quantized_products_match_the_cpu_on_each_kernel;
            // the rotation's f32 cos/sin against f64.
            assert_close(
                &format!("qkv, {rows} rows"),
                &exec.read(qkv)?,
                &f32s(&want[0]),
                ATOL,
                RTOL,
            );
            assert_close(
                &format!("rotated q and k heads, {rows} rows"),
                &exec.read(rotated)?,
                &f32s(&want[1]),
                ATOL,
                RTOL,
            );
            assert_close(
                &format!("gated, {rows} rows"),
                &exec.read(gated)?,
                &f32s(&want[2]),
                ATOL,
                RTOL,
            );
            Ok(())
        });
    }
}

#[test]
fn a_graph_with_quantized_parameters_matches_its_reference() {
    use wgrad::graph::{Executor, Graph};
    let (vocab, channels, out, tokens) = (11, 64, 37, 7);
    let mut r = rng(2900);
    let table_raw = random_blocks(&mut r, QuantFormat::Q8_0, vocab, channels);
    let weight_raw = random_blocks(&mut r, QuantFormat::Q4_1, out, channels);
    let ids_h: Vec<u32> = (0..tokens).map(|_| r.random_range(0..vocab as u32)).collect();
    let mut g = Graph::new();
    let ids = g.ids("ids", &[1, tokens]).unwrap();
    let table = g
        .parameter_quantized("wte", &[vocab, channels], QuantFormat::Q8_0, &table_raw)
        .unwrap();
    let w = g
        .parameter_quantized("proj.weight", &[out, channels], QuantFormat::Q4_1, &weight_raw)
        .unwrap();
    let x = g.embedding(table, ids).unwrap();
    let y = g.rows_matmul(wgrad::kernels::MatmulForm::ABt, x, w).unwrap();
    // The tied head: the same table as an ABt's B.
    let logits = g.rows_matmul(wgrad::kernels::MatmulForm::ABt, x, table).unwrap();
    // Only a product's B (ABt, or AB: a frozen weight's backward) and the
    // table read them; k = 33 is refused.
    let err = g.add(w, w).unwrap_err();
    assert!(err.to_string().contains("Q4_1"), "{err}");
    let err = g.matmul_form(wgrad::kernels::MatmulForm::AtB, x, w).unwrap_err();
    assert!(err.to_string().contains("quantized"), "{err}");
    let err = g
        .parameter_quantized("odd", &[2, 33], QuantFormat::Q8_0, &[0; 68])
        .unwrap_err();
    assert!(err.to_string().contains("multiple of 32"), "{err}");
    let feeds = [(ids, ids_h.iter().map(|&i| f64::from(i)).collect::<Vec<f64>>())];
    let want = g.evaluate_f64(&[x, y, logits], &feeds).unwrap();
    for_each_adapter("quantized weights: graph", |k| {
        let mut exec = Executor::new(k.clone(), g.clone(), &[x, y, logits], None, None)?;
        exec.set_labels(ids, &ids_h)?;
        exec.run(&[x, y, logits])?;
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        // The lookup is exact (see quantized_embedding_matches_the_cpu);
        // the products as quantized_products_match_the_cpu_on_each_kernel.
        assert_close("graph embedding", &exec.read(x)?, &f32s(&want[0]), 0.0, 0.0);
        assert_close("graph Linear", &exec.read(y)?, &f32s(&want[1]), ATOL, RTOL);
        assert_close("graph tied head", &exec.read(logits)?, &f32s(&want[2]), ATOL, RTOL);
        // The weights take their packed words, not f32 values.
        let words = (
            QuantFormat::Q8_0.stored_words(vocab * channels),
            QuantFormat::Q4_1.stored_words(out * channels),
        );
        assert!(
            exec.plan().param_arena_len < words.0 + words.1 + 2 * 64,
            "arena of {} words",
            exec.plan().param_arena_len
        );
        let err = exec.read(w).unwrap_err();
        assert!(err.to_string().contains("Q4_1"), "{err}");
        // Their words are not f32 values: the host copies leave them out.
        assert!(exec.parameters()?.is_empty(), "quantized parameters read as f32");
        // Training refuses them unless frozen (in backward, or in the executor).
        let mut train = g.clone();
        let loss = train.mean(y)?;
        let err = match train.backward(loss) {
            Ok(grads) => Executor::new(k.clone(), train, &[loss], Some(grads), None).unwrap_err(),
            Err(e) => e,
        };
        assert!(err.to_string().contains("quantized"), "{err}");
        Ok(())
    });
}

/// A Llama generator whose projections, head and token table are stored
/// quantized (`Generator::new_with_weights`, the path a GGUF file takes)
/// against the f32 generator on the same weights decoded: both hold the
/// same values, so they differ only by the f32 rounding of the sums (the
/// quantized kernels scale each block's sum of integer products).
#[test]
fn a_quantized_llama_generator_equals_an_f32_one_on_the_decoded_weights() {
    for_each_adapter("quantized weights: Llama generator", |k| {
        for tied in [true, false] {
            check_quantized_llama(k, &LEGACY, (64, 96, 2), tied)?;
        }
        Ok(())
    });
}

/// The same with the weights in the formats a `Q4_K_M` file mixes (Q4_K,
/// Q6_K, Q5_0 and Q8_0, one per matrix in turn, so q, k and v differ and
/// take one product each), 256 channels (a k-quant row is whole
/// super-blocks).
#[test]
fn a_k_quant_llama_generator_equals_an_f32_one_on_the_decoded_weights() {
    let formats = [
        QuantFormat::Q4_K,
        QuantFormat::Q6_K,
        QuantFormat::Q5_0,
        QuantFormat::Q8_0,
    ];
    for_each_adapter("quantized weights: k-quant Llama generator", |k| {
        check_quantized_llama(k, &formats, (256, 512, 1), true)
    });
}

/// One model of the quantized Llama generator tests: (channels, MLP width,
/// layers), its matrices in `formats` in turn.
fn check_quantized_llama(
    k: &std::sync::Arc<Kernels>,
    formats: &[QuantFormat],
    (n_embd, intermediate_size, n_layer): (usize, usize, usize),
    tied: bool,
) -> wgrad::Result<()> {
    use std::collections::HashMap;
    use std::sync::Arc;
    use wgrad::infer::generate::{Generator, WeightDtype};
    use wgrad::models::{Llama, LlamaConfig};
    use wgrad::nn::{Module, QuantizedMatrix};
    // Logits of order 1–10 after two layers: 1e-3 absolute and relative
    // (the product tolerance above, grown through the layers).
    const LLAMA_ATOL: f32 = 1e-3;
    const LLAMA_RTOL: f32 = 1e-3;
    let config = LlamaConfig {
        vocab_size: 37,
        block_size: 13,
        n_layer,
        n_head: 2,
        n_kv_head: 1,
        n_embd,
        intermediate_size,
        tie_word_embeddings: tied,
        ..LlamaConfig::small(37)
    };
    let mut r = rng(2950);
    let mut quantized = HashMap::new();
    let mut formats = formats.iter().cycle();
    let model = Llama::from_parameters(config, |name, shape| {
        let &[rows, cols] = shape else {
            return Ok(vec![1.0; shape.iter().product()]);
        };
        let format = *formats.next().expect("cycles");
        let raw = random_blocks(&mut r, format, rows, cols);
        let values = cpu::dequantize(format, &raw)?;
        quantized.insert(
            name.to_string(),
            QuantizedMatrix {
                format,
                raw: raw.into(),
            },
        );
        Ok(values)
    })?;
    assert_eq!(
        quantized.len(),
        model.named_parameters().iter().filter(|(_, s)| s.len() == 2).count()
    );
    let mut quant = Generator::new_with_weights(k.clone(), &model, 1, WeightDtype::F32, Arc::new(quantized))?;
    let mut reference = Generator::new(k.clone(), &model, 1)?;
    let (small, full) = (
        quant.executor().plan().param_arena_len,
        reference.executor().plan().param_arena_len,
    );
    assert!(
        small * 3 < full,
        "tied {tied}: quantized arena {small} words against f32 {full}"
    );
    let sequence: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 37).collect();
    assert_close(
        &format!("tied {tied}: prefill"),
        &quant.prefill(&[&sequence[..4]])?,
        &reference.prefill(&[&sequence[..4]])?,
        LLAMA_ATOL,
        LLAMA_RTOL,
    );
    for &token in &sequence[4..] {
        assert_close(
            &format!("tied {tied}: decode {token}"),
            &quant.decode(&[token])?,
            &reference.decode(&[token])?,
            LLAMA_ATOL,
            LLAMA_RTOL,
        );
    }
    Ok(())
}

/// The formats after Q4_1 in the kernels' layout: any bytes at all (every
/// bit pattern is a block) round trip through `pack_quantized` and
/// `unpack_quantized`, and a k-quant row must be whole super-blocks.
#[test]
fn new_formats_pack_round_trip() {
    let mut r = rng(2501);
    for format in NEW {
        let (rows, cols) = (3, 2 * format.super_block());
        let blocks = rows * cols / format.super_block();
        let any: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| r.random()).collect();
        for raw in [any, random_blocks(&mut r, format, rows, cols)] {
            let words = pack_quantized(format, &raw, rows, cols).unwrap();
            assert_eq!(words.len(), format.stored_words(rows * cols), "{format:?}");
            assert_eq!(unpack_quantized(format, &words, rows, cols).unwrap(), raw, "{format:?}");
        }
    }
    let err = pack_quantized(QuantFormat::Q4_K, &[0; 144], 1, 128).unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("multiple of 256"),
        "{err}"
    );
    let err = pack_quantized(QuantFormat::Q6_K, &[0; 209], 1, 256).unwrap_err();
    assert!(err.to_string().contains("209 bytes"), "{err}");
}

/// Each format after Q4_1 on each kernel against its twin (which decodes
/// with the bit-exact decoders): k of one GGUF block and three (a k-quant:
/// 8 and 24 blocks of 32), n of 1 and a prime, m of 1 (decode), 2 (the
/// other adapters' matrix-vector kernels and the tiled one) and 5; the
/// epilogue one per format (it does not depend on the format). Tolerance
/// as the products above (the weights are within about ±1 likewise).
#[test]
fn new_format_products_match_the_cpu_on_each_kernel() {
    for_each_adapter("quantized weights: new formats", |k| {
        for (i, format) in NEW.into_iter().enumerate() {
            let store = [Store::Plain, Store::Bias, Store::BiasGeluPre][i % 3];
            let mut others = vec![QuantWeightsKernel::Tiled];
            if k.gpu_shaped() {
                others.extend([QuantWeightsKernel::MatvecColumns, QuantWeightsKernel::MatvecRows]);
            } else {
                others.push(QuantWeightsKernel::Matvec { lanes: 8 });
                if k.supports_quant_rows_subgroup() {
                    others.push(QuantWeightsKernel::MatvecRows);
                }
            }
            for kk in [format.super_block(), 3 * format.super_block()] {
                for n in [1, 37] {
                    let seed = 4000 + 10 * i as u64 + (kk + n) as u64;
                    for m in [1, 5] {
                        check_product(k, None, format, store, (m, n, kk), seed + m as u64)?;
                    }
                    for &kernel in &others {
                        check_product(k, Some(kernel), format, store, (2, n, kk), seed)?;
                    }
                }
            }
        }
        Ok(())
    });
}

/// q, k and v in a k-quant (and gate and up) as one product, the parts
/// packed into one buffer as the parameter arena packs them: the
/// matrix-vector kernels find each part's side words (2 or 3 a block) from
/// its own start.
#[test]
fn new_format_parts_match_the_cpu() {
    for_each_shaping("quantized weights: new format parts", |k| {
        for (i, format) in [QuantFormat::Q4_K, QuantFormat::Q6_K, QuantFormat::Q5_0]
            .into_iter()
            .enumerate()
        {
            let kk = 2 * format.super_block();
            let seed = 4200 + 4 * i as u64;
            assert_eq!(
                check_parts(k, format, &[5, 1, 37], (1, kk), false, true, seed)?,
                1,
                "{format:?}"
            );
            let gated = check_parts(k, format, &[67, 67], (1, kk), true, true, seed + 1)?;
            assert_eq!(gated, if k.gpu_shaped() { 2 } else { 1 }, "{format:?} gated");
            check_parts(k, format, &[3, 7], (MATVEC_MAX_ROWS + 1, kk), false, true, seed + 2)?;
        }
        Ok(())
    });
}

/// The lookup from a table in each format after Q4_1, over one binding and
/// split over small ones (4 KiB: 3 ids' output fits, the table takes
/// several launches). Exact: a value is q·(d·s) + m on both sides with
/// d·s, its product with q and dmin·m each exact in f32 (at most 11 + 8 +
/// 6 significant bits), so only the sum rounds, once, as the twin's.
#[test]
fn new_format_embedding_matches_the_cpu() {
    for_each_adapter("quantized weights: new format embedding", |k| {
        let align = u64::from(k.device().limits().min_storage_buffer_offset_alignment);
        let limit = 4096 + align.saturating_sub(4);
        let limits = LimitOverrides {
            max_storage_buffer_binding_size: Some(limit),
            ..LimitOverrides::default()
        };
        let lim = limited_kernels(k, limits);
        for (i, format) in NEW.into_iter().enumerate() {
            let (vocab, channels) = (61, 256);
            let mut r = rng(4300 + i as u64);
            let raw = random_blocks(&mut r, format, vocab, channels);
            let mut ids: Vec<u32> = (0..9).map(|_| r.random_range(0..vocab as u32)).collect();
            // The last row, and ids past the vocabulary (rows of NaN).
            (ids[0], ids[2], ids[8]) = (vocab as u32 - 1, vocab as u32 + 3, vocab as u32);
            for (kernels, n, split) in [(k, 9, false), (&lim, 3, true)] {
                let ids = &ids[..n];
                let want = cpu::embedding_quant_weights(format, &raw, ids, vocab, channels)?;
                let words = kernels.upload(&pack_quantized(format, &raw, vocab, channels)?)?;
                let (i, out) = (kernels.upload(ids)?, kernels.zeros(n * channels)?);
                let table = QuantView::new(words.view(), format, vocab, channels)?;
                let d = kernels.embedding_quant_weights(out.view(), table, i.view(), n)?;
                assert_eq!(d.launches() > 1, split, "{format:?}");
                kernels.run(&[&d])?;
                assert_close(
                    &format!("embedding {format:?} split {split}"),
                    &read(kernels, &out)?,
                    &want,
                    0.0,
                    0.0,
                );
            }
        }
        Ok(())
    });
}

/// One transposed product C[m, n] = A[m, k]·B[k, n] (`matmul_quant_transposed`,
/// a frozen weight's backward dX = dY·W with B stored [k, n] as its rows)
/// against the twin, C holding `start` before (added to with `accumulate`,
/// overwritten without); returns the launches.
fn check_transposed(
    k: &Kernels,
    format: QuantFormat,
    (m, n, kk): (usize, usize, usize),
    accumulate: bool,
    seed: u64,
) -> wgrad::Result<usize> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
    let raw = random_blocks(&mut r, format, kk, n);
    let start = random_vec(&mut r, m * n, -1.0, 1.0);
    let words = k.upload(&pack_quantized(format, &raw, kk, n)?)?;
    let (a, c) = (k.upload(&a_host)?, k.upload(&start)?);
    let request = MatmulRequest::new(MatmulForm::AB, m, n, kk).accumulating(accumulate);
    let d = k.matmul(
        &request,
        c.view(),
        a.view(),
        QuantView::new(words.view(), format, kk, n)?,
    )?;
    assert_eq!(d.kernel().entry, "matmul_quant_transposed");
    k.run(&[&d])?;
    let mut want = cpu::matmul_quant_transposed(&a_host, format, &raw, m, n, kk)?;
    if accumulate {
        want.iter_mut().zip(&start).for_each(|(w, s)| *w += s);
    }
    let what = format!("matmul_quant_transposed {format:?} m={m} n={n} k={kk} accumulate={accumulate}");
    // Sums of ≤ 131 products of values in [-1, 1] with weights within
    // about ±1, each weight decoded alone (q·d + m, one rounding) before
    // its multiply-add: f32 against the twin's f64, as the forward's.
    assert_close(&what, &read(k, &c)?, &want, ATOL, RTOL);
    Ok(d.launches())
}

/// The transposed product on every format, at 1, prime and
/// non-multiple-of-64 rows (C's and A's, past a 64-row tile and its
/// 8-row invocations), 1 and prime rows of B (the sum: one step, 37 steps,
/// 131 over more than two tiles' worth), and C's columns one block, three
/// (not a whole 64-column tile) and a k-quant's super-block and more;
/// accumulating and not.
#[test]
fn transposed_quantized_products_match_the_cpu() {
    for_each_adapter("quantized weights: transposed products", |k| {
        let mut case = 0u64;
        for format in QuantFormat::ALL {
            let block = format.super_block();
            let widths = if block == QuantFormat::BLOCK {
                vec![32, 96, 320]
            } else {
                vec![block, 2 * block]
            };
            for (i, &n) in widths.iter().enumerate() {
                for (j, &(m, kk)) in [(1, 1), (7, 37), (67, 131)].iter().enumerate() {
                    case += 1;
                    // Accumulation on some (format, shape) pairs: the
                    // override is one line of the store, whatever the shape.
                    let accumulate = (i + j) % 2 == 1;
                    check_transposed(k, format, (m, n, kk), accumulate, 3100 + case)?;
                }
            }
        }
        Ok(())
    });
}

/// A B larger than one binding sums its rows over several launches, each
/// after the first adding into C: equal to the twin; A or C over one
/// binding, a row of B over one, an epilogue, a batch or another kernel
/// are refused.
#[test]
fn transposed_quantized_products_split_and_refuse() {
    for_each_adapter("quantized weights: transposed split and refusals", |k| {
        // 1 KiB bindings (grown by the offset alignment, as in
        // quantized_weights_over_small_bindings_equal_the_twins): B of
        // Q8_0 [100, 32] is 900 words, 28 rows a launch; Q4_K [9, 256]
        // 432 words, 5 rows a launch. A and C fit (C of Q4_K: one row).
        let align = u64::from(k.device().limits().min_storage_buffer_offset_alignment);
        let lim = limited_kernels(
            k,
            LimitOverrides {
                max_storage_buffer_binding_size: Some(1024 + align.saturating_sub(4)),
                ..LimitOverrides::default()
            },
        );
        assert!(check_transposed(&lim, QuantFormat::Q8_0, (2, 32, 100), false, 3300)? > 1);
        assert!(check_transposed(&lim, QuantFormat::Q4_K, (1, 256, 9), true, 3301)? > 1);
        let words = k.zeros(QuantFormat::Q8_0.stored_words(1024))?;
        let b = QuantView::new(words.view(), QuantFormat::Q8_0, 2, 512)?;
        // C [1, 512] (2 KiB) over the 1 KiB binding.
        let (a, c) = (k.zeros(2)?, k.zeros(512)?);
        let err = lim
            .matmul(&MatmulRequest::new(MatmulForm::AB, 1, 512, 2), c.view(), a.view(), b)
            .unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. }) && err.to_string().contains("does not split"),
            "{err}"
        );
        let (a, c) = (k.zeros(3 * 2)?, k.zeros(3 * 512)?);
        // B must be [k, n] = [2, 512]: k = 3 is refused.
        let err = k
            .matmul(&MatmulRequest::new(MatmulForm::AB, 2, 512, 3), c.view(), a.view(), b)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("k=3"),
            "{err}"
        );
        let (a, c) = (k.zeros(3 * 2)?, k.zeros(3 * 512)?);
        let bias = k.zeros(512)?;
        let refused = [
            MatmulRequest::new(MatmulForm::AB, 3, 512, 2).with_bias(bias.view()),
            MatmulRequest::new(MatmulForm::AB, 3, 512, 2).with_batch(1),
            MatmulRequest::new(MatmulForm::AB, 3, 512, 2).with_kernel(MatmulKernel::Quant(QuantWeightsKernel::Tiled)),
            MatmulRequest::new(MatmulForm::AtB, 3, 512, 2),
        ];
        for request in refused {
            let err = k.matmul(&request, c.view(), a.view(), b).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{request:?}: {err}");
        }
        Ok(())
    });
}

/// The gradient through a frozen quantized weight, d loss / d x of
/// y = x·Wᵀ: the backward's transposed product against f64 central
/// differences (`common::gradcheck`: x is the only trainable parameter),
/// on a legacy format, a 5-bit one and a k-quant, 1 and prime rows and
/// columns (x [m, in], W [out, in]).
#[test]
fn gradients_through_frozen_quantized_weights_match_central_differences() {
    use common::{gradcheck, mse_to_random, param};
    use wgrad::graph::Graph;
    for_each_adapter("quantized weights: gradcheck", |k| {
        let cases = [
            (QuantFormat::Q4_1, 1, 37, 64),
            (QuantFormat::Q5_0, 7, 1, 32),
            (QuantFormat::Q4_K, 5, 3, 256),
        ];
        for (i, &(format, m, out, inn)) in cases.iter().enumerate() {
            let raw = random_blocks(&mut rng(3400 + i as u64), format, out, inn);
            let mut g = Graph::new();
            let x = param(&mut g, "x", &[m, inn], 3410 + i as u64);
            let w = g.parameter_quantized("w", &[out, inn], format, &raw)?;
            g.freeze(w)?;
            let y = g.matmul_form(MatmulForm::ABt, x, w)?;
            let (loss, feeds) = mse_to_random(&mut g, y, 3420 + i as u64)?;
            gradcheck(k, &format!("x·Wᵀ, W {format:?} [{out}, {inn}]"), g, loss, feeds, vec![])?;
        }
        Ok(())
    });
}
