//! Ops that move elements: reshape (no kernel: a view of its input's
//! storage, which the plan aliases), permute, and slicing, padding and
//! concatenating along the last dimension.

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;

/// Ops that move elements without arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub enum LayoutOp {
    /// The input's elements under a new shape: no kernel, the output shares
    /// the input's storage.
    Reshape,
    /// A copy with axes reordered: output dim i is input dim perm[i].
    Permute(Vec<usize>),
    /// Columns `start..start + width` of the last dimension (width is the
    /// output's last dimension).
    SliceLast { start: usize },
    /// The input placed at columns `start..` of a zero tensor (the
    /// gradient of [`LayoutOp::SliceLast`]).
    PadLast { start: usize },
    /// inputs (a, b): [.., a_cols] and [.., b_cols] side by side.
    ConcatLast,
}

/// The last dimension of a shape the builder checked (rank ≥ 1).
fn last(shape: &[usize]) -> usize {
    shape.last().copied().unwrap_or(1)
}

impl OpFamily for LayoutOp {
    fn name(&self) -> &'static str {
        match self {
            LayoutOp::Reshape => "reshape",
            LayoutOp::Permute(_) => "permute",
            LayoutOp::SliceLast { .. } => "slice",
            LayoutOp::PadLast { .. } => "pad",
            LayoutOp::ConcatLast => "concat",
        }
    }

    fn has_kernel(&self) -> bool {
        *self != LayoutOp::Reshape
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, out, x) = (cx.kernels(), cx.out()?, cx.input(0)?);
        let (rows, x_cols) = flat_rows_cols(cx.input_shape(0));
        match self {
            LayoutOp::Permute(perm) => k.permute(out, x, cx.input_shape(0), perm),
            LayoutOp::SliceLast { start } => k.slice_last(out, x, rows, x_cols, *start, last(cx.shape())),
            LayoutOp::PadLast { start } => k.pad_last(false, out, x, rows, last(cx.shape()), *start, x_cols),
            LayoutOp::ConcatLast => k.concat_last(out, x, cx.input(1)?, rows, x_cols, last(cx.input_shape(1))),
            LayoutOp::Reshape => Err(cx.no_kernel()),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let inputs = g.node(node).inputs.clone();
        let in_shape = g.shape(inputs[slot]).to_vec();
        match (self, slot) {
            (LayoutOp::Reshape, 0) => g.reshape(dy, &in_shape),
            (LayoutOp::Permute(perm), 0) => {
                let mut inverse = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inverse[p] = i;
                }
                g.permute(dy, &inverse)
            }
            (LayoutOp::SliceLast { start }, 0) => g.pad_last(dy, *start, last(&in_shape)),
            (LayoutOp::PadLast { start }, 0) => g.slice_last(dy, *start, last(&in_shape)),
            (LayoutOp::ConcatLast, _) => {
                let start = if slot == 0 { 0 } else { last(g.shape(inputs[0])) };
                g.slice_last(dy, start, last(&in_shape))
            }
            _ => Err(super::no_gradient(g, node, slot)),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let x = cx.input(0)?;
        let (rows, x_cols) = flat_rows_cols(cx.input_shape(0));
        match self {
            LayoutOp::Reshape => Ok(x.to_vec()),
            LayoutOp::Permute(perm) => cpu::permute(x, cx.input_shape(0), perm),
            LayoutOp::SliceLast { start } => Ok(cpu::slice_last(x, rows, x_cols, *start, last(cx.shape()))),
            LayoutOp::PadLast { start } => Ok(cpu::pad_last(x, rows, last(cx.shape()), *start, x_cols)),
            LayoutOp::ConcatLast => Ok(cpu::concat_last(x, cx.input(1)?, rows, x_cols, last(cx.input_shape(1)))),
        }
    }
}

impl Graph {
    /// The same elements under a new shape (same count): no copy.
    pub fn reshape(&mut self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "reshape";
        self.check_handle(OP, x)?;
        Self::non_empty(OP, shape)?;
        let sx = self.shape(x).to_vec();
        if shape.iter().product::<usize>() != sx.iter().product::<usize>() {
            return Err(Error::shape(OP, "the element count must not change", &[&sx, shape]));
        }
        let dtype = self.node(x).dtype;
        Ok(self.push(
            LayoutOp::Reshape,
            vec![x],
            shape.to_vec(),
            dtype,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// Axes reordered (a copy): output dimension i is input dimension perm[i].
    pub fn permute(&mut self, x: Tensor, perm: &[usize]) -> Result<Tensor> {
        const OP: &str = "permute";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let mut seen = vec![false; sx.len()];
        for &p in perm {
            if p >= sx.len() || std::mem::replace(&mut seen[p], true) {
                return Err(Error::shape(
                    OP,
                    format!("{perm:?} is not a permutation of the input's axes"),
                    &[&sx, perm],
                ));
            }
        }
        if perm.len() != sx.len() {
            return Err(Error::shape(
                OP,
                format!("{perm:?} is not a permutation of the input's axes"),
                &[&sx, perm],
            ));
        }
        let shape: Vec<usize> = perm.iter().map(|&p| sx[p]).collect();
        Ok(self.push(
            LayoutOp::Permute(perm.to_vec()),
            vec![x],
            shape,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// Swaps two axes (a copy).
    pub fn transpose(&mut self, x: Tensor, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.check_handle("transpose", x)?;
        let rank = self.shape(x).len();
        if dim0 >= rank || dim1 >= rank {
            return Err(Error::shape(
                "transpose",
                format!("axes {dim0} and {dim1} of a rank-{rank} tensor"),
                &[self.shape(x)],
            ));
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(dim0, dim1);
        self.permute(x, &perm)
    }

    /// Columns `start..start + width` of the last dimension (a copy).
    pub fn slice_last(&mut self, x: Tensor, start: usize, width: usize) -> Result<Tensor> {
        const OP: &str = "slice";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = rows_cols(OP, &sx, &[&sx])?;
        if width == 0 || start.checked_add(width).is_none_or(|end| end > cols) {
            return Err(Error::shape(
                OP,
                format!("columns {start}..{} of {cols}", start.saturating_add(width)),
                &[&sx],
            ));
        }
        let mut shape = sx.clone();
        if let Some(last) = shape.last_mut() {
            *last = width;
        }
        Ok(self.push(
            LayoutOp::SliceLast { start },
            vec![x],
            shape,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// Splits the last dimension into pieces of the given widths (q, k and
    /// v from one projection), like torch.split.
    pub fn split_last(&mut self, x: Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.check_handle("split", x)?;
        let sx = self.shape(x).to_vec();
        if widths.iter().sum::<usize>() != sx.last().copied().unwrap_or(0) {
            return Err(Error::shape(
                "split",
                format!("widths {widths:?} do not add up to the last dimension"),
                &[&sx, widths],
            ));
        }
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let piece = self.slice_last(x, start, w);
                start += w;
                piece
            })
            .collect()
    }

    /// x[.., width] placed at columns `start..` of a zero [.., cols] tensor.
    pub(crate) fn pad_last(&mut self, x: Tensor, start: usize, cols: usize) -> Result<Tensor> {
        const OP: &str = "pad";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, width) = rows_cols(OP, &sx, &[&sx])?;
        if start.checked_add(width).is_none_or(|end| end > cols) {
            return Err(Error::shape(
                OP,
                format!("columns {start}..{} of {cols}", start + width),
                &[&sx],
            ));
        }
        let mut shape = sx.clone();
        if let Some(last) = shape.last_mut() {
            *last = cols;
        }
        Ok(self.push(
            LayoutOp::PadLast { start },
            vec![x],
            shape,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// Tensors side by side along the last dimension (equal leading shapes),
    /// like torch.cat(.., dim=-1).
    pub fn concat_last(&mut self, parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "concat";
        let (&first, rest) = parts.split_first().ok_or_else(|| Error::InvalidArgument {
            op: OP,
            reason: "nothing to concatenate".into(),
        })?;
        self.f32_inputs(OP, parts)?;
        rest.iter().try_fold(first, |acc, &b| {
            let (sa, sb) = (self.shape(acc).to_vec(), self.shape(b).to_vec());
            rows_cols(OP, &sa, &[&sa, &sb])?;
            rows_cols(OP, &sb, &[&sa, &sb])?;
            if sa.len() != sb.len() || sa[..sa.len() - 1] != sb[..sb.len() - 1] {
                return Err(Error::shape(OP, "leading dimensions must be equal", &[&sa, &sb]));
            }
            let mut shape = sa.clone();
            if let Some(last) = shape.last_mut() {
                *last += sb[sb.len() - 1];
            }
            Ok(self.push(
                LayoutOp::ConcatLast,
                vec![acc, b],
                shape,
                DType::F32,
                format!("{OP}{}", self.nodes.len()),
            ))
        })
    }
}
