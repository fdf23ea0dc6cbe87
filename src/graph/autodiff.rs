//! Reverse-mode autodiff: `Graph::backward(loss)` appends gradient nodes.
//! Every op's rule is in the one `match` of `input_gradients`.

use std::collections::HashMap;

use super::builder::{DType, Graph, Op, Tensor};
use crate::error::{Error, Result};
use crate::kernels::{Binary, MatmulForm, Unary};

/// The gradient node of each parameter after `backward`.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// The tensor differentiated (a scalar loss, or a stage's output).
    pub loss: Tensor,
    by_param: HashMap<Tensor, Tensor>,
    by_input: HashMap<Tensor, Tensor>,
    /// Every accumulation node this backward pass added, in order.
    accumulations: Vec<Tensor>,
}

impl Gradients {
    /// The gradient of `param`, if the loss depends on it.
    pub fn get(&self, param: Tensor) -> Option<Tensor> {
        self.by_param.get(&param).copied()
    }

    /// The gradient with respect to an input asked for in
    /// [`Graph::backward_from`] (what a pipeline stage sends back).
    pub fn input(&self, input: Tensor) -> Option<Tensor> {
        self.by_input.get(&input).copied()
    }

    /// Every node adding into a parameter's gradient (a parameter used
    /// twice has two).
    pub fn accumulations(&self) -> &[Tensor] {
        &self.accumulations
    }

    /// Every input gradient node (they must survive the run).
    pub fn input_gradients(&self) -> Vec<Tensor> {
        let mut v: Vec<Tensor> = self.by_input.values().copied().collect();
        v.sort();
        v
    }

    /// (parameter, gradient) pairs in parameter order.
    pub fn pairs(&self) -> Vec<(Tensor, Tensor)> {
        let mut v: Vec<_> = self.by_param.iter().map(|(&p, &g)| (p, g)).collect();
        v.sort();
        v
    }
}

impl Graph {
    /// Appends the nodes computing d loss / d parameter for every parameter
    /// the scalar `loss` depends on. Gradients accumulate (`+=`) into each
    /// parameter's gradient buffer; zeroing it is an explicit step.
    pub fn backward(&mut self, loss: Tensor) -> Result<Gradients> {
        if loss.0 >= self.nodes.len() {
            return Err(Error::InvalidArgument { op: "backward", reason: format!("tensor #{} is not in this graph", loss.0) });
        }
        if self.shape(loss) != [1] || self.node(loss).dtype != DType::F32 {
            return Err(Error::shape("backward", "the loss must be an f32 scalar of shape [1]", &[self.shape(loss)]));
        }
        let seed = self.constant("dloss", &[1], vec![1.0])?;
        self.backward_from(loss, seed, &[])
    }

    /// Reverse mode from `output` with a given gradient `seed` (same shape:
    /// a stage's output receiving d loss / d output from the next stage, or
    /// a loss with a scale). Also returns the gradients with respect to the
    /// listed `inputs` (what a stage sends to the previous one).
    pub fn backward_from(&mut self, output: Tensor, seed: Tensor, inputs: &[Tensor]) -> Result<Gradients> {
        for &t in [output, seed].iter().chain(inputs) {
            if t.0 >= self.nodes.len() {
                return Err(Error::InvalidArgument { op: "backward", reason: format!("tensor #{} is not in this graph", t.0) });
            }
        }
        if self.shape(seed) != self.shape(output) {
            return Err(Error::shape("backward", "the seed gradient must have the output's shape", &[self.shape(output), self.shape(seed)]));
        }
        if let Some(&bad) = inputs.iter().find(|t| self.node(**t).op != Op::Input || self.node(**t).dtype != DType::F32) {
            return Err(Error::InvalidArgument { op: "backward", reason: format!("`{}` is not an f32 input", self.node(bad).name) });
        }
        let count = output.0 + 1;
        let mut requires_grad = vec![false; count];
        for i in 0..count {
            requires_grad[i] = match self.nodes[i].op {
                Op::Parameter { .. } => true,
                Op::Input => inputs.contains(&Tensor(i)),
                Op::Constant { .. } => false,
                _ => self.nodes[i].inputs.iter().any(|t| requires_grad[t.0]),
            };
        }
        let mut grads: HashMap<usize, Tensor> = HashMap::from([(output.0, seed)]);
        let mut by_param = HashMap::new();
        let mut by_input = HashMap::new();
        let mut accumulations = Vec::new();
        for i in (0..count).rev() {
            let Some(dy) = grads.remove(&i) else { continue };
            if !requires_grad[i] {
                continue;
            }
            match self.nodes[i].op {
                Op::Parameter { .. } => continue,
                Op::Input => {
                    by_input.insert(Tensor(i), dy);
                    continue;
                }
                _ => {}
            }
            let node_inputs = self.nodes[i].inputs.clone();
            for (slot, &input) in node_inputs.iter().enumerate() {
                if !requires_grad[input.0] {
                    continue;
                }
                let contribution = self.input_gradient(Tensor(i), slot, dy)?;
                if matches!(self.nodes[input.0].op, Op::Parameter { .. }) {
                    let shape = self.shape(input).to_vec();
                    let name = format!("{}.grad", self.nodes[input.0].name);
                    let g = self.push(Op::AccumulateGrad { param: input }, vec![contribution], shape, DType::F32, name);
                    by_param.insert(input, g);
                    accumulations.push(g);
                } else {
                    let total = match grads.get(&input.0) {
                        Some(&previous) => self.add(previous, contribution)?,
                        None => contribution,
                    };
                    grads.insert(input.0, total);
                }
            }
        }
        accumulations.sort();
        Ok(Gradients { loss: output, by_param, by_input, accumulations })
    }

    /// d loss / d (input `slot` of `node`), given dy = d loss / d node.
    fn input_gradient(&mut self, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let n = self.node(node).clone();
        let input = |k: usize| n.inputs[k];
        let in_shape = self.shape(input(slot)).to_vec();
        match (&n.op, slot) {
            (Op::MatMul(form) | Op::BatchMatMul(form), _) => {
                let (a, b) = (input(0), input(1));
                match (form, slot) {
                    (MatmulForm::AB, 0) => self.matmul_form(MatmulForm::ABt, dy, b),
                    (MatmulForm::AB, _) => self.matmul_form(MatmulForm::AtB, a, dy),
                    (MatmulForm::AtB, 0) => self.matmul_form(MatmulForm::ABt, b, dy),
                    (MatmulForm::AtB, _) => self.matmul_form(MatmulForm::AB, a, dy),
                    (MatmulForm::ABt, 0) => self.matmul_form(MatmulForm::AB, dy, b),
                    (MatmulForm::ABt, _) => self.matmul_form(MatmulForm::AtB, dy, a),
                }
            }
            // Broadcast operands get the sum of dy over the dimensions they
            // were repeated along.
            (Op::Binary(Binary::Add), _) => self.sum_to(dy, &in_shape),
            (Op::Binary(Binary::Sub), 0) => self.sum_to(dy, &in_shape),
            (Op::Binary(Binary::Sub), _) => {
                let g = self.sum_to(dy, &in_shape)?;
                self.scale(g, -1.0)
            }
            (Op::Binary(Binary::Mul), _) => {
                let g = self.mul(dy, input(1 - slot))?;
                self.sum_to(g, &in_shape)
            }
            (Op::Binary(Binary::Div), 0) => {
                let g = self.div(dy, input(1))?;
                self.sum_to(g, &in_shape)
            }
            // d(a/b)/db = -(a/b)/b
            (Op::Binary(Binary::Div), _) => {
                let g = self.mul(dy, node)?;
                let g = self.div(g, input(1))?;
                let g = self.sum_to(g, &in_shape)?;
                self.scale(g, -1.0)
            }
            (Op::Unary(Unary::Exp), 0) => self.mul(dy, node),
            // d x^(-1/2) = -1/2 · y³
            (Op::Unary(Unary::Rsqrt), 0) => {
                let y2 = self.mul(node, node)?;
                let y3 = self.mul(y2, node)?;
                let g = self.mul(dy, y3)?;
                self.scale(g, -0.5)
            }
            (Op::Scale(alpha), 0) => self.scale(dy, *alpha),
            (Op::BiasAdd, 0) => Ok(dy),
            (Op::BiasAdd, 1) => self.sum_rows(dy),
            (Op::Activation(act), 0) => {
                let shape = n.shape.clone();
                let name = format!("d{}", n.name);
                Ok(self.push(Op::ActivationBackward(*act), vec![input(0), dy], shape, DType::F32, name))
            }
            (Op::Loss(kind), 0) => {
                let shape = self.shape(input(0)).to_vec();
                let name = format!("d{}", self.node(input(0)).name);
                Ok(self.push(Op::LossBackward(*kind), vec![input(0), input(1), dy], shape, DType::F32, name))
            }
            (Op::Reshape, 0) => self.reshape(dy, &in_shape),
            (Op::Permute(perm), 0) => {
                let mut inverse = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inverse[p] = i;
                }
                self.permute(dy, &inverse)
            }
            (Op::SliceLast { start }, 0) => self.pad_last(dy, *start, in_shape[in_shape.len() - 1]),
            (Op::PadLast { start }, 0) => self.slice_last(dy, *start, in_shape[in_shape.len() - 1]),
            (Op::ConcatLast, _) => {
                let a_cols = *self.shape(input(0)).last().unwrap_or(&0);
                let start = if slot == 0 { 0 } else { a_cols };
                self.slice_last(dy, start, in_shape[in_shape.len() - 1])
            }
            (Op::Softmax { .. }, 0) => {
                let name = format!("d{}", n.name);
                Ok(self.push(Op::SoftmaxBackward, vec![node, dy], n.shape.clone(), DType::F32, name))
            }
            (Op::LayerNorm { .. }, _) => {
                let stats = self.companion(node).ok_or_else(|| Error::NoGradient { op: "layer_norm", input: n.name.clone() })?;
                let x = input(0);
                if slot == 0 {
                    let inputs = vec![dy, x, input(1), stats];
                    return Ok(self.push(Op::LayerNormBackward, inputs, n.shape.clone(), DType::F32, format!("d{}", self.node(x).name)));
                }
                // Weight and bias gradients come from one dispatch: reuse it
                // for the second.
                let inputs = vec![dy, x, stats];
                let cols = in_shape[0];
                let existing = self.nodes.iter().position(|m| m.op == Op::LayerNormParamsBackward && m.inputs == inputs);
                let both = match existing {
                    Some(i) => Tensor(i),
                    None => {
                        let shape = vec![1, super::builder::stats_offset(cols) + cols];
                        self.push(Op::LayerNormParamsBackward, inputs, shape, DType::F32, format!("d{}.params", n.name))
                    }
                };
                let start = if slot == 1 { 0 } else { super::builder::stats_offset(cols) };
                let g = self.slice_last(both, start, cols)?;
                self.reshape(g, &[cols])
            }
            (Op::Embedding, 0) => {
                let (table, ids) = (input(0), input(1));
                let vocab = self.shape(table)[0];
                let n_ids = self.node(ids).len();
                let existing = self.nodes.iter().position(|m| m.op == (Op::EmbeddingSort { vocab }) && m.inputs == [ids]);
                let sort = match existing {
                    Some(i) => Tensor(i),
                    None => {
                        let shape = vec![super::builder::stats_offset(n_ids) + vocab + 1];
                        self.push(Op::EmbeddingSort { vocab }, vec![ids], shape, DType::U32, format!("{}.sorted", self.node(ids).name))
                    }
                };
                let name = format!("d{}", self.node(table).name);
                Ok(self.push(Op::EmbeddingBackward, vec![dy, ids, sort], in_shape, DType::F32, name))
            }
            // The mean's gradient dy/N at every element: a constant of 1/N
            // times dy, broadcast (one dispatch).
            (Op::Mean, 0) => {
                let count = self.node(input(0)).len();
                let share = self.constant(&format!("{}.share", n.name), &in_shape, vec![1.0 / count as f32; count])?;
                self.mul(share, dy)
            }
            (Op::CrossEntropyRows, 0) => {
                let grad = self.companion(node).ok_or_else(|| Error::NoGradient { op: "cross_entropy_rows", input: n.name.clone() })?;
                let rows = n.shape[0];
                let per_row = self.reshape(dy, &[rows, 1])?;
                self.mul(grad, per_row)
            }
            _ => Err(Error::NoGradient { op: n.op.name(), input: self.node(n.inputs[slot]).name.clone() }),
        }
    }
}
