//! Generation's ops, with no gradient: attention over a KV cache that its
//! dispatch updates in place, and sampling the next token on the GPU.

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext, SourceOp};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::{CachedAttentionShape, Dispatch};

/// Inference-only ops (no gradients).
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationOp {
    /// inputs (qkv [S, T, 3·C], u32 starts [S], k cache, v cache, each
    /// [S, heads, P, C/heads]) -> [S, T, C]: writes the rows' keys and
    /// values into the caches at positions starts[s] + t, then attends
    /// over positions 0..=starts[s] + t (see
    /// `Kernels::cached_attention_forward`). No gradient.
    CachedAttention { heads: usize },
    /// inputs (logits [.., vocab], draws [rows, 2] f32 of (u, temperature),
    /// top_k [rows] u32) -> [rows, 2] u32: each row's token and its first
    /// non-finite logit (see `Kernels::sample_rows`). No gradient.
    SampleTokens,
}

/// A cached attention's sizes from its qkv [S, T, 3·C] and cache
/// [S, heads, P, C/heads] shapes.
fn attention_shape(heads: usize, qkv: &[usize], cache: &[usize]) -> Result<CachedAttentionShape> {
    let (&[seqs, rows, width], &[_, _, context, head_dim]) = (qkv, cache) else {
        return Err(Error::shape("Executor", "cached_attention's operands lost their ranks", &[qkv, cache]));
    };
    if width != 3 * heads * head_dim {
        return Err(Error::shape("Executor", "cached_attention's qkv does not match its caches", &[qkv, cache]));
    }
    Ok(CachedAttentionShape { seqs, rows, heads, head_dim, context })
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
            GenerationOp::CachedAttention { heads } => {
                let sizes = attention_shape(*heads, cx.input_shape(0), cx.input_shape(2))?;
                k.cached_attention_forward(cx.out()?, cx.input(2)?, cx.input(3)?, cx.input(0)?, cx.input(1)?, sizes)
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
            GenerationOp::CachedAttention { heads } => {
                let sizes = attention_shape(*heads, cx.input_shape(0), cx.input_shape(2))?;
                Ok(cpu::cached_attention(cx.input(0)?, &cx.input_u32(1)?, cx.input(2)?, cx.input(3)?, sizes).0)
            }
            // Sampling reads f32 logits and draws, as the kernel does.
            GenerationOp::SampleTokens => {
                let (rows, vocab) = flat_rows_cols(cx.input_shape(0));
                let narrow = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
                let tokens = cpu::sample_rows(&narrow(cx.input(0)?), &narrow(cx.input(1)?), &cx.input_u32(2)?, rows, vocab);
                Ok(tokens.into_iter().map(f64::from).collect())
            }
        }
    }
}

impl Graph {
    /// Causal self-attention of `qkv` [S, T, 3·C] (q | k | v of T new
    /// positions per sequence, `heads` heads) over KV caches `k_cache`,
    /// `v_cache` [S, heads, P, C/heads] ([`Graph::cache`] tensors): row t
    /// of sequence s is position starts[s] + t (u32 `starts` [S]); its key
    /// and value are written into the caches there, and it attends over
    /// positions 0 ..= starts[s] + t, the earlier ones from the caches.
    /// -> [S, T, C], heads side by side. Positions must stay below P (the
    /// caller checks the starts it writes). No gradient.
    pub fn cached_attention(&mut self, qkv: Tensor, starts: Tensor, k_cache: Tensor, v_cache: Tensor, heads: usize) -> Result<Tensor> {
        const OP: &str = "cached_attention";
        self.f32_inputs(OP, &[qkv, k_cache, v_cache])?;
        self.check_handle(OP, starts)?;
        let (sq, ss, sk, sv) = (self.shape(qkv).to_vec(), self.shape(starts).to_vec(), self.shape(k_cache).to_vec(), self.shape(v_cache).to_vec());
        let all: [&[usize]; 4] = [&sq, &ss, &sk, &sv];
        let [seqs, rows, width] = sq[..] else {
            return Err(Error::shape(OP, "qkv must be [sequences, rows, 3·channels]", &all));
        };
        if heads == 0 || width % 3 != 0 || (width / 3) % heads != 0 {
            return Err(Error::shape(OP, format!("qkv's last dimension must be 3·channels with channels a multiple of {heads} heads"), &all));
        }
        let head_dim = width / 3 / heads;
        if self.node(starts).dtype != DType::U32 || ss != [seqs] {
            return Err(Error::shape(OP, format!("starts must be u32 [{seqs}]"), &all));
        }
        let cache_ok = |shape: &[usize]| shape.len() == 4 && shape[0] == seqs && shape[1] == heads && shape[3] == head_dim;
        if !cache_ok(&sk) || sk != sv {
            return Err(Error::shape(OP, format!("the caches must both be [{seqs}, {heads}, context, {head_dim}]"), &all));
        }
        for cache in [k_cache, v_cache] {
            if self.node(cache).op != SourceOp::Cache {
                return Err(Error::InvalidArgument { op: OP, reason: format!("`{}` is not a cache tensor (Graph::cache)", self.node(cache).name) });
            }
        }
        if k_cache == v_cache {
            return Err(Error::InvalidArgument { op: OP, reason: "keys and values need two different caches".into() });
        }
        let shape = vec![seqs, rows, width / 3];
        Ok(self.push(GenerationOp::CachedAttention { heads }, vec![qkv, starts, k_cache, v_cache], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// The next token of each row of `logits` [.., vocab] (rows: the
    /// product of the leading dimensions), drawn on the GPU with each
    /// row's settings read from inputs, so that changing them rebuilds
    /// nothing: `draws` f32 [rows, 2] holds (u, temperature) with u
    /// uniform in `[0, 1)`, `top_k` (u32 `[rows]`) the number of largest logits
    /// to sample among (clamped to 1..=vocab). -> u32 [rows, 2]: (token,
    /// first column whose logit is not finite, or
    /// [`NO_TOKEN`](crate::ops::NO_TOKEN) when all are). Temperature 0 is
    /// the first maximum; see `Kernels::sample_rows`. No gradient.
    pub fn sample_tokens(&mut self, logits: Tensor, draws: Tensor, top_k: Tensor) -> Result<Tensor> {
        const OP: &str = "sample_tokens";
        self.f32_inputs(OP, &[logits, draws])?;
        self.check_handle(OP, top_k)?;
        let (sl, sd, sk) = (self.shape(logits).to_vec(), self.shape(draws).to_vec(), self.shape(top_k).to_vec());
        let all: [&[usize]; 3] = [&sl, &sd, &sk];
        let (rows, _) = rows_cols(OP, &sl, &all)?;
        if sd != [rows, 2] {
            return Err(Error::shape(OP, format!("draws must be [{rows}, 2]: (u, temperature) for each of the logits' {rows} rows"), &all));
        }
        if self.node(top_k).dtype != DType::U32 || sk != [rows] {
            return Err(Error::shape(OP, format!("top_k must be u32 [{rows}], one k for each of the logits' {rows} rows"), &all));
        }
        Ok(self.push(GenerationOp::SampleTokens, vec![logits, draws, top_k], vec![rows, 2], DType::U32, format!("{OP}{}", self.nodes.len())))
    }
}
