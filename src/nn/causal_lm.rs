//! What generation needs from a causal language model, and the forward
//! context that carries the KV cache and the weights' dtype through the
//! model's own forward (as candle passes its cache).
//!
//! # Why a scoped context, not a parameter of `forward`
//!
//! [`Module::forward`]`(g, x, prefix)` is the one signature every module,
//! engine (data, tensor, pipeline), trainer and predictor calls. A cache
//! argument there would enter every module and every caller for the sake
//! of what three places read: the attention modules (write keys and values
//! into the cache and attend over it), a Linear's and a tied head's
//! weight declaration (f16 storage) and the GPT's position rows (at the
//! cache's positions). candle passes its cache explicitly because each
//! candle model writes its own forward signature; here one `Module` trait
//! serves every engine. So [`ForwardContext::run`] installs the context
//! for the duration of exactly one forward, on this thread, and removes
//! it when the forward returns (an error or a panic included), as
//! Megatron's `parallel_state` scopes the tensor-parallel rank: outside
//! it every module builds its plain training forward, and an engine that
//! never calls `run` never sees one. The context also lets one graph hold
//! several forwards over the same parameters and caches (a generator's
//! prefill and decode passes): a name declared once is handed back, not
//! declared twice.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use super::Module;
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, Tensor};
use crate::kernels::{Kernels, QkvLayout};
use crate::ops::QuantFormat;

/// How a generator stores the model's weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDtype {
    #[default]
    F32,
    /// The matrices a decode step reads whole — every Linear's weight and
    /// a token table the head reuses — in f16, read in f32; needs
    /// SHADER_F16 (f32 elsewhere). Biases, norms, position tables and
    /// the KV caches stay f32.
    F16,
}

impl WeightDtype {
    /// `f32` or `f16`, as `wgrad generate --dtype` and the bench name it.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
        }
    }

    /// What a generator asking for `self` gets on `kernels`' adapter: f16
    /// only where the adapter has SHADER_F16.
    pub fn on(self, kernels: &Kernels) -> WeightDtype {
        match self {
            WeightDtype::F16 if !kernels.supports_f16() => WeightDtype::F32,
            other => other,
        }
    }
}

/// A matrix a forward stores block-quantized instead of as its module's
/// values: its format and its bytes as a GGUF file stores them (blocks of
/// 32 values in row order; a q or k projection's rows already in
/// Hugging Face's order).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedMatrix {
    pub format: QuantFormat,
    pub raw: Arc<[u8]>,
}

/// Quantized matrices by parameter name (the module tree's, e.g.
/// `model.layers.0.self_attn.q_proj.weight`): a forward context's weight
/// source ([`ForwardContext::with_quantized`]).
pub type QuantizedWeights = HashMap<String, QuantizedMatrix>;

/// What one model stores, from its sizes alone: the check that an adapter
/// holds a generator runs on these before any weight is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmSizes {
    /// Every parameter value.
    pub parameters: u64,
    /// The values [`WeightDtype::F16`] stores in f16.
    pub f16_weight_values: u64,
    /// Attention layers, each with a key and a value cache.
    pub cached_layers: u64,
    /// Values of one position of one sequence in one cache (KV heads ·
    /// head width).
    pub cache_width: u64,
    /// Positions the caches hold (the model's context).
    pub context: usize,
    pub vocab_size: usize,
    /// Channels per attention head.
    pub head_dim: usize,
}

/// A causal language model's configuration, sized without building it.
pub trait LmConfig {
    fn lm_sizes(&self) -> LmSizes;
}

/// A causal language model a generator runs: ids [B, T] -> logits, its
/// forward split where a generator passes only some rows to the head.
/// Run under a [`ForwardContext`], the attention layers read and write the
/// context's KV caches.
pub trait CausalLm: Module {
    /// The sizes [`LmConfig`] gives for this model's configuration.
    fn lm_sizes(&self) -> LmSizes;

    fn vocab_size(&self) -> usize {
        self.lm_sizes().vocab_size
    }

    /// The longest sequence: positions a KV cache holds.
    fn context_len(&self) -> usize {
        self.lm_sizes().context
    }

    /// The forward up to the final norm: hidden states x [B, T, C] of ids
    /// `idx` [B, T], and the token table (which a tied head reads).
    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<(Tensor, Tensor)>;

    /// The final norm and the head: logits [.., vocab] of rows x [.., C];
    /// `table` is what [`CausalLm::body`] returned.
    fn logits(&self, g: &mut Graph, table: Tensor, x: Tensor, prefix: &str) -> Result<Tensor>;
}

/// The KV-cache state of forwards built into one graph: the weights'
/// dtype, the caches' size, and every parameter and cache declared so far
/// (see the module documentation).
#[derive(Debug, Default)]
pub struct ForwardContext {
    weights: WeightDtype,
    /// Matrices declared quantized whatever `weights` says.
    quantized: Arc<QuantizedWeights>,
    /// Positions each cache holds.
    context: usize,
    /// Appended to the names of the caches declared from now on (see
    /// [`ForwardContext::set_cache_set`]).
    cache_set: String,
    declared: HashMap<String, Tensor>,
    /// The u32 [S] inputs naming each sequence's adapter, one per S, and
    /// the adapters they index (see [`row_adapters`]).
    adapter_rows: Vec<(usize, Tensor)>,
    adapters: usize,
}

/// One forward's view of the cache: row t of sequence s is position
/// starts[s] + t, `positions` [S, T] holding those values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachePass {
    /// u32 [S].
    pub starts: Tensor,
    /// u32 [S, T].
    pub positions: Tensor,
}

struct Active {
    cx: ForwardContext,
    pass: CachePass,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// Puts the context back into its owner when a forward ends, however.
struct Restore<'a>(&'a mut ForwardContext);

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if let Some(active) = ACTIVE.with(|a| a.borrow_mut().take()) {
            *self.0 = active.cx;
        }
    }
}

impl ForwardContext {
    /// A context whose caches hold `context` positions and whose weights
    /// are stored as `weights`.
    pub fn new(weights: WeightDtype, context: usize) -> Self {
        ForwardContext {
            weights,
            quantized: Arc::default(),
            context,
            cache_set: String::new(),
            declared: HashMap::new(),
            adapter_rows: Vec::new(),
            adapters: 0,
        }
    }

    /// The u32 [S] inputs a model carrying many adapters
    /// ([`super::MultiLora`]) declared for its forwards, with S, each to
    /// hold every sequence's adapter (or [`crate::ops::NO_ADAPTER`])
    /// before a run over S sequences; empty for any other model.
    pub fn adapter_rows(&self) -> &[(usize, Tensor)] {
        &self.adapter_rows
    }

    /// The adapters those inputs index (0: none).
    pub fn adapters(&self) -> usize {
        self.adapters
    }

    /// Forwards run from now on read and write their own caches,
    /// `{prefix}k_cache.{name}` (the empty name: the first set,
    /// `{prefix}k_cache`), sized by their own batch: a pass over fewer
    /// sequences than another (a server's one-slot prefill beside its
    /// every-slot decode) needs caches of its own. Parameters stay shared.
    pub fn set_cache_set(&mut self, name: &str) {
        self.cache_set = if name.is_empty() {
            String::new()
        } else {
            format!(".{name}")
        };
    }

    /// This context with `quantized`'s matrices stored block-quantized
    /// (`Graph::parameter_quantized`) when a forward declares them, by
    /// name, in place of the module's values; every other parameter as
    /// `weights` says. Only a Linear's weight and an embedding table take
    /// them (any other op reading one is a graph error naming it).
    pub fn with_quantized(mut self, quantized: Arc<QuantizedWeights>) -> Self {
        self.quantized = quantized;
        self
    }

    /// Runs `forward` (a model's forward declaring into one graph) with
    /// this context active on this thread: its attention layers write the
    /// keys and values of row t of sequence s at position starts[s] + t
    /// and attend over the cache, `pass` giving those positions.
    pub fn run<R>(&mut self, pass: CachePass, forward: impl FnOnce() -> Result<R>) -> Result<R> {
        let busy = ACTIVE.with(|a| a.borrow().is_some());
        if busy {
            return Err(Error::InvalidArgument {
                op: "ForwardContext::run",
                reason: "a forward context is already active on this thread".into(),
            });
        }
        let cx = std::mem::take(self);
        ACTIVE.with(|a| *a.borrow_mut() = Some(Active { cx, pass }));
        let _restore = Restore(self);
        forward()
    }
}

/// The u32 [S] input naming the adapter of each of the active pass's S
/// sequences, for a model carrying `adapters` adapters: declared by the
/// first forward over S sequences and shared by every later one (the
/// generator writes it before each run). An error outside a forward
/// context, which alone knows the sequences.
pub(crate) fn row_adapters(g: &mut Graph, adapters: usize) -> Result<Tensor> {
    ACTIVE.with(|a| {
        let mut active = a.borrow_mut();
        let Some(Active { cx, pass }) = active.as_mut() else {
            return Err(Error::InvalidArgument {
                op: "MultiLora",
                reason: "many adapters run under a generator, whose forward context names each sequence's adapter"
                    .into(),
            });
        };
        if cx.adapters != 0 && cx.adapters != adapters {
            return Err(Error::InvalidArgument {
                op: "MultiLora",
                reason: format!("one forward context serves {} adapters, not {adapters}", cx.adapters),
            });
        }
        cx.adapters = adapters;
        let seqs = g.shape_of(pass.starts).and_then(|s| s.first().copied()).unwrap_or(0);
        if let Some(&(_, t)) = cx.adapter_rows.iter().find(|(s, _)| *s == seqs) {
            return Ok(t);
        }
        let t = g.ids(&format!("lora.adapters{seqs}"), &[seqs])?;
        cx.adapter_rows.push((seqs, t));
        Ok(t)
    })
}

/// The active forward's cache pass, when a forward runs under a
/// [`ForwardContext`].
pub(crate) fn cache_pass() -> Option<CachePass> {
    ACTIVE.with(|a| a.borrow().as_ref().map(|active| active.pass))
}

/// Declares `{name}` as a parameter of `g`, or hands back the one an
/// earlier forward under the same context declared. A parameter the
/// context has quantized is stored so; else a `matrix` (a Linear's weight,
/// a table the head reads) in f16 under an f16 context.
pub(crate) fn declare_parameter(
    g: &mut Graph,
    name: String,
    shape: &[usize],
    values: &[f32],
    matrix: bool,
) -> Result<Tensor> {
    // Under a LoRA scope every parameter but an adapter's is frozen, and a
    // training forward (no forward context) stores the base as the
    // adapters' model says (QLoRA: quantized).
    let frozen = super::lora::trainable(&name) == Some(false);
    let stored = match frozen && cache_pass().is_none() {
        true => super::lora::declare_stored(g, &name, shape, values)?,
        false => None,
    };
    let t = match stored {
        Some(t) => t,
        None => declare_in_context(g, name, shape, values, matrix)?,
    };
    if frozen {
        g.freeze(t)?;
    }
    Ok(t)
}

fn declare_in_context(g: &mut Graph, name: String, shape: &[usize], values: &[f32], matrix: bool) -> Result<Tensor> {
    ACTIVE.with(|a| {
        let mut active = a.borrow_mut();
        let Some(Active { cx, .. }) = active.as_mut() else {
            return super::parameter_tree::declare_one(g, &name, shape, values);
        };
        if let Some(&t) = cx.declared.get(&name) {
            return Ok(t);
        }
        let t = match (cx.quantized.get(&name), cx.weights) {
            (Some(q), _) => g.parameter_quantized(&name, shape, q.format, &q.raw)?,
            (None, WeightDtype::F16) if matrix => g.parameter_f16(&name, shape, values.to_vec())?,
            (None, _) => g.parameter(&name, shape, values.to_vec())?,
        };
        cx.declared.insert(name, t);
        Ok(t)
    })
}

/// The weights (declared) of Linear layers reading the same input that a
/// generation forward multiplies in one product
/// ([`Graph::matmul_quant_parts`]): under a forward context, outside
/// tensor parallelism, when every one is block-quantized in one format.
pub(crate) fn one_quantized_product(g: &Graph, weights: &[Tensor]) -> bool {
    let dtypes: Vec<Option<DType>> = weights.iter().map(|&w| g.get(w).map(|n| n.dtype)).collect();
    let first = dtypes.first().copied().flatten();
    unsharded_generation() && matches!(first, Some(DType::Quant(_))) && dtypes.iter().all(|&d| d == first)
}

/// Whether a layer may try generation's joined products: a cache pass over
/// a whole (not tensor-parallel) model. Asked before declaring the weights
/// whole, since a shard declares them at its own shapes.
pub(crate) fn unsharded_generation() -> bool {
    // A joined product would skip the adapters a LoRA scope adds per Linear.
    cache_pass().is_some() && !super::shard::sharded() && !super::lora::active()
}

/// Attention of the active pass's rows over the KV caches of the layer at
/// `prefix` (`{prefix}k_cache`, `{prefix}v_cache`, [S, kv_heads, context,
/// head_dim], declared by the first forward): see [`Graph::cached_attention`].
/// -> [S, T, heads·head_dim].
pub(crate) fn cached_attention(
    g: &mut Graph,
    prefix: &str,
    qkv: [Tensor; 3],
    layout: QkvLayout,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    window: Option<usize>,
) -> Result<Tensor> {
    let sequences = g.shape_of(qkv[0]).and_then(|s| s.first().copied()).unwrap_or(0);
    let (pass, caches) = ACTIVE.with(|a| -> Result<_> {
        let mut active = a.borrow_mut();
        let Some(Active { cx, pass }) = active.as_mut() else {
            return Err(Error::InvalidArgument {
                op: "cached_attention",
                reason: "no forward context is active".into(),
            });
        };
        let (keys, values) = (
            format!("{prefix}k_cache{}", cx.cache_set),
            format!("{prefix}v_cache{}", cx.cache_set),
        );
        let mut cache = |name: String| -> Result<Tensor> {
            if let Some(&t) = cx.declared.get(&name) {
                return Ok(t);
            }
            let t = g.cache(&name, &[sequences, kv_heads, cx.context, head_dim])?;
            cx.declared.insert(name, t);
            Ok(t)
        };
        let caches = (cache(keys)?, cache(values)?);
        Ok((*pass, caches))
    })?;
    g.cached_attention_window(qkv, layout, pass.starts, [caches.0, caches.1], heads, window)
}
