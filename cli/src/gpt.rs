//! `wgrad train --model gpt`: a GPT on text, with a progress bar, the
//! validation loss, both curves in the PNG, the model folder and a sample.

use std::path::PathBuf;
use std::sync::Arc;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling, WeightDtype};
use wgrad::io::text::{Tokenizer, Utf8Stream};
use wgrad::models::{qwen, Llama, LlamaConfig, LlamaVariant};
use wgrad::models::{Gemma, GemmaConfig, Gpt, GptConfig};
use wgrad::nn::{AttentionKernel, CausalLm};
use wgrad::parallel::distributed::ProcessGroup;
use wgrad::parallel::pipeline::Schedule;
use wgrad::train::{language_model_run, AdamWSchedule, LanguageModel, LmUpdate, Pretrained, TextSource};
use wgrad::train::{Evaluation, TrainConfig, TrainingRun};
use wgrad::train::{TokenizerKind, TrainableLm, MAKE_TRAIN_GPT};
use wgrad::{DeviceOptions, Kernels};

use crate::{plot, spinner, Bars, OptimizerName, TrainArgs};

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
    /// real GPU; Llama: small (default) or smollm2-135m (SmolLM2-135M's
    /// architecture on 2048-token windows); Qwen2: small (default) or
    /// qwen2.5-0.5b; Qwen3: small (default) or qwen3-0.6b. --block-size may
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
    /// f32) or a Hugging Face GPT-2/Llama folder. Its config, weights and
    /// own tokenizer replace --preset, --n-* and --tokenizer; --block-size
    /// is the training windows' length (at most its context); AdamW starts
    /// fresh. --out gets a Hugging Face folder with its tokenizer files;
    /// --model is the file's unless given (a mismatch is an error).
    #[arg(long, conflicts_with_all = ["preset", "n_layer", "n_head", "n_embd", "tokenizer", "resume"])]
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
}

/// Streams a sample of `tokens` tokens after `prompt` from any causal
/// language model: (tokens, seconds).
fn sample(
    model: &dyn CausalLm,
    kernels: Arc<Kernels>,
    tokenizer: &Tokenizer,
    prompt: &str,
    tokens: usize,
    sampling: &Sampling,
) -> wgrad::Result<(usize, f64)> {
    let mut generator = prepared_generator(kernels, model, &GeneratorOptions::default())?;
    let ids = tokenizer.encode(prompt)?;
    stream(&mut generator, tokenizer, prompt, &ids, tokens, sampling)
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
    /// `--preset` names a preset of the variant (default `small`).
    fn sizes(g: &GptArgs, variant: LlamaVariant) -> wgrad::Result<LlamaConfig> {
        let name = g.preset.as_deref().unwrap_or("small");
        let preset = qwen::preset(variant, name, 0)?;
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

/// A language model's run (`--model gpt|llama|qwen2|qwen3`, the Llama
/// family's `variant`); across the processes of `process_group` when
/// given, where only rank 0 prints, saves and samples.
pub fn train<M: CliModel>(
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
            let bar = crate::spinner("loading the pretrained model");
            let loaded = Pretrained::<M>::load(path);
            bar.finish_and_clear();
            Some(loaded?)
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
    let config = TrainConfig {
        optimizer: schedule.optimizer_for(update, max_steps),
        eval_every: g.eval_every,
        schedule: Schedule::parse(&g.schedule)?,
        save: Some(g.out.clone()),
        ..crate::run_config(args, defaults)?
    };
    if args.dry_run {
        return dry_run::<M>(args, &config, variant);
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
    let start_loss = match run.task().init.as_ref().map(|p| p.source.clone()) {
        Some(source) => fine_tune_start(&mut run, &source, args)?,
        None => None,
    };
    let Some(summary) = run.fit(&mut bars)? else {
        return Ok(());
    };
    crate::print_summary(&summary, "tokens");
    let Evaluation::ValidationLoss(validation) = summary.evaluation else {
        return Err(wgrad::Error::InvalidArgument {
            op: "train",
            reason: "a language model's run gave no validation loss".into(),
        });
    };
    println!("final validation loss {validation:.4}");
    println!("model folder: {}", g.out.display());
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

fn tokenizer_kind(name: TokenizerName) -> TokenizerKind {
    match name {
        TokenizerName::Char => TokenizerKind::Char,
        TokenizerName::Gpt2 => TokenizerKind::Gpt2,
    }
}

/// `--dry-run`: each strategy's bytes on the fullest device, at 1 device
/// and at each power of two up to --devices (and --devices itself),
/// planned without a device. The model takes its preset's vocabulary, or
/// the text's under the chosen tokenizer when the sizes leave it open.
fn dry_run<M: CliModel>(args: &TrainArgs, config: &TrainConfig, variant: LlamaVariant) -> wgrad::Result<()> {
    use wgrad::parallel::engine::Strategy;
    use wgrad::parallel::memory::{every_strategy, strategy_memory, Planning};
    let g = &args.gpt;
    let sizes = M::sizes(g, variant)?;
    wgrad::nn::manual_seed(args.seed);
    let sizes = if wgrad::nn::LmConfig::lm_sizes(&sizes).vocab_size > 0 {
        sizes
    } else {
        let text = wgrad::train::read_text(&g.text.clone().map_or(TextSource::Shakespeare, TextSource::File))?;
        let vocab = wgrad::train::tokenize_text(&text, tokenizer_kind(g.tokenizer), 0.1)?
            .tokenizer
            .vocab_size();
        M::with_vocab(sizes, vocab)
    };
    let model = M::build(&sizes)?;
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
            rows.push((n, name, strategy_memory(&model, strategy, n, &planning)));
        }
    }
    // MiB, or KiB for a small model (whose MiB would all read 0.0).
    let largest = rows
        .iter()
        .filter_map(|(_, _, m)| m.as_ref().ok())
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
    for (n, name, memory) in rows {
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
    Ok(())
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

/// How the next token is picked, for `generate` and `chat`.
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// 0: greedy (the most likely token, deterministic).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: among the fewest most likely tokens whose
    /// probability reaches p, in (0, 1].
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

/// `wgrad generate`'s flags.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A model: a llama.cpp GGUF file (a Llama's quantized matrices stay
    /// quantized on the GPU), or a folder, a GPT-2 or a Llama by its
    /// config.json (`wgrad train --model gpt` writes out/gpt; Hugging Face
    /// folders work too, with their tokenizer.json when they have one).
    #[arg(long, default_value = "out/gpt")]
    model: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Token ids to continue instead of --prompt's text, separated by
    /// commas or spaces (a folder without a tokenizer needs --print-ids).
    #[arg(long, conflicts_with = "prompt")]
    prompt_ids: Option<String>,
    /// Print token ids instead of text: a line `prompt_ids …`, then
    /// `new_ids …` with each new token as it comes.
    #[arg(long)]
    print_ids: bool,
    /// Several prompts at once, one per line (blank lines skipped; token
    /// ids with --print-ids), generated together in the same steps, each
    /// with its own KV cache. Each sequence prints when all are done.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids"])]
    prompts_file: Option<PathBuf>,
    /// Continue the prompt this many times at once (with a temperature
    /// above 0, as many different samples), printed as --prompts-file's are.
    #[arg(long, conflicts_with = "prompts_file")]
    batch: Option<usize>,
    /// The most new tokens; a model with its own tokenizer also stops at
    /// its end-of-sequence or end-of-turn token.
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// How the weights are stored: f16 halves the bytes each token reads
    /// (the projections and the token embedding; computed in f32), where
    /// the adapter has SHADER_F16; elsewhere f32, with a notice. Default:
    /// f32, but a GGUF file's quantized matrices as the file stores them
    /// (any --dtype de-quantizes them).
    #[arg(long, value_enum)]
    dtype: Option<DtypeName>,
    /// Positions the KV cache holds (default: the model's context; for a
    /// GGUF file's or tokenizer.json folder's one prompt, its tokens and
    /// --max-new-tokens rounded up to a power of two from 64): fewer for
    /// less memory (SmolLM2's 8192 are 180 MiB of keys and values).
    #[arg(long)]
    context: Option<usize>,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeName {
    F32,
    F16,
}

impl DtypeName {
    pub fn weights(self) -> WeightDtype {
        match self {
            DtypeName::F32 => WeightDtype::F32,
            DtypeName::F16 => WeightDtype::F16,
        }
    }
}

fn write_out(out: &mut std::io::StdoutLock, s: &str) -> wgrad::Result<()> {
    use std::io::Write;
    out.write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| wgrad::Error::InvalidArgument {
            op: "generate",
            reason: format!("writing to stdout: {e}"),
        })
}

/// Streams `max_new_tokens` tokens after `prompt` to stdout as they are
/// produced; returns the tokens generated and the seconds they took, the
/// prompt's prefill included.
fn stream(
    generator: &mut Generator,
    tokenizer: &Tokenizer,
    prompt: &str,
    ids: &[u32],
    max_new_tokens: usize,
    sampling: &Sampling,
) -> wgrad::Result<(usize, f64)> {
    let mut text = Utf8Stream::default();
    let mut out = std::io::stdout().lock();
    let start = std::time::Instant::now();
    let mut wrote_prompt = false;
    let tokens = generator.generate(ids, max_new_tokens, sampling, |token| {
        // The prompt prints once it was accepted (it fits the context).
        if !wrote_prompt {
            write_out(&mut out, prompt)?;
            wrote_prompt = true;
        }
        let piece = text.push(&tokenizer.decode_bytes(&[token])?);
        write_out(&mut out, &piece)
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let rest = text.finish();
    write_out(&mut out, &format!("{rest}\n"))?;
    Ok((tokens.len(), seconds))
}

/// [`stream`] for `--print-ids`: the prompt's ids on one line, then the
/// new ones on the next as they come.
fn stream_ids(
    generator: &mut Generator,
    ids: &[u32],
    max_new_tokens: usize,
    sampling: &Sampling,
) -> wgrad::Result<(usize, f64)> {
    let mut out = std::io::stdout().lock();
    let start = std::time::Instant::now();
    let mut wrote_prompt = false;
    let tokens = generator.generate(ids, max_new_tokens, sampling, |token| {
        if !wrote_prompt {
            let prompt: Vec<String> = ids.iter().map(u32::to_string).collect();
            write_out(&mut out, &format!("prompt_ids {}\nnew_ids", prompt.join(" ")))?;
            wrote_prompt = true;
        }
        write_out(&mut out, &format!(" {token}"))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    write_out(&mut out, "\n")?;
    Ok((tokens.len(), seconds))
}

/// Token ids separated by commas or white space; `source` names where
/// they came from in an error (`--prompt-ids`, a line of --prompts-file).
fn parse_ids(text: &str, source: &str) -> wgrad::Result<Vec<u32>> {
    let ids = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| wgrad::Error::InvalidArgument {
                op: "generate",
                reason: format!("{source}: `{s}` is not a token id"),
            })
        })
        .collect::<wgrad::Result<Vec<u32>>>()?;
    if ids.is_empty() {
        return Err(wgrad::Error::InvalidArgument {
            op: "generate",
            reason: format!("{source} holds no ids"),
        });
    }
    Ok(ids)
}

/// A generator of `sequences` sequences for `model` with its weights
/// stored as `dtype`, behind a spinner while its pipelines compile; a
/// notice on stderr when the adapter cannot store them so and f32 is used.
fn prepared_generator(
    kernels: Arc<Kernels>,
    model: &dyn CausalLm,
    options: &GeneratorOptions,
) -> wgrad::Result<Generator> {
    let bar = spinner("preparing kernels");
    let label = kernels.device().label();
    let dtype = options.dtype;
    let generator = Generator::with_options(kernels, model, options);
    bar.finish_and_clear();
    let generator = generator?;
    if generator.dtype() != dtype {
        eprintln!(
            "note: --dtype {} needs SHADER_F16, which {label} lacks; generating with {} weights",
            dtype.name(),
            generator.dtype().name()
        );
    }
    Ok(generator)
}

pub fn generate(opts: &DeviceOptions, args: &GenerateArgs) -> wgrad::Result<()> {
    if args.max_new_tokens == 0 {
        return Err(wgrad::Error::InvalidArgument {
            op: "generate",
            reason: "--max-new-tokens must be at least 1".into(),
        });
    }
    if args.batch == Some(0) {
        return Err(wgrad::Error::InvalidArgument {
            op: "generate",
            reason: "--batch must be at least 1".into(),
        });
    }
    if args.prompt_ids.is_some() && !args.print_ids {
        return Err(wgrad::Error::InvalidArgument {
            op: "generate",
            reason: "--prompt-ids goes with --print-ids".into(),
        });
    }
    if crate::chat::has_own_tokenizer(&args.model) {
        if args.prompts_file.is_some() || args.batch.is_some() {
            return Err(wgrad::Error::InvalidArgument { op: "generate", reason: "--prompts-file and --batch run models with wgrad's own tokenizers; a GGUF file or a tokenizer.json folder generates one prompt".into() });
        }
        let ids = args
            .prompt_ids
            .as_deref()
            .map(|ids| parse_ids(ids, "--prompt-ids"))
            .transpose()?;
        return crate::chat::generate(
            opts,
            &args.model,
            &args.prompt,
            ids,
            args.print_ids,
            args.max_new_tokens,
            &args.sampling,
            args.dtype,
            args.context,
        );
    }
    // The prompts as given: (text, whether it is token ids), each once.
    let given: Vec<(String, &str)> = match (&args.prompts_file, &args.prompt_ids) {
        (Some(path), _) => read_prompts(path)?
            .into_iter()
            .map(|line| (line, if args.print_ids { "a line of --prompts-file" } else { "" }))
            .collect(),
        (None, Some(ids)) => vec![(ids.clone(), "--prompt-ids")],
        (None, None) => vec![(args.prompt.clone(), "")],
    };
    // The sizes first: a model the adapter cannot hold is refused before
    // its weights are read.
    // A GPT-2 or a Llama folder, by its config.json.
    let config = wgrad::io::lm_folder::read_lm_config(&args.model)?;
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let dtype = args.dtype.unwrap_or(DtypeName::F32).weights();
    let copies = args.batch.unwrap_or(1);
    let sequences = given.len() * copies;
    let options = GeneratorOptions {
        sequences,
        context: args.context,
        dtype,
        ..GeneratorOptions::default()
    };
    wgrad::infer::generate::check_fits_with_options(&kernels, config.as_ref(), &options)?;
    let sizes = config.lm_sizes();
    let context = options.context_for(sizes.context)?;
    let loaded = wgrad::io::lm_folder::load_lm_folder(&args.model)?;
    // Every prompt's ids, checked before any device work: ids in the
    // vocabulary, text in the tokenizer's alphabet, lengths in the context.
    let needs_tokenizer = given.iter().any(|(_, ids_source)| ids_source.is_empty());
    let tokenizer = if needs_tokenizer {
        Some(folder_tokenizer(&loaded, args)?)
    } else {
        None
    };
    let mut prompts = Vec::with_capacity(sequences);
    for (s, (text, ids_source)) in given.iter().enumerate() {
        let ids = match &tokenizer {
            Some(t) if ids_source.is_empty() => t.encode(text)?,
            _ => parse_ids(text, ids_source)?,
        };
        wgrad::kernels::check_token_ids("generate", &ids, sizes.vocab_size)?;
        if ids.len() > context {
            let which = if given.len() > 1 {
                format!("prompt {s}")
            } else {
                "the prompt".into()
            };
            return Err(wgrad::Error::InvalidArgument {
                op: "generate",
                reason: format!("{which} has {} tokens, more than the context of {context}", ids.len()),
            });
        }
        prompts.push(ids);
    }
    let texts: Vec<String> = given
        .iter()
        .flat_map(|(text, _)| std::iter::repeat_n(text.clone(), copies))
        .collect();
    let prompts: Vec<Vec<u32>> = prompts
        .into_iter()
        .flat_map(|ids| std::iter::repeat_n(ids, copies))
        .collect();
    let sampling = args.sampling.sampling();
    let mut generator = prepared_generator(kernels.clone(), loaded.model.as_ref(), &options)?;
    let text_tokenizer = if args.print_ids { None } else { tokenizer.as_ref() };
    let (count, seconds) = if args.prompts_file.is_some() || args.batch.is_some() {
        generate_batch(
            &mut generator,
            text_tokenizer,
            &texts,
            &prompts,
            args.max_new_tokens,
            &sampling,
        )?
    } else {
        match text_tokenizer {
            Some(tokenizer) => stream(
                &mut generator,
                tokenizer,
                &texts[0],
                &prompts[0],
                args.max_new_tokens,
                &sampling,
            )?,
            None => stream_ids(&mut generator, &prompts[0], args.max_new_tokens, &sampling)?,
        }
    };
    eprintln!(
        "{count} tokens in {seconds:.2} s: {:.1} tokens/s on {}",
        count as f64 / seconds.max(1e-9),
        kernels.device().label()
    );
    Ok(())
}

/// `--prompts-file`: its non-blank lines, at least one.
fn read_prompts(path: &std::path::Path) -> wgrad::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| wgrad::Error::InvalidArgument {
        op: "generate",
        reason: format!("--prompts-file {}: {e}", path.display()),
    })?;
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if prompts.is_empty() {
        return Err(wgrad::Error::InvalidArgument {
            op: "generate",
            reason: format!("--prompts-file {} holds no prompt (one per line)", path.display()),
        });
    }
    Ok(prompts)
}

/// Several prompts in the same steps ([`Generator::generate_batch`]);
/// a progress bar counts the steps, and each sequence prints when all are
/// done: its prompt and continuation as text, or `prompt_ids S …` and
/// `new_ids S …` lines without a tokenizer. Returns the tokens generated
/// (all sequences) and the seconds they took, the prefill included.
fn generate_batch(
    generator: &mut Generator,
    tokenizer: Option<&Tokenizer>,
    texts: &[String],
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    sampling: &Sampling,
) -> wgrad::Result<(usize, f64)> {
    let bar = ProgressBar::new(max_new_tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps of {msg} sequences {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(prompts.len().to_string());
    let start = std::time::Instant::now();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let new_tokens = generator.generate_batch(&refs, max_new_tokens, sampling, |_| {
        bar.inc(1);
        Ok(())
    });
    bar.finish_and_clear();
    let new_tokens = new_tokens?;
    let seconds = start.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    for (s, (tokens, (text, ids))) in new_tokens.iter().zip(texts.iter().zip(prompts)).enumerate() {
        match tokenizer {
            Some(t) => {
                let mut decoded = Utf8Stream::default();
                let continuation = decoded.push(&t.decode_bytes(tokens)?) + &decoded.finish();
                write_out(&mut out, &format!("=== sequence {s} ===\n{text}{continuation}\n"))?;
            }
            None => {
                let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
                write_out(
                    &mut out,
                    &format!("prompt_ids {s} {}\nnew_ids {s} {}\n", join(ids), join(tokens)),
                )?;
            }
        }
    }
    Ok((new_tokens.iter().map(Vec::len).sum(), seconds))
}

/// The tokenizer the folder names (GPT-2's BPE for GPT-2's vocabulary).
fn folder_tokenizer(loaded: &wgrad::io::lm_folder::LoadedLm, args: &GenerateArgs) -> wgrad::Result<Tokenizer> {
    let spec = loaded.tokenizer.clone().ok_or_else(|| wgrad::Error::InvalidArgument {
        op: "generate",
        reason: format!("`{}` names no tokenizer (no wgrad_tokenizer.json, and not GPT-2's vocabulary size); give --prompt-ids with --print-ids", args.model.display()),
    })?;
    spec.tokenizer()
}
