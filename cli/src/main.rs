//! The `wgrad` command line: the commands and their flags, and the
//! dispatch to the file named for each command's job.

mod bench;
mod chat;
mod common;
mod export;
mod generate;
mod infer;
mod kernels;
mod perplexity;
mod plot;
mod serve;
mod train;
mod train_flags;
mod train_memory;
mod webgpu_cases;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use wgrad::DeviceOptions;

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
    Train(Box<train::TrainArgs>),
    /// Continue a prompt with a model (a GGUF file, a GPT-2 or Llama
    /// folder), streaming the text; load time and tokens/s on stderr.
    Generate(Box<generate::GenerateArgs>),
    /// Converse with a model that has a chat template (a GGUF file, a
    /// folder with tokenizer.json): one message per line of standard
    /// input, each answer streamed; end of input ends it.
    Chat(Box<chat::ChatArgs>),
    /// Serve a model (a GGUF file, a folder with tokenizer.json) over an
    /// OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /// /v1/models, /health), streaming, with continuous batching of
    /// --max-batch requests on the GPU.
    Serve(Box<serve::ServeArgs>),
    /// Merge a LoRA adapter into its base model and write the result: a
    /// Hugging Face folder (transformers loads it) or a GGUF file (F16,
    /// Q8_0, Q4_0, Q4_1 or F32 matrices; llama.cpp runs it).
    Export(Box<export::ExportArgs>),
    /// A model's mean next-token loss and perplexity over a text, as
    /// llama.cpp's llama-perplexity reports it: non-overlapping windows
    /// of --context tokens, each scoring the predictions of its second
    /// half (a GGUF file, a folder with tokenizer.json).
    Perplexity(Box<perplexity::PerplexityArgs>),
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
        /// `--only serve_lora` (only by that name): 16 streams over
        /// SmolLM2 alone, then over 4 LoRA adapters (r = 16, every
        /// Linear) served at once, and over the base beside them.
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
        Command::Adapters => kernels::adapters(),
        Command::Train(args) => train::train(&opts, args),
        Command::Infer {
            checkpoint,
            mnist,
            show,
        } => infer::infer(&opts, checkpoint, mnist.as_ref(), *show),
        Command::Matmul { n, reps } => kernels::matmul(&opts, *n, *reps),
        Command::Generate(args) => generate::generate(&opts, args),
        Command::Chat(args) => chat::chat(&opts, args),
        Command::Serve(args) => serve::serve(&opts, args),
        Command::Perplexity(args) => perplexity::perplexity(&opts, args),
        Command::Export(args) => export::export(args),
        Command::Bench {
            quick,
            compile,
            profile,
            only,
        } => bench::bench(&opts, *quick, *compile, *profile, only),
        Command::Tune => kernels::tune(&opts),
        Command::Shaders { dump, check_native } => kernels::shaders(&opts, dump, *check_native),
        Command::Allreduce { sizes, reps } => bench::allreduce_bench(sizes, *reps),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
