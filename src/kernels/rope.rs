//! `rope.wgsl`: rotary position embedding over x [S, T, H, D], forward and
//! backward, from a (cos, sin) table the host computes once
//! ([`crate::ops::rope_table`]). q and k are separate calls, each with its
//! own head count (grouped-query attention): the rotation reads and writes
//! each element once, so one launch over both would save a launch, not
//! memory traffic.

use super::registry::entry_points;
use super::rowwise::check_lengths;
use super::{bind, dim, flat_groups, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{RopeLayout, RopeShape};

entry_points! {
    Rope {
        ROPE_FORWARD = "rope_forward",
        ROPE_BACKWARD = "rope_backward",
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeParams {
    seqs: u32,
    rows: u32,
    heads: u32,
    head_dim: u32,
    rotary_dim: u32,
    positions: u32,
    pair_layout: u32,
    rotated_heads: u32,
}

impl Kernels {
    /// y[S, T, H, D] = x with the first `rotary_dim` channels of each head
    /// rotated pair by pair (pairs as `layout` says) by the angle of row
    /// (s, t)'s position starts[s] + t, read from table [positions,
    /// rotary_dim/2, 2] of [`crate::ops::rope_table`]; the other channels
    /// copied. `starts` is u32 [S]. A position ≥ `shape.positions` gives
    /// a row of NaN (the kernel reads nothing out of bounds).
    pub fn rope_forward(
        &self,
        y: View<'_>,
        x: View<'_>,
        starts: View<'_>,
        table: View<'_>,
        shape: RopeShape,
        layout: RopeLayout,
    ) -> Result<Dispatch> {
        self.rope(
            ROPE_FORWARD,
            ("y", y),
            ("x", x),
            starts,
            table,
            shape,
            layout,
            shape.heads,
        )
    }

    /// [`Kernels::rope_forward`] rotating only heads 0..rotated_heads of
    /// each row and copying the rest: a fused q | k | v row seen as
    /// heads, its value heads passing through.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_forward_heads(
        &self,
        y: View<'_>,
        x: View<'_>,
        starts: View<'_>,
        table: View<'_>,
        shape: RopeShape,
        layout: RopeLayout,
        rotated_heads: usize,
    ) -> Result<Dispatch> {
        self.rope(
            ROPE_FORWARD,
            ("y", y),
            ("x", x),
            starts,
            table,
            shape,
            layout,
            rotated_heads,
        )
    }

    /// dx[S, T, H, D] from dy: the rotation by minus each angle (the
    /// forward's transpose); the same table, starts and shape as the
    /// forward.
    pub fn rope_backward(
        &self,
        dx: View<'_>,
        dy: View<'_>,
        starts: View<'_>,
        table: View<'_>,
        shape: RopeShape,
        layout: RopeLayout,
    ) -> Result<Dispatch> {
        self.rope(
            ROPE_BACKWARD,
            ("dx", dx),
            ("dy", dy),
            starts,
            table,
            shape,
            layout,
            shape.heads,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        kernel: Kernel,
        (out_name, out): (&'static str, View<'_>),
        (in_name, input): (&'static str, View<'_>),
        starts: View<'_>,
        table: View<'_>,
        shape: RopeShape,
        layout: RopeLayout,
        rotated_heads: usize,
    ) -> Result<Dispatch> {
        let op = kernel.entry;
        let RopeShape {
            seqs,
            rows,
            heads,
            head_dim,
            rotary_dim,
            positions,
        } = shape;
        let lengths = shape.lengths();
        check_lengths(
            op,
            &[
                ("seqs", seqs),
                ("rows", rows),
                ("heads", heads),
                ("head_dim", head_dim),
                ("rotary_dim", rotary_dim),
                ("positions", positions),
            ],
            &[
                (out_name, out.len, lengths.map(|l| l.0)),
                (in_name, input.len, lengths.map(|l| l.0)),
                ("starts", starts.len, Some(seqs)),
                ("table", table.len, lengths.map(|l| l.1)),
            ],
        )?;
        if rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(Error::shape(
                op,
                format!("rotary_dim must be even and ≤ head_dim = {head_dim}, got {rotary_dim}"),
                &[&[seqs, rows, heads, head_dim], &[rotary_dim]],
            ));
        }
        let params = RopeParams {
            seqs: dim(op, seqs)?,
            rows: dim(op, rows)?,
            heads: dim(op, heads)?,
            head_dim: dim(op, head_dim)?,
            rotary_dim: dim(op, rotary_dim)?,
            positions: dim(op, positions)?,
            pair_layout: layout.code(),
            rotated_heads: dim(op, rotated_heads.min(heads))?,
        };
        // Flat indices, and (start + t)·R + 2·pair into the table, in u32.
        dim(op, out.len)?;
        dim(op, table.len)?;
        self.prepare(
            kernel,
            &[],
            &[
                bind(0, in_name, input),
                bind(1, "starts", starts),
                bind(2, "table", table),
                bind(3, out_name, out),
            ],
            4,
            &params,
            flat_groups(out.len),
        )
    }
}
