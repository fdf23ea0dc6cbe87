//! `matmul.wgsl`: C = op(A)·op(B) in the three forms training needs.

use super::registry::{MATMUL_FORWARD_REGISTER, MATMUL_FORWARD_SHARED};
use super::{bind, dim, Dispatch, Kernels, View};
use crate::error::{Error, Result};

/// Which operand is transposed. Shapes are row-major as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulForm {
    /// C[M,N] = A[M,K] · B[K,N] (forward pass).
    AB,
    /// C[M,N] = A[K,M]ᵀ · B[K,N] (weight gradient, Xᵀ·dY).
    AtB,
    /// C[M,N] = A[M,K] · B[N,K]ᵀ (input gradient, dY·Wᵀ).
    ABt,
}

impl MatmulForm {
    pub const ALL: [MatmulForm; 3] = [MatmulForm::AB, MatmulForm::AtB, MatmulForm::ABt];

    /// Stored shapes of A and B for an M×N×K product.
    pub fn operand_shapes(self, m: usize, n: usize, k: usize) -> ([usize; 2], [usize; 2]) {
        match self {
            MatmulForm::AB => ([m, k], [k, n]),
            MatmulForm::AtB => ([k, m], [k, n]),
            MatmulForm::ABt => ([m, k], [n, k]),
        }
    }

    fn transposes(self) -> (bool, bool) {
        match self {
            MatmulForm::AB => (false, false),
            MatmulForm::AtB => (true, false),
            MatmulForm::ABt => (false, true),
        }
    }
}

/// The kernel shape: register-blocked (CPU adapters, where workgroup memory
/// and barriers are slow) or workgroup-memory tiled (real GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulVariant {
    Register,
    Shared,
}

impl MatmulVariant {
    pub const ALL: [MatmulVariant; 2] = [MatmulVariant::Register, MatmulVariant::Shared];
}

const TILE: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    tiles_n: u32,
    tiles_total: u32,
    _pad: [u32; 3],
}

impl Kernels {
    /// The variant used by [`Kernels::matmul`] on this adapter.
    pub fn matmul_variant(&self) -> MatmulVariant {
        if self.device().is_cpu() {
            MatmulVariant::Register
        } else {
            MatmulVariant::Shared
        }
    }

    /// C[m,n] = op(A)·op(B) with the variant best for this adapter.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        form: MatmulForm,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        self.matmul_with(self.matmul_variant(), form, c, a, b, m, n, k)
    }

    /// C[m,n] += op(A)·op(B): accumulates into C (gradients).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_accumulate(
        &self,
        form: MatmulForm,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        self.matmul_impl(self.matmul_variant(), form, true, None, c, a, b, m, n, k)
    }

    /// C[m,n] = op(A)·op(B) with an explicit kernel variant.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with(
        &self,
        variant: MatmulVariant,
        form: MatmulForm,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        self.matmul_impl(variant, form, false, None, c, a, b, m, n, k)
    }

    /// C[m,n] = op(A)·op(B) + bias[n] (a Linear layer's forward).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_bias(
        &self,
        form: MatmulForm,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        bias: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        self.matmul_impl(self.matmul_variant(), form, false, Some(bias), c, a, b, m, n, k)
    }

    /// The one place the matmul dispatch is built.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_impl(
        &self,
        variant: MatmulVariant,
        form: MatmulForm,
        accumulate: bool,
        bias: Option<View<'_>>,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let kernel = match variant {
            MatmulVariant::Register => MATMUL_FORWARD_REGISTER,
            MatmulVariant::Shared => MATMUL_FORWARD_SHARED,
        };
        let op = kernel.entry;
        let (a_shape, b_shape) = form.operand_shapes(m, n, k);
        let shapes: [&[usize]; 3] = [&a_shape, &b_shape, &[m, n]];
        if m == 0 || n == 0 || k == 0 {
            return Err(Error::shape(op, format!("{form:?}: every dimension must be at least 1"), &shapes));
        }
        let sizes_ok = m.checked_mul(k) == Some(a.len)
            && k.checked_mul(n) == Some(b.len)
            && m.checked_mul(n) == Some(c.len);
        if !sizes_ok {
            return Err(Error::shape(
                op,
                format!(
                    "{form:?} with m={m} n={n} k={k} needs A, B, C of {}, {}, {} elements; got {}, {}, {}",
                    m * k, k * n, m * n, a.len, b.len, c.len
                ),
                &shapes,
            ));
        }
        if let Some(bias) = &bias {
            if bias.len != n {
                return Err(Error::shape(op, format!("bias must hold n = {n} values, got {}", bias.len), &[&a_shape, &b_shape, &[bias.len]]));
            }
        }
        let tiles_n = n.div_ceil(TILE);
        let tiles_total = tiles_n * m.div_ceil(TILE);
        let params = MatmulParams {
            m: dim(op, m)?,
            n: dim(op, n)?,
            k: dim(op, k)?,
            tiles_n: dim(op, tiles_n)?,
            tiles_total: dim(op, tiles_total)?,
            _pad: [0; 3],
        };
        let (trans_a, trans_b) = form.transposes();
        let constants = [
            ("TRANS_A", f64::from(u8::from(trans_a))),
            ("TRANS_B", f64::from(u8::from(trans_b))),
            ("ACCUMULATE", f64::from(u8::from(accumulate))),
            ("HAS_BIAS", f64::from(u8::from(bias.is_some()))),
        ];
        // The bias slot is in the layout whatever HAS_BIAS says; without a
        // bias it holds a placeholder the kernel never reads.
        let bias_view = bias.unwrap_or(View { buffer: self.placeholder(), offset: 0, len: 1 });
        self.prepare(
            kernel,
            &constants,
            &[bind(0, "a", a), bind(1, "b", b), bind(2, "c", c), bind(4, "bias", bias_view)],
            3,
            &params,
            tiles_total as u64,
        )
    }
}
