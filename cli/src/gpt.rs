//! `wgrad train --model gpt`: a GPT on text, with a progress bar, the
//! validation loss, both curves in the PNG, the model folder and a sample.

use std::path::PathBuf;
use std::sync::Arc;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::lm_training::{LmProgress, LmRunInfo, LmTrainConfig, LmTrainingRun, TextSource, TokenizerKind};
use wgrad::generate::{Generator, Sampling, WeightDtype};
use wgrad::nn::CausalLm;
use wgrad::parallel::distributed::ProcessGroup;
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::pipeline::Schedule;
use wgrad::parallel::DeviceSelection;
use wgrad::text::{Tokenizer, Utf8Stream};
use wgrad::{DeviceOptions, Kernels};

use crate::{plot, spinner, TrainArgs};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TokenizerName {
    /// One token per character of the training text.
    Char,
    /// GPT-2's byte-level BPE (r50k_base, 50,257 tokens).
    Gpt2,
}

/// The GPT's flags; the defaults are `make train`'s run ([`LmTrainConfig`]).
#[derive(clap::Args)]
pub struct GptArgs {
    /// GPT: GPT-2's sizes by Hugging Face name (gpt2, gpt2-medium,
    /// gpt2-large, gpt2-xl) instead of --n-layer/--n-head/--n-embd/--block-size;
    /// for a real GPU.
    #[arg(long, conflicts_with_all = ["n_layer", "n_head", "n_embd", "block_size"])]
    preset: Option<String>,
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = LmTrainConfig::default().n_layer)]
    n_layer: usize,
    /// GPT: attention heads per block.
    #[arg(long, default_value_t = LmTrainConfig::default().n_head)]
    n_head: usize,
    /// GPT: channels.
    #[arg(long, default_value_t = LmTrainConfig::default().n_embd)]
    n_embd: usize,
    /// GPT: context length in tokens.
    #[arg(long, default_value_t = LmTrainConfig::default().block_size)]
    block_size: usize,
    /// GPT: the tokenizer.
    #[arg(long, value_enum, default_value_t = TokenizerName::Char)]
    tokenizer: TokenizerName,
    /// GPT: train on this UTF-8 text file instead of the shipped Shakespeare.
    #[arg(long)]
    text: Option<PathBuf>,
    /// GPT: steps of linear warmup before the cosine decay.
    #[arg(long, default_value_t = LmTrainConfig::default().warmup_steps)]
    warmup_steps: u64,
    /// GPT: the learning rate the cosine decays to at the last step.
    #[arg(long, default_value_t = LmTrainConfig::default().min_lr)]
    min_lr: f32,
    /// GPT: AdamW's weight decay (matrices only).
    #[arg(long, default_value_t = LmTrainConfig::default().weight_decay)]
    weight_decay: f32,
    /// GPT: clip the gradients' global norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// GPT: the validation loss every this many steps.
    #[arg(long, default_value_t = LmTrainConfig::default().eval_every)]
    eval_every: u64,
    /// GPT: batches of held-out windows per validation loss.
    #[arg(long, default_value_t = LmTrainConfig::default().eval_batches)]
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
}

fn config(args: &TrainArgs) -> wgrad::Result<LmTrainConfig> {
    if args.mnist.is_some() {
        return Err(wgrad::Error::InvalidArgument { op: "train --model gpt", reason: "--mnist is for --model mlp; the GPT takes --text".into() });
    }
    let g = &args.gpt;
    let defaults = LmTrainConfig::default();
    let (n_layer, n_head, n_embd, block_size) = match &g.preset {
        Some(name) => {
            let p = wgrad::nn::GptConfig::preset(name)?;
            (p.n_layer, p.n_head, p.n_embd, p.block_size)
        }
        None => (g.n_layer, g.n_head, g.n_embd, g.block_size),
    };
    Ok(LmTrainConfig {
        text: g.text.clone().map_or(TextSource::Shakespeare, TextSource::File),
        tokenizer: match g.tokenizer {
            TokenizerName::Char => TokenizerKind::Char,
            TokenizerName::Gpt2 => TokenizerKind::Gpt2,
        },
        n_layer,
        n_head,
        n_embd,
        block_size,
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        max_steps: args.max_steps.unwrap_or(defaults.max_steps),
        lr: args.lr.unwrap_or(defaults.lr),
        min_lr: g.min_lr,
        warmup_steps: g.warmup_steps,
        weight_decay: g.weight_decay,
        betas: defaults.betas,
        clip_grad_norm: (g.clip > 0.0).then_some(g.clip),
        eval_every: g.eval_every,
        eval_batches: g.eval_batches,
        validation_fraction: defaults.validation_fraction,
        loss_every: args.loss_every,
        seed: args.seed,
        resume: args.resume.clone(),
        // Across processes the GPT trains data parallel, as the MLP does.
        strategy: match (args.parallel.as_deref(), args.distributed.is_some()) {
            (Some(name), _) => Strategy::parse(name)?,
            (None, true) => Strategy::Data,
            (None, false) => Strategy::Single,
        },
        devices: args.devices.as_deref().map(DeviceSelection::parse).transpose()?,
        split: args.split.clone(),
        micro_batches: args.micro_batches,
        schedule: Schedule::parse(&g.schedule)?,
        #[cfg(feature = "fault-injection")]
        fail_at: args.fail_at.as_deref().map(crate::parse_fail_at).transpose()?,
    })
}

/// A spinner while kernels are prepared, then a bar over the steps with the
/// loss, tokens/s and the ETA.
#[derive(Default)]
struct Bars {
    preparing: Option<ProgressBar>,
    steps: Option<ProgressBar>,
}

impl LmProgress for Bars {
    fn preparing(&mut self) {
        self.preparing = Some(spinner("preparing kernels"));
    }

    fn started(&mut self, info: &LmRunInfo) {
        if let Some(s) = self.preparing.take() {
            s.finish_and_clear();
        }
        println!("devices: {}", info.devices.join(", "));
        println!("{}", info.engine);
        println!("model: {} | {} parameters", info.model, info.parameters);
        println!(
            "data: {} tokenizer, vocabulary {}, {} train / {} validation tokens | {} tokens per step",
            info.tokenizer, info.vocab_size, info.train_tokens, info.validation_tokens, info.tokens_per_step
        );
        println!("{} dispatches per step, {} KiB of GPU memory", info.dispatches_per_step, info.peak_gpu_bytes / 1024);
        let bar = ProgressBar::new(info.steps);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} steps {elapsed_precise} (ETA {eta}) {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar.set_message("first steps compile kernels (cached for later runs)");
        self.steps = Some(bar);
    }

    fn step(&mut self, _step: u64) {
        if let Some(bar) = &self.steps {
            bar.inc(1);
        }
    }

    fn loss(&mut self, _step: u64, loss: f32, tokens_per_s: f64) {
        if let Some(bar) = &self.steps {
            bar.set_message(format!("loss {loss:.4} | {tokens_per_s:.0} tokens/s"));
        }
    }

    fn validation(&mut self, step: u64, loss: f32) {
        let line = format!("step {step}: validation loss {loss:.4}");
        // Printed through the bar so it stays above it; `suspend` prints
        // even where the bar is hidden (output not a terminal).
        match &self.steps {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }
}

/// The GPT's run; across the processes of `process_group` when given,
/// where only rank 0 prints, saves and samples.
pub fn train(opts: &DeviceOptions, args: &TrainArgs, process_group: Option<Arc<dyn ProcessGroup>>) -> wgrad::Result<()> {
    let config = config(args)?;
    let mut bars = Bars::default();
    let mut run = match process_group {
        None => LmTrainingRun::new(opts, config, &mut bars)?,
        Some(group) => LmTrainingRun::distributed(opts, config, group, &mut bars)?,
    };
    let summary = run.fit(&mut bars)?;
    if !run.is_root() {
        return Ok(());
    }
    if let Some(bar) = bars.steps.take() {
        bar.finish();
    }
    println!(
        "trained {} steps in {:.1} s: {:.0} ms/step, {:.0} tokens/s",
        summary.steps, summary.train_seconds, summary.ms_per_step, summary.tokens_per_s
    );
    if !summary.report.is_empty() {
        println!("{}", summary.report);
    }
    println!("final validation loss {:.4}", summary.final_validation_loss);
    let model = run.save(&args.gpt.out)?;
    println!("model folder: {}", args.gpt.out.display());
    if args.gpt.sample_tokens > 0 {
        println!("sample (temperature 0.8, top-k 40, seed {}):", args.seed);
        let sampling = Sampling { temperature: 0.8, top_k: Some(40), seed: args.seed };
        let mut generator = prepared_generator(run.kernels().clone(), &model, 1, WeightDtype::F32)?;
        let prompt = run.sample_prompt()?;
        let ids = run.tokenizer().encode(&prompt)?;
        let (count, seconds) = stream(&mut generator, run.tokenizer(), &prompt, &ids, args.gpt.sample_tokens, &sampling)?;
        println!("({count} tokens at {:.1} tokens/s)", count as f64 / seconds.max(1e-9));
    }
    let c = run.config();
    let title = format!("GPT L{} H{} C{} T{}: validation loss {:.4}", c.n_layer, c.n_head, c.n_embd, c.block_size, summary.final_validation_loss);
    plot::loss_curves(&args.plot, &title, &[("train", &summary.train_curve), ("validation", &summary.validation_curve)])?;
    println!("loss curves: {}", args.plot.display());
    Ok(())
}

/// `wgrad generate`'s flags.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A model folder: a GPT-2 or a Llama, by its config.json (`wgrad
    /// train --model gpt` writes out/gpt; Hugging Face GPT-2 and Llama
    /// folders work too).
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
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// 0: greedy (the most likely token, deterministic).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How the weights are stored: f16 halves the bytes each token reads
    /// (the projections and the token embedding; computed in f32), where
    /// the adapter has SHADER_F16; elsewhere f32, with a notice.
    #[arg(long, value_enum, default_value_t = DtypeName::F32)]
    dtype: DtypeName,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeName {
    F32,
    F16,
}

impl DtypeName {
    fn weights(self) -> WeightDtype {
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
        .map_err(|e| wgrad::Error::InvalidArgument { op: "generate", reason: format!("writing to stdout: {e}") })
}

/// Streams `max_new_tokens` tokens after `prompt` to stdout as they are
/// produced; returns the tokens generated and the seconds they took, the
/// prompt's prefill included.
fn stream(generator: &mut Generator, tokenizer: &Tokenizer, prompt: &str, ids: &[u32], max_new_tokens: usize, sampling: &Sampling) -> wgrad::Result<(usize, f64)> {
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
fn stream_ids(generator: &mut Generator, ids: &[u32], max_new_tokens: usize, sampling: &Sampling) -> wgrad::Result<(usize, f64)> {
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
        .map(|s| s.parse::<u32>().map_err(|_| wgrad::Error::InvalidArgument { op: "generate", reason: format!("{source}: `{s}` is not a token id") }))
        .collect::<wgrad::Result<Vec<u32>>>()?;
    if ids.is_empty() {
        return Err(wgrad::Error::InvalidArgument { op: "generate", reason: format!("{source} holds no ids") });
    }
    Ok(ids)
}

/// A generator of `sequences` sequences for `model` with its weights
/// stored as `dtype`, behind a spinner while its pipelines compile; a
/// notice on stderr when the adapter cannot store them so and f32 is used.
fn prepared_generator(kernels: Arc<Kernels>, model: &dyn CausalLm, sequences: usize, dtype: WeightDtype) -> wgrad::Result<Generator> {
    let bar = spinner("preparing kernels");
    let label = kernels.device().label();
    let generator = Generator::new_with_dtype(kernels, model, sequences, dtype);
    bar.finish_and_clear();
    let generator = generator?;
    if generator.dtype() != dtype {
        eprintln!("note: --dtype {} needs SHADER_F16, which {label} lacks; generating with {} weights", dtype.name(), generator.dtype().name());
    }
    Ok(generator)
}

pub fn generate(opts: &DeviceOptions, args: &GenerateArgs) -> wgrad::Result<()> {
    if args.max_new_tokens == 0 {
        return Err(wgrad::Error::InvalidArgument { op: "generate", reason: "--max-new-tokens must be at least 1".into() });
    }
    if args.batch == Some(0) {
        return Err(wgrad::Error::InvalidArgument { op: "generate", reason: "--batch must be at least 1".into() });
    }
    if args.prompt_ids.is_some() && !args.print_ids {
        return Err(wgrad::Error::InvalidArgument { op: "generate", reason: "--prompt-ids goes with --print-ids".into() });
    }
    // The prompts as given: (text, whether it is token ids), each once.
    let given: Vec<(String, &str)> = match (&args.prompts_file, &args.prompt_ids) {
        (Some(path), _) => read_prompts(path)?.into_iter().map(|line| (line, if args.print_ids { "a line of --prompts-file" } else { "" })).collect(),
        (None, Some(ids)) => vec![(ids.clone(), "--prompt-ids")],
        (None, None) => vec![(args.prompt.clone(), "")],
    };
    // The sizes first: a model the adapter cannot hold is refused before
    // its weights are read.
    // A GPT-2 or a Llama folder, by its config.json.
    let config = wgrad::lm_folder::read_lm_config(&args.model)?;
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let dtype = args.dtype.weights();
    let copies = args.batch.unwrap_or(1);
    let sequences = given.len() * copies;
    wgrad::generate::check_fits_with_dtype(&kernels, config.as_ref(), sequences, dtype)?;
    let sizes = config.lm_sizes();
    let loaded = wgrad::lm_folder::load_lm_folder(&args.model)?;
    // Every prompt's ids, checked before any device work: ids in the
    // vocabulary, text in the tokenizer's alphabet, lengths in the context.
    let needs_tokenizer = given.iter().any(|(_, ids_source)| ids_source.is_empty());
    let tokenizer = if needs_tokenizer { Some(folder_tokenizer(&loaded, args)?) } else { None };
    let mut prompts = Vec::with_capacity(sequences);
    for (s, (text, ids_source)) in given.iter().enumerate() {
        let ids = match &tokenizer {
            Some(t) if ids_source.is_empty() => t.encode(text)?,
            _ => parse_ids(text, ids_source)?,
        };
        wgrad::kernels::check_token_ids("generate", &ids, sizes.vocab_size)?;
        if ids.len() > sizes.context {
            let which = if given.len() > 1 { format!("prompt {s}") } else { "the prompt".into() };
            return Err(wgrad::Error::InvalidArgument { op: "generate", reason: format!("{which} has {} tokens, more than the model's context of {}", ids.len(), sizes.context) });
        }
        prompts.push(ids);
    }
    let texts: Vec<String> = given.iter().flat_map(|(text, _)| std::iter::repeat_n(text.clone(), copies)).collect();
    let prompts: Vec<Vec<u32>> = prompts.into_iter().flat_map(|ids| std::iter::repeat_n(ids, copies)).collect();
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, seed: args.seed };
    let mut generator = prepared_generator(kernels.clone(), loaded.model.as_ref(), sequences, dtype)?;
    let text_tokenizer = if args.print_ids { None } else { tokenizer.as_ref() };
    let (count, seconds) = if args.prompts_file.is_some() || args.batch.is_some() {
        generate_batch(&mut generator, text_tokenizer, &texts, &prompts, args.max_new_tokens, &sampling)?
    } else {
        match text_tokenizer {
            Some(tokenizer) => stream(&mut generator, tokenizer, &texts[0], &prompts[0], args.max_new_tokens, &sampling)?,
            None => stream_ids(&mut generator, &prompts[0], args.max_new_tokens, &sampling)?,
        }
    };
    eprintln!("{count} tokens in {seconds:.2} s: {:.1} tokens/s on {}", count as f64 / seconds.max(1e-9), kernels.device().label());
    Ok(())
}

/// `--prompts-file`: its non-blank lines, at least one.
fn read_prompts(path: &std::path::Path) -> wgrad::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| wgrad::Error::InvalidArgument { op: "generate", reason: format!("--prompts-file {}: {e}", path.display()) })?;
    let prompts: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    if prompts.is_empty() {
        return Err(wgrad::Error::InvalidArgument { op: "generate", reason: format!("--prompts-file {} holds no prompt (one per line)", path.display()) });
    }
    Ok(prompts)
}

/// Several prompts in the same steps ([`Generator::generate_batch`]);
/// a progress bar counts the steps, and each sequence prints when all are
/// done: its prompt and continuation as text, or `prompt_ids S …` and
/// `new_ids S …` lines without a tokenizer. Returns the tokens generated
/// (all sequences) and the seconds they took, the prefill included.
fn generate_batch(generator: &mut Generator, tokenizer: Option<&Tokenizer>, texts: &[String], prompts: &[Vec<u32>], max_new_tokens: usize, sampling: &Sampling) -> wgrad::Result<(usize, f64)> {
    let bar = ProgressBar::new(max_new_tokens as u64);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} steps of {msg} sequences {elapsed}").unwrap_or_else(|_| ProgressStyle::default_bar()));
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
                write_out(&mut out, &format!("prompt_ids {s} {}\nnew_ids {s} {}\n", join(ids), join(tokens)))?;
            }
        }
    }
    Ok((new_tokens.iter().map(Vec::len).sum(), seconds))
}

/// The tokenizer the folder names (GPT-2's BPE for GPT-2's vocabulary).
fn folder_tokenizer(loaded: &wgrad::lm_folder::LoadedLm, args: &GenerateArgs) -> wgrad::Result<Tokenizer> {
    let spec = loaded.tokenizer.clone().ok_or_else(|| wgrad::Error::InvalidArgument {
        op: "generate",
        reason: format!("`{}` names no tokenizer (no wgrad_tokenizer.json, and not GPT-2's vocabulary size); give --prompt-ids with --print-ids", args.model.display()),
    })?;
    spec.tokenizer()
}
