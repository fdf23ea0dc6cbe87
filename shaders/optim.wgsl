// Optimizer updates, in place over flat parameter arrays of length n,
// following PyTorch's single-tensor formulas (torch.optim.SGD / Adam / AdamW).
//   sgd_update:   param[n], grad[n], momentum_buf[n]
//   adam_update:  param[n], grad[n], exp_avg[n], exp_avg_sq[n]  (L2 weight decay)
//   adamw_update: same buffers                                   (decoupled weight decay)
// Step-dependent scalars (bias corrections) are computed on the host in f64.

struct SgdParams {
    n: u32,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: u32,
    // 1 on the first step: PyTorch initialises the buffer to the gradient.
    first_step: u32,
    _pad: u32,
}

struct AdamParams {
    n: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    // lr / (1 - beta1^t) and sqrt(1 - beta2^t)
    step_size: f32,
    bias_correction2_sqrt: f32,
}

@group(0) @binding(0) var<storage, read_write> param: array<f32>;
@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> exp_avg: array<f32>;
@group(0) @binding(3) var<uniform> sgd: SgdParams;
@group(0) @binding(4) var<storage, read_write> exp_avg_sq: array<f32>;
@group(0) @binding(5) var<uniform> adam: AdamParams;

// WG (256) and flat_index come from common.wgsl (Family::source).

// The momentum buffer is `exp_avg` (binding 2) for SGD.
@compute @workgroup_size(256)
fn sgd_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= sgd.n {
        return;
    }
    var d_p = grad[i];
    if sgd.weight_decay != 0.0 {
        d_p = d_p + sgd.weight_decay * param[i];
    }
    if sgd.momentum != 0.0 {
        var buf = d_p;
        if sgd.first_step == 0u {
            buf = sgd.momentum * exp_avg[i] + (1.0 - sgd.dampening) * d_p;
        }
        exp_avg[i] = buf;
        if sgd.nesterov != 0u {
            d_p = d_p + sgd.momentum * buf;
        } else {
            d_p = buf;
        }
    }
    param[i] = param[i] - sgd.lr * d_p;
}

fn adam_moments(i: u32, g: f32) -> f32 {
    // exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    let m = exp_avg[i] + (1.0 - adam.beta1) * (g - exp_avg[i]);
    let v = adam.beta2 * exp_avg_sq[i] + (1.0 - adam.beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    let denom = sqrt(v) / adam.bias_correction2_sqrt + adam.eps;
    return adam.step_size * (m / denom);
}

@compute @workgroup_size(256)
fn adam_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= adam.n {
        return;
    }
    var g = grad[i];
    if adam.weight_decay != 0.0 {
        g = g + adam.weight_decay * param[i];
    }
    param[i] = param[i] - adam_moments(i, g);
}

@compute @workgroup_size(256)
fn adamw_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= adam.n {
        return;
    }
    let decayed = param[i] * (1.0 - adam.lr * adam.weight_decay);
    param[i] = decayed - adam_moments(i, grad[i]);
}
