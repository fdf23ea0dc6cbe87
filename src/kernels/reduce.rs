//! `reduce.wgsl`: column sums, whole-array sum and mean, row max and argmax.

use super::registry::*;
use super::{bind, column_groups, dim, flat_groups, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ReduceParams {
    rows: u32,
    cols: u32,
    n: u32,
    _pad: u32,
}

fn check_matrix(op: &'static str, x: &View<'_>, rows: usize, cols: usize, out_len: usize, want_out: usize) -> Result<()> {
    if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(x.len) || out_len != want_out {
        return Err(Error::shape(
            op,
            format!(
                "x must be rows×cols = {rows}×{cols} and the output {want_out} long; got x {}, out {out_len}",
                x.len
            ),
            &[&[rows, cols], &[out_len]],
        ));
    }
    Ok(())
}

impl Kernels {
    /// out[cols] = Σ_r x[rows, cols] (the bias gradient).
    pub fn sum_rows(&self, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        self.sum_rows_impl(false, out, x, rows, cols)
    }

    /// out[cols] += Σ_r x[rows, cols] (accumulating a bias gradient).
    pub fn sum_rows_accumulate(&self, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        self.sum_rows_impl(true, out, x, rows, cols)
    }

    fn sum_rows_impl(&self, accumulate: bool, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        let op = SUM_ROWS_FORWARD.entry;
        check_matrix(op, &x, rows, cols, out.len, cols)?;
        let params = ReduceParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, x.len)?, _pad: 0 };
        let constants = [("ACCUMULATE", f64::from(u8::from(accumulate)))];
        self.prepare(SUM_ROWS_FORWARD, &constants, &[bind(0, "x", x), bind(2, "out", out)], 3, &params, column_groups(cols))
    }

    fn whole(&self, kernel: Kernel, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        let op = kernel.entry;
        if out.len != 1 || x.len == 0 {
            return Err(Error::shape(op, "reduces a non-empty x into out of length 1", &[&[x.len], &[out.len]]));
        }
        let params = ReduceParams { rows: 1, cols: dim(op, x.len)?, n: dim(op, x.len)?, _pad: 0 };
        // One workgroup: a fixed summation order makes the result deterministic.
        self.prepare(kernel, &[], &[bind(0, "x", x), bind(2, "out", out)], 3, &params, 1)
    }

    /// out[0] = Σ x.
    pub fn sum(&self, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        self.whole(SUM_FORWARD, out, x)
    }

    /// out[0] = Σ x / len(x).
    pub fn mean(&self, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        self.whole(MEAN_FORWARD, out, x)
    }

    /// out[rows] = max over each row of x[rows, cols].
    pub fn max_rows(&self, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        let op = MAX_ROWS_FORWARD.entry;
        check_matrix(op, &x, rows, cols, out.len, rows)?;
        let params = ReduceParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, x.len)?, _pad: 0 };
        self.prepare(MAX_ROWS_FORWARD, &[], &[bind(0, "x", x), bind(2, "out", out)], 3, &params, flat_groups(rows))
    }

    /// indices[rows] (u32) = first column holding each row's maximum.
    pub fn argmax_rows(&self, indices: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        let op = ARGMAX_ROWS_FORWARD.entry;
        check_matrix(op, &x, rows, cols, indices.len, rows)?;
        let params = ReduceParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, x.len)?, _pad: 0 };
        self.prepare(
            ARGMAX_ROWS_FORWARD,
            &[],
            &[bind(0, "x", x), bind(4, "indices", indices)],
            3,
            &params,
            flat_groups(rows),
        )
    }
}
