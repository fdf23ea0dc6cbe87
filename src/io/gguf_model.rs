//! A llama.cpp GGUF file as a wgrad model: [`GgufModel`] reads a `llama`
//! file's sizes from its metadata into a [`LlamaConfig`] (a `gpt2` file's
//! into a [`GptConfig`]), checks every tensor against that config before
//! anything is allocated for the model, and builds the [`Llama`] (the
//! [`Gpt`]) with every tensor de-quantized to f32. It keeps the file open,
//! so a quantized weight source can take the same tensors' raw blocks by
//! parameter name ([`GgufModel::raw_parameter`]).
//!
//! The rotary layout: llama.cpp's converter permutes the rows of q and k
//! within each head so that the channels a rotation pairs sit side by side
//! (Meta's interleaved layout, which llama.cpp's RoPE computes). The model
//! built here keeps the file's rows and rotates interleaved pairs
//! ([`RopeLayout::Interleaved`]); the attention scores equal Hugging Face's
//! half-split model's, since q and k move alike and v does not move. So
//! raw quantized rows need no moving either (the GGUF reader's
//! [`crate::io::gguf::llama::unpermute_rows`] gives Hugging Face's order
//! when a caller wants it).
//!
//! Qwen2 and Qwen3 files (`qwen2`, `qwen3`) load as a [`Llama`] of that
//! variant ([`crate::models::qwen`]): their converter leaves q and k in
//! Hugging Face's order (llama.cpp rotates them in NEOX mode, half-split
//! pairs), so the model rotates [`RopeLayout::HalfSplit`]; Qwen2's q/k/v
//! biases are `blk.N.attn_{q,k,v}.bias`, Qwen3's norms
//! `blk.N.attn_{q,k}_norm.weight` and its head width
//! `qwen3.attention.key_length`.
//!
//! llama.cpp writes Mistral as a `llama` file; one with
//! `llama.attention.sliding_window` loads as a [`Llama`] of the Mistral
//! variant attending over that window ([`crate::models::mistral`]).
//!
//! GPT-2 files (llama.cpp's converter stores the Conv1D weights transposed,
//! [out, in] as wgrad's Linear holds them) load as a [`Gpt`], whose head is
//! the token table: a file with an `output.weight` that does not decode to
//! the token table's values is refused.
//!
//! What is refused, each with an error naming the file and the key or the
//! tensor and its type: an architecture other than `llama` and `gpt2`,
//! sizes the model cannot have, a file without its tokenizer's vocabulary
//! (or, for a Llama, one whose length is not the model's vocabulary), a
//! missing tensor, a tensor whose shape disagrees with the metadata's
//! sizes, a type wgrad does not decode, and a tensor the model has no
//! parameter for (a Llama's biases, `rope_freqs.weight`: ignoring one would
//! silently compute another model).

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::gguf::{llama, unsupported, GgmlType, Gguf, TensorInfo};
use crate::io::gpt_folder::parameter_count;
use crate::io::hf_folder::SIZE_CHECKED_ABOVE;
use crate::models::{Gemma, GemmaConfig, Gpt, GptConfig, Llama, LlamaConfig, LlamaVariant};
use crate::nn::{CausalLm, LmConfig, Module, ParameterTree, QuantizedMatrix, QuantizedWeights, RopeLayout};
use crate::ops::QuantFormat;

/// The metadata key of the tokenizer's vocabulary (one string per id).
pub const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
/// The metadata key of the tokenizer's kind (`gpt2` for byte-level BPE).
pub const TOKENIZER_MODEL_KEY: &str = "tokenizer.ggml.model";
/// A `llama` file's attention window (gguf-py's `Keys.Attention.SLIDING_WINDOW`).
pub const SLIDING_WINDOW_KEY: &str = "llama.attention.sliding_window";

/// The metadata key naming the architecture.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// Sizes read from the metadata above this are refused (the GGUF reader's
/// Llama bound), so a corrupt file cannot make the loader build an absurd
/// model's structure.
const MAX_SIZE: u64 = 1 << 24;
/// GPT-2's untied head name in a GGUF file; wgrad's GPT ties its head.
const GPT2_HEAD: &str = "output.weight";

/// What a GGUF file holds, with the sizes from its metadata.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GgufArchitecture {
    /// `llama`: q and k rotate interleaved pairs (the file's row order);
    /// `qwen2`, `qwen3`: the config's variant, half-split pairs.
    Llama(LlamaConfig),
    /// `gpt2`, with its LayerNorm epsilon.
    Gpt2 { config: GptConfig, layer_norm_eps: f32 },
    /// `gemma3`: q and k in Hugging Face's order (half-split pairs), every
    /// norm weight stored as 1 + Hugging Face's.
    Gemma3(GemmaConfig),
}

impl GgufArchitecture {
    /// The sizes [`crate::infer::generate::check_fits`] needs.
    pub fn lm_config(&self) -> Box<dyn LmConfig> {
        match *self {
            GgufArchitecture::Llama(config) => Box::new(config),
            GgufArchitecture::Gpt2 { config, .. } => Box::new(config),
            GgufArchitecture::Gemma3(config) => Box::new(config),
        }
    }
}

/// A GGUF model file checked against its own metadata: the model it
/// describes and, for each of the model's parameters, the tensor that
/// holds it.
#[derive(Debug)]
pub struct GgufModel {
    gguf: Gguf,
    architecture: GgufArchitecture,
    /// (wgrad parameter name, GGUF tensor name) of every parameter of the
    /// model, in [`Module::named_parameters`] order.
    parameters: Vec<(String, String)>,
}

impl GgufModel {
    /// Reads the header of the file at `path` and checks it (see the
    /// module docs); reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(Gguf::open(path)?)
    }

    /// The same checks on a file already opened.
    pub fn from_gguf(gguf: Gguf) -> Result<Self> {
        let bad = |reason: String| Error::Gguf {
            path: gguf.path().to_path_buf(),
            reason,
        };
        let (architecture, named): (_, Vec<(String, Vec<usize>)>) = match gguf.get_str(ARCHITECTURE_KEY)? {
            "llama" => {
                let config = llama_config(&gguf)?;
                check_data_holds(&gguf, config.num_parameters())?;
                (
                    GgufArchitecture::Llama(config),
                    Llama::empty(config)?.named_parameters(),
                )
            }
            arch @ ("qwen2" | "qwen3") => {
                let config = qwen_config(&gguf, arch)?;
                check_data_holds(&gguf, config.num_parameters())?;
                (
                    GgufArchitecture::Llama(config),
                    Llama::empty(config)?.named_parameters(),
                )
            }
            "gemma3" => {
                let config = gemma_config(&gguf)?;
                check_data_holds(&gguf, config.num_parameters())?;
                (
                    GgufArchitecture::Gemma3(config),
                    Gemma::empty(config)?.named_parameters(),
                )
            }
            "gpt2" => {
                let (config, layer_norm_eps) = gpt2_config(&gguf)?;
                check_data_holds(&gguf, parameter_count(&config))?;
                (
                    GgufArchitecture::Gpt2 { config, layer_norm_eps },
                    Gpt::empty(config)?.named_parameters(),
                )
            }
            other => {
                return Err(bad(format!(
                    "architecture `{other}`: wgrad runs `llama`, `qwen2`, `qwen3`, `gemma3` and `gpt2` GGUF files"
                )))
            }
        };
        let gguf_name: fn(&str) -> Option<String> = match architecture {
            GgufArchitecture::Llama(config) if matches!(config.variant, LlamaVariant::Qwen2 | LlamaVariant::Qwen3) => {
                qwen_gguf_name
            }
            GgufArchitecture::Llama(_) => llama::gguf_name,
            GgufArchitecture::Gpt2 { .. } => gpt2_gguf_name,
            GgufArchitecture::Gemma3(_) => gemma_gguf_name,
        };
        let optional = match architecture {
            GgufArchitecture::Llama(_) | GgufArchitecture::Gemma3(_) => vec![],
            GgufArchitecture::Gpt2 { config, .. } => {
                vec![(GPT2_HEAD.to_string(), vec![config.vocab_size, config.n_embd])]
            }
        };
        let parameters = match_tensors(&gguf, named, gguf_name, optional)?;
        Ok(GgufModel {
            gguf,
            architecture,
            parameters,
        })
    }

    /// The architecture and sizes the metadata describes.
    pub fn architecture(&self) -> &GgufArchitecture {
        &self.architecture
    }

    /// The file: metadata (the tokenizer's), tensor infos, raw tensors.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// (wgrad parameter name, GGUF tensor name) of every parameter, in
    /// [`Module::named_parameters`] order.
    pub fn parameters(&self) -> &[(String, String)] {
        &self.parameters
    }

    /// The tensor info of the parameter `name` (`model.layers.0.mlp.up_proj.weight`).
    pub fn parameter_info(&self, name: &str) -> Result<&TensorInfo> {
        let tensor = self
            .parameters
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
            .ok_or_else(|| Error::InvalidArgument {
                op: "GgufModel::parameter_info",
                reason: format!("`{name}` is not a parameter of {}", self.gguf.path().display()),
            })?;
        self.gguf.require_tensor(tensor)
    }

    /// The parameter `name`'s bytes as stored (ggml blocks, rows of q and k
    /// in the interleaved layout the Llama's config rotates), with its
    /// info (type, dims): for weights that stay quantized on the GPU.
    pub fn raw_parameter(&self, name: &str) -> Result<(&TensorInfo, Vec<u8>)> {
        let info = self.parameter_info(name)?;
        Ok((info, self.gguf.read_raw(&info.name)?))
    }

    /// The parameter `name` de-quantized to f32, row-major, in the same
    /// layout; a Gemma 3 norm weight as Hugging Face stores it (the file's
    /// less 1).
    pub fn parameter_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.parameter_info(name)?;
        let mut values = self.gguf.read_f32(&info.name)?;
        if matches!(self.architecture, GgufArchitecture::Gemma3(_)) && name.ends_with("norm.weight") {
            values.iter_mut().for_each(|v| *v -= 1.0);
        }
        Ok(values)
    }

    /// Every matrix the file stores block-quantized in a format the kernels
    /// read (every `QuantFormat`: the legacy blocks and the k-quants), by
    /// parameter name, as its raw blocks: the
    /// weight source of a generator whose weights stay quantized on the
    /// GPU (`Generator::new_with_weights`). Matrices of other types are
    /// not in it (the model's f32 values serve them).
    pub fn quantized_weights(&self) -> Result<QuantizedWeights> {
        let mut quantized = QuantizedWeights::new();
        for (name, _) in &self.parameters {
            let info = self.parameter_info(name)?;
            if let Some(format) = kept_quantized(info) {
                // Checked (finite scales) before any kernel reads it.
                let (_, raw) = self.gguf.read_quantized(&info.name)?;
                quantized.insert(
                    name.clone(),
                    QuantizedMatrix {
                        format,
                        raw: raw.into(),
                    },
                );
            }
        }
        Ok(quantized)
    }

    /// The matrices a LoRA base over this file keeps block-quantized on
    /// the device (QLoRA, `nn::BaseStorage::Quantized`): what a generator
    /// keeps quantized ([`GgufModel::to_quantized_causal_lm`]'s map), by
    /// the module tree's names; none for GPT-2, whose fused matrices are
    /// de-quantized.
    pub fn lora_base_weights(&self) -> Result<QuantizedWeights> {
        match self.architecture {
            GgufArchitecture::Llama(_) | GgufArchitecture::Gemma3(_) => self.quantized_weights(),
            GgufArchitecture::Gpt2 { .. } => Ok(QuantizedWeights::new()),
        }
    }

    /// What [`GgufModel::to_quantized_causal_lm`] keeps block-quantized,
    /// from the header alone: (values, stored bytes) of those matrices, so
    /// a generator's memory is checked before any weight is read. A GPT-2
    /// keeps none (its fused matrices are de-quantized).
    pub fn quantized_storage(&self) -> Result<(u64, u64)> {
        if matches!(self.architecture, GgufArchitecture::Gpt2 { .. }) {
            return Ok((0, 0));
        }
        let mut stored = (0u64, 0u64);
        for (name, _) in &self.parameters {
            let info = self.parameter_info(name)?;
            if kept_quantized(info).is_some() {
                stored = (stored.0 + info.n_elements, stored.1 + info.n_bytes);
            }
        }
        Ok(stored)
    }

    /// The Llama, every weight de-quantized to f32; an error for another
    /// architecture.
    pub fn to_llama(&self) -> Result<Llama> {
        match self.architecture {
            GgufArchitecture::Llama(config) => Llama::from_parameters(config, |name, _| self.parameter_f32(name)),
            GgufArchitecture::Gpt2 { .. } => Err(self.not_a("Llama", "gpt2")),
            GgufArchitecture::Gemma3(_) => Err(self.not_a("Llama", "gemma3")),
        }
    }

    /// The Gemma 3, every weight de-quantized to f32; an error for another
    /// architecture.
    pub fn to_gemma(&self) -> Result<Gemma> {
        match self.architecture {
            GgufArchitecture::Gemma3(config) => Gemma::from_parameters(config, |name, _| self.parameter_f32(name)),
            _ => Err(self.not_a("Gemma 3", self.gguf.get_str(ARCHITECTURE_KEY).unwrap_or("other"))),
        }
    }

    /// The model with its matrices as the file stores them (see
    /// [`GgufModel::to_quantized_llama`]): a Llama (or Qwen) or a Gemma 3
    /// with values only for the parameters not in the map; a GPT-2 (whose
    /// fused matrices the generator de-quantizes) de-quantized to f32
    /// with an empty map.
    pub fn to_quantized_causal_lm(&self) -> Result<(Box<dyn CausalLm>, QuantizedWeights)> {
        match self.architecture {
            GgufArchitecture::Llama(_) => {
                let (model, quantized) = self.to_quantized_llama()?;
                Ok((Box::new(model), quantized))
            }
            GgufArchitecture::Gemma3(config) => {
                let quantized = self.quantized_weights()?;
                let mut model = Gemma::empty(config)?;
                model.visit_mut("", &mut |name, _, values| {
                    if !quantized.contains_key(&name) {
                        *values = self.parameter_f32(&name)?;
                    }
                    Ok(())
                })?;
                Ok((Box::new(model), quantized))
            }
            GgufArchitecture::Gpt2 { .. } => Ok((Box::new(self.to_gpt()?), QuantizedWeights::new())),
        }
    }

    /// The Llama with its matrices as the file stores them: each Q8_0,
    /// Q4_0 or Q4_1 matrix's raw blocks by parameter name, for
    /// [`crate::infer::generate::Generator::new_with_weights`], and the
    /// model holding values only for the other parameters (norms, F32 and
    /// F16 matrices, as f32), so no quantized matrix is expanded to f32 on
    /// the host. An error for another architecture.
    pub fn to_quantized_llama(&self) -> Result<(Llama, QuantizedWeights)> {
        let GgufArchitecture::Llama(config) = self.architecture else {
            return Err(self.not_a("Llama", "gpt2"));
        };
        let quantized = self.quantized_weights()?;
        let mut model = Llama::empty(config)?;
        model.visit_mut("", &mut |name, _, values| {
            if !quantized.contains_key(&name) {
                *values = self.parameter_f32(&name)?;
            }
            Ok(())
        })?;
        Ok((model, quantized))
    }

    /// The GPT-2, every weight de-quantized to f32; an error for another
    /// architecture, or for a stored head that is not the token table.
    pub fn to_gpt(&self) -> Result<Gpt> {
        let GgufArchitecture::Gpt2 { config, layer_norm_eps } = self.architecture else {
            return Err(self.not_a("GPT-2", "llama"));
        };
        let mut model = Gpt::from_parameters(config, |name, _| self.parameter_f32(name))?;
        if let Some(head) = self.gguf.tensor(GPT2_HEAD) {
            let same = self
                .gguf
                .read_f32(GPT2_HEAD)?
                .iter()
                .zip(&model.wte.weight)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                return Err(self.gguf.tensor_error(
                    head,
                    "differs from `token_embd.weight`: wgrad's GPT ties its head to the token table".into(),
                ));
            }
        }
        for block in &mut model.h {
            block.ln_1.eps = layer_norm_eps;
            block.ln_2.eps = layer_norm_eps;
        }
        model.ln_f.eps = layer_norm_eps;
        Ok(model)
    }

    /// The model, of whichever architecture, de-quantized to f32.
    pub fn to_causal_lm(&self) -> Result<Box<dyn CausalLm>> {
        Ok(match self.architecture {
            GgufArchitecture::Llama(_) => Box::new(self.to_llama()?),
            GgufArchitecture::Gpt2 { .. } => Box::new(self.to_gpt()?),
            GgufArchitecture::Gemma3(_) => Box::new(self.to_gemma()?),
        })
    }

    fn not_a(&self, wanted: &str, is: &str) -> Error {
        Error::Gguf {
            path: self.gguf.path().to_path_buf(),
            reason: format!("is a `{is}` file, not a {wanted}"),
        }
    }
}

/// The format a matrix stays in on the GPU: a 2-D tensor in a block format
/// the kernels read; `None` for what is de-quantized to f32.
fn kept_quantized(info: &TensorInfo) -> Option<QuantFormat> {
    QuantFormat::try_from(info.ty).ok().filter(|_| info.dims.len() == 2)
}

/// The Llama of the GGUF file at `path`, de-quantized to f32.
pub fn load_llama_gguf(path: impl AsRef<Path>) -> Result<Llama> {
    GgufModel::open(path)?.to_llama()
}

/// The size of the tokenizer's vocabulary; an error naming the key when
/// the file has none.
fn tokenizer_vocabulary(gguf: &Gguf) -> Result<usize> {
    if gguf.get(TOKENS_KEY).is_none() {
        return Err(Error::Gguf {
            path: gguf.path().to_path_buf(),
            reason: format!("no tokenizer: the metadata has no `{TOKENS_KEY}` (a model file carries its vocabulary)"),
        });
    }
    gguf.get_str(TOKENIZER_MODEL_KEY)?;
    Ok(gguf.get_strings(TOKENS_KEY)?.len())
}

/// A `llama` file's config: the GGUF reader's sizes, the tokenizer's
/// vocabulary agreeing, and enough tensors for the blocks claimed.
fn llama_config(gguf: &Gguf) -> Result<LlamaConfig> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let tokens = tokenizer_vocabulary(gguf)?;
    let hp = llama::Hparams::from_gguf(gguf)?;
    if tokens != hp.vocab_size {
        return Err(bad(format!(
            "the tokenizer has {tokens} tokens (`{TOKENS_KEY}`) but the model a vocabulary of {}",
            hp.vocab_size
        )));
    }
    check_blocks(gguf, "llama", hp.n_layer, 9)?;
    // llama.cpp converts Mistral to `llama`; a window marks it one.
    let sliding_window = match gguf.get(SLIDING_WINDOW_KEY) {
        None => None,
        Some(_) => match gguf.get_u64(SLIDING_WINDOW_KEY)? {
            w @ 1..=MAX_SIZE => Some(w as usize),
            w => {
                return Err(bad(format!(
                    "metadata `{SLIDING_WINDOW_KEY}` = {w} is outside 1..={MAX_SIZE}"
                )))
            }
        },
    };
    let config = LlamaConfig {
        vocab_size: hp.vocab_size,
        block_size: hp.n_ctx,
        n_layer: hp.n_layer,
        n_head: hp.n_head,
        n_kv_head: hp.n_kv_head,
        n_embd: hp.n_embd,
        intermediate_size: hp.n_ff,
        rope_theta: hp.rope_base,
        rms_norm_eps: hp.rms_eps,
        tie_word_embeddings: hp.tied_embeddings,
        rope_layout: RopeLayout::Interleaved,
        head_dim: None,
        sliding_window,
        variant: if sliding_window.is_some() {
            LlamaVariant::Mistral
        } else {
            LlamaVariant::Llama
        },
    };
    config
        .check()
        .map_err(|e| bad(format!("the metadata's sizes make no Llama: {e}")))?;
    Ok(config)
}

/// A `qwen2` or `qwen3` file's config, from its `{arch}.*` metadata
/// (llama.cpp's names: `block_count`, `attention.head_count_kv`,
/// `attention.key_length`, `rope.freq_base`, …); the vocabulary is the
/// tokenizer's (the converter pads it to the embedding's rows).
fn qwen_config(gguf: &Gguf, arch: &str) -> Result<LlamaConfig> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let key = |name: &str| format!("{arch}.{name}");
    let size = |name: &str| -> Result<usize> {
        let v = gguf.get_u64(&key(name))?;
        if v == 0 || v > MAX_SIZE {
            return Err(bad(format!("metadata `{}` = {v} is outside 1..={MAX_SIZE}", key(name))));
        }
        Ok(v as usize)
    };
    let optional = |name: &str| -> Result<Option<usize>> { gguf.get(&key(name)).map(|_| size(name)).transpose() };
    let variant = if arch == "qwen2" {
        LlamaVariant::Qwen2
    } else {
        LlamaVariant::Qwen3
    };
    let (n_embd, n_head) = (size("embedding_length")?, size("attention.head_count")?);
    let head_dim = optional("attention.key_length")?;
    if optional("attention.value_length")?.is_some_and(|v| Some(v) != head_dim) {
        return Err(bad(format!(
            "`{}` differs from `{}`: wgrad's heads have one width",
            key("attention.value_length"),
            key("attention.key_length")
        )));
    }
    let rope_dims = optional("rope.dimension_count")?;
    let config = LlamaConfig {
        vocab_size: tokenizer_vocabulary(gguf)?,
        block_size: size("context_length")?,
        n_layer: size("block_count")?,
        n_head,
        n_kv_head: optional("attention.head_count_kv")?.unwrap_or(n_head),
        n_embd,
        intermediate_size: size("feed_forward_length")?,
        rope_theta: if gguf.get(&key("rope.freq_base")).is_some() {
            gguf.get_f32(&key("rope.freq_base"))?
        } else {
            10000.0
        },
        rms_norm_eps: gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        tie_word_embeddings: gguf.tensor("output.weight").is_none(),
        rope_layout: RopeLayout::HalfSplit,
        head_dim: head_dim.filter(|&d| n_head.checked_mul(d) != Some(n_embd)),
        sliding_window: None,
        variant,
    };
    if rope_dims.is_some_and(|d| d != config.head_dim()) {
        return Err(bad(format!(
            "rotary embedding over {rope_dims:?} of each head's {} dimensions (wgrad's Qwen rotates them all)",
            config.head_dim()
        )));
    }
    // Nine tensors a block as the Llama's, and the biases or the norms.
    check_blocks(
        gguf,
        arch,
        config.n_layer,
        if variant == LlamaVariant::Qwen2 { 12 } else { 11 },
    )?;
    config
        .check()
        .map_err(|e| bad(format!("the metadata's sizes make no {}: {e}", variant.names().2)))?;
    Ok(config)
}

/// The GGUF name of a Qwen2/Qwen3 parameter: the Llama's names (the
/// biases included), and Qwen3's `blk.N.attn_q_norm` / `attn_k_norm`.
pub fn qwen_gguf_name(name: &str) -> Option<String> {
    if let Some(gguf) = llama::gguf_name(name) {
        return Some(gguf);
    }
    let (layer, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let norm = match rest {
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{norm}.weight"))
}

/// A `gemma3` file's config, from its `gemma3.*` metadata (llama.cpp's
/// names). What the metadata does not carry is what llama.cpp assumes for
/// this architecture: local layers' rotary base 10,000, a global layer
/// every sixth, scores scaled by key_length^-½ (`query_pre_attn_scalar`
/// = head width, as in every Gemma 3 but the 27B).
fn gemma_config(gguf: &Gguf) -> Result<GemmaConfig> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let size = |name: &str| -> Result<usize> {
        let key = format!("gemma3.{name}");
        let v = gguf.get_u64(&key)?;
        if v == 0 || v > MAX_SIZE {
            return Err(bad(format!("metadata `{key}` = {v} is outside 1..={MAX_SIZE}")));
        }
        Ok(v as usize)
    };
    let n_head = size("attention.head_count")?;
    let n_embd = size("embedding_length")?;
    let head_dim = match gguf.get("gemma3.attention.key_length") {
        Some(_) => size("attention.key_length")?,
        None => n_embd / n_head,
    };
    if gguf.get("gemma3.attention.value_length").is_some() && size("attention.value_length")? != head_dim {
        return Err(bad(
            "`gemma3.attention.value_length` differs from `gemma3.attention.key_length`: wgrad's heads have one width"
                .into(),
        ));
    }
    if gguf.tensor("output.weight").is_some() {
        return Err(bad(
            "has an `output.weight`: wgrad's Gemma 3 ties its head to the token table".into(),
        ));
    }
    let config = GemmaConfig {
        vocab_size: tokenizer_vocabulary(gguf)?,
        block_size: size("context_length")?,
        n_layer: size("block_count")?,
        n_head,
        n_kv_head: match gguf.get("gemma3.attention.head_count_kv") {
            Some(_) => size("attention.head_count_kv")?,
            None => n_head,
        },
        n_embd,
        head_dim,
        intermediate_size: size("feed_forward_length")?,
        rope_theta: match gguf.get("gemma3.rope.freq_base") {
            Some(_) => gguf.get_f32("gemma3.rope.freq_base")?,
            None => 1_000_000.0,
        },
        rope_local_theta: 10_000.0,
        rms_norm_eps: gguf.get_f32("gemma3.attention.layer_norm_rms_epsilon")?,
        query_pre_attn_scalar: head_dim as f32,
        sliding_window: size("attention.sliding_window")?,
        sliding_window_pattern: 6,
    };
    // Thirteen tensors a block: the four projections, q/k norms, four
    // norms around the branches, the three MLP matrices.
    check_blocks(gguf, "gemma3", config.n_layer, 13)?;
    config
        .check()
        .map_err(|e| bad(format!("the metadata's sizes make no Gemma 3: {e}")))?;
    Ok(config)
}

/// The GGUF name of a [`Gemma`] parameter (gguf-py's `GEMMA3` tensors).
pub fn gemma_gguf_name(name: &str) -> Option<String> {
    const MODEL: [(&str, &str); 2] = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ];
    const BLOCK: [(&str, &str); 13] = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("self_attn.o_proj", "attn_output"),
        ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ];
    if let Some((_, gguf)) = MODEL.iter().find(|(n, _)| *n == name) {
        return Some(gguf.to_string());
    }
    let (layer, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let (_, gguf) = BLOCK.iter().find(|(n, _)| *n == module)?;
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// A `gpt2` file's config and LayerNorm epsilon (`gpt2.*` keys; the
/// vocabulary is the tokenizer's).
fn gpt2_config(gguf: &Gguf) -> Result<(GptConfig, f32)> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let size = |key: &str| -> Result<usize> {
        let v = gguf.get_u64(&format!("gpt2.{key}"))?;
        if v == 0 || v > MAX_SIZE {
            return Err(bad(format!("metadata `gpt2.{key}` = {v} is outside 1..={MAX_SIZE}")));
        }
        Ok(v as usize)
    };
    let config = GptConfig {
        vocab_size: tokenizer_vocabulary(gguf)?,
        block_size: size("context_length")?,
        n_layer: size("block_count")?,
        n_head: size("attention.head_count")?,
        n_embd: size("embedding_length")?,
    };
    if gguf.get("gpt2.feed_forward_length").is_some() && size("feed_forward_length")? != 4 * config.n_embd {
        return Err(bad(format!(
            "`gpt2.feed_forward_length` is not 4 × {} channels: wgrad's GPT-2 MLP is 4 times wider than the model",
            config.n_embd
        )));
    }
    let eps = gguf.get_f32("gpt2.attention.layer_norm_epsilon")?;
    if !(eps.is_finite() && eps > 0.0) {
        return Err(bad(format!(
            "`gpt2.attention.layer_norm_epsilon` {eps} is not a positive number"
        )));
    }
    if config.vocab_size == 0 || config.n_embd % config.n_head != 0 {
        return Err(bad(format!("the metadata's sizes make no GPT-2: {config:?}")));
    }
    check_blocks(gguf, "gpt2", config.n_layer, 12)?;
    Ok((config, eps))
}

/// Refuses sizes whose model has more parameters than the file's tensor
/// data could hold at Q2_K's 84 bytes a 256 values (the densest type wgrad
/// decodes: Q4_0's 18 a 32 refused real Q2_K files), before the model's
/// structure is built: a 3 KB file of 8 blocks of 2^24 channels made the
/// empty Llama allocate 1 GB of norms.
fn check_data_holds(gguf: &Gguf, parameters: Option<usize>) -> Result<()> {
    const DENSEST: GgmlType = GgmlType::Q2_K;
    if parameters.is_some_and(|n| n <= SIZE_CHECKED_ABOVE) {
        return Ok(());
    }
    let held = gguf.file_size().saturating_sub(gguf.data_offset());
    let needed = parameters
        .and_then(|n| u64::try_from(n).ok())
        .and_then(|n| n.checked_mul(DENSEST.type_size()))
        .map(|b| b / DENSEST.block_size());
    if needed.is_none_or(|needed| needed > held) {
        let count = parameters.map_or("more than 2^64".to_string(), |n| n.to_string());
        return Err(Error::Gguf {
            path: gguf.path().to_path_buf(),
            reason: format!(
                "the metadata's sizes make a model of {count} parameters, more than {held} bytes of tensor data hold ({} bytes a {} values at the least, {DENSEST}'s)",
                DENSEST.type_size(),
                DENSEST.block_size()
            ),
        });
    }
    Ok(())
}

/// A file claiming more blocks than its tensors fill is refused before the
/// model's structure is built for them.
fn check_blocks(gguf: &Gguf, arch: &str, blocks: usize, tensors_per_block: usize) -> Result<()> {
    if blocks
        .checked_mul(tensors_per_block)
        .is_none_or(|n| n > gguf.tensors().len())
    {
        return Err(Error::Gguf {
            path: gguf.path().to_path_buf(),
            reason: format!(
                "`{arch}.block_count` = {blocks} blocks of {tensors_per_block} tensors, but the file has {} tensors",
                gguf.tensors().len()
            ),
        });
    }
    Ok(())
}

/// The GGUF name of a [`Gpt`] parameter (GPT-2's names): llama.cpp's
/// `blk.N.attn_qkv` for `h.N.attn.c_attn`, and so on.
pub fn gpt2_gguf_name(name: &str) -> Option<String> {
    const MODEL: [(&str, &str); 4] = [
        ("wte.weight", "token_embd.weight"),
        ("wpe.weight", "position_embd.weight"),
        ("ln_f.weight", "output_norm.weight"),
        ("ln_f.bias", "output_norm.bias"),
    ];
    const BLOCK: [(&str, &str); 6] = [
        ("ln_1", "attn_norm"),
        ("attn.c_attn", "attn_qkv"),
        ("attn.c_proj", "attn_output"),
        ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"),
        ("mlp.c_proj", "ffn_down"),
    ];
    if let Some((_, gguf)) = MODEL.iter().find(|(n, _)| *n == name) {
        return Some(gguf.to_string());
    }
    let (layer, rest) = name.strip_prefix("h.")?.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let (_, gguf) = BLOCK.iter().find(|(n, _)| *n == module)?;
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// Every parameter's tensor (`named`: the model's names and shapes), of
/// its shape and a decoded type, and no tensor left over but `optional`
/// ones (GGUF names and shapes; their values are the caller's to check).
fn match_tensors(
    gguf: &Gguf,
    named: Vec<(String, Vec<usize>)>,
    gguf_name: fn(&str) -> Option<String>,
    optional: Vec<(String, Vec<usize>)>,
) -> Result<Vec<(String, String)>> {
    let mut unused: HashMap<&str, &TensorInfo> = gguf.tensors().iter().map(|t| (t.name.as_str(), t)).collect();
    let mut parameters = Vec::new();
    let check = |info: &TensorInfo, name: &str, shape: &[usize]| -> Result<()> {
        if info.shape() != shape {
            return Err(gguf.tensor_error(
                info,
                format!(
                    "has the row-major shape {:?}, but the metadata's sizes make `{name}` {shape:?}",
                    info.shape()
                ),
            ));
        }
        if !info.ty.is_decoded() {
            return Err(gguf.tensor_error(info, unsupported(info.ty)));
        }
        Ok(())
    };
    for (name, shape) in named {
        let tensor = gguf_name(&name).ok_or_else(|| Error::InvalidArgument {
            op: "GgufModel",
            reason: format!("no GGUF name for parameter `{name}`"),
        })?;
        let info = unused.remove(tensor.as_str()).ok_or_else(|| Error::GgufTensor {
            path: gguf.path().to_path_buf(),
            tensor: tensor.clone(),
            dtype: "absent".into(),
            reason: format!("the file has no such tensor, but its metadata implies `{name}` of shape {shape:?}"),
        })?;
        check(info, &name, &shape)?;
        parameters.push((name, tensor));
    }
    for (tensor, shape) in optional {
        if let Some(info) = unused.remove(tensor.as_str()) {
            check(info, &tensor, &shape)?;
        }
    }
    if let Some(info) = gguf.tensors().iter().find(|t| unused.contains_key(t.name.as_str())) {
        return Err(gguf.tensor_error(info, "is not a parameter of the model wgrad builds for this architecture (its Llama has no biases and computes the default rotary embedding)".into()));
    }
    Ok(parameters)
}
