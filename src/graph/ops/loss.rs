//! Losses: MSE and cross-entropy over one workgroup (the plan runs each
//! with its backward, and can fold the last Linear layer in), and the
//! row-wise cross-entropy for logits too large for one workgroup, whose
//! dispatch also writes its gradient.

use super::{not_mine, DispatchContext, Op, OpFamily, ReferenceContext};
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

pub(super) struct Losses;

impl OpFamily for Losses {
    fn name(&self, op: &Op) -> &'static str {
        match op {
            Op::Loss(LossKind::Mse) => "mse_loss",
            Op::Loss(LossKind::CrossEntropy) => "cross_entropy_loss",
            Op::LossBackward(_) => "loss_backward",
            Op::CrossEntropyRows => "cross_entropy_rows",
            _ => "cross_entropy_rows_grad",
        }
    }

    fn is_companion(&self, op: &Op) -> bool {
        matches!(op, Op::CrossEntropyRowsGrad)
    }

    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, i, out) = (cx.kernels(), cx.node, cx.out()?);
        let (pred, target) = (cx.input(0)?, cx.input(1)?);
        let s = cx.input_shape(0);
        match op {
            // The plan computes this loss with its backward in one dispatch.
            Op::Loss(kind) if cx.plan().loss_with_grad[i].is_some() => {
                let b = Tensor(cx.plan().loss_with_grad[i].unwrap_or(i));
                let (grad, dloss) = (cx.view(b)?, cx.view(cx.graph().node(b).inputs[2])?);
                match kind {
                    LossKind::Mse => k.mse_forward_backward(out, grad, pred, target, dloss),
                    LossKind::CrossEntropy => k.cross_entropy_forward_backward(out, grad, pred, target, dloss, s[0], s[1]),
                }
            }
            Op::Loss(LossKind::Mse) => k.mse_forward(out, pred, target),
            Op::Loss(LossKind::CrossEntropy) => k.cross_entropy_forward(out, pred, target, s[0], s[1]),
            Op::LossBackward(LossKind::Mse) => k.mse_backward(out, pred, target, cx.input(2)?),
            Op::LossBackward(LossKind::CrossEntropy) => k.cross_entropy_backward(out, pred, target, cx.input(2)?, s[0], s[1]),
            Op::CrossEntropyRows => k.cross_entropy_rows_forward_backward(out, cx.view(cx.companion()?)?, pred, target, s[0], s[1], 1.0),
            _ => Err(not_mine("loss", op)),
        }
    }

    fn gradient(&self, op: &Op, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let n = g.node(node).clone();
        match (op, slot) {
            (Op::Loss(kind), 0) => {
                let pred = n.inputs[0];
                let (shape, name) = (g.shape(pred).to_vec(), format!("d{}", g.node(pred).name));
                Ok(g.push(Op::LossBackward(*kind), vec![pred, n.inputs[1], dy], shape, DType::F32, name))
            }
            (Op::CrossEntropyRows, 0) => {
                let grad = g.companion(node).ok_or_else(|| Error::NoGradient { op: "cross_entropy_rows", input: n.name.clone() })?;
                let per_row = g.reshape(dy, &[n.shape[0], 1])?;
                g.mul(grad, per_row)
            }
            _ => Err(super::no_gradient(g, op, node, slot)),
        }
    }

    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match op {
            Op::Loss(LossKind::Mse) => Ok(vec![cpu::mse_forward(cx.input(0)?, cx.input(1)?)]),
            Op::Loss(LossKind::CrossEntropy) => {
                let s = cx.input_shape(0);
                Ok(vec![cpu::cross_entropy_forward(cx.input(0)?, &cx.input_u32(1)?, s[0], s[1])])
            }
            Op::LossBackward(LossKind::Mse) => Ok(cpu::mse_backward(cx.input(0)?, cx.input(1)?, cx.input(2)?[0])),
            Op::LossBackward(LossKind::CrossEntropy) => {
                let s = cx.input_shape(0);
                Ok(cpu::cross_entropy_backward(cx.input(0)?, &cx.input_u32(1)?, cx.input(2)?[0], s[0], s[1]))
            }
            Op::CrossEntropyRows => {
                let s = cx.input_shape(0);
                Ok(cpu::cross_entropy_rows_loss(cx.input(0)?, &cx.input_u32(1)?, s[0], s[1]))
            }
            // The gradient its writer's dispatch leaves beside the losses.
            Op::CrossEntropyRowsGrad => {
                let writer = cx.graph().node(cx.node().inputs[0]);
                let (logits, targets) = (cx.value(writer.inputs[0])?, cx.value(writer.inputs[1])?);
                let s = cx.graph().shape(writer.inputs[0]);
                let targets: Vec<u32> = targets.iter().map(|&t| t as u32).collect();
                Ok(cpu::cross_entropy_rows_forward_backward(logits, &targets, s[0], s[1], 1.0).1)
            }
            _ => Err(not_mine("loss", op)),
        }
    }

    /// A class label outside the logits' columns.
    fn check_u32_input(&self, op: &Op, g: &Graph, node: Tensor, slot: usize, labels: &[u32]) -> Result<()> {
        let classifies = matches!(op, Op::Loss(LossKind::CrossEntropy) | Op::LossBackward(LossKind::CrossEntropy) | Op::CrossEntropyRows);
        if classifies && slot == 1 {
            let classes = g.shape(g.node(node).inputs[0]).last().copied().unwrap_or(0);
            if let Some(&bad) = labels.iter().find(|&&l| l as usize >= classes) {
                return Err(Error::InvalidArgument { op: "CrossEntropyLoss", reason: format!("class {bad} is out of range for {classes} outputs") });
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
            return Err(Error::shape(OP, "prediction and target must have the same shape", &[self.shape(pred), self.shape(target)]));
        }
        Ok(self.push(Op::Loss(LossKind::Mse), vec![pred, target], vec![1], DType::F32, format!("{OP}{}", self.nodes.len())))
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
            return Err(Error::shape(OP, format!("labels must be u32 class indices of shape {:?}", &sl[..sl.len() - 1]), &[&sl, &st]));
        }
        if sl.len() > 2 || st.len() > 1 {
            // Rows are rows whatever the leading shape: the 2-D loss serves.
            let flat_logits = self.reshape(logits, &[rows, classes])?;
            let flat_labels = self.reshape(labels, &[rows])?;
            return self.cross_entropy_loss(flat_logits, flat_labels);
        }
        if rows * classes > SINGLE_WORKGROUP_LOSS_MAX {
            // Too large for one workgroup: a workgroup per row, then the mean.
            let losses = self.push(Op::CrossEntropyRows, vec![logits, labels], vec![rows], DType::F32, format!("{OP}{}.rows", self.nodes.len()));
            self.push(Op::CrossEntropyRowsGrad, vec![losses], sl.clone(), DType::F32, format!("{OP}{}.grad", losses.0));
            return self.mean(losses);
        }
        Ok(self.push(Op::Loss(LossKind::CrossEntropy), vec![logits, labels], vec![1], DType::F32, format!("{OP}{}", self.nodes.len())))
    }
}
