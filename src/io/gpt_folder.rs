//! GPT model folders as Hugging Face shares them: a [`Gpt`] saved here is a
//! folder `transformers.GPT2LMHeadModel.from_pretrained` opens, and a GPT-2
//! folder written by `save_pretrained` (or downloaded from the Hub) loads
//! into a [`Gpt`].
//!
//! A folder holds:
//!
//! - `config.json`: `transformers.GPT2Config`'s fields (`model_type: gpt2`,
//!   `n_positions`, `n_embd`, `n_layer`, `n_head`, `vocab_size`,
//!   `layer_norm_epsilon`, `activation_function: gelu_new`, dropouts 0,
//!   `tie_word_embeddings: true`, …).
//! - `model.safetensors`: the weights under the names `save_pretrained`
//!   writes for GPT2LMHeadModel in transformers 5 (`transformer.wte.weight`,
//!   `transformer.h.0.attn.c_attn.weight`, …; no `lm_head.weight`, since
//!   the head is the token embedding), F32, metadata `format: pt`. GPT-2's
//!   attention and MLP projections are `Conv1D`s, stored [in, out]; wgrad's
//!   `Linear` holds [out, in], so those weights are transposed both ways.
//! - `wgrad_tokenizer.json`: the [`TokenizerSpec`] (`{"kind":"char",
//!   "vocabulary":"…"}` or `{"kind":"gpt2-bpe","encoding":"r50k_base"}`).
//! - optionally `optimizer.safetensors`: an [`OptimizerState`], each moment
//!   under its parameter's name and layout in `model.safetensors` plus
//!   `.exp_avg` (etc.), with the step count and the optimizer's settings in
//!   the metadata, so training resumes exactly where it stopped.
//!
//! Loading also takes what Hugging Face writes elsewhere: names with or
//! without the `transformer.` prefix; `lm_head.weight`, accepted only when
//! it equals `wte.weight` bit for bit (wgrad's head is tied to the token
//! embedding, so a different head cannot run) and then ignored; the
//! attention-mask buffers `attn.bias` / `attn.masked_bias` of older
//! checkpoints, dropped; F16, BF16 and F64 tensors, converted to f32 (F64
//! rounded to nearest, as `tensor.float()` does); weights sharded over
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json`.
//! Other dtypes (integers, bool, F8) are refused. `layer_norm_epsilon` is
//! carried into every LayerNorm; the activation must be GPT-2's tanh GELU
//! (`gelu_new`, `gelu_pytorch_tanh`, or `gelu_fast`), the attention GPT-2's
//! plain scaled dot product.
//!
//! Saving is atomic: everything goes into a temporary sibling folder, each
//! file fsynced, and only then does the folder take the target's name. An
//! existing target is moved aside first and deleted once the new folder is
//! in place (a crash between the two renames leaves it, whole, under a
//! `.NAME.old-…` name beside the target). Every check runs before the disk is
//! touched, and a failure leaves the previous folder as it was. A target
//! folder holding anything that is not part of a model folder is refused
//! rather than replaced, so saving cannot delete unrelated files.
//!
//! This module works on host copies only; it knows no devices.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::ErrorKind;
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};
use crate::io::checkpoint::{self, Checkpoint, NamedTensor};
use crate::io::hf_folder::{
    check_extra_files, check_weights_hold, io_err, json_f32, pretty_json, read_weights, save_atomically,
    within_size_limits, write_extra_files, write_synced, ConfigFields, ExtraFile, Weights, MAX_LAYERS, MAX_PARAMETERS,
};
pub use crate::io::hf_folder::{CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE};
use crate::io::text::{CharTokenizer, Gpt2Bpe, Tokenizer};
use crate::models::{Gpt, GptConfig};
use crate::nn::Module;

/// The [`TokenizerSpec`].
pub const TOKENIZER_FILE: &str = "wgrad_tokenizer.json";
/// The optional [`OptimizerState`].
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// `save_pretrained`'s prefix for GPT2LMHeadModel's body.
const BODY_PREFIX: &str = "transformer.";
/// The head's name; tied to `wte.weight`, so it is never written.
const HEAD: &str = "lm_head.weight";
/// GPT-2's BPE (tiktoken's `r50k_base`, the same as its `gpt2`) has this
/// many tokens, the last being `<|endoftext|>`.
const GPT2_BPE_TOKENS: usize = 50257;
/// Metadata keys of `optimizer.safetensors` that [`OptimizerState`] owns.
const OPTIMIZER_KEYS: [&str; 5] = ["format", "optimizer", "step", "state_names", "layout"];

/// What turns text into token ids for a saved model. The CLI makes the
/// tokenizer from it: [`TokenizerSpec::char_tokenizer`], or GPT-2's BPE by
/// its tiktoken name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// One token per character, ids in this order ([`CharTokenizer::vocabulary`]).
    #[serde(rename = "char")]
    Char { vocabulary: String },
    /// GPT-2's byte-pair encoding, by tiktoken's name (`r50k_base`).
    #[serde(rename = "gpt2-bpe")]
    Gpt2Bpe { encoding: String },
    /// A pretrained model's own tokenizer, the folder's Hugging Face
    /// `tokenizer.json` (`BpeTokenizer::from_folder` reads it), with the
    /// ids config.json names as bos and eos.
    #[serde(rename = "tokenizer.json")]
    TokenizerJson { bos: Option<u32>, eos: Option<u32> },
}

impl TokenizerSpec {
    /// GPT-2's BPE, `r50k_base`.
    pub fn gpt2() -> Self {
        TokenizerSpec::Gpt2Bpe {
            encoding: "r50k_base".into(),
        }
    }

    /// The character tokenizer this spec describes; an error for BPE.
    pub fn char_tokenizer(&self) -> Result<CharTokenizer> {
        match self {
            TokenizerSpec::Char { vocabulary } => CharTokenizer::from_vocabulary(vocabulary),
            TokenizerSpec::Gpt2Bpe { encoding } => Err(Error::InvalidArgument {
                op: "TokenizerSpec::char_tokenizer",
                reason: format!("the folder's tokenizer is GPT-2 BPE `{encoding}`, not a character tokenizer"),
            }),
            TokenizerSpec::TokenizerJson { .. } => Err(Error::InvalidArgument {
                op: "TokenizerSpec::char_tokenizer",
                reason: "the folder's tokenizer is its tokenizer.json, not a character tokenizer".into(),
            }),
        }
    }

    /// Tokens the tokenizer produces ids for, when known here.
    fn token_count(&self) -> Option<usize> {
        match self {
            TokenizerSpec::Char { vocabulary } => Some(vocabulary.chars().count()),
            TokenizerSpec::Gpt2Bpe { encoding } if encoding == "r50k_base" || encoding == "gpt2" => {
                Some(GPT2_BPE_TOKENS)
            }
            TokenizerSpec::Gpt2Bpe { .. } | TokenizerSpec::TokenizerJson { .. } => None,
        }
    }

    /// The id config.json names as bos/eos: `<|endoftext|>` for GPT-2's
    /// BPE; for characters, the model's last id (a char model has no
    /// special token, and transformers wants one).
    fn end_of_text(&self, vocab_size: usize) -> usize {
        match self {
            TokenizerSpec::Char { .. } => vocab_size - 1,
            TokenizerSpec::Gpt2Bpe { .. } => GPT2_BPE_TOKENS - 1,
            TokenizerSpec::TokenizerJson { eos, .. } => eos.map_or(vocab_size - 1, |id| id as usize),
        }
    }

    /// Why this tokenizer cannot go with a model of `vocab_size` tokens
    /// (its ids must all index the embedding), if it cannot.
    pub(crate) fn misfit(&self, vocab_size: usize) -> Option<String> {
        match self {
            TokenizerSpec::Char { vocabulary } => {
                if let Err(e) = CharTokenizer::from_vocabulary(vocabulary) {
                    return Some(e.to_string());
                }
            }
            TokenizerSpec::Gpt2Bpe { encoding } if encoding.is_empty() => {
                return Some("the BPE encoding has no name".into())
            }
            TokenizerSpec::Gpt2Bpe { .. } => {}
            TokenizerSpec::TokenizerJson { bos, eos } => {
                if let Some(id) = [bos, eos].into_iter().flatten().find(|&&id| id as usize >= vocab_size) {
                    return Some(format!(
                        "the tokenizer's bos or eos id {id} is outside the model's vocab_size {vocab_size}"
                    ));
                }
            }
        }
        self.token_count()
            .filter(|&n| n > vocab_size)
            .map(|n| format!("the tokenizer has {n} tokens, more than the model's vocab_size {vocab_size}"))
    }
}

impl TokenizerSpec {
    /// The tokenizer this spec describes.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match self {
            TokenizerSpec::Char { .. } => Ok(Tokenizer::Char(self.char_tokenizer()?)),
            TokenizerSpec::Gpt2Bpe { encoding } if encoding == "r50k_base" => Ok(Tokenizer::Gpt2(Gpt2Bpe::new()?)),
            TokenizerSpec::Gpt2Bpe { encoding } => Err(Error::InvalidArgument {
                op: "TokenizerSpec::tokenizer",
                reason: format!("unknown BPE encoding `{encoding}`: wgrad knows GPT-2's r50k_base"),
            }),
            TokenizerSpec::TokenizerJson { .. } => Err(Error::InvalidArgument {
                op: "TokenizerSpec::tokenizer",
                reason: "the tokenizer is the folder's tokenizer.json: read it with BpeTokenizer::from_folder".into(),
            }),
        }
    }
}

impl From<&Tokenizer> for TokenizerSpec {
    fn from(t: &Tokenizer) -> Self {
        match t {
            Tokenizer::Char(c) => c.into(),
            Tokenizer::Gpt2(_) => TokenizerSpec::gpt2(),
            Tokenizer::Bpe(t) => TokenizerSpec::TokenizerJson {
                bos: t.bos_id(),
                eos: t.eos_id(),
            },
        }
    }
}

impl From<&CharTokenizer> for TokenizerSpec {
    fn from(t: &CharTokenizer) -> Self {
        TokenizerSpec::Char {
            vocabulary: t.vocabulary(),
        }
    }
}

/// An optimizer's per-parameter state, for resuming training exactly: the
/// moments under wgrad's parameter names and layouts, as
/// `Executor::optimizer_state` gives them and `Executor::load_state` takes
/// them, the step count and the optimizer's settings.
///
/// An optimizer without state (SGD without momentum) has an empty `state`:
/// the step count still places the learning-rate schedule.
///
/// From a trainer: `OptimizerState::from_checkpoint(&trainer.checkpoint()?)`.
/// Back into a trainer built from the loaded model (which already holds the
/// weights): `trainer.executor_mut().load_state(&[], &state.state, Some(state.step))`
/// after checking `state.optimizer` against `optim::describe` of its optimizer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState {
    /// `optim::describe` of the optimizer that wrote the state.
    pub optimizer: String,
    /// Optimizer steps taken (the learning-rate schedule's position).
    pub step: u64,
    /// (parameter name, state name, values) for every parameter and every
    /// state name, e.g. (`h.0.attn.c_attn.weight`, `exp_avg`, …).
    pub state: Vec<(String, String, Vec<f32>)>,
    /// Anything else the caller needs to resume (a data position, a seed),
    /// stored in the file's metadata.
    pub metadata: BTreeMap<String, String>,
}

impl OptimizerState {
    /// The optimizer part of `Trainer::checkpoint`: its `optim.<param>.<state>`
    /// tensors and its `step` and `optimizer` metadata.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Self> {
        let missing = |key: &str| Error::InvalidArgument {
            op: "OptimizerState::from_checkpoint",
            reason: format!("the checkpoint has no `{key}` metadata"),
        };
        let optimizer = ckpt.meta("optimizer").ok_or_else(|| missing("optimizer"))?.to_string();
        let step = ckpt.meta("step").ok_or_else(|| missing("step"))?;
        let step = step.parse().map_err(|_| Error::InvalidArgument {
            op: "OptimizerState::from_checkpoint",
            reason: format!("step `{step}` is not a count"),
        })?;
        let mut state = Vec::new();
        for t in &ckpt.tensors {
            if let Some((param, name)) = t.name.strip_prefix("optim.").and_then(|rest| rest.rsplit_once('.')) {
                state.push((param.to_string(), name.to_string(), t.data.clone()));
            }
        }
        Ok(OptimizerState {
            optimizer,
            step,
            state,
            metadata: BTreeMap::new(),
        })
    }

    /// The distinct state names, in first-seen order (`exp_avg`, `exp_avg_sq`).
    pub fn state_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for (_, name, _) in &self.state {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
        names
    }
}

/// What [`load_gpt_folder`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedGpt {
    pub model: Gpt,
    /// From `wgrad_tokenizer.json`; without that file, GPT-2's BPE when
    /// `vocab_size` is GPT-2's 50257 (a Hugging Face GPT-2 folder), else
    /// `None`.
    pub tokenizer: Option<TokenizerSpec>,
    /// From `optimizer.safetensors`, when the folder has one.
    pub optimizer: Option<OptimizerState>,
}

/// Saves `model` as a model folder at `dir` (see the module docs), with its
/// tokenizer and, for resuming, its optimizer state. Atomic: `dir` is
/// either the previous folder or the complete new one.
pub fn save_gpt_folder(
    dir: impl AsRef<Path>,
    model: &Gpt,
    tokenizer: &TokenizerSpec,
    optimizer: Option<&OptimizerState>,
) -> Result<()> {
    save_gpt_folder_with_files(dir, model, tokenizer, optimizer, &[])
}

/// [`save_gpt_folder`] with Hugging Face tokenizer and generation files
/// beside the weights (a fine-tuned model's `tokenizer.json`, …).
pub fn save_gpt_folder_with_files(
    dir: impl AsRef<Path>,
    model: &Gpt,
    tokenizer: &TokenizerSpec,
    optimizer: Option<&OptimizerState>,
    files: &[ExtraFile],
) -> Result<()> {
    // Everything is built and checked in memory before the disk is touched.
    check_extra_files("save_gpt_folder", files)?;
    let folder = FolderFiles::new(model, tokenizer, optimizer)?;
    save_atomically(
        dir.as_ref(),
        "save_gpt_folder",
        &[TOKENIZER_FILE, OPTIMIZER_FILE],
        |temp| {
            folder.write(temp)?;
            write_extra_files(temp, files)
        },
    )
}

/// Reads a model folder written by [`save_gpt_folder`] or by Hugging Face
/// (see the module docs for what is accepted). Every tensor is checked
/// against config.json before the model is built.
pub fn load_gpt_folder(dir: impl AsRef<Path>) -> Result<LoadedGpt> {
    let dir = dir.as_ref();
    let spec = read_config(dir)?;
    let config = spec.config;
    // read_config checked the count: it is there.
    check_weights_hold(
        dir,
        &dir.join(CONFIG_FILE),
        parameter_count(&config).unwrap_or(usize::MAX),
    )?;
    let mut expected: HashMap<String, Vec<usize>> = hf_shapes(&config)?.into_iter().collect();
    // A stored head must be the token table (checked below), so it has its shape.
    expected.insert(HEAD.into(), vec![config.vocab_size, config.n_embd]);
    let name_of = |stored: &str| {
        let name = stored.strip_prefix(BODY_PREFIX).unwrap_or(stored);
        (!is_mask_buffer(name)).then(|| name.to_string())
    };
    let mut weights = read_weights(dir, &expected, &name_of)?;

    let weights_path = weights.source.clone();
    for (name, shape) in hf_shapes(&config)? {
        if !weights.tensors.contains_key(&name) {
            return Err(Error::FolderTensorMissing {
                path: weights_path,
                name: hf_name(&name),
                expected: shape,
            });
        }
    }
    check_head(&weights, spec.tied, dir)?;

    let mut model = Gpt::from_parameters(config, |name, shape| {
        let tensor = weights.tensors.remove(name).ok_or_else(|| Error::FolderTensorMissing {
            path: weights_path.clone(),
            name: hf_name(name),
            expected: shape.to_vec(),
        })?;
        Ok(from_stored(name, shape, tensor.data))
    })?;
    let eps = spec.layer_norm_epsilon;
    for block in &mut model.h {
        block.ln_1.eps = eps;
        block.ln_2.eps = eps;
    }
    model.ln_f.eps = eps;

    let tokenizer = read_tokenizer(dir, config.vocab_size)?;
    let optimizer = read_optimizer(dir, &model, &Gpt2Layout)?;
    Ok(LoadedGpt {
        model,
        tokenizer,
        optimizer,
    })
}

/// The sizes config.json gives, without reading the weights.
pub fn read_gpt_config(dir: impl AsRef<Path>) -> Result<GptConfig> {
    Ok(read_config(dir.as_ref())?.config)
}

// ---------------------------------------------------------------- names

/// How a folder stores a parameter (and its optimizer moments): name,
/// shape and values from wgrad's. Identity by default, as Llama's folder
/// holds wgrad's names and layouts.
pub(crate) trait StoredLayout {
    fn name(&self, name: &str) -> String {
        name.to_string()
    }
    fn shape(&self, _name: &str, shape: &[usize]) -> Vec<usize> {
        shape.to_vec()
    }
    fn to_stored(&self, _name: &str, _shape: &[usize], data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }
    fn unstore(&self, _name: &str, _shape: &[usize], data: Vec<f32>) -> Vec<f32> {
        data
    }
}

/// GPT-2's folder: the body's prefix and Conv1D matrices.
struct Gpt2Layout;

impl StoredLayout for Gpt2Layout {
    fn name(&self, name: &str) -> String {
        hf_name(name)
    }
    fn shape(&self, name: &str, shape: &[usize]) -> Vec<usize> {
        stored_shape(name, shape)
    }
    fn to_stored(&self, name: &str, shape: &[usize], data: &[f32]) -> Vec<f32> {
        to_stored(name, shape, data)
    }
    fn unstore(&self, name: &str, shape: &[usize], data: Vec<f32>) -> Vec<f32> {
        from_stored(name, shape, data)
    }
}

/// wgrad's parameter name as `model.safetensors` holds it.
fn hf_name(name: &str) -> String {
    format!("{BODY_PREFIX}{name}")
}

/// The format's one rule besides the prefix: the blocks' matrices are
/// GPT-2 Conv1Ds ([in, out]); wgrad's Linear holds [out, in]. Every other
/// parameter (the embeddings, the norms, the biases) is stored as held.
fn is_conv1d(name: &str, wgrad_shape: &[usize]) -> bool {
    name.starts_with("h.") && wgrad_shape.len() == 2
}

/// The shape `model.safetensors` stores a parameter of wgrad's `shape` in.
fn stored_shape(name: &str, shape: &[usize]) -> Vec<usize> {
    match shape {
        [rows, cols] if is_conv1d(name, shape) => vec![*cols, *rows],
        _ => shape.to_vec(),
    }
}

/// A parameter's values (wgrad's `shape`) in the stored layout.
fn to_stored(name: &str, shape: &[usize], data: &[f32]) -> Vec<f32> {
    if is_conv1d(name, shape) {
        transpose(data, shape[0], shape[1])
    } else {
        data.to_vec()
    }
}

/// Stored values back in wgrad's layout, for a parameter of wgrad's `shape`.
fn from_stored(name: &str, shape: &[usize], data: Vec<f32>) -> Vec<f32> {
    if is_conv1d(name, shape) {
        transpose(&data, shape[1], shape[0])
    } else {
        data
    }
}

/// Row-major [rows, cols] → [cols, rows].
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

/// Every parameter's (wgrad name, shape in model.safetensors) for `config`,
/// in state_dict order: the module tree's names, shapes stored by the
/// format's rule. The one list both saving and loading check against.
fn hf_shapes(config: &GptConfig) -> Result<Vec<(String, Vec<usize>)>> {
    let shapes = Gpt::empty(*config)?.named_parameters();
    Ok(shapes
        .into_iter()
        .map(|(name, shape)| {
            let stored = stored_shape(&name, &shape);
            (name, stored)
        })
        .collect())
}

/// Parameters of a model of `config`; `None` when the count overflows
/// (sizes from a file may be absurd).
pub(crate) fn parameter_count(config: &GptConfig) -> Option<usize> {
    let c = config.n_embd;
    let c2 = c.checked_mul(c)?;
    // ln_1, ln_2: 4c; c_attn: 3c² + 3c; c_proj: c² + c; c_fc: 4c² + 4c; mlp c_proj: 4c² + c.
    let block = c2.checked_mul(12)?.checked_add(c.checked_mul(13)?)?;
    let tables = config.vocab_size.checked_add(config.block_size)?.checked_mul(c)?;
    block
        .checked_mul(config.n_layer)?
        .checked_add(tables)?
        .checked_add(2 * c)
}

/// GPT-2's causal-mask buffers (`h.N.attn.bias`, `h.N.attn.masked_bias`):
/// constants older transformers saved with the weights.
fn is_mask_buffer(name: &str) -> bool {
    name.strip_prefix("h.")
        .and_then(|rest| rest.split_once('.'))
        .is_some_and(|(layer, rest)| {
            layer.bytes().all(|b| b.is_ascii_digit()) && (rest == "attn.bias" || rest == "attn.masked_bias")
        })
}

// ---------------------------------------------------------------- saving

/// A folder's files, built and checked in memory.
struct FolderFiles {
    config: Vec<u8>,
    tokenizer: Vec<u8>,
    weights: Checkpoint,
    optimizer: Option<Checkpoint>,
}

impl FolderFiles {
    fn new(model: &Gpt, tokenizer: &TokenizerSpec, optimizer: Option<&OptimizerState>) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "save_gpt_folder",
            reason,
        };
        let config = model.config;
        if model.h.iter().any(|b| b.attn.is_none()) {
            return Err(bad("a block without attention has no GPT-2 equivalent".into()));
        }
        let eps = model.ln_f.eps;
        if model.h.iter().any(|b| b.ln_1.eps != eps || b.ln_2.eps != eps) {
            return Err(bad(
                "GPT-2 has one layer_norm_epsilon, but the model's LayerNorms differ".into(),
            ));
        }
        if let Some(reason) = tokenizer.misfit(config.vocab_size) {
            return Err(bad(reason));
        }

        // The model's own sizes must be the ones config.json will state.
        let values = model.parameter_values();
        let expected = Gpt::empty(config)?.named_parameters();
        if values.len() != expected.len() {
            return Err(bad(format!(
                "the model has {} parameters, its config {config:?} implies {}",
                values.len(),
                expected.len()
            )));
        }
        let mut weights = Checkpoint::new();
        weights.set_meta("format", "pt");
        for ((name, shape, data), (want_name, want_shape)) in values.iter().zip(&expected) {
            if name != want_name || shape != want_shape || data.len() != shape.iter().product::<usize>() {
                return Err(bad(format!("parameter `{name}` {shape:?} with {} values; its config {config:?} implies `{want_name}` {want_shape:?}", data.len())));
            }
            weights.push(NamedTensor::new(
                hf_name(name),
                stored_shape(name, shape),
                to_stored(name, shape, data),
            )?);
        }

        let end = tokenizer.end_of_text(config.vocab_size);
        let config_json = json!({
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size,
            "n_positions": config.block_size,
            "n_ctx": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": json_f32(eps),
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": true,
            "bos_token_id": end,
            "eos_token_id": end,
            "dtype": "float32",
        });
        let config_bytes = pretty_json(&config_json, "save_gpt_folder")?;
        let tokenizer_bytes = pretty_json(tokenizer, "save_gpt_folder")?;

        let optimizer = optimizer
            .map(|state| optimizer_checkpoint(model, state, &Gpt2Layout))
            .transpose()?;
        Ok(FolderFiles {
            config: config_bytes,
            tokenizer: tokenizer_bytes,
            weights,
            optimizer,
        })
    }

    fn write(&self, dir: &Path) -> Result<()> {
        write_synced(&dir.join(CONFIG_FILE), &self.config)?;
        write_synced(&dir.join(TOKENIZER_FILE), &self.tokenizer)?;
        checkpoint::save(dir.join(WEIGHTS_FILE), &self.weights)?;
        if let Some(opt) = &self.optimizer {
            checkpoint::save(dir.join(OPTIMIZER_FILE), opt)?;
        }
        Ok(())
    }
}

/// `optimizer.safetensors`: each moment under `model.safetensors`'s name
/// and layout of its parameter, plus `.STATE`. Refuses state that does not
/// cover every parameter with every state name, since resuming from it
/// would not be exact.
pub(crate) fn optimizer_checkpoint(
    model: &dyn Module,
    state: &OptimizerState,
    layout: &dyn StoredLayout,
) -> Result<Checkpoint> {
    let bad = |reason: String| Error::InvalidArgument {
        op: "save model folder (optimizer state)",
        reason,
    };
    let names = state.state_names();
    let params: HashMap<String, Vec<usize>> = model.named_parameters().into_iter().collect();
    let mut ckpt = Checkpoint::new();
    let mut seen = BTreeSet::new();
    for (param, name, data) in &state.state {
        if name.is_empty() || name.contains(['.', ',']) {
            return Err(bad(format!(
                "state name `{name}` must be non-empty, without `.` or `,`"
            )));
        }
        let shape = params
            .get(param)
            .ok_or_else(|| bad(format!("`{param}` is not a parameter of the model")))?;
        if data.len() != shape.iter().product::<usize>() {
            return Err(bad(format!(
                "`{param}.{name}` has {} values; the parameter's shape is {shape:?}",
                data.len()
            )));
        }
        if !seen.insert((param.as_str(), name.as_str())) {
            return Err(bad(format!("`{param}.{name}` appears twice")));
        }
        ckpt.push(NamedTensor::new(
            format!("{}.{name}", layout.name(param)),
            layout.shape(param, shape),
            layout.to_stored(param, shape, data),
        )?);
    }
    if seen.len() != params.len() * names.len() {
        let absent = params
            .keys()
            .flat_map(|p| names.iter().map(move |n| (p.as_str(), *n)))
            .find(|k| !seen.contains(k));
        if let Some((p, n)) = absent {
            return Err(bad(format!(
                "no `{n}` for `{p}`: resuming from partial state would not be exact"
            )));
        }
    }
    for (key, value) in &state.metadata {
        if OPTIMIZER_KEYS.contains(&key.as_str()) {
            return Err(bad(format!(
                "metadata key `{key}` is reserved for the optimizer state itself"
            )));
        }
        ckpt.set_meta(key.clone(), value.clone());
    }
    ckpt.set_meta("format", "wgrad-optimizer");
    ckpt.set_meta("optimizer", state.optimizer.clone());
    ckpt.set_meta("step", state.step.to_string());
    ckpt.set_meta("state_names", names.join(","));
    ckpt.set_meta("layout", "names and layouts of model.safetensors, plus .STATE");
    Ok(ckpt)
}

// ---------------------------------------------------------------- loading

/// What config.json says, checked.
struct ConfigSpec {
    config: GptConfig,
    layer_norm_epsilon: f32,
    tied: bool,
}

fn read_config(dir: &Path) -> Result<ConfigSpec> {
    let fields = ConfigFields::read(dir, "GPT2Config")?;
    let bad = |reason: String| fields.bad(reason);
    let (size, required, text, flag) = (
        |k| fields.size(k),
        |k| fields.required(k),
        |k| fields.text(k),
        |k, d| fields.flag(k, d),
    );

    if let Some(kind) = text("model_type")? {
        if kind != "gpt2" {
            return Err(bad(format!("model_type `{kind}`: wgrad reads GPT-2 (`gpt2`) folders")));
        }
    }
    let block_size = match (size("n_positions")?, size("n_ctx")?) {
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => return Err(bad("no `n_positions` (nor `n_ctx`) field (GPT2Config needs it)".into())),
    };
    let config = GptConfig {
        vocab_size: required("vocab_size")?,
        block_size,
        n_layer: required("n_layer")?,
        n_head: required("n_head")?,
        n_embd: required("n_embd")?,
    };
    // Sizes come from a file: refuse ones whose tables would not fit before
    // anything is allocated for them.
    let positive = ![
        config.vocab_size,
        config.block_size,
        config.n_layer,
        config.n_head,
        config.n_embd,
    ]
    .contains(&0);
    if !positive || config.n_embd % config.n_head != 0 || !within_size_limits(config.n_layer, parameter_count(&config))
    {
        return Err(bad(format!(
            "sizes {config:?}: every size must be positive, n_embd a multiple of n_head, at most {MAX_LAYERS} layers and {MAX_PARAMETERS} parameters"
        )));
    }

    let layer_norm_epsilon = fields.positive("layer_norm_epsilon", 1e-5)?;
    match text("activation_function")? {
        None | Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => {}
        Some(other) => {
            return Err(bad(format!(
                "activation_function `{other}`: wgrad's GPT uses GPT-2's tanh GELU (gelu_new, gelu_pytorch_tanh)"
            )));
        }
    }
    if let Some(inner) = size("n_inner")? {
        if inner != 4 * config.n_embd {
            return Err(bad(format!(
                "n_inner {inner}: wgrad's MLP is 4 × n_embd = {}",
                4 * config.n_embd
            )));
        }
    }
    if !flag("scale_attn_weights", true)?
        || flag("scale_attn_by_inverse_layer_idx", false)?
        || flag("add_cross_attention", false)?
    {
        return Err(bad("attention other than GPT-2's (scale_attn_weights true, scale_attn_by_inverse_layer_idx and add_cross_attention false)".into()));
    }
    let tied = flag("tie_word_embeddings", true)?;
    Ok(ConfigSpec {
        config,
        layer_norm_epsilon,
        tied,
    })
}

/// wgrad's head is the token embedding: a stored `lm_head.weight` must be
/// that same table, and an untied model must store it.
fn check_head(weights: &Weights, tied: bool, dir: &Path) -> Result<()> {
    let wte = weights.tensors.get("wte.weight");
    match (weights.tensors.get(HEAD), wte) {
        (Some(head), Some(wte)) => {
            // read_weights checked its shape against [vocab_size, n_embd].
            let path = &head.path;
            let same = head.data.iter().zip(&wte.data).all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                return Err(Error::CheckpointFormat {
                    path: path.clone(),
                    reason: format!("`{HEAD}` differs from `{BODY_PREFIX}wte.weight`: an untied head, which wgrad's GPT (head tied to the token embedding) cannot run"),
                });
            }
            Ok(())
        }
        (None, _) if !tied => Err(Error::CheckpointFormat {
            path: dir.join(CONFIG_FILE),
            reason: format!("tie_word_embeddings is false but the weights hold no `{HEAD}`; wgrad's GPT ties its head to the token embedding"),
        }),
        _ => Ok(()),
    }
}

pub(crate) fn read_tokenizer(dir: &Path, vocab_size: usize) -> Result<Option<TokenizerSpec>> {
    let path = dir.join(TOKENIZER_FILE);
    let text = match fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            // A Hugging Face GPT-2 folder: its tokenizer is GPT-2's BPE.
            return Ok((vocab_size == GPT2_BPE_TOKENS).then(TokenizerSpec::gpt2));
        }
        Err(e) => return Err(io_err(&path, "read", e)),
    };
    let spec: TokenizerSpec = serde_json::from_slice(&text).map_err(|e| Error::CheckpointFormat {
        path: path.clone(),
        reason: format!("not a tokenizer description ({{\"kind\":\"char\",\"vocabulary\":…}} or {{\"kind\":\"gpt2-bpe\",\"encoding\":…}}): {e}"),
    })?;
    if let Some(reason) = spec.misfit(vocab_size) {
        return Err(Error::CheckpointFormat { path, reason });
    }
    Ok(Some(spec))
}

pub(crate) fn read_optimizer(
    dir: &Path,
    model: &dyn Module,
    layout: &dyn StoredLayout,
) -> Result<Option<OptimizerState>> {
    let path = dir.join(OPTIMIZER_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let ckpt = checkpoint::load(&path)?;
    let bad = |reason: String| Error::CheckpointFormat {
        path: path.clone(),
        reason,
    };
    let meta = |key: &str| ckpt.meta(key).ok_or_else(|| bad(format!("no `{key}` in the metadata")));
    let optimizer = meta("optimizer")?.to_string();
    let step_text = meta("step")?;
    let step = step_text
        .parse()
        .map_err(|_| bad(format!("step `{step_text}` is not a count")))?;
    let names: Vec<&str> = meta("state_names")?.split(',').filter(|n| !n.is_empty()).collect();

    let params = model.named_parameters();
    let by_name: HashMap<&str, &Vec<usize>> = params.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let mut state = Vec::with_capacity(params.len() * names.len());
    let mut used = 0;
    // The executor's order: every parameter of the first state, then the next.
    for name in &names {
        for (param, shape) in &params {
            let stored = format!("{}.{name}", layout.name(param));
            let hf = layout.shape(param, shape);
            let t = ckpt.get(&stored).ok_or_else(|| Error::FolderTensorMissing {
                path: path.clone(),
                name: stored.clone(),
                expected: hf.clone(),
            })?;
            if t.shape != hf {
                return Err(Error::FolderTensorShape {
                    path: path.clone(),
                    name: stored,
                    expected: hf,
                    found: t.shape.clone(),
                });
            }
            let data = layout.unstore(param, shape, t.data.clone());
            state.push((param.clone(), name.to_string(), data));
            used += 1;
        }
    }
    if used != ckpt.tensors.len() {
        let known: std::collections::HashSet<String> = by_name
            .keys()
            .flat_map(|p| names.iter().map(move |n| format!("{}.{n}", layout.name(p))))
            .collect();
        let extra = ckpt.tensors.iter().find(|t| !known.contains(&t.name));
        if let Some(t) = extra {
            return Err(Error::FolderTensorUnexpected {
                path: path.clone(),
                name: t.name.clone(),
                shape: t.shape.clone(),
            });
        }
    }
    let metadata = ckpt
        .metadata
        .iter()
        .filter(|(k, _)| !OPTIMIZER_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Some(OptimizerState {
        optimizer,
        step,
        state,
        metadata,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_buffers_are_recognised_and_nothing_else() {
        assert!(is_mask_buffer("h.0.attn.bias"));
        assert!(is_mask_buffer("h.11.attn.masked_bias"));
        assert!(!is_mask_buffer("h.0.attn.c_attn.bias"));
        assert!(!is_mask_buffer("h.x.attn.bias"));
        assert!(!is_mask_buffer("wte.weight"));
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        // [2, 3] → [3, 2]
        assert_eq!(
            transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3),
            vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        );
    }

    #[test]
    fn stored_shapes_transpose_only_the_blocks_matrices() {
        let config = GptConfig {
            vocab_size: 7,
            block_size: 5,
            n_layer: 2,
            n_head: 2,
            n_embd: 4,
        };
        let stored: HashMap<String, Vec<usize>> = hf_shapes(&config).unwrap().into_iter().collect();
        assert_eq!(stored["wte.weight"], [7, 4]);
        assert_eq!(stored["h.1.attn.c_attn.weight"], [4, 12]);
        assert_eq!(stored["h.0.mlp.c_proj.weight"], [16, 4]);
        assert_eq!(stored["h.0.mlp.c_fc.bias"], [16]);
        assert_eq!(parameter_count(&config), Some(config.num_parameters()));
        assert_eq!(parameter_count(&GptConfig::gpt2()), Some(124_439_808));
    }
}
