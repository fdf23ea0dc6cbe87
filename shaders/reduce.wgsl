// Reductions over f32 arrays.
//   sum_rows_forward:    out[cols] = Σ_r x[rows, cols]      (bias gradient)
//   sum_rows_partial:    out[blocks, cols] = Σ over each block of
//                        block_rows rows of x[rows, cols]   (stage one)
//   sum_forward:         out[1]    = Σ_i x[n]
//   mean_forward:        out[1]    = Σ_i x[n] / n
//   max_rows_forward:    out[rows] = max_c x[rows, cols]
//   argmax_rows_forward: idx[rows] = first c with x[r, c] = max_c x[r, c]
// Whole-array reductions run in one workgroup with a fixed summation order,
// so their result is deterministic on a given adapter.

// sum_rows_forward adds into `out` instead of overwriting it (a bias
// gradient accumulated straight into its parameter's gradient buffer).
override ACCUMULATE: bool = false;

struct ReduceParams {
    rows: u32,
    cols: u32,
    n: u32,
    // sum_rows_partial: rows per block (the last block may hold fewer).
    block_rows: u32,
    // argmax_rows_forward over x larger than one binding runs as launches
    // over parts of whole rows (`rows` of them): the first row's index, and
    // where it starts in this launch's binding of x.
    first_row: u32,
    part_base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: ReduceParams;
@group(0) @binding(4) var<storage, read_write> idx: array<u32>;

// WG (256) and flat_index come from common.wgsl (Family::source).
var<workgroup> partial: array<f32, 256>;

// One thread per column; rows summed in order.
@compute @workgroup_size(64)
fn sum_rows_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = column_index(wid, nwg, lid);
    if c >= p.cols {
        return;
    }
    var acc = 0.0;
    for (var r = 0u; r < p.rows; r++) {
        acc += x[r * p.cols + c];
    }
    if ACCUMULATE {
        out[c] = out[c] + acc;
    } else {
        out[c] = acc;
    }
}

// Stage one of a two-stage column sum (the GPU shaping, reduce.rs): one
// invocation per (block, column), index b·cols + c, so neighbouring
// invocations read neighbouring columns. Each sums its block's rows in
// order; sum_rows_forward over out[blocks, cols] is stage two, adding the
// blocks in order. The blocks depend on the shape alone, so the result is
// the same on every run and every adapter that takes this path.
@compute @workgroup_size(256)
fn sum_rows_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    let blocks = (p.rows + p.block_rows - 1u) / p.block_rows;
    if i >= blocks * p.cols {
        return;
    }
    let c = i % p.cols;
    let first = (i / p.cols) * p.block_rows;
    let end = min(first + p.block_rows, p.rows);
    var acc = 0.0;
    for (var r = first; r < end; r++) {
        acc += x[r * p.cols + c];
    }
    out[i] = acc;
}

// Strided partial sums, then a tree in workgroup memory.
fn workgroup_sum(t: u32) -> f32 {
    var acc = 0.0;
    for (var i = t; i < p.n; i += WG) {
        acc += x[i];
    }
    partial[t] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if t < stride {
            partial[t] += partial[t + stride];
        }
        workgroupBarrier();
    }
    return partial[0];
}

@compute @workgroup_size(256)
fn sum_forward(@builtin(local_invocation_index) t: u32) {
    let total = workgroup_sum(t);
    if t == 0u {
        out[0] = total;
    }
}

@compute @workgroup_size(256)
fn mean_forward(@builtin(local_invocation_index) t: u32) {
    let total = workgroup_sum(t);
    if t == 0u {
        out[0] = total / f32(p.n);
    }
}

// One thread per row.
@compute @workgroup_size(256)
fn max_rows_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = flat_index(wid, nwg, lid);
    if r >= p.rows {
        return;
    }
    var best = x[r * p.cols];
    for (var c = 1u; c < p.cols; c++) {
        best = max(best, x[r * p.cols + c]);
    }
    out[r] = best;
}

@compute @workgroup_size(256)
fn argmax_rows_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = flat_index(wid, nwg, lid);
    if r >= p.rows {
        return;
    }
    let start = p.part_base + r * p.cols;
    var best = x[start];
    var best_c = 0u;
    for (var c = 1u; c < p.cols; c++) {
        let v = x[start + c];
        if v > best {
            best = v;
            best_c = c;
        }
    }
    idx[p.first_row + r] = best_c;
}
