//! `tensor.wgsl`: layout ops on contiguous row-major tensors of rank 1..4,
//! for the transformer's graph: NumPy-broadcasting binary ops, unary ops,
//! the reduction that is a broadcast's gradient, axis permutation, and
//! slice / pad / concat along the last axis. Every entry checks the shapes
//! against the views and pads them to rank 4 (leading 1s) as per-axis
//! strides, so the kernels share one indexing function.

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Binding, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{broadcast_shape, Binary, Unary};

entry_points! {
    Tensor {
        BINARY_BROADCAST_FORWARD = "binary_broadcast_forward",
        UNARY_FORWARD = "unary_forward",
        REDUCE_TO_SHAPE_FORWARD = "reduce_to_shape_forward",
        REDUCE_TO_SHAPE_PARTIAL = "reduce_to_shape_partial",
        PERMUTE_FORWARD = "permute_forward",
        SLICE_LAST_FORWARD = "slice_last_forward",
        PAD_LAST_FORWARD = "pad_last_forward",
        CONCAT_LAST_FORWARD = "concat_last_forward",
    }
}

/// The highest rank these kernels take.
pub const MAX_RANK: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct TensorParams {
    n: u32,
    op: u32,
    accumulate: u32,
    block: u32,
    dims: [u32; 4],
    x_strides: [u32; 4],
    y_strides: [u32; 4],
    extra: [u32; 4],
}

impl TensorParams {
    fn new(op: &'static str, n: usize) -> Result<Self> {
        Ok(TensorParams {
            n: dim(op, n)?,
            op: 0,
            accumulate: 0,
            block: 0,
            dims: [1; 4],
            x_strides: [0; 4],
            y_strides: [0; 4],
            extra: [0; 4],
        })
    }
}

/// Elements of a shape, None on overflow.
fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// `shape` with leading 1s up to rank 4 (the caller checked the rank).
fn pad4(shape: &[usize]) -> [usize; 4] {
    let mut out = [1; 4];
    out[MAX_RANK - shape.len()..].copy_from_slice(shape);
    out
}

/// Row-major strides of a rank-4 shape.
fn strides4(shape: [usize; 4]) -> [usize; 4] {
    let mut s = [1; 4];
    for i in (0..3).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn to_u32x4(op: &'static str, v: [usize; 4]) -> Result<[u32; 4]> {
    Ok([dim(op, v[0])?, dim(op, v[1])?, dim(op, v[2])?, dim(op, v[3])?])
}

/// Rank 1..=4 and no zero dimension, for each named shape.
fn check_shapes(op: &'static str, named: &[(&str, &[usize])], all: &[&[usize]]) -> Result<()> {
    for (name, shape) in named {
        if shape.is_empty() || shape.len() > MAX_RANK {
            return Err(Error::shape(
                op,
                format!(
                    "{name} has rank {}; these kernels take rank 1..={MAX_RANK}",
                    shape.len()
                ),
                all,
            ));
        }
        if shape.contains(&0) {
            return Err(Error::shape(op, format!("{name} {shape:?} has a zero dimension"), all));
        }
    }
    Ok(())
}

/// Each view holds exactly the elements its shape asks for.
fn check_views(op: &'static str, views: &[(&str, &View<'_>, &[usize])], all: &[&[usize]]) -> Result<()> {
    for (name, view, shape) in views {
        if numel(shape) != Some(view.len) {
            return Err(Error::shape(
                op,
                format!(
                    "`{name}` has {} elements, its shape {shape:?} needs {}",
                    view.len,
                    numel(shape).map_or("overflowing".into(), |n| n.to_string())
                ),
                all,
            ));
        }
    }
    Ok(())
}

/// rows, cols (and so on) at least 1, `start + width ≤ cols`.
fn check_last_axis(op: &'static str, rows: usize, cols: usize, start: usize, width: usize) -> Result<()> {
    let all: [&[usize]; 2] = [&[rows, cols], &[rows, width]];
    if rows == 0 || cols == 0 || width == 0 {
        return Err(Error::shape(
            op,
            format!("rows {rows}, cols {cols} and width {width} must be at least 1"),
            &all,
        ));
    }
    if start.checked_add(width).is_none_or(|end| end > cols) {
        return Err(Error::shape(
            op,
            format!(
                "columns {start}..{} are outside the {cols} columns",
                start.saturating_add(width)
            ),
            &all,
        ));
    }
    Ok(())
}

impl Kernels {
    fn tensor_dispatch(&self, kernel: Kernel, params: &TensorParams, bindings: &[Binding<'_>]) -> Result<Dispatch> {
        self.prepare(kernel, &[], bindings, 3, params, flat_groups(params.n as usize))
    }

    /// out = a ∘ b with NumPy broadcasting of rank ≤ 4 shapes aligned at
    /// the trailing dimension; out has the broadcast shape (e.g. [B,T,C] ∘
    /// [C], [B,H,T,T] ∘ [T,T], [B,T,1] ∘ [B,T,C]).
    pub fn binary_broadcast(
        &self,
        op: Binary,
        out: View<'_>,
        a: View<'_>,
        b: View<'_>,
        a_shape: &[usize],
        b_shape: &[usize],
    ) -> Result<Dispatch> {
        let kernel = BINARY_BROADCAST_FORWARD;
        let name = kernel.entry;
        let all: [&[usize]; 2] = [a_shape, b_shape];
        check_shapes(name, &[("a", a_shape), ("b", b_shape)], &all)?;
        let out_shape = broadcast_shape(a_shape, b_shape).ok_or_else(|| {
            Error::shape(
                name,
                format!("{op:?}: shapes {a_shape:?} and {b_shape:?} do not broadcast"),
                &all,
            )
        })?;
        let all: [&[usize]; 3] = [a_shape, b_shape, &out_shape];
        check_views(
            name,
            &[("a", &a, a_shape), ("b", &b, b_shape), ("out", &out, &out_shape)],
            &all,
        )?;
        let dims = pad4(&out_shape);
        // A size-1 axis of an operand is read at coordinate 0: stride 0.
        let strides = |shape: &[usize]| {
            let padded = pad4(shape);
            let s = strides4(padded);
            std::array::from_fn(|i| if padded[i] == 1 { 0 } else { s[i] })
        };
        let params = TensorParams {
            op: op.code(),
            dims: to_u32x4(name, dims)?,
            x_strides: to_u32x4(name, strides(a_shape))?,
            y_strides: to_u32x4(name, strides(b_shape))?,
            ..TensorParams::new(name, out.len)?
        };
        self.tensor_dispatch(
            kernel,
            &params,
            &[bind(0, "a", a), bind(1, "b", b), bind(2, "out", out)],
        )
    }

    /// out = f(x) elementwise; see [`Unary`] for x ≤ 0 under Rsqrt.
    pub fn unary(&self, op: Unary, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        let kernel = UNARY_FORWARD;
        if out.len != x.len {
            return Err(Error::shape(
                kernel.entry,
                format!("{op:?}: out has {} elements, x {}", out.len, x.len),
                &[&[out.len], &[x.len]],
            ));
        }
        let params = TensorParams {
            op: op.code(),
            ..TensorParams::new(kernel.entry, out.len)?
        };
        self.tensor_dispatch(kernel, &params, &[bind(0, "x", x), bind(2, "out", out)])
    }

    /// Sums x (shape `x_shape`) down to `out_shape`, where x_shape is
    /// out_shape broadcast (leading axes dropped and/or size-1 axes
    /// expanded): the gradient of a broadcast. Each output element sums its
    /// inputs in one fixed order (deterministic, no atomics). `accumulate`
    /// adds into out.
    pub fn reduce_to_shape(
        &self,
        accumulate: bool,
        out: View<'_>,
        x: View<'_>,
        x_shape: &[usize],
        out_shape: &[usize],
    ) -> Result<Dispatch> {
        let kernel = REDUCE_TO_SHAPE_FORWARD;
        let name = kernel.entry;
        let all: [&[usize]; 2] = [x_shape, out_shape];
        check_shapes(name, &[("x", x_shape), ("out", out_shape)], &all)?;
        if broadcast_shape(x_shape, out_shape).as_deref() != Some(x_shape) {
            return Err(Error::shape(
                name,
                format!("x {x_shape:?} is not a broadcast of out {out_shape:?}"),
                &all,
            ));
        }
        check_views(name, &[("x", &x, x_shape), ("out", &out, out_shape)], &all)?;
        let (xp, op) = (pad4(x_shape), pad4(out_shape));
        let extra: [usize; 4] = std::array::from_fn(|i| if op[i] == 1 { xp[i] } else { 1 });
        let params = TensorParams {
            accumulate: u32::from(accumulate),
            dims: to_u32x4(name, op)?,
            x_strides: to_u32x4(name, strides4(xp))?,
            extra: to_u32x4(name, extra)?,
            ..TensorParams::new(name, out.len)?
        };
        // Elements summed into each output: the "rows" of a column sum.
        let summed = x.len / out.len;
        let Some(blocks) = self.column_blocks(summed, out.len, 1) else {
            return self.tensor_dispatch(kernel, &params, &[bind(0, "x", x), bind(2, "out", out)]);
        };
        // Two stages (see reduce.rs): block sums into the device's
        // scratch, then reduce.wgsl's column sum over them in block order.
        let _gl = self.device().lock_gl();
        let scratch = self.reduction_scratch(name, blocks.blocks * out.len)?;
        let partial = View {
            buffer: &scratch,
            offset: 0,
            len: blocks.blocks * out.len,
        };
        let params = TensorParams {
            block: dim(name, blocks.block_rows)?,
            ..params
        };
        let first = self.prepare(
            REDUCE_TO_SHAPE_PARTIAL,
            &[],
            &[bind(0, "x", x), bind(2, "partial", partial)],
            3,
            &params,
            flat_groups(partial.len),
        )?;
        Ok(first.then(self.sum_rows_pass(accumulate, out, partial, blocks.blocks, out.len)?))
    }

    /// out = x with axes permuted: out_shape[i] = shape[perm[i]]; rank ≤ 4.
    pub fn permute(&self, out: View<'_>, x: View<'_>, shape: &[usize], perm: &[usize]) -> Result<Dispatch> {
        let kernel = PERMUTE_FORWARD;
        let name = kernel.entry;
        let all: [&[usize]; 2] = [shape, perm];
        check_shapes(name, &[("x", shape)], &all)?;
        let mut seen = [false; MAX_RANK];
        let is_perm = perm.len() == shape.len()
            && perm
                .iter()
                .all(|&axis| axis < shape.len() && !std::mem::replace(&mut seen[axis], true));
        if !is_perm {
            return Err(Error::shape(
                name,
                format!("{perm:?} is not a permutation of the {} axes of {shape:?}", shape.len()),
                &all,
            ));
        }
        check_views(name, &[("x", &x, shape), ("out", &out, shape)], &all)?;
        let offset = MAX_RANK - shape.len();
        let x_strides = strides4(pad4(shape));
        let mut dims = [1; 4];
        let mut strides = [0; 4];
        for (i, &axis) in perm.iter().enumerate() {
            dims[offset + i] = shape[axis];
            strides[offset + i] = x_strides[offset + axis];
        }
        let params = TensorParams {
            dims: to_u32x4(name, dims)?,
            x_strides: to_u32x4(name, strides)?,
            ..TensorParams::new(name, out.len)?
        };
        self.tensor_dispatch(kernel, &params, &[bind(0, "x", x), bind(2, "out", out)])
    }

    /// x [rows, cols] -> out [rows, width] = x[:, start..start + width].
    pub fn slice_last(
        &self,
        out: View<'_>,
        x: View<'_>,
        rows: usize,
        cols: usize,
        start: usize,
        width: usize,
    ) -> Result<Dispatch> {
        let kernel = SLICE_LAST_FORWARD;
        let name = kernel.entry;
        check_last_axis(name, rows, cols, start, width)?;
        let all: [&[usize]; 2] = [&[rows, cols], &[rows, width]];
        check_views(name, &[("x", &x, &[rows, cols]), ("out", &out, &[rows, width])], &all)?;
        let params = TensorParams {
            extra: to_u32x4(name, [cols, start, width, 0])?,
            ..TensorParams::new(name, out.len)?
        };
        self.tensor_dispatch(kernel, &params, &[bind(0, "x", x), bind(2, "out", out)])
    }

    /// x [rows, width] -> out [rows, cols] with x in columns start..start +
    /// width and zeros elsewhere (the gradient of [`Kernels::slice_last`]);
    /// `accumulate` adds x into those columns and leaves the rest.
    #[allow(clippy::too_many_arguments)]
    pub fn pad_last(
        &self,
        accumulate: bool,
        out: View<'_>,
        x: View<'_>,
        rows: usize,
        cols: usize,
        start: usize,
        width: usize,
    ) -> Result<Dispatch> {
        let kernel = PAD_LAST_FORWARD;
        let name = kernel.entry;
        check_last_axis(name, rows, cols, start, width)?;
        let all: [&[usize]; 2] = [&[rows, width], &[rows, cols]];
        check_views(name, &[("x", &x, &[rows, width]), ("out", &out, &[rows, cols])], &all)?;
        let params = TensorParams {
            accumulate: u32::from(accumulate),
            extra: to_u32x4(name, [cols, start, width, 0])?,
            ..TensorParams::new(name, out.len)?
        };
        self.tensor_dispatch(kernel, &params, &[bind(0, "x", x), bind(2, "out", out)])
    }

    /// out [rows, a_cols + b_cols] = [a | b] row by row.
    pub fn concat_last(
        &self,
        out: View<'_>,
        a: View<'_>,
        b: View<'_>,
        rows: usize,
        a_cols: usize,
        b_cols: usize,
    ) -> Result<Dispatch> {
        let kernel = CONCAT_LAST_FORWARD;
        let name = kernel.entry;
        let cols = a_cols.checked_add(b_cols);
        let out_shape = [rows, cols.unwrap_or(usize::MAX)];
        let all: [&[usize]; 3] = [&[rows, a_cols], &[rows, b_cols], &out_shape];
        if rows == 0 || a_cols == 0 || b_cols == 0 || cols.is_none() {
            return Err(Error::shape(
                name,
                format!("rows {rows}, a_cols {a_cols} and b_cols {b_cols} must be at least 1"),
                &all,
            ));
        }
        check_views(
            name,
            &[
                ("a", &a, &[rows, a_cols]),
                ("b", &b, &[rows, b_cols]),
                ("out", &out, &out_shape),
            ],
            &all,
        )?;
        let params = TensorParams {
            extra: to_u32x4(name, [a_cols, b_cols, 0, 0])?,
            ..TensorParams::new(name, out.len)?
        };
        self.tensor_dispatch(
            kernel,
            &params,
            &[bind(0, "a", a), bind(1, "b", b), bind(2, "out", out)],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_and_strides_are_row_major_rank_4() {
        assert_eq!(pad4(&[3, 5]), [1, 1, 3, 5]);
        assert_eq!(strides4([2, 3, 5, 7]), [105, 35, 7, 1]);
        assert_eq!(broadcast_shape(&[2, 3, 1], &[4]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast_shape(&[2, 3], &[4]), None);
    }
}
