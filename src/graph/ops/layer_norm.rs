//! The norms over the last dimension: LayerNorm and RMSNorm. A forward
//! dispatch also writes the rows' statistics into a node (a companion
//! added right after it), which the backward reads: mean and rstd for a
//! LayerNorm, rstd for an RMSNorm. A LayerNorm's weight and bias gradients
//! come from one dispatch, as two parts of one node.

use super::{not_mine, rows_cols as flat_rows_cols, stats_offset, two_parts, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::check_norm_eps;

pub(super) struct LayerNorms;

/// mean[rows] and rstd[rows], the two parts of a statistics node's value.
fn stats_parts(stats: &[f64], rows: usize) -> (&[f64], &[f64]) {
    (&stats[..rows], &stats[stats_offset(rows)..stats_offset(rows) + rows])
}

impl OpFamily for LayerNorms {
    fn name(&self, op: &Op) -> &'static str {
        match op {
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormStats => "layer_norm_stats",
            Op::LayerNormBackward => "layer_norm_backward",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormStats => "rms_norm_stats",
            Op::RmsNormBackward => "rms_norm_backward",
            Op::RmsNormWeightBackward => "rms_norm_weight_backward",
            _ => "layer_norm_params_backward",
        }
    }

    fn is_companion(&self, op: &Op) -> bool {
        matches!(op, Op::LayerNormStats | Op::RmsNormStats)
    }

    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        match op {
            Op::LayerNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = cx.halves(cx.companion()?, rows)?;
                k.layernorm_forward(cx.out()?, mean, rstd, cx.input(0)?, cx.input(1)?, cx.input(2)?, rows, cols, *eps)
            }
            Op::LayerNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = cx.halves(cx.read(3), rows)?;
                k.layernorm_backward(cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?, mean, rstd, rows, cols)
            }
            Op::LayerNormParamsBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                let (mean, rstd) = cx.halves(cx.read(2), rows)?;
                let (dweight, dbias) = cx.halves(Tensor(cx.node), cols)?;
                k.layernorm_backward_params(false, dweight, dbias, cx.input(0)?, cx.input(1)?, mean, rstd, rows, cols)
            }
            Op::RmsNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                k.rmsnorm_forward(cx.out()?, cx.view(cx.companion()?)?, cx.input(0)?, cx.input(1)?, rows, cols, *eps)
            }
            Op::RmsNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                k.rmsnorm_backward(cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?, cx.input(3)?, rows, cols)
            }
            Op::RmsNormWeightBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                k.rmsnorm_backward_params(cx.accumulate(), cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?, rows, cols)
            }
            _ => Err(not_mine("layer_norm", op)),
        }
    }

    fn gradient(&self, op: &Op, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        if let Op::RmsNorm { .. } = op {
            let n = g.node(node).clone();
            let stats = g.companion(node).ok_or_else(|| Error::NoGradient { op: "rms_norm", input: n.name.clone() })?;
            let (x, weight) = (n.inputs[0], n.inputs[1]);
            return Ok(if slot == 0 {
                let name = format!("d{}", g.node(x).name);
                g.push(Op::RmsNormBackward, vec![dy, x, weight, stats], n.shape.clone(), DType::F32, name)
            } else {
                let name = format!("d{}", g.node(weight).name);
                g.push(Op::RmsNormWeightBackward, vec![dy, x, stats], g.shape(weight).to_vec(), DType::F32, name)
            });
        }
        let Op::LayerNorm { .. } = op else { return Err(super::no_gradient(g, op, node, slot)) };
        let n = g.node(node).clone();
        let stats = g.companion(node).ok_or_else(|| Error::NoGradient { op: "layer_norm", input: n.name.clone() })?;
        let x = n.inputs[0];
        if slot == 0 {
            let name = format!("d{}", g.node(x).name);
            return Ok(g.push(Op::LayerNormBackward, vec![dy, x, n.inputs[1], stats], n.shape.clone(), DType::F32, name));
        }
        // Weight and bias gradients come from one dispatch: reuse it for
        // the second.
        let inputs = vec![dy, x, stats];
        let cols = g.shape(n.inputs[slot])[0];
        let existing = g.nodes().iter().position(|m| m.op == Op::LayerNormParamsBackward && m.inputs == inputs);
        let both = match existing {
            Some(i) => Tensor(i),
            None => g.push(Op::LayerNormParamsBackward, inputs, vec![1, stats_offset(cols) + cols], DType::F32, format!("d{}.params", n.name)),
        };
        let start = if slot == 1 { 0 } else { stats_offset(cols) };
        let part = g.slice_last(both, start, cols)?;
        g.reshape(part, &[cols])
    }

    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match op {
            Op::LayerNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::layernorm_forward(cx.input(0)?, cx.input(1)?, cx.input(2)?, rows, cols, *eps).y)
            }
            // What its writer's dispatch leaves beside its output.
            Op::LayerNormStats => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::LayerNorm { eps } = writer.op else { return Err(not_mine("layer_norm", &writer.op)) };
                let (rows, cols) = flat_rows_cols(&writer.shape);
                let [x, weight, bias] = [0, 1, 2].map(|j| cx.value(writer.inputs[j]));
                let forward = cpu::layernorm_forward(x?, weight?, bias?, rows, cols, eps);
                Ok(two_parts(forward.mean, forward.rstd, rows))
            }
            Op::LayerNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                let (mean, rstd) = stats_parts(cx.input(3)?, rows);
                Ok(cpu::layernorm_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?, mean, rstd, rows, cols).dx)
            }
            Op::LayerNormParamsBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                let (mean, rstd) = stats_parts(cx.input(2)?, rows);
                // dweight and dbias do not depend on the weight.
                let grads = cpu::layernorm_backward(cx.input(0)?, cx.input(1)?, &vec![1.0; cols], mean, rstd, rows, cols);
                Ok(two_parts(grads.dweight, grads.dbias, cols))
            }
            Op::RmsNorm { eps } => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::rmsnorm_forward(cx.input(0)?, cx.input(1)?, rows, cols, *eps).y)
            }
            Op::RmsNormStats => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let Op::RmsNorm { eps } = writer.op else { return Err(not_mine("layer_norm", &writer.op)) };
                let (rows, cols) = flat_rows_cols(&writer.shape);
                Ok(cpu::rmsnorm_forward(cx.value(writer.inputs[0])?, cx.value(writer.inputs[1])?, rows, cols, eps).rstd)
            }
            Op::RmsNormBackward => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                Ok(cpu::rmsnorm_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?, cx.input(3)?, rows, cols).dx)
            }
            Op::RmsNormWeightBackward => {
                let (rows, cols) = flat_rows_cols(cx.input_shape(1));
                // dweight does not depend on the weight.
                Ok(cpu::rmsnorm_backward(cx.input(0)?, cx.input(1)?, &vec![1.0; cols], cx.input(2)?, rows, cols).dweight)
            }
            _ => Err(not_mine("layer_norm", op)),
        }
    }
}

impl Graph {
    /// torch.nn.functional.layer_norm over the last dimension, with
    /// weight and bias [C].
    pub fn layer_norm(&mut self, x: Tensor, weight: Tensor, bias: Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        self.f32_inputs(OP, &[x, weight, bias])?;
        let (sx, sw, sb) = (self.shape(x).to_vec(), self.shape(weight).to_vec(), self.shape(bias).to_vec());
        let (rows, cols) = rows_cols(OP, &sx, &[&sx, &sw, &sb])?;
        if sw != [cols] || sb != [cols] {
            return Err(Error::shape(OP, format!("weight and bias must be [{cols}]"), &[&sx, &sw, &sb]));
        }
        check_norm_eps(OP, eps)?;
        let y = self.push(Op::LayerNorm { eps }, vec![x, weight, bias], sx, DType::F32, format!("{OP}{}", self.nodes.len()));
        let stats_len = stats_offset(rows) + rows;
        self.push(Op::LayerNormStats, vec![y], vec![stats_len], DType::F32, format!("{OP}{}.stats", y.0));
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
        let y = self.push(Op::RmsNorm { eps }, vec![x, weight], sx, DType::F32, format!("{OP}{}", self.nodes.len()));
        self.push(Op::RmsNormStats, vec![y], vec![rows], DType::F32, format!("{OP}{}.stats", y.0));
        Ok(y)
    }
}
