//! `quant_weights.wgsl`: generation with block-quantized weights (ggml's
//! Q8_0, Q4_0, Q4_1, as a GGUF file stores them) decoded inside the
//! kernels, activations in f32. C = A·Bᵀ with A [m, k] f32 and B [n, k]
//! quantized (a Linear layer's weight, the tied head), on a matrix-vector
//! kernel for decode's few rows and a tiled one otherwise, with the
//! forward epilogue; and the embedding lookup from a quantized table.
//! Core WGSL only: every adapter runs them.
//!
//! The weights are in [`pack_quantized`]'s layout (a [`QuantView`]): the
//! quantized words of every block, then a scale word per block. An operand
//! larger than one storage binding splits by rows, as the f16 kernels'
//! do: the product by blocks of B's rows (C's columns), the lookup by
//! ranges of table rows; each part binds its quantized words and its
//! scale words separately. A and C must each fit one binding.
//!
//! [`pack_quantized`]: crate::ops::pack_quantized

use super::matmul::{ProductParams, MATVEC_COLUMNS, TILE};
use super::registry::{entry_points, Kernel};
use super::{bind, dim, flat_groups, Dispatch, Kernels, MatmulEpilogue, View, MATVEC_MAX_ROWS};
use crate::error::{Error, Result};
use crate::ops::QuantFormat;

entry_points! {
    QuantWeights {
        MATVEC_QUANT_FORWARD = "matvec_quant_forward",
        MATVEC_QUANT_FORWARD_COLUMNS = "matvec_quant_forward_columns",
        MATMUL_QUANT_FORWARD = "matmul_quant_forward",
        EMBEDDING_QUANT_FORWARD = "embedding_quant_forward",
    }
}

/// A block-quantized matrix [rows, cols] in the kernels' layout
/// ([`crate::ops::pack_quantized`]): `words` holds
/// [`QuantFormat::stored_words`]`(rows · cols)` words.
#[derive(Clone, Copy, Debug)]
pub struct QuantView<'a> {
    words: View<'a>,
    format: QuantFormat,
    rows: usize,
    cols: usize,
}

impl<'a> QuantView<'a> {
    /// `words` holding a [rows, cols] `format` matrix; cols a multiple of
    /// [`QuantFormat::BLOCK`].
    pub fn new(words: View<'a>, format: QuantFormat, rows: usize, cols: usize) -> Result<Self> {
        const OP: &str = "QuantView::new";
        format.check_shape(OP, rows, cols)?;
        let want = rows.checked_mul(cols).map(|len| format.stored_words(len));
        if want != Some(words.len) {
            return Err(Error::shape(OP, format!("[{rows}, {cols}] in {} takes {} words per block of 32 values; the view has {} words", format.name(), format.quant_words() + 1, words.len), &[&[rows, cols], &[words.len]]));
        }
        Ok(QuantView { words, format, rows, cols })
    }

    pub fn words(&self) -> View<'a> {
        self.words
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / QuantFormat::BLOCK
    }

    /// Whether the quantized words start 16-byte aligned (the
    /// matrix-vector kernel's vector loads).
    fn aligned(&self) -> bool {
        self.words.offset % 16 == 0
    }
}

/// Rows `r0..r1` of a [`QuantView`] as a launch binds them: its quantized
/// words and its scale words, each from the nearest storage-offset-aligned
/// word before them, and where the part's first block starts in each.
struct QuantRows<'a> {
    quants: View<'a>,
    q_base: usize,
    scales: View<'a>,
    s_base: usize,
}

impl Kernels {
    fn quant_rows<'a>(&self, b: &QuantView<'a>, (r0, r1): (usize, usize)) -> QuantRows<'a> {
        let kb = b.blocks_per_row();
        let qw = b.format.quant_words();
        let all_quants = b.rows * kb * qw;
        let (quants, q_base) = self.bind_part(b.words, r0 * kb * qw, (r1 - r0) * kb * qw);
        let (scales, s_base) = self.bind_part(b.words, all_quants + r0 * kb, (r1 - r0) * kb);
        QuantRows { quants, q_base, scales, s_base }
    }

    /// Rows of a quantized matrix one part may hold, so that its quantized
    /// words fit a binding wherever the part starts (its scale words are
    /// fewer).
    fn quant_rows_per_part(&self, b: &QuantView<'_>) -> usize {
        self.part_capacity() / (b.blocks_per_row() * b.format.quant_words())
    }
}

/// Columns of C per workgroup of `matvec_quant_forward_columns` (the
/// shader's constant of that name): 8 lanes of 8 columns.
const QUANT_COLUMNS_PER_GROUP: usize = 64;

/// Which kernel of `quant_weights.wgsl` a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantWeightsKernel {
    /// `matvec_quant_forward` with this many lanes per workgroup (a power
    /// of two from 8 to 64): decode's 1 to [`MATVEC_MAX_ROWS`] rows.
    Matvec { lanes: u32 },
    /// `matvec_quant_forward_columns`: the same rows, 8 lanes each owning
    /// 8 columns and summing all of k (no sum over lanes): a CPU
    /// adapter's.
    MatvecColumns,
    /// `matmul_quant_forward`: 8×8 per invocation, any m.
    Tiled,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct QuantParams {
    product: ProductParams,
    q_base: u32,
    s_base: u32,
    c_base: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct QuantEmbeddingParams {
    n: u32,
    cols: u32,
    vocab: u32,
    row_start: u32,
    row_end: u32,
    q_base: u32,
    s_base: u32,
    _pad: u32,
}

impl Kernels {
    /// The kernel [`Kernels::matmul_quant_weights`] runs for an m-row
    /// product: for 1 to [`MATVEC_MAX_ROWS`] rows when A and B's words
    /// start 16-byte aligned on an adapter whose storage offsets are too
    /// (they are read 16 bytes at a time), a matrix-vector one — on a GPU
    /// the one splitting k over [`Kernels::matvec_lanes`] lanes, on a CPU
    /// adapter the one with a lane per 8 columns (3× its speed on
    /// lavapipe) — else the tiled one.
    pub fn quant_weights_kernel_for(&self, m: usize, a: &View<'_>, b: &QuantView<'_>) -> QuantWeightsKernel {
        if !self.quant_matvec_runs(m, a, b) {
            QuantWeightsKernel::Tiled
        } else if self.gpu_shaped() {
            QuantWeightsKernel::Matvec { lanes: self.matvec_lanes() }
        } else {
            QuantWeightsKernel::MatvecColumns
        }
    }

    fn quant_vectors_aligned(&self, a: &View<'_>) -> bool {
        self.device().limits().min_storage_buffer_offset_alignment % 16 == 0 && a.offset % 16 == 0
    }

    fn quant_matvec_runs(&self, m: usize, a: &View<'_>, b: &QuantView<'_>) -> bool {
        (1..=MATVEC_MAX_ROWS).contains(&m) && self.quant_vectors_aligned(a) && b.aligned()
    }

    /// C[m,n] (f32) = epilogue(A·Bᵀ) with A [m, k] f32 and B [n, k]
    /// block-quantized: a Linear layer (or the tied head) whose weight
    /// stays as a GGUF file stores it, decoded in the kernel and summed in
    /// f32. The kernel is picked by shape
    /// ([`Kernels::quant_weights_kernel_for`]). The epilogue may add a bias
    /// and apply an activation (keeping the pre-activation); accumulation
    /// and activation gradients are training's and are refused. A is read
    /// in vec4s: it must start 16-byte aligned, on an adapter whose storage
    /// offsets are too.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_quant_weights(&self, epilogue: MatmulEpilogue<'_>, c: View<'_>, a: View<'_>, b: QuantView<'_>, m: usize, n: usize, k: usize) -> Result<Dispatch> {
        let kernel = self.quant_weights_kernel_for(m, &a, &b);
        self.matmul_quant_weights_with(kernel, epilogue, c, a, b, m, n, k)
    }

    /// [`Kernels::matmul_quant_weights`] on an explicit kernel (tests); the
    /// matrix-vector one refuses what it cannot run.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_quant_weights_with(
        &self,
        kernel: QuantWeightsKernel,
        epilogue: MatmulEpilogue<'_>,
        c: View<'_>,
        a: View<'_>,
        b: QuantView<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let entry = match kernel {
            QuantWeightsKernel::Matvec { .. } => MATVEC_QUANT_FORWARD,
            QuantWeightsKernel::MatvecColumns => MATVEC_QUANT_FORWARD_COLUMNS,
            QuantWeightsKernel::Tiled => MATMUL_QUANT_FORWARD,
        };
        let op = entry.entry;
        let shapes: [&[usize]; 3] = [&[m, k], &[n, k], &[m, n]];
        if m == 0 || n == 0 || k == 0 {
            return Err(Error::shape(op, "every dimension must be at least 1", &shapes));
        }
        b.format.check_shape(op, n, k)?;
        let len = |x: usize, y: usize| x.checked_mul(y);
        if len(m, k) != Some(a.len) || (b.rows, b.cols) != (n, k) || len(m, n) != Some(c.len) {
            return Err(Error::shape(
                op,
                format!("A·Bᵀ with m={m} n={n} k={k} needs A [m, k], B [n, k], C [m, n]; got A of {} values, B [{}, {}], C of {} values", a.len, b.rows, b.cols, c.len),
                &shapes,
            ));
        }
        let pre = epilogue.forward_only(op, "quantized weights", (m, n, k))?;
        let MatmulEpilogue { bias, activation, .. } = epilogue;
        if !self.quant_vectors_aligned(&a) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "reads A in vec4s: A must start 16-byte aligned on an adapter whose storage offset alignment is a multiple of 16; A starts at byte {}, the alignment is {} B",
                    a.offset,
                    self.device().limits().min_storage_buffer_offset_alignment
                ),
            });
        }
        if let QuantWeightsKernel::Matvec { lanes } = kernel {
            // Lane c stores column c of the workgroup's 8.
            if !(lanes.is_power_of_two() && (8..=64).contains(&lanes)) {
                return Err(Error::InvalidArgument { op, reason: format!("{lanes} lanes: a power of two from 8 to 64") });
            }
        }
        if matches!(kernel, QuantWeightsKernel::Matvec { .. } | QuantWeightsKernel::MatvecColumns) && !self.quant_matvec_runs(m, &a, &b) {
            return Err(Error::shape(op, format!("takes 1 to {MATVEC_MAX_ROWS} rows and B's words 16-byte aligned; got m={m}, B at byte {}", b.words.offset), &shapes));
        }
        // A and C (and pre, indexed like C) bind whole or in blocks of C's
        // columns; B in the matching blocks of its rows.
        let limit = self.binding_limit();
        if a.bytes() > limit {
            return Err(self.binding_too_large(op, "a (the activations, which do not split)", a.bytes()));
        }
        let oversize = c.bytes() > limit || pre.is_some_and(|p| p.bytes() > limit) || b.words.bytes() > limit;
        let cols = if oversize {
            let by_b = self.quant_rows_per_part(&b);
            let by_c = self.part_capacity().saturating_sub((m - 1) * n);
            let cols = by_b.min(by_c).min(n);
            if cols == 0 {
                let (operand, bytes) = if by_b == 0 { ("b (one row of it)", (k / QuantFormat::BLOCK * b.format.quant_words() * 4) as u64) } else { ("c (its rows do not split)", c.bytes()) };
                return Err(self.binding_too_large(op, operand, bytes));
            }
            // Whole tiles (and matrix-vector workgroups) per launch.
            let unit = match kernel {
                QuantWeightsKernel::Matvec { .. } => MATVEC_COLUMNS,
                QuantWeightsKernel::MatvecColumns => QUANT_COLUMNS_PER_GROUP,
                QuantWeightsKernel::Tiled => TILE,
            };
            if cols > unit { cols / unit * unit } else { cols }
        } else {
            n
        };
        let act = activation.map(|(act, _)| act);
        let launches = (0..n)
            .step_by(cols)
            .map(|n0| {
                let cols = cols.min(n - n0);
                let whole = cols == n;
                let rows = self.quant_rows(&b, (n0, n0 + cols));
                let c_range = (n0, (m - 1) * n + cols);
                let (c_bind, c_base) = if whole { (c, 0) } else { self.bind_part(c, c_range.0, c_range.1) };
                let pre_bind = match pre {
                    Some(p) if !whole => Some(self.bind_like_c(op, p, c_range, c_base)?),
                    other => other,
                };
                let params = QuantParams {
                    product: ProductParams::new(op, (m, cols, k), n, n0, act)?,
                    q_base: dim(op, rows.q_base)?,
                    s_base: dim(op, rows.s_base)?,
                    c_base: dim(op, c_base)?,
                    _pad: 0,
                };
                self.quant_weights_launch(entry, kernel, b.format, (bias, activation.is_some(), pre_bind), [c_bind, a, rows.quants, rows.scales], &params, m, cols)
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no columns", &shapes))
    }

    /// One launch of a product over `cols` columns.
    #[allow(clippy::too_many_arguments)]
    fn quant_weights_launch(
        &self,
        entry: Kernel,
        kernel: QuantWeightsKernel,
        format: QuantFormat,
        (bias, activation, pre): (Option<View<'_>>, bool, Option<View<'_>>),
        [c, a, quants, scales]: [View<'_>; 4],
        params: &QuantParams,
        m: usize,
        cols: usize,
    ) -> Result<Dispatch> {
        let flag = |on: bool| f64::from(u8::from(on));
        let mut constants = vec![
            ("QUANT_FORMAT", f64::from(format.code())),
            ("HAS_BIAS", flag(bias.is_some())),
            ("ACTIVATION_FORWARD", flag(activation)),
            ("STORE_PRE", flag(pre.is_some())),
        ];
        let groups = match kernel {
            QuantWeightsKernel::Matvec { lanes } => {
                // A pipeline per row count, as the f32 matrix-vector kernel.
                constants.extend([("MATVEC_ROWS", m as f64), ("MATVEC_WG", f64::from(lanes))]);
                cols.div_ceil(MATVEC_COLUMNS) as u64
            }
            QuantWeightsKernel::MatvecColumns => {
                constants.push(("MATVEC_ROWS", m as f64));
                cols.div_ceil(QUANT_COLUMNS_PER_GROUP) as u64
            }
            QuantWeightsKernel::Tiled => u64::from(params.product.tiles_total),
        };
        // Unused read-only slots hold a placeholder the kernel never reads;
        // an unused `pre` a writable one of its own (not C: a writable
        // binding may alias no other).
        let placeholder = View { buffer: self.placeholder(), offset: 0, len: 1 };
        self.prepare(
            entry,
            &constants,
            &[
                bind(0, "a", a),
                bind(1, "b (quantized words)", quants),
                bind(2, "b (scales)", scales),
                bind(3, "c", c),
                bind(5, "bias", bias.unwrap_or(placeholder)),
                bind(6, "pre", pre.unwrap_or(self.unused_writable(0))),
            ],
            4,
            params,
            groups,
        )
    }

    /// out[n, channels] (f32) = table[ids[i], :] for a block-quantized
    /// table [vocab, channels] and u32 ids [n]: the token embedding of a
    /// model whose table stays quantized. An id ≥ vocab gives a row of
    /// NaN, as [`Kernels::embedding_forward`] (check ids with
    /// [`super::check_token_ids`] where the host has them).
    pub fn embedding_quant_weights(&self, out: View<'_>, table: QuantView<'_>, ids: View<'_>, n: usize) -> Result<Dispatch> {
        let kernel = EMBEDDING_QUANT_FORWARD;
        let op = kernel.entry;
        let (vocab, channels) = (table.rows, table.cols);
        let shapes: [&[usize]; 3] = [&[vocab, channels], &[n], &[n, channels]];
        if n == 0 || Some(out.len) != n.checked_mul(channels) || ids.len != n {
            return Err(Error::shape(op, format!("out and ids must hold n·channels and n ≥ 1 values; got {} and {} (n = {n}, channels = {channels})", out.len, ids.len), &shapes));
        }
        let parts: Vec<(usize, usize)> = if table.words.bytes() <= self.binding_limit() {
            vec![(0, vocab)]
        } else {
            let per_part = self.quant_rows_per_part(&table);
            if per_part == 0 {
                return Err(self.binding_too_large(op, "table (one row of it)", (table.blocks_per_row() * table.format.quant_words() * 4) as u64));
            }
            (0..vocab).step_by(per_part).map(|r0| (r0, (r0 + per_part).min(vocab))).collect()
        };
        let launches = parts
            .into_iter()
            .map(|(r0, r1)| {
                let rows = self.quant_rows(&table, (r0, r1));
                let params = QuantEmbeddingParams {
                    n: dim(op, n)?,
                    cols: dim(op, channels)?,
                    vocab: dim(op, vocab)?,
                    row_start: dim(op, r0)?,
                    row_end: dim(op, r1)?,
                    q_base: dim(op, rows.q_base)?,
                    s_base: dim(op, rows.s_base)?,
                    _pad: 0,
                };
                self.prepare(
                    kernel,
                    &[("QUANT_FORMAT", f64::from(table.format.code()))],
                    &[bind(7, "table (quantized words)", rows.quants), bind(8, "table (scales)", rows.scales), bind(9, "ids", ids), bind(10, "out", out)],
                    11,
                    &params,
                    flat_groups(out.len),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no table rows", &shapes))
    }
}
