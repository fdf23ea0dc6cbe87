// Elementwise kernels over flat f32 arrays of length n (one invocation per
// element, 256 per workgroup, the workgroups spread over a 2-D grid).
//   binary:   out[n] = x[n] ∘ y[n]
//   unary:    out[n] = f(x[n])
//   backward: dx[n] = f'(x[n]) · dy[n]   (x is the forward *input*)
//   bias add: out[rows, cols] = x[rows, cols] + bias[cols]   (bias in `y`)
//   add_assign: out[n] += x[n]   (gradient accumulation)

struct ElementwiseParams {
    n: u32,
    cols: u32,
    alpha: f32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: ElementwiseParams;

const WG: u32 = 256u;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// tanh overflows to NaN on some drivers for large |x|; f32 tanh is ±1 past 15.
fn safe_tanh(v: f32) -> f32 {
    return tanh(clamp(v, -15.0, 15.0));
}

fn sigmoid(v: f32) -> f32 {
    // exp of a non-positive argument only, so it never overflows.
    let e = exp(-abs(v));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), v >= 0.0);
}

const GELU_C: f32 = 0.7978845608028654; // sqrt(2 / pi)
const GELU_A: f32 = 0.044715;

@compute @workgroup_size(256)
fn add_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = x[i] + y[i]; }
}

@compute @workgroup_size(256)
fn sub_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = x[i] - y[i]; }
}

@compute @workgroup_size(256)
fn mul_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = x[i] * y[i]; }
}

// out = alpha · x
@compute @workgroup_size(256)
fn scale_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = p.alpha * x[i]; }
}

// out += x
@compute @workgroup_size(256)
fn add_assign(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = out[i] + x[i]; }
}

// out[r, c] = x[r, c] + bias[c]; n = rows · cols
@compute @workgroup_size(256)
fn bias_add_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = x[i] + y[i % p.cols]; }
}

@compute @workgroup_size(256)
fn relu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = max(x[i], 0.0); }
}

// dx = dy where x > 0 (PyTorch's convention: the gradient at 0 is 0)
@compute @workgroup_size(256)
fn relu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = select(0.0, y[i], x[i] > 0.0); }
}

// gelu(x) = x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))   (PyTorch approximate="tanh")
@compute @workgroup_size(256)
fn gelu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n {
        let v = x[i];
        out[i] = 0.5 * v * (1.0 + safe_tanh(GELU_C * (v + GELU_A * v * v * v)));
    }
}

@compute @workgroup_size(256)
fn gelu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n {
        let v = x[i];
        let t = safe_tanh(GELU_C * (v + GELU_A * v * v * v));
        let dinner = GELU_C * (1.0 + 3.0 * GELU_A * v * v);
        out[i] = y[i] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dinner);
    }
}

@compute @workgroup_size(256)
fn sigmoid_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = sigmoid(x[i]); }
}

@compute @workgroup_size(256)
fn sigmoid_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n {
        let s = sigmoid(x[i]);
        out[i] = y[i] * s * (1.0 - s);
    }
}

@compute @workgroup_size(256)
fn tanh_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = safe_tanh(x[i]); }
}

@compute @workgroup_size(256)
fn tanh_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n {
        let t = safe_tanh(x[i]);
        out[i] = y[i] * (1.0 - t * t);
    }
}
