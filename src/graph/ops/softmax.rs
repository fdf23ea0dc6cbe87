//! Softmax over the last dimension (optionally causal) and its backward.

use super::{not_mine, rows_cols as flat_rows_cols, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;

pub(super) struct Softmaxes;

impl OpFamily for Softmaxes {
    fn name(&self, op: &Op) -> &'static str {
        match op {
            Op::Softmax { .. } => "softmax",
            _ => "softmax_backward",
        }
    }

    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (rows, cols) = flat_rows_cols(cx.shape());
        match op {
            Op::Softmax { causal } => cx.kernels().softmax_forward(cx.out()?, cx.input(0)?, rows, cols, causal.then_some(cols)),
            Op::SoftmaxBackward => cx.kernels().softmax_backward(cx.out()?, cx.input(0)?, cx.input(1)?, rows, cols),
            _ => Err(not_mine("softmax", op)),
        }
    }

    fn gradient(&self, op: &Op, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        match (op, slot) {
            (Op::Softmax { .. }, 0) => {
                let (shape, name) = (g.node(node).shape.clone(), format!("d{}", g.node(node).name));
                Ok(g.push(Op::SoftmaxBackward, vec![node, dy], shape, DType::F32, name))
            }
            _ => Err(super::no_gradient(g, op, node, slot)),
        }
    }

    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let (rows, cols) = flat_rows_cols(cx.shape());
        match op {
            Op::Softmax { causal } => Ok(cpu::softmax_forward(cx.input(0)?, rows, cols, causal.then_some(cols))),
            Op::SoftmaxBackward => Ok(cpu::softmax_backward(cx.input(0)?, cx.input(1)?, rows, cols)),
            _ => Err(not_mine("softmax", op)),
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
        Ok(self.push(Op::Softmax { causal }, vec![x], sx, DType::F32, format!("{OP}{}", self.nodes.len())))
    }
}
