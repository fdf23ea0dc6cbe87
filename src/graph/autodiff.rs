//! Reverse-mode autodiff: `Graph::backward(loss)` appends gradient nodes,
//! each from the rule its op declares (`OpFamily::gradient` in `ops/`).

use std::collections::HashMap;

use super::builder::{DType, Graph, Tensor};
use super::ops::{ElementwiseOp, Op, SourceOp};
use crate::error::{Error, Result};

/// The gradient node of each parameter after `backward`.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// The tensor differentiated (a scalar loss, or a stage's output).
    pub loss: Tensor,
    by_param: HashMap<Tensor, Tensor>,
    by_input: HashMap<Tensor, Tensor>,
    /// Every accumulation node this backward pass added, in order.
    accumulations: Vec<Tensor>,
    /// The first node this backward pass added: nodes from here on are
    /// the backward's, those before it the forward's.
    start: usize,
    /// d loss / d output that seeded the pass (a loss's is the constant 1,
    /// which loss scaling overwrites with the scale inside each step).
    seed: Tensor,
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

    /// The gradient the pass started from (`dloss`, or a stage's seed).
    pub fn seed(&self) -> Tensor {
        self.seed
    }

    /// The first node index the backward pass added (the forward's nodes
    /// come before it).
    pub fn backward_start(&self) -> Tensor {
        Tensor(self.start)
    }

    /// The same gradients in a graph rebuilt with `map[old index]` as
    /// each node's new index (a precision or recomputation pass).
    pub(super) fn remapped(&self, map: &[usize]) -> Gradients {
        let at = |t: Tensor| Tensor(map[t.0]);
        Gradients {
            loss: at(self.loss),
            by_param: self.by_param.iter().map(|(&p, &g)| (at(p), at(g))).collect(),
            by_input: self.by_input.iter().map(|(&i, &g)| (at(i), at(g))).collect(),
            accumulations: self.accumulations.iter().map(|&t| at(t)).collect(),
            seed: at(self.seed),
            start: map
                .get(self.start)
                .copied()
                .unwrap_or_else(|| map.last().map_or(0, |&l| l + 1)),
        }
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
            return Err(Error::InvalidArgument {
                op: "backward",
                reason: format!("tensor #{} is not in this graph", loss.0),
            });
        }
        if self.shape(loss) != [1] || self.node(loss).dtype != DType::F32 {
            return Err(Error::shape(
                "backward",
                "the loss must be an f32 scalar of shape [1]",
                &[self.shape(loss)],
            ));
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
                return Err(Error::InvalidArgument {
                    op: "backward",
                    reason: format!("tensor #{} is not in this graph", t.0),
                });
            }
        }
        if self.shape(seed) != self.shape(output) {
            return Err(Error::shape(
                "backward",
                "the seed gradient must have the output's shape",
                &[self.shape(output), self.shape(seed)],
            ));
        }
        if let Some(&bad) = inputs
            .iter()
            .find(|t| self.node(**t).op != SourceOp::Input || self.node(**t).dtype != DType::F32)
        {
            return Err(Error::InvalidArgument {
                op: "backward",
                reason: format!("`{}` is not an f32 input", self.node(bad).name),
            });
        }
        let start = self.nodes.len();
        let count = output.0 + 1;
        let mut requires_grad = vec![false; count];
        for i in 0..count {
            requires_grad[i] = match self.nodes[i].op {
                Op::Source(SourceOp::Parameter { .. }) => !self.is_frozen(Tensor(i)),
                Op::Source(SourceOp::Input) => inputs.contains(&Tensor(i)),
                Op::Source(SourceOp::Constant { .. }) => false,
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
                Op::Source(SourceOp::Parameter { .. }) => continue,
                Op::Source(SourceOp::Input) => {
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
                let stored = self.nodes[input.0].dtype.is_stored_weight();
                if stored && matches!(self.nodes[input.0].op, Op::Source(SourceOp::Parameter { .. })) {
                    return Err(self.frozen_only(input));
                }
                let contribution = self.input_gradient(Tensor(i), slot, dy)?;
                if matches!(self.nodes[input.0].op, Op::Source(SourceOp::Parameter { .. })) {
                    let shape = self.shape(input).to_vec();
                    let name = format!("{}.grad", self.nodes[input.0].name);
                    let g = self.push(
                        ElementwiseOp::AccumulateGrad { param: input },
                        vec![contribution],
                        shape,
                        DType::F32,
                        name,
                    );
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
        Ok(Gradients {
            loss: output,
            by_param,
            by_input,
            accumulations,
            start,
            seed,
        })
    }

    /// The error of a gradient asked for an f16 or quantized parameter:
    /// such a weight is a frozen base's (adapters train beside it).
    fn frozen_only(&self, param: Tensor) -> Error {
        let node = self.node(param);
        Error::InvalidArgument {
            op: "backward",
            reason: format!(
                "`{}` holds {}, which cannot be trained (no gradient, no update): freeze it (Graph::freeze) \
                 and train adapters over it (nn::Lora), or store it in f32",
                node.name,
                node.dtype.describe()
            ),
        }
    }

    /// d loss / d (input `slot` of `node`), given dy = d loss / d node:
    /// the rule its op's family declares.
    fn input_gradient(&mut self, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let op = self.node(node).op.clone();
        op.family().gradient(self, node, slot, dy)
    }
}
