//! `wgrad perplexity`: a model's mean next-token loss and perplexity over
//! a text, as llama.cpp's `llama-perplexity` reports it (see
//! `wgrad::infer::perplexity` for the windows and what is scored).

use std::path::PathBuf;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use wgrad::infer::generate::GeneratorOptions;
use wgrad::infer::perplexity::{scored_per_window, Scorer, ScorerOptions};
use wgrad::infer::pretrained::load_pretrained_with_config;
use wgrad::train::{read_text, TextSource};
use wgrad::{DeviceOptions, Kernels};

use crate::generate::DtypeName;

/// The window when --context is not given: llama.cpp's usual figure
/// (its published perplexities are at 512), or the model's context if
/// shorter.
const DEFAULT_CONTEXT: usize = 512;

/// `wgrad perplexity`'s flags.
#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// A GGUF file (its quantized matrices scored as stored) or a Hugging
    /// Face folder with a tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// The UTF-8 text to score (a `.gz` file is read decompressed).
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window [default: 512, or the model's context if
    /// shorter]; each window scores the predictions of its second half.
    #[arg(long)]
    context: Option<usize>,
    /// Score only the text's first this many tokens (whole windows of
    /// them).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// De-quantize a GGUF file's matrices and store them as this (default:
    /// as the file stores them).
    #[arg(long, value_enum)]
    dtype: Option<DtypeName>,
}

fn invalid(reason: String) -> wgrad::Error {
    wgrad::Error::InvalidArgument {
        op: "perplexity",
        reason,
    }
}

pub fn perplexity(opts: &DeviceOptions, args: &PerplexityArgs) -> wgrad::Result<()> {
    if args.max_tokens == Some(0) {
        return Err(invalid("--max-tokens must be at least 1".into()));
    }
    if !args.text.is_file() {
        return Err(invalid(format!("--text `{}` is not a file", args.text.display())));
    }
    let config = wgrad::io::lm_folder::read_model_config(&args.model)?;
    let model_context = config.lm_sizes().context;
    let context = args.context.unwrap_or(DEFAULT_CONTEXT.min(model_context));
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    let fits = GeneratorOptions {
        context: Some(context),
        ..GeneratorOptions::default()
    };
    let loading = crate::common::spinner("loading the model");
    let dtype = args.dtype.map(DtypeName::weights);
    let lm = load_pretrained_with_config(&kernels, &args.model, config.as_ref(), dtype, &fits);
    loading.finish_and_clear();
    let lm = lm?;
    let text = read_text(&TextSource::File(args.text.clone()))?;
    let mut tokens = lm.tokenizer.encode(&text, true)?;
    let read = tokens.len();
    if let Some(most) = args.max_tokens {
        tokens.truncate(most);
    }
    let options = ScorerOptions {
        context,
        dtype: dtype.unwrap_or_default(),
        quantized: Arc::new(lm.quantized),
    };
    let preparing = crate::common::spinner("preparing kernels");
    let scorer = Scorer::new(kernels.clone(), lm.model.as_ref(), &options);
    preparing.finish_and_clear();
    let mut scorer = scorer?;
    let bos = lm.tokenizer.leading_bos();
    println!(
        "{}: {read} tokens{}; windows of {context} tokens, each scoring its last {}{}",
        args.text.display(),
        if tokens.len() < read {
            format!(", the first {} scored", tokens.len())
        } else {
            String::new()
        },
        scored_per_window(context),
        if bos.is_some() { ", BOS first" } else { "" }
    );
    let bar = ProgressBar::new((tokens.len() / context) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} windows {elapsed} (ETA {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let result = scorer.score(&tokens, bos, |done, _| bar.set_position(done as u64));
    bar.finish_and_clear();
    let result = result?;
    println!("windows {}", result.windows);
    println!("tokens scored {}", result.scored);
    if result.left_out > 0 {
        println!("tokens left out {} (after the last whole window)", result.left_out);
    }
    println!("mean loss {:.6} nats", result.mean_loss);
    println!("perplexity {:.4}", result.perplexity());
    println!(
        "{:.1} tokens/s ({} windows in {:.2} s on {})",
        result.tokens_per_second(),
        result.windows,
        result.seconds,
        kernels.device().label()
    );
    Ok(())
}
