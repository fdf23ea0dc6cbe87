//! `f16_weights.wgsl`: products with f32 activations and f16 weights
//! (matrix-vector, small, register-blocked and workgroup-memory tiles, the
//! last a GPU's choice tested here on the software adapters) and the lookup from
//! an f16 table, against their CPU twins, on every adapter with
//! SHADER_F16; split over small bindings; and `Error::Unsupported` where
//! the adapter lacks SHADER_F16 (llvmpipe through GL). Then a tiny GPT's
//! f16 generator against an f32 one on the same weights rounded to f16,
//! the fallback to f32 without SHADER_F16, and f16 parameters refused in
//! training. The twins take the
//! same f16 weights widened to f32 (exact), so what is left to tolerate is
//! the f32 summation order against the twins' f64, as for the f32 kernels.
//! Tolerance: `|gpu - cpu| <= atol + rtol·|cpu|`, beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, limited_kernels, random_vec, read, rng};
use half::f16;
use rand::Rng;
use wgrad::graph::{Executor, Graph};
use wgrad::infer::generate::{Generator, WeightDtype};
use wgrad::kernels::{Activation, F16WeightsKernel, LimitOverrides, MatmulEpilogue, MatmulForm, MATVEC_MAX_ROWS};
use wgrad::kernels::{MatmulKernel, MatmulOperand, MatmulRequest};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self};
use wgrad::{cpu, Error, Kernels};

/// What a case fuses into its store: decode's Linear layers take a bias
/// (and GELU for the MLP's first); the head takes nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Plain,
    Bias,
    /// Bias, GELU and the pre-activation kept.
    BiasGeluPre,
}

/// f32 sums of ≤ 768 products of values in [-1, 1] (sums of order 10)
/// against f64, then GELU (slope ≤ 1.13): as tests/suite/matvec.rs.
const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-5;

fn skip(k: &Kernels, test: &str) -> bool {
    if k.supports_f16() {
        return false;
    }
    eprintln!("SKIP {test} on {}: no SHADER_F16 (the Unsupported path is tested in f16_weights_are_unsupported_without_shader_f16)", k.device().label());
    true
}

/// Runs one product on `k` with `kernel` (the shape-selected one when
/// None) and checks C (and pre) against the twin; returns the dispatch's
/// entry and launches.
fn check_product(
    k: &Kernels,
    kernel: Option<F16WeightsKernel>,
    store: Store,
    (m, n, kk): (usize, usize, usize),
    seed: u64,
) -> wgrad::Result<(&'static str, usize)> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
    let b_host = cpu::to_f16(&random_vec(&mut r, n * kk, -1.0, 1.0));
    let bias_host = random_vec(&mut r, n, -1.0, 1.0);
    let (a, b, c, pre, bias) = (
        k.upload(&a_host)?,
        k.upload_f16(&b_host)?,
        k.upload(&vec![f32::NAN; m * n])?,
        k.zeros(m * n)?,
        k.upload(&bias_host)?,
    );
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
                .with_kernel(MatmulKernel::F16Weights(kernel))
                .with_epilogue(epilogue),
            c.view(),
            a.view(),
            MatmulOperand::F16Weight(b.view()),
        )?,
        None => k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
            c.view(),
            a.view(),
            MatmulOperand::F16Weight(b.view()),
        )?,
    };
    k.run(&[&d])?;
    let e = cpu::Epilogue {
        bias: (store != Store::Plain).then_some(&bias_host[..]),
        activation: (store == Store::BiasGeluPre).then_some(Activation::Gelu),
        ..cpu::Epilogue::default()
    };
    let (want, want_pre) = cpu::matmul_f16_weights(e, &a_host, &b_host, m, n, kk);
    let what = format!("{} m={m} n={n} k={kk} {store:?}", d.kernel().entry);
    assert_close(&what, &read(k, &c)?, &want, ATOL, RTOL);
    if store == Store::BiasGeluPre {
        assert_close(&format!("{what} pre"), &read(k, &pre)?, &want_pre, ATOL, RTOL);
    }
    Ok((d.kernel().entry, d.launches()))
}

#[test]
fn f16_weight_products_match_the_cpu_on_each_kernel() {
    for_each_adapter("f16 weights: products", |k| {
        if skip(k, "f16 weights: products") {
            return Ok(());
        }
        // Matrix-vector: (n, k) of one column, fewer columns than a
        // workgroup's 8, a prime n, k of one 8-value step, k not a
        // multiple of the lanes' stride, and GPT-2's k = 768; every row
        // count, each with its own lanes and epilogue (a pipeline per
        // combination, so four in all).
        let combinations = [
            (1, 8, Store::Plain),
            (2, 64, Store::BiasGeluPre),
            (3, 16, Store::Bias),
            (MATVEC_MAX_ROWS, 8, Store::BiasGeluPre),
        ];
        for (case, &(n, kk)) in [(1, 8), (7, 24), (71, 264), (13, 768)].iter().enumerate() {
            for &(m, lanes, store) in &combinations {
                let kernel = F16WeightsKernel::Matvec { lanes };
                check_product(k, Some(kernel), store, (m, n, kk), 1600 + case as u64 * 10 + m as u64)?;
            }
        }
        // Small tiles: 1, primes and non-multiples of the 64×64 tile, odd k
        // (rows of B starting on an odd f16), and each epilogue.
        for (case, &(m, n, kk)) in [(1, 1, 1), (5, 3, 7), (13, 70, 31), (67, 65, 9), (2, 129, 33)]
            .iter()
            .enumerate()
        {
            for store in [Store::Plain, Store::Bias, Store::BiasGeluPre] {
                check_product(k, Some(F16WeightsKernel::Small), store, (m, n, kk), 1700 + case as u64)?;
            }
        }
        // Register-blocked tiles: one pipeline (every epilogue step on),
        // several tiles with ragged edges in both directions.
        for (case, &(m, n, kk)) in [(1, 1, 1), (70, 130, 33), (33, 67, 64)].iter().enumerate() {
            check_product(
                k,
                Some(F16WeightsKernel::Register),
                Store::BiasGeluPre,
                (m, n, kk),
                1800 + case as u64,
            )?;
        }
        // Workgroup-memory tiles (a GPU's, run here as tests of the layout):
        // scalar loads (k not a multiple of 8: one step, fewer than a
        // 16-step slice, odd, several slices) and 8-weight loads (k = 8, a
        // partial last slice, whole slices), ragged tiles, each epilogue.
        let shapes = [
            (1, 1, 1),
            (5, 3, 7),
            (70, 130, 33),
            (67, 65, 12),
            (1, 9, 8),
            (33, 67, 40),
            (66, 70, 64),
        ];
        for (case, &(m, n, kk)) in shapes.iter().enumerate() {
            let store = [Store::Plain, Store::Bias, Store::BiasGeluPre][case % 3];
            let (entry, _) = check_product(k, Some(F16WeightsKernel::Shared), store, (m, n, kk), 1850 + case as u64)?;
            let want = if kk % 8 == 0 {
                "matmul_f16w_forward_shared_vec"
            } else {
                "matmul_f16w_forward_shared"
            };
            assert_eq!(entry, want, "m={m} n={n} k={kk}");
        }
        Ok(())
    });
}

#[test]
fn f16_weight_products_pick_their_kernel_by_shape() {
    for_each_adapter("f16 weights: selection", |k| {
        if skip(k, "f16 weights: selection") {
            return Ok(());
        }
        let entry = |m: usize, n: usize, kk: usize| -> wgrad::Result<&'static str> {
            let (a, b, c) = (k.zeros(m * kk)?, k.zeros_f16(n * kk)?, k.zeros(m * n)?);
            let kernel = k.f16_weights_kernel_for(m, n, kk, &a.view(), &b.view());
            Ok(k.matmul(
                &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_kernel(MatmulKernel::F16Weights(kernel)),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )?
            .kernel()
            .entry)
        };
        assert_eq!(entry(1, 50, 16)?, "matvec_f16w_forward");
        assert_eq!(entry(MATVEC_MAX_ROWS, 50, 16)?, "matvec_f16w_forward");
        assert_eq!(
            entry(MATVEC_MAX_ROWS + 1, 50, 16)?,
            "matmul_f16w_forward_small",
            "too many rows"
        );
        assert_eq!(entry(1, 50, 12)?, "matmul_f16w_forward_small", "k not a multiple of 8");
        // Past 2^20 multiply-adds: the register kernel on a CPU adapter, the
        // workgroup-memory one on a GPU. The software adapters are CPUs;
        // the GPU's choices are asked of F16WeightsKernel::for_shape.
        let big = k.f16_weights_kernel_for(64, 1024, 32, &k.zeros(1)?.view(), &k.zeros_f16(2)?.view());
        assert_eq!(
            big,
            if k.device().is_cpu() {
                F16WeightsKernel::Register
            } else {
                F16WeightsKernel::Shared
            },
            "past 2^20 multiply-adds"
        );
        assert_eq!(
            F16WeightsKernel::for_shape(true, 64, false, 64, 1024, 32),
            F16WeightsKernel::Shared
        );
        assert_eq!(
            F16WeightsKernel::for_shape(false, 8, false, 64, 1024, 32),
            F16WeightsKernel::Register
        );
        assert_eq!(
            F16WeightsKernel::for_shape(true, 64, false, 5, 50, 16),
            F16WeightsKernel::Small,
            "small products stay on the small kernel"
        );
        assert_eq!(
            F16WeightsKernel::for_shape(true, 64, true, 1, 50_257, 768),
            F16WeightsKernel::Matvec { lanes: 64 },
            "decode's head"
        );
        // The explicit matrix-vector entry refuses what it cannot run, and
        // training's epilogues are refused.
        let (a, b, c) = (k.zeros(6)?, k.zeros_f16(18)?, k.zeros(3)?);
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 3, 6)
                    .with_kernel(MatmulKernel::F16Weights(F16WeightsKernel::Matvec { lanes: 8 })),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )
            .unwrap_err();
        assert!(err.to_string().contains("k=6"), "{err}");
        let accumulate = MatmulEpilogue {
            accumulate: true,
            ..MatmulEpilogue::default()
        };
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 3, 6).with_epilogue(accumulate),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 3, 5),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("m=1 n=3 k=5"),
            "{err}"
        );
        Ok(())
    });
}

#[test]
fn f16_embedding_matches_the_cpu() {
    for_each_adapter("f16 weights: embedding", |k| {
        if skip(k, "f16 weights: embedding") {
            return Ok(());
        }
        // (n, vocab, channels): one of each, odd channels (rows starting
        // on odd f16 values), more outputs than a workgroup.
        for (case, &(n, vocab, channels)) in [(1, 1, 1), (5, 7, 3), (40, 11, 13), (3, 50, 768)].iter().enumerate() {
            let mut r = rng(1900 + case as u64);
            let table = cpu::to_f16(&random_vec(&mut r, vocab * channels, -2.0, 2.0));
            let mut ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
            // An id past the vocabulary gives a row of NaN, as in f32.
            ids[n - 1] = vocab as u32 + 3;
            let (t, i, out) = (k.upload_f16(&table)?, k.upload(&ids)?, k.zeros(n * channels)?);
            k.run(&[&k.embedding_f16_weights(out.view(), t.view(), i.view(), n, vocab, channels)?])?;
            // A copy: exact.
            assert_close(
                &format!("embedding n={n} vocab={vocab} channels={channels}"),
                &read(k, &out)?,
                &cpu::embedding_f16_weights(&table, &ids, vocab, channels),
                0.0,
                0.0,
            );
        }
        Ok(())
    });
}

#[test]
fn f16_weights_over_small_bindings_equal_the_twins() {
    for_each_adapter("f16 weights: split bindings", |k| {
        if skip(k, "f16 weights: split bindings") {
            return Ok(());
        }
        // 1 KiB bindings: 512 f16 values, so B, the table and (for many
        // rows) C take several launches.
        // A part may start up to one offset alignment before its first
        // value, so the limit grows with the alignment to keep 256 words a
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
        // The head at decode (B by blocks of rows), an odd k (blocks
        // starting on odd values), and C split with B.
        for (i, &(kernel, store, shape)) in [
            (F16WeightsKernel::Matvec { lanes: 8 }, Store::Plain, (1, 300, 8)),
            (F16WeightsKernel::Small, Store::BiasGeluPre, (3, 100, 7)),
            (F16WeightsKernel::Small, Store::Bias, (2, 200, 9)),
            (F16WeightsKernel::Shared, Store::BiasGeluPre, (3, 100, 7)),
            (F16WeightsKernel::Shared, Store::Bias, (2, 120, 16)),
        ]
        .iter()
        .enumerate()
        {
            let (_, launches) = check_product(&lim, Some(kernel), store, shape, 2000 + i as u64)?;
            assert!(launches > 1, "{kernel:?} {shape:?} ran in one launch");
        }
        let (n, vocab, channels) = (9, 100, 13);
        let mut r = rng(2010);
        let table = cpu::to_f16(&random_vec(&mut r, vocab * channels, -2.0, 2.0));
        let ids: Vec<u32> = (0..n)
            .map(|_| r.random_range(0..vocab as u32))
            .chain([0, vocab as u32 - 1])
            .collect();
        let (t, i, out) = (
            lim.upload_f16(&table)?,
            lim.upload(&ids)?,
            lim.zeros(ids.len() * channels)?,
        );
        let d = lim.embedding_f16_weights(out.view(), t.view(), i.view(), ids.len(), vocab, channels)?;
        assert!(d.launches() > 1, "the table in one launch");
        lim.run(&[&d])?;
        assert_close(
            "split embedding",
            &read(&lim, &out)?,
            &cpu::embedding_f16_weights(&table, &ids, vocab, channels),
            0.0,
            0.0,
        );
        // What cannot split is a clear error: the activations, a table row.
        let (a, b, c) = (lim.zeros(600)?, lim.zeros_f16(1200)?, lim.zeros(2)?);
        let err = lim
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 2, 600),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. }) && err.to_string().contains("activations"),
            "{err}"
        );
        let (t, i, out) = (lim.zeros_f16(1200)?, lim.zeros(1)?, lim.zeros(600)?);
        let err = lim
            .embedding_f16_weights(out.view(), t.view(), i.view(), 1, 2, 600)
            .unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. }) && err.to_string().contains("one row"),
            "{err}"
        );
        Ok(())
    });
}

#[test]
fn f16_weights_are_unsupported_without_shader_f16() {
    for_each_adapter("f16 weights: unsupported", |k| {
        if k.supports_f16() {
            return Ok(());
        }
        let (a, b, c, ids) = (k.zeros(4)?, k.upload_f16(&[f16::ONE; 8])?, k.zeros(2)?, k.zeros(1)?);
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 2, 4),
                c.view(),
                a.view(),
                MatmulOperand::F16Weight(b.view()),
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { .. }) && err.to_string().contains("SHADER_F16"),
            "{err}"
        );
        let out = k.zeros(4)?;
        let err = k
            .embedding_f16_weights(out.view(), b.view(), ids.view(), 1, 2, 4)
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        Ok(())
    });
}

const CONFIG: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 13,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};

/// A random GPT with sharp attention and logits of order 1 (as
/// tests/suite/generate.rs's), and the same model with the weights an f16
/// generator stores rounded to f16: the token embedding and every block's
/// four projection weights.
fn models(seed: u64) -> (Gpt, Gpt) {
    nn::manual_seed(seed);
    let mut model = Gpt::new(CONFIG).expect("valid config");
    for w in model.wte.weight.iter_mut().chain(model.wpe.weight.iter_mut()) {
        *w *= 25.0;
    }
    for block in &mut model.h {
        if let Some(attn) = &mut block.attn {
            attn.c_attn.weight.iter_mut().for_each(|w| *w *= 10.0);
        }
    }
    let mut rounded = model.clone();
    let round = |w: &mut Vec<f32>| *w = cpu::from_f16(&cpu::to_f16(w));
    round(&mut rounded.wte.weight);
    for block in &mut rounded.h {
        if let Some(attn) = &mut block.attn {
            round(&mut attn.c_attn.weight);
            round(&mut attn.c_proj.weight);
        }
        round(&mut block.mlp.c_fc.weight);
        round(&mut block.mlp.c_proj.weight);
    }
    (model, rounded)
}

/// The f16 generator and the f32 one on the rounded weights hold the same
/// weight values and run the same f32 arithmetic in kernels of the same
/// shape (the f16 matrix-vector and small kernels are the f32 ones with B
/// widened on load), so they differ only where the compiler orders f32
/// operations differently: a few ulps of logits of order 1-10. 1e-4 (the
/// bound generate.rs allows between two summation orders) leaves a wide
/// margin, and is far below what the rounding itself changes (checked).
const SAME_WEIGHTS_ATOL: f32 = 1e-4;
const SAME_WEIGHTS_RTOL: f32 = 1e-4;

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn an_f16_generator_equals_an_f32_one_on_the_rounded_weights() {
    for_each_adapter("f16 weights: generator", |k| {
        if skip(k, "f16 weights: generator") {
            return Ok(());
        }
        let (model, rounded) = models(31);
        let mut half = Generator::new_with_dtype(k.clone(), &model, 2, WeightDtype::F16)?;
        let mut reference = Generator::new(k.clone(), &rounded, 2)?;
        let mut unrounded = Generator::new(k.clone(), &model, 2)?;
        assert_eq!((half.dtype(), reference.dtype()), (WeightDtype::F16, WeightDtype::F32));
        // The stored weights are the rounded ones, read back widened.
        let mut stored = half.executor().parameters()?;
        let mut want = reference.executor().parameters()?;
        stored.sort_by(|a, b| a.0.cmp(&b.0));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            stored, want,
            "the f16 generator's parameters against the rounded model's"
        );
        let (half_bytes, full_bytes) = (
            half.executor().plan().param_arena_len,
            reference.executor().plan().param_arena_len,
        );
        assert!(
            half_bytes * 10 < full_bytes * 6,
            "f16 arena {half_bytes} words against f32 {full_bytes}"
        );

        let mut r = rng(32);
        let sequences: Vec<Vec<u32>> = (0..2)
            .map(|_| {
                (0..CONFIG.block_size)
                    .map(|_| r.random_range(0..CONFIG.vocab_size as u32))
                    .collect()
            })
            .collect();
        let lens = [5, 2];
        let prompts: Vec<&[u32]> = sequences.iter().zip(lens).map(|(s, n)| &s[..n]).collect();
        let (got, want, far) = (
            half.prefill(&prompts)?,
            reference.prefill(&prompts)?,
            unrounded.prefill(&prompts)?,
        );
        assert_close("prefill", &got, &want, SAME_WEIGHTS_ATOL, SAME_WEIGHTS_RTOL);
        let mut rounding_shows = max_difference(&got, &far);
        let mut worst = max_difference(&got, &want);
        for step in 0..CONFIG.block_size - lens[0] {
            let tokens: Vec<u32> = (0..2).map(|s| sequences[s][lens[s] + step]).collect();
            let (got, want, far) = (
                half.decode(&tokens)?,
                reference.decode(&tokens)?,
                unrounded.decode(&tokens)?,
            );
            assert_close(
                &format!("decode step {step}"),
                &got,
                &want,
                SAME_WEIGHTS_ATOL,
                SAME_WEIGHTS_RTOL,
            );
            rounding_shows = rounding_shows.max(max_difference(&got, &far));
            worst = worst.max(max_difference(&got, &want));
        }
        eprintln!("{}: f16 generator vs f32 on rounded weights: max |diff| {worst:e}; vs unrounded weights {rounding_shows:e}", k.device().label());
        // The f16 path is in use: the rounding moves the logits well past
        // the tolerance.
        assert!(
            rounding_shows > 10.0 * SAME_WEIGHTS_ATOL,
            "rounding the weights changed the logits by only {rounding_shows}"
        );
        Ok(())
    });
}

#[test]
fn f16_generation_falls_back_to_f32_without_shader_f16() {
    for_each_adapter("f16 weights: fallback", |k| {
        let (model, _) = models(33);
        let mut asked = Generator::new_with_dtype(k.clone(), &model, 1, WeightDtype::F16)?;
        let want = if k.supports_f16() {
            WeightDtype::F16
        } else {
            WeightDtype::F32
        };
        assert_eq!(asked.dtype(), want);
        assert_eq!(WeightDtype::F16.on(k), want);
        if k.supports_f16() {
            return Ok(());
        }
        // Without SHADER_F16 it is the f32 generator, bit for bit.
        let mut plain = Generator::new(k.clone(), &model, 1)?;
        let prompt = [3, 1, 4, 1, 5];
        assert_close(
            "fallback prefill",
            &asked.prefill(&[&prompt])?,
            &plain.prefill(&[&prompt])?,
            0.0,
            0.0,
        );
        assert_close("fallback decode", &asked.decode(&[9])?, &plain.decode(&[9])?, 0.0, 0.0);
        Ok(())
    });
}

#[test]
fn f16_parameters_are_for_inference_only() {
    let mut g = Graph::new();
    let x = g.input("x", &[2, 4]).unwrap();
    let w = g.parameter_f16("w", &[3, 4], vec![0.5; 12]).unwrap();
    // Only a product's B (ABt, or AB: a frozen weight's backward) and an
    // embedding's table take f16.
    let err = g.matmul_form(MatmulForm::AtB, x, w).unwrap_err();
    assert!(err.to_string().contains("f16"), "{err}");
    let err = g.add(w, w).unwrap_err();
    assert!(err.to_string().contains("f16"), "{err}");
    let y = g.rows_matmul(MatmulForm::ABt, x, w).unwrap();
    let loss = g.mean(y).unwrap();
    for_each_adapter("f16 weights: no training", |k| {
        let mut g = g.clone();
        // Refused by backward (no rule reads f16) or by the executor.
        let err = match g.backward(loss) {
            Ok(grads) => Executor::new(k.clone(), g, &[loss], Some(grads), None).unwrap_err(),
            Err(e) => e,
        };
        assert!(err.to_string().contains("f16"), "{err}");
        Ok(())
    });
}

#[test]
fn f16_weights_are_counted_at_two_bytes() {
    let config = GptConfig::gpt2();
    let (c, halved) = (
        config.n_embd as u64,
        (config.vocab_size * config.n_embd + config.n_layer * 12 * config.n_embd * config.n_embd) as u64,
    );
    for position in [0, 100] {
        let f32_bytes = wgrad_benches::decode_bytes_per_token(&config, position);
        assert_eq!(
            wgrad_benches::decode_bytes_per_token_with(&config, position, WeightDtype::F32),
            f32_bytes
        );
        assert_eq!(
            wgrad_benches::decode_bytes_per_token_with(&config, position, WeightDtype::F16),
            f32_bytes - 2 * halved
        );
    }
    // GPT-2 124M: 498 MB of f32 parameters and 75 MB of caches; in f16
    // 251 MB of parameters. A 400 MB budget holds the f16 generator only.
    assert_eq!(halved, 50_257 * c + 12 * 12 * c * c);
    for_each_adapter("f16 weights: check_fits", |k| {
        let budget = common::limited_kernels(
            k,
            LimitOverrides {
                memory_bytes: Some(400 << 20),
                ..LimitOverrides::default()
            },
        );
        let err = wgrad::infer::generate::check_fits(&budget, &config, 1).unwrap_err();
        // Under WebGPU's default limits the f32 arena (498 MB) is already
        // over max_buffer_size (256 MiB); the f16 one (251 MB) is not.
        assert!(
            matches!(
                err,
                Error::MemoryTooSmall { .. }
                    | Error::TooLarge {
                        limit_name: "max_buffer_size",
                        ..
                    }
            ),
            "{err}"
        );
        let f16 = wgrad::infer::generate::check_fits_with_dtype(&budget, &config, 1, WeightDtype::F16);
        // Without SHADER_F16 the generator would be f32, and so is the check.
        assert_eq!(f16.is_ok(), k.supports_f16(), "{f16:?}");
        Ok(())
    });
}

/// A Llama's f16 generator (tied head, multi-query: the token table and
/// every projection in f16) against the f32 one on the same weights
/// rounded; the untied model keeps its token table f32 and its lm_head f16.
#[test]
fn an_f16_llama_generator_equals_an_f32_one_on_the_rounded_weights() {
    use wgrad::models::{Llama, LlamaConfig};
    for_each_adapter("f16 weights: Llama generator", |k| {
        if skip(k, "f16 weights: Llama generator") {
            return Ok(());
        }
        for tied in [true, false] {
            let config = LlamaConfig {
                vocab_size: 37,
                block_size: 13,
                n_layer: 2,
                n_head: 3,
                n_kv_head: 1,
                n_embd: 24,
                intermediate_size: 40,
                tie_word_embeddings: tied,
                ..LlamaConfig::small(37)
            };
            nn::manual_seed(34);
            let mut model = Llama::new(config)?;
            model.embed_tokens.weight.iter_mut().for_each(|w| *w *= 50.0);
            let mut rounded = model.clone();
            let round = |w: &mut Vec<f32>| *w = cpu::from_f16(&cpu::to_f16(w));
            if tied {
                round(&mut rounded.embed_tokens.weight);
            }
            if let Some(head) = &mut rounded.lm_head {
                round(&mut head.weight);
            }
            for layer in &mut rounded.layers {
                let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
                for w in [
                    &mut a.q_proj.weight,
                    &mut a.k_proj.weight,
                    &mut a.v_proj.weight,
                    &mut a.o_proj.weight,
                    &mut m.gate_proj.weight,
                    &mut m.up_proj.weight,
                    &mut m.down_proj.weight,
                ] {
                    round(w);
                }
            }
            let mut half = Generator::new_with_dtype(k.clone(), &model, 1, WeightDtype::F16)?;
            let mut reference = Generator::new(k.clone(), &rounded, 1)?;
            let mut stored = half.executor().parameters()?;
            let mut want = reference.executor().parameters()?;
            stored.sort_by(|a, b| a.0.cmp(&b.0));
            want.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(
                stored, want,
                "tied {tied}: the f16 generator's parameters against the rounded model's"
            );
            let sequence: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 37).collect();
            assert_close(
                &format!("tied {tied}: prefill"),
                &half.prefill(&[&sequence[..4]])?,
                &reference.prefill(&[&sequence[..4]])?,
                SAME_WEIGHTS_ATOL,
                SAME_WEIGHTS_RTOL,
            );
            for &token in &sequence[4..] {
                assert_close(
                    &format!("tied {tied}: decode {token}"),
                    &half.decode(&[token])?,
                    &reference.decode(&[token])?,
                    SAME_WEIGHTS_ATOL,
                    SAME_WEIGHTS_RTOL,
                );
            }
        }
        Ok(())
    });
}
