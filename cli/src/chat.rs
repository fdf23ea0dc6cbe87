//! `wgrad chat`: a conversation with a model that has a chat template (a
//! GGUF file, or a Hugging Face folder with a `tokenizer.json`). Text
//! streams as it comes; a turn ends at the tokenizer's EOS or an
//! end-of-turn token. A chat keeps its history in the KV cache: each turn
//! renders the whole conversation through the model's chat template and
//! prefills only what follows the part the cache holds.

use std::io::{BufRead, IsTerminal};
use std::path::Path;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgrad::infer::generate::GeneratorOptions;
use wgrad::io::bpe::BpeTokenizer;
use wgrad::io::chat::{ChatMessage, ChatTemplate};
use wgrad::io::lm_folder::is_gguf_path;
use wgrad::{DeviceOptions, Kernels};

use crate::generate::{
    answer, bpe_generator, invalid, load_bpe_lm, read_adapter, write_out, BoxedLm, DtypeName, SamplingArgs, Timing,
};

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
    /// A PEFT LoRA adapter folder (adapter_config.json and
    /// adapter_model.safetensors, as `wgrad train --lora` or PEFT writes
    /// it) applied over --model.
    #[arg(long)]
    lora: Option<std::path::PathBuf>,
    /// Multiplies the adapter's output (its alpha / r) by this: 0 is the
    /// base alone, 1 the adapter as trained.
    #[arg(long, requires = "lora")]
    lora_scale: Option<f32>,
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
    // The adapter folder is read and checked before a device opens.
    let adapter = args
        .lora
        .as_deref()
        .map(|dir| read_adapter(dir, args.lora_scale.unwrap_or(1.0)))
        .transpose()?;
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let options = GeneratorOptions {
        context: args.context,
        ..GeneratorOptions::default()
    };
    let mut lm = load_bpe_lm(&kernels, &args.model, args.dtype, &options)?;
    if let Some(adapter) = adapter {
        lm.model = Box::new(adapter.apply(BoxedLm(lm.model))?);
    }
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
