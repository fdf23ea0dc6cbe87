// Elementwise kernels over flat f32 arrays of length n (one invocation per
// element, 256 per workgroup, the workgroups spread over a 2-D grid).
//   binary:   out[n] = x[n] ∘ y[n]
//   unary:    out[n] = f(x[n])
//   backward: dx[n] = f'(x[n]) · dy[n]   (x is the forward *input*)
//   bias add: out[rows, cols] = x[rows, cols] + bias[cols]   (bias in `y`)
//   add_assign: out[n] += x[n]   (gradient accumulation)
//   dropout:  out[n] = x[n]·mask[n]/(1-p)   (the mask a hash: see below)
// Composed with common.wgsl (WG, flat_index) and activations.wgsl (the
// formulas, shared with the matmul epilogue); see Family::source.

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

@compute @workgroup_size(256)
fn div_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = x[i] / y[i]; }
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

// Activations: out = act(x); backward out = act'(x) · dy with dy in `y`.
// The formulas are activations.wgsl's.
@compute @workgroup_size(256)
fn relu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_forward(ACT_RELU, x[i]); }
}

@compute @workgroup_size(256)
fn relu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_backward(ACT_RELU, x[i], y[i]); }
}

@compute @workgroup_size(256)
fn gelu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_forward(ACT_GELU, x[i]); }
}

@compute @workgroup_size(256)
fn gelu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_backward(ACT_GELU, x[i], y[i]); }
}

@compute @workgroup_size(256)
fn sigmoid_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_forward(ACT_SIGMOID, x[i]); }
}

@compute @workgroup_size(256)
fn sigmoid_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_backward(ACT_SIGMOID, x[i], y[i]); }
}

@compute @workgroup_size(256)
fn tanh_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_forward(ACT_TANH, x[i]); }
}

@compute @workgroup_size(256)
fn tanh_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_backward(ACT_TANH, x[i], y[i]); }
}

@compute @workgroup_size(256)
fn silu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_forward(ACT_SILU, x[i]); }
}

@compute @workgroup_size(256)
fn silu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i < p.n { out[i] = activation_backward(ACT_SILU, x[i], y[i]); }
}

// out[n] = x[n] in vec4s: each invocation copies COPY_VEC4S consecutive
// vec4s. The bandwidth bench's copy (bench::CopyBandwidth): on llvmpipe a
// 16-byte load per invocation moves about 4× the bytes per second of the
// f32 kernels above, which issue one 4-byte load each. The length goes
// through workgroup memory (as in matmul_forward_matvec): lavapipe
// specializes a shader on the uniform values that bound its loops.
@group(0) @binding(0) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out4: array<vec4<f32>>;
const COPY_VEC4S: u32 = 4u;
var<workgroup> copy_len: u32;
@compute @workgroup_size(64)
fn copy_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let first = ((wid.y * nwg.x + wid.x) * 64u + lid.x) * COPY_VEC4S;
    if lid.x == 0u {
        copy_len = p.n;
    }
    let n = workgroupUniformLoad(&copy_len);
    for (var j = 0u; j < COPY_VEC4S; j++) {
        let i = first + j;
        if i < n { out4[i] = x4[i]; }
    }
}

// Dropout (inverted, as torch.nn.Dropout in training; ops::DropoutMask):
// out[n] = x[n]·scale where the element's hash is at least `threshold`
// (p·2³²), else 0, x viewed as [n / cols, cols]. `control` holds the run's
// words, which the executor writes: [key, on, first_example, _]; with `on`
// 0 the kernel copies x (evaluation). The backward is this kernel over dy:
// the same mask, drawn again rather than stored.
struct DropoutParams {
    n: u32,
    cols: u32,
    // The whole rows' width and where these columns start in them (a
    // tensor-parallel share), and rows per example (where first_example
    // puts a device's rows of a split batch).
    row_width: u32,
    col_offset: u32,
    rows_per_example: u32,
    threshold: u32,
    salt: u32,
    scale: f32,
}
@group(0) @binding(4) var<storage, read> control: array<u32>;
@group(0) @binding(5) var<uniform> drop: DropoutParams;

// lowbias32 (C. Wellons' hash prospector): a bijection of u32 whose output
// bits each flip with about half the input bits (cpu::hash_u32 is its twin).
fn hash_u32(v: u32) -> u32 {
    var h = v;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

@compute @workgroup_size(256)
fn dropout_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if i >= drop.n { return; }
    if control[1] == 0u {
        out[i] = x[i];
        return;
    }
    // Integer arithmetic wraps: a number past 2³² still hashes, as its twin's.
    let row = control[2] * drop.rows_per_example + i / drop.cols;
    let element = row * drop.row_width + drop.col_offset + i % drop.cols;
    let stream = hash_u32(hash_u32(control[0]) ^ drop.salt);
    let h = hash_u32(hash_u32(element ^ stream) + stream);
    out[i] = select(0.0, x[i] * drop.scale, h >= drop.threshold);
}
