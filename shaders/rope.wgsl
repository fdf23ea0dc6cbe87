// Rotary position embedding (RoPE, as in Llama), forward and backward.
//
// rope_forward:  out[S, T, H, D] = x[S, T, H, D] with each channel pair of
//                each head rotated by its angle
// rope_backward: out[S, T, H, D] = dx from dy[S, T, H, D] (in `x`): the
//                rotation by minus the angle, the forward's transpose
//   x       [S, T, H, D]  rows of a [S·T, H·D] projection (q or k), head h
//                         at columns h·D .. h·D + D
//   starts  [S] u32       the position of each sequence's row 0 (0 in
//                         training; the cached length when decoding)
//   table   [P, R/2, 2]   (cos, sin) of position p's angle for pair i
//                         (ops::rope_table, computed on the host)
// Row t of sequence s is at position p = starts[s] + t. The first R =
// rotary_dim channels of each head form R/2 pairs (a, b), rotated to
// (a·cos − b·sin, b·cos + a·sin) with pair i's (cos, sin) at p; channels
// R .. D pass through. Which channels pair up is the layout:
//   ROPE_INTERLEAVED  pair i = channels (2i, 2i + 1)  (Meta's Llama, GGUF)
//   ROPE_HALF_SPLIT   pair i = channels (i, i + R/2)  (Hugging Face's
//                     q·cos + rotate_half(q)·sin: the same products)
// A position ≥ P is the host's error; its row is written as NaN.
// One invocation per output element (the pair's other channel is read
// twice, by both invocations: a rotation has no reduction to share).
// Composed with common.wgsl (WG, flat_index, quiet_nan).

struct RopeParams {
    // S, T, H, D as above.
    seqs: u32,
    rows: u32,
    heads: u32,
    head_dim: u32,
    // R: even, ≤ D.
    rotary_dim: u32,
    // P: rows of the table.
    positions: u32,
    // ROPE_* below (ops::RopeLayout::code).
    pair_layout: u32,
    // Heads h ≥ this pass through whole (the values of a fused q | k | v
    // row, rotated as heads q and k only); H otherwise.
    rotated_heads: u32,
}

const ROPE_INTERLEAVED: u32 = 0u;
const ROPE_HALF_SPLIT: u32 = 1u;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> starts: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> p: RopeParams;

// out[i]; sin_sign 1 rotates by the angle, −1 by minus the angle.
fn rope_element(i: u32, sin_sign: f32) {
    let n = p.seqs * p.rows * p.heads * p.head_dim;
    if i >= n {
        return;
    }
    let c = i % p.head_dim;
    if c >= p.rotary_dim || (i / p.head_dim) % p.heads >= p.rotated_heads {
        out[i] = x[i];
        return;
    }
    let row = i / (p.heads * p.head_dim);
    let t = row % p.rows;
    let start = starts[row / p.rows];
    // start + t ≥ P without the u32 overflow of the sum.
    if start >= p.positions || t >= p.positions - start {
        out[i] = quiet_nan();
        return;
    }
    let half = p.rotary_dim / 2u;
    var pair: u32;
    var first: bool;
    if p.pair_layout == ROPE_INTERLEAVED {
        pair = c / 2u;
        first = c % 2u == 0u;
    } else {
        pair = c % half;
        first = c < half;
    }
    // The partner is as far past a first channel as before a second one.
    let gap = select(1u, half, p.pair_layout == ROPE_HALF_SPLIT);
    var partner = i + gap;
    if !first {
        partner = i - gap;
    }
    let b = x[partner];
    let at = ((start + t) * half + pair) * 2u;
    let cos_a = table[at];
    let sin_a = sin_sign * table[at + 1u];
    if first {
        out[i] = x[i] * cos_a - b * sin_a;
    } else {
        out[i] = x[i] * cos_a + b * sin_a;
    }
}

@compute @workgroup_size(256)
fn rope_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    rope_element(flat_index(wid, nwg, lid), 1.0);
}

@compute @workgroup_size(256)
fn rope_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    rope_element(flat_index(wid, nwg, lid), -1.0);
}
