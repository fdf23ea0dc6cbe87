//! Reductions: column sums (a bias gradient), the sum and mean of every
//! element, the sum down to a broadcast's source shape, and argmax.

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::broadcast_shape;

/// Reductions.
#[derive(Clone, Debug, PartialEq)]
pub enum ReduceOp {
    /// Column sums of a matrix (the bias gradient).
    SumRows,
    Sum,
    Mean,
    /// Sums the input down to this node's shape (the gradient of a
    /// broadcast).
    SumTo,
    /// u32 index of each row's maximum.
    Argmax,
}

impl OpFamily for ReduceOp {
    fn name(&self) -> &'static str {
        match self {
            ReduceOp::SumRows => "sum_rows",
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::SumTo => "sum_to",
            ReduceOp::Argmax => "argmax",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, out, x) = (cx.kernels(), cx.out()?, cx.input(0)?);
        let (rows, cols) = flat_rows_cols(cx.input_shape(0));
        match self {
            ReduceOp::SumRows if cx.accumulate() => k.sum_rows_accumulate(out, x, rows, cols),
            ReduceOp::SumRows => k.sum_rows(out, x, rows, cols),
            ReduceOp::Sum => k.sum(out, x),
            ReduceOp::Mean => k.mean(out, x),
            ReduceOp::SumTo => k.reduce_to_shape(false, out, x, cx.input_shape(0), cx.shape()),
            ReduceOp::Argmax => k.argmax_rows(out, x, rows, cols),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        match (self, slot) {
            // The mean's gradient dy/N at every element: a constant of 1/N
            // times dy, broadcast (one dispatch).
            (ReduceOp::Mean, 0) => {
                let n = g.node(node).clone();
                let in_shape = g.shape(n.inputs[0]).to_vec();
                let count = g.node(n.inputs[0]).len();
                let share = g.constant(&format!("{}.share", n.name), &in_shape, vec![1.0 / count as f32; count])?;
                g.mul(share, dy)
            }
            _ => Err(super::no_gradient(g, node, slot)),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let x = cx.input(0)?;
        let (rows, cols) = flat_rows_cols(cx.input_shape(0));
        match self {
            ReduceOp::SumRows => Ok(cpu::sum_rows(x, rows, cols)),
            ReduceOp::Sum => Ok(vec![cpu::sum(x)]),
            ReduceOp::Mean => Ok(vec![cpu::mean(x)]),
            ReduceOp::SumTo => cpu::reduce_to_shape(x, cx.input_shape(0), cx.shape()),
            ReduceOp::Argmax => Ok(cpu::argmax_rows(x, rows, cols).into_iter().map(f64::from).collect()),
        }
    }
}

impl Graph {
    /// Column sums: [.., cols] -> [cols].
    pub fn sum_rows(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum_rows", &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = rows_cols("sum_rows", &sx, &[&sx])?;
        Ok(self.push(
            ReduceOp::SumRows,
            vec![x],
            vec![cols],
            DType::F32,
            format!("sum_rows{}", self.nodes.len()),
        ))
    }

    /// Sum of every element -> [1].
    pub fn sum(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum", &[x])?;
        Ok(self.push(
            ReduceOp::Sum,
            vec![x],
            vec![1],
            DType::F32,
            format!("sum{}", self.nodes.len()),
        ))
    }

    /// Mean of every element -> [1].
    pub fn mean(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("mean", &[x])?;
        Ok(self.push(
            ReduceOp::Mean,
            vec![x],
            vec![1],
            DType::F32,
            format!("mean{}", self.nodes.len()),
        ))
    }

    /// Index of each row's maximum: [.., cols] -> u32 [..].
    pub fn argmax(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("argmax", &[x])?;
        let sx = self.shape(x).to_vec();
        rows_cols("argmax", &sx, &[&sx])?;
        Ok(self.push(
            ReduceOp::Argmax,
            vec![x],
            sx[..sx.len() - 1].to_vec(),
            DType::U32,
            format!("argmax{}", self.nodes.len()),
        ))
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
            return Err(Error::shape(
                OP,
                "the target does not broadcast to the input",
                &[&sx, shape],
            ));
        }
        Ok(self.push(
            ReduceOp::SumTo,
            vec![x],
            shape.to_vec(),
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
