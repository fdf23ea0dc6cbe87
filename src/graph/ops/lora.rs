//! The gathered low-rank products of many LoRA adapters over one base
//! (S-LoRA, Punica): each sequence of a batch names its adapter in a u32
//! input, so requests with different adapters run in one pass, each row
//! applying its own ([`LoraShape`]). Inference only: no gradients (an
//! adapter is trained by `nn::Lora`, one at a time).

use super::{rows_cols, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::{LoraShape, LORA_META, NO_ADAPTER};

/// The shrink and the expand.
#[derive(Clone, Debug, PartialEq)]
pub enum LoraOp {
    /// inputs (x [.., cols], a [ranks, cols], meta [adapters, 3], u32 index
    /// [seqs]) -> h [.., width]: each row times its adapter's A (see
    /// `Kernels::lora_shrink`). No gradient.
    Shrink { width: usize },
    /// inputs (y [.., cols], h [.., width], bt [ranks, cols], meta, index)
    /// -> y plus each row's adapter's scaled B·h (see
    /// `Kernels::lora_expand`). No gradient.
    Expand,
}

/// The kernels' sizes of a node of this family: rows and columns of its
/// input 0 (x or y), the width of h, the stacked rows (input 1 of a shrink,
/// input 2 of an expand), the adapters (meta's rows) and the sequences.
fn lora_shape(g: &Graph, node: Tensor) -> LoraShape {
    let n = g.node(node);
    let (rows, cols) = rows_cols(g.shape(n.inputs[0]));
    let (width, stacked, meta, index) = match n.op {
        Op::Lora(LoraOp::Shrink { width }) => (width, n.inputs[1], n.inputs[2], n.inputs[3]),
        _ => (rows_cols(g.shape(n.inputs[1])).1, n.inputs[2], n.inputs[3], n.inputs[4]),
    };
    LoraShape {
        seqs: g.node(index).len(),
        rows,
        cols,
        width,
        adapters: g.shape(meta)[0],
        ranks: g.shape(stacked)[0],
    }
}

/// f64 values as the f32 the kernels read.
fn narrow(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

impl OpFamily for LoraOp {
    fn name(&self) -> &'static str {
        match self {
            LoraOp::Shrink { .. } => "lora_shrink",
            LoraOp::Expand => "lora_expand",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let shape = lora_shape(cx.graph(), Tensor(cx.node));
        let k = cx.kernels();
        match self {
            LoraOp::Shrink { .. } => {
                k.lora_shrink(cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?, cx.input(3)?, shape)
            }
            LoraOp::Expand => k.lora_expand(
                cx.out()?,
                cx.input(0)?,
                cx.input(1)?,
                cx.input(2)?,
                cx.input(3)?,
                cx.input(4)?,
                shape,
            ),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let shape = lora_shape(cx.graph(), cx.node);
        match self {
            LoraOp::Shrink { .. } => Ok(cpu::lora_shrink(
                cx.input(0)?,
                cx.input(1)?,
                &narrow(cx.input(2)?),
                &cx.input_u32(3)?,
                shape,
            )),
            LoraOp::Expand => Ok(cpu::lora_expand(
                cx.input(0)?,
                cx.input(1)?,
                cx.input(2)?,
                &narrow(cx.input(3)?),
                &cx.input_u32(4)?,
                shape,
            )),
        }
    }

    /// An adapter index past the adapters that is not [`NO_ADAPTER`].
    fn check_u32_input(&self, g: &Graph, node: Tensor, slot: usize, values: &[u32]) -> Result<()> {
        let (meta, index_slot) = match self {
            LoraOp::Shrink { .. } => (2, 3),
            LoraOp::Expand => (3, 4),
        };
        if slot != index_slot {
            return Ok(());
        }
        let adapters = g.shape(g.node(node).inputs[meta])[0];
        match values.iter().find(|&&v| v as usize >= adapters && v != NO_ADAPTER) {
            Some(bad) => Err(Error::InvalidArgument {
                op: self.name(),
                reason: format!(
                    "adapter {bad} of {adapters}: give an index below {adapters}, or NO_ADAPTER ({NO_ADAPTER}) for none"
                ),
            }),
            None => Ok(()),
        }
    }
}

impl Graph {
    /// The gathered shrink: h [.., width] with h[row, j] = Σ_i x[row,
    /// i]·a[first + j, i] for j below the rank of the adapter of the row's
    /// sequence, 0 past it and for a sequence whose index is
    /// [`NO_ADAPTER`]. x [.., cols] holds whole sequences: its rows are
    /// S·T for u32 `index` [S] (sequence s owns rows s·T .. s·T + T).
    /// `a` [ranks, cols] stacks every adapter's A; `meta` [adapters, 3]
    /// holds each one's (first row, rank, scale) ([`LoraShape`]); `width`
    /// is the largest rank. No gradient.
    pub fn lora_shrink(&mut self, x: Tensor, a: Tensor, meta: Tensor, index: Tensor, width: usize) -> Result<Tensor> {
        const OP: &str = "lora_shrink";
        let (_, shape) = self.check_lora(OP, x, a, meta, index)?;
        if width == 0 {
            return Err(Error::shape(
                OP,
                "the width of h (the largest rank) must be at least 1",
                &[&shape],
            ));
        }
        let mut out = shape;
        if let Some(last) = out.last_mut() {
            *last = width;
        }
        Self::non_empty(OP, &out)?;
        let name = format!("{}.lora_h", self.node(x).name);
        Ok(self.push(LoraOp::Shrink { width }, vec![x, a, meta, index], out, DType::F32, name))
    }

    /// The gathered expand: y [.., cols] plus, on each row, its sequence's
    /// adapter's scale times h[row, 0..rank]·bt[first..first + rank] (a
    /// row whose sequence names no adapter is y's). `h` [.., width] is
    /// [`Graph::lora_shrink`]'s; `bt` [ranks, cols] stacks every adapter's
    /// Bᵀ as its A rows are stacked. No gradient.
    pub fn lora_expand(&mut self, y: Tensor, h: Tensor, bt: Tensor, meta: Tensor, index: Tensor) -> Result<Tensor> {
        const OP: &str = "lora_expand";
        let (rows, shape) = self.check_lora(OP, y, bt, meta, index)?;
        self.f32_inputs(OP, &[h])?;
        let sh = self.shape(h).to_vec();
        if sh.len() < 2 || rows_cols(&sh).0 != rows {
            return Err(Error::shape(
                OP,
                format!("h must be [{rows} rows, width]"),
                &[&shape, &sh],
            ));
        }
        let name = format!("{}.lora", self.node(y).name);
        Ok(self.push(LoraOp::Expand, vec![y, h, bt, meta, index], shape, DType::F32, name))
    }

    /// Checks the operands both products share: x or y [.., cols] of rank
    /// 2 or more with whole sequences of rows, `stacked` [ranks, cols],
    /// `meta` [adapters, 3], u32 `index` [seqs]; -> (rows, x's shape).
    fn check_lora(
        &self,
        op: &'static str,
        x: Tensor,
        stacked: Tensor,
        meta: Tensor,
        index: Tensor,
    ) -> Result<(usize, Vec<usize>)> {
        self.f32_inputs(op, &[x, stacked, meta])?;
        self.check_handle(op, index)?;
        let (sx, ss, sm, si) = (
            self.shape(x).to_vec(),
            self.shape(stacked).to_vec(),
            self.shape(meta).to_vec(),
            self.shape(index).to_vec(),
        );
        let all: [&[usize]; 4] = [&sx, &ss, &sm, &si];
        if sx.len() < 2 {
            return Err(Error::shape(op, "x must be [.., features] of rank 2 or more", &all));
        }
        let (rows, cols) = rows_cols(&sx);
        if ss.len() != 2 || ss[1] != cols {
            return Err(Error::shape(
                op,
                format!("the stacked adapters must be [ranks, {cols}]"),
                &all,
            ));
        }
        if sm.len() != 2 || sm[1] != LORA_META {
            return Err(Error::shape(
                op,
                format!("meta must be [adapters, {LORA_META}]: (first row, rank, scale) each"),
                &all,
            ));
        }
        if self.node(index).dtype != DType::U32 || si.len() != 1 || rows % si[0] != 0 {
            return Err(Error::shape(
                op,
                format!("index must be u32 [sequences], the {rows} rows whole sequences of them"),
                &all,
            ));
        }
        Ok((rows, sx))
    }
}
