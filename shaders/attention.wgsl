// Attention over a KV cache: the generation path (src/generate.rs), where
// each new token costs one position's attention instead of a re-run of the
// whole sequence (llm.c, llama.cpp).
//
// cached_attention_forward:
//   qkv     [S, T, 3·C]   rows of the c_attn projection: q | k | v, head h
//                         at columns h·d .. h·d + d of each third (C = H·d)
//   starts  [S] u32       the cache position of each sequence's row 0
//   k_cache [S, H, P, d]  read_write: keys of positions 0 .. P (the context)
//   v_cache [S, H, P, d]  read_write: values, the same layout
//   out     [S, T, C]     heads side by side, as c_proj reads them
// Row t of sequence s is position p = starts[s] + t. Its invocation writes
// k and v of p into the caches, then attends over positions 0 ..= p:
// softmax(q·kᵀ · scale) · v. Keys before starts[s] come from the cache;
// keys starts[s] .. p come from qkv itself, because another invocation of
// this dispatch writes them and WGSL cannot order that write before this
// read. So every invocation reads cache rows < starts[s] and writes one row
// ≥ starts[s]: no race, one dispatch for a decode step (T = 1) and for a
// whole prompt (starts = 0, T = prompt length). A position ≥ P is the
// host's error; here it writes NaN to its output and leaves the cache.
//
// Two shapes of the same contract (kernels/attention.rs picks by adapter):
//
// cached_attention_forward: ONE INVOCATION PER (sequence, row, head), 256
// per workgroup over a 2-D grid, with serial loops over keys and channels:
// lavapipe pays per workgroup and per barrier (see rowwise.wgsl), and the
// softmax is online (a running maximum; the output row being summed is
// rescaled when it grows), so each key is read once and the sum runs in
// position order: the result is the same on every run. On a GPU this is
// a handful of invocations for a decode step (GPT-2: 12, one per head).
//
// cached_attention_forward_workgroup: ONE WORKGROUP PER (sequence, row,
// head), for GPUs. Its DECODE_WG lanes split the positions (lane l takes
// positions l, l + DECODE_WG, ...), each keeping its own online-softmax
// state (running maximum, Σ exp, and the weighted value row in `acc`);
// the lanes' states then merge over a fixed tree by the online-softmax
// rule: (max, Σ exp) pairwise, then each lane's row rescaled by
// exp(its max − the max) and summed over the same tree, MERGE_CHUNK
// channels at a time. No atomics and a fixed order: the same bits on
// every run.
//
// Head dimensions up to MAX_HEAD_DIM. Composed with common.wgsl (WG,
// flat_index, LOWEST, quiet_nan).

struct AttentionParams {
    // S: sequences.
    seqs: u32,
    // T: new rows per sequence.
    rows: u32,
    // H: heads.
    heads: u32,
    // d: channels per head.
    head_dim: u32,
    // P: cache rows per (sequence, head).
    context: u32,
    // Multiplies q·k: 1/√d.
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read> starts: array<u32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<uniform> params: AttentionParams;

// The parameters through workgroup memory: lavapipe inlines uniform values
// that bound loops and re-optimizes the shader on every dispatch (see
// loss.wgsl); a value from workgroupUniformLoad is not inlined.
var<workgroup> shared_params: AttentionParams;

// The largest head dimension: the query and the output row being summed
// live in private arrays (registers or scratch), not in storage, which on
// lavapipe made a 256-token prompt's attention ~2× faster than summing in
// `out`. kernels::attention::MAX_HEAD_DIM on the Rust side.
const MAX_HEAD_DIM: u32 = 256u;
var<private> query: array<f32, MAX_HEAD_DIM>;
var<private> acc: array<f32, MAX_HEAD_DIM>;

// Online softmax: adds a score to state = (running maximum, Σ exp(score −
// maximum)), rescaling acc[0..d] when the maximum grows; returns the new
// score's weight exp(score − maximum).
fn push_score(state: ptr<function, vec2<f32>>, score: f32, d: u32) -> f32 {
    if score > (*state).x {
        let shrink = exp((*state).x - score);
        (*state).y *= shrink;
        scale_acc(shrink, d);
        (*state).x = score;
    }
    let weight = exp(score - (*state).x);
    (*state).y += weight;
    return weight;
}

// The channel loops of one position, 8 channels per iteration, then the
// rest one by one, in channel order (the same sums as a plain loop):
// llvmpipe ends an invocation's loops after 65,535 iterations in all (one
// counter for every loop), and cached_attention_forward runs three such
// loops per position; unrolled, GPT-2's 1,024 positions of 64 channels
// fit (kernels::attention counts the iterations and takes the workgroup
// kernel past them).
fn scale_acc(factor: f32, d: u32) {
    let full = d - d % 8u;
    var e = 0u;
    while e < full {
        acc[e] *= factor;
        acc[e + 1u] *= factor;
        acc[e + 2u] *= factor;
        acc[e + 3u] *= factor;
        acc[e + 4u] *= factor;
        acc[e + 5u] *= factor;
        acc[e + 6u] *= factor;
        acc[e + 7u] *= factor;
        e += 8u;
    }
    while e < d {
        acc[e] *= factor;
        e++;
    }
}

// query · k_cache[at .. at + d].
fn cache_dot(at: u32, d: u32) -> f32 {
    let full = d - d % 8u;
    var score = 0.0;
    var e = 0u;
    while e < full {
        score += query[e] * k_cache[at + e];
        score += query[e + 1u] * k_cache[at + e + 1u];
        score += query[e + 2u] * k_cache[at + e + 2u];
        score += query[e + 3u] * k_cache[at + e + 3u];
        score += query[e + 4u] * k_cache[at + e + 4u];
        score += query[e + 5u] * k_cache[at + e + 5u];
        score += query[e + 6u] * k_cache[at + e + 6u];
        score += query[e + 7u] * k_cache[at + e + 7u];
        e += 8u;
    }
    while e < d {
        score += query[e] * k_cache[at + e];
        e++;
    }
    return score;
}

// query · qkv[at .. at + d].
fn qkv_dot(at: u32, d: u32) -> f32 {
    let full = d - d % 8u;
    var score = 0.0;
    var e = 0u;
    while e < full {
        score += query[e] * qkv[at + e];
        score += query[e + 1u] * qkv[at + e + 1u];
        score += query[e + 2u] * qkv[at + e + 2u];
        score += query[e + 3u] * qkv[at + e + 3u];
        score += query[e + 4u] * qkv[at + e + 4u];
        score += query[e + 5u] * qkv[at + e + 5u];
        score += query[e + 6u] * qkv[at + e + 6u];
        score += query[e + 7u] * qkv[at + e + 7u];
        e += 8u;
    }
    while e < d {
        score += query[e] * qkv[at + e];
        e++;
    }
    return score;
}

// acc += weight · v_cache[at .. at + d].
fn cache_axpy(at: u32, weight: f32, d: u32) {
    let full = d - d % 8u;
    var e = 0u;
    while e < full {
        acc[e] += weight * v_cache[at + e];
        acc[e + 1u] += weight * v_cache[at + e + 1u];
        acc[e + 2u] += weight * v_cache[at + e + 2u];
        acc[e + 3u] += weight * v_cache[at + e + 3u];
        acc[e + 4u] += weight * v_cache[at + e + 4u];
        acc[e + 5u] += weight * v_cache[at + e + 5u];
        acc[e + 6u] += weight * v_cache[at + e + 6u];
        acc[e + 7u] += weight * v_cache[at + e + 7u];
        e += 8u;
    }
    while e < d {
        acc[e] += weight * v_cache[at + e];
        e++;
    }
}

// acc += weight · qkv[at .. at + d].
fn qkv_axpy(at: u32, weight: f32, d: u32) {
    let full = d - d % 8u;
    var e = 0u;
    while e < full {
        acc[e] += weight * qkv[at + e];
        acc[e + 1u] += weight * qkv[at + e + 1u];
        acc[e + 2u] += weight * qkv[at + e + 2u];
        acc[e + 3u] += weight * qkv[at + e + 3u];
        acc[e + 4u] += weight * qkv[at + e + 4u];
        acc[e + 5u] += weight * qkv[at + e + 5u];
        acc[e + 6u] += weight * qkv[at + e + 6u];
        acc[e + 7u] += weight * qkv[at + e + 7u];
        e += 8u;
    }
    while e < d {
        acc[e] += weight * qkv[at + e];
        e++;
    }
}

@compute @workgroup_size(256)
fn cached_attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    if lid.x == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    let i = flat_index(wid, nwg, lid);
    if i >= q.seqs * q.rows * q.heads {
        return;
    }
    let d = q.head_dim;
    let c = q.heads * d;
    let h = i % q.heads;
    let t = (i / q.heads) % q.rows;
    let s = i / (q.heads * q.rows);
    let start = starts[s];
    let pos = start + t;
    // Row t of sequence s in qkv, its head's q, k, v columns; its output.
    let row = (s * q.rows + t) * 3u * c;
    let q_at = row + h * d;
    let out_at = (s * q.rows + t) * c + h * d;
    if pos >= q.context {
        for (var e = 0u; e < d; e++) {
            out[out_at + e] = quiet_nan();
        }
        return;
    }
    // Cache rows of (s, h) start here.
    let head_base = (s * q.heads + h) * q.context * d;
    let own = head_base + pos * d;
    for (var e = 0u; e < d; e++) {
        query[e] = qkv[q_at + e];
        k_cache[own + e] = qkv[q_at + c + e];
        v_cache[own + e] = qkv[q_at + 2u * c + e];
        acc[e] = 0.0;
    }
    var state = vec2<f32>(LOWEST, 0.0);
    // Keys and values before `start` from the caches, then this
    // dispatch's rows from qkv: two loops, so neither tests per element.
    for (var j = 0u; j < start; j++) {
        let at = head_base + j * d;
        let weight = push_score(&state, cache_dot(at, d) * q.scale, d);
        cache_axpy(at, weight, d);
    }
    for (var j = start; j <= pos; j++) {
        let at = (s * q.rows + (j - start)) * 3u * c + c + h * d;
        let weight = push_score(&state, qkv_dot(at, d) * q.scale, d);
        qkv_axpy(at + c, weight, d);
    }
    let inverse = 1.0 / state.y;
    for (var e = 0u; e < d; e++) {
        out[out_at + e] = acc[e] * inverse;
    }
}

// Lanes of cached_attention_forward_workgroup: two 32-wide subgroups or
// one 64-wide, so a 1,024-position context is 16 positions per lane.
// kernels::attention::DECODE_LANES on the Rust side.
const DECODE_WG: u32 = 64u;
// Channels of the lanes' rows merged per pass: DECODE_WG · MERGE_CHUNK
// floats (8 KiB) of workgroup memory, within WebGPU's default 16 KiB with
// the shared query beside it.
const MERGE_CHUNK: u32 = 32u;
// The query, the same for every lane: read once into workgroup memory.
var<workgroup> query_shared: array<f32, MAX_HEAD_DIM>;
// Each lane's (running maximum, Σ exp), then the tree's merges.
var<workgroup> lane_stats: array<vec2<f32>, DECODE_WG>;
// Each lane's rescaled row, MERGE_CHUNK channels of it, then the tree's sums.
var<workgroup> lane_rows: array<f32, DECODE_WG * MERGE_CHUNK>;
// starts[s], through workgroup memory so that what depends on it is
// uniform (a storage read is not) and the barriers after it are valid.
var<workgroup> shared_start: u32;

// Two online-softmax states (maximum, Σ exp(score − maximum)) as one.
fn merge_stats(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// Shapes as cached_attention_forward: qkv [S, T, 3·C], starts [S],
// k_cache / v_cache [S, H, P, d], out [S, T, C]; workgroup i (over the
// folded 2-D grid) is head h = i % H of row t of sequence s.
@compute @workgroup_size(DECODE_WG)
fn cached_attention_forward_workgroup(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    if lane == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    let i = wid.y * nwg.x + wid.x;
    if i >= q.seqs * q.rows * q.heads {
        return;
    }
    let d = q.head_dim;
    let c = q.heads * d;
    let h = i % q.heads;
    let t = (i / q.heads) % q.rows;
    let s = i / (q.heads * q.rows);
    if lane == 0u {
        shared_start = starts[s];
    }
    let start = workgroupUniformLoad(&shared_start);
    let pos = start + t;
    let row = (s * q.rows + t) * 3u * c;
    let q_at = row + h * d;
    let out_at = (s * q.rows + t) * c + h * d;
    if pos >= q.context {
        for (var e = lane; e < d; e += DECODE_WG) {
            out[out_at + e] = quiet_nan();
        }
        return;
    }
    let head_base = (s * q.heads + h) * q.context * d;
    let own = head_base + pos * d;
    for (var e = lane; e < d; e += DECODE_WG) {
        query_shared[e] = qkv[q_at + e];
        k_cache[own + e] = qkv[q_at + c + e];
        v_cache[own + e] = qkv[q_at + 2u * c + e];
    }
    workgroupBarrier();
    for (var e = 0u; e < d; e++) {
        acc[e] = 0.0;
    }
    // This lane's positions: before `start` from the caches, from `start`
    // on from qkv (this dispatch writes those cache rows; see the top).
    var state = vec2<f32>(LOWEST, 0.0);
    for (var j = lane; j <= pos; j += DECODE_WG) {
        var score = 0.0;
        if j < start {
            let at = head_base + j * d;
            for (var e = 0u; e < d; e++) {
                score += query_shared[e] * k_cache[at + e];
            }
            let weight = push_score(&state, score * q.scale, d);
            for (var e = 0u; e < d; e++) {
                acc[e] += weight * v_cache[at + e];
            }
        } else {
            let at = (s * q.rows + (j - start)) * 3u * c + c + h * d;
            for (var e = 0u; e < d; e++) {
                score += query_shared[e] * qkv[at + e];
            }
            let weight = push_score(&state, score * q.scale, d);
            for (var e = 0u; e < d; e++) {
                acc[e] += weight * qkv[at + c + e];
            }
        }
    }
    // The maxima and sums over the tree; a lane without positions holds
    // (LOWEST, 0), which the merge weighs by exp(LOWEST − max) = 0.
    lane_stats[lane] = state;
    for (var stride = DECODE_WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lane < stride {
            lane_stats[lane] = merge_stats(lane_stats[lane], lane_stats[lane + stride]);
        }
    }
    let total = workgroupUniformLoad(&lane_stats[0]);
    let rescale = exp(state.x - total.x);
    let inverse = 1.0 / total.y;
    // The rows, rescaled to the common maximum, summed over the same tree
    // a chunk of channels at a time; each tree level's additions are spread
    // over all lanes.
    for (var first = 0u; first < d; first += MERGE_CHUNK) {
        let width = min(MERGE_CHUNK, d - first);
        for (var k = 0u; k < MERGE_CHUNK; k++) {
            var v = 0.0;
            if k < width {
                v = acc[first + k] * rescale;
            }
            lane_rows[lane * MERGE_CHUNK + k] = v;
        }
        for (var stride = DECODE_WG / 2u; stride > 0u; stride /= 2u) {
            workgroupBarrier();
            for (var w = lane; w < stride * MERGE_CHUNK; w += DECODE_WG) {
                lane_rows[w] += lane_rows[w + stride * MERGE_CHUNK];
            }
        }
        workgroupBarrier();
        if lane < width {
            out[out_at + first + lane] = lane_rows[lane] * inverse;
        }
        // Every lane has read its result before the next chunk overwrites.
        workgroupBarrier();
    }
}
