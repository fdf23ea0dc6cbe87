//! Data parallel with f16 activations and activation checkpointing, in one
//! process and as one process of a distributed job: step by step the
//! single-device run's losses, an overflow on one replica skipping the
//! step on every replica, the loss scale kept through a re-split, a
//! broadcast from rank 0 and a checkpoint. Two devices on the adapter
//! with SHADER_F16 (lavapipe), an uneven split.

use crate::common;
use crate::parallel::{open_groups, Groups};

use std::sync::Arc;

use common::assert_close;
use wgrad::graph::{PlanOptions, Precision};
use wgrad::io::text::{random_windows, CharTokenizer};
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, MSELoss, Sequential};
use wgrad::optim::{AdamW, LossScaleState, LossScaling};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::distributed::{DistributedDataParallel, ProcessGroup, SingleProcess};
use wgrad::parallel::engine::{Strategy, TrainEngine};
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::train::{Evaluation, LanguageModel, Summary, TextSource, TrainConfig, TrainingRun};
use wgrad::{Targets, Trainer};

const PANGRAM: &str = "the quick brown fox, jumps over the lazy dog. ";
/// Global batch and its uneven split over the two devices.
const BATCH: usize = 5;
const SPLIT: [usize; 2] = [2, 3];

/// Two devices on the first adapter with SHADER_F16; none (said why)
/// without one.
fn f16_pair(test: &str) -> Groups {
    let Some(index) = common::reports()
        .iter()
        .find(|r| r.features.contains(wgpu::Features::SHADER_F16))
        .map(|r| r.index)
    else {
        eprintln!("{test}: no adapter with SHADER_F16, skipped");
        return open_groups(test, &[]);
    };
    open_groups(
        test,
        &[DeviceSelection::Adapters(vec![index.to_string(), index.to_string()])],
    )
}

fn options(precision: Precision, checkpoint_activations: bool) -> PlanOptions {
    PlanOptions {
        precision,
        checkpoint_activations,
        ..PlanOptions::default()
    }
}

/// Clipped AdamW, loss-scaled by `scaling`.
fn adamw(scaling: LossScaling) -> OptimizerConfig {
    AdamW::new(1e-2)
        .betas(0.9, 0.95)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(1.0)
        .loss_scaling(scaling)
        .into()
}

/// L3 H2 C16 T11 on the pangram: three blocks to recompute.
fn gpt() -> Gpt {
    nn::manual_seed(3);
    Gpt::new(GptConfig {
        vocab_size: 29,
        block_size: 11,
        n_layer: 3,
        n_head: 2,
        n_embd: 16,
    })
    .unwrap()
}

fn gpt_batches(steps: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let tokens = CharTokenizer::from_text(PANGRAM)
        .unwrap()
        .encode(&PANGRAM.repeat(20))
        .unwrap();
    let mut rng = common::rng(5);
    (0..steps)
        .map(|_| random_windows(&tokens, BATCH, 11, &mut rng).unwrap())
        .collect()
}

fn state(t: &Trainer) -> LossScaleState {
    t.executor()
        .read_loss_scale()
        .unwrap()
        .expect("a loss-scaled optimizer")
}

/// f16 data parallel (with and without checkpointing) against one device
/// planned the same way, on the same global batches: the losses step by
/// step and the loss scale's state; and against f32 data parallel.
#[test]
fn f16_data_parallel_follows_one_device_step_by_step() {
    let batches = gpt_batches(6);
    for group in f16_pair("data_parallel_precision::f16_data_parallel_follows_one_device") {
        for checkpoint in [false, true] {
            let (model, opts) = (gpt(), options(Precision::F16, checkpoint));
            let optimizer = adamw(LossScaling::default());
            let mut single = Trainer::with_blocks(
                group.members()[0].clone(),
                &model,
                CrossEntropyLoss,
                optimizer,
                BATCH,
                opts,
            )
            .unwrap();
            let mut dp = DataParallel::with_options(
                &group,
                &model,
                CrossEntropyLoss,
                optimizer,
                BATCH,
                Split::Rows(SPLIT.to_vec()),
                opts,
            )
            .unwrap();
            let (mut want, mut got) = (Vec::new(), Vec::new());
            for (x, y) in &batches {
                single.zero_grad();
                single.forward_ids(x).unwrap();
                single.loss(Targets::Classes(y)).unwrap();
                single.backward().unwrap();
                want.push(single.step_reading_loss().unwrap());
                got.push(dp.step(x, Targets::Classes(y), true).unwrap().unwrap());
            }
            let what = format!("f16 data parallel {SPLIT:?}, checkpointing {checkpoint}");
            let drift = got
                .iter()
                .zip(&want)
                .map(|(g, w)| ((g - w) / w).abs())
                .fold(0.0f32, f32::max);
            eprintln!("{what}: largest relative loss difference against one device {drift:.2e}");
            // The same f16 roundings of the same activations; the shards'
            // means are weighted and their gradients summed in another
            // order (f32 ulps), which can move an f16 rounding by one step
            // (2^-11) in a few values: relative 1e-4 on the mean loss.
            assert_close(&format!("{what}: losses"), &got, &want, 0.0, 1e-4);
            // And the same engine in f32: f16 keeps 11 bits of each stored
            // activation; over 6 steps within 1e-3 relative (measured
            // 2.6e-5; mixed_precision.rs's tiny GPT drifts 8e-4 over 20).
            let mut f32_dp = DataParallel::with_options(
                &group,
                &model,
                CrossEntropyLoss,
                optimizer.with_loss_scaling(None),
                BATCH,
                Split::Rows(SPLIT.to_vec()),
                options(Precision::F32, checkpoint),
            )
            .unwrap();
            let f32_losses: Vec<f32> = batches
                .iter()
                .map(|(x, y)| f32_dp.step(x, Targets::Classes(y), true).unwrap().unwrap())
                .collect();
            let drift = got
                .iter()
                .zip(&f32_losses)
                .map(|(g, w)| ((g - w) / w).abs())
                .fold(0.0f32, f32::max);
            eprintln!("{what}: largest relative loss difference against f32 data parallel {drift:.2e}");
            assert_close(
                &format!("{what}: losses against f32 data parallel"),
                &got,
                &f32_losses,
                0.0,
                1e-3,
            );
            let want_state = state(&single);
            assert_eq!(
                (want_state.steps_taken, want_state.skipped),
                (6, 0),
                "{what}: no overflow at 2^16 here"
            );
            for (r, replica) in dp.replicas().iter().enumerate() {
                assert_eq!(state(replica), want_state, "{what}: replica {r}'s loss scale");
                assert_eq!(replica.precision(), Precision::F16);
            }
            // Parameters are compared by the losses they give: the key
            // bias's gradient is zero but for rounding (softmax ignores
            // it), which Adam turns into steps of ±lr. The replicas, on one
            // adapter, take the same steps on the same all-reduced
            // gradients: bit for bit.
            let bits = |t: &Trainer| -> Vec<Vec<u32>> {
                t.executor()
                    .parameters()
                    .unwrap()
                    .iter()
                    .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
                    .collect()
            };
            assert!(
                bits(&dp.replicas()[1]) == bits(&dp.replicas()[0]),
                "{what}: the replicas' parameters differ"
            );
        }
    }
}

/// Checkpointed data parallel trains as plain data parallel (the same
/// kernels recomputed) and every replica holds less.
#[test]
fn checkpointed_data_parallel_trains_as_plain_data_parallel() {
    let batches = gpt_batches(4);
    for group in f16_pair("data_parallel_precision::checkpointed_data_parallel") {
        let optimizer: OptimizerConfig = AdamW::new(1e-2).clip_grad_norm(1.0).into();
        let mut runs = Vec::new();
        for checkpoint in [false, true] {
            let mut dp = DataParallel::with_options(
                &group,
                &gpt(),
                CrossEntropyLoss,
                optimizer,
                BATCH,
                Split::Rows(SPLIT.to_vec()),
                options(Precision::F32, checkpoint),
            )
            .unwrap();
            let losses: Vec<f32> = batches
                .iter()
                .map(|(x, y)| dp.step(x, Targets::Classes(y), true).unwrap().unwrap())
                .collect();
            runs.push((dp, losses));
        }
        let ((plain, want), (checkpointed, got)) = (&runs[0], &runs[1]);
        // As activation_checkpointing.rs: the plan may fuse the recomputed
        // copies differently (f32 ulps).
        assert_close("checkpointed data parallel: losses", got, want, 1e-6, 1e-5);
        for (r, (c, p)) in checkpointed.replicas().iter().zip(plain.replicas()).enumerate() {
            for ((name, _, g), (_, _, w)) in c
                .executor()
                .parameters()
                .unwrap()
                .iter()
                .zip(&p.executor().parameters().unwrap())
            {
                assert_close(
                    &format!("checkpointed data parallel: {name} on replica {r}"),
                    g,
                    w,
                    1e-6,
                    1e-4,
                );
            }
            let (held, held_plain) = (
                c.executor().plan().held_activation_bytes,
                p.executor().plan().held_activation_bytes,
            );
            assert!(
                held < held_plain / 2,
                "replica {r} ({} rows): checkpointing holds {held} B of activations, plain {held_plain} B",
                SPLIT[r]
            );
        }
        let (planned, planned_plain) = (checkpointed.memory(), plain.memory());
        eprintln!("checkpointed data parallel: fullest device {planned:?} against {planned_plain:?}");
        assert!(
            planned.activations < planned_plain.activations,
            "the run's memory report: {planned:?} against {planned_plain:?}"
        );
        let (ours, theirs) = (
            checkpointed.footprint().intermediates.unwrap(),
            plain.footprint().intermediates.unwrap(),
        );
        assert!(
            ours.0 < theirs.0,
            "planned intermediates {} B against plain {} B",
            ours.0,
            theirs.0
        );
    }
}

/// Linear(5, 128) ReLU Linear(128, 3) on MSE: small enough to train many
/// times, its hidden activation kept in f16 (a row of it is
/// `MIN_F16_VALUES` long, so even a one-row shard stores it in f16).
fn mlp() -> Sequential {
    nn::manual_seed(5);
    Sequential::mlp(&[5, 128, 3], Layer::ReLU).unwrap()
}

/// Batch `step` of [`BATCH`] rows; at `overflow_step` row 0 (device 0's
/// shard only) holds 1e30, which overflows f16 and the scaled gradient.
fn mlp_batch(step: u64, overflow_step: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = common::rng(200 + step);
    let mut x = common::random_vec(&mut rng, BATCH * 5, -2.0, 2.0);
    if step == overflow_step {
        x[0] = 1e30;
    }
    (x, common::random_vec(&mut rng, BATCH * 3, -1.0, 1.0))
}

/// The overflow step, and a scale that grows every 2 clean steps.
const OVERFLOW: u64 = 3;
const SCALING: LossScaling = LossScaling {
    init_scale: 1024.0,
    growth_factor: 2.0,
    backoff_factor: 0.5,
    growth_interval: 2,
};

fn mlp_single(k: &Arc<wgrad::Kernels>, steps: u64) -> Trainer {
    let mut t = Trainer::with_blocks(
        k.clone(),
        &mlp(),
        MSELoss,
        adamw(SCALING),
        BATCH,
        options(Precision::F16, false),
    )
    .unwrap();
    for step in 1..=steps {
        let (x, y) = mlp_batch(step, OVERFLOW);
        t.zero_grad();
        t.forward(&x).unwrap();
        t.loss(Targets::Values(&y)).unwrap();
        t.backward().unwrap();
        t.step().unwrap();
    }
    t
}

/// Every replica against one device's run: the same loss scale's state,
/// and parameters up to the shards' summation order (f32 ulps of the
/// gradient, compounded over AdamW steps; measured: 6e-6).
fn assert_replicas_follow(what: &str, replicas: &[Trainer], single: &Trainer) {
    let (want_state, want) = (state(single), single.executor().parameters().unwrap());
    for (r, t) in replicas.iter().enumerate() {
        assert_eq!(
            state(t),
            want_state,
            "{what}: replica {r}'s loss scale against one device's"
        );
        for ((name, _, g), (_, _, w)) in t.executor().parameters().unwrap().iter().zip(&want) {
            assert_close(&format!("{what}: {name} on replica {r}"), g, w, 1e-5, 1e-4);
        }
    }
}

/// Only device 0's shard overflows, yet device 1 (finite gradients of its
/// own) skips the step too: the all-reduced gradient holds the inf. Both
/// skip exactly the single device's step, halve the scale alike and end
/// with its parameters.
#[test]
fn an_overflow_on_one_replica_skips_the_step_on_every_replica() {
    const STEPS: u64 = 6;
    for group in f16_pair("data_parallel_precision::an_overflow_on_one_replica") {
        let single = mlp_single(&group.members()[0], STEPS);
        let want = state(&single);
        assert_eq!(
            (want.skipped, want.skipped_steps.clone(), want.steps_taken),
            (1, vec![OVERFLOW], STEPS - 1),
            "one device skips the overflow step"
        );
        let mut dp = DataParallel::with_options(
            &group,
            &mlp(),
            MSELoss,
            adamw(SCALING),
            BATCH,
            Split::Rows(SPLIT.to_vec()),
            options(Precision::F16, false),
        )
        .unwrap();
        let mut before = Vec::new();
        for step in 1..=STEPS {
            let (x, y) = mlp_batch(step, OVERFLOW);
            if step == OVERFLOW {
                before = dp
                    .replicas()
                    .iter()
                    .map(|t| t.executor().parameters().unwrap())
                    .collect();
            }
            dp.step(&x, Targets::Values(&y), false).unwrap();
            if step == OVERFLOW {
                for (r, t) in dp.replicas().iter().enumerate() {
                    assert_eq!(
                        t.executor().parameters().unwrap(),
                        before[r],
                        "replica {r} moved on the overflow step"
                    );
                    assert_eq!(state(t).skipped_steps, vec![OVERFLOW], "replica {r}");
                }
            }
        }
        assert_replicas_follow("after an overflow", dp.replicas(), &single);
    }
}

/// A re-split (new rows per device, replicas rebuilt through the host)
/// keeps the scale, its counters and history, so training goes on as if
/// the split had not changed.
#[test]
fn a_resplit_keeps_the_loss_scale() {
    const STEPS: u64 = 8;
    for group in f16_pair("data_parallel_precision::a_resplit_keeps_the_loss_scale") {
        let single = mlp_single(&group.members()[0], STEPS);
        // Measured, never re-split on its own: the test re-splits.
        let mut dp = DataParallel::with_options(
            &group,
            &mlp(),
            MSELoss,
            adamw(SCALING),
            BATCH,
            Split::Measured { every: 0 },
            options(Precision::F16, false),
        )
        .unwrap();
        for step in 1..=STEPS {
            if step == OVERFLOW + 2 {
                let saved = state(&dp.replicas()[0]);
                assert!(saved.skipped == 1 && saved.growth_tracker == 1, "{saved:?}");
                // What a cross-process re-split does to this process.
                dp.set_global_batch(BATCH - 1).unwrap();
                dp.set_global_batch(BATCH).unwrap();
                for (r, t) in dp.replicas().iter().enumerate() {
                    assert_eq!(state(t), saved, "replica {r} after the re-split");
                }
            }
            let (x, y) = mlp_batch(step, OVERFLOW);
            dp.step(&x, Targets::Values(&y), false).unwrap();
        }
        assert!(
            state(&single).scale > SCALING.init_scale,
            "the scale grew after the skip: {:?}",
            state(&single)
        );
        assert_replicas_follow("re-split", dp.replicas(), &single);
    }
}

/// The distributed engine (here the only process of its job) plans the
/// options, and its state broadcast and its checkpoint carry the loss
/// scale: `sync_from_root` used to start it afresh.
#[test]
fn distributed_data_parallel_carries_the_loss_scale() {
    const STEPS: u64 = 6;
    for group in f16_pair("data_parallel_precision::distributed_data_parallel_carries_the_loss_scale") {
        let single = mlp_single(&group.members()[0], STEPS);
        let ddp = |group: &DeviceGroup| {
            DistributedDataParallel::with_options(
                Arc::new(SingleProcess),
                group,
                &mlp(),
                MSELoss,
                adamw(SCALING),
                BATCH,
                None,
                options(Precision::F16, true),
            )
            .unwrap()
        };
        let mut engine = ddp(&group);
        assert!(engine
            .local()
            .replicas()
            .iter()
            .all(|t| t.precision() == Precision::F16));
        for step in 1..=STEPS {
            let (x, y) = mlp_batch(step, OVERFLOW);
            engine.step(&x, Targets::Values(&y), false).unwrap();
        }
        let want = state(&single);
        assert_eq!(state(engine.replica()), want);
        engine.sync_from_root().unwrap();
        assert_replicas_follow("after sync_from_root", engine.local().replicas(), &single);
        // Resuming as the training run does: state, then the scale from
        // the checkpoint's metadata, then rank 0's state to every rank.
        let ckpt = engine.checkpoint().unwrap();
        let scale = LossScaleState::from_metadata(|key| ckpt.meta(key))
            .unwrap()
            .expect("the checkpoint carries the loss scale");
        assert_eq!(scale, want);
        let params: Vec<(String, Vec<usize>, Vec<f32>)> = engine.parameters().unwrap();
        let opt: Vec<(String, String, Vec<f32>)> = engine
            .optimizer_state()
            .unwrap()
            .into_iter()
            .map(|(p, s, v)| (p, s.to_string(), v))
            .collect();
        let mut resumed = ddp(&DeviceGroup::from_kernels(group.members().to_vec()).unwrap());
        resumed.load_state(&params, &opt, Some(engine.step_count())).unwrap();
        resumed.load_loss_scale(&scale).unwrap();
        resumed.sync_from_root().unwrap();
        for (r, t) in resumed.local().replicas().iter().enumerate() {
            assert_eq!(state(t), want, "resumed replica {r}");
        }
    }
}

fn validation(s: &Summary) -> f32 {
    match s.evaluation {
        Evaluation::ValidationLoss(v) => v,
        other => panic!("a language model's run ended with {other:?}"),
    }
}

/// `wgrad train --parallel data --precision f16 --checkpoint-activations`
/// as the run builds it, in one process and as a distributed job of one,
/// ends where the single-device run with the same flags ends.
#[test]
fn an_f16_checkpointed_data_parallel_run_ends_where_one_device_ends() {
    let groups = f16_pair("data_parallel_precision::an_f16_checkpointed_data_parallel_run");
    let Some(group) = groups.first() else { return };
    let config = TrainConfig {
        batch_size: BATCH,
        max_steps: Some(8),
        optimizer: AdamW::new(1e-2).clip_grad_norm(1.0).into(),
        eval_every: 4,
        loss_every: 4,
        seed: 7,
        precision: Precision::F16,
        checkpoint_activations: true,
        ..TrainConfig::default()
    };
    let task = || LanguageModel::<Gpt> {
        text: TextSource::Text(PANGRAM.repeat(60)),
        eval_batches: 2,
        ..LanguageModel::new(GptConfig {
            vocab_size: 0,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
        })
    };
    let regroup = || DeviceGroup::from_kernels(group.members().to_vec()).unwrap();
    let want = TrainingRun::with_kernels(group.members()[0].clone(), config.clone(), task(), &mut ())
        .unwrap()
        .fit(&mut ())
        .unwrap()
        .unwrap();
    let data = TrainConfig {
        strategy: Some(Strategy::Data),
        ..config
    };
    for (what, across_processes) in [("data parallel", false), ("distributed, one process", true)] {
        // Across processes the split names rows per process.
        let (split, processes) = if across_processes {
            (None, Some(Arc::new(SingleProcess) as Arc<dyn ProcessGroup>))
        } else {
            (Some(SPLIT.to_vec()), None)
        };
        let mut run = TrainingRun::with_devices(
            regroup(),
            TrainConfig { split, ..data.clone() },
            task(),
            processes,
            &mut (),
        )
        .unwrap();
        assert_eq!(run.info().precision, Precision::F16, "{what}");
        assert!(run.info().held_activation_bytes.is_some(), "{what}");
        let got = run.fit(&mut ()).unwrap().unwrap();
        let last = |s: &Summary| s.train_curve.last().map(|p| p.1).unwrap();
        eprintln!(
            "{what}, f16 + checkpointing: final losses {} / {} against one device's {} / {}",
            last(&got),
            validation(&got),
            last(&want),
            validation(&want)
        );
        // Summation order of the batch (see gpt_data_parallel.rs): 1e-3 relative.
        for (name, a, b) in [
            ("training", last(&got), last(&want)),
            ("validation", validation(&got), validation(&want)),
        ] {
            assert!(
                a.is_finite() && (a - b).abs() <= 1e-3 * b.abs(),
                "{what}: final {name} loss {a} against {b}"
            );
        }
        assert_eq!(got.loss_scale, want.loss_scale, "{what}: the loss scale's state");
    }
}
