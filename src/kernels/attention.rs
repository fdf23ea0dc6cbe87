//! `attention.wgsl`: attention over a KV cache, the per-token step of
//! generation (and the prompt's, which fills the cache).

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{window_positions, CachedAttentionShape};

entry_points! {
    Attention {
        CACHED_ATTENTION_FORWARD = "cached_attention_forward",
        CACHED_ATTENTION_FORWARD_WORKGROUP = "cached_attention_forward_workgroup",
        CACHED_ATTENTION_FORWARD_GROUPED = "cached_attention_forward_grouped",
        CACHED_ATTENTION_FORWARD_CHANNELS = "cached_attention_forward_channels",
    }
}

/// The largest head dimension `cached_attention_forward` takes: each
/// invocation keeps its query and output row in private arrays of this
/// size (attention.wgsl's `MAX_HEAD_DIM`). GPT-2's heads have 64 channels.
pub const MAX_HEAD_DIM: usize = 256;

/// The most loop iterations one invocation may run on llvmpipe, in all
/// of its loops together.
const LOOP_ITERATIONS_MAX: usize = 65_535;

/// Lanes of `cached_attention_forward_workgroup`, the GPU shape: one
/// workgroup of this many lanes per (sequence, row, head), the lanes
/// splitting the positions (attention.wgsl's `DECODE_WG`).
pub const DECODE_LANES: usize = 64;

/// Lanes of `cached_attention_forward_workgroup` on a CPU adapter where a
/// context is too long for the one-invocation kernel and this many lanes
/// keep under llvmpipe's loop limit (its merge needs at least 32).
const CPU_DECODE_LANES: usize = 32;

/// Lanes of `cached_attention_forward_grouped`: one SIMD row of
/// llvmpipe (attention.wgsl's `GROUPED_LANES`).
const GROUPED_LANES: usize = 8;

/// The largest head dimension `cached_attention_forward_grouped` takes
/// (attention.wgsl's `GROUPED_HEAD_VEC4` vec4s): its per-lane query and
/// output rows are sized by it, and llvmpipe's cold compile of the kernel
/// grows faster than they do (2.3 s at 64 channels, 8.7 s at 128, 25 s
/// at 256). Longer heads run on the other kernels, which take 2–3.5× the
/// grouped kernel's time on a 128-channel grouped-query decode step: the
/// price of the 64-channel kernel's compile, for SmolLM2's 64.
pub const GROUPED_MAX_HEAD_DIM: usize = 64;

/// Query heads one workgroup of `cached_attention_forward_grouped` (and of
/// `cached_attention_forward_channels`) serves (attention.wgsl's
/// `GROUP_HEADS`); a larger group takes several.
const GROUP_HEADS: usize = 4;

/// Lanes of `cached_attention_forward_channels` (attention.wgsl's
/// `CHANNEL_LANES`), each owning every 8th vec4 of a head's channels.
const CHANNEL_LANES: usize = 8;

/// Which kernel of `attention.wgsl` a cached attention runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachedAttentionKernel {
    /// `cached_attention_forward`: one invocation per (sequence, row,
    /// head), serial over the positions.
    Serial,
    /// `cached_attention_forward_workgroup` with this many lanes (32 or
    /// 64) splitting the positions of one (sequence, row, head): a GPU's.
    Workgroup { lanes: u32 },
    /// `cached_attention_forward_grouped`: 8 lanes splitting the positions
    /// of one (sequence, row, KV head), each key and value read once, as
    /// vec4s, for up to 4 of the query heads sharing it: a CPU adapter's,
    /// for heads of at most [`GROUPED_MAX_HEAD_DIM`] channels.
    Grouped,
    /// `cached_attention_forward_channels`: 8 lanes splitting the channels
    /// of up to 4 query heads sharing a KV head, all walking the positions
    /// together: a CPU adapter's for heads wider than
    /// [`GROUPED_MAX_HEAD_DIM`] (Gemma 3's 256 channels), vec4 reads.
    Channels,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AttentionParams {
    seqs: u32,
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    context: u32,
    scale: f32,
    q_width: u32,
    k_width: u32,
    v_width: u32,
    q_first: u32,
    k_first: u32,
    v_first: u32,
    window: u32,
    _pad1: u32,
    _pad2: u32,
}

impl Kernels {
    /// For each sequence s and new row t (position p = starts[s] + t):
    /// writes row t's k and v into the caches at p, then out[s, t] =
    /// softmax(q·kᵀ/√d over positions 0..=p)·v per query head, head h
    /// reading KV head h / (heads / kv_heads). `q`, `k`, `v` hold the
    /// heads where `shape.layout` puts them: one fused qkv buffer bound
    /// three times (a GPT's c_attn), or three operands (Llama's, q and k
    /// already rotated at their positions). Positions before starts[s] are
    /// read from the caches, so a decode step (rows = 1) costs one
    /// position's attention. The caller keeps every p < context (a larger
    /// one writes NaN to its output). Under `shape.window` position p
    /// attends to positions p - window + 1 ..= p only.
    ///
    /// The kernel is picked by [`Kernels::cached_attention_kernel_for`]:
    /// on a GPU ([`Kernels::gpu_shaped`]) one workgroup of
    /// [`DECODE_LANES`] lanes per (sequence, row, head), the lanes
    /// splitting the positions and merging their online softmax over a
    /// fixed tree (deterministic); on a CPU adapter one workgroup of 8
    /// lanes per (sequence, row, KV head) serving up to 4 of its query
    /// heads (SmolLM2's attention 25 → 11–12 ms of a decode step on
    /// lavapipe, loaded) — its 8 lanes splitting the positions for heads
    /// of up to [`GROUPED_MAX_HEAD_DIM`] channels, the channels for wider
    /// ones — or where neither can run, one invocation per (sequence, row,
    /// head), or the workgroup kernel past llvmpipe's loop limit.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_attention_forward(
        &self,
        out: View<'_>,
        k_cache: View<'_>,
        v_cache: View<'_>,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        starts: View<'_>,
        shape: CachedAttentionShape,
    ) -> Result<Dispatch> {
        let kernel = self.cached_attention_kernel_for(&shape, &[out, k_cache, v_cache, q, k, v]);
        self.cached_attention_forward_with(kernel, out, k_cache, v_cache, q, k, v, starts, shape)
    }

    /// The kernel [`Kernels::cached_attention_forward`] runs `shape` on,
    /// its f32 operands `views`: on a GPU ([`Kernels::gpu_shaped`]) the
    /// workgroup kernel of [`DECODE_LANES`]; on a CPU adapter, for
    /// grouped-query attention, the grouped one where it can run (head_dim
    /// a multiple of 4 up to [`GROUPED_MAX_HEAD_DIM`], every view 16-byte
    /// aligned, each lane's share of
    /// the context under llvmpipe's loop limit: SmolLM2's 8,192 positions
    /// of 64 channels), for wider heads the channel kernel where it can
    /// run (head_dim a multiple of 4, views aligned), else the serial
    /// one where the context fits that limit, else the workgroup kernel
    /// with the fewest lanes that fit it.
    pub fn cached_attention_kernel_for(
        &self,
        shape: &CachedAttentionShape,
        views: &[View<'_>],
    ) -> CachedAttentionKernel {
        let CachedAttentionShape { head_dim, context, .. } = *shape;
        if self.gpu_shaped() {
            return CachedAttentionKernel::Workgroup {
                lanes: DECODE_LANES as u32,
            };
        }
        // Grouped-query attention (a KV head shared by 2 or more query
        // heads): multi-head attention keeps the kernels below, which
        // spend nothing on the grouped kernel's 4 heads per workgroup.
        if shape.heads / shape.kv_heads >= 2 && self.grouped_attention_runs(shape, views) {
            return CachedAttentionKernel::Grouped;
        }
        // Heads too wide for the grouped kernel's per-lane rows (Gemma 3's
        // 256 channels): the lanes split the channels, and each key and
        // value is read once for up to 4 query heads (Gemma 3 270M's decode
        // attention on lavapipe: 1.3 ms a layer on the one-invocation
        // kernel at 64 positions).
        if head_dim > GROUPED_MAX_HEAD_DIM && self.channel_attention_runs(shape, views) {
            return CachedAttentionKernel::Channels;
        }
        // The one-invocation kernel's three channel loops per position
        // step 8 channels at a time, then the rest one by one; past the
        // limit (GPT-2's 1,024 positions of 64 channels take 25,728) the
        // workgroup kernel gives each lane 1/lanes of the positions.
        let per_position = 3 * (head_dim / 8 + head_dim % 8) + 1;
        let serial_iterations = context.saturating_mul(per_position).saturating_add(2 * head_dim);
        if serial_iterations <= LOOP_ITERATIONS_MAX {
            return CachedAttentionKernel::Serial;
        }
        // Each lane's positions take two channel loops (and a rescale).
        let lane_iterations = |lanes: usize| context.div_ceil(lanes).saturating_mul(3 * head_dim + 1);
        let lanes = if lane_iterations(CPU_DECODE_LANES) <= LOOP_ITERATIONS_MAX {
            CPU_DECODE_LANES
        } else {
            DECODE_LANES
        };
        CachedAttentionKernel::Workgroup { lanes: lanes as u32 }
    }

    /// Whether `cached_attention_forward_grouped` takes `shape` with these
    /// operands: vec4 reads (head_dim a multiple of 4 up to
    /// [`GROUPED_MAX_HEAD_DIM`], views 16-byte
    /// aligned on an adapter whose storage offsets are too), and on a CPU
    /// adapter a lane's iterations under llvmpipe's loop limit: its
    /// positions' two vec4 loops, the queries' loads and the merge.
    fn grouped_attention_runs(&self, shape: &CachedAttentionShape, views: &[View<'_>]) -> bool {
        let CachedAttentionShape { head_dim, context, .. } = *shape;
        let d4 = head_dim / 4;
        let aligned = self.vec4_views(views);
        let iterations = context
            .div_ceil(GROUPED_LANES)
            .saturating_mul(2 * d4 + 1)
            .saturating_add(16 * d4 + 4 * GROUPED_LANES + 64);
        head_dim % 4 == 0
            && head_dim <= GROUPED_MAX_HEAD_DIM
            && aligned
            && (self.gpu_shaped() || iterations <= LOOP_ITERATIONS_MAX)
    }

    /// Whether `views` may be read as vec4s: each starts 16-byte aligned on
    /// an adapter whose storage offsets are too.
    fn vec4_views(&self, views: &[View<'_>]) -> bool {
        self.device().limits().min_storage_buffer_offset_alignment % 16 == 0 && views.iter().all(|v| v.offset % 16 == 0)
    }

    /// Whether `cached_attention_forward_channels` takes `shape` with these
    /// operands: vec4 reads (head_dim a multiple of 4, views 16-byte
    /// aligned), and on a CPU adapter a lane's loop iterations (about one
    /// per position, and the queries' and outputs' loops over the heads)
    /// under llvmpipe's limit.
    fn channel_attention_runs(&self, shape: &CachedAttentionShape, views: &[View<'_>]) -> bool {
        let CachedAttentionShape { head_dim, context, .. } = *shape;
        let vec4s = (head_dim / 4).div_ceil(CHANNEL_LANES);
        let iterations = context.saturating_add(2 * GROUP_HEADS * vec4s + head_dim / 4 + 16);
        head_dim % 4 == 0
            && head_dim <= MAX_HEAD_DIM
            && self.vec4_views(views)
            && (self.gpu_shaped() || iterations <= LOOP_ITERATIONS_MAX)
    }

    /// Refuses what `kernel` cannot run: a workgroup kernel of other than
    /// 32 or 64 lanes, or `shape` on the vec4 kernels where they cannot
    /// (see [`Kernels::cached_attention_kernel_for`]).
    fn check_attention_kernel(
        &self,
        kernel: CachedAttentionKernel,
        shape: &CachedAttentionShape,
        views: &[View<'_>],
    ) -> Result<()> {
        let CachedAttentionShape { head_dim, context, .. } = *shape;
        let dims = [shape.seqs, shape.rows, shape.heads, shape.kv_heads, head_dim, context];
        match kernel {
            CachedAttentionKernel::Workgroup { lanes }
                if lanes as usize != CPU_DECODE_LANES && lanes as usize != DECODE_LANES =>
            {
                Err(Error::InvalidArgument {
                    op: CACHED_ATTENTION_FORWARD.entry,
                    reason: format!("{lanes} lanes: the workgroup kernel takes {CPU_DECODE_LANES} or {DECODE_LANES}"),
                })
            }
            CachedAttentionKernel::Grouped if !self.grouped_attention_runs(shape, views) => Err(Error::shape(
                CACHED_ATTENTION_FORWARD_GROUPED.entry,
                format!("reads vec4s: head_dim a multiple of 4 up to {GROUPED_MAX_HEAD_DIM} (got {head_dim}), every operand 16-byte aligned, and (on a CPU adapter) {context} positions over {GROUPED_LANES} lanes within llvmpipe's loop limit"),
                &[&dims],
            )),
            CachedAttentionKernel::Channels if !self.channel_attention_runs(shape, views) => Err(Error::shape(
                CACHED_ATTENTION_FORWARD_CHANNELS.entry,
                format!("reads vec4s: head_dim a multiple of 4 up to {MAX_HEAD_DIM} (got {head_dim}), every operand 16-byte aligned, and (on a CPU adapter) {context} positions within llvmpipe's loop limit"),
                &[&dims],
            )),
            _ => Ok(()),
        }
    }

    /// [`Kernels::cached_attention_forward`] on an explicit kernel
    /// (tests); the grouped one refuses what it cannot run, and a
    /// workgroup kernel takes 32 or 64 lanes.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_attention_forward_with(
        &self,
        kernel: CachedAttentionKernel,
        out: View<'_>,
        k_cache: View<'_>,
        v_cache: View<'_>,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        starts: View<'_>,
        shape: CachedAttentionShape,
    ) -> Result<Dispatch> {
        let op = CACHED_ATTENTION_FORWARD.entry;
        let CachedAttentionShape {
            seqs,
            rows,
            heads,
            kv_heads,
            head_dim,
            context,
            ..
        } = shape;
        let dims = [seqs, rows, heads, kv_heads, head_dim, context];
        if dims.contains(&0) {
            return Err(Error::shape(
                op,
                format!("every size must be at least 1: {shape:?}"),
                &[&dims],
            ));
        }
        if heads % kv_heads != 0 {
            return Err(Error::shape(
                op,
                format!("{kv_heads} KV heads do not divide {heads} query heads"),
                &[&dims],
            ));
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::shape(
                op,
                format!("head_dim {head_dim} is over the largest this kernel takes, {MAX_HEAD_DIM}"),
                &[&dims],
            ));
        }
        if shape.window == Some(0) {
            return Err(Error::shape(
                op,
                format!("a sliding window must hold at least 1 position: {shape:?}"),
                &[&dims],
            ));
        }
        let overflow = || Error::shape(op, format!("{shape:?} overflows"), &[&dims]);
        let want = shape.lengths().ok_or_else(overflow)?;
        let columns = shape.columns().ok_or_else(overflow)?;
        let operands = [
            ("out", out.len, want.out),
            ("k_cache", k_cache.len, want.cache),
            ("v_cache", v_cache.len, want.cache),
            ("q", q.len, want.q),
            ("k", k.len, want.k),
            ("v", v.len, want.v),
            ("starts", starts.len, seqs),
        ];
        if let Some((name, len, want)) = operands.iter().find(|(_, len, want)| len != want) {
            return Err(Error::shape(
                op,
                format!("`{name}` has {len} elements, want {want} for {shape:?}"),
                &[&dims, &[*len]],
            ));
        }
        let invocations = seqs
            .checked_mul(rows)
            .and_then(|n| n.checked_mul(heads))
            .filter(|&n| n <= u32::MAX as usize);
        let invocations = invocations.ok_or_else(|| {
            Error::shape(
                op,
                format!("more than 2^32 (sequence, row, head) triples: {shape:?}"),
                &[&dims],
            )
        })?;
        let [(q_width, q_first), (k_width, k_first), (v_width, v_first)] = columns;
        let params = AttentionParams {
            seqs: dim(op, seqs)?,
            rows: dim(op, rows)?,
            heads: dim(op, heads)?,
            kv_heads: dim(op, kv_heads)?,
            head_dim: dim(op, head_dim)?,
            context: dim(op, context)?,
            scale: 1.0 / (head_dim as f32).sqrt(),
            q_width: dim(op, q_width)?,
            k_width: dim(op, k_width)?,
            v_width: dim(op, v_width)?,
            q_first: dim(op, q_first)?,
            k_first: dim(op, k_first)?,
            v_first: dim(op, v_first)?,
            window: dim(op, window_positions(shape.window, context))?,
            _pad1: 0,
            _pad2: 0,
        };
        // A fused qkv is one buffer bound three times, read-only each
        // time (WebGPU forbids only a writable binding aliasing another).
        let bindings = [
            bind(0, "q", q),
            bind(1, "k", k),
            bind(2, "v", v),
            bind(3, "starts", starts),
            bind(4, "k_cache", k_cache),
            bind(5, "v_cache", v_cache),
            bind(6, "out", out),
        ];
        self.check_attention_kernel(kernel, &shape, &[out, k_cache, v_cache, q, k, v])?;
        // llvmpipe (lavapipe's and GL's shader compiler) ends an
        // invocation's loops after 65,535 iterations in all (one counter
        // shared by every loop; see rowwise.wgsl's layernorm_backward_params),
        // silently dropping the rest: cached_attention_kernel_for picks
        // within it.
        // The grouped and channel kernels: a workgroup per (sequence, row,
        // KV head, chunk of up to 4 of its query heads).
        let workgroups = (invocations / heads * kv_heads) as u64 * (heads / kv_heads).div_ceil(GROUP_HEADS) as u64;
        match kernel {
            CachedAttentionKernel::Serial => self.prepare(
                CACHED_ATTENTION_FORWARD,
                &[],
                &bindings,
                7,
                &params,
                flat_groups(invocations),
            ),
            CachedAttentionKernel::Workgroup { lanes } => self.prepare(
                CACHED_ATTENTION_FORWARD_WORKGROUP,
                &[("DECODE_WG", f64::from(lanes))],
                &bindings,
                7,
                &params,
                invocations as u64,
            ),
            CachedAttentionKernel::Grouped => self.prepare(
                CACHED_ATTENTION_FORWARD_GROUPED,
                &[("GROUPED_LANES", GROUPED_LANES as f64)],
                &bindings,
                7,
                &params,
                workgroups,
            ),
            CachedAttentionKernel::Channels => {
                // A pipeline per ⌈head_dim / 32⌉: each lane's vec4s of a head.
                let vec4s = (head_dim / 4).div_ceil(CHANNEL_LANES);
                self.prepare(
                    CACHED_ATTENTION_FORWARD_CHANNELS,
                    &[("CHANNEL_VEC4", vec4s as f64)],
                    &bindings,
                    7,
                    &params,
                    workgroups,
                )
            }
        }
    }
}
