//! `rowwise.wgsl`: the transformer's row-wise ops. Softmax (optionally with
//! a causal mask), layernorm, RMSNorm, cross-entropy with its gradient, each with one
//! workgroup per row, or one invocation per row for rows of at most
//! [`Kernels::short_row_max`] columns (by adapter); embedding lookup with a deterministic
//! backward (a stable counting sort of the ids, then a gather).
//!
//! None of these kernels has a row-length limit: a workgroup strides over
//! its row. Rows are spread over a 2-D grid, so the row count is bounded
//! only by `max_compute_workgroups_per_dimension`² (an `Error::TooLarge`).

use super::registry::entry_points;
use super::{bind, column_groups, dim, flat_groups, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};

entry_points! {
    Rowwise {
        SOFTMAX_FORWARD = "softmax_forward",
        SOFTMAX_BACKWARD = "softmax_backward",
        LAYERNORM_FORWARD = "layernorm_forward",
        LAYERNORM_BACKWARD = "layernorm_backward",
        LAYERNORM_BACKWARD_PARAMS = "layernorm_backward_params",
        LAYERNORM_BACKWARD_PARAMS_PARTIAL = "layernorm_backward_params_partial",
        LAYERNORM_BACKWARD_PARAMS_FINISH = "layernorm_backward_params_finish",
        CROSS_ENTROPY_ROWS_FORWARD_BACKWARD = "cross_entropy_rows_forward_backward",
        SOFTMAX_FORWARD_SHORT = "softmax_forward_short",
        SOFTMAX_BACKWARD_SHORT = "softmax_backward_short",
        LAYERNORM_FORWARD_SHORT = "layernorm_forward_short",
        LAYERNORM_BACKWARD_SHORT = "layernorm_backward_short",
        CROSS_ENTROPY_ROWS_FORWARD_BACKWARD_SHORT = "cross_entropy_rows_forward_backward_short",
        RMSNORM_FORWARD = "rmsnorm_forward",
        RMSNORM_BACKWARD = "rmsnorm_backward",
        RMSNORM_FORWARD_SHORT = "rmsnorm_forward_short",
        RMSNORM_BACKWARD_SHORT = "rmsnorm_backward_short",
        EMBEDDING_FORWARD = "embedding_forward",
        EMBEDDING_BACKWARD_SORT = "embedding_backward_sort",
        EMBEDDING_BACKWARD = "embedding_backward",
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RowParams {
    rows: u32,
    cols: u32,
    causal: u32,
    vocab: u32,
    eps: f32,
    scale: f32,
    accumulate: u32,
    block_rows: u32,
    row_start: u32,
    row_end: u32,
    table_base: u32,
    centered: u32,
}

impl RowParams {
    fn new(op: &'static str, rows: usize, cols: usize) -> Result<Self> {
        Ok(RowParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            causal: 0,
            vocab: 0,
            eps: 0.0,
            scale: 0.0,
            accumulate: 0,
            block_rows: 0,
            row_start: 0,
            row_end: 0,
            table_base: 0,
            centered: 0,
        })
    }
}

/// Checks that no dimension is zero and that each operand holds what the
/// dimensions ask for: `operands` are (name, length, wanted length; None
/// when the product overflows). The error lists the dimensions first, then
/// every operand's length in argument order.
pub(super) fn check_lengths(
    op: &'static str,
    dims: &[(&str, usize)],
    operands: &[(&str, usize, Option<usize>)],
) -> Result<()> {
    let shape: Vec<usize> = dims.iter().map(|&(_, d)| d).collect();
    let mut shapes: Vec<&[usize]> = vec![shape.as_slice()];
    let lens: Vec<[usize; 1]> = operands.iter().map(|&(_, len, _)| [len]).collect();
    shapes.extend(lens.iter().map(|l| &l[..]));
    let named = || {
        dims.iter()
            .map(|(name, d)| format!("{name} = {d}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some((name, _)) = dims.iter().find(|&&(_, d)| d == 0) {
        return Err(Error::shape(op, format!("{name} must not be 0 ({})", named()), &shapes));
    }
    let wrong: Vec<String> = operands
        .iter()
        .filter(|&&(_, len, want)| Some(len) != want)
        .map(|&(name, len, want)| match want {
            Some(w) => format!("`{name}` has {len} elements, want {w}"),
            None => format!("`{name}`: the size overflows"),
        })
        .collect();
    if !wrong.is_empty() {
        return Err(Error::shape(op, format!("{} ({})", wrong.join("; "), named()), &shapes));
    }
    Ok(())
}

fn finite(op: &'static str, name: &str, value: f32) -> Result<()> {
    if !value.is_finite() {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{name} must be finite, got {value}"),
        });
    }
    Ok(())
}

/// Checks token ids on the host before they are written to the GPU: every
/// id must be < `vocab`. The kernels cannot raise an error; with a bad id
/// `embedding_forward` writes a row of NaN and the backward drops that
/// position's gradient, so callers that hold the ids on the host should
/// check them here first.
pub fn check_token_ids(op: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(n) => Err(Error::InvalidArgument {
            op,
            reason: format!("id {} at position {n} is outside the vocabulary of {vocab}", ids[n]),
        }),
        None => Ok(()),
    }
}

/// The longest row the `_short` kernels take on a CPU adapter: one
/// invocation per row with a serial loop, instead of one 256-wide
/// workgroup per row with barrier trees. On lavapipe (bench-suite/benches/kernels.rs,
/// `transformer` and `rowwise` families) the serial path is ~100× faster
/// at 12 and 48 columns and still faster at 128, where a row is 128 serial
/// steps against the tree's 8 barriers; long rows (a vocabulary) keep a
/// workgroup each so a few rows still spread over the whole device.
pub const SHORT_ROW_MAX: usize = 128;

/// The same on a GPU ([`Kernels::short_row_max`]), where a barrier costs a
/// few cycles, not a fiber switch: 32 columns, one 128-byte line. A lone
/// invocation reads a row that fits one line at full efficiency (its
/// neighbours' rows are the next lines), where a 256-wide workgroup would
/// leave at least 7 of 8 lanes idle; a longer row spans lines that a
/// workgroup reads coalesced, and its serial loop would cost more than
/// the workgroup's 8-level tree.
pub const SHORT_ROW_MAX_GPU: usize = 32;

/// Invocations of `embedding_backward_sort`'s one workgroup on a GPU that
/// allows them (on a CPU adapter, and under WebGPU's default limit, 256):
/// the histogram, the scan's buckets per lane and the tiles of the
/// scatter (two barriers each) all shrink 4×, and one workgroup is all
/// this sort has. `SORT_WG_MAX` in rowwise.wgsl.
const SORT_WG_GPU: u32 = 1024;

impl Kernels {
    /// The longest row of the one-invocation-per-row (`_short`) kernels on
    /// this adapter: [`SHORT_ROW_MAX`] on a CPU adapter, else
    /// [`SHORT_ROW_MAX_GPU`] (see [`Kernels::gpu_shaped`]).
    pub fn short_row_max(&self) -> usize {
        if self.gpu_shaped() {
            SHORT_ROW_MAX_GPU
        } else {
            SHORT_ROW_MAX
        }
    }

    /// `short` with one invocation per row when `cols` ≤
    /// [`Kernels::short_row_max`], else `long` with one workgroup per row;
    /// both over a folded 2-D grid.
    fn per_row<P: bytemuck::Pod>(
        &self,
        (long, short): (Kernel, Kernel),
        bindings: &[super::Binding<'_>],
        params: &P,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        if cols <= self.short_row_max() {
            self.prepare(short, &[], bindings, 3, params, flat_groups(rows))
        } else {
            self.prepare(long, &[], bindings, 3, params, rows as u64)
        }
    }

    /// y[rows, cols] = softmax(x[rows, cols]) over each row. With
    /// `causal = Some(t)` the rows are attention scores [batch·heads·t, t]:
    /// row r is query position r % t, columns after it get probability 0.
    pub fn softmax_forward(
        &self,
        y: View<'_>,
        x: View<'_>,
        rows: usize,
        cols: usize,
        causal: Option<usize>,
    ) -> Result<Dispatch> {
        let op = SOFTMAX_FORWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[("y", y.len, n), ("x", x.len, n)],
        )?;
        let mut params = RowParams::new(op, rows, cols)?;
        if let Some(t) = causal {
            if t != cols || rows % t != 0 {
                return Err(Error::shape(
                    op,
                    format!("a causal mask over T = {t} positions needs scores [batch·heads·T, T]; got rows {rows}, cols {cols}"),
                    &[&[rows, cols], &[t]],
                ));
            }
            params.causal = dim(op, t)?;
        }
        self.per_row(
            (SOFTMAX_FORWARD, SOFTMAX_FORWARD_SHORT),
            &[bind(0, "x", x), bind(2, "y", y)],
            &params,
            rows,
            cols,
        )
    }

    /// dx[rows, cols] = y · (dy − Σ_c dy·y) per row, from the forward's
    /// output y (a causal mask needs nothing more: masked y are 0).
    pub fn softmax_backward(
        &self,
        dx: View<'_>,
        y: View<'_>,
        dy: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = SOFTMAX_BACKWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[("dx", dx.len, n), ("y", y.len, n), ("dy", dy.len, n)],
        )?;
        let params = RowParams::new(op, rows, cols)?;
        self.per_row(
            (SOFTMAX_BACKWARD, SOFTMAX_BACKWARD_SHORT),
            &[bind(1, "y", y), bind(4, "dy", dy), bind(2, "dx", dx)],
            &params,
            rows,
            cols,
        )
    }

    /// y[rows, cols] = (x − mean) / sqrt(var + eps) · weight[cols] +
    /// bias[cols] over each row (torch.nn.LayerNorm over the last
    /// dimension), keeping mean[rows] and rstd[rows] = 1 / sqrt(var + eps)
    /// for the backward.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        y: View<'_>,
        mean: View<'_>,
        rstd: View<'_>,
        x: View<'_>,
        weight: View<'_>,
        bias: View<'_>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<Dispatch> {
        let op = LAYERNORM_FORWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("y", y.len, n),
                ("mean", mean.len, Some(rows)),
                ("rstd", rstd.len, Some(rows)),
                ("x", x.len, n),
                ("weight", weight.len, Some(cols)),
                ("bias", bias.len, Some(cols)),
            ],
        )?;
        crate::ops::check_norm_eps(op, eps)?;
        let params = RowParams {
            eps,
            ..RowParams::new(op, rows, cols)?
        };
        self.per_row(
            (LAYERNORM_FORWARD, LAYERNORM_FORWARD_SHORT),
            &[
                bind(0, "x", x),
                bind(5, "weight", weight),
                bind(6, "bias", bias),
                bind(2, "y", y),
                bind(7, "mean", mean),
                bind(8, "rstd", rstd),
            ],
            &params,
            rows,
            cols,
        )
    }

    /// dx[rows, cols] of layernorm from dy, the forward input x, weight and
    /// the forward's mean and rstd. The parameter gradients come from
    /// [`Kernels::layernorm_backward_params`].
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        dx: View<'_>,
        dy: View<'_>,
        x: View<'_>,
        weight: View<'_>,
        mean: View<'_>,
        rstd: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = LAYERNORM_BACKWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("dx", dx.len, n),
                ("dy", dy.len, n),
                ("x", x.len, n),
                ("weight", weight.len, Some(cols)),
                ("mean", mean.len, Some(rows)),
                ("rstd", rstd.len, Some(rows)),
            ],
        )?;
        let params = RowParams::new(op, rows, cols)?;
        self.per_row(
            (LAYERNORM_BACKWARD, LAYERNORM_BACKWARD_SHORT),
            &[
                bind(4, "dy", dy),
                bind(0, "x", x),
                bind(5, "weight", weight),
                bind(9, "mean", mean),
                bind(10, "rstd", rstd),
                bind(2, "dx", dx),
            ],
            &params,
            rows,
            cols,
        )
    }

    /// dweight[cols] = Σ_r dy · x̂ and dbias[cols] = Σ_r dy, with
    /// x̂ = (x − mean)·rstd, or `+=` both when `accumulate`: one invocation
    /// per column adds the rows in order, or on a GPU with many rows two
    /// stages over fixed blocks of rows (as `Kernels::sum_rows`); either
    /// way the result is deterministic.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward_params(
        &self,
        accumulate: bool,
        dweight: View<'_>,
        dbias: View<'_>,
        dy: View<'_>,
        x: View<'_>,
        mean: View<'_>,
        rstd: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = LAYERNORM_BACKWARD_PARAMS.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("dweight", dweight.len, Some(cols)),
                ("dbias", dbias.len, Some(cols)),
                ("dy", dy.len, n),
                ("x", x.len, n),
                ("mean", mean.len, Some(rows)),
                ("rstd", rstd.len, Some(rows)),
            ],
        )?;
        let params = RowParams {
            accumulate: u32::from(accumulate),
            centered: 1,
            ..RowParams::new(op, rows, cols)?
        };
        self.norm_backward_params(
            op,
            &params,
            NormParamViews {
                dweight,
                dbias,
                dy,
                x,
                mean,
                rstd,
            },
            rows,
            cols,
        )
    }

    /// The column sums of [`Kernels::layernorm_backward_params`] and
    /// [`Kernels::rmsnorm_backward_params`] (`params.centered` picks), in
    /// one launch or two stages; the shapes are checked.
    fn norm_backward_params(
        &self,
        op: &'static str,
        params: &RowParams,
        v: NormParamViews<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let NormParamViews {
            dweight,
            dbias,
            dy,
            x,
            mean,
            rstd,
        } = v;
        if let Some(blocks) = self.column_blocks(rows, cols, 2) {
            // Partials [blocks, 2, cols] in the device's scratch, then
            // their sums in block order.
            let _gl = self.device().lock_gl();
            let len = blocks.blocks * 2 * cols;
            let scratch = self.reduction_scratch(op, len)?;
            let partial = View {
                buffer: &scratch,
                offset: 0,
                len,
            };
            let params = RowParams {
                block_rows: dim(op, blocks.block_rows)?,
                ..*params
            };
            let first = self.prepare(
                LAYERNORM_BACKWARD_PARAMS_PARTIAL,
                &[],
                &[
                    bind(4, "dy", dy),
                    bind(0, "x", x),
                    bind(9, "mean", mean),
                    bind(10, "rstd", rstd),
                    bind(2, "partial", partial),
                ],
                3,
                &params,
                flat_groups(blocks.blocks * cols),
            )?;
            let second = self.prepare(
                LAYERNORM_BACKWARD_PARAMS_FINISH,
                &[],
                &[
                    bind(0, "partial", partial),
                    bind(11, "dweight", dweight),
                    bind(12, "dbias", dbias),
                ],
                3,
                &params,
                column_groups(cols),
            )?;
            return Ok(first.then(second));
        }
        self.prepare(
            LAYERNORM_BACKWARD_PARAMS,
            &[],
            &[
                bind(4, "dy", dy),
                bind(0, "x", x),
                bind(9, "mean", mean),
                bind(10, "rstd", rstd),
                bind(11, "dweight", dweight),
                bind(12, "dbias", dbias),
            ],
            3,
            params,
            column_groups(cols),
        )
    }

    /// y[rows, cols] = x · rstd · weight[cols] with rstd[rows] =
    /// 1 / sqrt(mean_c(x²) + eps) kept for the backward: torch.nn.RMSNorm
    /// and Hugging Face's LlamaRMSNorm over the last dimension, the same
    /// f32 steps in the same order. `eps` must be finite and > 0 (the one
    /// rule for RMSNorm): a row of zeros then gives y = 0, where eps = 0
    /// would give 0·∞ = NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        &self,
        y: View<'_>,
        rstd: View<'_>,
        x: View<'_>,
        weight: View<'_>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<Dispatch> {
        let op = RMSNORM_FORWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("y", y.len, n),
                ("rstd", rstd.len, Some(rows)),
                ("x", x.len, n),
                ("weight", weight.len, Some(cols)),
            ],
        )?;
        crate::ops::check_norm_eps(op, eps)?;
        let params = RowParams {
            eps,
            ..RowParams::new(op, rows, cols)?
        };
        self.per_row(
            (RMSNORM_FORWARD, RMSNORM_FORWARD_SHORT),
            &[
                bind(0, "x", x),
                bind(5, "weight", weight),
                bind(2, "y", y),
                bind(8, "rstd", rstd),
            ],
            &params,
            rows,
            cols,
        )
    }

    /// dx[rows, cols] of RMSNorm from dy, the forward input x, weight and
    /// the forward's rstd. The weight's gradient comes from
    /// [`Kernels::rmsnorm_backward_params`].
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dx: View<'_>,
        dy: View<'_>,
        x: View<'_>,
        weight: View<'_>,
        rstd: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = RMSNORM_BACKWARD.entry;
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("dx", dx.len, n),
                ("dy", dy.len, n),
                ("x", x.len, n),
                ("weight", weight.len, Some(cols)),
                ("rstd", rstd.len, Some(rows)),
            ],
        )?;
        let params = RowParams::new(op, rows, cols)?;
        self.per_row(
            (RMSNORM_BACKWARD, RMSNORM_BACKWARD_SHORT),
            &[
                bind(4, "dy", dy),
                bind(0, "x", x),
                bind(5, "weight", weight),
                bind(10, "rstd", rstd),
                bind(2, "dx", dx),
            ],
            &params,
            rows,
            cols,
        )
    }

    /// dweight[cols] = Σ_r dy · x · rstd of RMSNorm, or `+=` when
    /// `accumulate`: layernorm's column sums (the same one or two stages,
    /// deterministic) with x̂ = x·rstd and no bias.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward_params(
        &self,
        accumulate: bool,
        dweight: View<'_>,
        dy: View<'_>,
        x: View<'_>,
        rstd: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = "rmsnorm_backward_params";
        let n = rows.checked_mul(cols);
        check_lengths(
            op,
            &[("rows", rows), ("cols", cols)],
            &[
                ("dweight", dweight.len, Some(cols)),
                ("dy", dy.len, n),
                ("x", x.len, n),
                ("rstd", rstd.len, Some(rows)),
            ],
        )?;
        let params = RowParams {
            accumulate: u32::from(accumulate),
            centered: 0,
            ..RowParams::new(op, rows, cols)?
        };
        // The kernels read `mean` (any [rows] view; not centered, it is
        // multiplied away) and write no `dbias`.
        let views = NormParamViews {
            dweight,
            dbias: self.unused_writable(0),
            dy,
            x,
            mean: rstd,
            rstd,
        };
        self.norm_backward_params(op, &params, views, rows, cols)
    }

    /// Softmax cross-entropy of logits[rows, vocab] against u32
    /// targets[rows], fused with its gradient in one pass per row:
    /// losses[rows] = logsumexp(logits[r]) − logits[r, targets[r]] and
    /// dlogits[rows, vocab] = (softmax(logits[r]) − onehot(targets[r])) ·
    /// scale. For the mean loss pass scale = 1/rows and reduce `losses`
    /// with [`Kernels::mean`]. A target ≥ vocab makes its row's loss and
    /// dlogits NaN (the kernel reads no element out of bounds).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_rows_forward_backward(
        &self,
        losses: View<'_>,
        dlogits: View<'_>,
        logits: View<'_>,
        targets: View<'_>,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<Dispatch> {
        let op = CROSS_ENTROPY_ROWS_FORWARD_BACKWARD.entry;
        let n = rows.checked_mul(vocab);
        check_lengths(
            op,
            &[("rows", rows), ("vocab", vocab)],
            &[
                ("losses", losses.len, Some(rows)),
                ("dlogits", dlogits.len, n),
                ("logits", logits.len, n),
                ("targets", targets.len, Some(rows)),
            ],
        )?;
        finite(op, "scale", scale)?;
        let params = RowParams {
            scale,
            ..RowParams::new(op, rows, vocab)?
        };
        self.per_row(
            (
                CROSS_ENTROPY_ROWS_FORWARD_BACKWARD,
                CROSS_ENTROPY_ROWS_FORWARD_BACKWARD_SHORT,
            ),
            &[
                bind(0, "logits", logits),
                bind(13, "targets", targets),
                bind(14, "losses", losses),
                bind(2, "dlogits", dlogits),
            ],
            &params,
            rows,
            vocab,
        )
    }

    /// out[n, channels] = table[ids[n], :] for table[vocab, channels] and
    /// u32 ids[n]. An id ≥ vocab gives a row of NaN; check ids on the host
    /// with [`check_token_ids`] where they are at hand.
    pub fn embedding_forward(
        &self,
        out: View<'_>,
        table: View<'_>,
        ids: View<'_>,
        n: usize,
        vocab: usize,
        channels: usize,
    ) -> Result<Dispatch> {
        let op = EMBEDDING_FORWARD.entry;
        check_lengths(
            op,
            &[("n", n), ("vocab", vocab), ("channels", channels)],
            &[
                ("out", out.len, n.checked_mul(channels)),
                ("table", table.len, vocab.checked_mul(channels)),
                ("ids", ids.len, Some(n)),
            ],
        )?;
        let launches = self
            .table_parts(op, "table", table, vocab, channels)?
            .into_iter()
            .map(|part| {
                let params = RowParams {
                    vocab: dim(op, vocab)?,
                    ..part.params(op, n, channels)?
                };
                self.prepare(
                    EMBEDDING_FORWARD,
                    &[],
                    &[
                        bind(16, "table", part.binding),
                        bind(15, "ids", ids),
                        bind(2, "out", out),
                    ],
                    3,
                    &params,
                    flat_groups(out.len),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no table rows", &[&[vocab, channels]]))
    }

    /// The launches over a table [vocab, channels] that fits one storage
    /// binding (one, binding it whole) or does not (one per range of rows
    /// whose part fits, each bound from the nearest aligned element).
    fn table_parts<'a>(
        &self,
        op: &'static str,
        name: &'static str,
        table: View<'a>,
        vocab: usize,
        channels: usize,
    ) -> Result<Vec<TablePart<'a>>> {
        let parts = RowPartLayout {
            op,
            name,
            vocab,
            channels,
            value_bytes: 4,
            values_per_part: self.part_capacity(),
        };
        self.row_parts(table, parts, |start, len| self.bind_part(table, start, len))
    }

    /// The launches over the rows of a table of `layout.vocab` rows held
    /// in `whole`: the whole table when it fits one binding, else ranges
    /// of rows of at most `values_per_part` values, each bound by
    /// `bind_values(first value, values)` as (binding, first value's index
    /// in it). f32 tables bind elements, f16 ones the words holding them.
    pub(crate) fn row_parts<'a>(
        &self,
        whole: View<'a>,
        layout: RowPartLayout,
        bind_values: impl Fn(usize, usize) -> (View<'a>, usize),
    ) -> Result<Vec<TablePart<'a>>> {
        let RowPartLayout {
            op,
            name,
            vocab,
            channels,
            value_bytes,
            values_per_part,
        } = layout;
        if whole.bytes() <= self.binding_limit() {
            return Ok(vec![TablePart {
                rows: (0, vocab),
                binding: whole,
                base: 0,
            }]);
        }
        let rows_per_part = values_per_part / channels;
        if rows_per_part == 0 {
            return Err(self.binding_too_large(op, name, channels as u64 * value_bytes));
        }
        Ok((0..vocab)
            .step_by(rows_per_part)
            .map(|start| {
                let end = (start + rows_per_part).min(vocab);
                let (binding, base) = bind_values(start * channels, (end - start) * channels);
                TablePart {
                    rows: (start, end),
                    binding,
                    base,
                }
            })
            .collect())
    }

    /// The first half of the embedding backward: order[n] (u32) = the
    /// positions sorted by id, stably, using cursor[vocab + 1] (u32) as
    /// scratch. One workgroup (of 1024 lanes on a GPU that allows them,
    /// else 256). Record [`Kernels::embedding_backward`]
    /// after it (the same pass is fine); both buffers are plain scratch a
    /// step may reuse afterwards.
    pub fn embedding_backward_sort(
        &self,
        order: View<'_>,
        cursor: View<'_>,
        ids: View<'_>,
        n: usize,
        vocab: usize,
    ) -> Result<Dispatch> {
        let op = EMBEDDING_BACKWARD_SORT.entry;
        check_lengths(
            op,
            &[("n", n), ("vocab", vocab)],
            &[
                ("order", order.len, Some(n)),
                ("cursor", cursor.len, vocab.checked_add(1)),
                ("ids", ids.len, Some(n)),
            ],
        )?;
        // vocab + 1 buckets must be countable in u32.
        dim(op, vocab + 1)?;
        let params = RowParams {
            vocab: dim(op, vocab)?,
            ..RowParams::new(op, n, 1)?
        };
        let limits = self.device().limits();
        let fits = limits.max_compute_invocations_per_workgroup >= SORT_WG_GPU
            && limits.max_compute_workgroup_size_x >= SORT_WG_GPU;
        let lanes = if self.gpu_shaped() && fits { SORT_WG_GPU } else { 256 };
        self.prepare(
            EMBEDDING_BACKWARD_SORT,
            &[("SORT_WG", f64::from(lanes))],
            &[
                bind(15, "ids", ids),
                bind(18, "cursor", cursor),
                bind(19, "order", order),
            ],
            3,
            &params,
            1,
        )
    }

    /// dtable[vocab, channels] += Σ over positions with ids[n] = v of
    /// dout[n, :], each row summed in position order, from the `order` that
    /// [`Kernels::embedding_backward_sort`] wrote: deterministic, bit for
    /// bit, however often a token repeats. Positions with an id ≥ vocab
    /// add nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward(
        &self,
        dtable: View<'_>,
        dout: View<'_>,
        ids: View<'_>,
        order: View<'_>,
        n: usize,
        vocab: usize,
        channels: usize,
    ) -> Result<Dispatch> {
        let op = EMBEDDING_BACKWARD.entry;
        let rows_out = n.checked_mul(channels);
        check_lengths(
            op,
            &[("n", n), ("vocab", vocab), ("channels", channels)],
            &[
                ("dtable", dtable.len, vocab.checked_mul(channels)),
                ("dout", dout.len, rows_out),
                ("ids", ids.len, Some(n)),
                ("order", order.len, Some(n)),
            ],
        )?;
        let launches = self
            .table_parts(op, "dtable", dtable, vocab, channels)?
            .into_iter()
            .map(|part| {
                let params = RowParams {
                    vocab: dim(op, vocab)?,
                    ..part.params(op, n, channels)?
                };
                let bindings = [
                    bind(4, "dout", dout),
                    bind(15, "ids", ids),
                    bind(19, "order", order),
                    bind(17, "dtable", part.binding),
                ];
                self.prepare(EMBEDDING_BACKWARD, &[], &bindings, 3, &params, flat_groups(dout.len))
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no table rows", &[&[vocab, channels]]))
    }
}

/// One embedding launch's rows of the table: ids rows.0..rows.1, whose
/// first element is element `base` of `binding`.
pub(crate) struct TablePart<'a> {
    pub(crate) rows: (usize, usize),
    pub(crate) binding: View<'a>,
    pub(crate) base: usize,
}

/// How [`Kernels::row_parts`] splits a table: its rows and width, the
/// bytes of one value (for the error when one row is over a binding) and
/// the values one part may hold.
pub(crate) struct RowPartLayout {
    pub(crate) op: &'static str,
    pub(crate) name: &'static str,
    pub(crate) vocab: usize,
    pub(crate) channels: usize,
    pub(crate) value_bytes: u64,
    pub(crate) values_per_part: usize,
}

impl TablePart<'_> {
    fn params(&self, op: &'static str, n: usize, channels: usize) -> Result<RowParams> {
        Ok(RowParams {
            row_start: dim(op, self.rows.0)?,
            row_end: dim(op, self.rows.1)?,
            table_base: dim(op, self.base)?,
            ..RowParams::new(op, n, channels)?
        })
    }
}

/// The buffers of the norms' parameter-gradient kernels.
struct NormParamViews<'a> {
    dweight: View<'a>,
    dbias: View<'a>,
    dy: View<'a>,
    x: View<'a>,
    mean: View<'a>,
    rstd: View<'a>,
}
