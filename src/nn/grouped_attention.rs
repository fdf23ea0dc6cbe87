//! Grouped-query causal self-attention with rotary positions (Llama's):
//! n_head query heads share n_kv_head key/value heads (n_kv_head = n_head
//! is multi-head, 1 is multi-query), separate `q_proj`, `k_proj`, `v_proj`
//! and `o_proj` projections without biases. Its relatives are options
//! ([`AttentionOptions`]): Qwen2's biases on q, k and v, Qwen3's RMSNorm
//! over each q and k head before the rotation, and a head width that is
//! not n_embd / n_head (Qwen3's `head_dim`).

use super::causal_lm::{cache_pass, cached_attention, one_quantized_product, unsharded_generation};
use super::parameter_tree::{child_prefix, parameter_tree};
use super::shard::AttentionSplit;
use super::transformer::{causal_attention_window, AttentionKernel};
use super::{Linear, Module, ParameterTree, RmsNorm, Rotary};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{MatmulForm, QkvLayout};

/// What a family changes in Llama's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Channels per head (n_embd / n_head in Llama and Qwen2).
    pub head_dim: usize,
    /// Biases on q_proj, k_proj and v_proj (Qwen2's), not on o_proj.
    pub qkv_bias: bool,
    /// Qwen3's `q_norm` and `k_norm`: an RMSNorm of this epsilon over each
    /// head's channels of q and of k, before the rotation.
    pub qk_norm_eps: Option<f32>,
    /// Attend only to the last this-many positions (key j of query i when i - j < window); None: all of them.
    pub sliding_window: Option<usize>,
    /// The scores' scale when not 1/√head_dim (Gemma's
    /// `query_pre_attn_scalar`^-½).
    pub scale: Option<f32>,
}

impl AttentionOptions {
    /// Llama's: heads of n_embd / n_head channels, no biases, no q/k norm.
    pub fn llama(n_embd: usize, n_head: usize) -> Self {
        AttentionOptions {
            head_dim: n_embd / n_head.max(1),
            qkv_bias: false,
            qk_norm_eps: None,
            sliding_window: None,
            scale: None,
        }
    }
}

/// transformers' LlamaAttention (with [`AttentionOptions`], Qwen2Attention
/// and Qwen3Attention) over x [B, T, C].
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedQueryAttention {
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    /// Channels per head: q_proj yields n_head of them, k_proj and v_proj
    /// n_kv_head.
    pub head_dim: usize,
    pub rotary: Rotary,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// Qwen3's RMSNorm over each query head (weight [head_dim], shared by
    /// the heads); `None` in Llama and Qwen2.
    pub q_norm: Option<RmsNorm>,
    /// The same over each key head.
    pub k_norm: Option<RmsNorm>,
    pub o_proj: Linear,
    pub attention: AttentionKernel,
    /// Sliding-window attention ([`AttentionOptions::sliding_window`]),
    /// in training, prefill and the cached decode alike.
    pub sliding_window: Option<usize>,
    /// See [`AttentionOptions::scale`].
    pub scale: Option<f32>,
}

impl GroupedQueryAttention {
    /// Weights N(0, std²), no biases (Llama's init).
    pub fn normal(n_embd: usize, n_head: usize, n_kv_head: usize, rotary: Rotary, std: f32) -> Result<Self> {
        Self::check(n_embd, n_head, n_kv_head)?;
        Self::with_options(
            n_embd,
            n_head,
            n_kv_head,
            AttentionOptions::llama(n_embd, n_head),
            rotary,
            std,
        )
    }

    /// transformers' init of a family's attention: weights N(0, std²),
    /// biases zero, norms one.
    pub fn with_options(
        n_embd: usize,
        n_head: usize,
        n_kv_head: usize,
        options: AttentionOptions,
        rotary: Rotary,
        std: f32,
    ) -> Result<Self> {
        let mut attention = Self::empty(n_embd, n_head, n_kv_head, options, rotary)?;
        for linear in [
            &mut attention.q_proj,
            &mut attention.k_proj,
            &mut attention.v_proj,
            &mut attention.o_proj,
        ] {
            *linear = Linear {
                bias: linear.bias.as_ref().map(|_| vec![0.0; linear.out_features]),
                ..Linear::normal_no_bias(linear.in_features, linear.out_features, std)
            };
        }
        Ok(attention)
    }

    /// The structure with no values (empty matrices and biases, norms
    /// ones), for a model's `from_parameters` to fill.
    pub fn empty(
        n_embd: usize,
        n_head: usize,
        n_kv_head: usize,
        options: AttentionOptions,
        rotary: Rotary,
    ) -> Result<Self> {
        let d = options.head_dim;
        Self::check_heads(n_embd, n_head, n_kv_head, d)?;
        let (q, kv) = (n_head * d, n_kv_head * d);
        let norm = || options.qk_norm_eps.map(|eps| RmsNorm::new(d, eps));
        Ok(GroupedQueryAttention {
            n_embd,
            n_head,
            n_kv_head,
            head_dim: d,
            rotary,
            q_proj: Linear::empty(n_embd, q, options.qkv_bias),
            k_proj: Linear::empty(n_embd, kv, options.qkv_bias),
            v_proj: Linear::empty(n_embd, kv, options.qkv_bias),
            q_norm: norm(),
            k_norm: norm(),
            o_proj: Linear::empty(q, n_embd, false),
            attention: AttentionKernel::default(),
            sliding_window: options.sliding_window,
            scale: options.scale,
        })
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Llama's sizes: heads dividing the channels, KV heads the heads.
    pub(crate) fn check(n_embd: usize, n_head: usize, n_kv_head: usize) -> Result<()> {
        if n_head == 0 || n_kv_head == 0 || n_embd == 0 || n_embd % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(Error::InvalidArgument {
                op: "GroupedQueryAttention",
                reason: format!("n_embd {n_embd} must be a positive multiple of n_head {n_head}, and n_kv_head {n_kv_head} a positive divisor of n_head"),
            });
        }
        Ok(())
    }

    /// Sizes with a head width of their own: every size positive and KV
    /// heads dividing the heads.
    fn check_heads(n_embd: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> Result<()> {
        if n_head == 0 || n_kv_head == 0 || n_embd == 0 || head_dim == 0 || n_head % n_kv_head != 0 {
            return Err(Error::InvalidArgument {
                op: "GroupedQueryAttention",
                reason: format!("n_embd {n_embd}, head_dim {head_dim} and n_head {n_head} must be positive, and n_kv_head {n_kv_head} a positive divisor of n_head"),
            });
        }
        Ok(())
    }
}

impl Module for GroupedQueryAttention {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_heads(self.n_embd, self.n_head, self.n_kv_head, self.head_dim)?;
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [b, t, c] = shape[..] else {
            return Err(Error::shape(
                "GroupedQueryAttention",
                "expects x [batch, time, channels]",
                &[&shape],
            ));
        };
        if c != self.n_embd {
            return Err(Error::shape(
                "GroupedQueryAttention",
                format!("expects {} channels", self.n_embd),
                &[&shape],
            ));
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
        let q = self
            .q_proj
            .forward_split(g, x, &child_prefix!(prefix, self.q_proj), split.query)?;
        let k = self
            .k_proj
            .forward_split(g, x, &child_prefix!(prefix, self.k_proj), split.key_value)?;
        let v = self
            .v_proj
            .forward_split(g, x, &child_prefix!(prefix, self.v_proj), split.key_value)?;
        let heads_of = |g: &Graph, y: Tensor| g.shape_of(y).and_then(|s| s.last().copied()).unwrap_or(0) / d;
        let (h, kv) = (heads_of(g, q), heads_of(g, k));
        // Rotary positions on [B, T, heads, d], the projections' own
        // layout, before the KV heads are repeated (each rotated once).
        let q = g.reshape(q, &[b, t, h, d])?;
        let q = head_norm(g, &self.q_norm, q, &child_prefix!(prefix, self.q_norm))?;
        let q = self.rotary.forward(g, q, starts)?;
        let q = self.scale_queries(g, q)?;
        let k = g.reshape(k, &[b, t, kv, d])?;
        let k = head_norm(g, &self.k_norm, k, &child_prefix!(prefix, self.k_norm))?;
        let k = self.rotary.forward(g, k, starts)?;
        let k = g.reshape(k, &[b, t, kv * d])?;
        if pass.is_some() {
            // Generation: the cache holds the kv heads, rotated once at
            // their positions; the kernel shares each among its group.
            let q = g.reshape(q, &[b, t, h * d])?;
            let y = cached_attention(
                g,
                prefix,
                [q, k, v],
                QkvLayout::Separate,
                (h, kv, d),
                self.sliding_window,
            )?;
            return self
                .o_proj
                .forward_split(g, y, &child_prefix!(prefix, self.o_proj), split.output);
        }
        let q = g.reshape(q, &[b, t, h * d])?;
        let y = causal_attention_window(g, [q, k, v], (h, kv, d), self.attention, self.sliding_window)?;
        self.o_proj
            .forward_split(g, y, &child_prefix!(prefix, self.o_proj), split.output)
    }

    fn describe(&self) -> String {
        let mut options = String::new();
        if self.head_dim * self.n_head != self.n_embd {
            options += &format!(", head_dim={}", self.head_dim);
        }
        if self.q_proj.bias.is_some() {
            options += ", qkv_bias";
        }
        if self.q_norm.is_some() {
            options += ", qk_norm";
        }
        if let Some(scale) = self.scale {
            options += &format!(", scale={scale}");
        }
        if let Some(window) = self.sliding_window {
            options += &format!(", sliding_window={window}");
        }
        format!(
            "GroupedQueryAttention(n_embd={}, n_head={}, n_kv_head={}{options})",
            self.n_embd, self.n_head, self.n_kv_head
        )
    }
}

impl GroupedQueryAttention {
    /// The queries times scale·√d, so that the attention's 1/√d makes
    /// the scores' scale `scale` (q·k is linear in q: before or after the
    /// rotation alike); as they are without one.
    fn scale_queries(&self, g: &mut Graph, q: Tensor) -> Result<Tensor> {
        match self.scale {
            Some(scale) if (scale * (self.head_dim as f32).sqrt() - 1.0).abs() > f32::EPSILON => {
                g.scale(q, scale * (self.head_dim as f32).sqrt())
            }
            _ => Ok(q),
        }
    }
}

/// Qwen3's q/k norm: an RMSNorm over the last dim of heads [B, T, H, d]
/// (its weight [d] replicated under tensor parallelism, where each device
/// normalises its own heads and the engine sums the weight's gradient
/// over the devices); `None` passes the heads through.
fn head_norm(g: &mut Graph, norm: &Option<RmsNorm>, heads: Tensor, prefix: &str) -> Result<Tensor> {
    match norm {
        Some(norm) => norm.forward(g, heads, prefix),
        None => Ok(heads),
    }
}

impl GroupedQueryAttention {
    /// Generation with block-quantized q, k and v projections (a GGUF
    /// file's) and no biases: one product over the three, its rows q | k |
    /// v, one rotation of its q and k heads, and the cached attention
    /// reading that row as fused: two dispatches where separate
    /// projections take five. None where that does not apply.
    fn quantized_qkv_attention(
        &self,
        g: &mut Graph,
        x: Tensor,
        prefix: &str,
        starts: Option<Tensor>,
    ) -> Result<Option<Tensor>> {
        let projections = [
            (&self.q_proj, child_prefix!(prefix, self.q_proj)),
            (&self.k_proj, child_prefix!(prefix, self.k_proj)),
            (&self.v_proj, child_prefix!(prefix, self.v_proj)),
        ];
        let plain = projections.iter().all(|(l, _)| l.bias.is_none())
            && self.q_norm.is_none()
            && self.k_norm.is_none()
            && self.scale.is_none();
        if !unsharded_generation() || !plain {
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
            return Err(Error::shape(
                "GroupedQueryAttention",
                "expects x [batch, time, channels]",
                &[&shape],
            ));
        };
        let (d, h, kv) = (self.head_dim(), self.n_head, self.n_kv_head);
        let rows = g.reshape(x, &[b * t, c])?;
        let qkv = g.matmul_quant_parts(rows, &weights, false)?;
        let heads = g.reshape(qkv, &[b, t, h + 2 * kv, d])?;
        let rotated = self.rotary.forward_heads(g, heads, starts, h + kv)?;
        let qkv = g.reshape(rotated, &[b, t, (h + 2 * kv) * d])?;
        let y = cached_attention(
            g,
            prefix,
            [qkv, qkv, qkv],
            QkvLayout::Fused,
            (h, kv, d),
            self.sliding_window,
        )?;
        self.o_proj.forward(g, y, &child_prefix!(prefix, self.o_proj)).map(Some)
    }
}

// In the order the forward declares them.
parameter_tree!(GroupedQueryAttention {
    q_proj,
    k_proj,
    v_proj,
    q_norm,
    k_norm,
    o_proj
});

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
