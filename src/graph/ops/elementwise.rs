//! Elementwise ops: binary ops with broadcasting, scale, bias add, the
//! activations and their backward, the unary functions, and the
//! accumulation of a gradient contribution into a parameter's gradient,
//! and the f32 <-> f16 storage casts of mixed precision
//! (`graph/precision.rs` decides where they go).

use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor, MAX_RANK};
use crate::kernels::{Activation, Binary, Dispatch, F16View, Unary};
use crate::ops::broadcast_shape;

/// One output element per input element (broadcasting where said).
#[derive(Clone, Debug, PartialEq)]
pub enum ElementwiseOp {
    Binary(Binary),
    Scale(f32),
    /// x[rows, cols] + bias[cols]
    BiasAdd,
    Activation(Activation),
    /// inputs (x, dy): f'(x)·dy
    ActivationBackward(Activation),
    Unary(Unary),
    /// inputs (x): adds x into the gradient of a parameter; the result is
    /// that gradient. Emitted by autodiff only.
    AccumulateGrad {
        param: Tensor,
    },
    /// f32 -> [`DType::F16`] storage (rounded to nearest, two values per
    /// word): an activation the backward pass keeps, at half the bytes.
    StoreF16,
    /// [`DType::F16`] storage -> f32 (exact), where the backward reads it.
    LoadF16,
}

impl OpFamily for ElementwiseOp {
    fn name(&self) -> &'static str {
        match self {
            ElementwiseOp::Binary(Binary::Add) => "add",
            ElementwiseOp::Binary(Binary::Sub) => "sub",
            ElementwiseOp::Binary(Binary::Mul) => "mul",
            ElementwiseOp::Binary(Binary::Div) => "div",
            ElementwiseOp::Scale(_) => "scale",
            ElementwiseOp::BiasAdd => "bias_add",
            ElementwiseOp::Activation(_) => "activation",
            ElementwiseOp::ActivationBackward(_) => "activation_backward",
            ElementwiseOp::Unary(Unary::Exp) => "exp",
            ElementwiseOp::Unary(Unary::Rsqrt) => "rsqrt",
            ElementwiseOp::AccumulateGrad { .. } => "accumulate_grad",
            ElementwiseOp::StoreF16 => "store_f16",
            ElementwiseOp::LoadF16 => "load_f16",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        let (out, x) = (cx.out()?, cx.input(0)?);
        match self {
            ElementwiseOp::Binary(op) if cx.input_shape(0) == cx.input_shape(1) => k.binary(*op, out, x, cx.input(1)?),
            ElementwiseOp::Binary(op) => {
                k.binary_broadcast(*op, out, x, cx.input(1)?, cx.input_shape(0), cx.input_shape(1))
            }
            ElementwiseOp::Scale(alpha) => k.scale(out, x, *alpha),
            ElementwiseOp::BiasAdd => {
                let (rows, cols) = flat_rows_cols(cx.shape());
                k.bias_add(out, x, cx.input(1)?, rows, cols)
            }
            ElementwiseOp::Activation(act) => k.activation_forward(*act, out, x),
            ElementwiseOp::ActivationBackward(act) => k.activation_backward(*act, out, x, cx.input(1)?),
            ElementwiseOp::Unary(op) => k.unary(*op, out, x),
            ElementwiseOp::AccumulateGrad { .. } => k.add_assign(out, x),
            ElementwiseOp::StoreF16 => k.to_f16(F16View::new(out, cx.input_node(0).len())?, x),
            ElementwiseOp::LoadF16 => k.from_f16(out, F16View::new(x, out.len)?),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let n = g.node(node).clone();
        let input = |k: usize| n.inputs[k];
        let in_shape = g.shape(input(slot)).to_vec();
        match (self, slot) {
            // Broadcast operands get the sum of dy over the dimensions they
            // were repeated along.
            (ElementwiseOp::Binary(Binary::Add), _) => g.sum_to(dy, &in_shape),
            (ElementwiseOp::Binary(Binary::Sub), 0) => g.sum_to(dy, &in_shape),
            (ElementwiseOp::Binary(Binary::Sub), _) => {
                let d = g.sum_to(dy, &in_shape)?;
                g.scale(d, -1.0)
            }
            (ElementwiseOp::Binary(Binary::Mul), _) => {
                let d = g.mul(dy, input(1 - slot))?;
                g.sum_to(d, &in_shape)
            }
            (ElementwiseOp::Binary(Binary::Div), 0) => {
                let d = g.div(dy, input(1))?;
                g.sum_to(d, &in_shape)
            }
            // d(a/b)/db = -(a/b)/b
            (ElementwiseOp::Binary(Binary::Div), _) => {
                let d = g.mul(dy, node)?;
                let d = g.div(d, input(1))?;
                let d = g.sum_to(d, &in_shape)?;
                g.scale(d, -1.0)
            }
            (ElementwiseOp::Unary(Unary::Exp), 0) => g.mul(dy, node),
            // d x^(-1/2) = -1/2 · y³
            (ElementwiseOp::Unary(Unary::Rsqrt), 0) => {
                let y2 = g.mul(node, node)?;
                let y3 = g.mul(y2, node)?;
                let d = g.mul(dy, y3)?;
                g.scale(d, -0.5)
            }
            (ElementwiseOp::Scale(alpha), 0) => g.scale(dy, *alpha),
            (ElementwiseOp::BiasAdd, 0) => Ok(dy),
            (ElementwiseOp::BiasAdd, 1) => g.sum_rows(dy),
            (ElementwiseOp::Activation(act), 0) => Ok(g.push(
                ElementwiseOp::ActivationBackward(*act),
                vec![input(0), dy],
                n.shape.clone(),
                DType::F32,
                format!("d{}", n.name),
            )),
            _ => Err(super::no_gradient(g, node, slot)),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let x = cx.input(0)?;
        match self {
            ElementwiseOp::Binary(op) => {
                cpu::binary_broadcast(*op, x, cx.input(1)?, cx.input_shape(0), cx.input_shape(1))
            }
            ElementwiseOp::Scale(alpha) => Ok(cpu::scale(x, *alpha)),
            ElementwiseOp::BiasAdd => Ok(cpu::bias_add(x, cx.input(1)?, flat_rows_cols(cx.shape()).1)),
            ElementwiseOp::Activation(act) => Ok(cpu::activation_forward(*act, x)),
            ElementwiseOp::ActivationBackward(act) => Ok(cpu::activation_backward(*act, x, cx.input(1)?)),
            ElementwiseOp::Unary(op) => Ok(cpu::unary(*op, x)),
            // The f16 values the words hold, as f64.
            ElementwiseOp::StoreF16 => {
                let narrowed: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                Ok(cpu::from_f16(&cpu::to_f16(&narrowed))
                    .into_iter()
                    .map(f64::from)
                    .collect())
            }
            ElementwiseOp::LoadF16 => Ok(x.to_vec()),
            // The parameter's gradient so far (zeroed before the step): the
            // previous accumulation into it, plus this contribution.
            ElementwiseOp::AccumulateGrad { param } => {
                let nodes = cx.graph().nodes();
                let earlier = (0..cx.node.0)
                    .rev()
                    .find(|&j| nodes[j].op == ElementwiseOp::AccumulateGrad { param: *param });
                match earlier {
                    Some(j) => Ok(cx.value(Tensor(j))?.iter().zip(x).map(|(a, b)| a + b).collect()),
                    None => Ok(x.to_vec()),
                }
            }
        }
    }
}

impl Graph {
    /// An elementwise op with NumPy broadcasting over trailing dimensions
    /// (a `[C]` bias over `[B, T, C]`, a `[T, T]` mask over `[B, H, T, T]`).
    fn broadcast_binary(&mut self, op: Binary, a: Tensor, b: Tensor) -> Result<Tensor> {
        let name = ElementwiseOp::Binary(op).name();
        self.f32_inputs(name, &[a, b])?;
        let shape = broadcast_shape(self.shape(a), self.shape(b)).ok_or_else(|| {
            Error::shape(
                name,
                "shapes do not broadcast (trailing dimensions must be equal or 1)",
                &[self.shape(a), self.shape(b)],
            )
        })?;
        if shape.len() > MAX_RANK {
            return Err(Error::shape(
                name,
                format!("tensors have at most {MAX_RANK} dimensions"),
                &[self.shape(a), self.shape(b)],
            ));
        }
        Ok(self.push(
            ElementwiseOp::Binary(op),
            vec![a, b],
            shape,
            DType::F32,
            format!("{name}{}", self.nodes.len()),
        ))
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
        Ok(self.push(
            ElementwiseOp::Scale(alpha),
            vec![x],
            shape,
            DType::F32,
            format!("scale{}", self.nodes.len()),
        ))
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
        Ok(self.push(
            ElementwiseOp::BiasAdd,
            vec![x, bias],
            sx,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }

    pub fn activation(&mut self, act: Activation, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("activation", &[x])?;
        let shape = self.shape(x).to_vec();
        let name = format!("{act:?}{}", self.nodes.len()).to_lowercase();
        Ok(self.push(ElementwiseOp::Activation(act), vec![x], shape, DType::F32, name))
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

    fn unary(&mut self, op: Unary, x: Tensor) -> Result<Tensor> {
        let name = ElementwiseOp::Unary(op).name();
        self.f32_inputs(name, &[x])?;
        let shape = self.shape(x).to_vec();
        Ok(self.push(
            ElementwiseOp::Unary(op),
            vec![x],
            shape,
            DType::F32,
            format!("{name}{}", self.nodes.len()),
        ))
    }

    pub fn exp(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Unary::Exp, x)
    }

    /// `x` stored in f16 ([`DType::F16`], two values per 4-byte word), as
    /// mixed precision keeps an activation for the backward pass; only
    /// [`Graph::load_f16`] reads it. No gradient: the precision pass
    /// inserts it after `backward`.
    pub fn store_f16(&mut self, x: Tensor) -> Result<Tensor> {
        self.f32_inputs("store_f16", &[x])?;
        let shape = self.shape(x).to_vec();
        let name = format!("{}.f16", self.node(x).name);
        Ok(self.push(ElementwiseOp::StoreF16, vec![x], shape, DType::F16, name))
    }

    /// The f32 values of `h`, a [`Graph::store_f16`] output.
    pub fn load_f16(&mut self, h: Tensor) -> Result<Tensor> {
        self.check_handle("load_f16", h)?;
        if self.node(h).op != ElementwiseOp::StoreF16 {
            return Err(Error::InvalidArgument {
                op: "load_f16",
                reason: format!("`{}` is not an f16 copy made by store_f16", self.node(h).name),
            });
        }
        let shape = self.shape(h).to_vec();
        let name = format!("{}.f32", self.node(h).name);
        Ok(self.push(ElementwiseOp::LoadF16, vec![h], shape, DType::F32, name))
    }

    /// 1 / sqrt(x) (inf at 0, NaN below, as IEEE).
    pub fn rsqrt(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Unary::Rsqrt, x)
    }
}
