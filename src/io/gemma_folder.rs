//! Gemma 3 model folders as Hugging Face shares them: a [`Gemma`] saved here
//! is a folder `transformers.Gemma3ForCausalLM.from_pretrained` opens, and a
//! folder `save_pretrained` wrote loads into a [`Gemma`].
//!
//! A folder holds `config.json` (Gemma3TextConfig's fields: `model_type:
//! gemma3_text`, `hidden_size`, `head_dim`, `query_pre_attn_scalar`,
//! `sliding_window`, `layer_types`, the rotary bases in transformers 5's
//! `rope_parameters` or the older `rope_theta` / `rope_local_base_freq`,
//! …), `model.safetensors` under the module tree's names, which are
//! Hugging Face's (norm weights as Hugging Face stores them: the norm
//! scales by 1 + weight), and optionally `wgrad_tokenizer.json`. The head
//! is the token table: a stored `lm_head.weight` must equal it. Refused,
//! each naming the field: logit soft-capping, another activation, RoPE
//! scaling, bidirectional attention, an untied head, and `layer_types`
//! that are not one global layer every `sliding_window_pattern`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::io::checkpoint::{self, Checkpoint, NamedTensor};
use crate::io::gpt_folder::{
    optimizer_checkpoint, read_optimizer, read_tokenizer, OptimizerState, StoredLayout, TokenizerSpec, OPTIMIZER_FILE,
    TOKENIZER_FILE,
};
use crate::io::hf_folder::{
    check_extra_files, check_weights_hold, json_f32, pretty_json, read_weights, save_atomically, within_size_limits,
    write_extra_files, write_synced, ConfigFields, ExtraFile, CONFIG_FILE, MAX_LAYERS, MAX_PARAMETERS, WEIGHTS_FILE,
};
use crate::models::{Gemma, GemmaConfig};
use crate::nn::Module;

/// The head's name, which a tied model may store (equal to the table).
const HEAD: &str = "lm_head.weight";
/// transformers' `model_type` and class.
pub const MODEL_TYPE: &str = "gemma3_text";
pub const CLASS: &str = "Gemma3ForCausalLM";

/// What [`load_gemma_folder`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedGemma {
    pub model: Gemma,
    /// From `wgrad_tokenizer.json`, when the folder has one.
    pub tokenizer: Option<TokenizerSpec>,
    /// From `optimizer.safetensors` (wgrad's names), when the folder has one.
    pub optimizer: Option<OptimizerState>,
}

/// The optimizer state under wgrad's names, which are Hugging Face's.
struct WgradNames;

impl StoredLayout for WgradNames {}

/// Saves `model` as a Hugging Face folder at `dir` (see the module docs),
/// with its tokenizer when given. Atomic, as the Llama's.
pub fn save_gemma_folder(dir: impl AsRef<Path>, model: &Gemma, tokenizer: Option<&TokenizerSpec>) -> Result<()> {
    save_gemma_folder_with_files(dir, model, tokenizer, None, &[])
}

/// [`save_gemma_folder`] with the optimizer state to resume training from
/// and Hugging Face tokenizer files beside the weights.
pub fn save_gemma_folder_with_files(
    dir: impl AsRef<Path>,
    model: &Gemma,
    tokenizer: Option<&TokenizerSpec>,
    optimizer: Option<&OptimizerState>,
    files: &[ExtraFile],
) -> Result<()> {
    const OP: &str = "save_gemma_folder";
    check_extra_files(OP, files)?;
    let bad = |reason: String| Error::InvalidArgument { op: OP, reason };
    let config = model.config;
    config.check()?;
    if let Some(reason) = tokenizer.and_then(|t| t.misfit(config.vocab_size)) {
        return Err(bad(reason));
    }
    let mut expected = Gemma::empty(config)?.named_parameters().into_iter();
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
        weights.push(NamedTensor::new(name, shape, values.to_vec())?);
    }
    if expected.next().is_some() {
        return Err(bad(format!(
            "the model has fewer parameters than its config {config:?} implies"
        )));
    }
    let config_bytes = pretty_json(&config_json(&config, tokenizer), OP)?;
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

/// Gemma3TextConfig's fields for `config`.
fn config_json(config: &GemmaConfig, tokenizer: Option<&TokenizerSpec>) -> Value {
    let layer_types: Vec<&str> = (0..config.n_layer)
        .map(|i| {
            if config.is_global(i) {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let mut json = json!({
        "architectures": [CLASS],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": json_f32(config.rms_norm_eps),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": json_f32(config.rope_theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": json_f32(config.rope_local_theta)},
        },
        // transformers' strict config takes an integer here.
        "query_pre_attn_scalar": if config.query_pre_attn_scalar.fract() == 0.0 {
            json!(config.query_pre_attn_scalar as u64)
        } else {
            json!(json_f32(config.query_pre_attn_scalar))
        },
        "sliding_window": config.sliding_window,
        "layer_types": layer_types,
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": crate::models::gemma::INITIALIZER_RANGE,
        "tie_word_embeddings": true,
        "use_cache": true,
        "pad_token_id": null,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": "float32",
    });
    if let Some(TokenizerSpec::TokenizerJson { bos, eos }) = tokenizer {
        for (key, id) in [("bos_token_id", bos), ("eos_token_id", eos)] {
            if let Some(id) = id {
                json[key] = (*id).into();
            }
        }
    }
    json
}

/// Reads a folder written by [`save_gemma_folder`] or by Hugging Face.
/// Every tensor is checked against config.json before the model is built.
pub fn load_gemma_folder(dir: impl AsRef<Path>) -> Result<LoadedGemma> {
    let dir = dir.as_ref();
    let config = read_gemma_config(dir)?;
    check_weights_hold(
        dir,
        &dir.join(CONFIG_FILE),
        config.num_parameters().unwrap_or(usize::MAX),
    )?;
    let shapes = Gemma::empty(config)?.named_parameters();
    let mut expected: HashMap<String, Vec<usize>> = shapes.iter().cloned().collect();
    expected.insert(HEAD.into(), vec![config.vocab_size, config.n_embd]);
    let mut weights = read_weights(dir, &expected, &|stored: &str| Some(stored.to_string()))?;
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
                reason: format!("`{HEAD}` differs from `model.embed_tokens.weight`: wgrad's Gemma 3 ties its head"),
            });
        }
    }
    weights.tensors.remove(HEAD);
    let source = weights.source.clone();
    let model = Gemma::from_parameters(config, |name, shape| {
        let tensor = weights.tensors.remove(name).ok_or_else(|| Error::FolderTensorMissing {
            path: source.clone(),
            name: name.into(),
            expected: shape.to_vec(),
        })?;
        Ok(tensor.data)
    })?;
    let tokenizer = read_tokenizer(dir, config.vocab_size)?;
    let optimizer = read_optimizer(dir, &model, &WgradNames)?;
    Ok(LoadedGemma {
        model,
        tokenizer,
        optimizer,
    })
}

/// The config.json of a Gemma 3 folder, checked, without reading the weights.
pub fn read_gemma_config(dir: impl AsRef<Path>) -> Result<GemmaConfig> {
    let fields = ConfigFields::read(dir.as_ref(), "Gemma3TextConfig")?;
    let bad = |reason: String| fields.bad(reason);
    match fields.text("model_type")? {
        Some(MODEL_TYPE) => {}
        other => {
            return Err(bad(format!(
                "model_type {other:?}: a Gemma 3 text folder says `{MODEL_TYPE}`"
            )))
        }
    }
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if fields.get(key).is_some_and(|v| !v.is_null()) {
            return Err(bad(format!("`{key}` is set: wgrad's Gemma 3 caps no logits")));
        }
    }
    if fields.flag("use_bidirectional_attention", false)? {
        return Err(bad("use_bidirectional_attention: wgrad's Gemma 3 is causal".into()));
    }
    if !fields.flag("tie_word_embeddings", true)? {
        return Err(bad("tie_word_embeddings is false: wgrad's Gemma 3 ties its head".into()));
    }
    let act = fields
        .text("hidden_activation")?
        .or(fields.text("hidden_act")?)
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(bad(format!(
            "hidden_activation `{act}`: wgrad's Gemma 3 MLP gates with gelu_pytorch_tanh"
        )));
    }
    let n_head = fields.required("num_attention_heads")?;
    let n_embd = fields.required("hidden_size")?;
    let head_dim = fields.size("head_dim")?.unwrap_or(256);
    let (rope_theta, rope_local_theta) = rope_bases(&fields)?;
    let n_layer = fields.required("num_hidden_layers")?;
    let config = GemmaConfig {
        vocab_size: fields.required("vocab_size")?,
        block_size: fields.required("max_position_embeddings")?,
        n_layer,
        n_head,
        n_kv_head: fields.size("num_key_value_heads")?.unwrap_or(n_head),
        n_embd,
        head_dim,
        intermediate_size: fields.required("intermediate_size")?,
        rope_theta,
        rope_local_theta,
        rms_norm_eps: fields.positive("rms_norm_eps", 1e-6)?,
        query_pre_attn_scalar: fields.positive("query_pre_attn_scalar", 256.0)?,
        sliding_window: fields.size("sliding_window")?.unwrap_or(4096),
        sliding_window_pattern: window_pattern(&fields, n_layer)?,
    };
    if !within_size_limits(n_layer, config.num_parameters()) {
        return Err(bad(format!(
            "sizes {config:?}: at most {MAX_LAYERS} layers and {MAX_PARAMETERS} parameters"
        )));
    }
    config.check().map_err(|e| bad(e.to_string()))?;
    Ok(config)
}

/// The global and local rotary bases: transformers 5's `rope_parameters`
/// by layer type, else `rope_theta` and `rope_local_base_freq`
/// (defaults 1,000,000 and 10,000, as transformers').
fn rope_bases(fields: &ConfigFields) -> Result<(f32, f32)> {
    let Some(rope) = fields.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok((
            fields.positive("rope_theta", 1_000_000.0)?,
            fields.positive("rope_local_base_freq", 10_000.0)?,
        ));
    };
    let base = |layer: &str, default: f32| -> Result<f32> {
        let Some(params) = rope.get(layer) else {
            return Ok(default);
        };
        let kind = params.get("rope_type").and_then(Value::as_str).unwrap_or("default");
        if kind != "default" {
            return Err(fields.bad(format!(
                "RoPE scaling `{kind}` on {layer}: wgrad's Gemma 3 computes the default rotary embedding only"
            )));
        }
        match params.get("rope_theta") {
            None => Ok(default),
            Some(theta) => theta
                .as_f64()
                .filter(|t| *t > 1.0 && t.is_finite())
                .map(|t| t as f32)
                .ok_or_else(|| {
                    fields.bad(format!(
                        "`rope_parameters.{layer}.rope_theta` is {theta}, not a number above 1"
                    ))
                }),
        }
    };
    Ok((
        base("full_attention", 1_000_000.0)?,
        base("sliding_attention", 10_000.0)?,
    ))
}

/// The period of global layers `layer_types` follows (`sliding_window_pattern`,
/// 6 without either); an error when it follows none.
fn window_pattern(fields: &ConfigFields, n_layer: usize) -> Result<usize> {
    let Some(types) = fields.get("layer_types").and_then(Value::as_array) else {
        return Ok(fields.size("sliding_window_pattern")?.unwrap_or(6));
    };
    let global: Vec<bool> = types.iter().map(|t| t.as_str() == Some("full_attention")).collect();
    let pattern = global.iter().position(|&g| g).map_or(n_layer + 1, |i| i + 1);
    let follows = global.len() == n_layer && global.iter().enumerate().all(|(i, &g)| g == ((i + 1) % pattern == 0));
    if !follows {
        return Err(fields.bad(format!(
            "layer_types {types:?}: wgrad's Gemma 3 has a global layer every sliding_window_pattern layers, the rest sliding"
        )));
    }
    Ok(pattern)
}
