//! f16 activations and activation checkpointing on the engines built from
//! stages (tensor and pipeline parallel): a checkpointed pipeline trains
//! as the plain one and holds less on every stage; f16 on both engines
//! follows single-device f16 and f32 training with one loss scale on
//! every stage; an overflow on one stage skips the step on all of them;
//! a resumed pipeline keeps its loss scale. The Llama of llama_parallel
//! (tied table, 4 query heads over 2 KV heads), two devices on adapter 0
//! (lavapipe has SHADER_F16; llvmpipe's GL has none).

use crate::common;
use crate::llama_parallel::{batches, config, optimizer};
use crate::parallel::{open_groups, Groups};

use std::sync::Arc;

use common::{assert_close, assert_same_parameters, rng, Parameters};
use wgrad::graph::{ElementwiseOp, Executor, Graph, PlanOptions, Precision, Tensor};
use wgrad::kernels::{Activation, MatmulForm, OptimizerConfig};
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, Criterion, CrossEntropyLoss};
use wgrad::optim::{AdamW, LossScaleState, LossScaling};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{Pipeline, Schedule};
use wgrad::parallel::stage::{reduce_and_step, SharedParameter, Stage, StageEnd};
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::Kernels;
use wgrad::{Targets, Trainer};

const BATCH: usize = 4;
const MICRO: usize = 2;

/// llama_parallel's tied Llama with `n_layer` layers.
fn llama(n_layer: usize) -> Llama {
    nn::manual_seed(13);
    Llama::new(LlamaConfig {
        n_layer,
        ..config(true)
    })
    .unwrap()
}

fn options(precision: Precision, checkpoint_activations: bool) -> PlanOptions {
    PlanOptions {
        precision,
        checkpoint_activations,
        ..PlanOptions::default()
    }
}

/// llama_parallel's clipped AdamW, loss-scaled by `scaling` for f16.
fn scaled(scaling: Option<LossScaling>) -> OptimizerConfig {
    optimizer().with_loss_scaling(scaling)
}

/// Two devices on adapter 0 when both have SHADER_F16; `None` (said
/// aloud) otherwise.
fn f16_pair(test: &str) -> Option<Groups> {
    let groups = open_groups(test, &[DeviceSelection::Adapters(vec!["0".into(), "0".into()])]);
    if let Some(k) = groups.first()?.members().iter().find(|k| !k.supports_f16()) {
        eprintln!("{test}: {} has no SHADER_F16, skipped", k.device().label());
        return None;
    }
    Some(groups)
}

/// `engine` trained on `steps` of llama_parallel's batches: each loss.
fn losses(engine: &mut dyn TrainEngine, steps: usize) -> Vec<f32> {
    batches()
        .iter()
        .take(steps)
        .map(|(ids, targets)| {
            engine
                .step(ids.into(), Targets::Classes(targets), true)
                .unwrap()
                .unwrap()
        })
        .collect()
}

fn pipeline(group: &DeviceGroup, model: &Llama, optimizer: OptimizerConfig, options: PlanOptions) -> Pipeline {
    Pipeline::with_options(
        group,
        model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        MICRO,
        Schedule::OneFOneB,
        None,
        options,
    )
    .unwrap()
}

/// Checkpointing recomputes the same kernels on the same inputs, so the
/// losses and parameters equal the plain pipeline's but for the plan's
/// fusion of the recomputed copies (a few f32 ulps over 4 steps, as
/// activation_checkpointing.rs measures on one device); each stage (two
/// layers; the last also the head) holds less.
#[test]
fn a_checkpointed_pipeline_trains_as_the_plain_one_and_holds_less() {
    let Some(groups) = f16_pair("parallel_f16_checkpointing::checkpointed_pipeline") else {
        return;
    };
    let group = &groups[0];
    let model = llama(4);
    let mut plain = pipeline(group, &model, optimizer(), PlanOptions::default());
    let mut checkpointed = pipeline(group, &model, optimizer(), options(Precision::F32, true));
    assert_eq!(checkpointed.blocks_per_stage(), [2, 2]);
    let (want, got) = (losses(&mut plain, 4), losses(&mut checkpointed, 4));
    assert_close("checkpointed pipeline losses", &got, &want, 1e-6, 1e-5);
    assert_same_parameters(
        "checkpointed pipeline",
        &checkpointed.parameters().unwrap(),
        &plain.parameters().unwrap(),
        1e-6,
        1e-4,
    );
    let (held, held_plain) = (checkpointed.held_activation_bytes(), plain.held_activation_bytes());
    eprintln!("pipeline activations held per stage: checkpointed {held:?} B, plain {held_plain:?} B");
    for (s, (h, p)) in held.iter().zip(&held_plain).enumerate() {
        assert!(h < p, "stage {s}: checkpointed holds {h} B, plain {p} B");
    }
}

/// The single-device f16 run's losses and loss-scale state, checkpointed.
fn single_device_f16(k: &Arc<Kernels>, model: &Llama, steps: usize) -> (Vec<f32>, LossScaleState) {
    let mut t = Trainer::with_blocks(
        k.clone(),
        model,
        CrossEntropyLoss,
        scaled(Some(LossScaling::default())),
        BATCH,
        options(Precision::F16, true),
    )
    .unwrap();
    let losses = losses(&mut t, steps);
    let state = t.executor().read_loss_scale().unwrap().expect("a loss-scaled trainer");
    (losses, state)
}

/// Every stage's loss-scale state, checked to be one.
fn one_scale(what: &str, stages: &[&Stage]) -> LossScaleState {
    let states: Vec<LossScaleState> = stages
        .iter()
        .map(|s| s.executor().read_loss_scale().unwrap().expect("loss-scaled stages"))
        .collect();
    assert!(
        states.iter().all(|s| s == &states[0]),
        "{what}: the stages' loss scales differ: {states:?}"
    );
    states[0].clone()
}

/// f16 keeps 11 bits of each activation the backward reads: over 10
/// clipped AdamW steps the losses stay within mixed_precision.rs's 2% of
/// the f32 run's, and of the single-device f16 run's (stage boundaries
/// are f32 here and f16 there, so not equal; measured 4.4e-5 and 6e-6
/// on lavapipe). Every stage stores f16
/// activations and keeps one loss scale, the single device's.
#[test]
fn tensor_and_pipeline_parallel_in_f16_follow_single_device_training() {
    let Some(groups) = f16_pair("parallel_f16_checkpointing::f16_engines") else {
        return;
    };
    let group = &groups[0];
    let k = &group.members()[0];
    let model = llama(2);
    let steps = 10;
    let (_, f32_losses, _) = common::train_on_one_device(k, &model, optimizer(), BATCH, &batches());
    let (f16_losses, f16_state) = single_device_f16(k, &model, steps);
    assert_eq!(
        (f16_state.steps_taken, f16_state.skipped),
        (steps as u64, 0),
        "no overflow at 2^16"
    );
    let both = options(Precision::F16, true);
    let mut pp = pipeline(group, &model, scaled(Some(LossScaling::default())), both);
    let mut tp = TensorParallel::with_options(
        group,
        &model,
        CrossEntropyLoss,
        scaled(Some(LossScaling::default())),
        BATCH,
        both,
    )
    .unwrap();
    let runs: [(&str, Vec<f32>, Vec<&Stage>); 2] = [
        ("pipeline", losses(&mut pp, steps), pp.stages().iter().collect()),
        (
            "tensor parallel",
            losses(&mut tp, steps),
            tp.stages().map(|(_, s)| s).collect(),
        ),
    ];
    for (what, got, stages) in &runs {
        let drift = |want: &[f32]| {
            got.iter()
                .zip(want)
                .map(|(g, w)| ((g - w) / w).abs())
                .fold(0.0f32, f32::max)
        };
        eprintln!(
            "{what} f16: largest relative loss difference {:.1e} against single-device f16, {:.1e} against f32",
            drift(&f16_losses),
            drift(&f32_losses)
        );
        assert_close(
            &format!("{what} f16 against single-device f16"),
            got,
            &f16_losses,
            0.0,
            0.02,
        );
        assert_close(&format!("{what} f16 against f32"), got, &f32_losses, 0.0, 0.02);
        for (s, stage) in stages.iter().enumerate() {
            let stored = stage
                .executor()
                .graph()
                .nodes()
                .iter()
                .any(|n| n.op == ElementwiseOp::StoreF16);
            assert!(stored, "{what} stage {s} stores no activation in f16");
        }
        let state = one_scale(what, stages);
        assert_eq!(state, f16_state, "{what}: the loss scale against one device's");
    }
}

/// Two stages of y = tanh(x·Wᵀ + b0)·Wᵀ + b1 (W on both, as a tied table
/// is) under loss-scaled, clipped AdamW. An inf in the first stage's
/// gradients alone skips the step on both stages: no parameter moves, and
/// both scales back off together. The next, clean step is the unscaled
/// whole model's first step (unscaling by a power of two is exact; the
/// norm counts W's summed gradient once).
#[test]
fn an_overflow_on_one_stage_skips_the_step_on_every_stage() {
    const ROWS: usize = 6;
    const F: usize = 5;
    let mut r = rng(7);
    let init = |r: &mut rand_chacha::ChaCha8Rng, n| common::random_vec(r, n, -0.5, 0.5);
    let (w, b0, b1) = (init(&mut r, F * F), init(&mut r, F), init(&mut r, F));
    let (xv, yv) = (init(&mut r, ROWS * F), init(&mut r, ROWS * F));
    let plain: OptimizerConfig = AdamW::new(0.05)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(0.05)
        .into();
    let scaling = LossScaling {
        init_scale: 1024.0,
        ..LossScaling::default()
    };
    let layer = |g: &mut Graph, x: Tensor, bias: (&str, &[f32])| -> wgrad::Result<Tensor> {
        let wt = g.parameter("shared.weight", &[F, F], w.clone())?;
        let b = g.parameter(bias.0, &[F], bias.1.to_vec())?;
        let h = g.rows_matmul(MatmulForm::ABt, x, wt)?;
        g.bias_add(h, b)
    };
    common::for_each_adapter("parallel_f16_checkpointing::an_overflow_on_one_stage", |k| {
        let mut g0 = Graph::new();
        let x0 = g0.input("x", &[ROWS, F])?;
        let h0 = layer(&mut g0, x0, ("0.bias", &b0))?;
        let h0 = g0.activation(Activation::Tanh, h0)?;
        let mut first = Stage::from_graph(
            k.clone(),
            g0,
            x0,
            h0,
            false,
            StageEnd::Middle,
            plain.with_loss_scaling(Some(scaling)),
        )?;
        let mut g1 = Graph::new();
        let h1 = g1.input("h", &[ROWS, F])?;
        let y1 = layer(&mut g1, h1, ("1.bias", &b1))?;
        let mut last = Stage::from_graph(
            k.clone(),
            g1,
            h1,
            y1,
            true,
            StageEnd::Last(Criterion::Mse),
            plain.with_loss_scaling(Some(scaling)),
        )?;
        let shared = [SharedParameter {
            name: "shared.weight".into(),
            holders: vec![0, 1],
        }];
        let backward = |first: &mut Stage, last: &mut Stage, scale: f32| -> wgrad::Result<()> {
            first.set_input(&xv)?;
            first.forward()?;
            last.set_input(&k.read::<f32>(first.output_view()?)?)?;
            last.set_targets(Targets::Values(&yv), scale)?;
            last.backward(true)?;
            let dh = k.read::<f32>(last.input_gradient_view().expect("asked for")?)?;
            first.set_output_gradient(&dh)?;
            first.backward(true)
        };
        let before = [first.executor().parameters()?, last.executor().parameters()?];
        backward(&mut first, &mut last, scaling.init_scale)?;
        let mut grad = first.executor().read_grad_named("0.bias")?;
        grad[2] = f32::INFINITY;
        first.executor().write_grad_named("0.bias", &grad)?;
        reduce_and_step(&mut [&mut first, &mut last], &[0, 1], &shared)?;
        assert_eq!(
            [first.executor().parameters()?, last.executor().parameters()?],
            before,
            "a skipped step moves nothing"
        );
        let state = one_scale("after the overflow", &[&first, &last]);
        assert_eq!(
            (
                state.scale,
                state.skipped,
                state.skipped_steps.clone(),
                state.steps_taken
            ),
            (512.0, 1, vec![1], 0)
        );

        backward(&mut first, &mut last, state.scale)?;
        let norm = reduce_and_step(&mut [&mut first, &mut last], &[0, 1], &shared)?.expect("the optimizer clips");
        let state = one_scale("after a clean step", &[&first, &last]);
        assert_eq!(
            (state.scale, state.skipped, state.steps_taken, state.steps_run),
            (512.0, 1, 1, 2)
        );
        // The whole model, unscaled, one step on the same batch.
        let mut g = Graph::new();
        let x = g.input("x", &[ROWS, F])?;
        let h = layer(&mut g, x, ("0.bias", &b0))?;
        let h = g.activation(Activation::Tanh, h)?;
        let wt = g
            .parameters()
            .into_iter()
            .find(|&p| g.get(p).is_some_and(|n| n.name == "shared.weight"))
            .expect("declared");
        let b = g.parameter("1.bias", &[F], b1.clone())?;
        let y = g.rows_matmul(MatmulForm::ABt, h, wt)?;
        let y = g.bias_add(y, b)?;
        let target = Criterion::Mse.targets(&mut g, y)?;
        let loss = Criterion::Mse.loss(&mut g, y, target)?;
        let grads = g.backward(loss)?;
        let mut whole = Executor::new(k.clone(), g, &[loss], Some(grads), Some(plain))?;
        whole.set_input(x, &xv)?;
        whole.set_input(target, &yv)?;
        whole.train_step(true, true, false)?;
        let want_norm = whole.read_grad_norm()?.expect("clipping");
        assert!(want_norm > 0.05, "the step clips: norm {want_norm}");
        // f64 sums of the stages' f32 partials against one f32 reduction.
        assert_close("the clean step's norm", &[norm], &[want_norm], 0.0, 1e-5);
        let stages: Parameters = first
            .executor()
            .parameters()?
            .into_iter()
            .chain(last.executor().parameters()?)
            .collect();
        for (name, _, want) in whole.parameters()? {
            for (_, _, got) in stages.iter().filter(|(n, _, _)| *n == name) {
                assert_close(&format!("{name} after the clean step"), got, &want, 1e-6, 1e-5);
            }
        }
        Ok(())
    });
}

/// A pipeline saved after 4 loss-scaled steps (the scale grown once, its
/// tracker part-way) and resumed on fresh stages takes the unbroken run's
/// next 4 steps bit for bit; the checkpoint's metadata carries the scale.
#[test]
fn a_resumed_f16_pipeline_keeps_its_loss_scale() {
    let Some(groups) = f16_pair("parallel_f16_checkpointing::resumed_pipeline") else {
        return;
    };
    let group = &groups[0];
    let model = llama(2);
    let optimizer = scaled(Some(LossScaling {
        init_scale: 1024.0,
        growth_interval: 3,
        ..LossScaling::default()
    }));
    let f16 = options(Precision::F16, false);
    let mut unbroken = pipeline(group, &model, optimizer, f16);
    losses(&mut unbroken, 8);
    let mut first = pipeline(group, &model, optimizer, f16);
    losses(&mut first, 4);
    let saved = first.read_loss_scale().unwrap().expect("loss-scaled");
    assert_eq!((saved.scale, saved.growth_tracker, saved.steps_taken), (2048.0, 1, 4));
    let ckpt = first.checkpoint().unwrap();
    assert_eq!(
        LossScaleState::from_metadata(|key| ckpt.meta(key)).unwrap().as_ref(),
        Some(&saved),
        "the checkpoint carries the scale"
    );
    let state: Vec<(String, String, Vec<f32>)> = first
        .optimizer_state()
        .unwrap()
        .into_iter()
        .map(|(p, s, v)| (p, s.to_string(), v))
        .collect();
    let mut resumed = pipeline(group, &model, optimizer, f16);
    resumed
        .load_state(&first.parameters().unwrap(), &state, Some(first.step_count()))
        .unwrap();
    resumed.load_loss_scale(&saved).unwrap();
    let stages: Vec<&Stage> = resumed.stages().iter().collect();
    assert_eq!(one_scale("resumed", &stages), saved);
    let tail: Vec<f32> = batches()[4..8]
        .iter()
        .map(|(ids, t)| {
            resumed
                .step(ids.as_slice(), Targets::Classes(t), true)
                .unwrap()
                .unwrap()
        })
        .collect();
    assert!(tail.iter().all(|l| l.is_finite()));
    assert_eq!(resumed.read_loss_scale().unwrap(), unbroken.read_loss_scale().unwrap());
    assert_eq!(
        resumed.parameters().unwrap(),
        unbroken.parameters().unwrap(),
        "the same kernels on the same numbers: equal bits"
    );
}
