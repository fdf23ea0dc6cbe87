//! Matrix products: 2-D (`MatMul`, which the plan fuses with a bias add,
//! an activation or its backward, and gradient accumulation) and batched
//! over leading dimensions (`BatchMatMul`).

use super::{no_gradient, DispatchContext, ElementwiseOp, Op, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{rows_cols, DType, Graph, Tensor, MAX_RANK};
use crate::graph::plan::Storage;
use crate::kernels::{
    Activation, Dispatch, F16View, MatmulEpilogue, MatmulForm, MatmulOperand, MatmulRequest, QuantView,
};

/// Matrix products.
#[derive(Clone, Debug, PartialEq)]
pub enum MatmulOp {
    MatMul(MatmulForm),
    /// A matmul per leading index of rank-3/4 operands with equal leading
    /// dimensions.
    BatchMatMul(MatmulForm),
    /// inputs (x [m, k], block-quantized weights W_i [n_i, k] of one
    /// format) -> x·[W₀; W₁; …]ᵀ [m, Σ n_i], or with `gated` (two weights
    /// of equal rows) silu(x·W₀ᵀ) ⊙ (x·W₁ᵀ) [m, n₀]: generation's q, k and
    /// v projections, and SwiGLU's gate and up, in one launch (see
    /// `MatmulOperand::QuantParts`). No gradient.
    QuantParts {
        gated: bool,
    },
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
        _ => Err(Error::Internal {
            op: "Executor",
            reason: format!("`{}` is not an activation", cx.graph().node(Tensor(i)).name),
        }),
    }
}

/// Input `j` as the kernels read it: activations a training step stores in
/// f16 (graph::precision) as they are stored.
fn operand<'a>(cx: &DispatchContext<'a>, j: usize) -> Result<MatmulOperand<'a>> {
    Ok(match cx.input_node(j).dtype {
        DType::F16 => F16View::new(cx.input(j)?, cx.input_node(j).len())?.into(),
        _ => cx.input(j)?.into(),
    })
}

impl OpFamily for MatmulOp {
    fn name(&self) -> &'static str {
        match self {
            MatmulOp::BatchMatMul(_) => "batch_matmul",
            MatmulOp::MatMul(_) => "matmul",
            MatmulOp::QuantParts { .. } => "matmul_quant_parts",
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
                let epilogue = MatmulEpilogue {
                    accumulate: plan.accumulate[i],
                    bias,
                    activation,
                    activation_grad,
                };
                // Weights stored in f16 or quantized (the builder allows them
                // as an ABt's B, or an AB's in a frozen weight's backward).
                let weight = matches!(cx.input_node(1).op, Op::Source(_));
                match cx.input_node(1).dtype {
                    // SHADER_F16's kernels where the adapter has it; else
                    // (and for AB) the f32 kernels widening f16 B on load.
                    DType::F16 if weight && *form == MatmulForm::ABt && k.supports_f16() => {
                        return k.matmul(
                            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
                            cx.out()?,
                            cx.input(0)?,
                            MatmulOperand::F16Weight(F16View::new(cx.input(1)?, n * kk)?),
                        )
                    }
                    DType::Quant(format) => {
                        // ABt: B [n, k]; AB (the transposed product): B [k, n].
                        let (rows, cols) = if *form == MatmulForm::AB { (kk, n) } else { (n, kk) };
                        return k.matmul(
                            &MatmulRequest::new(*form, m, n, kk).with_epilogue(epilogue),
                            cx.out()?,
                            cx.input(0)?,
                            QuantView::new(cx.input(1)?, format, rows, cols)?,
                        );
                    }
                    DType::F16 | DType::F32 | DType::U32 => {}
                }
                k.matmul(
                    &MatmulRequest::new(*form, m, n, kk).with_epilogue(epilogue),
                    cx.out()?,
                    operand(cx, 0)?,
                    operand(cx, 1)?,
                )
            }
            MatmulOp::BatchMatMul(form) => {
                let rank = shape.len();
                let batch = shape[..rank - 2].iter().product();
                let (m, n, kk) = (shape[rank - 2], shape[rank - 1], inner(*form, cx.input_shape(0)));
                k.matmul(
                    &MatmulRequest::new(*form, m, n, kk)
                        .with_batch(batch)
                        .accumulating(cx.accumulate()),
                    cx.out()?,
                    operand(cx, 0)?,
                    operand(cx, 1)?,
                )
            }
            MatmulOp::QuantParts { gated } => {
                let [m, kk] = cx.input_shape(0)[..] else {
                    return Err(Error::internal(
                        "matmul_quant_parts",
                        format!("x lost its rank: {:?}", cx.input_shape(0)),
                    ));
                };
                let count = cx.graph().node(Tensor(i)).inputs.len();
                let parts = (1..count)
                    .map(|j| match (cx.input_node(j).dtype, cx.input_shape(j)) {
                        (DType::Quant(format), &[rows, _]) => QuantView::new(cx.input(j)?, format, rows, kk),
                        _ => Err(Error::Internal {
                            op: "matmul_quant_parts",
                            reason: format!("`{}` is not a quantized matrix", cx.input_node(j).name),
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (request, gated) = (MatmulRequest::new(MatmulForm::ABt, m, shape[1], kk), *gated);
                k.matmul(
                    &request,
                    cx.out()?,
                    cx.input(0)?,
                    MatmulOperand::QuantParts { parts: &parts, gated },
                )
            }
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let (MatmulOp::MatMul(form) | MatmulOp::BatchMatMul(form)) = self else {
            return Err(no_gradient(g, node, slot));
        };
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
        let form = match self {
            MatmulOp::MatMul(form) | MatmulOp::BatchMatMul(form) => form,
            MatmulOp::QuantParts { gated } => return parts_reference(*gated, cx),
        };

        let shape = cx.shape();
        let rank = shape.len();
        let batch = shape[..rank - 2].iter().product();
        let (m, n, kk) = (shape[rank - 2], shape[rank - 1], inner(*form, cx.input_shape(0)));
        Ok(cpu::matmul_batched(*form, cx.input(0)?, cx.input(1)?, batch, m, n, kk))
    }
}

/// `MatmulOp::QuantParts`' f64 reference: each weight's product (on its
/// de-quantized values) side by side, or gated.
fn parts_reference(gated: bool, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
    let [m, kk] = cx.input_shape(0)[..] else {
        return Err(Error::internal(
            "matmul_quant_parts",
            format!("x lost its rank: {:?}", cx.input_shape(0)),
        ));
    };
    let products = (1..cx.node().inputs.len())
        .map(|j| {
            let n = cx.input_shape(j)[0];
            Ok((
                n,
                cpu::matmul_batched(MatmulForm::ABt, cx.input(0)?, cx.input(j)?, 1, m, n, kk),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(cpu::join_products(&products, m, gated))
}

impl Graph {
    /// Whether `b` is an f16 or quantized parameter read as the weight of
    /// an ABt product (generation's Linear layers and tied head, stored
    /// [out, in]) or of an AB one (a frozen weight's backward, dX = dY·W):
    /// the matmuls such weights take.
    fn stored_weight(&self, form: MatmulForm, b: Tensor) -> bool {
        matches!(form, MatmulForm::ABt | MatmulForm::AB) && self.get(b).is_some_and(|n| n.dtype.is_stored_weight())
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
            return Err(Error::shape(
                OP,
                "f16 and quantized weights take 2-D products only",
                &all,
            ));
        }
        let lead = sa.len() - 2;
        if sa[..lead] != sb[..lead] {
            return Err(Error::shape(
                OP,
                "batched operands must have equal leading dimensions",
                &all,
            ));
        }
        let (ar, ac, br, bc) = (sa[lead], sa[lead + 1], sb[lead], sb[lead + 1]);
        let (m, ka, kb, n) = match form {
            MatmulForm::AB => (ar, ac, br, bc),
            MatmulForm::AtB => (ac, ar, br, bc),
            MatmulForm::ABt => (ar, ac, bc, br),
        };
        if ka != kb {
            return Err(Error::shape(
                OP,
                format!("{form:?}: inner dimensions differ ({ka} vs {kb})"),
                &all,
            ));
        }
        let mut shape = sa[..lead].to_vec();
        shape.extend([m, n]);
        let op = if lead == 0 {
            MatmulOp::MatMul(form)
        } else {
            MatmulOp::BatchMatMul(form)
        };
        Ok(self.push(op, vec![a, b], shape, DType::F32, format!("{OP}{}", self.nodes.len())))
    }

    /// x [m, k] · [W₀; W₁; …]ᵀ -> [m, Σ n_i] for block-quantized weights
    /// W_i [n_i, k] of one format (at most 4): the products a layer takes
    /// of one input side by side (q, k and v) in one launch where the
    /// kernels can (see `MatmulOperand::QuantParts`); with `gated`, two
    /// weights of equal rows, silu(x·W₀ᵀ) ⊙ (x·W₁ᵀ) [m, n₀] (SwiGLU's
    /// hidden units). Generation only: no gradient.
    pub fn matmul_quant_parts(&mut self, x: Tensor, weights: &[Tensor], gated: bool) -> Result<Tensor> {
        const OP: &str = "matmul_quant_parts";
        self.f32_inputs(OP, &[x])?;
        let sx = self.shape(x).to_vec();
        let shapes: Vec<Vec<usize>> = weights
            .iter()
            .map(|&w| self.shape_of(w).map(<[usize]>::to_vec).unwrap_or_default())
            .collect();
        let mut all: Vec<&[usize]> = vec![&sx];
        all.extend(shapes.iter().map(Vec::as_slice));
        let [m, k] = sx[..] else {
            return Err(Error::shape(OP, "x must be [m, k]", &all));
        };
        let formats: Vec<Option<DType>> = weights.iter().map(|&w| self.get(w).map(|n| n.dtype)).collect();
        let first = formats.first().copied().flatten();
        let one_format = matches!(first, Some(DType::Quant(_))) && formats.iter().all(|&f| f == first);
        if weights.is_empty() || weights.len() > 4 || !one_format || shapes.iter().any(|s| s.len() != 2 || s[1] != k) {
            return Err(Error::shape(
                OP,
                format!("takes 1 to 4 block-quantized matrices of one format, each [rows, {k}]"),
                &all,
            ));
        }
        if gated && (weights.len() != 2 || shapes[0] != shapes[1]) {
            return Err(Error::shape(
                OP,
                "a gated product takes two matrices of equal shape",
                &all,
            ));
        }
        let n = if gated {
            shapes[0][0]
        } else {
            shapes.iter().map(|s| s[0]).sum()
        };
        let mut inputs = vec![x];
        inputs.extend_from_slice(weights);
        Ok(self.push(
            MatmulOp::QuantParts { gated },
            inputs,
            vec![m, n],
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
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
