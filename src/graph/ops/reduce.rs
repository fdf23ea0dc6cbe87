//! Reductions: column sums (a bias gradient), the sum and mean of every
//! element, the sum down to a broadcast's source shape, and argmax.

use super::{not_mine, rows_cols as flat_rows_cols, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::broadcast_shape;

pub(super) struct Reductions;

impl OpFamily for Reductions {
    fn name(&self, op: &Op) -> &'static str {
        match op {
            Op::SumRows => "sum_rows",
            Op::Sum => "sum",
            Op::Mean => "mean",
            Op::SumTo => "sum_to",
            _ => "argmax",
        }
    }

    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, out, x) = (cx.kernels(), cx.out()?, cx.input(0)?);
        let (rows, cols) = flat_rows_cols(cx.input_shape(0));
        match op {
            Op::SumRows if cx.accumulate() => k.sum_rows_accumulate(out, x, rows, cols),
            Op::SumRows => k.sum_rows(out, x, rows, cols),
            Op::Sum => k.sum(out, x),
            Op::Mean => k.mean(out, x),
            Op::SumTo => k.reduce_to_shape(false, out, x, cx.input_shape(0), cx.shape()),
            Op::Argmax => k.argmax_rows(out, x, rows, cols),
            _ => Err(not_mine("reduction", op)),
        }
    }

    fn gradient(&self, op: &Op, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        match (op, slot) {
            // The mean's gradient dy/N at every element: a constant of 1/N
            // times dy, broadcast (one dispatch).
            (Op::Mean, 0) => {
                let n = g.node(node).clone();
                let in_shape = g.shape(n.inputs[0]).to_vec();
                let count = g.node(n.inputs[0]).len();
                let share = g.constant(&format!("{}.share", n.name), &in_shape, vec![1.0 / count as f32; count])?;
                g.mul(share, dy)
            }
            _ => Err(super::no_gradient(g, op, node, slot)),
        }
    }

    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let x = cx.input(0)?;
        let (rows, cols) = flat_rows_cols(cx.input_shape(0));
        match op {
            Op::SumRows => Ok(cpu::sum_rows(x, rows, cols)),
            Op::Sum => Ok(vec![cpu::sum(x)]),
            Op::Mean => Ok(vec![cpu::mean(x)]),
            Op::SumTo => cpu::reduce_to_shape(x, cx.input_shape(0), cx.shape()),
            Op::Argmax => Ok(cpu::argmax_rows(x, rows, cols).into_iter().map(f64::from).collect()),
            _ => Err(not_mine("reduction", op)),
        }
    }
}

impl Graph {
    /// Column sums: [.., cols] -> [cols].
    pub fn sum_rows(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum_rows", &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = rows_cols("sum_rows", &sx, &[&sx])?;
        Ok(self.push(Op::SumRows, vec![x], vec![cols], DType::F32, format!("sum_rows{}", self.nodes.len())))
    }

    /// Sum of every element -> [1].
    pub fn sum(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum", &[x])?;
        Ok(self.push(Op::Sum, vec![x], vec![1], DType::F32, format!("sum{}", self.nodes.len())))
    }

    /// Mean of every element -> [1].
    pub fn mean(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("mean", &[x])?;
        Ok(self.push(Op::Mean, vec![x], vec![1], DType::F32, format!("mean{}", self.nodes.len())))
    }

    /// Index of each row's maximum: [.., cols] -> u32 [..].
    pub fn argmax(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("argmax", &[x])?;
        let sx = self.shape(x).to_vec();
        rows_cols("argmax", &sx, &[&sx])?;
        Ok(self.push(Op::Argmax, vec![x], sx[..sx.len() - 1].to_vec(), DType::U32, format!("argmax{}", self.nodes.len())))
    }

    /// Sums `x` down to `shape`, a shape `x`'s broadcasts from.
    pub(crate) fn sum_to(&mut self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "sum_to";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        if sx == shape {
            return Ok(x);
        }
        if broadcast_shape(&sx, shape).as_deref() != Some(sx.as_slice()) {
            return Err(Error::shape(OP, "the target does not broadcast to the input", &[&sx, shape]));
        }
        Ok(self.push(Op::SumTo, vec![x], shape.to_vec(), DType::F32, format!("{OP}{}", self.nodes.len())))
    }
}
