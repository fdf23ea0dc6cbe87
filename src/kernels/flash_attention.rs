//! `flash_attention.wgsl`: fused causal self-attention, forward and
//! backward (FlashAttention-2), for training and for a whole sequence's
//! forward; see the WGSL file for the algorithm and layouts. Two shapes
//! of the forward, dq and dk/dv kernels, picked by
//! [`Kernels::gpu_shaped`]: workgroup-memory tiles for GPUs, register
//! blocks with no workgroup memory for CPU adapters (`…_rows`, heads of
//! up to [`ROWS_MAX_HEAD_DIM`] channels).

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Binding, Dispatch, Kernel, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{window_positions, FlashAttentionShape};

entry_points! {
    FlashAttention {
        FLASH_ATTENTION_FORWARD = "flash_attention_forward",
        FLASH_ATTENTION_BACKWARD_PREPARE = "flash_attention_backward_prepare",
        FLASH_ATTENTION_BACKWARD_QUERY = "flash_attention_backward_query",
        FLASH_ATTENTION_BACKWARD_KEY_VALUE = "flash_attention_backward_key_value",
        FLASH_ATTENTION_FORWARD_ROWS = "flash_attention_forward_rows",
        FLASH_ATTENTION_BACKWARD_QUERY_ROWS = "flash_attention_backward_query_rows",
        FLASH_ATTENTION_BACKWARD_KEY_VALUE_ROWS = "flash_attention_backward_key_value_rows",
    }
}

/// The widest head the fused attention takes (flash_attention.wgsl's
/// `MAX_HEAD_VEC4` vec4s): each invocation keeps its rows in private
/// arrays of this size. SmolLM2's and GPT-2's heads have 64 channels,
/// Gemma 3's 256.
pub const FLASH_MAX_HEAD_DIM: usize = 256;

/// Rows (queries or keys) per workgroup, one per invocation
/// (flash_attention.wgsl's `BLOCK_ROWS`).
const BLOCK_ROWS: usize = 64;

/// The CPU-shaped kernels' rows per invocation, invocations per
/// workgroup, and rows streamed per step (flash_attention.wgsl's
/// `ROW_BLOCK`, `ROW_LANES`, `STEP`).
const ROW_BLOCK: usize = 8;

/// The widest head the CPU-shaped kernels take (flash_attention.wgsl's
/// `ROW_HEAD_VEC4` vec4s); wider heads take the tiled ones. Their private
/// arrays' size sets llvmpipe's compile time (see the WGSL).
const ROWS_MAX_HEAD_DIM: usize = 64;
const ROW_LANES: usize = 8;
const STEP: usize = 4;

/// vec4s of one workgroup-memory tile and the most rows of one
/// (flash_attention.wgsl's `TILE_VEC4`, `MAX_TILE`).
const TILE_VEC4: usize = 384;
const MAX_TILE: usize = 64;

/// Loop iterations one invocation may run in one launch on a CPU
/// adapter: llvmpipe stops an invocation's loops after 65,535 in all (see
/// kernels/attention.rs), less a margin for the row loads and stores.
const CPU_LOOP_BUDGET: usize = 60_000;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct FlashParams {
    batch: u32,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    scale: f32,
    chunk_start: u32,
    chunk_end: u32,
    first: u32,
    tile: u32,
    window: u32,
    _pad1: u32,
}

/// vec4s of one row in the tiles: `d` rounded up to 16 channels
/// (flash_attention.wgsl's `padded_vec4s`).
fn padded_vec4s(d: usize) -> usize {
    d.div_ceil(16) * 4
}

/// Rows of one tile for heads of `d` channels.
fn tile_rows(d: usize) -> usize {
    (TILE_VEC4 / padded_vec4s(d)).min(MAX_TILE)
}

impl Kernels {
    /// The shape's checks and the operands' lengths against it.
    fn check_flash(
        &self,
        op: &'static str,
        shape: FlashAttentionShape,
        operands: &[(&'static str, usize, usize)],
    ) -> Result<FlashParams> {
        shape.check(op, FLASH_MAX_HEAD_DIM)?;
        let dims = [shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim];
        if let Some((name, len, want)) = operands.iter().find(|(_, len, want)| len != want) {
            return Err(Error::shape(
                op,
                format!("`{name}` has {len} elements, want {want} for {shape:?}"),
                &[&dims, &[*len]],
            ));
        }
        let max = self.device().limits().max_compute_workgroups_per_dimension as usize;
        if shape.seq.div_ceil(self.flash_group_rows(shape)) > max || shape.heads > max || shape.batch > max {
            return Err(Error::shape(op, format!("{shape:?} is over this adapter's max_compute_workgroups_per_dimension ({max}) in row tiles, heads or sequences"), &[&dims]));
        }
        Ok(FlashParams {
            batch: dim(op, shape.batch)?,
            seq: dim(op, shape.seq)?,
            heads: dim(op, shape.heads)?,
            kv_heads: dim(op, shape.kv_heads)?,
            head_dim: dim(op, shape.head_dim)?,
            scale: shape.scale() as f32,
            chunk_start: 0,
            chunk_end: dim(op, shape.seq)?,
            first: 1,
            tile: dim(op, tile_rows(shape.head_dim))?,
            window: dim(op, window_positions(shape.window, shape.seq))?,
            _pad1: 0,
        })
    }

    /// The launches of a tiled kernel over a loop of `seq` rows, each
    /// pass over one row costing about `per_row` iterations: one launch on
    /// a GPU; on a CPU adapter as many as keep each invocation under
    /// llvmpipe's loop limit (or [`super::LimitOverrides::loop_iterations`]),
    /// each continuing the last (`first` = 0).
    fn flash_launches(
        &self,
        kernel: Kernel,
        bindings: &[Binding<'_>],
        params: FlashParams,
        per_row: usize,
        grid: [u32; 3],
    ) -> Result<Dispatch> {
        let seq = params.seq as usize;
        let budget = self
            .overrides
            .loop_iterations
            .or(self.device().is_cpu().then_some(CPU_LOOP_BUDGET));
        let chunk = budget.map_or(seq, |budget| (budget / per_row.max(1)).max(1));
        let mut parts = Vec::new();
        for start in (0..seq).step_by(chunk) {
            let part = FlashParams {
                chunk_start: dim(kernel.entry, start)?,
                chunk_end: dim(kernel.entry, (start + chunk).min(seq))?,
                first: u32::from(start == 0),
                ..params
            };
            parts.push(self.prepare_grid(kernel, &[], bindings, 7, &part, grid)?);
        }
        Dispatch::chain(parts).ok_or_else(|| Error::shape(kernel.entry, "no rows", &[&[seq]]))
    }

    /// Loop iterations one invocation spends per key (forward, dq) or per
    /// (query, head) (dk/dv). GPU-shaped: `channel_loops` loops of 16
    /// channels per iteration, its share of the tile loads and the score
    /// loops (forward 2, dq 3, dk/dv 4). CPU-shaped: per step of STEP
    /// rows, two loops of 4 channels per iteration, each holding a loop
    /// over the block's rows, and one more such loop, counted as if Mesa
    /// left them rolled.
    fn flash_per_row(&self, shape: FlashAttentionShape, channel_loops: usize) -> usize {
        if self.rows_shaped(shape) {
            return (2 * shape.head_dim.div_ceil(4) * (ROW_BLOCK + 1) + ROW_BLOCK + 1).div_ceil(STEP);
        }
        let d4 = padded_vec4s(shape.head_dim);
        channel_loops * d4 / 4 + 4 + (4 * d4).div_ceil(BLOCK_ROWS) + 1
    }

    /// Whether the forward, dq and dk/dv take the CPU-shaped kernels:
    /// on a CPU adapter, for heads they hold.
    fn rows_shaped(&self, shape: FlashAttentionShape) -> bool {
        !self.gpu_shaped() && self.flash_rows_hold(shape.head_dim)
    }

    /// Whether the CPU-shaped fused attention kernels hold heads of
    /// `head_dim` channels (wider heads take the tiled ones).
    pub fn flash_rows_hold(&self, head_dim: usize) -> bool {
        head_dim <= ROWS_MAX_HEAD_DIM
    }

    /// Rows (queries or keys) one workgroup of the forward, dq or dk/dv
    /// kernel covers: the GPU-shaped kernels' one per invocation, the
    /// CPU-shaped ones' blocks of ROW_BLOCK.
    fn flash_group_rows(&self, shape: FlashAttentionShape) -> usize {
        if self.rows_shaped(shape) {
            ROW_BLOCK * ROW_LANES
        } else {
            BLOCK_ROWS
        }
    }

    /// The GPU-shaped entry (workgroup-memory tiles) or the CPU-shaped one
    /// (register blocks, no barriers in the loops; see flash_attention.wgsl):
    /// on lavapipe the tiled ones ran 2.5–4× slower than the unfused graph
    /// (BENCHMARKS.md, issue 27).
    fn flash_entry(&self, tiled: Kernel, rows: Kernel, shape: FlashAttentionShape) -> Kernel {
        if self.rows_shaped(shape) {
            rows
        } else {
            tiled
        }
    }

    /// out [B, T, H, d] = softmax(q·kᵀ/√d, causal)·v and lse [B, H, T],
    /// each row's log-sum-exp of its scaled scores, from q [B, T, H, d]
    /// and k, v [B, T, Hkv, d]: query head h reads KV head h / (H / Hkv).
    /// Under `shape.window` query i sees keys i - window + 1 ..= i, and
    /// each workgroup's loop starts at the first key its rows see.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_forward(
        &self,
        out: View<'_>,
        lse: View<'_>,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        shape: FlashAttentionShape,
    ) -> Result<Dispatch> {
        let op = FLASH_ATTENTION_FORWARD.entry;
        let (q_len, kv_len, rows) = shape.lengths().unwrap_or_default();
        let params = self.check_flash(
            op,
            shape,
            &[
                ("out", out.len, q_len),
                ("lse", lse.len, rows),
                ("q", q.len, q_len),
                ("k", k.len, kv_len),
                ("v", v.len, kv_len),
            ],
        )?;
        let bindings = [
            bind(0, "q", q),
            bind(1, "k", k),
            bind(2, "v", v),
            bind(8, "out", out),
            bind(9, "lse", lse),
        ];
        let grid = [
            shape.seq.div_ceil(self.flash_group_rows(shape)) as u32,
            params.heads,
            params.batch,
        ];
        let kernel = self.flash_entry(FLASH_ATTENTION_FORWARD, FLASH_ATTENTION_FORWARD_ROWS, shape);
        self.flash_launches(kernel, &bindings, params, self.flash_per_row(shape, 2), grid)
    }

    /// delta [B, H, T] = rowsum(dout ∘ out) per query head, from dout and
    /// out [B, T, H, d]: the backward's preprocessing.
    pub fn flash_attention_backward_prepare(
        &self,
        delta: View<'_>,
        dout: View<'_>,
        out: View<'_>,
        shape: FlashAttentionShape,
    ) -> Result<Dispatch> {
        let op = FLASH_ATTENTION_BACKWARD_PREPARE.entry;
        let (q_len, _, rows) = shape.lengths().unwrap_or_default();
        let params = self.check_flash(
            op,
            shape,
            &[
                ("delta", delta.len, rows),
                ("dout", dout.len, q_len),
                ("out", out.len, q_len),
            ],
        )?;
        let bindings = [bind(3, "dout", dout), bind(4, "out", out), bind(10, "delta", delta)];
        self.prepare(
            FLASH_ATTENTION_BACKWARD_PREPARE,
            &[],
            &bindings,
            7,
            &params,
            flat_groups(rows),
        )
    }

    /// dq [B, T, H, d] from dout [B, T, H, d], the forward's q, k, v, its
    /// lse and [`Kernels::flash_attention_backward_prepare`]'s delta, the
    /// probabilities recomputed tile by tile.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_query(
        &self,
        dq: View<'_>,
        dout: View<'_>,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        lse: View<'_>,
        delta: View<'_>,
        shape: FlashAttentionShape,
    ) -> Result<Dispatch> {
        let op = FLASH_ATTENTION_BACKWARD_QUERY.entry;
        let (q_len, kv_len, rows) = shape.lengths().unwrap_or_default();
        let operands = [
            ("dq", dq.len, q_len),
            ("dout", dout.len, q_len),
            ("q", q.len, q_len),
            ("k", k.len, kv_len),
            ("v", v.len, kv_len),
            ("lse", lse.len, rows),
            ("delta", delta.len, rows),
        ];
        let params = self.check_flash(op, shape, &operands)?;
        let bindings = [
            bind(0, "q", q),
            bind(1, "k", k),
            bind(2, "v", v),
            bind(3, "dout", dout),
            bind(5, "lse", lse),
            bind(6, "delta", delta),
            bind(11, "dq", dq),
        ];
        let grid = [
            shape.seq.div_ceil(self.flash_group_rows(shape)) as u32,
            params.heads,
            params.batch,
        ];
        let kernel = self.flash_entry(
            FLASH_ATTENTION_BACKWARD_QUERY,
            FLASH_ATTENTION_BACKWARD_QUERY_ROWS,
            shape,
        );
        self.flash_launches(kernel, &bindings, params, self.flash_per_row(shape, 3), grid)
    }

    /// dk and dv [B, T, Hkv, d], each KV head's summed over its query
    /// heads in order, from the same operands as
    /// [`Kernels::flash_attention_backward_query`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_key_value(
        &self,
        dk: View<'_>,
        dv: View<'_>,
        dout: View<'_>,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        lse: View<'_>,
        delta: View<'_>,
        shape: FlashAttentionShape,
    ) -> Result<Dispatch> {
        let op = FLASH_ATTENTION_BACKWARD_KEY_VALUE.entry;
        let (q_len, kv_len, rows) = shape.lengths().unwrap_or_default();
        let operands = [
            ("dk", dk.len, kv_len),
            ("dv", dv.len, kv_len),
            ("dout", dout.len, q_len),
            ("q", q.len, q_len),
            ("k", k.len, kv_len),
            ("v", v.len, kv_len),
            ("lse", lse.len, rows),
            ("delta", delta.len, rows),
        ];
        let params = self.check_flash(op, shape, &operands)?;
        let bindings = [
            bind(0, "q", q),
            bind(1, "k", k),
            bind(2, "v", v),
            bind(3, "dout", dout),
            bind(5, "lse", lse),
            bind(6, "delta", delta),
            bind(12, "dk", dk),
            bind(13, "dv", dv),
        ];
        let grid = [
            shape.seq.div_ceil(self.flash_group_rows(shape)) as u32,
            params.kv_heads,
            params.batch,
        ];
        // Each query is visited once per query head of the group.
        let per_row = self.flash_per_row(shape, 4) * shape.group();
        let kernel = self.flash_entry(
            FLASH_ATTENTION_BACKWARD_KEY_VALUE,
            FLASH_ATTENTION_BACKWARD_KEY_VALUE_ROWS,
            shape,
        );
        self.flash_launches(kernel, &bindings, params, per_row, grid)
    }
}
