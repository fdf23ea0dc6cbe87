//! `wgrad train`: every model it trains — the MLP on the digits, and the
//! language models (GPT, Llama, Qwen2, Qwen3, Mistral) on text, from scratch or
//! fine-tuning a pretrained file — with a progress bar, the validation
//! loss, the loss curves in a PNG, the model written at the end and a
//! sample; across the processes of an MPI job too.

use std::path::PathBuf;
use std::sync::Arc;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::infer::generate::Sampling;
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{mistral, qwen, Llama, LlamaConfig, LlamaVariant};
use wgrad::models::{Gemma, GemmaConfig, Gpt, GptConfig};
use wgrad::nn::{AttentionKernel, BaseStorage, Lora, LoraConfig, Module};
use wgrad::optim::{Adam, AdamW, SGD};
#[cfg(feature = "fault-injection")]
use wgrad::parallel::distributed::InjectedFailure;
use wgrad::parallel::distributed::ProcessGroup;
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::memory::{strategy_memory, DeviceMemory, Planning};
use wgrad::parallel::pipeline::Schedule;
use wgrad::parallel::DeviceSelection;
use wgrad::train::{self, Classifier, Evaluation, Progress, RunInfo, Summary, TrainConfig};
use wgrad::train::{language_model_run, AdamWSchedule, LanguageModel, LmUpdate, Pretrained, TextSource};
use wgrad::train::{LoraLmConfig, TokenizerKind, TrainableLm, TrainingRun, MAKE_TRAIN_GPT};
use wgrad::DeviceOptions;

use crate::common::spinner;
use crate::generate::sample;
use crate::{plot, train_flags};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum OptimizerName {
    Adam,
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ModelKind {
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
    /// A small Mistral (the Llama attending over a sliding window of 16
    /// positions) on text.
    Mistral,
    /// A small Gemma 3 (norms before and after attention and MLP, GELU
    /// gate, q/k norms, local and global layers) on text.
    Gemma3,
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// What to train [default: gpt; with --init, the file's family].
    #[arg(long, value_enum)]
    pub(crate) model: Option<ModelKind>,
    #[command(flatten)]
    pub(crate) gpt: GptArgs,
    /// MLP: passes over the training set.
    #[arg(long, default_value_t = 40)]
    pub(crate) epochs: usize,
    /// The flags given on the command line (clap's ids), for
    /// [`train_flags::check`]: a flag left at its default is never refused.
    #[arg(skip)]
    pub(crate) given: Vec<String>,
    /// Examples (MLP) or sequences (GPT) per step; default 32 (MLP), 8 (GPT).
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// MLP: hidden layer widths.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    pub(crate) hidden: Vec<usize>,
    /// The optimizer [default: adam for the MLP; adamw for the GPT and
    /// the Llama, whose schedule, clipping and weight decay (matrices
    /// only) apply to each].
    #[arg(long, value_enum)]
    pub(crate) optimizer: Option<OptimizerName>,
    /// Learning rate (GPT: the peak of the schedule); default 2e-3 (MLP), 3e-3 (GPT).
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// SGD's momentum (--optimizer sgd).
    #[arg(long, default_value_t = 0.9)]
    pub(crate) momentum: f32,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// MLP: share of the data held out for testing.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) test_fraction: f64,
    /// Read the loss back every this many steps (others never wait for the GPU).
    #[arg(long, default_value_t = 10)]
    pub(crate) loss_every: u64,
    /// MLP: the checkpoint written at the end (a language model writes
    /// its folder to --out).
    #[arg(long, default_value = "out/digits.safetensors")]
    pub(crate) checkpoint: PathBuf,
    #[arg(long, default_value = "out/loss.png")]
    pub(crate) plot: PathBuf,
    /// Continue from this checkpoint (MLP), model folder (GPT, Llama, …) or,
    /// with --init and --lora, adapter folder: parameters (the adapters'),
    /// optimizer state, step; the same --seed and --batch-size draw the
    /// windows the first run would have drawn next.
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// MLP: train on MNIST IDX files in this folder instead of the digits set.
    #[arg(long)]
    pub(crate) mnist: Option<PathBuf>,
    /// Spread training over several devices: data, zero (sharded data
    /// parallel, --zero-stage), pipeline or tensor.
    #[arg(long)]
    pub(crate) parallel: Option<String>,
    /// With --parallel zero: 1 shards AdamW's moments over the devices, 2
    /// also the gradients (reduce-scatter), 3 also the parameters.
    #[arg(long)]
    pub(crate) zero_stage: Option<u32>,
    /// Devices for --parallel: a count, `all`, or adapter indexes like 0,1,1
    /// (env WGRAD_DEVICES; default 2).
    #[arg(long)]
    pub(crate) devices: Option<String>,
    /// --parallel pipeline: micro-batches per step.
    #[arg(long, default_value_t = 4)]
    pub(crate) micro_batches: usize,
    /// Data parallel: fixed rows per device (e.g. 24,8) instead of the
    /// measured split; with --distributed, rows per process.
    #[arg(long, value_delimiter = ',')]
    pub(crate) split: Option<Vec<usize>>,
    /// Train across the processes of an MPI job (`mpi`; run under mpirun or
    /// srun; needs a build with `--features mpi`). Each process uses its own
    /// --devices (default: one adapter per process).
    #[arg(long)]
    pub(crate) distributed: Option<String>,
    /// f16: keep the activations the backward reads in f16 (half their
    /// bytes) with dynamic loss scaling, on one device or any --parallel
    /// engine; needs SHADER_F16 on every device (else trains in f32, and
    /// says so).
    #[arg(long, default_value = "f32")]
    pub(crate) precision: String,
    /// GPT and Llama: recompute each transformer block's forward in its
    /// backward: less activation memory for more compute (one device or
    /// any --parallel engine). On by default for adapters over a quantized
    /// base (QLoRA's recipe, as PEFT's prepare_model_for_kbit_training
    /// does); --checkpoint-activations=false turns it off.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub(crate) checkpoint_activations: Option<bool>,
    /// --precision f16: clean steps before the loss scale doubles (GradScaler's growth_interval).
    #[arg(long, default_value_t = 2000)]
    pub(crate) loss_scale_interval: u32,
    /// Stop after this many steps (MLP default: all epochs; GPT default: 750).
    #[arg(long)]
    pub(crate) max_steps: Option<u64>,
    /// GPT and Llama: print each strategy's bytes per device (parameters,
    /// gradients, optimizer state, activations) at 1 device and at powers
    /// of two up to --devices, planned without opening a device; no training.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Testing the failure path: RANK:STEP[:panic] makes that rank fail at
    /// that step (an error, or a panic). Only in `fault-injection` builds.
    #[cfg(feature = "fault-injection")]
    #[arg(long, hide = true)]
    pub(crate) fail_at: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TokenizerName {
    /// One token per character of the training text.
    Char,
    /// GPT-2's byte-level BPE (r50k_base, 50,257 tokens).
    Gpt2,
}

/// The language models' flags; the defaults are `make train`'s run
/// ([`language_model_run`], [`AdamWSchedule`]).
#[derive(clap::Args)]
pub struct GptArgs {
    /// GPT: GPT-2's sizes by Hugging Face name (gpt2, gpt2-medium,
    /// gpt2-large, gpt2-xl) instead of --n-layer/--n-head/--n-embd, for a
    /// real GPU; Llama: small (default), smollm2-135m (SmolLM2-135M's
    /// architecture on 2048-token windows) or llama3.2-1b (Llama 3.2 1B's
    /// shapes); Qwen2: small (default), qwen2.5-0.5b or qwen2.5-1.5b;
    /// Qwen3: small (default) or qwen3-0.6b; Mistral: small
    /// (default) or mistral-7b-v0.1. --block-size may
    /// shorten or lengthen the context up to the preset's largest.
    #[arg(long, conflicts_with_all = ["n_layer", "n_head", "n_embd"])]
    preset: Option<String>,
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = MAKE_TRAIN_GPT.n_layer)]
    n_layer: usize,
    /// GPT: attention heads per block.
    #[arg(long, default_value_t = MAKE_TRAIN_GPT.n_head)]
    n_head: usize,
    /// GPT: channels.
    #[arg(long, default_value_t = MAKE_TRAIN_GPT.n_embd)]
    n_embd: usize,
    /// GPT and Llama: context length in tokens [default: 64, or the
    /// preset's].
    #[arg(long)]
    block_size: Option<usize>,
    /// GPT: the tokenizer.
    #[arg(long, value_enum, default_value_t = TokenizerName::Char)]
    tokenizer: TokenizerName,
    /// GPT: train on this UTF-8 text file instead of the shipped Shakespeare.
    #[arg(long)]
    text: Option<PathBuf>,
    /// GPT: steps of linear warmup before the cosine decay [default: 40;
    /// with --init 0].
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// GPT: the learning rate the cosine decays to at the last step
    /// [default: 3e-4; with --init the learning rate: constant, as
    /// nanoGPT's finetune_shakespeare].
    #[arg(long)]
    min_lr: Option<f32>,
    /// Fine-tune a pretrained model: a GGUF file (weights de-quantized to
    /// f32; with --lora kept quantized, see --base-dtype) or a Hugging Face
    /// GPT-2/Llama folder. Its config, weights and
    /// own tokenizer replace --preset, --n-* and --tokenizer; --block-size
    /// is the training windows' length (at most its context); AdamW starts
    /// fresh. --out gets a Hugging Face folder with its tokenizer files;
    /// --model is the file's unless given (a mismatch is an error). With
    /// --lora, --resume continues an adapter run over this model.
    #[arg(long, conflicts_with_all = ["preset", "n_layer", "n_head", "n_embd", "tokenizer"])]
    pub init: Option<PathBuf>,
    /// GPT and Llama: weight decay, on matrices only [default: 0.1 with AdamW
    /// (decoupled), 0 with Adam and SGD (an L2 term of the gradient, as in
    /// PyTorch)].
    #[arg(long)]
    weight_decay: Option<f32>,
    /// GPT: clip the gradients' global norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// GPT: the validation loss every this many steps.
    #[arg(long, default_value_t = language_model_run().eval_every)]
    eval_every: u64,
    /// GPT: batches of held-out windows per validation loss.
    #[arg(long, default_value_t = 16)]
    eval_batches: usize,
    /// GPT: the model folder written at the end.
    #[arg(long, default_value = "out/gpt")]
    out: PathBuf,
    /// GPT: tokens of the sample generated at the end (0: none).
    #[arg(long, default_value_t = 200)]
    sample_tokens: usize,
    /// GPT with --parallel pipeline: gpipe (every forward, then every
    /// backward) or 1f1b (one forward, one backward: fewer activations held).
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// GPT and Llama: how attention trains: fused (FlashAttention-2, no
    /// [T, T] scores stored), unfused (the scores and probabilities as
    /// separate ops), or auto: fused on GPUs, and on CPU adapters from the
    /// context where it is faster there.
    #[arg(long, value_enum, default_value_t = AttentionChoice::Auto)]
    attention: AttentionChoice,
    /// Train low-rank adapters over the frozen --init model instead of
    /// every weight: `r=16,alpha=32,dropout=0,targets=all-linear` (PEFT's
    /// names; targets may list modules, e.g. q_proj,v_proj). --out is then
    /// the PEFT adapter folder [default: out/lora]. Over a GGUF file the
    /// base stays quantized on the device (QLoRA; --base-dtype). With
    /// --dry-run, plans the adapters over the sized model (or --init's)
    /// beside full fine-tuning.
    #[arg(long)]
    pub(crate) lora: Option<String>,
    /// With --lora: how the frozen base is stored on the device. auto: a
    /// GGUF file's matrices as the file stores them (QLoRA: Q4_0, Q4_1,
    /// Q8_0, the k-quants; only the adapters train, the backward runs
    /// through the quantized weights), a folder's in f32; f32: every weight
    /// de-quantized to f32 (LoRA over the full-precision base); f16: the
    /// matrices in f16 (the token lookup needs SHADER_F16). With --dry-run
    /// and no --init, a format (q4_0, q4_1, q8_0, q4_k, q6_k, ...) plans a
    /// preset's matrices as that format.
    #[arg(long, default_value = "auto")]
    pub(crate) base_dtype: String,
}

/// `--lora`'s declaration.
pub(crate) fn lora_config(g: &GptArgs) -> wgrad::Result<LoraConfig> {
    LoraConfig::parse(g.lora.as_deref().unwrap_or_default())
}

/// PEFT's `print_trainable_parameters` line.
pub(crate) fn trainable_line(trainable: usize, all: usize) -> String {
    let grouped = |n: usize| {
        let digits = n.to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        out
    };
    format!(
        "trainable params: {} || all params: {} || trainable%: {:.4}",
        grouped(trainable),
        grouped(all),
        100.0 * trainable as f64 / all.max(1) as f64
    )
}

/// `--attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionChoice {
    Auto,
    Fused,
    Unfused,
}

impl AttentionChoice {
    fn kernel(self) -> Option<AttentionKernel> {
        match self {
            AttentionChoice::Auto => None,
            AttentionChoice::Fused => Some(AttentionKernel::Fused),
            AttentionChoice::Unfused => Some(AttentionKernel::Unfused),
        }
    }
}

/// What the command line knows of a language model family: its sizes
/// from the flags and a title for the plot.
pub trait CliModel: TrainableLm {
    /// `variant`: which of the Llama family `--model` named (a GPT has one).
    fn sizes(args: &GptArgs, variant: LlamaVariant) -> wgrad::Result<Self::Config>;
    fn title(config: &Self::Config) -> String;
    /// The pretrained model `--init` names, as this run trains it.
    fn pretrained(path: &std::path::Path, _args: &GptArgs) -> wgrad::Result<Pretrained<Self>> {
        Pretrained::load(path)
    }
    /// Whether a run checkpoints activations unless told otherwise: an
    /// adapter run over a quantized base, whose activations would
    /// otherwise outweigh what the quantized base saves.
    fn checkpoints_by_default(&self) -> bool {
        false
    }
    /// PEFT's trainable-parameters line, for a run that trains part of the model.
    fn trainable(&self) -> Option<String> {
        None
    }
    /// After the run wrote `dir`: what a folder of this model records of
    /// the `source` it was trained from.
    fn saved(&self, _dir: &std::path::Path, _source: Option<&std::path::Path>) -> wgrad::Result<()> {
        Ok(())
    }
    /// A model of `config` to plan memory with (`--dry-run`): built
    /// without values where the family can (its graph is planned, never
    /// run, and a 1B preset holds no 5 GB of random weights).
    fn planned(config: &Self::Config) -> wgrad::Result<Self> {
        Self::build(config)
    }
    /// For a run that trains part of the model (adapters): what full
    /// fine-tuning of the same model plans under `strategy` on `devices`.
    fn full_memory(
        &self,
        _strategy: Strategy,
        _devices: usize,
        _p: &Planning,
        _attention: AttentionKernel,
    ) -> Option<wgrad::Result<DeviceMemory>> {
        None
    }
}

impl<M: CliModel> CliModel for Lora<M> {
    /// The preset's sizes, the base stored as --base-dtype plans it.
    fn sizes(g: &GptArgs, variant: LlamaVariant) -> wgrad::Result<LoraLmConfig<M::Config>> {
        Ok(LoraLmConfig {
            storage: crate::train_memory::base_storage(&g.base_dtype, None)?,
            ..LoraLmConfig::new(M::sizes(g, variant)?, lora_config(g)?)
        })
    }
    fn title(c: &LoraLmConfig<M::Config>) -> String {
        format!("{} + LoRA r={} alpha={}", M::title(&c.base), c.lora.r, c.lora.alpha)
    }
    fn pretrained(path: &std::path::Path, g: &GptArgs) -> wgrad::Result<Pretrained<Self>> {
        let storage = crate::train_memory::base_storage(&g.base_dtype, Some(path))?;
        M::pretrained(path, g)?.with_lora_storage(lora_config(g)?, storage)
    }
    fn checkpoints_by_default(&self) -> bool {
        match self.base_storage() {
            BaseStorage::Quantized(matrices) => !matrices.is_empty(),
            BaseStorage::QuantizedAs(_) => true,
            BaseStorage::F32 | BaseStorage::F16 => false,
        }
    }
    fn trainable(&self) -> Option<String> {
        Some(format!(
            "{}\n{}",
            trainable_line(self.trainable_parameters(), self.num_parameters()),
            crate::train_memory::base_line(self.base_storage())
        ))
    }
    fn planned(c: &LoraLmConfig<M::Config>) -> wgrad::Result<Self> {
        Ok(Lora::new(M::planned(&c.base)?, c.lora.clone())?.with_base_storage(c.storage.clone()))
    }
    fn full_memory(
        &self,
        strategy: Strategy,
        devices: usize,
        p: &Planning,
        attention: AttentionKernel,
    ) -> Option<wgrad::Result<DeviceMemory>> {
        Some(M::planned(&self.base.config()).and_then(|mut base| {
            base.set_attention_kernel(attention);
            strategy_memory(&base, strategy, devices, p)
        }))
    }
    /// The adapter folder's config names the base it was trained over.
    fn saved(&self, dir: &std::path::Path, source: Option<&std::path::Path>) -> wgrad::Result<()> {
        let base = source.map(|p| p.display().to_string()).unwrap_or_default();
        let path = dir.join("adapter_config.json");
        std::fs::write(&path, wgrad::io::peft::config_json(&self.config, &base)).map_err(|source| {
            wgrad::Error::CheckpointIo {
                path,
                action: "write",
                source,
            }
        })
    }
}

/// A preset's context, or --block-size's where given: at least 1, and at
/// most `most` positions where the preset has a largest.
fn preset_context(g: &GptArgs, name: &str, context: usize, most: Option<usize>) -> wgrad::Result<usize> {
    let refuse = |reason: String| {
        Err(wgrad::Error::InvalidArgument {
            op: "train --block-size",
            reason,
        })
    };
    match (g.block_size, most) {
        (None, _) => Ok(context),
        (Some(0), _) => refuse("a context of 0 positions: give at least 1".into()),
        (Some(n), Some(most)) if n > most => {
            refuse(format!("{n} positions for the preset `{name}`: give 1 to its {most}"))
        }
        (Some(n), _) => Ok(n),
    }
}

impl CliModel for Gpt {
    fn planned(config: &GptConfig) -> wgrad::Result<Self> {
        Gpt::empty(*config)
    }
    fn sizes(g: &GptArgs, _: LlamaVariant) -> wgrad::Result<GptConfig> {
        let Some(name) = g.preset.as_deref() else {
            let block_size = g.block_size.unwrap_or(MAKE_TRAIN_GPT.block_size);
            return Ok(GptConfig {
                vocab_size: 0,
                n_layer: g.n_layer,
                n_head: g.n_head,
                n_embd: g.n_embd,
                block_size,
            });
        };
        let preset = GptConfig::preset(name)?;
        // GPT-2's learned position table: its rows are the most.
        let block_size = preset_context(g, name, preset.block_size, Some(preset.block_size))?;
        Ok(GptConfig { block_size, ..preset })
    }
    fn title(c: &GptConfig) -> String {
        format!("GPT L{} H{} C{} T{}", c.n_layer, c.n_head, c.n_embd, c.block_size)
    }
}

impl CliModel for Gemma {
    fn planned(config: &GemmaConfig) -> wgrad::Result<Self> {
        Gemma::empty(*config)
    }
    /// `--preset` names a Gemma 3 preset (default `small`, whose sliding
    /// window is its whole context).
    fn sizes(g: &GptArgs, _: LlamaVariant) -> wgrad::Result<GemmaConfig> {
        let name = g.preset.as_deref().unwrap_or("small");
        let preset = GemmaConfig::preset(name, 0)?;
        let block_size = preset_context(g, name, preset.block_size, Some(GemmaConfig::gemma3_270m().block_size))?;
        let sliding_window = if name == "small" {
            block_size
        } else {
            preset.sliding_window
        };
        Ok(GemmaConfig {
            block_size,
            sliding_window,
            ..preset
        })
    }
    fn title(c: &GemmaConfig) -> String {
        format!(
            "Gemma3 L{} H{}/{} C{} T{}",
            c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.block_size
        )
    }
}

impl CliModel for Llama {
    fn planned(config: &LlamaConfig) -> wgrad::Result<Self> {
        Llama::empty(*config)
    }
    /// `--preset` names a preset of the variant (default `small`).
    fn sizes(g: &GptArgs, variant: LlamaVariant) -> wgrad::Result<LlamaConfig> {
        let name = g.preset.as_deref().unwrap_or("small");
        let preset = match variant {
            LlamaVariant::Mistral => mistral::preset(name, 0)?,
            _ => qwen::preset(variant, name, 0)?,
        };
        // SmolLM2 trains on 2048 positions of the 8192 it serves; the other
        // presets' rotary positions take any context.
        let most = (name == "smollm2-135m").then_some(LlamaConfig::smollm2_135m().block_size);
        let block_size = preset_context(g, name, preset.block_size, most)?;
        Ok(LlamaConfig { block_size, ..preset })
    }
    fn title(c: &LlamaConfig) -> String {
        format!(
            "{} L{} H{}/{} C{} T{}",
            c.variant.names().2,
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.n_embd,
            c.block_size
        )
    }
}

/// A language model's run (`--model gpt|llama|qwen2|qwen3|mistral`, the Llama
/// family's `variant`); across the processes of `process_group` when
/// given, where only rank 0 prints, saves and samples.
fn train_language_model<M: CliModel>(
    opts: &DeviceOptions,
    args: &TrainArgs,
    process_group: Option<Arc<dyn ProcessGroup>>,
    variant: LlamaVariant,
) -> wgrad::Result<()> {
    let g = &args.gpt;
    let defaults = language_model_run();
    let max_steps = args.max_steps.or(defaults.max_steps).unwrap_or(1);
    let pretrained = match &g.init {
        Some(path) => {
            // Adapters declared over the model draw their A from --seed.
            wgrad::nn::manual_seed(args.seed);
            let bar = spinner("loading the pretrained model");
            let loaded = M::pretrained(path, g);
            bar.finish_and_clear();
            let loaded = loaded?;
            if let Some(line) = loaded.model.trainable() {
                println!("{line}");
            }
            Some(loaded)
        }
        None => None,
    };
    let lr = args.lr.unwrap_or(AdamWSchedule::default().lr);
    let update = match args.optimizer.unwrap_or(OptimizerName::Adamw) {
        OptimizerName::Adamw => LmUpdate::AdamW,
        OptimizerName::Adam => LmUpdate::Adam,
        OptimizerName::Sgd => LmUpdate::Sgd {
            momentum: args.momentum,
        },
    };
    let decay = if update == LmUpdate::AdamW {
        AdamWSchedule::default().weight_decay
    } else {
        0.0
    };
    let schedule = AdamWSchedule {
        lr,
        min_lr: g.min_lr.unwrap_or(if pretrained.is_some() {
            lr
        } else {
            AdamWSchedule::default().min_lr
        }),
        warmup_steps: g.warmup_steps.unwrap_or(if pretrained.is_some() {
            0
        } else {
            AdamWSchedule::default().warmup_steps
        }),
        weight_decay: g.weight_decay.unwrap_or(decay),
        clip_grad_norm: (g.clip > 0.0).then_some(g.clip),
        ..AdamWSchedule::default()
    };
    let mut config = TrainConfig {
        optimizer: schedule.optimizer_for(update, max_steps),
        eval_every: g.eval_every,
        schedule: Schedule::parse(&g.schedule)?,
        save: Some(out_folder(args)),
        ..run_config(args, defaults)?
    };
    if args.checkpoint_activations.is_none() && pretrained.as_ref().is_some_and(|p| p.model.checkpoints_by_default()) {
        config.checkpoint_activations = true;
        println!("{CHECKPOINTING_QLORA}");
    }
    if args.dry_run {
        return dry_run::<M>(args, &config, variant, pretrained.as_ref());
    }
    let task = LanguageModel::<M> {
        text: g.text.clone().map_or(TextSource::Shakespeare, TextSource::File),
        tokenizer: tokenizer_kind(g.tokenizer),
        eval_batches: g.eval_batches,
        ..LanguageModel::new(match &pretrained {
            Some(p) => M::with_context(p.model.config(), g.block_size.unwrap_or(MAKE_TRAIN_GPT.block_size)),
            None => M::sizes(g, variant)?,
        })
    };
    let task = LanguageModel {
        init: pretrained,
        attention: g.attention.kernel(),
        ..task
    };
    let mut bars = Bars::default();
    let mut run = TrainingRun::new(opts, config, task, process_group, &mut bars)?;
    // A resumed adapter run continues: no step-0 loss or sample again.
    let start_loss = match run.task().init.as_ref().map(|p| p.source.clone()) {
        Some(source) if args.resume.is_none() => fine_tune_start(&mut run, &source, args)?,
        _ => None,
    };
    let Some(summary) = run.fit(&mut bars)? else {
        return Ok(());
    };
    print_summary(&summary, "tokens");
    let Evaluation::ValidationLoss(validation) = summary.evaluation else {
        return Err(wgrad::Error::InvalidArgument {
            op: "train",
            reason: "a language model's run gave no validation loss".into(),
        });
    };
    println!("final validation loss {validation:.4}");
    let out = out_folder(args);
    if args.gpt.lora.is_some() {
        run.model().saved(&out, g.init.as_deref())?;
        println!("adapter folder: {}", out.display());
    } else {
        println!("model folder: {}", out.display());
    }
    if let Some((start, (step, end))) = start_loss.zip(summary.validation_curve.last().copied()) {
        println!(
            "held-out loss: step 0 {start:.4}, step {step} {end:.4} ({:+.4} nats)",
            end - start
        );
    }
    print_sample(&run, "sample", args)?;
    let title = format!("{}: validation loss {validation:.4}", M::title(&run.model().config()));
    plot::loss_curves(
        &args.plot,
        &title,
        &[
            ("train", &summary.train_curve),
            ("validation", &summary.validation_curve),
        ],
    )?;
    println!("loss curves: {}", args.plot.display());
    Ok(())
}

/// Where the run writes: --out, whose default for an adapter run is
/// `out/lora` (the PEFT folder) rather than a model's `out/gpt`.
fn out_folder(args: &TrainArgs) -> PathBuf {
    if args.gpt.lora.is_some() && !args.given.iter().any(|g| g == "out") {
        PathBuf::from("out/lora")
    } else {
        args.gpt.out.clone()
    }
}

/// A language model's run of family `M`, or of adapters over it with --lora.
fn train_family<M: CliModel>(
    opts: &DeviceOptions,
    args: &TrainArgs,
    process_group: Option<Arc<dyn ProcessGroup>>,
    variant: LlamaVariant,
) -> wgrad::Result<()> {
    if args.gpt.lora.is_some() {
        train_language_model::<Lora<M>>(opts, args, process_group, variant)
    } else {
        train_language_model::<M>(opts, args, process_group, variant)
    }
}

fn tokenizer_kind(name: TokenizerName) -> TokenizerKind {
    match name {
        TokenizerName::Char => TokenizerKind::Char,
        TokenizerName::Gpt2 => TokenizerKind::Gpt2,
    }
}

/// Said where QLoRA turns activation checkpointing on by itself.
const CHECKPOINTING_QLORA: &str = "activation checkpointing: on, as QLoRA trains (the base is quantized; \
                                   --checkpoint-activations=false turns it off)";

/// `--dry-run`: each strategy's bytes on the fullest device, at 1 device
/// and at each power of two up to --devices (and --devices itself),
/// planned without a device. The model takes its preset's vocabulary, or
/// the text's under the chosen tokenizer when the sizes leave it open.
fn dry_run<M: CliModel>(
    args: &TrainArgs,
    config: &TrainConfig,
    variant: LlamaVariant,
    pretrained: Option<&Pretrained<M>>,
) -> wgrad::Result<()> {
    use wgrad::parallel::memory::every_strategy;
    let g = &args.gpt;
    wgrad::nn::manual_seed(args.seed);
    let mut model = match pretrained {
        // --init with --lora: the adapters over the file on the run's windows.
        Some(p) => p.cropped(g.block_size.unwrap_or(MAKE_TRAIN_GPT.block_size))?,
        None => {
            let sizes = M::sizes(g, variant)?;
            let sizes = if wgrad::nn::LmConfig::lm_sizes(&sizes).vocab_size > 0 {
                sizes
            } else {
                let text = wgrad::train::read_text(&g.text.clone().map_or(TextSource::Shakespeare, TextSource::File))?;
                let vocab = wgrad::train::tokenize_text(&text, tokenizer_kind(g.tokenizer), 0.1)?
                    .tokenizer
                    .vocab_size();
                M::with_vocab(sizes, vocab)
            };
            M::planned(&sizes)?
        }
    };
    // A pretrained model's line is printed as it loads.
    if let (None, Some(line)) = (pretrained, model.trainable()) {
        println!("{line}");
    }
    // Attention as --attention names it; auto plans fused, what a GPU
    // trains (a CPU adapter trains short windows unfused, which holds the
    // scores: more activations than planned here).
    let attention = g.attention.kernel().unwrap_or_default();
    model.set_attention_kernel(attention);
    if g.attention == AttentionChoice::Auto {
        println!("attention planned fused, as a GPU trains (--attention unfused plans what a CPU adapter runs below {} positions)", wgrad::nn::CPU_FUSED_ATTENTION_MIN_SEQ);
    }
    // A preset planned under QLoRA checkpoints as a run over a file would.
    let mut config = config.clone();
    if pretrained.is_none() && args.checkpoint_activations.is_none() && model.checkpoints_by_default() {
        config.checkpoint_activations = true;
        println!("{CHECKPOINTING_QLORA}");
    }
    let config = &config;
    let most = match &config.devices {
        Some(selection) => selection.check()?,
        None => 2,
    };
    let mut counts = vec![1];
    while counts.last().is_some_and(|&n| n * 2 < most) {
        counts.push(counts[counts.len() - 1] * 2);
    }
    if most > 1 {
        counts.push(most);
    }
    let planning = Planning {
        criterion: wgrad::nn::CrossEntropyLoss.into(),
        optimizer: config.optimizer,
        batch: config.batch_size,
        micro_batches: config.micro_batches,
        device_alignment: 256,
        precision: config.precision,
        checkpoint_activations: config.checkpoint_activations,
    };
    let context = model.lm_sizes().context;
    println!(
        "{}: {} parameters, vocabulary {}; batch {} × {context} tokens; {}",
        M::title(&model.config()),
        model.num_parameters(),
        model.vocab_size(),
        config.batch_size,
        wgrad::optim::describe(&config.optimizer)
    );
    let mut rows = Vec::new();
    for &n in &counts {
        let strategies = if n == 1 {
            vec![("single".to_string(), Strategy::Single)]
        } else {
            every_strategy()
        };
        for (name, strategy) in strategies {
            rows.push((n, name, strategy, strategy_memory(&model, strategy, n, &planning)));
        }
    }
    // MiB, or KiB for a small model (whose MiB would all read 0.0).
    let largest = rows
        .iter()
        .filter_map(|(_, _, _, m)| m.as_ref().ok())
        .map(|m| m.total())
        .max()
        .unwrap_or(0);
    let (unit, scale) = if largest >= 10 << 20 {
        ("MiB", 1024.0 * 1024.0)
    } else {
        ("KiB", 1024.0)
    };
    println!("bytes on the fullest device ({unit}), planned without a device; ZeRO-1: the whole-arena engine (whole parameters and gradients, a shard of the state), ZeRO-2/3: what the stage-by-stage engine allocates");
    let mut planned_as = Vec::new();
    if config.precision == wgrad::graph::Precision::F16 {
        planned_as.push("f16 activations (assumes every device has SHADER_F16; without it a run keeps f32)");
    }
    if config.checkpoint_activations {
        planned_as.push("checkpointed activations (recomputed block by block where the engine recomputes)");
    }
    if !planned_as.is_empty() {
        println!("planned with {}", planned_as.join(", "));
    }
    println!(
        "{:>7}  {:<9} {:>11} {:>11} {:>11} {:>12} {:>11}",
        "devices", "strategy", "parameters", "gradients", "optimizer", "activations", "total"
    );
    let v = |b: u64| format!("{:.1}", b as f64 / scale);
    for (n, name, _, memory) in &rows {
        match memory {
            Ok(m) => println!(
                "{n:>7}  {name:<9} {:>11} {:>11} {:>11} {:>12} {:>11}",
                v(m.parameters),
                v(m.gradients),
                v(m.optimizer_state),
                v(m.activations),
                v(m.total())
            ),
            Err(e) => println!("{n:>7}  {name:<9} cannot: {e}"),
        }
    }
    crate::train_memory::beside_full_fine_tuning(&model, &rows, &planning, attention, (unit, scale))
}

/// A fine-tune's start, printed before its first step: the source, the
/// held-out loss at step 0 (returned) and a sample of the pretrained model.
fn fine_tune_start<M: CliModel>(
    run: &mut TrainingRun<LanguageModel<M>>,
    source: &std::path::Path,
    args: &TrainArgs,
) -> wgrad::Result<Option<f32>> {
    let optimizer = format!("{:?}", args.optimizer.unwrap_or(OptimizerName::Adamw)).to_lowercase();
    println!("fine-tuning {} (fresh {optimizer} state)", source.display());
    let loss = run.validation_loss()?;
    if let Some(loss) = loss {
        println!("held-out loss at step 0: {loss:.4}");
    }
    print_sample(run, "sample before fine-tuning", args)?;
    Ok(loss)
}

/// `--sample-tokens` tokens of the model as trained so far after the
/// task's prompt, by the run's tokenizer (temperature 0.8, top-k 40).
fn print_sample<M: CliModel>(run: &TrainingRun<LanguageModel<M>>, title: &str, args: &TrainArgs) -> wgrad::Result<()> {
    let tokens = args.gpt.sample_tokens;
    if tokens == 0 {
        return Ok(());
    }
    let task = run.task();
    let model = task.trained_model(run.engine(), run.model())?;
    let tokenizer = task.text_tokenizer().ok_or_else(|| wgrad::Error::InvalidArgument {
        op: "train",
        reason: "the run has no tokenizer".into(),
    })?;
    let sampling = Sampling {
        temperature: 0.8,
        top_k: Some(40),
        top_p: None,
        seed: args.seed,
    };
    println!("{title} (temperature 0.8, top-k 40, seed {}):", args.seed);
    let (count, seconds) = sample(
        &model,
        run.kernels().clone(),
        tokenizer,
        &task.sample_prompt()?,
        tokens,
        &sampling,
    )?;
    println!("({count} tokens at {:.1} tokens/s)", count as f64 / seconds.max(1e-9));
    Ok(())
}

pub fn train(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    let kind = model_kind(args)?;
    train_flags::check(args, kind)?;
    let run = |process_group: Option<Arc<dyn ProcessGroup>>| match kind {
        ModelKind::Gpt => train_family::<wgrad::models::Gpt>(opts, args, process_group, LlamaVariant::Llama),
        ModelKind::Llama => train_family::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Llama),
        ModelKind::Qwen2 => train_family::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Qwen2),
        ModelKind::Qwen3 => train_family::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Qwen3),
        ModelKind::Mistral => train_family::<wgrad::models::Llama>(opts, args, process_group, LlamaVariant::Mistral),
        ModelKind::Gemma3 => train_family::<wgrad::models::Gemma>(opts, args, process_group, LlamaVariant::Llama),
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
        GgufArchitecture::Gpt2 { .. } | GgufArchitecture::Gemma3(_) => LlamaVariant::Llama,
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
            LlamaVariant::Mistral => (ModelKind::Mistral, "mistral"),
        },
        wgrad::io::lm_folder::LmFamily::Gemma3 => (ModelKind::Gemma3, "gemma3"),
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
pub(crate) fn train_mpi_missing(op: &'static str) -> wgrad::Result<()> {
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

/// Bytes by what they hold, in MiB; the total in bytes too (what a dry
/// run planned, to the byte).
pub(crate) fn memory_line(m: &wgrad::parallel::memory::DeviceMemory) -> String {
    format!(
        "parameters {}, gradients {}, optimizer state {}, activations {}; total {} ({} bytes)",
        mib(m.parameters),
        mib(m.gradients),
        mib(m.optimizer_state),
        mib(m.activations),
        mib(m.total()),
        m.total()
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
        checkpoint_activations: args.checkpoint_activations.unwrap_or(false),
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
