//! `lora.wgsl`: the gathered low-rank products of many LoRA adapters over
//! one base (S-LoRA's and Punica's shrink and expand): each sequence of a
//! batch names its adapter, so requests with different adapters decode in
//! the same step, each row applying its own ([`LoraShape`]).

use super::registry::entry_points;
use super::rowwise::check_lengths;
use super::{bind, dim, Dispatch, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::LoraShape;

entry_points! {
    Lora {
        LORA_SHRINK = "lora_shrink",
        LORA_EXPAND = "lora_expand",
    }
}

/// Columns of h one shrink workgroup sums (lora.wgsl's LORA_RANKS).
const LORA_RANKS: usize = 8;
/// Columns of out one expand workgroup writes (lora.wgsl's LORA_COLS).
const LORA_COLS: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct LoraParams {
    seqs: u32,
    rows: u32,
    cols: u32,
    width: u32,
    adapters: u32,
    ranks: u32,
    _pad0: u32,
    _pad1: u32,
}

impl Kernels {
    /// h[rows, width] = each row's adapter's A times the row: h[row, j] =
    /// Σ_i x[row, i]·a[first + j, i] for j below the adapter's rank, 0
    /// past it and for a row whose sequence names no adapter (see
    /// [`LoraShape`]). `x` [rows, cols], `a` [ranks, cols] (every
    /// adapter's A stacked), `meta` f32 [adapters, 3], `index` u32 [seqs].
    /// A workgroup per row and 8 columns of h; `cpu::lora_shrink` is the
    /// twin.
    pub fn lora_shrink(
        &self,
        h: View<'_>,
        x: View<'_>,
        a: View<'_>,
        meta: View<'_>,
        index: View<'_>,
        shape: LoraShape,
    ) -> Result<Dispatch> {
        let op = LORA_SHRINK.entry;
        let lengths = shape.lengths();
        self.check_lora(
            op,
            shape,
            &[
                ("h", h.len, lengths.map(|l| l[2])),
                ("x", x.len, lengths.map(|l| l[0])),
                ("a", a.len, lengths.map(|l| l[1])),
                ("meta", meta.len, lengths.map(|l| l[3])),
                ("index", index.len, Some(shape.seqs)),
            ],
        )?;
        let lanes = self.lora_lanes();
        let groups = (shape.rows as u64).saturating_mul(shape.width.div_ceil(LORA_RANKS) as u64);
        self.prepare(
            LORA_SHRINK,
            &[("LORA_WG", lanes)],
            &[
                bind(1, "meta", meta),
                bind(2, "index", index),
                bind(3, "h", h),
                bind(4, "x", x),
                bind(5, "a", a),
            ],
            0,
            &lora_params(op, shape)?,
            groups,
        )
    }

    /// out[rows, cols] = y + scale · h[row, 0..rank]·bt[first..first +
    /// rank] for each row's adapter (first, rank, scale from `meta`); a
    /// row whose sequence names no adapter is y's. `y` [rows, cols], `h`
    /// [rows, width] (from [`Kernels::lora_shrink`]), `bt` [ranks, cols]
    /// (every adapter's Bᵀ stacked as `a` is), `meta` and `index` as the
    /// shrink's. A workgroup per row and 256 columns of it;
    /// `cpu::lora_expand` is the twin.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_expand(
        &self,
        out: View<'_>,
        y: View<'_>,
        h: View<'_>,
        bt: View<'_>,
        meta: View<'_>,
        index: View<'_>,
        shape: LoraShape,
    ) -> Result<Dispatch> {
        let op = LORA_EXPAND.entry;
        let lengths = shape.lengths();
        self.check_lora(
            op,
            shape,
            &[
                ("out", out.len, lengths.map(|l| l[0])),
                ("y", y.len, lengths.map(|l| l[0])),
                ("h", h.len, lengths.map(|l| l[2])),
                ("bt", bt.len, lengths.map(|l| l[1])),
                ("meta", meta.len, lengths.map(|l| l[3])),
                ("index", index.len, Some(shape.seqs)),
            ],
        )?;
        self.prepare(
            LORA_EXPAND,
            &[("LORA_WG", self.lora_lanes())],
            &[
                bind(1, "meta", meta),
                bind(2, "index", index),
                bind(3, "out", out),
                bind(6, "y", y),
                bind(7, "h", h),
                bind(8, "bt", bt),
            ],
            0,
            &lora_params(op, shape)?,
            (shape.rows as u64).saturating_mul(shape.cols.div_ceil(LORA_COLS) as u64),
        )
    }

    /// Lanes per workgroup of both products (lora.wgsl's LORA_WG): 8 on a
    /// CPU adapter (one SIMD row of llvmpipe, whose barriers then cost
    /// little), 64 on a GPU.
    fn lora_lanes(&self) -> f64 {
        if self.gpu_shaped() {
            64.0
        } else {
            8.0
        }
    }

    /// The sizes both products check: none zero, the rows whole sequences,
    /// each operand its length, the flat indices within u32.
    fn check_lora(&self, op: &'static str, shape: LoraShape, operands: &[(&str, usize, Option<usize>)]) -> Result<()> {
        let LoraShape {
            seqs,
            rows,
            cols,
            width,
            adapters,
            ranks,
        } = shape;
        check_lengths(
            op,
            &[
                ("seqs", seqs),
                ("rows", rows),
                ("cols", cols),
                ("width", width),
                ("adapters", adapters),
                ("ranks", ranks),
            ],
            operands,
        )?;
        if rows % seqs != 0 {
            return Err(Error::shape(
                op,
                format!("{rows} rows are not whole sequences of {seqs}"),
                &[&[seqs, rows, cols]],
            ));
        }
        for &(_, len, _) in operands {
            dim(op, len)?;
        }
        Ok(())
    }
}

fn lora_params(op: &'static str, shape: LoraShape) -> Result<LoraParams> {
    Ok(LoraParams {
        seqs: dim(op, shape.seqs)?,
        rows: dim(op, shape.rows)?,
        cols: dim(op, shape.cols)?,
        width: dim(op, shape.width)?,
        adapters: dim(op, shape.adapters)?,
        ranks: dim(op, shape.ranks)?,
        _pad0: 0,
        _pad1: 0,
    })
}
