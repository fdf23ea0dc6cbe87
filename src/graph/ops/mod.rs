//! Every graph op, declared in one place per op family: its builder method
//! (the shape rule), its kernel binding (the `Dispatch` built from the
//! executor's views), its gradient rule (written with other graph ops) and
//! its CPU reference (through the twins in `cpu.rs`, in f64).
//!
//! Each family's file defines the family's own op enum (`NormOp`,
//! `RopeOp`, ..) and implements [`OpFamily`] on it; [`Op`] has one variant
//! per family holding that enum (`Op::Norm(NormOp::RmsNorm { eps })`).
//! Why this shape:
//! - an op added to a family is a variant of the family's enum, in the
//!   family's file, and nothing here changes: this file lists families,
//!   not ops, so it changes only when a family is added;
//! - the ops stay plain data rather than trait objects: the plan's fusion
//!   rules pattern-match them (a matmul read only by a bias add, a loss
//!   beside its backward) and tests compare nodes by value, which enums
//!   give for free;
//! - each family's `match self` is exhaustive over its own ops, so a new
//!   variant the family forgets to dispatch, name or reference is a
//!   compile error, and no family can be handed another's op.
//!
//! The executor, autodiff and the reference interpreter ask [`Op::family`]
//! and name no op. Ops that share a kernel family's buffers and helpers
//! (LayerNorm, RMSNorm and their statistics and backward nodes) share a
//! file. Builder methods are `impl Graph` blocks in the family's file;
//! `Graph::push` takes a family's op directly (`Into<Op>`), and `node.op
//! == NormOp::RmsNormStats` compares across the wrapper.

mod attention;
mod elementwise;
mod embedding;
mod generation;
mod layout;
mod lora;
mod loss;
mod matmul;
mod norms;
mod reduce;
mod rope;
mod softmax;
mod source;

use super::builder::{Graph, Node, Tensor};
use super::executor::Executor;
use super::plan::Plan;
use crate::error::{Error, Result};
use crate::kernels::{Dispatch, Kernels, View};

pub use attention::AttentionOp;
pub use elementwise::{ElementwiseOp, DROPOUT_CONTROL};
pub use embedding::EmbeddingOp;
pub use generation::GenerationOp;
pub use layout::LayoutOp;
pub use lora::LoraOp;
pub use loss::{LossKind, LossOp};
pub use matmul::MatmulOp;
pub use norms::NormOp;
pub use reduce::ReduceOp;
pub use rope::RopeOp;
pub use softmax::SoftmaxOp;
pub use source::{ParameterInit, SourceOp};

/// Declares [`Op`] with one variant per family, the family's enum
/// converting into it (`From`) and comparing with it (`PartialEq`), and
/// [`Op::family`], from one line per family.
macro_rules! op_families {
    ($($(#[$doc:meta])* $variant:ident($family:ident),)+) => {
        /// A graph node's op: one variant per op family, holding the
        /// family's own enum (see the module docs).
        #[derive(Clone, Debug, PartialEq)]
        pub enum Op {
            $($(#[$doc])* $variant($family),)+
        }

        impl Op {
            /// The family that declares this op, which answers for it.
            pub(crate) fn family(&self) -> &dyn OpFamily {
                match self {
                    $(Op::$variant(op) => op,)+
                }
            }
        }

        $(
            impl From<$family> for Op {
                fn from(op: $family) -> Op {
                    Op::$variant(op)
                }
            }

            impl PartialEq<$family> for Op {
                fn eq(&self, other: &$family) -> bool {
                    matches!(self, Op::$variant(op) if op == other)
                }
            }
        )+
    };
}

op_families! {
    /// Tensors the graph feeds, trains, fixes or keeps: no kernel.
    Source(SourceOp),
    Matmul(MatmulOp),
    /// Same-shape and broadcasting arithmetic, activations, gradient
    /// accumulation.
    Elementwise(ElementwiseOp),
    Reduce(ReduceOp),
    Loss(LossOp),
    /// Reshape, permute, slice, pad and concat.
    Layout(LayoutOp),
    Softmax(SoftmaxOp),
    /// LayerNorm and RMSNorm with their statistics and backward nodes.
    Norm(NormOp),
    Rope(RopeOp),
    Embedding(EmbeddingOp),
    /// Cached attention and sampling: inference only, no gradients.
    Generation(GenerationOp),
    /// Fused causal self-attention and its backward nodes.
    Attention(AttentionOp),
    /// Many LoRA adapters' gathered products (generation): no gradients.
    Lora(LoraOp),
}

impl Op {
    pub fn name(&self) -> &'static str {
        self.family().name()
    }

    /// A node another node's dispatch writes (it has no kernel of its own
    /// and follows its writer).
    pub fn is_companion(&self) -> bool {
        self.family().is_companion()
    }

    /// Whether the op is a dispatch of its own: not a tensor the executor
    /// uploads or feeds, a view of another's storage, or a companion.
    pub fn has_kernel(&self) -> bool {
        self.family().has_kernel()
    }
}

/// What one family of ops declares, implemented by the family's op enum:
/// each method answers for `self`, one op of the family.
pub(crate) trait OpFamily {
    fn name(&self) -> &'static str;

    /// See [`Op::is_companion`].
    fn is_companion(&self) -> bool {
        false
    }

    /// See [`Op::has_kernel`].
    fn has_kernel(&self) -> bool {
        !self.is_companion()
    }

    /// The dispatch computing node `cx.node` (and what the plan fused into
    /// it), bound to the executor's buffers.
    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch>;

    /// d loss / d (input `slot` of `node`), given dy = d loss / d node, as
    /// new graph nodes. An op without a rule says so.
    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let _ = dy;
        Err(no_gradient(g, node, slot))
    }

    /// The node's value in f64 from its inputs' values (u32 tensors hold
    /// their integers as f64), through the CPU twins.
    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>>;

    /// Checks u32 `values` about to be fed as input `slot` of node `node`
    /// (a class label or token id out of range) before they reach the GPU.
    fn check_u32_input(&self, _g: &Graph, _node: Tensor, _slot: usize, _values: &[u32]) -> Result<()> {
        Ok(())
    }
}

/// The error of node `node`'s op asked for a gradient rule it does not
/// have.
fn no_gradient(g: &Graph, node: Tensor, slot: usize) -> Error {
    Error::NoGradient {
        op: g.node(node).op.name(),
        input: g.node(g.node(node).inputs[slot]).name.clone(),
    }
}

/// A companion whose writer is not the op it belongs to: a graph built
/// around the builder, reported rather than panicked.
fn unexpected_writer(companion: &'static str, writer: &Op) -> Error {
    Error::Internal {
        op: "graph",
        reason: format!("a {companion} node follows {writer:?}"),
    }
}

/// Where the second part of a node holding two vectors starts (elements):
/// `len` rounded up to 64 elements = 256 bytes, the largest storage offset
/// alignment an adapter may require, so each part binds on its own.
pub fn stats_offset(len: usize) -> usize {
    len.div_ceil(64) * 64
}

/// A tensor of rank ≥ 1 as [rows, last dimension] (shapes the builder
/// already checked).
fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, lead)) => (lead.iter().product(), cols),
        None => (1, 1),
    }
}

/// One node's dispatch being built: its views in the executor's buffers.
pub(crate) struct DispatchContext<'a> {
    pub exec: &'a Executor,
    pub node: usize,
}

impl<'a> DispatchContext<'a> {
    pub fn kernels(&self) -> &'a Kernels {
        self.exec.kernels()
    }

    pub fn graph(&self) -> &'a Graph {
        self.exec.graph()
    }

    pub fn plan(&self) -> &'a Plan {
        self.exec.plan()
    }

    /// This node's shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.graph().node(Tensor(self.node)).shape
    }

    /// The tensor this node reads as input `j` (the plan may redirect a
    /// read, see [`Plan::reads`]).
    pub fn read(&self, j: usize) -> Tensor {
        self.plan().reads[self.node][j]
    }

    pub fn input_shape(&self, j: usize) -> &'a [usize] {
        self.graph().shape(self.read(j))
    }

    pub fn input_node(&self, j: usize) -> &'a Node {
        self.graph().node(self.read(j))
    }

    /// This node's output.
    pub fn out(&self) -> Result<View<'a>> {
        self.view(Tensor(self.node))
    }

    pub fn input(&self, j: usize) -> Result<View<'a>> {
        self.view(self.read(j))
    }

    pub fn view(&self, t: Tensor) -> Result<View<'a>> {
        self.exec.view(t)
    }

    /// Whether the plan adds this node's result into its storage (a
    /// gradient computed straight into the gradient arena).
    pub fn accumulate(&self) -> bool {
        self.plan().accumulate[self.node]
    }

    /// The two parts of `t`, a node holding two vectors of `len` elements,
    /// the second at [`stats_offset`]`(len)`.
    pub fn halves(&self, t: Tensor, len: usize) -> Result<(View<'a>, View<'a>)> {
        let whole = self.view(t)?;
        let second = stats_offset(len);
        if whole.len <= second {
            return Err(Error::shape(
                "Executor",
                format!(
                    "`{}` is too short to hold two parts of {len}",
                    self.graph().node(t).name
                ),
                &[&[whole.len]],
            ));
        }
        Ok((
            View { len, ..whole },
            View {
                offset: whole.offset + second as u64 * 4,
                len: whole.len - second,
                ..whole
            },
        ))
    }

    /// The error of a dispatch asked of a node without a kernel of its own
    /// ([`Op::has_kernel`]): a bug in the executor, reported as
    /// [`Error::Internal`].
    pub fn no_kernel(&self) -> Error {
        let node = self.graph().node(Tensor(self.node));
        Error::Internal {
            op: "Executor",
            reason: format!("`{}` ({}) has no kernel", node.name, node.op.name()),
        }
    }

    /// The node this node's dispatch also writes ([`Op::is_companion`]).
    pub fn companion(&self) -> Result<Tensor> {
        self.graph()
            .companion(Tensor(self.node))
            .ok_or_else(|| Error::Internal {
                op: "Executor",
                reason: format!(
                    "`{}` lost the node its dispatch also writes",
                    self.graph().node(Tensor(self.node)).name
                ),
            })
    }
}

/// One node's inputs for its CPU reference.
pub struct ReferenceContext<'a> {
    pub(super) graph: &'a Graph,
    pub(super) node: Tensor,
    /// Every node's value so far (`None`: not needed).
    pub(super) values: &'a [Option<Vec<f64>>],
    /// Values fed to inputs and caches.
    pub(super) feeds: &'a [(Tensor, Vec<f64>)],
}

impl<'a> ReferenceContext<'a> {
    pub fn graph(&self) -> &'a Graph {
        self.graph
    }

    pub fn node(&self) -> &'a Node {
        self.graph.node(self.node)
    }

    pub fn shape(&self) -> &'a [usize] {
        &self.node().shape
    }

    pub fn input_shape(&self, j: usize) -> &'a [usize] {
        self.graph.shape(self.node().inputs[j])
    }

    /// The value of any node evaluated before this one.
    pub fn value(&self, t: Tensor) -> Result<&'a [f64]> {
        self.values
            .get(t.0)
            .and_then(|v| v.as_deref())
            .ok_or_else(|| Error::Internal {
                op: "evaluate_f64",
                reason: format!(
                    "`{}` was not evaluated before `{}`",
                    self.graph.node(t).name,
                    self.node().name
                ),
            })
    }

    pub fn input(&self, j: usize) -> Result<&'a [f64]> {
        self.value(self.node().inputs[j])
    }

    /// A u32 input's values (ids, labels), held as f64.
    pub fn input_u32(&self, j: usize) -> Result<Vec<u32>> {
        Ok(self.input(j)?.iter().map(|&v| v as u32).collect())
    }

    /// The values fed to this node (an input or a cache).
    pub fn fed(&self) -> Result<Vec<f64>> {
        let fed = self.feeds.iter().find(|(t, _)| *t == self.node).map(|(_, v)| v.clone());
        let node = self.node();
        match fed {
            Some(v) if v.len() == node.len() => Ok(v),
            Some(v) => Err(Error::shape(
                "evaluate_f64",
                format!("`{}` was fed {} values", node.name, v.len()),
                &[&node.shape],
            )),
            // A cache starts at zero, as the executor makes it.
            None if node.op == SourceOp::Cache => Ok(vec![0.0; node.len()]),
            None => Err(Error::InvalidArgument {
                op: "evaluate_f64",
                reason: format!("no values fed to `{}`", node.name),
            }),
        }
    }
}

/// Two parts of `len` values, the second at [`stats_offset`]`(len)`, as
/// one node holding both.
fn two_parts(first: Vec<f64>, second: Vec<f64>, len: usize) -> Vec<f64> {
    let mut out = first;
    out.resize(stats_offset(len), 0.0);
    out.extend(second);
    out
}
