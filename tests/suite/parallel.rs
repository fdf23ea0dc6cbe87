//! Several devices on one model: collectives against host computations, and
//! data-parallel training against single-device training on the same global
//! batch. On a CPU-only machine the groups mix lavapipe (Vulkan) and
//! llvmpipe (GL), and repeat an adapter for a third device.

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{assert_close, random_vec, rng};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::SGD;
use wgrad::parallel::collectives::{all_gather, all_reduce, broadcast, send, Part};
use wgrad::parallel::data::{proportional_split, DataParallel, Split};
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::{DeviceGroup, DeviceSelection, MAX_DEVICES};
use wgrad::Error;
use wgrad::{Kernels, Targets, Trainer};

/// The device groups the tests run on, holding wgrad's GL lock (when a GL
/// adapter is among them) until the last group is dropped: the tests drop
/// tensors and devices and destroy a device outside wgrad's own locked calls,
/// and on GL those must not wait on wgpu's context while another test
/// thread's submit holds it (wgpu panics after 6 s).
pub(crate) struct Groups {
    list: Vec<DeviceGroup>,
    // Declared last: dropped after the groups.
    _gl: Option<wgrad::device::GlGuard>,
}

impl std::ops::Deref for Groups {
    type Target = [DeviceGroup];
    fn deref(&self) -> &[DeviceGroup] {
        &self.list
    }
}

/// Iterates over the groups, still holding the GL lock.
pub(crate) struct GroupsIter {
    list: std::vec::IntoIter<DeviceGroup>,
    _gl: Option<wgrad::device::GlGuard>,
}

impl Iterator for GroupsIter {
    type Item = DeviceGroup;
    fn next(&mut self) -> Option<DeviceGroup> {
        self.list.next()
    }
}

impl IntoIterator for Groups {
    type Item = DeviceGroup;
    type IntoIter = GroupsIter;
    fn into_iter(self) -> GroupsIter {
        GroupsIter {
            list: self.list.into_iter(),
            _gl: self._gl,
        }
    }
}

/// Two devices on two adapters, one adapter twice, and three devices; none
/// (failing in CI, see `common::no_adapter`) without an adapter.
pub(crate) fn groups(test: &str) -> Groups {
    open_groups(
        test,
        &[
            DeviceSelection::Count(2),
            DeviceSelection::Adapters(vec!["0".into(), "0".into()]),
            DeviceSelection::Count(3),
        ],
    )
}

/// A group for each selection, of the suite's shared devices
/// ([`shared_device`]), holding wgrad's GL lock until dropped: the lock
/// the groups' GL devices need (see [`Groups`]), and here what keeps two
/// tests from driving the shared devices at once (it is reentrant, so a
/// test inside `common::for_each_adapter` may open groups too). None
/// without an adapter.
pub(crate) fn open_groups(test: &str, selections: &[DeviceSelection]) -> Groups {
    if !common::any_adapter(test) {
        return Groups {
            list: Vec::new(),
            _gl: None,
        };
    }
    let gl = wgrad::device::lock_gl();
    let list = selections
        .iter()
        .map(|s| {
            let selectors = s.selectors().unwrap();
            let members = (0..selectors.len())
                .map(|i| {
                    let nth = selectors[..i]
                        .iter()
                        .filter(|&earlier| *earlier == selectors[i])
                        .count();
                    shared_device(&selectors[i], nth)
                })
                .collect();
            DeviceGroup::from_kernels(members).unwrap()
        })
        .collect();
    Groups { list, _gl: Some(gl) }
}

/// The `nth` device the suite opened on the adapter `selector` names,
/// opened at first use and kept for the whole run: every multi-device test
/// runs on these, so each compiles a kernel once rather than once per
/// test (a new device compiles every pipeline again: LLVM's work on
/// lavapipe, about 10× the suite's distinct pipelines before). The first
/// on an adapter the single-device tests use is theirs
/// (`common::adapters`), which already runs many tests at once. The
/// caller holds wgrad's GL lock ([`open_groups`]).
fn shared_device(selector: &str, nth: usize) -> Arc<Kernels> {
    if nth == 0 {
        let reports = common::reports();
        if let Some(k) = reports
            .iter()
            .zip(common::adapters())
            .find_map(|(r, k)| (r.index.to_string() == selector).then(|| k.clone()))
        {
            return k;
        }
    }
    static SHARED: Mutex<BTreeMap<(String, usize), Arc<Kernels>>> = Mutex::new(BTreeMap::new());
    let mut shared = SHARED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    shared
        .entry((selector.to_string(), nth))
        .or_insert_with(|| {
            let device = wgrad::Device::open(&wgrad::DeviceOptions {
                backends: None,
                adapter: Some(selector.to_string()),
                ..Default::default()
            })
            .unwrap();
            Arc::new(Kernels::new(device))
        })
        .clone()
}

/// [`open_groups`] on devices opened for the test alone, for a test that
/// destroys one.
pub(crate) fn open_fresh_groups(test: &str, selections: &[DeviceSelection]) -> Groups {
    if !common::any_adapter(test) {
        return Groups {
            list: Vec::new(),
            _gl: None,
        };
    }
    let gl = common::lock_gl_if_any();
    let list = selections.iter().map(|s| DeviceGroup::open(s).unwrap()).collect();
    Groups { list, _gl: gl }
}

#[test]
fn device_selections_parse() {
    assert_eq!(DeviceSelection::parse("3").unwrap(), DeviceSelection::Count(3));
    assert_eq!(DeviceSelection::parse("all").unwrap(), DeviceSelection::All);
    assert_eq!(
        DeviceSelection::parse("0, 1,1").unwrap(),
        DeviceSelection::Adapters(vec!["0".into(), "1".into(), "1".into()])
    );
    assert!(DeviceSelection::parse("0").is_err());
    assert!(DeviceSelection::parse(" ").is_err());
}

/// A device count that cannot work is an error naming the numbers before
/// any device opens (no adapter needed): opening 100000 devices one by one
/// used to block for minutes.
#[test]
fn impossible_device_counts_are_errors_before_opening() {
    let count = |n| DeviceSelection::Count(n).check();
    assert_eq!(count(MAX_DEVICES).unwrap(), MAX_DEVICES);
    let err = count(100_000).unwrap_err().to_string();
    assert!(
        err.contains("100000") && err.contains(&MAX_DEVICES.to_string()),
        "{err}"
    );
    let list = DeviceSelection::Adapters(vec!["0".into(), "0".into(), "999".into()]);
    assert!(list.check().is_err());

    nn::manual_seed(0);
    let model = Sequential::mlp(&[64, 16, 10], Layer::ReLU).unwrap();
    let reason = |s: Strategy, devices, split: Option<&[usize]>| {
        s.check_devices(devices, &model, 32, split, 4).unwrap_err().to_string()
    };
    let err = reason(Strategy::Data, 40, None);
    assert!(err.contains("40 devices") && err.contains("32 rows"), "{err}");
    let err = reason(Strategy::Data, 2, Some(&[10, 10, 12]));
    assert!(err.contains("3 devices") && err.contains("2 devices"), "{err}");
    let err = reason(Strategy::Pipeline, 3, None);
    assert!(err.contains("3 stages") && err.contains("2 blocks"), "{err}");
    let err = reason(Strategy::Tensor, 17, None);
    assert!(err.contains("17 devices") && err.contains("has 16"), "{err}");
    let err = reason(Strategy::Single, 65, None);
    assert!(err.contains("65"), "{err}");
    for s in [Strategy::Data, Strategy::Pipeline, Strategy::Tensor] {
        s.check_devices(2, &model, 32, None, 4).unwrap();
    }
}

#[test]
fn proportional_split_gives_everyone_a_row_and_sums_to_the_batch() {
    assert_eq!(proportional_split(10, &[1.0, 1.0]).unwrap(), vec![5, 5]);
    assert_eq!(proportional_split(10, &[3.0, 1.0]).unwrap().iter().sum::<usize>(), 10);
    assert_eq!(proportional_split(3, &[1000.0, 1.0, 1.0]).unwrap(), vec![1, 1, 1]);
    assert_eq!(proportional_split(100, &[3.0, 1.0]).unwrap(), vec![75, 25]);
    assert_eq!(
        proportional_split(7, &[f64::NAN, 0.0]).unwrap().iter().sum::<usize>(),
        7
    );
    assert!(proportional_split(1, &[1.0, 1.0]).is_err());
}

#[test]
fn collectives_match_host_computations() {
    for group in groups("collectives_match_host_computations") {
        let labels = group.labels().join(", ");
        let n = 1000;
        let data: Vec<Vec<f32>> = (0..group.len())
            .map(|i| random_vec(&mut rng(i as u64), n, -1.0, 1.0))
            .collect();
        let tensors: Vec<_> = group
            .members()
            .iter()
            .zip(&data)
            .map(|(k, d)| k.upload(d).unwrap())
            .collect();
        let parts: Vec<Part<'_>> = group
            .members()
            .iter()
            .zip(&tensors)
            .map(|(k, t)| Part::new(k, t.view()))
            .collect();
        // Weighted all-reduce in small buckets (exercises the bucket edges).
        let weights: Vec<f64> = (0..group.len()).map(|i| (i + 1) as f64 / 10.0).collect();
        all_reduce(&parts, Some(&weights), 333, Instant::now()).unwrap();
        let want: Vec<f32> = (0..n)
            .map(|j| data.iter().zip(&weights).map(|(d, w)| w * f64::from(d[j])).sum::<f64>() as f32)
            .collect();
        for (k, t) in group.members().iter().zip(&tensors) {
            let got: Vec<f32> = k.read(t.view()).unwrap();
            // Accumulated in f64 then rounded once: exact to the rounding.
            assert_close(&format!("weighted all_reduce on [{labels}]"), &got, &want, 0.0, 0.0);
        }
        // Plain sum.
        all_reduce(&parts, None, 0, Instant::now()).unwrap();
        let sum: Vec<f32> = want
            .iter()
            .map(|v| (f64::from(*v) * group.len() as f64) as f32)
            .collect();
        let got: Vec<f32> = group.members()[0].read(tensors[0].view()).unwrap();
        assert_close(&format!("sum all_reduce on [{labels}]"), &got, &sum, 1e-6, 1e-6);
        // Broadcast from the last device.
        let last = group.len() - 1;
        let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
        group.members()[last].write(tensors[last].view(), &src).unwrap();
        broadcast(parts[last], &parts).unwrap();
        for (k, t) in group.members().iter().zip(&tensors) {
            assert_eq!(k.read::<f32>(t.view()).unwrap(), src, "broadcast on [{labels}]");
        }
        // All-gather: every device gets all parts, in order.
        let small: Vec<_> = group
            .members()
            .iter()
            .enumerate()
            .map(|(i, k)| k.upload(&[i as f32; 3]).unwrap())
            .collect();
        let big: Vec<_> = group
            .members()
            .iter()
            .map(|k| k.zeros(3 * group.len()).unwrap())
            .collect();
        let srcs: Vec<Part<'_>> = group
            .members()
            .iter()
            .zip(&small)
            .map(|(k, t)| Part::new(k, t.view()))
            .collect();
        let dsts: Vec<Part<'_>> = group
            .members()
            .iter()
            .zip(&big)
            .map(|(k, t)| Part::new(k, t.view()))
            .collect();
        all_gather(&srcs, &dsts).unwrap();
        let joined: Vec<f32> = (0..group.len()).flat_map(|i| [i as f32; 3]).collect();
        for (k, t) in group.members().iter().zip(&big) {
            assert_eq!(k.read::<f32>(t.view()).unwrap(), joined, "all_gather on [{labels}]");
        }
        // Send between two devices.
        send(srcs[0], srcs[1]).unwrap();
        assert_eq!(group.members()[1].read::<f32>(small[1].view()).unwrap(), vec![0.0; 3]);
        // Mismatched lengths are refused.
        assert!(matches!(
            all_reduce(&[parts[0], srcs[1]], None, 0, Instant::now()),
            Err(Error::Shape { .. })
        ));
    }
}

const IN: usize = 12;
const CLASSES: usize = 4;

fn batch(rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut r = rng(seed);
    let x = random_vec(&mut r, rows * IN, -1.0, 1.0);
    let y = (0..rows)
        .map(|i| (x[i * IN] > 0.0) as u32 + 2 * (x[i * IN + 1] > 0.0) as u32)
        .collect();
    (x, y)
}

fn model() -> Sequential {
    nn::manual_seed(21);
    Sequential::mlp(&[IN, 24, CLASSES], Layer::ReLU).unwrap()
}

fn optimizer() -> SGD {
    SGD::new(0.1).momentum(0.9)
}

#[test]
fn data_parallel_matches_single_device_training() {
    const GLOBAL: usize = 16;
    const STEPS: u64 = 8;
    for group in groups("data_parallel_matches_single_device_training") {
        let labels = group.labels().join(", ");
        // Single-device reference on the same global batches.
        let mut single = Trainer::new(
            group.members()[0].clone(),
            &model(),
            CrossEntropyLoss,
            optimizer(),
            GLOBAL,
        )
        .unwrap();
        for s in 0..STEPS {
            let (x, y) = batch(GLOBAL, s);
            single.zero_grad();
            single.forward(&x).unwrap();
            single.loss(Targets::Classes(&y)).unwrap();
            single.backward().unwrap();
            single.step().unwrap();
        }
        let want = single.executor().parameters().unwrap();
        // An uneven split with a one-row shard, and the measured split.
        let uneven: Vec<usize> = match group.len() {
            2 => vec![1, GLOBAL - 1],
            n => {
                let mut v = vec![1; n];
                v[n - 1] = GLOBAL - (n - 1);
                v[0] = 5;
                v[n - 1] -= 4;
                v
            }
        };
        for split in [Split::Rows(uneven.clone()), Split::Measured { every: 3 }] {
            let mut dp =
                DataParallel::new(&group, &model(), CrossEntropyLoss, optimizer(), GLOBAL, split.clone()).unwrap();
            for s in 0..STEPS {
                let (x, y) = batch(GLOBAL, s);
                let loss = dp.step(&x, Targets::Classes(&y), s == STEPS - 1).unwrap();
                if let Some(l) = loss {
                    assert!(l.is_finite() && l > 0.0);
                }
            }
            for (r, replica) in dp.replicas().iter().enumerate() {
                let got = replica.executor().parameters().unwrap();
                for ((name, _, g), (_, _, w)) in got.iter().zip(&want) {
                    // Same math; only the summation order of the batch differs
                    // (shards summed separately, then weighted): f32 rounding
                    // compounded over 8 momentum steps.
                    assert_close(
                        &format!("{name} on replica {r} of [{labels}] with {split:?}"),
                        g,
                        w,
                        1e-5,
                        1e-4,
                    );
                }
            }
        }
    }
}

#[test]
fn replicas_stay_bit_identical() {
    for group in groups("replicas_stay_bit_identical") {
        // Fixed rows, and fewer steps than the periodic synchronisation, so
        // nothing copies replica 0 over the others.
        let rows = if group.len() == 2 { vec![3, 7] } else { vec![3, 3, 4] };
        let mut dp = DataParallel::new(&group, &model(), CrossEntropyLoss, optimizer(), 10, Split::Rows(rows)).unwrap();
        for s in 0..6 {
            let (x, y) = batch(10, 100 + s);
            dp.step(&x, Targets::Classes(&y), false).unwrap();
        }
        let bits: Vec<Vec<Vec<u32>>> = dp
            .replicas()
            .iter()
            .map(|r| {
                r.executor()
                    .parameters()
                    .unwrap()
                    .into_iter()
                    .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
                    .collect()
            })
            .collect();
        for (i, b) in bits.iter().enumerate().skip(1) {
            assert_eq!(b, &bits[0], "replica {i} of [{}]", group.labels().join(", "));
        }
        assert_eq!(dp.shares().iter().sum::<usize>(), 10);
    }
}

#[test]
fn a_device_failing_mid_training_is_an_error_naming_it() {
    let groups = open_fresh_groups(
        "a_device_failing_mid_training_is_an_error_naming_it",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let mut dp = DataParallel::new(
        group,
        &model(),
        CrossEntropyLoss,
        optimizer(),
        8,
        Split::Measured { every: 0 },
    )
    .unwrap();
    let (x, y) = batch(8, 1);
    dp.step(&x, Targets::Classes(&y), false).unwrap();
    group.members()[1].device().wgpu_device().destroy();
    let start = Instant::now();
    let err = dp.step(&x, Targets::Classes(&y), true).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(30), "failed fast");
    match &err {
        Error::OnDevice { device, .. } => assert!(device.starts_with("#1 "), "{err}"),
        other => panic!("expected an error naming device #1, got {other}"),
    }
}

use wgrad::nn::Staged;
use wgrad::parallel::pipeline::{partition, Pipeline, Schedule};
use wgrad::parallel::tensor::TensorParallel;

fn single_device_reference(
    k: &std::sync::Arc<wgrad::Kernels>,
    model: &Sequential,
    global: usize,
    steps: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut single = Trainer::new(k.clone(), model, CrossEntropyLoss, optimizer(), global).unwrap();
    for s in 0..steps {
        let (x, y) = batch(global, s);
        single.zero_grad();
        single.forward(&x).unwrap();
        single.loss(Targets::Classes(&y)).unwrap();
        single.backward().unwrap();
        single.step().unwrap();
    }
    single.executor().parameters().unwrap()
}

fn assert_same_parameters(what: &str, got: &[(String, Vec<usize>, Vec<f32>)], want: &[(String, Vec<usize>, Vec<f32>)]) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for (name, shape, w) in want {
        let (_, gshape, g) = got
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("{what}: no {name}"));
        assert_eq!(gshape, shape, "{what}: {name} shape");
        // Same math, different f32 summation order (micro-batches / shards),
        // compounded over the momentum steps.
        assert_close(&format!("{what}: {name}"), g, w, 1e-5, 1e-4);
    }
}

#[test]
fn balanced_partitions_cover_every_layer() {
    nn::manual_seed(0);
    let m = Sequential::mlp(&[64, 256, 32, 32, 10], Layer::ReLU).unwrap();
    // Blocks are the Linears (each with its activation).
    let counts = partition(&m.stage_costs(), 2).unwrap();
    assert_eq!(counts.iter().sum::<usize>(), 4);
    assert_eq!(counts, vec![1, 3], "the big first layer stands alone");
    let three = partition(&m.stage_costs(), 3).unwrap();
    assert_eq!(three.len(), 3);
    assert!(three.iter().all(|&c| c > 0));
    assert!(partition(&m.stage_costs(), 5).is_err());
}

#[test]
fn pipeline_parallel_matches_single_device_training() {
    const GLOBAL: usize = 16;
    const STEPS: u64 = 6;
    nn::manual_seed(31);
    let m = Sequential::mlp(&[IN, 20, 16, CLASSES], Layer::Tanh).unwrap();
    for group in groups("pipeline_parallel_matches_single_device_training") {
        let labels = group.labels().join(", ");
        let want = single_device_reference(&group.members()[0], &m, GLOBAL, STEPS);
        for micro in [1, 4] {
            let mut p = Pipeline::new(
                &group,
                &m,
                CrossEntropyLoss,
                optimizer(),
                GLOBAL,
                micro,
                Schedule::GPipe,
            )
            .unwrap();
            let mut last = None;
            for s in 0..STEPS {
                let (x, y) = batch(GLOBAL, s);
                last = p.step(&x, Targets::Classes(&y), true).unwrap();
            }
            assert!(last.is_some_and(|l| l.is_finite()));
            assert_same_parameters(
                &format!("pipeline M={micro} on [{labels}] {:?}", p.blocks_per_stage()),
                &p.parameters().unwrap(),
                &want,
            );
            let ideal = p.ideal_bubble_fraction();
            assert!((ideal - (group.len() - 1) as f64 / (micro + group.len() - 1) as f64).abs() < 1e-12);
            let measured = p.measured_bubble_fraction();
            assert!((0.0..=1.0).contains(&measured));
            // Predictions flow through every stage; the last stage's GPU
            // argmax picks what the outputs say (exact: same values, ties
            // to the first index on both sides).
            let (x, _) = batch(7, 99);
            let predictions = p.predict(&x).unwrap();
            assert_eq!(
                predictions,
                wgrad::cpu::argmax_rows(&p.outputs(&x).unwrap(), 7, CLASSES)
            );
        }
    }
}

#[test]
fn tensor_parallel_matches_single_device_training() {
    const BATCH: usize = 12;
    const STEPS: u64 = 6;
    nn::manual_seed(41);
    let with_pre = Sequential::new(vec![
        Layer::Linear(nn::Linear::new(IN, 8)),
        Layer::ReLU,
        Layer::Linear(nn::Linear::new(8, 24)),
        Layer::Tanh,
        Layer::Linear(nn::Linear::new(24, CLASSES)),
    ]);
    let block_only = Sequential::mlp(&[IN, 25, CLASSES], Layer::GELU).unwrap();
    let with_post = Sequential::mlp(&[IN, 9, 6, CLASSES], Layer::ReLU).unwrap();
    for group in groups("tensor_parallel_matches_single_device_training") {
        let labels = group.labels().join(", ");
        // The Sequential splits each Linear–activation–Linear pair from its
        // first layer: with_pre's first two Linears (its last is whole, on
        // device 0 after the all-reduce), block_only's both, with_post's
        // first two.
        for (what, m, split) in [
            ("pair+post", &with_pre, "0.weight"),
            ("pair", &block_only, "0.weight"),
            ("pair+post", &with_post, "2.weight"),
        ] {
            let want = single_device_reference(&group.members()[0], m, BATCH, STEPS);
            let mut tp = TensorParallel::new(&group, m, CrossEntropyLoss, optimizer(), BATCH).unwrap();
            assert!(
                tp.slices(split).iter().all(Option::is_some),
                "{what}: `{split}` split over every device"
            );
            for s in 0..STEPS {
                let (x, y) = batch(BATCH, s);
                tp.step(&x, Targets::Classes(&y), s == STEPS - 1).unwrap();
            }
            assert_same_parameters(
                &format!("tensor {what} on [{labels}]"),
                &tp.parameters().unwrap(),
                &want,
            );
            // More rows than a batch, so the last chunk is padded; the GPU
            // argmax must agree exactly with the outputs it reads.
            let (x, _) = batch(BATCH + 5, 98);
            assert_eq!(
                tp.predict(&x).unwrap(),
                wgrad::cpu::argmax_rows(&tp.outputs(&x).unwrap(), BATCH + 5, CLASSES)
            );
        }
    }
}

#[test]
fn the_balanced_split_evens_out_finishing_times() {
    use wgrad::parallel::data::{balanced_split, Cost};
    let same = Cost {
        fixed: 0.001,
        per_row: 0.0001,
    };
    assert_eq!(balanced_split(32, &[same, same]).unwrap(), vec![16, 16]);
    // A device twice as slow per row gets about a third of the rows.
    let slow = Cost {
        fixed: 0.001,
        per_row: 0.0002,
    };
    let split = balanced_split(30, &[same, slow]).unwrap();
    assert_eq!(split.iter().sum::<usize>(), 30);
    assert!((19..=21).contains(&split[0]), "{split:?}");
    // A large fixed cost shifts rows to the other device, never below one.
    let laggy = Cost {
        fixed: 1.0,
        per_row: 0.0001,
    };
    assert_eq!(balanced_split(10, &[same, laggy]).unwrap(), vec![9, 1]);
}

#[test]
fn one_device_twice_in_a_group_or_a_collective_is_an_error() {
    let groups = groups("one_device_twice_in_a_group_or_a_collective_is_an_error");
    let Some(group) = groups.first() else { return };
    let k = group.members()[0].clone();
    assert!(DeviceGroup::from_kernels(vec![k.clone(), k.clone()]).is_err());
    assert!(DeviceGroup::open(&DeviceSelection::Adapters(vec![])).is_err());
    let t = k.zeros(4).unwrap();
    let u = k.zeros(4).unwrap();
    let parts = [Part::new(&k, t.view()), Part::new(&k, u.view())];
    assert!(matches!(
        all_reduce(&parts, None, 0, Instant::now()),
        Err(Error::InvalidArgument { .. })
    ));
}

use wgrad::parallel::data::Cost;
use wgrad::parallel::distributed::{
    broadcast_f32, broadcast_u64, DistributedDataParallel, ProcessGroup, SingleProcess,
};
use wgrad::parallel::engine::TrainEngine;

#[test]
fn combined_cost_finishes_every_device_together() {
    let costs = [
        Cost {
            fixed: 1e-3,
            per_row: 1e-4,
        },
        Cost {
            fixed: 3e-3,
            per_row: 3e-4,
        },
    ];
    let c = Cost::combined(&costs);
    // At the combined time T for R rows, the devices' rows (T − fixed)/per_row sum to R.
    let rows = 400.0;
    let t = c.fixed + c.per_row * rows;
    let sum: f64 = costs.iter().map(|d| (t - d.fixed) / d.per_row).sum();
    assert!((sum - rows).abs() < 1e-9, "{sum} rows at T={t}");
    let one = Cost::combined(&costs[..1]);
    assert!(
        (one.fixed - costs[0].fixed).abs() < 1e-15 && (one.per_row - costs[0].per_row).abs() < 1e-15,
        "{one:?}"
    );
}

#[test]
fn the_single_process_group_is_the_identity() {
    let g = SingleProcess;
    let mut v = vec![1.5f64, -2.0];
    g.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, [1.5, -2.0]);
    assert_eq!(g.all_gather(&[4.0, 5.0]).unwrap(), [4.0, 5.0]);
    let mut f = vec![0.25f32, 7.0];
    broadcast_f32(&g, 0, &mut f).unwrap();
    assert_eq!(f, [0.25, 7.0]);
    let mut u = vec![u64::MAX, 3];
    broadcast_u64(&g, 0, &mut u).unwrap();
    assert_eq!(u, [u64::MAX, 3]);
    assert!(g.broadcast_bytes(1, &mut Vec::new()).is_err(), "rank 1 does not exist");
}

/// The distributed engine in a job of one process (no MPI needed): the
/// hierarchical path — local all-reduce, the cross-process stage, a
/// re-split of the process's rows — gives single-device training.
#[test]
fn distributed_data_parallel_in_one_process_matches_single_device_training() {
    const GLOBAL: usize = 16;
    const STEPS: u64 = 8;
    for group in groups("distributed_data_parallel_in_one_process_matches_single_device_training")
        .into_iter()
        .take(2)
    {
        let labels = group.labels().join(", ");
        let want = single_device_reference(&group.members()[0], &model(), GLOBAL, STEPS);
        let mut ddp = DistributedDataParallel::new(
            std::sync::Arc::new(SingleProcess),
            &group,
            &model(),
            CrossEntropyLoss,
            optimizer(),
            GLOBAL,
            None,
        )
        .unwrap();
        assert_eq!(ddp.process_shares(), [GLOBAL]);
        for s in 0..STEPS {
            let (x, y) = batch(GLOBAL, s);
            if s == 4 {
                // What a cross-process re-split does to this process: other
                // rows, same state.
                ddp.local_mut().set_global_batch(GLOBAL - 3).unwrap();
                ddp.local_mut().set_global_batch(GLOBAL).unwrap();
            }
            let loss = ddp.step(&x, Targets::Classes(&y), true).unwrap();
            assert!(loss.is_some_and(|l| l.is_finite() && l > 0.0));
        }
        for (r, replica) in ddp.local().replicas().iter().enumerate() {
            assert_same_parameters(
                &format!("replica {r} of [{labels}]"),
                &replica.executor().parameters().unwrap(),
                &want,
            );
        }
        // Wrong batch shapes are errors that name the op.
        let (x, y) = batch(GLOBAL - 1, 0);
        let err = ddp.step(&x, Targets::Classes(&y), false).unwrap_err().to_string();
        assert!(err.contains("DistributedDataParallel::step"), "{err}");
    }
}

#[test]
fn a_bad_process_split_is_refused() {
    let groups = groups("a_bad_process_split_is_refused");
    let Some(group) = groups.first() else { return };
    for rows in [vec![10, 6], vec![15], vec![0]] {
        let err = DistributedDataParallel::new(
            std::sync::Arc::new(SingleProcess),
            group,
            &model(),
            CrossEntropyLoss,
            optimizer(),
            16,
            Some(rows.clone()),
        );
        assert!(matches!(err, Err(Error::InvalidArgument { .. })), "{rows:?}");
    }
}

#[test]
fn all_and_counts_open_one_device_per_physical_gpu_and_no_software_adapter_beside_one() {
    use wgrad::device::AdapterReport;
    use wgrad::parallel::physical_adapters;
    let report =
        |index: usize, name: &str, backend: wgpu::Backend, device_type: wgpu::DeviceType, device: u32| AdapterReport {
            index,
            info: wgpu::AdapterInfo {
                name: name.into(),
                vendor: if device == 0 { 0 } else { 0x10de },
                device,
                ..wgpu::AdapterInfo::new(device_type, backend)
            },
            limits: wgpu::Limits::default(),
            features: wgpu::Features::empty(),
        };
    use wgpu::{Backend::*, DeviceType::*};
    // One NVIDIA GPU listed by GL and Vulkan, a second one by Vulkan, and
    // lavapipe: the two GPUs through Vulkan, in policy order.
    let machine = [
        report(0, "NVIDIA H200 (GL)", Gl, DiscreteGpu, 0x2335),
        report(1, "llvmpipe", Vulkan, Cpu, 0),
        report(2, "NVIDIA H200", Vulkan, DiscreteGpu, 0x2335),
        report(3, "NVIDIA L4", Vulkan, DiscreteGpu, 0x27b8),
    ];
    assert_eq!(physical_adapters(&machine), [2, 3]);
    // Without a GPU every software adapter is a device of its own.
    let cpu_only = [
        report(0, "llvmpipe", Vulkan, Cpu, 0),
        report(1, "llvmpipe", Gl, Cpu, 0),
        report(2, "SwiftShader", Vulkan, Cpu, 0),
    ];
    assert_eq!(physical_adapters(&cpu_only), [0, 2, 1]);
}

/// Two devices on one adapter (the first the tests use), one opened with
/// the adapter's own limits and one with WebGPU's defaults: two storage
/// offset alignments where the adapter's is under 256 B (32 B on lavapipe
/// and llvmpipe-GL), as a group of two kinds of adapter has, on any
/// machine with one adapter. `None` (skipped or failed as `common`
/// says) without an adapter.
pub(crate) fn mixed_limits_group(test: &str) -> Option<(DeviceGroup, Option<wgrad::device::GlGuard>)> {
    if !common::any_adapter(test) {
        return None;
    }
    let gl = common::lock_gl_if_any();
    let index = common::reports()[0].index;
    let open = |mode: wgrad::LimitsMode| {
        let opts = wgrad::DeviceOptions {
            backends: None,
            adapter: Some(index.to_string()),
            limits: Some(mode),
            ..Default::default()
        };
        std::sync::Arc::new(wgrad::Kernels::new(wgrad::Device::open(&opts).unwrap()))
    };
    let group =
        DeviceGroup::from_kernels(vec![open(wgrad::LimitsMode::Adapter), open(wgrad::LimitsMode::WebGpu)]).unwrap();
    let aligns: Vec<u32> = group
        .members()
        .iter()
        .map(|k| k.device().limits().min_storage_buffer_offset_alignment)
        .collect();
    eprintln!(
        "{test}: {} with storage offset alignments {aligns:?} B",
        group.members()[0].device().label()
    );
    Some((group, gl))
}

/// Data parallel over devices whose own arena layouts differ (see
/// [`mixed_limits_group`]): every replica lays its arenas out at the
/// group's alignment, so the all-reduce, the synchronisation and a
/// re-split work, and training matches one device as on any group.
#[test]
fn data_parallel_across_different_limits_matches_single_device_training() {
    const GLOBAL: usize = 16;
    const STEPS: u64 = 8;
    let test = "data_parallel_across_different_limits_matches_single_device_training";
    let Some((group, _gl)) = mixed_limits_group(test) else {
        return;
    };
    let want = single_device_reference(&group.members()[0], &model(), GLOBAL, STEPS);
    // The devices' own layouts differ where their alignments do.
    let own: Vec<usize> = group
        .members()
        .iter()
        .map(|k| {
            Trainer::new(k.clone(), &model(), CrossEntropyLoss, optimizer(), 4)
                .unwrap()
                .executor()
                .plan()
                .param_arena_len
        })
        .collect();
    eprintln!("{test}: parameter arenas at each device's own alignment: {own:?} elements");
    for split in [Split::Rows(vec![5, GLOBAL - 5]), Split::Measured { every: 3 }] {
        let mut dp = DataParallel::new(&group, &model(), CrossEntropyLoss, optimizer(), GLOBAL, split.clone()).unwrap();
        for s in 0..STEPS {
            let (x, y) = batch(GLOBAL, s);
            let loss = dp.step(&x, Targets::Classes(&y), s == STEPS - 1).unwrap();
            assert!(loss.is_none_or(|l| l.is_finite() && l > 0.0));
        }
        assert_eq!(dp.arena_alignment(), 256);
        let lens: Vec<usize> = dp
            .replicas()
            .iter()
            .map(|t| t.executor().plan().param_arena_len)
            .collect();
        assert!(lens.iter().all(|&l| l == lens[0]), "one layout for the group: {lens:?}");
        let replicas: Vec<_> = dp
            .replicas()
            .iter()
            .map(|t| t.executor().parameters().unwrap())
            .collect();
        for (r, got) in replicas.iter().enumerate() {
            assert_same_parameters(&format!("replica {r} with {split:?}"), got, &want);
        }
        // One adapter, the same gradients and the same update: bit for bit.
        let bits = |p: &[(String, Vec<usize>, Vec<f32>)]| -> Vec<Vec<u32>> {
            p.iter()
                .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&replicas[1]), bits(&replicas[0]), "replicas with {split:?}");
        dp.synchronise().unwrap();
        assert_eq!(
            bits(&dp.replicas()[1].executor().parameters().unwrap()),
            bits(&replicas[0]),
            "after synchronise"
        );
    }
    // The distributed engine's path: a re-split rebuilds every replica.
    let mut ddp = DistributedDataParallel::new(
        std::sync::Arc::new(SingleProcess),
        &group,
        &model(),
        CrossEntropyLoss,
        optimizer(),
        GLOBAL,
        None,
    )
    .unwrap();
    for s in 0..STEPS {
        if s == 4 {
            ddp.local_mut().set_global_batch(GLOBAL - 3).unwrap();
            ddp.local_mut().set_global_batch(GLOBAL).unwrap();
        }
        let (x, y) = batch(GLOBAL, s);
        ddp.step(&x, Targets::Classes(&y), false).unwrap();
    }
    for (r, replica) in ddp.local().replicas().iter().enumerate() {
        assert_same_parameters(
            &format!("distributed replica {r}"),
            &replica.executor().parameters().unwrap(),
            &want,
        );
    }
}

/// The MLP's pipeline and tensor parallel against single-device training
/// with what the GPT's get: 10 AdamW steps with weight decay and a
/// gradient clip every step hits (clipped by the whole model's norm);
/// and each engine's checkpoint from halfway resumes on the other to the
/// uninterrupted run.
#[test]
fn mlp_pipeline_and_tensor_parallel_clip_and_resume_as_one_device() {
    use wgrad::io::gpt_folder::OptimizerState;
    use wgrad::kernels::OptimizerConfig;
    const BATCH: usize = 12;
    const STEPS: u64 = 10;
    const HALF: u64 = STEPS / 2;
    /// Below every step's gradient norm here (asserted).
    const CLIP: f32 = 0.1;
    let adamw = || -> OptimizerConfig {
        wgrad::optim::AdamW::new(1e-2)
            .weight_decay(0.1)
            .decay_matrices_only()
            .clip_grad_norm(CLIP)
            .into()
    };
    nn::manual_seed(43);
    // Two Linear pairs for tensor parallel (two all-reduces), four blocks
    // for the pipeline.
    let m = Sequential::mlp(&[IN, 14, 9, 11, CLASSES], Layer::Tanh).unwrap();
    let resume_state = |ckpt: &wgrad::io::checkpoint::Checkpoint| {
        let state = OptimizerState::from_checkpoint(ckpt).unwrap();
        let params: Vec<(String, Vec<usize>, Vec<f32>)> = ckpt
            .tensors
            .iter()
            .filter(|t| !t.name.starts_with("optim."))
            .map(|t| (t.name.clone(), t.shape.clone(), t.data.clone()))
            .collect();
        (params, state)
    };
    for group in groups("mlp_pipeline_and_tensor_parallel_clip_and_resume_as_one_device") {
        let labels = group.labels().join(", ");
        let mut single = Trainer::new(group.members()[0].clone(), &m, CrossEntropyLoss, adamw(), BATCH).unwrap();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let (x, y) = batch(BATCH, 500 + s);
            single.zero_grad();
            single.forward(&x).unwrap();
            single.loss(Targets::Classes(&y)).unwrap();
            single.backward().unwrap();
            losses.push(single.step_reading_loss().unwrap());
            norms.push(single.executor().read_grad_norm().unwrap().unwrap());
        }
        assert!(norms.iter().all(|&n| n > CLIP), "every step clips: {norms:?}");
        let want = single.executor().parameters().unwrap();

        let mut p = Pipeline::new(&group, &m, CrossEntropyLoss, adamw(), BATCH, 3, Schedule::OneFOneB).unwrap();
        let mut tp = TensorParallel::new(&group, &m, CrossEntropyLoss, adamw(), BATCH).unwrap();
        let (mut p_half, mut tp_half) = (None, None);
        for s in 0..STEPS {
            let (x, y) = batch(BATCH, 500 + s);
            let i = s as usize;
            let p_loss = p.step(&x, Targets::Classes(&y), true).unwrap().unwrap();
            let tp_loss = tp.step(&x, Targets::Classes(&y), true).unwrap().unwrap();
            // The loss (about 1.4) and the norm summed per micro-batch or
            // per device, in another order: relative 1e-5.
            assert_close(
                &format!("pipeline loss of step {s} on [{labels}]"),
                &[p_loss],
                &[losses[i]],
                0.0,
                1e-5,
            );
            assert_close(
                &format!("tensor loss of step {s} on [{labels}]"),
                &[tp_loss],
                &[losses[i]],
                0.0,
                1e-5,
            );
            assert_close(
                &format!("pipeline norm of step {s} on [{labels}]"),
                &[p.stats().last_grad_norm.unwrap()],
                &[norms[i]],
                0.0,
                1e-5,
            );
            assert_close(
                &format!("tensor norm of step {s} on [{labels}]"),
                &[tp.last_grad_norm().unwrap()],
                &[norms[i]],
                0.0,
                1e-5,
            );
            if s + 1 == HALF {
                p_half = Some(p.checkpoint().unwrap());
                tp_half = Some(tp.checkpoint().unwrap());
            }
        }
        assert_same_parameters(
            &format!("clipped AdamW pipeline on [{labels}]"),
            &p.parameters().unwrap(),
            &want,
        );
        assert_same_parameters(
            &format!("clipped AdamW tensor on [{labels}]"),
            &tp.parameters().unwrap(),
            &want,
        );

        // The pipeline's halfway checkpoint on tensor parallel, and the
        // other way round.
        let (params, state) = resume_state(&p_half.unwrap());
        assert_eq!(state.step, HALF);
        let mut tp2 = TensorParallel::new(&group, &m, CrossEntropyLoss, adamw(), BATCH).unwrap();
        tp2.load_state(&params, &state.state, Some(state.step)).unwrap();
        let (params, state) = resume_state(&tp_half.unwrap());
        let mut p2 = Pipeline::new(&group, &m, CrossEntropyLoss, adamw(), BATCH, 2, Schedule::GPipe).unwrap();
        p2.load_state(&params, &state.state, Some(state.step)).unwrap();
        for s in HALF..STEPS {
            let (x, y) = batch(BATCH, 500 + s);
            tp2.step(&x, Targets::Classes(&y), false).unwrap();
            p2.step(&x, Targets::Classes(&y), false).unwrap();
        }
        assert_eq!((tp2.step_count(), p2.step_count()), (STEPS, STEPS));
        assert_same_parameters(
            &format!("pipeline resumed on tensor parallel [{labels}]"),
            &tp2.parameters().unwrap(),
            &want,
        );
        assert_same_parameters(
            &format!("tensor parallel resumed on a pipeline [{labels}]"),
            &p2.parameters().unwrap(),
            &want,
        );
    }
}
