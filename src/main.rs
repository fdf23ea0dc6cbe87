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
    Train(TrainArgs),
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
    /// Data parallel: fixed rows per device (e.g. 24,8) instead of the measured split.
    #[arg(long, value_delimiter = ',')]
    split: Option<Vec<usize>>,
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

fn open_kernels(opts: &DeviceOptions) -> wgrad::Result<Arc<Kernels>> {
    Ok(Arc::new(Kernels::new(Device::open(opts)?)))
}

fn train(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    let (train_set, test_set, data_name) = load_data(args.mnist.as_ref(), args.test_fraction, args.seed)?;
    let strategy = match &args.parallel {
        Some(name) => Strategy::parse(name)?,
        None => Strategy::Single,
    };
    let group = match (&args.devices, strategy) {
        (Some(d), _) => DeviceGroup::open(&DeviceSelection::parse(d)?)?,
        (None, Strategy::Single) => DeviceGroup::from_kernels(vec![open_kernels(opts)?])?,
        (None, _) => DeviceGroup::from_env(DeviceSelection::Count(2))?,
    };
    let mut widths = vec![train_set.features()];
    widths.extend(&args.hidden);
    widths.push(train_set.classes());
    nn::manual_seed(args.seed);
    let model = Sequential::mlp(&widths, Layer::ReLU)?;
    let optimizer: OptimizerConfig = match args.optimizer {
        OptimizerName::Adam => Adam::new(args.lr).into(),
        OptimizerName::Adamw => AdamW::new(args.lr).into(),
        OptimizerName::Sgd => SGD::new(args.lr).momentum(args.momentum).into(),
    };
    let mut engine = Engine::new(strategy, &group, &model, CrossEntropyLoss.into(), optimizer, args.batch_size, args.micro_batches, args.split.clone())?;
    if let Some(path) = &args.resume {
        match &mut engine {
            Engine::Single(t) => t.load(path)?,
            Engine::Data(d) => {
                for t in d.replicas_mut() {
                    t.load(path)?;
                }
            }
            _ => {
                return Err(wgrad::Error::InvalidArgument {
                    op: "train --resume",
                    reason: "resuming is supported for single-device and data-parallel runs".into(),
                })
            }
        }
        println!("resumed from {}", path.display());
    }
    println!("devices: {}", group.labels().join(", "));
    if let Engine::Single(t) = &engine {
        let exec = t.executor();
        println!(
            "GPU memory {} KiB (intermediates {} KiB planned vs {} KiB naive)",
            exec.peak_bytes() / 1024,
            exec.plan().slot_bytes / 1024,
            exec.plan().naive_intermediate_bytes / 1024,
        );
    }
    println!("model: {} | {} | batch {}", model.describe(), wgrad::optim::describe(&optimizer), args.batch_size);
    println!("{}", engine.describe());
    println!("data: {data_name}, {} train / {} test rows", train_set.len(), test_set.len());

    let mut sampler = Sampler::new(train_set.len(), args.batch_size, args.seed, true)?;
    let steps = (sampler.num_batches() * args.epochs) as u64;
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut x = vec![0.0f32; args.batch_size * train_set.features()];
    let mut y = vec![0u32; args.batch_size];
    let mut curve: Vec<(u64, f32)> = Vec::new();
    let start = Instant::now();
    let mut done = 0u64;
    let shares_of = |e: &Engine| match e {
        Engine::Data(d) => d.shares().to_vec(),
        _ => Vec::new(),
    };
    let mut last_shares = shares_of(&engine);
    for _ in 0..args.epochs {
        for b in 0..sampler.num_batches() {
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
                bar.println(format!("step {done}: {}", engine.describe()));
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
    println!("model: {} (step {})", predictor.model().describe(), ckpt.meta("step").unwrap_or("?"));
    let predictions = predictor.predict(test_set.x())?;
    for (i, (p, l)) in predictions.iter().zip(test_set.labels()).take(show).enumerate() {
        println!("  sample {i:4}: predicted {p}, label {l}{}", if p == l { "" } else { "  (wrong)" });
    }
    let acc = accuracy(&predictions, test_set.labels());
    println!("test accuracy {:.2}% on {} rows of {data_name}", 100.0 * acc, test_set.len());
    Ok(())
}

fn bench(opts: &DeviceOptions, quick: bool) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    let threads = std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    println!("adapter: {} (LP_NUM_THREADS={threads})", kernels.device().label());
    let sizes: &[usize] = if quick { &[256, 512] } else { &[256, 512, 1024, 2048] };
    let reps = if quick { 3 } else { 5 };
    let mut lines = Vec::new();
    for &n in sizes {
        lines.push(wgrad::bench::matmul(&kernels, n, reps)?);
    }
    lines.push(wgrad::bench::mlp_step(&kernels, if quick { 5 } else { 20 })?);
    lines.push(wgrad::bench::linear_step(&kernels, if quick { 100 } else { 1000 })?);
    println!("{:<32} {}", "case", "measurements");
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
        Command::Bench { quick } => bench(&opts, *quick),
        Command::Tune => tune(&opts),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
