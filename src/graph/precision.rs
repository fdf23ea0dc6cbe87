//! Mixed precision: which tensors a training step stores in f16. The rule
//! is written here once, after torch.autocast's lists:
//!
//! - parameters (the f32 master weights), their gradients and the
//!   optimizer's state stay f32 (the executor refuses anything else);
//! - inputs, constants and u32 tensors (ids, labels) are stored as fed;
//! - norm statistics (a norm's companion node), losses and the predictions
//!   a loss reads (autocast's float32 list: softmax statistics, norms,
//!   losses) stay f32, as do tensors under [`MIN_F16_VALUES`] values,
//!   where the saving is nothing;
//! - every other tensor the backward pass reads from the forward pass (the
//!   activations a step holds from forward to backward, its largest
//!   memory) is stored in f16: [`ElementwiseOp::StoreF16`] right after
//!   its writer. The matmuls reading it, forward and backward, read
//!   that f16 copy itself (the kernels widen each value in registers,
//!   `kernels::MatmulOperand`): torch.autocast's matmuls on f16 inputs,
//!   the activation cast once when stored, with no widened copy made.
//!   Every other backward node reading it reads an
//!   [`ElementwiseOp::LoadF16`] made just before it (or before the
//!   dispatch the plan may fuse it into). The forward's f32 value is then
//!   free as soon as the forward's other readers are done with it, and
//!   only the f16 copy lives until the backward.
//!
//! Arithmetic stays f32 (sums, matmul accumulation); the matmuls and the
//! backward compute on the f16-rounded activations, so gradients carry
//! f16's rounding, and the optimizer's dynamic loss scaling (`optim`)
//! keeps small ones from vanishing where they pass through f16.

use super::autodiff::Gradients;
use super::builder::{DType, Graph, Node, Tensor};
use super::ops::{ElementwiseOp, LayoutOp, MatmulOp, Op};
use crate::error::{Error, Result};

/// Where a training step keeps the activations its backward pass reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// The rule of this module: saved activations in f16 (needs the
    /// adapter's SHADER_F16), with dynamic loss scaling in the optimizer.
    F16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "f16" => Ok(Precision::F16),
            other => Err(Error::InvalidArgument {
                op: "precision",
                reason: format!("`{other}` is not a precision (f16 or f32)"),
            }),
        }
    }
}

/// Tensors smaller than this stay f32: a few words saved, a dispatch more.
pub const MIN_F16_VALUES: usize = 128;

/// Old node index -> new, after a pass rebuilt a graph.
#[derive(Clone, Debug)]
pub struct Remap(Vec<usize>);

impl Remap {
    pub(super) fn new(map: Vec<usize>) -> Remap {
        Remap(map)
    }

    /// Where tensor `t` of the old graph is in the new one.
    pub fn tensor(&self, t: Tensor) -> Tensor {
        Tensor(self.0.get(t.0).copied().unwrap_or(t.0))
    }
}

/// Whether `node` reads f16 copies itself rather than a widened load: the
/// matmuls, 2-D and batched (the kernels read f16 operands), but for a
/// product with an f16 or quantized weight (a frozen base's), whose
/// kernels read f32 activations.
fn reads_f16(nodes: &[Node], node: &Node) -> bool {
    let stored_weight = |n: &Node| n.inputs.get(1).is_some_and(|b| nodes[b.0].dtype.is_stored_weight());
    matches!(node.op, Op::Matmul(MatmulOp::MatMul(_) | MatmulOp::BatchMatMul(_))) && !stored_weight(node)
}

impl Graph {
    /// The earliest place backward node `reader` may run: before itself, or
    /// before the earliest backward node (from `start` on) writing one of
    /// its inputs, whose dispatch the plan may fuse it into (a matmul doing
    /// an activation's backward); never between a writer and its
    /// companion. What a pass adds for `reader` goes there.
    pub(super) fn backward_anchor(&self, reader: usize, start: usize) -> usize {
        let mut anchor = self.nodes[reader]
            .inputs
            .iter()
            .map(|t| t.0)
            .filter(|&t| t >= start)
            .fold(reader, usize::min);
        while anchor > 0 && self.companion(Tensor(anchor - 1)) == Some(Tensor(anchor)) {
            anchor -= 1;
        }
        anchor
    }

    /// Whether the policy stores forward tensor `t` in f16 for the
    /// backward (see the module docs). `loss_read`: some loss reads it.
    fn stored_in_f16(&self, t: Tensor, loss_read: bool) -> bool {
        let node = self.node(t);
        let mut owner = t;
        while self.node(owner).op == LayoutOp::Reshape {
            owner = self.node(owner).inputs[0];
        }
        node.dtype == DType::F32
            && !matches!(self.node(owner).op, Op::Source(_))
            && !node.op.is_companion()
            && !loss_read
            && node.len() >= MIN_F16_VALUES
    }

    /// This graph with the activations its backward pass (`grads`) reads
    /// stored in f16, by the rule of [`crate::graph::precision`], the
    /// gradients in the new graph, and where every old tensor now is.
    pub fn with_f16_activations(&self, grads: &Gradients) -> Result<(Graph, Gradients, Remap)> {
        let nodes = self.nodes();
        let count = nodes.len();
        let start = grads.backward_start().0;
        if grads.loss.0 >= count || start > count {
            return Err(Error::InvalidArgument {
                op: "with_f16_activations",
                reason: "the gradients are not of this graph".into(),
            });
        }
        let mut loss_read = vec![false; count];
        let mut read_by_backward = vec![false; count];
        for (i, node) in nodes.iter().enumerate() {
            for t in &node.inputs {
                loss_read[t.0] |= matches!(node.op, Op::Loss(_));
                read_by_backward[t.0] |= i >= start && t.0 < start;
            }
        }
        let f16: Vec<bool> = (0..count)
            .map(|t| read_by_backward[t] && self.stored_in_f16(Tensor(t), loss_read[t]))
            .collect();

        let mut out: Vec<Node> = Vec::with_capacity(count + 2 * f16.iter().filter(|&&s| s).count());
        let mut map = vec![0usize; count];
        // The new index of each stored tensor's f16 copy.
        let mut copy: Vec<Option<usize>> = vec![None; count];
        let push = |out: &mut Vec<Node>, node: Node| {
            out.push(node);
            out.len() - 1
        };
        let store = |out: &mut Vec<Node>, old: usize, at: usize| {
            let n = &nodes[old];
            push(
                out,
                Node {
                    op: ElementwiseOp::StoreF16.into(),
                    inputs: vec![Tensor(at)],
                    shape: n.shape.clone(),
                    dtype: DType::F16,
                    name: format!("{}.f16", n.name),
                },
            )
        };
        // Where each backward reader's loads go (a load after the fused
        // dispatch reading it would be read before it is written).
        let mut loads_at: Vec<Vec<usize>> = vec![Vec::new(); count];
        for (b, node) in nodes.iter().enumerate().skip(start) {
            if reads_f16(nodes, node) || !node.inputs.iter().any(|t| f16[t.0]) {
                continue;
            }
            loads_at[self.backward_anchor(b, start)].push(b);
        }
        // The new index of each reader's load of each of its inputs.
        let mut loaded: Vec<Vec<Option<usize>>> = vec![Vec::new(); count];
        for (i, node) in nodes.iter().enumerate() {
            for &b in &loads_at[i] {
                loaded[b] = nodes[b]
                    .inputs
                    .iter()
                    .map(|t| {
                        copy[t.0].map(|h| {
                            let n = &nodes[t.0];
                            push(
                                &mut out,
                                Node {
                                    op: ElementwiseOp::LoadF16.into(),
                                    inputs: vec![Tensor(h)],
                                    shape: n.shape.clone(),
                                    dtype: DType::F32,
                                    name: format!("{}.f32", n.name),
                                },
                            )
                        })
                    })
                    .collect();
            }
            let mut inputs: Vec<Tensor> = node.inputs.iter().map(|t| Tensor(map[t.0])).collect();
            for (slot, load) in loaded[i].iter().enumerate() {
                if let Some(l) = load {
                    inputs[slot] = Tensor(*l);
                }
            }
            if reads_f16(nodes, node) {
                for (input, t) in inputs.iter_mut().zip(&node.inputs) {
                    if let Some(h) = copy[t.0] {
                        *input = Tensor(h);
                    }
                }
            }
            let op = match node.op {
                Op::Elementwise(ElementwiseOp::AccumulateGrad { param }) => ElementwiseOp::AccumulateGrad {
                    param: Tensor(map[param.0]),
                }
                .into(),
                ref op => op.clone(),
            };
            map[i] = push(
                &mut out,
                Node {
                    op,
                    inputs,
                    ..node.clone()
                },
            );
            // The copy follows its writer, and its writer's companion: a
            // companion must stay right after the node that writes it.
            if f16[i] && self.companion(Tensor(i)).is_none() {
                copy[i] = Some(store(&mut out, i, map[i]));
            }
            if i > 0 && f16[i - 1] && self.companion(Tensor(i - 1)) == Some(Tensor(i)) {
                copy[i - 1] = Some(store(&mut out, i - 1, map[i - 1]));
            }
        }
        let graph = self.with_nodes(out, &map);
        Ok((graph, grads.remapped(&map), Remap(map)))
    }
}
