// Attention over a KV cache: the generation path (src/generate.rs), where
// each new token costs one position's attention instead of a re-run of the
// whole sequence (llm.c, llama.cpp).
//
// cached_attention_forward:
//   q_rows  [S, T, *]       query rows: head h at columns q_first + h·d ..
//                           + d of each row of q_width
//   k_rows  [S, T, *]       key rows, KV head g at k_first + g·d (k_width)
//   v_rows  [S, T, *]       value rows, KV head g at v_first + g·d (v_width)
//   starts  [S] u32         the cache position of each sequence's row 0
//   k_cache [S, Hkv, P, d]  read_write: keys of positions 0 .. P (the context)
//   v_cache [S, Hkv, P, d]  read_write: values, the same layout
//   out     [S, T, H·d]     query heads side by side, as c_proj / o_proj read them
// A GPT's fused c_attn rows (q | k | v, widths 3·H·d) are one buffer bound
// as all three row operands; Llama's q, k, v projections are three. Query
// head h reads KV head h / (H / Hkv) (grouped-query attention; H = Hkv is
// multi-head). Row t of sequence s is position p = starts[s] + t. The
// invocation of its KV group's first query head writes k and v of p into
// the caches; every query head then attends over positions 0 ..= p
// (p - W + 1 ..= p under a sliding window of W positions; the host passes
// W = P for none): softmax(q·kᵀ · scale) · v. Keys before starts[s] come from the cache;
// keys starts[s] .. p come from the row operands themselves, because
// another invocation of this dispatch writes them and WGSL cannot order
// that write before this read. So every invocation reads cache rows <
// starts[s] and writes only rows ≥ starts[s], each by one invocation: no
// race, one dispatch for a decode step (T = 1) and for a whole prompt
// (starts = 0, T = prompt length). A position ≥ P is the host's error;
// here it writes NaN to its output and leaves the cache.
//
// Three shapes of the same contract (kernels/attention.rs picks by
// adapter; cached_attention_forward_grouped, a CPU adapter's, is below):
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
    // H: query heads.
    heads: u32,
    // Hkv: key/value heads, dividing H.
    kv_heads: u32,
    // d: channels per head.
    head_dim: u32,
    // P: cache rows per (sequence, KV head).
    context: u32,
    // Multiplies q·k: 1/√d.
    scale: f32,
    // Row widths of q_rows, k_rows, v_rows and the column of each one's
    // head 0.
    q_width: u32,
    k_width: u32,
    v_width: u32,
    q_first: u32,
    k_first: u32,
    v_first: u32,
    // W: position p attends to positions p - W + 1 ..= p; 1 ≤ W ≤ P.
    window: u32,
    _pad1: u32,
    _pad2: u32,
}

// The first position position `pos` attends to.
fn first_position(q: AttentionParams, pos: u32) -> u32 {
    return pos + 1u - min(pos + 1u, q.window);
}

// Where one (sequence, row, query head) reads and writes.
struct Places {
    // Its query in q_rows and its output row in out.
    q_at: u32,
    out_at: u32,
    // Its KV head's row 0 in the caches, and its key and value in the row
    // operands at the dispatch's first row (row r adds r · width).
    cache_base: u32,
    k_at: u32,
    v_at: u32,
    // Whether this invocation writes its KV head's new keys and values:
    // the first query head of the group does.
    writes: bool,
}

fn places(q: AttentionParams, s: u32, t: u32, h: u32) -> Places {
    let d = q.head_dim;
    let kv = h / (q.heads / q.kv_heads);
    let row = s * q.rows + t;
    let first_row = s * q.rows;
    return Places(
        row * q.q_width + q.q_first + h * d,
        row * q.heads * d + h * d,
        (s * q.kv_heads + kv) * q.context * d,
        first_row * q.k_width + q.k_first + kv * d,
        first_row * q.v_width + q.v_first + kv * d,
        h % (q.heads / q.kv_heads) == 0u,
    );
}

@group(0) @binding(0) var<storage, read> q_rows: array<f32>;
@group(0) @binding(1) var<storage, read> k_rows: array<f32>;
@group(0) @binding(2) var<storage, read> v_rows: array<f32>;
@group(0) @binding(3) var<storage, read> starts: array<u32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<uniform> params: AttentionParams;

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

// query · k_rows[at .. at + d].
fn rows_dot(at: u32, d: u32) -> f32 {
    let full = d - d % 8u;
    var score = 0.0;
    var e = 0u;
    while e < full {
        score += query[e] * k_rows[at + e];
        score += query[e + 1u] * k_rows[at + e + 1u];
        score += query[e + 2u] * k_rows[at + e + 2u];
        score += query[e + 3u] * k_rows[at + e + 3u];
        score += query[e + 4u] * k_rows[at + e + 4u];
        score += query[e + 5u] * k_rows[at + e + 5u];
        score += query[e + 6u] * k_rows[at + e + 6u];
        score += query[e + 7u] * k_rows[at + e + 7u];
        e += 8u;
    }
    while e < d {
        score += query[e] * k_rows[at + e];
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

// acc += weight · v_rows[at .. at + d].
fn rows_axpy(at: u32, weight: f32, d: u32) {
    let full = d - d % 8u;
    var e = 0u;
    while e < full {
        acc[e] += weight * v_rows[at + e];
        acc[e + 1u] += weight * v_rows[at + e + 1u];
        acc[e + 2u] += weight * v_rows[at + e + 2u];
        acc[e + 3u] += weight * v_rows[at + e + 3u];
        acc[e + 4u] += weight * v_rows[at + e + 4u];
        acc[e + 5u] += weight * v_rows[at + e + 5u];
        acc[e + 6u] += weight * v_rows[at + e + 6u];
        acc[e + 7u] += weight * v_rows[at + e + 7u];
        e += 8u;
    }
    while e < d {
        acc[e] += weight * v_rows[at + e];
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
    let h = i % q.heads;
    let t = (i / q.heads) % q.rows;
    let s = i / (q.heads * q.rows);
    let start = starts[s];
    let pos = start + t;
    let at = places(q, s, t, h);
    if pos >= q.context {
        for (var e = 0u; e < d; e++) {
            out[at.out_at + e] = quiet_nan();
        }
        return;
    }
    let own = at.cache_base + pos * d;
    let new_k = at.k_at + t * q.k_width;
    let new_v = at.v_at + t * q.v_width;
    for (var e = 0u; e < d; e++) {
        query[e] = q_rows[at.q_at + e];
        acc[e] = 0.0;
    }
    if at.writes {
        for (var e = 0u; e < d; e++) {
            k_cache[own + e] = k_rows[new_k + e];
            v_cache[own + e] = v_rows[new_v + e];
        }
    }
    var state = vec2<f32>(LOWEST, 0.0);
    // Keys and values before `start` from the caches, then this
    // dispatch's rows from the row operands: two loops, so neither tests
    // per element.
    let lo = first_position(q, pos);
    for (var j = lo; j < start; j++) {
        let cached = at.cache_base + j * d;
        let weight = push_score(&state, cache_dot(cached, d) * q.scale, d);
        cache_axpy(cached, weight, d);
    }
    for (var j = max(start, lo); j <= pos; j++) {
        let r = j - start;
        let weight = push_score(&state, rows_dot(at.k_at + r * q.k_width, d) * q.scale, d);
        rows_axpy(at.v_at + r * q.v_width, weight, d);
    }
    let inverse = 1.0 / state.y;
    for (var e = 0u; e < d; e++) {
        out[at.out_at + e] = acc[e] * inverse;
    }
}

// Lanes of cached_attention_forward_workgroup: on a GPU two 32-wide
// subgroups or one 64-wide, so a 1,024-position context is 16 positions
// per lane; on a CPU adapter 32 (fewer fibers to switch at each barrier).
// At least MERGE_CHUNK: lane c stores channel c of each merged chunk.
// kernels::attention::DECODE_LANES (the GPU's) on the Rust side.
override DECODE_WG: u32 = 64u;
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

// starts[s] as a workgroup-uniform value (lane 0 reads it); called from
// uniform control flow.
fn workgroup_start(lane: u32, s: u32) -> u32 {
    if lane == 0u {
        shared_start = starts[s];
    }
    return workgroupUniformLoad(&shared_start);
}

// Two online-softmax states (maximum, Σ exp(score − maximum)) as one.
fn merge_stats(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// Shapes as cached_attention_forward: q_rows, k_rows, v_rows [S, T, *],
// starts [S], k_cache / v_cache [S, Hkv, P, d], out [S, T, H·d]; workgroup
// i (over the folded 2-D grid) is query head h = i % H of row t of
// sequence s.
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
    let h = i % q.heads;
    let t = (i / q.heads) % q.rows;
    let s = i / (q.heads * q.rows);
    let start = workgroup_start(lane, s);
    let pos = start + t;
    let at = places(q, s, t, h);
    if pos >= q.context {
        for (var e = lane; e < d; e += DECODE_WG) {
            out[at.out_at + e] = quiet_nan();
        }
        return;
    }
    let own = at.cache_base + pos * d;
    let new_k = at.k_at + t * q.k_width;
    let new_v = at.v_at + t * q.v_width;
    for (var e = lane; e < d; e += DECODE_WG) {
        query_shared[e] = q_rows[at.q_at + e];
        if at.writes {
            k_cache[own + e] = k_rows[new_k + e];
            v_cache[own + e] = v_rows[new_v + e];
        }
    }
    workgroupBarrier();
    for (var e = 0u; e < d; e++) {
        acc[e] = 0.0;
    }
    // This lane's positions: before `start` from the caches, from `start`
    // on from the row operands (this dispatch writes those cache rows; see
    // the top).
    var state = vec2<f32>(LOWEST, 0.0);
    for (var j = first_position(q, pos) + lane; j <= pos; j += DECODE_WG) {
        var score = 0.0;
        if j < start {
            let cached = at.cache_base + j * d;
            for (var e = 0u; e < d; e++) {
                score += query_shared[e] * k_cache[cached + e];
            }
            let weight = push_score(&state, score * q.scale, d);
            for (var e = 0u; e < d; e++) {
                acc[e] += weight * v_cache[cached + e];
            }
        } else {
            let r = j - start;
            let key = at.k_at + r * q.k_width;
            let value = at.v_at + r * q.v_width;
            for (var e = 0u; e < d; e++) {
                score += query_shared[e] * k_rows[key + e];
            }
            let weight = push_score(&state, score * q.scale, d);
            for (var e = 0u; e < d; e++) {
                acc[e] += weight * v_rows[value + e];
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
            out[at.out_at + first + lane] = lane_rows[lane] * inverse;
        }
        // Every lane has read its result before the next chunk overwrites.
        workgroupBarrier();
    }
}

// cached_attention_forward_grouped: ONE WORKGROUP PER (sequence, row, KV
// head, chunk of up to GROUP_HEADS of the query heads sharing that KV
// head), for CPU adapters. Its GROUPED_LANES lanes (one SIMD row of
// llvmpipe: no fiber switch at its barriers) split the positions as the
// workgroup kernel's do, and each key and value, read as vec4s, serves
// every query head of the chunk: grouped-query attention reads the cache
// once per KV head, not once per query head (SmolLM2: 3 heads share one).
// Each lane keeps an online-softmax state per head, component g of a
// vec4 being head g's; the rescale is folded into the value update (acc
// · shrink + weight · v), so no branch on the maximum. The lanes then
// merge in a fixed order (the same bits on every run). head_dim a
// multiple of 4 and at most GROUPED_MAX_HEAD_DIM; the operands' views start 16-byte aligned and their
// columns (widths, first columns) are multiples of 4 (the Rust side
// checks). Loop iterations per lane: ≈ positions / GROUPED_LANES · (2 ·
// head_dim / 4 + 1), which the Rust side keeps under llvmpipe's 65,535.
override GROUPED_LANES: u32 = 8u;
const GROUP_HEADS: u32 = 4u;
// The largest head_dim this kernel takes (kernels::attention's
// GROUPED_MAX_HEAD_DIM), as vec4s: its per-lane arrays are sized by it, and
// llvmpipe's compile time grows faster than their size (cold, 2.3 s at 64
// channels, 8.7 s at 128, 25 s at 256), while a longer head falls back to
// the kernels above. SmolLM2's, Llama 3.2 1B's and Qwen2.5 0.5B's are 64.
const GROUPED_HEAD_VEC4: u32 = 16u;

@group(0) @binding(0) var<storage, read> q_rows4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_rows4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_rows4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> k_cache4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> v_cache4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out4: array<vec4<f32>>;

// Head g's query (vec4 e at g · GROUPED_HEAD_VEC4 + e) and its weighted value
// row being summed, per lane.
var<private> group_query: array<vec4<f32>, GROUP_HEADS * GROUPED_HEAD_VEC4>;
var<private> group_acc: array<vec4<f32>, GROUP_HEADS * GROUPED_HEAD_VEC4>;
// Each lane's (maximum, Σ exp) per head, then its rescaled rows one head
// at a time.
var<workgroup> grouped_stats: array<vec4<f32>, 2u * GROUPED_LANES>;
var<workgroup> grouped_rows: array<vec4<f32>, GROUPED_LANES * GROUPED_HEAD_VEC4>;

// The scores of one key (vec4s at `at` of k_cache4, or of k_rows4 when
// `cached` is false) against the chunk's queries, head g in component g.
fn grouped_scores(at: u32, cached: bool, d4: u32) -> vec4<f32> {
    var score = vec4<f32>(0.0);
    for (var e = 0u; e < d4; e++) {
        var key: vec4<f32>;
        if cached {
            key = k_cache4[at + e];
        } else {
            key = k_rows4[at + e];
        }
        score += vec4<f32>(
            dot(group_query[e], key),
            dot(group_query[GROUPED_HEAD_VEC4 + e], key),
            dot(group_query[2u * GROUPED_HEAD_VEC4 + e], key),
            dot(group_query[3u * GROUPED_HEAD_VEC4 + e], key),
        );
    }
    return score;
}

// acc_g = acc_g · shrink[g] + weight[g] · value for the value at `at`.
fn grouped_update(at: u32, cached: bool, d4: u32, shrink: vec4<f32>, weight: vec4<f32>) {
    for (var e = 0u; e < d4; e++) {
        var value: vec4<f32>;
        if cached {
            value = v_cache4[at + e];
        } else {
            value = v_rows4[at + e];
        }
        group_acc[e] = fma(vec4<f32>(weight.x), value, group_acc[e] * shrink.x);
        group_acc[GROUPED_HEAD_VEC4 + e] = fma(vec4<f32>(weight.y), value, group_acc[GROUPED_HEAD_VEC4 + e] * shrink.y);
        group_acc[2u * GROUPED_HEAD_VEC4 + e] = fma(vec4<f32>(weight.z), value, group_acc[2u * GROUPED_HEAD_VEC4 + e] * shrink.z);
        group_acc[3u * GROUPED_HEAD_VEC4 + e] = fma(vec4<f32>(weight.w), value, group_acc[3u * GROUPED_HEAD_VEC4 + e] * shrink.w);
    }
}

// Shapes as cached_attention_forward; workgroup i (over the folded 2-D
// grid) is chunk c of KV head g of row t of sequence s, in that order
// (chunks = ⌈(H / Hkv) / GROUP_HEADS⌉ per KV head).
@compute @workgroup_size(GROUPED_LANES)
fn cached_attention_forward_grouped(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    if lane == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    let group = q.heads / q.kv_heads;
    let chunks = (group + GROUP_HEADS - 1u) / GROUP_HEADS;
    let i = wid.y * nwg.x + wid.x;
    if i >= q.seqs * q.rows * q.kv_heads * chunks {
        return;
    }
    let d4 = q.head_dim / 4u;
    let chunk = i % chunks;
    let kv = (i / chunks) % q.kv_heads;
    let t = (i / (chunks * q.kv_heads)) % q.rows;
    let s = i / (chunks * q.kv_heads * q.rows);
    let head0 = kv * group + chunk * GROUP_HEADS;
    let heads = min(GROUP_HEADS, group - chunk * GROUP_HEADS);
    let start = workgroup_start(lane, s);
    let pos = start + t;
    let at = places(q, s, t, head0);
    if pos >= q.context {
        for (var e = lane; e < heads * d4; e += GROUPED_LANES) {
            out4[at.out_at / 4u + e] = vec4<f32>(quiet_nan());
        }
        return;
    }
    let cache_base = at.cache_base / 4u;
    let own = cache_base + pos * d4;
    let new_k = (at.k_at + t * q.k_width) / 4u;
    let new_v = (at.v_at + t * q.v_width) / 4u;
    if at.writes {
        for (var e = lane; e < d4; e += GROUPED_LANES) {
            k_cache4[own + e] = k_rows4[new_k + e];
            v_cache4[own + e] = v_rows4[new_v + e];
        }
    }
    // The chunk's queries; a head past the chunk's stays zero (its scores
    // are zeros, its rows never stored).
    for (var g = 0u; g < GROUP_HEADS; g++) {
        let q_at = at.q_at / 4u + g * d4;
        for (var e = 0u; e < d4; e++) {
            var value = vec4<f32>(0.0);
            if g < heads {
                value = q_rows4[q_at + e];
            }
            group_query[g * GROUPED_HEAD_VEC4 + e] = value;
            group_acc[g * GROUPED_HEAD_VEC4 + e] = vec4<f32>(0.0);
        }
    }
    let k_step = q.k_width / 4u;
    let v_step = q.v_width / 4u;
    let k_rows_at = at.k_at / 4u;
    let v_rows_at = at.v_at / 4u;
    var maximum = vec4<f32>(LOWEST);
    var total = vec4<f32>(0.0);
    for (var j = first_position(q, pos) + lane; j <= pos; j += GROUPED_LANES) {
        // Before `start` from the caches, from `start` on from the row
        // operands (this dispatch writes those cache rows; see the top).
        let cached = j < start;
        var key_at = cache_base + j * d4;
        var value_at = key_at;
        if !cached {
            key_at = k_rows_at + (j - start) * k_step;
            value_at = v_rows_at + (j - start) * v_step;
        }
        let score = grouped_scores(key_at, cached, d4) * q.scale;
        let grown = max(maximum, score);
        let shrink = exp(maximum - grown);
        let weight = exp(score - grown);
        total = fma(total, shrink, weight);
        maximum = grown;
        grouped_update(value_at, cached, d4, shrink, weight);
    }
    // The lanes' states merged in lane order; a lane without positions
    // holds (LOWEST, 0), weighed by exp(LOWEST − max) = 0.
    grouped_stats[lane] = maximum;
    grouped_stats[GROUPED_LANES + lane] = total;
    workgroupBarrier();
    var common_max = vec4<f32>(LOWEST);
    for (var l = 0u; l < GROUPED_LANES; l++) {
        common_max = max(common_max, grouped_stats[l]);
    }
    var sum = vec4<f32>(0.0);
    for (var l = 0u; l < GROUPED_LANES; l++) {
        sum = fma(grouped_stats[GROUPED_LANES + l], exp(grouped_stats[l] - common_max), sum);
    }
    let factor = exp(maximum - common_max) / sum;
    for (var g = 0u; g < GROUP_HEADS; g++) {
        if g < heads {
            // Every lane has read the previous head's rows.
            workgroupBarrier();
            for (var e = 0u; e < d4; e++) {
                grouped_rows[lane * GROUPED_HEAD_VEC4 + e] = group_acc[g * GROUPED_HEAD_VEC4 + e] * factor[g];
            }
            workgroupBarrier();
            for (var e = lane; e < d4; e += GROUPED_LANES) {
                var row = vec4<f32>(0.0);
                for (var l = 0u; l < GROUPED_LANES; l++) {
                    row += grouped_rows[l * GROUPED_HEAD_VEC4 + e];
                }
                out4[at.out_at / 4u + g * d4 + e] = row;
            }
        }
    }
}

// cached_attention_forward_channels: ONE WORKGROUP PER (sequence, row, KV
// head, chunk of up to GROUP_HEADS of its query heads), as the grouped
// kernel, for CPU adapters and heads too wide for that kernel's per-lane
// rows (Gemma 3's 256 channels). Its CHANNEL_LANES lanes (one SIMD row of
// llvmpipe: no fiber switch at its barriers) split the CHANNELS, not the
// positions: lane l owns vec4s l, l + 8, l + 16, … of every head (up to
// CHANNEL_VEC4 of them, an override: ⌈head_dim / 32⌉), and all lanes walk
// the positions together. At each position a lane sums its channels'
// products with the key for each head of the chunk (component g: head g),
// the lanes' partial scores are added in workgroup memory in lane order
// (so every lane holds the same scores, bit for bit, and runs the same
// online softmax), and each lane updates its own channels of the output
// rows. What a lane keeps is CHANNEL_VEC4 4×4 matrices of query and of
// output (column g: head g), indexed by constants only: the grouped
// kernel's per-lane rows indexed in a loop live in memory on llvmpipe and
// compile slowly past 64 channels; here no merge follows either (a lane
// stores its own channels). A key and a value are read once for the
// chunk's heads, as vec4s: head_dim a multiple of 4, the operands 16-byte
// aligned (the Rust side checks). Loop iterations per lane: about one per
// position (the channel loops are unrolled by hand).
const CHANNEL_LANES: u32 = 8u;
override CHANNEL_VEC4: u32 = 8u;
var<workgroup> channel_partials: array<vec4<f32>, CHANNEL_LANES>;

// A lane's channels of the chunk's heads: rows[i] column g is head g's vec4
// lane + 8·i (zero past head_dim or past the chunk's heads).
struct ChannelRows {
    r0: mat4x4<f32>,
    r1: mat4x4<f32>,
    r2: mat4x4<f32>,
    r3: mat4x4<f32>,
    r4: mat4x4<f32>,
    r5: mat4x4<f32>,
    r6: mat4x4<f32>,
    r7: mat4x4<f32>,
}

// The lane's vec4 i of a head (clamped into it: a lane past head_dim reads
// the last vec4 again, against a zero query, and stores nothing).
fn channel_index(lane: u32, i: u32, d4: u32) -> u32 {
    return min(lane + CHANNEL_LANES * i, d4 - 1u);
}

fn channel_owns(lane: u32, i: u32, d4: u32) -> bool {
    return lane + CHANNEL_LANES * i < d4;
}

// Vec4 i of the lane's channels of the key (`cached`: of k_cache4 from
// `at`, else of k_rows4) or of the value (v_cache4, v_rows4).
fn channel_key(at: u32, cached: bool, lane: u32, i: u32, d4: u32) -> vec4<f32> {
    let e = at + channel_index(lane, i, d4);
    if cached {
        return k_cache4[e];
    }
    return k_rows4[e];
}

fn channel_value(at: u32, cached: bool, lane: u32, i: u32, d4: u32) -> vec4<f32> {
    let e = at + channel_index(lane, i, d4);
    if cached {
        return v_cache4[e];
    }
    return v_rows4[e];
}

// The lane's part of each head's score against the key at `at`.
fn channel_scores(q: ChannelRows, at: u32, cached: bool, lane: u32, d4: u32) -> vec4<f32> {
    var s = channel_key(at, cached, lane, 0u, d4) * q.r0;
    if CHANNEL_VEC4 > 1u {
        s += channel_key(at, cached, lane, 1u, d4) * q.r1;
    }
    if CHANNEL_VEC4 > 2u {
        s += channel_key(at, cached, lane, 2u, d4) * q.r2;
    }
    if CHANNEL_VEC4 > 3u {
        s += channel_key(at, cached, lane, 3u, d4) * q.r3;
    }
    if CHANNEL_VEC4 > 4u {
        s += channel_key(at, cached, lane, 4u, d4) * q.r4;
    }
    if CHANNEL_VEC4 > 5u {
        s += channel_key(at, cached, lane, 5u, d4) * q.r5;
    }
    if CHANNEL_VEC4 > 6u {
        s += channel_key(at, cached, lane, 6u, d4) * q.r6;
    }
    if CHANNEL_VEC4 > 7u {
        s += channel_key(at, cached, lane, 7u, d4) * q.r7;
    }
    return s;
}

// Head g's column of `rows` times shrink[g], plus weight[g] times value.
fn channel_update(rows: mat4x4<f32>, value: vec4<f32>, shrink: vec4<f32>, weight: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(
        fma(vec4<f32>(weight.x), value, rows[0] * shrink.x),
        fma(vec4<f32>(weight.y), value, rows[1] * shrink.y),
        fma(vec4<f32>(weight.z), value, rows[2] * shrink.z),
        fma(vec4<f32>(weight.w), value, rows[3] * shrink.w),
    );
}

// The lane's output rows rescaled and given the value at `at`.
fn channel_values(acc: ChannelRows, at: u32, cached: bool, lane: u32, d4: u32, shrink: vec4<f32>, weight: vec4<f32>) -> ChannelRows {
    var r = acc;
    r.r0 = channel_update(acc.r0, channel_value(at, cached, lane, 0u, d4), shrink, weight);
    if CHANNEL_VEC4 > 1u {
        r.r1 = channel_update(acc.r1, channel_value(at, cached, lane, 1u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 2u {
        r.r2 = channel_update(acc.r2, channel_value(at, cached, lane, 2u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 3u {
        r.r3 = channel_update(acc.r3, channel_value(at, cached, lane, 3u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 4u {
        r.r4 = channel_update(acc.r4, channel_value(at, cached, lane, 4u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 5u {
        r.r5 = channel_update(acc.r5, channel_value(at, cached, lane, 5u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 6u {
        r.r6 = channel_update(acc.r6, channel_value(at, cached, lane, 6u, d4), shrink, weight);
    }
    if CHANNEL_VEC4 > 7u {
        r.r7 = channel_update(acc.r7, channel_value(at, cached, lane, 7u, d4), shrink, weight);
    }
    return r;
}

// Vec4 i of the lane's channels of each head of the chunk's queries (from
// `q_at`, heads d4 apart), zero past the chunk's `heads` or head_dim.
fn channel_query(q_at: u32, lane: u32, i: u32, d4: u32, heads: u32) -> mat4x4<f32> {
    let e = q_at + channel_index(lane, i, d4);
    var m = mat4x4<f32>();
    if channel_owns(lane, i, d4) {
        for (var g = 0u; g < GROUP_HEADS; g++) {
            if g < heads {
                m[g] = q_rows4[e + g * d4];
            }
        }
    }
    return m;
}

fn channel_queries(q_at: u32, lane: u32, d4: u32, heads: u32) -> ChannelRows {
    var r = ChannelRows();
    r.r0 = channel_query(q_at, lane, 0u, d4, heads);
    if CHANNEL_VEC4 > 1u {
        r.r1 = channel_query(q_at, lane, 1u, d4, heads);
    }
    if CHANNEL_VEC4 > 2u {
        r.r2 = channel_query(q_at, lane, 2u, d4, heads);
    }
    if CHANNEL_VEC4 > 3u {
        r.r3 = channel_query(q_at, lane, 3u, d4, heads);
    }
    if CHANNEL_VEC4 > 4u {
        r.r4 = channel_query(q_at, lane, 4u, d4, heads);
    }
    if CHANNEL_VEC4 > 5u {
        r.r5 = channel_query(q_at, lane, 5u, d4, heads);
    }
    if CHANNEL_VEC4 > 6u {
        r.r6 = channel_query(q_at, lane, 6u, d4, heads);
    }
    if CHANNEL_VEC4 > 7u {
        r.r7 = channel_query(q_at, lane, 7u, d4, heads);
    }
    return r;
}

// Stores vec4 i of the lane's channels of each head of the chunk (from
// `out_at`, heads d4 apart), divided by its Σ exp.
fn channel_store(rows: mat4x4<f32>, out_at: u32, lane: u32, i: u32, d4: u32, heads: u32, inverse: vec4<f32>) {
    if channel_owns(lane, i, d4) {
        let e = out_at + lane + CHANNEL_LANES * i;
        for (var g = 0u; g < GROUP_HEADS; g++) {
            if g < heads {
                out4[e + g * d4] = rows[g] * inverse[g];
            }
        }
    }
}

fn channel_store_all(acc: ChannelRows, out_at: u32, lane: u32, d4: u32, heads: u32, inverse: vec4<f32>) {
    channel_store(acc.r0, out_at, lane, 0u, d4, heads, inverse);
    if CHANNEL_VEC4 > 1u {
        channel_store(acc.r1, out_at, lane, 1u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 2u {
        channel_store(acc.r2, out_at, lane, 2u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 3u {
        channel_store(acc.r3, out_at, lane, 3u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 4u {
        channel_store(acc.r4, out_at, lane, 4u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 5u {
        channel_store(acc.r5, out_at, lane, 5u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 6u {
        channel_store(acc.r6, out_at, lane, 6u, d4, heads, inverse);
    }
    if CHANNEL_VEC4 > 7u {
        channel_store(acc.r7, out_at, lane, 7u, d4, heads, inverse);
    }
}

// The lanes' partial scores summed in lane order: the same in every lane.
// Called from uniform control flow.
fn channel_sum(partial: vec4<f32>, lane: u32) -> vec4<f32> {
    channel_partials[lane] = partial;
    workgroupBarrier();
    let p = channel_partials;
    // Every lane has read the partials before the next position's writes.
    workgroupBarrier();
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// Shapes as cached_attention_forward; workgroups as the grouped kernel's.
@compute @workgroup_size(CHANNEL_LANES)
fn cached_attention_forward_channels(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    if lane == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    let group = q.heads / q.kv_heads;
    let chunks = (group + GROUP_HEADS - 1u) / GROUP_HEADS;
    let i = wid.y * nwg.x + wid.x;
    if i >= q.seqs * q.rows * q.kv_heads * chunks {
        return;
    }
    let d4 = q.head_dim / 4u;
    let chunk = i % chunks;
    let kv = (i / chunks) % q.kv_heads;
    let t = (i / (chunks * q.kv_heads)) % q.rows;
    let s = i / (chunks * q.kv_heads * q.rows);
    let head0 = kv * group + chunk * GROUP_HEADS;
    let heads = min(GROUP_HEADS, group - chunk * GROUP_HEADS);
    let start = workgroup_start(lane, s);
    let pos = start + t;
    let at = places(q, s, t, head0);
    if pos >= q.context {
        for (var e = lane; e < heads * d4; e += CHANNEL_LANES) {
            out4[at.out_at / 4u + e] = vec4<f32>(quiet_nan());
        }
        return;
    }
    let cache_base = at.cache_base / 4u;
    let own = cache_base + pos * d4;
    let new_k = (at.k_at + t * q.k_width) / 4u;
    let new_v = (at.v_at + t * q.v_width) / 4u;
    if at.writes {
        for (var e = lane; e < d4; e += CHANNEL_LANES) {
            k_cache4[own + e] = k_rows4[new_k + e];
            v_cache4[own + e] = v_rows4[new_v + e];
        }
    }
    let query = channel_queries(at.q_at / 4u, lane, d4, heads);
    var acc = ChannelRows();
    let k_step = q.k_width / 4u;
    let v_step = q.v_width / 4u;
    let k_rows_at = at.k_at / 4u;
    let v_rows_at = at.v_at / 4u;
    var maximum = vec4<f32>(LOWEST);
    var total = vec4<f32>(0.0);
    for (var j = first_position(q, pos); j <= pos; j++) {
        // Before `start` from the caches, from `start` on from the row
        // operands (this dispatch writes those cache rows; see the top).
        let cached = j < start;
        var key_at = cache_base + j * d4;
        var value_at = key_at;
        if !cached {
            key_at = k_rows_at + (j - start) * k_step;
            value_at = v_rows_at + (j - start) * v_step;
        }
        let score = channel_sum(channel_scores(query, key_at, cached, lane, d4), lane) * q.scale;
        let grown = max(maximum, score);
        let shrink = exp(maximum - grown);
        let weight = exp(score - grown);
        total = fma(total, shrink, weight);
        maximum = grown;
        acc = channel_values(acc, value_at, cached, lane, d4, shrink, weight);
    }
    channel_store_all(acc, at.out_at / 4u, lane, d4, heads, vec4<f32>(1.0) / total);
}
