//! `quant_weights.wgsl`: generation with block-quantized weights (ggml's
//! Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the k-quants Q2_K..Q6_K, as a
//! GGUF file stores them) decoded inside the
//! kernels, activations in f32. C = A·Bᵀ with A [m, k] f32 and B [n, k]
//! quantized (a Linear layer's weight, the tied head), on a matrix-vector
//! kernel for decode's few rows and a tiled one otherwise, with the
//! forward epilogue; and the embedding lookup from a quantized table.
//! Core WGSL only: every adapter runs them.
//!
//! The weights are in [`pack_quantized`]'s layout (a [`QuantView`]): the
//! quantized words of every block, then its side words (scales, high
//! bits: [`QuantFormat::side_words`] per block). An operand
//! larger than one storage binding splits by rows, as the f16 kernels'
//! do: the product by blocks of B's rows (C's columns), the lookup by
//! ranges of table rows; each part binds its quantized words and its
//! scale words separately. A and C must each fit one binding.
//!
//! [`pack_quantized`]: crate::ops::pack_quantized

use super::matmul::{matvec_rows_bucket, ProductParams, MATVEC_COLUMNS, TILE};
use super::registry::{entry_points, Kernel};
use super::{bind, dim, flat_groups, Dispatch, Kernels, MatmulEpilogue, View, MATVEC_MAX_ROWS};
use crate::error::{Error, Result};
use crate::ops::Activation;
use crate::ops::QuantFormat;

entry_points! {
    QuantWeights {
        MATVEC_QUANT_FORWARD = "matvec_quant_forward",
        MATVEC_QUANT_FORWARD_COLUMNS = "matvec_quant_forward_columns",
        MATVEC_QUANT_FORWARD_ROWS = "matvec_quant_forward_rows",
        MATMUL_QUANT_FORWARD = "matmul_quant_forward",
        EMBEDDING_QUANT_FORWARD = "embedding_quant_forward",
        MATMUL_QUANT_TRANSPOSED = "matmul_quant_transposed",
    }
    QuantWeightsSubgroup {
        MATVEC_QUANT_FORWARD_ROWS_SUBGROUP = "matvec_quant_forward_rows_subgroup",
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
            let per_block = format.quant_words() + format.side_words();
            let reason = format!(
                "[{rows}, {cols}] in {} takes {per_block} words per block of 32 values; the view has {} words",
                format.name(),
                words.len
            );
            return Err(Error::shape(OP, reason, &[&[rows, cols], &[words.len]]));
        }
        Ok(QuantView {
            words,
            format,
            rows,
            cols,
        })
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
        let (qw, sw) = (b.format.quant_words(), b.format.side_words());
        let all_quants = b.rows * kb * qw;
        let (quants, q_base) = self.bind_part(b.words, r0 * kb * qw, (r1 - r0) * kb * qw);
        let (scales, s_base) = self.bind_part(b.words, all_quants + r0 * kb * sw, (r1 - r0) * kb * sw);
        QuantRows {
            quants,
            q_base,
            scales,
            s_base,
        }
    }

    /// Rows of a quantized matrix one part may hold, so that its quantized
    /// words fit a binding wherever the part starts (its scale words are
    /// fewer).
    fn quant_rows_per_part(&self, b: &QuantView<'_>) -> usize {
        self.part_capacity() / (b.blocks_per_row() * b.format.quant_words())
    }
}

/// Columns of C per workgroup of `matvec_quant_forward_columns` (the
/// shader's constant of that name): 8 lanes of 16 columns.
const QUANT_COLUMNS_PER_GROUP: usize = 128;

/// Which kernel of `quant_weights.wgsl` a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantWeightsKernel {
    /// `matvec_quant_forward` with this many lanes per workgroup (a power
    /// of two from 8 to 64): decode's 1 to [`MATVEC_MAX_ROWS`] rows.
    Matvec { lanes: u32 },
    /// `matvec_quant_forward_columns`: the same rows, 8 lanes each owning
    /// 16 columns and summing all of k (no sum over lanes): a CPU
    /// adapter's.
    MatvecColumns,
    /// `matmul_quant_forward`: 8×8 per invocation, any m.
    Tiled,
    /// `matvec_quant_forward_rows`: the columns kernel's lanes over 1 to
    /// [`QUANT_ROWS_MAX_ROWS`] rows (a continuous batch's decode step), each
    /// block of weights decoded once for every row: a CPU adapter's.
    MatvecRows,
    /// `matvec_quant_forward_rows_subgroup`: [`QuantWeightsKernel::MatvecRows`]
    /// with each row's block of A loaded once per workgroup and shared by
    /// subgroup broadcasts (SUBGROUP with 8-lane subgroups).
    MatvecRowsSubgroup,
}

/// The most rows `matvec_quant_forward_rows` takes (4 groups of 4).
pub const QUANT_ROWS_MAX_ROWS: usize = 16;

/// Rows of A per group of the rows kernels (the shader's `QUANT_ROW_GROUP`).
const QUANT_ROW_GROUP: usize = 4;

/// The `MATVEC_ROWS` override the rows kernels compile an m-row product
/// with: m rounded up to whole groups of 4 rows (4, 8, 12, 16), the
/// kernels' unit (a group's rows share its loads of A and its
/// accumulators), or 2 for 1 and 2 rows, m itself coming at run time. A
/// server's batches of 2 to 16 rows compile 5 pipelines, not 15; a batch
/// short of its bucket computes up to 3 rows it does not store. Two rows
/// keep a bucket of their own: computed as 4 their decode step took 30%
/// longer (SmolLM2 Q4_1 on lavapipe, 85 → 114 ms).
fn quant_rows_bucket(m: usize) -> usize {
    if m <= 2 {
        2
    } else {
        m.next_multiple_of(QUANT_ROW_GROUP)
    }
}

/// The fewest rows a CPU adapter runs on `matvec_quant_forward_rows`
/// rather than the columns kernel.
const QUANT_ROWS_MIN_ROWS: usize = 2;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct QuantParams {
    product: ProductParams,
    q_base: u32,
    s_base: u32,
    c_base: u32,
    _pad: u32,
    /// quant_weights.wgsl's parts of B (one matrix: [n; 4], zeros).
    part_end: [u32; 4],
    part_q: [u32; 4],
    part_s: [u32; 4],
}

/// What a launch's epilogue does besides [`MatmulEpilogue`]'s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LaunchMode {
    /// Multiply what C holds by the result.
    multiply_c: bool,
    /// The columns kernel's gated product (B's two parts G and U).
    gated: bool,
}

/// Output columns per workgroup of the gated `matvec_quant_forward_columns`
/// (the shader's `QUANT_GATED_COLUMNS_PER_GROUP`): 8 lanes of 8.
const QUANT_GATED_COLUMNS_PER_GROUP: usize = 64;
/// Columns of C per workgroup of the rows kernels (the shader's
/// `QUANT_ROWS_COLUMNS_PER_GROUP`, gated `QUANT_ROWS_GATED_…`): 8 lanes of 8, or of 4.
const QUANT_ROWS_COLUMNS_PER_GROUP: usize = 64;
const QUANT_ROWS_GATED_COLUMNS_PER_GROUP: usize = 32;

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
    /// The kernel a quantized weight's product ([`super::MatmulOperand::Quant`]) runs for an m-row
    /// product: for 1 to [`MATVEC_MAX_ROWS`] rows when A and B's words
    /// start 16-byte aligned on an adapter whose storage offsets are too
    /// (they are read 16 bytes at a time), a matrix-vector one — on a GPU
    /// the one splitting k over [`Kernels::matvec_lanes`] lanes, on a CPU
    /// adapter the one with a lane per 16 columns (3× its speed on
    /// lavapipe) — else the tiled one. A CPU adapter runs 2 to
    /// [`QUANT_ROWS_MAX_ROWS`] rows (a continuous batch's step) on the rows
    /// kernel, which decodes each block of weights once for all of them.
    pub fn quant_weights_kernel_for(&self, m: usize, a: &View<'_>, b: &QuantView<'_>) -> QuantWeightsKernel {
        // A CPU adapter's batched decode: the rows kernel.
        if !self.gpu_shaped() && m >= QUANT_ROWS_MIN_ROWS && self.quant_rows_runs(m, a, b) {
            return if self.supports_quant_rows_subgroup() {
                QuantWeightsKernel::MatvecRowsSubgroup
            } else {
                QuantWeightsKernel::MatvecRows
            };
        }
        if !self.quant_matvec_runs(m, a, b) {
            QuantWeightsKernel::Tiled
        } else if self.gpu_shaped() {
            QuantWeightsKernel::Matvec {
                lanes: self.matvec_lanes(),
            }
        } else {
            QuantWeightsKernel::MatvecColumns
        }
    }

    /// True when [`QuantWeightsKernel::MatvecRowsSubgroup`] runs here:
    /// SUBGROUP, with subgroups of exactly 8 lanes.
    pub fn supports_quant_rows_subgroup(&self) -> bool {
        self.require_family(MATVEC_QUANT_FORWARD_ROWS_SUBGROUP).is_ok()
    }

    fn quant_vectors_aligned(&self, a: &View<'_>) -> bool {
        self.device().limits().min_storage_buffer_offset_alignment % 16 == 0 && a.offset % 16 == 0
    }

    fn quant_matvec_runs(&self, m: usize, a: &View<'_>, b: &QuantView<'_>) -> bool {
        (1..=MATVEC_MAX_ROWS).contains(&m) && self.quant_vectors_aligned(a) && b.aligned()
    }

    fn quant_rows_runs(&self, m: usize, a: &View<'_>, b: &QuantView<'_>) -> bool {
        (1..=QUANT_ROWS_MAX_ROWS).contains(&m) && self.quant_vectors_aligned(a) && b.aligned()
    }

    /// C[m,n] (f32) = epilogue(A·Bᵀ) with A [m, k] f32 and B [n, k]
    /// block-quantized ([`super::MatmulOperand::Quant`]): a Linear layer (or
    /// the tied head) whose weight stays as a GGUF file stores it, decoded
    /// in the kernel and summed in f32, on `kernel` (the matrix-vector one
    /// refuses what it cannot run). The epilogue may add a bias and apply
    /// an activation (keeping the pre-activation); accumulation and
    /// activation gradients are training's and are refused. A is read in
    /// vec4s: it must start 16-byte aligned, on an adapter whose storage
    /// offsets are too.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_quant_weights(
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
            QuantWeightsKernel::MatvecRows => MATVEC_QUANT_FORWARD_ROWS,
            QuantWeightsKernel::MatvecRowsSubgroup => MATVEC_QUANT_FORWARD_ROWS_SUBGROUP,
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
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("{lanes} lanes: a power of two from 8 to 64"),
                });
            }
        }
        if matches!(
            kernel,
            QuantWeightsKernel::Matvec { .. } | QuantWeightsKernel::MatvecColumns
        ) && !self.quant_matvec_runs(m, &a, &b)
        {
            return Err(Error::shape(
                op,
                format!(
                    "takes 1 to {MATVEC_MAX_ROWS} rows and B's words 16-byte aligned; got m={m}, B at byte {}",
                    b.words.offset
                ),
                &shapes,
            ));
        }
        if kernel == QuantWeightsKernel::MatvecRowsSubgroup {
            self.require_family(MATVEC_QUANT_FORWARD_ROWS_SUBGROUP)?;
        }
        if matches!(
            kernel,
            QuantWeightsKernel::MatvecRows | QuantWeightsKernel::MatvecRowsSubgroup
        ) && !self.quant_rows_runs(m, &a, &b)
        {
            return Err(Error::shape(
                op,
                format!(
                    "takes 1 to {QUANT_ROWS_MAX_ROWS} rows and B's words 16-byte aligned; got m={m}, B at byte {}",
                    b.words.offset
                ),
                &shapes,
            ));
        }
        self.quant_launches(entry, kernel, epilogue, pre, c, (0, n), a, b, m, LaunchMode::default())
    }

    /// C (f32) = A·[B₀; B₁; …]ᵀ with A [m, k] f32 and the block-quantized
    /// `parts` B_i [n_i, k] (one format) side by side: C [m, Σ n_i], a
    /// product over q, k and v (or any matrices read by the same A) in one
    /// launch where the matrix-vector kernels run it and the parts lie in
    /// one binding's reach, else one launch per part. `gated` takes two
    /// parts G and U of equal rows and gives C [m, n] = silu(A·Gᵀ) ⊙
    /// (A·Uᵀ) (SwiGLU's hidden units): one launch on a CPU adapter's
    /// columns kernel, else two (the second multiplying C).
    pub(super) fn matmul_quant_parts(
        &self,
        c: View<'_>,
        a: View<'_>,
        parts: &[QuantView<'_>],
        m: usize,
        k: usize,
        gated: bool,
    ) -> Result<Dispatch> {
        const OP: &str = "matmul_quant_parts";
        let Some(first) = parts.first() else {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "no matrices".into(),
            });
        };
        let rows: Vec<usize> = parts.iter().map(|b| b.rows).collect();
        let n: usize = if gated { first.rows } else { rows.iter().sum() };
        let shapes: [&[usize]; 3] = [&[m, k], &rows, &[m, n]];
        if parts.len() > 4 || (gated && (parts.len() != 2 || rows[0] != rows[1])) {
            return Err(Error::shape(
                OP,
                "takes 1 to 4 matrices, or two of equal rows gated",
                &shapes,
            ));
        }
        if m == 0 || k == 0 || parts.iter().any(|b| b.cols != k || b.format != first.format) {
            return Err(Error::shape(
                OP,
                format!(
                    "every matrix must be [rows, k = {k}] in {}, and m ≥ 1",
                    first.format.name()
                ),
                &shapes,
            ));
        }
        if m.checked_mul(k) != Some(a.len) || m.checked_mul(n) != Some(c.len) {
            return Err(Error::shape(
                OP,
                format!(
                    "A must hold m·k = {m}·{k} values and C m·n = {m}·{n}; got {} and {}",
                    a.len, c.len
                ),
                &shapes,
            ));
        }
        if !self.quant_vectors_aligned(&a) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "reads A in vec4s: A must start 16-byte aligned; it starts at byte {}",
                    a.offset
                ),
            });
        }
        if let Some(launch) = self.quant_parts_launch(c, a, parts, m, k, gated)? {
            return Ok(launch);
        }
        // One launch per part, each on the kernel its shape takes.
        let part_launch = |epilogue: MatmulEpilogue<'_>, col0: usize, b: QuantView<'_>, mode: LaunchMode| {
            let kernel = self.quant_weights_kernel_for(m, &a, &b);
            let entry = match kernel {
                QuantWeightsKernel::Matvec { .. } => MATVEC_QUANT_FORWARD,
                QuantWeightsKernel::MatvecColumns => MATVEC_QUANT_FORWARD_COLUMNS,
                QuantWeightsKernel::MatvecRows => MATVEC_QUANT_FORWARD_ROWS,
                QuantWeightsKernel::MatvecRowsSubgroup => MATVEC_QUANT_FORWARD_ROWS_SUBGROUP,
                QuantWeightsKernel::Tiled => MATMUL_QUANT_FORWARD,
            };
            self.quant_launches(entry, kernel, epilogue, None, c, (col0, n), a, b, m, mode)
        };
        let plain = MatmulEpilogue::default();
        let launches = if gated {
            let silu = MatmulEpilogue {
                activation: Some((Activation::Silu, None)),
                ..plain
            };
            vec![
                part_launch(silu, 0, parts[0], LaunchMode::default())?,
                part_launch(
                    plain,
                    0,
                    parts[1],
                    LaunchMode {
                        multiply_c: true,
                        gated: false,
                    },
                )?,
            ]
        } else {
            let mut col0 = 0;
            parts
                .iter()
                .map(|b| {
                    let launch = part_launch(plain, col0, *b, LaunchMode::default());
                    col0 += b.rows;
                    launch
                })
                .collect::<Result<Vec<_>>>()?
        };
        Dispatch::chain(launches).ok_or_else(|| Error::shape(OP, "no matrices", &shapes))
    }

    /// `matmul_quant_parts` as one launch of a matrix-vector
    /// kernel, or None where it cannot be: more than decode's rows, a
    /// vector operand unaligned, the parts in different buffers or beyond
    /// one binding's reach, a part starting between blocks of another's
    /// binding, or a gated product off the columns kernel.
    fn quant_parts_launch(
        &self,
        c: View<'_>,
        a: View<'_>,
        parts: &[QuantView<'_>],
        m: usize,
        k: usize,
        gated: bool,
    ) -> Result<Option<Dispatch>> {
        const WORD: u64 = 4;
        let first = parts[0];
        let format = first.format;
        let kernel = self.quant_weights_kernel_for(m, &a, &first);
        let entry = match kernel {
            QuantWeightsKernel::Matvec { .. } if !gated => MATVEC_QUANT_FORWARD,
            QuantWeightsKernel::MatvecColumns => MATVEC_QUANT_FORWARD_COLUMNS,
            QuantWeightsKernel::MatvecRows => MATVEC_QUANT_FORWARD_ROWS,
            QuantWeightsKernel::MatvecRowsSubgroup => MATVEC_QUANT_FORWARD_ROWS_SUBGROUP,
            _ => return Ok(None),
        };
        let op = entry.entry;
        let same_buffer = parts
            .iter()
            .all(|b| std::ptr::eq(b.words.buffer, first.words.buffer) && b.aligned());
        if !same_buffer || c.bytes() > self.binding_limit() {
            return Ok(None);
        }
        // Each part's quantized words and side words, in words from the
        // buffer's start.
        let (qw, sw) = (format.quant_words(), format.side_words());
        let quants: Vec<(usize, usize)> = parts
            .iter()
            .map(|b| ((b.words.offset / WORD) as usize, b.rows * b.blocks_per_row() * qw))
            .collect();
        let scales: Vec<usize> = parts
            .iter()
            .zip(&quants)
            .map(|(_, &(start, len))| start + len)
            .collect();
        let span = |ranges: &mut dyn Iterator<Item = (usize, usize)>| {
            let (mut lo, mut hi) = (usize::MAX, 0);
            for (start, len) in ranges {
                (lo, hi) = (lo.min(start), hi.max(start + len));
            }
            (lo, hi)
        };
        let (q_lo, q_hi) = span(&mut quants.iter().copied());
        let side_len = |b: &QuantView<'_>| b.rows * b.blocks_per_row() * sw;
        let (s_lo, s_hi) = span(&mut parts.iter().zip(&scales).map(|(b, &start)| (start, side_len(b))));
        let whole = View {
            buffer: first.words.buffer,
            offset: 0,
            len: q_hi.max(s_hi),
        };
        let (quant_bind, q_base) = self.bind_part(whole, q_lo, q_hi - q_lo);
        let (scale_bind, s_base) = self.bind_part(whole, s_lo, s_hi - s_lo);
        let between_blocks = quants.iter().any(|&(start, _)| (start - q_lo) % qw != 0);
        if quant_bind.bytes() > self.binding_limit() || scale_bind.bytes() > self.binding_limit() || between_blocks {
            return Ok(None);
        }
        let (mut part_end, mut part_q, mut part_s) = ([0u32; 4], [0u32; 4], [0u32; 4]);
        let mut end = 0;
        for (i, b) in parts.iter().enumerate() {
            end += b.rows;
            part_end[i] = dim(op, end)?;
            part_q[i] = dim(op, (quants[i].0 - q_lo) / qw)?;
            part_s[i] = dim(op, scales[i] - s_lo)?;
        }
        part_end[parts.len()..].fill(dim(op, end)?);
        let n = if gated { first.rows } else { end };
        let params = QuantParams {
            product: ProductParams::new(op, (m, n, k), n, 0, None)?,
            q_base: dim(op, q_base)?,
            s_base: dim(op, s_base)?,
            c_base: 0,
            _pad: 0,
            part_end,
            part_q,
            part_s,
        };
        let mode = LaunchMode {
            multiply_c: false,
            gated,
        };
        self.quant_weights_launch(
            entry,
            kernel,
            format,
            (None, false, None),
            [c, a, quant_bind, scale_bind],
            &params,
            m,
            n,
            mode,
        )
        .map(Some)
    }

    /// The launches of C[:, c_col0 .. c_col0 + n] (C's rows `ldc` wide;
    /// n = B's rows) = epilogue(A·Bᵀ), or that times what C holds
    /// (`mode.multiply_c`). A and C (and pre, indexed like C) bind whole
    /// or in blocks of C's columns; B in the matching blocks of its rows.
    #[allow(clippy::too_many_arguments)]
    fn quant_launches(
        &self,
        entry: Kernel,
        kernel: QuantWeightsKernel,
        epilogue: MatmulEpilogue<'_>,
        pre: Option<View<'_>>,
        c: View<'_>,
        (c_col0, ldc): (usize, usize),
        a: View<'_>,
        b: QuantView<'_>,
        m: usize,
        mode: LaunchMode,
    ) -> Result<Dispatch> {
        let op = entry.entry;
        let (n, k) = (b.rows, b.cols);
        let shapes: [&[usize]; 3] = [&[m, k], &[n, k], &[m, ldc]];
        let MatmulEpilogue { bias, activation, .. } = epilogue;
        let limit = self.binding_limit();
        if a.bytes() > limit {
            return Err(self.binding_too_large(op, "a (the activations, which do not split)", a.bytes()));
        }
        let oversize = c.bytes() > limit || pre.is_some_and(|p| p.bytes() > limit) || b.words.bytes() > limit;
        let cols = if oversize {
            let by_b = self.quant_rows_per_part(&b);
            let by_c = self.part_capacity().saturating_sub((m - 1) * ldc);
            let cols = by_b.min(by_c).min(n);
            if cols == 0 {
                let (operand, bytes) = if by_b == 0 {
                    (
                        "b (one row of it)",
                        (k / QuantFormat::BLOCK * b.format.quant_words() * 4) as u64,
                    )
                } else {
                    ("c (its rows do not split)", c.bytes())
                };
                return Err(self.binding_too_large(op, operand, bytes));
            }
            // Whole tiles (and matrix-vector workgroups) per launch.
            let unit = match kernel {
                QuantWeightsKernel::Matvec { .. } => MATVEC_COLUMNS,
                QuantWeightsKernel::MatvecColumns => QUANT_COLUMNS_PER_GROUP,
                QuantWeightsKernel::MatvecRows | QuantWeightsKernel::MatvecRowsSubgroup => QUANT_ROWS_COLUMNS_PER_GROUP,
                QuantWeightsKernel::Tiled => TILE,
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
                let whole = c_col0 == 0 && cols == ldc;
                let rows = self.quant_rows(&b, (n0, n0 + cols));
                let c_range = (c_col0 + n0, (m - 1) * ldc + cols);
                let (c_bind, c_base) = if whole {
                    (c, 0)
                } else {
                    self.bind_part(c, c_range.0, c_range.1)
                };
                let pre_bind = match pre {
                    Some(p) if !whole => Some(self.bind_like_c(op, p, c_range, c_base)?),
                    other => other,
                };
                let params = QuantParams {
                    product: ProductParams::new(op, (m, cols, k), ldc, n0, act)?,
                    q_base: dim(op, rows.q_base)?,
                    s_base: dim(op, rows.s_base)?,
                    c_base: dim(op, c_base)?,
                    _pad: 0,
                    part_end: [dim(op, cols)?; 4],
                    part_q: [0; 4],
                    part_s: [0; 4],
                };
                self.quant_weights_launch(
                    entry,
                    kernel,
                    b.format,
                    (bias, activation.is_some(), pre_bind),
                    [c_bind, a, rows.quants, rows.scales],
                    &params,
                    m,
                    cols,
                    mode,
                )
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
        mode: LaunchMode,
    ) -> Result<Dispatch> {
        let flag = |on: bool| f64::from(u8::from(on));
        let mut constants = vec![
            ("QUANT_FORMAT", f64::from(format.code())),
            ("HAS_BIAS", flag(bias.is_some())),
            ("ACTIVATION_FORWARD", flag(activation)),
            ("STORE_PRE", flag(pre.is_some())),
        ];
        // Pipelines without them keep their old keys.
        if mode.multiply_c {
            constants.push(("MULTIPLY_C", 1.0));
        }
        if mode.gated {
            constants.push(("GATED", 1.0));
        }
        let groups = match kernel {
            QuantWeightsKernel::Matvec { lanes } => {
                // A pipeline per bucket of row counts, as the f32
                // matrix-vector kernel.
                constants.extend([
                    ("MATVEC_ROWS", matvec_rows_bucket(m) as f64),
                    ("MATVEC_WG", f64::from(lanes)),
                ]);
                cols.div_ceil(MATVEC_COLUMNS) as u64
            }
            QuantWeightsKernel::MatvecColumns => {
                constants.push(("MATVEC_ROWS", matvec_rows_bucket(m) as f64));
                cols.div_ceil(if mode.gated {
                    QUANT_GATED_COLUMNS_PER_GROUP
                } else {
                    QUANT_COLUMNS_PER_GROUP
                }) as u64
            }
            QuantWeightsKernel::MatvecRows | QuantWeightsKernel::MatvecRowsSubgroup => {
                constants.push(("MATVEC_ROWS", quant_rows_bucket(m) as f64));
                cols.div_ceil(if mode.gated {
                    QUANT_ROWS_GATED_COLUMNS_PER_GROUP
                } else {
                    QUANT_ROWS_COLUMNS_PER_GROUP
                }) as u64
            }
            QuantWeightsKernel::Tiled => u64::from(params.product.tiles_total),
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
    pub fn embedding_quant_weights(
        &self,
        out: View<'_>,
        table: QuantView<'_>,
        ids: View<'_>,
        n: usize,
    ) -> Result<Dispatch> {
        let kernel = EMBEDDING_QUANT_FORWARD;
        let op = kernel.entry;
        let (vocab, channels) = (table.rows, table.cols);
        let shapes: [&[usize]; 3] = [&[vocab, channels], &[n], &[n, channels]];
        if n == 0 || Some(out.len) != n.checked_mul(channels) || ids.len != n {
            return Err(Error::shape(
                op,
                format!(
                    "out and ids must hold n·channels and n ≥ 1 values; got {} and {} (n = {n}, channels = {channels})",
                    out.len, ids.len
                ),
                &shapes,
            ));
        }
        let parts: Vec<(usize, usize)> = if table.words.bytes() <= self.binding_limit() {
            vec![(0, vocab)]
        } else {
            let per_part = self.quant_rows_per_part(&table);
            if per_part == 0 {
                return Err(self.binding_too_large(
                    op,
                    "table (one row of it)",
                    (table.blocks_per_row() * table.format.quant_words() * 4) as u64,
                ));
            }
            (0..vocab)
                .step_by(per_part)
                .map(|r0| (r0, (r0 + per_part).min(vocab)))
                .collect()
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
                    &[
                        bind(7, "table (quantized words)", rows.quants),
                        bind(8, "table (scales)", rows.scales),
                        bind(9, "ids", ids),
                        bind(10, "out", out),
                    ],
                    11,
                    &params,
                    flat_groups(out.len),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no table rows", &shapes))
    }
}

impl Kernels {
    /// C[m, n] = A[m, k]·B[k, n] (C += it with `accumulate`) for a
    /// block-quantized B stored as its k rows of n values: a frozen Linear
    /// weight W [out, in] in its backward, dX = dY·W, each block decoded in
    /// registers (`matmul_quant_transposed`; no dense copy of W is made).
    /// A is read a value at a time (any k, any offset); n is B's row
    /// length, a multiple of the format's block. A B larger than one
    /// storage binding is summed by blocks of its rows, each launch after
    /// the first adding into C; A and C must each fit one binding.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_quant_transposed(
        &self,
        accumulate: bool,
        c: View<'_>,
        a: View<'_>,
        b: QuantView<'_>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Dispatch> {
        let entry = MATMUL_QUANT_TRANSPOSED;
        let op = entry.entry;
        let shapes: [&[usize]; 3] = [&[m, k], &[k, n], &[m, n]];
        if m == 0 || n == 0 || k == 0 {
            return Err(Error::shape(op, "every dimension must be at least 1", &shapes));
        }
        b.format.check_shape(op, k, n)?;
        let len = |x: usize, y: usize| x.checked_mul(y);
        if len(m, k) != Some(a.len) || (b.rows, b.cols) != (k, n) || len(m, n) != Some(c.len) {
            return Err(Error::shape(
                op,
                format!(
                    "A·B with m={m} n={n} k={k} needs A [m, k], B [k, n] (stored as its k rows), C [m, n]; \
                     got A of {} values, B [{}, {}], C of {} values",
                    a.len, b.rows, b.cols, c.len
                ),
                &shapes,
            ));
        }
        let limit = self.binding_limit();
        if a.bytes() > limit {
            return Err(self.binding_too_large(op, "a (the gradients, which do not split)", a.bytes()));
        }
        if c.bytes() > limit {
            return Err(self.binding_too_large(op, "c (which does not split)", c.bytes()));
        }
        // Rows of B per launch: all of them, or as many as one binding holds.
        let per_launch = if b.words.bytes() <= limit {
            k
        } else {
            self.quant_rows_per_part(&b)
        };
        if per_launch == 0 {
            let row = (n / QuantFormat::BLOCK * b.format.quant_words() * 4) as u64;
            return Err(self.binding_too_large(op, "b (one row of it)", row));
        }
        let launches = (0..k)
            .step_by(per_launch)
            .map(|r0| {
                let r1 = (r0 + per_launch).min(k);
                let rows = self.quant_rows(&b, (r0, r1));
                let params = QuantParams {
                    // The product's k is this launch's rows of B; A's rows
                    // are k long (ldc) and its columns start at r0.
                    product: ProductParams::new(op, (m, n, r1 - r0), k, r0, None)?,
                    q_base: dim(op, rows.q_base)?,
                    s_base: dim(op, rows.s_base)?,
                    c_base: 0,
                    _pad: 0,
                    part_end: [0; 4],
                    part_q: [0; 4],
                    part_s: [0; 4],
                };
                let mut constants = vec![("QUANT_FORMAT", f64::from(b.format.code()))];
                if accumulate || r0 > 0 {
                    constants.push(("ACCUMULATE", 1.0));
                }
                self.prepare(
                    entry,
                    &constants,
                    &[
                        bind(0, "a", a),
                        bind(1, "b (quantized words)", rows.quants),
                        bind(2, "b (scales)", rows.scales),
                        bind(3, "c", c),
                    ],
                    4,
                    &params,
                    u64::from(params.product.tiles_total),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no rows of B", &shapes))
    }
}
