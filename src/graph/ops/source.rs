//! The tensors a graph starts from: inputs fed per run, parameters,
//! constants and caches. The executor gives each its buffer (no kernel);
//! the reference takes their values from the feeds or the graph.

use super::{not_mine, DispatchContext, Op, OpFamily, ReferenceContext};
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::Dispatch;

pub(super) struct Sources;

impl OpFamily for Sources {
    fn name(&self, op: &Op) -> &'static str {
        match op {
            Op::Parameter { .. } => "parameter",
            Op::Constant { .. } => "constant",
            Op::Cache => "cache",
            _ => "input",
        }
    }

    fn has_kernel(&self, _op: &Op) -> bool {
        false
    }

    fn dispatch(&self, op: &Op, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        Err(Error::InvalidArgument { op: "Executor", reason: format!("`{}` ({}) has no kernel", cx.graph().node(Tensor(cx.node)).name, self.name(op)) })
    }

    fn reference(&self, op: &Op, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match op {
            Op::Input | Op::Cache => cx.fed(),
            // An f16 parameter is read as the f16 nearest its initial value.
            Op::Parameter { init } if cx.node().dtype == DType::F16 => Ok(init.iter().map(|&v| f64::from(half::f16::from_f32(v).to_f32())).collect()),
            Op::Parameter { init } => Ok(init.iter().map(|&v| f64::from(v)).collect()),
            Op::Constant { values } => Ok(values.iter().map(|&v| f64::from(v)).collect()),
            _ => Err(not_mine("source", op)),
        }
    }
}

impl Graph {
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
}
