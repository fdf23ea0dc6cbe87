// Fused causal self-attention, forward and backward: FlashAttention-2
// (Dao, 2023). Tiles of queries against tiles of keys with an online
// softmax; the forward keeps each row's log-sum-exp, and the backward
// recomputes the probabilities tile by tile from it, so no [T, T] tensor
// is ever stored: memory O(B·H·T·d).
//
// Layouts (each row's heads side by side, as the projections produce them,
// so the models need no permute):
//   q, out, dout, dq   [B, T, H, d]
//   k, v, dk, dv       [B, T, Hkv, d]      query head h reads KV head h / (H / Hkv)
//   lse, delta         [B, H, T]           row statistics
// Scores s = q·kᵀ · scale (scale = 1/√d), causal: query i sees keys 0 ..= i.
//
// flash_attention_forward:            out = softmax(s)·v, lse = log Σ exp(s)
// flash_attention_backward_prepare:   delta = rowsum(dout ∘ out)
// flash_attention_backward_query:     dq = Σ_j p (dout·v_j − delta) k_j · scale
// flash_attention_backward_key_value: dv = Σ_i p dout_i, dk = Σ_i p (dout_i·v − delta_i) q_i · scale,
//                                     summed over the KV head's query heads
// with p = exp(s − lse). The forward and dq take one workgroup of
// BLOCK_ROWS invocations per (query tile, head, sequence), one query row
// each; dk/dv one per (key tile, KV head, sequence), one key row each, so
// every output element has one writer summing in a fixed order: no
// atomics, the same bits on every run.
//
// A launch covers the keys (forward, dq) or queries (dk/dv) chunk_start ..
// chunk_end; with `first` = 0 it continues what the previous launch left
// in the outputs: the forward from (out, lse), which are the normalized
// row and log-sum-exp of the keys so far (the running sum of exp is
// exp(lse) in the frame of maximum lse), the gradients by adding. The host
// splits long loops over several launches because llvmpipe ends an
// invocation's loops after 65,535 iterations in all (see attention.wgsl);
// on a GPU one launch covers everything. Head dimensions up to
// 4·MAX_HEAD_VEC4. Composed with common.wgsl (WG, flat_index, LOWEST).

struct FlashParams {
    // B, T, H, Hkv, d.
    batch: u32,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    // 1/√d.
    scale: f32,
    // The keys (forward, dq) or queries (dk/dv) this launch covers.
    chunk_start: u32,
    chunk_end: u32,
    // 1: the launch starts the outputs; 0: it continues them.
    first: u32,
    // Rows per workgroup-memory tile (TILE_VEC4 / padded_vec4s(d), at most
    // MAX_TILE).
    tile: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read> out_in: array<f32>;
@group(0) @binding(5) var<storage, read> lse_in: array<f32>;
@group(0) @binding(6) var<storage, read> delta_in: array<f32>;
@group(0) @binding(7) var<uniform> params: FlashParams;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;
@group(0) @binding(9) var<storage, read_write> lse: array<f32>;
@group(0) @binding(10) var<storage, read_write> delta: array<f32>;
@group(0) @binding(11) var<storage, read_write> dq: array<f32>;
@group(0) @binding(12) var<storage, read_write> dk: array<f32>;
@group(0) @binding(13) var<storage, read_write> dv: array<f32>;

// Invocations per workgroup of the tiled kernels, one row each
// (kernels::flash_attention::BLOCK_ROWS).
const BLOCK_ROWS: u32 = 64u;
// The widest head, in vec4s: d ≤ 128 (kernels::flash_attention::MAX_HEAD_DIM).
const MAX_HEAD_VEC4: u32 = 32u;
// vec4s of one workgroup-memory tile: two tiles and the statistics stay
// under WebGPU's 16 KiB of workgroup memory.
const TILE_VEC4: u32 = 384u;
// The most rows of a tile (the private score array).
const MAX_TILE: u32 = 64u;

// The parameters through workgroup memory: lavapipe inlines uniform values
// that bound loops and re-optimizes the shader on every dispatch (see
// loss.wgsl); a value from workgroupUniformLoad is not inlined.
var<workgroup> shared_params: FlashParams;
// Keys (forward, dq) or queries (dk/dv) of the current tile, row r at
// r·padded_vec4s(d), padded with zeros.
var<workgroup> tile_a: array<vec4<f32>, TILE_VEC4>;
// Values (forward, dq) or dout rows (dk/dv) of the current tile.
var<workgroup> tile_b: array<vec4<f32>, TILE_VEC4>;
// (lse, delta) of the current query tile (dk/dv).
var<workgroup> tile_stats: array<vec2<f32>, MAX_TILE>;

// The invocation's own rows, zero-padded to padded_vec4s(d): q · scale
// (forward, dq) or k · scale (dk/dv); dout (dq) or v (dk/dv).
var<private> row_a: array<vec4<f32>, MAX_HEAD_VEC4>;
var<private> row_b: array<vec4<f32>, MAX_HEAD_VEC4>;
// What it sums: out (forward), dq, or dk; and dv.
var<private> acc_a: array<vec4<f32>, MAX_HEAD_VEC4>;
var<private> acc_b: array<vec4<f32>, MAX_HEAD_VEC4>;
// One tile's scores, then their weights.
var<private> scores: array<f32, MAX_TILE>;

// Where row t's head `head` of a [B, T, heads, d] tensor starts.
fn head_at(p: FlashParams, heads: u32, b: u32, t: u32, head: u32) -> u32 {
    return ((b * p.seq + t) * heads + head) * p.head_dim;
}

// vec4s per row in the tiles and the private rows: d rounded up to 16
// channels (zeros past d), so every channel loop steps 4 vec4s at a time.
// llvmpipe pays for each loop iteration (its execution masks and its
// iteration counter), and these loops run once per (query, key) pair.
fn padded_vec4s(d: u32) -> u32 {
    return (d + 15u) / 16u * 4u;
}

// row_a · tile_a row c.
fn dot_a(c: u32, d4: u32) -> f32 {
    var s = 0.0;
    let at = c * d4;
    for (var e = 0u; e < d4; e += 4u) {
        s += dot(row_a[e], tile_a[at + e]) + dot(row_a[e + 1u], tile_a[at + e + 1u]) + dot(row_a[e + 2u], tile_a[at + e + 2u]) + dot(row_a[e + 3u], tile_a[at + e + 3u]);
    }
    return s;
}

// row_b · tile_b row c.
fn dot_b(c: u32, d4: u32) -> f32 {
    var s = 0.0;
    let at = c * d4;
    for (var e = 0u; e < d4; e += 4u) {
        s += dot(row_b[e], tile_b[at + e]) + dot(row_b[e + 1u], tile_b[at + e + 1u]) + dot(row_b[e + 2u], tile_b[at + e + 2u]) + dot(row_b[e + 3u], tile_b[at + e + 3u]);
    }
    return s;
}

// acc_a += w · tile_a's row starting at vec4 `at`.
fn add_tile_a_row(w: f32, at: u32, d4: u32) {
    for (var e = 0u; e < d4; e += 4u) {
        acc_a[e] += w * tile_a[at + e];
        acc_a[e + 1u] += w * tile_a[at + e + 1u];
        acc_a[e + 2u] += w * tile_a[at + e + 2u];
        acc_a[e + 3u] += w * tile_a[at + e + 3u];
    }
}

// Rows first .. first + n of the keys and values of KV head `head` into
// the tiles (forward, dq), zero past d; the workgroup's invocations share
// the loads. (Two functions, not one with a flag: an entry point binds
// every buffer its functions name.)
fn load_key_tiles(p: FlashParams, b: u32, head: u32, first: u32, n: u32, d4: u32, lane: u32) {
    let width = d4 * 4u;
    for (var idx = lane; idx < n * width; idx += BLOCK_ROWS) {
        let r = idx / width;
        let e = idx % width;
        var x = 0.0;
        var y = 0.0;
        if e < p.head_dim {
            let at = head_at(p, p.kv_heads, b, first + r, head) + e;
            x = k[at];
            y = v[at];
        }
        tile_a[r * d4 + e / 4u][e % 4u] = x;
        tile_b[r * d4 + e / 4u][e % 4u] = y;
    }
}

// The same for the queries and dout rows of query head `head` (dk/dv).
fn load_query_tiles(p: FlashParams, b: u32, head: u32, first: u32, n: u32, d4: u32, lane: u32) {
    let width = d4 * 4u;
    for (var idx = lane; idx < n * width; idx += BLOCK_ROWS) {
        let r = idx / width;
        let e = idx % width;
        var x = 0.0;
        var y = 0.0;
        if e < p.head_dim {
            let at = head_at(p, p.heads, b, first + r, head) + e;
            x = q[at];
            y = dout[at];
        }
        tile_a[r * d4 + e / 4u][e % 4u] = x;
        tile_b[r * d4 + e / 4u][e % 4u] = y;
    }
}

// The parameters, through workgroup memory (see `shared_params`); called
// first, in uniform control flow.
fn uniform_params(lane: u32) -> FlashParams {
    if lane == 0u {
        shared_params = params;
    }
    return workgroupUniformLoad(&shared_params);
}

// Where an invocation of the forward or dq kernels works: query row i of
// head h of sequence b, its place in q (`at`, clamped to a real row when i
// is past T) and in the statistics. (Derived from the invocation's id, so
// no loop bound around a barrier may read it: WGSL's uniformity rule.)
struct QueryRow {
    d4: u32,
    h: u32,
    b: u32,
    kvh: u32,
    i: u32,
    valid: bool,
    at: u32,
    stat: u32,
}

fn query_row(p: FlashParams, wid: vec3<u32>, lane: u32) -> QueryRow {
    let h = wid.y;
    let b = wid.z;
    let i = wid.x * BLOCK_ROWS + lane;
    let row = min(i, p.seq - 1u);
    return QueryRow(padded_vec4s(p.head_dim), h, b, h / (p.heads / p.kv_heads), i, i < p.seq, head_at(p, p.heads, b, row, h), (b * p.heads + h) * p.seq + row);
}

@compute @workgroup_size(64)
fn flash_attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let r = query_row(p, wid, lid.x);
    let d = p.head_dim;
    // (running maximum, Σ exp(s − maximum)); acc_a the unnormalized row.
    var m = LOWEST;
    var l = 0.0;
    for (var e = 0u; e < r.d4 * 4u; e++) {
        var x = 0.0;
        var o = 0.0;
        if r.valid && e < d {
            x = q[r.at + e] * p.scale;
            if p.first == 0u {
                o = out[r.at + e];
            }
        }
        row_a[e / 4u][e % 4u] = x;
        acc_a[e / 4u][e % 4u] = o;
    }
    if r.valid && p.first == 0u {
        // The keys so far, in the frame of maximum lse: Σ exp = 1.
        m = lse[r.stat];
        l = 1.0;
    }
    let key_end = min(p.chunk_end, min(p.seq, (wid.x + 1u) * BLOCK_ROWS));
    for (var j0 = p.chunk_start; j0 < key_end; j0 += p.tile) {
        let n = min(p.tile, key_end - j0);
        workgroupBarrier();
        load_key_tiles(p, r.b, r.kvh, j0, n, r.d4, lid.x);
        workgroupBarrier();
        if r.valid && j0 <= r.i {
            let visible = min(n, r.i - j0 + 1u);
            var tile_max = LOWEST;
            for (var c = 0u; c < visible; c++) {
                let s = dot_a(c, r.d4);
                scores[c] = s;
                tile_max = max(tile_max, s);
            }
            let m_new = max(m, tile_max);
            let shrink = exp(m - m_new);
            l *= shrink;
            for (var c = 0u; c < visible; c++) {
                let w = exp(scores[c] - m_new);
                scores[c] = w;
                l += w;
            }
            for (var e = 0u; e < r.d4; e += 4u) {
                acc_a[e] *= shrink;
                acc_a[e + 1u] *= shrink;
                acc_a[e + 2u] *= shrink;
                acc_a[e + 3u] *= shrink;
            }
            for (var c = 0u; c < visible; c++) {
                let w = scores[c];
                let row_at = c * r.d4;
                for (var e = 0u; e < r.d4; e += 4u) {
                    acc_a[e] += w * tile_b[row_at + e];
                    acc_a[e + 1u] += w * tile_b[row_at + e + 1u];
                    acc_a[e + 2u] += w * tile_b[row_at + e + 2u];
                    acc_a[e + 3u] += w * tile_b[row_at + e + 3u];
                }
            }
            m = m_new;
        }
    }
    if r.valid {
        let inv = 1.0 / l;
        for (var e = 0u; e < d; e++) {
            out[r.at + e] = acc_a[e / 4u][e % 4u] * inv;
        }
        lse[r.stat] = m + log(l);
    }
}

@compute @workgroup_size(256)
fn flash_attention_backward_prepare(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    // One invocation per (sequence, row, head): its row of dout ∘ out.
    let p = uniform_params(lid.x);
    let r = flat_index(wid, nwg, lid);
    if r >= p.batch * p.seq * p.heads {
        return;
    }
    let h = r % p.heads;
    let t = (r / p.heads) % p.seq;
    let b = r / (p.heads * p.seq);
    let at = r * p.head_dim;
    var s = 0.0;
    for (var e = 0u; e < p.head_dim; e++) {
        s += dout[at + e] * out_in[at + e];
    }
    delta[(b * p.heads + h) * p.seq + t] = s;
}

@compute @workgroup_size(64)
fn flash_attention_backward_query(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let r = query_row(p, wid, lid.x);
    let d = p.head_dim;
    for (var e = 0u; e < r.d4 * 4u; e++) {
        var x = 0.0;
        var g = 0.0;
        if r.valid && e < d {
            x = q[r.at + e] * p.scale;
            g = dout[r.at + e];
        }
        row_a[e / 4u][e % 4u] = x;
        row_b[e / 4u][e % 4u] = g;
        acc_a[e / 4u][e % 4u] = 0.0;
    }
    let row_lse = lse_in[r.stat];
    let row_delta = delta_in[r.stat];
    let key_end = min(p.chunk_end, min(p.seq, (wid.x + 1u) * BLOCK_ROWS));
    for (var j0 = p.chunk_start; j0 < key_end; j0 += p.tile) {
        let n = min(p.tile, key_end - j0);
        workgroupBarrier();
        load_key_tiles(p, r.b, r.kvh, j0, n, r.d4, lid.x);
        workgroupBarrier();
        if r.valid && j0 <= r.i {
            let visible = min(n, r.i - j0 + 1u);
            for (var c = 0u; c < visible; c++) {
                let prob = exp(dot_a(c, r.d4) - row_lse);
                let ds = prob * (dot_b(c, r.d4) - row_delta);
                add_tile_a_row(ds, c * r.d4, r.d4);
            }
        }
    }
    if r.valid {
        for (var e = 0u; e < d; e++) {
            var before = 0.0;
            if p.first == 0u {
                before = dq[r.at + e];
            }
            dq[r.at + e] = before + acc_a[e / 4u][e % 4u] * p.scale;
        }
    }
}

@compute @workgroup_size(64)
fn flash_attention_backward_key_value(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let d = p.head_dim;
    let d4 = padded_vec4s(d);
    let kvh = wid.y;
    let b = wid.z;
    let group = p.heads / p.kv_heads;
    let first_key = wid.x * BLOCK_ROWS;
    let j = first_key + lid.x;
    let valid = j < p.seq;
    let at = head_at(p, p.kv_heads, b, min(j, p.seq - 1u), kvh);
    for (var e = 0u; e < d4 * 4u; e++) {
        var x = 0.0;
        var y = 0.0;
        if valid && e < d {
            x = k[at + e] * p.scale;
            y = v[at + e];
        }
        row_a[e / 4u][e % 4u] = x;
        row_b[e / 4u][e % 4u] = y;
        acc_a[e / 4u][e % 4u] = 0.0;
        acc_b[e / 4u][e % 4u] = 0.0;
    }
    // Queries before the tile's first key see none of its keys.
    let query_start = max(p.chunk_start, first_key);
    let query_end = min(p.chunk_end, p.seq);
    // The group's query heads in order, then its queries in order.
    for (var r = 0u; r < group; r++) {
        let h = kvh * group + r;
        for (var i0 = query_start; i0 < query_end; i0 += p.tile) {
            let n = min(p.tile, query_end - i0);
            workgroupBarrier();
            load_query_tiles(p, b, h, i0, n, d4, lid.x);
            if lid.x < n {
                let stat = (b * p.heads + h) * p.seq + i0 + lid.x;
                tile_stats[lid.x] = vec2<f32>(lse_in[stat], delta_in[stat]);
            }
            workgroupBarrier();
            if valid && i0 + n > j {
                // Rows before key j do not see it.
                for (var c = select(0u, j - i0, j > i0); c < n; c++) {
                    let stats = tile_stats[c];
                    // tile_a holds q unscaled; row_a is k · scale.
                    let prob = exp(dot_a(c, d4) - stats.x);
                    let ds = prob * (dot_b(c, d4) - stats.y);
                    add_tile_a_row(ds, c * d4, d4);
                    let at = c * d4;
                    for (var e = 0u; e < d4; e += 4u) {
                        acc_b[e] += prob * tile_b[at + e];
                        acc_b[e + 1u] += prob * tile_b[at + e + 1u];
                        acc_b[e + 2u] += prob * tile_b[at + e + 2u];
                        acc_b[e + 3u] += prob * tile_b[at + e + 3u];
                    }
                }
            }
        }
    }
    if valid {
        for (var e = 0u; e < d; e++) {
            var dk_before = 0.0;
            var dv_before = 0.0;
            if p.first == 0u {
                dk_before = dk[at + e];
                dv_before = dv[at + e];
            }
            dk[at + e] = dk_before + acc_a[e / 4u][e % 4u] * p.scale;
            dv[at + e] = dv_before + acc_b[e / 4u][e % 4u];
        }
    }
}
