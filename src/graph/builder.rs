//! Define-then-run graph: tensor handles and nodes. Each op's builder
//! method (its shape rule) is with the rest of its declaration in
//! `graph/ops/`, so a bad shape is an `Error` at build time naming the op;
//! here are the checks they share.

use super::ops::{Op, ParameterInit, SourceOp};
use crate::error::{Error, Result};
use crate::ops::QuantFormat;

/// A handle to a node's output. Cheap to copy; only meaningful for the graph
/// that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tensor(pub(crate) usize);

impl Tensor {
    pub fn index(self) -> usize {
        self.0
    }
}

/// Element type of a tensor: values are f32, class labels and argmax
/// indices u32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    U32,
    /// f16, two values per 4-byte word: a parameter in the parameter arena
    /// ([`Graph::parameter_f16`], generation's weights, which only an ABt
    /// matmul (as B) and an embedding (as the table) read, in f32; an
    /// executor with gradients or an optimizer refuses it), or an
    /// activation mixed precision keeps for the backward
    /// ([`Graph::store_f16`], read by [`Graph::load_f16`]).
    F16,
    /// A parameter stored block-quantized, as a GGUF file holds it, in the
    /// kernels' layout ([`Graph::parameter_quantized`],
    /// [`crate::ops::pack_quantized`]): generation's weights. Read as
    /// [`DType::F16`] is, by an ABt matmul (as B) and an embedding (as the
    /// table) only; an executor with gradients or an optimizer refuses it.
    Quant(QuantFormat),
}

impl DType {
    /// A weight only an ABt matmul's B or an embedding's table reads (f16
    /// or block-quantized): generation's storage.
    pub fn is_stored_weight(self) -> bool {
        matches!(self, DType::F16 | DType::Quant(_))
    }

    /// What a tensor of this dtype holds, for errors.
    pub(crate) fn describe(self) -> String {
        match self {
            DType::F32 => "f32 values".into(),
            DType::U32 => "u32 values".into(),
            DType::F16 => "f16 weights (only a matmul's B, ABt or AB, or an embedding table)".into(),
            DType::Quant(format) => format!(
                "{} block-quantized weights (only a matmul's B, ABt or AB, or an embedding table)",
                format.name()
            ),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<Tensor>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub name: String,
}

impl Node {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Nodes in the order they were added, which is a topological order: an op
/// can only take tensors that already exist.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub(crate) nodes: Vec<Node>,
    /// Parameters the optimizer applies no weight decay to (sorted).
    no_weight_decay: Vec<Tensor>,
    /// Parameters their module says belong in the no-decay group
    /// (embedding tables), honoured when the optimizer uses groups.
    no_decay_group: Vec<Tensor>,
    /// Parameters kept fixed ([`Graph::freeze`]): no gradient, no
    /// optimizer state (sorted).
    frozen: Vec<Tensor>,
}

/// The largest rank a tensor may have.
pub const MAX_RANK: usize = 4;

/// A tensor of rank ≥ 2 seen as [rows, last dimension] (row-wise ops,
/// biases, losses).
pub(super) fn rows_cols(op: &'static str, shape: &[usize], all: &[&[usize]]) -> Result<(usize, usize)> {
    match shape.split_last() {
        Some((&cols, lead)) if !lead.is_empty() => Ok((lead.iter().product(), cols)),
        _ => Err(Error::shape(op, "expects a tensor of rank 2 or more", all)),
    }
}

impl Graph {
    pub fn new() -> Self {
        Graph::default()
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node behind `t`, if `t` belongs to this graph.
    pub fn get(&self, t: Tensor) -> Option<&Node> {
        self.nodes.get(t.0)
    }

    /// Internal: `t` has been checked to belong to this graph.
    pub(crate) fn node(&self, t: Tensor) -> &Node {
        &self.nodes[t.0]
    }

    /// The initial values of a parameter, to edit before the graph runs
    /// (None for a block-quantized one, whose words are not values).
    pub fn parameter_init_mut(&mut self, t: Tensor) -> Option<&mut [f32]> {
        match self.nodes.get_mut(t.0).map(|n| &mut n.op) {
            Some(Op::Source(SourceOp::Parameter {
                init: ParameterInit::Values(init),
            })) => Some(init.as_mut_slice()),
            _ => None,
        }
    }

    /// The shape of `t`, if `t` belongs to this graph.
    pub fn shape_of(&self, t: Tensor) -> Option<&[usize]> {
        self.nodes.get(t.0).map(|n| n.shape.as_slice())
    }

    /// Internal: `t` has been checked to belong to this graph.
    pub(crate) fn shape(&self, t: Tensor) -> &[usize] {
        &self.nodes[t.0].shape
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub(super) fn check_handle(&self, op: &'static str, t: Tensor) -> Result<()> {
        if t.0 >= self.nodes.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("tensor #{} does not belong to this graph", t.0),
            });
        }
        Ok(())
    }

    pub(crate) fn push(
        &mut self,
        op: impl Into<Op>,
        inputs: Vec<Tensor>,
        shape: Vec<usize>,
        dtype: DType,
        name: String,
    ) -> Tensor {
        self.nodes.push(Node {
            op: op.into(),
            inputs,
            shape,
            dtype,
            name,
        });
        Tensor(self.nodes.len() - 1)
    }

    pub(super) fn f32_inputs(&self, op: &'static str, inputs: &[Tensor]) -> Result<()> {
        for &t in inputs {
            self.check_handle(op, t)?;
            if self.node(t).dtype != DType::F32 {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "`{}` holds {}; {op} needs f32",
                        self.node(t).name,
                        self.node(t).dtype.describe()
                    ),
                });
            }
        }
        Ok(())
    }

    pub(super) fn non_empty(op: &'static str, shape: &[usize]) -> Result<()> {
        if shape.is_empty() || shape.contains(&0) {
            return Err(Error::shape(op, "every dimension must be at least 1", &[shape]));
        }
        if shape.len() > MAX_RANK {
            return Err(Error::shape(
                op,
                format!("tensors have at most {MAX_RANK} dimensions"),
                &[shape],
            ));
        }
        if shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none_or(|n| n > u32::MAX as usize)
        {
            return Err(Error::shape(op, "more than 2^32 elements", &[shape]));
        }
        Ok(())
    }

    /// The node `y`'s dispatch also writes (a layernorm's statistics, a
    /// cross-entropy's gradient), added right after it.
    pub(crate) fn companion(&self, y: Tensor) -> Option<Tensor> {
        let s = Tensor(y.0 + 1);
        (self.get(s).is_some_and(|n| n.op.is_companion() && n.inputs == [y])).then_some(s)
    }

    /// This graph's settings over `nodes`, a rebuilt node list in which
    /// old node i is `map[i]` (a precision or recomputation pass).
    pub(super) fn with_nodes(&self, nodes: Vec<Node>, map: &[usize]) -> Graph {
        let at = |list: &[Tensor]| {
            let mut v: Vec<Tensor> = list.iter().map(|t| Tensor(map[t.0])).collect();
            v.sort();
            v
        };
        Graph {
            nodes,
            no_weight_decay: at(&self.no_weight_decay),
            no_decay_group: at(&self.no_decay_group),
            frozen: at(&self.frozen),
        }
    }

    /// Every parameter, in the order added.
    pub fn parameters(&self) -> Vec<Tensor> {
        (0..self.nodes.len())
            .filter(|&i| matches!(self.nodes[i].op, Op::Source(SourceOp::Parameter { .. })))
            .map(Tensor)
            .collect()
    }

    /// Every input (data fed per run), in the order added.
    pub fn inputs(&self) -> Vec<Tensor> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].op == SourceOp::Input)
            .map(Tensor)
            .collect()
    }

    /// Puts `param` in the group without weight decay (biases, norm gains,
    /// embeddings, as nanoGPT's `configure_optimizers` does). Every optimizer
    /// honours it; the executor lays decayed parameters out first so the
    /// update needs only the boundary.
    pub fn exclude_from_weight_decay(&mut self, param: Tensor) -> Result<()> {
        if !matches!(
            self.get(param).map(|n| &n.op),
            Some(Op::Source(SourceOp::Parameter { .. }))
        ) {
            return Err(Error::InvalidArgument {
                op: "exclude_from_weight_decay",
                reason: format!("tensor #{} is not a parameter of this graph", param.0),
            });
        }
        if let Err(at) = self.no_weight_decay.binary_search(&param) {
            self.no_weight_decay.insert(at, param);
        }
        Ok(())
    }

    /// Marks `param` for the no-decay group, which an optimizer with
    /// parameter groups (`decay_matrices_only`) leaves undecayed along with
    /// every parameter of fewer than 2 dimensions: for a matrix that is not
    /// a weight, such as an embedding table. Without groups it decays like
    /// any other parameter (PyTorch's default).
    pub fn mark_no_decay_group(&mut self, param: Tensor) -> Result<()> {
        if !matches!(
            self.get(param).map(|n| &n.op),
            Some(Op::Source(SourceOp::Parameter { .. }))
        ) {
            return Err(Error::InvalidArgument {
                op: "mark_no_decay_group",
                reason: format!("tensor #{} is not a parameter of this graph", param.0),
            });
        }
        if let Err(at) = self.no_decay_group.binary_search(&param) {
            self.no_decay_group.insert(at, param);
        }
        Ok(())
    }

    /// Whether `param`'s module put it in the no-decay group.
    pub fn in_no_decay_group(&self, param: Tensor) -> bool {
        self.no_decay_group.binary_search(&param).is_ok()
    }

    /// Keeps `param` fixed: a backward pass computes no gradient for it, so
    /// the plan gives it no place in the gradient and optimizer-state
    /// arenas (a LoRA adapter's frozen base).
    pub fn freeze(&mut self, param: Tensor) -> Result<()> {
        if !matches!(
            self.get(param).map(|n| &n.op),
            Some(Op::Source(SourceOp::Parameter { .. }))
        ) {
            return Err(Error::InvalidArgument {
                op: "freeze",
                reason: format!("tensor #{} is not a parameter of this graph", param.0),
            });
        }
        if let Err(at) = self.frozen.binary_search(&param) {
            self.frozen.insert(at, param);
        }
        Ok(())
    }

    /// Whether `param` is kept fixed ([`Graph::freeze`]).
    pub fn is_frozen(&self, param: Tensor) -> bool {
        self.frozen.binary_search(&param).is_ok()
    }

    /// Every parameter a backward pass differentiates (not frozen), in the
    /// order added.
    pub fn trainable_parameters(&self) -> Vec<Tensor> {
        self.parameters().into_iter().filter(|&p| !self.is_frozen(p)).collect()
    }

    /// Whether the optimizer's weight decay applies to `param` (true unless
    /// excluded by [`Graph::exclude_from_weight_decay`]).
    pub fn weight_decay_applies(&self, param: Tensor) -> bool {
        self.no_weight_decay.binary_search(&param).is_err()
    }
}
