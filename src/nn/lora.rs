//! Low-rank adapters (LoRA, Hu et al. 2021) that any [`Linear`] of any
//! model carries by declaration: `y = x·Wᵀ + b + (α/r)·(x·Aᵀ)·Bᵀ`, with A
//! [r, in] and B [out, r] trained and the base frozen.
//!
//! # Why a wrapper and a scope, not a field of `Linear`
//!
//! Models build their Linears in their own files and stay unaware of
//! adapters. [`Lora`] wraps a whole model: it finds the model's Linears by
//! walking its module tree ([`ParameterTree::visit_linears`]: each
//! Linear's module name, as PEFT names it, and its sizes, with no graph
//! built), picks those the
//! [`LoraConfig`]'s targets name, and gives each an adapter. Its forward
//! runs the model's own forward inside a scope (as
//! [`ForwardContext`](super::ForwardContext) carries a KV cache) in which
//! each targeted Linear adds its low-rank path, and every other parameter
//! declared is frozen ([`Graph::freeze`]): the plan then gives the base no
//! gradient and no optimizer state. Adapter parameters are named
//! `{module}.lora_A.weight` and `{module}.lora_B.weight` (PEFT's names
//! without its `base_model.model.` prefix).
//!
//! The frozen base may be stored in f16 or block-quantized as a GGUF file
//! holds it ([`BaseStorage`], QLoRA): the scope declares those matrices
//! so stored, the forward runs the quantized (or f16) products, and the
//! backward takes only the input gradient through them (dX = dY·W, the
//! weight decoded in registers), which is all the adapters need.

use std::cell::RefCell;
use std::sync::Arc;

use super::causal_lm::{declare_parameter, CausalLm, LmSizes, QuantizedMatrix, QuantizedWeights};
use super::shard::{self, Slice};
use super::{uniform, Module, ParameterTree, StageCosts, Staged};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, Tensor};
use crate::kernels::{DropoutMask, MatmulForm};
use crate::ops::QuantFormat;

/// Which Linears carry an adapter and how: rank `r`, scale `alpha / r`,
/// dropout on the adapter's input, and PEFT's `target_modules`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f32,
    /// PEFT's `lora_dropout`, on each adapter's input ([`Graph::dropout`],
    /// a mask of its own per adapter): in training steps only, so
    /// evaluation and generation see the whole input, as PEFT in `eval()`.
    pub dropout: f32,
    /// Module names or suffixes (`q_proj`, `c_attn`, `mlp.down_proj`), or
    /// the one entry `all-linear`: every Linear but the output head.
    pub targets: Vec<String>,
}

/// PEFT's target that means every Linear but the output layer.
pub const ALL_LINEAR: &str = "all-linear";

impl LoraConfig {
    /// Rank `r`, `alpha`, no dropout, over `targets`.
    pub fn new(r: usize, alpha: f32, targets: &[&str]) -> Self {
        LoraConfig {
            r,
            alpha,
            dropout: 0.0,
            targets: targets.iter().map(|t| (*t).to_string()).collect(),
        }
    }

    /// `α / r`, the factor on the adapter's output.
    pub fn scale(&self) -> f32 {
        self.alpha / self.r.max(1) as f32
    }

    /// Parses `r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj` (the CLI's
    /// `--lora`): keys in any order; the words after `targets=` up to the
    /// next `key=` are target names (`all-linear`, or names separated by
    /// commas). `alpha` defaults to `2·r` (PEFT's examples), `targets` to
    /// `all-linear`, `dropout` to 0.
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument { op: "--lora", reason };
        let (mut r, mut alpha, mut dropout, mut targets) = (None, None, 0.0f32, Vec::new());
        let mut in_targets = false;
        for word in spec.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let Some((key, value)) = word.split_once('=') else {
                if in_targets {
                    targets.push(word.to_string());
                    continue;
                }
                return Err(bad(format!("`{word}` is not key=value (r, alpha, dropout, targets)")));
            };
            in_targets = false;
            let number = |v: &str| {
                v.trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| bad(format!("`{key}={v}` is not a number")))
            };
            match key.trim() {
                "r" | "rank" => {
                    r = Some(
                        value
                            .trim()
                            .parse::<usize>()
                            .map_err(|_| bad(format!("`r={value}` is not a whole number")))?,
                    )
                }
                "alpha" | "lora_alpha" => alpha = Some(number(value)?),
                "dropout" | "lora_dropout" => dropout = number(value)?,
                "targets" | "target_modules" => {
                    in_targets = true;
                    targets.push(value.trim().to_string());
                }
                other => return Err(bad(format!("unknown key `{other}`: use r, alpha, dropout, targets"))),
            }
        }
        let r = r.ok_or_else(|| bad("no rank: give r=N".into()))?;
        let config = LoraConfig {
            r,
            alpha: alpha.unwrap_or(2.0 * r as f32),
            dropout,
            targets: if targets.is_empty() {
                vec![ALL_LINEAR.into()]
            } else {
                targets
            },
        };
        config.check()?;
        Ok(config)
    }

    /// The sizes and options every adapter needs, before any layer is seen.
    pub fn check(&self) -> Result<()> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "LoraConfig",
            reason,
        };
        if self.r == 0 {
            return Err(bad("the rank r must be at least 1".into()));
        }
        if !self.alpha.is_finite() {
            return Err(bad(format!("alpha {} is not finite", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad(format!("dropout {} is not in [0, 1)", self.dropout)));
        }
        if self.targets.is_empty() || self.targets.iter().any(|t| t.trim().is_empty()) {
            return Err(bad("no target modules: name some (q_proj,v_proj) or all-linear".into()));
        }
        Ok(())
    }

    fn all_linear(&self) -> bool {
        self.targets.iter().any(|t| t == ALL_LINEAR)
    }

    /// Whether the Linear named `module` is a target: PEFT's rule for a
    /// list, the name itself or its last components (`q_proj` matches
    /// `model.layers.0.self_attn.q_proj`).
    fn targets_module(&self, module: &str) -> bool {
        self.targets
            .iter()
            .any(|t| module == t || module.strip_suffix(t.as_str()).is_some_and(|head| head.ends_with('.')))
    }
}

/// One Linear's adapter: A [r, in] and B [out, r], row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraAdapter {
    /// The Linear's module name (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    pub in_features: usize,
    pub out_features: usize,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

/// A Linear a model's forward runs: its module name and sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearSite {
    pub module: String,
    pub in_features: usize,
    pub out_features: usize,
}

/// How a [`Lora`]'s frozen base is stored on the device. The adapters
/// are f32 whatever the base; the base gets no gradient and no optimizer
/// state, and its products' backward computes only the input gradient,
/// through the stored weights (a quantized one decoded in registers:
/// `matmul_quant_transposed`).
#[derive(Clone, Default)]
pub enum BaseStorage {
    /// As the base model holds its values: f32.
    #[default]
    F32,
    /// Every matrix (a Linear's weight, an embedding table) in f16, half
    /// the bytes; vectors (norms, biases) f32.
    F16,
    /// QLoRA: the named matrices block-quantized, as a GGUF file stores
    /// them (`GgufModel::quantized_weights`, by the module tree's names);
    /// every other parameter f32 from the base's values.
    Quantized(Arc<QuantizedWeights>),
    /// Every matrix whose rows hold whole blocks of the format stored in
    /// it, for a base built without values to plan memory (`wgrad train
    /// --dry-run` over a preset): no executor runs such a graph (wgrad
    /// reads quantized weights from files; it does not quantize).
    QuantizedAs(QuantFormat),
}

/// How [`BaseStorage`] declares one parameter.
enum Stored {
    Blocks(QuantizedMatrix),
    F16,
    /// No contents (a base sized without values), of this dtype.
    Planned(DType),
}

impl BaseStorage {
    /// Quantized, f16 or f32, as `wgrad train --base-dtype` names it.
    pub fn describe(&self) -> String {
        match self {
            BaseStorage::F32 => "f32".into(),
            BaseStorage::F16 => "f16".into(),
            BaseStorage::Quantized(q) => {
                let mut formats: Vec<&str> = q.values().map(|m| m.format.name()).collect();
                formats.sort_unstable();
                formats.dedup();
                format!("quantized ({})", formats.join(", "))
            }
            BaseStorage::QuantizedAs(format) => format!("quantized ({})", format.name()),
        }
    }

    /// How the base parameter `name` (the base's own name) of `shape` is
    /// declared; None: f32 from its values (or planned, if it has none).
    fn stored_as(&self, name: &str, shape: &[usize], values: &[f32]) -> Result<Option<Stored>> {
        let matrix = shape.len() == 2;
        Ok(match self {
            BaseStorage::F32 => None,
            BaseStorage::F16 if matrix && values.is_empty() => Some(Stored::Planned(DType::F16)),
            BaseStorage::F16 if matrix => Some(Stored::F16),
            BaseStorage::F16 => None,
            BaseStorage::Quantized(q) => q.get(name).cloned().map(Stored::Blocks),
            BaseStorage::QuantizedAs(format) => {
                let whole_blocks = matrix && shape[1] % format.super_block() == 0;
                if whole_blocks && !values.is_empty() {
                    return Err(Error::InvalidArgument {
                        op: "LoRA",
                        reason: format!(
                            "`{name}` has values: a base stored as {} comes from a file's blocks \
                             (BaseStorage::Quantized); wgrad does not quantize",
                            format.name()
                        ),
                    });
                }
                whole_blocks.then_some(Stored::Planned(DType::Quant(*format)))
            }
        })
    }
}

impl std::fmt::Debug for BaseStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BaseStorage::Quantized(q) => write!(f, "Quantized({} matrices)", q.len()),
            other => f.write_str(&other.describe()),
        }
    }
}

/// Storages compare by what they hold: the same map (one file's) or the
/// same rule.
impl PartialEq for BaseStorage {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (BaseStorage::F32, BaseStorage::F32) | (BaseStorage::F16, BaseStorage::F16) => true,
            (BaseStorage::Quantized(a), BaseStorage::Quantized(b)) => Arc::ptr_eq(a, b) || a == b,
            (BaseStorage::QuantizedAs(a), BaseStorage::QuantizedAs(b)) => a == b,
            _ => false,
        }
    }
}

/// A model whose targeted Linears carry low-rank adapters over its frozen
/// parameters (see the module documentation).
#[derive(Clone, Debug)]
pub struct Lora<M> {
    pub base: M,
    pub config: LoraConfig,
    adapters: Arc<Vec<LoraAdapter>>,
    /// How the frozen base is stored on the device (f32 unless set).
    storage: BaseStorage,
}

struct Scope {
    root: String,
    scale: f32,
    /// On each adapter's input, in training graphs.
    dropout: f32,
    adapters: Arc<Vec<LoraAdapter>>,
    storage: BaseStorage,
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
}

/// Runs `f` with `scope` active on this thread, restoring what was active
/// before however it ends; returns the scope as `f` left it.
fn with_scope<R>(scope: Scope, f: impl FnOnce() -> Result<R>) -> (Result<R>, Option<Scope>) {
    /// Puts the previous scope back if `f` panics.
    struct Restore(Option<Option<Scope>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                SCOPE.with(|s| *s.borrow_mut() = previous);
            }
        }
    }
    let mut restore = Restore(Some(SCOPE.with(|s| s.borrow_mut().replace(scope))));
    let result = f();
    let previous = restore.0.take().flatten();
    let left = SCOPE.with(|s| std::mem::replace(&mut *s.borrow_mut(), previous));
    (result, left)
}

/// Whether a forward runs under a LoRA scope (generation's joined
/// quantized products then stay apart, so each Linear adds its adapter).
pub(crate) fn active() -> bool {
    SCOPE.with(|s| s.borrow().is_some()) || super::multi_lora::active()
}

/// Under an applying scope: whether the parameter `name` (a full name)
/// stays trainable, that is, is an adapter's. Outside one, every parameter
/// is (None: no scope).
pub(crate) fn trainable(name: &str) -> Option<bool> {
    SCOPE.with(|s| match &*s.borrow() {
        Some(Scope { root, adapters, .. }) => {
            let local = name.strip_prefix(root.as_str()).unwrap_or(name);
            Some(adapters.iter().any(|a| {
                local
                    .strip_prefix(a.module.as_str())
                    .is_some_and(|rest| rest == ".lora_A.weight" || rest == ".lora_B.weight")
            }))
        }
        None => None,
    })
}

/// Under an applying scope whose base is stored other than in f32: the
/// frozen parameter `name` (a full name) declared as the base's
/// [`BaseStorage`] keeps it, or handed back where `g` has it already (a
/// table a tied head reads again). None where the scope keeps it f32 (the
/// caller declares it as usual).
pub(crate) fn declare_stored(g: &mut Graph, name: &str, shape: &[usize], values: &[f32]) -> Result<Option<Tensor>> {
    let stored = SCOPE.with(|s| match &*s.borrow() {
        Some(Scope { root, storage, .. }) => {
            let local = name.strip_prefix(root.as_str()).unwrap_or(name);
            storage.stored_as(local, shape, values)
        }
        None => Ok(None),
    })?;
    let Some(stored) = stored else {
        return Ok(None);
    };
    // A tensor-parallel rank holds a share of each split matrix; cutting a
    // file's blocks into shares is not done here.
    if super::shard::sharded() && matches!(stored, Stored::Blocks(_) | Stored::Planned(DType::Quant(_))) {
        return Err(Error::InvalidArgument {
            op: "LoRA",
            reason: format!(
                "`{name}`: tensor parallel over a quantized base is not supported (each rank would need a share \
                 of the file's blocks); train it on one device or under data, ZeRO or pipeline parallel, or \
                 store the base in f32 or f16 (--base-dtype)"
            ),
        });
    }
    if let Some(t) = g
        .parameters()
        .into_iter()
        .find(|&p| g.get(p).is_some_and(|n| n.name == name))
    {
        return Ok(Some(t));
    }
    Ok(Some(match stored {
        Stored::Blocks(matrix) => g.parameter_quantized(name, shape, matrix.format, &matrix.raw)?,
        Stored::Planned(dtype) => g.parameter_planned(name, shape, dtype)?,
        Stored::F16 => g.parameter_f16(name, shape, values.to_vec())?,
    }))
}

/// `y` (the Linear at `prefix`'s output, of x [.., in]) with the active
/// adapter's path added, when that Linear carries one. Under tensor
/// parallelism `y` is a rank's share of the Linear, and the adapter splits
/// with it ([`share_of`]).
pub(crate) fn adapt(
    g: &mut Graph,
    x: Tensor,
    y: Tensor,
    prefix: &str,
    in_features: usize,
    out_features: usize,
) -> Result<Tensor> {
    // Many adapters at once (a server's), gathered per row.
    if let Some(y) = super::multi_lora::adapt(g, x, y, prefix, in_features, out_features)? {
        return Ok(y);
    }
    let share = shard::linear_share(prefix);
    let [whole_out, whole_in] = share.as_ref().map_or([out_features, in_features], |(whole, _)| *whole);
    let found = SCOPE.with(|s| -> Result<Option<(String, f32, f32, LoraAdapter)>> {
        match &*s.borrow() {
            None => Ok(None),
            Some(Scope {
                root,
                scale,
                dropout,
                adapters,
                ..
            }) => {
                let local = prefix.strip_prefix(root.as_str()).unwrap_or(prefix);
                let module = local.strip_suffix('.').unwrap_or(local);
                let Some(a) = adapters.iter().find(|a| a.module == module) else {
                    return Ok(None);
                };
                if (a.in_features, a.out_features) != (whole_in, whole_out) {
                    return Err(Error::shape(
                        "LoRA",
                        format!(
                            "the adapter of `{module}` is [{}, {}] but the Linear is [{whole_out}, {whole_in}]",
                            a.out_features, a.in_features
                        ),
                        &[&[a.out_features, a.in_features], &[whole_out, whole_in]],
                    ));
                }
                Ok(Some((prefix.to_string(), *scale, *dropout, a.clone())))
            }
        }
    })?;
    let Some((prefix, scale, dropout, adapter)) = found else {
        return Ok(y);
    };
    let module = adapter.module.clone();
    let (adapter, col_offset) = share_of(adapter, share, &prefix, [out_features, in_features])?;
    let r = adapter.a.len() / in_features.max(1);
    let a = declare_parameter(
        g,
        format!("{prefix}lora_A.weight"),
        &[r, in_features],
        &adapter.a,
        false,
    )?;
    let b = declare_parameter(
        g,
        format!("{prefix}lora_B.weight"),
        &[out_features, r],
        &adapter.b,
        false,
    )?;
    // PEFT's lora_dropout on the adapter's input, where a graph trains
    // (generation's cached forward never does); a row-parallel share's
    // columns draw the whole input's mask where they lie in it.
    let x = if dropout > 0.0 && super::causal_lm::cache_pass().is_none() {
        let mask = DropoutMask {
            p: dropout,
            salt: dropout_salt(&module),
            row_width: whole_in,
            col_offset,
        };
        g.dropout(x, mask)?
    } else {
        x
    };
    let shape = g.shape_of(y).map(<[usize]>::to_vec).unwrap_or_default();
    let rows = shape.iter().product::<usize>() / out_features.max(1);
    let flat = g.reshape(x, &[rows, in_features])?;
    let down = g.matmul_form(MatmulForm::ABt, flat, a)?;
    let up = g.matmul_form(MatmulForm::ABt, down, b)?;
    let scaled = g.scale(up, scale)?;
    let delta = g.reshape(scaled, &shape)?;
    g.add(y, delta)
}

/// A number telling one adapter's dropout masks from another's (FNV-1a of
/// its module name): q, k and v read the same input with masks of their
/// own, as PEFT's separate `lora_dropout` modules draw.
fn dropout_salt(module: &str) -> u32 {
    module
        .bytes()
        .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// The adapter's share beside a tensor-parallel share of its Linear
/// (`share`: the whole Linear's [out, in] and where the rank's weight lies,
/// [`shard::linear_share`]; none: the whole adapter), which runs `local`
/// [out, in]; and where the share's input columns start. Beside a
/// column-parallel share (some output rows) B keeps the same rows and A
/// stays whole; beside a row-parallel one (some input columns) A keeps the
/// same columns and B stays whole, so each rank's path is a partial sum
/// that the base's all-reduce adds up with the base's. The split matrix is
/// noted for the engine; the whole one, on every rank, is a replicated
/// parameter whose gradient the engine sums over the ranks.
fn share_of(
    adapter: LoraAdapter,
    share: Option<([usize; 2], Slice)>,
    prefix: &str,
    local: [usize; 2],
) -> Result<(LoraAdapter, usize)> {
    let Some(([out, input], slice)) = share else {
        return Ok((adapter, 0));
    };
    let r = adapter.a.len() / input.max(1);
    let (mut a, mut b, mut col_offset) = (adapter.a, adapter.b, 0);
    match &slice {
        Slice::Rows(_) => {
            b = slice.take(&b, &[out, r]);
            shard::record_slice(format!("{prefix}lora_B.weight"), vec![out, r], slice);
        }
        Slice::Columns(columns) => {
            col_offset = columns.start;
            a = slice.take(&a, &[r, input]);
            shard::record_slice(format!("{prefix}lora_A.weight"), vec![r, input], slice);
        }
    }
    let [local_out, local_in] = local;
    if a.len() != r * local_in || b.len() != local_out * r {
        return Err(Error::Internal {
            op: "LoRA",
            reason: format!("`{prefix}`'s adapter share does not fit its Linear's [{local_out}, {local_in}]"),
        });
    }
    Ok((
        LoraAdapter {
            a,
            b,
            in_features: local_in,
            out_features: local_out,
            ..adapter
        },
        col_offset,
    ))
}

/// Every Linear `model`'s forward runs, in order, and the output head (an
/// `lm_head`, a Sequential's last Linear; none when the head is a tied
/// table), from its module tree ([`ParameterTree::visit_linears`]): no
/// graph is built and no value copied.
pub fn linear_sites(model: &dyn Module) -> Result<(Vec<LinearSite>, Option<String>)> {
    let (mut sites, mut head) = (Vec::new(), None);
    model.visit_linears("", &mut |site, is_head| {
        if is_head && head.is_none() {
            head = Some(site.module.clone());
        }
        sites.push(site);
    });
    Ok((sites, head))
}

impl<M: Module> Lora<M> {
    /// `base` with adapters on the Linears `config` targets, initialised as
    /// PEFT does: A kaiming-uniform (a = √5, that is U(-1/√in, 1/√in)) from
    /// the seeded generator ([`super::manual_seed`]), B zero, so the model
    /// starts as the base. An error when a target matches no Linear or the
    /// rank exceeds a targeted layer's smaller side.
    pub fn new(base: M, config: LoraConfig) -> Result<Self> {
        let sites = Self::targeted(&base, &config)?;
        let r = config.r;
        let adapters = sites
            .into_iter()
            .map(|s| LoraAdapter {
                a: uniform(r * s.in_features, 1.0 / (s.in_features.max(1) as f32).sqrt()),
                b: vec![0.0; s.out_features * r],
                module: s.module,
                in_features: s.in_features,
                out_features: s.out_features,
            })
            .collect();
        Ok(Lora {
            base,
            config,
            adapters: Arc::new(adapters),
            storage: BaseStorage::F32,
        })
    }

    /// `base` with the given adapters (read from a file): each must be a
    /// Linear of `base` that `config` targets, at its sizes and rank, and
    /// every targeted Linear must have one.
    pub fn with_adapters(base: M, config: LoraConfig, adapters: Vec<LoraAdapter>) -> Result<Self> {
        let sites = Self::targeted(&base, &config)?;
        for a in &adapters {
            let site = sites
                .iter()
                .find(|s| s.module == a.module)
                .ok_or_else(|| Error::InvalidArgument {
                    op: "LoRA",
                    reason: format!(
                        "the adapter names `{}`, which is not a targeted Linear of this model",
                        a.module
                    ),
                })?;
            let (i, o, r) = (site.in_features, site.out_features, config.r);
            if (a.in_features, a.out_features, a.a.len(), a.b.len()) != (i, o, r * i, o * r) {
                return Err(Error::shape(
                    "LoRA",
                    format!(
                        "`{}`: the base Linear is [{o}, {i}], so rank {r} needs A [{r}, {i}] and B [{o}, {r}]",
                        a.module
                    ),
                    &[&[a.out_features, a.in_features], &[a.a.len()], &[a.b.len()]],
                ));
            }
        }
        if let Some(missing) = sites.iter().find(|s| !adapters.iter().any(|a| a.module == s.module)) {
            return Err(Error::InvalidArgument {
                op: "LoRA",
                reason: format!("no adapter for `{}`, which the targets name", missing.module),
            });
        }
        let mut ordered = adapters;
        ordered.sort_by_key(|a| sites.iter().position(|s| s.module == a.module));
        Ok(Lora {
            base,
            config,
            adapters: Arc::new(ordered),
            storage: BaseStorage::F32,
        })
    }

    /// The Linears of `base` that `config` targets, each checked against the
    /// rank.
    fn targeted(base: &M, config: &LoraConfig) -> Result<Vec<LinearSite>> {
        config.check()?;
        let (sites, head) = linear_sites(base)?;
        let mut chosen: Vec<LinearSite> = Vec::new();
        for site in sites {
            let wanted = if config.all_linear() {
                head.as_deref() != Some(site.module.as_str())
            } else {
                config.targets_module(&site.module)
            };
            if wanted && !chosen.iter().any(|c| c.module == site.module) {
                chosen.push(site);
            }
        }
        if !config.all_linear() {
            let named = |t: &String| chosen.iter().any(|s| config_targets_one(t, &s.module));
            if let Some(t) = config.targets.iter().find(|t| !named(t)) {
                return Err(Error::InvalidArgument {
                    op: "LoRA",
                    reason: format!("target `{t}` matches no Linear of `{}`", base.describe()),
                });
            }
        }
        if chosen.is_empty() {
            return Err(Error::InvalidArgument {
                op: "LoRA",
                reason: format!("`{}` has no Linear layer to adapt", base.describe()),
            });
        }
        if let Some(s) = chosen.iter().find(|s| config.r > s.in_features.min(s.out_features)) {
            return Err(Error::InvalidArgument {
                op: "LoRA",
                reason: format!(
                    "rank {} exceeds `{}` [{}, {}]: at most {}",
                    config.r,
                    s.module,
                    s.out_features,
                    s.in_features,
                    s.in_features.min(s.out_features)
                ),
            });
        }
        Ok(chosen)
    }
}

fn config_targets_one(target: &str, module: &str) -> bool {
    module == target || module.strip_suffix(target).is_some_and(|head| head.ends_with('.'))
}

impl<M> Lora<M> {
    /// The adapters, in the order the model runs their Linears.
    pub fn adapters(&self) -> &[LoraAdapter] {
        &self.adapters
    }

    /// Values the adapters train (PEFT's "trainable params").
    pub fn trainable_parameters(&self) -> usize {
        self.adapters.iter().map(|a| a.a.len() + a.b.len()).sum()
    }

    fn scope(&self, root: &str) -> Scope {
        Scope {
            root: root.to_string(),
            scale: self.config.scale(),
            dropout: self.config.dropout,
            adapters: Arc::clone(&self.adapters),
            storage: self.storage.clone(),
        }
    }

    /// How the frozen base is stored on the device.
    pub fn base_storage(&self) -> &BaseStorage {
        &self.storage
    }

    /// This model with its frozen base stored as `storage` on the device
    /// (QLoRA with [`BaseStorage::Quantized`]): the forward reads the
    /// base's matrices so stored and the backward computes the input
    /// gradient through them; only the adapters train. The base's own
    /// values serve the parameters `storage` leaves in f32.
    pub fn with_base_storage(mut self, storage: BaseStorage) -> Self {
        self.storage = storage;
        self
    }

    /// `f` under this model's scope.
    fn run<R>(&self, root: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        with_scope(self.scope(root), f).0
    }
}

impl<M: Module> Lora<M> {
    /// Each adapted Linear's weight with its adapter folded in, W + (α/r)·B·A
    /// (summed in f64, rounded once), by parameter name (`{module}.weight`),
    /// in the adapters' order: what a merged model stores.
    pub fn merged_weights(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let base = self.base.parameter_values();
        let (r, scale) = (self.config.r, f64::from(self.config.scale()));
        self.adapters
            .iter()
            .map(|a| {
                let name = format!("{}.weight", a.module);
                let (i, o) = (a.in_features, a.out_features);
                let w = base
                    .iter()
                    .find(|(n, _, _)| *n == name)
                    .map(|(_, _, v)| *v)
                    .filter(|v| v.len() == o * i && a.a.len() == r * i && a.b.len() == o * r)
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "Lora::merged_weights",
                        reason: format!(
                            "the base has no values for `{name}` [{o}, {i}] (a quantized weight is merged from its \
                             de-quantized values)"
                        ),
                    })?;
                let mut merged = Vec::with_capacity(o * i);
                for row in 0..o {
                    let b = &a.b[row * r..(row + 1) * r];
                    for col in 0..i {
                        let delta: f64 = (0..r).map(|k| f64::from(b[k]) * f64::from(a.a[k * i + col])).sum();
                        merged.push((f64::from(w[row * i + col]) + scale * delta) as f32);
                    }
                }
                Ok((name, merged))
            })
            .collect()
    }
}

impl<M: Module + Clone> Lora<M> {
    /// The base with every adapter folded into its Linear
    /// ([`Lora::merged_weights`]): the same function, with no adapter.
    pub fn merged(&self) -> Result<M> {
        let mut weights = self.merged_weights()?;
        let mut base = self.base.clone();
        base.visit_mut("", &mut |name, _, values| {
            if let Some(i) = weights.iter().position(|(n, _)| *n == name) {
                *values = weights.swap_remove(i).1;
            }
            Ok(())
        })?;
        Ok(base)
    }
}

impl<M: ParameterTree> ParameterTree for Lora<M> {
    /// The base's Linears (an adapter is not one).
    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool)) {
        self.base.visit_linears(prefix, f);
    }

    /// The base's parameters, then each adapter's A and B.
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        self.base.visit(prefix, f);
        let r = self.config.r;
        for a in self.adapters.iter() {
            f(
                format!("{prefix}{}.lora_A.weight", a.module),
                vec![r, a.in_features],
                &a.a,
            );
            f(
                format!("{prefix}{}.lora_B.weight", a.module),
                vec![a.out_features, r],
                &a.b,
            );
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        self.base.visit_mut(prefix, f)?;
        let r = self.config.r;
        for a in Arc::make_mut(&mut self.adapters).iter_mut() {
            f(
                format!("{prefix}{}.lora_A.weight", a.module),
                vec![r, a.in_features],
                &mut a.a,
            )?;
            f(
                format!("{prefix}{}.lora_B.weight", a.module),
                vec![a.out_features, r],
                &mut a.b,
            )?;
        }
        Ok(())
    }
}

impl<M: Module> Module for Lora<M> {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        self.run(prefix, || self.base.forward(g, x, prefix))
    }

    /// The base's line, then the adapters': `LoRA(r=8, alpha=16,
    /// targets=q_proj,v_proj)`.
    fn describe(&self) -> String {
        format!(
            "{} LoRA(r={}, alpha={}, targets={})",
            self.base.describe(),
            self.config.r,
            self.config.alpha,
            self.config.targets.join(",")
        )
    }

    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        self.base.input(g, batch)
    }

    fn permuted_rows(&self) -> Vec<(String, usize)> {
        self.base.permuted_rows()
    }

    fn hf_module_prefix(&self) -> &'static str {
        self.base.hf_module_prefix()
    }
}

impl<M: Staged> Staged for Lora<M> {
    fn prologue(&self, g: &mut Graph, input: Tensor) -> Result<Tensor> {
        self.run("", || self.base.prologue(g, input))
    }

    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor> {
        self.run("", || self.base.block(g, index, x))
    }

    fn epilogue(&self, g: &mut Graph, x: Tensor) -> Result<Tensor> {
        self.run("", || self.base.epilogue(g, x))
    }

    /// The base's costs: an adapter's work (2·r·(in + out) per row) is small
    /// beside its layer's.
    fn stage_costs(&self) -> StageCosts {
        self.base.stage_costs()
    }
}

impl<M: CausalLm> CausalLm for Lora<M> {
    fn lm_sizes(&self) -> LmSizes {
        let sizes = self.base.lm_sizes();
        LmSizes {
            parameters: sizes.parameters + self.trainable_parameters() as u64,
            ..sizes
        }
    }

    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<(Tensor, Tensor)> {
        self.run(prefix, || self.base.body(g, idx, prefix))
    }

    fn logits(&self, g: &mut Graph, table: Tensor, x: Tensor, prefix: &str) -> Result<Tensor> {
        self.run(prefix, || self.base.logits(g, table, x, prefix))
    }
}
