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
// Scores s = q·kᵀ · scale (scale = 1/√d), causal: query i sees keys 0 ..= i,
// or under a sliding window of W positions keys i - W + 1 ..= i (the host
// passes W = T for no window). Each kernel starts its key (query) loop at
// the first row its workgroup's rows see, so a window skips whole tiles.
//
// flash_attention_forward:            out = softmax(s)·v, lse = log Σ exp(s)
// flash_attention_backward_prepare:   delta = rowsum(dout ∘ out)
// flash_attention_backward_query:     dq = Σ_j p (dout·v_j − delta) k_j · scale
// flash_attention_backward_key_value: dv = Σ_i p dout_i, dk = Σ_i p (dout_i·v − delta_i) q_i · scale,
//                                     summed over the KV head's query heads
// with p = exp(s − lse). (The CPU-shaped kernels at the end of this file
// compute the same with register blocks instead of tiles.) The forward and dq take one workgroup of
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
    // W: query i sees key j when j ≤ i < j + W; 1 ≤ W ≤ T.
    window: u32,
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
// The widest head, in vec4s: d ≤ 256 (kernels::flash_attention::MAX_HEAD_DIM;
// Gemma 3's heads are 256 wide).
const MAX_HEAD_VEC4: u32 = 64u;
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

// The first key query i sees (sliding window).
fn first_key(p: FlashParams, i: u32) -> u32 {
    return i + 1u - min(i + 1u, p.window);
}

// The keys query i sees in a tile of n keys from j0: (first, end) offsets
// into the tile, first ≥ end when it sees none.
fn visible_range(p: FlashParams, i: u32, j0: u32, n: u32) -> vec2<u32> {
    let lo = first_key(p, i);
    let first = select(0u, lo - j0, lo > j0);
    let end = select(0u, min(n, i - j0 + 1u), j0 <= i);
    return vec2<u32>(first, end);
}

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
        // The keys so far, in the frame of maximum lse: Σ exp = 1 (0 for
        // a row that saw none, its lse LOWEST: a window past them).
        m = lse[r.stat];
        l = select(1.0, 0.0, m == LOWEST);
    }
    let key_end = min(p.chunk_end, min(p.seq, (wid.x + 1u) * BLOCK_ROWS));
    let key_start = max(p.chunk_start, first_key(p, wid.x * BLOCK_ROWS));
    for (var j0 = key_start; j0 < key_end; j0 += p.tile) {
        let n = min(p.tile, key_end - j0);
        workgroupBarrier();
        load_key_tiles(p, r.b, r.kvh, j0, n, r.d4, lid.x);
        workgroupBarrier();
        let range = visible_range(p, r.i, j0, n);
        if r.valid && range.x < range.y {
            let visible = range.y;
            var tile_max = LOWEST;
            for (var c = range.x; c < visible; c++) {
                let s = dot_a(c, r.d4);
                scores[c] = s;
                tile_max = max(tile_max, s);
            }
            let m_new = max(m, tile_max);
            let shrink = exp(m - m_new);
            l *= shrink;
            for (var c = range.x; c < visible; c++) {
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
            for (var c = range.x; c < visible; c++) {
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
        // A row that saw no key yet (a window past this launch's keys)
        // keeps zeros and lse LOWEST for the next launch.
        let inv = select(0.0, 1.0 / l, l > 0.0);
        for (var e = 0u; e < d; e++) {
            out[r.at + e] = acc_a[e / 4u][e % 4u] * inv;
        }
        lse[r.stat] = select(LOWEST, m + log(l), l > 0.0);
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
    let key_start = max(p.chunk_start, first_key(p, wid.x * BLOCK_ROWS));
    for (var j0 = key_start; j0 < key_end; j0 += p.tile) {
        let n = min(p.tile, key_end - j0);
        workgroupBarrier();
        load_key_tiles(p, r.b, r.kvh, j0, n, r.d4, lid.x);
        workgroupBarrier();
        let range = visible_range(p, r.i, j0, n);
        if r.valid {
            for (var c = range.x; c < range.y; c++) {
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
    // Queries before the tile's first key see none of its keys, nor
    // those a window past its last key.
    let query_start = max(p.chunk_start, first_key);
    let query_end = min(min(p.chunk_end, p.seq), first_key + BLOCK_ROWS - 1u + p.window);
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
            if valid && i0 + n > j && i0 < j + p.window {
                // Rows before key j do not see it, nor rows W or more after it.
                for (var c = select(0u, j - i0, j > i0); c < min(n, j + p.window - i0); c++) {
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

// ---------------------------------------------------------------------
// The CPU-shaped kernels (Kernels::gpu_shaped() false, d ≤ 64): the same outputs,
// statistics and launch chunks as the tiled ones above, shaped for
// llvmpipe, which runs a workgroup's lanes as one SIMD row, pays a fiber
// switch per barrier, and loads an address its lanes share once: no
// workgroup tiles and no barrier in the loops. Each invocation holds a
// block of ROW_BLOCK rows (queries for the forward and dq, keys for
// dk/dv) in private arrays and streams over the other side STEP rows at
// a time, in vec4s of channels straight from the storage buffers; the
// lanes of a workgroup take neighbouring blocks of one head, so every
// lane loads the same key (query) rows at the same time. A step's scores
// are a vec4 per held row (the loops over the block's rows have constant
// bounds, which Mesa unrolls, so they stay in registers), and each vec4
// loaded feeds ROW_BLOCK dot products or multiply-adds. Causal and
// end-of-sequence masks are selects, so the loops' bounds and the
// streamed addresses stay the workgroup's.

// Rows per invocation and invocations per workgroup
// (kernels::flash_attention::{ROW_BLOCK, ROW_LANES}): a workgroup covers
// 64 rows, so its causal loop overshoots a lane's own rows by at most 63.
const ROW_BLOCK: u32 = 8u;
const ROW_LANES: u32 = 8u;
// Rows streamed per step: one vec4 of scores per held row.
const STEP: u32 = 4u;

// The widest head these kernels take, in vec4s: d ≤ 64
// (kernels::flash_attention::ROWS_MAX_HEAD_DIM); wider heads take the
// tiled kernels. WGSL zeroes the private arrays below at each invocation's
// start, which llvmpipe compiles to 8 lanes' scalar stores per float in one
// basic block, and LLVM's time on that block grows faster than linearly:
// with room for d = 128 the three entries took 111 s to compile on a cold
// Mesa cache, 2.6 times what d ≤ 64 takes (43 s).
const ROW_HEAD_VEC4: u32 = 16u;

// The invocation's rows, block[r][e] row r's channels 4e .. 4e + 3,
// ceil(d/4) vec4s each, zero past d: q · scale and (dq) dout, or k · scale
// and v (dk/dv).
var<private> block_a: array<array<vec4<f32>, ROW_HEAD_VEC4>, ROW_BLOCK>;
var<private> block_b: array<array<vec4<f32>, ROW_HEAD_VEC4>, ROW_BLOCK>;
// What it sums: out (forward), dq, or dk; and dv.
var<private> block_acc_a: array<array<vec4<f32>, ROW_HEAD_VEC4>, ROW_BLOCK>;
var<private> block_acc_b: array<array<vec4<f32>, ROW_HEAD_VEC4>, ROW_BLOCK>;

// Channels 4e .. 4e + 3 that are inside the head.
fn channels_in(e: u32, d: u32) -> vec4<bool> {
    return vec4<u32>(4u * e) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(d);
}

// Channels 4e .. 4e + 3 of the row starting at `at`, zero past d. (One
// function per buffer: WGSL passes no storage pointers.)
fn q4(at: u32, e: u32, d: u32) -> vec4<f32> {
    let c = at + 4u * e;
    return select(vec4<f32>(0.0), vec4<f32>(q[c], q[c + 1u], q[c + 2u], q[c + 3u]), channels_in(e, d));
}

fn k4(at: u32, e: u32, d: u32) -> vec4<f32> {
    let c = at + 4u * e;
    return select(vec4<f32>(0.0), vec4<f32>(k[c], k[c + 1u], k[c + 2u], k[c + 3u]), channels_in(e, d));
}

fn v4(at: u32, e: u32, d: u32) -> vec4<f32> {
    let c = at + 4u * e;
    return select(vec4<f32>(0.0), vec4<f32>(v[c], v[c + 1u], v[c + 2u], v[c + 3u]), channels_in(e, d));
}

fn dout4(at: u32, e: u32, d: u32) -> vec4<f32> {
    let c = at + 4u * e;
    return select(vec4<f32>(0.0), vec4<f32>(dout[c], dout[c + 1u], dout[c + 2u], dout[c + 3u]), channels_in(e, d));
}

// STEP keys' (queries') channels 4e .. 4e + 3, one per column, from the
// rows starting at `at`.
fn k_step(at: vec4<u32>, e: u32, d: u32) -> mat4x4<f32> {
    return mat4x4<f32>(k4(at.x, e, d), k4(at.y, e, d), k4(at.z, e, d), k4(at.w, e, d));
}

fn v_step(at: vec4<u32>, e: u32, d: u32) -> mat4x4<f32> {
    return mat4x4<f32>(v4(at.x, e, d), v4(at.y, e, d), v4(at.z, e, d), v4(at.w, e, d));
}

fn q_step(at: vec4<u32>, e: u32, d: u32) -> mat4x4<f32> {
    return mat4x4<f32>(q4(at.x, e, d), q4(at.y, e, d), q4(at.z, e, d), q4(at.w, e, d));
}

fn dout_step(at: vec4<u32>, e: u32, d: u32) -> mat4x4<f32> {
    return mat4x4<f32>(dout4(at.x, e, d), dout4(at.y, e, d), dout4(at.z, e, d), dout4(at.w, e, d));
}

// Where rows first .. first + 3 of head `head` of a [B, T, heads, d]
// tensor start, each row clamped to `last`.
fn step_at(p: FlashParams, heads: u32, b: u32, first: u32, last: u32, head: u32) -> vec4<u32> {
    let t = min(vec4<u32>(first) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    return ((vec4<u32>(b * p.seq) + t) * heads + head) * p.head_dim;
}

// Where row t (clamped to `last`) of head `head` starts.
fn row_at(p: FlashParams, heads: u32, b: u32, t: u32, last: u32, head: u32) -> u32 {
    return head_at(p, heads, b, min(t, last), head);
}

// Keys `keys` that query `i` sees: causal and within the window.
fn keys_visible(p: FlashParams, keys: vec4<u32>, i: u32) -> vec4<bool> {
    return (keys <= vec4<u32>(i)) & (keys + vec4<u32>(p.window) > vec4<u32>(i));
}

// The invocation's first row.
fn block_first_row(wid: vec3<u32>, lane: u32) -> u32 {
    return (wid.x * ROW_LANES + lane) * ROW_BLOCK;
}

// Channels 4e .. 4e + 3 of every row's sums, to zero.
fn clear_block_acc(e: u32) {
    for (var r = 0u; r < ROW_BLOCK; r++) {
        block_acc_a[r][e] = vec4<f32>(0.0);
        block_acc_b[r][e] = vec4<f32>(0.0);
    }
}

// Where an invocation of the CPU-shaped forward or dq works: query rows
// i0 .. i0 + ROW_BLOCK - 1 (those past T clamped to `last` for loads) of
// head h of sequence b, reading KV head kvh; its statistics start at
// stat0 + i0.
struct QueryBlock {
    h: u32,
    b: u32,
    kvh: u32,
    d: u32,
    d4: u32,
    i0: u32,
    last: u32,
    stat0: u32,
    // The keys the workgroup's rows see in this launch end here, and
    // start here (a sliding window skips the earlier ones).
    key_end: u32,
    key_start: u32,
}

fn query_block(p: FlashParams, wid: vec3<u32>, lane: u32) -> QueryBlock {
    let h = wid.y;
    let b = wid.z;
    let key_end = min(p.chunk_end, min(p.seq, (wid.x + 1u) * ROW_LANES * ROW_BLOCK));
    let key_start = max(p.chunk_start, first_key(p, wid.x * ROW_LANES * ROW_BLOCK));
    return QueryBlock(h, b, h / (p.heads / p.kv_heads), p.head_dim, (p.head_dim + 3u) / 4u, block_first_row(wid, lane), p.seq - 1u, (b * p.heads + h) * p.seq, key_end, key_start);
}

// Zeroes sums declared inside a loop before each pass adds to them. WGSL
// zeroes a `var` at each execution of its declaration, but Chrome's
// compiler (Tint, on SwiftShader) carried dq's dp sums over from the step
// before, so they are zeroed here explicitly.
fn zero_rows(sums: ptr<function, array<vec4<f32>, ROW_BLOCK>>) {
    for (var r = 0u; r < ROW_BLOCK; r++) {
        (*sums)[r] = vec4<f32>(0.0);
    }
}

// s[r]: held row r (block_a) against the STEP keys at `key_at`.
fn key_step_scores(key_at: vec4<u32>, d4: u32, d: u32) -> array<vec4<f32>, ROW_BLOCK> {
    var s: array<vec4<f32>, ROW_BLOCK>;
    for (var e = 0u; e < d4; e++) {
        let kb = k_step(key_at, e, d);
        for (var r = 0u; r < ROW_BLOCK; r++) {
            s[r] += block_a[r][e] * kb;
        }
    }
    return s;
}

// out's channels 4e .. 4e + 3 of the row at `at` that are inside the head.
fn store_out4(at: u32, e: u32, d: u32, x: vec4<f32>) {
    let c = at + 4u * e;
    for (var i = 0u; i < 4u; i++) {
        if 4u * e + i < d {
            out[c + i] = x[i];
        }
    }
}

@compute @workgroup_size(8)
fn flash_attention_forward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let qb = query_block(p, wid, lid.x);
    let d = qb.d;
    let d4 = qb.d4;
    let i0 = qb.i0;
    // Per row: running maximum and Σ exp(s − maximum).
    var m: array<f32, ROW_BLOCK>;
    var l: array<f32, ROW_BLOCK>;
    for (var r = 0u; r < ROW_BLOCK; r++) {
        m[r] = LOWEST;
        l[r] = 0.0;
        if p.first == 0u {
            // The keys so far, in the frame of maximum lse: Σ exp = 1 (0
            // for a row that saw none: see the tiled forward).
            m[r] = lse[qb.stat0 + min(i0 + r, qb.last)];
            l[r] = select(1.0, 0.0, m[r] == LOWEST);
        }
    }
    for (var e = 0u; e < d4; e++) {
        for (var r = 0u; r < ROW_BLOCK; r++) {
            let at = row_at(p, p.heads, qb.b, i0 + r, qb.last, qb.h);
            block_a[r][e] = q4(at, e, d) * p.scale;
            var o = vec4<f32>(0.0);
            if p.first == 0u {
                let c = at + 4u * e;
                o = select(vec4<f32>(0.0), vec4<f32>(out[c], out[c + 1u], out[c + 2u], out[c + 3u]), channels_in(e, d));
            }
            block_acc_a[r][e] = o;
        }
    }
    for (var j0 = qb.key_start; j0 < qb.key_end; j0 += STEP) {
        let keys = vec4<u32>(j0) + vec4<u32>(0u, 1u, 2u, 3u);
        let key_at = step_at(p, p.kv_heads, qb.b, j0, qb.key_end - 1u, qb.kvh);
        let s = key_step_scores(key_at, d4, d);
        // The online softmax: weights in the frame of each row's new
        // maximum, 0 for keys the row does not see.
        var w: array<vec4<f32>, ROW_BLOCK>;
        var shrink: array<f32, ROW_BLOCK>;
        let in_chunk = keys < vec4<u32>(qb.key_end);
        for (var r = 0u; r < ROW_BLOCK; r++) {
            let visible = in_chunk & keys_visible(p, keys, i0 + r);
            let masked = select(vec4<f32>(LOWEST), s[r], visible);
            let m_new = max(m[r], max(max(masked.x, masked.y), max(masked.z, masked.w)));
            w[r] = select(vec4<f32>(0.0), exp(masked - m_new), visible);
            shrink[r] = exp(m[r] - m_new);
            l[r] = l[r] * shrink[r] + dot(w[r], vec4<f32>(1.0));
            m[r] = m_new;
        }
        for (var e = 0u; e < d4; e++) {
            let vb = v_step(key_at, e, d);
            for (var r = 0u; r < ROW_BLOCK; r++) {
                block_acc_a[r][e] = block_acc_a[r][e] * shrink[r] + vb * w[r];
            }
        }
    }
    for (var r = 0u; r < ROW_BLOCK; r++) {
        if i0 + r < p.seq {
            let at = head_at(p, p.heads, qb.b, i0 + r, qb.h);
            let inv = select(0.0, 1.0 / l[r], l[r] > 0.0);
            for (var e = 0u; e < d4; e++) {
                store_out4(at, e, d, block_acc_a[r][e] * inv);
            }
            lse[qb.stat0 + i0 + r] = select(LOWEST, m[r] + log(l[r]), l[r] > 0.0);
        }
    }
}

@compute @workgroup_size(8)
fn flash_attention_backward_query_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let qb = query_block(p, wid, lid.x);
    let d = qb.d;
    let d4 = qb.d4;
    let i0 = qb.i0;
    var row_lse: array<f32, ROW_BLOCK>;
    var row_delta: array<f32, ROW_BLOCK>;
    for (var r = 0u; r < ROW_BLOCK; r++) {
        row_lse[r] = lse_in[qb.stat0 + min(i0 + r, qb.last)];
        row_delta[r] = delta_in[qb.stat0 + min(i0 + r, qb.last)];
    }
    for (var e = 0u; e < d4; e++) {
        for (var r = 0u; r < ROW_BLOCK; r++) {
            let at = row_at(p, p.heads, qb.b, i0 + r, qb.last, qb.h);
            block_a[r][e] = q4(at, e, d) * p.scale;
            block_b[r][e] = dout4(at, e, d);
        }
        clear_block_acc(e);
    }
    for (var j0 = qb.key_start; j0 < qb.key_end; j0 += STEP) {
        let keys = vec4<u32>(j0) + vec4<u32>(0u, 1u, 2u, 3u);
        let key_at = step_at(p, p.kv_heads, qb.b, j0, qb.key_end - 1u, qb.kvh);
        let s = key_step_scores(key_at, d4, d);
        // dp[r]: dout_r · v_j.
        var dp: array<vec4<f32>, ROW_BLOCK>;
        zero_rows(&dp);
        for (var e = 0u; e < d4; e++) {
            let vb = v_step(key_at, e, d);
            for (var r = 0u; r < ROW_BLOCK; r++) {
                dp[r] += block_b[r][e] * vb;
            }
        }
        // ds = p (dout·v − delta), p = exp(s − lse), 0 where not visible.
        var ds: array<vec4<f32>, ROW_BLOCK>;
        let in_chunk = keys < vec4<u32>(qb.key_end);
        for (var r = 0u; r < ROW_BLOCK; r++) {
            let visible = in_chunk & keys_visible(p, keys, i0 + r);
            ds[r] = select(vec4<f32>(0.0), exp(s[r] - row_lse[r]), visible) * (dp[r] - row_delta[r]);
        }
        for (var e = 0u; e < d4; e++) {
            let kb = k_step(key_at, e, d);
            for (var r = 0u; r < ROW_BLOCK; r++) {
                block_acc_a[r][e] += kb * ds[r];
            }
        }
    }
    for (var r = 0u; r < ROW_BLOCK; r++) {
        if i0 + r < p.seq {
            let at = head_at(p, p.heads, qb.b, i0 + r, qb.h);
            for (var e = 0u; e < d; e++) {
                var before = 0.0;
                if p.first == 0u {
                    before = dq[at + e];
                }
                dq[at + e] = before + block_acc_a[r][e / 4u][e % 4u] * p.scale;
            }
        }
    }
}

@compute @workgroup_size(8)
fn flash_attention_backward_key_value_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = uniform_params(lid.x);
    let kvh = wid.y;
    let b = wid.z;
    let group = p.heads / p.kv_heads;
    let d = p.head_dim;
    let d4 = (d + 3u) / 4u;
    let j0 = block_first_row(wid, lid.x);
    let last = p.seq - 1u;
    for (var e = 0u; e < d4; e++) {
        for (var r = 0u; r < ROW_BLOCK; r++) {
            let at = row_at(p, p.kv_heads, b, j0 + r, last, kvh);
            block_a[r][e] = k4(at, e, d) * p.scale;
            block_b[r][e] = v4(at, e, d);
        }
        clear_block_acc(e);
    }
    // Queries before the workgroup's first key see none of its keys, nor
    // those a window past its last.
    let first_key = wid.x * ROW_LANES * ROW_BLOCK;
    let query_start = max(p.chunk_start, first_key);
    let query_end = min(min(p.chunk_end, p.seq), first_key + ROW_LANES * ROW_BLOCK - 1u + p.window);
    // The group's query heads in order, then its queries in order.
    for (var g = 0u; g < group; g++) {
        let h = kvh * group + g;
        let stat0 = (b * p.heads + h) * p.seq;
        for (var i0 = query_start; i0 < query_end; i0 += STEP) {
            let queries = vec4<u32>(i0) + vec4<u32>(0u, 1u, 2u, 3u);
            let query_at = step_at(p, p.heads, b, i0, query_end - 1u, h);
            let stat = vec4<u32>(stat0) + min(queries, vec4<u32>(query_end - 1u));
            let step_lse = vec4<f32>(lse_in[stat.x], lse_in[stat.y], lse_in[stat.z], lse_in[stat.w]);
            let step_delta = vec4<f32>(delta_in[stat.x], delta_in[stat.y], delta_in[stat.z], delta_in[stat.w]);
            // s[r]: key r's scores against the step's queries; dp[r]: v_r · dout_i.
            var s: array<vec4<f32>, ROW_BLOCK>;
            var dp: array<vec4<f32>, ROW_BLOCK>;
            zero_rows(&s);
            zero_rows(&dp);
            for (var e = 0u; e < d4; e++) {
                let qb = q_step(query_at, e, d);
                let ob = dout_step(query_at, e, d);
                for (var r = 0u; r < ROW_BLOCK; r++) {
                    s[r] += block_a[r][e] * qb;
                    dp[r] += block_b[r][e] * ob;
                }
            }
            // Query i sees key j when j ≤ i < j + W.
            var w: array<vec4<f32>, ROW_BLOCK>;
            var ds: array<vec4<f32>, ROW_BLOCK>;
            let in_chunk = queries < vec4<u32>(query_end);
            for (var r = 0u; r < ROW_BLOCK; r++) {
                let seen = (queries >= vec4<u32>(j0 + r)) & (queries < vec4<u32>(j0 + r + p.window));
                w[r] = select(vec4<f32>(0.0), exp(s[r] - step_lse), in_chunk & seen);
                ds[r] = w[r] * (dp[r] - step_delta);
            }
            for (var e = 0u; e < d4; e++) {
                let qb = q_step(query_at, e, d);
                let ob = dout_step(query_at, e, d);
                for (var r = 0u; r < ROW_BLOCK; r++) {
                    block_acc_a[r][e] += qb * ds[r];
                    block_acc_b[r][e] += ob * w[r];
                }
            }
        }
    }
    for (var r = 0u; r < ROW_BLOCK; r++) {
        if j0 + r < p.seq {
            let at = head_at(p, p.kv_heads, b, j0 + r, kvh);
            for (var e = 0u; e < d; e++) {
                var dk_before = 0.0;
                var dv_before = 0.0;
                if p.first == 0u {
                    dk_before = dk[at + e];
                    dv_before = dv[at + e];
                }
                dk[at + e] = dk_before + block_acc_a[r][e / 4u][e % 4u] * p.scale;
                dv[at + e] = dv_before + block_acc_b[r][e / 4u][e % 4u];
            }
        }
    }
}
