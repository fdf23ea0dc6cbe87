//! Sharded data parallel (ZeRO stages 1–3) and its collectives: the
//! reduce-scatter and all-gather against f64 sums on the host, on 1, 2 and
//! 3 devices with uneven segments; the shard ranges; and each stage of the
//! GPT and the Llama over 2 and 3 devices (uneven rows and shards) against
//! one device over ten clipped AdamW steps (stages 2 and 3 block by block,
//! [`ZeroStages`]; the whole-arena stage 3 MPI runs in a resumed run, its
//! stage 2 in cli/tests/mpi.rs), the state gathered back to single-device
//! names, and a run resumed on another strategy.

use crate::common;
use crate::parallel::open_groups;
use crate::{gpt_tensor, llama_parallel};

use std::time::Instant;

use common::{assert_close, assert_same_parameters, rng, train_on_one_device, Parameters};
use rand::Rng;
use wgrad::graph::{DType, PlanOptions, Precision};
use wgrad::kernels::OptimizerConfig;
use wgrad::nn::{self, CrossEntropyLoss, Layer, Linear, MSELoss, Sequential, Staged};
use wgrad::optim::{AdamW, LossScaleState, LossScaling};
use wgrad::parallel::collectives::{all_gather, reduce_scatter, Part};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::engine::{Holding, Strategy};
use wgrad::parallel::memory::DeviceMemory;
use wgrad::parallel::pipeline::Schedule;
use wgrad::parallel::zero::{shard_ranges, Zero, ZeroStage};
use wgrad::parallel::zero_stages::ZeroStages;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::{Targets, Trainer};

/// Both models' tests train 4 sequences per step.
const BATCH: usize = 4;

fn rows(devices: usize) -> Vec<usize> {
    match devices {
        2 => vec![1, 3],
        3 => vec![1, 1, 2],
        n => panic!("no split for {n} devices"),
    }
}

#[test]
fn shard_ranges_are_whole_blocks_as_even_as_possible() {
    // 1031 elements = 16 blocks of 64 and 7: 6 + 6 + 5 blocks, the last short.
    assert_eq!(shard_ranges(1031, 3, 64).unwrap(), vec![0..384, 384..768, 768..1031]);
    assert_eq!(shard_ranges(10, 1, 64).unwrap(), vec![0..10]);
    assert_eq!(shard_ranges(128, 2, 64).unwrap(), vec![0..64, 64..128]);
    let err = shard_ranges(100, 3, 64).unwrap_err().to_string();
    assert!(err.contains("100 elements") && err.contains("3 devices"), "{err}");
    assert!(ZeroStage::new(4).is_err() && ZeroStage::new(0).is_err());
    assert_eq!(ZeroStage::new(2).unwrap().number(), 2);
}

/// The reduce-scatter gives each destination its segment of the weighted
/// f64 sum (the same sums in the same order as the reference: equal to
/// f32 rounding, rtol 1e-7); the all-gather concatenates uneven sources.
#[test]
fn reduce_scatter_and_all_gather_take_uneven_segments() {
    let groups = open_groups(
        "reduce_scatter_and_all_gather_take_uneven_segments",
        &[
            DeviceSelection::Count(1),
            DeviceSelection::Count(2),
            DeviceSelection::Count(3),
        ],
    );
    for group in groups.iter() {
        let n = group.len();
        let k = group.members();
        // Segment lengths: 1 alone, primes, and a zero-length segment.
        let cases: Vec<Vec<usize>> = match n {
            1 => vec![vec![1], vec![1031]],
            2 => vec![vec![7, 2], vec![0, 13]],
            _ => vec![vec![400, 331, 300], vec![1, 5, 0]],
        };
        for segments in cases {
            let total: usize = segments.iter().sum();
            let mut r = rng(total as u64);
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..total).map(|_| r.random_range(-1.0f32..1.0)).collect())
                .collect();
            let weights: Vec<f64> = (0..n).map(|i| (i + 1) as f64 / 3.0).collect();
            let srcs: Vec<_> = k.iter().zip(&inputs).map(|(k, v)| k.upload(v).unwrap()).collect();
            let dsts: Vec<_> = k
                .iter()
                .zip(&segments)
                .map(|(k, &len)| k.zeros(len.max(1)).unwrap())
                .collect();
            let src_parts: Vec<Part> = k.iter().zip(&srcs).map(|(k, t)| Part::new(k, t.view())).collect();
            let dst_parts: Vec<Part> = k
                .iter()
                .zip(&dsts)
                .zip(&segments)
                .map(|((k, t), &len)| Part::new(k, t.slice(0, len).unwrap()))
                .collect();
            for bucket in [0, 3] {
                reduce_scatter(&src_parts, Some(&weights), &dst_parts, bucket, Instant::now()).unwrap();
                let mut start = 0;
                for (d, &len) in segments.iter().enumerate() {
                    let want: Vec<f32> = (start..start + len)
                        .map(|e| {
                            inputs
                                .iter()
                                .zip(&weights)
                                .map(|(v, w)| w * f64::from(v[e]))
                                .sum::<f64>() as f32
                        })
                        .collect();
                    let got: Vec<f32> = k[d].read(dst_parts[d].view).unwrap();
                    assert_close(
                        &format!("segment {d} of {segments:?}, bucket {bucket}, {n} devices"),
                        &got,
                        &want,
                        0.0,
                        1e-7,
                    );
                    start += len;
                }
            }
            // Every device gathers the segments back, in device order.
            let gathered: Vec<_> = k.iter().map(|k| k.zeros(total.max(1)).unwrap()).collect();
            let whole: Vec<Part> = k
                .iter()
                .zip(&gathered)
                .map(|(k, t)| Part::new(k, t.slice(0, total).unwrap()))
                .collect();
            all_gather(&dst_parts, &whole).unwrap();
            let joined: Vec<f32> = dst_parts
                .iter()
                .zip(k)
                .flat_map(|(p, k)| k.read::<f32>(p.view).unwrap())
                .collect();
            for (d, part) in whole.iter().enumerate() {
                assert_eq!(
                    k[d].read::<f32>(part.view).unwrap(),
                    joined,
                    "all_gather on device {d} of {n}"
                );
            }
        }
        // Segments that do not add up to the sources are refused.
        let src = k[0].zeros(8).unwrap();
        let short = k[0].zeros(3).unwrap();
        let srcs = vec![Part::new(&k[0], src.view())];
        let err = reduce_scatter(&srcs, None, &[Part::new(&k[0], short.view())], 0, Instant::now())
            .unwrap_err()
            .to_string();
        assert!(err.contains("reduce_scatter"), "{err}");
    }
}

/// One model's case: what it is, the model, its optimizer, its batches.
pub(crate) struct Case<'a> {
    pub(crate) what: &'a str,
    pub(crate) model: &'a dyn Staged,
    pub(crate) optimizer: OptimizerConfig,
    pub(crate) clip: f32,
    pub(crate) batches: Vec<(Vec<u32>, Vec<u32>)>,
}

/// A ZeRO engine and its last step's gradient norm.
trait Sharded: TrainEngine {
    fn norm(&self) -> Option<f32>;
}

impl Sharded for Zero {
    fn norm(&self) -> Option<f32> {
        self.last_grad_norm()
    }
}

impl Sharded for ZeroStages {
    fn norm(&self) -> Option<f32> {
        self.last_grad_norm()
    }
}

/// Every stage on `groups` against one device on the same batches: the
/// loss every step (a row-weighted mean of the shards': relative 1e-5),
/// the global norm every step (shards' squares added in f64 against one
/// device's f32 reduction: relative 1e-4), the parameters after ten steps
/// (the batch's sums split over devices, compounded over ten clipped Adam
/// steps: 1e-5 + 1e-4·|p|), and AdamW's moments gathered to single-device
/// names (the same sums squared for exp_avg_sq: 1e-6 + 1e-3·|m|).
pub(crate) fn stages_match_one_device(groups: &[DeviceGroup], case: &Case<'_>) {
    let Some(first) = groups.first() else { return };
    let (reference, losses, norms) =
        train_on_one_device(&first.members()[0], case.model, case.optimizer, BATCH, &case.batches);
    assert!(
        norms.iter().all(|&n| n > case.clip),
        "{}: every step clips: norms {norms:?} against {}",
        case.what,
        case.clip
    );
    let want: Parameters = reference.executor().parameters().unwrap();
    let want_state = reference.executor().optimizer_state().unwrap();
    for group in groups {
        let labels = group.labels().join(", ");
        for stage in 1..=3 {
            let zero_stage = ZeroStage::new(stage).unwrap();
            let mut z: Box<dyn Sharded> = match zero_stage {
                ZeroStage::OptimizerState => Box::new(
                    Zero::new(
                        group,
                        case.model,
                        CrossEntropyLoss,
                        case.optimizer,
                        BATCH,
                        zero_stage,
                        Some(rows(group.len())),
                    )
                    .unwrap(),
                ),
                _ => Box::new(
                    ZeroStages::new(
                        group,
                        case.model,
                        CrossEntropyLoss,
                        case.optimizer,
                        BATCH,
                        zero_stage,
                        Some(rows(group.len())),
                    )
                    .unwrap(),
                ),
            };
            let what = format!("{} ZeRO-{stage} on [{labels}]", case.what);
            let (mut loss_err, mut norm_err) = (0.0f32, 0.0f32);
            for (s, (ids, targets)) in case.batches.iter().enumerate() {
                let loss = z
                    .step(ids.as_slice().into(), Targets::Classes(targets), true)
                    .unwrap()
                    .unwrap();
                let norm = z.norm().unwrap();
                loss_err = loss_err.max((loss - losses[s]).abs() / losses[s]);
                norm_err = norm_err.max((norm - norms[s]).abs() / norms[s]);
                assert_close(&format!("{what} step {s} loss"), &[loss], &[losses[s]], 0.0, 1e-5);
                assert_close(&format!("{what} step {s} norm"), &[norm], &[norms[s]], 0.0, 1e-4);
            }
            assert_eq!(z.step_count(), case.batches.len() as u64, "{what}: steps");
            let param_err = assert_same_parameters(&what, &z.parameters().unwrap(), &want, 1e-5, 1e-4);
            let got_state = z.optimizer_state().unwrap();
            assert_eq!(got_state.len(), want_state.len(), "{what}: state entries");
            for ((gp, gs, g), (wp, ws, w)) in got_state.iter().zip(&want_state) {
                assert_eq!((gp, gs), (wp, ws), "{what}: state order");
                assert_close(&format!("{what}: {wp}.{ws}"), g, w, 1e-6, 1e-3);
            }
            eprintln!("{what}: loss rel err {loss_err:.1e}, norm rel err {norm_err:.1e}, max |Δparam| {param_err:.1e}");
        }
    }
}

/// Stage 3 between steps: every device's parameters outside its shard are
/// cleared (so a step that forgot the gather could not match).
fn assert_holds_only_its_shard(what: &str, z: &Zero) {
    for (d, (t, shard)) in z.replicas().iter().zip(z.shards()).enumerate() {
        let exec = t.executor();
        let values = exec.parameters().unwrap();
        for (span, (_, _, v)) in exec.parameter_spans().iter().zip(&values) {
            for (j, x) in v.iter().enumerate() {
                let e = span.offset + j;
                if !shard.contains(&e) {
                    assert_eq!(
                        *x, 0.0,
                        "{what}: device {d} holds element {e} of {} outside its shard {shard:?}",
                        span.name
                    );
                }
            }
        }
    }
}

pub(crate) fn two_and_three(test: &str) -> crate::parallel::Groups {
    open_groups(test, &[DeviceSelection::Count(2), DeviceSelection::Count(3)])
}

#[test]
fn zero_stages_train_the_llama_as_one_device() {
    let groups = two_and_three("zero_stages_train_the_llama_as_one_device");
    for tied in [false, true] {
        let model = llama_parallel::model(tied);
        let case = Case {
            what: if tied { "tied Llama" } else { "untied Llama" },
            model: &model,
            optimizer: llama_parallel::optimizer(),
            clip: llama_parallel::CLIP,
            batches: llama_parallel::batches(),
        };
        stages_match_one_device(&groups, &case);
    }
}

#[test]
fn zero_stages_train_the_gpt_as_one_device() {
    let groups = two_and_three("zero_stages_train_the_gpt_as_one_device");
    let model = gpt_tensor::model();
    let case = Case {
        what: "GPT",
        model: &model,
        optimizer: gpt_tensor::adamw().into(),
        clip: gpt_tensor::CLIP,
        batches: (0..10).map(gpt_tensor::batch).collect(),
    };
    stages_match_one_device(&groups, &case);
}

/// Five steps under ZeRO-3 block by block on 3 devices, its checkpoint's
/// parameters, moments and step loaded into the whole-arena ZeRO-3 (the
/// MPI path's) on 2 devices, which holds only its shard between steps,
/// into ZeRO-2 block by block on 2 devices and into one device, five more
/// steps: the ten-step single-device run (tolerances as above).
#[test]
fn a_zero_run_resumes_on_another_strategy() {
    let groups = two_and_three("a_zero_run_resumes_on_another_strategy");
    let [two, three] = &groups[..] else { return };
    let model = llama_parallel::model(true);
    let (optimizer, batches) = (llama_parallel::optimizer(), llama_parallel::batches());
    let (reference, _, _) = train_on_one_device(&two.members()[0], &model, optimizer, BATCH, &batches);
    let want = reference.executor().parameters().unwrap();

    let mut first = ZeroStages::new(
        three,
        &model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        ZeroStage::Parameters,
        Some(rows(3)),
    )
    .unwrap();
    for (ids, targets) in &batches[..5] {
        first.step(ids, Targets::Classes(targets), false).unwrap();
    }
    let ckpt = first.checkpoint().unwrap();
    assert_eq!(ckpt.meta("step"), Some("5"));
    let params = first.parameters().unwrap();
    let state: Vec<(String, String, Vec<f32>)> = first
        .optimizer_state()
        .unwrap()
        .into_iter()
        .map(|(p, s, v)| (p, s.to_string(), v))
        .collect();

    let mut second = Zero::new(
        two,
        &model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        ZeroStage::Parameters,
        Some(rows(2)),
    )
    .unwrap();
    second.load_state(&params, &state, Some(5)).unwrap();
    // Loaded as saved: the same bits back under the same names.
    let bits = |p: &Parameters| {
        p.iter()
            .map(|(_, _, v)| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(&second.parameters().unwrap()),
        bits(&params),
        "parameters after loading"
    );
    let mut stage2 = ZeroStages::new(
        two,
        &model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        ZeroStage::Gradients,
        Some(rows(2)),
    )
    .unwrap();
    stage2.load_state(&params, &state, Some(5)).unwrap();
    assert_eq!(
        bits(&stage2.parameters().unwrap()),
        bits(&params),
        "parameters after loading into ZeRO-2"
    );
    let mut single = wgrad::Trainer::new(two.members()[0].clone(), &model, CrossEntropyLoss, optimizer, BATCH).unwrap();
    TrainEngine::load_state(&mut single, &params, &state, Some(5)).unwrap();
    for (ids, targets) in &batches[5..] {
        second.step(ids, Targets::Classes(targets), false).unwrap();
        assert_holds_only_its_shard("whole-arena ZeRO-3, resumed", &second);
        stage2.step(ids, Targets::Classes(targets), false).unwrap();
        TrainEngine::step(&mut single, ids.as_slice().into(), Targets::Classes(targets), false).unwrap();
    }
    assert_eq!((second.step_count(), stage2.step_count()), (10, 10));
    assert_same_parameters(
        "ZeRO-3 on 3 devices, resumed as whole-arena ZeRO-3 on 2",
        &second.parameters().unwrap(),
        &want,
        1e-5,
        1e-4,
    );
    assert_same_parameters(
        "ZeRO-3 on 3 devices, resumed as ZeRO-2 block by block on 2",
        &stage2.parameters().unwrap(),
        &want,
        1e-5,
        1e-4,
    );
    assert_same_parameters(
        "ZeRO-3 on 3 devices, resumed on one device",
        &single.executor().parameters().unwrap(),
        &want,
        1e-5,
        1e-4,
    );
}

/// Each strategy's bytes on the fullest device planned without a device
/// under `options` (its precision and checkpointing) equal what its
/// engine allocated on `group` with the same options (both plan the same
/// graphs, with the same passes and alignment: exact). 2 devices, rows
/// split evenly (the plan's split), 2 micro-batches; by strategy, the
/// single device first.
fn planned_equals_allocated(
    group: &DeviceGroup,
    options: PlanOptions,
    optimizer: OptimizerConfig,
) -> Vec<(Strategy, DeviceMemory)> {
    use wgrad::parallel::data::{DataParallel, Split};
    use wgrad::parallel::memory::{strategy_memory, Planning};
    use wgrad::parallel::pipeline::Pipeline;
    use wgrad::parallel::tensor::TensorParallel;
    let model = llama_parallel::model(true);
    let alignment = group
        .members()
        .iter()
        .map(|k| k.device().limits().min_storage_buffer_offset_alignment)
        .max()
        .unwrap();
    let planning = Planning {
        criterion: CrossEntropyLoss.into(),
        optimizer,
        batch: BATCH,
        micro_batches: 2,
        device_alignment: alignment,
        precision: options.precision,
        checkpoint_activations: options.checkpoint_activations,
    };
    let what = format!(
        "{}{}",
        options.precision.name(),
        if options.checkpoint_activations {
            ", checkpointed"
        } else {
            ""
        }
    );
    let even = || Some(vec![2, 2]);
    let single = Trainer::with_blocks(
        group.members()[0].clone(),
        &model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        options,
    )
    .unwrap();
    let engines: Vec<(Strategy, Box<dyn TrainEngine>)> = vec![
        (
            Strategy::Data,
            Box::new(
                DataParallel::with_options(
                    group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    BATCH,
                    Split::Rows(vec![2, 2]),
                    options,
                )
                .unwrap(),
            ),
        ),
        (
            Strategy::Tensor,
            Box::new(TensorParallel::with_options(group, &model, CrossEntropyLoss, optimizer, BATCH, options).unwrap()),
        ),
        (
            Strategy::Pipeline,
            Box::new(
                Pipeline::with_options(
                    group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    BATCH,
                    2,
                    Schedule::OneFOneB,
                    None,
                    options,
                )
                .unwrap(),
            ),
        ),
        // Stage 1: the whole-arena engine; 2 and 3 block by block.
        (
            Strategy::Zero(ZeroStage::OptimizerState),
            Box::new(
                Zero::across(
                    None,
                    group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    BATCH,
                    ZeroStage::OptimizerState,
                    even(),
                    options,
                )
                .unwrap(),
            ),
        ),
        (
            Strategy::Zero(ZeroStage::Gradients),
            Box::new(
                ZeroStages::with_options(
                    group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    BATCH,
                    ZeroStage::Gradients,
                    even(),
                    options,
                )
                .unwrap(),
            ),
        ),
        (
            Strategy::Zero(ZeroStage::Parameters),
            Box::new(
                ZeroStages::with_options(
                    group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    BATCH,
                    ZeroStage::Parameters,
                    even(),
                    options,
                )
                .unwrap(),
            ),
        ),
    ];
    let mut memory = vec![(
        Strategy::Single,
        strategy_memory(&model, Strategy::Single, 1, &planning).unwrap(),
    )];
    assert_eq!(memory[0].1, TrainEngine::memory(&single), "{what}: single device");
    for (strategy, engine) in engines {
        let planned = strategy_memory(&model, strategy, 2, &planning).unwrap();
        assert_eq!(planned, engine.memory(), "{what}: {}", engine.describe());
        memory.push((strategy, planned));
    }
    memory
}

/// The planned memory of `strategy` in `memory`.
fn memory_of(memory: &[(Strategy, DeviceMemory)], strategy: Strategy) -> DeviceMemory {
    memory.iter().find(|(s, _)| *s == strategy).map(|&(_, m)| m).unwrap()
}

/// The memory planned without a device equals what each engine's
/// executors planned on real devices, for every strategy on 2 devices,
/// in f32 and with checkpointed activations
/// ([`planned_equals_allocated`]); ZeRO's kept optimizer state is half
/// of data parallel's (at most 0.55×: shards are whole 256-byte blocks).
/// Checkpointing holds fewer activation bytes where an engine recomputes
/// a replica's or a stage's blocks (single device, data parallel, ZeRO-1,
/// the pipeline) and the same where its graphs hold no whole block
/// (tensor parallel's segments) or already recompute every block (ZeRO-2/3).
#[test]
fn planned_memory_equals_each_engines() {
    let groups = open_groups("planned_memory_equals_each_engines", &[DeviceSelection::Count(2)]);
    let Some(group) = groups.first() else { return };
    let optimizer = llama_parallel::optimizer();
    let memory = planned_equals_allocated(group, PlanOptions::default(), optimizer);
    let m = |strategy| memory_of(&memory, strategy);
    // Whole-arena ZeRO (stage 1; stage 2 over MPI): data parallel's
    // arenas and activations, the state's shard.
    let whole = m(Strategy::Data);
    let zero1 = m(Strategy::Zero(ZeroStage::OptimizerState));
    let whole_arena = |stage| {
        Zero::new(
            group,
            &llama_parallel::model(true),
            CrossEntropyLoss,
            optimizer,
            BATCH,
            stage,
            Some(vec![2, 2]),
        )
        .unwrap()
    };
    for zero in [
        whole_arena(ZeroStage::OptimizerState),
        whole_arena(ZeroStage::Gradients),
    ] {
        assert_eq!(
            zero.memory(),
            DeviceMemory {
                optimizer_state: zero.kept_memory().optimizer_state,
                ..whole
            },
            "whole-arena {}",
            zero.describe()
        );
    }
    // Stages 2 and 3 block by block (shards, the whole parameters at
    // stage 2, pooled stage arenas, every stage's activations): fewer
    // gradient bytes than data parallel allocates (this tiny model's
    // largest stage, the tied embedding, is a third of it: a deep model
    // saves far more), and at stage 3 fewer parameter bytes too.
    let (second, third) = (
        m(Strategy::Zero(ZeroStage::Gradients)),
        m(Strategy::Zero(ZeroStage::Parameters)),
    );
    for (stage, z) in [(2, second), (3, third)] {
        assert!(
            z.gradients < whole.gradients,
            "ZeRO-{stage} {z:?} against data parallel {whole:?}"
        );
    }
    assert!(
        third.parameters < whole.parameters,
        "ZeRO-3 {third:?} against data parallel {whole:?}"
    );
    // The same shards and pool; stage 2 holds every parameter besides.
    assert_eq!(
        (second.gradients, second.optimizer_state, second.activations),
        (third.gradients, third.optimizer_state, third.activations),
        "ZeRO-2 {second:?} against ZeRO-3 {third:?}"
    );
    assert!(
        second.parameters > third.parameters,
        "ZeRO-2 {second:?} against ZeRO-3 {third:?}"
    );
    // Shards are whole 256-byte blocks: at most 0.55× data parallel's state.
    for (what, state) in [
        ("ZeRO-1", zero1.optimizer_state),
        ("ZeRO-2", second.optimizer_state),
        ("ZeRO-3", third.optimizer_state),
    ] {
        let ratio = state as f64 / whole.optimizer_state as f64;
        assert!(
            ratio <= 0.55,
            "{what} keeps {ratio:.3} of data parallel's optimizer state"
        );
    }

    let checkpointed = planned_equals_allocated(
        group,
        PlanOptions {
            checkpoint_activations: true,
            ..PlanOptions::default()
        },
        optimizer,
    );
    for (strategy, recomputing) in checkpointed {
        let plain = m(strategy);
        eprintln!(
            "{strategy:?}: activations {} B checkpointed, {} B plain",
            recomputing.activations, plain.activations
        );
        assert_eq!(
            DeviceMemory {
                activations: plain.activations,
                ..recomputing
            },
            plain,
            "{strategy:?}: checkpointing changes only the activations"
        );
        match strategy {
            Strategy::Tensor | Strategy::Zero(ZeroStage::Gradients | ZeroStage::Parameters) => {
                assert_eq!(recomputing, plain, "{strategy:?} recomputes nothing more")
            }
            _ => assert!(
                recomputing.activations < plain.activations,
                "{strategy:?}: checkpointed {recomputing:?}, plain {plain:?}"
            ),
        }
    }
}

/// [`planned_memory_equals_each_engines`] in f16, plain and checkpointed,
/// on lavapipe devices (SHADER_F16; skipped, said, without it): the
/// planned f16 graphs are the engines' to the byte, and every strategy's
/// activations differ from its f32 plan (the f16 copies are counted),
/// the arenas not at all (master weights, gradients and state stay f32).
#[test]
fn planned_f16_memory_equals_each_engines() {
    let Some(groups) = f16_group("planned_f16_memory_equals_each_engines") else {
        return;
    };
    let group = &groups[0];
    let f32_memory = planned_equals_allocated(group, PlanOptions::default(), llama_parallel::optimizer());
    let scaled = llama_parallel::optimizer().with_loss_scaling(Some(LossScaling::default()));
    for checkpoint_activations in [false, true] {
        let options = PlanOptions {
            precision: Precision::F16,
            checkpoint_activations,
            ..PlanOptions::default()
        };
        for (strategy, f16) in planned_equals_allocated(group, options, scaled) {
            let f32 = memory_of(&f32_memory, strategy);
            eprintln!(
                "{strategy:?}{}: activations {} B f16, {} B f32",
                if checkpoint_activations { " checkpointed" } else { "" },
                f16.activations,
                f32.activations
            );
            assert_eq!(
                DeviceMemory {
                    activations: f32.activations,
                    ..f16
                },
                f32,
                "{strategy:?}: f16 changes only the activations"
            );
            assert_ne!(f16.activations, f32.activations, "{strategy:?}: the f16 plan");
        }
    }
}

/// `engine`'s loss every step on `batches`.
fn losses_of(engine: &mut dyn TrainEngine, batches: &[(Vec<u32>, Vec<u32>)]) -> Vec<f32> {
    batches
        .iter()
        .map(|(ids, targets)| {
            engine
                .step(ids.as_slice().into(), Targets::Classes(targets), true)
                .unwrap()
                .unwrap()
        })
        .collect()
}

/// Every stage through [`Strategy::build`] (what `wgrad train` runs),
/// on `group` with rows 1 + 3.
fn zero_engine(
    group: &DeviceGroup,
    model: &dyn ParallelModel,
    stage: u32,
    optimizer: OptimizerConfig,
    options: PlanOptions,
) -> Box<dyn TrainEngine> {
    model.build(
        Strategy::Zero(ZeroStage::new(stage).unwrap()),
        group,
        optimizer,
        options,
    )
}

/// The Llama, as `Strategy::build` takes it (a concrete model).
trait ParallelModel {
    fn build(
        &self,
        strategy: Strategy,
        group: &DeviceGroup,
        optimizer: OptimizerConfig,
        options: PlanOptions,
    ) -> Box<dyn TrainEngine>;
}

impl ParallelModel for wgrad::models::Llama {
    fn build(
        &self,
        strategy: Strategy,
        group: &DeviceGroup,
        optimizer: OptimizerConfig,
        options: PlanOptions,
    ) -> Box<dyn TrainEngine> {
        strategy
            .build(
                group,
                None,
                self,
                CrossEntropyLoss.into(),
                optimizer,
                BATCH,
                1,
                Schedule::OneFOneB,
                Some(rows(group.len())),
                options,
            )
            .unwrap()
    }
}

/// `--checkpoint-activations` under each stage: the same losses as
/// without (the recomputed forward is the forward's kernels on the same
/// inputs; the plan may fuse the copies differently, so as
/// activation_checkpointing.rs: 1e-6 + 1e-5·|loss|). ZeRO-1 (whole-arena
/// replicas) holds fewer activation bytes; stages 2 and 3 run block by
/// block and already recompute each block's forward in its backward, so
/// they allocate exactly what they did.
#[test]
fn zero_with_checkpointed_activations_trains_as_without() {
    let groups = open_groups(
        "zero_with_checkpointed_activations_trains_as_without",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let model = llama_parallel::model(true);
    let batches = &llama_parallel::batches()[..4];
    let checkpointed = PlanOptions {
        checkpoint_activations: true,
        ..PlanOptions::default()
    };
    for stage in 1..=3 {
        let mut plain = zero_engine(
            group,
            &model,
            stage,
            llama_parallel::optimizer(),
            PlanOptions::default(),
        );
        let mut recomputing = zero_engine(group, &model, stage, llama_parallel::optimizer(), checkpointed);
        let (want, got) = (
            losses_of(plain.as_mut(), batches),
            losses_of(recomputing.as_mut(), batches),
        );
        assert_close(&format!("ZeRO-{stage} checkpointed losses"), &got, &want, 1e-6, 1e-5);
        let (held, held_plain) = (recomputing.memory().activations, plain.memory().activations);
        eprintln!("ZeRO-{stage}: activations {held} B checkpointed, {held_plain} B plain");
        if stage == 1 {
            let held = |e: &dyn TrainEngine| match e.holding() {
                Holding::Replica(t) => t.executor().plan().held_activation_bytes,
                Holding::Stages(..) => panic!("ZeRO-1 holds whole replicas"),
            };
            assert!(
                held(recomputing.as_ref()) < held(plain.as_ref()),
                "ZeRO-1: checkpointing holds {} B, the plain step {} B",
                held(recomputing.as_ref()),
                held(plain.as_ref())
            );
        } else {
            assert_eq!(
                recomputing.memory(),
                plain.memory(),
                "ZeRO-{stage} block by block allocates the same"
            );
        }
    }
}

/// The optimizer with dynamic loss scaling from `init_scale`, growing
/// after `growth_interval` clean steps.
fn scaled(init_scale: f32, growth_interval: u32) -> OptimizerConfig {
    llama_parallel::optimizer().with_loss_scaling(Some(LossScaling {
        init_scale,
        growth_interval,
        ..LossScaling::default()
    }))
}

/// Two lavapipe devices (SHADER_F16); `None`, said, where adapter 0 has
/// no SHADER_F16.
fn f16_group(test: &str) -> Option<crate::parallel::Groups> {
    let groups = open_groups(test, &[DeviceSelection::Adapters(vec!["0".into(), "0".into()])]);
    let group = groups.first()?;
    if !group.members().iter().all(|k| k.supports_f16()) {
        eprintln!("{test}: {} has no SHADER_F16, skipped", group.labels().join(", "));
        return None;
    }
    Some(groups)
}

/// Whether `engine` stores some activation in f16 (each replica, or each
/// stage of device 0).
fn stores_f16(engine: &dyn TrainEngine) -> bool {
    let has = |g: &wgrad::graph::Graph| g.nodes().iter().any(|n| n.dtype == DType::F16);
    match engine.holding() {
        Holding::Replica(t) => has(t.executor().graph()),
        Holding::Stages(_, stages) => stages.iter().any(|s| has(s.executor().graph())),
    }
}

/// One device in f16 on the Llama's batches: its losses and its loss
/// scaling state at the end.
fn one_device_f16(
    group: &DeviceGroup,
    model: &wgrad::models::Llama,
    optimizer: OptimizerConfig,
    batches: &[(Vec<u32>, Vec<u32>)],
) -> (Vec<f32>, LossScaleState) {
    let f16 = PlanOptions {
        precision: Precision::F16,
        ..PlanOptions::default()
    };
    let mut single = Trainer::with_blocks(
        group.members()[0].clone(),
        model,
        CrossEntropyLoss,
        optimizer,
        BATCH,
        f16,
    )
    .unwrap();
    assert_eq!(single.precision(), Precision::F16);
    let losses = losses_of(&mut single, batches);
    (losses, single.executor().read_loss_scale().unwrap().unwrap())
}

/// f16 activations under each stage (through `Strategy::build`, with
/// checkpointing too) against one device in f16 and the stage's own f32
/// run, at the default scale (no overflow here). f16 keeps 11 bits of
/// what the backward reads, and rows split over devices store a few
/// small tensors differently (f32 below 128 values): as
/// mixed_precision.rs, 2% of the loss (measured: printed).
#[test]
fn zero_in_f16_follows_one_device_in_f16() {
    let Some(groups) = f16_group("zero_in_f16_follows_one_device_in_f16") else {
        return;
    };
    let group = &groups[0];
    let model = llama_parallel::model(true);
    let batches = llama_parallel::batches();
    let optimizer = scaled(LossScaling::default().init_scale, 2000);
    let (want, want_scale) = one_device_f16(group, &model, optimizer, &batches);
    assert_eq!(
        (want_scale.skipped, want_scale.steps_taken),
        (0, batches.len() as u64),
        "no overflow at 2^16: {want_scale:?}"
    );
    for stage in 1..=3 {
        let options = PlanOptions {
            precision: Precision::F16,
            checkpoint_activations: true,
            ..PlanOptions::default()
        };
        let mut z = zero_engine(group, &model, stage, optimizer, options);
        assert!(stores_f16(z.as_ref()), "ZeRO-{stage}: no activation stored in f16");
        let got = losses_of(z.as_mut(), &batches);
        assert_eq!(
            z.read_loss_scale().unwrap().as_ref(),
            Some(&want_scale),
            "ZeRO-{stage}: loss scaling state"
        );
        let f32_losses = losses_of(
            zero_engine(
                group,
                &model,
                stage,
                llama_parallel::optimizer(),
                PlanOptions::default(),
            )
            .as_mut(),
            &batches,
        );
        let drift = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0.0f32, f32::max);
        eprintln!("ZeRO-{stage} f16: largest relative loss difference {:.1e} against one device in f16, {:.1e} against its f32 run", drift(&got, &want), drift(&got, &f32_losses));
        assert_close(
            &format!("ZeRO-{stage} f16 losses against one device in f16"),
            &got,
            &want,
            0.0,
            0.02,
        );
        assert_close(
            &format!("ZeRO-{stage} f16 losses against its f32 run"),
            &got,
            &f32_losses,
            0.0,
            0.02,
        );
    }
}

/// Linear(200, 1) on MSE whose first 64 inputs are about 1e3 and the
/// others about 1e-3: the gradients of the first 64 weights (the start of
/// the arena, in the first device's shard) are about 2^18, the rest below
/// 1, so a loss scale of 2^112 overflows the first shard alone.
fn lopsided_model() -> Sequential {
    nn::manual_seed(7);
    Sequential::new(vec![Layer::Linear(Linear::new(200, 1))])
}

fn lopsided_batches() -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..8)
        .map(|s| {
            let mut r = rng(500 + s);
            let x = (0..BATCH * 200)
                .map(|i| r.random_range(-1.0f32..1.0) * if i % 200 < 64 { 1e3 } else { 1e-3 })
                .collect();
            (x, (0..BATCH).map(|_| r.random_range(-1.0f32..1.0)).collect())
        })
        .collect()
}

/// From a loss scale so large that the first steps overflow in one
/// device's shard alone. At ZeRO-1 every device skips a step exactly when
/// some shard of the summed gradient overflows, including steps whose
/// overflow lay in the first device's shard alone (asserted: there the
/// second device's own check would have let it step), and every device's
/// loss scaling state is the same. (A device's gradient is the mean over
/// its own rows, so one holding fewer rows than the batch overflows a
/// little sooner than one device would: the steps skipped are ZeRO's, as
/// with PyTorch's DDP.) ZeRO-2 and ZeRO-3 block by block on the same rows
/// skip the same steps and end in the same state on every device, with
/// the same losses (summed in another order: 1e-5 relative).
#[test]
fn every_zero_device_skips_a_step_any_shard_overflows() {
    let Some(groups) = f16_group("every_zero_device_skips_a_step_any_shard_overflows") else {
        return;
    };
    let group = &groups[0];
    let model = lopsided_model();
    let batches = lopsided_batches();
    let optimizer: OptimizerConfig = AdamW::new(1e-2)
        .weight_decay(0.1)
        .clip_grad_norm(1.0)
        .loss_scaling(LossScaling {
            init_scale: 2f32.powi(112),
            ..LossScaling::default()
        })
        .into();
    let f16 = PlanOptions {
        precision: Precision::F16,
        ..PlanOptions::default()
    };
    let step = |engine: &mut dyn TrainEngine, (x, y): &(Vec<f32>, Vec<f32>)| {
        engine
            .step(x.as_slice().into(), Targets::Values(y), true)
            .unwrap()
            .unwrap()
    };
    let mut z = Zero::across(
        None,
        group,
        &model,
        MSELoss,
        optimizer,
        BATCH,
        ZeroStage::OptimizerState,
        Some(rows(2)),
        f16,
    )
    .unwrap();
    let (mut want, mut partial) = (Vec::new(), 0);
    for (s, batch) in batches.iter().enumerate() {
        let before = z.loss_scales().unwrap();
        want.push(step(&mut z, batch));
        // ZeRO-1 all-reduces whole: device 0 holds the summed gradient.
        let grads: Vec<f32> = group.members()[0]
            .read(z.replicas()[0].executor().gradient_arena().unwrap())
            .unwrap();
        let overflows: Vec<usize> = z
            .shards()
            .iter()
            .map(|r| grads[r.clone()].iter().filter(|g| !g.is_finite()).count())
            .collect();
        let after = z.loss_scales().unwrap();
        for (d, (b, a)) in before.iter().zip(&after).enumerate() {
            let skipped = a.as_ref().unwrap().skipped > b.as_ref().unwrap().skipped;
            assert_eq!(
                skipped,
                overflows.iter().any(|&n| n > 0),
                "step {}: device {d} skipped it: {skipped}; overflows per shard {overflows:?}",
                s + 1
            );
        }
        partial += usize::from(overflows[0] > 0 && overflows[1] == 0);
    }
    let states = z.loss_scales().unwrap();
    let reference = states[0].clone().unwrap();
    eprintln!(
        "ZeRO-1 from 2^112: {}; {partial} steps overflowed in the first shard alone",
        reference.summary()
    );
    assert!(partial > 0, "ZeRO-1: no step overflowed in the first shard alone");
    assert!(reference.steps_taken > 0, "some steps are taken: {reference:?}");
    let mut all = vec![("ZeRO-1".to_string(), states)];
    for stage in [2, 3] {
        let mut z = ZeroStages::with_options(
            group,
            &model,
            MSELoss,
            optimizer,
            BATCH,
            ZeroStage::new(stage).unwrap(),
            Some(rows(2)),
            f16,
        )
        .unwrap();
        let got: Vec<f32> = batches.iter().map(|b| step(&mut z, b)).collect();
        assert_close(&format!("ZeRO-{stage} losses against ZeRO-1"), &got, &want, 0.0, 1e-5);
        all.push((format!("ZeRO-{stage}"), z.loss_scales().unwrap()));
    }
    for (what, per_device) in &all {
        for (d, state) in per_device.iter().enumerate() {
            assert_eq!(
                state.as_ref(),
                Some(&reference),
                "{what}: device {d}'s loss scaling against ZeRO-1's first device"
            );
        }
    }
}

/// An f16 run under ZeRO-1 and ZeRO-3 stopped after 3 steps, its
/// checkpoint (parameters, moments, step and the loss scale, grown once
/// by then) loaded into a fresh engine of the same stage, 3 more steps:
/// the unbroken run's losses and scale, bit for bit (the same state on
/// the same devices).
#[test]
fn a_zero_f16_run_resumes_with_its_loss_scale() {
    let Some(groups) = f16_group("a_zero_f16_run_resumes_with_its_loss_scale") else {
        return;
    };
    let group = &groups[0];
    let model = llama_parallel::model(false);
    let batches = &llama_parallel::batches()[..6];
    let optimizer = scaled(LossScaling::default().init_scale, 2);
    let f16 = PlanOptions {
        precision: Precision::F16,
        ..PlanOptions::default()
    };
    for stage in [1, 3] {
        let mut unbroken = zero_engine(group, &model, stage, optimizer, f16);
        let want = losses_of(unbroken.as_mut(), batches);
        let want_scale = unbroken.read_loss_scale().unwrap().unwrap();
        assert_eq!(
            want_scale.scale,
            8.0 * LossScaling::default().init_scale,
            "ZeRO-{stage}: grown every 2 clean steps"
        );

        let mut first = zero_engine(group, &model, stage, optimizer, f16);
        losses_of(first.as_mut(), &batches[..3]);
        let ckpt = first.checkpoint().unwrap();
        let scale = LossScaleState::from_metadata(|key| ckpt.meta(key))
            .unwrap()
            .expect("the checkpoint carries the loss scale");
        assert_eq!(
            scale.scale,
            2.0 * LossScaling::default().init_scale,
            "ZeRO-{stage}: the scale after 3 steps"
        );
        let params = first.parameters().unwrap();
        let state: Vec<(String, String, Vec<f32>)> = first
            .optimizer_state()
            .unwrap()
            .into_iter()
            .map(|(p, s, v)| (p, s.to_string(), v))
            .collect();
        let mut second = zero_engine(group, &model, stage, optimizer, f16);
        second.load_state(&params, &state, Some(3)).unwrap();
        second.load_loss_scale(&scale).unwrap();
        let got = losses_of(second.as_mut(), &batches[3..]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want[3..]),
            "ZeRO-{stage}: resumed losses {got:?} against {:?}",
            &want[3..]
        );
        assert_eq!(
            second.read_loss_scale().unwrap(),
            Some(want_scale),
            "ZeRO-{stage}: loss scaling state after resuming"
        );
    }
}
