//! Grouped-query causal self-attention with rotary positions (Llama's):
//! n_head query heads share n_kv_head key/value heads (n_kv_head = n_head
//! is multi-head, 1 is multi-query), separate `q_proj`, `k_proj`, `v_proj`
//! and `o_proj` projections without biases.

use super::causal_lm::{cache_pass, cached_attention, one_quantized_product, unsharded_generation};
use super::parameter_tree::{child_prefix, parameter_tree};
use super::shard::AttentionSplit;
use super::transformer::{causal_attention, AttentionKernel};
use super::{Linear, Module, ParameterTree, Rotary};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{MatmulForm, QkvLayout};

/// transformers' LlamaAttention over x [B, T, C].
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedQueryAttention {
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub rotary: Rotary,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub attention: AttentionKernel,
}

impl GroupedQueryAttention {
    /// Weights N(0, std²), no biases (Llama's init).
    pub fn normal(n_embd: usize, n_head: usize, n_kv_head: usize, rotary: Rotary, std: f32) -> Result<Self> {
        Self::check(n_embd, n_head, n_kv_head)?;
        let kv = n_kv_head * (n_embd / n_head);
        Ok(GroupedQueryAttention {
            n_embd,
            n_head,
            n_kv_head,
            rotary,
            q_proj: Linear::normal_no_bias(n_embd, n_embd, std),
            k_proj: Linear::normal_no_bias(n_embd, kv, std),
            v_proj: Linear::normal_no_bias(n_embd, kv, std),
            o_proj: Linear::normal_no_bias(n_embd, n_embd, std),
            attention: AttentionKernel::default(),
        })
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    pub(crate) fn check(n_embd: usize, n_head: usize, n_kv_head: usize) -> Result<()> {
        if n_head == 0 || n_kv_head == 0 || n_embd == 0 || n_embd % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(Error::InvalidArgument {
                op: "GroupedQueryAttention",
                reason: format!("n_embd {n_embd} must be a positive multiple of n_head {n_head}, and n_kv_head {n_kv_head} a positive divisor of n_head"),
            });
        }
        Ok(())
    }
}

impl Module for GroupedQueryAttention {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check(self.n_embd, self.n_head, self.n_kv_head)?;
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [b, t, c] = shape[..] else {
            return Err(Error::shape("GroupedQueryAttention", "expects x [batch, time, channels]", &[&shape]));
        };
        if c != self.n_embd {
            return Err(Error::shape("GroupedQueryAttention", format!("expects {} channels", self.n_embd), &[&shape]));
        }
        // Under tensor parallelism a device takes whole KV heads and, in
        // step, the query heads sharing them; its head counts are the
        // widths its projections yield.
        let d = self.head_dim();
        let pass = cache_pass();
        let starts = pass.map(|p| p.starts);
        if let Some(y) = self.quantized_qkv_attention(g, x, prefix, starts)? {
            return Ok(y);
        }
        let split = AttentionSplit::grouped_query(self.n_head, self.n_kv_head, d)?;
        let q = self.q_proj.forward_split(g, x, &child_prefix!(prefix, self.q_proj), split.query)?;
        let k = self.k_proj.forward_split(g, x, &child_prefix!(prefix, self.k_proj), split.key_value)?;
        let v = self.v_proj.forward_split(g, x, &child_prefix!(prefix, self.v_proj), split.key_value)?;
        let heads_of = |g: &Graph, y: Tensor| g.shape_of(y).and_then(|s| s.last().copied()).unwrap_or(0) / d;
        let (h, kv) = (heads_of(g, q), heads_of(g, k));
        // Rotary positions on [B, T, heads, d], the projections' own
        // layout, before the KV heads are repeated (each rotated once).
        let q = g.reshape(q, &[b, t, h, d])?;
        let q = self.rotary.forward(g, q, starts)?;
        let k = g.reshape(k, &[b, t, kv, d])?;
        let k = self.rotary.forward(g, k, starts)?;
        let k = g.reshape(k, &[b, t, kv * d])?;
        if pass.is_some() {
            // Generation: the cache holds the kv heads, rotated once at
            // their positions; the kernel shares each among its group.
            let q = g.reshape(q, &[b, t, h * d])?;
            let y = cached_attention(g, prefix, [q, k, v], QkvLayout::Separate, h, kv, d)?;
            return self.o_proj.forward_split(g, y, &child_prefix!(prefix, self.o_proj), split.output);
        }
        let q = g.reshape(q, &[b, t, h * d])?;
        let y = causal_attention(g, [q, k, v], h, kv, d, self.attention)?;
        self.o_proj.forward_split(g, y, &child_prefix!(prefix, self.o_proj), split.output)
    }

    fn describe(&self) -> String {
        format!("GroupedQueryAttention(n_embd={}, n_head={}, n_kv_head={})", self.n_embd, self.n_head, self.n_kv_head)
    }
}

impl GroupedQueryAttention {
    /// Generation with block-quantized q, k and v projections (a GGUF
    /// file's) and no biases: one product over the three, its rows q | k |
    /// v, one rotation of its q and k heads, and the cached attention
    /// reading that row as fused: two dispatches where separate
    /// projections take five. None where that does not apply.
    fn quantized_qkv_attention(&self, g: &mut Graph, x: Tensor, prefix: &str, starts: Option<Tensor>) -> Result<Option<Tensor>> {
        let projections = [(&self.q_proj, child_prefix!(prefix, self.q_proj)), (&self.k_proj, child_prefix!(prefix, self.k_proj)), (&self.v_proj, child_prefix!(prefix, self.v_proj))];
        if !unsharded_generation() || projections.iter().any(|(l, _)| l.bias.is_some()) {
            return Ok(None);
        }
        let mut weights = Vec::with_capacity(3);
        for (linear, name) in &projections {
            weights.extend(linear.declare_weights(g, name)?);
        }
        if weights.len() != 3 || !one_quantized_product(g, &weights) {
            return Ok(None);
        }
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [b, t, c] = shape[..] else {
            return Err(Error::shape("GroupedQueryAttention", "expects x [batch, time, channels]", &[&shape]));
        };
        let (d, h, kv) = (self.head_dim(), self.n_head, self.n_kv_head);
        let rows = g.reshape(x, &[b * t, c])?;
        let qkv = g.matmul_quant_parts(rows, &weights, false)?;
        let heads = g.reshape(qkv, &[b, t, h + 2 * kv, d])?;
        let rotated = self.rotary.forward_heads(g, heads, starts, h + kv)?;
        let qkv = g.reshape(rotated, &[b, t, (h + 2 * kv) * d])?;
        let y = cached_attention(g, prefix, [qkv, qkv, qkv], QkvLayout::Fused, h, kv, d)?;
        self.o_proj.forward(g, y, &child_prefix!(prefix, self.o_proj)).map(Some)
    }
}

parameter_tree!(GroupedQueryAttention { q_proj, k_proj, v_proj, o_proj });

/// Key or value heads x [.., n_kv·d] repeated to [.., n_kv·n_rep·d], each
/// KV head n_rep times in a row (transformers' `repeat_kv`: query head i
/// reads KV head i / n_rep). A product with a 0/1 selection matrix, so the
/// values are exact and the gradient sums each group's copies; one call
/// site: the unfused path of `transformer::causal_attention`.
pub(crate) fn repeat_kv(g: &mut Graph, x: Tensor, n_kv: usize, n_rep: usize, head_dim: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x);
    }
    let (width, repeated) = (n_kv * head_dim, n_kv * n_rep * head_dim);
    let mut select = vec![0.0f32; width * repeated];
    for kv in 0..n_kv {
        for copy in 0..n_rep {
            for j in 0..head_dim {
                let column = (kv * n_rep + copy) * head_dim + j;
                select[(kv * head_dim + j) * repeated + column] = 1.0;
            }
        }
    }
    let select = g.constant("repeat_kv", &[width, repeated], select)?;
    g.rows_matmul(MatmulForm::AB, x, select)
}
