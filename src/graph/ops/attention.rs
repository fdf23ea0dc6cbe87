//! Fused causal self-attention (FlashAttention-2): one op for
//! softmax(q·kᵀ/√d, causal)·v with grouped-query heads, whose forward
//! keeps each row's log-sum-exp (a companion node) and whose backward
//! recomputes the probabilities tile by tile: no [T, T] tensor, forward or
//! backward. Its gradient is three nodes: the preprocessing D =
//! rowsum(dO ∘ O), dq, and dk with dv as its companion (one dispatch).
//!
//! q, k, v stay [B, T, heads·d] as the projections produce them (the
//! kernels index heads inside a row), so neither the models nor the
//! gradients permute to [B, H, T, d] and back.

use super::{no_gradient, unexpected_writer, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::{Dispatch, FlashAttentionShape, FLASH_MAX_HEAD_DIM};

/// Fused causal attention and the nodes of its gradient.
#[derive(Clone, Debug, PartialEq)]
pub enum AttentionOp {
    /// inputs (q [B, T, heads·d], k, v [B, T, kv_heads·d]) -> [B, T,
    /// heads·d]: softmax(q·kᵀ/√d, causal)·v per query head, head h reading
    /// KV head h / (heads / kv_heads). Its dispatch also fills the
    /// [`AttentionOp::FusedCausalStats`] node added right after it. With
    /// a `window`, query i sees keys i - window + 1 ..= i only.
    FusedCausal { heads: usize, window: Option<usize> },
    /// inputs (the attention's output): each row's log-sum-exp [B, heads,
    /// T], written by the attention's dispatch.
    FusedCausalStats,
    /// inputs (dy, the attention's output) -> D [B, heads, T] = rowsum(dy ∘ y).
    FusedCausalPrepare { heads: usize },
    /// inputs (dy, q, k, v, lse, D) -> dq.
    FusedCausalQueryBackward { heads: usize, window: Option<usize> },
    /// inputs (dy, q, k, v, lse, D) -> dk; its dispatch also fills the
    /// [`AttentionOp::FusedCausalValueBackward`] node added right after it.
    FusedCausalKeyValueBackward { heads: usize, window: Option<usize> },
    /// inputs (the dk node): dv, written by dk's dispatch.
    FusedCausalValueBackward,
}

/// The kernels' shape from q [B, T, heads·d] and k [B, T, kv_heads·d].
fn flash_shape(
    op: &'static str,
    (heads, window): (usize, Option<usize>),
    q: &[usize],
    k: &[usize],
) -> Result<FlashAttentionShape> {
    let (&[batch, seq, width], &[_, _, kv_width]) = (q, k) else {
        return Err(Error::shape(
            op,
            "q and k must be [batch, time, heads·head_dim]",
            &[q, k],
        ));
    };
    let head_dim = width / heads.max(1);
    Ok(FlashAttentionShape {
        batch,
        seq,
        heads,
        kv_heads: kv_width / head_dim.max(1),
        head_dim,
        window,
    })
}

impl OpFamily for AttentionOp {
    fn name(&self) -> &'static str {
        match self {
            AttentionOp::FusedCausal { .. } => "fused_causal_attention",
            AttentionOp::FusedCausalStats => "fused_causal_attention_stats",
            AttentionOp::FusedCausalPrepare { .. } => "fused_causal_attention_prepare",
            AttentionOp::FusedCausalQueryBackward { .. } => "fused_causal_attention_query_backward",
            AttentionOp::FusedCausalKeyValueBackward { .. } => "fused_causal_attention_key_value_backward",
            AttentionOp::FusedCausalValueBackward => "fused_causal_attention_value_backward",
        }
    }

    fn is_companion(&self) -> bool {
        matches!(
            self,
            AttentionOp::FusedCausalStats | AttentionOp::FusedCausalValueBackward
        )
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        const OP: &str = "Executor";
        match self {
            AttentionOp::FusedCausal { heads, window } => {
                let shape = flash_shape(OP, (*heads, *window), cx.input_shape(0), cx.input_shape(1))?;
                k.flash_attention_forward(
                    cx.out()?,
                    cx.view(cx.companion()?)?,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    shape,
                )
            }
            AttentionOp::FusedCausalPrepare { heads } => {
                // Only q's sizes matter here: k is q's shape for this purpose.
                let shape = flash_shape(OP, (*heads, None), cx.input_shape(1), cx.input_shape(1))?;
                k.flash_attention_backward_prepare(
                    cx.out()?,
                    cx.input(0)?,
                    cx.input(1)?,
                    FlashAttentionShape {
                        kv_heads: *heads,
                        ..shape
                    },
                )
            }
            AttentionOp::FusedCausalQueryBackward { heads, window } => {
                let shape = flash_shape(OP, (*heads, *window), cx.input_shape(1), cx.input_shape(2))?;
                k.flash_attention_backward_query(
                    cx.out()?,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    cx.input(3)?,
                    cx.input(4)?,
                    cx.input(5)?,
                    shape,
                )
            }
            AttentionOp::FusedCausalKeyValueBackward { heads, window } => {
                let shape = flash_shape(OP, (*heads, *window), cx.input_shape(1), cx.input_shape(2))?;
                let dv = cx.view(cx.companion()?)?;
                k.flash_attention_backward_key_value(
                    cx.out()?,
                    dv,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    cx.input(3)?,
                    cx.input(4)?,
                    cx.input(5)?,
                    shape,
                )
            }
            AttentionOp::FusedCausalStats | AttentionOp::FusedCausalValueBackward => Err(cx.no_kernel()),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let (AttentionOp::FusedCausal { heads, window }, 0..=2) = (self, slot) else {
            return Err(no_gradient(g, node, slot));
        };
        let (heads, window) = (*heads, *window);
        let n = g.node(node).clone();
        let lse = g.companion(node).ok_or_else(|| Error::NoGradient {
            op: "fused_causal_attention",
            input: n.name.clone(),
        })?;
        let (q, k, v) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        // One D and one dk/dv dispatch serve all three inputs' gradients.
        let find = |g: &Graph, op: AttentionOp, inputs: &[Tensor]| {
            g.nodes()
                .iter()
                .position(|m| m.op == op && m.inputs == inputs)
                .map(Tensor)
        };
        let prepare = AttentionOp::FusedCausalPrepare { heads };
        let delta = match find(g, prepare.clone(), &[dy, node]) {
            Some(t) => t,
            None => {
                let stats_shape = g.shape(lse).to_vec();
                g.push(
                    prepare,
                    vec![dy, node],
                    stats_shape,
                    DType::F32,
                    format!("{}.delta", n.name),
                )
            }
        };
        let inputs = vec![dy, q, k, v, lse, delta];
        if slot == 0 {
            let name = format!("d{}", g.node(q).name);
            return Ok(g.push(
                AttentionOp::FusedCausalQueryBackward { heads, window },
                inputs,
                g.shape(q).to_vec(),
                DType::F32,
                name,
            ));
        }
        let key_value = AttentionOp::FusedCausalKeyValueBackward { heads, window };
        let dk = match find(g, key_value.clone(), &inputs) {
            Some(t) => t,
            None => {
                let (dk_name, dv_name) = (format!("d{}", g.node(k).name), format!("d{}", g.node(v).name));
                let dk = g.push(key_value, inputs, g.shape(k).to_vec(), DType::F32, dk_name);
                g.push(
                    AttentionOp::FusedCausalValueBackward,
                    vec![dk],
                    g.shape(v).to_vec(),
                    DType::F32,
                    dv_name,
                );
                dk
            }
        };
        if slot == 1 {
            return Ok(dk);
        }
        g.companion(dk).ok_or_else(|| Error::NoGradient {
            op: "fused_causal_attention",
            input: g.node(v).name.clone(),
        })
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        const OP: &str = "evaluate_f64";
        match self {
            AttentionOp::FusedCausal { heads, window } => {
                let shape = flash_shape(OP, (*heads, *window), cx.input_shape(0), cx.input_shape(1))?;
                Ok(cpu::flash_attention_forward(cx.input(0)?, cx.input(1)?, cx.input(2)?, shape).0)
            }
            // What its writer's dispatch leaves beside its output.
            AttentionOp::FusedCausalStats => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::Attention(AttentionOp::FusedCausal { heads, window }) = writer.op else {
                    return Err(unexpected_writer("fused_causal_attention_stats", &writer.op));
                };
                let [q, k, v] = [0, 1, 2].map(|j| writer.inputs[j]);
                let shape = flash_shape(OP, (heads, window), cx.graph().shape(q), cx.graph().shape(k))?;
                Ok(cpu::flash_attention_forward(cx.value(q)?, cx.value(k)?, cx.value(v)?, shape).1)
            }
            AttentionOp::FusedCausalPrepare { heads } => {
                let shape = flash_shape(OP, (*heads, None), cx.input_shape(1), cx.input_shape(1))?;
                Ok(cpu::flash_attention_backward_prepare(cx.input(0)?, cx.input(1)?, shape))
            }
            AttentionOp::FusedCausalQueryBackward { heads, window }
            | AttentionOp::FusedCausalKeyValueBackward { heads, window } => {
                let shape = flash_shape(OP, (*heads, *window), cx.input_shape(1), cx.input_shape(2))?;
                let [dy, q, k, v, lse, delta] = [0, 1, 2, 3, 4, 5].map(|j| cx.input(j));
                let grads = cpu::flash_attention_backward(dy?, q?, k?, v?, lse?, delta?, shape);
                Ok(if matches!(self, AttentionOp::FusedCausalQueryBackward { .. }) {
                    grads.dq
                } else {
                    grads.dk
                })
            }
            AttentionOp::FusedCausalValueBackward => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::Attention(AttentionOp::FusedCausalKeyValueBackward { heads, window }) = writer.op else {
                    return Err(unexpected_writer("fused_causal_attention_value_backward", &writer.op));
                };
                let shape = flash_shape(
                    OP,
                    (heads, window),
                    cx.graph().shape(writer.inputs[1]),
                    cx.graph().shape(writer.inputs[2]),
                )?;
                let [dy, q, k, v, lse, delta] = [0, 1, 2, 3, 4, 5].map(|j| cx.value(writer.inputs[j]));
                Ok(cpu::flash_attention_backward(dy?, q?, k?, v?, lse?, delta?, shape).dv)
            }
        }
    }
}

impl Graph {
    /// Causal self-attention of `heads` query heads, fused
    /// (FlashAttention-2): softmax(q·kᵀ/√d, causal)·v per head, with q [B,
    /// T, heads·d] and k, v [B, T, kv_heads·d] (grouped-query: query head
    /// h reads KV head h / (heads / kv_heads); kv_heads = heads is
    /// multi-head) -> [B, T, heads·d], heads side by side. Memory O(B·heads·T)
    /// beside the operands, forward and backward; d ≤
    /// [`FLASH_MAX_HEAD_DIM`]. The unfused reference is q·kᵀ, scale,
    /// `softmax(.., true)`, ·v over [B, H, T, d].
    pub fn fused_causal_attention(&mut self, q: Tensor, k: Tensor, v: Tensor, heads: usize) -> Result<Tensor> {
        self.fused_causal_attention_window(q, k, v, heads, None)
    }

    /// [`Graph::fused_causal_attention`] with a sliding window: query i
    /// sees keys i - window + 1 ..= i (None: all of 0 ..= i; a window of at
    /// least T is no window). The kernels skip the key tiles outside it.
    pub fn fused_causal_attention_window(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        heads: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        const OP: &str = "fused_causal_attention";
        self.f32_inputs(OP, &[q, k, v])?;
        let (sq, sk, sv) = (self.shape(q).to_vec(), self.shape(k).to_vec(), self.shape(v).to_vec());
        let all: [&[usize]; 3] = [&sq, &sk, &sv];
        let [batch, seq, width] = sq[..] else {
            return Err(Error::shape(OP, "q must be [batch, time, heads·head_dim]", &all));
        };
        if heads == 0 || width % heads != 0 {
            return Err(Error::shape(
                OP,
                format!("{heads} heads must divide q's {width} columns"),
                &all,
            ));
        }
        let head_dim = width / heads;
        let kv_width = sk.last().copied().unwrap_or(0);
        if sk.len() != 3 || sk[..2] != [batch, seq] || kv_width % head_dim != 0 || sv != sk {
            return Err(Error::shape(
                OP,
                format!("k and v must both be [{batch}, {seq}, kv_heads·{head_dim}]"),
                &all,
            ));
        }
        let shape = FlashAttentionShape {
            batch,
            seq,
            heads,
            kv_heads: kv_width / head_dim,
            head_dim,
            window,
        };
        shape.check(OP, FLASH_MAX_HEAD_DIM)?;
        let y = self.push(
            AttentionOp::FusedCausal { heads, window },
            vec![q, k, v],
            sq,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        );
        self.push(
            AttentionOp::FusedCausalStats,
            vec![y],
            vec![batch, heads, seq],
            DType::F32,
            format!("{OP}{}.lse", y.0),
        );
        Ok(y)
    }
}
