//! A llama.cpp GGUF file as a wgrad model: [`GgufLlama`] reads a `llama`
//! file's sizes from its metadata into a [`LlamaConfig`], checks every
//! tensor against that config before anything is allocated for the model,
//! and builds the [`Llama`] with every tensor de-quantized to f32. It keeps
//! the file open, so a quantized weight source can take the same tensors'
//! raw blocks by parameter name ([`GgufLlama::raw_parameter`]).
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
//! What is refused, each with an error naming the file and the key or the
//! tensor and its type: an architecture other than `llama`, sizes the model
//! cannot have, a file without its tokenizer's vocabulary (or one whose
//! length is not the model's vocabulary), a missing tensor, a tensor whose
//! shape disagrees with the metadata's sizes, a type wgrad does not
//! decode, and a tensor the model has no parameter for (biases,
//! `rope_freqs.weight`: ignoring one would silently compute another model).

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::gguf::{llama, unsupported, Gguf, TensorInfo};
use crate::models::{Llama, LlamaConfig};
use crate::nn::{Module, RopeLayout};

/// The metadata key of the tokenizer's vocabulary (one string per id).
pub const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
/// The metadata key of the tokenizer's kind (`gpt2` for byte-level BPE).
pub const TOKENIZER_MODEL_KEY: &str = "tokenizer.ggml.model";
/// Tensors in a block of a Llama file (two norms, q, k, v, o, gate, up,
/// down): a file claiming more blocks than its tensors fill is refused
/// before the model's structure is built for them.
const TENSORS_PER_BLOCK: usize = 9;

/// A GGUF Llama checked against its own metadata: the config it describes
/// and, for each of the model's parameters, the tensor that holds it.
#[derive(Debug)]
pub struct GgufLlama {
    gguf: Gguf,
    config: LlamaConfig,
    /// Hugging Face parameter name → GGUF tensor name, for every
    /// parameter of `Llama::empty(config)` in its order.
    parameters: Vec<(String, String)>,
}

impl GgufLlama {
    /// Reads the header of the file at `path` and checks it (see the
    /// module docs); reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(Gguf::open(path)?)
    }

    /// The same checks on a file already opened.
    pub fn from_gguf(gguf: Gguf) -> Result<Self> {
        let bad = |reason: String| Error::Gguf { path: gguf.path().to_path_buf(), reason };
        let hp = llama::Hparams::from_gguf(&gguf)?;
        let tokens = match gguf.get(TOKENS_KEY) {
            Some(_) => gguf.get_strings(TOKENS_KEY)?.len(),
            None => return Err(bad(format!("no tokenizer: the metadata has no `{TOKENS_KEY}` (a model file carries its vocabulary)"))),
        };
        gguf.get_str(TOKENIZER_MODEL_KEY)?;
        if tokens != hp.vocab_size {
            return Err(bad(format!("the tokenizer has {tokens} tokens (`{TOKENS_KEY}`) but the model a vocabulary of {}", hp.vocab_size)));
        }
        let blocks_fit = hp.n_layer.checked_mul(TENSORS_PER_BLOCK).is_some_and(|n| n <= gguf.tensors().len());
        if !blocks_fit {
            return Err(bad(format!("`llama.block_count` = {} blocks of {TENSORS_PER_BLOCK} tensors, but the file has {} tensors", hp.n_layer, gguf.tensors().len())));
        }
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
        };
        config.check().map_err(|e| bad(format!("the metadata's sizes make no Llama: {e}")))?;
        let parameters = Self::match_tensors(&gguf, &config)?;
        Ok(GgufLlama { gguf, config, parameters })
    }

    /// Every parameter's tensor, of its shape and a decoded type, and no
    /// tensor left over.
    fn match_tensors(gguf: &Gguf, config: &LlamaConfig) -> Result<Vec<(String, String)>> {
        let mut unused: HashMap<&str, &TensorInfo> = gguf.tensors().iter().map(|t| (t.name.as_str(), t)).collect();
        let mut parameters = Vec::new();
        for (name, shape) in Llama::empty(*config)?.named_parameters() {
            let tensor = llama::gguf_name(&name).ok_or_else(|| Error::InvalidArgument { op: "GgufLlama", reason: format!("no GGUF name for parameter `{name}`") })?;
            let info = unused.remove(tensor.as_str()).ok_or_else(|| Error::GgufTensor {
                path: gguf.path().to_path_buf(),
                tensor: tensor.clone(),
                dtype: "absent".into(),
                reason: format!("the file has no such tensor, but its metadata implies `{name}` of shape {shape:?}"),
            })?;
            if info.shape() != shape {
                return Err(gguf.tensor_error(
                    info,
                    format!("has the row-major shape {:?}, but the metadata's sizes make `{name}` {shape:?}", info.shape()),
                ));
            }
            if !info.ty.is_decoded() {
                return Err(gguf.tensor_error(info, unsupported(info.ty)));
            }
            parameters.push((name, tensor));
        }
        if let Some(info) = gguf.tensors().iter().find(|t| unused.contains_key(t.name.as_str())) {
            return Err(gguf.tensor_error(info, "is not a parameter of wgrad's Llama (which has no biases and computes the default rotary embedding)".into()));
        }
        Ok(parameters)
    }

    /// The config the metadata describes, q/k rotating interleaved pairs.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The file: metadata (the tokenizer's), tensor infos, raw tensors.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// (Hugging Face parameter name, GGUF tensor name) of every parameter,
    /// in [`Module::named_parameters`] order.
    pub fn parameters(&self) -> &[(String, String)] {
        &self.parameters
    }

    /// The tensor info of the parameter `name` (`model.layers.0.mlp.up_proj.weight`).
    pub fn parameter_info(&self, name: &str) -> Result<&TensorInfo> {
        let tensor = self.parameters.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str()).ok_or_else(|| Error::InvalidArgument {
            op: "GgufLlama::parameter_info",
            reason: format!("`{name}` is not a parameter of {}", self.gguf.path().display()),
        })?;
        self.gguf.require_tensor(tensor)
    }

    /// The parameter `name`'s bytes as stored (ggml blocks, rows of q and k
    /// in the interleaved layout [`GgufLlama::config`] rotates), with its
    /// info (type, dims): for weights that stay quantized on the GPU.
    pub fn raw_parameter(&self, name: &str) -> Result<(&TensorInfo, Vec<u8>)> {
        let info = self.parameter_info(name)?;
        Ok((info, self.gguf.read_raw(&info.name)?))
    }

    /// The parameter `name` de-quantized to f32, row-major, in the same layout.
    pub fn parameter_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.parameter_info(name)?;
        self.gguf.read_f32(&info.name)
    }

    /// The model with every weight de-quantized to f32.
    pub fn to_llama(&self) -> Result<Llama> {
        Llama::from_parameters(self.config, |name, _| self.parameter_f32(name))
    }
}

/// The Llama of the GGUF file at `path`, de-quantized to f32.
pub fn load_llama_gguf(path: impl AsRef<Path>) -> Result<Llama> {
    GgufLlama::open(path)?.to_llama()
}
