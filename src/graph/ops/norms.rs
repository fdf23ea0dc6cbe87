//! The norms over the last dimension: LayerNorm and RMSNorm. A forward
//! dispatch also writes the rows' statistics into a node (a companion
//! added right after it), which the backward reads: mean and rstd for a
//! LayerNorm, rstd for an RMSNorm. A LayerNorm's weight and bias gradients
//! come from one dispatch, as two parts of one node.

use super::{
    rows_cols as flat_rows_cols, stats_offset, two_parts, unexpected_writer, DispatchContext, Op, OpFamily,
    ReferenceContext,
};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::check_norm_eps;

/// The norms over the last dimension and their statistics and backward nodes.
#[derive(Clone, Debug, PartialEq)]
pub enum NormOp {
    /// inputs (x, weight, bias): torch.nn.LayerNorm over the last
    /// dimension. Its dispatch also fills the [`NormOp::LayerNormStats`] node
    /// added right after it.
    LayerNorm { eps: f32 },
    /// inputs (y of the layernorm): mean[rows], then rstd[rows] at element
    /// [`stats_offset`]`(rows)`, written by the layernorm's dispatch.
    LayerNormStats,
    /// inputs (dy, x, weight, stats) -> dx.
    LayerNormBackward,
    /// inputs (dy, x, stats) -> dweight, then dbias at
    /// [`stats_offset`]`(cols)`.
    LayerNormParamsBackward,
    /// inputs (x, weight): torch.nn.RMSNorm over the last dimension. Its
    /// dispatch also fills the [`NormOp::RmsNormStats`] node added right after
    /// it.
    RmsNorm { eps: f32 },
    /// inputs (y of the RMSNorm): rstd[rows], written by its dispatch.
    RmsNormStats,
    /// inputs (dy, x, weight, stats) -> dx.
    RmsNormBackward,
    /// inputs (dy, x, stats) -> dweight.
    RmsNormWeightBackward,
}

/// mean[rows] and rstd[rows], the two parts of a statistics node's value.
fn stats_parts(stats: &[f64], rows: usize) -> (&[f64], &[f64]) {
    (&stats[..rows], &stats[stats_offset(rows)..stats_offset(rows) + rows])
}

impl OpFamily for NormOp {
    fn name(&self) -> &'static str {
        match self {
            NormOp::LayerNorm { .. } => "layer_norm",
            NormOp::LayerNormStats => "layer_norm_stats",
            NormOp::LayerNormBackward => "layer_norm_backward",
            NormOp::RmsNorm { .. } => "rms_norm",
            NormOp::RmsNormStats => "rms_norm_stats",
            NormOp::RmsNormBackward => "rms_norm_backward",
            NormOp::RmsNormWeightBackward => "rms_norm_weight_backward",
            NormOp::LayerNormParamsBackward => "layer_norm_params_backward",
        }
    }

    fn is_companion(&self) -> bool {
        matches!(self, NormOp::LayerNormStats | NormOp::RmsNormStats)
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        match self {
            NormOp::LayerNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = cx.halves(cx.companion()?, rows)?;
                k.layernorm_forward(
                    cx.out()?,
                    mean,
                    rstd,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    rows,
                    cols,
                    *eps,
                )
            }
            NormOp::LayerNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = cx.halves(cx.read(3), rows)?;
                k.layernorm_backward(
                    cx.out()?,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    mean,
                    rstd,
                    rows,
                    cols,
                )
            }
            NormOp::LayerNormParamsBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                let (mean, rstd) = cx.halves(cx.read(2), rows)?;
                let (dweight, dbias) = cx.halves(Tensor(cx.node), cols)?;
                k.layernorm_backward_params(
                    false,
                    dweight,
                    dbias,
                    cx.input(0)?,
                    cx.input(1)?,
                    mean,
                    rstd,
                    rows,
                    cols,
                )
            }
            NormOp::RmsNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                k.rmsnorm_forward(
                    cx.out()?,
                    cx.view(cx.companion()?)?,
                    cx.input(0)?,
                    cx.input(1)?,
                    rows,
                    cols,
                    *eps,
                )
            }
            NormOp::RmsNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                k.rmsnorm_backward(
                    cx.out()?,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    cx.input(3)?,
                    rows,
                    cols,
                )
            }
            NormOp::RmsNormWeightBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                k.rmsnorm_backward_params(
                    cx.accumulate(),
                    cx.out()?,
                    cx.input(0)?,
                    cx.input(1)?,
                    cx.input(2)?,
                    rows,
                    cols,
                )
            }
            NormOp::LayerNormStats | NormOp::RmsNormStats => Err(cx.no_kernel()),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        if let NormOp::RmsNorm { .. } = self {
            let n = g.node(node).clone();
            let stats = g.companion(node).ok_or_else(|| Error::NoGradient {
                op: "rms_norm",
                input: n.name.clone(),
            })?;
            let (x, weight) = (n.inputs[0], n.inputs[1]);
            return Ok(if slot == 0 {
                let name = format!("d{}", g.node(x).name);
                g.push(
                    NormOp::RmsNormBackward,
                    vec![dy, x, weight, stats],
                    n.shape.clone(),
                    DType::F32,
                    name,
                )
            } else {
                let name = format!("d{}", g.node(weight).name);
                g.push(
                    NormOp::RmsNormWeightBackward,
                    vec![dy, x, stats],
                    g.shape(weight).to_vec(),
                    DType::F32,
                    name,
                )
            });
        }
        let NormOp::LayerNorm { .. } = self else {
            return Err(super::no_gradient(g, node, slot));
        };
        let n = g.node(node).clone();
        let stats = g.companion(node).ok_or_else(|| Error::NoGradient {
            op: "layer_norm",
            input: n.name.clone(),
        })?;
        let x = n.inputs[0];
        if slot == 0 {
            let name = format!("d{}", g.node(x).name);
            return Ok(g.push(
                NormOp::LayerNormBackward,
                vec![dy, x, n.inputs[1], stats],
                n.shape.clone(),
                DType::F32,
                name,
            ));
        }
        // Weight and bias gradients come from one dispatch: reuse it for
        // the second.
        let inputs = vec![dy, x, stats];
        let cols = g.shape(n.inputs[slot])[0];
        let existing = g
            .nodes()
            .iter()
            .position(|m| m.op == NormOp::LayerNormParamsBackward && m.inputs == inputs);
        let both = match existing {
            Some(i) => Tensor(i),
            None => g.push(
                NormOp::LayerNormParamsBackward,
                inputs,
                vec![1, stats_offset(cols) + cols],
                DType::F32,
                format!("d{}.params", n.name),
            ),
        };
        let start = if slot == 1 { 0 } else { stats_offset(cols) };
        let part = g.slice_last(both, start, cols)?;
        g.reshape(part, &[cols])
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match self {
            NormOp::LayerNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::layernorm_forward(cx.input(0)?, cx.input(1)?, cx.input(2)?, rows, cols, *eps).y)
            }
            // What its writer's dispatch leaves beside its output.
            NormOp::LayerNormStats => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::Norm(NormOp::LayerNorm { eps }) = writer.op else {
                    return Err(unexpected_writer("layer_norm_stats", &writer.op));
                };
                let (rows, cols) = flat_rows_cols(&writer.shape);
                let [x, weight, bias] = [0, 1, 2].map(|j| cx.value(writer.inputs[j]));
                let forward = cpu::layernorm_forward(x?, weight?, bias?, rows, cols, eps);
                Ok(two_parts(forward.mean, forward.rstd, rows))
            }
            NormOp::LayerNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = stats_parts(cx.input(3)?, rows);
                Ok(cpu::layernorm_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?, mean, rstd, rows, cols).dx)
            }
            NormOp::LayerNormParamsBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                let (mean, rstd) = stats_parts(cx.input(2)?, rows);
                // dweight and dbias do not depend on the weight.
                let grads =
                    cpu::layernorm_backward(cx.input(0)?, cx.input(1)?, &vec![1.0; cols], mean, rstd, rows, cols);
                Ok(two_parts(grads.dweight, grads.dbias, cols))
            }
            NormOp::RmsNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::rmsnorm_forward(cx.input(0)?, cx.input(1)?, rows, cols, *eps).y)
            }
            NormOp::RmsNormStats => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::Norm(NormOp::RmsNorm { eps }) = writer.op else {
                    return Err(unexpected_writer("rms_norm_stats", &writer.op));
                };
                let (rows, cols) = flat_rows_cols(&writer.shape);
                Ok(cpu::rmsnorm_forward(
                    cx.value(writer.inputs[0])?,
                    cx.value(writer.inputs[1])?,
                    rows,
                    cols,
                    eps,
                )
                .rstd)
            }
            NormOp::RmsNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::rmsnorm_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?, cx.input(3)?, rows, cols).dx)
            }
            NormOp::RmsNormWeightBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                // dweight does not depend on the weight.
                Ok(
                    cpu::rmsnorm_backward(cx.input(0)?, cx.input(1)?, &vec![1.0; cols], cx.input(2)?, rows, cols)
                        .dweight,
                )
            }
        }
    }
}

impl Graph {
    /// torch.nn.functional.layer_norm over the last dimension, with
    /// weight and bias [C].
    pub fn layer_norm(&mut self, x: Tensor, weight: Tensor, bias: Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        self.f32_inputs(OP, &[x, weight, bias])?;
        let (sx, sw, sb) = (
            self.shape(x).to_vec(),
            self.shape(weight).to_vec(),
            self.shape(bias).to_vec(),
        );
        let (rows, cols) = rows_cols(OP, &sx, &[&sx, &sw, &sb])?;
        if sw != [cols] || sb != [cols] {
            return Err(Error::shape(
                OP,
                format!("weight and bias must be [{cols}]"),
                &[&sx, &sw, &sb],
            ));
        }
        check_norm_eps(OP, eps)?;
        let y = self.push(
            NormOp::LayerNorm { eps },
            vec![x, weight, bias],
            sx,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        );
        let stats_len = stats_offset(rows) + rows;
        self.push(
            NormOp::LayerNormStats,
            vec![y],
            vec![stats_len],
            DType::F32,
            format!("{OP}{}.stats", y.0),
        );
        Ok(y)
    }

    /// torch.nn.functional.rms_norm over the last dimension (Llama's
    /// RMSNorm): x · rsqrt(mean(x²) + eps) · weight, with weight [C].
    pub fn rms_norm(&mut self, x: Tensor, weight: Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        self.f32_inputs(OP, &[x, weight])?;
        let (sx, sw) = (self.shape(x).to_vec(), self.shape(weight).to_vec());
        let (rows, cols) = rows_cols(OP, &sx, &[&sx, &sw])?;
        if sw != [cols] {
            return Err(Error::shape(OP, format!("weight must be [{cols}]"), &[&sx, &sw]));
        }
        check_norm_eps(OP, eps)?;
        let y = self.push(
            NormOp::RmsNorm { eps },
            vec![x, weight],
            sx,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        );
        self.push(
            NormOp::RmsNormStats,
            vec![y],
            vec![rows],
            DType::F32,
            format!("{OP}{}.stats", y.0),
        );
        Ok(y)
    }
}
