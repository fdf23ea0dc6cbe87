//! Rotary position embedding (RoPE) over x [S, T, H, D]: the first
//! `rotary_dim` channels of each head rotated pair by pair by the angles
//! of each row's position, read from a (cos, sin) table the graph holds as
//! a constant ([`crate::ops::rope_table`], computed once on the host as
//! PyTorch computes it). Its gradient is the rotation by minus each angle.

use super::{no_gradient, DispatchContext, Op, OpFamily, ReferenceContext, SourceOp};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::{rope_table, RopeLayout, RopeShape};

/// Rotary position embedding and its backward.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeOp {
    /// inputs (x [S, T, H, D], u32 starts [S], (cos, sin) table
    /// [positions, rotary_dim/2, 2]) -> x with the first `rotary_dim`
    /// channels of each head rotated by the angles of positions
    /// starts[s] + t (see `Kernels::rope_forward`).
    Rope {
        layout: RopeLayout,
        base: f32,
        rotary_dim: usize,
    },
    /// inputs (dy, starts, table) -> dx: the rotation by minus each angle.
    RopeBackward {
        layout: RopeLayout,
        base: f32,
        rotary_dim: usize,
    },
    /// `Rope` over heads 0..rotated of each row only, the others copied (a
    /// fused q | k | v row whose q and k heads rotate). No gradient.
    RopeHeads {
        layout: RopeLayout,
        base: f32,
        rotary_dim: usize,
        rotated: usize,
    },
}

impl RopeOp {
    /// The op's settings, forward or backward.
    fn settings(&self) -> (RopeLayout, f32, usize) {
        let (RopeOp::Rope {
            layout,
            base,
            rotary_dim,
        }
        | RopeOp::RopeBackward {
            layout,
            base,
            rotary_dim,
        }
        | RopeOp::RopeHeads {
            layout,
            base,
            rotary_dim,
            ..
        }) = *self;
        (layout, base, rotary_dim)
    }
}

/// The kernels' shape of x [S, T, H, D] with a table of `table_len` values.
fn rope_shape(x: &[usize], rotary_dim: usize, table_len: usize) -> RopeShape {
    let [seqs, rows, heads, head_dim] = x[..] else {
        return RopeShape {
            seqs: 0,
            rows: 0,
            heads: 0,
            head_dim: 0,
            rotary_dim,
            positions: 0,
        };
    };
    RopeShape {
        seqs,
        rows,
        heads,
        head_dim,
        rotary_dim,
        positions: table_len / rotary_dim.max(1),
    }
}

impl OpFamily for RopeOp {
    fn name(&self) -> &'static str {
        match self {
            RopeOp::Rope { .. } => "rope",
            RopeOp::RopeBackward { .. } => "rope_backward",
            RopeOp::RopeHeads { .. } => "rope_heads",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (layout, _, rotary_dim) = self.settings();
        let shape = rope_shape(cx.shape(), rotary_dim, cx.input_node(2).len());
        let (out, x, starts, table) = (cx.out()?, cx.input(0)?, cx.input(1)?, cx.input(2)?);
        match self {
            RopeOp::Rope { .. } => cx.kernels().rope_forward(out, x, starts, table, shape, layout),
            RopeOp::RopeHeads { rotated, .. } => cx
                .kernels()
                .rope_forward_heads(out, x, starts, table, shape, layout, *rotated),
            RopeOp::RopeBackward { .. } => cx.kernels().rope_backward(out, x, starts, table, shape, layout),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let (
            RopeOp::Rope {
                layout,
                base,
                rotary_dim,
            },
            0,
        ) = (self, slot)
        else {
            return Err(no_gradient(g, node, slot));
        };
        let n = g.node(node).clone();
        let name = format!("d{}", g.node(n.inputs[0]).name);
        let backward = RopeOp::RopeBackward {
            layout: *layout,
            base: *base,
            rotary_dim: *rotary_dim,
        };
        Ok(g.push(backward, vec![dy, n.inputs[1], n.inputs[2]], n.shape, DType::F32, name))
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let (layout, base, rotary_dim) = self.settings();
        let shape = rope_shape(cx.shape(), rotary_dim, cx.graph().node(cx.node().inputs[2]).len());
        let sign = if matches!(self, RopeOp::RopeBackward { .. }) {
            -1.0
        } else {
            1.0
        };
        let mut y = cpu::rope_f64(cx.input(0)?, &cx.input_u32(1)?, shape, layout, base, sign);
        if let RopeOp::RopeHeads { rotated, .. } = *self {
            // Heads past `rotated` keep x's values.
            let x = cx.input(0)?;
            for (i, v) in y.iter_mut().enumerate() {
                if (i / shape.head_dim) % shape.heads >= rotated {
                    *v = x[i];
                }
            }
        }
        Ok(y)
    }
}

impl Graph {
    /// Rotary position embedding over x [S, T, H, D] (sequences,
    /// positions, heads, head dim: a projection's output [S, T, H·D]
    /// reshaped): the first `rotary_dim` channels of each head (even, ≤ D)
    /// rotated pair by pair, pairs as `layout` says, by the angles of base
    /// `base` at row (s, t)'s position starts[s] + t; the other channels
    /// pass through. `starts` is u32 [S] (a KV cache's lengths so far);
    /// `None` starts every sequence at 0, as training does. The table
    /// holds `positions` positions (the model's context); a position past
    /// it gives NaN. Layers with the same settings share one table.
    pub fn rope(
        &mut self,
        x: Tensor,
        starts: Option<Tensor>,
        layout: RopeLayout,
        base: f32,
        rotary_dim: usize,
        positions: usize,
    ) -> Result<Tensor> {
        let heads = self.shape_of(x).and_then(|s| s.get(2).copied()).unwrap_or(0);
        self.rope_heads(x, starts, layout, base, rotary_dim, positions, heads)
    }

    /// [`Graph::rope`] rotating heads 0..rotated of x [S, T, H, D] only,
    /// the others passing through: a fused q | k | v projection reshaped to
    /// its heads, whose q and k heads rotate. No gradient when some pass.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_heads(
        &mut self,
        x: Tensor,
        starts: Option<Tensor>,
        layout: RopeLayout,
        base: f32,
        rotary_dim: usize,
        positions: usize,
        rotated: usize,
    ) -> Result<Tensor> {
        const OP: &str = "rope";
        self.f32_inputs(OP, &[x])?;
        let shape = self.shape(x).to_vec();
        let [seqs, rows, heads, head_dim] = shape[..] else {
            return Err(Error::shape(
                OP,
                "expects x [sequences, positions, heads, head_dim]",
                &[&shape],
            ));
        };
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(Error::shape(
                OP,
                format!("rotary_dim {rotary_dim} must be even, positive and at most the head dim"),
                &[&shape],
            ));
        }
        if rotated > heads {
            return Err(Error::shape(
                OP,
                format!("{rotated} rotated heads of {heads}"),
                &[&shape],
            ));
        }
        if rows > positions {
            return Err(Error::shape(
                OP,
                format!("{rows} positions do not fit a table of {positions}"),
                &[&shape],
            ));
        }
        let starts = match starts {
            Some(starts) => {
                self.check_handle(OP, starts)?;
                if self.node(starts).dtype != DType::U32 || self.shape(starts) != [seqs] {
                    return Err(Error::shape(
                        OP,
                        format!("starts must be u32 [{seqs}]"),
                        &[&shape, self.shape(starts)],
                    ));
                }
                starts
            }
            // Zero bits are zero in f32 and u32 alike: a constant of 0.0
            // read as u32.
            None => self.shared_constant(&format!("rope.starts[{seqs}]"), &[seqs], DType::U32, || {
                Ok(vec![0.0; seqs])
            })?,
        };
        let table_name = format!("rope.table(base={base}, rotary_dim={rotary_dim}, positions={positions})");
        let table = self.shared_constant(&table_name, &[positions, rotary_dim / 2, 2], DType::F32, || {
            rope_table(base, rotary_dim, positions)
        })?;
        let name = format!("{OP}{}", self.nodes.len());
        let op = if rotated == heads {
            RopeOp::Rope {
                layout,
                base,
                rotary_dim,
            }
        } else {
            RopeOp::RopeHeads {
                layout,
                base,
                rotary_dim,
                rotated,
            }
        };
        Ok(self.push(op, vec![x, starts, table], shape, DType::F32, name))
    }

    /// The constant named `name`, made by `values` the first time.
    fn shared_constant(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        values: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Tensor> {
        if let Some(i) = self
            .nodes
            .iter()
            .position(|n| matches!(n.op, Op::Source(SourceOp::Constant { .. })) && n.name == name)
        {
            return Ok(Tensor(i));
        }
        let t = self.constant(name, shape, values()?)?;
        self.nodes[t.0].dtype = dtype;
        Ok(t)
    }
}
