// Layout kernels for contiguous row-major tensors of rank 1..4, one
// invocation per output element (256 per workgroup, spread over a 2-D grid):
//   binary_broadcast: out[dims] = x[..] ∘ y[..], NumPy broadcasting
//   unary:            out[n] = f(x[n])
//   reduce_to_shape:  out[dims] (+)= Σ x over the axes out broadcasts
//   reduce_to_shape_partial: the same sums over fixed blocks, stage one of
//                     the two-stage form (reduce.wgsl's sum_rows_forward
//                     adds the blocks)
//   permute:          out[dims] = x with axes permuted
//   slice_last:       out[rows, width] = x[rows, cols][:, start..start+width]
//   pad_last:         out[rows, cols] (+)= x[rows, width] in columns start..
//   concat_last:      out[rows, a_cols + b_cols] = [x | y] row by row
// The Rust side (kernels/tensor.rs) pads every shape to rank 4 with leading
// 1s and turns broadcasting and permutation into per-axis strides, so one
// indexing function serves them all. Composed with common.wgsl (WG,
// flat_index); see Family::source.

// Binary ops by code (ops::Binary::code).
const BIN_ADD: u32 = 0u;
const BIN_SUB: u32 = 1u;
const BIN_MUL: u32 = 2u;
const BIN_DIV: u32 = 3u;
// Unary ops by code (ops::Unary::code).
const UN_EXP: u32 = 0u;
const UN_RSQRT: u32 = 1u;

struct TensorParams {
    // Output elements.
    n: u32,
    // A BIN_* or UN_* code. A uniform, not an override: these kernels are
    // memory-bound, and one pipeline per entry keeps compiles few.
    op: u32,
    // 1: add into out instead of overwriting (reduce_to_shape, pad_last).
    accumulate: u32,
    // reduce_to_shape_partial: summed elements per block.
    block: u32,
    // The output's shape padded to rank 4.
    dims: vec4<u32>,
    // Per output axis, the stride into x / y (0 on an axis they broadcast).
    x_strides: vec4<u32>,
    y_strides: vec4<u32>,
    // reduce_to_shape: per axis, how many x elements fold into one output
    // element (1 where out keeps the axis). Last-axis ops: see each kernel.
    extra: vec4<u32>,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: TensorParams;

// The offset, through `strides`, of output element i's coordinates.
fn strided(i: u32, strides: vec4<u32>) -> u32 {
    let d = p.dims;
    let c3 = i % d.w;
    let t2 = i / d.w;
    let c2 = t2 % d.z;
    let t1 = t2 / d.z;
    let c1 = t1 % d.y;
    let c0 = t1 / d.y;
    return c0 * strides.x + c1 * strides.y + c2 * strides.z + c3 * strides.w;
}

fn binary_op(op: u32, a: f32, b: f32) -> f32 {
    if op == BIN_SUB {
        return a - b;
    }
    if op == BIN_MUL {
        return a * b;
    }
    if op == BIN_DIV {
        return a / b;
    }
    return a + b;
}

// out[dims] = x ∘ y with x, y read through their broadcast strides.
@compute @workgroup_size(256)
fn binary_broadcast_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    out[i] = binary_op(p.op, x[strided(i, p.x_strides)], y[strided(i, p.y_strides)]);
}

// out[n] = exp(x) or inverseSqrt(x). inverseSqrt of x ≤ 0 is left to the
// adapter (IEEE gives +inf at +0 and NaN below; ops::Unary::Rsqrt).
@compute @workgroup_size(256)
fn unary_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    let v = x[i];
    if p.op == UN_RSQRT {
        out[i] = inverseSqrt(v);
    } else {
        out[i] = exp(v);
    }
}

// out[dims] (+)= the sum of x over the axes where out has 1 and x more
// (x_strides are x's own). Each output element sums its x elements in one
// fixed order, axis 0 outermost, in f32: deterministic, no atomics, no
// cross-invocation reduction (the gradient of a broadcast is a few sums of
// at most B·T terms, memory-bound either way).
@compute @workgroup_size(256)
fn reduce_to_shape_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    // The output's coordinate on a summed axis is 0, so this is the first
    // x element that folds into out[i].
    let base = strided(i, p.x_strides);
    let e = p.extra;
    let s = p.x_strides;
    var acc = 0.0;
    for (var i0 = 0u; i0 < e.x; i0++) {
        for (var i1 = 0u; i1 < e.y; i1++) {
            for (var i2 = 0u; i2 < e.z; i2++) {
                let row = base + i0 * s.x + i1 * s.y + i2 * s.z;
                for (var i3 = 0u; i3 < e.w; i3++) {
                    acc += x[row + i3 * s.w];
                }
            }
        }
    }
    if p.accumulate != 0u {
        out[i] = out[i] + acc;
    } else {
        out[i] = acc;
    }
}

// reduce_to_shape_partial: out[blocks, n] = the sums of reduce_to_shape
// split into blocks of `block` consecutive summed elements (in the one-pass
// kernel's order, axis 0 outermost), one invocation per (block, output
// element), index b·n + i: neighbours read neighbouring x where the last
// axis is kept. For a GPU, where a few outputs over many rows (a bias's
// [B, T, C] -> [C]) would otherwise be C serial invocations (tensor.rs).
@compute @workgroup_size(256)
fn reduce_to_shape_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = flat_index(wid, nwg, lid);
    let e = p.extra;
    let summed = e.x * e.y * e.z * e.w;
    let blocks = (summed + p.block - 1u) / p.block;
    if j >= blocks * p.n {
        return;
    }
    let i = j % p.n;
    let first = (j / p.n) * p.block;
    let end = min(first + p.block, summed);
    let base = strided(i, p.x_strides);
    let s = p.x_strides;
    // The first summed element's coordinates, then a counter over them.
    var i3 = first % e.w;
    var i2 = (first / e.w) % e.z;
    var i1 = (first / (e.w * e.z)) % e.y;
    var i0 = first / (e.w * e.z * e.y);
    var acc = 0.0;
    for (var k = first; k < end; k++) {
        acc += x[base + i0 * s.x + i1 * s.y + i2 * s.z + i3 * s.w];
        i3++;
        if i3 == e.w {
            i3 = 0u;
            i2++;
            if i2 == e.z {
                i2 = 0u;
                i1++;
                if i1 == e.y {
                    i1 = 0u;
                    i0++;
                }
            }
        }
    }
    out[j] = acc;
}

// out[dims] = x with axes permuted: x_strides[i] is x's stride of axis perm[i].
@compute @workgroup_size(256)
fn permute_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    out[i] = x[strided(i, p.x_strides)];
}

// out[rows, width] = x[rows, cols][:, start..start + width];
// extra = (cols, start, width, _).
@compute @workgroup_size(256)
fn slice_last_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    let width = p.extra.z;
    out[i] = x[(i / width) * p.extra.x + p.extra.y + i % width];
}

// out[rows, cols]: columns start..start + width (+)= x[rows, width], the
// others 0 (or left as they are when accumulating);
// extra = (cols, start, width, _).
@compute @workgroup_size(256)
fn pad_last_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    let cols = p.extra.x;
    let start = p.extra.y;
    let width = p.extra.z;
    let c = i % cols;
    let inside = c >= start && c < start + width;
    if inside {
        let v = x[(i / cols) * width + c - start];
        if p.accumulate != 0u {
            out[i] = out[i] + v;
        } else {
            out[i] = v;
        }
    } else if p.accumulate == 0u {
        out[i] = 0.0;
    }
}

// out[rows, a_cols + b_cols] = [x[rows, a_cols] | y[rows, b_cols]];
// extra = (a_cols, b_cols, _, _).
@compute @workgroup_size(256)
fn concat_last_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= p.n {
        return;
    }
    let a_cols = p.extra.x;
    let b_cols = p.extra.y;
    let total = a_cols + b_cols;
    let r = i / total;
    let c = i % total;
    if c < a_cols {
        out[i] = x[r * a_cols + c];
    } else {
        out[i] = y[r * b_cols + c - a_cols];
    }
}
