// Losses, reduced with PyTorch's default reduction="mean".
//   mse_forward:            loss[1] = Σ (pred - target)² / n
//   mse_backward:           dpred[n] = 2 (pred - target) / n · dloss[0]
//   cross_entropy_forward:  loss[1] = Σ_r (logsumexp(logits[r, :]) - logits[r, label[r]]) / rows
//   cross_entropy_backward: dlogits[rows, cols] = (softmax(logits[r, :]) - onehot(label[r])) / rows · dloss[0]
//   mse_forward_backward, cross_entropy_forward_backward: both of the above
//   in one single-workgroup dispatch: loss[1] and the gradient (`grad`);
//   with BIAS_GRAD also bias_grad[cols] += Σ_r grad[r, :] (the bias gradient
//   of the Linear layer that produced the prediction, saving a column-sum
//   dispatch).
//   mse_linear_forward_backward, cross_entropy_linear_forward_backward: the
//   same, but the prediction is first computed here from a small Linear
//   layer, pred_out[rows, cols] = x[rows, inner] · weight[cols, inner]ᵀ
//   (+ bias[cols] with HAS_BIAS), and weight_grad[cols, inner] += gradᵀ · x:
//   a whole small last layer's forward and backward in one dispatch.
//   mse_partial, cross_entropy_partial, loss_finish: mse_forward and
//   cross_entropy_forward in two stages, for a GPU (loss.rs chooses): many
//   workgroups write partial sums (Σ (pred - target)² per LOSS_CHUNK
//   elements; each row's loss), then one workgroup adds them over a fixed
//   tree and divides: out[0] = Σ_b partial[b] / count.
// A label ≥ cols makes the loss NaN (the GPU cannot raise an error; a NaN
// loss is caught where the loss is read).

// Gradients accumulate: they are added into the parameter gradients.
override BIAS_GRAD: bool = false;
override HAS_BIAS: bool = false;

struct LossParams {
    rows: u32,
    cols: u32,
    n: u32,
    // Input features of the fused Linear layer.
    inner: u32,
    // cross_entropy_partial and cross_entropy_backward over logits larger
    // than one binding run as launches over parts of whole rows: this
    // launch's first row and row count, and where its first row starts in
    // its binding of the logits (and of their gradient).
    first_row: u32,
    part_rows: u32,
    part_base: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> pred: array<f32>;
@group(0) @binding(1) var<storage, read> targets: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: LossParams;
// The parameters every function reads. The single-workgroup fused kernels
// take them through workgroup memory: lavapipe inlines uniform values that
// bound loops into the shader and re-optimizes it (NIR passes, unrolling)
// on every dispatch, which made the fused loss ~15 ms per dispatch on the
// digits MLP (batch 32) instead of tens of µs; a value loaded from
// workgroup memory is not inlined.
var<private> p: LossParams;
var<workgroup> shared_params: LossParams;
@group(0) @binding(4) var<storage, read> labels: array<u32>;
@group(0) @binding(5) var<storage, read> dloss: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<f32>;
@group(0) @binding(7) var<storage, read> x: array<f32>;
@group(0) @binding(8) var<storage, read> weight: array<f32>;
@group(0) @binding(9) var<storage, read> bias: array<f32>;
@group(0) @binding(10) var<storage, read_write> pred_out: array<f32>;
@group(0) @binding(11) var<storage, read_write> weight_grad: array<f32>;
@group(0) @binding(12) var<storage, read_write> bias_grad: array<f32>;

// WG (256) and flat_index come from common.wgsl (Family::source).
var<workgroup> partial: array<f32, 256>;

// Barrier: call from uniform control flow, before any use of `p`.
fn load_params_not_inlined(t: u32) {
    if t == 0u {
        shared_params = params;
    }
    p = workgroupUniformLoad(&shared_params);
}

fn tree_sum(t: u32, value: f32) -> f32 {
    partial[t] = value;
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
fn mse_forward(@builtin(local_invocation_index) t: u32) {
    p = params;
    var acc = 0.0;
    for (var i = t; i < p.n; i += WG) {
        let d = pred[i] - targets[i];
        acc += d * d;
    }
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.n);
    }
}

@compute @workgroup_size(256)
fn mse_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    p = params;
    let i = flat_index(wid, nwg, lid);
    if i < p.n {
        out[i] = 2.0 * (pred[i] - targets[i]) / f32(p.n) * dloss[0];
    }
}

// Stable log-sum-exp of the row starting at pred[start]: max + log Σ exp(x - max).
fn row_max(start: u32) -> f32 {
    var m = pred[start];
    for (var c = 1u; c < p.cols; c++) {
        m = max(m, pred[start + c]);
    }
    return m;
}

fn row_sum_exp(start: u32, m: f32) -> f32 {
    var s = 0.0;
    for (var c = 0u; c < p.cols; c++) {
        s += exp(pred[start + c] - m);
    }
    return s;
}

@compute @workgroup_size(256)
fn cross_entropy_forward(@builtin(local_invocation_index) t: u32) {
    p = params;
    var acc = 0.0;
    for (var r = t; r < p.rows; r += WG) {
        let label = labels[r];
        let m = row_max(r * p.cols);
        let lse = m + log(row_sum_exp(r * p.cols, m));
        let picked = pred[r * p.cols + min(label, p.cols - 1u)];
        acc += select(quiet_nan(), lse - picked, label < p.cols);
    }
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.rows);
    }
}

// Elements per invocation of mse_partial (kernels::loss::LOSS_CHUNK).
const LOSS_CHUNK: u32 = 64u;

// mse_partial: out[⌈n / LOSS_CHUNK⌉] = Σ (pred - target)² over each chunk
// of LOSS_CHUNK elements, in order; one invocation per chunk.
@compute @workgroup_size(256)
fn mse_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    p = params;
    let b = flat_index(wid, nwg, lid);
    let first = b * LOSS_CHUNK;
    if first >= p.n {
        return;
    }
    var acc = 0.0;
    for (var i = first; i < min(first + LOSS_CHUNK, p.n); i++) {
        let d = pred[i] - targets[i];
        acc += d * d;
    }
    out[b] = acc;
}

// cross_entropy_partial: out[rows] = logsumexp(logits[r, :]) -
// logits[r, label[r]] (NaN for a label ≥ cols); one invocation per row.
@compute @workgroup_size(256)
fn cross_entropy_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    p = params;
    let local = flat_index(wid, nwg, lid);
    if local >= p.part_rows {
        return;
    }
    let r = p.first_row + local;
    let start = p.part_base + local * p.cols;
    let label = labels[r];
    let m = row_max(start);
    let lse = m + log(row_sum_exp(start, m));
    let picked = pred[start + min(label, p.cols - 1u)];
    out[r] = select(quiet_nan(), lse - picked, label < p.cols);
}

// loss_finish: out[0] = Σ_{b < n} pred[b] / rows, the partials of
// mse_partial (rows = the elements) or cross_entropy_partial (the rows);
// one workgroup, strided sums then a fixed tree.
@compute @workgroup_size(256)
fn loss_finish(@builtin(local_invocation_index) t: u32) {
    p = params;
    var acc = 0.0;
    for (var b = t; b < p.n; b += WG) {
        acc += pred[b];
    }
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.rows);
    }
}

// One invocation per row: softmax recomputed from the logits (fused, no
// stored probabilities).
@compute @workgroup_size(256)
fn cross_entropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    p = params;
    let local = flat_index(wid, nwg, lid);
    if local >= p.part_rows {
        return;
    }
    let r = p.first_row + local;
    let start = p.part_base + local * p.cols;
    let label = labels[r];
    let m = row_max(start);
    let inv_sum = 1.0 / row_sum_exp(start, m);
    let scale = dloss[0] / f32(p.rows);
    let bad = select(0.0, quiet_nan(), label >= p.cols);
    for (var c = 0u; c < p.cols; c++) {
        let prob = exp(pred[start + c] - m) * inv_sum;
        let onehot = select(0.0, 1.0, c == label);
        out[start + c] = (prob - onehot) * scale + bad;
    }
}

@compute @workgroup_size(256)
fn mse_forward_backward(@builtin(local_invocation_index) t: u32) {
    load_params_not_inlined(t);
    var acc = 0.0;
    for (var i = t; i < p.n; i += WG) {
        let d = pred[i] - targets[i];
        acc += d * d;
        grad[i] = 2.0 * d / f32(p.n) * dloss[0];
    }
    accumulate_bias_grad(t);
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.n);
    }
}

@compute @workgroup_size(256)
fn cross_entropy_forward_backward(@builtin(local_invocation_index) t: u32) {
    load_params_not_inlined(t);
    var acc = 0.0;
    let scale = dloss[0] / f32(p.rows);
    for (var r = t; r < p.rows; r += WG) {
        let label = labels[r];
        let m = row_max(r * p.cols);
        let sum = row_sum_exp(r * p.cols, m);
        let picked = pred[r * p.cols + min(label, p.cols - 1u)];
        acc += select(quiet_nan(), m + log(sum) - picked, label < p.cols);
        let inv_sum = 1.0 / sum;
        let bad = select(0.0, quiet_nan(), label >= p.cols);
        for (var c = 0u; c < p.cols; c++) {
            let prob = exp(pred[r * p.cols + c] - m) * inv_sum;
            let onehot = select(0.0, 1.0, c == label);
            grad[r * p.cols + c] = (prob - onehot) * scale + bad;
        }
    }
    accumulate_bias_grad(t);
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.rows);
    }
}

// Column sums of `grad` added into bias_grad, once every invocation's grad
// writes are visible (the storage barrier). Rows summed in order.
fn accumulate_bias_grad(t: u32) {
    storageBarrier();
    if BIAS_GRAD {
        for (var c = t; c < p.cols; c += WG) {
            var s = 0.0;
            for (var r = 0u; r < p.rows; r++) {
                s += grad[r * p.cols + c];
            }
            bias_grad[c] = bias_grad[c] + s;
        }
    }
}

// weight_grad += gradᵀ · x, then the bias gradient.
fn accumulate_linear_grads(t: u32) {
    storageBarrier();
    for (var i = t; i < p.cols * p.inner; i += WG) {
        let c = i / p.inner;
        let j = i % p.inner;
        var s = 0.0;
        for (var r = 0u; r < p.rows; r++) {
            s += grad[r * p.cols + c] * x[r * p.inner + j];
        }
        weight_grad[i] = weight_grad[i] + s;
    }
    accumulate_bias_grad(t);
}

// One output of the Linear layer: the product, then the bias (the order
// the matmul kernel adds them in).
fn linear_value(r: u32, c: u32) -> f32 {
    var z = 0.0;
    for (var j = 0u; j < p.inner; j++) {
        z += x[r * p.inner + j] * weight[c * p.inner + j];
    }
    if HAS_BIAS {
        z += bias[c];
    }
    return z;
}

@compute @workgroup_size(256)
fn mse_linear_forward_backward(@builtin(local_invocation_index) t: u32) {
    load_params_not_inlined(t);
    var acc = 0.0;
    for (var i = t; i < p.n; i += WG) {
        let z = linear_value(i / p.cols, i % p.cols);
        pred_out[i] = z;
        let d = z - targets[i];
        acc += d * d;
        grad[i] = 2.0 * d / f32(p.n) * dloss[0];
    }
    accumulate_linear_grads(t);
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.n);
    }
}

// One invocation per row: the row's logits are computed and stored, then
// read back for the softmax.
@compute @workgroup_size(256)
fn cross_entropy_linear_forward_backward(@builtin(local_invocation_index) t: u32) {
    load_params_not_inlined(t);
    var acc = 0.0;
    let scale = dloss[0] / f32(p.rows);
    for (var r = t; r < p.rows; r += WG) {
        let row = r * p.cols;
        var m = linear_value(r, 0u);
        pred_out[row] = m;
        for (var c = 1u; c < p.cols; c++) {
            let z = linear_value(r, c);
            pred_out[row + c] = z;
            m = max(m, z);
        }
        var sum = 0.0;
        for (var c = 0u; c < p.cols; c++) {
            sum += exp(pred_out[row + c] - m);
        }
        let label = labels[r];
        let picked = pred_out[row + min(label, p.cols - 1u)];
        acc += select(quiet_nan(), m + log(sum) - picked, label < p.cols);
        let inv_sum = 1.0 / sum;
        let bad = select(0.0, quiet_nan(), label >= p.cols);
        for (var c = 0u; c < p.cols; c++) {
            let prob = exp(pred_out[row + c] - m) * inv_sum;
            let onehot = select(0.0, 1.0, c == label);
            grad[row + c] = (prob - onehot) * scale + bad;
        }
    }
    accumulate_linear_grads(t);
    let total = tree_sum(t, acc);
    if t == 0u {
        out[0] = total / f32(p.rows);
    }
}
