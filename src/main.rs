//! The `wgrad` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::data::{self, Dataset, Sampler};
use wgrad::kernels::{MatmulForm, OptimizerConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::{Adam, AdamW, SGD};
use wgrad::parallel::distributed::{DistributedDataParallel, ProcessGroup};
#[cfg(feature = "fault-injection")]
use wgrad::parallel::distributed::InjectedFailure;
use wgrad::parallel::engine::{Engine, Strategy};
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::trainer::{accuracy, Predictor, Targets};
use wgrad::{Device, DeviceOptions, Kernels};

#[derive(Parser)]
#[command(name = "wgrad", version, about = "Train and run neural networks on any GPU vendor through wgpu")]
struct Cli {
    /// Backend to search: vulkan, metal, dx12 or gl (default: all; env WGRAD_BACKEND).
    #[arg(long, global = true)]
    backend: Option<String>,
    /// Adapter index from `wgrad adapters`, or a name substring (env WGRAD_ADAPTER).
    #[arg(long, global = true)]
    adapter: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend with its limits and features.
    Adapters,
    /// Train an MLP classifier (default: the shipped UCI digits) and write a
    /// checkpoint and a loss-curve PNG.
    Train(Box<TrainArgs>),
    /// Load a checkpoint, predict the test split and report accuracy.
    Infer {
        #[arg(long, default_value = "out/digits.safetensors")]
        checkpoint: PathBuf,
        /// Read MNIST IDX files from this folder instead of the digits set.
        #[arg(long)]
        mnist: Option<PathBuf>,
        /// How many predictions to print.
        #[arg(long, default_value_t = 10)]
        show: usize,
    },
    /// Time every matmul kernel variant per form on this adapter, keep the
    /// fastest and cache the choice (see `wgrad::kernels::autotune`).
    Tune,
    /// Measure matmul GFLOPS (beside a CPU sgemm), the MLP and Linear(10,1)
    /// training steps on the chosen adapter; ends with `bench ...` lines.
    Bench {
        /// Fewer repetitions and sizes.
        #[arg(long)]
        quick: bool,
        /// Only the start-up costs: per-pipeline compile times and the
        /// digits MLP's build and first step (see `wgrad::bench::compile_times`).
        #[arg(long)]
        compile: bool,
    },
    /// Under mpirun: time the cross-process gradient all-reduce (f64 sums in
    /// the buckets training uses) for several gradient sizes; rank 0 prints
    /// a table. Needs a build with `--features mpi`.
    Allreduce {
        /// Gradient sizes in parameters.
        #[arg(long, value_delimiter = ',', default_value = "1000,16000,262144,1048576,4194304,16777216")]
        sizes: Vec<usize>,
        /// Timed repetitions per size after one warm-up.
        #[arg(long, default_value_t = 10)]
        reps: usize,
    },
    /// Multiply two random n×n matrices on the GPU, check the result against
    /// the CPU and print the speed.
    Matmul {
        #[arg(long, default_value_t = 512)]
        n: usize,
        /// Timed repetitions after one warm-up.
        #[arg(long, default_value_t = 5)]
        reps: usize,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OptimizerName {
    Adam,
    Adamw,
    Sgd,
}

#[derive(clap::Args)]
struct TrainArgs {
    #[arg(long, default_value_t = 40)]
    epochs: usize,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Hidden layer widths.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    hidden: Vec<usize>,
    #[arg(long, value_enum, default_value_t = OptimizerName::Adam)]
    optimizer: OptimizerName,
    #[arg(long, default_value_t = 2e-3)]
    lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Share of the data held out for testing.
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
    /// Read the loss back every this many steps (others never wait for the GPU).
    #[arg(long, default_value_t = 10)]
    loss_every: u64,
    #[arg(long, default_value = "out/digits.safetensors")]
    checkpoint: PathBuf,
    #[arg(long, default_value = "out/loss.png")]
    plot: PathBuf,
    /// Continue from this checkpoint (parameters, optimizer state, step).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Train on MNIST IDX files in this folder instead of the digits set.
    #[arg(long)]
    mnist: Option<PathBuf>,
    /// Spread training over several devices: data, pipeline or tensor.
    #[arg(long)]
    parallel: Option<String>,
    /// Devices for --parallel: a count, `all`, or adapter indexes like 0,1,1
    /// (env WGRAD_DEVICES; default 2).
    #[arg(long)]
    devices: Option<String>,
    /// Pipeline micro-batches per step.
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
    /// Data parallel: fixed rows per device (e.g. 24,8) instead of the
    /// measured split; with --distributed, rows per process.
    #[arg(long, value_delimiter = ',')]
    split: Option<Vec<usize>>,
    /// Train across the processes of an MPI job (`mpi`; run under mpirun or
    /// srun; needs a build with `--features mpi`). Each process uses its own
    /// --devices (default: one adapter per process).
    #[arg(long)]
    distributed: Option<String>,
    /// Stop after this many steps (default: all epochs).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Testing the failure path: RANK:STEP[:panic] makes that rank fail at
    /// that step (an error, or a panic). Only in `fault-injection` builds.
    #[cfg(feature = "fault-injection")]
    #[arg(long, hide = true)]
    fail_at: Option<String>,
}

/// The train/test split every command agrees on.
fn load_data(mnist: Option<&PathBuf>, test_fraction: f64, seed: u64) -> wgrad::Result<(Dataset, Dataset, String)> {
    match mnist {
        Some(dir) => {
            let (train, test) = data::mnist(dir)?;
            Ok((train, test, format!("mnist:{}", dir.display())))
        }
        None => {
            let (train, test) = data::digits()?.split(test_fraction, seed)?;
            Ok((train, test, "digits".to_string()))
        }
    }
}

fn tune(opts: &DeviceOptions) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    println!("tuning matmul on {}", kernels.device().label());
    let table = kernels.autotune()?;
    print!("{}", table.table());
    match wgrad::kernels::autotune::cache_path() {
        Some(path) => println!("cached in {}", path.display()),
        None => println!("no cache directory (set WGRAD_CACHE_DIR); kept for this run only"),
    }
    Ok(())
}

/// A ticking spinner with a message, for waits of unknown length.
fn spinner(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

fn open_kernels(opts: &DeviceOptions) -> wgrad::Result<Arc<Kernels>> {
    Ok(Arc::new(Kernels::new(Device::open(opts)?)))
}

fn train(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    match args.distributed.as_deref() {
        None => run_training(opts, args, None),
        Some("mpi") => train_mpi(opts, args),
        Some(other) => Err(wgrad::Error::InvalidArgument {
            op: "train --distributed",
            reason: format!("unknown transport `{other}`: use mpi"),
        }),
    }
}

/// Under MPI every way out of a rank is an explicit one: a clean finalise
/// after success, MPI_Abort after an error (returning would finalise and
/// hang the ranks still waiting in a collective).
#[cfg(feature = "mpi")]
fn train_mpi(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    use wgrad::parallel::distributed::ProcessGroup;
    let group = Arc::new(wgrad::parallel::mpi::MpiGroup::init()?);
    let shared: Arc<dyn ProcessGroup> = group.clone();
    match run_training(opts, args, Some(shared)) {
        Ok(()) => match Arc::try_unwrap(group) {
            Ok(group) => {
                group.finalize();
                Ok(())
            }
            Err(group) => group.abort(1),
        },
        Err(e) => {
            eprintln!("error: rank {} of {}: {e}; aborting the MPI job", group.rank(), group.size());
            group.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn train_mpi(_opts: &DeviceOptions, _args: &TrainArgs) -> wgrad::Result<()> {
    train_mpi_missing("train --distributed mpi")
}

#[cfg(not(feature = "mpi"))]
fn train_mpi_missing(op: &'static str) -> wgrad::Result<()> {
    Err(wgrad::Error::InvalidArgument {
        op,
        reason: "this wgrad was built without MPI: build with `cargo build --release --features mpi` \
                 (needs an MPI library, e.g. Debian's libopenmpi-dev, and libclang)"
            .into(),
    })
}

/// Rank 0's data on every rank: only rank 0 reads files.
fn share_data(group: &dyn ProcessGroup, loaded: Option<(Dataset, Dataset, String)>) -> wgrad::Result<(Dataset, Dataset, String)> {
    use wgrad::parallel::distributed::{broadcast_f32, broadcast_u64};
    let root = group.rank() == 0;
    let (train, test, name) = match loaded {
        Some((train, test, name)) => (Some(train), Some(test), name),
        None => (None, None, String::new()),
    };
    let mut name_bytes = name.into_bytes();
    group.broadcast_bytes(0, &mut name_bytes)?;
    let share = |set: Option<Dataset>| -> wgrad::Result<Dataset> {
        let (mut x, labels, features, classes) = match set {
            Some(d) if root => d.into_parts(),
            _ => (Vec::new(), Vec::new(), 0, 0),
        };
        let mut meta = vec![features as u64, classes as u64];
        let mut labels: Vec<u64> = labels.into_iter().map(u64::from).collect();
        broadcast_u64(group, 0, &mut meta)?;
        broadcast_f32(group, 0, &mut x)?;
        broadcast_u64(group, 0, &mut labels)?;
        let labels = labels.into_iter().map(|l| l as u32).collect();
        Dataset::new(x, labels, meta[0] as usize, meta[1] as usize)
    };
    let train = share(train)?;
    let test = share(test)?;
    Ok((train, test, String::from_utf8_lossy(&name_bytes).into_owned()))
}

fn run_training(opts: &DeviceOptions, args: &TrainArgs, process_group: Option<Arc<dyn ProcessGroup>>) -> wgrad::Result<()> {
    let rank = process_group.as_ref().map_or(0, |g| g.rank());
    let root = rank == 0;
    let (train_set, test_set, data_name) = match &process_group {
        None => load_data(args.mnist.as_ref(), args.test_fraction, args.seed)?,
        Some(g) => {
            let loaded = if root { Some(load_data(args.mnist.as_ref(), args.test_fraction, args.seed)?) } else { None };
            share_data(g.as_ref(), loaded)?
        }
    };
    log::info!("rank {rank}: data ready");
    let strategy = match (&args.parallel, &process_group) {
        (Some(name), _) => Strategy::parse(name)?,
        (None, Some(_)) => Strategy::Data,
        (None, None) => Strategy::Single,
    };
    if process_group.is_some() && strategy != Strategy::Data {
        return Err(wgrad::Error::InvalidArgument {
            op: "train --distributed",
            reason: "across processes wgrad trains data parallel: use --parallel data".into(),
        });
    }
    let selection = match (&args.devices, strategy, &process_group) {
        (Some(d), _, _) => Some(DeviceSelection::parse(d)?),
        (None, Strategy::Single, _) | (None, _, Some(_)) => None,
        (None, _, None) => Some(DeviceSelection::from_env(DeviceSelection::Count(2))?),
    };
    let mut widths = vec![train_set.features()];
    widths.extend(&args.hidden);
    widths.push(train_set.classes());
    nn::manual_seed(args.seed);
    let model = Sequential::mlp(&widths, Layer::ReLU)?;
    // A device count that cannot work fails here, before devices open one
    // by one (minutes for a large count). Across processes --split holds
    // rows per process, not per device.
    if let Some(selection) = &selection {
        let split = if process_group.is_some() { None } else { args.split.as_deref() };
        strategy.check_devices(selection.check()?, &model, args.batch_size, split)?;
    }
    let group = match &selection {
        Some(selection) => DeviceGroup::open(selection)?,
        None => DeviceGroup::from_kernels(vec![open_kernels(opts)?])?,
    };
    let optimizer: OptimizerConfig = match args.optimizer {
        OptimizerName::Adam => Adam::new(args.lr).into(),
        OptimizerName::Adamw => AdamW::new(args.lr).into(),
        OptimizerName::Sgd => SGD::new(args.lr).momentum(args.momentum).into(),
    };
    log::info!("rank {rank}: devices open");
    // Pipelines compile while the engine is built (lavapipe) or at their
    // first dispatch (llvmpipe-GL, and lavapipe with a cold shader cache):
    // both can take seconds, so neither happens in silence.
    let preparing = if root { spinner("preparing kernels") } else { ProgressBar::hidden() };
    let mut engine = match process_group {
        Some(g) => Engine::Distributed(DistributedDataParallel::new(g, &group, &model, CrossEntropyLoss, optimizer, args.batch_size, args.split.clone())?),
        None => Engine::new(strategy, &group, &model, CrossEntropyLoss.into(), optimizer, args.batch_size, args.micro_batches, args.split.clone())?,
    };
    // Cleared before anything below prints.
    preparing.finish_and_clear();
    #[cfg(feature = "fault-injection")]
    if let (Some(spec), Engine::Distributed(d)) = (&args.fail_at, &mut engine) {
        let (fail_rank, step, how) = parse_fail_at(spec)?;
        d.inject_failure(fail_rank, step, how);
    }
    if let Some(path) = &args.resume {
        match &mut engine {
            Engine::Single(t) => t.load(path)?,
            Engine::Data(d) => {
                for t in d.replicas_mut() {
                    t.load(path)?;
                }
            }
            // Rank 0 reads the checkpoint and every rank takes its state,
            // whatever the number of processes that wrote it.
            Engine::Distributed(d) => {
                if root {
                    for t in d.local_mut().replicas_mut() {
                        t.load(path)?;
                    }
                }
                d.sync_from_root()?;
            }
            _ => {
                return Err(wgrad::Error::InvalidArgument {
                    op: "train --resume",
                    reason: "resuming is supported for single-device and data-parallel runs".into(),
                })
            }
        }
        if root {
            println!("resumed from {}", path.display());
        }
    }
    // Rank 0 speaks for the job; other ranks only report errors.
    macro_rules! say {
        ($($arg:tt)*) => { if root { println!($($arg)*); } };
    }
    say!("devices: {}", group.labels().join(", "));
    if let Engine::Single(t) = &engine {
        let exec = t.executor();
        say!(
            "GPU memory {} KiB (intermediates {} KiB planned vs {} KiB naive)",
            exec.peak_bytes() / 1024,
            exec.plan().slot_bytes / 1024,
            exec.plan().naive_intermediate_bytes / 1024,
        );
    }
    say!("model: {} | {} | batch {}", model.describe(), wgrad::optim::describe(&optimizer), args.batch_size);
    say!("{}", engine.describe());
    say!("data: {data_name}, {} train / {} test rows", train_set.len(), test_set.len());

    let mut sampler = Sampler::new(train_set.len(), args.batch_size, args.seed, true)?;
    let all_steps = (sampler.num_batches() * args.epochs) as u64;
    let steps = args.max_steps.map_or(all_steps, |m| m.min(all_steps));
    let bar = if root { ProgressBar::new(steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} steps {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // Ticks on its own thread, so a first step that waits on a shader
    // compile still shows the run is alive.
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar.set_message("first steps compile kernels (cached for later runs)");
    let mut x = vec![0.0f32; args.batch_size * train_set.features()];
    let mut y = vec![0u32; args.batch_size];
    let mut curve: Vec<(u64, f32)> = Vec::new();
    let start = Instant::now();
    let mut done = 0u64;
    let shares_of = |e: &Engine| match e {
        Engine::Data(d) => d.shares().to_vec(),
        Engine::Distributed(d) => d.process_shares().to_vec(),
        _ => Vec::new(),
    };
    let mut last_shares = shares_of(&engine);
    'epochs: for _ in 0..args.epochs {
        for b in 0..sampler.num_batches() {
            if done >= steps {
                break 'epochs;
            }
            let Some(indices) = sampler.batch(b) else { break };
            train_set.fill_batch(indices, &mut x, &mut y)?;
            done += 1;
            let read = done % args.loss_every.max(1) == 0 || done == steps;
            if let Some(loss) = engine.step(&x, Targets::Classes(&y), read)? {
                curve.push((done, loss));
                let rate = (done * args.batch_size as u64) as f64 / start.elapsed().as_secs_f64();
                bar.set_message(format!("loss {loss:.4} | {rate:.0} samples/s"));
            }
            let shares = shares_of(&engine);
            if shares != last_shares {
                if root {
                    bar.println(format!("step {done}: {}", engine.describe()));
                }
                last_shares = shares;
            }
            bar.inc(1);
        }
        sampler.next_epoch();
    }
    for k in group.members() {
        k.device().wait_idle("train")?;
    }
    let seconds = start.elapsed().as_secs_f64();
    bar.finish();
    if !root {
        return Ok(());
    }
    let test_accuracy = accuracy(&engine.predict(test_set.x())?, test_set.labels());
    let train_accuracy = accuracy(&engine.predict(train_set.x())?, train_set.labels());
    println!(
        "trained {done} steps in {seconds:.1} s ({:.0} samples/s); train accuracy {:.2}%, test accuracy {:.2}%",
        (done * args.batch_size as u64) as f64 / seconds,
        100.0 * train_accuracy,
        100.0 * test_accuracy
    );
    let report = engine.report();
    if !report.is_empty() {
        println!("{report}");
    }
    let mut ckpt = engine.checkpoint(&model, &optimizer)?;
    ckpt.set_meta("data", data_name);
    ckpt.set_meta("split_seed", args.seed.to_string());
    ckpt.set_meta("test_fraction", args.test_fraction.to_string());
    ckpt.set_meta("test_accuracy", format!("{test_accuracy:.6}"));
    if let Some(dir) = args.checkpoint.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| wgrad::Error::CheckpointIo {
            path: dir.to_path_buf(),
            action: "create the directory",
            source,
        })?;
    }
    wgrad::checkpoint::save(&args.checkpoint, &ckpt)?;
    println!("checkpoint: {}", args.checkpoint.display());
    let title = format!("{} — test accuracy {:.2}%", model.describe(), 100.0 * test_accuracy);
    wgrad::plot::loss_curve(&args.plot, &title, &curve)?;
    println!("loss curve: {}", args.plot.display());
    Ok(())
}

#[cfg(feature = "mpi")]
fn allreduce_bench(sizes: &[usize], reps: usize) -> wgrad::Result<()> {
    use wgrad::parallel::distributed::ProcessGroup;
    let group = wgrad::parallel::mpi::MpiGroup::init()?;
    // Training reduces the gradient bucket by bucket: 2^18 f64 sums each.
    const BUCKET: usize = 1 << 18;
    let mut rows = Vec::new();
    for &n in sizes {
        let mut values = vec![1.0f64; n];
        let mut times = Vec::with_capacity(reps.max(1));
        for rep in 0..=reps.max(1) {
            let start = Instant::now();
            for chunk in values.chunks_mut(BUCKET) {
                if let Err(e) = group.all_reduce_sum(chunk) {
                    eprintln!("error: rank {}: {e}", group.rank());
                    group.abort(1);
                }
            }
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        rows.push((n, times[times.len() / 2], times[0]));
    }
    if group.rank() == 0 {
        println!("{}", group.describe());
        println!("{:>12} {:>12} {:>12} {:>12} {:>10}", "parameters", "f32 MiB", "median ms", "min ms", "GB/s f64");
        for (n, median, min) in &rows {
            let bytes = 8.0 * *n as f64;
            println!("{n:>12} {:>12.2} {:>12.3} {:>12.3} {:>10.2}", 4.0 * *n as f64 / (1 << 20) as f64, 1e3 * median, 1e3 * min, bytes / median / 1e9);
        }
        for (n, median, _) in &rows {
            println!("bench allreduce processes={} parameters={n} ms={:.3}", group.size(), 1e3 * median);
        }
    }
    group.finalize();
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn allreduce_bench(_sizes: &[usize], _reps: usize) -> wgrad::Result<()> {
    train_mpi_missing("allreduce")
}

/// `RANK:STEP[:panic|error]` for --fail-at.
#[cfg(feature = "fault-injection")]
fn parse_fail_at(spec: &str) -> wgrad::Result<(usize, u64, InjectedFailure)> {
    let bad = || wgrad::Error::InvalidArgument { op: "train --fail-at", reason: format!("`{spec}` is not RANK:STEP[:panic|error]") };
    let mut fields = spec.split(':');
    let rank = fields.next().and_then(|r| r.trim().parse().ok()).ok_or_else(bad)?;
    let step = fields.next().and_then(|s| s.trim().parse().ok()).ok_or_else(bad)?;
    let how = match fields.next().map(str::trim) {
        None | Some("error") => InjectedFailure::Error,
        Some("panic") => InjectedFailure::Panic,
        Some(_) => return Err(bad()),
    };
    Ok((rank, step, how))
}

fn infer(opts: &DeviceOptions, path: &PathBuf, mnist: Option<&PathBuf>, show: usize) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    let (mut predictor, ckpt) = Predictor::from_checkpoint(kernels.clone(), path, 256)?;
    let seed = ckpt.meta("split_seed").and_then(|s| s.parse().ok()).unwrap_or(0);
    let fraction = ckpt.meta("test_fraction").and_then(|s| s.parse().ok()).unwrap_or(0.2);
    let (_, test_set, data_name) = load_data(mnist, fraction, seed)?;
    if test_set.features() != predictor.in_features() {
        return Err(wgrad::Error::shape(
            "infer",
            format!("the model takes {} features, {data_name} has {}", predictor.in_features(), test_set.features()),
            &[&[predictor.in_features()], &[test_set.features()]],
        ));
    }
    println!("adapter: {}", kernels.device().label());
    println!("model: {} (step {})", predictor.model_description(), ckpt.meta("step").unwrap_or("?"));
    let predicting = spinner("predicting (a first run on this adapter compiles kernels)");
    let predictions = predictor.predict(test_set.x())?;
    predicting.finish_and_clear();
    for (i, (p, l)) in predictions.iter().zip(test_set.labels()).take(show).enumerate() {
        println!("  sample {i:4}: predicted {p}, label {l}{}", if p == l { "" } else { "  (wrong)" });
    }
    let acc = accuracy(&predictions, test_set.labels());
    println!("test accuracy {:.2}% on {} rows of {data_name}", 100.0 * acc, test_set.len());
    Ok(())
}

fn bench(opts: &DeviceOptions, quick: bool, compile: bool) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    let threads = std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    println!("adapter: {} (LP_NUM_THREADS={threads})", kernels.device().label());
    if compile {
        for l in wgrad::bench::compile_times(&kernels)? {
            println!("{l}");
        }
        return Ok(());
    }
    let sizes: &[usize] = if quick { &[256, 512] } else { &[256, 512, 1024, 2048] };
    let reps = if quick { 3 } else { 5 };
    let mut lines = Vec::new();
    for &n in sizes {
        lines.push(wgrad::bench::matmul(&kernels, n, reps)?);
    }
    lines.push(wgrad::bench::mlp_step(&kernels, if quick { 5 } else { 20 })?);
    lines.push(wgrad::bench::linear_step(&kernels, if quick { 100 } else { 1000 })?);
    println!("{:<32} measurements", "case");
    for l in &lines {
        let values: Vec<String> = l.values.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("{:<32} {}", l.case, values.join(", "));
    }
    println!();
    for l in &lines {
        println!("{l}");
    }
    Ok(())
}

fn device_options(cli: &Cli) -> wgrad::Result<DeviceOptions> {
    let mut opts = DeviceOptions::from_env()?;
    if let Some(b) = &cli.backend {
        opts.backends = Some(wgrad::device::parse_backend(b)?);
    }
    if let Some(a) = &cli.adapter {
        opts.adapter = Some(a.clone());
    }
    Ok(opts)
}

fn adapters() -> wgrad::Result<()> {
    let list = wgrad::device::list_adapters();
    if list.is_empty() {
        return Err(wgrad::Error::NoAdapter { filter: String::new() });
    }
    for report in &list {
        println!("{report}");
    }
    Ok(())
}

/// A small deterministic generator so the CLI needs no RNG crate.
fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matmul(opts: &DeviceOptions, n: usize, reps: usize) -> wgrad::Result<()> {
    let kernels = Kernels::new(Device::open(opts)?);
    println!("adapter: {} — {:?} kernel", kernels.device().label(), kernels.matmul_variant());
    let a_host = pseudo_random(n * n, 1);
    let b_host = pseudo_random(n * n, 2);
    let a = kernels.upload(&a_host)?;
    let b = kernels.upload(&b_host)?;
    let c = kernels.zeros(n * n)?;
    let dispatch = kernels.matmul(MatmulForm::AB, c.view(), a.view(), b.view(), n, n, n)?;
    kernels.run(&[&dispatch])?;
    let gpu = kernels.read::<f32>(c.view())?;
    let start = Instant::now();
    for _ in 0..reps {
        kernels.run(&[&dispatch])?;
    }
    kernels.device().wait_idle("matmul")?;
    let seconds = start.elapsed().as_secs_f64() / reps.max(1) as f64;
    let reference = wgrad::cpu::matmul(MatmulForm::AB, &a_host, &b_host, n, n, n);
    let max_err = gpu
        .iter()
        .zip(&reference)
        .map(|(g, r)| (g - r).abs())
        .fold(0.0f32, f32::max);
    let gflops = 2.0 * (n as f64).powi(3) / seconds / 1e9;
    println!("matmul n={n}: {:.2} ms, {gflops:.2} GFLOPS, max |gpu - cpu| = {max_err:.2e}", seconds * 1e3);
    let tolerance = 1e-6 * n as f32 + 1e-5;
    if max_err > tolerance {
        return Err(wgrad::Error::Validation {
            op: "matmul".into(),
            message: format!("GPU result differs from the CPU reference by {max_err} (> {tolerance})"),
        });
    }
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn,wgpu_hal::gles::egl=off")).init();
    let cli = Cli::parse();
    let result = device_options(&cli).and_then(|opts| match &cli.command {
        Command::Adapters => adapters(),
        Command::Train(args) => train(&opts, args),
        Command::Infer { checkpoint, mnist, show } => infer(&opts, checkpoint, mnist.as_ref(), *show),
        Command::Matmul { n, reps } => matmul(&opts, *n, *reps),
        Command::Bench { quick, compile } => bench(&opts, *quick, *compile),
        Command::Tune => tune(&opts),
        Command::Allreduce { sizes, reps } => allreduce_bench(sizes, *reps),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
