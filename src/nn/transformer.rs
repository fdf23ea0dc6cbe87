//! The pieces of a GPT block with GPT-2's parameter names: causal
//! multi-head self-attention, the MLP, and the pre-norm residual block.

use super::causal_lm::{cache_pass, cached_attention};
use super::grouped_attention::repeat_kv;
use super::parameter_tree::{child_prefix, parameter_tree};
use super::{shard, Layer, LayerNorm, Linear, Module, TensorSplit};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{MatmulForm, QkvLayout, FLASH_MAX_HEAD_DIM};

/// How an attention module computes softmax(q·kᵀ/√d, causal)·v when it
/// trains or runs whole sequences (generation's cached path is its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// One fused op, forward and backward (FlashAttention-2,
    /// [`Graph::fused_causal_attention`]): no [B, H, T, T] scores or
    /// probabilities stored.
    #[default]
    Fused,
    /// Separate graph ops over [B, H, T, d] (q·kᵀ, scale, causal softmax,
    /// ·v), which store the scores and probabilities: the reference.
    Unfused,
}

/// The shortest sequence from which whole GPT training steps ran faster
/// with the CPU-shaped fused kernels than with the unfused graph on
/// lavapipe (BENCHMARKS.md, issue 27: 4 layers × 128, 4 heads of 32; 40
/// steps fused/unfused ×1.4 at T = 16, ×1.2 at 64, ×1.0–1.2 at 128, ×0.53
/// at 256): below it the unfused graph's small products cost less than
/// the fused kernels' per-row work on a CPU.
pub const CPU_FUSED_ATTENTION_MIN_SEQ: usize = 256;

impl AttentionKernel {
    /// The kernel to train sequences of `seq` positions, in heads of
    /// `head_dim` channels, with on `devices`: fused where every one
    /// shapes its kernels for a GPU, and on CPU adapters from
    /// [`CPU_FUSED_ATTENTION_MIN_SEQ`] positions for heads their
    /// register-blocked kernels hold; unfused otherwise, where the few
    /// small products of the unfused graph cost less than the fused
    /// kernels' per-row work (or, for wider heads, than the tiled kernels
    /// a CPU runs poorly).
    pub fn for_devices(devices: &[std::sync::Arc<crate::kernels::Kernels>], seq: usize, head_dim: usize) -> Self {
        let fused_pays = |k: &crate::kernels::Kernels| {
            k.gpu_shaped() || (seq >= CPU_FUSED_ATTENTION_MIN_SEQ && k.flash_rows_hold(head_dim))
        };
        if !devices.is_empty() && devices.iter().all(|k| fused_pays(k)) {
            AttentionKernel::Fused
        } else {
            AttentionKernel::Unfused
        }
    }
}

/// Causal self-attention of q [B, T, heads·d] over k, v [B, T,
/// kv_heads·d] (query head h reads KV head h / (heads / kv_heads)) ->
/// [B, T, heads·d], as `kernel` says. Heads wider than the fused kernel
/// takes go unfused.
pub fn causal_attention(
    g: &mut Graph,
    qkv: [Tensor; 3],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    kernel: AttentionKernel,
) -> Result<Tensor> {
    causal_attention_window(g, qkv, (heads, kv_heads, head_dim), kernel, None)
}

/// [`causal_attention`] of (heads, kv_heads, head_dim) with a sliding
/// window: query i sees keys i - window + 1 ..= i (None: 0 ..= i). The
/// unfused path adds a constant mask of -1e30 outside the window to the
/// scores before the causal softmax.
pub fn causal_attention_window(
    g: &mut Graph,
    [q, k, v]: [Tensor; 3],
    (heads, kv_heads, head_dim): (usize, usize, usize),
    kernel: AttentionKernel,
    window: Option<usize>,
) -> Result<Tensor> {
    let shape = g.shape_of(q).map(<[usize]>::to_vec).unwrap_or_default();
    let [b, t, _] = shape[..] else {
        return Err(Error::shape(
            "causal_attention",
            "expects q [batch, time, heads·head_dim]",
            &[&shape],
        ));
    };
    if kernel == AttentionKernel::Fused && head_dim <= FLASH_MAX_HEAD_DIM {
        return g.fused_causal_attention_window(q, k, v, heads, window);
    }
    let k = repeat_kv(g, k, kv_heads, heads / kv_heads.max(1), head_dim)?;
    let v = repeat_kv(g, v, kv_heads, heads / kv_heads.max(1), head_dim)?;
    // [B, T, H·d] -> [B, H, T, d]
    let mut split = Vec::with_capacity(3);
    for part in [q, k, v] {
        let part = g.reshape(part, &[b, t, heads, head_dim])?;
        split.push(g.permute(part, &[0, 2, 1, 3])?);
    }
    let scores = g.matmul_form(MatmulForm::ABt, split[0], split[1])?;
    let mut scores = g.scale(scores, 1.0 / (head_dim as f32).sqrt())?;
    if let Some(window) = window.filter(|&w| w < t) {
        let mask = window_mask(g, t, window)?;
        scores = g.add(scores, mask)?;
    }
    let att = g.softmax(scores, true)?;
    let y = g.matmul_form(MatmulForm::AB, att, split[2])?;
    let y = g.permute(y, &[0, 2, 1, 3])?;
    g.reshape(y, &[b, t, heads * head_dim])
}

/// The additive mask of a sliding window over [T, T] scores: 0 where query
/// i sees key j (i - window < j), -1e30 before (the causal softmax masks
/// after): exp of a masked score is 0, and every row keeps its diagonal.
fn window_mask(g: &mut Graph, t: usize, window: usize) -> Result<Tensor> {
    if window == 0 {
        return Err(Error::shape(
            "causal_attention",
            "a sliding window must hold at least 1 position",
            &[&[t, window]],
        ));
    }
    let mask = (0..t * t)
        .map(|at| if at / t >= at % t + window { -1e30 } else { 0.0 })
        .collect();
    g.constant(&format!("window_mask{window}"), &[t, t], mask)
}

/// Causal multi-head self-attention over x [B, T, C]: one projection to q,
/// k, v (`c_attn`), softmax(q·kᵀ/√d) with a causal mask per head, and an
/// output projection (`c_proj`), as nanoGPT's CausalSelfAttention.
#[derive(Clone, Debug, PartialEq)]
pub struct CausalSelfAttention {
    pub n_embd: usize,
    pub n_head: usize,
    pub c_attn: Linear,
    pub c_proj: Linear,
    pub attention: AttentionKernel,
}

impl CausalSelfAttention {
    /// PyTorch's default Linear init.
    pub fn new(n_embd: usize, n_head: usize) -> Result<Self> {
        Self::check(n_embd, n_head)?;
        Ok(CausalSelfAttention {
            n_embd,
            n_head,
            c_attn: Linear::new(n_embd, 3 * n_embd),
            c_proj: Linear::new(n_embd, n_embd),
            attention: AttentionKernel::default(),
        })
    }

    /// GPT-2's init: N(0, 0.02²) weights, and `proj_std` for the output
    /// projection (0.02/√(2·layers) in GPT-2).
    pub fn normal(n_embd: usize, n_head: usize, proj_std: f32) -> Result<Self> {
        Self::check(n_embd, n_head)?;
        Ok(CausalSelfAttention {
            n_embd,
            n_head,
            c_attn: Linear::normal(n_embd, 3 * n_embd, 0.02),
            c_proj: Linear::normal(n_embd, n_embd, proj_std),
            attention: AttentionKernel::default(),
        })
    }

    fn check(n_embd: usize, n_head: usize) -> Result<()> {
        if n_head == 0 || n_embd == 0 || n_embd % n_head != 0 {
            return Err(Error::InvalidArgument {
                op: "CausalSelfAttention",
                reason: format!("n_embd {n_embd} must be a positive multiple of n_head {n_head}"),
            });
        }
        Ok(())
    }
}

impl Module for CausalSelfAttention {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [_, _, c] = shape[..] else {
            return Err(Error::shape(
                "CausalSelfAttention",
                "expects x [batch, time, channels]",
                &[&shape],
            ));
        };
        if c != self.n_embd {
            return Err(Error::shape(
                "CausalSelfAttention",
                format!("expects {} channels", self.n_embd),
                &[&shape],
            ));
        }
        let d = c / self.n_head;
        let ranks = shard::ranks();
        if ranks > self.n_head {
            return Err(Error::InvalidArgument {
                op: "CausalSelfAttention",
                reason: format!("{ranks} devices need at least one attention head each, but the model has {} heads: use at most {} devices", self.n_head, self.n_head),
            });
        }
        // Split over heads under tensor parallelism: q, k and v are three
        // blocks of c_attn's rows; this rank's heads are what it yields.
        let qkv = self.c_attn.forward_split(
            g,
            x,
            &child_prefix!(prefix, self.c_attn),
            TensorSplit::Column { groups: 3, unit: d },
        )?;
        let local = g.shape_of(qkv).and_then(|s| s.last().copied()).unwrap_or(0) / 3;
        let h = local / d;
        if cache_pass().is_some() {
            // Generation: the fused rows straight into the KV cache.
            let y = cached_attention(g, prefix, [qkv; 3], QkvLayout::Fused, (h, h, d), None)?;
            return self
                .c_proj
                .forward_split(g, y, &child_prefix!(prefix, self.c_proj), TensorSplit::Row { unit: d });
        }
        let parts = g.split_last(qkv, &[local, local, local])?;
        let y = causal_attention(g, [parts[0], parts[1], parts[2]], h, h, d, self.attention)?;
        self.c_proj
            .forward_split(g, y, &child_prefix!(prefix, self.c_proj), TensorSplit::Row { unit: d })
    }

    fn describe(&self) -> String {
        format!("CausalSelfAttention(n_embd={}, n_head={})", self.n_embd, self.n_head)
    }
}

parameter_tree!(CausalSelfAttention { c_attn, c_proj });

/// The transformer MLP: `c_fc` to 4·C, GELU (tanh), `c_proj` back to C.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    pub c_fc: Linear,
    pub c_proj: Linear,
}

impl Mlp {
    pub fn new(n_embd: usize) -> Self {
        Mlp {
            c_fc: Linear::new(n_embd, 4 * n_embd),
            c_proj: Linear::new(4 * n_embd, n_embd),
        }
    }

    /// GPT-2's init (see [`CausalSelfAttention::normal`]).
    pub fn normal(n_embd: usize, proj_std: f32) -> Self {
        Mlp {
            c_fc: Linear::normal(n_embd, 4 * n_embd, 0.02),
            c_proj: Linear::normal(4 * n_embd, n_embd, proj_std),
        }
    }
}

impl Module for Mlp {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        // On rows as a matrix, so the plan fuses bias and GELU into c_fc's
        // matmul and GELU's backward into the matmul feeding it.
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let rows = shape[..shape.len().saturating_sub(1)].iter().product::<usize>();
        let flat = if shape.len() > 2 {
            g.reshape(x, &[rows, self.c_fc.in_features])?
        } else {
            x
        };
        // Megatron's MLP: c_fc column-parallel, c_proj row-parallel.
        let hidden = self.c_fc.forward_split(
            g,
            flat,
            &child_prefix!(prefix, self.c_fc),
            TensorSplit::Column { groups: 1, unit: 1 },
        )?;
        let hidden = Layer::GELU.forward(g, hidden, prefix)?;
        let y = self.c_proj.forward_split(
            g,
            hidden,
            &child_prefix!(prefix, self.c_proj),
            TensorSplit::Row { unit: 1 },
        )?;
        if shape.len() > 2 {
            g.reshape(y, &shape)
        } else {
            Ok(y)
        }
    }

    fn describe(&self) -> String {
        format!("Mlp({}, {})", self.c_fc.in_features, self.c_fc.out_features)
    }
}

parameter_tree!(Mlp { c_fc, c_proj });

/// A pre-norm GPT block: x + attn(ln_1(x)), then + mlp(ln_2(x)). Without
/// `attn` it is an MLP-only block (a baseline that cannot look at other
/// positions).
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub ln_1: LayerNorm,
    pub attn: Option<CausalSelfAttention>,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
}

impl Block {
    pub fn new(n_embd: usize, n_head: usize) -> Result<Self> {
        Ok(Block {
            ln_1: LayerNorm::new(n_embd),
            attn: Some(CausalSelfAttention::new(n_embd, n_head)?),
            ln_2: LayerNorm::new(n_embd),
            mlp: Mlp::new(n_embd),
        })
    }

    /// GPT-2's init for a model of `n_layer` blocks.
    pub fn gpt2(n_embd: usize, n_head: usize, n_layer: usize) -> Result<Self> {
        let proj_std = 0.02 / (2.0 * n_layer.max(1) as f32).sqrt();
        Ok(Block {
            ln_1: LayerNorm::new(n_embd),
            attn: Some(CausalSelfAttention::normal(n_embd, n_head, proj_std)?),
            ln_2: LayerNorm::new(n_embd),
            mlp: Mlp::normal(n_embd, proj_std),
        })
    }

    /// A block with no attention: each position on its own.
    pub fn mlp_only(n_embd: usize) -> Self {
        Block {
            ln_1: LayerNorm::new(n_embd),
            attn: None,
            ln_2: LayerNorm::new(n_embd),
            mlp: Mlp::new(n_embd),
        }
    }

    /// [`Block::mlp_only`] with GPT-2's init for a model of `n_layer` blocks.
    pub fn mlp_only_gpt2(n_embd: usize, n_layer: usize) -> Self {
        let proj_std = 0.02 / (2.0 * n_layer.max(1) as f32).sqrt();
        Block {
            ln_1: LayerNorm::new(n_embd),
            attn: None,
            ln_2: LayerNorm::new(n_embd),
            mlp: Mlp::normal(n_embd, proj_std),
        }
    }
}

impl Module for Block {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let mut x = x;
        if let Some(attn) = &self.attn {
            let normed = self.ln_1.forward(g, x, &child_prefix!(prefix, self.ln_1))?;
            let attended = attn.forward(g, normed, &child_prefix!(prefix, self.attn))?;
            x = shard::reduce_residual(g, x, attended)?;
        }
        let normed = self.ln_2.forward(g, x, &child_prefix!(prefix, self.ln_2))?;
        let transformed = self.mlp.forward(g, normed, &child_prefix!(prefix, self.mlp))?;
        shard::reduce_residual(g, x, transformed)
    }

    fn describe(&self) -> String {
        match &self.attn {
            Some(a) => format!("Block({}, {})", a.describe(), self.mlp.describe()),
            None => format!("Block({})", self.mlp.describe()),
        }
    }
}

// ln_1 feeds only the attention: a block without one has no ln_1 parameters.
parameter_tree!(Block { ln_1 if attn, attn, ln_2, mlp });
