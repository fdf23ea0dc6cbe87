//! `loss.wgsl`: mean squared error and softmax cross-entropy (mean reduction).

use super::registry::*;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View};
use crate::error::{Error, Result};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct LossParams {
    rows: u32,
    cols: u32,
    n: u32,
    _pad: u32,
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
    /// loss[0] = mean((pred - target)²).
    pub fn mse_forward(&self, loss: View<'_>, pred: View<'_>, target: View<'_>) -> Result<Dispatch> {
        let op = MSE_FORWARD.entry;
        check_mse(op, loss.len, 1, &pred, &target)?;
        let params = LossParams { rows: 1, cols: dim(op, pred.len)?, n: dim(op, pred.len)?, _pad: 0 };
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
    pub fn mse_backward(
        &self,
        dpred: View<'_>,
        pred: View<'_>,
        target: View<'_>,
        dloss: View<'_>,
    ) -> Result<Dispatch> {
        let op = MSE_BACKWARD.entry;
        check_mse(op, dpred.len, pred.len, &pred, &target)?;
        if dloss.len != 1 {
            return Err(Error::shape(op, "dloss must hold one value", &[&[dloss.len]]));
        }
        let params = LossParams { rows: 1, cols: dim(op, pred.len)?, n: dim(op, pred.len)?, _pad: 0 };
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
        let params = LossParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, logits.len)?, _pad: 0 };
        self.prepare(
            CROSS_ENTROPY_FORWARD,
            &[],
            &[bind(0, "logits", logits), bind(4, "labels", labels), bind(2, "loss", loss)],
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
        let params = LossParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, logits.len)?, _pad: 0 };
        self.prepare(
            CROSS_ENTROPY_BACKWARD,
            &[],
            &[
                bind(0, "logits", logits),
                bind(4, "labels", labels),
                bind(5, "dloss", dloss),
                bind(2, "dlogits", dlogits),
            ],
            3,
            &params,
            flat_groups(rows),
        )
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
        let op = MSE_FORWARD_BACKWARD.entry;
        check_mse(op, loss.len, 1, &pred, &target)?;
        if dloss.len != 1 || dpred.len != pred.len {
            return Err(Error::shape(op, "dpred must match pred and dloss hold one value", &[&[dpred.len], &[pred.len], &[dloss.len]]));
        }
        let params = LossParams { rows: 1, cols: dim(op, pred.len)?, n: dim(op, pred.len)?, _pad: 0 };
        self.prepare(
            MSE_FORWARD_BACKWARD,
            &[],
            &[
                bind(0, "pred", pred),
                bind(1, "target", target),
                bind(2, "loss", loss),
                bind(5, "dloss", dloss),
                bind(6, "dpred", dpred),
            ],
            3,
            &params,
            1,
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
        let op = CROSS_ENTROPY_FORWARD_BACKWARD.entry;
        check_ce(op, &logits, &labels, rows, cols)?;
        if loss.len != 1 || dloss.len != 1 || dlogits.len != logits.len {
            return Err(Error::shape(
                op,
                "loss and dloss hold one value, dlogits matches logits",
                &[&[loss.len], &[dlogits.len], &[logits.len], &[dloss.len]],
            ));
        }
        let params = LossParams { rows: dim(op, rows)?, cols: dim(op, cols)?, n: dim(op, logits.len)?, _pad: 0 };
        self.prepare(
            CROSS_ENTROPY_FORWARD_BACKWARD,
            &[],
            &[
                bind(0, "logits", logits),
                bind(4, "labels", labels),
                bind(2, "loss", loss),
                bind(5, "dloss", dloss),
                bind(6, "dlogits", dlogits),
            ],
            3,
            &params,
            1,
        )
    }
}
