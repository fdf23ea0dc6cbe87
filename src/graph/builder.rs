//! Define-then-run graph: tensor handles and ops, shape-checked as they are
//! added, so a bad shape is an `Error` at build time naming the op.

use crate::error::{Error, Result};
use crate::kernels::{Activation, Binary, MatmulForm};

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
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Parameter { .. } => "parameter",
            Op::Constant { .. } => "constant",
            Op::MatMul(_) => "matmul",
            Op::Binary(Binary::Add) => "add",
            Op::Binary(Binary::Sub) => "sub",
            Op::Binary(Binary::Mul) => "mul",
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
}

fn matrix(op: &'static str, shape: &[usize], all: &[&[usize]]) -> Result<(usize, usize)> {
    match shape {
        [r, c] => Ok((*r, *c)),
        _ => Err(Error::shape(op, "expects 2-D tensors", all)),
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
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("`{}` holds u32 values; {op} needs f32", self.node(t).name),
                });
            }
        }
        Ok(())
    }

    fn non_empty(op: &'static str, shape: &[usize]) -> Result<()> {
        if shape.is_empty() || shape.contains(&0) {
            return Err(Error::shape(op, "every dimension must be at least 1", &[shape]));
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
        Self::non_empty("labels", &[len])?;
        Ok(self.push(Op::Input, vec![], vec![len], DType::U32, name.to_string()))
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

    pub fn constant(&mut self, name: &str, shape: &[usize], values: Vec<f32>) -> Result<Tensor> {
        Self::non_empty("constant", shape)?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::shape("constant", format!("`{name}` got {} values", values.len()), &[shape]));
        }
        Ok(self.push(Op::Constant { values }, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    /// op(a)·op(b) for a `MatmulForm` (stored shapes as the form says).
    pub fn matmul_form(&mut self, form: MatmulForm, a: Tensor, b: Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        self.f32_inputs(OP, &[a, b])?;
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        let all: [&[usize]; 2] = [&sa, &sb];
        let (ar, ac) = matrix(OP, &sa, &all)?;
        let (br, bc) = matrix(OP, &sb, &all)?;
        let (m, ka, kb, n) = match form {
            MatmulForm::AB => (ar, ac, br, bc),
            MatmulForm::AtB => (ac, ar, br, bc),
            MatmulForm::ABt => (ar, ac, bc, br),
        };
        if ka != kb {
            return Err(Error::shape(OP, format!("{form:?}: inner dimensions differ ({ka} vs {kb})"), &all));
        }
        Ok(self.push(Op::MatMul(form), vec![a, b], vec![m, n], DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// a·b
    pub fn matmul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.matmul_form(MatmulForm::AB, a, b)
    }

    fn same_shape_binary(&mut self, op: Binary, a: Tensor, b: Tensor) -> Result<Tensor> {
        let name = Op::Binary(op).name();
        self.f32_inputs(name, &[a, b])?;
        if self.shape(a) != self.shape(b) {
            return Err(Error::shape(name, "operands must have the same shape", &[self.shape(a), self.shape(b)]));
        }
        let shape = self.shape(a).to_vec();
        Ok(self.push(Op::Binary(op), vec![a, b], shape, DType::F32, format!("{name}{}", self.nodes.len())))
    }

    pub fn add(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.same_shape_binary(Binary::Add, a, b)
    }

    pub fn sub(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.same_shape_binary(Binary::Sub, a, b)
    }

    pub fn mul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.same_shape_binary(Binary::Mul, a, b)
    }

    pub fn scale(&mut self, x: Tensor, alpha: f32) -> Result<Tensor> {
        self.f32_inputs("scale", &[x])?;
        let shape = self.shape(x).to_vec();
        Ok(self.push(Op::Scale(alpha), vec![x], shape, DType::F32, format!("scale{}", self.nodes.len())))
    }

    /// x[rows, cols] + bias[cols], broadcast over rows.
    pub fn bias_add(&mut self, x: Tensor, bias: Tensor) -> Result<Tensor> {
        const OP: &str = "bias_add";
        self.f32_inputs(OP, &[x, bias])?;
        let (sx, sb) = (self.shape(x).to_vec(), self.shape(bias).to_vec());
        let (_, cols) = matrix(OP, &sx, &[&sx, &sb])?;
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

    /// Column sums: [rows, cols] -> [cols].
    pub fn sum_rows(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("sum_rows", &[x])?;
        let sx = self.shape(x).to_vec();
        let (_, cols) = matrix("sum_rows", &sx, &[&sx])?;
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

    /// Softmax cross-entropy of logits [rows, classes] against u32 labels
    /// [rows], mean over rows -> [1].
    pub fn cross_entropy_loss(&mut self, logits: Tensor, labels: Tensor) -> Result<Tensor> {
        const OP: &str = "cross_entropy_loss";
        self.f32_inputs(OP, &[logits])?;
        self.check_handle(OP, labels)?;
        let (sl, st) = (self.shape(logits).to_vec(), self.shape(labels).to_vec());
        let (rows, _) = matrix(OP, &sl, &[&sl, &st])?;
        if self.node(labels).dtype != DType::U32 || st != [rows] {
            return Err(Error::shape(OP, format!("labels must be u32 class indices of shape [{rows}]"), &[&sl, &st]));
        }
        Ok(self.push(Op::Loss(LossKind::CrossEntropy), vec![logits, labels], vec![1], DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// Index of each row's maximum: [rows, cols] -> u32 [rows].
    pub fn argmax(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("argmax", &[x])?;
        let sx = self.shape(x).to_vec();
        let (rows, _) = matrix("argmax", &sx, &[&sx])?;
        Ok(self.push(Op::Argmax, vec![x], vec![rows], DType::U32, format!("argmax{}", self.nodes.len())))
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

    /// Whether the optimizer's weight decay applies to `param` (true unless
    /// excluded by [`Graph::exclude_from_weight_decay`]).
    pub fn weight_decay_applies(&self, param: Tensor) -> bool {
        self.no_weight_decay.binary_search(&param).is_err()
    }
}
