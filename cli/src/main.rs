//! The `wgrad` command line.

mod bench;
mod chat;
mod gpt;
mod plot;
mod serve;
mod train_flags;
mod webgpu_cases;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::infer::Predictor;
use wgrad::kernels::MatmulRequest;
use wgrad::kernels::{MatmulForm, OptimizerConfig};
use wgrad::models::LlamaVariant;
use wgrad::optim::{Adam, AdamW, SGD};
#[cfg(feature = "fault-injection")]
use wgrad::parallel::distributed::InjectedFailure;
use wgrad::parallel::distributed::ProcessGroup;
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::DeviceSelection;
use wgrad::train::accuracy;
use wgrad::train::{self, Classifier, Evaluation, Progress, RunInfo, Summary, TrainConfig};
use wgrad::{Device, DeviceOptions, Kernels};

#[derive(Parser)]
#[command(
    name = "wgrad",
    version,
    about = "Train and run neural networks on any GPU vendor through wgpu"
)]
struct Cli {
    /// Backend to search: vulkan, metal, dx12 or gl (default: all; env WGRAD_BACKEND).
    #[arg(long, global = true)]
    backend: Option<String>,
    /// Adapter index from `wgrad adapters`, or a name substring (env WGRAD_ADAPTER).
    #[arg(long, global = true)]
    adapter: Option<String>,
    /// `webgpu`: open devices with WebGPU's default limits, as a browser
    /// would (8 storage buffers per stage, 128 MiB bindings, 256-byte
    /// offsets); `adapter` (default): the adapter's own (env WGRAD_LIMITS).
    #[arg(long, global = true)]
    limits: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend with its limits and features.
    Adapters,
    /// Train a model (default: a GPT on the shipped Shakespeare; or a Llama,
    /// or an MLP on the digits) and write it with a loss-curve PNG.
    Train(Box<TrainArgs>),
    /// Continue a prompt with a model (a GGUF file, a GPT-2 or Llama
    /// folder), streaming the text; load time and tokens/s on stderr.
    Generate(Box<gpt::GenerateArgs>),
    /// Converse with a model that has a chat template (a GGUF file, a
    /// folder with tokenizer.json): one message per line of standard
    /// input, each answer streamed; end of input ends it.
    Chat(Box<chat::ChatArgs>),
    /// Serve a model (a GGUF file, a folder with tokenizer.json) over an
    /// OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /// /v1/models, /health), streaming, with continuous batching of
    /// --max-batch requests on the GPU.
    Serve(Box<serve::ServeArgs>),
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
        /// digits MLP's build and first step (see `wgrad_benches::compile_times`).
        #[arg(long)]
        compile: bool,
        /// Run only the cases whose name contains one of these
        /// comma-separated words, e.g. `--only gpt2_124m` or
        /// `--only matmul,mlp` (default: every case). The gpt2_124m
        /// prefill and decode lines come from one run, so either brings
        /// both; so do smollm2's (`--only smollm2`: SmolLM2-135M-Instruct's
        /// GGUF file, from $WGRAD_SMOLLM2 or where
        /// scripts/fetch-smollm2.sh caches it; an error when missing).
        /// `--only serve` (only by that name): `wgrad serve` on SmolLM2
        /// under 1, 4 and 16 concurrent streaming clients.
        /// `--only smollm2_decode_rows` (only by that name): SmolLM2's
        /// batched decode step at 1 to 16 rows, without the server.
        #[arg(long, value_delimiter = ',', conflicts_with = "compile")]
        only: Vec<String>,
        /// After the gpt2_124m and smollm2 decode timings, one decode step
        /// dispatch by dispatch: time, bytes and copy-bandwidth share per
        /// kernel (`…_decode_profile` lines).
        #[arg(long, conflicts_with = "compile")]
        profile: bool,
    },
    /// Under mpirun: time the cross-process gradient all-reduce (f64 sums in
    /// the buckets training uses) for several gradient sizes; rank 0 prints
    /// a table. Needs a build with `--features mpi`.
    Allreduce {
        /// Gradient sizes in parameters.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1000,16000,262144,1048576,4194304,16777216"
        )]
        sizes: Vec<usize>,
        /// Timed repetitions per size after one warm-up.
        #[arg(long, default_value_t = 10)]
        reps: usize,
    },
    /// Write every shader module exactly as wgrad composes it (for Tint,
    /// Chrome's compiler: `tint --format ir -o /dev/null DIR/modules/*.wgsl`),
    /// and a case per entry point for a browser's WebGPU (scripts/webgpu/).
    Shaders {
        /// The folder to write: modules/NAME.wgsl (WebGPU's dialect, every
        /// one a module Tint accepts), modules.json; cases.json and
        /// cases/*.bin (each entry point's inputs, uniform block, constants,
        /// grid and the CPU twin's expected output, built on the chosen
        /// adapter with WebGPU's default limits).
        #[arg(long)]
        dump: PathBuf,
        /// Also run every case on the adapter that built it and compare with
        /// the twin (an error if one disagrees). Compiles every pipeline:
        /// on a cold Mesa cache ~30 s more on lavapipe.
        #[arg(long)]
        check_native: bool,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OptimizerName {
    Adam,
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// A GPT on text (default: the shipped Shakespeare).
    Gpt,
    /// An MLP classifier on the digits (or MNIST).
    Mlp,
    /// A small Llama (grouped-query attention, RMSNorm, SwiGLU, rotary
    /// positions) on text, as the GPT trains.
    Llama,
    /// A small Qwen2 (the Llama with q/k/v biases) on text.
    Qwen2,
    /// A small Qwen3 (the Llama with q/k norms and heads of their own
    /// width) on text.
    Qwen3,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// What to train [default: gpt; with --init, the file's family].
    #[arg(long, value_enum)]
    model: Option<ModelKind>,
    #[command(flatten)]
    gpt: gpt::GptArgs,
    /// MLP: passes over the training set.
    #[arg(long, default_value_t = 40)]
    epochs: usize,
    /// The flags given on the command line (clap's ids), for
    /// [`train_flags::check`]: a flag left at its default is never refused.
    #[arg(skip)]
    given: Vec<String>,
    /// Examples (MLP) or sequences (GPT) per step; default 32 (MLP), 8 (GPT).
    #[arg(long)]
    batch_size: Option<usize>,
    /// MLP: hidden layer widths.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    hidden: Vec<usize>,
    /// The optimizer [default: adam for the MLP; adamw for the GPT and
    /// the Llama, whose schedule, clipping and weight decay (matrices
    /// only) apply to each].
    #[arg(long, value_enum)]
    optimizer: Option<OptimizerName>,
    /// Learning rate (GPT: the peak of the schedule); default 2e-3 (MLP), 3e-3 (GPT).
    #[arg(long)]
    lr: Option<f32>,
    /// SGD's momentum (--optimizer sgd).
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// MLP: share of the data held out for testing.
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
    /// Read the loss back every this many steps (others never wait for the GPU).
    #[arg(long, default_value_t = 10)]
    loss_every: u64,
    /// MLP: the checkpoint written at the end (a language model writes
    /// its folder to --out).
    #[arg(long, default_value = "out/digits.safetensors")]
    checkpoint: PathBuf,
    #[arg(long, default_value = "out/loss.png")]
    plot: PathBuf,
    /// Continue from this checkpoint (MLP) or model folder (GPT): parameters, optimizer state, step.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// MLP: train on MNIST IDX files in this folder instead of the digits set.
    #[arg(long)]
    mnist: Option<PathBuf>,
    /// Spread training over several devices: data, zero (sharded data
    /// parallel, --zero-stage), pipeline or tensor.
    #[arg(long)]
    parallel: Option<String>,
    /// With --parallel zero: 1 shards AdamW's moments over the devices, 2
    /// also the gradients (reduce-scatter), 3 also the parameters.
    #[arg(long)]
    zero_stage: Option<u32>,
    /// Devices for --parallel: a count, `all`, or adapter indexes like 0,1,1
    /// (env WGRAD_DEVICES; default 2).
    #[arg(long)]
    devices: Option<String>,
    /// --parallel pipeline: micro-batches per step.
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
    /// f16: keep the activations the backward reads in f16 (half their
    /// bytes) with dynamic loss scaling, on one device or any --parallel
    /// engine; needs SHADER_F16 on every device (else trains in f32, and
    /// says so).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// GPT and Llama: recompute each transformer block's forward in its
    /// backward: less activation memory for more compute (one device or
    /// any --parallel engine).
    #[arg(long)]
    checkpoint_activations: bool,
    /// --precision f16: clean steps before the loss scale doubles (GradScaler's growth_interval).
    #[arg(long, default_value_t = 2000)]
    loss_scale_interval: u32,
    /// Stop after this many steps (MLP default: all epochs; GPT default: 750).
    #[arg(long)]
    max_steps: Option<u64>,
    /// GPT and Llama: print each strategy's bytes per device (parameters,
    /// gradients, optimizer state, activations) at 1 device and at powers
    /// of two up to --devices, planned without opening a device; no training.
    #[arg(long)]
    dry_run: bool,
    /// Testing the failure path: RANK:STEP[:panic] makes that rank fail at
    /// that step (an error, or a panic). Only in `fault-injection` builds.
    #[cfg(feature = "fault-injection")]
    #[arg(long, hide = true)]
    fail_at: Option<String>,
}

fn shaders(opts: &DeviceOptions, dir: &Path, check_native: bool) -> wgrad::Result<()> {
    let written = wgrad::kernels::dump::write_modules(dir)?;
    for m in &written {
        println!("{} ({} entry points)", m.path.display(), m.entries.len());
    }
    println!("{} modules in {}", written.len(), dir.display());
    // The cases are built as a browser would run them, with WebGPU's
    // default limits; the few entries over those get the adapter's.
    let web_opts = DeviceOptions {
        limits: Some(wgrad::LimitsMode::WebGpu),
        ..opts.clone()
    };
    let web = Kernels::new(Device::open(&web_opts)?);
    let full = Kernels::new(Device::open(&DeviceOptions {
        limits: Some(wgrad::LimitsMode::Adapter),
        ..opts.clone()
    })?);
    let lowered = wgrad::kernels::LimitOverrides {
        max_storage_buffer_binding_size: Some(webgpu_cases::SPLIT_BINDING),
        ..Default::default()
    };
    let split = Kernels::with_limits(Device::open(&web_opts)?, lowered)?;
    let gpu_shaped = wgrad::kernels::LimitOverrides {
        gpu_shaping: Some(true),
        ..Default::default()
    };
    let gpu = Kernels::with_limits(Device::open(&web_opts)?, gpu_shaped)?;
    let cases = webgpu_cases::write_cases(
        dir,
        &webgpu_cases::CaseKernels {
            web: &web,
            full: &full,
            split: &split,
            gpu: &gpu,
        },
        check_native,
    )?;
    for reason in &cases.unbuilt {
        println!("not built on {}: {reason}", web.device().label());
    }
    let checked = if check_native {
        ", each checked there against the CPU twin"
    } else {
        ""
    };
    println!(
        "{} cases in {} (built on {}{checked})",
        cases.built,
        dir.join("cases.json").display(),
        web.device().label()
    );
    if !cases.native_failures.is_empty() {
        return Err(wgrad::Error::Validation {
            op: "shaders --dump".into(),
            message: format!(
                "{} case(s) disagree with the CPU twin on {} itself:\n{}",
                cases.native_failures.len(),
                web.device().label(),
                cases.native_failures.join("\n")
            ),
        });
    }
    Ok(())
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
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

fn open_kernels(opts: &DeviceOptions) -> wgrad::Result<Arc<Kernels>> {
    Ok(Arc::new(Kernels::new(Device::open(opts)?)))
}

fn train(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    let kind = model_kind(args)?;
    train_flags::check(args, kind)?;
    let run = |process_group: Option<Arc<dyn ProcessGroup>>| match kind {
        ModelKind::Gpt => gpt::train::<wgrad::models::Gpt>(opts, args, process_group, LlamaVariant::Llama),
        ModelKind::Llama => gpt::train::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Llama),
        ModelKind::Qwen2 => gpt::train::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Qwen2),
        ModelKind::Qwen3 => gpt::train::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Qwen3),
        ModelKind::Mlp => run_training(opts, args, process_group),
    };
    match args.distributed.as_deref() {
        None => run(None),
        Some("mpi") => train_mpi(run),
        Some(other) => Err(wgrad::Error::InvalidArgument {
            op: "train --distributed",
            reason: format!("unknown transport `{other}`: use mpi"),
        }),
    }
}

/// Which of the Llama family the GGUF file or folder at `path` holds.
fn llama_variant(path: &std::path::Path) -> wgrad::Result<LlamaVariant> {
    use wgrad::io::gguf_model::{GgufArchitecture, GgufModel};
    if !wgrad::io::lm_folder::is_gguf_path(path) {
        return Ok(wgrad::io::llama_folder::read_llama_config(path)?.variant);
    }
    Ok(match GgufModel::open(path)?.architecture() {
        GgufArchitecture::Llama(config) => config.variant,
        GgufArchitecture::Gpt2 { .. } => LlamaVariant::Llama,
    })
}

/// `--model`, or with `--init` the pretrained file's family; a `--model`
/// naming another family is refused.
fn model_kind(args: &TrainArgs) -> wgrad::Result<ModelKind> {
    let Some(init) = args.gpt.init.as_deref() else {
        return Ok(args.model.unwrap_or(ModelKind::Gpt));
    };
    if !init.exists() {
        return Err(wgrad::Error::InvalidArgument {
            op: "train --init",
            reason: format!(
                "`{}` does not exist (give a GGUF file or a Hugging Face model folder)",
                init.display()
            ),
        });
    }
    let (family, name) = match wgrad::io::lm_folder::model_family(init)? {
        wgrad::io::lm_folder::LmFamily::Gpt2 => (ModelKind::Gpt, "gpt"),
        wgrad::io::lm_folder::LmFamily::Llama => match llama_variant(init)? {
            LlamaVariant::Llama => (ModelKind::Llama, "llama"),
            LlamaVariant::Qwen2 => (ModelKind::Qwen2, "qwen2"),
            LlamaVariant::Qwen3 => (ModelKind::Qwen3, "qwen3"),
        },
    };
    match args.model {
        Some(given) if given != family => Err(wgrad::Error::InvalidArgument {
            op: "train --init",
            reason: format!(
                "`{}` holds a {name} model, but --model is {given:?}: give --model {name} or leave --model out",
                init.display()
            ),
        }),
        _ => Ok(family),
    }
}

/// Runs `run` as one rank of an MPI job. Every way out of a rank is an
/// explicit one: a clean finalise after success, MPI_Abort after an error
/// (returning would finalise and hang the ranks still waiting in a
/// collective).
#[cfg(feature = "mpi")]
fn train_mpi(run: impl FnOnce(Option<Arc<dyn ProcessGroup>>) -> wgrad::Result<()>) -> wgrad::Result<()> {
    let group = Arc::new(wgrad::parallel::mpi::MpiGroup::init()?);
    let shared: Arc<dyn ProcessGroup> = group.clone();
    match run(Some(shared)) {
        Ok(()) => match Arc::try_unwrap(group) {
            Ok(group) => {
                group.finalize();
                Ok(())
            }
            Err(group) => group.abort(1),
        },
        Err(e) => {
            eprintln!(
                "error: rank {} of {}: {e}; aborting the MPI job",
                group.rank(),
                group.size()
            );
            group.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn train_mpi(_run: impl FnOnce(Option<Arc<dyn ProcessGroup>>) -> wgrad::Result<()>) -> wgrad::Result<()> {
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

/// `bytes` in MiB, to one decimal.
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Bytes by what they hold, in MiB.
pub(crate) fn memory_line(m: &wgrad::parallel::memory::DeviceMemory) -> String {
    format!(
        "parameters {}, gradients {}, optimizer state {}, activations {}; total {}",
        mib(m.parameters),
        mib(m.gradients),
        mib(m.optimizer_state),
        mib(m.activations),
        mib(m.total())
    )
}

/// --parallel, with --zero-stage's stage for `zero`.
fn strategy(args: &TrainArgs) -> wgrad::Result<Option<Strategy>> {
    let strategy = args.parallel.as_deref().map(Strategy::parse).transpose()?;
    match (strategy, args.zero_stage) {
        (Some(Strategy::Zero(_)), Some(stage)) => {
            Ok(Some(Strategy::Zero(wgrad::parallel::zero::ZeroStage::new(stage)?)))
        }
        (_, Some(_)) => Err(wgrad::Error::InvalidArgument {
            op: "train --zero-stage",
            reason: "a ZeRO stage needs --parallel zero".into(),
        }),
        (strategy, None) => Ok(strategy),
    }
}

/// The flags every task shares, over `defaults` (the task's run).
fn run_config(args: &TrainArgs, defaults: TrainConfig) -> wgrad::Result<TrainConfig> {
    Ok(TrainConfig {
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        max_steps: args.max_steps.or(defaults.max_steps),
        seed: args.seed,
        loss_every: args.loss_every,
        resume: args.resume.clone(),
        strategy: strategy(args)?,
        devices: args.devices.as_deref().map(DeviceSelection::parse).transpose()?,
        micro_batches: args.micro_batches,
        split: args.split.clone(),
        precision: args.precision.parse()?,
        loss_scaling: wgrad::optim::LossScaling {
            growth_interval: args.loss_scale_interval,
            ..Default::default()
        },
        checkpoint_activations: args.checkpoint_activations,
        #[cfg(feature = "fault-injection")]
        fail_at: args.fail_at.as_deref().map(parse_fail_at).transpose()?,
        ..defaults
    })
}

/// A spinner while kernels are prepared, then a bar over the steps with the
/// loss, the rate and the ETA; validation losses and rebalancing print
/// above it. The library reports only on rank 0, so other ranks draw nothing.
#[derive(Default)]
pub(crate) struct Bars {
    preparing: Option<ProgressBar>,
    steps: Option<ProgressBar>,
    unit: &'static str,
}

impl Bars {
    /// Prints `line` above the bar; `suspend` prints even where the bar is
    /// hidden (output not a terminal).
    fn print(&self, line: &str) {
        match &self.steps {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }
}

impl Progress for Bars {
    fn preparing(&mut self) {
        // Pipelines compile while the engine is built (lavapipe) or at
        // their first dispatch (llvmpipe-GL, and lavapipe with a cold
        // shader cache): both can take seconds, so neither happens in silence.
        self.preparing = Some(spinner("preparing kernels"));
    }

    fn started(&mut self, info: &RunInfo) {
        // Cleared before anything below prints.
        if let Some(s) = self.preparing.take() {
            s.finish_and_clear();
        }
        if let Some(path) = &info.resumed_from {
            println!("resumed from {} at step {}", path.display(), info.first_step - 1);
        }
        println!("devices: {}", info.devices.join(", "));
        println!("{}", info.engine);
        println!(
            "model: {} | {} parameters | {} | batch {}",
            info.model, info.parameters, info.optimizer, info.batch_size
        );
        println!("data: {} | {} {} per step", info.data, info.per_step, info.unit);
        println!("memory per device (the fullest): {}", memory_line(&info.memory));
        if let Some(note) = &info.precision_note {
            println!("{note}");
        }
        if info.precision == wgrad::graph::Precision::F16 {
            println!("precision f16: activations kept for the backward in f16, f32 master weights and optimizer state, dynamic loss scaling");
        }
        if let Some(bytes) = info.held_activation_bytes {
            println!(
                "activations held for the backward: {} KiB per step ({})",
                bytes / 1024,
                info.precision.name()
            );
        }
        let f = &info.footprint;
        match f.intermediates {
            Some((planned, naive)) => println!(
                "{} dispatches per step, GPU memory {} KiB (intermediates {} KiB planned vs {} KiB naive)",
                f.dispatches_per_step,
                f.peak_bytes / 1024,
                planned / 1024,
                naive / 1024
            ),
            None => println!(
                "{} dispatches per step, {} KiB of GPU memory on the fullest device",
                f.dispatches_per_step,
                f.peak_bytes / 1024
            ),
        }
        self.unit = info.unit;
        let bar = ProgressBar::new(info.steps);
        bar.set_position(info.first_step - 1);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} steps {elapsed_precise} (ETA {eta}) {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        // Ticks on its own thread, so a first step that waits on a shader
        // compile still shows the run is alive.
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar.set_message("first steps compile kernels (cached for later runs)");
        self.steps = Some(bar);
    }

    fn loss(&mut self, _step: u64, loss: f32, per_s: f64) {
        if let Some(bar) = &self.steps {
            bar.set_message(format!("loss {loss:.4} | {per_s:.0} {}/s", self.unit));
        }
    }

    fn validation(&mut self, step: u64, loss: f32) {
        self.print(&format!("step {step}: validation loss {loss:.4}"));
    }

    fn rebalanced(&mut self, step: u64, engine: &str) {
        self.print(&format!("step {step}: {engine}"));
    }

    fn step(&mut self, _step: u64) {
        if let Some(bar) = &self.steps {
            bar.inc(1);
        }
    }

    fn trained(&mut self) {
        if let Some(bar) = &self.steps {
            bar.finish();
        }
    }
}

/// The end of every run: steps, time, rate and the engine's report.
pub(crate) fn print_summary(summary: &Summary, unit: &str) {
    let first = summary.first_step_seconds;
    let later = summary.steps.saturating_sub(1);
    if summary.steps == 0 {
        println!("trained 0 steps");
    } else if later == 0 {
        println!("trained 1 step in {first:.2} s (with what compiles at first use)");
    } else {
        // The first step compiles what the build left: the rate is the others'
        // (Summary::first_step_seconds).
        let seconds = (summary.seconds - first).max(1e-9);
        let per_s = summary.per_s * summary.seconds / summary.steps as f64 * later as f64 / seconds;
        let ms = 1e3 * seconds / later as f64;
        println!(
            "trained {} steps in {:.1} s: first step {first:.2} s (with what compiles at first use), \
             then {ms:.1} ms/step, {per_s:.0} {unit}/s",
            summary.steps, summary.seconds
        );
    }
    if !summary.report.is_empty() {
        println!("{}", summary.report);
    }
    if let Some((step, loss)) = summary.train_curve.last() {
        println!("final training loss {loss:.6} (step {step})");
    }
    if let Some(scale) = &summary.loss_scale {
        println!("{}", scale.summary());
    }
}

fn run_training(
    opts: &DeviceOptions,
    args: &TrainArgs,
    process_group: Option<Arc<dyn ProcessGroup>>,
) -> wgrad::Result<()> {
    let lr = args.lr.unwrap_or(2e-3);
    let optimizer: OptimizerConfig = match args.optimizer.unwrap_or(OptimizerName::Adam) {
        OptimizerName::Adam => Adam::new(lr).into(),
        OptimizerName::Adamw => AdamW::new(lr).into(),
        OptimizerName::Sgd => SGD::new(lr).momentum(args.momentum).into(),
    };
    if args.dry_run {
        return Err(wgrad::Error::InvalidArgument {
            op: "train --dry-run",
            reason: "plans a language model's run: use --model gpt or llama".into(),
        });
    }
    let config = TrainConfig {
        optimizer,
        save: Some(args.checkpoint.clone()),
        ..run_config(args, TrainConfig::default())?
    };
    let task = Classifier {
        hidden: args.hidden.clone(),
        epochs: args.epochs,
        test_fraction: args.test_fraction,
        mnist: args.mnist.clone(),
        ..Classifier::default()
    };
    let mut bars = Bars::default();
    let Some(summary) = train::train(opts, config, task, process_group, &mut bars)? else {
        return Ok(());
    };
    print_summary(&summary, "samples");
    let Evaluation::Accuracy { train, test } = summary.evaluation else {
        return Err(wgrad::Error::InvalidArgument {
            op: "train --model mlp",
            reason: "the classifier's run gave no accuracy".into(),
        });
    };
    println!(
        "train accuracy {:.2}%, test accuracy {:.2}%",
        100.0 * train,
        100.0 * test
    );
    if let Some(path) = &summary.saved {
        println!("checkpoint: {}", path.display());
    }
    let title = format!("{} — test accuracy {:.2}%", summary.model, 100.0 * test);
    plot::loss_curve(&args.plot, &title, &summary.train_curve)?;
    println!("loss curve: {}", args.plot.display());
    Ok(())
}

#[cfg(feature = "mpi")]
fn allreduce_bench(sizes: &[usize], reps: usize) -> wgrad::Result<()> {
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
        println!(
            "{:>12} {:>12} {:>12} {:>12} {:>10}",
            "parameters", "f32 MiB", "median ms", "min ms", "GB/s f64"
        );
        for (n, median, min) in &rows {
            let bytes = 8.0 * *n as f64;
            println!(
                "{n:>12} {:>12.2} {:>12.3} {:>12.3} {:>10.2}",
                4.0 * *n as f64 / (1 << 20) as f64,
                1e3 * median,
                1e3 * min,
                bytes / median / 1e9
            );
        }
        for (n, median, _) in &rows {
            println!(
                "bench allreduce processes={} parameters={n} ms={:.3}",
                group.size(),
                1e3 * median
            );
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
    let bad = || wgrad::Error::InvalidArgument {
        op: "train --fail-at",
        reason: format!("`{spec}` is not RANK:STEP[:panic|error]"),
    };
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
    let train::DataSplit {
        test: test_set,
        name: data_name,
        ..
    } = train::load_data(mnist.map(PathBuf::as_path), fraction, seed)?;
    if test_set.features() != predictor.in_features() {
        return Err(wgrad::Error::shape(
            "infer",
            format!(
                "the model takes {} features, {data_name} has {}",
                predictor.in_features(),
                test_set.features()
            ),
            &[&[predictor.in_features()], &[test_set.features()]],
        ));
    }
    println!("adapter: {}", kernels.device().label());
    println!(
        "model: {} (step {})",
        predictor.model_description(),
        ckpt.meta("step").unwrap_or("?")
    );
    let predicting = spinner("predicting (a first run on this adapter compiles kernels)");
    let predictions = predictor.predict(test_set.x())?;
    predicting.finish_and_clear();
    for (i, (p, l)) in predictions.iter().zip(test_set.labels()).take(show).enumerate() {
        println!(
            "  sample {i:4}: predicted {p}, label {l}{}",
            if p == l { "" } else { "  (wrong)" }
        );
    }
    let acc = accuracy(&predictions, test_set.labels());
    println!(
        "test accuracy {:.2}% on {} rows of {data_name}",
        100.0 * acc,
        test_set.len()
    );
    Ok(())
}

fn bench(opts: &DeviceOptions, quick: bool, compile: bool, profile: bool, only: &[String]) -> wgrad::Result<()> {
    const CASES: [&str; 12] = [
        "matmul",
        "mlp_step",
        "gpt_train_step",
        "gpt_generate",
        "linear_step",
        "gpt2_124m_prefill",
        "gpt2_124m_decode",
        "smollm2_prefill",
        "smollm2_decode",
        "smollm2_decode_rows",
        "serve",
        "attention",
    ];
    if let Some(unknown) = only
        .iter()
        .find(|w| w.is_empty() || !CASES.iter().any(|c| c.contains(w.as_str())))
    {
        return Err(wgrad::Error::InvalidArgument {
            op: "bench --only",
            reason: format!("no case is named like `{unknown}`; the cases are {}", CASES.join(", ")),
        });
    }
    let runs = |case: &str| only.is_empty() || only.iter().any(|w| case.contains(w.as_str()));
    let kernels = open_kernels(opts)?;
    let threads = std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    println!("adapter: {} (LP_NUM_THREADS={threads})", kernels.device().label());
    if compile {
        for l in wgrad_benches::compile_times(&kernels)? {
            println!("{l}");
        }
        return Ok(());
    }
    let sizes: &[usize] = if quick { &[256, 512] } else { &[256, 512, 1024, 2048] };
    let reps = if quick { 3 } else { 5 };
    let mut lines = Vec::new();
    if runs("matmul") {
        for &n in sizes {
            lines.push(bench::matmul(&kernels, n, reps)?);
        }
    }
    if runs("mlp_step") {
        lines.push(wgrad_benches::mlp_step(&kernels, if quick { 5 } else { 20 })?);
    }
    if runs("gpt_train_step") {
        // The GPT step's mfu is against the best matmul measured in this run.
        let gflops = |ls: &[wgrad_benches::BenchLine]| {
            ls.iter()
                .filter_map(|l| l.values.iter().find(|v| v.0 == "gflops"))
                .filter_map(|v| v.1.parse::<f64>().ok())
                .fold(0.0, f64::max)
        };
        let mut best_gflops = gflops(&lines);
        if best_gflops == 0.0 {
            best_gflops = gflops(&[bench::matmul(&kernels, 512, reps)?]);
        }
        lines.push(wgrad_benches::gpt_train_step(
            &kernels,
            wgrad_benches::gpt_bench_config(),
            16,
            if quick { 2 } else { 5 },
            best_gflops,
        )?);
        if kernels.supports_f16() {
            let f16 = wgrad::graph::PlanOptions {
                precision: wgrad::graph::Precision::F16,
                ..Default::default()
            };
            lines.push(wgrad_benches::gpt_train_step_with(
                &kernels,
                wgrad_benches::gpt_bench_config(),
                16,
                if quick { 2 } else { 5 },
                best_gflops,
                f16,
            )?);
        }
    }
    if runs("gpt_generate") {
        lines.push(wgrad_benches::gpt_generate(
            &kernels,
            wgrad_benches::gpt_bench_config(),
            if quick { 16 } else { 48 },
        )?);
    }
    if runs("linear_step") {
        lines.push(wgrad_benches::linear_step(&kernels, if quick { 100 } else { 1000 })?);
    }
    if runs("attention") {
        // Fused against unfused attention training at a fixed B·T = 1024
        // tokens, 4 heads of 64 channels (SmolLM2's and GPT-2's width).
        for t in [64, 256, 1024] {
            lines.push(wgrad_benches::attention_train(
                &kernels,
                t,
                1024,
                4,
                64,
                if quick { 2 } else { 5 },
            )?);
        }
    }
    if runs("gpt2_124m_prefill") || runs("gpt2_124m_decode") {
        // GPT-2 124M's shape: a 16-token prompt and 8 decoded tokens when quick.
        let (prompt, decoded) = if quick { (16, 8) } else { (64, 32) };
        lines.extend(wgrad_benches::gpt2_124m_generate(&kernels, prompt, decoded, profile)?);
    }
    if runs("smollm2_prefill") || runs("smollm2_decode") {
        // The 128-token prompt; fewer decoded tokens when quick.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench smollm2",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        lines.extend(wgrad_benches::smollm2_generate(
            &kernels,
            &path,
            128,
            if quick { 8 } else { 32 },
            profile,
        )?);
    }
    if only.iter().any(|w| w == "smollm2_decode_rows") {
        // Only by its name: it builds a SmolLM2 generator per row count.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench smollm2_decode_rows",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        lines.extend(wgrad_benches::smollm2_decode_rows(
            &kernels,
            &path,
            &[1, 2, 4, 8, 16],
            if quick { 4 } else { 8 },
            profile,
        )?);
    }
    if only.iter().any(|w| w == "serve") {
        // Only when asked for by name: it needs SmolLM2 and runs minutes.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench serve",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        let (requests, max_tokens) = if quick { (1, 16) } else { (2, 32) };
        lines.extend(bench::serve(&kernels, &path, &[1, 4, 16], requests, max_tokens)?);
    }
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
    if let Some(l) = &cli.limits {
        let mode = wgrad::LimitsMode::parse(l)?;
        opts.limits = Some(mode);
        // Device groups (--devices) open their members by index and read
        // the environment for the rest.
        std::env::set_var(
            wgrad::device::ENV_LIMITS,
            if mode == wgrad::LimitsMode::WebGpu {
                "webgpu"
            } else {
                "adapter"
            },
        );
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
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matmul(opts: &DeviceOptions, n: usize, reps: usize) -> wgrad::Result<()> {
    let kernels = Kernels::new(Device::open(opts)?);
    println!(
        "adapter: {} — {:?} kernel",
        kernels.device().label(),
        kernels.matmul_variant()
    );
    let a_host = pseudo_random(n * n, 1);
    let b_host = pseudo_random(n * n, 2);
    let a = kernels.upload(&a_host)?;
    let b = kernels.upload(&b_host)?;
    let c = kernels.zeros(n * n)?;
    let dispatch = kernels.matmul(
        &MatmulRequest::new(MatmulForm::AB, n, n, n),
        c.view(),
        a.view(),
        b.view(),
    )?;
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
    println!(
        "matmul n={n}: {:.2} ms, {gflops:.2} GFLOPS, max |gpu - cpu| = {max_err:.2e}",
        seconds * 1e3
    );
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
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Command::Train(args), Some(("train", given))) = (&mut cli.command, matches.subcommand()) {
        let on_command_line = |id: &&clap::Id| given.value_source(id.as_str()) == Some(ValueSource::CommandLine);
        args.given = given
            .ids()
            .filter(on_command_line)
            .map(|id| id.as_str().to_string())
            .collect();
    }
    let result = device_options(&cli).and_then(|opts| match &cli.command {
        Command::Adapters => adapters(),
        Command::Train(args) => train(&opts, args),
        Command::Infer {
            checkpoint,
            mnist,
            show,
        } => infer(&opts, checkpoint, mnist.as_ref(), *show),
        Command::Matmul { n, reps } => matmul(&opts, *n, *reps),
        Command::Generate(args) => gpt::generate(&opts, args),
        Command::Chat(args) => chat::chat(&opts, args),
        Command::Serve(args) => serve::serve(&opts, args),
        Command::Bench {
            quick,
            compile,
            profile,
            only,
        } => bench(&opts, *quick, *compile, *profile, only),
        Command::Tune => tune(&opts),
        Command::Shaders { dump, check_native } => shaders(&opts, dump, *check_native),
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
