//! A pretrained model with its own tokenizer, ready for a generator or a
//! scorer: a llama.cpp GGUF file (its matrices kept block-quantized as the
//! file stores them) or a Hugging Face folder with a `tokenizer.json`.
//! What `wgrad generate`, `chat`, `serve`, `perplexity` and the bench all
//! load, so each reads a model the same way.

use std::path::Path;

use crate::device::Instant;
use crate::error::{Error, Result};
use crate::infer::generate::{check_fits_stored, check_fits_with_options, GeneratorOptions, WeightDtype};
use crate::io::bpe::BpeTokenizer;
use crate::io::gguf_model::GgufModel;
use crate::io::lm_folder::{is_gguf_path, load_lm_folder, read_model_config};
use crate::kernels::Kernels;
use crate::nn::{CausalLm, LmConfig, LmSizes, QuantizedWeights};

/// A model with its own tokenizer, as [`load_pretrained`] reads it.
pub struct PretrainedLm {
    pub model: Box<dyn CausalLm>,
    /// Matrices stored as the GGUF file stores them (empty for a folder or
    /// when a dtype was asked for).
    pub quantized: QuantizedWeights,
    pub tokenizer: BpeTokenizer,
    /// The ids that end a turn ([`crate::io::chat::stop_ids`]).
    pub stops: Vec<u32>,
    /// The model's ids the tokenizer has no text for (rows past its
    /// vocabulary, holes in it): a generator never samples them.
    pub suppressed: Vec<u32>,
    /// The model's sizes as its config gives them, read once.
    pub sizes: LmSizes,
    pub load_seconds: f64,
}

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "load_pretrained",
        reason,
    }
}

/// Whether `path` is a model [`load_pretrained`] reads: a GGUF file, or a
/// folder with a `tokenizer.json`.
pub fn has_own_tokenizer(path: &Path) -> bool {
    is_gguf_path(path) || path.join("tokenizer.json").is_file()
}

/// The model at `path` (see [`has_own_tokenizer`]), checked against the
/// adapter's memory from its sizes before any weight is read (`fits`: the
/// sequences, context and prefill it will run). A GGUF Llama-family file
/// keeps its block-quantized matrices as stored unless `dtype` is given,
/// which de-quantizes every matrix (stored then as `dtype` says).
pub fn load_pretrained(
    kernels: &Kernels,
    path: &Path,
    dtype: Option<WeightDtype>,
    fits: &GeneratorOptions,
) -> Result<PretrainedLm> {
    let config = read_model_config(path)?;
    load_pretrained_with_config(kernels, path, config.as_ref(), dtype, fits)
}

/// (values, stored bytes) of the matrices [`load_pretrained`] keeps
/// block-quantized for the model at `path` (a GGUF file's, unless `dtype`
/// de-quantizes them; none for a folder), from the file's header alone:
/// what [`crate::infer::generate::context_that_fits_stored`] counts.
pub fn quantized_storage(path: &Path, dtype: Option<WeightDtype>) -> Result<(u64, u64)> {
    match dtype {
        None if is_gguf_path(path) => GgufModel::open(path)?.quantized_storage(),
        _ => Ok((0, 0)),
    }
}

/// [`load_pretrained`] for a caller that has read the model's config
/// already ([`read_model_config`], to size `fits` by it): the file's header
/// or config.json is read once.
pub fn load_pretrained_with_config(
    kernels: &Kernels,
    path: &Path,
    config: &dyn LmConfig,
    dtype: Option<WeightDtype>,
    fits: &GeneratorOptions,
) -> Result<PretrainedLm> {
    let start = Instant::now();
    let options = GeneratorOptions {
        dtype: dtype.unwrap_or_default(),
        ..fits.clone()
    };
    let sizes = config.lm_sizes();
    if is_gguf_path(path) {
        // The header only, so the check comes before any weight is read.
        let gguf = GgufModel::open(path)?;
        check_gguf_fits(kernels, &gguf, config, dtype, &options)?;
        return pretrained_gguf(gguf, dtype, sizes, start);
    }
    check_fits_with_options(kernels, config, &options)?;
    let tokenizer = BpeTokenizer::from_folder(path)?
        .ok_or_else(|| invalid(format!("`{}` has no tokenizer.json", path.display())))?;
    finish(
        load_lm_folder(path)?.model,
        QuantizedWeights::new(),
        tokenizer,
        sizes,
        start,
    )
}

/// [`load_pretrained`] on a GGUF file's bytes (what a page read from a
/// file picker or fetched); `label` names it in messages.
pub fn load_pretrained_gguf_bytes(
    kernels: &Kernels,
    label: &str,
    bytes: impl Into<std::sync::Arc<[u8]>>,
    dtype: Option<WeightDtype>,
    fits: &GeneratorOptions,
) -> Result<PretrainedLm> {
    let start = Instant::now();
    let gguf = GgufModel::from_gguf(crate::io::gguf::Gguf::from_bytes(label, bytes)?)?;
    let config = gguf.architecture().lm_config();
    let options = GeneratorOptions {
        dtype: dtype.unwrap_or_default(),
        ..fits.clone()
    };
    check_gguf_fits(kernels, &gguf, config.as_ref(), dtype, &options)?;
    pretrained_gguf(gguf, dtype, config.lm_sizes(), start)
}

/// The generator's memory check for a GGUF model: its matrices at their
/// stored size where they stay quantized (no `dtype`).
fn check_gguf_fits(
    kernels: &Kernels,
    gguf: &GgufModel,
    config: &dyn LmConfig,
    dtype: Option<WeightDtype>,
    options: &GeneratorOptions,
) -> Result<()> {
    let quantized = match dtype {
        None => gguf.quantized_storage()?,
        Some(_) => (0, 0),
    };
    check_fits_stored(kernels, config, options, quantized)
}

/// A GGUF model with its metadata's tokenizer, its matrices kept as stored
/// unless `dtype` is given.
fn pretrained_gguf(
    gguf: GgufModel,
    dtype: Option<WeightDtype>,
    sizes: LmSizes,
    start: Instant,
) -> Result<PretrainedLm> {
    let tokenizer = BpeTokenizer::from_gguf(gguf.gguf())?;
    match dtype {
        None => {
            let (model, quantized) = gguf.to_quantized_causal_lm()?;
            finish(model, quantized, tokenizer, sizes, start)
        }
        Some(_) => finish(gguf.to_causal_lm()?, QuantizedWeights::new(), tokenizer, sizes, start),
    }
}

/// The model with its tokenizer, checked against each other.
fn finish(
    model: Box<dyn CausalLm>,
    quantized: QuantizedWeights,
    tokenizer: BpeTokenizer,
    sizes: LmSizes,
    start: Instant,
) -> Result<PretrainedLm> {
    if tokenizer.vocab_size() > model.vocab_size() {
        return Err(invalid(format!(
            "the tokenizer has {} tokens, the model a vocabulary of {}",
            tokenizer.vocab_size(),
            model.vocab_size()
        )));
    }
    let stops = crate::io::chat::stop_ids(&tokenizer);
    let size = model.vocab_size();
    let vocab = u32::try_from(size).map_err(|_| invalid(format!("a vocabulary of {size} tokens")))?;
    let suppressed = (0..vocab).filter(|&id| tokenizer.token_bytes(id).is_err()).collect();
    Ok(PretrainedLm {
        model,
        quantized,
        tokenizer,
        stops,
        suppressed,
        sizes,
        load_seconds: start.elapsed().as_secs_f64(),
    })
}
