//! Matrix products: 2-D (`MatMul`, which the plan fuses with a bias add,
//! an activation or its backward, and gradient accumulation) and batched
//! over leading dimensions (`BatchMatMul`).

use super::{DispatchContext, ElementwiseOp, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor, MAX_RANK};
use crate::graph::plan::Storage;
use crate::kernels::{Activation, Dispatch, F16View, MatmulEpilogue, MatmulForm, QuantView};

/// Matrix products.
#[derive(Clone, Debug, PartialEq)]
pub enum MatmulOp {
    MatMul(MatmulForm),
    /// A matmul per leading index of rank-3/4 operands with equal leading
    /// dimensions.
    BatchMatMul(MatmulForm),
}

/// The stored inner dimension of `form`'s A operand of shape `a` (rank ≥ 2).
fn inner(form: MatmulForm, a: &[usize]) -> usize {
    let rank = a.len();
    match form {
        MatmulForm::AtB => a[rank - 2],
        _ => a[rank - 1],
    }
}

/// The activation of an activation (or activation-backward) node the plan
/// fused into a matmul.
fn activation_of(cx: &DispatchContext<'_>, i: usize) -> Result<Activation> {
    match cx.graph().node(Tensor(i)).op {
        Op::Elementwise(ElementwiseOp::Activation(act) | ElementwiseOp::ActivationBackward(act)) => Ok(act),
        _ => Err(Error::InvalidArgument { op: "Executor", reason: format!("`{}` is not an activation", cx.graph().node(Tensor(i)).name) }),
    }
}

impl OpFamily for MatmulOp {
    fn name(&self) -> &'static str {
        match self {
            MatmulOp::BatchMatMul(_) => "batch_matmul",
            MatmulOp::MatMul(_) => "matmul",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let (k, i, shape) = (cx.kernels(), cx.node, cx.shape());
        match self {
            MatmulOp::MatMul(form) => {
                let (m, n, kk) = (shape[0], shape[1], inner(*form, cx.input_shape(0)));
                let plan = cx.plan();
                let bias = plan.bias_into[i].map(|b| cx.view(plan.reads[b][1])).transpose()?;
                // The pre-activation is stored only where the plan kept it.
                let activation = match plan.activation_into[i] {
                    Some(y) => {
                        let pre = plan.bias_into[i].filter(|&z| plan.storage[z] != Storage::Unused);
                        Some((activation_of(cx, y)?, pre.map(|z| cx.view(Tensor(z))).transpose()?))
                    }
                    None => None,
                };
                let activation_grad = match plan.activation_grad_into[i] {
                    Some(dx) => Some((activation_of(cx, dx)?, cx.view(plan.reads[dx][0])?)),
                    None => None,
                };
                let epilogue = MatmulEpilogue { accumulate: plan.accumulate[i], bias, activation, activation_grad };
                // Weights stored in f16 or quantized (the builder allows them
                // as an ABt's B).
                match cx.input_node(1).dtype {
                    DType::F16 => return k.matmul_f16_weights(epilogue, cx.out()?, cx.input(0)?, F16View::new(cx.input(1)?, n * kk)?, m, n, kk),
                    DType::Quant(format) => return k.matmul_quant_weights(epilogue, cx.out()?, cx.input(0)?, QuantView::new(cx.input(1)?, format, n, kk)?, m, n, kk),
                    DType::F32 | DType::U32 => {}
                }
                k.matmul_epilogue(*form, epilogue, cx.out()?, cx.input(0)?, cx.input(1)?, m, n, kk)
            }
            MatmulOp::BatchMatMul(form) => {
                let rank = shape.len();
                let batch = shape[..rank - 2].iter().product();
                let (m, n, kk) = (shape[rank - 2], shape[rank - 1], inner(*form, cx.input_shape(0)));
                k.matmul_batched(*form, cx.accumulate(), cx.out()?, cx.input(0)?, cx.input(1)?, batch, m, n, kk)
            }
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let (MatmulOp::MatMul(form) | MatmulOp::BatchMatMul(form)) = self;
        let (a, b) = (g.node(node).inputs[0], g.node(node).inputs[1]);
        match (form, slot) {
            (MatmulForm::AB, 0) => g.matmul_form(MatmulForm::ABt, dy, b),
            (MatmulForm::AB, _) => g.matmul_form(MatmulForm::AtB, a, dy),
            (MatmulForm::AtB, 0) => g.matmul_form(MatmulForm::ABt, b, dy),
            (MatmulForm::AtB, _) => g.matmul_form(MatmulForm::AB, a, dy),
            (MatmulForm::ABt, 0) => g.matmul_form(MatmulForm::AB, dy, b),
            (MatmulForm::ABt, _) => g.matmul_form(MatmulForm::AtB, dy, a),
        }
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        let (MatmulOp::MatMul(form) | MatmulOp::BatchMatMul(form)) = self;
        let shape = cx.shape();
        let rank = shape.len();
        let batch = shape[..rank - 2].iter().product();
        let (m, n, kk) = (shape[rank - 2], shape[rank - 1], inner(*form, cx.input_shape(0)));
        Ok(cpu::matmul_batched(*form, cx.input(0)?, cx.input(1)?, batch, m, n, kk))
    }
}

impl Graph {
    /// Whether `b` is an f16 or quantized parameter read as the weight of
    /// an ABt product, the one matmul such weights take (generation's
    /// Linear layers and tied head, stored [out, in]).
    fn stored_weight(&self, form: MatmulForm, b: Tensor) -> bool {
        form == MatmulForm::ABt && self.get(b).is_some_and(|n| n.dtype.is_stored_weight())
    }

    /// op(a)·op(b) for a `MatmulForm` (stored shapes as the form says):
    /// 2-D operands, or rank-3/4 operands with equal leading dimensions (a
    /// product per leading index).
    pub fn matmul_form(&mut self, form: MatmulForm, a: Tensor, b: Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        let stored_weight = self.stored_weight(form, b);
        let pair = [a, b];
        self.f32_inputs(OP, &pair[..if stored_weight { 1 } else { 2 }])?;
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        let all: [&[usize]; 2] = [&sa, &sb];
        if sa.len() != sb.len() || !(2..=MAX_RANK).contains(&sa.len()) {
            return Err(Error::shape(OP, "operands must both be 2-D, or both rank 3 or 4", &all));
        }
        if stored_weight && sa.len() != 2 {
            return Err(Error::shape(OP, "f16 and quantized weights take 2-D products only", &all));
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
        let op = if lead == 0 { MatmulOp::MatMul(form) } else { MatmulOp::BatchMatMul(form) };
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
        let stored_weight = self.stored_weight(form, w);
        let pair = [x, w];
        self.f32_inputs(OP, &pair[..if stored_weight { 1 } else { 2 }])?;
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
}
