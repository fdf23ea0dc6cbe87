//! Losses: MSE and cross-entropy over one workgroup (the plan runs each
//! with its backward, and can fold the last Linear layer in), and the
//! row-wise cross-entropy for logits too large for one workgroup, whose
//! dispatch also writes its gradient.

use super::{DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor};
use crate::kernels::Dispatch;

/// The loss functions, with PyTorch's default "mean" reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    Mse,
    CrossEntropy,
}

/// Largest logits (elements) whose cross-entropy runs as the loss
/// family's single-workgroup kernels, which the plan fuses with the last
/// layer; above it, one workgroup per row.
pub const SINGLE_WORKGROUP_LOSS_MAX: usize = 1 << 16;

/// Losses and their gradients.
#[derive(Clone, Debug, PartialEq)]
pub enum LossOp {
    /// inputs (prediction, target) -> scalar
    Loss(LossKind),
    /// inputs (prediction, target, dloss) -> d prediction
    LossBackward(LossKind),
    /// inputs (logits [rows, V], u32 targets [rows]) -> per-row losses
    /// [rows], one workgroup per row (any vocabulary). Its dispatch also
    /// fills the [`LossOp::CrossEntropyRowsGrad`] node added right after it
    /// with d loss_r / d logits (llm.c's fused logits, loss and gradient).
    CrossEntropyRows,
    /// inputs (the per-row losses): softmax(logits) − onehot(target),
    /// written by the cross-entropy's dispatch.
    CrossEntropyRowsGrad,
}

impl OpFamily for LossOp {
    fn name(&self) -> &'static str {
        match self {
            LossOp::Loss(LossKind::Mse) => "mse_loss",
            LossOp::Loss(LossKind::CrossEntropy) => "cross_entropy_loss",
            LossOp::LossBackward(_) => "loss_backward",
            LossOp::CrossEntropyRows => "cross_entropy_rows",
            LossOp::CrossEntropyRowsGrad => "cross_entropy_rows_grad",
        }
    }

    fn is_companion(&self) -> bool {
        matches!(self, LossOp::CrossEntropyRowsGrad)
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, i, out) = (cx.kernels(), cx.node, cx.out()?);
        let (pred, target) = (cx.input(0)?, cx.input(1)?);
        let s = cx.input_shape(0);
        match self {
            // The plan computes this loss with its backward in one dispatch.
            LossOp::Loss(kind) if cx.plan().loss_with_grad[i].is_some() => {
                let b = Tensor(cx.plan().loss_with_grad[i].unwrap_or(i));
                let (grad, dloss) = (cx.view(b)?, cx.view(cx.graph().node(b).inputs[2])?);
                match kind {
                    LossKind::Mse => k.mse_forward_backward(out, grad, pred, target, dloss),
                    LossKind::CrossEntropy => {
                        k.cross_entropy_forward_backward(out, grad, pred, target, dloss, s[0], s[1])
                    }
                }
            }
            LossOp::Loss(LossKind::Mse) => k.mse_forward(out, pred, target),
            LossOp::Loss(LossKind::CrossEntropy) => k.cross_entropy_forward(out, pred, target, s[0], s[1]),
            LossOp::LossBackward(LossKind::Mse) => k.mse_backward(out, pred, target, cx.input(2)?),
            LossOp::LossBackward(LossKind::CrossEntropy) => {
                k.cross_entropy_backward(out, pred, target, cx.input(2)?, s[0], s[1])
            }
            LossOp::CrossEntropyRows => {
                k.cross_entropy_rows_forward_backward(out, cx.view(cx.companion()?)?, pred, target, s[0], s[1], 1.0)
            }
            LossOp::CrossEntropyRowsGrad => Err(cx.no_kernel()),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let n = g.node(node).clone();
        match (self, slot) {
            (LossOp::Loss(kind), 0) => {
                let pred = n.inputs[0];
                let (shape, name) = (g.shape(pred).to_vec(), format!("d{}", g.node(pred).name));
                Ok(g.push(
                    LossOp::LossBackward(*kind),
                    vec![pred, n.inputs[1], dy],
                    shape,
                    DType::F32,
                    name,
                ))
            }
            (LossOp::CrossEntropyRows, 0) => {
                let grad = g.companion(node).ok_or_else(|| Error::NoGradient {
                    op: "cross_entropy_rows",
                    input: n.name.clone(),
                })?;
                let per_row = g.reshape(dy, &[n.shape[0], 1])?;
                g.mul(grad, per_row)
            }
            _ => Err(super::no_gradient(g, node, slot)),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match self {
            LossOp::Loss(LossKind::Mse) => Ok(vec![cpu::mse_forward(cx.input(0)?, cx.input(1)?)]),
            LossOp::Loss(LossKind::CrossEntropy) => {
                let s = cx.input_shape(0);
                Ok(vec![cpu::cross_entropy_forward(
                    cx.input(0)?,
                    &cx.input_u32(1)?,
                    s[0],
                    s[1],
                )])
            }
            LossOp::LossBackward(LossKind::Mse) => Ok(cpu::mse_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?[0])),
            LossOp::LossBackward(LossKind::CrossEntropy) => {
                let s = cx.input_shape(0);
                Ok(cpu::cross_entropy_backward(
                    cx.input(0)?,
                    &cx.input_u32(1)?,
                    cx.input(2)?[0],
                    s[0],
                    s[1],
                ))
            }
            LossOp::CrossEntropyRows => {
                let s = cx.input_shape(0);
                Ok(cpu::cross_entropy_rows_loss(
                    cx.input(0)?,
                    &cx.input_u32(1)?,
                    s[0],
                    s[1],
                ))
            }
            // The gradient its writer's dispatch leaves beside the losses.
            LossOp::CrossEntropyRowsGrad => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let (logits, targets) = (cx.value(writer.inputs[0])?, cx.value(writer.inputs[1])?);
                let s = cx.graph().shape(writer.inputs[0]);
                let targets: Vec<u32> = targets.iter().map(|&t| t as u32).collect();
                Ok(cpu::cross_entropy_rows_forward_backward(logits, &targets, s[0], s[1], 1.0).1)
            }
        }
    }

    /// A class label outside the logits' columns.
    fn check_u32_input(&self, g: &Graph, node: Tensor, slot: usize, labels: &[u32]) -> Result<()> {
        let classifies = matches!(
            self,
            LossOp::Loss(LossKind::CrossEntropy)
                | LossOp::LossBackward(LossKind::CrossEntropy)
                | LossOp::CrossEntropyRows
        );
        if classifies && slot == 1 {
            let classes = g.shape(g.node(node).inputs[0]).last().copied().unwrap_or(0);
            if let Some(&bad) = labels.iter().find(|&&l| l as usize >= classes) {
                return Err(Error::InvalidArgument {
                    op: "CrossEntropyLoss",
                    reason: format!("class {bad} is out of range for {classes} outputs"),
                });
            }
        }
        Ok(())
    }
}

impl Graph {
    /// mean((pred - target)²) -> [1].
    pub fn mse_loss(&mut self, pred: Tensor, target: Tensor) -> Result<Tensor> {
        const OP: &str = "mse_loss";
        self.f32_inputs(OP, &[pred, target])?;
        if self.shape(pred) != self.shape(target) {
            return Err(Error::shape(
                OP,
                "prediction and target must have the same shape",
                &[self.shape(pred), self.shape(target)],
            ));
        }
        Ok(self.push(
            LossOp::Loss(LossKind::Mse),
            vec![pred, target],
            vec![1],
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    /// Softmax cross-entropy of logits [.., classes] against u32 labels
    /// [..] (the logits' leading shape), mean over rows -> [1].
    pub fn cross_entropy_loss(&mut self, logits: Tensor, labels: Tensor) -> Result<Tensor> {
        const OP: &str = "cross_entropy_loss";
        self.f32_inputs(OP, &[logits])?;
        self.check_handle(OP, labels)?;
        let (sl, st) = (self.shape(logits).to_vec(), self.shape(labels).to_vec());
        let (rows, classes) = rows_cols(OP, &sl, &[&sl, &st])?;
        if self.node(labels).dtype != DType::U32 || st.iter().product::<usize>() != rows {
            return Err(Error::shape(
                OP,
                format!("labels must be u32 class indices of shape {:?}", &sl[..sl.len() - 1]),
                &[&sl, &st],
            ));
        }
        if sl.len() > 2 || st.len() > 1 {
            // Rows are rows whatever the leading shape: the 2-D loss serves.
            let flat_logits = self.reshape(logits, &[rows, classes])?;
            let flat_labels = self.reshape(labels, &[rows])?;
            return self.cross_entropy_loss(flat_logits, flat_labels);
        }
        if rows * classes > SINGLE_WORKGROUP_LOSS_MAX {
            // Too large for one workgroup: a workgroup per row, then the mean.
            let losses = self.push(
                LossOp::CrossEntropyRows,
                vec![logits, labels],
                vec![rows],
                DType::F32,
                format!("{OP}{}.rows", self.nodes.len()),
            );
            self.push(
                LossOp::CrossEntropyRowsGrad,
                vec![losses],
                sl.clone(),
                DType::F32,
                format!("{OP}{}.grad", losses.0),
            );
            return self.mean(losses);
        }
        Ok(self.push(
            LossOp::Loss(LossKind::CrossEntropy),
            vec![logits, labels],
            vec![1],
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
