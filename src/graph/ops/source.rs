//! The tensors a graph starts from: inputs fed per run, parameters,
//! constants and caches. The executor gives each its buffer (no kernel);
//! the reference takes their values from the feeds or the graph.

use super::{DispatchContext, Op, OpFamily, ReferenceContext};
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::Dispatch;
use crate::ops::{pack_quantized, unpack_quantized, QuantFormat};

/// The graph's leaves: tensors fed, trained, fixed or kept.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceOp {
    /// Data fed before each step (a batch, its targets).
    Input,
    /// A trainable tensor with its initial contents.
    Parameter { init: ParameterInit },
    /// A fixed tensor uploaded once (the seed gradient 1.0 of a loss).
    Constant { values: Vec<f32> },
    /// A tensor that keeps its values from run to run (a KV cache): zero
    /// when the executor is built and after `Executor::clear_caches`, and
    /// written only by the ops that update it in place
    /// ([`SourceOp::CachedAttention`]). Not trainable.
    Cache,
}

/// A parameter's initial contents, as its dtype stores them.
#[derive(Clone, Debug, PartialEq)]
pub enum ParameterInit {
    /// Values, stored as f32 or rounded to f16 ([`DType::F32`],
    /// [`DType::F16`]).
    Values(Vec<f32>),
    /// A block-quantized matrix's words in the kernels' layout
    /// ([`DType::Quant`], [`pack_quantized`]).
    Packed(Vec<u32>),
    /// No contents: a parameter of a graph built to plan its memory (a
    /// model sized without values, `wgrad train --dry-run`); the plan lays
    /// it out by its dtype and shape, and no executor or reference runs it.
    Planned,
}

impl OpFamily for SourceOp {
    fn name(&self) -> &'static str {
        match self {
            SourceOp::Parameter { .. } => "parameter",
            SourceOp::Constant { .. } => "constant",
            SourceOp::Cache => "cache",
            SourceOp::Input => "input",
        }
    }

    fn has_kernel(&self) -> bool {
        false
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        Err(cx.no_kernel())
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match self {
            SourceOp::Input | SourceOp::Cache => cx.fed(),
            // An f16 parameter is read as the f16 nearest its initial value.
            SourceOp::Parameter {
                init: ParameterInit::Values(init),
            } if cx.node().dtype == DType::F16 => Ok(init
                .iter()
                .map(|&v| f64::from(half::f16::from_f32(v).to_f32()))
                .collect()),
            SourceOp::Parameter {
                init: ParameterInit::Values(init),
            } => Ok(init.iter().map(|&v| f64::from(v)).collect()),
            // A quantized one as its blocks decode (the kernels' twin).
            SourceOp::Parameter {
                init: ParameterInit::Packed(words),
            } => {
                let (DType::Quant(format), &[rows, cols]) = (cx.node().dtype, cx.shape()) else {
                    return Err(Error::Internal {
                        op: "parameter",
                        reason: format!("`{}` holds packed words but is not a quantized matrix", cx.node().name),
                    });
                };
                let raw = unpack_quantized(format, words, rows, cols)?;
                Ok(crate::cpu::dequantize(format, &raw)?
                    .into_iter()
                    .map(f64::from)
                    .collect())
            }
            SourceOp::Parameter {
                init: ParameterInit::Planned,
            } => Err(Error::InvalidArgument {
                op: "evaluate_f64",
                reason: format!("`{}` has no contents (a graph for planning only)", cx.node().name),
            }),
            SourceOp::Constant { values } => Ok(values.iter().map(|&v| f64::from(v)).collect()),
        }
    }
}

impl Graph {
    /// A tensor fed before each run (f32 features or targets).
    pub fn input(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("input", shape)?;
        Ok(self.push(SourceOp::Input, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    /// A tensor of u32 class labels fed before each run.
    pub fn labels(&mut self, name: &str, len: usize) -> Result<Tensor> {
        self.ids(name, &[len])
    }

    /// A u32 input of any shape fed before each run: token ids for an
    /// embedding, or class labels.
    pub fn ids(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("ids", shape)?;
        Ok(self.push(SourceOp::Input, vec![], shape.to_vec(), DType::U32, name.to_string()))
    }

    /// A trainable tensor; `name` is its state_dict key (e.g. `0.weight`).
    pub fn parameter(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Result<Tensor> {
        Self::non_empty("parameter", shape)?;
        if init.len() != shape.iter().product::<usize>() {
            return Err(Error::shape(
                "parameter",
                format!("`{name}` got {} initial values", init.len()),
                &[shape],
            ));
        }
        self.push_parameter(name, shape, ParameterInit::Values(init), DType::F32)
    }

    fn push_parameter(&mut self, name: &str, shape: &[usize], init: ParameterInit, dtype: DType) -> Result<Tensor> {
        if self
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Source(SourceOp::Parameter { .. })) && n.name == name)
        {
            return Err(Error::InvalidArgument {
                op: "parameter",
                reason: format!("a parameter named `{name}` already exists"),
            });
        }
        Ok(self.push(
            SourceOp::Parameter { init },
            vec![],
            shape.to_vec(),
            dtype,
            name.to_string(),
        ))
    }

    /// A [rows, cols] matrix stored block-quantized ([`DType::Quant`]):
    /// `raw` is its bytes as a GGUF file stores them (blocks of 32 values
    /// in row order, cols a multiple of 32), re-packed here into the
    /// kernels' layout ([`pack_quantized`]) and uploaded as it is, so the
    /// arena holds about 1.06 (Q8_0) or 0.56-0.63 (Q4) bytes per value.
    /// For inference only: it may be the B of an ABt matmul (a Linear
    /// weight [out, in], a tied head) or an embedding's table.
    pub fn parameter_quantized(
        &mut self,
        name: &str,
        shape: &[usize],
        format: QuantFormat,
        raw: &[u8],
    ) -> Result<Tensor> {
        Self::non_empty("parameter_quantized", shape)?;
        let &[rows, cols] = shape else {
            return Err(Error::shape(
                "parameter_quantized",
                format!("`{name}`: a quantized parameter is a matrix [rows, cols]"),
                &[shape],
            ));
        };
        let words = pack_quantized(format, raw, rows, cols)?;
        self.push_parameter(name, shape, ParameterInit::Packed(words), DType::Quant(format))
    }

    /// A parameter of `dtype` with no contents ([`ParameterInit::Planned`]):
    /// a graph built only to plan its memory, from a model sized without
    /// values. An executor refuses it.
    pub fn parameter_planned(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::non_empty("parameter_planned", shape)?;
        if let DType::Quant(format) = dtype {
            let &[rows, cols] = shape else {
                return Err(Error::shape(
                    "parameter_planned",
                    format!("`{name}`: a quantized parameter is a matrix [rows, cols]"),
                    &[shape],
                ));
            };
            format.check_shape("parameter_planned", rows, cols)?;
        }
        self.push_parameter(name, shape, ParameterInit::Planned, dtype)
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
    /// [`SourceOp::Cache`]): the keys or values of a KV cache.
    pub fn cache(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Self::non_empty("cache", shape)?;
        Ok(self.push(SourceOp::Cache, vec![], shape.to_vec(), DType::F32, name.to_string()))
    }

    pub fn constant(&mut self, name: &str, shape: &[usize], values: Vec<f32>) -> Result<Tensor> {
        Self::non_empty("constant", shape)?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::shape(
                "constant",
                format!("`{name}` got {} values", values.len()),
                &[shape],
            ));
        }
        Ok(self.push(
            SourceOp::Constant { values },
            vec![],
            shape.to_vec(),
            DType::F32,
            name.to_string(),
        ))
    }
}
