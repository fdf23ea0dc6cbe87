//! Softmax over the last dimension (optionally causal) and its backward.

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;

/// Softmax and its backward.
#[derive(Clone, Debug, PartialEq)]
pub enum SoftmaxOp {
    /// Softmax over the last dimension; `causal` masks column j > row i of
    /// each trailing [T, T] block.
    Softmax { causal: bool },
    /// inputs (y, dy) of a softmax.
    SoftmaxBackward,
}

impl OpFamily for SoftmaxOp {
    fn name(&self) -> &'static str {
        match self {
            SoftmaxOp::Softmax { .. } => "softmax",
            SoftmaxOp::SoftmaxBackward => "softmax_backward",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (rows, cols) = flat_rows_cols(cx.shape());
        match self {
            SoftmaxOp::Softmax { causal } => {
                cx.kernels()
                    .softmax_forward(cx.out()?, cx.input(0)?, rows, cols, causal.then_some(cols))
            }
            SoftmaxOp::SoftmaxBackward => {
                cx.kernels()
                    .softmax_backward(cx.out()?, cx.input(0)?, cx.input(1)?, rows, cols)
            }
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        match (self, slot) {
            (SoftmaxOp::Softmax { .. }, 0) => {
                let (shape, name) = (g.node(node).shape.clone(), format!("d{}", g.node(node).name));
                Ok(g.push(SoftmaxOp::SoftmaxBackward, vec![node, dy], shape, DType::F32, name))
            }
            _ => Err(super::no_gradient(g, node, slot)),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let (rows, cols) = flat_rows_cols(cx.shape());
        match self {
            SoftmaxOp::Softmax { causal } => Ok(cpu::softmax_forward(cx.input(0)?, rows, cols, causal.then_some(cols))),
            SoftmaxOp::SoftmaxBackward => Ok(cpu::softmax_backward(cx.input(0)?, cx.input(1)?, rows, cols)),
        }
    }
}

impl Graph {
    /// Softmax over the last dimension. `causal`: scores [.., T, T] where
    /// query i sees keys 0..=i only (the rest get probability 0).
    pub fn softmax(&mut self, x: Tensor, causal: bool) -> Result<Tensor> {
        const OP: &str = "softmax";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        rows_cols(OP, &sx, &[&sx])?;
        if causal && sx[sx.len() - 2] != sx[sx.len() - 1] {
            return Err(Error::shape(OP, "a causal mask needs square [.., T, T] scores", &[&sx]));
        }
        Ok(self.push(
            SoftmaxOp::Softmax { causal },
            vec![x],
            sx,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
