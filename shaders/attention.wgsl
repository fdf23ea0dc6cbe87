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
// ONE INVOCATION PER (sequence, row, head), 256 per workgroup over a 2-D
// grid, with serial loops over keys and channels: lavapipe pays per
// workgroup and per barrier (see rowwise.wgsl), and the softmax is online
// (a running maximum; the output row being summed is rescaled when it
// grows), so each key is read once and the sum runs in position order: the
// result is the same on every run. Head dimensions up to MAX_HEAD_DIM.
// Composed with common.wgsl (WG, flat_index).

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
        for (var e = 0u; e < d; e++) {
            acc[e] *= shrink;
        }
        (*state).x = score;
    }
    let weight = exp(score - (*state).x);
    (*state).y += weight;
    return weight;
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
        var score = 0.0;
        for (var e = 0u; e < d; e++) {
            score += query[e] * k_cache[at + e];
        }
        let weight = push_score(&state, score * q.scale, d);
        for (var e = 0u; e < d; e++) {
            acc[e] += weight * v_cache[at + e];
        }
    }
    for (var j = start; j <= pos; j++) {
        let at = (s * q.rows + (j - start)) * 3u * c + c + h * d;
        var score = 0.0;
        for (var e = 0u; e < d; e++) {
            score += query[e] * qkv[at + e];
        }
        let weight = push_score(&state, score * q.scale, d);
        for (var e = 0u; e < d; e++) {
            acc[e] += weight * qkv[at + c + e];
        }
    }
    let inverse = 1.0 / state.y;
    for (var e = 0u; e < d; e++) {
        out[out_at + e] = acc[e] * inverse;
    }
}
