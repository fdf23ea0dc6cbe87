//! Plain-Rust twins of every kernel, the references the GPU results are
//! checked against. Written for clarity, not speed: sums accumulate in f64,
//! so the reference is more accurate than the f32 kernels it checks.
//! Shapes are row-major and follow the kernels' argument conventions.

use crate::ops::{Activation, AdamConfig, Binary, MatmulForm, SgdConfig};

/// C[m,n] = op(A)·op(B) for the stored shapes of [`MatmulForm::operand_shapes`].
pub fn matmul(form: MatmulForm, a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let a_at = |i: usize, p: usize| a[form.a_index(m, k, i, p)];
    let b_at = |p: usize, j: usize| b[form.b_index(n, k, p, j)];
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let acc: f64 = (0..k).map(|p| f64::from(a_at(i, p)) * f64::from(b_at(p, j))).sum();
            c[i * n + j] = acc as f32;
        }
    }
    c
}

/// Host-side description of a fused matmul epilogue (twin of
/// `kernels::MatmulEpilogue`).
#[derive(Clone, Copy, Default)]
pub struct Epilogue<'a> {
    /// C before the product is added (accumulate), or None for C = result.
    pub accumulate_onto: Option<&'a [f32]>,
    pub bias: Option<&'a [f32]>,
    pub activation: Option<Activation>,
    /// The activation and its forward input x [m, n].
    pub activation_grad: Option<(Activation, &'a [f32])>,
}

/// C = epilogue(op(A)·op(B)), returned with the pre-activation values (the
/// product plus bias, before any activation). The product is rounded to f32
/// first, as the kernel stores it, then the same steps as the unfused twins.
pub fn matmul_epilogue(form: MatmulForm, e: Epilogue<'_>, a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut pre = matmul(form, a, b, m, n, k);
    if let Some(bias) = e.bias {
        pre = bias_add(&pre, bias, n);
    }
    let mut result = match (e.activation, e.activation_grad) {
        (Some(act), _) => activation_forward(act, &pre),
        (None, Some((act, x))) => activation_backward(act, x, &pre),
        (None, None) => pre.clone(),
    };
    if let Some(c) = e.accumulate_onto {
        result.iter_mut().zip(c).for_each(|(r, c)| *r += c);
    }
    (result, pre)
}

pub fn binary(op: Binary, x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(&a, &b)| match op {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
        })
        .collect()
}

pub fn scale(x: &[f32], alpha: f32) -> Vec<f32> {
    x.iter().map(|&v| alpha * v).collect()
}

pub fn bias_add(x: &[f32], bias: &[f32], cols: usize) -> Vec<f32> {
    x.iter().enumerate().map(|(i, &v)| v + bias[i % cols]).collect()
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

/// f(x) for one element, in f64.
pub fn activation_value(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Relu => x.max(0.0),
        Activation::Gelu => 0.5 * x * (1.0 + (GELU_C * (x + GELU_A * x * x * x)).tanh()),
        Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Activation::Tanh => x.tanh(),
    }
}

/// f'(x) for one element, in f64 (0 at x = 0 for ReLU, as PyTorch).
pub fn activation_derivative(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Gelu => {
            let t = (GELU_C * (x + GELU_A * x * x * x)).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
        }
        Activation::Sigmoid => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 - s)
        }
        Activation::Tanh => 1.0 - x.tanh().powi(2),
    }
}

pub fn activation_forward(act: Activation, x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| activation_value(act, f64::from(v)) as f32).collect()
}

pub fn activation_backward(act: Activation, x: &[f32], dy: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| (activation_derivative(act, f64::from(v)) * f64::from(g)) as f32)
        .collect()
}

pub fn sum_rows(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .map(|c| (0..rows).map(|r| f64::from(x[r * cols + c])).sum::<f64>() as f32)
        .collect()
}

pub fn sum(x: &[f32]) -> f32 {
    x.iter().map(|&v| f64::from(v)).sum::<f64>() as f32
}

pub fn mean(x: &[f32]) -> f32 {
    (x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64) as f32
}

pub fn max_rows(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .map(|r| x[r * cols..(r + 1) * cols].iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect()
}

/// First index of each row's maximum.
pub fn argmax_rows(x: &[f32], rows: usize, cols: usize) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let row = &x[r * cols..(r + 1) * cols];
            let mut best = 0;
            for (c, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = c;
                }
            }
            best as u32
        })
        .collect()
}

pub fn mse_forward(pred: &[f32], target: &[f32]) -> f32 {
    let total: f64 = pred
        .iter()
        .zip(target)
        .map(|(&p, &t)| (f64::from(p) - f64::from(t)).powi(2))
        .sum();
    (total / pred.len() as f64) as f32
}

pub fn mse_backward(pred: &[f32], target: &[f32], dloss: f32) -> Vec<f32> {
    let n = pred.len() as f64;
    pred.iter()
        .zip(target)
        .map(|(&p, &t)| (2.0 * (f64::from(p) - f64::from(t)) / n * f64::from(dloss)) as f32)
        .collect()
}

fn log_softmax_row(row: &[f32]) -> Vec<f64> {
    let m = row.iter().map(|&v| f64::from(v)).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|&v| (f64::from(v) - m).exp()).sum::<f64>().ln();
    row.iter().map(|&v| f64::from(v) - lse).collect()
}

/// Mean over rows of -log softmax(logits[r])[labels[r]]; NaN for a label ≥ cols.
pub fn cross_entropy_forward(logits: &[f32], labels: &[u32], rows: usize, cols: usize) -> f32 {
    let total: f64 = (0..rows)
        .map(|r| {
            let label = labels[r] as usize;
            if label >= cols {
                return f64::NAN;
            }
            -log_softmax_row(&logits[r * cols..(r + 1) * cols])[label]
        })
        .sum();
    (total / rows as f64) as f32
}

pub fn cross_entropy_backward(logits: &[f32], labels: &[u32], dloss: f32, rows: usize, cols: usize) -> Vec<f32> {
    let mut d = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let logp = log_softmax_row(&logits[r * cols..(r + 1) * cols]);
        for (c, lp) in logp.iter().enumerate() {
            let onehot = if c == labels[r] as usize { 1.0 } else { 0.0 };
            d.push(((lp.exp() - onehot) / rows as f64 * f64::from(dloss)) as f32);
        }
    }
    d
}

/// What a loss compares with (twin of `kernels::LossTargets`).
#[derive(Clone, Copy, Debug)]
pub enum LossTargets<'a> {
    Values(&'a [f32]),
    Labels(&'a [u32]),
}

/// Everything `Kernels::loss_forward_backward_fused` computes.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedLoss {
    pub loss: f32,
    pub pred: Vec<f32>,
    pub dpred: Vec<f32>,
    /// d loss / d weight [cols, inner] (empty without a Linear layer).
    pub weight_grad: Vec<f32>,
    /// Column sums of dpred [cols].
    pub bias_grad: Vec<f32>,
}

/// Twin of the fused loss kernels, built from the unfused twins: the
/// Linear layer pred = x·weightᵀ + bias when `linear` is (x, weight, bias,
/// inner), else `pred` as given; the loss and its gradient; the weight
/// gradient dpredᵀ·x and the bias gradient (column sums of dpred).
pub fn loss_forward_backward_fused(
    targets: LossTargets<'_>,
    pred: &[f32],
    linear: Option<(&[f32], &[f32], Option<&[f32]>, usize)>,
    dloss: f32,
    rows: usize,
    cols: usize,
) -> FusedLoss {
    let pred = match linear {
        Some((x, weight, bias, inner)) => {
            let product = matmul(MatmulForm::ABt, x, weight, rows, cols, inner);
            bias.map_or(product.clone(), |b| bias_add(&product, b, cols))
        }
        None => pred.to_vec(),
    };
    let (loss, dpred) = match targets {
        LossTargets::Values(t) => (mse_forward(&pred, t), mse_backward(&pred, t, dloss)),
        LossTargets::Labels(l) => (cross_entropy_forward(&pred, l, rows, cols), cross_entropy_backward(&pred, l, dloss, rows, cols)),
    };
    let weight_grad = match linear {
        Some((x, _, _, inner)) => matmul(MatmulForm::AtB, &dpred, x, cols, inner, rows),
        None => Vec::new(),
    };
    let bias_grad = sum_rows(&dpred, rows, cols);
    FusedLoss { loss, pred, dpred, weight_grad, bias_grad }
}

/// torch.optim.SGD, one step (counted from 1), in f32 as PyTorch computes it.
pub fn sgd_update(param: &mut [f32], grad: &[f32], momentum_buf: &mut [f32], cfg: &SgdConfig, step: u64) {
    for i in 0..param.len() {
        let mut d_p = grad[i];
        if cfg.weight_decay != 0.0 {
            d_p += cfg.weight_decay * param[i];
        }
        if cfg.momentum != 0.0 {
            let buf = if step == 1 {
                d_p
            } else {
                cfg.momentum * momentum_buf[i] + (1.0 - cfg.dampening) * d_p
            };
            momentum_buf[i] = buf;
            d_p = if cfg.nesterov { d_p + cfg.momentum * buf } else { buf };
        }
        param[i] -= cfg.lr * d_p;
    }
}

/// torch.optim.Adam / AdamW (by `cfg.decoupled_weight_decay`), one step
/// (counted from 1), in f32 with the bias corrections in f64.
pub fn adam_update(param: &mut [f32], grad: &[f32], exp_avg: &mut [f32], exp_avg_sq: &mut [f32], cfg: &AdamConfig, step: u64) {
    let (beta1, beta2) = cfg.betas;
    let t = step as i32;
    let step_size = (f64::from(cfg.lr) / (1.0 - f64::from(beta1).powi(t))) as f32;
    let bias_correction2_sqrt = (1.0 - f64::from(beta2).powi(t)).sqrt() as f32;
    for i in 0..param.len() {
        let mut g = grad[i];
        if cfg.decoupled_weight_decay {
            param[i] *= 1.0 - cfg.lr * cfg.weight_decay;
        } else if cfg.weight_decay != 0.0 {
            g += cfg.weight_decay * param[i];
        }
        exp_avg[i] += (1.0 - beta1) * (g - exp_avg[i]);
        exp_avg_sq[i] = beta2 * exp_avg_sq[i] + (1.0 - beta2) * g * g;
        let denom = exp_avg_sq[i].sqrt() / bias_correction2_sqrt + cfg.eps;
        param[i] -= step_size * (exp_avg[i] / denom);
    }
}

/// Twin of `f32_to_f16`: round to nearest, ties to even.
pub fn to_f16(x: &[f32]) -> Vec<half::f16> {
    x.iter().map(|&v| half::f16::from_f32(v)).collect()
}

/// Twin of `f16_to_f32` (exact).
pub fn from_f16(x: &[half::f16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Twin of `matmul_f16_forward`: the f16 operands widened (exactly) and
/// multiplied with f64 accumulation. `matmul_subgroup_forward`'s twin is
/// [`matmul`] itself.
pub fn matmul_f16(form: MatmulForm, a: &[half::f16], b: &[half::f16], m: usize, n: usize, k: usize) -> Vec<f32> {
    matmul(form, &from_f16(a), &from_f16(b), m, n, k)
}
