//! Text generation from any causal language model ([`CausalLm`]: a
//! [`crate::models::Gpt`], a [`crate::models::Llama`]) with a KV cache, as
//! llm.c, ratchet and llama.cpp do it: after the prompt, each new token
//! costs one position's work instead of a re-run of the whole sequence.
//!
//! ```no_run
//! # fn main() -> wgrad::Result<()> {
//! use std::sync::Arc;
//! use wgrad::infer::generate::{Generator, Sampling};
//! use wgrad::models::{Gpt, GptConfig};
//! let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
//! let model = Gpt::new(GptConfig { vocab_size: 65, block_size: 64, n_layer: 2, n_head: 2, n_embd: 32 })?;
//! let mut generator = Generator::new(kernels, &model, 1)?;
//! let sampling = Sampling { temperature: 0.8, top_k: Some(20), top_p: Some(0.95), seed: 1 };
//! let tokens = generator.generate(&[0, 1, 2], 100, &sampling, |token| {
//!     print!("{token} ");
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! # How
//!
//! The generator is an ordinary graph, planned, fused and allocated once
//! like a training step, rather than a second engine of hand-built
//! dispatches: the [`Executor`] owns the KV caches as tensors that keep
//! their values from run to run ([`Graph::cache`]), written only by
//! [`Graph::cached_attention`]. Each attention layer has a key and a value
//! cache, `[sequences, n_kv_head, block_size, head_dim]` f32 for the whole
//! context (72 MiB for GPT-2 small; a grouped-query model's are n_head /
//! n_kv_head times smaller).
//!
//! The passes are the model's **own forward** under a [`ForwardContext`]
//! (`nn::causal_lm`), which routes its attention through the caches and its
//! positions through the pass's inputs, so generation knows a model only
//! through [`CausalLm`]. One graph holds, over the same parameters:
//!
//! - **prefill** passes, a whole prompt in one submission, for a few
//!   lengths (powers of two from 8, then the chunk: [`PREFILL_CHUNK`]
//!   rows or the context if shorter; a prompt runs padded in the shortest
//!   that holds it, so at most twice its work). A longer prompt runs in
//!   chunks, one pass after another writing the same caches, so no
//!   activation grows with the context. Only each sequence's last prompt
//!   row goes through the final norm and the head.
//! - **decode**, one token per sequence at a position written as a u32
//!   input, so the graph is never rebuilt: work per token is linear in the
//!   position instead of quadratic.
//!
//! Each pass ends in [`Graph::sample_tokens`], so a step reads back two u32
//! per sequence (the token, and the first non-finite logit for the error)
//! instead of its logits; the sampler's settings and its uniform draws (a
//! ChaCha8 stream on the host, one per sequence per step) are inputs.
//! [`Sampling::sample`] is the same sampler on the host.
//!
//! Past the context, [`Generator::generate`] keeps the last `block_size /
//! 2` tokens and prefills them again (nanoGPT instead recomputes a cropped
//! window for every token, `block_size` times the work).
//!
//! With [`WeightDtype::F16`] every Linear's weight and a tied token table
//! are stored in f16 and read in f32 (`f16_weights.wgsl`), so a decode step
//! moves about half the bytes; the rest stays f32. Without SHADER_F16 the
//! generator is f32 and [`Generator::dtype`] says so.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::graph::{Executor, Graph, SourceOp, Tensor};
use crate::kernels::{check_token_ids, Kernels, View};
pub use crate::nn::WeightDtype;
use crate::nn::{CachePass, CausalLm, ForwardContext, LmConfig, QuantizedWeights};
use crate::ops::NO_ADAPTER;

/// How the next token is picked from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy, the most likely token (deterministic). Above 0: sample
    /// from softmax(logits / temperature).
    pub temperature: f32,
    /// Sample only among the `k` most likely tokens (ties broken by the
    /// lower id); None for all.
    pub top_k: Option<usize>,
    /// Nucleus sampling: of those, only the smallest set of the most
    /// likely (ranked as top-k ranks them) whose probability reaches p, in
    /// (0, 1]; None (or 1) for all.
    pub top_p: Option<f32>,
    /// Seeds the ChaCha8 generator the samples are drawn with.
    pub seed: u64,
}

impl Sampling {
    /// The most likely token every time.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    /// Refuses settings no sampler takes: a temperature below 0 or not
    /// finite, top_k 0, top_p outside (0, 1].
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::InvalidArgument {
                op: "Sampling",
                reason: format!("the temperature must be finite and ≥ 0, got {}", self.temperature),
            });
        }
        if self.top_k == Some(0) {
            return Err(Error::InvalidArgument {
                op: "Sampling",
                reason: "top_k must be at least 1".into(),
            });
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::InvalidArgument {
                    op: "Sampling",
                    reason: format!("top_p must be in (0, 1], got {p}"),
                });
            }
        }
        Ok(())
    }

    /// A token id drawn from one position's `logits` (`[vocab]`), using one
    /// draw u of `rng` whatever the settings (so a seed gives the same
    /// stream for any mix of settings, as on the GPU): the first maximum
    /// at temperature 0; else the `top_k` largest logits (ties at the
    /// boundary to the lower id) are the candidates, each weighing
    /// w = exp((logit − max) / T); with `top_p`, only the smallest set of
    /// them, most likely first, whose Σw reaches top_p times theirs stays;
    /// the token is the first candidate in id order whose running sum of w
    /// exceeds u·Σw. This is what
    /// [`Generator::decode_and_sample`] computes on the GPU (in f32 there,
    /// f64 here, so a draw within rounding of a boundary between two
    /// candidates may pick either).
    pub fn sample(&self, logits: &[f32], rng: &mut ChaCha8Rng) -> Result<u32> {
        self.check()?;
        if logits.is_empty() {
            return Err(Error::InvalidArgument {
                op: "Sampling::sample",
                reason: "no logits".into(),
            });
        }
        if let Some(bad) = logits.iter().position(|v| !v.is_finite()) {
            return Err(Error::InvalidArgument {
                op: "Sampling::sample",
                reason: format!("logit {} of token {bad} is not finite", logits[bad]),
            });
        }
        let u = rng.random::<f32>();
        // Most likely first; equal logits in id order.
        let mut ranked: Vec<usize> = (0..logits.len()).collect();
        ranked.sort_by(|&a, &b| {
            logits[b]
                .partial_cmp(&logits[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        let k = self.top_k.unwrap_or(logits.len()).min(logits.len());
        if self.temperature == 0.0 || k == 1 {
            return Ok(ranked[0] as u32);
        }
        let top = f64::from(logits[ranked[0]]);
        let temperature = f64::from(self.temperature);
        let mut candidates: Vec<(usize, f64)> = ranked[..k]
            .iter()
            .map(|&i| (i, ((f64::from(logits[i]) - top) / temperature).exp()))
            .collect();
        if let Some(p) = self.top_p {
            // The nucleus: the shortest most-likely-first prefix reaching p.
            let mass = f64::from(p) * candidates.iter().map(|&(_, w)| w).sum::<f64>();
            let mut running = 0.0;
            let kept = candidates.iter().position(|&(_, w)| {
                running += w;
                running >= mass
            });
            candidates.truncate(kept.map_or(k, |i| i + 1));
        }
        candidates.sort_unstable_by_key(|&(i, _)| i);
        let target = f64::from(u) * candidates.iter().map(|&(_, w)| w).sum::<f64>();
        let mut running = 0.0;
        for &(id, w) in &candidates {
            running += w;
            if running > target {
                return Ok(id as u32);
            }
        }
        // Rounding left the draw past the last weight: the last candidate.
        Ok(candidates.last().map_or(ranked[0], |&(id, _)| id) as u32)
    }

    /// The settings as the GPU sampler takes them for one row: (u drawn
    /// from `rng`, temperature, top_p) and k.
    fn row_settings(&self, rng: &mut ChaCha8Rng, vocab: usize) -> ([f32; 3], u32) {
        let k = self.top_k.unwrap_or(vocab).min(vocab);
        (
            [rng.random::<f32>(), self.temperature, self.top_p.unwrap_or(1.0)],
            u32::try_from(k).unwrap_or(u32::MAX),
        )
    }
}

/// How a generator's prompts are run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillMode {
    /// Every sequence's prompt in one pass ([`Generator::prefill`],
    /// [`Generator::generate_batch`]): a batch that starts together.
    #[default]
    AllSequences,
    /// One slot's prompt at a time ([`Generator::prefill_slot`]) while the
    /// other slots keep their caches: continuous batching, where requests
    /// join a running batch between decode steps. The prompt runs over
    /// staging caches of one sequence that are then copied into the slot's
    /// (one sequence's caches more on the GPU), so a join costs its own
    /// rows, not every slot's. The all-sequence prefills are not built.
    OneSlot,
}

/// What [`Generator::with_options`] builds.
#[derive(Clone, Debug)]
pub struct GeneratorOptions {
    /// Sequences (slots) the caches hold.
    pub sequences: usize,
    /// Positions each sequence's cache holds, at most the model's context
    /// (None: the model's). The caches are sized by it: SmolLM2's whole
    /// 8192 positions are 180 MiB of keys and values per sequence.
    pub context: Option<usize>,
    pub dtype: WeightDtype,
    /// Matrices stored block-quantized (see [`Generator::new_with_weights`]).
    pub quantized: Arc<QuantizedWeights>,
    pub prefill: PrefillMode,
    /// Rows one prefill pass holds at most: a longer prompt is prefilled
    /// in chunks of it, one pass after another over the same caches (None:
    /// [`PREFILL_CHUNK`], or fewer where a pass that long would hold an
    /// activation past one storage binding). The caches still hold the
    /// whole context; the chunk bounds the activations.
    pub prefill_chunk: Option<usize>,
    /// Token ids never sampled (transformers' `suppress_tokens`): ids the
    /// tokenizer has no text for, such as the padding rows of a model's
    /// embedding past its tokenizer's vocabulary. Their logits get
    /// [`SUPPRESSED_LOGIT`] added in the graph, so the logits read back
    /// show them suppressed too. Empty: no op is added.
    pub suppressed_tokens: Vec<u32>,
}

impl Default for GeneratorOptions {
    fn default() -> Self {
        GeneratorOptions {
            sequences: 1,
            context: None,
            dtype: WeightDtype::F32,
            quantized: Arc::default(),
            prefill: PrefillMode::AllSequences,
            prefill_chunk: None,
            suppressed_tokens: Vec::new(),
        }
    }
}

/// The most rows a prefill pass holds unless
/// [`GeneratorOptions::prefill_chunk`] says otherwise (llama.cpp's default
/// batch): a prompt past it is prefilled in chunks.
pub const PREFILL_CHUNK: usize = 512;

/// What a suppressed token's logit gets added: finite (the samplers refuse
/// logits that are not, and WGSL may assume no infinities), yet far enough
/// below any real logit that its weight exp((l - max) / T) is 0 in f32.
pub const SUPPRESSED_LOGIT: f32 = -1e30;

impl GeneratorOptions {
    /// The positions the caches hold for a model of `model_context`.
    pub fn context_for(&self, model_context: usize) -> Result<usize> {
        match self.context {
            None => Ok(model_context),
            Some(c) if c >= 1 && c <= model_context => Ok(c),
            Some(c) => Err(Error::InvalidArgument {
                op: "Generator::new",
                reason: format!("a context of {c} positions: give 1 to the model's {model_context}"),
            }),
        }
    }
}

/// The name of the one-slot prefill's cache set.
const STAGING: &str = "slot";

/// Each layer's (cache, staging cache) pairs of a graph built with
/// [`PrefillMode::OneSlot`], matched by name.
fn staging_pairs(g: &Graph) -> Result<Vec<(Tensor, Tensor)>> {
    let caches: Vec<(Tensor, &str)> = g
        .nodes()
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op == SourceOp::Cache)
        .map(|(i, n)| (Tensor(i), n.name.as_str()))
        .collect();
    let suffix = format!(".{STAGING}");
    caches
        .iter()
        .filter_map(|&(staging, name)| name.strip_suffix(&suffix).map(|main| (staging, main)))
        .map(|(staging, main)| {
            let found = caches.iter().find(|(_, n)| *n == main).map(|&(t, _)| (t, staging));
            found.ok_or_else(|| Error::InvalidArgument {
                op: "Generator::new",
                reason: format!("the staging cache of `{main}` has no cache beside it"),
            })
        })
        .collect()
}

/// A causal language model's forward for generation ([`CausalLm`]: a
/// [`crate::models::Gpt`], a [`crate::models::Llama`]), with a KV cache on the
/// GPU for `sequences` sequences over the model's whole context (see the
/// module documentation).
pub struct Generator {
    exec: Executor,
    /// The model's [`crate::nn::Module::describe`].
    model: String,
    vocab_size: usize,
    context: usize,
    sequences: usize,
    /// How the weights are stored (f32 where f16 was asked for but the
    /// adapter lacks SHADER_F16).
    dtype: WeightDtype,
    /// Whole-prompt passes by length, shortest first, each over
    /// `prefill_batch` sequences.
    prefill: Vec<PrefillPass>,
    /// S, or 1 where the prefill passes run one slot at a time
    /// ([`PrefillMode::OneSlot`]).
    prefill_batch: usize,
    /// u32 [prefill_batch]: where each sequence's prefill rows start (0 for
    /// a prompt, the cache's length for a continuation); None when the
    /// model reads no starts.
    prefill_starts: Option<Tensor>,
    /// The prefill passes' sampler inputs (the decode pass's where the
    /// batches match).
    prefill_sampler: SamplerInputs,
    /// With [`PrefillMode::OneSlot`]: each layer's (cache [S, kv_heads,
    /// context, head_dim], the one-slot prefill's staging cache [1, ..]),
    /// keys and values alike.
    staging: Vec<(Tensor, Tensor)>,
    decode: DecodePass,
    sampler: SamplerInputs,
    /// With [`PrefillMode::OneSlot`]: decode passes over the first 1, 2,
    /// 4, … slots (fewer than S), each with its sampler inputs, so a step
    /// computes the rows up to the highest running slot, not every slot.
    smaller_decodes: Vec<(DecodePass, SamplerInputs)>,
    /// The tokens whose keys and values each sequence's cache holds, in
    /// position order.
    cached: Vec<Vec<u32>>,
    /// With a model carrying many adapters ([`crate::nn::MultiLora`]): the
    /// u32 [S] inputs naming each sequence's adapter, by S, the adapters,
    /// and each slot's ([`NO_ADAPTER`]: the base).
    adapter_rows: Vec<(usize, Tensor)>,
    adapters: usize,
    slot_adapters: Vec<u32>,
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let positions: Vec<usize> = self.cached.iter().map(Vec::len).collect();
        f.debug_struct("Generator")
            .field("model", &self.model)
            .field("positions", &positions)
            .finish()
    }
}

/// One slot's part of [`Generator::decode_slots`]: the token it feeds,
/// and how it picks the next.
pub struct SlotStep<'a> {
    pub token: u32,
    pub sampling: &'a Sampling,
    /// The request's own stream: one draw per step.
    pub rng: &'a mut ChaCha8Rng,
}

/// Inputs and output of a whole-prompt pass over `rows` positions.
struct PrefillPass {
    rows: usize,
    /// [S, rows] token ids, each prompt padded with zeros.
    ids: Tensor,
    /// [S] flat row of each sequence's last prompt position in [S·rows].
    last: Tensor,
    /// [S, rows] u32: each row's position (its start + t); None when the
    /// model reads no positions.
    positions: Option<Tensor>,
    /// [S, vocab].
    logits: Tensor,
    /// [S, 2] u32: each sequence's next token, sampled from `logits`.
    tokens: Tensor,
}

/// Inputs and output of the one-token pass.
#[derive(Clone, Copy)]
struct DecodePass {
    /// [S, 1] the new token of each sequence.
    ids: Tensor,
    /// [S] its position: where the attention writes its key and value
    /// (and the GPT's position embedding row).
    positions: Tensor,
    /// [S, vocab].
    logits: Tensor,
    /// [S, 2] u32: each sequence's next token, sampled from `logits`.
    tokens: Tensor,
}

/// The sampler's settings, inputs of every pass's `sample_tokens`.
#[derive(Clone, Copy)]
struct SamplerInputs {
    /// [S, 3] f32: each sequence's uniform draw, temperature and top_p.
    draws: Tensor,
    /// [S] u32.
    top_k: Tensor,
}

/// The model's forward over ids [S, T] at `pass`'s positions, under the
/// generator's context, with only the rows `last` picks (u32 [S], flat
/// rows of [S·T]; all of them when None) going through the final norm and
/// the head: -> (logits [S, vocab], the next tokens sampled from them).
#[allow(clippy::too_many_arguments)]
fn lm_pass(
    g: &mut Graph,
    cx: &mut ForwardContext,
    model: &dyn CausalLm,
    ids: Tensor,
    pass: CachePass,
    last: Option<Tensor>,
    sampler: SamplerInputs,
    suppress: Option<Tensor>,
) -> Result<(Tensor, Tensor)> {
    let logits = cx.run(pass, || {
        let (x, table) = model.body(g, ids, "")?;
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let rows = shape[..shape.len().saturating_sub(1)].iter().product::<usize>();
        let x = g.reshape(x, &[rows, shape.last().copied().unwrap_or(0)])?;
        let x = match last {
            Some(last) => g.embedding(x, last)?,
            None => x,
        };
        model.logits(g, table, x, "")
    })?;
    let logits = match suppress {
        Some(bias) => g.bias_add(logits, bias)?,
        None => logits,
    };
    let tokens = g.sample_tokens(logits, sampler.draws, sampler.top_k)?;
    Ok((logits, tokens))
}

/// The [vocab] bias that suppresses `ids` (None when there are none): an
/// id outside the vocabulary, or every id suppressed, is an error.
fn suppression(g: &mut Graph, ids: &[u32], vocab: usize) -> Result<Option<Tensor>> {
    const OP: &str = "Generator::new";
    if ids.is_empty() {
        return Ok(None);
    }
    let mut bias = vec![0.0f32; vocab];
    for &id in ids {
        let slot = bias.get_mut(id as usize).ok_or_else(|| Error::InvalidArgument {
            op: OP,
            reason: format!("suppressed token {id} is outside the vocabulary of {vocab}"),
        })?;
        *slot = SUPPRESSED_LOGIT;
    }
    if bias.iter().all(|&b| b != 0.0) {
        let reason = format!("all {vocab} tokens are suppressed: none is left to sample");
        return Err(Error::InvalidArgument { op: OP, reason });
    }
    Ok(Some(g.constant("sample.suppressed", &[vocab], bias)?))
}

/// Whether any op of `g` reads `t` (an input the model's forward may
/// leave unread: the GPT's position ids, a model without attention's
/// starts).
fn is_read(g: &Graph, t: Tensor) -> bool {
    g.nodes().iter().any(|n| n.inputs.contains(&t))
}

/// The prompt lengths a prefill pass is built for: powers of two from 8
/// below the chunk (at most the context), then the chunk. A prompt runs in
/// the shortest that holds it, so it costs at most twice its length (at
/// least 8 positions), and a longer one in chunks of the longest.
fn prefill_lengths(chunk: usize) -> Vec<usize> {
    let mut lengths: Vec<usize> = std::iter::successors(Some(8usize), |&n| n.checked_mul(2))
        .take_while(|&n| n < chunk)
        .collect();
    lengths.push(chunk);
    lengths
}

/// Checks that a model of `config` with caches for `sequences` sequences
/// can fit the adapter, from the sizes alone: its parameters (one buffer)
/// and its KV caches against the buffer limit and the adapter's memory.
/// Run it before reading a model's weights from disk, so a model too large
/// for the adapter is refused before gigabytes are read; [`Generator::new`]
/// checks the whole plan, activations included, before allocating.
pub fn check_fits(kernels: &Kernels, config: &dyn LmConfig, sequences: usize) -> Result<()> {
    check_fits_with_dtype(kernels, config, sequences, WeightDtype::F32)
}

/// [`check_fits`] for a generator whose weights are stored as `dtype`
/// would be on this adapter ([`WeightDtype::on`]): in f16, 2 bytes for
/// each of its [`crate::nn::LmSizes::f16_weight_values`].
pub fn check_fits_with_dtype(
    kernels: &Kernels,
    config: &dyn LmConfig,
    sequences: usize,
    dtype: WeightDtype,
) -> Result<()> {
    check_fits_with_options(
        kernels,
        config,
        &GeneratorOptions {
            sequences,
            dtype,
            ..GeneratorOptions::default()
        },
    )
}

/// [`check_fits`] for a generator built with `options` (its quantized
/// matrices aside: they are read from the file later), its caches sized by
/// their context and, with [`PrefillMode::OneSlot`], one sequence's more.
pub fn check_fits_with_options(kernels: &Kernels, config: &dyn LmConfig, options: &GeneratorOptions) -> Result<()> {
    check_fits_stored(kernels, config, options, (0, 0))
}

/// [`check_fits_with_options`] for a model whose matrices of `quantized.0`
/// values stay block-quantized in `quantized.1` bytes (a GGUF file's, as
/// [`crate::io::gguf_model::GgufModel::quantized_storage`] counts them):
/// SmolLM2's parameters take 98 MB so, not the 538 MB of f32.
pub fn check_fits_stored(
    kernels: &Kernels,
    config: &dyn LmConfig,
    options: &GeneratorOptions,
    quantized: (u64, u64),
) -> Result<()> {
    const BYTES: u64 = 4;
    let sizes = config.lm_sizes();
    let context = options.context_for(sizes.context)?;
    let sequences = options.sequences + usize::from(options.prefill == PrefillMode::OneSlot);
    let halved = match options.dtype.on(kernels) {
        WeightDtype::F32 => 0,
        WeightDtype::F16 => sizes.f16_weight_values.saturating_sub(quantized.0),
    };
    let parameters = sizes
        .parameters
        .saturating_sub(quantized.0)
        .saturating_mul(BYTES)
        .saturating_sub(halved * 2)
        .saturating_add(quantized.1);
    // Keys and values per layer, [sequences, kv_heads, context, head_dim] each.
    let one_cache = (sequences as u64)
        .saturating_mul(context as u64)
        .saturating_mul(sizes.cache_width)
        .saturating_mul(BYTES);
    let caches = one_cache.saturating_mul(2 * sizes.cached_layers);
    kernels.check_allocation(
        "Generator",
        &[("parameters", parameters, parameters), ("KV caches", caches, one_cache)],
    )
}

/// A generator's graph before its executor: every pass's inputs and
/// outputs.
struct GraphParts {
    g: Graph,
    prefill: Vec<PrefillPass>,
    prefill_batch: usize,
    prefill_starts: Option<Tensor>,
    prefill_sampler: SamplerInputs,
    staging: Vec<(Tensor, Tensor)>,
    decode: DecodePass,
    sampler: SamplerInputs,
    smaller_decodes: Vec<(DecodePass, SamplerInputs)>,
    /// The nodes each prefill pass added, by index (the first pass's
    /// include the parameters and caches it declared).
    prefill_nodes: Vec<std::ops::Range<usize>>,
    /// The adapter inputs a model carrying many adapters declared, by
    /// their sequences, and its adapters ([`ForwardContext::adapter_rows`]).
    adapter_rows: Vec<(usize, Tensor)>,
    adapters: usize,
}

impl GraphParts {
    /// The graph of a generator of `model` with caches of `context`
    /// positions and prefill passes of up to `chunk` rows.
    fn build(
        model: &dyn CausalLm,
        options: &GeneratorOptions,
        dtype: WeightDtype,
        context: usize,
        chunk: usize,
    ) -> Result<Self> {
        let sequences = options.sequences;
        let mut g = Graph::new();
        let suppress = suppression(&mut g, &options.suppressed_tokens, model.vocab_size())?;
        let mut cx = ForwardContext::new(dtype, context).with_quantized(options.quantized.clone());
        let sampler = SamplerInputs {
            draws: g.input("sample.draws", &[sequences, 3])?,
            top_k: g.ids("sample.top_k", &[sequences])?,
        };
        let one_slot = options.prefill == PrefillMode::OneSlot;
        let prefill_batch = if one_slot { 1 } else { sequences };
        let prefill_sampler = if one_slot {
            // The one-slot passes write caches of their own, copied into
            // the slot's afterwards (`Generator::copy_slot`).
            cx.set_cache_set(STAGING);
            SamplerInputs {
                draws: g.input("slot.sample.draws", &[1, 3])?,
                top_k: g.ids("slot.sample.top_k", &[1])?,
            }
        } else {
            sampler
        };
        // Row t of sequence s is position starts[s] + t: a prompt starts at
        // 0, a continuation where the cache ends (written before each run).
        let prefill_starts = g.ids("prefill.starts", &[prefill_batch])?;
        let mut prefill = Vec::new();
        let mut prefill_nodes = Vec::new();
        for rows in prefill_lengths(chunk) {
            let first = g.nodes().len();
            let ids = g.ids(&format!("prefill{rows}.idx"), &[prefill_batch, rows])?;
            let positions = g.ids(&format!("prefill{rows}.positions"), &[prefill_batch, rows])?;
            let last = g.ids(&format!("prefill{rows}.last"), &[prefill_batch])?;
            let pass = CachePass {
                starts: prefill_starts,
                positions,
            };
            let (logits, tokens) = lm_pass(&mut g, &mut cx, model, ids, pass, Some(last), prefill_sampler, suppress)?;
            prefill.push(PrefillPass {
                rows,
                ids,
                last,
                positions: Some(positions),
                logits,
                tokens,
            });
            prefill_nodes.push(first..g.nodes().len());
        }
        cx.set_cache_set("");
        let ids = g.ids("decode.idx", &[sequences, 1])?;
        let positions = g.ids("decode.positions", &[sequences])?;
        let pass = CachePass {
            starts: positions,
            positions: g.reshape(positions, &[sequences, 1])?,
        };
        let (logits, tokens) = lm_pass(&mut g, &mut cx, model, ids, pass, None, sampler, suppress)?;
        let decode = DecodePass {
            ids,
            positions,
            logits,
            tokens,
        };
        // After the S-slot pass declared the caches: these read their
        // first slots.
        let mut smaller_decodes = Vec::new();
        for rows in
            std::iter::successors(Some(1usize), |&n| n.checked_mul(2)).take_while(|&n| one_slot && n < sequences)
        {
            let sampler = SamplerInputs {
                draws: g.input(&format!("decode{rows}.sample.draws"), &[rows, 3])?,
                top_k: g.ids(&format!("decode{rows}.sample.top_k"), &[rows])?,
            };
            let ids = g.ids(&format!("decode{rows}.idx"), &[rows, 1])?;
            let positions = g.ids(&format!("decode{rows}.positions"), &[rows])?;
            let pass = CachePass {
                starts: positions,
                positions: g.reshape(positions, &[rows, 1])?,
            };
            let (logits, tokens) = lm_pass(&mut g, &mut cx, model, ids, pass, None, sampler, suppress)?;
            smaller_decodes.push((
                DecodePass {
                    ids,
                    positions,
                    logits,
                    tokens,
                },
                sampler,
            ));
        }
        for pass in &mut prefill {
            pass.positions = pass.positions.filter(|&t| is_read(&g, t));
        }
        let prefill_starts = Some(prefill_starts).filter(|&t| is_read(&g, t));
        let staging = if one_slot { staging_pairs(&g)? } else { Vec::new() };
        Ok(GraphParts {
            g,
            prefill,
            prefill_batch,
            prefill_starts,
            prefill_sampler,
            staging,
            decode,
            sampler,
            smaller_decodes,
            prefill_nodes,
            adapter_rows: cx.adapter_rows().to_vec(),
            adapters: cx.adapters(),
        })
    }

    /// The most rows a prefill pass may have with each of its activations
    /// within `limit` bytes, from how each grows between the first two
    /// passes (the same ops at two lengths): None where there are not two
    /// passes to compare, or their ops differ, or nothing grows.
    fn rows_within(&self, limit: u64) -> Option<usize> {
        let [first, second, ..] = self.prefill.as_slice() else {
            return None;
        };
        let bytes = |range: &std::ops::Range<usize>| -> Vec<u64> {
            self.g.nodes()[range.clone()]
                .iter()
                .filter(|n| !matches!(n.op, crate::graph::Op::Source(_)))
                .map(|n| 4 * n.shape.iter().product::<usize>() as u64)
                .collect()
        };
        let (short, long) = (bytes(&self.prefill_nodes[0]), bytes(&self.prefill_nodes[1]));
        if short.len() != long.len() {
            return None;
        }
        let added_rows = (second.rows - first.rows) as u64;
        short
            .iter()
            .zip(&long)
            .filter(|(a, b)| b > a)
            .map(|(&a, &b)| {
                let per_row = (b - a).div_ceil(added_rows);
                let fixed = a.saturating_sub(per_row * first.rows as u64);
                (limit.saturating_sub(fixed) / per_row) as usize
            })
            .min()
    }
}

/// The positions a generator built with `options` keeps in its caches:
/// its context (the model's when None) where the caches fit the adapter's
/// memory and buffer size beside the model, as [`check_fits_with_options`]
/// counts them, else the most that do — for a caller that would rather
/// hold a shorter context than fail (Gemma 3's 32,768 positions are 1.2
/// GB of keys and values). An error, the check's own, when not even
/// `at_least` positions fit.
pub fn context_that_fits(
    kernels: &Kernels,
    config: &dyn LmConfig,
    options: &GeneratorOptions,
    at_least: usize,
) -> Result<usize> {
    context_that_fits_stored(kernels, config, options, at_least, (0, 0))
}

/// [`context_that_fits`] for a model whose matrices of `quantized.0` values
/// stay block-quantized in `quantized.1` bytes, as [`check_fits_stored`]
/// counts them.
pub fn context_that_fits_stored(
    kernels: &Kernels,
    config: &dyn LmConfig,
    options: &GeneratorOptions,
    at_least: usize,
    quantized: (u64, u64),
) -> Result<usize> {
    let wanted = options.context_for(config.lm_sizes().context)?;
    let fits = |context: usize| {
        check_fits_stored(
            kernels,
            config,
            &GeneratorOptions {
                context: Some(context),
                ..options.clone()
            },
            quantized,
        )
    };
    if fits(wanted).is_ok() {
        return Ok(wanted);
    }
    let mut low = at_least.clamp(1, wanted);
    fits(low)?;
    // The largest that fits, by halving the range between one that does
    // (low) and one that does not (high).
    let mut high = wanted;
    while high - low > 1 {
        let middle = low + (high - low) / 2;
        if fits(middle).is_ok() {
            low = middle;
        } else {
            high = middle;
        }
    }
    Ok(low)
}

impl Generator {
    /// Builds the passes for `sequences` sequences and allocates
    /// everything once: parameters (the model's current weights), caches,
    /// activations, dispatches.
    pub fn new(kernels: Arc<Kernels>, model: &dyn CausalLm, sequences: usize) -> Result<Self> {
        Self::new_with_dtype(kernels, model, sequences, WeightDtype::F32)
    }

    /// [`Generator::new`] with the weights stored as `dtype`: f16 where the
    /// adapter has SHADER_F16, else f32 ([`Generator::dtype`] tells which).
    pub fn new_with_dtype(
        kernels: Arc<Kernels>,
        model: &dyn CausalLm,
        sequences: usize,
        dtype: WeightDtype,
    ) -> Result<Self> {
        Self::new_with_weights(kernels, model, sequences, dtype, Arc::default())
    }

    /// [`Generator::new_with_dtype`] with the matrices `quantized` names
    /// stored block-quantized, as its bytes (a GGUF file's) hold them, in
    /// place of the model's values for them (see
    /// [`ForwardContext::with_quantized`]).
    pub fn new_with_weights(
        kernels: Arc<Kernels>,
        model: &dyn CausalLm,
        sequences: usize,
        dtype: WeightDtype,
        quantized: Arc<QuantizedWeights>,
    ) -> Result<Self> {
        Self::with_options(
            kernels,
            model,
            &GeneratorOptions {
                sequences,
                dtype,
                quantized,
                ..GeneratorOptions::default()
            },
        )
    }

    /// A generator built as `options` say: its sequences (slots), the
    /// positions its caches hold, its weights, and whether it prefills all
    /// sequences together or one slot at a time.
    pub fn with_options(kernels: Arc<Kernels>, model: &dyn CausalLm, options: &GeneratorOptions) -> Result<Self> {
        const OP: &str = "Generator::new";
        let dtype = options.dtype.on(&kernels);
        if options.sequences == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "sequences must be at least 1".into(),
            });
        }
        if options.prefill_chunk == Some(0) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "a prefill chunk must hold at least 1 row".into(),
            });
        }
        let context = options.context_for(model.context_len())?;
        let chunk = options.prefill_chunk.unwrap_or(PREFILL_CHUNK).min(context);
        let mut built = GraphParts::build(model, options, dtype, context, chunk)?;
        // A model whose widest activation of `chunk` rows would not fit one
        // storage binding: shorter passes (read from how the first two
        // passes' activations grow with their rows).
        if options.prefill_chunk.is_none() {
            if let Some(fit) = built.rows_within(kernels.binding_limit()).filter(|&fit| fit < chunk) {
                built = GraphParts::build(model, options, dtype, context, fit.max(1))?;
            }
        }
        let GraphParts {
            g,
            prefill,
            prefill_batch,
            prefill_starts,
            prefill_sampler,
            staging,
            decode,
            sampler,
            smaller_decodes,
            adapter_rows,
            adapters,
            ..
        } = built;
        let mut outputs: Vec<Tensor> = prefill.iter().flat_map(|p| [p.logits, p.tokens]).collect();
        outputs.extend([decode.logits, decode.tokens]);
        outputs.extend(smaller_decodes.iter().flat_map(|(p, _)| [p.logits, p.tokens]));
        let exec = Executor::new(kernels, g, &outputs, None, None)?;
        let mut declared = exec.parameters_shapes();
        let mut expected = model.named_parameters();
        declared.sort();
        expected.sort();
        if declared != expected {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("the generation graph's parameters {declared:?} are not the model's {expected:?}"),
            });
        }
        Ok(Generator {
            exec,
            model: model.describe(),
            vocab_size: model.vocab_size(),
            context,
            sequences: options.sequences,
            dtype,
            prefill,
            prefill_batch,
            prefill_starts,
            prefill_sampler,
            staging,
            decode,
            sampler,
            smaller_decodes,
            cached: vec![Vec::new(); options.sequences],
            adapter_rows,
            adapters,
            slot_adapters: vec![NO_ADAPTER; options.sequences],
        })
    }

    /// The adapters the model carries ([`crate::nn::MultiLora`]; 0 for
    /// any other model).
    pub fn adapters(&self) -> usize {
        self.adapters
    }

    /// Which adapter slot `slot` applies from its next run on: `Some(i)`,
    /// adapter i of the model's [`crate::nn::MultiLora`], or None, the
    /// base. Every slot starts with the base; a slot keeps its adapter
    /// until this changes it ([`Generator::move_slot`] moves it too). The
    /// rows of one step may each apply a different adapter.
    pub fn set_slot_adapter(&mut self, slot: usize, adapter: Option<usize>) -> Result<()> {
        const OP: &str = "Generator::set_slot_adapter";
        self.slot_tokens(OP, slot)?;
        self.slot_adapters[slot] = match adapter {
            None => NO_ADAPTER,
            Some(a) if a < self.adapters => a as u32,
            Some(a) => {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!(
                        "adapter {a} of a model carrying {} (a model with many adapters is a MultiLora)",
                        self.adapters
                    ),
                })
            }
        };
        Ok(())
    }

    /// The adapter slot `slot` applies (None: the base, or no such slot).
    pub fn slot_adapter(&self, slot: usize) -> Option<usize> {
        self.slot_adapters
            .get(slot)
            .filter(|&&a| a != NO_ADAPTER)
            .map(|&a| a as usize)
    }

    /// Writes the adapters of `slots`, in order, into the adapter input of
    /// a pass over that many sequences (none for a model without many
    /// adapters).
    fn set_adapter_rows(&self, slots: impl Iterator<Item = usize>) -> Result<()> {
        if self.adapter_rows.is_empty() {
            return Ok(());
        }
        let rows: Vec<u32> = slots.map(|s| self.slot_adapters[s]).collect();
        match self.adapter_rows.iter().find(|(n, _)| *n == rows.len()) {
            Some(&(_, t)) => self.exec.set_labels(t, &rows),
            None => Err(Error::Internal {
                op: "Generator",
                reason: format!("no adapter input for a pass over {} sequences", rows.len()),
            }),
        }
    }

    /// How the weights are stored: what was asked for, except f32 where
    /// f16 was asked for on an adapter without SHADER_F16.
    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// The model's [`crate::nn::Module::describe`].
    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Positions each sequence's cache holds (the model's context unless
    /// [`GeneratorOptions::context`] says fewer).
    pub fn context_len(&self) -> usize {
        self.context
    }

    /// The most rows one prefill pass runs: a longer prompt is prefilled
    /// in chunks of this many ([`GeneratorOptions::prefill_chunk`]).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill.last().map_or(1, |p| p.rows)
    }

    /// Sequences (slots) the caches hold.
    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// Whether prompts run one slot at a time ([`PrefillMode::OneSlot`]).
    pub fn prefills_one_slot(&self) -> bool {
        !self.staging.is_empty()
    }

    /// The tokens whose keys and values `sequence`'s cache holds (its next
    /// position is their count).
    pub fn cached_tokens(&self, sequence: usize) -> Option<&[u32]> {
        self.cached.get(sequence).map(Vec::as_slice)
    }

    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// A decode step's dispatches at the current positions, each submitted
    /// alone and waited for ([`crate::graph::DispatchTime`]): where a
    /// token's time goes (`wgrad bench --profile`). The caches get the
    /// step's keys and values as by [`Generator::decode`] with `tokens`,
    /// but the positions do not advance.
    pub fn profile_decode(&mut self, tokens: &[u32]) -> Result<crate::graph::DispatchTimes> {
        self.set_decode("Generator::profile_decode", tokens)?;
        self.exec.profile_run(&[self.decode.tokens])
    }

    /// Empties every sequence's cache (zeroes it on the GPU).
    pub fn reset(&mut self) -> Result<()> {
        self.exec.clear_caches()?;
        self.cached.iter_mut().for_each(Vec::clear);
        Ok(())
    }

    fn check_ids(&self, op: &'static str, ids: &[u32]) -> Result<()> {
        check_token_ids(op, ids, self.vocab_size)
    }

    /// Checks `tokens`, one non-empty chunk per row of the prefill passes,
    /// each to follow `held[s]` (the tokens its cache holds): their ids,
    /// and that each fits the context after what its cache holds.
    fn check_rows(&self, op: &'static str, held: &[Vec<u32>], tokens: &[&[u32]]) -> Result<()> {
        let context = self.context;
        if tokens.len() != self.prefill_batch || held.len() != tokens.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("got {} prompts for {} sequences", tokens.len(), self.prefill_batch),
            });
        }
        for (s, (chunk, history)) in tokens.iter().zip(held).enumerate() {
            if chunk.is_empty() {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("prompt {s} is empty; give at least one token"),
                });
            }
            let start = history.len();
            if start + chunk.len() > context {
                let held = if start > 0 {
                    format!(" after the {start} its cache holds")
                } else {
                    String::new()
                };
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "prompt {s} has {} tokens{held}, more than the model's context of {context}",
                        chunk.len()
                    ),
                });
            }
            self.check_ids(op, chunk)?;
        }
        Ok(())
    }

    /// Feeds `tokens`, one non-empty chunk per row of the prefill passes,
    /// after `held` (the tokens each row's cache holds, in position
    /// order) through the prefill passes, at most the longest pass's rows
    /// of each at a time (chunked prefill: a long prompt's activations are
    /// those of one chunk, its keys and values all in the caches). Every
    /// pass but the last is run (submitted, not waited for); the last is
    /// written and its index returned, with the first position any pass
    /// writes. `held` ends as the caches will hold after the last pass.
    fn feed_rows(&mut self, op: &'static str, held: &mut [Vec<u32>], tokens: &[&[u32]]) -> Result<(usize, usize)> {
        self.check_rows(op, held, tokens)?;
        let chunk = self.prefill_chunk();
        let mut fed = vec![0; tokens.len()];
        let mut first_written = usize::MAX;
        loop {
            let mut pieces = Vec::with_capacity(tokens.len());
            let mut starts = Vec::with_capacity(tokens.len());
            for ((chunk_tokens, history), fed) in tokens.iter().zip(held.iter_mut()).zip(&mut fed) {
                let rest = &chunk_tokens[*fed..];
                if rest.is_empty() {
                    // Done before the others: its last token again at its
                    // position (the same key and value), so that its row
                    // of the last pass's logits follows it.
                    let at = history.len() - 1;
                    pieces.push(history[at..].to_vec());
                    starts.push(at);
                } else {
                    let n = rest.len().min(chunk);
                    pieces.push(rest[..n].to_vec());
                    starts.push(history.len());
                    history.extend_from_slice(&rest[..n]);
                    *fed += n;
                }
            }
            let (pass, from) = self.write_rows(op, &pieces, &starts, held)?;
            first_written = first_written.min(from);
            if fed.iter().zip(tokens).all(|(&n, t)| n == t.len()) {
                return Ok((pass, first_written));
            }
            let logits = self.prefill[pass].logits;
            self.exec.run(&[logits])?;
        }
    }

    /// Writes `pieces` (one per row, each at most the longest pass's rows,
    /// to start at `starts[s]` after `held[s][..starts[s]]`) into the
    /// shortest prefill pass that holds them: its ids, last rows, starts
    /// and positions. Returns the pass's index and its first position. A
    /// pass runs all its rows, so a row whose padding would pass the
    /// context's end starts earlier, running the cached tokens before it
    /// again (their keys and values are written again, the same).
    fn write_rows(
        &self,
        op: &'static str,
        pieces: &[Vec<u32>],
        starts: &[usize],
        held: &[Vec<u32>],
    ) -> Result<(usize, usize)> {
        let longest = pieces.iter().map(Vec::len).max().unwrap_or(1);
        let index = self
            .prefill
            .iter()
            .position(|p| p.rows >= longest)
            .ok_or_else(|| Error::Internal {
                op,
                reason: format!("no prefill pass holds {longest} positions"),
            })?;
        let pass = &self.prefill[index];
        let rows = pass.rows;
        let mut ids = vec![0u32; self.prefill_batch * rows];
        let mut last = Vec::with_capacity(self.prefill_batch);
        let mut firsts = Vec::with_capacity(self.prefill_batch);
        for (s, (piece, &start)) in pieces.iter().zip(starts).enumerate() {
            let first = start.min(self.context.saturating_sub(rows));
            let again = held[s].get(first..start).ok_or_else(|| Error::Internal {
                op,
                reason: format!("row {s} starts at {start} after {} cached tokens", held[s].len()),
            })?;
            let row = &mut ids[s * rows..(s + 1) * rows];
            row[..again.len()].copy_from_slice(again);
            row[again.len()..again.len() + piece.len()].copy_from_slice(piece);
            last.push((s * rows + again.len() + piece.len() - 1) as u32);
            firsts.push(first);
        }
        self.exec.set_labels(pass.ids, &ids)?;
        self.exec.set_labels(pass.last, &last)?;
        if let Some(t) = self.prefill_starts {
            self.exec
                .set_labels(t, &firsts.iter().map(|&p| p as u32).collect::<Vec<_>>())?;
        }
        if let Some(t) = pass.positions {
            let positions: Vec<u32> = firsts.iter().flat_map(|&p| (p..p + rows).map(|q| q as u32)).collect();
            self.exec.set_labels(t, &positions)?;
        }
        Ok((index, firsts.iter().copied().min().unwrap_or(0)))
    }

    /// Checks `tokens` (one per sequence, each with room in its cache) and
    /// writes them and their positions into the decode pass.
    fn set_decode(&self, op: &'static str, tokens: &[u32]) -> Result<()> {
        let context = self.context;
        if tokens.len() != self.sequences {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "got {} tokens for {} sequences; give one per sequence",
                    tokens.len(),
                    self.sequences
                ),
            });
        }
        self.check_ids(op, tokens)?;
        if let Some(s) = self.cached.iter().position(|c| c.len() >= context) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "sequence {s} has filled its context of {context} positions; prefill it again with its last tokens"
                ),
            });
        }
        let positions: Vec<u32> = self.cached.iter().map(|c| c.len() as u32).collect();
        self.set_adapter_rows(0..self.sequences)?;
        self.exec.set_labels(self.decode.ids, tokens)?;
        self.exec.set_labels(self.decode.positions, &positions)
    }

    /// Writes the sampler's inputs for the next step: `sampling`'s
    /// settings for every sequence, and one uniform draw of `rng` per
    /// sequence, in sequence order (as [`Sampling::sample`] draws).
    fn set_sampling(&self, sampling: &Sampling, rng: &mut ChaCha8Rng) -> Result<()> {
        let rows: Vec<_> = (0..self.sequences)
            .map(|_| sampling.row_settings(rng, self.vocab_size))
            .collect();
        self.set_sampler_rows(self.sampler, &rows)
    }

    /// Writes each row's (u, temperature, top_p) and k into `sampler`.
    fn set_sampler_rows(&self, sampler: SamplerInputs, rows: &[([f32; 3], u32)]) -> Result<()> {
        let draws: Vec<f32> = rows.iter().flat_map(|r| r.0).collect();
        let top_k: Vec<u32> = rows.iter().map(|r| r.1).collect();
        self.exec.set_input(sampler.draws, &draws)?;
        self.exec.set_labels(sampler.top_k, &top_k)
    }

    /// The tokens in the sampler's output `picks` [S, 2], or the error
    /// [`Sampling::sample`] gives for a logit that is not finite (its value
    /// read back from `logits`, the one logit that comes back).
    fn sampled_tokens(&self, op: &'static str, picks: &[u32], logits: Tensor) -> Result<Vec<u32>> {
        let many = picks.len() > 2;
        picks
            .chunks_exact(2)
            .enumerate()
            .map(|(s, pick)| self.sampled_token(op, s, many, pick, logits))
            .collect()
    }

    /// Row `s`'s token of the sampler's output, `pick` = (token, first
    /// non-finite logit); `many` names the sequence in the error.
    fn sampled_token(&self, op: &'static str, s: usize, many: bool, pick: &[u32], logits: Tensor) -> Result<u32> {
        let vocab = self.vocab_size;
        let (token, bad) = (pick[0], pick[1]);
        if bad != crate::ops::NO_TOKEN {
            let all = self.exec.tensor_view(logits)?;
            let at = s * vocab + bad as usize;
            let one = View {
                offset: all.offset + at as u64 * 4,
                len: 1,
                ..all
            };
            let value = if at < all.len {
                self.exec.kernels().read::<f32>(one)?.first().map(f32::to_string)
            } else {
                None
            };
            let value = value.unwrap_or_else(|| "?".into());
            let sequence = if many {
                format!(" in sequence {s}")
            } else {
                String::new()
            };
            return Err(Error::InvalidArgument {
                op,
                reason: format!("logit {value} of token {bad}{sequence} is not finite"),
            });
        }
        if token as usize >= vocab {
            return Err(Error::Internal {
                op,
                reason: format!("the GPU sampler picked token {token}, outside the vocabulary of {vocab}"),
            });
        }
        Ok(token)
    }

    /// Refuses an all-sequence prefill on a generator built to prefill one
    /// slot at a time.
    fn all_sequences(&self, op: &'static str) -> Result<()> {
        if self.staging.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            op,
            reason: "this generator prefills one slot at a time (PrefillMode::OneSlot): use prefill_slot".into(),
        })
    }

    /// Runs each sequence's prompt from position 0 in one submission,
    /// replacing what its cache held; returns the logits after each
    /// prompt's last token, [sequences, vocab_size], all read back (to
    /// pick the next token, [`Generator::prefill_and_sample`] reads back
    /// only the token).
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<Vec<f32>> {
        crate::device::wait("Generator::prefill", self.prefill_async(prompts))
    }

    /// [`Generator::prefill`], awaited.
    pub async fn prefill_async(&mut self, prompts: &[&[u32]]) -> Result<Vec<f32>> {
        self.all_sequences("Generator::prefill")?;
        let (pass, held) = self.feed_prompts("Generator::prefill", prompts)?;
        let logits = self.prefill[pass].logits;
        let values = self.exec.run_and_read_async(&[logits], logits).await?;
        self.cached = held;
        Ok(values)
    }

    /// [`Generator::feed_rows`] of `prompts` from position 0, replacing
    /// what each cache held: the last pass to run, and what the caches
    /// will hold after it.
    fn feed_prompts(&mut self, op: &'static str, prompts: &[&[u32]]) -> Result<(usize, Vec<Vec<u32>>)> {
        self.set_adapter_rows(0..prompts.len())?;
        let mut held = vec![Vec::new(); prompts.len()];
        self.check_rows(op, &held, prompts)?;
        // The caches are being replaced: a failure between chunks leaves
        // them holding nothing that counts.
        self.cached.iter_mut().for_each(Vec::clear);
        let (pass, _) = self.feed_rows(op, &mut held, prompts)?;
        Ok((pass, held))
    }

    /// [`Generator::feed_rows`] of `tokens` after what each cache holds:
    /// the last pass to run, and what the caches will hold after it.
    fn feed_continuation(&mut self, op: &'static str, tokens: &[&[u32]]) -> Result<(usize, Vec<Vec<u32>>)> {
        self.set_adapter_rows(0..tokens.len())?;
        let mut held = self.cached.clone();
        let (pass, _) = self.feed_rows(op, &mut held, tokens)?;
        Ok((pass, held))
    }

    /// [`Generator::prefill`] that also picks each sequence's next token
    /// by `sampling` on the GPU, in the same submission, with one draw of
    /// `rng` per sequence: only the tokens come back, one per sequence. The
    /// tokens are those [`Sampling::sample`] picks from the logits with
    /// the same `rng`, up to f32 rounding at the boundaries between
    /// candidates (see `Kernels::sample_rows`).
    pub fn prefill_and_sample(
        &mut self,
        prompts: &[&[u32]],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<u32>> {
        crate::device::wait(
            "Generator::prefill_and_sample",
            self.prefill_and_sample_async(prompts, sampling, rng),
        )
    }

    /// [`Generator::prefill_and_sample`], awaited.
    pub async fn prefill_and_sample_async(
        &mut self,
        prompts: &[&[u32]],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<u32>> {
        const OP: &str = "Generator::prefill_and_sample";
        self.all_sequences(OP)?;
        sampling.check()?;
        let (pass, held) = self.feed_prompts(OP, prompts)?;
        self.set_sampling(sampling, rng)?;
        let PrefillPass { logits, tokens, .. } = self.prefill[pass];
        let picks = self.exec.run_and_read_u32_async(&[tokens], tokens).await?;
        self.cached = held;
        self.sampled_tokens(OP, &picks, logits)
    }

    /// Feeds `tokens`, one chunk per sequence, after what each sequence's
    /// cache holds, in one submission: a prefill starting at the cache's
    /// length, so a conversation's next turn costs its own tokens, not the
    /// whole history's. Returns the logits after each chunk's last token,
    /// [sequences, vocab_size] (the same as a prefill of the cache's
    /// tokens and the chunk from 0, up to rounding). The cache and the
    /// chunk together must fit the context.
    pub fn extend(&mut self, tokens: &[&[u32]]) -> Result<Vec<f32>> {
        crate::device::wait("Generator::extend", self.extend_async(tokens))
    }

    /// [`Generator::extend`], awaited.
    pub async fn extend_async(&mut self, tokens: &[&[u32]]) -> Result<Vec<f32>> {
        self.all_sequences("Generator::extend")?;
        let (pass, held) = self.feed_continuation("Generator::extend", tokens)?;
        let logits = self.prefill[pass].logits;
        let values = self.exec.run_and_read_async(&[logits], logits).await?;
        self.cached = held;
        Ok(values)
    }

    /// [`Generator::extend`] picking each sequence's next token on the GPU,
    /// as [`Generator::prefill_and_sample`] does.
    pub fn extend_and_sample(
        &mut self,
        tokens: &[&[u32]],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<u32>> {
        crate::device::wait(
            "Generator::extend_and_sample",
            self.extend_and_sample_async(tokens, sampling, rng),
        )
    }

    /// [`Generator::extend_and_sample`], awaited.
    pub async fn extend_and_sample_async(
        &mut self,
        tokens: &[&[u32]],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<u32>> {
        const OP: &str = "Generator::extend_and_sample";
        self.all_sequences(OP)?;
        sampling.check()?;
        let (pass, held) = self.feed_continuation(OP, tokens)?;
        self.set_sampling(sampling, rng)?;
        let PrefillPass {
            logits, tokens: picks, ..
        } = self.prefill[pass];
        let picks = self.exec.run_and_read_u32_async(&[picks], picks).await?;
        self.cached = held;
        self.sampled_tokens(OP, &picks, logits)
    }

    /// Feeds `tokens` to slot `slot` after what its cache holds (all of
    /// them: truncate it to 0 first for a new prompt, as
    /// [`Generator::prefill_slot`] does) and picks its next token by
    /// `sampling` with one draw of `rng`, while every other slot keeps its
    /// cache: continuous batching's join. Needs [`PrefillMode::OneSlot`].
    /// The slot's history (if any) is copied into the staging caches, the
    /// chunk runs there in one submission, and the positions it wrote are
    /// copied back into the slot.
    pub fn extend_slot(
        &mut self,
        slot: usize,
        tokens: &[u32],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<u32> {
        const OP: &str = "Generator::extend_slot";
        sampling.check()?;
        if self.staging.is_empty() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "this generator prefills all sequences together: build it with PrefillMode::OneSlot".into(),
            });
        }
        let mut held = vec![self.slot_tokens(OP, slot)?.to_vec()];
        self.check_rows(OP, &held, &[tokens])?;
        // The slot's history into the staging caches, then the chunks
        // after it there.
        self.copy_slot(slot, 0, held[0].len(), true)?;
        self.set_adapter_rows(std::iter::once(slot))?;
        let (pass, from) = self.feed_rows(OP, &mut held, &[tokens])?;
        self.set_sampler_rows(self.prefill_sampler, &[sampling.row_settings(rng, self.vocab_size)])?;
        let PrefillPass {
            logits, tokens: picks, ..
        } = self.prefill[pass];
        let picks = self.exec.run_and_read_u32(&[picks], picks)?;
        let after = held.pop().unwrap_or_default();
        self.copy_slot(slot, from, after.len(), false)?;
        self.cached[slot] = after;
        self.sampled_token(OP, 0, false, &picks, logits)
    }

    /// Runs `prompt` in slot `slot` from position 0, replacing what its
    /// cache held, and picks its next token ([`Generator::extend_slot`]).
    pub fn prefill_slot(
        &mut self,
        slot: usize,
        prompt: &[u32],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<u32> {
        self.truncate(slot, 0)?;
        self.extend_slot(slot, prompt, sampling, rng)
    }

    /// `slot`'s cached tokens, or an error naming the slots there are.
    fn slot_tokens(&self, op: &'static str, slot: usize) -> Result<&[u32]> {
        let sequences = self.sequences;
        self.cached
            .get(slot)
            .map(Vec::as_slice)
            .ok_or_else(|| Error::InvalidArgument {
                op,
                reason: format!("slot {slot} of a generator of {sequences}"),
            })
    }

    /// Copies positions `from .. to` of `slot`'s keys and values into the
    /// staging caches (`to_staging`) or back, every layer and KV head, in
    /// one submission (queued after the last run, before the next).
    fn copy_slot(&self, slot: usize, from: usize, to: usize, to_staging: bool) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        const BYTES: u64 = 4;
        let graph = self.exec.graph();
        let mut copies = Vec::new();
        for &(main, staging) in &self.staging {
            let &[_, kv_heads, context, head_dim] = graph.shape_of(main).unwrap_or_default() else {
                return Err(Error::Internal {
                    op: "Generator::copy_slot",
                    reason: "a cache lost its shape [sequences, kv_heads, context, head_dim]".into(),
                });
            };
            let (main, staging) = (self.exec.tensor_view(main)?, self.exec.tensor_view(staging)?);
            let row = head_dim as u64 * BYTES;
            for h in 0..kv_heads {
                let main_at = main.offset + (((slot * kv_heads + h) * context + from) as u64) * row;
                let staging_at = staging.offset + ((h * context + from) as u64) * row;
                let (source, destination) = if to_staging {
                    ((main.buffer, main_at), (staging.buffer, staging_at))
                } else {
                    ((staging.buffer, staging_at), (main.buffer, main_at))
                };
                copies.push((source, destination, (to - from) as u64 * row));
            }
        }
        self.exec.kernels().submit_pass(
            "Generator::copy_slot",
            std::iter::empty(),
            |encoder| {
                for ((source, source_at), (destination, destination_at), bytes) in copies {
                    encoder.copy_buffer_to_buffer(source, source_at, destination, destination_at, bytes);
                }
            },
            |_| {},
        )
    }

    /// One decode step over the slots in one submission: slot s with
    /// `steps[s]` = Some feeds its token at its next position and picks
    /// the next by its own sampling and draws from its own stream (one
    /// draw per step), so each request samples as it would alone. The step
    /// computes the slots up to the highest stepping one (rounded up to a
    /// power of two, with [`PrefillMode::OneSlot`]; else every slot): a
    /// slot with None among them sits the step out, its row computed at
    /// its next position and forgotten (one whose cache is full cannot:
    /// free or truncate it). Returns each stepping slot's token, or its
    /// own error (a logit that is not finite) without failing the others'.
    pub fn decode_slots(&mut self, steps: &mut [Option<SlotStep<'_>>]) -> Result<Vec<Option<Result<u32>>>> {
        const OP: &str = "Generator::decode_slots";
        let (context, sequences) = (self.context, self.sequences);
        if steps.len() != sequences {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("got {} slots' steps for a generator of {sequences}", steps.len()),
            });
        }
        let needed = steps.iter().rposition(Option::is_some).map_or(0, |s| s + 1);
        if needed == 0 {
            return Ok(steps.iter().map(|_| None).collect());
        }
        let (pass, sampler) = self
            .smaller_decodes
            .iter()
            .map(|&(p, s)| (p, s))
            .find(|(p, _)| self.exec.graph().shape_of(p.positions).is_some_and(|s| s[0] >= needed))
            .unwrap_or((self.decode, self.sampler));
        let rows = self.exec.graph().shape_of(pass.positions).map_or(sequences, |s| s[0]);
        let mut ids = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        let mut draws = Vec::with_capacity(rows);
        for (s, step) in steps[..rows].iter_mut().enumerate() {
            let held = self.cached[s].len();
            if held >= context {
                let why = if step.is_some() {
                    "has filled its context"
                } else {
                    "sits out the step with a full context"
                };
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("slot {s} {why} of {context} positions; free it or truncate it"),
                });
            }
            positions.push(held as u32);
            match step {
                Some(step) => {
                    step.sampling.check()?;
                    ids.push(step.token);
                    draws.push(step.sampling.row_settings(step.rng, self.vocab_size));
                }
                // Greedy, so the row draws nothing.
                None => {
                    ids.push(0);
                    draws.push(([0.0, 0.0, 1.0], 1));
                }
            }
        }
        self.check_ids(OP, &ids)?;
        self.set_adapter_rows(0..rows)?;
        self.exec.set_labels(pass.ids, &ids)?;
        self.exec.set_labels(pass.positions, &positions)?;
        self.set_sampler_rows(sampler, &draws)?;
        let picks = self.exec.run_and_read_u32(&[pass.tokens], pass.tokens)?;
        let mut tokens: Vec<Option<Result<u32>>> = Vec::with_capacity(sequences);
        for (s, step) in steps.iter().enumerate() {
            tokens.push(step.as_ref().map(|step| {
                self.cached[s].push(step.token);
                self.sampled_token(OP, s, true, &picks[2 * s..2 * s + 2], pass.logits)
            }));
        }
        Ok(tokens)
    }

    /// Moves what slot `from` holds into slot `to` (which it replaces;
    /// `from` is left empty): a server keeps its running requests in the
    /// lowest slots, so its steps compute fewer rows. Needs
    /// [`PrefillMode::OneSlot`] (the move goes through the staging caches).
    pub fn move_slot(&mut self, from: usize, to: usize) -> Result<()> {
        const OP: &str = "Generator::move_slot";
        let held = self.slot_tokens(OP, from)?.len();
        self.slot_tokens(OP, to)?;
        if self.staging.is_empty() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "this generator prefills all sequences together: build it with PrefillMode::OneSlot".into(),
            });
        }
        if from == to {
            return Ok(());
        }
        self.copy_slot(from, 0, held, true)?;
        self.copy_slot(to, 0, held, false)?;
        self.cached[to] = std::mem::take(&mut self.cached[from]);
        self.slot_adapters[to] = std::mem::replace(&mut self.slot_adapters[from], NO_ADAPTER);
        Ok(())
    }

    /// Bytes of the key and value caches: (every slot's, the one-slot
    /// prefill's staging caches').
    pub fn cache_bytes(&self) -> (u64, u64) {
        let graph = self.exec.graph();
        let bytes = |t: Tensor| graph.shape_of(t).map_or(0, |s| s.iter().product::<usize>() as u64 * 4);
        let staging: u64 = self.staging.iter().map(|&(_, t)| bytes(t)).sum();
        let all: u64 = graph
            .nodes()
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op == SourceOp::Cache)
            .map(|(i, _)| bytes(Tensor(i)))
            .sum();
        (all - staging, staging)
    }

    /// Forgets all but the first `len` tokens of `sequence`'s cache (the
    /// positions past them are overwritten by what comes next): a
    /// conversation whose re-rendered history departs from what the cache
    /// holds keeps the common part.
    pub fn truncate(&mut self, sequence: usize, len: usize) -> Result<()> {
        let sequences = self.sequences;
        let cached = self.cached.get_mut(sequence).ok_or_else(|| Error::InvalidArgument {
            op: "Generator::truncate",
            reason: format!("sequence {sequence} of a generator of {sequences}"),
        })?;
        cached.truncate(len);
        Ok(())
    }

    /// Feeds one token per sequence at its next position, in one
    /// submission; returns the logits after it, [sequences, vocab_size],
    /// all read back ([`Generator::decode_and_sample`] reads back only the
    /// next tokens). A sequence whose cache is full (block_size tokens) is
    /// an error: prefill it again with its last tokens
    /// ([`Generator::generate`] does).
    pub fn decode(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        crate::device::wait("Generator::decode", self.decode_async(tokens))
    }

    /// [`Generator::decode`], awaited.
    pub async fn decode_async(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.set_decode("Generator::decode", tokens)?;
        let logits = self
            .exec
            .run_and_read_async(&[self.decode.logits], self.decode.logits)
            .await?;
        for (cached, &token) in self.cached.iter_mut().zip(tokens) {
            cached.push(token);
        }
        Ok(logits)
    }

    /// [`Generator::decode`] picking each sequence's next token on the GPU,
    /// as [`Generator::prefill_and_sample`] does.
    pub fn decode_and_sample(&mut self, tokens: &[u32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> Result<Vec<u32>> {
        crate::device::wait(
            "Generator::decode_and_sample",
            self.decode_and_sample_async(tokens, sampling, rng),
        )
    }

    /// [`Generator::decode_and_sample`], awaited.
    pub async fn decode_and_sample_async(
        &mut self,
        tokens: &[u32],
        sampling: &Sampling,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<u32>> {
        const OP: &str = "Generator::decode_and_sample";
        sampling.check()?;
        self.set_decode(OP, tokens)?;
        self.set_sampling(sampling, rng)?;
        let picks = self
            .exec
            .run_and_read_u32_async(&[self.decode.tokens], self.decode.tokens)
            .await?;
        for (cached, &token) in self.cached.iter_mut().zip(tokens) {
            cached.push(token);
        }
        self.sampled_tokens(OP, &picks, self.decode.logits)
    }

    /// Continues `prompt` by `max_new_tokens` tokens picked by `sampling`,
    /// passing each to `on_token` as soon as it is chosen (an error from
    /// it stops generation and is returned). Returns the new tokens, the
    /// prompt not included. Past the context the cache keeps the last
    /// block_size / 2 tokens (see the module documentation). Needs a
    /// generator of one sequence; [`Generator::generate_batch`] runs
    /// several.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampling: &Sampling,
        on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        crate::device::wait(
            "Generator::generate",
            self.generate_async(prompt, max_new_tokens, sampling, on_token),
        )
    }

    /// [`Generator::generate`], awaited: the page yields to the browser
    /// between tokens, so `on_token` can show each as it comes.
    pub async fn generate_async(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampling: &Sampling,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        const OP: &str = "Generator::generate";
        if self.sequences != 1 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "generates one sequence; this generator was built for {} (use generate_batch)",
                    self.sequences
                ),
            });
        }
        let mut new_tokens = self
            .generate_batch_async(&[prompt], max_new_tokens, sampling, |tokens| on_token(tokens[0]))
            .await?;
        Ok(new_tokens.pop().unwrap_or_default())
    }

    /// Continues each of `prompts`, one per sequence of this generator, by
    /// `max_new_tokens` tokens, all in the same steps: one prefill of every
    /// prompt, then one decode step per token that feeds every sequence's
    /// last token at its own position, each step one submission that reads
    /// back only the picks. `on_tokens` gets each step's tokens, one per
    /// sequence, as soon as they are chosen (an error from it stops
    /// generation and is returned). Returns each sequence's new tokens.
    ///
    /// The draws come from one ChaCha8 stream seeded with `sampling.seed`,
    /// one per sequence per step in sequence order, so one prompt gives
    /// what [`Generator::generate`] gives. When a sequence fills its
    /// context, every sequence is prefilled again with its last
    /// block_size / 2 tokens (all of them when it has fewer), as
    /// [`Generator::generate`] does for one: a sequence shorter than the
    /// longest may then lose context it would have kept alone.
    pub fn generate_batch(
        &mut self,
        prompts: &[&[u32]],
        max_new_tokens: usize,
        sampling: &Sampling,
        on_tokens: impl FnMut(&[u32]) -> Result<()>,
    ) -> Result<Vec<Vec<u32>>> {
        crate::device::wait(
            "Generator::generate_batch",
            self.generate_batch_async(prompts, max_new_tokens, sampling, on_tokens),
        )
    }

    /// [`Generator::generate_batch`], awaited.
    pub async fn generate_batch_async(
        &mut self,
        prompts: &[&[u32]],
        max_new_tokens: usize,
        sampling: &Sampling,
        mut on_tokens: impl FnMut(&[u32]) -> Result<()>,
    ) -> Result<Vec<Vec<u32>>> {
        const OP: &str = "Generator::generate_batch";
        if prompts.len() != self.sequences {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "got {} prompts for a generator of {} sequences",
                    prompts.len(),
                    self.sequences
                ),
            });
        }
        if max_new_tokens == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "max_new_tokens must be at least 1".into(),
            });
        }
        sampling.check()?;
        let context = self.context;
        let keep = (context / 2).max(1);
        let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
        // Each step picks its tokens on the GPU: the logits never come back.
        let mut tokens = self.prefill_and_sample_async(prompts, sampling, &mut rng).await?;
        let mut new_tokens = vec![Vec::with_capacity(max_new_tokens); self.sequences];
        loop {
            on_tokens(&tokens)?;
            for (sequence, &token) in new_tokens.iter_mut().zip(&tokens) {
                sequence.push(token);
            }
            if new_tokens[0].len() == max_new_tokens {
                return Ok(new_tokens);
            }
            tokens = if self.cached.iter().all(|c| c.len() < context) {
                self.decode_and_sample_async(&tokens, sampling, &mut rng).await?
            } else {
                let windows: Vec<Vec<u32>> = self
                    .cached
                    .iter()
                    .zip(&tokens)
                    .map(|(cached, &token)| {
                        let mut window = cached[cached.len().saturating_sub(keep - 1)..].to_vec();
                        window.push(token);
                        window
                    })
                    .collect();
                let windows: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
                self.prefill_and_sample_async(&windows, sampling, &mut rng).await?
            };
        }
    }
}
