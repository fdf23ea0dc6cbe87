//! `wgrad generate`: continues a prompt with a model, streaming the text.
//! A GGUF file or a Hugging Face folder with a `tokenizer.json` runs with
//! its own tokenizer ([`wgrad::infer::pretrained`]; a GGUF file's matrices
//! kept quantized on the GPU as the file stores them) and stops at its EOS
//! or an end-of-turn token; a folder wgrad wrote (or a GPT-2 folder) runs
//! with wgrad's tokenizers, and several prompts can run together. Also
//! what `chat`, `serve`, `perplexity` and the bench share of it: the
//! sampling and dtype flags, loading a model, and building its generator.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgrad::graph::{Graph, Tensor};
use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling, WeightDtype};
use wgrad::infer::pretrained::{has_own_tokenizer, load_pretrained, PretrainedLm};
use wgrad::io::text::{Tokenizer, Utf8Stream};
use wgrad::nn::CausalLm;
use wgrad::{DeviceOptions, Kernels};

use crate::common::spinner;

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
    /// Positions the KV cache holds (default: the model's context, or as
    /// many as fit the adapter's memory beside the model): fewer for less
    /// memory (SmolLM2's 8192 are 180 MiB of keys and values, Gemma 3's
    /// 32,768 1.2 GB). A long prompt is prefilled in chunks.
    #[arg(long)]
    context: Option<usize>,
    /// A PEFT LoRA adapter folder (adapter_config.json and
    /// adapter_model.safetensors, as `wgrad train --lora` or PEFT writes
    /// it) applied over --model.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Multiplies the adapter's output (its alpha / r) by this: 0 is the
    /// base alone, 1 the adapter as trained.
    #[arg(long, requires = "lora")]
    lora_scale: Option<f32>,
}

/// A model behind `Box<dyn CausalLm>` as a model type of its own, so that
/// adapters can wrap whichever family a file held.
pub(crate) struct BoxedLm(pub(crate) Box<dyn CausalLm>);

impl wgrad::nn::ParameterTree for BoxedLm {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        self.0.visit(prefix, f)
    }
    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(wgrad::nn::LinearSite, bool)) {
        self.0.visit_linears(prefix, f)
    }
    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> wgrad::Result<()>,
    ) -> wgrad::Result<()> {
        self.0.visit_mut(prefix, f)
    }
}

impl wgrad::nn::Module for BoxedLm {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> wgrad::Result<Tensor> {
        self.0.forward(g, x, prefix)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn input(&self, g: &mut Graph, batch: usize) -> wgrad::Result<Tensor> {
        self.0.input(g, batch)
    }
    fn permuted_rows(&self) -> Vec<(String, usize)> {
        self.0.permuted_rows()
    }
    fn hf_module_prefix(&self) -> &'static str {
        self.0.hf_module_prefix()
    }
}

impl CausalLm for BoxedLm {
    fn lm_sizes(&self) -> wgrad::nn::LmSizes {
        self.0.lm_sizes()
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn context_len(&self) -> usize {
        self.0.context_len()
    }
    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> wgrad::Result<(Tensor, Tensor)> {
        self.0.body(g, idx, prefix)
    }
    fn logits(&self, g: &mut Graph, table: Tensor, x: Tensor, prefix: &str) -> wgrad::Result<Tensor> {
        self.0.logits(g, table, x, prefix)
    }
}

/// `model` with the PEFT adapter folder `dir` over it, its output scaled
/// by `scale` (B scaled: the same product as scaling alpha / r).
pub(crate) fn with_adapter(
    model: Box<dyn CausalLm>,
    adapter: Option<(&Path, f32)>,
) -> wgrad::Result<Box<dyn CausalLm>> {
    let Some((dir, scale)) = adapter else {
        return Ok(model);
    };
    Ok(Box::new(read_adapter(dir, scale)?.apply(BoxedLm(model))?))
}

/// The PEFT adapter folder `dir` with its output scaled by `scale` (B
/// scaled: the same product as scaling alpha / r).
pub(crate) fn read_adapter(dir: &Path, scale: f32) -> wgrad::Result<wgrad::io::peft::PeftAdapter> {
    if !scale.is_finite() {
        return Err(invalid("--lora-scale", format!("{scale} is not a finite number")));
    }
    let mut peft = wgrad::io::peft::read(dir)?;
    for a in &mut peft.adapters {
        a.b.iter_mut().for_each(|v| *v *= scale);
    }
    Ok(peft)
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
    if has_own_tokenizer(&args.model) {
        if args.prompts_file.is_some() || args.batch.is_some() {
            return Err(wgrad::Error::InvalidArgument { op: "generate", reason: "--prompts-file and --batch run models with wgrad's own tokenizers; a GGUF file or a tokenizer.json folder generates one prompt".into() });
        }
        let ids = args
            .prompt_ids
            .as_deref()
            .map(|ids| parse_ids(ids, "--prompt-ids"))
            .transpose()?;
        return generate_pretrained(
            opts,
            &args.model,
            &args.prompt,
            ids,
            args.print_ids,
            args.max_new_tokens,
            &args.sampling,
            args.dtype,
            args.context,
            adapter(args),
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
    let mut loaded = wgrad::io::lm_folder::load_lm_folder(&args.model)?;
    loaded.model = with_adapter(loaded.model, adapter(args))?;
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

/// `--lora` with its `--lora-scale` (default 1).
fn adapter(args: &GenerateArgs) -> Option<(&Path, f32)> {
    args.lora.as_deref().map(|dir| (dir, args.lora_scale.unwrap_or(1.0)))
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

/// Streams a sample of `tokens` tokens after `prompt` from any causal
/// language model: (tokens, seconds).
pub(crate) fn sample(
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

pub(crate) fn invalid(op: &'static str, reason: String) -> wgrad::Error {
    wgrad::Error::InvalidArgument { op, reason }
}

pub(crate) fn write_out(out: &mut impl Write, s: &str) -> wgrad::Result<()> {
    out.write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| invalid("generate", format!("writing to stdout: {e}")))
}

/// The model at `path` with its own tokenizer
/// ([`wgrad::infer::pretrained::load_pretrained`]), its matrices as
/// `--dtype` says.
pub(crate) fn load_bpe_lm(
    kernels: &Kernels,
    path: &Path,
    dtype: Option<DtypeName>,
    fits: &GeneratorOptions,
) -> wgrad::Result<PretrainedLm> {
    load_pretrained(kernels, path, dtype.map(DtypeName::weights), fits)
}

/// A generator for `lm` as `options` say (its weights as `dtype` says, the
/// file's quantized matrices as stored), behind a spinner while its
/// pipelines compile.
pub fn bpe_generator(
    kernels: Arc<Kernels>,
    lm: &PretrainedLm,
    dtype: Option<DtypeName>,
    options: &GeneratorOptions,
) -> wgrad::Result<Generator> {
    let bar = spinner("preparing kernels");
    let weights = dtype.map_or(WeightDtype::F32, DtypeName::weights);
    let options = GeneratorOptions {
        dtype: weights,
        quantized: Arc::new(lm.quantized.clone()),
        suppressed_tokens: lm.suppressed.clone(),
        ..options.clone()
    };
    let generator = Generator::with_options(kernels, lm.model.as_ref(), &options);
    bar.finish_and_clear();
    let generator = generator?;
    if generator.dtype() != weights {
        eprintln!(
            "note: --dtype {} needs SHADER_F16, which this adapter lacks; generating with {} weights",
            weights.name(),
            generator.dtype().name()
        );
    }
    Ok(generator)
}

/// What one answer took.
#[derive(Default)]
pub(crate) struct Timing {
    prefill_tokens: usize,
    prefill_seconds: f64,
    decode_steps: usize,
    decode_seconds: f64,
}

impl Timing {
    pub(crate) fn add(&mut self, other: &Timing) {
        self.prefill_tokens += other.prefill_tokens;
        self.prefill_seconds += other.prefill_seconds;
        self.decode_steps += other.decode_steps;
        self.decode_seconds += other.decode_seconds;
    }

    pub(crate) fn report(&self, load_seconds: f64, device: &str) -> String {
        let rate = |n: usize, s: f64| n as f64 / s.max(1e-9);
        format!(
            "load {load_seconds:.2} s; prefill {} tokens in {:.2} s ({:.1} tokens/s); decode {} tokens in {:.2} s ({:.1} tokens/s) on {device}",
            self.prefill_tokens,
            self.prefill_seconds,
            rate(self.prefill_tokens, self.prefill_seconds),
            self.decode_steps,
            self.decode_seconds,
            rate(self.decode_steps, self.decode_seconds)
        )
    }
}

/// Continues what the cache holds by `new` (from position 0 when
/// `continuation` is false) and samples until a stop token, `max_new`
/// tokens or a full context; passes each token to `emit` as it comes.
/// Returns the new tokens (the stop token not included) and the timing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn answer(
    generator: &mut Generator,
    new: &[u32],
    continuation: bool,
    max_new: usize,
    sampling: &Sampling,
    rng: &mut ChaCha8Rng,
    stops: &[u32],
    mut emit: impl FnMut(u32) -> wgrad::Result<()>,
) -> wgrad::Result<(Vec<u32>, Timing)> {
    let start = Instant::now();
    let mut token = if continuation {
        generator.extend_and_sample(&[new], sampling, rng)?
    } else {
        generator.prefill_and_sample(&[new], sampling, rng)?
    }[0];
    let mut timing = Timing {
        prefill_tokens: new.len(),
        prefill_seconds: start.elapsed().as_secs_f64(),
        ..Timing::default()
    };
    let start = Instant::now();
    let mut tokens = Vec::new();
    while !stops.contains(&token) {
        emit(token)?;
        tokens.push(token);
        let held = generator.cached_tokens(0).map_or(0, <[u32]>::len);
        if tokens.len() == max_new || held >= generator.context_len() {
            if held >= generator.context_len() {
                eprintln!("\nnote: the context of {} tokens is full", generator.context_len());
            }
            break;
        }
        token = generator.decode_and_sample(&[token], sampling, rng)?[0];
        timing.decode_steps += 1;
    }
    timing.decode_seconds = start.elapsed().as_secs_f64();
    Ok((tokens, timing))
}

/// `wgrad generate` on a model with its own tokenizer ([`has_own_tokenizer`]): `prompt` is text,
/// or ids with `print_ids` (which prints ids, not text).
#[allow(clippy::too_many_arguments)]
pub fn generate_pretrained(
    opts: &DeviceOptions,
    model: &Path,
    prompt: &str,
    prompt_ids: Option<Vec<u32>>,
    print_ids: bool,
    max_new: usize,
    sampling_args: &SamplingArgs,
    dtype: Option<DtypeName>,
    context: Option<usize>,
    adapter: Option<(&Path, f32)>,
) -> wgrad::Result<()> {
    let sampling = sampling_args.sampling();
    sampling.check()?;
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    // The cache holds --context positions, or the model's whole context
    // (a long prompt is prefilled in chunks), or as many as fit the
    // adapter's memory beside the model, said so.
    let config = wgrad::io::lm_folder::read_model_config(model)?;
    let options = GeneratorOptions {
        context,
        dtype: dtype.map_or(WeightDtype::F32, DtypeName::weights),
        ..GeneratorOptions::default()
    };
    let stored = wgrad::infer::pretrained::quantized_storage(model, dtype.map(DtypeName::weights))?;
    let fitted = wgrad::infer::generate::context_that_fits_stored(&kernels, config.as_ref(), &options, 1, stored)?;
    let wanted = options.context_for(config.lm_sizes().context)?;
    if fitted < wanted {
        eprintln!("note: the KV cache holds {fitted} positions, what fits this adapter's memory beside the model (not {wanted}); give --context to choose fewer");
    }
    let options = GeneratorOptions {
        context: Some(fitted),
        ..options
    };
    let mut lm = wgrad::infer::pretrained::load_pretrained_with_config(
        &kernels,
        model,
        config.as_ref(),
        dtype.map(DtypeName::weights),
        &options,
    )?;
    lm.model = with_adapter(lm.model, adapter)?;
    let ids = match prompt_ids {
        Some(ids) => ids,
        None => lm.tokenizer.encode(prompt, true)?,
    };
    if ids.is_empty() {
        return Err(invalid("generate", "the prompt is empty: give some text".into()));
    }
    wgrad::kernels::check_token_ids("generate", &ids, lm.model.vocab_size())?;
    let context = fitted;
    if ids.len() > context {
        return Err(invalid(
            "generate",
            format!(
                "the prompt has {} tokens, more than the context of {context}",
                ids.len()
            ),
        ));
    }
    let mut generator = bpe_generator(kernels.clone(), &lm, dtype, &options)?;
    let mut out = std::io::stdout().lock();
    let mut text = lm.tokenizer.stream(true);
    if print_ids {
        let joined: Vec<String> = ids.iter().map(u32::to_string).collect();
        write_out(&mut out, &format!("prompt_ids {}\nnew_ids", joined.join(" ")))?;
    } else {
        write_out(&mut out, prompt)?;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
    let (_, timing) = answer(
        &mut generator,
        &ids,
        false,
        max_new,
        &sampling,
        &mut rng,
        &lm.stops,
        |token| {
            let piece = if print_ids {
                format!(" {token}")
            } else {
                text.push(token)?
            };
            write_out(&mut out, &piece)
        },
    )?;
    let rest = if print_ids { String::new() } else { text.finish() };
    write_out(&mut out, &format!("{rest}\n"))?;
    eprintln!("{}", timing.report(lm.load_seconds, &kernels.device().label()));
    Ok(())
}
