// Optimizer updates, in place over flat parameter arrays of length n,
// following PyTorch's single-tensor formulas (torch.optim.SGD / Adam / AdamW).
//   sgd_update:   param[n], grad[n], momentum_buf[n]
//   adam_update:  param[n], grad[n], exp_avg[n], exp_avg_sq[n]  (L2 weight decay)
//   adamw_update: same buffers                                   (decoupled weight decay)
// Step-dependent scalars (bias corrections, the scheduled lr) are computed on
// the host in f64. An arena over the binding limit is updated by several
// launches, each over an aligned part (n and decay_end then the part's). Weight decay applies to elements below `decay_end` only
// (the executor lays the decayed parameter group out first). With `clip` set
// the gradients are scaled by grad_norm[1], which the two grad_norm kernels
// below compute on the GPU in the same submission:
//   grad_norm_partials: grad[n] -> partials[groups]  (Σ grad² per chunk)
//   grad_norm_finish:   partials[groups] -> norm_out[2] = [‖grad‖₂, clip scale]

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
    decay_end: u32,
    clip: u32,
    _pad1: u32,
    _pad2: u32,
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
    decay_end: u32,
    clip: u32,
    _pad1: u32,
    _pad2: u32,
}

struct NormParams {
    // Elements of this launch's part of grad (all of it when unsplit).
    n: u32,
    // Elements per workgroup of grad_norm_partials.
    chunk: u32,
    // Workgroups of grad_norm_partials (entries of `partials`).
    groups: u32,
    max_norm: f32,
    // The partial this launch's first workgroup writes: a gradient over
    // the binding limit is summed by several launches, each over a part.
    first: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read_write> param: array<f32>;
@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> exp_avg: array<f32>;
@group(0) @binding(3) var<uniform> sgd: SgdParams;
@group(0) @binding(4) var<storage, read_write> exp_avg_sq: array<f32>;
@group(0) @binding(5) var<uniform> adam: AdamParams;
// [total norm, clip scale], written by grad_norm_finish (as `norm_out`).
@group(0) @binding(6) var<storage, read> grad_norm: array<f32>;
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<uniform> norm: NormParams;
@group(0) @binding(9) var<storage, read_write> norm_out: array<f32>;

var<workgroup> scratch: array<f32, 256>;

// The factor clip_grad_norm_ multiplies every gradient by (1 when off).
fn clip_scale(clip: u32) -> f32 {
    if clip != 0u {
        return grad_norm[1];
    }
    return 1.0;
}

// WG (256) and flat_index come from common.wgsl (Family::source).

// The momentum buffer is `exp_avg` (binding 2) for SGD.
@compute @workgroup_size(256)
fn sgd_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= sgd.n {
        return;
    }
    var d_p = grad[i] * clip_scale(sgd.clip);
    if sgd.weight_decay != 0.0 && i < sgd.decay_end {
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
    var g = grad[i] * clip_scale(adam.clip);
    if adam.weight_decay != 0.0 && i < adam.decay_end {
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
    var p = param[i];
    if i < adam.decay_end {
        p = p * (1.0 - adam.lr * adam.weight_decay);
    }
    param[i] = p - adam_moments(i, grad[i] * clip_scale(adam.clip));
}

// Sum of scratch[0..WG] into scratch[0], in a fixed tree order (so the norm
// is the same bits every run).
fn reduce_scratch(lid: u32) {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if lid < s {
            scratch[lid] = scratch[lid] + scratch[lid + s];
        }
        workgroupBarrier();
    }
}

// grad[n] -> partials[first ..]: workgroup w sums the squares of
// grad[w·chunk .. min((w+1)·chunk, n)] into partials[first + w].
@compute @workgroup_size(256)
fn grad_norm_partials(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let start = wid.x * norm.chunk;
    let end = min(start + norm.chunk, norm.n);
    var acc = 0.0;
    for (var i = start + lid.x; i < end; i = i + WG) {
        let g = grad[i];
        acc = acc + g * g;
    }
    scratch[lid.x] = acc;
    reduce_scratch(lid.x);
    if lid.x == 0u {
        partials[norm.first + wid.x] = scratch[0];
    }
}

// partials[groups] -> norm_out[2]: the L2 norm of all gradients and
// clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)). One workgroup.
@compute @workgroup_size(256)
fn grad_norm_finish(@builtin(local_invocation_id) lid: vec3<u32>) {
    var acc = 0.0;
    for (var i = lid.x; i < norm.groups; i = i + WG) {
        acc = acc + partials[i];
    }
    scratch[lid.x] = acc;
    reduce_scratch(lid.x);
    if lid.x == 0u {
        let total = sqrt(scratch[0]);
        norm_out[0] = total;
        norm_out[1] = min(1.0, norm.max_norm / (total + 1e-6));
    }
}
