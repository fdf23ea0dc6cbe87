//! Plain-Rust twins of every kernel, the references the GPU results are
//! checked against. Written for clarity, not speed: sums accumulate in f64,
//! so the reference is more accurate than the f32 kernels it checks.
//! Shapes are row-major and follow the kernels' argument conventions.

use crate::error::{Error, Result};
use crate::ops::{
    broadcast_shape, rope_angle, rope_inv_freq, Activation, AdamConfig, Binary, CachedAttentionShape, DropoutMask,
    FlashAttentionShape, LoraShape, LossScaling, MatmulForm, OptimizerConfig, QuantFormat, RopeLayout, RopeShape,
    SgdConfig, Unary, LORA_META,
};

/// The element types a twin computes in: f32, as the kernels store values,
/// and f64, for the graph's reference interpreter
/// ([`crate::graph::evaluate_f64`]), whose central differences need more
/// than f32's precision. Sums accumulate in f64 either way.
pub trait Real: Copy + Default + PartialOrd + Into<f64> + std::fmt::Debug {
    fn from_f64(v: f64) -> Self;
}

impl Real for f32 {
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
}

impl Real for f64 {
    fn from_f64(v: f64) -> f64 {
        v
    }
}

/// C[m,n] = op(A)·op(B) for the stored shapes of [`MatmulForm::operand_shapes`].
pub fn matmul<T: Real>(form: MatmulForm, a: &[T], b: &[T], m: usize, n: usize, k: usize) -> Vec<T> {
    let a_at = |i: usize, p: usize| -> f64 { a[form.a_index(m, k, i, p)].into() };
    let b_at = |p: usize, j: usize| -> f64 { b[form.b_index(n, k, p, j)].into() };
    let mut c = vec![T::default(); m * n];
    for i in 0..m {
        for j in 0..n {
            let acc: f64 = (0..k).map(|p| a_at(i, p) * b_at(p, j)).sum();
            c[i * n + j] = T::from_f64(acc);
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
pub fn matmul_epilogue(
    form: MatmulForm,
    e: Epilogue<'_>,
    a: &[f32],
    b: &[f32],
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f32>, Vec<f32>) {
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
    x.iter().zip(y).map(|(&a, &b)| op.apply(a, b)).collect()
}

/// One element of `op`, computed in f64 and rounded to the twin's type
/// (for f32 the kernels' [`Binary::apply`], as one f32 operation rounds).
fn binary_value<T: Real>(op: Binary, a: T, b: T) -> T {
    let (a, b): (f64, f64) = (a.into(), b.into());
    T::from_f64(match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
    })
}

pub fn scale<T: Real>(x: &[T], alpha: f32) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(f64::from(alpha) * v.into())).collect()
}

pub fn bias_add<T: Real>(x: &[T], bias: &[T], cols: usize) -> Vec<T> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| T::from_f64(v.into() + bias[i % cols].into()))
        .collect()
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

/// 1 / (1 + e^-x) in f64 (e^-x overflows to +inf below x ≈ −709, giving 0).
fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// f(x) for one element, in f64.
pub fn activation_value(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Relu => x.max(0.0),
        Activation::Gelu => 0.5 * x * (1.0 + (GELU_C * (x + GELU_A * x * x * x)).tanh()),
        Activation::Sigmoid => sigmoid(x),
        Activation::Tanh => x.tanh(),
        Activation::Silu => x * sigmoid(x),
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
            let s = sigmoid(x);
            s * (1.0 - s)
        }
        Activation::Tanh => 1.0 - x.tanh().powi(2),
        Activation::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
    }
}

pub fn activation_forward<T: Real>(act: Activation, x: &[T]) -> Vec<T> {
    x.iter()
        .map(|&v| T::from_f64(activation_value(act, v.into())))
        .collect()
}

pub fn activation_backward<T: Real>(act: Activation, x: &[T], dy: &[T]) -> Vec<T> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| T::from_f64(activation_derivative(act, v.into()) * g.into()))
        .collect()
}

pub fn sum_rows<T: Real>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..cols)
        .map(|c| T::from_f64((0..rows).map(|r| x[r * cols + c].into()).sum::<f64>()))
        .collect()
}

pub fn sum<T: Real>(x: &[T]) -> T {
    T::from_f64(x.iter().map(|&v| v.into()).sum::<f64>())
}

pub fn mean<T: Real>(x: &[T]) -> T {
    T::from_f64(x.iter().map(|&v| v.into()).sum::<f64>() / x.len() as f64)
}

pub fn max_rows(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            x[r * cols..(r + 1) * cols]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// First index of each row's maximum.
pub fn argmax_rows<T: Real>(x: &[T], rows: usize, cols: usize) -> Vec<u32> {
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

pub fn mse_forward<T: Real>(pred: &[T], target: &[T]) -> T {
    let total: f64 = pred
        .iter()
        .zip(target)
        .map(|(&p, &t)| (p.into() - t.into()).powi(2))
        .sum();
    T::from_f64(total / pred.len() as f64)
}

pub fn mse_backward<T: Real>(pred: &[T], target: &[T], dloss: T) -> Vec<T> {
    let n = pred.len() as f64;
    pred.iter()
        .zip(target)
        .map(|(&p, &t)| T::from_f64(2.0 * (p.into() - t.into()) / n * dloss.into()))
        .collect()
}

fn log_softmax_row<T: Real>(row: &[T]) -> Vec<f64> {
    let m = row.iter().map(|&v| v.into()).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|&v| (v.into() - m).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v.into() - lse).collect()
}

/// Mean over rows of -log softmax(logits[r])[labels[r]]; NaN for a label ≥ cols.
pub fn cross_entropy_forward<T: Real>(logits: &[T], labels: &[u32], rows: usize, cols: usize) -> T {
    let total: f64 = (0..rows)
        .map(|r| {
            let label = labels[r] as usize;
            if label >= cols {
                return f64::NAN;
            }
            -log_softmax_row(&logits[r * cols..(r + 1) * cols])[label]
        })
        .sum();
    T::from_f64(total / rows as f64)
}

pub fn cross_entropy_backward<T: Real>(logits: &[T], labels: &[u32], dloss: T, rows: usize, cols: usize) -> Vec<T> {
    let mut d = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let logp = log_softmax_row(&logits[r * cols..(r + 1) * cols]);
        for (c, lp) in logp.iter().enumerate() {
            let onehot = if c == labels[r] as usize { 1.0 } else { 0.0 };
            d.push(T::from_f64((lp.exp() - onehot) / rows as f64 * dloss.into()));
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
        LossTargets::Labels(l) => (
            cross_entropy_forward(&pred, l, rows, cols),
            cross_entropy_backward(&pred, l, dloss, rows, cols),
        ),
    };
    let weight_grad = match linear {
        Some((x, _, _, inner)) => matmul(MatmulForm::AtB, &dpred, x, cols, inner, rows),
        None => Vec::new(),
    };
    let bias_grad = sum_rows(&dpred, rows, cols);
    FusedLoss {
        loss,
        pred,
        dpred,
        weight_grad,
        bias_grad,
    }
}

/// torch.optim.SGD, one step (counted from 1), in f32 as PyTorch computes it.
pub fn sgd_update(param: &mut [f32], grad: &[f32], momentum_buf: &mut [f32], cfg: &SgdConfig, step: u64) {
    let lr = cfg.schedule.lr_at(cfg.lr, step);
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
        param[i] -= lr * d_p;
    }
}

/// torch.optim.Adam / AdamW (by `cfg.decoupled_weight_decay`), one step
/// (counted from 1), in f32 with the bias corrections in f64.
pub fn adam_update(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    cfg: &AdamConfig,
    step: u64,
) {
    let (beta1, beta2) = cfg.betas;
    let t = step as i32;
    let lr = cfg.schedule.lr_at(cfg.lr, step);
    let step_size = (f64::from(lr) / (1.0 - f64::from(beta1).powi(t))) as f32;
    let bias_correction2_sqrt = (1.0 - f64::from(beta2).powi(t)).sqrt() as f32;
    for i in 0..param.len() {
        let mut g = grad[i];
        if cfg.decoupled_weight_decay {
            param[i] *= 1.0 - lr * cfg.weight_decay;
        } else if cfg.weight_decay != 0.0 {
            g += cfg.weight_decay * param[i];
        }
        exp_avg[i] += (1.0 - beta1) * (g - exp_avg[i]);
        exp_avg_sq[i] = beta2 * exp_avg_sq[i] + (1.0 - beta2) * g * g;
        let denom = exp_avg_sq[i].sqrt() / bias_correction2_sqrt + cfg.eps;
        param[i] -= step_size * (exp_avg[i] / denom);
    }
}

/// Twin of `loss_scale_partials` + `loss_scale_finish` (torch.amp
/// GradScaler's unscale_, inf check and update), over the host's copy of
/// their state.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaleTwin {
    pub scale: f32,
    pub growth_tracker: u64,
    pub steps_taken: u64,
    pub steps_run: u64,
    pub skipped_steps: Vec<u64>,
}

impl LossScaleTwin {
    pub fn new(scaling: &LossScaling) -> Self {
        LossScaleTwin {
            scale: scaling.init_scale,
            growth_tracker: 0,
            steps_taken: 0,
            steps_run: 0,
            skipped_steps: Vec::new(),
        }
    }

    /// One step over gradients scaled by `self.scale`: the norm of the
    /// unscaled finite ones (f64 sums), and the factor the update
    /// multiplies them by (clip factor / scale), `None` when an inf or NaN
    /// skips the step.
    pub fn step(&mut self, grad: &[f32], scaling: &LossScaling, clip: Option<f32>) -> (f32, Option<f32>) {
        self.steps_run += 1;
        let inv_scale = 1.0 / self.scale;
        let squares: f64 = grad
            .iter()
            .filter(|g| g.is_finite())
            .map(|&g| f64::from(g * inv_scale).powi(2))
            .sum();
        let norm = squares.sqrt() as f32;
        if grad.iter().any(|g| !g.is_finite()) {
            self.skipped_steps.push(self.steps_run);
            self.scale *= scaling.backoff_factor;
            self.growth_tracker = 0;
            return (norm, None);
        }
        self.steps_taken += 1;
        let clip_factor = clip.map_or(1.0, |max_norm| (max_norm / (norm + 1e-6)).min(1.0));
        let factor = clip_factor * inv_scale;
        self.growth_tracker += 1;
        let grown = self.scale * scaling.growth_factor;
        if self.growth_tracker >= u64::from(scaling.growth_interval) && grown.is_finite() {
            self.scale = grown;
            self.growth_tracker = 0;
        }
        (norm, Some(factor))
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

/// An operand of [`matmul_operands`]: f32 values or f16 ones.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

/// Twin of `matmul.wgsl`'s products reading f16 operands (A_F16 / B_F16,
/// `Kernels::matmul` with `MatmulOperand::F16`): each f16 value widened (exactly), then
/// [`matmul_epilogue`].
pub fn matmul_operands(
    form: MatmulForm,
    e: Epilogue<'_>,
    a: Operand<'_>,
    b: Operand<'_>,
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f32>, Vec<f32>) {
    let widened = |x: Operand<'_>| match x {
        Operand::F32(v) => v.to_vec(),
        Operand::F16(v) => from_f16(v),
    };
    matmul_epilogue(form, e, &widened(a), &widened(b), m, n, k)
}

/// Twin of `f16_weights.wgsl`'s products (`matvec_f16w_forward`,
/// `matmul_f16w_forward_small`, `_register`): C = epilogue(A·Bᵀ) with A
/// [m, k] f32 and B [n, k] f16, widened exactly; f64 accumulation. Returns
/// C and the pre-activation, as [`matmul_epilogue`].
pub fn matmul_f16_weights(
    e: Epilogue<'_>,
    a: &[f32],
    b: &[half::f16],
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f32>, Vec<f32>) {
    matmul_epilogue(MatmulForm::ABt, e, a, &from_f16(b), m, n, k)
}

/// Twin of `embedding_f16w_forward`: out[n, channels] = table[ids[n], :]
/// widened from f16; a row of NaN for an id ≥ vocab.
pub fn embedding_f16_weights(table: &[half::f16], ids: &[u32], vocab: usize, channels: usize) -> Vec<f32> {
    embedding_forward(&from_f16(table), ids, vocab, channels)
}

/// A [rows, cols] `format` matrix as a GGUF file stores it (`raw`), decoded
/// block by block with the GGUF reader's reference decoders
/// ([`crate::ops::decode_q8_0`] and the others): the values the quantized kernels
/// compute with; an error for a length that is not whole blocks.
pub fn dequantize(format: QuantFormat, raw: &[u8]) -> Result<Vec<f32>> {
    format.dequantize(raw).map_err(|reason| Error::InvalidArgument {
        op: "cpu::dequantize",
        reason,
    })
}

/// Twin of `quant_weights.wgsl`'s products (`matvec_quant_forward`,
/// `matmul_quant_forward`): C = epilogue(A·Bᵀ) with A [m, k] f32 and B
/// [n, k] in `format` as a GGUF file stores it (`raw`), decoded exactly
/// ([`dequantize`]); f64 accumulation. Returns C and the pre-activation,
/// as [`matmul_epilogue`].
pub fn matmul_quant_weights(
    e: Epilogue<'_>,
    a: &[f32],
    format: QuantFormat,
    raw: &[u8],
    m: usize,
    n: usize,
    k: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    Ok(matmul_epilogue(
        MatmulForm::ABt,
        e,
        a,
        &dequantize(format, raw)?,
        m,
        n,
        k,
    ))
}

/// Twin of `matmul_quant_transposed`: C[m, n] = A[m, k]·B[k, n] with B
/// in `format` as a GGUF file stores it (`raw`: k rows of n values, a
/// Linear weight [out, in] in its backward dX = dY·W), decoded exactly
/// ([`dequantize`]); f64 accumulation.
pub fn matmul_quant_transposed(
    a: &[f32],
    format: QuantFormat,
    raw: &[u8],
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>> {
    Ok(matmul_epilogue(
        MatmulForm::AB,
        Epilogue::default(),
        a,
        &dequantize(format, raw)?,
        m,
        n,
        k,
    )
    .0)
}

/// Products x·W_iᵀ [m, n_i] (each row-major) joined as
/// `matmul_quant_parts` writes them: side by side [m, Σ n_i], or `gated`
/// (two of equal width) silu(first) ⊙ second [m, n₀].
pub fn join_products<T: Real>(products: &[(usize, Vec<T>)], m: usize, gated: bool) -> Vec<T> {
    if let (true, [(_, gate), (_, up)]) = (gated, products) {
        return gate
            .iter()
            .zip(up)
            .map(|(&g, &u)| T::from_f64(activation_value(Activation::Silu, g.into()) * u.into()))
            .collect();
    }
    let width: usize = products.iter().map(|p| p.0).sum();
    let mut out = Vec::with_capacity(m * width);
    for row in 0..m {
        for (n, product) in products {
            out.extend_from_slice(&product[row * n..(row + 1) * n]);
        }
    }
    out
}

/// Twin of `matmul_quant_parts`: A [m, k] times the `format` matrices
/// `parts` (raw GGUF blocks, rows each) side by side, or gated
/// ([`join_products`]).
pub fn matmul_quant_parts(
    a: &[f32],
    format: QuantFormat,
    parts: &[(&[u8], usize)],
    m: usize,
    k: usize,
    gated: bool,
) -> Result<Vec<f32>> {
    let products = parts
        .iter()
        .map(|&(raw, n)| Ok((n, matmul_quant_weights(Epilogue::default(), a, format, raw, m, n, k)?.0)))
        .collect::<Result<Vec<_>>>()?;
    Ok(join_products(&products, m, gated))
}

/// Twin of `embedding_quant_forward`: out[n, channels] = table[ids[n], :]
/// of a `format` table as a GGUF file stores it; a row of NaN for an id ≥
/// vocab.
pub fn embedding_quant_weights(
    format: QuantFormat,
    raw: &[u8],
    ids: &[u32],
    vocab: usize,
    channels: usize,
) -> Result<Vec<f32>> {
    Ok(embedding_forward(&dequantize(format, raw)?, ids, vocab, channels))
}

// Row-wise ops (rowwise.wgsl). Out-of-range targets and ids behave as the
// kernels do: NaN where the kernel writes NaN, nothing where it skips.

/// Twin of `softmax_forward`: softmax over each row of x[rows, cols]; with
/// `causal = Some(t)` row r keeps columns ≤ r % t and is 0 after them.
pub fn softmax_forward<T: Real>(x: &[T], rows: usize, cols: usize, causal: Option<usize>) -> Vec<T> {
    let mut y = vec![T::default(); rows * cols];
    for r in 0..rows {
        let live = causal.map_or(cols, |t| r % t + 1);
        let row: Vec<f64> = x[r * cols..r * cols + live].iter().map(|&v| v.into()).collect();
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for (c, v) in row.iter().enumerate() {
            y[r * cols + c] = T::from_f64((v - m).exp() / sum);
        }
    }
    y
}

/// Twin of `softmax_backward`: dx = y · (dy − Σ_c dy·y) per row.
pub fn softmax_backward<T: Real>(y: &[T], dy: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut dx = vec![T::default(); rows * cols];
    for r in 0..rows {
        let span = r * cols..(r + 1) * cols;
        let dot: f64 = y[span.clone()]
            .iter()
            .zip(&dy[span.clone()])
            .map(|(&a, &b)| a.into() * b.into())
            .sum();
        for i in span {
            dx[i] = T::from_f64(y[i].into() * (dy[i].into() - dot));
        }
    }
    dx
}

/// What [`layernorm_forward`] returns: y[rows, cols], mean[rows], rstd[rows].
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormForward<T = f32> {
    pub y: Vec<T>,
    pub mean: Vec<T>,
    pub rstd: Vec<T>,
}

/// Twin of `layernorm_forward` (torch.nn.LayerNorm over the last dimension,
/// biased variance).
pub fn layernorm_forward<T: Real>(
    x: &[T],
    weight: &[T],
    bias: &[T],
    rows: usize,
    cols: usize,
    eps: f32,
) -> LayerNormForward<T> {
    let mut out = LayerNormForward {
        y: vec![T::default(); rows * cols],
        mean: vec![T::default(); rows],
        rstd: vec![T::default(); rows],
    };
    for r in 0..rows {
        let row: Vec<f64> = x[r * cols..(r + 1) * cols].iter().map(|&v| v.into()).collect();
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
        let rstd = 1.0 / (var + f64::from(eps)).sqrt();
        for (c, v) in row.iter().enumerate() {
            out.y[r * cols + c] = T::from_f64((v - mean) * rstd * weight[c].into() + bias[c].into());
        }
        out.mean[r] = T::from_f64(mean);
        out.rstd[r] = T::from_f64(rstd);
    }
    out
}

/// What [`layernorm_backward`] returns: dx[rows, cols] and the gradients of
/// weight and bias [cols] (to be added into theirs).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormBackward<T = f32> {
    pub dx: Vec<T>,
    pub dweight: Vec<T>,
    pub dbias: Vec<T>,
}

/// Twin of `layernorm_backward` and `layernorm_backward_params`, from the
/// forward's mean and rstd as the kernels take them.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Real>(
    dy: &[T],
    x: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    rows: usize,
    cols: usize,
) -> LayerNormBackward<T> {
    let mut out = LayerNormBackward {
        dx: vec![T::default(); rows * cols],
        dweight: vec![T::default(); cols],
        dbias: vec![T::default(); cols],
    };
    let mut dweight = vec![0.0f64; cols];
    let mut dbias = vec![0.0f64; cols];
    for r in 0..rows {
        let (mu, rs): (f64, f64) = (mean[r].into(), rstd[r].into());
        let span = r * cols..(r + 1) * cols;
        let xhat: Vec<f64> = x[span.clone()].iter().map(|&v| (v.into() - mu) * rs).collect();
        let g: Vec<f64> = dy[span.clone()]
            .iter()
            .zip(weight)
            .map(|(&d, &w)| d.into() * w.into())
            .collect();
        let mean_g = g.iter().sum::<f64>() / cols as f64;
        let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for c in 0..cols {
            out.dx[r * cols + c] = T::from_f64((g[c] - mean_g - xhat[c] * mean_gx) * rs);
            dweight[c] += dy[r * cols + c].into() * xhat[c];
            dbias[c] += dy[r * cols + c].into();
        }
    }
    out.dweight = dweight.into_iter().map(T::from_f64).collect();
    out.dbias = dbias.into_iter().map(T::from_f64).collect();
    out
}

/// What [`rmsnorm_forward`] returns: y[rows, cols], rstd[rows].
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormForward<T> {
    pub y: Vec<T>,
    pub rstd: Vec<T>,
}

/// Twin of `rmsnorm_forward` (torch.nn.RMSNorm over the last dimension):
/// y[rows, cols] = x · rstd · weight[cols] and rstd[rows] =
/// 1 / sqrt(mean_c(x²) + eps), accumulated in f64. In f64 it is the
/// function the kernels' gradients are checked against by central
/// differences.
pub fn rmsnorm_forward<T: Real>(x: &[T], weight: &[T], rows: usize, cols: usize, eps: f32) -> RmsNormForward<T> {
    let mut y = vec![T::default(); rows * cols];
    let mut rstd = vec![T::default(); rows];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let rs = 1.0 / (row.iter().map(|&v| v.into() * v.into()).sum::<f64>() / cols as f64 + f64::from(eps)).sqrt();
        rstd[r] = T::from_f64(rs);
        for c in 0..cols {
            y[r * cols + c] = T::from_f64(row[c].into() * rs * weight[c].into());
        }
    }
    RmsNormForward { y, rstd }
}

/// What [`rmsnorm_backward`] returns: dx[rows, cols] and the weight's
/// gradient [cols] (to be added into its own).
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormBackward<T> {
    pub dx: Vec<T>,
    pub dweight: Vec<T>,
}

/// Twin of `rmsnorm_backward` and `rmsnorm_backward_params`, from the
/// forward's rstd as the kernels take it: with x̂ = x·rstd and
/// g = dy·weight, dx = (g − x̂·mean_c(g·x̂))·rstd and dweight = Σ_r dy·x̂.
pub fn rmsnorm_backward<T: Real>(
    dy: &[T],
    x: &[T],
    weight: &[T],
    rstd: &[T],
    rows: usize,
    cols: usize,
) -> RmsNormBackward<T> {
    let mut dx = vec![T::default(); rows * cols];
    let mut dweight = vec![0.0f64; cols];
    for r in 0..rows {
        let rs: f64 = rstd[r].into();
        let span = r * cols..(r + 1) * cols;
        let xhat: Vec<f64> = x[span.clone()].iter().map(|&v| v.into() * rs).collect();
        let g: Vec<f64> = dy[span.clone()]
            .iter()
            .zip(weight)
            .map(|(&d, &w)| d.into() * w.into())
            .collect();
        let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for c in 0..cols {
            dx[r * cols + c] = T::from_f64((g[c] - xhat[c] * mean_gx) * rs);
            dweight[c] += dy[r * cols + c].into() * xhat[c];
        }
    }
    RmsNormBackward {
        dx,
        dweight: dweight.into_iter().map(T::from_f64).collect(),
    }
}

/// Rotary embedding in f64 over x [S, T, H, D] (see `ops::RopeShape`):
/// `sign` 1 rotates by each angle, −1 by minus it (the backward). The
/// angles are PyTorch's f32 values (`ops::rope_inv_freq`,
/// `ops::rope_angle`), the rest f64. A position ≥ `shape.positions`
/// gives NaN, as the kernels.
pub fn rope_f64(x: &[f64], starts: &[u32], shape: RopeShape, layout: RopeLayout, base: f32, sign: f64) -> Vec<f64> {
    let RopeShape {
        rows,
        heads,
        head_dim,
        rotary_dim,
        positions,
        ..
    } = shape;
    let inv_freq = rope_inv_freq(base, rotary_dim);
    let mut out = x.to_vec();
    for (i, o) in out.iter_mut().enumerate() {
        let c = i % head_dim;
        if c >= rotary_dim {
            continue;
        }
        let row = i / (heads * head_dim);
        let position = starts[row / rows] as usize + row % rows;
        if position >= positions {
            *o = f64::NAN;
            continue;
        }
        let angle = f64::from(rope_angle(inv_freq[layout.pair(c, rotary_dim)], position));
        let (partner, first) = layout.partner(c, rotary_dim);
        let b = x[i - c + partner];
        let (cos, sin) = (angle.cos(), sign * angle.sin());
        *o = if first {
            x[i] * cos - b * sin
        } else {
            x[i] * cos + b * sin
        };
    }
    out
}

/// Twin of `rope_forward` (see [`rope_f64`]).
pub fn rope_forward(x: &[f32], starts: &[u32], shape: RopeShape, layout: RopeLayout, base: f32) -> Vec<f32> {
    let wide: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    rope_f64(&wide, starts, shape, layout, base, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Twin of `rope_backward`: dx from dy, the rotation by minus each angle.
pub fn rope_backward(dy: &[f32], starts: &[u32], shape: RopeShape, layout: RopeLayout, base: f32) -> Vec<f32> {
    let wide: Vec<f64> = dy.iter().map(|&v| f64::from(v)).collect();
    rope_f64(&wide, starts, shape, layout, base, -1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Per-row softmax cross-entropy in f64: logsumexp(logits[r]) −
/// logits[r, targets[r]], NaN for a target ≥ vocab. The loss the
/// cross-entropy kernel's gradient is checked against by central
/// differences.
pub fn cross_entropy_rows_loss(logits: &[f64], targets: &[u32], rows: usize, vocab: usize) -> Vec<f64> {
    (0..rows)
        .map(|r| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let target = targets[r] as usize;
            if target >= vocab {
                return f64::NAN;
            }
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln() - row[target]
        })
        .collect()
}

/// Twin of `cross_entropy_rows_forward_backward`: (losses[rows],
/// dlogits[rows, vocab] = (softmax − onehot) · scale); a target ≥ vocab
/// gives a NaN loss and a NaN gradient row.
pub fn cross_entropy_rows_forward_backward<T: Real>(
    logits: &[T],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    scale: f32,
) -> (Vec<T>, Vec<T>) {
    let wide: Vec<f64> = logits.iter().map(|&v| v.into()).collect();
    let losses = cross_entropy_rows_loss(&wide, targets, rows, vocab);
    let mut dlogits = vec![T::default(); rows * vocab];
    for r in 0..rows {
        let row = &wide[r * vocab..(r + 1) * vocab];
        let bad = if (targets[r] as usize) < vocab { 0.0 } else { f64::NAN };
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for (c, v) in row.iter().enumerate() {
            let onehot = if c == targets[r] as usize { 1.0 } else { 0.0 };
            dlogits[r * vocab + c] = T::from_f64(((v - m).exp() / sum - onehot) * f64::from(scale) + bad);
        }
    }
    (losses.into_iter().map(T::from_f64).collect(), dlogits)
}

/// Twin of `embedding_forward`: out[n, channels] = table[ids[n], :]; a row
/// of NaN for an id ≥ vocab.
pub fn embedding_forward<T: Real>(table: &[T], ids: &[u32], vocab: usize, channels: usize) -> Vec<T> {
    ids.iter()
        .flat_map(|&id| {
            let id = id as usize;
            (0..channels).map(move |c| {
                if id < vocab {
                    table[id * channels + c]
                } else {
                    T::from_f64(f64::NAN)
                }
            })
        })
        .collect()
}

/// Twin of `embedding_backward_sort` + `embedding_backward`: the gradient
/// of the table [vocab, channels], Σ of dout[n, :] over the positions with
/// ids[n] = v (to be added into dtable); positions with an id ≥ vocab add
/// nothing.
pub fn embedding_backward<T: Real>(dout: &[T], ids: &[u32], vocab: usize, channels: usize) -> Vec<T> {
    let mut dtable = vec![0.0f64; vocab * channels];
    for (n, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            continue;
        }
        for c in 0..channels {
            dtable[id * channels + c] += dout[n * channels + c].into();
        }
    }
    dtable.into_iter().map(T::from_f64).collect()
}

/// Twin of `cached_attention_forward`: writes each new row's k and v into
/// copies of the caches at position starts[s] + t, then attends over
/// positions 0..=p (the last `shape.window` of them under a sliding
/// window) with the caches' keys and values (the rows just written
/// included) — the plain definition, without the kernel's split between
/// cached rows and this step's rows. Query head h reads KV head
/// h / (heads / kv_heads). `q`, `k`, `v` are the operands as
/// [`CachedAttentionShape::columns`] places the heads in them (the same
/// slice three times for a fused qkv). Returns (out, k_cache, v_cache); a
/// position ≥ context gives a NaN output row and no cache write.
pub fn cached_attention<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    starts: &[u32],
    k_cache: &[T],
    v_cache: &[T],
    shape: CachedAttentionShape,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let CachedAttentionShape {
        seqs,
        rows,
        heads,
        kv_heads,
        head_dim: d,
        context,
        ..
    } = shape;
    let Some([(q_width, q_first), (k_width, k_first), (v_width, v_first)]) = shape.columns() else {
        return (Vec::new(), k_cache.to_vec(), v_cache.to_vec());
    };
    let group = heads / kv_heads.max(1);
    let (mut keys, mut values) = (k_cache.to_vec(), v_cache.to_vec());
    let cache_row = |s: usize, kvh: usize, p: usize| ((s * kv_heads + kvh) * context + p) * d;
    let row = |s: usize, t: usize| s * rows + t;
    for (s, &start) in starts.iter().enumerate().take(seqs) {
        for t in 0..rows {
            let p = start as usize + t;
            if p >= context {
                continue;
            }
            for kvh in 0..kv_heads {
                let at = cache_row(s, kvh, p);
                let (from_k, from_v) = (
                    row(s, t) * k_width + k_first + kvh * d,
                    row(s, t) * v_width + v_first + kvh * d,
                );
                keys[at..at + d].copy_from_slice(&k[from_k..from_k + d]);
                values[at..at + d].copy_from_slice(&v[from_v..from_v + d]);
            }
        }
    }
    let scale = 1.0 / (d as f64).sqrt();
    let c = heads * d;
    let mut out = vec![T::from_f64(f64::NAN); seqs * rows * c];
    for (s, &start) in starts.iter().enumerate().take(seqs) {
        for t in 0..rows {
            let p = start as usize + t;
            if p >= context {
                continue;
            }
            for h in 0..heads {
                let kvh = h / group;
                let query = &q[row(s, t) * q_width + q_first + h * d..][..d];
                let first = shape.first_visible(p);
                let scores: Vec<f64> = (first..=p)
                    .map(|j| {
                        let key = &keys[cache_row(s, kvh, j)..][..d];
                        query.iter().zip(key).map(|(&a, &b)| a.into() * b.into()).sum::<f64>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|&v| (v - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for e in 0..d {
                    let y: f64 = weights
                        .iter()
                        .enumerate()
                        .map(|(j, &w)| w * values[cache_row(s, kvh, first + j) + e].into())
                        .sum();
                    out[row(s, t) * c + h * d + e] = T::from_f64(y / total);
                }
            }
        }
    }
    (out, keys, values)
}

/// Where row t's head `head` of a [B, T, heads, d] tensor starts.
fn head_row(shape: FlashAttentionShape, heads: usize, b: usize, t: usize, head: usize) -> usize {
    ((b * shape.seq + t) * heads + head) * shape.head_dim
}

/// x · y over d values, in f64.
fn dot<T: Real>(x: &[T], y: &[T]) -> f64 {
    x.iter().zip(y).map(|(&a, &b)| a.into() * b.into()).sum()
}

/// Fused causal self-attention's forward, the twin of
/// `flash_attention_forward`, computed directly (all of a row's scores,
/// then its softmax): o [B, T, H, d] = softmax(q·kᵀ/√d, causal)·v per
/// query head, head h reading KV head h / (H / Hkv), and each row's
/// log-sum-exp of its scaled scores [B, H, T]. Under a sliding window query
/// i sees keys i - window + 1 ..= i.
pub fn flash_attention_forward<T: Real>(q: &[T], k: &[T], v: &[T], shape: FlashAttentionShape) -> (Vec<T>, Vec<T>) {
    let FlashAttentionShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim: d,
        ..
    } = shape;
    let (scale, group) = (shape.scale(), shape.group());
    let mut out = vec![T::default(); batch * seq * heads * d];
    let mut lse = vec![T::default(); batch * heads * seq];
    for b in 0..batch {
        for h in 0..heads {
            let kvh = h / group;
            for i in 0..seq {
                let query = &q[head_row(shape, heads, b, i, h)..][..d];
                let first = shape.first_visible(i);
                let scores: Vec<f64> = (first..=i)
                    .map(|j| dot(query, &k[head_row(shape, kv_heads, b, j, kvh)..][..d]) * scale)
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|&s| (s - max).exp()).sum();
                let row_lse = max + total.ln();
                for e in 0..d {
                    let y: f64 = scores
                        .iter()
                        .enumerate()
                        .map(|(j, &s)| (s - row_lse).exp() * v[head_row(shape, kv_heads, b, first + j, kvh) + e].into())
                        .sum();
                    out[head_row(shape, heads, b, i, h) + e] = T::from_f64(y);
                }
                lse[(b * heads + h) * seq + i] = T::from_f64(row_lse);
            }
        }
    }
    (out, lse)
}

/// D [B, H, T] = rowsum(dO ∘ O) per query head, the twin of
/// `flash_attention_backward_prepare`.
pub fn flash_attention_backward_prepare<T: Real>(dout: &[T], out: &[T], shape: FlashAttentionShape) -> Vec<T> {
    let FlashAttentionShape {
        batch,
        seq,
        heads,
        head_dim: d,
        ..
    } = shape;
    let mut delta = vec![T::default(); batch * heads * seq];
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..seq {
                let at = head_row(shape, heads, b, i, h);
                delta[(b * heads + h) * seq + i] = T::from_f64(dot(&dout[at..at + d], &out[at..at + d]));
            }
        }
    }
    delta
}

/// Fused causal attention's gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashAttentionGrads<T> {
    /// [B, T, H, d]
    pub dq: Vec<T>,
    /// [B, T, Hkv, d], summed over each KV head's query heads.
    pub dk: Vec<T>,
    pub dv: Vec<T>,
}

/// The gradients of [`flash_attention_forward`] given dO, the forward's
/// log-sum-exp and D ([`flash_attention_backward_prepare`]), as the
/// backward kernels take them: p = exp(s − lse), dV += pᵀ·dO, dS = p ∘
/// (dO·vᵀ − D), dQ = dS·k/√d, dK = dSᵀ·q/√d.
pub fn flash_attention_backward<T: Real>(
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    lse: &[T],
    delta: &[T],
    shape: FlashAttentionShape,
) -> FlashAttentionGrads<T> {
    let FlashAttentionShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim: d,
        ..
    } = shape;
    let (scale, group) = (shape.scale(), shape.group());
    let mut dq = vec![0.0f64; batch * seq * heads * d];
    let (mut dk, mut dv) = (
        vec![0.0f64; batch * seq * kv_heads * d],
        vec![0.0f64; batch * seq * kv_heads * d],
    );
    for b in 0..batch {
        for h in 0..heads {
            let kvh = h / group;
            for i in 0..seq {
                let (qi, stat) = (head_row(shape, heads, b, i, h), (b * heads + h) * seq + i);
                let (row_lse, row_delta) = (lse[stat].into(), delta[stat].into());
                for j in shape.first_visible(i)..=i {
                    let kj = head_row(shape, kv_heads, b, j, kvh);
                    let p = (dot(&q[qi..qi + d], &k[kj..kj + d]) * scale - row_lse).exp();
                    let ds = p * (dot(&dout[qi..qi + d], &v[kj..kj + d]) - row_delta);
                    for e in 0..d {
                        dq[qi + e] += ds * scale * k[kj + e].into();
                        dk[kj + e] += ds * scale * q[qi + e].into();
                        dv[kj + e] += p * dout[qi + e].into();
                    }
                }
            }
        }
    }
    let narrow = |x: Vec<f64>| x.into_iter().map(T::from_f64).collect();
    FlashAttentionGrads {
        dq: narrow(dq),
        dk: narrow(dk),
        dv: narrow(dv),
    }
}

// Tensor ops (matmul_batched in matmul.wgsl, the rest in tensor.wgsl) on
// contiguous row-major tensors of rank 1..4. The GPU entries' `accumulate`
// is "add the returned values into out"; the twins return the values. The
// broadcasting twins index by coordinates, not by the kernels' strides, and
// check their shapes (Error::Shape) as the entries do.

/// out[b] = op(a[b])·op(b[b]) for b in 0..batch, each operand `batch`
/// contiguous matrices stored as `form` says.
pub fn matmul_batched<T: Real>(
    form: MatmulForm,
    a: &[T],
    b: &[T],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<T> {
    (0..batch)
        .flat_map(|i| {
            matmul(
                form,
                &a[i * m * k..(i + 1) * m * k],
                &b[i * k * n..(i + 1) * k * n],
                m,
                n,
                k,
            )
        })
        .collect()
}

/// The row-major coordinates of element `i` of `shape`.
fn coords(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for (axis, &d) in shape.iter().enumerate().rev() {
        c[axis] = i % d;
        i /= d;
    }
    c
}

/// Element of `shape` (aligned at the trailing axis with `at`, a
/// coordinate of a shape of rank ≥ its own) that `at` reads under
/// broadcasting: coordinate 0 on its size-1 axes.
fn broadcast_index(shape: &[usize], at: &[usize]) -> usize {
    let skip = at.len() - shape.len();
    shape
        .iter()
        .zip(&at[skip..])
        .fold(0, |acc, (&d, &c)| acc * d + if d == 1 { 0 } else { c })
}

fn check_len<T>(op: &'static str, name: &str, data: &[T], shape: &[usize]) -> Result<()> {
    if shape.is_empty() || shape.len() > 4 || shape.iter().product::<usize>() != data.len() {
        return Err(Error::shape(
            op,
            format!("{name} has {} elements for a shape {shape:?} (rank 1..=4)", data.len()),
            &[shape],
        ));
    }
    Ok(())
}

/// Twin of `binary_broadcast`: a ∘ b with NumPy broadcasting; the result
/// has `ops::broadcast_shape(a_shape, b_shape)`.
pub fn binary_broadcast<T: Real>(op: Binary, a: &[T], b: &[T], a_shape: &[usize], b_shape: &[usize]) -> Result<Vec<T>> {
    check_len("binary_broadcast", "a", a, a_shape)?;
    check_len("binary_broadcast", "b", b, b_shape)?;
    let out_shape = broadcast_shape(a_shape, b_shape)
        .ok_or_else(|| Error::shape("binary_broadcast", "shapes do not broadcast", &[a_shape, b_shape]))?;
    let n: usize = out_shape.iter().product();
    Ok((0..n)
        .map(|i| {
            let at = coords(i, &out_shape);
            binary_value(op, a[broadcast_index(a_shape, &at)], b[broadcast_index(b_shape, &at)])
        })
        .collect())
}

/// Twin of `unary` (IEEE at x ≤ 0 for Rsqrt: +inf at 0, NaN below).
pub fn unary<T: Real>(op: Unary, x: &[T]) -> Vec<T> {
    x.iter()
        .map(|&v| {
            let v: f64 = v.into();
            T::from_f64(match op {
                Unary::Exp => v.exp(),
                Unary::Rsqrt => 1.0 / v.sqrt(),
            })
        })
        .collect()
}

/// Twin of elementwise.wgsl's `hash_u32` (lowbias32), in wrapping u32
/// arithmetic.
pub fn hash_u32(v: u32) -> u32 {
    let mut h = v;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

/// Which of `len` elements (viewed as [len / cols, cols], `rows_per_example`
/// rows to an example) `dropout_forward` keeps under `mask` with the
/// control words `control` (key, on, first example): all when off.
pub fn dropout_keeps(
    mask: &DropoutMask,
    control: &[u32],
    len: usize,
    cols: usize,
    rows_per_example: usize,
) -> Vec<bool> {
    let word = |i: usize| control.get(i).copied().unwrap_or(0);
    if word(1) == 0 {
        return vec![true; len];
    }
    let cols = cols.max(1);
    let stream = hash_u32(hash_u32(word(0)) ^ mask.salt);
    let threshold = mask.threshold();
    (0..len)
        .map(|i| {
            let row = word(2)
                .wrapping_mul(rows_per_example as u32)
                .wrapping_add((i / cols) as u32);
            let element = row
                .wrapping_mul(mask.row_width as u32)
                .wrapping_add(mask.col_offset as u32)
                .wrapping_add((i % cols) as u32);
            hash_u32(hash_u32(element ^ stream).wrapping_add(stream)) >= threshold
        })
        .collect()
}

/// Twin of `dropout_forward` (and of its backward, over dy): kept elements
/// times 1/(1 − p), the others 0; x itself when the control's `on` word is 0.
pub fn dropout<T: Real>(mask: &DropoutMask, x: &[T], control: &[u32], cols: usize, rows_per_example: usize) -> Vec<T> {
    if control.get(1).copied().unwrap_or(0) == 0 {
        return x.to_vec();
    }
    let scale = f64::from(mask.scale());
    dropout_keeps(mask, control, x.len(), cols.max(1), rows_per_example)
        .into_iter()
        .zip(x)
        .map(|(keep, &v)| {
            if keep {
                T::from_f64(scale * v.into())
            } else {
                T::default()
            }
        })
        .collect()
}

/// Twin of `reduce_to_shape`: x summed (in f64) down to `out_shape`, of
/// which `x_shape` is a broadcast.
pub fn reduce_to_shape<T: Real>(x: &[T], x_shape: &[usize], out_shape: &[usize]) -> Result<Vec<T>> {
    check_len("reduce_to_shape", "x", x, x_shape)?;
    if out_shape.is_empty() || out_shape.len() > 4 || broadcast_shape(x_shape, out_shape).as_deref() != Some(x_shape) {
        return Err(Error::shape(
            "reduce_to_shape",
            "x is not a broadcast of out",
            &[x_shape, out_shape],
        ));
    }
    let mut out = vec![0.0f64; out_shape.iter().product()];
    for (i, &v) in x.iter().enumerate() {
        out[broadcast_index(out_shape, &coords(i, x_shape))] += v.into();
    }
    Ok(out.into_iter().map(T::from_f64).collect())
}

/// Twin of `permute`: out has shape[perm[i]] on axis i.
pub fn permute<T: Copy>(x: &[T], shape: &[usize], perm: &[usize]) -> Result<Vec<T>> {
    check_len("permute", "x", x, shape)?;
    let mut sorted = perm.to_vec();
    sorted.sort_unstable();
    if sorted != (0..shape.len()).collect::<Vec<_>>() {
        return Err(Error::shape("permute", "not a permutation of the axes", &[shape, perm]));
    }
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    Ok((0..x.len())
        .map(|i| {
            let at = coords(i, &out_shape);
            // x's coordinate on axis perm[j] is out's on axis j.
            let mut xc = vec![0; shape.len()];
            for (j, &p) in perm.iter().enumerate() {
                xc[p] = at[j];
            }
            x[xc.iter().zip(shape).fold(0, |acc, (&c, &d)| acc * d + c)]
        })
        .collect())
}

/// Twin of `slice_last`: x[rows, cols][:, start..start + width].
pub fn slice_last<T: Copy>(x: &[T], rows: usize, cols: usize, start: usize, width: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|r| x[r * cols + start..r * cols + start + width].iter().copied())
        .collect()
}

/// Twin of `pad_last` (not accumulating): x[rows, width] in columns
/// start..start + width of a zero [rows, cols].
pub fn pad_last<T: Copy + Default>(x: &[T], rows: usize, cols: usize, start: usize, width: usize) -> Vec<T> {
    let mut out = vec![T::default(); rows * cols];
    for r in 0..rows {
        out[r * cols + start..r * cols + start + width].copy_from_slice(&x[r * width..(r + 1) * width]);
    }
    out
}

/// Twin of `concat_last`: [a | b] row by row.
pub fn concat_last<T: Copy>(a: &[T], b: &[T], rows: usize, a_cols: usize, b_cols: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|r| {
            a[r * a_cols..(r + 1) * a_cols]
                .iter()
                .chain(&b[r * b_cols..(r + 1) * b_cols])
                .copied()
        })
        .collect()
}

// Optimizer steps over separate parameter tensors, as PyTorch takes them:
// the reference for the executor, which works on one arena with the
// gradient norm reduced on the GPU and the decay group as a boundary.

/// torch.nn.utils.clip_grad_norm_(max_norm, norm_type=2) over all of
/// `grads`: the total L2 norm (accumulated in f64) and the factor
/// `min(1, max_norm / (norm + 1e-6))` every gradient is multiplied by.
pub fn clip_grad_norm(grads: &[&[f32]], max_norm: f32) -> (f32, f32) {
    let squares: f64 = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    let norm = squares.sqrt() as f32;
    (norm, (max_norm / (norm + 1e-6)).min(1.0))
}

/// One step of `cfg` over parameter tensors `params` with gradients
/// `grads` and per-tensor state `state[tensor][state_names index]` (zeros
/// before the first step): gradients clipped when `cfg.clip_grad_norm` is
/// set, then each tensor updated at the scheduled rate with weight decay
/// only where `decays[tensor]` (PyTorch's two param groups, the second
/// with `weight_decay=0`). Returns the total gradient norm when clipping.
pub fn optimizer_step(
    params: &mut [Vec<f32>],
    grads: &[Vec<f32>],
    state: &mut [Vec<Vec<f32>>],
    decays: &[bool],
    cfg: &OptimizerConfig,
    step: u64,
) -> Option<f32> {
    let clip = cfg
        .clip_grad_norm()
        .map(|max_norm| clip_grad_norm(&grads.iter().map(|g| g.as_slice()).collect::<Vec<_>>(), max_norm));
    let factor = clip.map_or(1.0, |(_, f)| f);
    for (i, param) in params.iter_mut().enumerate() {
        let grad: Vec<f32> = grads[i].iter().map(|&g| g * factor).collect();
        let s = &mut state[i];
        match *cfg {
            OptimizerConfig::Sgd(c) => {
                let c = SgdConfig {
                    weight_decay: if decays[i] { c.weight_decay } else { 0.0 },
                    ..c
                };
                sgd_update(param, &grad, &mut s[0], &c, step);
            }
            OptimizerConfig::Adam(c) => {
                let c = AdamConfig {
                    weight_decay: if decays[i] { c.weight_decay } else { 0.0 },
                    ..c
                };
                let (m, v) = s.split_at_mut(1);
                adam_update(param, &grad, &mut m[0], &mut v[0], &c, step);
            }
        }
    }
    clip.map(|(norm, _)| norm)
}

// Token sampling (sampling.wgsl).

/// The candidates of a sampled token with their weights, in id order:
/// the `top_k` largest `logits` (k clamped to 1..=len; among equal logits
/// at the boundary the lower ids), each weighing exp((l − max) /
/// temperature) in f64; with `top_p` below 1, only the smallest set of
/// them, most likely first (equal logits by id), whose Σw reaches top_p
/// times theirs (at least one; NaN keeps all). The logits must be finite.
/// A temperature not above 0 leaves the first maximum alone (weight 1).
pub fn sampling_candidates(logits: &[f32], temperature: f32, top_k: u32, top_p: f32) -> Vec<(u32, f64)> {
    if logits.is_empty() {
        return Vec::new();
    }
    // Most likely first, equal logits (−0 and +0 too) in id order.
    let mut ranked: Vec<usize> = (0..logits.len()).collect();
    // (+ 0.0 turns −0 into +0, so total_cmp orders like == on finite values.)
    ranked.sort_by(|&a, &b| (logits[b] + 0.0).total_cmp(&(logits[a] + 0.0)).then(a.cmp(&b)));
    let k = if temperature > 0.0 {
        (top_k as usize).clamp(1, logits.len())
    } else {
        1
    };
    let max = f64::from(logits[ranked[0]]);
    let weight = |i: usize| {
        if temperature > 0.0 {
            ((f64::from(logits[i]) - max) / f64::from(temperature)).exp()
        } else {
            1.0
        }
    };
    let mut candidates: Vec<(u32, f64)> = ranked[..k].iter().map(|&i| (i as u32, weight(i))).collect();
    if top_p < 1.0 {
        let target = f64::from(top_p.max(0.0)) * candidates.iter().map(|&(_, w)| w).sum::<f64>();
        let mut running = 0.0;
        let kept = candidates.iter().position(|&(_, w)| {
            running += w;
            running >= target
        });
        candidates.truncate(kept.map_or(k, |i| i + 1));
    }
    candidates.sort_unstable_by_key(|&(i, _)| i);
    candidates
}

/// Twin of one row of `sample_rows_forward`: (token, first column whose
/// logit is not finite), with [`NO_TOKEN`](crate::ops::NO_TOKEN) for the
/// token when there is one, and for the column when there is none. The
/// token is the first of [`sampling_candidates`] whose running sum of
/// weights, in id order, exceeds u·Σw (u clamped into [0, 1], NaN as 0),
/// or the last candidate when none does.
pub fn sample_row(logits: &[f32], u: f32, temperature: f32, top_k: u32, top_p: f32) -> (u32, u32) {
    if let Some(bad) = logits.iter().position(|v| !v.is_finite()) {
        return (crate::ops::NO_TOKEN, bad as u32);
    }
    let candidates = sampling_candidates(logits, temperature, top_k, top_p);
    let total: f64 = candidates.iter().map(|&(_, w)| w).sum();
    let u = if u > 0.0 { u.min(1.0) } else { 0.0 };
    let target = f64::from(u) * total;
    let mut running = 0.0;
    for &(id, w) in &candidates {
        running += w;
        if running > target {
            return (id, crate::ops::NO_TOKEN);
        }
    }
    (
        candidates.last().map_or(crate::ops::NO_TOKEN, |&(id, _)| id),
        crate::ops::NO_TOKEN,
    )
}

/// Twin of `sample_rows_forward`: [`sample_row`] of each row of
/// logits[rows, vocab] with draws[rows, 3] = (u, temperature, top_p) and
/// `top_k[rows]` -> [rows, 2].
pub fn sample_rows(logits: &[f32], draws: &[f32], top_k: &[u32], rows: usize, vocab: usize) -> Vec<u32> {
    (0..rows)
        .flat_map(|r| {
            let (token, bad) = sample_row(
                &logits[r * vocab..(r + 1) * vocab],
                draws[3 * r],
                draws[3 * r + 1],
                top_k[r],
                draws[3 * r + 2],
            );
            [token, bad]
        })
        .collect()
}

/// Row `row`'s adapter in a gathered low-rank product: (first stacked
/// row, rank, scale), None for a row whose sequence names no adapter.
fn lora_row(meta: &[f32], index: &[u32], shape: LoraShape, row: usize) -> Option<(usize, usize, f64)> {
    let adapter = index[row / (shape.rows / shape.seqs)] as usize;
    if adapter >= shape.adapters {
        return None;
    }
    let entry = meta.get(adapter * LORA_META..(adapter + 1) * LORA_META)?;
    let (first, rank) = shape.segment(entry[0], entry[1]);
    Some((first, rank, f64::from(entry[2])))
}

/// Twin of `lora_shrink`: h[rows, width], h[row, j] = Σ_i x[row,
/// i]·a[first+j, i] for j below the row's adapter's rank, else 0 (see
/// [`LoraShape`]).
pub fn lora_shrink<T: Real>(x: &[T], a: &[T], meta: &[f32], index: &[u32], shape: LoraShape) -> Vec<T> {
    let (cols, width) = (shape.cols, shape.width);
    let mut h = vec![T::default(); shape.rows * width];
    for row in 0..shape.rows {
        let Some((first, rank, _)) = lora_row(meta, index, shape, row) else {
            continue;
        };
        let x_row = &x[row * cols..(row + 1) * cols];
        for j in 0..rank {
            let a_row = &a[(first + j) * cols..(first + j + 1) * cols];
            h[row * width + j] = T::from_f64(dot(x_row, a_row));
        }
    }
    h
}

/// Twin of `lora_expand`: out[rows, cols] = y + scale·Σ_j h[row,
/// j]·bt[first+j] over the row's adapter's rank; y's row where it names
/// none.
pub fn lora_expand<T: Real>(y: &[T], h: &[T], bt: &[T], meta: &[f32], index: &[u32], shape: LoraShape) -> Vec<T> {
    let (cols, width) = (shape.cols, shape.width);
    let mut out = y.to_vec();
    for row in 0..shape.rows {
        let Some((first, rank, scale)) = lora_row(meta, index, shape, row) else {
            continue;
        };
        if rank == 0 {
            continue;
        }
        for c in 0..cols {
            let sum: f64 = (0..rank)
                .map(|j| h[row * width + j].into() * bt[(first + j) * cols + c].into())
                .sum();
            out[row * cols + c] = T::from_f64(y[row * cols + c].into() + scale * sum);
        }
    }
    out
}
