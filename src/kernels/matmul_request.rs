//! One entry for every matrix product: [`Kernels::matmul`] takes a
//! [`MatmulRequest`] (form, shape, batch, epilogue, kernel) and the
//! operands, whose [`MatmulOperand`] variants say how each is stored, and
//! picks the kernel family and the kernel. The families stay where they
//! are (matmul.rs, matmul_ext.rs, f16_weights.rs, quant_weights.rs); this
//! file only routes a request to one of them.

use super::{
    Dispatch, F16View, F16WeightsKernel, Kernels, MatmulEpilogue, MatmulVariant, QuantView, QuantWeightsKernel,
};
use super::{Pick, Stored, View};
use crate::error::{Error, Result};
use crate::ops::MatmulForm;

/// How an operand of a product is stored, which decides the kernels that
/// can read it.
#[derive(Clone, Copy, Debug)]
pub enum MatmulOperand<'a> {
    F32(View<'a>),
    /// f16 values packed two a word (the activations a training step saves
    /// in f16, `graph::precision`), which the f32 kernels widen as they
    /// load them: no device feature, products and sums in f32.
    F16(F16View<'a>),
    /// An f16 weight B [n, k] of an inference product A·Bᵀ (a Linear
    /// layer's, `Graph::parameter_f16`), on f16_weights.wgsl's kernels,
    /// which need SHADER_F16 and take the forward epilogue only.
    F16Weight(F16View<'a>),
    /// A block-quantized weight B [n, k] of an inference product A·Bᵀ
    /// (quant_weights.wgsl; the forward epilogue only), or, with
    /// [`MatmulForm::AB`], the B [k, n] of a frozen weight's backward
    /// dX = dY·B (`matmul_quant_transposed`; accumulation the only
    /// epilogue).
    Quant(QuantView<'a>),
    /// Block-quantized weights B_i [n_i, k] of one format read by one A:
    /// C [m, Σ n_i] = A·[B₀; B₁; …]ᵀ (q, k and v side by side), or with
    /// `gated` two parts G and U of equal rows and C [m, n] = silu(A·Gᵀ) ⊙
    /// (A·Uᵀ) (SwiGLU's hidden units). No epilogue.
    QuantParts {
        parts: &'a [QuantView<'a>],
        gated: bool,
    },
}

impl<'a> From<View<'a>> for MatmulOperand<'a> {
    fn from(view: View<'a>) -> Self {
        MatmulOperand::F32(view)
    }
}

/// f16 values read by the f32 kernels ([`MatmulOperand::F16`]); an f16
/// weight for SHADER_F16's kernels is [`MatmulOperand::F16Weight`].
impl<'a> From<F16View<'a>> for MatmulOperand<'a> {
    fn from(view: F16View<'a>) -> Self {
        MatmulOperand::F16(view)
    }
}

impl<'a> From<QuantView<'a>> for MatmulOperand<'a> {
    fn from(view: QuantView<'a>) -> Self {
        MatmulOperand::Quant(view)
    }
}

impl<'a> MatmulOperand<'a> {
    /// An f32 or f16 operand as the f32 family binds it.
    fn stored(self) -> Option<Stored<'a>> {
        match self {
            MatmulOperand::F32(v) => Some(Stored::F32(v)),
            MatmulOperand::F16(v) => Some(Stored::F16(v)),
            _ => None,
        }
    }

    /// The operand's storage, for messages.
    fn describe(&self) -> &'static str {
        match self {
            MatmulOperand::F32(_) => "f32",
            MatmulOperand::F16(_) => "f16",
            MatmulOperand::F16Weight(_) => "an f16 weight",
            MatmulOperand::Quant(_) => "a quantized weight",
            MatmulOperand::QuantParts { .. } => "quantized parts",
        }
    }
}

/// Which kernel runs a product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulKernel {
    /// Picked by the operands and the shape, as wgrad's own products run:
    /// f32 and f16 operands on the matrix-vector kernel for an unbatched
    /// A·Bᵀ of 1 to [`super::MATVEC_MAX_ROWS`] rows where it runs
    /// ([`Kernels::matvec_runs`], both f32), else on
    /// [`Kernels::matmul_variant_for_shape`]'s variant (a batch by its
    /// total work); an f16 weight on [`Kernels::f16_weights_kernel_for`]'s
    /// kernel; a quantized one on [`Kernels::quant_weights_kernel_for`]'s.
    #[default]
    Auto,
    /// One of the f32 family's tiled kernels (f16 operands are widened on
    /// load: they run the register kernel for `RegisterVec4` and
    /// `Subgroup`, and the shared kernel's scalar loads for `Shared`).
    Tiled(MatmulVariant),
    /// The f32 matrix-vector kernel with `lanes` (a power of two from 8 to
    /// 64) per workgroup: an unbatched A·Bᵀ of f32 operands that
    /// [`Kernels::matvec_runs`] accepts.
    Matvec { lanes: u32 },
    /// matmul_f16.wgsl: both operands [`MatmulOperand::F16`], read as f16
    /// with SHADER_F16 ([`Error::Unsupported`] without it), multiplied and
    /// summed in f32; unbatched, no epilogue.
    NativeF16,
    /// One of f16_weights.wgsl's kernels, for a [`MatmulOperand::F16Weight`].
    F16Weights(F16WeightsKernel),
    /// One of quant_weights.wgsl's kernels, for a [`MatmulOperand::Quant`].
    Quant(QuantWeightsKernel),
}

/// A product C[m, n] = epilogue(op(A)·op(B)), `form` saying which operand
/// is stored transposed, for [`Kernels::matmul`].
#[derive(Clone, Copy, Debug)]
pub struct MatmulRequest<'a> {
    pub form: MatmulForm,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `Some(b)`: b products, each operand b contiguous matrices (batch
    /// strides m·k, k·n, m·n), on one dispatch whose grid's z is the batch
    /// (at most the adapter's `max_compute_workgroups_per_dimension`); only
    /// the f32 family's tiled kernels, and accumulation the only epilogue.
    /// `None`: one product.
    pub batch: Option<usize>,
    pub epilogue: MatmulEpilogue<'a>,
    pub kernel: MatmulKernel,
}

impl<'a> MatmulRequest<'a> {
    /// One m×n×k product, no epilogue, the kernel picked by
    /// [`MatmulKernel::Auto`].
    pub fn new(form: MatmulForm, m: usize, n: usize, k: usize) -> Self {
        MatmulRequest {
            form,
            m,
            n,
            k,
            batch: None,
            epilogue: MatmulEpilogue::default(),
            kernel: MatmulKernel::Auto,
        }
    }

    /// `batch` products (see [`MatmulRequest::batch`]).
    pub fn with_batch(self, batch: usize) -> Self {
        MatmulRequest {
            batch: Some(batch),
            ..self
        }
    }

    pub fn with_epilogue(self, epilogue: MatmulEpilogue<'a>) -> Self {
        MatmulRequest { epilogue, ..self }
    }

    /// C[m, n] += the result when `accumulate` (gradients).
    pub fn accumulating(mut self, accumulate: bool) -> Self {
        self.epilogue.accumulate = accumulate;
        self
    }

    /// result + bias[col] (a Linear layer's forward).
    pub fn with_bias(mut self, bias: View<'a>) -> Self {
        self.epilogue.bias = Some(bias);
        self
    }

    pub fn with_kernel(self, kernel: MatmulKernel) -> Self {
        MatmulRequest { kernel, ..self }
    }
}

impl Kernels {
    /// C = the product `request` describes of `a` and `b`, on the kernel
    /// it names or, for [`MatmulKernel::Auto`], the one its operands and
    /// shape pick. Every matrix product wgrad runs goes through here.
    pub fn matmul<'a>(
        &self,
        request: &MatmulRequest<'a>,
        c: View<'a>,
        a: impl Into<MatmulOperand<'a>>,
        b: impl Into<MatmulOperand<'a>>,
    ) -> Result<Dispatch> {
        let (a, b) = (a.into(), b.into());
        let MatmulRequest {
            form,
            m,
            n,
            k,
            batch,
            epilogue,
            kernel,
        } = *request;
        if let (Some(a), Some(b), false) = (a.stored(), b.stored(), kernel == MatmulKernel::NativeF16) {
            return self.f32_family(request, c, a, b);
        }
        match (a, b) {
            (MatmulOperand::F16(a16), MatmulOperand::F16(b16)) => {
                let op = "matmul (f16 operands)";
                unbatched(op, batch)?;
                no_epilogue(op, &epilogue)?;
                self.matmul_f16(form, c, a16, b16, m, n, k)
            }
            (MatmulOperand::F32(a), MatmulOperand::F16Weight(b)) => {
                let op = "matmul (f16 weights)";
                weights_product(op, form, batch)?;
                let kernel = match kernel {
                    MatmulKernel::Auto => self.f16_weights_kernel_for(m, n, k, &a, &b),
                    MatmulKernel::F16Weights(kernel) => kernel,
                    other => return Err(mismatch(op, other, "an f16 weight")),
                };
                self.matmul_f16_weights(kernel, epilogue, c, a, b, m, n, k)
            }
            (MatmulOperand::F32(a), MatmulOperand::Quant(b)) if form == MatmulForm::AB => {
                // A frozen weight's backward: dX = dY·W, W [k, n] stored as its rows.
                let op = "matmul (quantized weights, transposed)";
                unbatched(op, batch)?;
                let MatmulEpilogue { accumulate, .. } = epilogue;
                no_epilogue(
                    op,
                    &MatmulEpilogue {
                        accumulate: false,
                        ..epilogue
                    },
                )?;
                if kernel != MatmulKernel::Auto {
                    return Err(mismatch(op, kernel, "a quantized weight's transposed product"));
                }
                self.matmul_quant_transposed(accumulate, c, a, b, m, n, k)
            }
            (MatmulOperand::F32(a), MatmulOperand::Quant(b)) => {
                let op = "matmul (quantized weights)";
                weights_product(op, form, batch)?;
                let kernel = match kernel {
                    MatmulKernel::Auto => self.quant_weights_kernel_for(m, &a, &b),
                    MatmulKernel::Quant(kernel) => kernel,
                    other => return Err(mismatch(op, other, "a quantized weight")),
                };
                self.matmul_quant_weights(kernel, epilogue, c, a, b, m, n, k)
            }
            (MatmulOperand::F32(a), MatmulOperand::QuantParts { parts, gated }) => {
                let op = "matmul_quant_parts";
                weights_product(op, form, batch)?;
                no_epilogue(op, &epilogue)?;
                if kernel != MatmulKernel::Auto {
                    return Err(mismatch(op, kernel, "quantized parts"));
                }
                let width = if gated {
                    parts.first().map_or(0, QuantView::rows)
                } else {
                    parts.iter().map(QuantView::rows).sum()
                };
                if width != n {
                    let rows: Vec<usize> = parts.iter().map(QuantView::rows).collect();
                    return Err(Error::shape(
                        op,
                        format!("n = {n}, but the parts give C {width} columns"),
                        &[&[m, k], &rows, &[m, n]],
                    ));
                }
                self.matmul_quant_parts(c, a, parts, m, k, gated)
            }
            (a, b) => Err(Error::InvalidArgument {
                op: "matmul",
                reason: format!(
                    "no {kernel:?} kernel multiplies {} A by {} B (f16 and quantized weights are B of an \
                     inference product with f32 A)",
                    a.describe(),
                    b.describe()
                ),
            }),
        }
    }

    /// The f32 family (matmul.wgsl, matmul_subgroup.wgsl), f32 or f16
    /// operands.
    fn f32_family(&self, request: &MatmulRequest<'_>, c: View<'_>, a: Stored<'_>, b: Stored<'_>) -> Result<Dispatch> {
        let MatmulRequest {
            form,
            m,
            n,
            k,
            batch,
            epilogue,
            kernel,
        } = *request;
        if let Some(batch) = batch {
            let op = "matmul (batched)";
            let plain = MatmulEpilogue {
                accumulate: epilogue.accumulate,
                ..MatmulEpilogue::default()
            };
            if epilogue.bias.is_some() || epilogue.activation.is_some() || epilogue.activation_grad.is_some() {
                return Err(Error::InvalidArgument {
                    op,
                    reason: "a batched product's only epilogue is accumulation".into(),
                });
            }
            // The batch's total work picks the kernel: 64 heads of
            // 128×128×32 are small one by one but too much for the small
            // kernel together.
            let variant = match kernel {
                MatmulKernel::Auto => self.matmul_variant_for_shape(form, batch.saturating_mul(m), n, k),
                MatmulKernel::Tiled(variant) => variant,
                other => return Err(mismatch(op, other, "a batch")),
            };
            return self.matmul_dispatch(Pick::Variant(variant), form, plain, c, a, b, batch, m, n, k);
        }
        let pick = match (kernel, a, b) {
            (MatmulKernel::Auto, Stored::F32(a), Stored::F32(b)) if self.matvec_runs(form, m, k, &a, &b) => {
                Pick::Matvec {
                    lanes: self.matvec_lanes(),
                }
            }
            (MatmulKernel::Auto, ..) => Pick::Variant(self.matmul_variant_for_shape(form, m, n, k)),
            (MatmulKernel::Tiled(variant), ..) => Pick::Variant(variant),
            (MatmulKernel::Matvec { lanes }, Stored::F32(a), Stored::F32(b)) => {
                if form != MatmulForm::ABt {
                    return Err(Error::shape(
                        "matmul_forward_matvec",
                        format!("takes ABt products, got {form:?}"),
                        &[&[m, k], &[n, k]],
                    ));
                }
                return self.matmul_matvec(lanes, epilogue, c, a, b, m, n, k);
            }
            (other, ..) => return Err(mismatch("matmul", other, "f32 or f16 operands")),
        };
        self.matmul_dispatch(pick, form, epilogue, c, a, b, 1, m, n, k)
    }
}

fn unbatched(op: &'static str, batch: Option<usize>) -> Result<()> {
    match batch {
        Some(batch) => Err(Error::InvalidArgument {
            op,
            reason: format!("runs one product, not a batch of {batch}"),
        }),
        None => Ok(()),
    }
}

fn no_epilogue(op: &'static str, epilogue: &MatmulEpilogue<'_>) -> Result<()> {
    let MatmulEpilogue {
        accumulate,
        bias,
        activation,
        activation_grad,
    } = epilogue;
    if *accumulate || bias.is_some() || activation.is_some() || activation_grad.is_some() {
        return Err(Error::InvalidArgument {
            op,
            reason: "takes no epilogue (accumulation, bias or activation)".into(),
        });
    }
    Ok(())
}

/// An inference product over stored weights: one A·Bᵀ.
fn weights_product(op: &'static str, form: MatmulForm, batch: Option<usize>) -> Result<()> {
    unbatched(op, batch)?;
    if form != MatmulForm::ABt {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("stored weights B [n, k] are multiplied as A·Bᵀ (MatmulForm::ABt), not {form:?}"),
        });
    }
    Ok(())
}

fn mismatch(op: &'static str, kernel: MatmulKernel, operands: &str) -> Error {
    Error::InvalidArgument {
        op,
        reason: format!("the {kernel:?} kernel does not take {operands}"),
    }
}
