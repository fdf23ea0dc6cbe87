//! Generation's ops, with no gradient: attention over a KV cache that its
//! dispatch updates in place, and sampling the next token on the GPU.

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext, SourceOp};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::{CachedAttentionShape, Dispatch, QkvLayout, View};

/// Inference-only ops (no gradients).
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationOp {
    /// inputs (q, k, v [S, T, *] placed by `layout` (one fused qkv given
    /// three times, or three operands), u32 starts [S], k cache, v cache,
    /// each [S, kv_heads, P, d]) -> [S, T, heads·d]: writes the rows' keys
    /// and values into the caches at positions starts[s] + t, then attends
    /// over positions 0..=starts[s] + t, the last `window` of them under a
    /// sliding window (see `Kernels::cached_attention_forward`). No
    /// gradient.
    CachedAttention {
        heads: usize,
        layout: QkvLayout,
        window: Option<usize>,
    },
    /// inputs (logits [.., vocab], draws [rows, 3] f32 of (u, temperature,
    /// top_p), top_k [rows] u32) -> [rows, 2] u32: each row's token and its first
    /// non-finite logit (see `Kernels::sample_rows`). No gradient.
    SampleTokens,
}

/// A cached attention's sizes from its q [S, T, *] and cache
/// [S, kv_heads, P, d] shapes.
fn attention_shape(
    (heads, layout, window): (usize, QkvLayout, Option<usize>),
    q: &[usize],
    cache: &[usize],
) -> Result<CachedAttentionShape> {
    let (&[seqs, rows, _], &[_, kv_heads, context, head_dim]) = (q, cache) else {
        return Err(Error::shape(
            "Executor",
            "cached_attention's operands lost their ranks",
            &[q, cache],
        ));
    };
    Ok(CachedAttentionShape {
        seqs,
        rows,
        heads,
        kv_heads,
        head_dim,
        context,
        layout,
        window,
    })
}

/// The first `len` elements of `v` (all of it when shorter).
fn first_elements(v: View<'_>, len: usize) -> View<'_> {
    View {
        len: len.min(v.len),
        ..v
    }
}

impl OpFamily for GenerationOp {
    fn name(&self) -> &'static str {
        match self {
            GenerationOp::CachedAttention { .. } => "cached_attention",
            GenerationOp::SampleTokens => "sample_tokens",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        match self {
            GenerationOp::CachedAttention { heads, layout, window } => {
                let sizes = attention_shape((*heads, *layout, *window), cx.input_shape(0), cx.input_shape(4))?;
                // The first `seqs` sequences of caches that may hold more.
                let len = sizes.lengths().map_or(0, |l| l.cache);
                k.cached_attention_forward(
                    cx.out()?,
                    first_elements(cx.input(4)?, len),
                    first_elements(cx.input(5)?, len),
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    cx.input(3)?,
                    sizes,
                )
            }
            GenerationOp::SampleTokens => {
                let (rows, vocab) = flat_rows_cols(cx.input_shape(0));
                k.sample_rows(cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?, rows, vocab)
            }
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match self {
            // The output only: the reference leaves the caches' values as
            // they were fed.
            GenerationOp::CachedAttention { heads, layout, window } => {
                let sizes = attention_shape((*heads, *layout, *window), cx.input_shape(0), cx.input_shape(4))?;
                let len = sizes.lengths().map_or(0, |l| l.cache);
                let (k_cache, v_cache) = (cx.input(4)?, cx.input(5)?);
                Ok(cpu::cached_attention(
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    &cx.input_u32(3)?,
                    &k_cache[..len.min(k_cache.len())],
                    &v_cache[..len.min(v_cache.len())],
                    sizes,
                )
                .0)
            }
            // Sampling reads f32 logits and draws, as the kernel does.
            GenerationOp::SampleTokens => {
                let (rows, vocab) = flat_rows_cols(cx.input_shape(0));
                let narrow = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
                let tokens = cpu::sample_rows(
                    &narrow(cx.input(0)?),
                    &narrow(cx.input(1)?),
                    &cx.input_u32(2)?,
                    rows,
                    vocab,
                );
                Ok(tokens.into_iter().map(f64::from).collect())
            }
        }
    }
}

impl Graph {
    /// Causal self-attention of T new positions per sequence over KV
    /// caches `k_cache`, `v_cache` [S, kv_heads, P, d] ([`Graph::cache`]
    /// tensors), `heads` query heads sharing the caches' kv_heads (query
    /// head h reads KV head h / (heads / kv_heads)). `qkv` are the
    /// queries, keys and values [S, T, *]: with [`QkvLayout::Fused`] one
    /// tensor given three times whose rows are q | k | v (a GPT's
    /// c_attn), with [`QkvLayout::Separate`] q [S, T, heads·d] and k, v
    /// [S, T, kv_heads·d] (keys already rotated at their positions, for
    /// Llama). Row t of sequence s is position starts[s] + t (u32 `starts`
    /// [S]); its key and value are written into the caches there, and it
    /// attends over positions 0 ..= starts[s] + t, the earlier ones from
    /// the caches. -> [S, T, heads·d], heads side by side. Positions must
    /// stay below P (the caller checks the starts it writes). The caches
    /// may hold more sequences than q: its S rows use the first S (a
    /// server's decode over its lowest slots). No gradient.
    pub fn cached_attention(
        &mut self,
        qkv: [Tensor; 3],
        layout: QkvLayout,
        starts: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        heads: usize,
    ) -> Result<Tensor> {
        self.cached_attention_window(qkv, layout, starts, [k_cache, v_cache], heads, None)
    }

    /// [`Graph::cached_attention`] with a sliding window: position p
    /// attends to positions p - window + 1 ..= p only (None: 0 ..= p).
    pub fn cached_attention_window(
        &mut self,
        qkv: [Tensor; 3],
        layout: QkvLayout,
        starts: Tensor,
        [k_cache, v_cache]: [Tensor; 2],
        heads: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        const OP: &str = "cached_attention";
        self.f32_inputs(OP, &[qkv[0], qkv[1], qkv[2], k_cache, v_cache])?;
        self.check_handle(OP, starts)?;
        let [sq, sk, sv] = qkv.map(|t| self.shape(t).to_vec());
        let (ss, skc, svc) = (
            self.shape(starts).to_vec(),
            self.shape(k_cache).to_vec(),
            self.shape(v_cache).to_vec(),
        );
        let all: [&[usize]; 6] = [&sq, &sk, &sv, &ss, &skc, &svc];
        let [_, kv_heads, context, head_dim] = skc[..] else {
            return Err(Error::shape(
                OP,
                "the caches must be [sequences, kv_heads, context, head_dim]",
                &all,
            ));
        };
        let [seqs, rows, _] = sq[..] else {
            return Err(Error::shape(OP, "q must be [sequences, rows, columns]", &all));
        };
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::shape(
                OP,
                format!("the caches' {kv_heads} KV heads must divide {heads} query heads"),
                &all,
            ));
        }
        let shape = CachedAttentionShape {
            seqs,
            rows,
            heads,
            kv_heads,
            head_dim,
            context,
            layout,
            window,
        };
        if window == Some(0) {
            return Err(Error::shape(OP, "a sliding window must hold at least 1 position", &all));
        }
        let columns = shape
            .columns()
            .ok_or_else(|| Error::shape(OP, "the sizes overflow", &all))?;
        if layout == QkvLayout::Fused && (qkv[1] != qkv[0] || qkv[2] != qkv[0]) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "a fused qkv is one tensor given as q, k and v".into(),
            });
        }
        for ((name, shape), (width, _)) in [("q", &sq), ("k", &sk), ("v", &sv)].into_iter().zip(columns) {
            if shape[..] != [seqs, rows, width] {
                return Err(Error::shape(OP, format!("{name} must be [{seqs}, {rows}, {width}] for {heads} heads over {kv_heads} KV heads of {head_dim} ({layout:?})"), &all));
            }
        }
        if self.node(starts).dtype != DType::U32 || ss != [seqs] {
            return Err(Error::shape(OP, format!("starts must be u32 [{seqs}]"), &all));
        }
        if skc[0] < seqs || skc != svc {
            return Err(Error::shape(
                OP,
                format!("the caches must both be [at least {seqs}, {kv_heads}, context, {head_dim}]"),
                &all,
            ));
        }
        for cache in [k_cache, v_cache] {
            if self.node(cache).op != SourceOp::Cache {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("`{}` is not a cache tensor (Graph::cache)", self.node(cache).name),
                });
            }
        }
        if k_cache == v_cache {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "keys and values need two different caches".into(),
            });
        }
        let out = vec![seqs, rows, heads * head_dim];
        let [q, k, v] = qkv;
        Ok(self.push(
            GenerationOp::CachedAttention { heads, layout, window },
            vec![q, k, v, starts, k_cache, v_cache],
            out,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// The next token of each row of `logits` [.., vocab] (rows: the
    /// product of the leading dimensions), drawn on the GPU with each
    /// row's settings read from inputs, so that changing them rebuilds
    /// nothing: `draws` f32 [rows, 3] holds (u, temperature, top_p) with u
    /// uniform in `[0, 1)` and top_p the nucleus's share of the
    /// candidates' mass (1: all of them), `top_k` (u32 `[rows]`) the number
    /// of largest logits to sample among (clamped to 1..=vocab). -> u32 [rows, 2]: (token,
    /// first column whose logit is not finite, or
    /// [`NO_TOKEN`](crate::ops::NO_TOKEN) when all are). Temperature 0 is
    /// the first maximum; see `Kernels::sample_rows`. No gradient.
    pub fn sample_tokens(&mut self, logits: Tensor, draws: Tensor, top_k: Tensor) -> Result<Tensor> {
        const OP: &str = "sample_tokens";
        self.f32_inputs(OP, &[logits, draws])?;
        self.check_handle(OP, top_k)?;
        let (sl, sd, sk) = (
            self.shape(logits).to_vec(),
            self.shape(draws).to_vec(),
            self.shape(top_k).to_vec(),
        );
        let all: [&[usize]; 3] = [&sl, &sd, &sk];
        let (rows, _) = rows_cols(OP, &sl, &all)?;
        if sd != [rows, 3] {
            return Err(Error::shape(
                OP,
                format!("draws must be [{rows}, 3]: (u, temperature, top_p) for each of the logits' {rows} rows"),
                &all,
            ));
        }
        if self.node(top_k).dtype != DType::U32 || sk != [rows] {
            return Err(Error::shape(
                OP,
                format!("top_k must be u32 [{rows}], one k for each of the logits' {rows} rows"),
                &all,
            ));
        }
        Ok(self.push(
            GenerationOp::SampleTokens,
            vec![logits, draws, top_k],
            vec![rows, 2],
            DType::U32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
