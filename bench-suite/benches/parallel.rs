//! Step time of each multi-device strategy against one device, for the
//! digits-sized MLP `Linear(64, 128) ReLU Linear(128, 10)` at batch 64 on
//! seeded random data (Adam, cross-entropy):
//!
//! - `single`: one device, a plain `Trainer` (devices = 1);
//! - `data`: `DataParallel`, split measured (as `wgrad train --parallel data`);
//! - `pipeline`: `Pipeline` with 4 micro-batches (a 2-Linear model fills at
//!   most 2 stages, so 3 devices are reported as skipped);
//! - `tensor`: `TensorParallel` over the hidden layer;
//!
//! each on 1, 2 and 3 devices (`DeviceSelection::Count`; on a CPU-only
//! machine: lavapipe, llvmpipe-GL, then lavapipe again). One measured step
//! is the engine's `step` followed by waiting until every device is idle,
//! so work queued behind the step (the optimizer update) is counted.
//!
//! Besides criterion's output, a separate timed run of each case prints
//!
//! ```text
//! bench parallel strategy=data devices=2 ms_per_step=3.71 comm_share=0.16
//! ```
//!
//! where `comm_share` is the share of step time spent moving data between
//! devices, from the engine's own stats over that run:
//! `DataParallelStats.communication / (compute + communication)`,
//! `PipelineStats.communication / wall`, `TensorParallelStats.communication
//! / wall` (0 for a single device). All lines are repeated at the end.
//!
//! Then the GPT `wgrad train --model gpt` trains by default (L4 H4 C128
//! T64, batch 8, 65 characters; AdamW with clipping) on one device (a
//! `Trainer`) against `Pipeline` on 2 devices (the Vulkan and the GL
//! adapter) with GPipe and 1F1B over 4 and 8 micro-batches, timed by hand
//! (a step takes about a second on a software adapter, too long for
//! criterion's samples):
//!
//! ```text
//! bench parallel gpt=pipeline devices=2 schedule=1F1B micro=4 ms_per_step=… busy_ms=[…] bubble=… ideal_bubble=0.20 comm_share=… blocks=[2,2] peak_in_flight=[2,1] peak_stash_kib=[…] gpu_mib=[…]
//! ```
//!
//! `busy_ms` is each stage's time per step from its ticks' starts until its
//! results arrived, `bubble` the measured idle share of the stages, `ideal_bubble`
//! (S−1)/(M+S−1); `peak_in_flight` the most micro-batches each stage held
//! for its backward, and `peak_stash_kib` the host memory that took.
//!
//! And the same GPT (vocabulary 84 as in `wgrad bench`) on one device
//! (`Trainer`) against `TensorParallel` on 2 (`DeviceSelection::Count(2)`: lavapipe and
//! llvmpipe-GL), timed by the same loop (no criterion: a step takes most of
//! a second on a CPU adapter), printing
//!
//! ```text
//! bench parallel model=gpt strategy=tensor devices=2 ms_per_step=… comm_share=… heads=[2,2] host_mb_per_step=…
//! ```
//!
//! where `comm_share` is `TensorParallelStats.communication / wall` and
//! `host_mb_per_step` what one step moves through the host
//! (`TensorParallel::floats_moved_per_step`).
//!
//! Then data parallel on the same 2 devices with 8 rows per device (weak
//! scaling), split evenly and as measured:
//!
//! ```text
//! bench parallel model=gpt strategy=data split=even devices=2 rows=[8,8] ms_per_step=… single_ms_per_step=… weak_scaling_efficiency=… comm_share=…
//! ```
//!
//! where `weak_scaling_efficiency` is the first device's step time alone
//! at 8 rows over this step time, both the median of steps timed in turns
//! (one alone, one data-parallel, …) so that the machine's drifting speed
//! hits both alike, and `comm_share` is
//! `DataParallelStats.communication / (compute + communication)`.
//!
//! And ZeRO-3 on `wgrad train --model llama`'s Llama (preset `small`,
//! vocabulary 84, batch 8) over 2 devices, the whole-arena engine
//! (`Zero`, one submission per step; the MPI path's) against the
//! stage-by-stage one (`ZeroStages`, gathers before each stage):
//!
//! ```text
//! bench parallel model=llama strategy=zero-3 engine=by-stage devices=2 ms_per_step=… gpu_mib=…
//! ```
//!
//! where `gpu_mib` is the fullest device's `TrainEngine::memory` total.
//!
//! Environment:
//! - `WGRAD_BENCH_QUICK=1`: devices 1 and 2 only, shorter measurements.
//! - `WGRAD_BENCH_PARALLEL=mlp`, `gpt` or `zero`: only those cases.
//! - `LP_NUM_THREADS`: llvmpipe/lavapipe worker threads.
//!
//! Run: `cargo bench -p wgrad-benches --bench parallel` (a few minutes on 2 cores).

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::{Adam, AdamW, LrSchedule};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{Pipeline, Schedule};
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::train::{language_model_run, MAKE_TRAIN_GPT};
use wgrad::{Targets, Trainer};

const BATCH: usize = 64;
const FEATURES: usize = 64;
const CLASSES: usize = 10;
const MICRO_BATCHES: usize = 4;

fn quick() -> bool {
    std::env::var("WGRAD_BENCH_QUICK")
        .map(|v| !v.trim().is_empty() && v.trim() != "0")
        .unwrap_or(false)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "n/a".into())
}

/// One strategy, built and ready to step.
enum Runner {
    Single(Box<Trainer>),
    Data(Box<DataParallel>),
    Pipeline(Box<Pipeline>),
    Tensor(Box<TensorParallel>),
}

/// (communication, whole step) seconds accumulated so far by the engine.
fn time_split(runner: &Runner) -> (f64, f64) {
    match runner {
        Runner::Single(_) => (0.0, 0.0),
        Runner::Data(d) => {
            let s = d.stats();
            (
                s.communication.as_secs_f64(),
                (s.compute + s.communication).as_secs_f64(),
            )
        }
        Runner::Pipeline(p) => (p.stats().communication.as_secs_f64(), p.stats().wall.as_secs_f64()),
        Runner::Tensor(t) => (t.stats().communication.as_secs_f64(), t.stats().wall.as_secs_f64()),
    }
}

impl Runner {
    fn new(strategy: &str, group: &DeviceGroup, model: &Sequential) -> wgrad::Result<Self> {
        let opt = Adam::new(2e-3);
        Ok(match strategy {
            "single" => Runner::Single(Box::new(Trainer::new(
                group.members()[0].clone(),
                model,
                CrossEntropyLoss,
                opt,
                BATCH,
            )?)),
            "data" => Runner::Data(Box::new(DataParallel::new(
                group,
                model,
                CrossEntropyLoss,
                opt,
                BATCH,
                Split::Measured { every: 20 },
            )?)),
            "pipeline" => Runner::Pipeline(Box::new(Pipeline::new(
                group,
                model,
                CrossEntropyLoss,
                opt,
                BATCH,
                MICRO_BATCHES,
                Schedule::GPipe,
            )?)),
            "tensor" => Runner::Tensor(Box::new(TensorParallel::new(
                group,
                model,
                CrossEntropyLoss,
                opt,
                BATCH,
            )?)),
            other => unreachable!("unknown strategy {other}"),
        })
    }

    /// One training step, then wait until every device of `group` is idle.
    fn step(&mut self, group: &DeviceGroup, x: &[f32], y: &[u32]) -> wgrad::Result<()> {
        let targets = Targets::Classes(y);
        match self {
            Runner::Single(t) => {
                t.zero_grad();
                t.forward(x)?;
                t.loss(targets)?;
                t.backward()?;
                t.step()?;
            }
            Runner::Data(d) => {
                d.step(x, targets, false)?;
            }
            Runner::Pipeline(p) => {
                p.step(x, targets, false)?;
            }
            Runner::Tensor(t) => {
                t.step(x, targets, false)?;
            }
        }
        for k in group.members() {
            k.device().wait_idle("bench parallel")?;
        }
        Ok(())
    }

    /// What the strategy chose, for the summary line.
    fn detail(&self) -> String {
        match self {
            Runner::Single(_) => String::new(),
            Runner::Data(d) => format!(" split={:?} resplits={}", d.shares(), d.stats().resplits).replace(", ", ","),
            Runner::Pipeline(p) => format!(
                " layers={:?} bubble={:.2} ideal_bubble={:.2}",
                p.blocks_per_stage(),
                p.measured_bubble_fraction(),
                p.ideal_bubble_fraction()
            )
            .replace(", ", ","),
            Runner::Tensor(t) => format!(" split={:?}", t.slices("0.weight")).replace(", ", ","),
        }
    }
}

/// The part `WGRAD_BENCH_PARALLEL` selects (`mlp`, `gpt`), or both.
fn runs(part: &str) -> bool {
    std::env::var("WGRAD_BENCH_PARALLEL")
        .map(|v| v.trim().is_empty() || v.trim().eq_ignore_ascii_case(part))
        .unwrap_or(true)
}

/// Waits until every device of `group` is idle.
fn wait_all(group: &DeviceGroup) -> wgrad::Result<()> {
    for k in group.members() {
        k.device().wait_idle("bench parallel gpt")?;
    }
    Ok(())
}

/// Mean milliseconds of `timed` calls of `step` after `warm_up` (which
/// compile the pipelines).
/// The middle value of `values` (the mean of the middle two when even).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn time_steps(warm_up: usize, timed: usize, mut step: impl FnMut() -> wgrad::Result<()>) -> wgrad::Result<f64> {
    for _ in 0..warm_up {
        step()?;
    }
    let start = Instant::now();
    for _ in 0..timed {
        step()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / timed as f64)
}

/// The default GPT on one device and as a 2-stage pipeline.
fn gpt_cases(quick: bool, lines: &mut Vec<String>) -> wgrad::Result<()> {
    let config = GptConfig {
        vocab_size: 65,
        ..MAKE_TRAIN_GPT
    };
    let run = language_model_run();
    let batch = run.batch_size;
    let (warm_up, timed) = if quick { (2, 3) } else { (2, 8) };
    let mut rng = ChaCha8Rng::seed_from_u64(0x9e7);
    let tokens = batch * config.block_size;
    let ids: Vec<u32> = (0..tokens)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let targets: Vec<u32> = (0..tokens)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    nn::manual_seed(0);
    let model = Gpt::new(config)?;
    println!(
        "\nGPT L{} H{} C{} T{} batch {batch}, vocab {}: one device, then a 2-stage pipeline",
        config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size
    );

    let one = DeviceGroup::open(&DeviceSelection::Count(1))?;
    let mut trainer = Trainer::new(one.members()[0].clone(), &model, CrossEntropyLoss, run.optimizer, batch)?;
    let ms = time_steps(warm_up, timed, || {
        trainer.zero_grad();
        trainer.forward_ids(&ids)?;
        trainer.loss(Targets::Classes(&targets))?;
        trainer.backward()?;
        trainer.step()?;
        wait_all(&one)
    })?;
    let line = format!(
        "bench parallel gpt=single devices=1 ms_per_step={ms:.0} device=\"{}\"",
        one.labels().join(", ")
    );
    println!("{line}");
    lines.push(line);
    drop(trainer);
    drop(one);

    let two = DeviceGroup::open(&DeviceSelection::Count(2))?;
    println!("2 devices: {}", two.labels().join(", "));
    for micro in [4, 8] {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut p = Pipeline::new(&two, &model, CrossEntropyLoss, run.optimizer, batch, micro, schedule)?;
            time_steps(warm_up, 0, || {
                p.step(&ids, Targets::Classes(&targets), false).map(|_| ())
            })?;
            p.reset_stats();
            let ms = time_steps(0, timed, || {
                p.step(&ids, Targets::Classes(&targets), false)?;
                wait_all(&two)
            })?;
            let stats = p.stats();
            let kib: Vec<String> = stats
                .peak_stash_bytes
                .iter()
                .map(|b| format!("{:.0}", *b as f64 / 1024.0))
                .collect();
            let mib: Vec<String> = p
                .stage_gpu_bytes()
                .iter()
                .map(|b| format!("{:.1}", *b as f64 / (1024.0 * 1024.0)))
                .collect();
            let busy: Vec<String> = stats
                .busy
                .iter()
                .map(|b| format!("{:.0}", b.as_secs_f64() * 1e3 / timed as f64))
                .collect();
            let line = format!(
                "bench parallel gpt=pipeline devices=2 schedule={schedule} micro={micro} ms_per_step={ms:.0} busy_ms=[{}] bubble={:.2} ideal_bubble={:.2} comm_share={:.2} blocks={:?} peak_in_flight={:?} peak_stash_kib=[{}] gpu_mib=[{}]",
                busy.join(","),
                p.measured_bubble_fraction(),
                p.ideal_bubble_fraction(),
                p.communication_share(),
                p.blocks_per_stage(),
                stats.peak_in_flight,
                kib.join(","),
                mib.join(",")
            )
            .replace(", ", ",");
            println!("{line}");
            lines.push(line);
        }
    }
    Ok(())
}

fn main() {
    if wgrad::device::list_adapters().is_empty() {
        println!("parallel bench skipped: wgpu found no adapter (no Vulkan, Metal, DX12 or GL driver)");
        return;
    }
    let quick = quick();
    if !runs("mlp") {
        let mut lines = Vec::new();
        if runs("gpt") {
            if let Err(e) = gpt_cases(quick, &mut lines) {
                println!("bench parallel gpt failed: {e}");
            }
            lines.extend(gpt_tensor_lines(quick));
        }
        if runs("zero") {
            lines.extend(zero3_lines(quick));
        }
        println!("\nsummary (load average now {}):", load_average());
        for line in &lines {
            println!("{line}");
        }
        return;
    }
    let (warm_up, measure, timed_steps, settle_steps) = if quick {
        (Duration::from_millis(200), Duration::from_millis(600), 20, 10)
    } else {
        (Duration::from_millis(500), Duration::from_secs(2), 100, 40)
    };
    let counts: &[usize] = match (runs("mlp"), quick) {
        (false, _) => &[],
        (true, true) => &[1, 2],
        (true, false) => &[1, 2, 3],
    };
    println!(
        "parallel bench: MLP 64-128-10, batch {BATCH}, LP_NUM_THREADS={}, load average {}{}",
        std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        load_average(),
        if quick { ", quick mode" } else { "" }
    );

    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let x: Vec<f32> = (0..BATCH * FEATURES).map(|_| rng.random_range(0.0f32..1.0)).collect();
    let y: Vec<u32> = (0..BATCH).map(|_| rng.random_range(0..CLASSES as u32)).collect();
    nn::manual_seed(0);
    let model = Sequential::mlp(&[FEATURES, 128, CLASSES], Layer::ReLU).expect("model");

    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(warm_up)
        .measurement_time(measure)
        .without_plots()
        .configure_from_args();
    let mut lines = Vec::new();

    for &devices in counts {
        let group = match DeviceGroup::open(&DeviceSelection::Count(devices)) {
            Ok(g) => g,
            Err(e) => {
                let line = format!("bench parallel devices={devices} skipped: cannot open the devices ({e})");
                println!("{line}");
                lines.push(line);
                continue;
            }
        };
        println!("\n{devices} device(s): {}", group.labels().join(", "));
        let mut bench_group = criterion.benchmark_group(format!("parallel_{devices}dev"));
        bench_group.sample_size(10).sampling_mode(SamplingMode::Flat);
        let strategies: &[&str] = if devices == 1 {
            &["single", "data", "pipeline", "tensor"]
        } else {
            &["data", "pipeline", "tensor"]
        };
        for &strategy in strategies {
            let mut runner = match Runner::new(strategy, &group, &model) {
                Ok(r) => r,
                Err(e) => {
                    let line = format!("bench parallel strategy={strategy} devices={devices} skipped: {e}");
                    println!("{line}");
                    lines.push(line);
                    continue;
                }
            };
            // Compile pipelines and let a measured data-parallel split settle.
            for _ in 0..settle_steps {
                runner.step(&group, &x, &y).expect("warm-up step");
            }
            bench_group.bench_function(BenchmarkId::new(strategy, devices), |b| {
                b.iter(|| runner.step(&group, &x, &y).expect("step"))
            });

            // Own timing, with the engine's stats over the same steps.
            let (comm0, whole0) = time_split(&runner);
            let start = Instant::now();
            for _ in 0..timed_steps {
                runner.step(&group, &x, &y).expect("timed step");
            }
            let ms = start.elapsed().as_secs_f64() * 1e3 / timed_steps as f64;
            let (comm1, whole1) = time_split(&runner);
            let share = if whole1 > whole0 {
                (comm1 - comm0) / (whole1 - whole0)
            } else {
                0.0
            };
            let line = format!(
                "bench parallel strategy={strategy} devices={devices} ms_per_step={ms:.2} comm_share={share:.2}{}",
                runner.detail()
            );
            println!("{line}");
            lines.push(line);
        }
        bench_group.finish();
    }
    criterion.final_summary();
    if runs("gpt") {
        if let Err(e) = gpt_cases(quick, &mut lines) {
            let line = format!("bench parallel gpt failed: {e}");
            println!("{line}");
            lines.push(line);
        }
        lines.extend(gpt_tensor_lines(quick));
    }
    if runs("zero") {
        lines.extend(zero3_lines(quick));
    }

    println!("\nsummary (load average now {}):", load_average());
    for line in &lines {
        println!("{line}");
    }
}

/// `make train`'s GPT: L4 H4 C128 T64, the char-level vocabulary's 84
/// rows as in `wgrad bench`, batch 8.
const GPT: GptConfig = GptConfig {
    vocab_size: 84,
    block_size: 64,
    n_layer: 4,
    n_head: 4,
    n_embd: 128,
};
const GPT_BATCH: usize = 8;

/// The GPT on one device against tensor parallel on two; one line each.
fn gpt_tensor_lines(quick: bool) -> Vec<String> {
    let (warm_up, timed) = if quick { (2, 5) } else { (3, 20) };
    let optimizer = AdamW::new(3e-3)
        .betas(0.9, 0.99)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(1.0)
        .schedule(LrSchedule::WarmupCosine {
            warmup_steps: 5,
            total_steps: 1000,
            min_lr: 3e-4,
        });
    let tokens = GPT_BATCH * GPT.block_size;
    let mut rng = ChaCha8Rng::seed_from_u64(0x6e7);
    let stream: Vec<u32> = (0..tokens + 1)
        .map(|_| rng.random_range(0..GPT.vocab_size as u32))
        .collect();
    let (x, y) = (&stream[..tokens], &stream[1..]);
    nn::manual_seed(0);
    let model = Gpt::new(GPT).expect("GPT");
    let config = format!(
        "L{}-H{}-C{}-T{}-V{}-B{GPT_BATCH}",
        GPT.n_layer, GPT.n_head, GPT.n_embd, GPT.block_size, GPT.vocab_size
    );
    println!("\nGPT {config}, {timed} timed steps after {warm_up}");
    let mut lines = Vec::new();
    let mut report = |line: String| {
        println!("{line}");
        lines.push(line);
    };

    match DeviceGroup::open(&DeviceSelection::Count(1)).and_then(|group| {
        let k = group.members()[0].clone();
        let mut trainer = Trainer::new(k.clone(), &model, CrossEntropyLoss, optimizer, GPT_BATCH)?;
        let mut step = || -> wgrad::Result<()> {
            trainer.zero_grad();
            trainer.forward_ids(x)?;
            trainer.loss(Targets::Classes(y))?;
            trainer.backward()?;
            trainer.step()?;
            k.device().wait_idle("bench parallel gpt")
        };
        for _ in 0..warm_up {
            step()?;
        }
        let start = Instant::now();
        for _ in 0..timed {
            step()?;
        }
        Ok((group.labels(), start.elapsed().as_secs_f64() * 1e3 / timed as f64))
    }) {
        Ok((labels, ms)) => {
            report(format!(
                "bench parallel model=gpt strategy=single devices=1 ms_per_step={ms:.1} comm_share=0.00 config={config} device={}",
                labels.join(",").replace(' ', "_")
            ))
        }
        Err(e) => report(format!("bench parallel model=gpt strategy=single devices=1 skipped: {e}")),
    }

    // Weak scaling: GPT_BATCH rows per device, split evenly and as measured.
    let weak_tokens = 2 * tokens;
    let weak_stream: Vec<u32> = (0..weak_tokens + 1)
        .map(|_| rng.random_range(0..GPT.vocab_size as u32))
        .collect();
    let (wx, wy) = (&weak_stream[..weak_tokens], &weak_stream[1..]);
    for (name, split) in [
        ("even", Split::Rows(vec![GPT_BATCH, GPT_BATCH])),
        ("measured", Split::Measured { every: 0 }),
    ] {
        match DeviceGroup::open(&DeviceSelection::Count(2)).and_then(|group| {
            let mut dp = DataParallel::new(&group, &model, CrossEntropyLoss, optimizer, 2 * GPT_BATCH, split)?;
            let step = |dp: &mut DataParallel| -> wgrad::Result<()> {
                dp.step(wx, Targets::Classes(wy), false)?;
                wait_all(&group)
            };
            // The one-device reference, GPT_BATCH rows on the group's first
            // device, timed in turns with the data-parallel step: the
            // machine's speed drifts between runs, so the efficiency is the
            // ratio of medians taken in the same moments.
            let first = group.members()[0].clone();
            let mut single = Trainer::new(first.clone(), &model, CrossEntropyLoss, optimizer, GPT_BATCH)?;
            let mut single_step = || -> wgrad::Result<()> {
                single.zero_grad();
                single.forward_ids(x)?;
                single.loss(Targets::Classes(y))?;
                single.backward()?;
                single.step()?;
                first.device().wait_idle("bench parallel gpt")
            };
            time_steps(warm_up, 0, &mut single_step)?;
            time_steps(warm_up, 0, || step(&mut dp))?;
            let (compute0, comm0) = (dp.stats().compute, dp.stats().communication);
            let (mut single_times, mut dp_times) = (Vec::new(), Vec::new());
            for _ in 0..timed.max(3) {
                single_times.push(time_steps(0, 1, &mut single_step)?);
                dp_times.push(time_steps(0, 1, || step(&mut dp))?);
            }
            let (compute, comm) = (dp.stats().compute - compute0, dp.stats().communication - comm0);
            let share = comm.as_secs_f64() / (compute + comm).as_secs_f64().max(1e-9);
            let (single_ms, ms) = (median(&mut single_times), median(&mut dp_times));
            // Weak-scaling efficiency: one device's step time at GPT_BATCH
            // rows over this step time at GPT_BATCH rows per device.
            let efficiency = single_ms / ms;
            Ok(format!(
                "bench parallel model=gpt strategy=data split={name} devices=2 rows={:?} ms_per_step={ms:.1} single_ms_per_step={single_ms:.1} weak_scaling_efficiency={efficiency:.2} comm_share={share:.2} config={config}",
                dp.shares()
            )
            .replace(", ", ","))
        }) {
            Ok(line) => report(line),
            Err(e) => report(format!("bench parallel model=gpt strategy=data split={name} devices=2 skipped: {e}")),
        }
    }

    match DeviceGroup::open(&DeviceSelection::Count(2)).and_then(|group| {
        let mut tp = TensorParallel::new(&group, &model, CrossEntropyLoss, optimizer, GPT_BATCH)?;
        let step = |tp: &mut TensorParallel| -> wgrad::Result<()> {
            tp.step(x, Targets::Classes(y), false)?;
            wait_all(&group)
        };
        time_steps(warm_up, 0, || step(&mut tp))?;
        let (comm0, wall0) = (tp.stats().communication, tp.stats().wall);
        let ms = time_steps(0, timed, || step(&mut tp))?;
        let share = (tp.stats().communication - comm0).as_secs_f64()
            / (tp.stats().wall - wall0).as_secs_f64().max(1e-9);
        println!("{}", tp.report());
        Ok(format!(
            "bench parallel model=gpt strategy=tensor devices=2 ms_per_step={ms:.1} comm_share={share:.2} split={:?} host_mb_per_step={:.1} config={config}",
            tp.slices("h.0.attn.c_proj.weight"),
            tp.floats_moved_per_step() as f64 * 4.0 / 1e6
        )
        .replace(", ", ","))
    }) {
        Ok(line) => report(line),
        Err(e) => report(format!("bench parallel model=gpt strategy=tensor devices=2 skipped: {e}")),
    }
    lines
}

/// ZeRO-3 on the default Llama over 2 devices: the whole-arena engine
/// against the stage-by-stage one; one line each.
fn zero3_lines(quick: bool) -> Vec<String> {
    use wgrad::models::{Llama, LlamaConfig};
    use wgrad::parallel::zero::{Zero, ZeroStage};
    use wgrad::parallel::zero_stages::ZeroStages;
    let (warm_up, timed) = if quick { (2, 5) } else { (3, 20) };
    let optimizer = AdamW::new(3e-3)
        .betas(0.9, 0.99)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(1.0);
    let run = || -> wgrad::Result<Vec<String>> {
        let config = LlamaConfig::preset("small", 84)?;
        let tokens = GPT_BATCH * config.block_size;
        let mut rng = ChaCha8Rng::seed_from_u64(0x2e3);
        let stream: Vec<u32> = (0..tokens + 1).map(|_| rng.random_range(0..84u32)).collect();
        let (x, y) = (&stream[..tokens], &stream[1..]);
        nn::manual_seed(0);
        let model = Llama::new(config)?;
        let group = DeviceGroup::open(&DeviceSelection::Count(2))?;
        let mut lines = Vec::new();
        let engines: [(&str, Box<dyn TrainEngine>); 2] = [
            (
                "whole-arena",
                Box::new(Zero::new(
                    &group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    GPT_BATCH,
                    ZeroStage::Parameters,
                    None,
                )?),
            ),
            (
                "by-stage",
                Box::new(ZeroStages::new(
                    &group,
                    &model,
                    CrossEntropyLoss,
                    optimizer,
                    GPT_BATCH,
                    ZeroStage::Parameters,
                    None,
                )?),
            ),
        ];
        for (name, mut engine) in engines {
            let ms = time_steps(warm_up, timed, || {
                engine.step(x.into(), Targets::Classes(y), false)?;
                wait_all(&group)
            })?;
            let mib = engine.memory().total() as f64 / (1024.0 * 1024.0);
            let line = format!("bench parallel model=llama strategy=zero-3 engine={name} devices=2 ms_per_step={ms:.1} gpu_mib={mib:.1}");
            println!("{line}");
            lines.push(line);
        }
        Ok(lines)
    };
    run().unwrap_or_else(|e| vec![format!("bench parallel zero-3 failed: {e}")])
}
