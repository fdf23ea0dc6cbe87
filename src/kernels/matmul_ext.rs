//! Opt-in matmuls for adapters with optional features: f16 storage with f32
//! accumulation (`matmul_f16.wgsl`, needs SHADER_F16) and a subgroup
//! variant of the f32 matmul (`matmul_subgroup.wgsl`, needs SUBGROUP with
//! 8-lane subgroups). On an adapter without the feature every entry here
//! returns [`Error::Unsupported`] before anything is compiled, so the
//! missing feature never surfaces as a wgpu validation error.
//!
//! f16 data lives in an [`F16Tensor`]: `len` values packed two per 4-byte
//! word (value 2i in the low half of word i), so it is an ordinary storage
//! buffer of `len.div_ceil(2)` words. Packing, upload and readback need no
//! feature; only the kernels do.

use half::f16;

use super::registry::{entry_points, Family};
use super::{bind, dim, flat_groups, Dispatch, GpuTensor, Kernel, Kernels, MatmulForm, View};
use crate::error::{Error, Result};

entry_points! {
    MatmulF16 {
        MATMUL_F16_FORWARD = "matmul_f16_forward",
        F32_TO_F16 = "f32_to_f16",
        F16_TO_F32 = "f16_to_f32",
    }
    MatmulSubgroup {
        MATMUL_SUBGROUP_FORWARD = "matmul_subgroup_forward",
    }
}

/// The subgroup size `matmul_subgroup_forward` is written for: one 8-wide
/// workgroup is one subgroup (llvmpipe's SIMD width with 256-bit vectors).
pub const SUBGROUP_MATMUL_LANES: u32 = 8;

/// Rows and columns of C per workgroup in both kernels.
const TILE: usize = 64;

/// `len` f16 values on the GPU, packed two per 4-byte word.
#[derive(Debug)]
pub struct F16Tensor {
    words: GpuTensor,
    len: usize,
}

impl F16Tensor {
    /// Number of f16 values.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        self.words.buffer()
    }

    pub fn view(&self) -> F16View<'_> {
        F16View {
            words: self.words.view(),
            len: self.len,
        }
    }
}

/// A range of f16 values: `len` values in `words` (whose `len` counts 4-byte
/// words, `len.div_ceil(2)` of them).
#[derive(Clone, Copy, Debug)]
pub struct F16View<'a> {
    words: View<'a>,
    len: usize,
}

impl<'a> F16View<'a> {
    /// `len` f16 values packed in `words`; `words.len` must be
    /// `len.div_ceil(2)`. A sub-range of an f16 tensor therefore starts on
    /// an even value.
    pub fn new(words: View<'a>, len: usize) -> Result<Self> {
        if words.len != len.div_ceil(2) {
            return Err(Error::shape(
                "F16View::new",
                format!(
                    "{len} f16 values need {} words, the view has {}",
                    len.div_ceil(2),
                    words.len
                ),
                &[&[len], &[words.len]],
            ));
        }
        Ok(F16View { words, len })
    }

    /// Number of f16 values.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed words.
    pub fn words(&self) -> View<'a> {
        self.words
    }
}

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

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ConvertParams {
    len: u32,
    words: u32,
    _pad: [u32; 2],
}

pub(crate) fn pack_f16(values: &[f16]) -> Vec<u32> {
    values
        .chunks(2)
        .map(|pair| {
            let lo = u32::from(pair[0].to_bits());
            let hi = pair.get(1).map_or(0, |v| u32::from(v.to_bits()));
            lo | (hi << 16)
        })
        .collect()
}

pub(crate) fn unpack_f16(words: &[u32], len: usize) -> Vec<f16> {
    words
        .iter()
        .flat_map(|&w| [f16::from_bits(w as u16), f16::from_bits((w >> 16) as u16)])
        .take(len)
        .collect()
}

/// Checks m, n, k against the operands' lengths (in values) and returns the
/// parameter block; the shapes in errors are the stored ones.
fn matmul_params(
    op: &'static str,
    form: MatmulForm,
    (a_len, b_len, c_len): (usize, usize, usize),
    m: usize,
    n: usize,
    k: usize,
) -> Result<MatmulParams> {
    let (a_shape, b_shape) = form.operand_shapes(m, n, k);
    let shapes: [&[usize]; 3] = [&a_shape, &b_shape, &[m, n]];
    if m == 0 || n == 0 || k == 0 {
        return Err(Error::shape(
            op,
            format!("{form:?}: every dimension must be at least 1"),
            &shapes,
        ));
    }
    let sizes_ok =
        m.checked_mul(k) == Some(a_len) && k.checked_mul(n) == Some(b_len) && m.checked_mul(n) == Some(c_len);
    if !sizes_ok {
        return Err(Error::shape(
            op,
            format!(
                "{form:?} with m={m} n={n} k={k} needs A, B, C of {}, {}, {} values; got {a_len}, {b_len}, {c_len}",
                m.saturating_mul(k),
                k.saturating_mul(n),
                m.saturating_mul(n)
            ),
            &shapes,
        ));
    }
    let tiles_n = n.div_ceil(TILE);
    let tiles_total = tiles_n * m.div_ceil(TILE);
    Ok(MatmulParams {
        m: dim(op, m)?,
        n: dim(op, n)?,
        k: dim(op, k)?,
        tiles_n: dim(op, tiles_n)?,
        tiles_total: dim(op, tiles_total)?,
        _pad: [0; 3],
    })
}

impl Kernels {
    /// True when the f16 kernels ([`super::MatmulKernel::NativeF16`], [`Kernels::to_f16`],
    /// [`Kernels::from_f16`]) can run here (the adapter has SHADER_F16).
    pub fn supports_f16(&self) -> bool {
        self.device().features().contains(Family::MatmulF16.required_features())
    }

    /// True when [`super::MatmulVariant::Subgroup`] can run here: SUBGROUP, and
    /// every subgroup the adapter may use has exactly
    /// [`SUBGROUP_MATMUL_LANES`] lanes.
    pub fn supports_subgroup_matmul(&self) -> bool {
        self.require_family(MATMUL_SUBGROUP_FORWARD).is_ok()
    }

    /// `Error::Unsupported` unless the device has what `kernel`'s file needs.
    pub(crate) fn require_family(&self, kernel: Kernel) -> Result<()> {
        let device = self.device();
        let needed = kernel.family.required_features();
        let unsupported = |feature: String| Error::Unsupported {
            op: kernel.entry,
            feature,
            adapter: device.label(),
        };
        if !device.features().contains(needed) {
            let names: Vec<&str> = crate::device::REPORTED_FEATURES
                .iter()
                .filter(|(flag, _)| needed.contains(*flag) && !device.features().contains(*flag))
                .map(|(_, name)| *name)
                .collect();
            return Err(unsupported(format!("the {} feature", names.join(" and "))));
        }
        if matches!(kernel.family, Family::MatmulSubgroup | Family::QuantWeightsSubgroup) {
            let info = device.info();
            let (lo, hi) = (info.subgroup_min_size, info.subgroup_max_size);
            // The kernel broadcasts from lanes 0..7 of an 8-invocation
            // workgroup: a subgroup of any other size would split or pad
            // the workgroup, so only an adapter that always uses 8 lanes runs it.
            if lo != SUBGROUP_MATMUL_LANES || hi != SUBGROUP_MATMUL_LANES {
                return Err(unsupported(format!(
                    "subgroups of exactly {SUBGROUP_MATMUL_LANES} invocations (this adapter's subgroups have {lo}..={hi})"
                )));
            }
        }
        Ok(())
    }

    /// A zero-filled f16 tensor of `len` values.
    pub fn zeros_f16(&self, len: usize) -> Result<F16Tensor> {
        Ok(F16Tensor {
            words: self.zeros(len.div_ceil(2))?,
            len,
        })
    }

    /// Uploads f16 values (rounded on the host, e.g. `half::f16::from_f32`).
    /// Needs no device feature.
    pub fn upload_f16(&self, values: &[f16]) -> Result<F16Tensor> {
        Ok(F16Tensor {
            words: self.upload(&pack_f16(values))?,
            len: values.len(),
        })
    }

    /// Copies f16 values back to the host, waiting for submitted work.
    pub fn read_f16(&self, view: F16View<'_>) -> Result<Vec<f16>> {
        let words: Vec<u32> = self.read(view.words)?;
        Ok(unpack_f16(&words, view.len))
    }

    /// dst = src rounded to f16 (the driver's rounding: round-to-nearest-even
    /// on lavapipe; WGSL allows either neighbour). Needs SHADER_F16.
    pub fn to_f16(&self, dst: F16View<'_>, src: View<'_>) -> Result<Dispatch> {
        self.convert(
            F32_TO_F16,
            src.len,
            dst.len,
            [bind(4, "src", src), bind(5, "dst", dst.words)],
        )
    }

    /// dst = src widened to f32 (exact). Needs SHADER_F16.
    pub fn from_f16(&self, dst: View<'_>, src: F16View<'_>) -> Result<Dispatch> {
        self.convert(
            F16_TO_F32,
            src.len,
            dst.len,
            [bind(6, "src", src.words), bind(7, "dst", dst)],
        )
    }

    fn convert(
        &self,
        kernel: Kernel,
        src_len: usize,
        dst_len: usize,
        bindings: [super::Binding<'_>; 2],
    ) -> Result<Dispatch> {
        let op = kernel.entry;
        self.require_family(kernel)?;
        if src_len != dst_len {
            return Err(Error::shape(
                op,
                format!("src has {src_len} values, dst {dst_len}"),
                &[&[src_len], &[dst_len]],
            ));
        }
        let words = src_len.div_ceil(2);
        let params = ConvertParams {
            len: dim(op, src_len)?,
            words: dim(op, words)?,
            _pad: [0; 2],
        };
        self.prepare(kernel, &[], &bindings, 8, &params, flat_groups(words))
    }

    /// C[m,n] (f32) = op(A)·op(B) with A and B stored as f16, multiplied
    /// and accumulated in f32: the error is the inputs' f16 rounding
    /// (≤ 2⁻¹¹ relative each) plus f32 accumulation, not f16 accumulation.
    /// Needs SHADER_F16; [`Error::Unsupported`] without it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_f16(
        &self,
        form: MatmulForm,
        c: View<'_>,
        a: F16View<'_>,
        b: F16View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let kernel = MATMUL_F16_FORWARD;
        self.require_family(kernel)?;
        let params = matmul_params(kernel.entry, form, (a.len, b.len, c.len), m, n, k)?;
        self.matmul_ext_dispatch(
            kernel,
            form,
            params,
            [bind(0, "a", a.words), bind(1, "b", b.words), bind(2, "c", c)],
        )
    }

    fn matmul_ext_dispatch(
        &self,
        kernel: Kernel,
        form: MatmulForm,
        params: MatmulParams,
        bindings: [super::Binding<'_>; 3],
    ) -> Result<Dispatch> {
        let (trans_a, trans_b) = form.transposes();
        let constants = [
            ("TRANS_A", f64::from(u8::from(trans_a))),
            ("TRANS_B", f64::from(u8::from(trans_b))),
        ];
        self.prepare(kernel, &constants, &bindings, 3, &params, u64::from(params.tiles_total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_odd_lengths_and_zeroes_the_spare_half() {
        let values: Vec<f16> = [1.0f32, -2.5, 65504.0].iter().map(|&v| f16::from_f32(v)).collect();
        let words = pack_f16(&values);
        assert_eq!(words.len(), 2);
        assert_eq!(words[1] >> 16, 0);
        assert_eq!(unpack_f16(&words, 3), values);
    }
}
