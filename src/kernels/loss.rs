//! `loss.wgsl`: mean squared error and softmax cross-entropy (mean reduction),
//! alone or fused with their gradient and the last Linear layer's work.

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View};
use crate::error::{Error, Result};

entry_points! {
    Loss {
        MSE_FORWARD = "mse_forward",
        MSE_BACKWARD = "mse_backward",
        CROSS_ENTROPY_FORWARD = "cross_entropy_forward",
        CROSS_ENTROPY_BACKWARD = "cross_entropy_backward",
        MSE_FORWARD_BACKWARD = "mse_forward_backward",
        CROSS_ENTROPY_FORWARD_BACKWARD = "cross_entropy_forward_backward",
        MSE_LINEAR_FORWARD_BACKWARD = "mse_linear_forward_backward",
        CROSS_ENTROPY_LINEAR_FORWARD_BACKWARD = "cross_entropy_linear_forward_backward",
        MSE_PARTIAL = "mse_partial",
        CROSS_ENTROPY_PARTIAL = "cross_entropy_partial",
        LOSS_FINISH = "loss_finish",
    }
}

/// Elements per invocation of `mse_partial` (loss.wgsl's `LOSS_CHUNK`).
const LOSS_CHUNK: usize = 64;

/// Lanes of the single-workgroup loss kernels (`WG`).
const LOSS_LANES: usize = 256;

/// On a GPU, the most elements an MSE takes in one workgroup: 16 per lane.
/// Beyond it `mse_forward` runs in two stages (chunks of [`LOSS_CHUNK`]
/// over many workgroups, then one workgroup over their sums), since one
/// workgroup holds one of the GPU's ~100 compute units.
const MSE_ONE_WORKGROUP_MAX_GPU: usize = 16 * LOSS_LANES;

/// Largest prediction (elements) whose loss and gradient run as one
/// single-workgroup dispatch on a CPU adapter (the plan's
/// `PlanOptions::fused_loss_max`): there a workgroup runs on one thread
/// anyway, and the dispatches fusion saves cost ~50–80 µs each.
pub const FUSED_LOSS_MAX: usize = 1 << 16;

/// The same on a GPU: 16 elements per lane, a few microseconds on one
/// compute unit, about the two or three dispatches fusion saves; a larger
/// loss is planned unfused, its gradient over many workgroups, its value
/// in two stages and a fused bias gradient as a two-stage column sum.
pub const FUSED_LOSS_MAX_GPU: usize = 16 * LOSS_LANES;

/// Largest Linear layer (rows·outputs·inputs multiply-adds, once forward
/// and once for the weight gradient) computed inside the loss's
/// single-workgroup dispatch on a CPU adapter: below this it finishes well
/// within the ~50–80 µs a dispatch costs on lavapipe.
pub const LINEAR_IN_LOSS_MAX_MACS: usize = 1 << 15;

/// The same on a GPU: 16 multiply-adds per lane each way, within the few
/// microseconds of the matmul dispatches it saves; a larger layer runs as
/// the tiled matmuls, which fill the chip.
pub const LINEAR_IN_LOSS_MAX_MACS_GPU: usize = 16 * LOSS_LANES;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct LossParams {
    rows: u32,
    cols: u32,
    n: u32,
    inner: u32,
    /// The cross-entropy row kernels' part (see `ce_launches`).
    first_row: u32,
    part_rows: u32,
    part_base: u32,
    _pad: u32,
}

/// What a loss compares its prediction with; the variant picks the loss.
#[derive(Clone, Copy, Debug)]
pub enum LossTargets<'a> {
    /// f32 values shaped like the prediction: mean squared error.
    Values(View<'a>),
    /// u32 class indices, one per row: softmax cross-entropy.
    Labels(View<'a>),
}

/// A Linear layer whose forward and weight gradient run inside a fused
/// loss dispatch: pred = x·weightᵀ (+ bias), weight_grad += dpredᵀ·x.
#[derive(Clone, Copy, Debug)]
pub struct LossLinear<'a> {
    /// [rows, inner]
    pub x: View<'a>,
    /// [cols, inner], torch.nn.Linear's layout.
    pub weight: View<'a>,
    /// [cols]
    pub bias: Option<View<'a>>,
    pub inner: usize,
    /// [cols, inner], added into.
    pub weight_grad: View<'a>,
}

fn check_mse(op: &'static str, out_len: usize, want_out: usize, pred: &View<'_>, target: &View<'_>) -> Result<()> {
    if pred.len == 0 || pred.len != target.len || out_len != want_out {
        return Err(Error::shape(
            op,
            format!("pred and target must have equal non-zero length and the output {want_out}"),
            &[&[pred.len], &[target.len], &[out_len]],
        ));
    }
    Ok(())
}

fn check_ce(op: &'static str, logits: &View<'_>, labels: &View<'_>, rows: usize, cols: usize) -> Result<()> {
    if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(logits.len) || labels.len != rows {
        return Err(Error::shape(
            op,
            format!("logits must be rows×cols = {rows}×{cols} and labels {rows} long"),
            &[&[logits.len], &[labels.len]],
        ));
    }
    Ok(())
}

impl Kernels {
    /// The largest prediction whose loss and gradient the plan fuses into
    /// one single-workgroup dispatch on this adapter: [`FUSED_LOSS_MAX`]
    /// on a CPU adapter, [`FUSED_LOSS_MAX_GPU`] on a GPU.
    /// A prediction over one storage binding is never fused: the
    /// unfused row kernels split it.
    pub fn fused_loss_max(&self) -> usize {
        let max = if self.gpu_shaped() {
            FUSED_LOSS_MAX_GPU
        } else {
            FUSED_LOSS_MAX
        };
        max.min(self.part_capacity())
    }

    /// The largest last Linear layer (multiply-adds) the plan moves into
    /// the fused loss on this adapter: [`LINEAR_IN_LOSS_MAX_MACS`] or
    /// [`LINEAR_IN_LOSS_MAX_MACS_GPU`].
    /// Its weight and input (each at most this many values) fit one binding.
    pub fn linear_in_loss_max_macs(&self) -> usize {
        self.linear_in_loss_max_macs_unbound().min(self.part_capacity())
    }

    fn linear_in_loss_max_macs_unbound(&self) -> usize {
        if self.gpu_shaped() {
            LINEAR_IN_LOSS_MAX_MACS_GPU
        } else {
            LINEAR_IN_LOSS_MAX_MACS
        }
    }

    /// A loss's two stages: `first` writes `partials` values into the
    /// device's scratch (bound at slot 2, after `bindings`) over `groups`
    /// workgroups, then `loss_finish` sums them into `loss` and divides by
    /// `count`.
    #[allow(clippy::too_many_arguments)]
    fn loss_two_stage(
        &self,
        first: super::Kernel,
        bindings: [super::Binding<'_>; 2],
        params: &LossParams,
        partials: usize,
        groups: u64,
        loss: View<'_>,
        count: usize,
    ) -> Result<Dispatch> {
        let op = first.entry;
        let _gl = self.device().lock_gl();
        let scratch = self.reduction_scratch(op, partials)?;
        let partial = View {
            buffer: &scratch,
            offset: 0,
            len: partials,
        };
        let [a, b] = bindings;
        let stage_one = self.prepare(first, &[], &[a, b, bind(2, "partials", partial)], 3, params, groups)?;
        let finish = LossParams {
            rows: dim(op, count)?,
            cols: 1,
            n: dim(op, partials)?,
            inner: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        let stage_two = self.prepare(
            LOSS_FINISH,
            &[],
            &[bind(0, "partials", partial), bind(2, "loss", loss)],
            3,
            &finish,
            1,
        )?;
        Ok(stage_one.then(stage_two))
    }

    /// loss[0] = mean((pred - target)²).
    pub fn mse_forward(&self, loss: View<'_>, pred: View<'_>, target: View<'_>) -> Result<Dispatch> {
        let op = MSE_FORWARD.entry;
        check_mse(op, loss.len, 1, &pred, &target)?;
        let params = LossParams {
            rows: 1,
            cols: dim(op, pred.len)?,
            n: dim(op, pred.len)?,
            inner: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        if self.gpu_shaped() && pred.len > MSE_ONE_WORKGROUP_MAX_GPU {
            let chunks = pred.len.div_ceil(LOSS_CHUNK);
            return self.loss_two_stage(
                MSE_PARTIAL,
                [bind(0, "pred", pred), bind(1, "target", target)],
                &params,
                chunks,
                flat_groups(chunks),
                loss,
                pred.len,
            );
        }
        self.prepare(
            MSE_FORWARD,
            &[],
            &[bind(0, "pred", pred), bind(1, "target", target), bind(2, "loss", loss)],
            3,
            &params,
            1,
        )
    }

    /// dpred = 2 (pred - target) / n · dloss[0].
    pub fn mse_backward(&self, dpred: View<'_>, pred: View<'_>, target: View<'_>, dloss: View<'_>) -> Result<Dispatch> {
        let op = MSE_BACKWARD.entry;
        check_mse(op, dpred.len, pred.len, &pred, &target)?;
        if dloss.len != 1 {
            return Err(Error::shape(op, "dloss must hold one value", &[&[dloss.len]]));
        }
        let params = LossParams {
            rows: 1,
            cols: dim(op, pred.len)?,
            n: dim(op, pred.len)?,
            inner: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        self.prepare(
            MSE_BACKWARD,
            &[],
            &[
                bind(0, "pred", pred),
                bind(1, "target", target),
                bind(2, "dpred", dpred),
                bind(5, "dloss", dloss),
            ],
            3,
            &params,
            flat_groups(pred.len),
        )
    }

    /// loss[0] = mean over rows of -log softmax(logits[r])[labels[r]].
    /// `labels` holds u32 class indices; one ≥ cols makes the loss NaN.
    pub fn cross_entropy_forward(
        &self,
        loss: View<'_>,
        logits: View<'_>,
        labels: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = CROSS_ENTROPY_FORWARD.entry;
        check_ce(op, &logits, &labels, rows, cols)?;
        if loss.len != 1 {
            return Err(Error::shape(op, "loss must hold one value", &[&[loss.len]]));
        }
        let params = LossParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, logits.len)?,
            inner: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        // One workgroup gives each lane a row; past one row per lane a GPU
        // does better with a row per invocation over many workgroups.
        if self.gpu_shaped() && rows > LOSS_LANES {
            let params = LossParams {
                part_rows: dim(op, rows)?,
                ..params
            };
            return self.loss_two_stage(
                CROSS_ENTROPY_PARTIAL,
                [bind(0, "logits", logits), bind(4, "labels", labels)],
                &params,
                rows,
                flat_groups(rows),
                loss,
                rows,
            );
        }
        // Logits over one binding: each row's loss by parts of rows, then
        // their mean, in the single-workgroup kernel's order.
        if logits.bytes() > self.binding_limit() {
            let _gl = self.device().lock_gl();
            let scratch = self.reduction_scratch(op, rows)?;
            let partials = View {
                buffer: &scratch,
                offset: 0,
                len: rows,
            };
            let mut launches = Vec::new();
            for (params, part, _) in self.ce_launches(op, params, logits, None, rows, cols)? {
                launches.push(self.prepare(
                    CROSS_ENTROPY_PARTIAL,
                    &[],
                    &[
                        bind(0, "logits", part),
                        bind(4, "labels", labels),
                        bind(2, "partials", partials),
                    ],
                    3,
                    &params,
                    flat_groups(params.part_rows as usize),
                )?);
            }
            let finish = LossParams {
                rows: dim(op, rows)?,
                cols: 1,
                n: dim(op, rows)?,
                ..bytemuck::Zeroable::zeroed()
            };
            let finish = self.prepare(
                LOSS_FINISH,
                &[],
                &[bind(0, "partials", partials), bind(2, "loss", loss)],
                3,
                &finish,
                1,
            )?;
            let sums = Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no rows", &[&[rows]]))?;
            return Ok(sums.then(finish));
        }
        self.prepare(
            CROSS_ENTROPY_FORWARD,
            &[],
            &[
                bind(0, "logits", logits),
                bind(4, "labels", labels),
                bind(2, "loss", loss),
            ],
            3,
            &params,
            1,
        )
    }

    /// dlogits = (softmax(logits) - onehot(labels)) / rows · dloss[0].
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_backward(
        &self,
        dlogits: View<'_>,
        logits: View<'_>,
        labels: View<'_>,
        dloss: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let op = CROSS_ENTROPY_BACKWARD.entry;
        check_ce(op, &logits, &labels, rows, cols)?;
        if dloss.len != 1 || dlogits.len != logits.len {
            return Err(Error::shape(
                op,
                "dlogits must match logits and dloss hold one value",
                &[&[dlogits.len], &[logits.len], &[dloss.len]],
            ));
        }
        let params = LossParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, logits.len)?,
            inner: 0,
            ..bytemuck::Zeroable::zeroed()
        };
        // Logits over one binding: a launch per part of rows.
        let mut launches = Vec::new();
        for (params, part, dpart) in self.ce_launches(op, params, logits, Some(dlogits), rows, cols)? {
            let bindings = [
                bind(0, "logits", part),
                bind(4, "labels", labels),
                bind(5, "dloss", dloss),
                bind(2, "dlogits", dpart.unwrap_or(dlogits)),
            ];
            launches.push(self.prepare(
                CROSS_ENTROPY_BACKWARD,
                &[],
                &bindings,
                3,
                &params,
                flat_groups(params.part_rows as usize),
            )?);
        }
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no rows", &[&[rows]]))
    }

    /// The launches of a cross-entropy row kernel over `rows` rows of
    /// `logits` (and `dlogits`, bound alike): one over all rows when the
    /// logits fit a binding, else one per part of whole rows that fits,
    /// each with its parameters and bindings. Both tensors start at
    /// aligned offsets, so their parts start at the same place in their
    /// bindings.
    fn ce_launches<'v>(
        &self,
        op: &'static str,
        params: LossParams,
        logits: View<'v>,
        dlogits: Option<View<'v>>,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<(LossParams, View<'v>, Option<View<'v>>)>> {
        if logits.bytes() <= self.binding_limit() {
            return Ok(vec![(
                LossParams {
                    part_rows: dim(op, rows)?,
                    ..params
                },
                logits,
                dlogits,
            )]);
        }
        let mut launches = Vec::new();
        for (first, count, part, base) in self.whole_row_parts(op, "logits (one row of them)", logits, rows, cols)? {
            let dpart = dlogits.map(|d| self.bind_part(d, first * cols, count * cols));
            if dpart.is_some_and(|(_, b)| b != base) {
                return Err(Error::InvalidArgument {
                    op,
                    reason:
                        "logits and dlogits sit at different storage alignments, so their parts cannot be indexed alike"
                            .into(),
                });
            }
            let params = LossParams {
                first_row: dim(op, first)?,
                part_rows: dim(op, count)?,
                part_base: dim(op, base)?,
                ..params
            };
            launches.push((params, part, dpart.map(|(d, _)| d)));
        }
        Ok(launches)
    }

    /// `mse_forward` and `mse_backward` in one dispatch (one workgroup:
    /// meant for the small tensors a loss sees).
    pub fn mse_forward_backward(
        &self,
        loss: View<'_>,
        dpred: View<'_>,
        pred: View<'_>,
        target: View<'_>,
        dloss: View<'_>,
    ) -> Result<Dispatch> {
        self.loss_forward_backward_fused(
            LossTargets::Values(target),
            loss,
            dpred,
            pred,
            dloss,
            1,
            pred.len,
            None,
            None,
        )
    }

    /// `cross_entropy_forward` and `cross_entropy_backward` in one dispatch
    /// (one workgroup).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_forward_backward(
        &self,
        loss: View<'_>,
        dlogits: View<'_>,
        logits: View<'_>,
        labels: View<'_>,
        dloss: View<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        self.loss_forward_backward_fused(
            LossTargets::Labels(labels),
            loss,
            dlogits,
            logits,
            dloss,
            rows,
            cols,
            None,
            None,
        )
    }

    /// A loss and its gradient in one single-workgroup dispatch, with more
    /// of the last layer's work folded in (each saves a dispatch):
    /// - `linear`: the prediction is computed here from a Linear layer and
    ///   written to `pred`, and the layer's weight gradient accumulated;
    ///   otherwise `pred` is read;
    /// - `bias_grad[cols] +=` the column sums of `dpred`.
    ///
    /// Everything runs on one workgroup: meant for small layers.
    #[allow(clippy::too_many_arguments)]
    pub fn loss_forward_backward_fused(
        &self,
        targets: LossTargets<'_>,
        loss: View<'_>,
        dpred: View<'_>,
        pred: View<'_>,
        dloss: View<'_>,
        rows: usize,
        cols: usize,
        linear: Option<LossLinear<'_>>,
        bias_grad: Option<View<'_>>,
    ) -> Result<Dispatch> {
        let kernel = match (targets, linear.is_some()) {
            (LossTargets::Values(_), false) => MSE_FORWARD_BACKWARD,
            (LossTargets::Labels(_), false) => CROSS_ENTROPY_FORWARD_BACKWARD,
            (LossTargets::Values(_), true) => MSE_LINEAR_FORWARD_BACKWARD,
            (LossTargets::Labels(_), true) => CROSS_ENTROPY_LINEAR_FORWARD_BACKWARD,
        };
        let op = kernel.entry;
        let n = rows.checked_mul(cols).filter(|&n| n > 0 && n == pred.len);
        let targets_ok = match targets {
            LossTargets::Values(t) => t.len == pred.len,
            LossTargets::Labels(l) => l.len == rows,
        };
        if n.is_none() || !targets_ok || loss.len != 1 || dloss.len != 1 || dpred.len != pred.len {
            let target_len = match targets {
                LossTargets::Values(t) | LossTargets::Labels(t) => t.len,
            };
            return Err(Error::shape(
                op,
                format!("pred and dpred must be rows×cols = {rows}×{cols}, targets match them (labels: one per row), loss and dloss one value"),
                &[&[pred.len], &[dpred.len], &[target_len], &[loss.len], &[dloss.len]],
            ));
        }
        if let Some(b) = &bias_grad {
            if b.len != cols {
                return Err(Error::shape(
                    op,
                    format!("bias_grad must hold cols = {cols} values"),
                    &[&[b.len]],
                ));
            }
        }
        let inner = linear.map_or(0, |l| l.inner);
        if let Some(l) = &linear {
            let bias_ok = l.bias.is_none_or(|b| b.len == cols);
            let ok = inner > 0
                && rows.checked_mul(inner) == Some(l.x.len)
                && cols.checked_mul(inner) == Some(l.weight.len)
                && l.weight_grad.len == l.weight.len
                && bias_ok;
            if !ok {
                return Err(Error::shape(
                    op,
                    format!("linear: x must be {rows}×{inner}, weight and weight_grad {cols}×{inner}, bias {cols}"),
                    &[
                        &[l.x.len],
                        &[l.weight.len],
                        &[l.weight_grad.len],
                        &[l.bias.map_or(0, |b| b.len)],
                    ],
                ));
            }
        }
        let params = LossParams {
            rows: dim(op, rows)?,
            cols: dim(op, cols)?,
            n: dim(op, pred.len)?,
            inner: dim(op, inner)?,
            ..bytemuck::Zeroable::zeroed()
        };
        let constants = [
            ("BIAS_GRAD", f64::from(u8::from(bias_grad.is_some()))),
            (
                "HAS_BIAS",
                f64::from(u8::from(linear.is_some_and(|l| l.bias.is_some()))),
            ),
        ];
        let mut bindings = vec![bind(2, "loss", loss), bind(5, "dloss", dloss), bind(6, "dpred", dpred)];
        bindings.push(match targets {
            LossTargets::Values(t) => bind(1, "target", t),
            LossTargets::Labels(l) => bind(4, "labels", l),
        });
        match linear {
            None => {
                bindings.push(bind(0, "pred", pred));
                bindings.push(bind(12, "bias_grad", bias_grad.unwrap_or(self.unused_writable(0))));
            }
            Some(l) => {
                bindings.push(bind(10, "pred", pred));
                bindings.push(bind(7, "x", l.x));
                bindings.push(bind(8, "weight", l.weight));
                // Unused slots: a read-only one gets the placeholder, a
                // writable one a buffer of its own (a writable binding may
                // alias no other). The kernel touches neither.
                bindings.push(bind(9, "bias", l.bias.unwrap_or(self.unused_slot())));
                bindings.push(bind(11, "weight_grad", l.weight_grad));
                bindings.push(bind(12, "bias_grad", bias_grad.unwrap_or(self.unused_writable(0))));
            }
        }
        self.prepare(kernel, &constants, &bindings, 3, &params, 1)
    }

    /// A one-element view of the placeholder buffer, for a slot the
    /// dispatch's constants tell the kernel not to touch.
    fn unused_slot(&self) -> View<'_> {
        View {
            buffer: self.placeholder(),
            offset: 0,
            len: 1,
        }
    }
}
