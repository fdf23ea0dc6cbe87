//! f16 mixed precision: the f16 storage ops against their twins, dynamic
//! loss scaling on the GPU (an overflow skips the step and halves the
//! scale, clean steps grow it, a scaled step equals the unscaled one), and
//! a tiny GPT trained with f16 activations against the f32 run.

use crate::common;

use std::sync::Arc;

use common::assert_close;
use wgrad::graph::{DType, ElementwiseOp, Executor, Graph, MatmulOp, Op, PlanOptions, Precision};
use wgrad::io::text::{random_windows, CharTokenizer};
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Linear, MSELoss, Sequential};
use wgrad::optim::{AdamW, LossScaleState, LossScaling, SGD};
use wgrad::Kernels;
use wgrad::{Targets, Trainer};

/// Adapters with SHADER_F16 (lavapipe); the others are named, not tested.
fn for_each_f16_adapter(test: &str, body: impl Fn(&Arc<Kernels>) -> wgrad::Result<()>) {
    common::for_each_adapter(test, |k| {
        if !k.supports_f16() {
            eprintln!("{test}: {} has no SHADER_F16, skipped there", k.device().label());
            return Ok(());
        }
        body(k)
    });
}

#[test]
fn store_and_load_f16_round_as_the_twin() {
    for_each_f16_adapter("mixed_precision::store_and_load_f16", |k| {
        // 1, odd and prime lengths (a half-filled last word), and values
        // past f16's smallest normal and near its largest.
        for n in [1usize, 2, 7, 131, 1000] {
            let mut rng = common::rng(n as u64);
            let mut x = common::random_vec(&mut rng, n, -3.0, 3.0);
            if n > 4 {
                x[1] = 1e-6;
                x[2] = 60000.0;
                x[3] = 1.0 + 1.0 / 4096.0;
            }
            let mut g = Graph::new();
            let input = g.input("x", &[n])?;
            let h = g.store_f16(input)?;
            let y = g.load_f16(h)?;
            assert_eq!(g.get(h).map(|n| n.dtype), Some(DType::F16));
            let mut exec = Executor::new(k.clone(), g.clone(), &[y], None, None)?;
            exec.set_input(input, &x)?;
            let got = exec.run_and_read(&[y], y)?;
            // The twins round to nearest even; WGSL allows either neighbour
            // of an inexact value, so one f16 step (2^-10 relative) apart.
            let want = wgrad::cpu::from_f16(&wgrad::cpu::to_f16(&x));
            assert_close(
                &format!("load_f16(store_f16(x)) n={n}"),
                &got,
                &want,
                1e-7,
                1.0 / 1024.0,
            );
            // The graph's reference rounds the same way.
            let reference = g.evaluate_f64(&[y], &[(input, x.iter().map(|&v| f64::from(v)).collect())])?;
            let reference: Vec<f32> = reference[0].iter().map(|&v| v as f32).collect();
            assert_close(&format!("evaluate_f64 n={n}"), &reference, &want, 0.0, 0.0);
        }
        Ok(())
    });
}

/// Linear(5, 3) on MSE with inputs of magnitude 8: gradients of a few
/// units, so a loss scale of 2^127 overflows them to inf.
fn linear_model() -> Sequential {
    nn::manual_seed(5);
    Sequential::new(vec![Layer::Linear(Linear::new(5, 3))])
}

fn linear_batch(step: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = common::rng(100 + step);
    (
        common::random_vec(&mut rng, 4 * 5, -8.0, 8.0),
        common::random_vec(&mut rng, 4 * 3, -1.0, 1.0),
    )
}

/// One step of `t` on batch `step`, reading the loss (and with it the
/// loss-scale state).
fn linear_step(t: &mut Trainer, step: u64) -> f32 {
    let (x, y) = linear_batch(step);
    t.zero_grad();
    t.forward(&x).unwrap();
    t.loss(Targets::Values(&y)).unwrap();
    t.backward().unwrap();
    t.step_reading_loss().unwrap()
}

fn scale_state(t: &Trainer) -> LossScaleState {
    t.executor()
        .loss_scale()
        .cloned()
        .expect("a loss-scaled step read its state with the loss")
}

/// AdamW at a constant rate, clipping at 1: a skipped step and a taken
/// one differ only in what the GPU counts.
fn adamw() -> AdamW {
    AdamW::new(1e-2).betas(0.9, 0.95).weight_decay(0.1).clip_grad_norm(1.0)
}

#[test]
fn an_overflow_skips_the_step_and_halves_the_scale() {
    for_each_f16_adapter("mixed_precision::an_overflow_skips_the_step", |k| {
        let model = linear_model();
        let scaling = LossScaling {
            init_scale: 2f32.powi(127),
            ..LossScaling::default()
        };
        let mut scaled = Trainer::new(k.clone(), &model, MSELoss, adamw().loss_scaling(scaling), 4)?;
        let before = scaled.executor().parameters()?;
        let loss = linear_step(&mut scaled, 1);
        assert!(loss.is_finite(), "the forward is not scaled");
        let grads: Vec<f32> = k.read::<f32>(scaled.executor().gradient_arena().expect("a trainer has gradients"))?;
        let mut twin = wgrad::cpu::LossScaleTwin::new(&scaling);
        assert_eq!(
            twin.step(&grads, &scaling, Some(1.0)).1,
            None,
            "the twin skips the same step"
        );
        assert_eq!(twin.scale, 2f32.powi(126));
        let state = scale_state(&scaled);
        assert_eq!(state.scale, 2f32.powi(126), "backoff halves the scale");
        assert_eq!(
            (
                state.skipped,
                state.skipped_steps.clone(),
                state.steps_taken,
                state.steps_run
            ),
            (1, vec![1], 0, 1)
        );
        // Nothing moved: parameters and both moments.
        assert_eq!(
            scaled.executor().parameters()?,
            before,
            "a skipped step leaves the parameters"
        );
        for (name, state_name, values) in scaled.executor().optimizer_state()? {
            assert!(
                values.iter().all(|&v| v == 0.0),
                "{name}.{state_name} changed on a skipped step"
            );
        }
        // Halving until the gradients fit; the first step taken is then
        // the unscaled run's first step on the same batch: the scale is a
        // power of two, so unscaling is exact, and the bias corrections
        // are the GPU's f32 products against the host's f64 powers (a few
        // f32 ulps).
        let mut runs = 1;
        while scale_state(&scaled).steps_taken == 0 {
            runs += 1;
            assert!(runs < 40, "the scale never came down far enough");
            linear_step(&mut scaled, 1);
        }
        let state = scale_state(&scaled);
        assert_eq!(state.skipped, runs - 1);
        assert_eq!(state.skipped_steps, (1..runs).take(32).collect::<Vec<_>>());
        assert_eq!(state.scale, 2f32.powi(127 - state.skipped as i32));
        let mut plain = Trainer::new(k.clone(), &model, MSELoss, adamw(), 4)?;
        linear_step(&mut plain, 1);
        let got = scaled.executor().parameters()?;
        let want = plain.executor().parameters()?;
        for ((name, _, g), (_, _, w)) in got.iter().zip(&want) {
            assert_close(&format!("first taken step: {name}"), g, w, 1e-6, 1e-5);
        }
        assert_close(
            "clipping's norm, unscaled",
            &[scaled.executor().read_grad_norm()?.unwrap_or(f32::NAN)],
            &[plain.executor().read_grad_norm()?.unwrap_or(f32::NAN)],
            0.0,
            1e-5,
        );
        Ok(())
    });
}

#[test]
fn the_scale_grows_after_the_interval_of_clean_steps() {
    for_each_f16_adapter("mixed_precision::the_scale_grows", |k| {
        let model = linear_model();
        let scaling = LossScaling {
            init_scale: 1024.0,
            growth_interval: 3,
            ..LossScaling::default()
        };
        // SGD too: its first step (the momentum buffer's start) comes from
        // the GPU's count.
        let optimizers: [OptimizerConfig; 2] = [
            adamw().loss_scaling(scaling).into(),
            SGD::new(0.05).momentum(0.9).loss_scaling(scaling).into(),
        ];
        for optimizer in optimizers {
            let mut t = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
            let mut scales = Vec::new();
            let mut twin = wgrad::cpu::LossScaleTwin::new(&scaling);
            for step in 1..=7 {
                linear_step(&mut t, step);
                let s = scale_state(&t);
                scales.push((s.scale, s.growth_tracker));
                // The kernels against their twin on this step's (scaled,
                // still held) gradients.
                let grads: Vec<f32> = k.read::<f32>(t.executor().gradient_arena().expect("a trainer has gradients"))?;
                twin.step(&grads, &scaling, optimizer.clip_grad_norm());
                assert_eq!(
                    (s.scale, s.growth_tracker, s.steps_taken, s.steps_run, &s.skipped_steps),
                    (
                        twin.scale,
                        twin.growth_tracker,
                        twin.steps_taken,
                        twin.steps_run,
                        &twin.skipped_steps
                    )
                );
            }
            assert_eq!(
                scales,
                vec![
                    (1024.0, 1),
                    (1024.0, 2),
                    (2048.0, 0),
                    (2048.0, 1),
                    (2048.0, 2),
                    (4096.0, 0),
                    (4096.0, 1)
                ],
                "{optimizer:?}"
            );
            let state = scale_state(&t);
            assert_eq!((state.steps_taken, state.skipped), (7, 0));
            // Every step was taken: the same parameters as unscaled.
            let plain_optimizer = optimizer.with_loss_scaling(None);
            let mut plain = Trainer::new(k.clone(), &model, MSELoss, plain_optimizer, 4)?;
            for step in 1..=7 {
                linear_step(&mut plain, step);
            }
            for ((name, _, g), (_, _, w)) in t.executor().parameters()?.iter().zip(&plain.executor().parameters()?) {
                assert_close(&format!("7 scaled steps: {name}"), g, w, 1e-6, 1e-5);
            }
        }
        Ok(())
    });
}

/// A checkpoint file for `test` on adapter `k`, removed when dropped.
struct TempCheckpoint(std::path::PathBuf);

impl TempCheckpoint {
    fn new(test: &str, k: &Kernels) -> Self {
        let label: String = k.device().label().chars().filter(char::is_ascii_alphanumeric).collect();
        TempCheckpoint(std::env::temp_dir().join(format!("wgrad-{test}-{}-{label}.safetensors", std::process::id())))
    }
}

impl Drop for TempCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_resumed_loss_scaled_run_equals_the_unbroken_run() {
    for_each_f16_adapter("mixed_precision::a_resumed_loss_scaled_run", |k| {
        let model = linear_model();
        // Overflowing at first (skipped steps), then growing every 2 clean
        // steps until it overflows again: the save falls amid all of it.
        let scaling = LossScaling {
            init_scale: 2f32.powi(127),
            growth_interval: 2,
            ..LossScaling::default()
        };
        let optimizer = adamw().loss_scaling(scaling);
        let mut unbroken = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
        for step in 1..=12 {
            linear_step(&mut unbroken, step);
        }
        let file = TempCheckpoint::new("resume-scaled", k);
        let mut first = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
        for step in 1..=6 {
            linear_step(&mut first, step);
        }
        let saved = scale_state(&first);
        assert!(
            saved.skipped > 0 && saved.steps_taken > 0,
            "the save should fall after skipped and taken steps: {saved:?}"
        );
        first.save(&file.0)?;
        let mut resumed = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
        resumed.load(&file.0)?;
        assert_eq!(
            resumed.executor().read_loss_scale()?.as_ref(),
            Some(&saved),
            "the scale, its counters and history come back"
        );
        for step in 7..=12 {
            linear_step(&mut resumed, step);
        }
        // The same kernels on the same numbers: equal bits, not a tolerance.
        assert_eq!(scale_state(&resumed), scale_state(&unbroken));
        assert_eq!(resumed.executor().parameters()?, unbroken.executor().parameters()?);
        assert_eq!(
            resumed.executor().optimizer_state()?,
            unbroken.executor().optimizer_state()?
        );
        Ok(())
    });
}

#[test]
fn an_f32_checkpoint_resumes_under_loss_scaling() {
    for_each_f16_adapter("mixed_precision::an_f32_checkpoint_resumes", |k| {
        // Every step fits the scale: the scaled run takes the plain run's
        // steps, its bias corrections counted from the checkpoint's step.
        let model = linear_model();
        let scaling = LossScaling {
            init_scale: 1024.0,
            ..LossScaling::default()
        };
        let mut plain = Trainer::new(k.clone(), &model, MSELoss, adamw(), 4)?;
        for step in 1..=3 {
            linear_step(&mut plain, step);
        }
        let file = TempCheckpoint::new("resume-f32", k);
        plain.save(&file.0)?;
        for step in 4..=6 {
            linear_step(&mut plain, step);
        }
        let mut scaled = Trainer::new(k.clone(), &model, MSELoss, adamw().loss_scaling(scaling), 4)?;
        scaled.load(&file.0)?;
        for step in 4..=6 {
            linear_step(&mut scaled, step);
        }
        let state = scale_state(&scaled);
        assert_eq!((state.steps_taken, state.steps_run, state.skipped), (6, 6, 0));
        // Unscaling by a power of two is exact; the bias corrections are
        // the GPU's f32 products against the host's (a few f32 ulps).
        for ((name, _, g), (_, _, w)) in scaled
            .executor()
            .parameters()?
            .iter()
            .zip(&plain.executor().parameters()?)
        {
            assert_close(&format!("3 + 3 steps: {name}"), g, w, 1e-6, 1e-5);
        }
        Ok(())
    });
}

#[test]
fn corrupt_loss_scale_metadata_is_an_error_and_changes_nothing() {
    for_each_f16_adapter("mixed_precision::corrupt_loss_scale_metadata", |k| {
        let model = linear_model();
        let optimizer = adamw().loss_scaling(LossScaling {
            init_scale: 1024.0,
            ..LossScaling::default()
        });
        let mut t = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
        for step in 1..=2 {
            linear_step(&mut t, step);
        }
        let file = TempCheckpoint::new("resume-corrupt", k);
        let good = t.checkpoint()?;
        let cases: [(&str, &str, &str); 4] = [
            ("loss_scale", "nan", "positive finite"),
            ("loss_scale", "-2", "positive finite"),
            ("loss_scale_steps_run", "9", "taken"),
            ("loss_scale_skipped_steps", "x", "not a step"),
        ];
        for (key, value, says) in cases {
            let mut ckpt = good.clone();
            ckpt.set_meta(key, value);
            wgrad::io::checkpoint::save(&file.0, &ckpt)?;
            let mut fresh = Trainer::new(k.clone(), &model, MSELoss, optimizer, 4)?;
            let before = fresh.executor().parameters()?;
            let err = fresh
                .load(&file.0)
                .expect_err("corrupt loss-scale metadata must not load");
            assert!(
                err.to_string().contains(key) && err.to_string().contains(says),
                "{key}={value}: {err}"
            );
            assert_eq!(fresh.executor().parameters()?, before, "{key}={value}: nothing changes");
        }
        Ok(())
    });
}

const PANGRAM: &str = "the quick brown fox, jumps over the lazy dog. ";

/// A tiny GPT's losses over 20 steps on the pangram, in `precision`, and
/// the trainer (for its plan).
fn gpt_losses(k: &Arc<Kernels>, precision: Precision) -> (Trainer, Vec<f32>) {
    let tokenizer = CharTokenizer::from_text(PANGRAM).unwrap();
    let tokens = tokenizer.encode(&PANGRAM.repeat(20)).unwrap();
    let mut rng = common::rng(3);
    nn::manual_seed(11);
    let gpt = Gpt::new(GptConfig {
        vocab_size: 29,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
    })
    .unwrap();
    let optimizer = AdamW::new(1e-2)
        .betas(0.9, 0.95)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(1.0);
    let optimizer = match precision {
        Precision::F16 => optimizer.loss_scaling(LossScaling::default()),
        Precision::F32 => optimizer,
    };
    let options = PlanOptions {
        precision,
        ..PlanOptions::default()
    };
    let mut t = Trainer::with_options(k.clone(), &gpt, CrossEntropyLoss, optimizer, 4, options).unwrap();
    let mut losses = Vec::new();
    for _ in 0..20 {
        let (x, y) = random_windows(&tokens, 4, 16, &mut rng).unwrap();
        t.zero_grad();
        t.forward_ids(&x).unwrap();
        t.loss(Targets::Classes(&y)).unwrap();
        t.backward().unwrap();
        losses.push(t.step_reading_loss().unwrap());
    }
    (t, losses)
}

#[test]
fn a_tiny_gpt_in_f16_follows_the_f32_run() {
    for_each_f16_adapter("mixed_precision::a_tiny_gpt_in_f16", |k| {
        let (f32_run, want) = gpt_losses(k, Precision::F32);
        let (f16_run, got) = gpt_losses(k, Precision::F16);
        assert_eq!(f16_run.precision(), Precision::F16);
        let stored = f16_run
            .executor()
            .graph()
            .nodes()
            .iter()
            .filter(|n| n.op == ElementwiseOp::StoreF16)
            .count();
        assert!(stored > 0, "no activation was stored in f16");
        // The matmuls read the f16 copies themselves: none reads a widened
        // load, and some (the Linear layers' weight gradients and forwards,
        // the unfused attention's products on a CPU adapter) read f16.
        let graph = f16_run.executor().graph();
        let matmuls: Vec<_> = graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Matmul(MatmulOp::MatMul(_) | MatmulOp::BatchMatMul(_))))
            .collect();
        let reads_f16 = matmuls
            .iter()
            .filter(|n| {
                n.inputs
                    .iter()
                    .any(|&t| graph.get(t).is_some_and(|i| i.dtype == DType::F16))
            })
            .count();
        assert!(reads_f16 > 0, "no matmul reads an f16 activation");
        let widened = matmuls
            .iter()
            .filter(|n| {
                n.inputs
                    .iter()
                    .any(|&t| graph.get(t).is_some_and(|i| i.op == ElementwiseOp::LoadF16))
            })
            .count();
        assert_eq!(widened, 0, "matmuls reading a widened f32 copy");
        // f16 keeps 11 significant bits of each activation the backward
        // reads: after 20 AdamW steps at lr 1e-2 the losses drift apart by
        // at most 2% (measured: 8e-4).
        let drift = got
            .iter()
            .zip(&want)
            .map(|(g, w)| ((g - w) / w).abs())
            .fold(0.0f32, f32::max);
        eprintln!("tiny GPT, 20 steps: largest relative loss difference f16 vs f32 {drift:.2e}");
        assert_close("f16 losses against f32", &got, &want, 0.0, 0.02);
        assert!(got[19] < got[0] - 0.5, "the f16 run learns: {got:?}");
        let state = f16_run.executor().loss_scale().cloned().unwrap_or_default();
        assert_eq!(
            (state.steps_taken, state.skipped),
            (20, 0),
            "no overflow at 2^16 on this model"
        );
        let (bytes16, bytes32) = (
            f16_run.executor().plan().slot_bytes,
            f32_run.executor().plan().slot_bytes,
        );
        eprintln!("tiny GPT intermediates: f16 {bytes16} B, f32 {bytes32} B");
        assert!(
            bytes16 < bytes32,
            "f16 storage planned {bytes16} B of intermediates against f32's {bytes32} B"
        );
        Ok(())
    });
}

/// One forward and backward of a tiny GPT, f16 activations against f32:
/// every parameter's gradient agrees to f16's rounding of what the
/// backward reads. (A load placed after the fused dispatch that reads it
/// gave 2 to 27% here.)
#[test]
fn f16_gradients_are_the_f32_ones_to_f16_rounding() {
    for_each_f16_adapter("mixed_precision::f16_gradients", |k| {
        let tokenizer = CharTokenizer::from_text(PANGRAM).unwrap();
        let tokens = tokenizer.encode(&PANGRAM.repeat(20)).unwrap();
        let mut rng = common::rng(3);
        nn::manual_seed(11);
        let gpt = Gpt::new(GptConfig {
            vocab_size: 29,
            block_size: 16,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
        })
        .unwrap();
        let (x, y) = random_windows(&tokens, 4, 16, &mut rng).unwrap();
        let mut runs = Vec::new();
        for precision in [Precision::F32, Precision::F16] {
            let options = PlanOptions {
                precision,
                ..PlanOptions::default()
            };
            let mut t = Trainer::with_options(k.clone(), &gpt, CrossEntropyLoss, AdamW::new(1e-2), 4, options)?;
            t.forward_ids(&x)?;
            t.loss(Targets::Classes(&y))?;
            let loss = t.forward_backward(true)?.unwrap_or(f32::NAN);
            let grads: Vec<(String, Vec<f32>)> = t
                .executor()
                .parameters_shapes()
                .into_iter()
                .map(|(name, _)| t.executor().read_grad_named(&name).map(|g| (name, g)))
                .collect::<wgrad::Result<_>>()?;
            runs.push((loss, grads));
        }
        // The forward's matmuls read the f16 copies of their inputs (as
        // autocast's do), so the loss moves by f16's input rounding
        // (2^-11 relative per value, averaging out over the sums): within
        // 1e-3 relative (measured: 2e-7).
        assert!(
            (runs[0].0 - runs[1].0).abs() <= 1e-3 * runs[0].0.abs(),
            "loss: f32 {} against f16 {}",
            runs[0].0,
            runs[1].0
        );
        for ((name, want), (_, got)) in runs[0].1.iter().zip(&runs[1].1) {
            let diff = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt();
            let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
            // f16 keeps 11 bits (2^-11 ≈ 5e-4 relative per value); the
            // measured relative L2 error is 4e-5 to 3.3e-4.
            assert!(
                diff <= 1e-3 * norm + 1e-7,
                "{name}: |f16 - f32| = {diff:e} against |f32| = {norm:e}"
            );
        }
        Ok(())
    });
}
