//! Elementwise ops: binary ops with broadcasting, scale, bias add, the
//! activations and their backward, the unary functions, and the
//! accumulation of a gradient contribution into a parameter's gradient,
//! and the f32 <-> f16 storage casts of mixed precision
//! (`graph/precision.rs` decides where they go).

use super::SourceOp;
use super::{rows_cols as flat_rows_cols, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor, MAX_RANK};
use crate::kernels::{Activation, Binary, Dispatch, DropoutMask, F16View, Unary, DROPOUT_CONTROL_WORDS};
use crate::ops::broadcast_shape;

/// The name of a graph's dropout control input ([`Graph::dropout_control`]).
pub const DROPOUT_CONTROL: &str = "dropout.control";

/// Rows of a tensor of `shape` (viewed as [rows, last dimension]) to each
/// of its first dimension's entries, its examples: 1 for a vector.
fn rows_per_example(shape: &[usize]) -> usize {
    match shape {
        [examples, _, ..] => (flat_rows_cols(shape).0 / (*examples).max(1)).max(1),
        _ => 1,
    }
}

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
    /// inputs (x, control): inverted dropout of x, its mask drawn from the
    /// control's words ([`Graph::dropout`]); its gradient is the same op
    /// over dy.
    Dropout(DropoutMask),
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
            ElementwiseOp::Dropout(_) => "dropout",
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
            ElementwiseOp::Dropout(mask) => {
                let shape = cx.shape();
                k.dropout(
                    *mask,
                    out,
                    x,
                    cx.input(1)?,
                    flat_rows_cols(shape).1,
                    rows_per_example(shape),
                )
            }
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
            // The same mask (the same control words) over dy.
            (ElementwiseOp::Dropout(mask), 0) => Ok(g.push(
                ElementwiseOp::Dropout(*mask),
                vec![dy, input(1)],
                n.shape.clone(),
                DType::F32,
                format!("d{}", n.name),
            )),
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
            ElementwiseOp::Dropout(mask) => {
                let control: Vec<u32> = cx.input(1)?.iter().map(|&w| w as u32).collect();
                let shape = cx.shape();
                Ok(cpu::dropout(
                    mask,
                    x,
                    &control,
                    flat_rows_cols(shape).1,
                    rows_per_example(shape),
                ))
            }
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

    /// The graph's one dropout control (made at the first call): an input
    /// of [`DROPOUT_CONTROL_WORDS`] u32 words the executor writes before
    /// every run — the key of the step's masks (its optimizer's step
    /// count, or what `Executor::set_dropout_step` fixes), whether dropout
    /// applies (in training steps; in other runs only in training mode,
    /// `Executor::set_training`), and the number of the batch's first
    /// example (`Executor::set_dropout_first_example`).
    pub fn dropout_control(&mut self) -> Result<Tensor> {
        let found = self
            .nodes
            .iter()
            .position(|n| n.op == SourceOp::Input && n.name == DROPOUT_CONTROL && n.dtype == DType::U32);
        match found {
            Some(i) => Ok(Tensor(i)),
            None => self.ids(DROPOUT_CONTROL, &[DROPOUT_CONTROL_WORDS]),
        }
    }

    /// x with inverted dropout (torch.nn.Dropout): each element zeroed
    /// with probability `mask.p`, the others scaled by 1/(1 − p), the mask
    /// drawn from the graph's control words ([`Graph::dropout_control`],
    /// [`DropoutMask`]); x itself where dropout is off and when p is 0.
    /// Its first dimension counts examples.
    pub fn dropout(&mut self, x: Tensor, mask: DropoutMask) -> Result<Tensor> {
        const OP: &str = "dropout";
        self.f32_inputs(OP, &[x])?;
        let shape = self.shape(x).to_vec();
        mask.check(OP, flat_rows_cols(&shape).1)?;
        if mask.p == 0.0 {
            return Ok(x);
        }
        let control = self.dropout_control()?;
        Ok(self.push(
            ElementwiseOp::Dropout(mask),
            vec![x, control],
            shape,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
