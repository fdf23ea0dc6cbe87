//! `f16_weights.wgsl`: generation with weights stored in f16 and
//! activations in f32 (needs SHADER_F16; [`Error::Unsupported`] before
//! anything is compiled elsewhere). C = A·Bᵀ with A [m, k] f32 and B
//! [n, k] f16 (a Linear layer's weight, the tied head), on a matrix-vector
//! kernel for decode's few rows and a tiled one otherwise, with the
//! forward epilogue; and the embedding lookup from an f16 table. Each f16
//! is widened exactly to f32 as it is loaded, so the results are the f32
//! kernels' on the weights rounded to f16.
//!
//! An f16 operand larger than one storage binding (a vocabulary past
//! ~87k tokens at 768 channels) splits, as the f32 kernels' do: the
//! product by blocks of B's rows (C's columns), the lookup by ranges of
//! table rows. A and C must each fit one binding.

use super::matmul::matvec_rows_bucket;
use super::matmul::{ProductParams, MATVEC_COLUMNS, SMALL_MATMUL_WORK, TILE};
use super::matmul_ext::F16View;
use super::registry::{entry_points, Kernel};
use super::rowwise::RowPartLayout;
use super::{bind, dim, flat_groups, Dispatch, Kernels, MatmulEpilogue, View, MATVEC_MAX_ROWS};
use crate::error::{Error, Result};

entry_points! {
    F16Weights {
        MATVEC_F16W_FORWARD = "matvec_f16w_forward",
        MATMUL_F16W_FORWARD_SMALL = "matmul_f16w_forward_small",
        MATMUL_F16W_FORWARD_REGISTER = "matmul_f16w_forward_register",
        MATMUL_F16W_FORWARD_SHARED = "matmul_f16w_forward_shared",
        MATMUL_F16W_FORWARD_SHARED_VEC = "matmul_f16w_forward_shared_vec",
        EMBEDDING_F16W_FORWARD = "embedding_f16w_forward",
    }
}

/// Which kernel of `f16_weights.wgsl` a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F16WeightsKernel {
    /// `matvec_f16w_forward` with this many lanes per workgroup (a power
    /// of two from 8 to 64): decode's 1 to [`MATVEC_MAX_ROWS`] rows.
    Matvec { lanes: u32 },
    /// `matmul_f16w_forward_small`: 8×8 per invocation, quick to compile.
    Small,
    /// `matmul_f16w_forward_register`: 32×16 per invocation (prefill on a
    /// CPU adapter, where storage loads are issued lane by lane and
    /// multiply-adds per load decide speed).
    Register,
    /// `matmul_f16w_forward_shared`: workgroup-memory tiles, 8×4 per
    /// invocation (prefill on a GPU, where Register's 512 accumulators per
    /// invocation would spill).
    Shared,
}

impl F16WeightsKernel {
    /// The kernel for an m×n×k product: the matrix-vector one with `lanes`
    /// where `matvec_runs` (1 to [`MATVEC_MAX_ROWS`] rows, k a multiple of
    /// 8, aligned operands), else the small tiled kernel up to
    /// [`SMALL_MATMUL_WORK`] multiply-adds, and above it the register one
    /// on a CPU adapter and the workgroup-memory one on a GPU (`gpu`).
    /// [`Kernels::f16_weights_kernel_for`] asks it for its adapter; tests
    /// ask it for the other kind, which the software adapters cannot be.
    pub fn for_shape(gpu: bool, lanes: u32, matvec_runs: bool, m: usize, n: usize, k: usize) -> Self {
        if matvec_runs {
            F16WeightsKernel::Matvec { lanes }
        } else if m.saturating_mul(n).saturating_mul(k) <= SMALL_MATMUL_WORK {
            F16WeightsKernel::Small
        } else if gpu {
            F16WeightsKernel::Shared
        } else {
            F16WeightsKernel::Register
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct F16wParams {
    product: ProductParams,
    b_base: u32,
    c_base: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct EmbeddingParams {
    n: u32,
    cols: u32,
    vocab: u32,
    row_start: u32,
    row_end: u32,
    table_base: u32,
    _pad: [u32; 2],
}

/// Where values `start..start + len` of an f16 operand bind: the words
/// holding them, from the nearest storage-offset-aligned word, and the
/// first value's index in that binding (in f16 values).
fn f16_part<'a>(k: &Kernels, words: View<'a>, start: usize, len: usize) -> (View<'a>, usize) {
    let first_word = start / 2;
    let end_word = (start + len).div_ceil(2);
    let (binding, base) = k.bind_part(words, first_word, end_word - first_word);
    (binding, 2 * base + start % 2)
}

impl Kernels {
    /// The kernel an f16 weight's product ([`super::MatmulOperand::F16Weight`]) runs for an m×n×k
    /// product ([`F16WeightsKernel::for_shape`] for this adapter): the
    /// matrix-vector one for 1 to [`MATVEC_MAX_ROWS`] rows when k is a
    /// multiple of 8 and A and B start 16-byte aligned (it reads 16 bytes
    /// at a time, 8 weights) on an adapter whose storage offsets are too
    /// (as [`Kernels::matvec_runs`] for f32), with
    /// [`Kernels::matvec_lanes`]; else the small tiled kernel up to
    /// [`SMALL_MATMUL_WORK`] multiply-adds, and above it the register one on
    /// a CPU adapter and the workgroup-memory one on a GPU.
    pub fn f16_weights_kernel_for(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &View<'_>,
        b: &F16View<'_>,
    ) -> F16WeightsKernel {
        F16WeightsKernel::for_shape(
            self.gpu_shaped(),
            self.matvec_lanes(),
            self.f16_matvec_runs(m, k, a, b),
            m,
            n,
            k,
        )
    }

    /// Whether the f16 matrix-vector kernel can run an m-row product over
    /// k with these operands (see [`Kernels::f16_weights_kernel_for`]).
    fn f16_matvec_runs(&self, m: usize, k: usize, a: &View<'_>, b: &F16View<'_>) -> bool {
        let offsets_aligned = self.device().limits().min_storage_buffer_offset_alignment % 16 == 0;
        let aligned = a.offset % 16 == 0 && b.words().offset % 16 == 0 && offsets_aligned;
        (1..=MATVEC_MAX_ROWS).contains(&m) && k % 8 == 0 && aligned
    }

    /// C[m,n] (f32) = epilogue(A·Bᵀ) with A [m, k] f32 and B [n, k] stored
    /// as f16 ([`super::MatmulOperand::F16Weight`]): a Linear layer (or the
    /// tied head) whose weight is f16, multiplied and summed in f32, on
    /// `kernel` (the matrix-vector one refuses what it cannot run). The
    /// epilogue may add a bias and apply an activation (keeping the
    /// pre-activation); accumulation and activation gradients are
    /// training's and are refused. Needs SHADER_F16; [`Error::Unsupported`]
    /// without it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_f16_weights(
        &self,
        kernel: F16WeightsKernel,
        epilogue: MatmulEpilogue<'_>,
        c: View<'_>,
        a: View<'_>,
        b: F16View<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let entry = match kernel {
            F16WeightsKernel::Matvec { .. } => MATVEC_F16W_FORWARD,
            F16WeightsKernel::Small => MATMUL_F16W_FORWARD_SMALL,
            F16WeightsKernel::Register => MATMUL_F16W_FORWARD_REGISTER,
            F16WeightsKernel::Shared => MATMUL_F16W_FORWARD_SHARED,
        };
        let op = entry.entry;
        // First, so a missing feature is always reported as Unsupported.
        self.require_family(entry)?;
        let shapes: [&[usize]; 3] = [&[m, k], &[n, k], &[m, n]];
        if m == 0 || n == 0 || k == 0 {
            return Err(Error::shape(op, "every dimension must be at least 1", &shapes));
        }
        let len = |x: usize, y: usize| x.checked_mul(y);
        if len(m, k) != Some(a.len) || len(n, k) != Some(b.len()) || len(m, n) != Some(c.len) {
            let want = |x: usize, y: usize| {
                len(x, y).map_or_else(|| "an overflowing number of".to_string(), |v| v.to_string())
            };
            return Err(Error::shape(
                op,
                format!(
                    "A·Bᵀ with m={m} n={n} k={k} needs A, B, C of {}, {}, {} values; got {}, {}, {}",
                    want(m, k),
                    want(n, k),
                    want(m, n),
                    a.len,
                    b.len(),
                    c.len
                ),
                &shapes,
            ));
        }
        let pre = epilogue.forward_only(op, "f16 weights", (m, n, k))?;
        let MatmulEpilogue { bias, activation, .. } = epilogue;
        if let F16WeightsKernel::Matvec { lanes } = kernel {
            // Lane c stores column c of the workgroup's 8.
            if !(lanes.is_power_of_two() && (8..=64).contains(&lanes)) {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("{lanes} lanes: a power of two from 8 to 64"),
                });
            }
            if !self.f16_matvec_runs(m, k, &a, &b) {
                return Err(Error::shape(
                    op,
                    format!("takes 1 to {MATVEC_MAX_ROWS} rows, k a multiple of 8 and 16-byte aligned operands; got m={m} k={k}, A at byte {}, B at byte {}", a.offset, b.words().offset),
                    &shapes,
                ));
            }
        }
        // A and C (and pre, indexed like C) bind whole or in blocks of C's
        // columns; B in the matching blocks of its rows.
        let limit = self.binding_limit();
        if a.bytes() > limit {
            return Err(self.binding_too_large(op, "a (the activations, which do not split)", a.bytes()));
        }
        let cap = self.part_capacity();
        let oversize = c.bytes() > limit || pre.is_some_and(|p| p.bytes() > limit) || b.words().bytes() > limit;
        let cols = if oversize {
            // B's block: cols·k values in ≤ cols·k / 2 + 1 words; C's:
            // (m − 1)·n + cols values from its first column.
            let by_b = (2 * cap).saturating_sub(2) / k;
            let by_c = cap.saturating_sub((m - 1) * n);
            let cols = by_b.min(by_c).min(n);
            if cols == 0 {
                let (operand, bytes) = if by_b == 0 {
                    ("b (one row of it)", k as u64 * 2)
                } else {
                    ("c (its rows do not split)", c.bytes())
                };
                return Err(self.binding_too_large(op, operand, bytes));
            }
            // Whole tiles (and matrix-vector workgroups) per launch.
            let unit = if matches!(kernel, F16WeightsKernel::Matvec { .. }) {
                MATVEC_COLUMNS
            } else {
                TILE
            };
            if cols > unit {
                cols / unit * unit
            } else {
                cols
            }
        } else {
            n
        };
        let act = activation.map(|(act, _)| act);
        let launches = (0..n)
            .step_by(cols)
            .map(|n0| {
                let cols = cols.min(n - n0);
                let whole = cols == n;
                let (b_bind, b_base) = if whole {
                    (b.words(), 0)
                } else {
                    f16_part(self, b.words(), n0 * k, cols * k)
                };
                let c_range = (n0, (m - 1) * n + cols);
                let (c_bind, c_base) = if whole {
                    (c, 0)
                } else {
                    self.bind_part(c, c_range.0, c_range.1)
                };
                let pre_bind = match pre {
                    Some(p) if !whole => Some(self.bind_like_c(op, p, c_range, c_base)?),
                    other => other,
                };
                let params = F16wParams {
                    product: ProductParams::new(op, (m, cols, k), n, n0, act)?,
                    b_base: dim(op, b_base)?,
                    c_base: dim(op, c_base)?,
                    _pad: [0; 2],
                };
                // The workgroup-memory kernel's vector loads read A in
                // vec4s and B 8 weights (16 bytes) at a time.
                let vectors = k % 8 == 0 && a.offset % 16 == 0 && b_base % 8 == 0 && b_bind.offset % 16 == 0;
                let entry = if kernel == F16WeightsKernel::Shared && vectors {
                    MATMUL_F16W_FORWARD_SHARED_VEC
                } else {
                    entry
                };
                self.f16_weights_launch(
                    entry,
                    kernel,
                    (bias, activation.is_some(), pre_bind),
                    [c_bind, a, b_bind],
                    &params,
                    m,
                    cols,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no columns", &shapes))
    }

    /// One launch of a product over `cols` columns.
    #[allow(clippy::too_many_arguments)]
    fn f16_weights_launch(
        &self,
        entry: Kernel,
        kernel: F16WeightsKernel,
        (bias, activation, pre): (Option<View<'_>>, bool, Option<View<'_>>),
        [c, a, b]: [View<'_>; 3],
        params: &F16wParams,
        m: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let flag = |on: bool| f64::from(u8::from(on));
        let mut constants = vec![
            ("HAS_BIAS", flag(bias.is_some())),
            ("ACTIVATION_FORWARD", flag(activation)),
            ("STORE_PRE", flag(pre.is_some())),
        ];
        let groups = match kernel {
            F16WeightsKernel::Matvec { lanes } => {
                // A pipeline per bucket of row counts, as the f32
                // matrix-vector kernel.
                constants.extend([
                    ("MATVEC_ROWS", matvec_rows_bucket(m) as f64),
                    ("MATVEC_WG", f64::from(lanes)),
                ]);
                cols.div_ceil(MATVEC_COLUMNS) as u64
            }
            F16WeightsKernel::Small | F16WeightsKernel::Register | F16WeightsKernel::Shared => {
                u64::from(params.product.tiles_total)
            }
        };
        // Unused read-only slots hold a placeholder the kernel never reads;
        // an unused `pre` a writable one of its own (not C: a writable
        // binding may alias no other).
        let placeholder = View {
            buffer: self.placeholder(),
            offset: 0,
            len: 1,
        };
        self.prepare(
            entry,
            &constants,
            &[
                bind(0, "a", a),
                bind(1, "b", b),
                bind(2, "c", c),
                bind(4, "bias", bias.unwrap_or(placeholder)),
                bind(5, "pre", pre.unwrap_or(self.unused_writable(0))),
            ],
            3,
            params,
            groups,
        )
    }

    /// out[n, channels] (f32) = table[ids[i], :] for an f16 table
    /// [vocab, channels] and u32 ids [n]: the token embedding of a model
    /// stored in f16. An id ≥ vocab gives a row of NaN, as
    /// [`Kernels::embedding_forward`] (check ids with
    /// [`super::check_token_ids`] where the host has them). Needs
    /// SHADER_F16; [`Error::Unsupported`] without it.
    pub fn embedding_f16_weights(
        &self,
        out: View<'_>,
        table: F16View<'_>,
        ids: View<'_>,
        n: usize,
        vocab: usize,
        channels: usize,
    ) -> Result<Dispatch> {
        let kernel = EMBEDDING_F16W_FORWARD;
        let op = kernel.entry;
        self.require_family(kernel)?;
        let shapes: [&[usize]; 3] = [&[vocab, channels], &[n], &[n, channels]];
        if n == 0 || vocab == 0 || channels == 0 {
            return Err(Error::shape(
                op,
                format!("n, vocab and channels must not be 0 (n = {n}, vocab = {vocab}, channels = {channels})"),
                &shapes,
            ));
        }
        if Some(out.len) != n.checked_mul(channels) || Some(table.len()) != vocab.checked_mul(channels) || ids.len != n
        {
            return Err(Error::shape(
                op,
                format!("out, table and ids must hold n·channels, vocab·channels and n values; got {}, {}, {} (n = {n}, vocab = {vocab}, channels = {channels})", out.len, table.len(), ids.len),
                &shapes,
            ));
        }
        // A part's values, in the words that hold them (two per word).
        let layout = RowPartLayout {
            op,
            name: "table (one row of it)",
            vocab,
            channels,
            value_bytes: 2,
            values_per_part: (2 * self.part_capacity()).saturating_sub(2),
        };
        let parts = self.row_parts(table.words(), layout, |start, len| {
            f16_part(self, table.words(), start, len)
        })?;
        let launches = parts
            .into_iter()
            .map(|part| {
                let params = EmbeddingParams {
                    n: dim(op, n)?,
                    cols: dim(op, channels)?,
                    vocab: dim(op, vocab)?,
                    row_start: dim(op, part.rows.0)?,
                    row_end: dim(op, part.rows.1)?,
                    table_base: dim(op, part.base)?,
                    _pad: [0; 2],
                };
                self.prepare(
                    kernel,
                    &[],
                    &[bind(6, "table", part.binding), bind(7, "ids", ids), bind(8, "out", out)],
                    9,
                    &params,
                    flat_groups(out.len),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no table rows", &shapes))
    }
}
