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
// With dynamic loss scaling (`scaled` set) the gradients are the loss
// scale times the true ones, and `grad_norm` is the loss-scale block that
// the two loss_scale kernels below keep (LS_* words): the update multiplies
// by its factor (clip scale / loss scale), returns at once when its skip
// flag is set (an inf or NaN gradient: no parameter or state changes), and
// takes Adam's bias corrections and SGD's first step from it, since only
// the GPU knows which steps were taken.
//   loss_scale_partials: grad[n] -> partials[2·groups]
//                        (Σ (grad / scale)², count of non-finite) per chunk
//   loss_scale_finish:   partials -> block (norm, factor, skip, corrections;
//                        scale, growth tracker, step counts, skip history)

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
    scaled: u32,
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
    scaled: u32,
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

struct ScaleParams {
    n: u32,
    chunk: u32,
    groups: u32,
    // 1: clip_grad_norm_ to max_norm, by the unscaled norm.
    clip: u32,
    max_norm: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    // Adam's betas (0 for SGD), for the bias corrections of the steps taken.
    beta1: f32,
    beta2: f32,
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(10) var<uniform> ls: ScaleParams;

// The loss-scale block's words (kernels::optim::LossScaleWord mirrors them).
// Written each step for the update:
const LS_NORM: u32 = 0u;       // ‖grad / scale‖₂
const LS_FACTOR: u32 = 1u;     // clip factor / scale (0 when skipped)
const LS_SKIP: u32 = 2u;       // 1: this step is skipped
const LS_BC1: u32 = 3u;        // 1 - beta1^t
const LS_BC2_SQRT: u32 = 4u;   // sqrt(1 - beta2^t)
const LS_FIRST: u32 = 5u;      // 1 on the first step taken (t = 1)
// Kept from step to step:
const LS_SCALE: u32 = 8u;      // the loss scale (seeds the next step's loss gradient)
const LS_TRACKER: u32 = 9u;    // clean steps since the scale last changed
const LS_STEP: u32 = 10u;      // steps taken, t
const LS_SKIPPED: u32 = 11u;   // steps skipped
const LS_ITER: u32 = 12u;      // steps run (taken or skipped)
const LS_BETA1_POW: u32 = 13u; // beta1^t
const LS_BETA2_POW: u32 = 14u; // beta2^t
const LS_HISTORY: u32 = 16u;   // the first LS_HISTORY_LEN skipped steps (1-based)
const LS_HISTORY_LEN: u32 = 32u;

var<workgroup> scratch: array<f32, 256>;

// The factor every gradient is multiplied by: clip_grad_norm_'s (1 when
// off), over the loss scale when scaled.
fn clip_scale(clip: u32, scaled: u32) -> f32 {
    if clip != 0u || scaled != 0u {
        return grad_norm[LS_FACTOR];
    }
    return 1.0;
}

// A loss-scaled step whose gradients held an inf or NaN changes nothing.
fn skipped(scaled: u32) -> bool {
    return scaled != 0u && grad_norm[LS_SKIP] != 0.0;
}

// The bit pattern of an inf or NaN (robust where a compiler assumes floats
// are finite).
fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// WG (256) and flat_index come from common.wgsl (Family::source).

// The momentum buffer is `exp_avg` (binding 2) for SGD.
@compute @workgroup_size(256)
fn sgd_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= sgd.n || skipped(sgd.scaled) {
        return;
    }
    var d_p = grad[i] * clip_scale(sgd.clip, sgd.scaled);
    if sgd.weight_decay != 0.0 && i < sgd.decay_end {
        d_p = d_p + sgd.weight_decay * param[i];
    }
    if sgd.momentum != 0.0 {
        var buf = d_p;
        var first = sgd.first_step != 0u;
        if sgd.scaled != 0u {
            first = grad_norm[LS_FIRST] != 0.0;
        }
        if !first {
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

// (lr / (1 - beta1^t), sqrt(1 - beta2^t)): the host's for the step it
// counts, or, loss-scaled, from the steps the GPU took.
fn adam_corrections() -> vec2<f32> {
    if adam.scaled != 0u {
        return vec2<f32>(adam.lr / grad_norm[LS_BC1], grad_norm[LS_BC2_SQRT]);
    }
    return vec2<f32>(adam.step_size, adam.bias_correction2_sqrt);
}

fn adam_moments(i: u32, g: f32) -> f32 {
    // exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    let m = exp_avg[i] + (1.0 - adam.beta1) * (g - exp_avg[i]);
    let v = adam.beta2 * exp_avg_sq[i] + (1.0 - adam.beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    let corrections = adam_corrections();
    let denom = sqrt(v) / corrections.y + adam.eps;
    return corrections.x * (m / denom);
}

@compute @workgroup_size(256)
fn adam_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= adam.n || skipped(adam.scaled) {
        return;
    }
    var g = grad[i] * clip_scale(adam.clip, adam.scaled);
    if adam.weight_decay != 0.0 && i < adam.decay_end {
        g = g + adam.weight_decay * param[i];
    }
    param[i] = param[i] - adam_moments(i, g);
}

@compute @workgroup_size(256)
fn adamw_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= adam.n || skipped(adam.scaled) {
        return;
    }
    var p = param[i];
    if i < adam.decay_end {
        p = p * (1.0 - adam.lr * adam.weight_decay);
    }
    param[i] = p - adam_moments(i, grad[i] * clip_scale(adam.clip, adam.scaled));
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

// The workgroup's sums of `a` and of `b` (one each per invocation), in
// reduce_scratch's fixed order.
fn reduce_two(lid: u32, a: f32, b: f32) -> vec2<f32> {
    scratch[lid] = a;
    reduce_scratch(lid);
    let first = scratch[0];
    // Every invocation has read scratch[0] before it is reused.
    workgroupBarrier();
    scratch[lid] = b;
    reduce_scratch(lid);
    return vec2<f32>(first, scratch[0]);
}

// grad[n] -> partials[2·groups]: workgroup w sums (grad / scale)² over
// grad[w·chunk .. min((w+1)·chunk, n)] (the unscaled norm clipping uses)
// and counts its infs and NaNs. The scale is the block's (`grad_norm`).
@compute @workgroup_size(256)
fn loss_scale_partials(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let start = wid.x * ls.chunk;
    let end = min(start + ls.chunk, ls.n);
    let inv_scale = 1.0 / grad_norm[LS_SCALE];
    var squares = 0.0;
    var bad = 0.0;
    for (var i = start + lid.x; i < end; i = i + WG) {
        let g = grad[i];
        if non_finite(g) {
            bad = bad + 1.0;
        } else {
            let u = g * inv_scale;
            squares = squares + u * u;
        }
    }
    let sums = reduce_two(lid.x, squares, bad);
    if lid.x == 0u {
        partials[2u * wid.x] = sums.x;
        partials[2u * wid.x + 1u] = sums.y;
    }
}

// partials[2·groups] -> the block (`norm_out`): GradScaler's unscale_,
// step and update in one workgroup. Infs or NaNs: skip the step, record
// it, scale × backoff, tracker to 0. Otherwise: the step is taken (t + 1,
// the bias corrections of t), the clip factor from the unscaled norm, and
// after growth_interval clean steps the scale × growth (while finite).
@compute @workgroup_size(256)
fn loss_scale_finish(@builtin(local_invocation_id) lid: vec3<u32>) {
    var squares = 0.0;
    var bad = 0.0;
    for (var i = lid.x; i < ls.groups; i = i + WG) {
        squares = squares + partials[2u * i];
        bad = bad + partials[2u * i + 1u];
    }
    let sums = reduce_two(lid.x, squares, bad);
    let total = sums.x;
    if lid.x != 0u {
        return;
    }
    let scale = norm_out[LS_SCALE];
    let iteration = norm_out[LS_ITER] + 1.0;
    norm_out[LS_ITER] = iteration;
    let norm = sqrt(total);
    norm_out[LS_NORM] = norm;
    if sums.y > 0.0 {
        norm_out[LS_SKIP] = 1.0;
        norm_out[LS_FACTOR] = 0.0;
        let skipped_before = norm_out[LS_SKIPPED];
        if skipped_before < f32(LS_HISTORY_LEN) {
            norm_out[LS_HISTORY + u32(skipped_before)] = iteration;
        }
        norm_out[LS_SKIPPED] = skipped_before + 1.0;
        norm_out[LS_SCALE] = scale * ls.backoff_factor;
        norm_out[LS_TRACKER] = 0.0;
        return;
    }
    var clip = 1.0;
    if ls.clip != 0u {
        clip = min(1.0, ls.max_norm / (norm + 1e-6));
    }
    norm_out[LS_SKIP] = 0.0;
    norm_out[LS_FACTOR] = clip * (1.0 / scale);
    let t = norm_out[LS_STEP] + 1.0;
    norm_out[LS_STEP] = t;
    let beta1_pow = norm_out[LS_BETA1_POW] * ls.beta1;
    let beta2_pow = norm_out[LS_BETA2_POW] * ls.beta2;
    norm_out[LS_BETA1_POW] = beta1_pow;
    norm_out[LS_BETA2_POW] = beta2_pow;
    norm_out[LS_BC1] = 1.0 - beta1_pow;
    norm_out[LS_BC2_SQRT] = sqrt(1.0 - beta2_pow);
    norm_out[LS_FIRST] = select(0.0, 1.0, t == 1.0);
    let tracker = norm_out[LS_TRACKER] + 1.0;
    let grown = scale * ls.growth_factor;
    if tracker >= f32(ls.growth_interval) && !non_finite(grown) {
        norm_out[LS_SCALE] = grown;
        norm_out[LS_TRACKER] = 0.0;
    } else {
        norm_out[LS_TRACKER] = tracker;
    }
}
