//! `reduce.wgsl`: column sums, whole-array sum and mean, row max and argmax.
//!
//! Column sums come in two shapes. On a CPU adapter, one invocation per
//! column adds all rows (a workgroup runs on one thread there, so the
//! columns already spread over the cores). On a GPU that leaves most of the
//! chip idle when columns are few (a bias of 128 over 8,192 rows is 128
//! invocations, each 8,192 dependent adds), so there the sum runs in two
//! stages ([`ColumnBlocks`]): fixed blocks of rows per column into partial
//! sums, then the partials in block order.

use super::registry::entry_points;
use super::{bind, column_groups, dim, flat_groups, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};

entry_points! {
    Reduce {
        SUM_ROWS_FORWARD = "sum_rows_forward",
        SUM_ROWS_PARTIAL = "sum_rows_partial",
        SUM_FORWARD = "sum_forward",
        MEAN_FORWARD = "mean_forward",
        MAX_ROWS_FORWARD = "max_rows_forward",
        ARGMAX_ROWS_FORWARD = "argmax_rows_forward",
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ReduceParams {
    rows: u32,
    cols: u32,
    n: u32,
    block_rows: u32,
    /// `argmax_rows`' part of the rows (see reduce.wgsl).
    first_row: u32,
    part_base: u32,
    _pad: [u32; 2],
}

/// The fewest rows a column sum takes in two stages on a GPU. Below this
/// one invocation per column finishes in a few memory latencies (its loads
/// are independent and pipeline), about what the second launch costs.
pub(crate) const TWO_STAGE_MIN_ROWS: usize = 256;

/// How a two-stage column sum splits its rows: `blocks` blocks of
/// `block_rows` rows (the last one shorter), ⌈√rows⌉ rows each, so stage
/// one (a block's rows per invocation) and stage two (the blocks per
/// column) are equally long and the partials are 1/√rows of the input.
/// A function of the shape alone: the same bits on every run and adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ColumnBlocks {
    pub(crate) block_rows: usize,
    pub(crate) blocks: usize,
}

impl ColumnBlocks {
    pub(crate) fn new(rows: usize) -> Self {
        let mut block_rows = (rows as f64).sqrt().ceil() as usize;
        // Exact integer ceiling of √rows whatever the float rounding did.
        while block_rows > 1 && (block_rows - 1) * (block_rows - 1) >= rows {
            block_rows -= 1;
        }
        while block_rows * block_rows < rows {
            block_rows += 1;
        }
        let block_rows = block_rows.max(1);
        ColumnBlocks {
            block_rows,
            blocks: rows.div_ceil(block_rows),
        }
    }
}

fn check_matrix(
    op: &'static str,
    x: &View<'_>,
    rows: usize,
    cols: usize,
    out_len: usize,
    want_out: usize,
) -> Result<()> {
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
    /// The blocks of a two-stage sum over `rows` rows of `outputs` output
    /// elements with `width` partial values each, or `None` for the
    /// one-pass kernel: on a CPU adapter (see [`Kernels::gpu_shaped`]),
    /// for fewer than [`TWO_STAGE_MIN_ROWS`] rows, or when the partials
    /// would not fit one storage binding.
    pub(crate) fn column_blocks(&self, rows: usize, outputs: usize, width: usize) -> Option<ColumnBlocks> {
        if !self.gpu_shaped() || rows < TWO_STAGE_MIN_ROWS {
            return None;
        }
        let blocks = ColumnBlocks::new(rows);
        let words = blocks.blocks.checked_mul(outputs)?.checked_mul(width)?;
        (words as u64 * 4 <= self.binding_limit() && u32::try_from(words).is_ok()).then_some(blocks)
    }

    /// out[cols] = Σ_r x[rows, cols] (the bias gradient).
    pub fn sum_rows(&self, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        self.sum_rows_impl(false, out, x, rows, cols)
    }

    /// out[cols] += Σ_r x[rows, cols] (accumulating a bias gradient).
    pub fn sum_rows_accumulate(&self, out: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        self.sum_rows_impl(true, out, x, rows, cols)
    }

    fn sum_rows_impl(
        &self,
        accumulate: bool,
        out: View<'_>,
        x: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = SUM_ROWS_FORWARD.entry;
        check_matrix(op, &x, rows, cols, out.len, cols)?;
        let Some(blocks) = self.column_blocks(rows, cols, 1) else {
            return self.sum_rows_pass(accumulate, out, x, rows, cols);
        };
        // Stage one into the device's scratch, stage two out of it.
        let _gl = self.device().lock_gl();
        let scratch = self.reduction_scratch(op, blocks.blocks * cols)?;
        let partial = View {
            buffer: &scratch,
            offset: 0,
            len: blocks.blocks * cols,
        };
        let params = ReduceParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, x.len)?,
            block_rows: dim(op, blocks.block_rows)?,
            ..bytemuck::Zeroable::zeroed()
        };
        let first = self.prepare(
            SUM_ROWS_PARTIAL,
            &[],
            &[bind(0, "x", x), bind(2, "partial", partial)],
            3,
            &params,
            flat_groups(partial.len),
        )?;
        let second = self.sum_rows_pass(accumulate, out, partial, blocks.blocks, cols)?;
        Ok(first.then(second))
    }

    /// out[cols] (+)= Σ_r x[rows, cols] by one invocation per column
    /// (`sum_rows_forward`); also stage two of the two-stage sums, over
    /// their partials.
    pub(crate) fn sum_rows_pass(
        &self,
        accumulate: bool,
        out: View<'_>,
        x: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = SUM_ROWS_FORWARD.entry;
        let params = ReduceParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, x.len)?,
            block_rows: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        let constants = [("ACCUMULATE", f64::from(u8::from(accumulate)))];
        self.prepare(
            SUM_ROWS_FORWARD,
            &constants,
            &[bind(0, "x", x), bind(2, "out", out)],
            3,
            &params,
            column_groups(cols),
        )
    }

    fn whole(&self, kernel: Kernel, out: View<'_>, x: View<'_>) -> Result<Dispatch> {
        let op = kernel.entry;
        if out.len != 1 || x.len == 0 {
            return Err(Error::shape(
                op,
                "reduces a non-empty x into out of length 1",
                &[&[x.len], &[out.len]],
            ));
        }
        let params = ReduceParams {
            rows: 1,
            cols: dim(op, x.len)?,
            n: dim(op, x.len)?,
            block_rows: 0,
            ..bytemuck::Zeroable::zeroed()
        };
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
        let params = ReduceParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, x.len)?,
            block_rows: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        self.prepare(
            MAX_ROWS_FORWARD,
            &[],
            &[bind(0, "x", x), bind(2, "out", out)],
            3,
            &params,
            flat_groups(rows),
        )
    }

    /// indices[rows] (u32) = first column holding each row's maximum.
    pub fn argmax_rows(&self, indices: View<'_>, x: View<'_>, rows: usize, cols: usize) -> Result<Dispatch> {
        let op = ARGMAX_ROWS_FORWARD.entry;
        check_matrix(op, &x, rows, cols, indices.len, rows)?;
        let params = ReduceParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, x.len)?,
            block_rows: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        if x.bytes() <= self.binding_limit() {
            return self.prepare(
                ARGMAX_ROWS_FORWARD,
                &[],
                &[bind(0, "x", x), bind(4, "indices", indices)],
                3,
                &params,
                flat_groups(rows),
            );
        }
        // x over one binding (an LM's logits): a launch per part of whole rows.
        let mut launches = Vec::new();
        for (first, count, part, base) in self.whole_row_parts(op, "x (one row of it)", x, rows, cols)? {
            let params = ReduceParams {
                rows: dim(op, count)?,
                first_row: dim(op, first)?,
                part_base: dim(op, base)?,
                ..params
            };
            launches.push(self.prepare(
                ARGMAX_ROWS_FORWARD,
                &[],
                &[bind(0, "x", part), bind(4, "indices", indices)],
                3,
                &params,
                flat_groups(count),
            )?);
        }
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no rows", &[&[rows]]))
    }
}
