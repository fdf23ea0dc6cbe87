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
use wgrad::kernels::OptimizerConfig;
use wgrad::nn::{CrossEntropyLoss, Staged};
use wgrad::parallel::collectives::{all_gather, reduce_scatter, Part};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::zero::{shard_ranges, Zero, ZeroStage};
use wgrad::parallel::zero_stages::ZeroStages;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::trainer::Targets;

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
    let groups = open_groups("reduce_scatter_and_all_gather_take_uneven_segments", &[DeviceSelection::Count(1), DeviceSelection::Count(2), DeviceSelection::Count(3)]);
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
            let inputs: Vec<Vec<f32>> = (0..n).map(|_| (0..total).map(|_| r.random_range(-1.0f32..1.0)).collect()).collect();
            let weights: Vec<f64> = (0..n).map(|i| (i + 1) as f64 / 3.0).collect();
            let srcs: Vec<_> = k.iter().zip(&inputs).map(|(k, v)| k.upload(v).unwrap()).collect();
            let dsts: Vec<_> = k.iter().zip(&segments).map(|(k, &len)| k.zeros(len.max(1)).unwrap()).collect();
            let src_parts: Vec<Part> = k.iter().zip(&srcs).map(|(k, t)| Part::new(k, t.view())).collect();
            let dst_parts: Vec<Part> = k.iter().zip(&dsts).zip(&segments).map(|((k, t), &len)| Part::new(k, t.slice(0, len).unwrap())).collect();
            for bucket in [0, 3] {
                reduce_scatter(&src_parts, Some(&weights), &dst_parts, bucket, Instant::now()).unwrap();
                let mut start = 0;
                for (d, &len) in segments.iter().enumerate() {
                    let want: Vec<f32> = (start..start + len).map(|e| inputs.iter().zip(&weights).map(|(v, w)| w * f64::from(v[e])).sum::<f64>() as f32).collect();
                    let got: Vec<f32> = k[d].read(dst_parts[d].view).unwrap();
                    assert_close(&format!("segment {d} of {segments:?}, bucket {bucket}, {n} devices"), &got, &want, 0.0, 1e-7);
                    start += len;
                }
            }
            // Every device gathers the segments back, in device order.
            let gathered: Vec<_> = k.iter().map(|k| k.zeros(total.max(1)).unwrap()).collect();
            let whole: Vec<Part> = k.iter().zip(&gathered).map(|(k, t)| Part::new(k, t.slice(0, total).unwrap())).collect();
            all_gather(&dst_parts, &whole).unwrap();
            let joined: Vec<f32> = dst_parts.iter().zip(k).flat_map(|(p, k)| k.read::<f32>(p.view).unwrap()).collect();
            for (d, part) in whole.iter().enumerate() {
                assert_eq!(k[d].read::<f32>(part.view).unwrap(), joined, "all_gather on device {d} of {n}");
            }
        }
        // Segments that do not add up to the sources are refused.
        let src = k[0].zeros(8).unwrap();
        let short = k[0].zeros(3).unwrap();
        let srcs = vec![Part::new(&k[0], src.view())];
        let err = reduce_scatter(&srcs, None, &[Part::new(&k[0], short.view())], 0, Instant::now()).unwrap_err().to_string();
        assert!(err.contains("reduce_scatter"), "{err}");
    }
}

/// One model's case: what it is, the model, its optimizer, its batches.
struct Case<'a> {
    what: &'a str,
    model: &'a dyn Staged,
    optimizer: OptimizerConfig,
    clip: f32,
    batches: Vec<(Vec<u32>, Vec<u32>)>,
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
fn stages_match_one_device(groups: &[DeviceGroup], case: &Case<'_>) {
    let Some(first) = groups.first() else { return };
    let (reference, losses, norms) = train_on_one_device(&first.members()[0], case.model, case.optimizer, BATCH, &case.batches);
    assert!(norms.iter().all(|&n| n > case.clip), "{}: every step clips: norms {norms:?} against {}", case.what, case.clip);
    let want: Parameters = reference.executor().parameters().unwrap();
    let want_state = reference.executor().optimizer_state().unwrap();
    for group in groups {
        let labels = group.labels().join(", ");
        for stage in 1..=3 {
            let zero_stage = ZeroStage::new(stage).unwrap();
            let mut z: Box<dyn Sharded> = match zero_stage {
                ZeroStage::OptimizerState => Box::new(Zero::new(group, case.model, CrossEntropyLoss, case.optimizer, BATCH, zero_stage, Some(rows(group.len()))).unwrap()),
                _ => Box::new(ZeroStages::new(group, case.model, CrossEntropyLoss, case.optimizer, BATCH, zero_stage, Some(rows(group.len()))).unwrap()),
            };
            let what = format!("{} ZeRO-{stage} on [{labels}]", case.what);
            let (mut loss_err, mut norm_err) = (0.0f32, 0.0f32);
            for (s, (ids, targets)) in case.batches.iter().enumerate() {
                let loss = z.step(ids.as_slice().into(), Targets::Classes(targets), true).unwrap().unwrap();
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
                    assert_eq!(*x, 0.0, "{what}: device {d} holds element {e} of {} outside its shard {shard:?}", span.name);
                }
            }
        }
    }
}

fn two_and_three(test: &str) -> crate::parallel::Groups {
    open_groups(test, &[DeviceSelection::Count(2), DeviceSelection::Count(3)])
}

#[test]
fn zero_stages_train_the_llama_as_one_device() {
    let groups = two_and_three("zero_stages_train_the_llama_as_one_device");
    for tied in [false, true] {
        let model = llama_parallel::model(tied);
        let case = Case { what: if tied { "tied Llama" } else { "untied Llama" }, model: &model, optimizer: llama_parallel::optimizer(), clip: llama_parallel::CLIP, batches: llama_parallel::batches() };
        stages_match_one_device(&groups, &case);
    }
}

#[test]
fn zero_stages_train_the_gpt_as_one_device() {
    let groups = two_and_three("zero_stages_train_the_gpt_as_one_device");
    let model = gpt_tensor::model();
    let case = Case { what: "GPT", model: &model, optimizer: gpt_tensor::adamw().into(), clip: gpt_tensor::CLIP, batches: (0..10).map(gpt_tensor::batch).collect() };
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

    let mut first = ZeroStages::new(three, &model, CrossEntropyLoss, optimizer, BATCH, ZeroStage::Parameters, Some(rows(3))).unwrap();
    for (ids, targets) in &batches[..5] {
        first.step(ids, Targets::Classes(targets), false).unwrap();
    }
    let ckpt = first.checkpoint().unwrap();
    assert_eq!(ckpt.meta("step"), Some("5"));
    let params = first.parameters().unwrap();
    let state: Vec<(String, String, Vec<f32>)> = first.optimizer_state().unwrap().into_iter().map(|(p, s, v)| (p, s.to_string(), v)).collect();

    let mut second = Zero::new(two, &model, CrossEntropyLoss, optimizer, BATCH, ZeroStage::Parameters, Some(rows(2))).unwrap();
    second.load_state(&params, &state, Some(5)).unwrap();
    // Loaded as saved: the same bits back under the same names.
    let bits = |p: &Parameters| p.iter().map(|(_, _, v)| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
    assert_eq!(bits(&second.parameters().unwrap()), bits(&params), "parameters after loading");
    let mut stage2 = ZeroStages::new(two, &model, CrossEntropyLoss, optimizer, BATCH, ZeroStage::Gradients, Some(rows(2))).unwrap();
    stage2.load_state(&params, &state, Some(5)).unwrap();
    assert_eq!(bits(&stage2.parameters().unwrap()), bits(&params), "parameters after loading into ZeRO-2");
    let mut single = wgrad::trainer::Trainer::new(two.members()[0].clone(), &model, CrossEntropyLoss, optimizer, BATCH).unwrap();
    TrainEngine::load_state(&mut single, &params, &state, Some(5)).unwrap();
    for (ids, targets) in &batches[5..] {
        second.step(ids, Targets::Classes(targets), false).unwrap();
        assert_holds_only_its_shard("whole-arena ZeRO-3, resumed", &second);
        stage2.step(ids, Targets::Classes(targets), false).unwrap();
        TrainEngine::step(&mut single, ids.as_slice().into(), Targets::Classes(targets), false).unwrap();
    }
    assert_eq!((second.step_count(), stage2.step_count()), (10, 10));
    assert_same_parameters("ZeRO-3 on 3 devices, resumed as whole-arena ZeRO-3 on 2", &second.parameters().unwrap(), &want, 1e-5, 1e-4);
    assert_same_parameters("ZeRO-3 on 3 devices, resumed as ZeRO-2 block by block on 2", &stage2.parameters().unwrap(), &want, 1e-5, 1e-4);
    assert_same_parameters("ZeRO-3 on 3 devices, resumed on one device", &single.executor().parameters().unwrap(), &want, 1e-5, 1e-4);
}

/// The memory planned without a device equals what each engine's
/// executors planned on real devices (both plan the same graphs with the
/// same alignment: exact), for every strategy on 2 devices; ZeRO's kept
/// optimizer state is half of data parallel's (at most 0.55×: shards are
/// whole 256-byte blocks).
#[test]
fn planned_memory_equals_each_engines() {
    use wgrad::parallel::data::{DataParallel, Split};
    use wgrad::parallel::engine::Strategy;
    use wgrad::parallel::memory::{strategy_memory, Planning};
    use wgrad::parallel::pipeline::{Pipeline, Schedule};
    use wgrad::parallel::tensor::TensorParallel;
    let groups = open_groups("planned_memory_equals_each_engines", &[DeviceSelection::Count(2)]);
    let Some(group) = groups.first() else { return };
    let model = llama_parallel::model(true);
    let optimizer = llama_parallel::optimizer();
    let alignment = group.members().iter().map(|k| k.device().limits().min_storage_buffer_offset_alignment).max().unwrap();
    let planning = Planning { criterion: CrossEntropyLoss.into(), optimizer, batch: BATCH, micro_batches: 2, device_alignment: alignment };
    let planned = |strategy| strategy_memory(&model, strategy, 2, &planning).unwrap();

    let single = wgrad::trainer::Trainer::new(group.members()[0].clone(), &model, CrossEntropyLoss, optimizer, BATCH).unwrap();
    assert_eq!(strategy_memory(&model, Strategy::Single, 1, &planning).unwrap(), TrainEngine::memory(&single), "single device");
    let data = DataParallel::new(group, &model, CrossEntropyLoss, optimizer, BATCH, Split::Rows(vec![2, 2])).unwrap();
    assert_eq!(planned(Strategy::Data), data.memory(), "data parallel");
    let tensor = TensorParallel::new(group, &model, CrossEntropyLoss, optimizer, BATCH).unwrap();
    assert_eq!(planned(Strategy::Tensor), tensor.memory(), "tensor parallel");
    let pipeline = Pipeline::new(group, &model, CrossEntropyLoss, optimizer, BATCH, 2, Schedule::OneFOneB).unwrap();
    assert_eq!(planned(Strategy::Pipeline), pipeline.memory(), "pipeline");
    // Whole-arena ZeRO (stage 1; stage 2 over MPI): data parallel's
    // arenas and activations, the state's shard; stage 1's table row is
    // what it allocates.
    let whole_arena = |stage| Zero::new(group, &model, CrossEntropyLoss, optimizer, BATCH, stage, Some(vec![2, 2])).unwrap();
    let zero1 = whole_arena(ZeroStage::OptimizerState);
    for zero in [&zero1, &whole_arena(ZeroStage::Gradients)] {
        assert_eq!(zero.memory(), wgrad::parallel::memory::DeviceMemory { optimizer_state: zero.kept_memory().optimizer_state, ..data.memory() }, "whole-arena {}", zero.describe());
    }
    assert_eq!(planned(Strategy::Zero(ZeroStage::OptimizerState)), zero1.memory(), "ZeRO-1");
    // Stages 2 and 3 block by block: what their devices allocated
    // (shards, the whole parameters at stage 2, pooled stage arenas,
    // every stage's activations) is the plan's, exactly; fewer gradient
    // bytes than data parallel allocates (this tiny model's largest
    // stage, the tied embedding, is a third of it: a deep model saves far
    // more), and at stage 3 fewer parameter bytes too.
    let whole = data.memory();
    let mut allocated = Vec::new();
    for stage in [ZeroStage::Gradients, ZeroStage::Parameters] {
        let z = ZeroStages::new(group, &model, CrossEntropyLoss, optimizer, BATCH, stage, Some(vec![2, 2])).unwrap();
        let m = planned(Strategy::Zero(stage));
        assert_eq!(z.memory(), m, "ZeRO-{} allocated", stage.number());
        assert!(m.gradients < whole.gradients, "ZeRO-{} {m:?} against data parallel {whole:?}", stage.number());
        allocated.push(m);
    }
    let (second, third) = (allocated[0], allocated[1]);
    assert!(third.parameters < whole.parameters, "ZeRO-3 {third:?} against data parallel {whole:?}");
    // The same shards and pool; stage 2 holds every parameter besides.
    assert_eq!((second.gradients, second.optimizer_state, second.activations), (third.gradients, third.optimizer_state, third.activations), "ZeRO-2 {second:?} against ZeRO-3 {third:?}");
    assert!(second.parameters > third.parameters, "ZeRO-2 {second:?} against ZeRO-3 {third:?}");
    // Shards are whole 256-byte blocks: at most 0.55× data parallel's state.
    for (what, state) in [("ZeRO-1", zero1.memory().optimizer_state), ("ZeRO-2", second.optimizer_state), ("ZeRO-3", third.optimizer_state)] {
        let ratio = state as f64 / whole.optimizer_state as f64;
        assert!(ratio <= 0.55, "{what} keeps {ratio:.3} of data parallel's optimizer state");
    }
}
