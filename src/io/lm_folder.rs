//! A causal language model folder of either family wgrad reads, told
//! apart by its config.json as transformers' `AutoModelForCausalLM` does:
//! `model_type: llama`, `qwen2` or `qwen3` (or `architectures:
//! [LlamaForCausalLM]`, …) is a [`crate::models::Llama`] folder ([`crate::io::llama_folder`]),
//! `gemma3_text` (`Gemma3ForCausalLM`) a [`crate::models::Gemma`] folder
//! ([`crate::io::gemma_folder`]), anything
//! else a GPT-2 folder ([`crate::io::gpt_folder`], which refuses another
//! `model_type` with its own error). What comes back is a [`CausalLm`],
//! which [`crate::infer::generate::Generator`] runs whatever the family.
//! [`load_model`] takes either such a folder or a llama.cpp GGUF file
//! ([`crate::io::gguf_model`]).

use std::path::Path;

use crate::error::Result;
use crate::io::gemma_folder::{self, load_gemma_folder, read_gemma_config};
use crate::io::gguf_model::{GgufArchitecture, GgufModel};
use crate::io::gpt_folder::{load_gpt_folder, read_gpt_config, TokenizerSpec};
use crate::io::hf_folder::ConfigFields;
use crate::io::llama_folder::{load_llama_folder, read_llama_config, variant_of_model_type};
use crate::models::LlamaVariant;
use crate::nn::{CausalLm, LmConfig};

/// The family a folder's config.json names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmFamily {
    Gpt2,
    Llama,
    Gemma3,
}

/// What [`load_lm_folder`] returns.
pub struct LoadedLm {
    pub family: LmFamily,
    pub model: Box<dyn CausalLm>,
    /// From `wgrad_tokenizer.json` (or GPT-2's BPE for GPT-2's vocabulary).
    pub tokenizer: Option<TokenizerSpec>,
    /// The GGUF file the model came from, kept open: its tokenizer's
    /// metadata and its tensors' raw (quantized) blocks. `None` for a folder.
    pub gguf: Option<GgufModel>,
}

/// The family of the folder at `dir`, from its config.json alone.
pub fn lm_family(dir: impl AsRef<Path>) -> Result<LmFamily> {
    let fields = ConfigFields::read(dir.as_ref(), "PretrainedConfig")?;
    // Qwen2, Qwen3 and Mistral are Llama variants, read by the Llama's folder code.
    let variants = [
        LlamaVariant::Llama,
        LlamaVariant::Qwen2,
        LlamaVariant::Qwen3,
        LlamaVariant::Mistral,
    ];
    let names_llama = fields.get("architectures").and_then(|a| a.as_array()).is_some_and(|a| {
        a.iter()
            .any(|v| variants.iter().any(|variant| v.as_str() == Some(variant.names().0)))
    });
    let llama_type = fields
        .text("model_type")?
        .is_some_and(|t| variant_of_model_type(t).is_some());
    let names_gemma = fields
        .get("architectures")
        .and_then(|a| a.as_array())
        .is_some_and(|a| a.iter().any(|v| v.as_str() == Some(gemma_folder::CLASS)));
    Ok(
        if names_gemma || fields.text("model_type")? == Some(gemma_folder::MODEL_TYPE) {
            LmFamily::Gemma3
        } else if llama_type || names_llama {
            LmFamily::Llama
        } else {
            LmFamily::Gpt2
        },
    )
}

/// The folder's sizes, checked, without reading its weights: enough for
/// [`crate::infer::generate::check_fits`].
pub fn read_lm_config(dir: impl AsRef<Path>) -> Result<Box<dyn LmConfig>> {
    let dir = dir.as_ref();
    Ok(match lm_family(dir)? {
        LmFamily::Gpt2 => Box::new(read_gpt_config(dir)?),
        LmFamily::Llama => Box::new(read_llama_config(dir)?),
        LmFamily::Gemma3 => Box::new(read_gemma_config(dir)?),
    })
}

/// The model and tokenizer of the folder at `dir`.
pub fn load_lm_folder(dir: impl AsRef<Path>) -> Result<LoadedLm> {
    let dir = dir.as_ref();
    let family = lm_family(dir)?;
    let (model, tokenizer): (Box<dyn CausalLm>, _) = match family {
        LmFamily::Gpt2 => {
            let loaded = load_gpt_folder(dir)?;
            (Box::new(loaded.model), loaded.tokenizer)
        }
        LmFamily::Llama => {
            let loaded = load_llama_folder(dir)?;
            (Box::new(loaded.model), loaded.tokenizer)
        }
        LmFamily::Gemma3 => {
            let loaded = load_gemma_folder(dir)?;
            (Box::new(loaded.model), loaded.tokenizer)
        }
    };
    Ok(LoadedLm {
        family,
        model,
        tokenizer,
        gguf: None,
    })
}

/// Whether [`load_model`] reads `path` as a GGUF file: it is a file (a
/// folder is a Hugging Face folder), or it does not exist and is named
/// `*.gguf` (so the error is the GGUF reader's).
pub fn is_gguf_path(path: impl AsRef<Path>) -> bool {
    let path = path.as_ref();
    path.is_file() || (!path.exists() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
}

/// The family of the model at `path`: a GGUF file's architecture (from
/// its header), or a folder's config.json.
pub fn model_family(path: impl AsRef<Path>) -> Result<LmFamily> {
    let path = path.as_ref();
    if !is_gguf_path(path) {
        return lm_family(path);
    }
    Ok(match GgufModel::open(path)?.architecture() {
        GgufArchitecture::Llama(_) => LmFamily::Llama,
        GgufArchitecture::Gpt2 { .. } => LmFamily::Gpt2,
        GgufArchitecture::Gemma3(_) => LmFamily::Gemma3,
    })
}

/// The sizes of the model at `path`, a folder or a GGUF file, checked,
/// without reading its weights: enough for
/// [`crate::infer::generate::check_fits`].
pub fn read_model_config(path: impl AsRef<Path>) -> Result<Box<dyn LmConfig>> {
    let path = path.as_ref();
    if is_gguf_path(path) {
        Ok(GgufModel::open(path)?.architecture().lm_config())
    } else {
        read_lm_config(path)
    }
}

/// The model at `path`: a Hugging Face folder ([`load_lm_folder`]) or a
/// GGUF file, whose weights are de-quantized to f32 (the file stays open
/// in [`LoadedLm::gguf`]; its tokenizer is in the file's metadata, so
/// [`LoadedLm::tokenizer`] is `None`).
pub fn load_model(path: impl AsRef<Path>) -> Result<LoadedLm> {
    let path = path.as_ref();
    if !is_gguf_path(path) {
        return load_lm_folder(path);
    }
    let gguf = GgufModel::open(path)?;
    let family = match gguf.architecture() {
        GgufArchitecture::Llama(_) => LmFamily::Llama,
        GgufArchitecture::Gpt2 { .. } => LmFamily::Gpt2,
        GgufArchitecture::Gemma3(_) => LmFamily::Gemma3,
    };
    Ok(LoadedLm {
        family,
        model: gguf.to_causal_lm()?,
        tokenizer: None,
        gguf: Some(gguf),
    })
}
