//! Data parallel training of the GPT: replicas on several devices (both CPU
//! adapters, one of them twice for a third device) against one device on
//! the same global batches, with AdamW, the warmup/cosine schedule and
//! gradient clipping all acting; the run `wgrad train --model gpt
//! --parallel data` makes; resuming; and device counts refused before any
//! device opens.

use crate::common;
use crate::parallel::groups;

use std::sync::Arc;

use common::assert_close;
use wgrad::io::text::{random_windows, CharTokenizer};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::distributed::SingleProcess;
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::{DeviceGroup, DeviceSelection, MAX_DEVICES};
use wgrad::train::{AdamWSchedule, LanguageModel, TextSource};
use wgrad::train::{Evaluation, Summary, TrainConfig, TrainingRun};
use wgrad::Error;
use wgrad::{Targets, Trainer};

/// 29 distinct characters: the alphabet, space, comma and full stop.
const PANGRAM: &str = "the quick brown fox, jumps over the lazy dog. ";
const BATCH: usize = 6;
const STEPS: u64 = 10;
/// Low enough that every step's gradient norm is above it (asserted), so
/// every step clips.
const MAX_NORM: f32 = 0.05;

/// L2 H2 C16 T8 B6 on the pangram, AdamW with weight decay, 3 warmup steps
/// then cosine decay over 10, clipping at [`MAX_NORM`].
fn config() -> TrainConfig {
    let schedule = AdamWSchedule {
        lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 3,
        clip_grad_norm: Some(MAX_NORM),
        ..AdamWSchedule::default()
    };
    TrainConfig {
        batch_size: BATCH,
        max_steps: Some(STEPS),
        optimizer: schedule.optimizer(STEPS),
        eval_every: 5,
        loss_every: 5,
        seed: 7,
        ..TrainConfig::default()
    }
}

/// The GPT of [`config`]'s run: L2 H2 C16 T8 on the pangram.
fn task() -> LanguageModel<Gpt> {
    LanguageModel {
        text: TextSource::Text(PANGRAM.repeat(60)),
        eval_batches: 2,
        ..LanguageModel::new(GptConfig {
            vocab_size: 0,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
        })
    }
}

fn validation(s: &Summary) -> f32 {
    match s.evaluation {
        Evaluation::ValidationLoss(v) => v,
        other => panic!("a language model's run ended with {other:?}"),
    }
}

fn trained(run: &TrainingRun<LanguageModel<Gpt>>) -> Gpt {
    run.task().trained_model(run.engine(), run.model()).unwrap()
}

/// Rows per device: uneven, with a one-row shard.
fn uneven_split(devices: usize) -> Vec<usize> {
    match devices {
        2 => vec![2, 4],
        3 => vec![1, 2, 3],
        n => panic!("no split for {n} devices"),
    }
}

/// max |got − want| over every parameter.
fn max_difference(got: &[(String, Vec<usize>, Vec<f32>)], want: &[(String, Vec<usize>, Vec<f32>)]) -> f32 {
    let mut worst = 0.0f32;
    for ((name, _, g), (other, _, w)) in got.iter().zip(want) {
        assert_eq!(name, other);
        worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
    }
    worst
}

fn bits(params: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
        .collect()
}

#[test]
fn gpt_data_parallel_matches_single_device_training() {
    let tokenizer = CharTokenizer::from_text(PANGRAM).unwrap();
    assert_eq!(tokenizer.vocab_size(), 29);
    let tokens = tokenizer.encode(&PANGRAM.repeat(20)).unwrap();
    let mut rng = common::rng(3);
    let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..STEPS)
        .map(|_| random_windows(&tokens, BATCH, 8, &mut rng).unwrap())
        .collect();
    let lm = config();
    nn::manual_seed(11);
    let gpt = Gpt::new(GptConfig {
        vocab_size: 29,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
    })
    .unwrap();
    for group in groups("gpt_data_parallel_matches_single_device_training") {
        let labels = group.labels().join(", ");
        // Single-device reference on the same global batches.
        let mut single = Trainer::new(group.members()[0].clone(), &gpt, CrossEntropyLoss, lm.optimizer, BATCH).unwrap();
        let (mut norms, mut rates) = (Vec::new(), Vec::new());
        for (x, y) in &batches {
            single.zero_grad();
            single.forward_ids(x).unwrap();
            single.loss(Targets::Classes(y)).unwrap();
            single.backward().unwrap();
            single.step().unwrap();
            norms.push(
                single
                    .executor()
                    .read_grad_norm()
                    .unwrap()
                    .expect("the optimizer clips"),
            );
            rates.push(single.executor().learning_rate().unwrap());
        }
        assert!(
            norms.iter().all(|&n| n > MAX_NORM),
            "every step must clip: pre-clip norms {norms:?} against {MAX_NORM}"
        );
        // Warmup rises over 3 steps, then the cosine falls towards min_lr.
        assert!(
            rates[0] < rates[2] && rates[3..].windows(2).all(|w| w[1] < w[0]) && rates[9] >= 1e-3,
            "schedule {rates:?}"
        );
        let want = single.executor().parameters().unwrap();

        let mut dp = DataParallel::new(
            &group,
            &gpt,
            CrossEntropyLoss,
            lm.optimizer,
            BATCH,
            Split::Rows(uneven_split(group.len())),
        )
        .unwrap();
        for (step, (x, y)) in batches.iter().enumerate() {
            dp.step(x, Targets::Classes(y), false).unwrap();
            // Each replica clipped by the norm of the all-reduced (global)
            // gradient: the single device's norm up to the shards' f32
            // summation order (relative 1e-4).
            for (r, replica) in dp.replicas().iter().enumerate() {
                let norm = replica
                    .executor()
                    .read_grad_norm()
                    .unwrap()
                    .expect("the optimizer clips");
                assert!(
                    (norm - norms[step]).abs() <= 1e-4 * norms[step],
                    "step {}: replica {r} of [{labels}] clipped by norm {norm}, one device by {}",
                    step + 1,
                    norms[step]
                );
            }
        }
        let replicas: Vec<_> = dp
            .replicas()
            .iter()
            .map(|t| t.executor().parameters().unwrap())
            .collect();
        for (r, got) in replicas.iter().enumerate() {
            for ((name, _, g), (_, _, w)) in got.iter().zip(&want) {
                // The same arithmetic but for the order of the batch's f32
                // sums (per shard, then weighted in f64), compounded over 10
                // AdamW steps: |Δ| ≤ 1e-5 + 1e-4·|p|.
                assert_close(&format!("{name} on replica {r} of [{labels}]"), g, w, 1e-5, 1e-4);
            }
            eprintln!(
                "gpt data parallel on [{labels}]: replica {r} max |Δparam| vs one device = {:.3e}",
                max_difference(got, &want)
            );
        }
        // Replicas on the same kind of adapter run the same kernels on the
        // same all-reduced gradients: bit-identical. Across Vulkan and GL
        // the shader compilers may round a division or square root
        // differently (WGSL allows a few ulp), which the periodic
        // `synchronise` stops from accumulating; here the difference is
        // measured, held to the tolerance above, and then `synchronise`
        // must make every replica replica 0 bit for bit.
        let infos: Vec<_> = group.members().iter().map(|k| k.device().info().clone()).collect();
        for i in 1..replicas.len() {
            if let Some(j) = (0..i).find(|&j| infos[j] == infos[i]) {
                assert_eq!(
                    bits(&replicas[i]),
                    bits(&replicas[j]),
                    "replicas {j} and {i} on the same adapter of [{labels}]"
                );
            } else {
                eprintln!(
                    "gpt data parallel on [{labels}]: replica {i} vs replica 0 (other backend) max |Δparam| = {:.3e}",
                    max_difference(&replicas[i], &replicas[0])
                );
            }
        }
        dp.synchronise().unwrap();
        let first = bits(&dp.replicas()[0].executor().parameters().unwrap());
        for (r, replica) in dp.replicas().iter().enumerate().skip(1) {
            assert_eq!(
                bits(&replica.executor().parameters().unwrap()),
                first,
                "replica {r} of [{labels}] after synchronise"
            );
        }
    }
}

/// The same devices as a new group (the test's groups keep theirs).
fn regroup(group: &DeviceGroup) -> DeviceGroup {
    DeviceGroup::from_kernels(group.members().to_vec()).unwrap()
}

/// `|a − b| ≤ 1e-3·|b|`: the losses of two runs whose parameters differ
/// by the summation order of the batch (see the test above).
fn assert_relative(what: &str, a: f32, b: f32) {
    assert!(
        a.is_finite() && (a - b).abs() <= 1e-3 * b.abs(),
        "{what}: {a} against {b}"
    );
}

/// `TrainingRun` with data parallel — in one process, and as the only
/// process of a distributed job — ends with the single-device run's losses.
#[test]
fn a_data_parallel_gpt_run_ends_where_a_single_device_run_ends() {
    let groups = groups("a_data_parallel_gpt_run_ends_where_a_single_device_run_ends");
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    let mut single = TrainingRun::with_kernels(group.members()[0].clone(), config(), task(), &mut ()).unwrap();
    let want = single.fit(&mut ()).unwrap().unwrap();
    assert!(want.report.is_empty());
    let data = TrainConfig {
        strategy: Some(Strategy::Data),
        ..config()
    };
    let runs = [
        (
            "data parallel",
            TrainingRun::with_devices(regroup(group), data.clone(), task(), None, &mut ()).unwrap(),
        ),
        (
            "distributed, one process",
            TrainingRun::with_devices(regroup(group), data, task(), Some(Arc::new(SingleProcess)), &mut ()).unwrap(),
        ),
    ];
    for (what, mut run) in runs {
        assert!(run.info().engine.contains("data parallel"), "{}", run.info().engine);
        assert_eq!(run.info().devices.len(), group.len());
        let got = run.fit(&mut ()).unwrap().unwrap();
        let last = |s: &Summary| s.train_curve.last().map(|p| p.1).unwrap();
        assert_eq!(got.train_curve.len(), want.train_curve.len());
        assert_relative(
            &format!("{what} on [{labels}]: final training loss"),
            last(&got),
            last(&want),
        );
        assert_relative(
            &format!("{what} on [{labels}]: final validation loss"),
            validation(&got),
            validation(&want),
        );
        eprintln!(
            "{what} on [{labels}]: final losses {} / {} against one device's {} / {}",
            last(&got),
            validation(&got),
            last(&want),
            validation(&want)
        );
        assert!(
            got.report.contains("communication") || got.report.contains("cross-process"),
            "{}",
            got.report
        );
    }
}

/// A data-parallel run saved after its warmup and resumed (into every
/// replica) ends where the uninterrupted run ends: bit for bit with a
/// fixed split on the same devices, and, resumed as a distributed job,
/// within the summation-order tolerance.
#[test]
fn a_resumed_data_parallel_gpt_run_equals_an_uninterrupted_one() {
    let groups = groups("a_resumed_data_parallel_gpt_run_equals_an_uninterrupted_one");
    let Some(group) = groups.first() else { return };
    let dir = std::env::temp_dir().join(format!("wgrad-gpt-dp-resume-{}", std::process::id()));
    let config = TrainConfig {
        strategy: Some(Strategy::Data),
        split: Some(uneven_split(group.len())),
        ..config()
    };
    let mut whole = TrainingRun::with_devices(regroup(group), config.clone(), task(), None, &mut ()).unwrap();
    whole.fit(&mut ()).unwrap().unwrap();
    let want = trained(&whole);

    // The first run stops where its warmup ends, so its schedule is the
    // longer run's up to there.
    let mut first = TrainingRun::with_devices(
        regroup(group),
        TrainConfig {
            max_steps: Some(3),
            ..config.clone()
        },
        task(),
        None,
        &mut (),
    )
    .unwrap();
    first.fit(&mut ()).unwrap().unwrap();
    first.save(&dir).unwrap();
    let resumed = TrainConfig {
        resume: Some(dir.clone()),
        ..config.clone()
    };
    let mut second = TrainingRun::with_devices(regroup(group), resumed.clone(), task(), None, &mut ()).unwrap();
    assert_eq!(second.info().first_step, 4);
    assert_eq!(second.fit(&mut ()).unwrap().unwrap().steps, 7);
    assert!(
        trained(&second) == want,
        "the resumed data-parallel run differs from the uninterrupted one"
    );

    // Rank 0 reads the folder and every replica takes its state.
    let distributed = TrainConfig { split: None, ..resumed };
    let mut third = TrainingRun::with_devices(
        regroup(group),
        distributed,
        task(),
        Some(Arc::new(SingleProcess)),
        &mut (),
    )
    .unwrap();
    assert_eq!(third.info().first_step, 4);
    third.fit(&mut ()).unwrap().unwrap();
    let (got, want) = (trained(&third), want);
    for ((name, _, g), (_, _, w)) in got.parameter_values().into_iter().zip(want.parameter_values()) {
        // Summation order only: |Δ| ≤ 1e-5 + 1e-4·|p|.
        assert_close(&format!("{name} resumed as a distributed job"), g, w, 1e-5, 1e-4);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Device counts no strategy can use, and a batch the pipeline cannot cut
/// into micro-batches, are errors naming the numbers before any device
/// opens (no adapter needed).
#[test]
fn impossible_gpt_device_counts_fail_before_opening() {
    let data = TrainConfig {
        strategy: Some(Strategy::Data),
        ..config()
    };
    let refusal =
        |config: TrainConfig| match TrainingRun::new(&wgrad::DeviceOptions::default(), config, task(), None, &mut ()) {
            Err(Error::InvalidArgument { reason, .. }) => reason,
            Err(e) => panic!("expected a refusal, got {e}"),
            Ok(_) => panic!("an impossible run was accepted"),
        };
    let reason = refusal(TrainConfig {
        devices: Some(DeviceSelection::Count(100_000)),
        ..data.clone()
    });
    assert!(
        reason.contains("100000") && reason.contains(&MAX_DEVICES.to_string()),
        "{reason}"
    );
    let reason = refusal(TrainConfig {
        devices: Some(DeviceSelection::Count(BATCH + 1)),
        ..data.clone()
    });
    assert!(reason.contains("7 devices") && reason.contains("6 rows"), "{reason}");
    let reason = refusal(TrainConfig {
        devices: Some(DeviceSelection::Count(2)),
        split: Some(vec![2, 2, 2]),
        ..data
    });
    assert!(reason.contains("3 devices") && reason.contains("2 devices"), "{reason}");
    let reason = refusal(TrainConfig {
        strategy: Some(Strategy::Tensor),
        devices: Some(DeviceSelection::Count(3)),
        ..config()
    });
    assert!(reason.contains("3 devices") && reason.contains("2 heads"), "{reason}");
    let reason = refusal(TrainConfig {
        strategy: Some(Strategy::Pipeline),
        devices: Some(DeviceSelection::Count(5)),
        micro_batches: 2,
        ..config()
    });
    assert!(reason.contains("5 stages") && reason.contains("at most 4"), "{reason}");
    let reason = refusal(TrainConfig {
        strategy: Some(Strategy::Pipeline),
        micro_batches: 4,
        ..config()
    });
    assert!(
        reason.contains(&format!("{BATCH} rows")) && reason.contains("4 equal micro-batches"),
        "{reason}"
    );
}

/// The GPT data parallel over one adapter opened with its own limits and
/// with WebGPU's defaults (two arena alignments where the adapter's is
/// under 256 B; `crate::parallel::mixed_limits_group`): clipped AdamW
/// steps match one device, replicas stay bit-identical, and a run through
/// `TrainingRun` ends where one device's does.
#[test]
fn gpt_data_parallel_across_different_limits_matches_single_device_training() {
    let test = "gpt_data_parallel_across_different_limits_matches_single_device_training";
    let Some((group, _gl)) = crate::parallel::mixed_limits_group(test) else {
        return;
    };
    let tokenizer = CharTokenizer::from_text(PANGRAM).unwrap();
    let tokens = tokenizer.encode(&PANGRAM.repeat(20)).unwrap();
    let mut rng = common::rng(3);
    let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..STEPS)
        .map(|_| random_windows(&tokens, BATCH, 8, &mut rng).unwrap())
        .collect();
    let lm = config();
    nn::manual_seed(11);
    let gpt = Gpt::new(GptConfig {
        vocab_size: 29,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
    })
    .unwrap();
    let mut single = Trainer::new(group.members()[0].clone(), &gpt, CrossEntropyLoss, lm.optimizer, BATCH).unwrap();
    for (x, y) in &batches {
        single.zero_grad();
        single.forward_ids(x).unwrap();
        single.loss(Targets::Classes(y)).unwrap();
        single.backward().unwrap();
        single.step().unwrap();
    }
    let want = single.executor().parameters().unwrap();
    let mut dp = DataParallel::new(
        &group,
        &gpt,
        CrossEntropyLoss,
        lm.optimizer,
        BATCH,
        Split::Rows(uneven_split(2)),
    )
    .unwrap();
    for (x, y) in &batches {
        dp.step(x, Targets::Classes(y), false).unwrap();
    }
    let replicas: Vec<_> = dp
        .replicas()
        .iter()
        .map(|t| t.executor().parameters().unwrap())
        .collect();
    for (r, got) in replicas.iter().enumerate() {
        for ((name, _, g), (_, _, w)) in got.iter().zip(&want) {
            // Summation order only, as in the test above.
            assert_close(&format!("{name} on replica {r}"), g, w, 1e-5, 1e-4);
        }
        eprintln!(
            "{test}: replica {r} max |Δparam| vs one device = {:.3e}",
            max_difference(got, &want)
        );
    }
    assert_eq!(bits(&replicas[1]), bits(&replicas[0]), "replicas on one adapter");
    dp.synchronise().unwrap();
    assert_eq!(
        bits(&dp.replicas()[1].executor().parameters().unwrap()),
        bits(&replicas[0]),
        "after synchronise"
    );

    let mut one = TrainingRun::with_kernels(group.members()[0].clone(), config(), task(), &mut ()).unwrap();
    let want = one.fit(&mut ()).unwrap().unwrap();
    let data = TrainConfig {
        strategy: Some(Strategy::Data),
        ..config()
    };
    let got = TrainingRun::with_devices(regroup(&group), data, task(), None, &mut ())
        .unwrap()
        .fit(&mut ())
        .unwrap()
        .unwrap();
    assert_relative("final validation loss", validation(&got), validation(&want));
}
