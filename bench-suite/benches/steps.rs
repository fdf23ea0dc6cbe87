//! Whole training steps, built by `wgrad_benches::StepCase` exactly as
//! `wgrad bench` builds them:
//!
//! - `mlp`: 784-512-512-10 ReLU MLP, cross-entropy, Adam, batch 256,
//!   seeded random data;
//! - `linear`: Linear(10, 1), MSE, SGD(0.01), batch 64;
//!
//! each on one device (`single`) and data-parallel on two devices (`data2`:
//! `DeviceSelection::Count(2)`, on a CPU-only machine lavapipe + llvmpipe-GL;
//! the split is measured once at construction and then kept, so every timed
//! step does the same work). The single-device case runs on the group's
//! first device, so the two figures compare the same model on the same
//! adapter. Both adapters share the machine's cores: on a CPU-only machine
//! `data2` shows the cost of splitting and all-reducing, not a speed-up.
//!
//! One iteration is a full step (zero_grad, forward, loss, backward,
//! optimizer update) followed by waiting until every device is idle.
//! Criterion reports samples (batch rows) per second.
//!
//! No adapter: prints why and exits successfully; only one device: the
//! data-parallel cases are reported as skipped.
//!
//! Run: `LP_NUM_THREADS=2 cargo bench -p wgrad-benches --bench steps` (a few minutes on 2
//! cores; the GL adapter compiles its shaders at the first step).

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::Trainer;
use wgrad_benches::{train_step, StepCase};

/// Steps before timing: pipelines compile (lazily on GL) and buffers settle.
const WARM_UP_STEPS: usize = 3;

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "n/a".into())
}

fn wait_all(group: &DeviceGroup) {
    for k in group.members() {
        k.device().wait_idle("bench steps").expect("wait");
    }
}

fn single(criterion: &mut Criterion, case: &StepCase, group: &DeviceGroup, short: &str) {
    let kernels = &group.members()[0];
    let mut trainer: Trainer = case.trainer(kernels).expect("build trainer");
    let targets = case.targets();
    let mut step = || {
        train_step(&mut trainer, &case.x, targets).expect("step");
        kernels.device().wait_idle("bench steps").expect("wait");
    };
    for _ in 0..WARM_UP_STEPS {
        step();
    }
    let mut bench_group = criterion.benchmark_group(format!("step_{short}"));
    bench_group
        .sampling_mode(SamplingMode::Flat)
        .throughput(Throughput::Elements(case.batch as u64));
    bench_group.bench_function(BenchmarkId::new("single", 1), |b| b.iter(&mut step));
    bench_group.finish();
    println!(
        "steps {short} single: {} on {}, {} dispatches per step",
        case.name,
        kernels.device().label(),
        trainer.executor().dispatches_per_step()
    );
}

fn data_parallel(criterion: &mut Criterion, case: &StepCase, group: &DeviceGroup, short: &str) {
    // `every: 0` measures each device once here and never re-splits, so
    // the timed steps all do the same work.
    let mut engine: DataParallel = match case.data_parallel(group, Split::Measured { every: 0 }) {
        Ok(e) => e,
        Err(e) => {
            println!("steps {short} data2 skipped: {e}");
            return;
        }
    };
    let targets = case.targets();
    let mut step = || {
        engine.step(&case.x, targets, false).expect("data-parallel step");
        wait_all(group);
    };
    for _ in 0..WARM_UP_STEPS {
        step();
    }
    let mut bench_group = criterion.benchmark_group(format!("step_{short}"));
    bench_group
        .sampling_mode(SamplingMode::Flat)
        .throughput(Throughput::Elements(case.batch as u64));
    bench_group.bench_function(BenchmarkId::new("data", group.len()), |b| b.iter(&mut step));
    bench_group.finish();
    let stats = engine.stats();
    let comm_share = stats.communication.as_secs_f64()
        / (stats.compute + stats.communication)
            .as_secs_f64()
            .max(f64::MIN_POSITIVE);
    println!(
        "steps {short} data{}: rows per device {:?} on {}, communication share {comm_share:.2} over {} steps",
        group.len(),
        engine.shares(),
        group.labels().join(" + "),
        stats.steps
    );
}

fn main() {
    if wgrad::device::list_adapters().is_empty() {
        println!("steps bench skipped: wgpu found no adapter (no Vulkan, Metal, DX12 or GL driver)");
        return;
    }
    println!(
        "steps bench, LP_NUM_THREADS={}, load average {}",
        std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        load_average()
    );
    let pair = match DeviceGroup::open(&DeviceSelection::Count(2)) {
        Ok(g) => Some(g),
        Err(e) => {
            println!("steps bench: cannot open two devices ({e}); data-parallel cases skipped");
            None
        }
    };
    let first = match &pair {
        Some(g) => DeviceGroup::from_kernels(vec![g.members()[0].clone()]),
        None => DeviceGroup::open(&DeviceSelection::Count(1)),
    };
    let first = match first {
        Ok(g) => g,
        Err(e) => {
            println!("steps bench skipped: cannot open a device ({e})");
            return;
        }
    };

    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .without_plots()
        .configure_from_args();
    let cases = [
        (StepCase::mlp().expect("MLP case"), "mlp"),
        (StepCase::linear(), "linear"),
    ];
    for (case, short) in &cases {
        single(&mut criterion, case, &first, short);
        if let Some(pair) = &pair {
            data_parallel(&mut criterion, case, pair, short);
        }
    }
    criterion.final_summary();
    println!("steps bench done, load average now {}", load_average());
}
