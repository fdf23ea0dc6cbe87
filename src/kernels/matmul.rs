//! `matmul.wgsl`: C = op(A)·op(B) in the three forms training needs.

use super::registry::{entry_points, MATMUL_SUBGROUP_FORWARD};
use super::{bind, dim, reflect, Dispatch, F16View, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{Activation, MatmulForm};

entry_points! {
    Matmul {
        MATMUL_FORWARD_REGISTER = "matmul_forward_register",
        MATMUL_FORWARD_SHARED = "matmul_forward_shared",
        MATMUL_FORWARD_SHARED_VEC4 = "matmul_forward_shared_vec4",
        MATMUL_FORWARD_REGISTER_VEC4 = "matmul_forward_register_vec4",
        MATMUL_FORWARD_MATVEC = "matmul_forward_matvec",
        MATMUL_FORWARD_SMALL = "matmul_forward_small",
    }
}

/// The kernel shape: register-blocked (CPU adapters, where workgroup memory
/// and barriers are slow) or workgroup-memory tiled (real GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MatmulVariant {
    Register,
    /// Workgroup-memory tiles of 64×64, 8×4 outputs per invocation, with
    /// coalesced loads in every form: vec4 loads where A's and B's stored
    /// rows are multiples of 4 long and the operands 16-byte aligned,
    /// scalar loads otherwise. The untuned choice on every non-CPU adapter.
    Shared,
    /// Register-blocked with vec4 loads (contiguous 16-column blocks) where
    /// M, N, K are multiples of 4 and every operand starts 16-byte aligned;
    /// other shapes run [`MatmulVariant::Register`].
    RegisterVec4,
    /// Register-blocked with the A values shared between the 8 lanes of a
    /// subgroup (`matmul_subgroup.wgsl`): a third of Register's storage
    /// loads. Only where the device has SUBGROUP and every subgroup has
    /// exactly 8 lanes ([`Kernels::supports_matmul_variant`]); elsewhere it
    /// is never chosen and asking for it gives `Error::Unsupported`.
    Subgroup,
    /// One 8×8 block per invocation, 64 invocations: the kernel for products of
    /// at most [`SMALL_MATMUL_WORK`] multiply-adds, whatever the tuning says.
    /// It compiles in tens of milliseconds where the register-blocked
    /// kernels take ~1.7 s (warm) to 5–9 s (cold shader cache) per pipeline
    /// on lavapipe, and at these sizes a dispatch costs about as much as the
    /// arithmetic, so small layers (the digits MLP, Linear(10,1)) start at
    /// once (`wgrad bench --compile`, BENCHMARKS.md).
    Small,
}

/// Products up to this many multiply-adds (m·n·k) run [`MatmulVariant::Small`].
/// The digits MLP's largest is 32·128·64 = 2^18; the benchmark MLP's
/// smallest is 256·10·512 ≈ 1.3·2^20, which stays on the tuned kernel.
pub const SMALL_MATMUL_WORK: usize = 1 << 20;

impl MatmulVariant {
    /// Every variant, including those an adapter may not run (see
    /// [`Kernels::supports_matmul_variant`]).
    pub const ALL: [MatmulVariant; 5] = [
        MatmulVariant::Register,
        MatmulVariant::Shared,
        MatmulVariant::RegisterVec4,
        MatmulVariant::Subgroup,
        MatmulVariant::Small,
    ];

    /// The entry point this variant runs for these operands (A, B, C),
    /// each a binding and the element its matrix starts at in it.
    /// With `f16` (an operand stored in f16) only the kernels reading
    /// through `load_a` / `load_b` run: the scalar shared kernel, and the
    /// register kernel for the register-blocked variants.
    fn kernel(
        self,
        form: MatmulForm,
        m: usize,
        n: usize,
        k: usize,
        operands: [(&View<'_>, usize); 3],
        f16: bool,
    ) -> super::Kernel {
        let aligned = |(v, base): &(&View<'_>, usize)| v.offset % 16 == 0 && base % 4 == 0 && !f16;
        match self {
            MatmulVariant::Subgroup if f16 => MATMUL_FORWARD_REGISTER,
            MatmulVariant::Register => MATMUL_FORWARD_REGISTER,
            MatmulVariant::Shared => {
                // vec4 loads along A's and B's stored rows: those a multiple
                // of 4 long and every matrix (the batch's too, whose sizes
                // are multiples of a row) 16-byte aligned.
                let (trans_a, trans_b) = form.transposes();
                let rows = (if trans_a { m } else { k }) % 4 == 0 && (if trans_b { k } else { n }) % 4 == 0;
                if rows && operands[..2].iter().all(aligned) {
                    MATMUL_FORWARD_SHARED_VEC4
                } else {
                    MATMUL_FORWARD_SHARED
                }
            }
            MatmulVariant::Subgroup => MATMUL_SUBGROUP_FORWARD,
            MatmulVariant::Small => MATMUL_FORWARD_SMALL,
            MatmulVariant::RegisterVec4 => {
                if [m, n, k].iter().all(|d| d % 4 == 0) && operands.iter().all(aligned) {
                    MATMUL_FORWARD_REGISTER_VEC4
                } else {
                    MATMUL_FORWARD_REGISTER
                }
            }
        }
    }
}

/// An operand of the f32 family's kernels: f32 values, or f16 values packed
/// two a word (the activations a training step saves in f16,
/// `graph::precision`), which the small, register and shared kernels widen
/// to f32 as they load them, so no widened copy is stored; products and
/// sums stay f32: [`super::MatmulOperand`]'s `F32` and `F16` as this
/// file binds them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Stored<'a> {
    F32(View<'a>),
    F16(F16View<'a>),
}

impl<'a> From<View<'a>> for Stored<'a> {
    fn from(view: View<'a>) -> Self {
        Stored::F32(view)
    }
}

impl<'a> From<F16View<'a>> for Stored<'a> {
    fn from(view: F16View<'a>) -> Self {
        Stored::F16(view)
    }
}

impl<'a> Stored<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Stored::F32(v) => v.len,
            Stored::F16(v) => v.len(),
        }
    }

    pub fn is_f16(&self) -> bool {
        matches!(self, Stored::F16(_))
    }

    /// The storage it is bound as (the packed words of f16 values).
    pub fn binding(&self) -> View<'a> {
        match self {
            Stored::F32(v) => *v,
            Stored::F16(v) => v.words(),
        }
    }
}

/// What happens to each product element before it is stored.
#[derive(Clone, Copy, Default, Debug)]
pub struct MatmulEpilogue<'a> {
    /// C += result instead of C = result.
    pub accumulate: bool,
    /// result = product + bias[col].
    pub bias: Option<View<'a>>,
    /// Forward: result = act(product [+ bias]); when the view is given, the
    /// pre-activation value (product [+ bias]) is also stored there ([m, n],
    /// same indexing as C), because the activation's backward needs it.
    pub activation: Option<(Activation, Option<View<'a>>)>,
    /// Backward: result = product · act'(x[row, col]) where x is the
    /// activation's forward input ([m, n]); exactly what
    /// `Kernels::activation_backward(act, dx, x, dy)` computes with dy = the
    /// product. Cannot be combined with `activation` or `bias`.
    pub activation_grad: Option<(Activation, View<'a>)>,
}

impl<'a> MatmulEpilogue<'a> {
    /// The epilogue of an inference product whose weights are stored in f16
    /// or quantized (`weights` names them): a bias of n values and an
    /// activation, its pre-activation [m, n] like C; accumulation and
    /// activation gradients are training's and are refused. Returns the
    /// pre-activation's view.
    pub(super) fn forward_only(
        &self,
        op: &'static str,
        weights: &str,
        (m, n, k): (usize, usize, usize),
    ) -> Result<Option<View<'a>>> {
        if self.accumulate || self.activation_grad.is_some() {
            return Err(Error::InvalidArgument { op, reason: format!("{weights} take the forward epilogue only (bias, activation); accumulation and activation gradients are training's") });
        }
        if let Some(bias) = &self.bias {
            if bias.len != n {
                return Err(Error::shape(
                    op,
                    format!("bias must hold n = {n} values, got {}", bias.len),
                    &[&[m, k], &[n, k], &[bias.len]],
                ));
            }
        }
        let pre = self.activation.and_then(|(_, pre)| pre);
        if let Some(pre) = &pre {
            if Some(pre.len) != m.checked_mul(n) {
                return Err(Error::shape(
                    op,
                    format!(
                        "the pre-activation output must be m×n = {m}×{n} like C, got {} values",
                        pre.len
                    ),
                    &[&[m, n], &[pre.len]],
                ));
            }
        }
        Ok(pre)
    }
}

pub(super) const TILE: usize = 64;
/// Columns per workgroup of the matrix-vector kernels, f32 and f16 weights
/// (matvec.wgsl's MATVEC_COLS).
pub(super) const MATVEC_COLUMNS: usize = 8;

/// The fields the forward products' parameter blocks start with, this
/// file's `MatmulParams` and f16_weights.rs's `F16wParams` (and their WGSL
/// structs): the launch's block of C, its tiles, and what the epilogue
/// reads.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct ProductParams {
    m: u32,
    n: u32,
    k: u32,
    tiles_n: u32,
    pub(super) tiles_total: u32,
    activation: u32,
    ldc: u32,
    bias_base: u32,
}

impl ProductParams {
    /// A launch computing `rows`×`cols` of C over `k`, from column `n0`
    /// of a product `n` columns wide (C's row stride), with `activation`'s
    /// code for the epilogue.
    pub(super) fn new(
        op: &'static str,
        (rows, cols, k): (usize, usize, usize),
        n: usize,
        n0: usize,
        activation: Option<Activation>,
    ) -> Result<Self> {
        let tiles_n = cols.div_ceil(TILE);
        Ok(ProductParams {
            m: dim(op, rows)?,
            n: dim(op, cols)?,
            k: dim(op, k)?,
            tiles_n: dim(op, tiles_n)?,
            tiles_total: dim(op, tiles_n * rows.div_ceil(TILE))?,
            activation: activation.map_or(0, Activation::code),
            ldc: dim(op, n)?,
            bias_base: dim(op, n0)?,
        })
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MatmulParams {
    product: ProductParams,
    sa_row: u32,
    sa_k: u32,
    sb_col: u32,
    sb_k: u32,
    batch_a: u32,
    batch_b: u32,
    batch_c: u32,
    a_base: u32,
    b_base: u32,
    c_base: u32,
    _pad: [u32; 2],
}

/// The block of the product one launch computes: rows m0..m0 + rows and
/// columns n0..n0 + cols. The whole product unless an operand exceeds one
/// storage binding.
/// The rows up to which the shape-selected entries run an ABt product on
/// the matrix-vector kernel (`matmul_forward_matvec`): decoding, one new
/// token per sequence.
pub const MATVEC_MAX_ROWS: usize = 4;

/// The `MATVEC_ROWS` override (matvec.wgsl's) the matrix-vector kernels
/// compile an m-row product with: a bucket of row counts (1, 2, 4) whose
/// pipeline runs every m up to it, m itself coming at run time, so 3 and 4
/// rows (a server's batches) share one compile. Decode's one row keeps its
/// own pipeline: it is the hot path, and a bucket would add rows to it.
pub(super) fn matvec_rows_bucket(m: usize) -> usize {
    m.next_power_of_two()
}

/// Which kernel a matmul dispatch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pick {
    Variant(MatmulVariant),
    /// `matmul_forward_matvec` with this many lanes per workgroup.
    Matvec {
        lanes: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    m0: usize,
    rows: usize,
    n0: usize,
    cols: usize,
    /// The part of the k sum this launch adds: all of it, except where an
    /// operand fits a binding only in parts along k.
    k0: usize,
    depth: usize,
}

impl Kernels {
    /// True when `variant` can run on this device: every variant but
    /// [`MatmulVariant::Subgroup`] runs everywhere.
    pub fn supports_matmul_variant(&self, variant: MatmulVariant) -> bool {
        match variant {
            MatmulVariant::Subgroup => self.supports_subgroup_matmul(),
            MatmulVariant::Register | MatmulVariant::Shared | MatmulVariant::RegisterVec4 | MatmulVariant::Small => {
                true
            }
        }
    }

    /// The variant [`Kernels::matmul`]'s `MatmulKernel::Auto` runs for
    /// the tiled kernels for an m×n×k product: [`MatmulVariant::Small`] for small ones,
    /// else the tuned variant for the form.
    pub fn matmul_variant_for_shape(&self, form: MatmulForm, m: usize, n: usize, k: usize) -> MatmulVariant {
        let work = m.saturating_mul(n).saturating_mul(k);
        if work <= SMALL_MATMUL_WORK {
            MatmulVariant::Small
        } else {
            self.matmul_variant_for(form)
        }
    }

    /// The tuned variant for the forward form (AB) on this adapter, which
    /// [`Kernels::matmul`] runs above the small kernel's size; see [`Kernels::matmul_variant_for`] for the others.
    pub fn matmul_variant(&self) -> MatmulVariant {
        self.matmul_variant_for(MatmulForm::AB)
    }

    /// Whether the matrix-vector kernel takes this product: ABt, 1 to
    /// [`MATVEC_MAX_ROWS`] rows, k a multiple of 4, A and B 16-byte
    /// aligned (it reads vec4s), on an adapter whose storage offsets are
    /// too, so every part of a split product stays aligned.
    pub fn matvec_runs(&self, form: MatmulForm, m: usize, k: usize, a: &View<'_>, b: &View<'_>) -> bool {
        let offsets_aligned = self.device().limits().min_storage_buffer_offset_alignment % 16 == 0;
        form == MatmulForm::ABt
            && (1..=MATVEC_MAX_ROWS).contains(&m)
            && k % 4 == 0
            && a.offset % 16 == 0
            && b.offset % 16 == 0
            && offsets_aligned
    }

    /// Lanes per workgroup the shape-selected entries give the
    /// matrix-vector kernel: 8 on a CPU adapter (one SIMD row of llvmpipe:
    /// with more lanes along k each has so few steps that the sum over the
    /// lanes costs more than the loads; 8 lanes took 0.5–0.6× the CPU time
    /// of 64 on lavapipe for GPT-2's layers), 64 on a GPU.
    pub fn matvec_lanes(&self) -> u32 {
        if self.gpu_shaped() {
            64
        } else {
            8
        }
    }

    /// C[m,n] = epilogue(A·Bᵀ) on the matrix-vector kernel with `lanes`
    /// (a power of two from 8 to 64) per workgroup, for products
    /// [`Kernels::matvec_runs`] accepts (an error otherwise):
    /// [`super::MatmulKernel::Matvec`]. `Auto` picks it by itself.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_matvec(
        &self,
        lanes: u32,
        epilogue: MatmulEpilogue<'_>,
        c: View<'_>,
        a: View<'_>,
        b: View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        // Lane c stores column c of the workgroup's 8.
        if !(lanes.is_power_of_two() && (8..=64).contains(&lanes)) {
            return Err(Error::InvalidArgument {
                op: MATMUL_FORWARD_MATVEC.entry,
                reason: format!("{lanes} lanes: a power of two from 8 to 64"),
            });
        }
        if !self.matvec_runs(MatmulForm::ABt, m, k, &a, &b) {
            return Err(Error::shape(
                MATMUL_FORWARD_MATVEC.entry,
                format!("takes ABt products of 1 to {MATVEC_MAX_ROWS} rows, k a multiple of 4 and 16-byte aligned operands; got m={m} k={k}, A at byte {}, B at byte {}", a.offset, b.offset),
                &[&[m, k], &[n, k]],
            ));
        }
        self.matmul_dispatch(
            Pick::Matvec { lanes },
            MatmulForm::ABt,
            epilogue,
            c,
            a.into(),
            b.into(),
            1,
            m,
            n,
            k,
        )
    }

    /// The one place the matmul dispatch is built; `batch` products of
    /// m×n×k, contiguous in each operand.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_dispatch(
        &self,
        pick: Pick,
        form: MatmulForm,
        epilogue: MatmulEpilogue<'_>,
        c: View<'_>,
        a: Stored<'_>,
        b: Stored<'_>,
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let f16 = a.is_f16() || b.is_f16();
        let kernel = match pick {
            Pick::Variant(variant) => {
                variant.kernel(form, m, n, k, [(&a.binding(), 0), (&b.binding(), 0), (&c, 0)], f16)
            }
            Pick::Matvec { .. } => MATMUL_FORWARD_MATVEC,
        };
        let op = kernel.entry;
        // Before anything else, so a missing feature is always reported as
        // Unsupported and never reaches wgpu as a validation error.
        self.require_family(kernel)?;
        let (a_shape, b_shape) = form.operand_shapes(m, n, k);
        let batched = |s: &[usize]| -> Vec<usize> {
            if batch == 1 {
                s.to_vec()
            } else {
                [&[batch][..], s].concat()
            }
        };
        let (a_full, b_full, c_full) = (batched(&a_shape), batched(&b_shape), batched(&[m, n]));
        let shapes: [&[usize]; 3] = [&a_full, &b_full, &c_full];
        if batch == 0 || m == 0 || n == 0 || k == 0 {
            return Err(Error::shape(
                op,
                format!("{form:?}: every dimension must be at least 1 (batch {batch})"),
                &shapes,
            ));
        }
        let len = |x: usize, y: usize| x.checked_mul(y).and_then(|v| v.checked_mul(batch));
        let sizes_ok = len(m, k) == Some(a.len()) && len(k, n) == Some(b.len()) && len(m, n) == Some(c.len);
        if !sizes_ok {
            let want = |x: usize, y: usize| {
                len(x, y).map_or_else(|| "an overflowing number of".to_string(), |v| v.to_string())
            };
            let of = if batch == 1 {
                String::new()
            } else {
                format!(" batch={batch}")
            };
            return Err(Error::shape(
                op,
                format!(
                    "{form:?} with{of} m={m} n={n} k={k} needs A, B, C of {}, {}, {} elements; got {}, {}, {}",
                    want(m, k),
                    want(k, n),
                    want(m, n),
                    a.len(),
                    b.len(),
                    c.len
                ),
                &shapes,
            ));
        }
        let MatmulEpilogue {
            bias,
            activation,
            activation_grad,
            ..
        } = epilogue;
        if let Some(bias) = &bias {
            if bias.len != n {
                return Err(Error::shape(
                    op,
                    format!("bias must hold n = {n} values, got {}", bias.len),
                    &[&a_shape, &b_shape, &[bias.len]],
                ));
            }
        }
        if activation_grad.is_some() && (activation.is_some() || bias.is_some()) {
            return Err(Error::InvalidArgument {
                op,
                reason: "an activation gradient epilogue cannot be combined with a bias or a forward activation".into(),
            });
        }
        let pre = activation.and_then(|(_, pre)| pre);
        let act_input = activation_grad.map(|(_, x)| x);
        for (name, view) in [("pre-activation output", pre), ("activation input", act_input)] {
            if let Some(view) = view {
                if view.len != c.len {
                    return Err(Error::shape(
                        op,
                        format!("the {name} must be m×n = {m}×{n} like C, got {} elements", view.len),
                        &[&a_shape, &b_shape, &[m, n], &[view.len]],
                    ));
                }
            }
        }
        let over = |v: &View<'_>| v.bytes() > self.binding_limit();
        let oversize = [&a.binding(), &b.binding(), &c]
            .into_iter()
            .chain(pre.as_ref())
            .chain(act_input.as_ref())
            .any(over);
        // A split product binds parts of its operands by f32 element.
        if let (true, Some(h)) = (oversize, [a, b].into_iter().find(Stored::is_f16)) {
            return Err(self.binding_too_large(
                op,
                "an f16 operand's product (f16 operands do not split)",
                h.binding().bytes().max(c.bytes()),
            ));
        }
        if batch == 1 && oversize {
            let plain = bias.is_none() && activation.is_none() && activation_grad.is_none();
            let (rows, cols, depth) = match self.matmul_blocks(op, form, m, n, k) {
                Ok((rows, cols)) => (rows, cols, k),
                Err(e) if plain => self.matmul_blocks_along_k(op, form, m, n, k).map_err(|_| e)?,
                Err(e) => return Err(e),
            };
            let mut launches = Vec::new();
            for m0 in (0..m).step_by(rows) {
                for n0 in (0..n).step_by(cols) {
                    // Parts along k add into C in order after the first.
                    for k0 in (0..k).step_by(depth) {
                        let block = Block {
                            m0,
                            rows: rows.min(m - m0),
                            n0,
                            cols: cols.min(n - n0),
                            k0,
                            depth: depth.min(k - k0),
                        };
                        let epilogue = MatmulEpilogue {
                            accumulate: epilogue.accumulate || k0 > 0,
                            ..epilogue
                        };
                        launches.push(self.matmul_launch(pick, form, epilogue, c, a, b, 1, (m, n, k), block)?);
                    }
                }
            }
            return Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no blocks", &shapes));
        }
        let whole = Block {
            m0: 0,
            rows: m,
            n0: 0,
            cols: n,
            k0: 0,
            depth: k,
        };
        self.matmul_launch(pick, form, epilogue, c, a, b, batch, (m, n, k), whole)
    }

    /// The block sizes (rows, columns) that split an m×n×k product so that
    /// every launch's part of A, B and C (and of the epilogue's pre and
    /// act_input, indexed like C) fits one storage binding. Rows split
    /// where op(A)'s rows are contiguous (A not transposed), columns where
    /// op(B)'s are (B transposed, as the LM head's x·wteᵀ). What cannot fit
    /// that way is an [`Error::TooLarge`] naming the operand: splitting k
    /// would need the partial products summed, which no kernel does.
    fn matmul_blocks(
        &self,
        op: &'static str,
        form: MatmulForm,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(usize, usize)> {
        let cap = self.part_capacity();
        let (trans_a, trans_b) = form.transposes();
        let too_large =
            |operand: &'static str, elements: usize| Err(self.binding_too_large(op, operand, elements as u64 * 4));
        let mut rows = m;
        if trans_a {
            if m * k > cap {
                return too_large("a (stored [k, m] for AtB, so it does not split by rows)", m * k);
            }
        } else {
            rows = rows.min(cap / k);
            if rows == 0 {
                return too_large("a (one row of it)", k);
            }
        }
        let mut cols = n;
        if trans_b {
            cols = cols.min(cap / k);
            if cols == 0 {
                return too_large("b (one row of it)", k);
            }
        } else if k * n > cap {
            return too_large("b (stored [k, n], which would split along k)", k * n);
        }
        // C's part is rows whole rows of n, less what the last row leaves out.
        if (rows - 1) * n + cols > cap {
            if cols == n && n <= cap {
                rows = cap / n;
            } else if cols == n {
                if !trans_b {
                    return too_large("c (one row of it, and B does not split by columns)", n);
                }
                rows = 1;
                cols = cap;
            } else {
                rows = rows.min((cap - cols) / n + 1);
            }
        }
        if trans_a && rows < m {
            return too_large("c (A is stored [k, m] for AtB, so the rows do not split)", m * n);
        }
        // Whole 64-wide tiles per launch where there are several.
        let tiled = |d: usize| if d > TILE { d / TILE * TILE } else { d };
        Ok((tiled(rows), tiled(cols)))
    }

    /// Blocks (rows, columns, depth) for a plain product (no bias or
    /// activation epilogue) whose operand fits a binding only in parts
    /// along k, as the tied LM head's gradients (dlogits·wte, dlogitsᵀ·x)
    /// where the vocabulary is k or A is stored [k, m]: each launch adds
    /// its part of the sum into C, so the sum is rounded once per part
    /// (not bit for bit the unsplit sum). Depths are whole 64-wide tiles
    /// where there are several, keeping the operands' vector alignment.
    fn matmul_blocks_along_k(
        &self,
        op: &'static str,
        form: MatmulForm,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(usize, usize, usize)> {
        let cap = self.part_capacity();
        let (trans_a, trans_b) = form.transposes();
        // C in whole rows; only a transposed B splits C's columns.
        let (mut rows, mut cols) = match (n <= cap, trans_b) {
            (true, _) => (m.min(cap / n), n),
            (false, true) => (1, cap),
            (false, false) => {
                return Err(self.binding_too_large(
                    op,
                    "c (one row of it, and B does not split by columns)",
                    n as u64 * 4,
                ))
            }
        };
        // The most of k each operand's part holds beside `rows` and `cols`.
        let depth_for = |rows: usize, cols: usize| -> usize {
            let a = if trans_a {
                if rows > cap {
                    0
                } else {
                    (cap - rows) / m + 1
                }
            } else {
                cap.saturating_sub((rows - 1) * k)
            };
            let b = if trans_b {
                cap.saturating_sub((cols - 1) * k)
            } else if cols > cap {
                0
            } else {
                (cap - cols) / n + 1
            };
            a.min(b).min(k)
        };
        // Fewer rows (and, where B is transposed, columns) until a part
        // holds a useful depth.
        while depth_for(rows, cols) < k.min(TILE) {
            if rows > 1 {
                rows /= 2;
            } else if trans_b && cols > 1 {
                cols /= 2;
            } else {
                break;
            }
        }
        let depth = depth_for(rows, cols);
        if depth == 0 {
            return Err(self.binding_too_large(op, "a or b (one row of each)", k as u64 * 4));
        }
        let tiled = |d: usize| if d > TILE { d / TILE * TILE } else { d };
        Ok((
            tiled(rows),
            if cols < n { tiled(cols) } else { n },
            if depth < k { tiled(depth) } else { k },
        ))
    }

    /// `v` (an epilogue tensor indexed like C: pre, act_input) bound over
    /// C's values `start..start + len` of a split product, where C's own
    /// part starts at `c_base` of its binding: refused unless `v`'s does
    /// too, since one index serves both in the kernel.
    pub(super) fn bind_like_c<'v>(
        &self,
        op: &'static str,
        v: View<'v>,
        (start, len): (usize, usize),
        c_base: usize,
    ) -> Result<View<'v>> {
        let (part, base) = self.bind_part(v, start, len);
        if base != c_base {
            return Err(Error::InvalidArgument {
                op,
                reason: "the epilogue's tensors and C sit at different storage alignments, so a split product cannot index them alike".into(),
            });
        }
        Ok(part)
    }

    /// One launch over `block` of an m×n×k product (`batch` products when
    /// the block is the whole product).
    #[allow(clippy::too_many_arguments)]
    fn matmul_launch<'v>(
        &self,
        pick: Pick,
        form: MatmulForm,
        epilogue: MatmulEpilogue<'v>,
        c: View<'v>,
        a_operand: Stored<'v>,
        b_operand: Stored<'v>,
        batch: usize,
        (m, n, k): (usize, usize, usize),
        block: Block,
    ) -> Result<Dispatch> {
        // f16 operands are never split (matmul_dispatch), so their
        // whole words are bound and `a`, `b` stand for them below.
        let (a, b) = (a_operand.binding(), b_operand.binding());
        let f16 = [a_operand.is_f16(), b_operand.is_f16()];
        let MatmulEpilogue {
            accumulate,
            bias,
            activation,
            activation_grad,
        } = epilogue;
        let (trans_a, trans_b) = form.transposes();
        let pre = activation.and_then(|(_, pre)| pre);
        let act_input = activation_grad.map(|(_, x)| x);
        let whole = block
            == Block {
                m0: 0,
                rows: m,
                n0: 0,
                cols: n,
                k0: 0,
                depth: k,
            };
        // Each operand's binding and where its block starts in it.
        let (a_bind, b_bind, c_bind, pre_bind, act_bind) = if whole {
            ((a, 0), (b, 0), (c, 0), pre.map(|v| (v, 0)), act_input.map(|v| (v, 0)))
        } else {
            // From the block's first element to its last, in storage order.
            let (k0, depth) = (block.k0, block.depth);
            let a_part = match (trans_a, block.rows == m && depth == k) {
                (true, true) => (a, 0),
                (true, false) => self.bind_part(a, k0 * m + block.m0, (depth - 1) * m + block.rows),
                (false, _) => self.bind_part(a, block.m0 * k + k0, (block.rows - 1) * k + depth),
            };
            let b_part = match (trans_b, block.cols == n && depth == k) {
                (true, _) => self.bind_part(b, block.n0 * k + k0, (block.cols - 1) * k + depth),
                (false, true) => (b, 0),
                (false, false) => self.bind_part(b, k0 * n + block.n0, (depth - 1) * n + block.cols),
            };
            let c_range = (block.m0 * n + block.n0, (block.rows - 1) * n + block.cols);
            let c_part = self.bind_part(c, c_range.0, c_range.1);
            let like_c = |v: View<'v>| {
                self.bind_like_c("matmul", v, c_range, c_part.1)
                    .map(|part| (part, c_part.1))
            };
            (
                a_part,
                b_part,
                c_part,
                pre.map(like_c).transpose()?,
                act_input.map(like_c).transpose()?,
            )
        };
        let (rows, cols) = (block.rows, block.cols);
        // Vector loads need the stored rows' length (k's whole, not the
        // part's) to be a multiple of 4, as the part's is when k's is.
        let k_aligned = if k % 4 == 0 { block.depth } else { k };
        let kernel = match pick {
            Pick::Variant(variant) => variant.kernel(
                form,
                rows,
                cols,
                k_aligned,
                [(&a_bind.0, a_bind.1), (&b_bind.0, b_bind.1), (&c_bind.0, c_bind.1)],
                f16.contains(&true),
            ),
            Pick::Matvec { .. } => MATMUL_FORWARD_MATVEC,
        };
        let op = kernel.entry;
        let act = activation.map(|(act, _)| act).or(activation_grad.map(|(act, _)| act));
        let product = ProductParams::new(op, (rows, cols, block.depth), n, block.n0, act)?;
        let params = MatmulParams {
            product,
            // The strides of the whole operands: a block splits only
            // dimensions that are not strides (rows of A when A is not
            // transposed, columns of B when B is).
            sa_row: dim(op, if trans_a { 1 } else { k })?,
            sa_k: dim(op, if trans_a { m } else { 1 })?,
            sb_col: dim(op, if trans_b { k } else { 1 })?,
            sb_k: dim(op, if trans_b { 1 } else { n })?,
            batch_a: dim(op, m * k)?,
            batch_b: dim(op, k * n)?,
            batch_c: dim(op, m * n)?,
            a_base: dim(op, a_bind.1)?,
            b_base: dim(op, b_bind.1)?,
            c_base: dim(op, c_bind.1)?,
            _pad: [0; 2],
        };
        let flag = |on: bool| f64::from(u8::from(on));
        // The epilogue overrides first, then the form's for the kernels
        // compiled per form.
        let constants = [
            ("ACCUMULATE", flag(accumulate)),
            ("HAS_BIAS", flag(bias.is_some())),
            ("ACTIVATION_FORWARD", flag(activation.is_some())),
            ("ACTIVATION_BACKWARD", flag(activation_grad.is_some())),
            ("STORE_PRE", flag(pre.is_some())),
            ("A_F16", flag(f16[0])),
            ("B_F16", flag(f16[1])),
            ("TRANS_A", flag(trans_a)),
            ("TRANS_B", flag(trans_b)),
        ];
        // Only the entries whose loops differ per form take TRANS_A /
        // TRANS_B; the others read the form's strides at run time, so the
        // register kernel a RegisterVec4 product falls back to (f16
        // operands, shapes off 4) shares Register's pipelines rather than
        // compiling the same code again for each form.
        let specialised = [
            MATMUL_FORWARD_SHARED,
            MATMUL_FORWARD_SHARED_VEC4,
            MATMUL_FORWARD_REGISTER_VEC4,
        ]
        .contains(&kernel);
        // The matrix-vector kernel is compiled per bucket of row counts
        // instead.
        let lanes = match pick {
            Pick::Matvec { lanes } => f64::from(lanes),
            Pick::Variant(_) => 0.0,
        };
        let with_rows = [
            &constants[..5],
            &[("MATVEC_ROWS", matvec_rows_bucket(rows) as f64), ("MATVEC_WG", lanes)],
        ]
        .concat();
        let constants = match pick {
            Pick::Matvec { .. } => &with_rows[..],
            Pick::Variant(_) if specialised => &constants[..],
            Pick::Variant(_) => &constants[..7],
        };
        // Every slot is in the layout whatever the overrides say; unused
        // read-only slots hold a placeholder the kernel never reads, and an
        // unused `pre` a writable one of its own (a writable binding may not
        // alias another, so not C).
        let placeholder = View {
            buffer: self.placeholder(),
            offset: 0,
            len: 1,
        };
        // Tiles of one product over x and y, the batch over z; the
        // matrix-vector kernel has a workgroup per 8 columns.
        let groups = match pick {
            Pick::Variant(_) => u64::from(product.tiles_total),
            Pick::Matvec { .. } => cols.div_ceil(MATVEC_COLUMNS) as u64,
        };
        let [x, y, _] = self.grid(op, groups)?;
        let max_z = self.device().limits().max_compute_workgroups_per_dimension;
        let z = u32::try_from(batch).ok().filter(|&z| z <= max_z).ok_or_else(|| {
            Error::shape(
                op,
                format!("a batch of {batch} products is over this adapter's max_compute_workgroups_per_dimension ({max_z}); split the batch"),
                &[&[batch, m, k], &[batch, k, n]],
            )
        })?;
        // Each operand in the binding of its type, a placeholder in the
        // other; the f16 slots only for the entries reading through them.
        let typed = |half: bool, view: View<'v>| if half { (placeholder, view) } else { (view, placeholder) };
        let (a32, a16) = typed(f16[0], a_bind.0);
        let (b32, b16) = typed(f16[1], b_bind.0);
        let mut bindings = vec![
            bind(0, "a", a32),
            bind(1, "b", b32),
            bind(2, "c", c_bind.0),
            bind(4, "bias", bias.unwrap_or(placeholder)),
            bind(5, "pre", pre_bind.map_or(self.unused_writable(0), |p| p.0)),
            bind(6, "act_input", act_bind.map_or(placeholder, |p| p.0)),
        ];
        if reflect::entry_needs(kernel)?.slots.iter().any(|s| s.slot == 7) {
            bindings.extend([bind(7, "a_h", a16), bind(8, "b_h", b16)]);
        }
        self.prepare_grid(kernel, constants, &bindings, 3, &params, [x, y, z])
    }
}
