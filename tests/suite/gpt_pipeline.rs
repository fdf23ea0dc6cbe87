//! A GPT trained pipeline parallel (`Pipeline`, GPipe and 1F1B) against
//! single-device training on the same global batches, and the step that
//! ends a model spread over stages (`reduce_and_step`: a shared
//! parameter's gradients summed, the whole model's norm clipped) against
//! one executor holding the whole model.

use crate::common;

use std::time::{Duration, Instant};

use common::{assert_close, rng};
use rand::Rng;
use wgrad::graph::{Executor, Graph, Tensor};
use wgrad::io::gpt_folder::OptimizerState;
use wgrad::kernels::{Activation, LrSchedule, MatmulForm, OptimizerConfig};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, Criterion, CrossEntropyLoss};
use wgrad::optim::AdamW;
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{partition, Pipeline, Schedule};
use wgrad::parallel::stage::{reduce_and_step, SharedParameter, Stage, StageEnd};
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::Error;
use wgrad::{Targets, Trainer};

/// One group per selection of the suite's shared devices; none (failing
/// in CI) without an adapter.
fn groups(test: &str, selections: &[DeviceSelection]) -> crate::parallel::Groups {
    crate::parallel::open_groups(test, selections)
}

const VOCAB: usize = 29;
const T: usize = 8;
const GLOBAL: usize = 8;
const STEPS: u64 = 10;
/// Low enough that every step clips (the norms run 1.08–1.74 here).
const MAX_NORM: f32 = 0.25;

fn config() -> GptConfig {
    GptConfig {
        vocab_size: VOCAB,
        block_size: T,
        n_layer: 3,
        n_head: 2,
        n_embd: 16,
    }
}

fn model() -> Gpt {
    nn::manual_seed(7);
    Gpt::new(config()).unwrap()
}

/// AdamW with weight decay on matrices, warmup and cosine, and clipping.
fn optimizer() -> OptimizerConfig {
    AdamW::new(3e-3)
        .betas(0.9, 0.99)
        .weight_decay(0.1)
        .decay_matrices_only()
        .schedule(LrSchedule::WarmupCosine {
            warmup_steps: 3,
            total_steps: STEPS,
            min_lr: 3e-4,
        })
        .clip_grad_norm(MAX_NORM)
        .into()
}

/// Step `step`'s batch: random tokens, each followed by a fixed function
/// of it (something to learn).
fn batch(step: u64) -> (Vec<u32>, Vec<u32>) {
    let mut r = rng(1000 + step);
    let ids: Vec<u32> = (0..GLOBAL * T).map(|_| r.random_range(0..VOCAB as u32)).collect();
    let targets = ids.iter().map(|&i| (i * 7 + 3) % VOCAB as u32).collect();
    (ids, targets)
}

type Parameters = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Single-device training: the losses and gradient norms of every step,
/// and the parameters after `steps`.
fn single_device(k: &std::sync::Arc<wgrad::Kernels>, steps: u64) -> (Vec<f32>, Vec<f32>, Parameters, Trainer) {
    let mut trainer = Trainer::new(k.clone(), &model(), CrossEntropyLoss, optimizer(), GLOBAL).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for s in 0..steps {
        let (ids, targets) = batch(s);
        trainer.zero_grad();
        trainer.forward_ids(&ids).unwrap();
        trainer.loss(Targets::Classes(&targets)).unwrap();
        trainer.backward().unwrap();
        losses.push(trainer.step_reading_loss().unwrap());
        norms.push(trainer.executor().read_grad_norm().unwrap().unwrap());
    }
    let params = trainer.executor().parameters().unwrap();
    (losses, norms, params, trainer)
}

/// The key third of an attention's `c_attn.bias`: its gradient is exactly
/// zero (a vector added to every key adds a constant to a row of scores,
/// which the softmax ignores), both sides hold rounding noise there, and
/// Adam scales noise to steps of about lr (see gpt_reference.rs). Nothing
/// depends on those values.
fn without_key_bias(name: &str, values: &[f32]) -> Vec<f32> {
    let c = config().n_embd;
    let mut v = values.to_vec();
    if name.ends_with("attn.c_attn.bias") {
        v.drain(c..2 * c);
    }
    v
}

/// Every parameter by name within atol 1e-5 + rtol 1e-4; returns the
/// largest difference.
fn assert_same_parameters(what: &str, got: &Parameters, want: &Parameters) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    let mut worst = 0.0f32;
    for (name, shape, w) in want {
        let (_, gshape, g) = got
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("{what}: no {name}"));
        assert_eq!(gshape, shape, "{what}: {name} shape");
        let (g, w) = (without_key_bias(name, g), without_key_bias(name, w));
        worst = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
        // Same math; the batch's sums run per micro-batch, then are added
        // up, and the tied gradient's two halves are added on the host:
        // f32 rounding, compounded over ten Adam steps.
        assert_close(&format!("{what}: {name}"), &g, &w, 1e-5, 1e-4);
    }
    worst
}

fn bits(params: &Parameters) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// The tied embedding's copies on the first and last stage.
fn wte_copies(p: &Pipeline) -> (Vec<f32>, Vec<f32>) {
    let copy = |stage: &Stage| {
        stage
            .executor()
            .parameters()
            .unwrap()
            .into_iter()
            .find(|(n, _, _)| n == "wte.weight")
            .unwrap()
            .2
    };
    (copy(&p.stages()[0]), copy(p.stages().last().unwrap()))
}

#[test]
fn gpt_pipeline_matches_single_device_training() {
    let selections = [
        DeviceSelection::Count(1),
        DeviceSelection::Count(2),
        DeviceSelection::Count(3),
    ];
    let groups = groups("gpt_pipeline_matches_single_device_training", &selections);
    let Some(first) = groups.first() else { return };
    let (want_losses, want_norms, want, _) = single_device(&first.members()[0], STEPS);
    assert!(
        want_norms.iter().all(|&n| n > MAX_NORM),
        "every step clips: norms {want_norms:?}"
    );
    let (mut loss_err, mut norm_err, mut param_err) = (0.0f32, 0.0f32, 0.0f32);
    for group in groups.iter() {
        let labels = group.labels().join(", ");
        let micro_counts: &[usize] = match group.len() {
            1 => &[2],
            2 => &[1, 2, 4, 8],
            _ => &[2, 4],
        };
        for &micro in micro_counts {
            let mut by_schedule = Vec::new();
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let mut p =
                    Pipeline::new(group, &model(), CrossEntropyLoss, optimizer(), GLOBAL, micro, schedule).unwrap();
                let what = format!("{} on [{labels}]", p.describe());
                assert_eq!(p.blocks_per_stage().iter().sum::<usize>(), 3, "{what}");
                for s in 0..STEPS {
                    let (ids, targets) = batch(s);
                    let loss = p.step(&ids, Targets::Classes(&targets), true).unwrap().unwrap();
                    let norm = p.stats().last_grad_norm.expect("a clipping optimizer reports the norm");
                    let su = s as usize;
                    loss_err = loss_err.max((loss - want_losses[su]).abs());
                    norm_err = norm_err.max((norm - want_norms[su]).abs() / want_norms[su]);
                    // The loss (about 3.3): per-micro-batch means weighted
                    // and summed instead of one mean, plus the weights'
                    // drift over the steps; measured up to 2.4e-7.
                    assert_close(
                        &format!("loss of step {} with {what}", s + 1),
                        &[loss],
                        &[want_losses[su]],
                        2e-6,
                        0.0,
                    );
                    // The norm (1.1–1.7): per-stage sums of squares added
                    // up, the tied gradient's counted once (counted twice,
                    // this check fails); measured up to 1.8e-7 relative.
                    assert_close(
                        &format!("gradient norm of step {} with {what}", s + 1),
                        &[norm],
                        &[want_norms[su]],
                        0.0,
                        1e-5,
                    );
                }
                assert_eq!(p.step_count(), STEPS);
                let got = p.parameters().unwrap();
                param_err = param_err.max(assert_same_parameters(&what, &got, &want));
                // The tied copies get the same summed gradient and take the
                // same step: bit-identical.
                let (wte_first, wte_last) = wte_copies(&p);
                assert_eq!(
                    wte_first.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                    wte_last.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                    "wte copies of {what}"
                );
                let ideal = p.ideal_bubble_fraction();
                assert!(
                    (ideal - (group.len() - 1) as f64 / (micro + group.len() - 1) as f64).abs() < 1e-12,
                    "{what}"
                );
                assert!((0.0..=1.0).contains(&p.measured_bubble_fraction()), "{what}");
                let report = p.report();
                assert!(
                    report.starts_with("10 steps")
                        && report.contains(&format!("{:?} micro-batches", p.stats().peak_in_flight)),
                    "{report}"
                );
                by_schedule.push((bits(&got), p));
            }
            // Both schedules run the same backward passes in the same
            // micro-batch order on every stage: bit-identical weights.
            assert_eq!(
                by_schedule[0].0, by_schedule[1].0,
                "GPipe and 1F1B with {micro} micro-batches on [{labels}]"
            );
            // What 1F1B changes: the host stash. GPipe holds every
            // micro-batch on each stage; 1F1B at most S − s on stage s.
            let stages = group.len();
            let (gpipe, one_f_one_b) = (&by_schedule[0].1, &by_schedule[1].1);
            for s in 0..stages {
                let in_flight = |p: &Pipeline| p.stats().peak_in_flight[s];
                if stages > 1 {
                    assert_eq!(
                        in_flight(gpipe),
                        micro,
                        "GPipe stage {s} of {stages}, {micro} micro-batches"
                    );
                    assert!(
                        in_flight(one_f_one_b) <= (stages - s).min(micro),
                        "1F1B stage {s}: {:?}",
                        one_f_one_b.stats().peak_in_flight
                    );
                }
            }
        }
    }
    println!("gpt pipeline vs single device: losses |err| {loss_err:.1e}, gradient norms rel err {norm_err:.1e}, parameters |err| {param_err:.1e}");
}

/// Evaluation is forward only, and a pipeline's checkpoint resumes on one
/// device (single-device names, optimizer state and step) to the
/// uninterrupted single-device run; loaded back into a pipeline it
/// continues that pipeline bit for bit.
#[test]
fn gpt_pipeline_evaluates_and_resumes_in_single_device_names() {
    let groups = groups(
        "gpt_pipeline_evaluates_and_resumes_in_single_device_names",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    const HALF: u64 = STEPS / 2;
    let (_, _, want, mut reference) = single_device(&group.members()[0], STEPS);
    let mut p = Pipeline::new(
        group,
        &model(),
        CrossEntropyLoss,
        optimizer(),
        GLOBAL,
        4,
        Schedule::OneFOneB,
    )
    .unwrap();
    for s in 0..HALF {
        let (ids, targets) = batch(s);
        p.step(&ids, Targets::Classes(&targets), false).unwrap();
    }
    let (ids, targets) = batch(99);
    let before = bits(&p.parameters().unwrap());
    let evaluated = p.evaluate_loss(&ids, Targets::Classes(&targets)).unwrap();
    assert_eq!(
        bits(&p.parameters().unwrap()),
        before,
        "evaluation leaves the weights alone"
    );
    assert_eq!(p.step_count(), HALF);

    let ckpt = p.checkpoint().unwrap();
    let state = OptimizerState::from_checkpoint(&ckpt).unwrap();
    assert_eq!(state.step, HALF);
    assert_eq!(state.state_names(), ["exp_avg", "exp_avg_sq"]);
    // The single-device model's names, each once.
    let names = p
        .parameters()
        .unwrap()
        .into_iter()
        .map(|(n, _, _)| n)
        .collect::<Vec<_>>();
    assert_eq!(names.iter().filter(|n| *n == "wte.weight").count(), 1);
    assert_eq!(state.state.len(), 2 * names.len());

    // On one device: the pipeline's model, its optimizer state and step.
    let k = &group.members()[0];
    let mut values = p.parameters().unwrap();
    let halfway = Gpt::from_parameters(config(), |name, _| {
        Ok(values.remove(values.iter().position(|(n, _, _)| n == name).unwrap()).2)
    })
    .unwrap();
    let mut single = Trainer::new(k.clone(), &halfway, CrossEntropyLoss, optimizer(), GLOBAL).unwrap();
    single
        .executor_mut()
        .load_state(&[], &state.state, Some(state.step))
        .unwrap();
    // The same batch's loss as the pipeline evaluated it (same weights;
    // summation order only).
    let on_one = single
        .evaluate_loss(wgrad::Examples::Ids(&ids), Targets::Classes(&targets))
        .unwrap();
    assert_close(
        &format!("evaluated loss on [{labels}]"),
        &[evaluated],
        &[on_one],
        2e-6,
        0.0,
    );
    for s in HALF..STEPS {
        let (ids, targets) = batch(s);
        single.zero_grad();
        single.forward_ids(&ids).unwrap();
        single.loss(Targets::Classes(&targets)).unwrap();
        single.backward().unwrap();
        single.step().unwrap();
    }
    assert_same_parameters(
        &format!("half on [{labels}], half resumed on one device"),
        &single.executor().parameters().unwrap(),
        &want,
    );
    let reference_eval = reference
        .evaluate_loss(wgrad::Examples::Ids(&ids), Targets::Classes(&targets))
        .unwrap();
    assert!(reference_eval.is_finite());

    // Back into a fresh pipeline (the initial model, then the checkpoint's
    // weights and state): it continues as the first one does.
    let params: Parameters = ckpt
        .tensors
        .iter()
        .filter(|t| !t.name.starts_with("optim."))
        .map(|t| (t.name.clone(), t.shape.clone(), t.data.clone()))
        .collect();
    let mut resumed = Pipeline::new(
        group,
        &model(),
        CrossEntropyLoss,
        optimizer(),
        GLOBAL,
        4,
        Schedule::OneFOneB,
    )
    .unwrap();
    resumed.load_state(&params, &state.state, Some(state.step)).unwrap();
    for s in HALF..STEPS {
        let (ids, targets) = batch(s);
        p.step(&ids, Targets::Classes(&targets), false).unwrap();
        resumed.step(&ids, Targets::Classes(&targets), false).unwrap();
    }
    assert_eq!(
        bits(&resumed.parameters().unwrap()),
        bits(&p.parameters().unwrap()),
        "resumed pipeline on [{labels}]"
    );
    let (a, b) = wte_copies(&resumed);
    assert_eq!(a, b, "the loaded wte went to both stages");

    // Unknown names and wrong sizes are refused before anything changes.
    let err = resumed
        .load_state(
            &[("lm_head.weight".into(), vec![VOCAB, 16], vec![0.0; VOCAB * 16])],
            &[],
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("lm_head.weight"), "{err}");
    let err = resumed
        .load_state(&[], &[("ln_f.bias".into(), "exp_avg".into(), vec![0.0; 3])], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ln_f.bias") && err.contains('3'), "{err}");
}

#[test]
fn blocks_are_balanced_by_work_and_impossible_splits_are_refused() {
    let gpt2 = GptConfig::gpt2();
    let balance_blocks = |config: &GptConfig, stages| partition(&config.stage_costs(config.n_layer), stages);
    // GPT-2's head (768 × 50257) costs about four and a half blocks.
    assert_eq!(balance_blocks(&gpt2, 2).unwrap(), [8, 4]);
    assert_eq!(balance_blocks(&gpt2, 1).unwrap(), [12]);
    let three = balance_blocks(&gpt2, 3).unwrap();
    assert_eq!(three.iter().sum::<usize>(), 12);
    assert!(three[2] < three[0], "{three:?}");
    // The default GPT (L4 C128 T64, 65 characters): a small head.
    let small = GptConfig {
        vocab_size: 65,
        block_size: 64,
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
    };
    assert_eq!(balance_blocks(&small, 2).unwrap(), [2, 2]);
    assert_eq!(balance_blocks(&config(), 2).unwrap(), [2, 1]);
    // Every stage needs a block, the embedding or the head.
    assert_eq!(balance_blocks(&config(), 5).unwrap(), [0, 1, 1, 1, 0]);
    let err = balance_blocks(&config(), 6).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("6 stages") && text.contains("3 blocks") && text.contains("at most 5"),
        "{text}"
    );
}

#[test]
fn gpt_pipeline_refuses_bad_batches_and_splits() {
    let selections = [DeviceSelection::Count(2), DeviceSelection::Count(3)];
    let groups = groups("gpt_pipeline_refuses_bad_batches_and_splits", &selections);
    let [two, three] = &groups[..] else { return };
    let reason =
        |group: &DeviceGroup, global: usize, micro: usize, blocks: Option<Vec<usize>>| match Pipeline::with_blocks(
            group,
            &model(),
            CrossEntropyLoss,
            optimizer(),
            global,
            micro,
            Schedule::GPipe,
            blocks,
        ) {
            Err(e @ Error::InvalidArgument { .. }) => e.to_string(),
            Err(other) => panic!("expected InvalidArgument, got {other}"),
            Ok(_) => panic!("global {global}, micro {micro} was accepted"),
        };
    let text = reason(two, 6, 4, None);
    assert!(
        text.contains("global batch of 6") && text.contains("4 equal micro-batches"),
        "{text}"
    );
    let text = reason(two, 6, 0, None);
    assert!(text.contains("0 equal micro-batches"), "{text}");
    let text = reason(two, 8, 2, Some(vec![3, 1]));
    assert!(text.contains("[3, 1]") && text.contains("3 blocks"), "{text}");
    let text = reason(three, 8, 2, Some(vec![2, 0, 1]));
    assert!(text.contains("[2, 0, 1]") && text.contains("middle"), "{text}");
    // An explicit split is taken as given.
    let p = Pipeline::with_blocks(
        three,
        &model(),
        CrossEntropyLoss,
        optimizer(),
        8,
        2,
        Schedule::OneFOneB,
        Some(vec![0, 2, 1]),
    )
    .unwrap();
    assert_eq!(p.blocks_per_stage(), [0, 2, 1]);
    assert!(
        p.describe().contains("stage 0 on #0") && p.describe().contains("1F1B"),
        "{}",
        p.describe()
    );
    // Batches of the wrong size name the call.
    let mut p = Pipeline::new(two, &model(), CrossEntropyLoss, optimizer(), 8, 2, Schedule::GPipe).unwrap();
    let (ids, targets) = batch(0);
    let err = p
        .step(&ids[T..], Targets::Classes(&targets[T..]), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Pipeline::step") && err.contains("8 × 8"), "{err}");
    let err = p
        .evaluate_loss(&ids, Targets::Classes(&targets[1..]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("Pipeline::evaluate_loss"), "{err}");
    // A token id past the vocabulary is refused on the stage reading it.
    let mut bad = ids.clone();
    bad[3] = VOCAB as u32;
    let err = p.step(&bad, Targets::Classes(&targets), false).unwrap_err().to_string();
    assert!(err.contains("device #0"), "{err}");
}

#[test]
fn a_device_failing_mid_training_is_an_error_naming_it() {
    // Devices of its own: it destroys one.
    let groups = crate::parallel::open_fresh_groups(
        "gpt_pipeline: a_device_failing_mid_training_is_an_error_naming_it",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let mut p = Pipeline::new(group, &model(), CrossEntropyLoss, optimizer(), 4, 2, Schedule::OneFOneB).unwrap();
    let (ids, targets) = batch(0);
    let (ids, targets) = (&ids[..4 * T], &targets[..4 * T]);
    p.step(ids, Targets::Classes(targets), false).unwrap();
    group.members()[1].device().wgpu_device().destroy();
    let start = Instant::now();
    let err = p.step(ids, Targets::Classes(targets), true).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(30), "failed fast");
    match &err {
        Error::OnDevice { device, .. } => assert!(device.starts_with("#1 "), "{err}"),
        other => panic!("expected an error naming device #1, got {other}"),
    }
}

/// Two stages holding one parameter (`shared.weight`: used by both, as
/// the tied embedding is), against one executor holding the whole model:
/// y = tanh(x·Wᵀ + b0)·Wᵀ + b1 with an MSE loss, three AdamW steps with
/// weight decay, clipped by a norm low enough to clip every step.
#[test]
fn reduce_and_step_sums_shared_gradients_and_clips_by_the_whole_models_norm() {
    const ROWS: usize = 6;
    const F: usize = 5;
    const MAX: f32 = 0.05;
    let mut r = rng(5);
    let init = |r: &mut rand_chacha::ChaCha8Rng, n| common::random_vec(r, n, -0.5, 0.5);
    let (w, b0, b1) = (init(&mut r, F * F), init(&mut r, F), init(&mut r, F));
    let batches: Vec<(Vec<f32>, Vec<f32>)> = (0..3)
        .map(|_| (init(&mut r, ROWS * F), init(&mut r, ROWS * F)))
        .collect();
    let opt: OptimizerConfig = AdamW::new(0.05)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(MAX)
        .into();
    let first_half = |g: &mut Graph, x: Tensor| -> Tensor {
        let wt = g.parameter("shared.weight", &[F, F], w.clone()).unwrap();
        let bias = g.parameter("0.bias", &[F], b0.clone()).unwrap();
        let h = g.rows_matmul(MatmulForm::ABt, x, wt).unwrap();
        let h = g.bias_add(h, bias).unwrap();
        g.activation(Activation::Tanh, h).unwrap()
    };
    let second_half = |g: &mut Graph, h: Tensor, wt: Option<Tensor>| -> Tensor {
        let wt = wt.unwrap_or_else(|| g.parameter("shared.weight", &[F, F], w.clone()).unwrap());
        let bias = g.parameter("1.bias", &[F], b1.clone()).unwrap();
        let y = g.rows_matmul(MatmulForm::ABt, h, wt).unwrap();
        g.bias_add(y, bias).unwrap()
    };
    common::for_each_adapter("reduce_and_step", |k| {
        // The whole model on one executor.
        let mut g = Graph::new();
        let x = g.input("x", &[ROWS, F])?;
        let h = first_half(&mut g, x);
        let wt = g
            .parameters()
            .into_iter()
            .find(|&p| g.get(p).is_some_and(|n| n.name == "shared.weight"));
        let y = second_half(&mut g, h, wt);
        let target = Criterion::Mse.targets(&mut g, y)?;
        let loss = Criterion::Mse.loss(&mut g, y, target)?;
        let grads = g.backward(loss)?;
        let mut whole = Executor::new(k.clone(), g, &[loss], Some(grads), Some(opt))?;
        // The same model as two stages on this device.
        let mut g0 = Graph::new();
        let x0 = g0.input("x", &[ROWS, F])?;
        let h0 = first_half(&mut g0, x0);
        let mut first = Stage::from_graph(k.clone(), g0, x0, h0, false, StageEnd::Middle, opt)?;
        let mut g1 = Graph::new();
        let h1 = g1.input("h", &[ROWS, F])?;
        let y1 = second_half(&mut g1, h1, None);
        let mut last = Stage::from_graph(k.clone(), g1, h1, y1, true, StageEnd::Last(Criterion::Mse), opt)?;
        let shared = [SharedParameter {
            name: "shared.weight".into(),
            holders: vec![0, 1],
        }];
        for (step, (xv, yv)) in batches.iter().enumerate() {
            whole.set_input(x, xv)?;
            whole.set_input(target, yv)?;
            whole.train_step(true, true, false)?;
            let want_norm = whole.read_grad_norm()?.expect("clipping");
            assert!(want_norm > MAX, "step {step} clips: norm {want_norm}");

            first.set_input(xv)?;
            first.forward()?;
            let h = k.read::<f32>(first.output_view()?)?;
            last.set_input(&h)?;
            last.set_targets(Targets::Values(yv), 1.0)?;
            last.backward(true)?;
            let dh = k.read::<f32>(last.input_gradient_view().expect("asked for")?)?;
            first.set_input(xv)?;
            first.set_output_gradient(&dh)?;
            first.backward(true)?;
            let norm = reduce_and_step(&mut [&mut first, &mut last], &[0, 1], &shared)?.expect("the optimizer clips");
            // Counting the shared gradient twice gives 0.318 instead of
            // 0.295 at the first step; the host's f64 sums against the
            // GPU's f32 reduction differ in the last bits.
            assert_close(
                &format!("gradient norm of step {step}"),
                &[norm],
                &[want_norm],
                0.0,
                1e-5,
            );
        }
        let whole_params = whole.parameters()?;
        let stage_params: Vec<_> = first
            .executor()
            .parameters()?
            .into_iter()
            .chain(last.executor().parameters()?)
            .collect();
        let copies: Vec<&Vec<f32>> = stage_params
            .iter()
            .filter(|(n, _, _)| n == "shared.weight")
            .map(|(_, _, v)| v)
            .collect();
        assert_eq!(copies.len(), 2);
        assert_eq!(copies[0], copies[1], "both copies took the same step");
        for (name, _, want) in &whole_params {
            let got = &stage_params
                .iter()
                .find(|(n, _, _)| n == name)
                .unwrap_or_else(|| panic!("no {name}"))
                .2;
            // The shared gradient is a sum of two halves in another order,
            // then three Adam steps (each about lr = 0.05).
            assert_close(&format!("{name} after three steps"), got, want, 1e-6, 1e-5);
        }
        Ok(())
    });
}
