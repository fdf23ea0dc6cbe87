// Row-wise kernels of the transformer: softmax (optionally causal),
// layernorm, RMSNorm, cross-entropy over long rows, embedding lookup.
//
// Every row op runs ONE WORKGROUP PER ROW: 256 invocations stride over the
// row, then reduce in workgroup memory with a tree of fixed shape, so a row
// of any length (a 50,257-token vocabulary) takes one dispatch and the
// result is the same on every run. Rows are spread over a 2-D grid of
// workgroups (row = wid.y · nwg.x + wid.x, as `Kernels::grid` lays them
// out); workgroups past the last row leave at once.
//
// Short rows (softmax, layernorm, cross-entropy with cols ≤ the adapter's
// Kernels::short_row_max in rowwise.rs) take the `_short` twin of each
// kernel instead: ONE INVOCATION PER ROW, a serial loop over the row and no barrier but the one
// that loads the parameters. On llvmpipe/lavapipe a workgroup barrier
// switches between the workgroup's fibers, so 1536 workgroups of 256 with a
// dozen barriers each cost ~80 ms for rows of 12, where one invocation per
// row needs ~0.3 ms. Rows are then laid out like elements (row =
// (wid.y · nwg.x + wid.x) · WG + t), and the serial sums run in column
// order, so results are deterministic too.
//
// Input gradients (dx, dlogits) are written; the embedding's dtable is added
// into (+=), like the rest of the engine's parameter gradients, and dweight,
// dbias of layernorm_backward_params either (its `accumulate` parameter).

struct RowParams {
    // Rows; embedding: positions n.
    rows: u32,
    // Row length; embedding: channels C.
    cols: u32,
    // softmax_forward: T of the causal mask, 0 for none.
    causal: u32,
    // embedding: vocabulary size V.
    vocab: u32,
    // layernorm_forward, rmsnorm_forward: added to the variance (mean square).
    eps: f32,
    // cross_entropy_rows_forward_backward: dlogits factor (1/rows for a mean).
    scale: f32,
    // layernorm_backward_params: 1 adds into dweight/dbias, 0 overwrites
    // them (an intermediate that holds stale values).
    accumulate: u32,
    // layernorm_backward_params_partial / _finish: rows per block.
    block_rows: u32,
    // embedding: the table rows (ids) row_start..row_end this launch
    // reads or writes, which start at element table_base of its `table` /
    // `dtable` binding. The whole vocabulary unless the table is too large
    // for one storage binding, which splits the lookup into launches over
    // row ranges, each skipping the ids outside its own.
    row_start: u32,
    row_end: u32,
    table_base: u32,
    // layernorm_backward_params*: 1 for layernorm (x̂ = (x − mean)·rstd,
    // and dbias), 0 for RMSNorm (x̂ = x·rstd; `mean` and `dbias` unused).
    centered: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: RowParams;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read> weight: array<f32>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;
@group(0) @binding(7) var<storage, read_write> mean_out: array<f32>;
@group(0) @binding(8) var<storage, read_write> rstd_out: array<f32>;
@group(0) @binding(9) var<storage, read> mean: array<f32>;
@group(0) @binding(10) var<storage, read> rstd: array<f32>;
@group(0) @binding(11) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(12) var<storage, read_write> dbias: array<f32>;
@group(0) @binding(13) var<storage, read> targets: array<u32>;
@group(0) @binding(14) var<storage, read_write> losses: array<f32>;
@group(0) @binding(15) var<storage, read> ids: array<u32>;
@group(0) @binding(16) var<storage, read> table: array<f32>;
@group(0) @binding(17) var<storage, read_write> dtable: array<f32>;
@group(0) @binding(18) var<storage, read_write> cursor: array<atomic<u32>>;
@group(0) @binding(19) var<storage, read_write> order: array<u32>;

// WG (256 invocations per workgroup) comes from common.wgsl.
var<workgroup> shared_params: RowParams;
var<workgroup> red: array<vec2<f32>, 256>;
// embedding_backward_sort's lanes: 256, or 1024 on a GPU that allows
// them (rowwise.rs, SORT_WG_GPU); its arrays hold the most.
override SORT_WG: u32 = 256u;
const SORT_WG_MAX: u32 = 1024u;
var<workgroup> tile_ids: array<u32, SORT_WG_MAX>;
var<workgroup> scan: array<u32, SORT_WG_MAX>;

// The parameters, through workgroup memory. lavapipe inlines uniform values
// that bound loops into the shader and re-optimizes it on every dispatch
// (see loss.wgsl); a value from workgroupUniformLoad is not inlined, and is
// uniform, so the early returns below that depend on it keep every barrier
// in uniform control flow. Call first, from uniform control flow.
fn uniform_params(t: u32) -> RowParams {
    if t == 0u {
        shared_params = params;
    }
    return workgroupUniformLoad(&shared_params);
}

fn row_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.y * nwg.x + wid.x;
}


// Componentwise sum of every invocation's `value`, as a fixed tree.
fn tree_sum2(t: u32, value: vec2<f32>) -> vec2<f32> {
    // Earlier readers of red[0] must be done before it is overwritten.
    workgroupBarrier();
    red[t] = value;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if t < stride {
            red[t] += red[t + stride];
        }
    }
    return workgroupUniformLoad(&red[0]);
}

// Online softmax statistics: (m, s) with s = Σ exp(v - m) over the values
// seen; two partial results merge exactly as one pass over both would.
fn online_push(ms: vec2<f32>, v: f32) -> vec2<f32> {
    if v > ms.x {
        return vec2<f32>(v, ms.y * exp(ms.x - v) + 1.0);
    }
    return vec2<f32>(ms.x, ms.y + exp(v - ms.x));
}

fn online_merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// (max, Σ exp(v - max)) over the workgroup, as a fixed tree.
fn tree_max_sum(t: u32, value: vec2<f32>) -> vec2<f32> {
    workgroupBarrier();
    red[t] = value;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if t < stride {
            red[t] = online_merge(red[t], red[t + stride]);
        }
    }
    return workgroupUniformLoad(&red[0]);
}

// (max, Σ exp(x - max)) of x[base .. base + len].
fn row_max_sum(t: u32, base: u32, len: u32) -> vec2<f32> {
    var ms = vec2<f32>(LOWEST, 0.0);
    for (var c = t; c < len; c += WG) {
        ms = online_push(ms, x[base + c]);
    }
    return tree_max_sum(t, ms);
}

// softmax_forward: out[rows, cols] = softmax(x[rows, cols]) over each row.
// With causal = T (rows = batch·heads·T, cols = T), row r is query position
// t = r % T: columns ≤ t are the softmax of themselves, columns > t are 0.
@compute @workgroup_size(256)
fn softmax_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var live = q.cols;
    if q.causal != 0u {
        live = r % q.causal + 1u;
    }
    let ms = row_max_sum(t, base, live);
    let inv = 1.0 / ms.y;
    for (var c = t; c < q.cols; c += WG) {
        var v = 0.0;
        if c < live {
            v = exp(x[base + c] - ms.x) * inv;
        }
        out[base + c] = v;
    }
}

// softmax_backward: out[rows, cols] = dx = y · (dy − Σ_c dy·y), from the
// forward's output y[rows, cols] and dy[rows, cols]. Masked columns have
// y = 0, so they get dx = 0 with no mask here.
@compute @workgroup_size(256)
fn softmax_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var acc = 0.0;
    for (var c = t; c < q.cols; c += WG) {
        acc += dy[base + c] * y[base + c];
    }
    let dot = tree_sum2(t, vec2<f32>(acc, 0.0)).x;
    for (var c = t; c < q.cols; c += WG) {
        out[base + c] = y[base + c] * (dy[base + c] - dot);
    }
}

// softmax_forward with one invocation per row (see the top of the file).
// Two passes over the live columns (max, then Σ exp), then the outputs.
@compute @workgroup_size(256)
fn softmax_forward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var live = q.cols;
    if q.causal != 0u {
        live = r % q.causal + 1u;
    }
    var m = LOWEST;
    for (var c = 0u; c < live; c++) {
        m = max(m, x[base + c]);
    }
    var s = 0.0;
    for (var c = 0u; c < live; c++) {
        s += exp(x[base + c] - m);
    }
    let inv = 1.0 / s;
    for (var c = 0u; c < q.cols; c++) {
        var v = 0.0;
        if c < live {
            v = exp(x[base + c] - m) * inv;
        }
        out[base + c] = v;
    }
}

// softmax_backward with one invocation per row.
@compute @workgroup_size(256)
fn softmax_backward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var dot = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        dot += dy[base + c] * y[base + c];
    }
    for (var c = 0u; c < q.cols; c++) {
        out[base + c] = y[base + c] * (dy[base + c] - dot);
    }
}

// layernorm_forward: out[rows, cols] = (x − mean) · rstd · weight[cols] +
// bias[cols], mean_out[rows] and rstd_out[rows] = 1 / sqrt(var + eps) with
// the biased variance (PyTorch's). Two passes for the variance (mean, then
// squared deviations): no cancellation when |mean| ≫ std.
@compute @workgroup_size(256)
fn layernorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let n = f32(q.cols);
    var s = 0.0;
    for (var c = t; c < q.cols; c += WG) {
        s += x[base + c];
    }
    let mu = tree_sum2(t, vec2<f32>(s, 0.0)).x / n;
    var v = 0.0;
    for (var c = t; c < q.cols; c += WG) {
        let d = x[base + c] - mu;
        v += d * d;
    }
    let variance = tree_sum2(t, vec2<f32>(v, 0.0)).x / n;
    // Not inverseSqrt: some drivers compute it to a few ulp only.
    let rs = 1.0 / sqrt(variance + q.eps);
    if t == 0u {
        mean_out[r] = mu;
        rstd_out[r] = rs;
    }
    for (var c = t; c < q.cols; c += WG) {
        out[base + c] = (x[base + c] - mu) * rs * weight[c] + bias[c];
    }
}

// layernorm_backward: out[rows, cols] = dx from dy[rows, cols], the forward
// input x[rows, cols], weight[cols] and the forward's mean[rows], rstd[rows]:
// with x̂ = (x − mean)·rstd and g = dy·weight,
// dx = (g − mean_c(g) − x̂ · mean_c(g·x̂)) · rstd.
@compute @workgroup_size(256)
fn layernorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let mu = mean[r];
    let rs = rstd[r];
    var acc = vec2<f32>(0.0, 0.0);
    for (var c = t; c < q.cols; c += WG) {
        let xhat = (x[base + c] - mu) * rs;
        let g = dy[base + c] * weight[c];
        acc += vec2<f32>(g, g * xhat);
    }
    let sums = tree_sum2(t, acc) / f32(q.cols);
    for (var c = t; c < q.cols; c += WG) {
        let xhat = (x[base + c] - mu) * rs;
        let g = dy[base + c] * weight[c];
        out[base + c] = (g - sums.x - xhat * sums.y) * rs;
    }
}

// layernorm_forward with one invocation per row: the same two passes.
@compute @workgroup_size(256)
fn layernorm_forward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let n = f32(q.cols);
    var s = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        s += x[base + c];
    }
    let mu = s / n;
    var v = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        let d = x[base + c] - mu;
        v += d * d;
    }
    // Not inverseSqrt: as layernorm_forward.
    let rs = 1.0 / sqrt(v / n + q.eps);
    mean_out[r] = mu;
    rstd_out[r] = rs;
    for (var c = 0u; c < q.cols; c++) {
        out[base + c] = (x[base + c] - mu) * rs * weight[c] + bias[c];
    }
}

// layernorm_backward with one invocation per row.
@compute @workgroup_size(256)
fn layernorm_backward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let mu = mean[r];
    let rs = rstd[r];
    var acc = vec2<f32>(0.0, 0.0);
    for (var c = 0u; c < q.cols; c++) {
        let xhat = (x[base + c] - mu) * rs;
        let g = dy[base + c] * weight[c];
        acc += vec2<f32>(g, g * xhat);
    }
    let sums = acc / f32(q.cols);
    for (var c = 0u; c < q.cols; c++) {
        let xhat = (x[base + c] - mu) * rs;
        let g = dy[base + c] * weight[c];
        out[base + c] = (g - sums.x - xhat * sums.y) * rs;
    }
}

// rmsnorm_forward: out[rows, cols] = x · rstd · weight[cols] and
// rstd_out[rows] = 1 / sqrt(mean_c(x²) + eps): torch.nn.RMSNorm and
// Hugging Face's LlamaRMSNorm, whose f32 steps are these in this order
// ((x · rstd) · weight).
@compute @workgroup_size(256)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var s = 0.0;
    for (var c = t; c < q.cols; c += WG) {
        s += x[base + c] * x[base + c];
    }
    // Not inverseSqrt: as layernorm_forward.
    let rs = 1.0 / sqrt(tree_sum2(t, vec2<f32>(s, 0.0)).x / f32(q.cols) + q.eps);
    if t == 0u {
        rstd_out[r] = rs;
    }
    for (var c = t; c < q.cols; c += WG) {
        out[base + c] = x[base + c] * rs * weight[c];
    }
}

// rmsnorm_backward: out[rows, cols] = dx from dy[rows, cols], the forward
// input x[rows, cols], weight[cols] and the forward's rstd[rows]: with
// x̂ = x·rstd and g = dy·weight, dx = (g − x̂ · mean_c(g·x̂)) · rstd.
@compute @workgroup_size(256)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let rs = rstd[r];
    var acc = 0.0;
    for (var c = t; c < q.cols; c += WG) {
        acc += dy[base + c] * weight[c] * x[base + c] * rs;
    }
    let mean_gx = tree_sum2(t, vec2<f32>(acc, 0.0)).x / f32(q.cols);
    for (var c = t; c < q.cols; c += WG) {
        out[base + c] = (dy[base + c] * weight[c] - x[base + c] * rs * mean_gx) * rs;
    }
}

// rmsnorm_forward with one invocation per row.
@compute @workgroup_size(256)
fn rmsnorm_forward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var s = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        s += x[base + c] * x[base + c];
    }
    let rs = 1.0 / sqrt(s / f32(q.cols) + q.eps);
    rstd_out[r] = rs;
    for (var c = 0u; c < q.cols; c++) {
        out[base + c] = x[base + c] * rs * weight[c];
    }
}

// rmsnorm_backward with one invocation per row.
@compute @workgroup_size(256)
fn rmsnorm_backward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let rs = rstd[r];
    var acc = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        acc += dy[base + c] * weight[c] * x[base + c] * rs;
    }
    let mean_gx = acc / f32(q.cols);
    for (var c = 0u; c < q.cols; c++) {
        out[base + c] = (dy[base + c] * weight[c] - x[base + c] * rs * mean_gx) * rs;
    }
}

// layernorm_backward_params: dweight[cols] (+)= Σ_r dy·x̂, dbias[cols] (+)= Σ_r dy,
// from dy[rows, cols], x[rows, cols], mean[rows], rstd[rows]; with
// centered = 0 RMSNorm's dweight alone, x̂ = x·rstd (the host binds any
// read-only [rows] view as `mean`, and an unused slot as `dbias`). Sums over rows
// cannot come from the one-workgroup-per-row kernel without float atomics,
// so one invocation per column adds the rows in order (deterministic; reads
// are coalesced across neighbouring columns, as in sum_rows_forward).
// acc + (dy·x̂, dy) of row r, column c; rows past the last add nothing.
fn norm_param_row(acc: vec2<f32>, r: u32, c: u32, q: RowParams) -> vec2<f32> {
    if r >= q.rows {
        return acc;
    }
    let i = r * q.cols + c;
    let xhat = (x[i] - select(0.0, mean[r], q.centered != 0u)) * rstd[r];
    return vec2<f32>(acc.x + dy[i] * xhat, acc.y + dy[i]);
}

// dweight[c] (+)= dw and, for layernorm, dbias[c] (+)= db.
fn store_norm_params(c: u32, dw: f32, db: f32, q: RowParams) {
    let keep = q.accumulate != 0u;
    dweight[c] = dw + select(0.0, dweight[c], keep);
    if q.centered != 0u {
        dbias[c] = db + select(0.0, dbias[c], keep);
    }
}

@compute @workgroup_size(64)
fn layernorm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let c = row_index(wid, nwg) * COLUMN_WG + t;
    if c >= q.cols {
        return;
    }
    // Eight rows per iteration, added in row order: llvmpipe (gallivm)
    // ends an invocation's loops after 65,535 iterations in all (one
    // limiter shared by every loop), which silently dropped the rows past
    // 65,535; unrolled, rows up to 8·65,535 are summed.
    var acc = vec2<f32>(0.0, 0.0);
    for (var r = 0u; r < q.rows; r += 8u) {
        acc = norm_param_row(acc, r, c, q);
        acc = norm_param_row(acc, r + 1u, c, q);
        acc = norm_param_row(acc, r + 2u, c, q);
        acc = norm_param_row(acc, r + 3u, c, q);
        acc = norm_param_row(acc, r + 4u, c, q);
        acc = norm_param_row(acc, r + 5u, c, q);
        acc = norm_param_row(acc, r + 6u, c, q);
        acc = norm_param_row(acc, r + 7u, c, q);
    }
    store_norm_params(c, acc.x, acc.y, q);
}

// The same sums in two stages, for a GPU (rowwise.rs chooses): 128
// columns over 8,192 rows would be 128 invocations of 8,192 steps each.
// layernorm_backward_params_partial: out[blocks, 2, cols] = (Σ dy·x̂, Σ dy)
// over each block of block_rows rows, one invocation per (block, column)
// (index b·cols + c: neighbours read neighbouring columns), rows in order.
@compute @workgroup_size(256)
fn layernorm_backward_params_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let i = row_index(wid, nwg) * WG + t;
    let blocks = (q.rows + q.block_rows - 1u) / q.block_rows;
    if i >= blocks * q.cols {
        return;
    }
    let c = i % q.cols;
    let b = i / q.cols;
    let end = min((b + 1u) * q.block_rows, q.rows);
    var acc = vec2<f32>(0.0, 0.0);
    for (var r = b * q.block_rows; r < end; r++) {
        acc = norm_param_row(acc, r, c, q);
    }
    out[b * 2u * q.cols + c] = acc.x;
    out[b * 2u * q.cols + q.cols + c] = acc.y;
}

// layernorm_backward_params_finish: dweight[cols] (+)= Σ_b x[b, 0, c],
// dbias[cols] (+)= Σ_b x[b, 1, c] over the partials x[blocks, 2, cols] of
// layernorm_backward_params_partial, blocks in order; one invocation per
// column.
@compute @workgroup_size(64)
fn layernorm_backward_params_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let c = row_index(wid, nwg) * COLUMN_WG + t;
    if c >= q.cols {
        return;
    }
    let blocks = (q.rows + q.block_rows - 1u) / q.block_rows;
    var dw = 0.0;
    var db = 0.0;
    for (var b = 0u; b < blocks; b++) {
        dw += x[b * 2u * q.cols + c];
        db += x[b * 2u * q.cols + q.cols + c];
    }
    store_norm_params(c, dw, db, q);
}

// cross_entropy_rows_forward_backward: logits x[rows, V], targets[rows] (u32)
//   losses[rows] = logsumexp(x[r, :]) − x[r, targets[r]]
//   out[rows, V] = dlogits = (softmax(x[r, :]) − onehot(targets[r])) · scale
// Fused as llm.c does: one pass for the (max, Σ exp) statistics, one that
// writes dlogits, so the probabilities never round-trip through memory.
// A target ≥ V is read clamped to V − 1 (never out of bounds) and makes the
// row's loss and dlogits NaN: the GPU cannot raise an error, and a NaN loss
// is caught where the loss is read.
@compute @workgroup_size(256)
fn cross_entropy_rows_forward_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg);
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    let ms = row_max_sum(t, base, q.cols);
    let label = targets[r];
    let valid = label < q.cols;
    let bad = select(quiet_nan(), 0.0, valid);
    if t == 0u {
        let picked = x[base + min(label, q.cols - 1u)];
        losses[r] = ms.x + log(ms.y) - picked + bad;
    }
    let inv = 1.0 / ms.y;
    for (var c = t; c < q.cols; c += WG) {
        let prob = exp(x[base + c] - ms.x) * inv;
        let onehot = select(0.0, 1.0, c == label);
        out[base + c] = (prob - onehot) * q.scale + bad;
    }
}

// cross_entropy_rows_forward_backward with one invocation per row (a small
// vocabulary): max, then Σ exp, then the loss and dlogits; the same NaN
// for a target ≥ V.
@compute @workgroup_size(256)
fn cross_entropy_rows_forward_backward_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let r = row_index(wid, nwg) * WG + t;
    if r >= q.rows {
        return;
    }
    let base = r * q.cols;
    var m = LOWEST;
    for (var c = 0u; c < q.cols; c++) {
        m = max(m, x[base + c]);
    }
    var s = 0.0;
    for (var c = 0u; c < q.cols; c++) {
        s += exp(x[base + c] - m);
    }
    let label = targets[r];
    let bad = select(quiet_nan(), 0.0, label < q.cols);
    losses[r] = m + log(s) - x[base + min(label, q.cols - 1u)] + bad;
    let inv = 1.0 / s;
    for (var c = 0u; c < q.cols; c++) {
        let prob = exp(x[base + c] - m) * inv;
        let onehot = select(0.0, 1.0, c == label);
        out[base + c] = (prob - onehot) * q.scale + bad;
    }
}

// embedding_forward: out[n, C] = table[ids[n], :] for table[V, C], ids[n]
// (u32); one invocation per output element. An id ≥ V writes a row of NaN
// (no out-of-bounds read; the NaN reaches the loss, where it is caught),
// in the launch that covers the table's last rows.
// The Rust side checks ids on the host where it has them (check_token_ids).
@compute @workgroup_size(256)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let i = row_index(wid, nwg) * WG + t;
    if i >= q.rows * q.cols {
        return;
    }
    let id = ids[i / q.cols];
    let c = i % q.cols;
    if id >= q.vocab {
        if q.row_end == q.vocab {
            out[i] = quiet_nan();
        }
        return;
    }
    if id < q.row_start || id >= q.row_end {
        return;
    }
    out[i] = table[q.table_base + (id - q.row_start) * q.cols + c];
}

// The embedding backward is a deterministic counting sort of the ids, then
// a gather. Why not one invocation per (vocabulary row, column) scanning all
// n positions: that is V·C·n work, 3·10^12 for GPT-2 (V = 50,257, C = 768,
// n = 8,192). Why not scatter-add per position: WGSL has no float atomics,
// and any order-dependent scheme gives different bits when a token repeats.
// The sort is stable (positions stay in order within an id), so each
// gradient row is summed in position order: O(n·C + V) work in all.

// Ids ≥ V share the last bucket, V, which the gather skips.
fn bucket(id: u32, vocab: u32) -> u32 {
    return min(id, vocab);
}

// embedding_backward_sort: order[n] = the positions 0..n sorted by ids[n]
// (stable), with cursor[V + 1] (u32) as scratch. One workgroup of SORT_WG
// lanes: a histogram (integer atomics: the counts do not depend on their
// order), an exclusive scan, then a scatter of SORT_WG positions at a time
// in which each position's slot is its bucket's cursor plus its rank among
// equal ids earlier in the tile, so equal ids keep their order.
@compute @workgroup_size(SORT_WG)
fn embedding_backward_sort(@builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let buckets = q.vocab + 1u;
    for (var b = t; b < buckets; b += SORT_WG) {
        atomicStore(&cursor[b], 0u);
    }
    storageBarrier();
    for (var n = t; n < q.rows; n += SORT_WG) {
        atomicAdd(&cursor[bucket(ids[n], q.vocab)], 1u);
    }
    storageBarrier();

    // Exclusive scan: invocation t owns buckets [lo, hi).
    let chunk = (buckets + SORT_WG - 1u) / SORT_WG;
    let lo = min(t * chunk, buckets);
    let hi = min(lo + chunk, buckets);
    var own = 0u;
    for (var b = lo; b < hi; b++) {
        own += atomicLoad(&cursor[b]);
    }
    scan[t] = own;
    for (var offset = 1u; offset < SORT_WG; offset *= 2u) {
        workgroupBarrier();
        var add = 0u;
        if t >= offset {
            add = scan[t - offset];
        }
        workgroupBarrier();
        scan[t] += add;
    }
    workgroupBarrier();
    var running = scan[t] - own;
    for (var b = lo; b < hi; b++) {
        let count = atomicLoad(&cursor[b]);
        atomicStore(&cursor[b], running);
        running += count;
    }
    storageBarrier();

    for (var start = 0u; start < q.rows; start += SORT_WG) {
        let n = start + t;
        let inside = n < q.rows;
        var b = 0xffffffffu;
        if inside {
            b = bucket(ids[n], q.vocab);
        }
        tile_ids[t] = b;
        workgroupBarrier();
        var rank = 0u;
        var last = true;
        for (var j = 0u; j < SORT_WG; j++) {
            if tile_ids[j] == b {
                if j < t {
                    rank++;
                } else if j > t {
                    last = false;
                }
            }
        }
        var slot = 0u;
        if inside {
            slot = atomicLoad(&cursor[b]) + rank;
            order[slot] = n;
        }
        // Every invocation has read its cursor before the last of each id
        // in the tile moves it on (and tile_ids may be overwritten).
        storageBarrier();
        if inside && last {
            atomicStore(&cursor[b], slot + 1u);
        }
        storageBarrier();
    }
}

// embedding_backward: dtable[V, C] += Σ_{n: ids[n] = v} dy[n, :] (dy = dout
// [n, C]), from the order[n] of embedding_backward_sort (run it first).
// One invocation per (sorted slot, column); the slot that starts an id's
// run sums the run in position order, the others leave. Positions with an
// id ≥ V are skipped: their gradient is dropped.
@compute @workgroup_size(256)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let q = uniform_params(t);
    let i = row_index(wid, nwg) * WG + t;
    if i >= q.rows * q.cols {
        return;
    }
    let slot = i / q.cols;
    let c = i % q.cols;
    let v = bucket(ids[order[slot]], q.vocab);
    if v == q.vocab || v < q.row_start || v >= q.row_end || (slot > 0u && bucket(ids[order[slot - 1u]], q.vocab) == v) {
        return;
    }
    var acc = 0.0;
    for (var j = slot; j < q.rows; j++) {
        let n = order[j];
        if bucket(ids[n], q.vocab) != v {
            break;
        }
        acc += dy[n * q.cols + c];
    }
    let at = q.table_base + (v - q.row_start) * q.cols + c;
    dtable[at] = dtable[at] + acc;
}
