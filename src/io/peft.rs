//! Hugging Face PEFT's LoRA adapter folders, both ways: `adapter_config.json`
//! (`peft_type: LORA`, `r`, `lora_alpha`, `lora_dropout`,
//! `target_modules`, …) and `adapter_model.safetensors`, whose tensors PEFT
//! names `base_model.model.{module}.lora_A.weight` ([r, in]) and
//! `….lora_B.weight` ([out, r]), `{module}` being the Linear's name in the
//! base model (`model.layers.0.self_attn.q_proj` in a Llama; wgrad's names
//! for Llama-family models are Hugging Face's; a GPT-2's are wgrad's after
//! `transformer.`, [`Module::hf_module_prefix`]). B rows follow Hugging
//! Face's order whatever order the base holds them in
//! ([`Module::permuted_rows`]: a GGUF Llama's q and k). An adapter wgrad cannot
//! run as PEFT would (DoRA, rsLoRA, trained biases, per-layer ranks, …) is
//! refused by name, and so is one that does not fit its base; nothing is
//! built until the whole folder has been read and checked.

use std::path::Path;

use safetensors::SafeTensors;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::io::checkpoint::{self, Checkpoint, NamedTensor};
use crate::io::gguf::llama::{permute_rows, unpermute_rows};
use crate::io::gpt_folder::OptimizerState;
use crate::nn::{Lora, LoraAdapter, LoraConfig, Module, ALL_LINEAR};

/// The adapter's settings file in a PEFT folder.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's tensors in a PEFT folder.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before a module's name in the base model.
const PREFIX: &str = "base_model.model.";

/// An adapter folder's contents: its settings, the base it names and one
/// adapter per Linear (module names without PEFT's prefix).
#[derive(Clone, Debug, PartialEq)]
pub struct PeftAdapter {
    pub config: LoraConfig,
    pub base_model: Option<String>,
    pub adapters: Vec<LoraAdapter>,
}

impl PeftAdapter {
    /// `base` carrying this adapter: every adapter must be a Linear of
    /// `base` that the targets name, at its sizes, and every Linear they
    /// name must have one. PEFT's `lora_dropout` is kept in the config;
    /// wgrad runs the adapter without it (as PEFT in evaluation). Over a
    /// model that holds some Linears' rows in another order than Hugging
    /// Face's ([`Module::permuted_rows`]: a GGUF Llama's q and k), their B
    /// rows are moved to the model's order.
    pub fn apply<M: Module>(self, base: M) -> Result<Lora<M>> {
        let fitted = self.fitted_to(&base)?;
        Lora::with_adapters(base, fitted.config, fitted.adapters)
    }

    /// This adapter under `base`'s own names and row order (what
    /// [`PeftAdapter::apply`] carries; what a server holding several
    /// adapters over one base stacks): Hugging Face's module prefix
    /// dropped, and B's rows moved where `base` permutes its Linears' rows.
    pub fn fitted_to<M: Module>(mut self, base: &M) -> Result<Self> {
        let r = self.config.r;
        // Hugging Face's names of the model's modules, wgrad's without the prefix.
        let hf = base.hf_module_prefix();
        for a in self.adapters.iter_mut().filter(|_| !hf.is_empty()) {
            if let Some(local) = a.module.strip_prefix(hf) {
                a.module = local.to_string();
            }
        }
        for (module, heads) in base.permuted_rows() {
            if let Some(a) = self.adapters.iter_mut().find(|a| a.module == module) {
                // A B of the wrong size is left for with_adapters to refuse by name.
                if a.b.len() == a.out_features * r && a.out_features % (2 * heads) == 0 {
                    a.b = permute_rows(&a.b, a.out_features, heads)?;
                }
            }
        }
        Ok(self)
    }
}

/// Reads the PEFT adapter folder `dir` ([`parse`] on its two files).
pub fn read(dir: impl AsRef<Path>) -> Result<PeftAdapter> {
    let dir = dir.as_ref();
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| Error::CheckpointIo {
            path,
            action: "read",
            source,
        })
    };
    parse(&read(CONFIG_FILE)?, &read(WEIGHTS_FILE)?, dir)
}

/// `base` with the adapter of the PEFT folder `dir`.
pub fn load<M: Module>(base: M, dir: impl AsRef<Path>) -> Result<Lora<M>> {
    read(dir)?.apply(base)
}

/// An adapter from the bytes of its `adapter_config.json` and
/// `adapter_model.safetensors` (`dir` names them in errors).
pub fn parse(config_json: &[u8], weights: &[u8], dir: &Path) -> Result<PeftAdapter> {
    let config_path = dir.join(CONFIG_FILE);
    let bad_config = |reason: String| Error::CheckpointFormat {
        path: config_path.clone(),
        reason,
    };
    let value: Value = serde_json::from_slice(config_json).map_err(|e| bad_config(format!("not JSON: {e}")))?;
    let (config, base_model) = config_of(&value).map_err(bad_config)?;
    let adapters = adapters_of(weights, config.r, &dir.join(WEIGHTS_FILE))?;
    Ok(PeftAdapter {
        config,
        base_model,
        adapters,
    })
}

/// The settings wgrad runs, or why it cannot.
fn config_of(v: &Value) -> std::result::Result<(LoraConfig, Option<String>), String> {
    match v.get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        Some(other) => return Err(format!("peft_type `{other}`: wgrad reads LoRA adapters (LORA) only")),
        None => return Err("no peft_type: not a PEFT adapter config".into()),
    }
    let is_true = |key: &str| v.get(key).and_then(Value::as_bool) == Some(true);
    let present = |key: &str| match v.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Bool(b)) => *b,
        Some(_) => true,
    };
    let refused = [
        ("use_dora", "DoRA (use_dora)"),
        ("use_rslora", "rank-stabilised LoRA (use_rslora)"),
        ("lora_bias", "adapter biases (lora_bias)"),
        ("use_qalora", "QA-LoRA (use_qalora)"),
    ];
    if let Some((_, what)) = refused.iter().find(|(key, _)| is_true(key)) {
        return Err(format!("{what} is not implemented in wgrad"));
    }
    let unsupported = [
        ("rank_pattern", "per-layer ranks (rank_pattern)"),
        ("alpha_pattern", "per-layer alphas (alpha_pattern)"),
        ("layers_to_transform", "a subset of layers (layers_to_transform)"),
        ("modules_to_save", "fully trained modules (modules_to_save)"),
        ("exclude_modules", "excluded modules (exclude_modules)"),
        ("layer_replication", "layer replication (layer_replication)"),
        ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(key, _)| present(key)) {
        return Err(format!("{what} is not implemented in wgrad"));
    }
    match v.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(other) => return Err(format!("bias `{other}`: wgrad trains no biases (bias must be none)")),
    }
    let r = v.get("r").and_then(Value::as_u64).ok_or("no whole-number r")? as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or("no number lora_alpha")? as f32;
    let dropout = v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    let targets = match v.get("target_modules") {
        Some(Value::String(s)) if s == ALL_LINEAR => vec![ALL_LINEAR.to_string()],
        Some(Value::String(s)) => {
            return Err(format!(
                "target_modules `{s}` is a regular expression, which wgrad does not match: list the module names"
            ))
        }
        Some(Value::Array(list)) => list
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or("target_modules holds a non-string")
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        _ => return Err("no target_modules".into()),
    };
    let config = LoraConfig {
        r,
        alpha,
        dropout,
        targets,
    };
    config.check().map_err(|e| e.to_string())?;
    let base = v
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string);
    Ok((config, base))
}

/// One adapter per module from the safetensors bytes, each A [r, in] and
/// B [out, r].
fn adapters_of(bytes: &[u8], r: usize, path: &Path) -> Result<Vec<LoraAdapter>> {
    let bad = |reason: String| Error::CheckpointFormat {
        path: path.to_path_buf(),
        reason,
    };
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| bad(checkpoint::describe_safetensors_error(&e, bytes.len())))?;
    let mut adapters: Vec<(String, Option<(Vec<usize>, Vec<f32>)>, Option<(Vec<usize>, Vec<f32>)>)> = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in names {
        let view = st
            .tensor(&name)
            .map_err(|e| bad(checkpoint::describe_safetensors_error(&e, bytes.len())))?;
        let local = name.strip_prefix(PREFIX).unwrap_or(&name);
        let (module, is_a) = match (
            local.strip_suffix(".lora_A.weight"),
            local.strip_suffix(".lora_B.weight"),
        ) {
            (Some(m), _) => (m, true),
            (_, Some(m)) => (m, false),
            _ => {
                return Err(bad(format!(
                    "tensor `{name}` is not a LoRA A or B matrix (wgrad reads those only)"
                )))
            }
        };
        let values = crate::io::hf_folder::decode(&name, &view, path)?;
        let entry = match adapters.iter().position(|(m, _, _)| m == module) {
            Some(i) => &mut adapters[i],
            None => {
                adapters.push((module.to_string(), None, None));
                adapters.last_mut().ok_or_else(|| bad("no adapter entry".into()))?
            }
        };
        let slot = if is_a { &mut entry.1 } else { &mut entry.2 };
        *slot = Some((view.shape().to_vec(), values));
    }
    if adapters.is_empty() {
        return Err(bad("no LoRA tensors".into()));
    }
    adapters
        .into_iter()
        .map(|(module, a, b)| {
            let (Some((a_shape, a)), Some((b_shape, b))) = (a, b) else {
                return Err(bad(format!("`{module}` needs both lora_A and lora_B")));
            };
            match (&a_shape[..], &b_shape[..]) {
                (&[ra, in_features], &[out_features, rb]) if ra == r && rb == r => Ok(LoraAdapter {
                    module,
                    in_features,
                    out_features,
                    a,
                    b,
                }),
                _ => Err(bad(format!(
                    "`{module}`: lora_A {a_shape:?} and lora_B {b_shape:?} are not [{r}, in] and [out, {r}] (r = {r})"
                ))),
            }
        })
        .collect()
}

/// The PEFT `adapter_config.json` of `config` over `base_model`.
pub fn config_json(config: &LoraConfig, base_model: &str) -> String {
    let targets = if config.targets.iter().any(|t| t == ALL_LINEAR) {
        json!(ALL_LINEAR)
    } else {
        json!(config.targets)
    };
    let v = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "use_rslora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let mut text = serde_json::to_string_pretty(&v).unwrap_or_default();
    text.push('\n');
    text
}

/// The adapter tensors under PEFT's names, from named parameters (a
/// [`Lora`] model's, or an executor's after training: every name ending
/// `lora_A.weight` or `lora_B.weight`; the others are the base's).
pub fn adapter_checkpoint(parameters: &[(String, Vec<usize>, Vec<f32>)]) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint::new();
    for (name, shape, values) in parameters {
        if name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") {
            ckpt.push(NamedTensor::new(
                format!("{PREFIX}{name}"),
                shape.clone(),
                values.clone(),
            )?);
        }
    }
    ckpt.set_meta("format", "pt");
    Ok(ckpt)
}

/// Writes the PEFT folder `dir` (created if missing): `config` and the
/// adapter tensors among `parameters` ([`adapter_checkpoint`]). Each file
/// is written atomically.
pub fn save(
    dir: impl AsRef<Path>,
    config: &LoraConfig,
    base_model: &str,
    parameters: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<()> {
    let dir = dir.as_ref();
    let ckpt = adapter_checkpoint(parameters)?;
    if ckpt.tensors.is_empty() {
        return Err(Error::InvalidArgument {
            op: "peft::save",
            reason: "no LoRA parameters (names ending lora_A.weight or lora_B.weight) to write".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::CheckpointIo {
        path: dir.to_path_buf(),
        action: "create",
        source,
    })?;
    checkpoint::save(dir.join(WEIGHTS_FILE), &ckpt)?;
    let path = dir.join(CONFIG_FILE);
    crate::atomic_write::write_atomic(&path, config_json(config, base_model).as_bytes())
        .map_err(|(action, source)| Error::CheckpointIo { path, action, source })
}

/// [`save`] of a [`Lora`] model's own adapters, B rows in Hugging Face's
/// order whatever order the base holds them in.
pub fn save_lora<M: Module>(dir: impl AsRef<Path>, model: &Lora<M>, base_model: &str) -> Result<()> {
    let r = model.config.r;
    let (permuted, hf) = (model.permuted_rows(), model.hf_module_prefix());
    let mut parameters = Vec::with_capacity(2 * model.adapters().len());
    for a in model.adapters() {
        let b_name = format!("{}.lora_B.weight", a.module);
        parameters.push((
            format!("{hf}{}.lora_A.weight", a.module),
            vec![r, a.in_features],
            a.a.clone(),
        ));
        let b = move_rows(&permuted, &b_name, &a.b, r, true)?;
        parameters.push((format!("{hf}{b_name}"), vec![a.out_features, r], b));
    }
    save(dir, &model.config, base_model, &parameters)
}

/// `values` of the adapter matrix `name` [rows, r] (or of its optimizer
/// state) with its rows moved: a B of a Linear in `permuted` (the model's
/// [`Module::permuted_rows`]) to Hugging Face's order when `to_hf`, else
/// from it; anything else is unchanged.
fn move_rows(permuted: &[(String, usize)], name: &str, values: &[f32], r: usize, to_hf: bool) -> Result<Vec<f32>> {
    let Some(module) = name.strip_suffix(".lora_B.weight") else {
        return Ok(values.to_vec());
    };
    match permuted.iter().find(|(m, _)| m == module) {
        Some(&(_, heads)) if to_hf => unpermute_rows(values, values.len() / r.max(1), heads),
        Some(&(_, heads)) => permute_rows(values, values.len() / r.max(1), heads),
        None => Ok(values.to_vec()),
    }
}

/// The optimizer state of an adapter run, beside its adapter in the PEFT
/// folder (PEFT reads only its own two files), so the run can be resumed.
pub const STATE_FILE: &str = "optimizer.safetensors";
/// `STATE_FILE`'s format tag.
const STATE_FORMAT: &str = "wgrad-lora-optimizer";
/// Metadata keys the state file owns; the run's own keys must differ.
const STATE_KEYS: [&str; 4] = ["format", "optimizer", "step", "state_names"];

/// Writes `state` (every adapter matrix's optimizer state of `model`, the
/// step count and the run's metadata) to `dir/optimizer.safetensors`,
/// atomically: tensors named `{PEFT name}.{state}`
/// (`base_model.model.model.layers.0.mlp.up_proj.lora_A.weight.exp_avg`),
/// names and rows as [`save_lora`] writes the adapters.
pub fn save_state<M: Module>(dir: impl AsRef<Path>, model: &Lora<M>, state: &OptimizerState) -> Result<()> {
    let bad = |reason: String| Error::InvalidArgument {
        op: "peft::save_state",
        reason,
    };
    let (r, permuted, hf) = (model.config.r, model.permuted_rows(), model.hf_module_prefix());
    let shapes = adapter_shapes(model);
    let names = state.state_names();
    let mut ckpt = Checkpoint::new();
    for (param, name, values) in &state.state {
        let shape = shapes
            .iter()
            .find(|(p, _)| p == param)
            .map(|(_, s)| s)
            .ok_or_else(|| bad(format!("`{param}` is not an adapter matrix of the model")))?;
        if values.len() != shape.iter().product::<usize>() || name.is_empty() || name.contains(['.', ',']) {
            return Err(bad(format!(
                "state `{param}.{name}`: {} values for {shape:?} (names without `.` or `,`)",
                values.len()
            )));
        }
        let stored = move_rows(&permuted, param, values, r, true)?;
        ckpt.push(NamedTensor::new(
            format!("{PREFIX}{hf}{param}.{name}"),
            shape.clone(),
            stored,
        )?);
    }
    if ckpt.tensors.len() != shapes.len() * names.len() {
        return Err(bad(format!(
            "{} state tensors for {} adapter matrices and {} state names: a partial state would not resume exactly",
            ckpt.tensors.len(),
            shapes.len(),
            names.len()
        )));
    }
    for (key, value) in &state.metadata {
        if STATE_KEYS.contains(&key.as_str()) {
            return Err(bad(format!("metadata key `{key}` is the state file's own")));
        }
        ckpt.set_meta(key.clone(), value.clone());
    }
    ckpt.set_meta("format", STATE_FORMAT);
    ckpt.set_meta("optimizer", state.optimizer.clone());
    ckpt.set_meta("step", state.step.to_string());
    ckpt.set_meta("state_names", names.join(","));
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|source| Error::CheckpointIo {
        path: dir.to_path_buf(),
        action: "create",
        source,
    })?;
    checkpoint::save(dir.join(STATE_FILE), &ckpt)
}

/// What [`save_state`] wrote in `dir`, for `model` (whose adapters it
/// continues, rows in the model's order); `None` where the folder has no
/// state file (an adapter saved by PEFT, or for use only). Every adapter
/// matrix must have every state, at its shape, and nothing else.
pub fn read_state<M: Module>(dir: impl AsRef<Path>, model: &Lora<M>) -> Result<Option<OptimizerState>> {
    let path = dir.as_ref().join(STATE_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let ckpt = checkpoint::load(&path)?;
    let bad = |reason: String| Error::CheckpointFormat {
        path: path.clone(),
        reason,
    };
    let meta = |key: &str| ckpt.meta(key).ok_or_else(|| bad(format!("no `{key}` in the metadata")));
    if meta("format")? != STATE_FORMAT {
        return Err(bad(format!("format `{}` is not {STATE_FORMAT}", meta("format")?)));
    }
    let step_text = meta("step")?;
    let step = step_text
        .parse()
        .map_err(|_| bad(format!("step `{step_text}` is not a count")))?;
    let names: Vec<&str> = meta("state_names")?.split(',').filter(|n| !n.is_empty()).collect();
    let (r, permuted, hf) = (model.config.r, model.permuted_rows(), model.hf_module_prefix());
    let shapes = adapter_shapes(model);
    let mut state = Vec::with_capacity(shapes.len() * names.len());
    for name in &names {
        for (param, shape) in &shapes {
            let stored = format!("{PREFIX}{hf}{param}.{name}");
            let t = ckpt.get(&stored).ok_or_else(|| Error::FolderTensorMissing {
                path: path.clone(),
                name: stored.clone(),
                expected: shape.clone(),
            })?;
            if t.shape != *shape {
                return Err(Error::FolderTensorShape {
                    path: path.clone(),
                    name: stored,
                    expected: shape.clone(),
                    found: t.shape.clone(),
                });
            }
            state.push((
                param.clone(),
                name.to_string(),
                move_rows(&permuted, param, &t.data, r, false)?,
            ));
        }
    }
    let known: std::collections::HashSet<String> = shapes
        .iter()
        .flat_map(|(p, _)| names.iter().map(move |n| format!("{PREFIX}{hf}{p}.{n}")))
        .collect();
    if let Some(t) = ckpt.tensors.iter().find(|t| !known.contains(&t.name)) {
        return Err(Error::FolderTensorUnexpected {
            path: path.clone(),
            name: t.name.clone(),
            shape: t.shape.clone(),
        });
    }
    let metadata = ckpt
        .metadata
        .iter()
        .filter(|(k, _)| !STATE_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Some(OptimizerState {
        optimizer: meta("optimizer")?.to_string(),
        step,
        state,
        metadata,
    }))
}

/// (name, shape) of every adapter matrix of `model`, A then B per adapter.
fn adapter_shapes<M>(model: &Lora<M>) -> Vec<(String, Vec<usize>)> {
    let r = model.config.r;
    model
        .adapters()
        .iter()
        .flat_map(|a| {
            [
                (format!("{}.lora_A.weight", a.module), vec![r, a.in_features]),
                (format!("{}.lora_B.weight", a.module), vec![a.out_features, r]),
            ]
        })
        .collect()
}
