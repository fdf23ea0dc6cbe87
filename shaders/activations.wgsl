// Each activation's forward and backward formula, the one source for the
// elementwise kernels and the matmul epilogue: both families compose this
// file (Family::source), so a fused Linear + activation is bit-identical
// to the unfused kernels. No entry points.
//
// An activation is named by its code: a constant below in the elementwise
// kernels, a uniform (`p.activation`) in the matmul epilogue.
// ops::Activation::code gives the same numbers on the Rust side
// (tests/shaders.rs checks them); 0 is the identity.
const ACT_RELU: u32 = 1u;
const ACT_GELU: u32 = 2u;
const ACT_SIGMOID: u32 = 3u;
const ACT_TANH: u32 = 4u;
const ACT_SILU: u32 = 5u;

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

// act(v).
//   relu(x) = max(x, 0)
//   gelu(x) = x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))   (PyTorch approximate="tanh")
//   sigmoid(x) = 1 / (1 + e^-x),  tanh(x)
//   silu(x) = x · sigmoid(x)   (SwiGLU's gate; PyTorch F.silu)
fn activation_forward(code: u32, v: f32) -> f32 {
    switch code {
        case ACT_RELU: { return max(v, 0.0); }
        case ACT_GELU: { return 0.5 * v * (1.0 + safe_tanh(GELU_C * (v + GELU_A * v * v * v))); }
        case ACT_SIGMOID: { return sigmoid(v); }
        case ACT_TANH: { return safe_tanh(v); }
        case ACT_SILU: { return v * sigmoid(v); }
        default: { return v; }
    }
}

// dy · act'(v), where v is the forward *input*. ReLU's gradient at 0 is 0
// (PyTorch's convention).
fn activation_backward(code: u32, v: f32, dy: f32) -> f32 {
    switch code {
        case ACT_RELU: { return select(0.0, dy, v > 0.0); }
        case ACT_GELU: {
            let t = safe_tanh(GELU_C * (v + GELU_A * v * v * v));
            let dinner = GELU_C * (1.0 + 3.0 * GELU_A * v * v);
            return dy * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dinner);
        }
        case ACT_SIGMOID: {
            let s = sigmoid(v);
            return dy * s * (1.0 - s);
        }
        case ACT_TANH: {
            let t = safe_tanh(v);
            return dy * (1.0 - t * t);
        }
        // silu'(x) = s + x·s·(1 − s) = s · (1 + x·(1 − s)), s = sigmoid(x).
        case ACT_SILU: {
            let s = sigmoid(v);
            return dy * s * (1.0 + v * (1.0 - s));
        }
        default: { return dy; }
    }
}
