//! Llama model folders as Hugging Face shares them: a [`Llama`] saved here
//! is a folder `transformers.LlamaForCausalLM.from_pretrained` opens, and a
//! folder `save_pretrained` wrote (or the Hub serves: SmolLM2, TinyLlama,
//! Llama 2/3) loads into a [`Llama`].
//!
//! A folder holds `config.json` (LlamaConfig's fields: `model_type: llama`,
//! `hidden_size`, `intermediate_size`, `num_attention_heads`,
//! `num_key_value_heads`, `num_hidden_layers`, `rms_norm_eps`,
//! `rope_theta`, `max_position_embeddings`, `vocab_size`,
//! `tie_word_embeddings`, …), `model.safetensors` under the module tree's
//! names, which are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`,
//! …; `lm_head.weight` only when untied), and optionally
//! `wgrad_tokenizer.json`. Hugging Face's rotary layout is the half-split
//! one: a model built with interleaved (Meta's) pairs has its q/k rows
//! permuted on saving, as Hugging Face's converter does.
//!
//! Loading takes one file or shards with `model.safetensors.index.json`,
//! F32/F16/BF16/F64 tensors, `rope_theta` at the top level or in
//! transformers 5's `rope_parameters`; it drops stored `rotary_emb.inv_freq`
//! buffers and a tied model's `lm_head.weight` when it equals the token
//! table. It refuses what this Llama does not compute (biases, another
//! activation, RoPE scaling, a head width other than hidden / heads) with
//! an error naming the field. Reading, shards, dtypes, atomic saving and
//! their errors are [`crate::io::hf_folder`]'s, shared with the GPT's folders.
//!
//! Qwen2/Qwen2.5 and Qwen3 folders (`model_type` `qwen2`, `qwen3`;
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`) are the same folders with the
//! variant's parameters (q/k/v biases; `q_norm`, `k_norm`) under the same
//! names, and a `head_dim` of Qwen3's own; a sliding window
//! (`use_sliding_window`) over every layer is read, one over some layers
//! refused. Mistral folders (`model_type: mistral`, `MistralForCausalLM`)
//! are Llama folders with `sliding_window` (null: none) and a `head_dim`
//! that may be its own.

use std::collections::HashMap;
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};
use crate::io::checkpoint::{self, Checkpoint, NamedTensor};
use crate::io::gguf::llama::unpermute_rows;
use crate::io::gpt_folder::{
    optimizer_checkpoint, read_optimizer, read_tokenizer, OptimizerState, StoredLayout, TokenizerSpec, OPTIMIZER_FILE,
    TOKENIZER_FILE,
};
use crate::io::hf_folder::{
    check_extra_files, check_weights_hold, json_f32, pretty_json, read_weights, save_atomically, within_size_limits,
    write_extra_files, write_synced, ConfigFields, ExtraFile, CONFIG_FILE, MAX_LAYERS, MAX_PARAMETERS, WEIGHTS_FILE,
};
use crate::models::{Llama, LlamaConfig, LlamaVariant};
use crate::nn::{Module, RopeLayout};

/// The untied head's name; a tied model stores none.
const HEAD: &str = "lm_head.weight";
/// transformers' MistralConfig `sliding_window` when config.json has none.
const MISTRAL_DEFAULT_WINDOW: usize = 4096;
/// transformers' Qwen2Config `max_window_layers`: layers before it attend fully.
const QWEN_MAX_WINDOW_LAYERS: usize = 28;

/// What [`load_llama_folder`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedLlama {
    pub model: Llama,
    /// From `wgrad_tokenizer.json`, when the folder has one.
    pub tokenizer: Option<TokenizerSpec>,
    /// From `optimizer.safetensors` (wgrad's names), when the folder has one.
    pub optimizer: Option<OptimizerState>,
}

/// Saves `model` as a Hugging Face folder at `dir` (see the module docs),
/// with its tokenizer when given. Atomic: `dir` is either the previous
/// folder or the complete new one.
pub fn save_llama_folder(dir: impl AsRef<Path>, model: &Llama, tokenizer: Option<&TokenizerSpec>) -> Result<()> {
    save_llama_folder_with_state(dir, model, tokenizer, None)
}

/// [`save_llama_folder`] with the optimizer state to resume training from
/// (`optimizer.safetensors`, as the GPT's folder has it).
pub fn save_llama_folder_with_state(
    dir: impl AsRef<Path>,
    model: &Llama,
    tokenizer: Option<&TokenizerSpec>,
    optimizer: Option<&OptimizerState>,
) -> Result<()> {
    save_llama_folder_with_files(dir, model, tokenizer, optimizer, &[])
}

/// [`save_llama_folder_with_state`] with Hugging Face tokenizer and
/// generation files beside the weights (a fine-tuned model's
/// `tokenizer.json`, …).
pub fn save_llama_folder_with_files(
    dir: impl AsRef<Path>,
    model: &Llama,
    tokenizer: Option<&TokenizerSpec>,
    optimizer: Option<&OptimizerState>,
    files: &[ExtraFile],
) -> Result<()> {
    const OP: &str = "save_llama_folder";
    check_extra_files(OP, files)?;
    let bad = |reason: String| Error::InvalidArgument { op: OP, reason };
    let config = model.config;
    config.check()?;
    let eps = config.rms_norm_eps;
    let norms_eps = model
        .layers
        .iter()
        .flat_map(|l| [l.input_layernorm.eps, l.post_attention_layernorm.eps])
        .chain([model.norm.eps]);
    if norms_eps.into_iter().any(|e| e != eps) {
        return Err(bad(format!(
            "LlamaConfig has one rms_norm_eps, but the model's RMSNorms differ from its config's {eps}"
        )));
    }
    if let Some(reason) = tokenizer.and_then(|t| t.misfit(config.vocab_size)) {
        return Err(bad(reason));
    }
    let mut expected = Llama::empty(config)?.named_parameters().into_iter();
    let mut weights = Checkpoint::new();
    weights.set_meta("format", "pt");
    for (name, shape, values) in model.parameter_values() {
        if expected.next().is_none_or(|(n, s)| n != name || s != shape)
            || values.len() != shape.iter().product::<usize>()
        {
            return Err(bad(format!(
                "parameter `{name}` {shape:?} with {} values does not fit the model's config {config:?}",
                values.len()
            )));
        }
        let stored = match (config.rope_layout, rotated_heads(&config, &name)) {
            // Hugging Face's half-split layout: undo Meta's pair order.
            (RopeLayout::Interleaved, Some(heads)) => unpermute_rows(values, shape[0], heads)?,
            _ => values.to_vec(),
        };
        weights.push(NamedTensor::new(name, shape, stored)?);
    }
    if expected.next().is_some() {
        return Err(bad(format!(
            "the model has fewer parameters than its config {config:?} implies"
        )));
    }
    let (class, model_type, _) = config.variant.names();
    let config_json = json!({
        "architectures": [class],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": json_f32(eps),
        "rope_theta": json_f32(config.rope_theta),
        "rope_scaling": null,
        // Qwen2's biases are not a setting in transformers (always on); the
        // field says what the weights hold.
        "attention_bias": config.variant == LlamaVariant::Qwen2,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": crate::models::llama::INITIALIZER_RANGE,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": true,
        "torch_dtype": "float32",
    });
    let mut config_json = config_json;
    match config.variant {
        LlamaVariant::Llama => {}
        // transformers' MistralConfig reads the window alone (null: none).
        LlamaVariant::Mistral => config_json["sliding_window"] = config.sliding_window.into(),
        LlamaVariant::Qwen2 | LlamaVariant::Qwen3 => {
            config_json["use_sliding_window"] = config.sliding_window.is_some().into();
            if let Some(window) = config.sliding_window {
                // Every layer slides (max_window_layers counts the full ones first).
                config_json["sliding_window"] = window.into();
                config_json["max_window_layers"] = 0.into();
            }
        }
    }
    // A pretrained tokenizer's special ids, which transformers' generate reads here.
    if let Some(TokenizerSpec::TokenizerJson { bos, eos }) = tokenizer {
        for (key, id) in [("bos_token_id", bos), ("eos_token_id", eos)] {
            if let Some(id) = id {
                config_json[key] = (*id).into();
            }
        }
    }
    let config_bytes = pretty_json(&config_json, OP)?;
    let tokenizer_bytes = tokenizer.map(|t| pretty_json(t, OP)).transpose()?;
    let optimizer = optimizer
        .map(|state| optimizer_checkpoint(model, state, &WgradNames))
        .transpose()?;
    save_atomically(dir.as_ref(), OP, &[TOKENIZER_FILE, OPTIMIZER_FILE], |temp| {
        write_synced(&temp.join(CONFIG_FILE), &config_bytes)?;
        if let Some(bytes) = &tokenizer_bytes {
            write_synced(&temp.join(TOKENIZER_FILE), bytes)?;
        }
        if let Some(state) = &optimizer {
            checkpoint::save(temp.join(OPTIMIZER_FILE), state)?;
        }
        write_extra_files(temp, files)?;
        checkpoint::save(temp.join(WEIGHTS_FILE), &weights)
    })
}

/// Reads a folder written by [`save_llama_folder`] or by Hugging Face (see
/// the module docs). Every tensor is checked against config.json before
/// the model is built.
pub fn load_llama_folder(dir: impl AsRef<Path>) -> Result<LoadedLlama> {
    let dir = dir.as_ref();
    let config = read_llama_config(dir)?;
    // read_llama_config checked the count: it is there.
    check_weights_hold(
        dir,
        &dir.join(CONFIG_FILE),
        config.num_parameters().unwrap_or(usize::MAX),
    )?;
    let shapes = Llama::empty(config)?.named_parameters();
    let mut expected: HashMap<String, Vec<usize>> = shapes.iter().cloned().collect();
    // A tied model may still store its head: it must then be the token table.
    expected.insert(HEAD.into(), vec![config.vocab_size, config.n_embd]);
    let name_of = |stored: &str| (!stored.ends_with("rotary_emb.inv_freq")).then(|| stored.to_string());
    let mut weights = read_weights(dir, &expected, &name_of)?;
    if config.tie_word_embeddings {
        if let (Some(head), Some(table)) = (
            weights.tensors.get(HEAD),
            weights.tensors.get("model.embed_tokens.weight"),
        ) {
            if head
                .data
                .iter()
                .zip(&table.data)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                return Err(Error::CheckpointFormat {
                    path: head.path.clone(),
                    reason: format!(
                        "`{HEAD}` differs from `model.embed_tokens.weight`, but config.json says tie_word_embeddings"
                    ),
                });
            }
        }
        weights.tensors.remove(HEAD);
    }
    let source = weights.source.clone();
    for (name, shape) in &shapes {
        if !weights.tensors.contains_key(name) {
            return Err(Error::FolderTensorMissing {
                path: source,
                name: name.clone(),
                expected: shape.clone(),
            });
        }
    }
    let model = Llama::from_parameters(config, |name, shape| {
        let tensor = weights.tensors.remove(name).ok_or_else(|| Error::FolderTensorMissing {
            path: source.clone(),
            name: name.into(),
            expected: shape.to_vec(),
        })?;
        Ok(tensor.data)
    })?;
    let tokenizer = read_tokenizer(dir, config.vocab_size)?;
    let optimizer = read_optimizer(dir, &model, &WgradNames)?;
    Ok(LoadedLlama {
        model,
        tokenizer,
        optimizer,
    })
}

/// The rows of `name` that rotate in pairs, by head: q_proj's weight and
/// bias over the query heads, k_proj's over the KV heads, and a q/k
/// norm's weight (one head); `None` for a parameter the rotation leaves.
fn rotated_heads(config: &LlamaConfig, name: &str) -> Option<usize> {
    let module = name.rsplit('.').nth(1)?;
    match module {
        "q_proj" => Some(config.n_head),
        "k_proj" => Some(config.n_kv_head),
        "q_norm" | "k_norm" => Some(1),
        _ => None,
    }
}

/// The variant a config.json's `model_type` names.
pub fn variant_of_model_type(model_type: &str) -> Option<LlamaVariant> {
    [
        LlamaVariant::Llama,
        LlamaVariant::Qwen2,
        LlamaVariant::Qwen3,
        LlamaVariant::Mistral,
    ]
    .into_iter()
    .find(|v| v.names().1 == model_type)
}

/// The config.json of a Llama (or Qwen2, Qwen3, Mistral) folder, checked, without
/// reading the weights.
pub fn read_llama_config(dir: impl AsRef<Path>) -> Result<LlamaConfig> {
    let fields = ConfigFields::read(dir.as_ref(), "LlamaConfig")?;
    let bad = |reason: String| fields.bad(reason);
    let variant = match fields.text("model_type")? {
        Some(name) => variant_of_model_type(name).ok_or_else(|| {
            bad(format!(
                "model_type `{name}`: wgrad reads Llama, Qwen2, Qwen3 and Mistral (`llama`, `qwen2`, `qwen3`, `mistral`) folders here"
            ))
        })?,
        None => return Err(bad("no `model_type` field (a Llama folder says `llama`)".into())),
    };
    let n_head = fields.required("num_attention_heads")?;
    let mut config = LlamaConfig {
        vocab_size: fields.required("vocab_size")?,
        block_size: fields.required("max_position_embeddings")?,
        n_layer: fields.required("num_hidden_layers")?,
        n_head,
        n_kv_head: fields.size("num_key_value_heads")?.unwrap_or(n_head),
        n_embd: fields.required("hidden_size")?,
        intermediate_size: fields.required("intermediate_size")?,
        rope_theta: fields.positive("rope_theta", 10000.0)?,
        rms_norm_eps: fields.positive("rms_norm_eps", 1e-6)?,
        tie_word_embeddings: fields.flag("tie_word_embeddings", false)?,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: sliding_window(&fields, variant, fields.required("num_hidden_layers")?)?,
        variant,
    };
    // transformers 5 keeps the base in `rope_parameters`, with its type.
    if let Some(rope) = fields.get("rope_parameters").or_else(|| fields.get("rope_scaling")) {
        let kind = rope
            .get("rope_type")
            .or_else(|| rope.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        if kind != "default" {
            return Err(bad(format!(
                "RoPE scaling `{kind}`: wgrad's Llama computes the default rotary embedding only"
            )));
        }
        if let Some(theta) = rope.get("rope_theta") {
            config.rope_theta = theta
                .as_f64()
                .filter(|t| *t > 1.0 && t.is_finite())
                .ok_or_else(|| bad(format!("`rope_parameters.rope_theta` is {theta}, not a number above 1")))?
                as f32;
        }
    }
    if let Some(act) = fields.text("hidden_act")? {
        if act != "silu" {
            return Err(bad(format!("hidden_act `{act}`: wgrad's Llama MLP is SwiGLU (silu)")));
        }
    }
    // Qwen2's q/k/v biases are built in (transformers reads no flag).
    if (variant != LlamaVariant::Qwen2 && fields.flag("attention_bias", false)?) || fields.flag("mlp_bias", false)? {
        return Err(bad(format!(
            "attention_bias or mlp_bias is true: wgrad's {} has no such biases",
            variant.names().2
        )));
    }
    let head_dim = fields.size("head_dim")?;
    // Qwen3's and Mistral's heads may have a width of their own; Llama's
    // and Qwen2's are hidden / heads.
    if matches!(variant, LlamaVariant::Qwen3 | LlamaVariant::Mistral)
        && head_dim.is_some_and(|d| d.checked_mul(n_head) != Some(config.n_embd))
    {
        config.head_dim = head_dim;
    }
    let sizes_ok = ![
        config.vocab_size,
        config.block_size,
        config.n_layer,
        n_head,
        config.n_kv_head,
        config.n_embd,
        config.intermediate_size,
        config.head_dim(),
    ]
    .contains(&0)
        && (config.head_dim.is_some() || config.n_embd % n_head == 0);
    if let Some(head_dim) = head_dim {
        if sizes_ok && head_dim != config.head_dim() {
            return Err(bad(format!(
                "head_dim {head_dim}: wgrad's {} has hidden_size / num_attention_heads = {}",
                variant.names().2,
                config.head_dim()
            )));
        }
    }
    if !sizes_ok || !within_size_limits(config.n_layer, config.num_parameters()) {
        return Err(bad(format!(
            "sizes {config:?}: every size must be positive, hidden_size a multiple of num_attention_heads, at most {MAX_LAYERS} layers and {MAX_PARAMETERS} parameters"
        )));
    }
    config.check().map_err(|e| bad(e.to_string()))?;
    Ok(config)
}

/// The window every layer attends over, as transformers reads it:
/// Mistral's `sliding_window` (null: none; absent: MistralConfig's default
/// 4096); a Qwen's when `use_sliding_window` is true, over the layers
/// `layer_types` names `sliding_attention` (or those from
/// `max_window_layers`, default 28, on). A Qwen that windows some layers
/// but not all is refused: wgrad's Qwen attends alike in every layer.
fn sliding_window(fields: &ConfigFields, variant: LlamaVariant, n_layer: usize) -> Result<Option<usize>> {
    match variant {
        LlamaVariant::Llama => Ok(None),
        LlamaVariant::Mistral if !fields.has("sliding_window") => Ok(Some(MISTRAL_DEFAULT_WINDOW)),
        LlamaVariant::Mistral => fields.size("sliding_window"),
        LlamaVariant::Qwen2 | LlamaVariant::Qwen3 => {
            let used = fields.flag("use_sliding_window", false)?;
            let Some(window) = fields.size("sliding_window")?.filter(|_| used) else {
                return Ok(None);
            };
            let sliding = match fields.get("layer_types").and_then(|v| v.as_array()) {
                Some(types) => types.iter().filter(|t| t.as_str() == Some("sliding_attention")).count(),
                None => n_layer.saturating_sub(fields.size("max_window_layers")?.unwrap_or(QWEN_MAX_WINDOW_LAYERS)),
            };
            match sliding {
                0 => Ok(None),
                n if n == n_layer => Ok(Some(window)),
                n => Err(fields.bad(format!(
                    "{n} of {n_layer} layers slide over a window (use_sliding_window, layer_types or max_window_layers): wgrad's Qwen attends alike in every layer"
                ))),
            }
        }
    }
}

/// The optimizer state under wgrad's names and layouts (the module tree's
/// names are Hugging Face's already).
struct WgradNames;

impl StoredLayout for WgradNames {}
