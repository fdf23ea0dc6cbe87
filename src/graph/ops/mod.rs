//! Every graph op, declared in one place per op family: its builder method
//! (the shape rule), its kernel binding (the `Dispatch` built from the
//! executor's views), its gradient rule (written with other graph ops) and
//! its CPU reference (through the twins in `cpu.rs`, in f64).
//!
//! Why an enum plus one trait impl per family, rather than a trait object
//! per node: the plan's fusion rules pattern-match ops (a matmul read only
//! by a bias add, a loss beside its backward), and tests compare nodes by
//! value, which an enum gives for free. So [`Op`] stays plain data, and
//! [`Op::family`] is the only `match` that lists every op: it hands each
//! variant to the [`OpFamily`] impl that knows it, in the family's file.
//! The executor, autodiff and the reference interpreter ask the family and
//! name no op. An op that shares a kernel family with others (LayerNorm and
//! its statistics and backward nodes) shares its file, as its parts share
//! buffers and helpers.
//!
//! Adding an op: its variant and family line below, and its family's file
//! (new or existing) with the builder method as an `impl Graph` block.

mod elementwise;
mod embedding;
mod generation;
mod layer_norm;
mod layout;
mod loss;
mod matmul;
mod reduce;
mod rope;
mod softmax;
mod source;

use super::builder::{Graph, Node, Tensor};
use super::executor::Executor;
use super::plan::Plan;
use crate::error::{Error, Result};
use crate::kernels::{Activation, Binary, Dispatch, Kernels, MatmulForm, RopeLayout, Unary, View};

pub use loss::LossKind;

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Data fed before each step (a batch, its targets).
    Input,
    /// A trainable tensor with its initial values.
    Parameter { init: Vec<f32> },
    /// A fixed tensor uploaded once (the seed gradient 1.0 of a loss).
    Constant { values: Vec<f32> },
    /// A tensor that keeps its values from run to run (a KV cache): zero
    /// when the executor is built and after `Executor::clear_caches`, and
    /// written only by the ops that update it in place
    /// ([`Op::CachedAttention`]). Not trainable.
    Cache,
    MatMul(MatmulForm),
    Binary(Binary),
    Scale(f32),
    /// x[rows, cols] + bias[cols]
    BiasAdd,
    Activation(Activation),
    /// inputs (x, dy): f'(x)·dy
    ActivationBackward(Activation),
    /// Column sums of a matrix (the bias gradient).
    SumRows,
    Sum,
    Mean,
    /// inputs (prediction, target) -> scalar
    Loss(LossKind),
    /// inputs (prediction, target, dloss) -> d prediction
    LossBackward(LossKind),
    /// u32 index of each row's maximum.
    Argmax,
    /// inputs (x): adds x into the gradient of a parameter; the result is
    /// that gradient. Emitted by autodiff only.
    AccumulateGrad { param: Tensor },
    /// The input's elements under a new shape: no kernel, the output shares
    /// the input's storage.
    Reshape,
    /// A copy with axes reordered: output dim i is input dim perm[i].
    Permute(Vec<usize>),
    /// Columns `start..start + width` of the last dimension (width is the
    /// output's last dimension).
    SliceLast { start: usize },
    /// The input placed at columns `start..` of a zero tensor (the
    /// gradient of [`Op::SliceLast`]).
    PadLast { start: usize },
    /// inputs (a, b): [.., a_cols] and [.., b_cols] side by side.
    ConcatLast,
    /// A matmul per leading index of rank-3/4 operands with equal leading
    /// dimensions.
    BatchMatMul(MatmulForm),
    Unary(Unary),
    /// Sums the input down to this node's shape (the gradient of a
    /// broadcast).
    SumTo,
    /// Softmax over the last dimension; `causal` masks column j > row i of
    /// each trailing [T, T] block.
    Softmax { causal: bool },
    /// inputs (y, dy) of a softmax.
    SoftmaxBackward,
    /// inputs (x, weight, bias): torch.nn.LayerNorm over the last
    /// dimension. Its dispatch also fills the [`Op::LayerNormStats`] node
    /// added right after it.
    LayerNorm { eps: f32 },
    /// inputs (y of the layernorm): mean[rows], then rstd[rows] at element
    /// [`stats_offset`]`(rows)`, written by the layernorm's dispatch.
    LayerNormStats,
    /// inputs (dy, x, weight, stats) -> dx.
    LayerNormBackward,
    /// inputs (dy, x, stats) -> dweight, then dbias at
    /// [`stats_offset`]`(cols)`.
    LayerNormParamsBackward,
    /// inputs (x, weight): torch.nn.RMSNorm over the last dimension. Its
    /// dispatch also fills the [`Op::RmsNormStats`] node added right after
    /// it.
    RmsNorm { eps: f32 },
    /// inputs (y of the RMSNorm): rstd[rows], written by its dispatch.
    RmsNormStats,
    /// inputs (dy, x, weight, stats) -> dx.
    RmsNormBackward,
    /// inputs (dy, x, stats) -> dweight.
    RmsNormWeightBackward,
    /// inputs (x [S, T, H, D], u32 starts [S], (cos, sin) table
    /// [positions, rotary_dim/2, 2]) -> x with the first `rotary_dim`
    /// channels of each head rotated by the angles of positions
    /// starts[s] + t (see `Kernels::rope_forward`).
    Rope { layout: RopeLayout, base: f32, rotary_dim: usize },
    /// inputs (dy, starts, table) -> dx: the rotation by minus each angle.
    RopeBackward { layout: RopeLayout, base: f32, rotary_dim: usize },
    /// inputs (table [V, C], u32 ids [..]) -> [.., C].
    Embedding,
    /// inputs (u32 ids): order[n] then cursor[vocab + 1] at
    /// [`stats_offset`]`(n)`: the positions sorted by id (u32 scratch).
    EmbeddingSort { vocab: usize },
    /// inputs (dy, ids, sort) -> the table's gradient, added into the
    /// parameter's gradient (always computed there).
    EmbeddingBackward,
    /// inputs (logits [rows, V], u32 targets [rows]) -> per-row losses
    /// [rows], one workgroup per row (any vocabulary). Its dispatch also
    /// fills the [`Op::CrossEntropyRowsGrad`] node added right after it
    /// with d loss_r / d logits (llm.c's fused logits, loss and gradient).
    CrossEntropyRows,
    /// inputs (the per-row losses): softmax(logits) − onehot(target),
    /// written by the cross-entropy's dispatch.
    CrossEntropyRowsGrad,
    /// inputs (q, k, v [S, T, *] placed by `layout` (one fused qkv given
    /// three times, or three operands), u32 starts [S], k cache, v cache,
    /// each [S, kv_heads, P, d]) -> [S, T, heads·d]: writes the rows' keys
    /// and values into the caches at positions starts[s] + t, then attends
    /// over positions 0..=starts[s] + t (see
    /// `Kernels::cached_attention_forward`). No gradient.
    CachedAttention { heads: usize, layout: crate::ops::QkvLayout },
    /// inputs (logits [.., vocab], draws [rows, 2] f32 of (u, temperature),
    /// top_k [rows] u32) -> [rows, 2] u32: each row's token and its first
    /// non-finite logit (see `Kernels::sample_rows`). No gradient.
    SampleTokens,
}

impl Op {
    /// The family that declares this op: the one list of every op.
    pub(crate) fn family(&self) -> &'static dyn OpFamily {
        match self {
            Op::Input | Op::Parameter { .. } | Op::Constant { .. } | Op::Cache => &source::Sources,
            Op::MatMul(_) | Op::BatchMatMul(_) => &matmul::Matmuls,
            Op::Binary(_) | Op::Scale(_) | Op::BiasAdd | Op::Activation(_) | Op::ActivationBackward(_) | Op::Unary(_) | Op::AccumulateGrad { .. } => {
                &elementwise::Elementwise
            }
            Op::SumRows | Op::Sum | Op::Mean | Op::SumTo | Op::Argmax => &reduce::Reductions,
            Op::Loss(_) | Op::LossBackward(_) | Op::CrossEntropyRows | Op::CrossEntropyRowsGrad => &loss::Losses,
            Op::Reshape | Op::Permute(_) | Op::SliceLast { .. } | Op::PadLast { .. } | Op::ConcatLast => &layout::Layout,
            Op::Softmax { .. } | Op::SoftmaxBackward => &softmax::Softmaxes,
            Op::LayerNorm { .. }
            | Op::LayerNormStats
            | Op::LayerNormBackward
            | Op::LayerNormParamsBackward
            | Op::RmsNorm { .. }
            | Op::RmsNormStats
            | Op::RmsNormBackward
            | Op::RmsNormWeightBackward => &layer_norm::LayerNorms,
            Op::Rope { .. } | Op::RopeBackward { .. } => &rope::Ropes,
            Op::Embedding | Op::EmbeddingSort { .. } | Op::EmbeddingBackward => &embedding::Embeddings,
            Op::CachedAttention { .. } | Op::SampleTokens => &generation::Generation,
        }
    }

    pub fn name(&self) -> &'static str {
        self.family().name(self)
    }

    /// A node another node's dispatch writes (it has no kernel of its own
    /// and follows its writer).
    pub fn is_companion(&self) -> bool {
        self.family().is_companion(self)
    }

    /// Whether the op is a dispatch of its own: not a tensor the executor
    /// uploads or feeds, a view of another's storage, or a companion.
    pub fn has_kernel(&self) -> bool {
        self.family().has_kernel(self)
    }
}

/// What one family of ops declares. Each method gets the op (a variant of
/// this family, as [`Op::family`] routes it) and answers for it.
pub(crate) trait OpFamily: Sync {
    fn name(&self, op: &Op) -> &'static str;

    /// See [`Op::is_companion`].
    fn is_companion(&self, _op: &Op) -> bool {
        false
    }

    /// See [`Op::has_kernel`].
    fn has_kernel(&self, op: &Op) -> bool {
        !self.is_companion(op)
    }

    /// The dispatch computing node `cx.node` (and what the plan fused into
    /// it), bound to the executor's buffers.
    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch>;

    /// d loss / d (input `slot` of `node`), given dy = d loss / d node, as
    /// new graph nodes. An op without a rule says so.
    fn gradient(&self, op: &Op, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let _ = dy;
        Err(no_gradient(g, op, node, slot))
    }

    /// The node's value in f64 from its inputs' values (u32 tensors hold
    /// their integers as f64), through the CPU twins.
    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>>;

    /// Checks u32 `values` about to be fed as input `slot` of node `node`
    /// (a class label or token id out of range) before they reach the GPU.
    fn check_u32_input(&self, _op: &Op, _g: &Graph, _node: Tensor, _slot: usize, _values: &[u32]) -> Result<()> {
        Ok(())
    }
}

/// The error of an op asked for a gradient rule it does not have.
fn no_gradient(g: &Graph, op: &Op, node: Tensor, slot: usize) -> Error {
    Error::NoGradient { op: op.name(), input: g.node(g.node(node).inputs[slot]).name.clone() }
}

/// A family handed a variant it does not declare: a bug in [`Op::family`],
/// reported rather than panicked.
fn not_mine(family: &'static str, op: &Op) -> Error {
    Error::InvalidArgument { op: "graph", reason: format!("the {family} ops do not declare {op:?}") }
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
            return Err(Error::shape("Executor", format!("`{}` is too short to hold two parts of {len}", self.graph().node(t).name), &[&[whole.len]]));
        }
        Ok((View { len, ..whole }, View { offset: whole.offset + second as u64 * 4, len: whole.len - second, ..whole }))
    }

    /// The node this node's dispatch also writes ([`Op::is_companion`]).
    pub fn companion(&self) -> Result<Tensor> {
        self.graph().companion(Tensor(self.node)).ok_or_else(|| Error::InvalidArgument {
            op: "Executor",
            reason: format!("`{}` lost the node its dispatch also writes", self.graph().node(Tensor(self.node)).name),
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
        self.values.get(t.0).and_then(|v| v.as_deref()).ok_or_else(|| Error::InvalidArgument {
            op: "evaluate_f64",
            reason: format!("`{}` was not evaluated before `{}`", self.graph.node(t).name, self.node().name),
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
            Some(v) => Err(Error::shape("evaluate_f64", format!("`{}` was fed {} values", node.name, v.len()), &[&node.shape])),
            // A cache starts at zero, as the executor makes it.
            None if matches!(node.op, Op::Cache) => Ok(vec![0.0; node.len()]),
            None => Err(Error::InvalidArgument { op: "evaluate_f64", reason: format!("no values fed to `{}`", node.name) }),
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
