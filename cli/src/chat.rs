//! `wgrad generate` and `wgrad chat` on a pretrained model with its own
//! BPE tokenizer: a llama.cpp GGUF file (its matrices kept quantized on the
//! GPU as the file stores them) or a Hugging Face folder with a
//! `tokenizer.json`. Text streams as it comes; a turn ends at the
//! tokenizer's EOS or an end-of-turn token. A chat keeps its history in the
//! KV cache: each turn renders the whole conversation through the model's
//! chat template and prefills only what follows the part the cache holds.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgrad::infer::generate::{check_fits_with_options, Generator, GeneratorOptions, Sampling, WeightDtype};
use wgrad::io::bpe::BpeTokenizer;
use wgrad::io::chat::{ChatMessage, ChatTemplate};
use wgrad::io::gguf_model::GgufModel;
use wgrad::io::lm_folder::{is_gguf_path, load_lm_folder, read_model_config};
use wgrad::nn::{CausalLm, QuantizedWeights};
use wgrad::{DeviceOptions, Kernels};

use crate::gpt::{DtypeName, SamplingArgs};

/// Tokens that end a turn besides the tokenizer's EOS, where the
/// vocabulary has them (ChatML's, Llama 3's, Phi's, Gemma's).
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// A model with its own tokenizer, ready for a generator.
pub struct BpeLm {
    pub model: Box<dyn CausalLm>,
    /// Matrices stored as the GGUF file stores them (empty for a folder or
    /// with `--dtype`).
    pub quantized: QuantizedWeights,
    pub tokenizer: BpeTokenizer,
    /// The ids that end a turn.
    pub stops: Vec<u32>,
    /// The model's ids the tokenizer has no text for (rows past its
    /// vocabulary, holes in it): never sampled.
    pub suppressed: Vec<u32>,
    pub load_seconds: f64,
}

fn invalid(op: &'static str, reason: String) -> wgrad::Error {
    wgrad::Error::InvalidArgument { op, reason }
}

/// Whether `path` is a model [`load_bpe_lm`] reads: a GGUF file, or a
/// folder with a `tokenizer.json`.
pub fn has_own_tokenizer(path: &Path) -> bool {
    is_gguf_path(path) || path.join("tokenizer.json").is_file()
}

/// The model at `path` (see [`has_own_tokenizer`]), checked against the
/// adapter's memory from its sizes before any weight is read. A GGUF
/// Llama keeps its Q8_0/Q4_0/Q4_1 matrices as stored unless `dtype` is
/// given, which de-quantizes every matrix (and stores it as `dtype`).
/// `fits` says what the generator will hold (its sequences, context and
/// prefill), checked against the adapter from the file's sizes alone.
pub fn load_bpe_lm(
    kernels: &Kernels,
    path: &Path,
    dtype: Option<DtypeName>,
    fits: &GeneratorOptions,
) -> wgrad::Result<BpeLm> {
    let start = Instant::now();
    let config = read_model_config(path)?;
    let weights = dtype.map_or(WeightDtype::F32, DtypeName::weights);
    check_fits_with_options(
        kernels,
        config.as_ref(),
        &GeneratorOptions {
            dtype: weights,
            ..fits.clone()
        },
    )?;
    let (model, quantized, tokenizer): (Box<dyn CausalLm>, _, _) = if is_gguf_path(path) {
        let gguf = GgufModel::open(path)?;
        let tokenizer = BpeTokenizer::from_gguf(gguf.gguf())?;
        match dtype {
            None => {
                let (model, quantized) = gguf.to_quantized_causal_lm()?;
                (model, quantized, tokenizer)
            }
            Some(_) => (gguf.to_causal_lm()?, QuantizedWeights::new(), tokenizer),
        }
    } else {
        let tokenizer = BpeTokenizer::from_folder(path)?
            .ok_or_else(|| invalid("generate", format!("`{}` has no tokenizer.json", path.display())))?;
        (load_lm_folder(path)?.model, QuantizedWeights::new(), tokenizer)
    };
    if tokenizer.vocab_size() > model.vocab_size() {
        return Err(invalid(
            "generate",
            format!(
                "the tokenizer has {} tokens, the model a vocabulary of {}",
                tokenizer.vocab_size(),
                model.vocab_size()
            ),
        ));
    }
    let mut stops: Vec<u32> = tokenizer
        .eos_id()
        .into_iter()
        .chain(END_OF_TURN.iter().filter_map(|t| tokenizer.token_id(t)))
        .collect();
    stops.dedup();
    let size = model.vocab_size();
    let vocab = u32::try_from(size).map_err(|_| invalid("generate", format!("a vocabulary of {size} tokens")))?;
    let suppressed = (0..vocab).filter(|&id| tokenizer.token_bytes(id).is_err()).collect();
    Ok(BpeLm {
        model,
        quantized,
        tokenizer,
        stops,
        suppressed,
        load_seconds: start.elapsed().as_secs_f64(),
    })
}

/// A generator for `lm` as `options` say (its weights as `dtype` says, the
/// file's quantized matrices as stored), behind a spinner while its
/// pipelines compile.
pub fn bpe_generator(
    kernels: Arc<Kernels>,
    lm: &BpeLm,
    dtype: Option<DtypeName>,
    options: &GeneratorOptions,
) -> wgrad::Result<Generator> {
    let bar = crate::spinner("preparing kernels");
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
struct Timing {
    prefill_tokens: usize,
    prefill_seconds: f64,
    decode_steps: usize,
    decode_seconds: f64,
}

impl Timing {
    fn add(&mut self, other: &Timing) {
        self.prefill_tokens += other.prefill_tokens;
        self.prefill_seconds += other.prefill_seconds;
        self.decode_steps += other.decode_steps;
        self.decode_seconds += other.decode_seconds;
    }

    fn report(&self, load_seconds: f64, device: &str) -> String {
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
fn answer(
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

fn write_out(out: &mut impl Write, s: &str) -> wgrad::Result<()> {
    out.write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| invalid("generate", format!("writing to stdout: {e}")))
}

/// `wgrad generate` on a model with its own tokenizer: `prompt` is text,
/// or ids with `print_ids` (which prints ids, not text).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    opts: &DeviceOptions,
    model: &Path,
    prompt: &str,
    prompt_ids: Option<Vec<u32>>,
    print_ids: bool,
    max_new: usize,
    sampling_args: &SamplingArgs,
    dtype: Option<DtypeName>,
    context: Option<usize>,
) -> wgrad::Result<()> {
    let sampling = sampling_args.sampling();
    sampling.check()?;
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let options = GeneratorOptions {
        context,
        ..GeneratorOptions::default()
    };
    let lm = load_bpe_lm(&kernels, model, dtype, &options)?;
    let ids = match prompt_ids {
        Some(ids) => ids,
        None => lm.tokenizer.encode(prompt, true)?,
    };
    if ids.is_empty() {
        return Err(invalid("generate", "the prompt is empty: give some text".into()));
    }
    wgrad::kernels::check_token_ids("generate", &ids, lm.model.vocab_size())?;
    // One generation's cache needs only its prompt and new tokens: the
    // model's whole context (Gemma 3's 32,768 positions) would cost a
    // gigabyte of keys and values, and a prefill pass that long activations
    // over a storage binding.
    let fitted = ids.len().saturating_add(max_new).max(64).next_power_of_two();
    let options = GeneratorOptions {
        context: context.or(Some(fitted.min(lm.model.context_len()))),
        ..options
    };
    let context = options.context_for(lm.model.context_len())?;
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

/// `wgrad chat`'s flags.
#[derive(clap::Args)]
pub struct ChatArgs {
    /// A GGUF file or a Hugging Face folder with a tokenizer.json and a chat
    /// template.
    #[arg(long)]
    model: std::path::PathBuf,
    /// The system message (default: the template's own, if it has one).
    #[arg(long)]
    system: Option<String>,
    /// The longest answer, in tokens.
    #[arg(long, default_value_t = 512)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// De-quantize a GGUF file's matrices and store them as this (default:
    /// as the file stores them).
    #[arg(long, value_enum)]
    dtype: Option<DtypeName>,
    /// Positions the KV cache holds (default: the model's context; SmolLM2's
    /// 8192 are 180 MiB of keys and values).
    #[arg(long)]
    context: Option<usize>,
}

/// The prompt of `messages` ready for the assistant's answer, as ids; the
/// oldest turns (after a system message) are dropped until it leaves room
/// for an answer in `context`.
fn render(
    template: &ChatTemplate,
    tokenizer: &BpeTokenizer,
    messages: &mut Vec<ChatMessage>,
    context: usize,
) -> wgrad::Result<Vec<u32>> {
    let (bos, eos) = (
        tokenizer.bos_token().unwrap_or_default(),
        tokenizer.eos_token().unwrap_or_default(),
    );
    loop {
        let ids = tokenizer.encode(&template.render(messages, true, &bos, &eos)?, false)?;
        if ids.len() < context {
            return Ok(ids);
        }
        let first = usize::from(messages.first().is_some_and(|m| m.role == "system"));
        if messages.len() - first <= 1 {
            return Err(invalid(
                "chat",
                format!(
                    "the message needs {} tokens with the template, more than the model's context of {context}",
                    ids.len()
                ),
            ));
        }
        messages.remove(first);
    }
}

/// A model without a chat template (a base model such as Gemma 3 270M):
/// wgrad does not guess a format the model was never trained on.
fn no_chat_template(model: &Path) -> wgrad::Error {
    let model = model.display();
    invalid(
        "chat",
        format!(
            "`{model}` has no chat template (a base model, or a file that does not carry one), so wgrad cannot \
             format a conversation for it; continue plain text with `wgrad generate --model {model} --prompt \"…\"`"
        ),
    )
}

/// `wgrad chat`: one user message per line of standard input, each
/// answered as it is generated; end of input ends the conversation.
pub fn chat(opts: &DeviceOptions, args: &ChatArgs) -> wgrad::Result<()> {
    if args.max_new_tokens == 0 {
        return Err(invalid("chat", "--max-new-tokens must be at least 1".into()));
    }
    let sampling = args.sampling.sampling();
    sampling.check()?;
    // A GGUF file's template is in its header: say it is missing before
    // opening a device or reading weights.
    if is_gguf_path(&args.model)
        && wgrad::io::gguf::Gguf::open(&args.model)?
            .get("tokenizer.chat_template")
            .is_none()
    {
        return Err(no_chat_template(&args.model));
    }
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let options = GeneratorOptions {
        context: args.context,
        ..GeneratorOptions::default()
    };
    let lm = load_bpe_lm(&kernels, &args.model, args.dtype, &options)?;
    let source = lm
        .tokenizer
        .chat_template()
        .ok_or_else(|| no_chat_template(&args.model))?;
    let template = ChatTemplate::new(source)?;
    let mut generator = bpe_generator(kernels.clone(), &lm, args.dtype, &options)?;
    let context = generator.context_len();
    let mut messages: Vec<ChatMessage> = args.system.iter().map(ChatMessage::system).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
    let mut total = Timing::default();
    let interactive = std::io::stdin().is_terminal();
    let mut lines = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        let read = lines
            .read_line(&mut line)
            .map_err(|e| invalid("chat", format!("reading standard input: {e}")))?;
        if read == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        messages.push(ChatMessage::user(line));
        let ids = render(&template, &lm.tokenizer, &mut messages, context)?;
        // Keep the cache's tokens the new render starts with (all but one
        // at most, so there is a token to feed); re-prefill when none.
        let held = generator.cached_tokens(0).unwrap_or(&[]);
        let common = held
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
        generator.truncate(0, common)?;
        let max_new = args.max_new_tokens.min(context - ids.len());
        let mut text = lm.tokenizer.stream(true);
        let (tokens, timing) = answer(
            &mut generator,
            &ids[common..],
            common > 0,
            max_new,
            &sampling,
            &mut rng,
            &lm.stops,
            |token| {
                let piece = text.push(token)?;
                write_out(&mut out, &piece)
            },
        )?;
        write_out(&mut out, &format!("{}\n", text.finish()))?;
        total.add(&timing);
        messages.push(ChatMessage::assistant(lm.tokenizer.decode(&tokens, true)?));
    }
    eprintln!("{}", total.report(lm.load_seconds, &kernels.device().label()));
    Ok(())
}
