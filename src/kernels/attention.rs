//! `attention.wgsl`: attention over a KV cache, the per-token step of
//! generation (and the prompt's, which fills the cache).

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::CachedAttentionShape;

entry_points! {
    Attention {
        CACHED_ATTENTION_FORWARD = "cached_attention_forward",
        CACHED_ATTENTION_FORWARD_WORKGROUP = "cached_attention_forward_workgroup",
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
    _pad0: u32,
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
    /// one writes NaN to its output).
    ///
    /// On a CPU adapter one invocation serves each (sequence, row, head),
    /// unless the context is too long for llvmpipe's loop limit; on a GPU
    /// ([`Kernels::gpu_shaped`]), and for such contexts, one workgroup of
    /// [`DECODE_LANES`] lanes does (32 on a CPU adapter where each lane's
    /// share stays under the limit: SmolLM2's 8192 positions, attention
    /// 33 → 23–25 ms of a decode step on lavapipe), the lanes splitting
    /// the positions and merging their online softmax over a fixed tree
    /// (deterministic).
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
        let op = CACHED_ATTENTION_FORWARD.entry;
        let CachedAttentionShape { seqs, rows, heads, kv_heads, head_dim, context, .. } = shape;
        let dims = [seqs, rows, heads, kv_heads, head_dim, context];
        if dims.contains(&0) {
            return Err(Error::shape(op, format!("every size must be at least 1: {shape:?}"), &[&dims]));
        }
        if heads % kv_heads != 0 {
            return Err(Error::shape(op, format!("{kv_heads} KV heads do not divide {heads} query heads"), &[&dims]));
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::shape(op, format!("head_dim {head_dim} is over the largest this kernel takes, {MAX_HEAD_DIM}"), &[&dims]));
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
            return Err(Error::shape(op, format!("`{name}` has {len} elements, want {want} for {shape:?}"), &[&dims, &[*len]]));
        }
        let invocations = seqs.checked_mul(rows).and_then(|n| n.checked_mul(heads)).filter(|&n| n <= u32::MAX as usize);
        let invocations = invocations.ok_or_else(|| Error::shape(op, format!("more than 2^32 (sequence, row, head) triples: {shape:?}"), &[&dims]))?;
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
            _pad0: 0,
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
        // llvmpipe (lavapipe's and GL's shader compiler) ends an
        // invocation's loops after 65,535 iterations in all (one counter
        // shared by every loop; see rowwise.wgsl's layernorm_backward_params),
        // silently dropping the rest. The one-invocation kernel's three
        // channel loops per position step 8 channels at a time, then the
        // rest one by one; past that count (GPT-2's 1,024 positions of 64
        // channels take 25,728) the workgroup kernel gives each lane
        // 1/DECODE_LANES of the positions.
        let per_position = 3 * (head_dim / 8 + head_dim % 8) + 1;
        let serial_iterations = context.saturating_mul(per_position).saturating_add(2 * head_dim);
        if self.gpu_shaped() || serial_iterations > LOOP_ITERATIONS_MAX {
            // On a CPU adapter the fewest lanes under the loop limit: each
            // lane's positions take two channel loops (and a rescale).
            let lane_iterations = |lanes: usize| context.div_ceil(lanes).saturating_mul(3 * head_dim + 1);
            let lanes = if !self.gpu_shaped() && lane_iterations(CPU_DECODE_LANES) <= LOOP_ITERATIONS_MAX { CPU_DECODE_LANES } else { DECODE_LANES };
            return self.prepare(CACHED_ATTENTION_FORWARD_WORKGROUP, &[("DECODE_WG", lanes as f64)], &bindings, 7, &params, invocations as u64);
        }
        self.prepare(CACHED_ATTENTION_FORWARD, &[], &bindings, 7, &params, flat_groups(invocations))
    }
}
