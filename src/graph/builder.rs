//! Define-then-run graph: tensor handles and ops, shape-checked as they are
//! added, so a bad shape is an `Error` at build time naming the op.

use crate::error::{Error, Result};
use crate::kernels::{Activation, Binary, MatmulForm, Unary};
use crate::ops::broadcast_shape;

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
    /// A parameter stored in f16, two values per 4-byte word of the
    /// parameter arena ([`Graph::parameter_f16`]): generation's weights.
    /// Only an ABt matmul (as B) and an embedding (as the table) read it,
    /// in f32; an executor with gradients or an optimizer refuses it.
    F16,
}

/// The loss functions, with PyTorch's default "mean" reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    Mse,
    CrossEntropy,
}

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
    /// inputs (qkv [S, T, 3·C], u32 starts [S], k cache, v cache, each
    /// [S, heads, P, C/heads]) -> [S, T, C]: writes the rows' keys and
    /// values into the caches at positions starts[s] + t, then attends
    /// over positions 0..=starts[s] + t (see
    /// `Kernels::cached_attention_forward`). No gradient.
    CachedAttention { heads: usize },
    /// inputs (logits [.., vocab], draws [rows, 2] f32 of (u, temperature),
    /// top_k [rows] u32) -> [rows, 2] u32: each row's token and its first
    /// non-finite logit (see `Kernels::sample_rows`). No gradient.
    SampleTokens,
}

impl Op {
    /// A node another node's dispatch writes (it has no kernel of its own
    /// and follows its writer).
    pub fn is_companion(&self) -> bool {
        matches!(self, Op::LayerNormStats | Op::CrossEntropyRowsGrad)
    }
}

/// Where the second part of a node holding two vectors starts (elements):
/// `len` rounded up to 64 elements = 256 bytes, the largest storage offset
/// alignment an adapter may require, so each part binds on its own.
pub fn stats_offset(len: usize) -> usize {
    len.div_ceil(64) * 64
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Parameter { .. } => "parameter",
            Op::Constant { .. } => "constant",
            Op::Cache => "cache",
            Op::MatMul(_) => "matmul",
            Op::Binary(Binary::Add) => "add",
            Op::Binary(Binary::Sub) => "sub",
            Op::Binary(Binary::Mul) => "mul",
            Op::Binary(Binary::Div) => "div",
            Op::Scale(_) => "scale",
            Op::BiasAdd => "bias_add",
            Op::Activation(_) => "activation",
            Op::ActivationBackward(_) => "activation_backward",
            Op::SumRows => "sum_rows",
            Op::Sum => "sum",
            Op::Mean => "mean",
            Op::Loss(LossKind::Mse) => "mse_loss",
            Op::Loss(LossKind::CrossEntropy) => "cross_entropy_loss",
            Op::LossBackward(_) => "loss_backward",
            Op::Argmax => "argmax",
            Op::AccumulateGrad { .. } => "accumulate_grad",
            Op::Reshape => "reshape",
            Op::Permute(_) => "permute",
            Op::SliceLast { .. } => "slice",
            Op::PadLast { .. } => "pad",
            Op::ConcatLast => "concat",
            Op::BatchMatMul(_) => "batch_matmul",
            Op::Unary(Unary::Exp) => "exp",
            Op::Unary(Unary::Rsqrt) => "rsqrt",
            Op::SumTo => "sum_to",
            Op::Softmax { .. } => "softmax",
            Op::SoftmaxBackward => "softmax_backward",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormStats => "layer_norm_stats",
            Op::LayerNormBackward => "layer_norm_backward",
            Op::LayerNormParamsBackward => "layer_norm_params_backward",
            Op::Embedding => "embedding",
            Op::EmbeddingSort { .. } => "embedding_sort",
            Op::EmbeddingBackward => "embedding_backward",
            Op::CrossEntropyRows => "cross_entropy_rows",
            Op::CrossEntropyRowsGrad => "cross_entropy_rows_grad",
            Op::CachedAttention { .. } => "cached_attention",
            Op::SampleTokens => "sample_tokens",
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
}


/// The largest rank a tensor may have.
pub const MAX_RANK: usize = 4;

/// Largest logits (elements) whose cross-entropy runs as the loss
/// family's single-workgroup kernels, which the plan fuses with the last
/// layer; above it, one workgroup per row.
pub const SINGLE_WORKGROUP_LOSS_MAX: usize = 1 << 16;

/// A tensor of rank ≥ 2 seen as [rows, last dimension] (row-wise ops,
/// biases, losses).
fn rows_cols(op: &'static str, shape: &[usize], all: &[&[usize]]) -> Result<(usize, usize)> {
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

    /// The initial values of a parameter, to edit before the graph runs.
    pub fn parameter_init_mut(&mut self, t: Tensor) -> Option<&mut [f32]> {
        match self.nodes.get_mut(t.0).map(|n| &mut n.op) {
            Some(Op::Parameter { init }) => Some(init.as_mut_slice()),
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

    fn check_handle(&self, op: &'static str, t: Tensor) -> Result<()> {
        if t.0 >= self.nodes.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("tensor #{} does not belong to this graph", t.0),
            });
        }
        Ok(())
    }

    pub(crate) fn push(&mut self, op: Op, inputs: Vec<Tensor>, shape: Vec<usize>, dtype: DType, name: String) -> Tensor {
        self.nodes.push(Node { op, inputs, shape, dtype, name });
        Tensor(self.nodes.len() - 1)
    }

    fn f32_inputs(&self, op: &'static str, inputs: &[Tensor]) -> Result<()> {
        for &t in inputs {
            self.check_handle(op, t)?;
            if self.node(t).dtype != DType::F32 {
                let held = if self.node(t).dtype == DType::F16 { "f16 weights (only an ABt matmul's B or an embedding table)" } else { "u32 values" };
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("`{}` holds {held}; {op} needs f32", self.node(t).name),
                });
            }
        }
        Ok(())
    }

    /// Whether `b` is an f16 parameter read as the weight of an ABt
    /// product, the one matmul f16 weights take (generation's Linear layers
    /// and tied head, stored [out, in]).
    fn f16_weight(&self, form: MatmulForm, b: Tensor) -> bool {
        form == MatmulForm::ABt && self.get(b).is_some_and(|n| n.dtype == DType::F16)
    }

    fn non_empty(op: &'static str, shape: &[usize]) -> Result<()> {
        if shape.is_empty() || shape.contains(&0) {
            return Err(Error::shape(op, "every dimension must be at least 1", &[shape]));
        }
        if shape.len() > MAX_RANK {
            return Err(Error::shape(op, format!("tensors have at most {MAX_RANK} dimensions"), &[shape]));
        }
        if shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).is_none_or(|n| n > u32::MAX as usize) {
            return Err(Error::shape(op, "more than 2^32 elements", &[shape]));
        }
        Ok(())
    }

    /// A tensor fed before each run (f32 features or targets).
    pub fn input(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("input", shape)?;
        Ok(self.push(Op::Input, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    /// A tensor of u32 class labels fed before each run.
    pub fn labels(&mut self, name: &str, len: usize) -> Result<Tensor> {
        self.ids(name, &[len])
    }

    /// A u32 input of any shape fed before each run: token ids for an
    /// embedding, or class labels.
    pub fn ids(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("ids", shape)?;
        Ok(self.push(Op::Input, vec![], shape.to_vec(), DType::U32, name.to_string()))
    }

    /// A trainable tensor; `name` is its state_dict key (e.g. `0.weight`).
    pub fn parameter(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Result<Tensor> {
        Self::non_empty("parameter", shape)?;
        if init.len() != shape.iter().product::<usize>() {
            return Err(Error::shape("parameter", format!("`{name}` got {} initial values", init.len()), &[shape]));
        }
        if self.nodes.iter().any(|n| matches!(n.op, Op::Parameter { .. }) && n.name == name) {
            return Err(Error::InvalidArgument { op: "parameter", reason: format!("a parameter named `{name}` already exists") });
        }
        Ok(self.push(Op::Parameter { init }, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    /// A parameter stored in f16 ([`DType::F16`]): `init` is rounded to
    /// the nearest f16 when the executor uploads it, and the arena holds
    /// two values per word, half the bytes of an f32 parameter. For
    /// inference only (generation's weights with `WeightDtype::F16`); it
    /// may be the B of an ABt matmul or an embedding's table.
    pub fn parameter_f16(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Result<Tensor> {
        let t = self.parameter(name, shape, init)?;
        self.nodes[t.0].dtype = DType::F16;
        Ok(t)
    }

    /// A tensor that keeps its values between runs, zero at first (see
    /// [`Op::Cache`]): the keys or values of a KV cache.
    pub fn cache(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("cache", shape)?;
        Ok(self.push(Op::Cache, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    pub fn constant(&mut self, name: &str, shape: &[usize], values: Vec<f32>) -> Result<Tensor> {
        Self::non_empty("constant", shape)?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::shape("constant", format!("`{name}` got {} values", values.len()), &[shape]));
        }
        Ok(self.push(Op::Constant { values }, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    /// op(a)·op(b) for a `MatmulForm` (stored shapes as the form says):
    /// 2-D operands, or rank-3/4 operands with equal leading dimensions (a
    /// product per leading index).
    pub fn matmul_form(&mut self, form: MatmulForm, a: Tensor, b: Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        let f16_weight = self.f16_weight(form, b);
        let pair = [a, b];
        self.f32_inputs(OP, &pair[..if f16_weight { 1 } else { 2 }])?;
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        let all: [&[usize]; 2] = [&sa, &sb];
        if sa.len() != sb.len() || !(2..=MAX_RANK).contains(&sa.len()) {
            return Err(Error::shape(OP, "operands must both be 2-D, or both rank 3 or 4", &all));
        }
        if f16_weight && sa.len() != 2 {
            return Err(Error::shape(OP, "f16 weights take 2-D products only", &all));
        }
        let lead = sa.len() - 2;
        if sa[..lead] != sb[..lead] {
            return Err(Error::shape(OP, "batched operands must have equal leading dimensions", &all));
        }
        let (ar, ac, br, bc) = (sa[lead], sa[lead + 1], sb[lead], sb[lead + 1]);
        let (m, ka, kb, n) = match form {
            MatmulForm::AB => (ar, ac, br, bc),
            MatmulForm::AtB => (ac, ar, br, bc),
            MatmulForm::ABt => (ar, ac, bc, br),
        };
        if ka != kb {
            return Err(Error::shape(OP, format!("{form:?}: inner dimensions differ ({ka} vs {kb})"), &all));
        }
        let mut shape = sa[..lead].to_vec();
        shape.extend([m, n]);
        let op = if lead == 0 { Op::MatMul(form) } else { Op::BatchMatMul(form) };
        Ok(self.push(op, vec![a, b], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// a·b, as torch.matmul for the cases a transformer uses: 2-D by 2-D,
    /// batched by batched (equal leading dimensions), and [.., K] by a 2-D
    /// [K, N] (a Linear layer over every position).
    pub fn matmul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.check_handle("matmul", a)?;
        self.check_handle("matmul", b)?;
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        if sa.len() > 2 && sb.len() == 2 {
            return self.rows_matmul(MatmulForm::AB, a, b);
        }
        self.matmul_form(MatmulForm::AB, a, b)
    }

    /// x[.., K] · op(w) for a 2-D w (AB: w is [K, N]; ABt: w is [N, K]),
    /// done as one 2-D product over all rows: -> [.., N].
    pub fn rows_matmul(&mut self, form: MatmulForm, x: Tensor, w: Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        let f16_weight = self.f16_weight(form, w);
        let pair = [x, w];
        self.f32_inputs(OP, &pair[..if f16_weight { 1 } else { 2 }])?;
        let (sx, sw) = (self.shape(x).to_vec(), self.shape(w).to_vec());
        let (rows, k) = rows_cols(OP, &sx, &[&sx, &sw])?;
        if sx.len() == 2 {
            return self.matmul_form(form, x, w);
        }
        let flat = self.reshape(x, &[rows, k])?;
        let y = self.matmul_form(form, flat, w)?;
        let mut shape = sx[..sx.len() - 1].to_vec();
        shape.push(self.shape(y)[1]);
        self.reshape(y, &shape)
    }

    /// An elementwise op with NumPy broadcasting over trailing dimensions
    /// (a `[C]` bias over `[B, T, C]`, a `[T, T]` mask over `[B, H, T, T]`).
    fn broadcast_binary(&mut self, op: Binary, a: Tensor, b: Tensor) -> Result<Tensor> {
        let name = Op::Binary(op).name();
        self.f32_inputs(name, &[a, b])?;
        let shape = broadcast_shape(self.shape(a), self.shape(b))
            .ok_or_else(|| Error::shape(name, "shapes do not broadcast (trailing dimensions must be equal or 1)", &[self.shape(a), self.shape(b)]))?;
        if shape.len() > MAX_RANK {
            return Err(Error::shape(name, format!("tensors have at most {MAX_RANK} dimensions"), &[self.shape(a), self.shape(b)]));
        }
        Ok(self.push(Op::Binary(op), vec![a, b], shape, DType::F32, format!("{name}{}", self.nodes.len())))
    }

    pub fn add(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Binary::Add, a, b)
    }

    pub fn sub(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Binary::Sub, a, b)
    }

    pub fn mul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Binary::Mul, a, b)
    }

    /// a / b, broadcasting.
    pub fn div(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Binary::Div, a, b)
    }

    pub fn scale(&mut self, x: Tensor, alpha: f32) -> Result<Tensor> {
        self.f32_inputs("scale", &[x])?;
        let shape = self.shape(x).to_vec();
        Ok(self.push(Op::Scale(alpha), vec![x], shape, DType::F32, format!("scale{}", self.nodes.len())))
    }

    /// x[.., cols] + bias[cols], broadcast over every row.
    pub fn bias_add(&mut self, x: Tensor, bias: Tensor) -> Result<Tensor> {
        const OP: &str = "bias_add";
        self.f32_inputs(OP, &[x, bias])?;
        let (sx, sb) = (self.shape(x).to_vec(), self.shape(bias).to_vec());
        let (_, cols) = rows_cols(OP, &sx, &[&sx, &sb])?;
        if sb != [cols] {
            return Err(Error::shape(OP, format!("bias must be [{cols}]"), &[&sx, &sb]));
        }
        Ok(self.push(Op::BiasAdd, vec![x, bias], sx, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    pub fn activation(&mut self, act: Activation, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("activation", &[x])?;
        let shape = self.shape(x).to_vec();
        let name = format!("{act:?}{}", self.nodes.len()).to_lowercase();
        Ok(self.push(Op::Activation(act), vec![x], shape, DType::F32, name))
    }

    pub fn relu(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(Activation::Relu, x)
    }

    pub fn gelu(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(Activation::Gelu, x)
    }

    pub fn sigmoid(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(Activation::Sigmoid, x)
    }

    pub fn tanh(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(Activation::Tanh, x)
    }

    /// Column sums: [.., cols] -> [cols].
    pub fn sum_rows(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum_rows", &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = rows_cols("sum_rows", &sx, &[&sx])?;
        Ok(self.push(Op::SumRows, vec![x], vec![cols], DType::F32, format!("sum_rows{}", self.nodes.len())))
    }

    /// Sum of every element -> [1].
    pub fn sum(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum", &[x])?;
        Ok(self.push(Op::Sum, vec![x], vec![1], DType::F32, format!("sum{}", self.nodes.len())))
    }

    /// Mean of every element -> [1].
    pub fn mean(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("mean", &[x])?;
        Ok(self.push(Op::Mean, vec![x], vec![1], DType::F32, format!("mean{}", self.nodes.len())))
    }

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

    /// Index of each row's maximum: [.., cols] -> u32 [..].
    pub fn argmax(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("argmax", &[x])?;
        let sx = self.shape(x).to_vec();
        rows_cols("argmax", &sx, &[&sx])?;
        Ok(self.push(Op::Argmax, vec![x], sx[..sx.len() - 1].to_vec(), DType::U32, format!("argmax{}", self.nodes.len())))
    }

    /// The same elements under a new shape (same count): no copy.
    pub fn reshape(&mut self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "reshape";
        self.check_handle(OP, x)?;
        Self::non_empty(OP, shape)?;
        let sx = self.shape(x).to_vec();
        if shape.iter().product::<usize>() != sx.iter().product::<usize>() {
            return Err(Error::shape(OP, "the element count must not change", &[&sx, shape]));
        }
        let dtype = self.node(x).dtype;
        Ok(self.push(Op::Reshape, vec![x], shape.to_vec(), dtype, format!("{OP}{}", self.nodes.len())))
    }

    /// Axes reordered (a copy): output dimension i is input dimension perm[i].
    pub fn permute(&mut self, x: Tensor, perm: &[usize]) -> Result<Tensor> {
        const OP: &str = "permute";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let mut seen = vec![false; sx.len()];
        for &p in perm {
            if p >= sx.len() || std::mem::replace(&mut seen[p], true) {
                return Err(Error::shape(OP, format!("{perm:?} is not a permutation of the input's axes"), &[&sx, perm]));
            }
        }
        if perm.len() != sx.len() {
            return Err(Error::shape(OP, format!("{perm:?} is not a permutation of the input's axes"), &[&sx, perm]));
        }
        let shape: Vec<usize> = perm.iter().map(|&p| sx[p]).collect();
        Ok(self.push(Op::Permute(perm.to_vec()), vec![x], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Swaps two axes (a copy).
    pub fn transpose(&mut self, x: Tensor, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.check_handle("transpose", x)?;
        let rank = self.shape(x).len();
        if dim0 >= rank || dim1 >= rank {
            return Err(Error::shape("transpose", format!("axes {dim0} and {dim1} of a rank-{rank} tensor"), &[self.shape(x)]));
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(dim0, dim1);
        self.permute(x, &perm)
    }

    /// Columns `start..start + width` of the last dimension (a copy).
    pub fn slice_last(&mut self, x: Tensor, start: usize, width: usize) -> Result<Tensor> {
        const OP: &str = "slice";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = rows_cols(OP, &sx, &[&sx])?;
        if width == 0 || start.checked_add(width).is_none_or(|end| end > cols) {
            return Err(Error::shape(OP, format!("columns {start}..{} of {cols}", start.saturating_add(width)), &[&sx]));
        }
        let mut shape = sx.clone();
        if let Some(last) = shape.last_mut() {
            *last = width;
        }
        Ok(self.push(Op::SliceLast { start }, vec![x], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Splits the last dimension into pieces of the given widths (q, k and
    /// v from one projection), like torch.split.
    pub fn split_last(&mut self, x: Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.check_handle("split", x)?;
        let sx = self.shape(x).to_vec();
        if widths.iter().sum::<usize>() != sx.last().copied().unwrap_or(0) {
            return Err(Error::shape("split", format!("widths {widths:?} do not add up to the last dimension"), &[&sx, widths]));
        }
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let piece = self.slice_last(x, start, w);
                start += w;
                piece
            })
            .collect()
    }

    /// x[.., width] placed at columns `start..` of a zero [.., cols] tensor.
    pub(crate) fn pad_last(&mut self, x: Tensor, start: usize, cols: usize) -> Result<Tensor> {
        const OP: &str = "pad";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, width) = rows_cols(OP, &sx, &[&sx])?;
        if start.checked_add(width).is_none_or(|end| end > cols) {
            return Err(Error::shape(OP, format!("columns {start}..{} of {cols}", start + width), &[&sx]));
        }
        let mut shape = sx.clone();
        if let Some(last) = shape.last_mut() {
            *last = cols;
        }
        Ok(self.push(Op::PadLast { start }, vec![x], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Tensors side by side along the last dimension (equal leading shapes),
    /// like torch.cat(.., dim=-1).
    pub fn concat_last(&mut self, parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "concat";
        let (&first, rest) = parts.split_first().ok_or_else(|| Error::InvalidArgument { op: OP, reason: "nothing to concatenate".into() })?;
        self.f32_inputs(OP, parts)?;
        rest.iter().try_fold(first, |acc, &b| {
            let (sa, sb) = (self.shape(acc).to_vec(), self.shape(b).to_vec());
            rows_cols(OP, &sa, &[&sa, &sb])?;
            rows_cols(OP, &sb, &[&sa, &sb])?;
            if sa.len() != sb.len() || sa[..sa.len() - 1] != sb[..sb.len() - 1] {
                return Err(Error::shape(OP, "leading dimensions must be equal", &[&sa, &sb]));
            }
            let mut shape = sa.clone();
            if let Some(last) = shape.last_mut() {
                *last += sb[sb.len() - 1];
            }
            Ok(self.push(Op::ConcatLast, vec![acc, b], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
        })
    }

    fn unary(&mut self, op: Unary, x: Tensor) -> Result<Tensor> {
        let name = Op::Unary(op).name();
        self.f32_inputs(name, &[x])?;
        let shape = self.shape(x).to_vec();
        Ok(self.push(Op::Unary(op), vec![x], shape, DType::F32, format!("{name}{}", self.nodes.len())))
    }

    pub fn exp(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Unary::Exp, x)
    }

    /// 1 / sqrt(x) (inf at 0, NaN below, as IEEE).
    pub fn rsqrt(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Unary::Rsqrt, x)
    }

    /// Sums `x` down to `shape`, a shape `x`'s broadcasts from.
    pub(crate) fn sum_to(&mut self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "sum_to";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        if sx == shape {
            return Ok(x);
        }
        if broadcast_shape(&sx, shape).as_deref() != Some(sx.as_slice()) {
            return Err(Error::shape(OP, "the target does not broadcast to the input", &[&sx, shape]));
        }
        Ok(self.push(Op::SumTo, vec![x], shape.to_vec(), DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Softmax over the last dimension. `causal`: scores [.., T, T] where
    /// query i sees keys 0..=i only (the rest get probability 0).
    pub fn softmax(&mut self, x: Tensor, causal: bool) -> Result<Tensor> {
        const OP: &str = "softmax";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        rows_cols(OP, &sx, &[&sx])?;
        if causal && sx[sx.len() - 2] != sx[sx.len() - 1] {
            return Err(Error::shape(OP, "a causal mask needs square [.., T, T] scores", &[&sx]));
        }
        Ok(self.push(Op::Softmax { causal }, vec![x], sx, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// torch.nn.functional.layer_norm over the last dimension, with
    /// weight and bias [C].
    pub fn layer_norm(&mut self, x: Tensor, weight: Tensor, bias: Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        self.f32_inputs(OP, &[x, weight, bias])?;
        let (sx, sw, sb) = (self.shape(x).to_vec(), self.shape(weight).to_vec(), self.shape(bias).to_vec());
        let (rows, cols) = rows_cols(OP, &sx, &[&sx, &sw, &sb])?;
        if sw != [cols] || sb != [cols] {
            return Err(Error::shape(OP, format!("weight and bias must be [{cols}]"), &[&sx, &sw, &sb]));
        }
        if !(eps.is_finite() && eps > 0.0) {
            return Err(Error::InvalidArgument { op: OP, reason: format!("eps must be positive and finite, got {eps}") });
        }
        let y = self.push(Op::LayerNorm { eps }, vec![x, weight, bias], sx, DType::F32, format!("{OP}{}", self.nodes.len()));
        let stats_len = stats_offset(rows) + rows;
        self.push(Op::LayerNormStats, vec![y], vec![stats_len], DType::F32, format!("{OP}{}.stats", y.0));
        Ok(y)
    }

    /// Rows of `table` [V, C] picked by u32 `ids` [..] -> [.., C]
    /// (torch.nn.functional.embedding).
    pub fn embedding(&mut self, table: Tensor, ids: Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        // An f16 table (generation's tied token embedding) is read in f32.
        if self.get(table).is_none_or(|n| n.dtype != DType::F16) {
            self.f32_inputs(OP, &[table])?;
        }
        self.check_handle(OP, ids)?;
        let (st, si) = (self.shape(table).to_vec(), self.shape(ids).to_vec());
        let [_, channels] = st[..] else {
            return Err(Error::shape(OP, "the table must be [vocab, channels]", &[&st, &si]));
        };
        if self.node(ids).dtype != DType::U32 {
            return Err(Error::shape(OP, "ids must be u32", &[&st, &si]));
        }
        let mut shape = si.clone();
        shape.push(channels);
        Self::non_empty(OP, &shape)?;
        Ok(self.push(Op::Embedding, vec![table, ids], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Causal self-attention of `qkv` [S, T, 3·C] (q | k | v of T new
    /// positions per sequence, `heads` heads) over KV caches `k_cache`,
    /// `v_cache` [S, heads, P, C/heads] ([`Graph::cache`] tensors): row t
    /// of sequence s is position starts[s] + t (u32 `starts` [S]); its key
    /// and value are written into the caches there, and it attends over
    /// positions 0 ..= starts[s] + t, the earlier ones from the caches.
    /// -> [S, T, C], heads side by side. Positions must stay below P (the
    /// caller checks the starts it writes). No gradient.
    pub fn cached_attention(&mut self, qkv: Tensor, starts: Tensor, k_cache: Tensor, v_cache: Tensor, heads: usize) -> Result<Tensor> {
        const OP: &str = "cached_attention";
        self.f32_inputs(OP, &[qkv, k_cache, v_cache])?;
        self.check_handle(OP, starts)?;
        let (sq, ss, sk, sv) = (self.shape(qkv).to_vec(), self.shape(starts).to_vec(), self.shape(k_cache).to_vec(), self.shape(v_cache).to_vec());
        let all: [&[usize]; 4] = [&sq, &ss, &sk, &sv];
        let [seqs, rows, width] = sq[..] else {
            return Err(Error::shape(OP, "qkv must be [sequences, rows, 3·channels]", &all));
        };
        if heads == 0 || width % 3 != 0 || (width / 3) % heads != 0 {
            return Err(Error::shape(OP, format!("qkv's last dimension must be 3·channels with channels a multiple of {heads} heads"), &all));
        }
        let head_dim = width / 3 / heads;
        if self.node(starts).dtype != DType::U32 || ss != [seqs] {
            return Err(Error::shape(OP, format!("starts must be u32 [{seqs}]"), &all));
        }
        let cache_ok = |shape: &[usize]| shape.len() == 4 && shape[0] == seqs && shape[1] == heads && shape[3] == head_dim;
        if !cache_ok(&sk) || sk != sv {
            return Err(Error::shape(OP, format!("the caches must both be [{seqs}, {heads}, context, {head_dim}]"), &all));
        }
        for cache in [k_cache, v_cache] {
            if self.node(cache).op != Op::Cache {
                return Err(Error::InvalidArgument { op: OP, reason: format!("`{}` is not a cache tensor (Graph::cache)", self.node(cache).name) });
            }
        }
        if k_cache == v_cache {
            return Err(Error::InvalidArgument { op: OP, reason: "keys and values need two different caches".into() });
        }
        let shape = vec![seqs, rows, width / 3];
        Ok(self.push(Op::CachedAttention { heads }, vec![qkv, starts, k_cache, v_cache], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// The next token of each row of `logits` [.., vocab] (rows: the
    /// product of the leading dimensions), drawn on the GPU with each
    /// row's settings read from inputs, so that changing them rebuilds
    /// nothing: `draws` f32 [rows, 2] holds (u, temperature) with u
    /// uniform in `[0, 1)`, `top_k` (u32 `[rows]`) the number of largest logits
    /// to sample among (clamped to 1..=vocab). -> u32 [rows, 2]: (token,
    /// first column whose logit is not finite, or
    /// [`NO_TOKEN`](crate::ops::NO_TOKEN) when all are). Temperature 0 is
    /// the first maximum; see `Kernels::sample_rows`. No gradient.
    pub fn sample_tokens(&mut self, logits: Tensor, draws: Tensor, top_k: Tensor) -> Result<Tensor> {
        const OP: &str = "sample_tokens";
        self.f32_inputs(OP, &[logits, draws])?;
        self.check_handle(OP, top_k)?;
        let (sl, sd, sk) = (self.shape(logits).to_vec(), self.shape(draws).to_vec(), self.shape(top_k).to_vec());
        let all: [&[usize]; 3] = [&sl, &sd, &sk];
        let (rows, _) = rows_cols(OP, &sl, &all)?;
        if sd != [rows, 2] {
            return Err(Error::shape(OP, format!("draws must be [{rows}, 2]: (u, temperature) for each of the logits' {rows} rows"), &all));
        }
        if self.node(top_k).dtype != DType::U32 || sk != [rows] {
            return Err(Error::shape(OP, format!("top_k must be u32 [{rows}], one k for each of the logits' {rows} rows"), &all));
        }
        Ok(self.push(Op::SampleTokens, vec![logits, draws, top_k], vec![rows, 2], DType::U32, format!("{OP}{}", self.nodes.len())))
    }

    /// The node `y`'s dispatch also writes (a layernorm's statistics, a
    /// cross-entropy's gradient), added right after it.
    pub(crate) fn companion(&self, y: Tensor) -> Option<Tensor> {
        let s = Tensor(y.0 + 1);
        (self.get(s).is_some_and(|n| n.op.is_companion() && n.inputs == [y])).then_some(s)
    }

    /// Every parameter, in the order added.
    pub fn parameters(&self) -> Vec<Tensor> {
        (0..self.nodes.len())
            .filter(|&i| matches!(self.nodes[i].op, Op::Parameter { .. }))
            .map(Tensor)
            .collect()
    }

    /// Every input (data fed per run), in the order added.
    pub fn inputs(&self) -> Vec<Tensor> {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].op == Op::Input).map(Tensor).collect()
    }

    /// Puts `param` in the group without weight decay (biases, norm gains,
    /// embeddings, as nanoGPT's `configure_optimizers` does). Every optimizer
    /// honours it; the executor lays decayed parameters out first so the
    /// update needs only the boundary.
    pub fn exclude_from_weight_decay(&mut self, param: Tensor) -> Result<()> {
        if !matches!(self.get(param).map(|n| &n.op), Some(Op::Parameter { .. })) {
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
        if !matches!(self.get(param).map(|n| &n.op), Some(Op::Parameter { .. })) {
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

    /// Whether the optimizer's weight decay applies to `param` (true unless
    /// excluded by [`Graph::exclude_from_weight_decay`]).
    pub fn weight_decay_applies(&self, param: Tensor) -> bool {
        self.no_weight_decay.binary_search(&param).is_err()
    }
}
