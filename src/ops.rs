//! The op vocabulary: which matmul form, which activation, which binary op,
//! and the optimizers' hyper-parameters. It sits below both the GPU kernels
//! ([`crate::kernels`], which re-exports all of it) and their CPU twins
//! ([`crate::cpu`]), so neither of those imports the other.

use crate::error::{Error, Result};

mod quant_blocks;
pub use quant_blocks::{IQ4_NL_LEVELS, QK_K};

/// Which operand is transposed. Shapes are row-major as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MatmulForm {
    /// C[M,N] = A[M,K] · B[K,N] (forward pass).
    AB,
    /// C[M,N] = A[K,M]ᵀ · B[K,N] (weight gradient, Xᵀ·dY).
    AtB,
    /// C[M,N] = A[M,K] · B[N,K]ᵀ (input gradient, dY·Wᵀ).
    ABt,
}

impl MatmulForm {
    pub const ALL: [MatmulForm; 3] = [MatmulForm::AB, MatmulForm::AtB, MatmulForm::ABt];

    /// Stored shapes of A and B for an M×N×K product.
    pub fn operand_shapes(self, m: usize, n: usize, k: usize) -> ([usize; 2], [usize; 2]) {
        match self {
            MatmulForm::AB => ([m, k], [k, n]),
            MatmulForm::AtB => ([k, m], [k, n]),
            MatmulForm::ABt => ([m, k], [n, k]),
        }
    }

    /// Whether A, B are stored transposed.
    pub(crate) fn transposes(self) -> (bool, bool) {
        match self {
            MatmulForm::AB => (false, false),
            MatmulForm::AtB => (true, false),
            MatmulForm::ABt => (false, true),
        }
    }

    /// Where element (row, kk) of op(A) sits in the stored A of an
    /// M×N×K product.
    pub fn a_index(self, m: usize, k: usize, row: usize, kk: usize) -> usize {
        if self.transposes().0 {
            kk * m + row
        } else {
            row * k + kk
        }
    }

    /// Where element (kk, col) of op(B) sits in the stored B of an
    /// M×N×K product.
    pub fn b_index(self, n: usize, k: usize, kk: usize, col: usize) -> usize {
        if self.transposes().1 {
            col * k + kk
        } else {
            kk * n + col
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    /// IEEE division on the host; on the GPU WGSL's (2.5 ulp where the
    /// divisor is normal, inf/NaN where the adapter gives them at 0).
    Div,
}

impl Binary {
    pub const ALL: [Binary; 4] = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div];

    /// The op's code in shaders/tensor.wgsl (`BIN_*`); tests/suite/tensor.rs
    /// checks the two agree.
    pub fn code(self) -> u32 {
        match self {
            Binary::Add => 0,
            Binary::Sub => 1,
            Binary::Mul => 2,
            Binary::Div => 3,
        }
    }

    /// One element, in f32 as the kernels compute it.
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
            Binary::Div => a / b,
        }
    }
}

/// Elementwise functions without a backward kernel of their own (their
/// gradients compose from other ops: d exp(x) = exp(x)·dy, d rsqrt(x) =
/// -0.5·rsqrt(x)³·dy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Exp,
    /// 1/√x. For x > 0 only is the result specified: WGSL's `inverseSqrt`
    /// of x ≤ 0 is whatever the adapter gives (IEEE: +inf at +0, NaN below;
    /// lavapipe and llvmpipe do that). The CPU twin returns IEEE's.
    Rsqrt,
}

impl Unary {
    pub const ALL: [Unary; 2] = [Unary::Exp, Unary::Rsqrt];

    /// The op's code in shaders/tensor.wgsl (`UN_*`).
    pub fn code(self) -> u32 {
        match self {
            Unary::Exp => 0,
            Unary::Rsqrt => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Relu,
    /// The tanh approximation (PyTorch `GELU(approximate="tanh")`).
    Gelu,
    Sigmoid,
    Tanh,
    /// x·sigmoid(x) (PyTorch `SiLU`; the gate of Llama's SwiGLU MLP).
    Silu,
}

impl Activation {
    pub const ALL: [Activation; 5] = [
        Activation::Relu,
        Activation::Gelu,
        Activation::Sigmoid,
        Activation::Tanh,
        Activation::Silu,
    ];

    /// The activation's code in shaders/activations.wgsl (its `ACT_*`
    /// constant), which the matmul epilogue receives as `p.activation`;
    /// tests/suite/shaders.rs checks the two agree. 0 there is the identity.
    pub fn code(self) -> u32 {
        match self {
            Activation::Relu => 1,
            Activation::Gelu => 2,
            Activation::Sigmoid => 3,
            Activation::Tanh => 4,
            Activation::Silu => 5,
        }
    }
}

/// `v >= 0`, false for NaN: a NaN hyper-parameter is refused like a
/// negative one, as PyTorch's `not 0.0 <= v` checks do.
fn non_negative(v: f32) -> bool {
    v >= 0.0
}

/// How the learning rate changes from step to step. Optimizer step `t`
/// (PyTorch's `step`, counted from 1) runs at [`LrSchedule::lr_at`]`(lr, t)`,
/// computed on the host and written with the step's other scalars, so a
/// schedule rebuilds nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LrSchedule {
    /// `lr` at every step.
    #[default]
    Constant,
    /// nanoGPT's and llm.c's `get_lr(it)`, with `it = t - 1` the zero-based
    /// index of the step: `lr·(it+1)/warmup_steps` while `it < warmup_steps`
    /// (linear warmup from near 0), then cosine decay from `lr` to `min_lr`
    /// reached at `it = total_steps`, and `min_lr` from there on.
    WarmupCosine {
        warmup_steps: u64,
        total_steps: u64,
        min_lr: f32,
    },
}

impl LrSchedule {
    /// Refuses a NaN or negative `min_lr` and `warmup_steps > total_steps`.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        match *self {
            LrSchedule::Constant => Ok(()),
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_lr,
            } => {
                let bad = |reason: String| Err(Error::InvalidArgument { op, reason });
                if !non_negative(min_lr) || min_lr.is_infinite() {
                    return bad(format!("invalid min_lr {min_lr}"));
                }
                if warmup_steps > total_steps {
                    return bad(format!("warmup_steps {warmup_steps} exceeds total_steps {total_steps}"));
                }
                Ok(())
            }
        }
    }

    /// The learning rate of step `step` (counted from 1; 0 is read as 1) for
    /// base rate `lr`, in f64 and rounded once to f32.
    pub fn lr_at(&self, lr: f32, step: u64) -> f32 {
        let LrSchedule::WarmupCosine {
            warmup_steps,
            total_steps,
            min_lr,
        } = *self
        else {
            return lr;
        };
        let it = step.saturating_sub(1);
        let (lr, min_lr) = (f64::from(lr), f64::from(min_lr));
        if it < warmup_steps {
            return (lr * (it + 1) as f64 / warmup_steps as f64) as f32;
        }
        // At it == total_steps the cosine is exactly min_lr, so `>=` agrees
        // with nanoGPT's `>` and avoids 0/0 when warmup_steps == total_steps.
        if it >= total_steps {
            return min_lr as f32;
        }
        let ratio = (it - warmup_steps) as f64 / (total_steps - warmup_steps) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        (min_lr + coeff * (lr - min_lr)) as f32
    }
}

/// torch.nn.utils.clip_grad_norm_'s check: `max_norm` may be 0 or infinite
/// (infinite only measures the norm), not NaN or negative.
fn validate_clip(op: &'static str, clip: Option<f32>) -> Result<()> {
    match clip {
        Some(max_norm) if !non_negative(max_norm) => Err(Error::InvalidArgument {
            op,
            reason: format!("invalid clip_grad_norm max_norm {max_norm}"),
        }),
        _ => Ok(()),
    }
}

/// torch.amp.GradScaler's dynamic loss scaling: the loss gradient is
/// seeded with `scale`; a step whose gradients hold an inf or NaN is
/// skipped (no parameter, moment or step-count change) and the scale
/// multiplied by `backoff_factor`; after `growth_interval` clean steps in
/// a row it is multiplied by `growth_factor`. Defaults are GradScaler's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaling {
    pub init_scale: f32,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// GradScaler's checks: a positive finite scale, growth above 1,
    /// backoff in (0, 1), an interval of at least one step.
    pub fn validate(&self) -> Result<()> {
        let ok = self.init_scale.is_finite()
            && self.init_scale > 0.0
            && self.growth_factor.is_finite()
            && self.growth_factor > 1.0
            && self.backoff_factor > 0.0
            && self.backoff_factor < 1.0
            && self.growth_interval >= 1;
        if !ok {
            return Err(Error::InvalidArgument {
                op: "loss_scaling",
                reason: format!(
                    "invalid {self:?}: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval ≥ 1"
                ),
            });
        }
        Ok(())
    }
}

/// torch.optim.SGD's hyper-parameters and defaults (lr has no default there;
/// 0.01 here), plus what every optimizer here shares: the learning-rate
/// schedule, gradient-norm clipping and nanoGPT's weight-decay groups.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    pub schedule: LrSchedule,
    /// `Some(max_norm)`: before each step, scale every gradient by
    /// `min(1, max_norm / (total_norm + 1e-6))`, with `total_norm` the L2
    /// norm of all gradients together (torch.nn.utils.clip_grad_norm_).
    pub clip_grad_norm: Option<f32>,
    /// Parameter groups: weight decay only on weight matrices, not on
    /// biases or norm gains (fewer than 2 dimensions) nor on what a module
    /// put in the no-decay group (`Graph::mark_no_decay_group`: embedding
    /// tables), as nanoGPT's `configure_optimizers` groups with embeddings
    /// left out. The executor marks the others with
    /// `Graph::exclude_from_weight_decay`, which also takes any parameter.
    pub decay_matrices_only: bool,
    /// Dynamic loss scaling for f16 training (torch.amp.GradScaler), run
    /// on the GPU inside the step; `None`: gradients as computed.
    pub loss_scaling: Option<LossScaling>,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            schedule: LrSchedule::Constant,
            clip_grad_norm: None,
            decay_matrices_only: false,
            loss_scaling: None,
        }
    }
}

impl SgdConfig {
    /// The same checks torch.optim.SGD makes.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "sgd_update",
                reason,
            })
        };
        if !non_negative(self.lr) {
            return bad(format!("invalid learning rate {}", self.lr));
        }
        if !non_negative(self.momentum) {
            return bad(format!("invalid momentum {}", self.momentum));
        }
        if !non_negative(self.weight_decay) {
            return bad(format!("invalid weight_decay {}", self.weight_decay));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad("Nesterov momentum requires a momentum and zero dampening".into());
        }
        self.schedule.validate("sgd_update")?;
        if let Some(l) = &self.loss_scaling {
            l.validate()?;
        }
        validate_clip("sgd_update", self.clip_grad_norm)
    }
}

/// torch.optim.Adam / AdamW hyper-parameters. Use [`AdamConfig::adam`] or
/// [`AdamConfig::adamw`] for PyTorch's defaults (they differ in weight decay).
/// The last three fields are [`SgdConfig`]'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW (decay applied to the parameter) instead of Adam (L2 added to the gradient).
    pub decoupled_weight_decay: bool,
    pub schedule: LrSchedule,
    pub clip_grad_norm: Option<f32>,
    pub decay_matrices_only: bool,
    pub loss_scaling: Option<LossScaling>,
}

impl AdamConfig {
    pub fn adam() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            schedule: LrSchedule::Constant,
            clip_grad_norm: None,
            decay_matrices_only: false,
            loss_scaling: None,
        }
    }

    pub fn adamw() -> Self {
        AdamConfig {
            weight_decay: 1e-2,
            decoupled_weight_decay: true,
            ..Self::adam()
        }
    }

    /// The same checks torch.optim.Adam makes.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "adam_update",
                reason,
            })
        };
        if !non_negative(self.lr) {
            return bad(format!("invalid learning rate {}", self.lr));
        }
        if !non_negative(self.eps) {
            return bad(format!("invalid epsilon {}", self.eps));
        }
        if !(0.0..1.0).contains(&self.betas.0) || !(0.0..1.0).contains(&self.betas.1) {
            return bad(format!("invalid betas {:?}: each must be in [0, 1)", self.betas));
        }
        if !non_negative(self.weight_decay) {
            return bad(format!("invalid weight_decay {}", self.weight_decay));
        }
        self.schedule.validate("adam_update")?;
        if let Some(l) = &self.loss_scaling {
            l.validate()?;
        }
        validate_clip("adam_update", self.clip_grad_norm)
    }
}

/// Either optimizer, for code that holds one without knowing which.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    Sgd(SgdConfig),
    Adam(AdamConfig),
}

impl OptimizerConfig {
    /// PyTorch's names for the per-parameter state this optimizer keeps
    /// (its `state_dict`), one state arena each, in the order the update
    /// kernel binds them. The executor allocates and names its state arenas
    /// from this list, so it need not know any optimizer.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            OptimizerConfig::Sgd(_) => &["momentum_buffer"],
            OptimizerConfig::Adam(_) => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// The optimizer's own checks ([`SgdConfig::validate`], [`AdamConfig::validate`]).
    pub fn validate(&self) -> Result<()> {
        match self {
            OptimizerConfig::Sgd(c) => c.validate(),
            OptimizerConfig::Adam(c) => c.validate(),
        }
    }

    /// The base learning rate (before the schedule).
    pub fn lr(&self) -> f32 {
        match self {
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::Adam(c) => c.lr,
        }
    }

    pub fn schedule(&self) -> LrSchedule {
        match self {
            OptimizerConfig::Sgd(c) => c.schedule,
            OptimizerConfig::Adam(c) => c.schedule,
        }
    }

    pub fn clip_grad_norm(&self) -> Option<f32> {
        match self {
            OptimizerConfig::Sgd(c) => c.clip_grad_norm,
            OptimizerConfig::Adam(c) => c.clip_grad_norm,
        }
    }

    pub fn decay_matrices_only(&self) -> bool {
        match self {
            OptimizerConfig::Sgd(c) => c.decay_matrices_only,
            OptimizerConfig::Adam(c) => c.decay_matrices_only,
        }
    }

    /// The (beta1, beta2) whose powers the loss-scaled update keeps for
    /// its bias corrections: Adam's, or (0, 0) for SGD, which has none.
    pub fn bias_correction_betas(&self) -> (f32, f32) {
        match self {
            OptimizerConfig::Adam(c) => c.betas,
            OptimizerConfig::Sgd(_) => (0.0, 0.0),
        }
    }

    pub fn loss_scaling(&self) -> Option<LossScaling> {
        match self {
            OptimizerConfig::Sgd(c) => c.loss_scaling,
            OptimizerConfig::Adam(c) => c.loss_scaling,
        }
    }

    /// This optimizer with dynamic loss scaling (`None`: without).
    pub fn with_loss_scaling(mut self, scaling: Option<LossScaling>) -> Self {
        match &mut self {
            OptimizerConfig::Sgd(c) => c.loss_scaling = scaling,
            OptimizerConfig::Adam(c) => c.loss_scaling = scaling,
        }
        self
    }

    /// The learning rate of step `step` (from 1): the schedule applied to `lr`.
    pub fn lr_at(&self, step: u64) -> f32 {
        self.schedule().lr_at(self.lr(), step)
    }

    /// This optimizer with learning-rate schedule `schedule`.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        match &mut self {
            OptimizerConfig::Sgd(c) => c.schedule = schedule,
            OptimizerConfig::Adam(c) => c.schedule = schedule,
        }
        self
    }

    /// This optimizer clipping the global gradient norm to `max_norm`
    /// (`None`: no clipping). See [`SgdConfig::clip_grad_norm`].
    pub fn with_clip_grad_norm(mut self, max_norm: Option<f32>) -> Self {
        match &mut self {
            OptimizerConfig::Sgd(c) => c.clip_grad_norm = max_norm,
            OptimizerConfig::Adam(c) => c.clip_grad_norm = max_norm,
        }
        self
    }

    /// This optimizer decaying only parameters of two or more dimensions.
    /// See [`SgdConfig::decay_matrices_only`].
    pub fn with_decay_matrices_only(mut self, on: bool) -> Self {
        match &mut self {
            OptimizerConfig::Sgd(c) => c.decay_matrices_only = on,
            OptimizerConfig::Adam(c) => c.decay_matrices_only = on,
        }
        self
    }
}

/// How the queries, keys and values of a cached attention sit in its
/// operands' rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvLayout {
    /// One operand [S, T, (H + 2·Hkv)·d], bound as q, k and v alike: its
    /// rows are q | k | v (a GPT's `c_attn` projection).
    Fused,
    /// Three operands q [S, T, H·d], k and v [S, T, Hkv·d] (Llama's
    /// `q_proj`, `k_proj`, `v_proj`, q and k rotated).
    Separate,
}

/// The sizes of attention over a KV cache (`Kernels::cached_attention_forward`
/// and its CPU twin `cpu::cached_attention`): `seqs` sequences
/// of `rows` new positions each, `heads` query heads of `head_dim`
/// channels sharing `kv_heads` key/value heads (query head h reads KV head
/// h / (heads / kv_heads), transformers' `repeat_kv`; kv_heads = heads is
/// multi-head attention), and caches of `context` positions per
/// (sequence, KV head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttentionShape {
    pub seqs: usize,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    pub layout: QkvLayout,
    /// Sliding-window attention: position p attends only to positions
    /// p - window + 1 ..= p; None: to all of 0 ..= p.
    pub window: Option<usize>,
}

impl CachedAttentionShape {
    /// Multi-head attention over one fused qkv operand (a GPT's).
    pub fn fused(seqs: usize, rows: usize, heads: usize, head_dim: usize, context: usize) -> Self {
        CachedAttentionShape {
            seqs,
            rows,
            heads,
            kv_heads: heads,
            head_dim,
            context,
            layout: QkvLayout::Fused,
            window: None,
        }
    }

    /// The first position that position `p` attends to.
    pub fn first_visible(&self, p: usize) -> usize {
        first_visible(p, self.window)
    }

    /// The (row width, first column) of the q, k and v operands: where
    /// head 0 of each starts in a row; head h follows at h·d.
    pub fn columns(&self) -> Option<[(usize, usize); 3]> {
        let (q, kv) = (
            self.heads.checked_mul(self.head_dim)?,
            self.kv_heads.checked_mul(self.head_dim)?,
        );
        Some(match self.layout {
            QkvLayout::Fused => {
                let width = q.checked_add(kv.checked_mul(2)?)?;
                [(width, 0), (width, q), (width, q + kv)]
            }
            QkvLayout::Separate => [(q, 0), (kv, 0), (kv, 0)],
        })
    }

    /// Elements of the q, k and v operands, of out [S, T, H·d] and of each
    /// cache [S, Hkv, P, d]; None when a product overflows.
    pub fn lengths(&self) -> Option<CachedAttentionLengths> {
        let positions = self.seqs.checked_mul(self.rows)?;
        let [q, k, v] = self.columns()?.map(|(width, _)| positions.checked_mul(width));
        let out = positions.checked_mul(self.heads.checked_mul(self.head_dim)?)?;
        let cache = self
            .seqs
            .checked_mul(self.kv_heads)?
            .checked_mul(self.head_dim)?
            .checked_mul(self.context)?;
        Some(CachedAttentionLengths {
            q: q?,
            k: k?,
            v: v?,
            out,
            cache,
        })
    }
}

/// The sizes of fused causal self-attention (`Kernels::flash_attention_*`,
/// their CPU twins `cpu::flash_attention_*` and `Graph::fused_causal_attention`):
/// `batch` sequences of `seq` positions, q [B, T, H, d] and k, v
/// [B, T, Hkv, d] (each row's heads side by side, as the projections
/// produce them), query head h reading KV head h / (heads / kv_heads), and
/// the row statistics (log-sum-exp, D) [B, H, T].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashAttentionShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: query i attends only to keys j with
    /// i - window < j ≤ i; None: to all of 0 ..= i.
    pub window: Option<usize>,
}

/// The first key a query at position `p` sees under a sliding window of
/// `window` positions (None: 0).
pub fn first_visible(p: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (p + 1).saturating_sub(w))
}

/// A sliding window as the kernels take it: its positions, capped at
/// `positions` (where a wider window sees everything), and `positions`
/// for no window.
pub fn window_positions(window: Option<usize>, positions: usize) -> usize {
    window.map_or(positions, |w| w.min(positions))
}

impl FlashAttentionShape {
    /// The first key query `i` sees.
    pub fn first_visible(&self, i: usize) -> usize {
        first_visible(i, self.window)
    }

    /// The softmax's scale, 1/√d.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Elements of q (and o, dO, dq), of k (and v, dk, dv) and of the
    /// row statistics [B, H, T]; None when a product overflows.
    pub fn lengths(&self) -> Option<(usize, usize, usize)> {
        let positions = self.batch.checked_mul(self.seq)?;
        let q = positions.checked_mul(self.heads.checked_mul(self.head_dim)?)?;
        let kv = positions.checked_mul(self.kv_heads.checked_mul(self.head_dim)?)?;
        let rows = positions.checked_mul(self.heads)?;
        Some((q, kv, rows))
    }

    /// The shape's own errors, as `op` reports them: a zero size, KV heads
    /// not dividing the query heads, a head wider than `max_head_dim`.
    pub fn check(&self, op: &'static str, max_head_dim: usize) -> Result<()> {
        let dims = [self.batch, self.seq, self.heads, self.kv_heads, self.head_dim];
        if dims.contains(&0) {
            return Err(Error::shape(
                op,
                format!("every size must be at least 1: {self:?}"),
                &[&dims],
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(Error::shape(
                op,
                format!("{} KV heads do not divide {} query heads", self.kv_heads, self.heads),
                &[&dims],
            ));
        }
        if self.window == Some(0) {
            return Err(Error::shape(
                op,
                format!("a sliding window must hold at least 1 position: {self:?}"),
                &[&dims],
            ));
        }
        if self.head_dim > max_head_dim {
            return Err(Error::shape(
                op,
                format!(
                    "head_dim {} is over the largest this op takes, {max_head_dim}",
                    self.head_dim
                ),
                &[&dims],
            ));
        }
        if self
            .lengths()
            .is_none_or(|(q, kv, rows)| q.max(kv).max(rows) > u32::MAX as usize)
        {
            return Err(Error::shape(
                op,
                format!("{self:?} has more than 2^32 elements"),
                &[&dims],
            ));
        }
        Ok(())
    }
}

/// Element counts of a cached attention's operands ([`CachedAttentionShape::lengths`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttentionLengths {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub out: usize,
    pub cache: usize,
}

/// Which channels of a head a rotary position embedding rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    /// Pair i is channels (2i, 2i + 1): Meta's original Llama and GGUF.
    Interleaved,
    /// Pair i is channels (i, i + rotary_dim/2): Hugging Face's
    /// `rotate_half`.
    HalfSplit,
}

impl RopeLayout {
    /// The layout's code in shaders/rope.wgsl (`ROPE_*`).
    pub fn code(self) -> u32 {
        match self {
            RopeLayout::Interleaved => 0,
            RopeLayout::HalfSplit => 1,
        }
    }

    /// The channel rotated with channel `c` (< rotary_dim) of a head, and
    /// whether `c` is the pair's first: a pair (a, b) becomes
    /// (a·cos − b·sin, b·cos + a·sin).
    pub fn partner(self, c: usize, rotary_dim: usize) -> (usize, bool) {
        let half = rotary_dim / 2;
        match self {
            RopeLayout::Interleaved if c % 2 == 0 => (c + 1, true),
            RopeLayout::Interleaved => (c - 1, false),
            RopeLayout::HalfSplit if c < half => (c + half, true),
            RopeLayout::HalfSplit => (c - half, false),
        }
    }

    /// The pair (the frequency index) channel `c` (< rotary_dim) belongs to.
    pub fn pair(self, c: usize, rotary_dim: usize) -> usize {
        match self {
            RopeLayout::Interleaved => c / 2,
            RopeLayout::HalfSplit => c % (rotary_dim / 2),
        }
    }
}

/// A rotary embedding over x [S, T, H, D] (sequences, rows, heads, head
/// dimension; a [S·T, H·D] projection's output): the first `rotary_dim`
/// channels of each head rotate, the rest pass through; row t of sequence
/// s is at position starts[s] + t, which must be below `positions`, the
/// rows of the (cos, sin) table ([`rope_table`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeShape {
    pub seqs: usize,
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub positions: usize,
}

impl RopeShape {
    /// Elements of x [S, T, H, D] and of the table [positions,
    /// rotary_dim/2, 2]; None when a product overflows.
    pub fn lengths(&self) -> Option<(usize, usize)> {
        let x = self
            .seqs
            .checked_mul(self.rows)?
            .checked_mul(self.heads)?
            .checked_mul(self.head_dim)?;
        Some((x, self.positions.checked_mul(self.rotary_dim)?))
    }
}

/// The most positions a rotary table holds: every position below 2^24 is
/// an exact f32, as PyTorch's `position_ids.float()` needs.
pub const ROPE_MAX_POSITIONS: usize = 1 << 24;

/// inv_freq[rotary_dim/2], inv_freq_i = 1 / base^(2i/rotary_dim), each
/// step rounded to f32 as transformers' LlamaRotaryEmbedding computes it
/// (`1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))`), so that
/// angles, and through them logits, match PyTorch's. The power is taken
/// in f64 and rounded once, the same on every platform: f32 `powf`
/// (glibc's is within 0.82 ulp) differed from PyTorch's in 2–13 entries of
/// Llama 2's, SmolLM2's and Llama 3's settings, this in none (the fixture
/// of tests/suite/llama_kernels.rs); an entry an ulp off would move
/// position p's angle by p·2^-24 of itself.
pub fn rope_inv_freq(base: f32, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / rotary_dim as f32;
            1.0 / f64::from(base).powf(f64::from(exponent)) as f32
        })
        .collect()
}

/// The angle of pair `i` at `position`: `position.float() * inv_freq` in
/// f32, as PyTorch; the rotation's cos and sin are of this f32 value.
pub fn rope_angle(inv_freq: f32, position: usize) -> f32 {
    position as f32 * inv_freq
}

/// The (cos, sin) table [positions, rotary_dim/2, 2] the rope kernels
/// read: the angles of [`rope_angle`], their cos and sin rounded once to
/// f32 (PyTorch's f32 cos/sin are within an ulp of that). Computed on
/// the host because a GPU's sin and cos are specified only near [−π, π]
/// (Vulkan: 2^-11 absolute there, nothing beyond), where angles reach
/// the positions themselves (thousands of radians); and a table is what a
/// scaled rope (Llama 3.1's) changes, not the kernel.
pub fn rope_table(base: f32, rotary_dim: usize, positions: usize) -> Result<Vec<f32>> {
    let op = "rope_table";
    let bad = |reason: String| Err(Error::InvalidArgument { op, reason });
    if !(base.is_finite() && base > 0.0) {
        return bad(format!("base must be finite and > 0, got {base}"));
    }
    if rotary_dim == 0 || rotary_dim % 2 != 0 {
        return bad(format!("rotary_dim must be even and > 0, got {rotary_dim}"));
    }
    if positions == 0 || positions > ROPE_MAX_POSITIONS {
        return bad(format!("positions must be 1..={ROPE_MAX_POSITIONS}, got {positions}"));
    }
    if positions.checked_mul(rotary_dim).is_none() {
        return bad(format!("{positions} positions × {rotary_dim} channels overflow"));
    }
    let inv_freq = rope_inv_freq(base, rotary_dim);
    let mut table = Vec::with_capacity(positions * rotary_dim);
    for p in 0..positions {
        for &f in &inv_freq {
            let angle = f64::from(rope_angle(f, p));
            table.push(angle.cos() as f32);
            table.push(angle.sin() as f32);
        }
    }
    Ok(table)
}

/// The token a sampler returns for a row with a logit that is not finite,
/// and the "first non-finite column" of a row without one
/// (`Kernels::sample_rows`, `cpu::sample_rows`).
pub const NO_TOKEN: u32 = u32::MAX;

/// The adapter index of a sequence that applies none in the gathered
/// low-rank products ([`LoraShape`]): its rows add nothing.
pub const NO_ADAPTER: u32 = u32::MAX;

/// Values per adapter in a gathered low-rank product's `meta` [N, 3]:
/// the first of its stacked rows, its rank at this layer (0: it has no
/// adapter here) and its scale (α / r).
pub const LORA_META: usize = 3;

/// The sizes of the gathered low-rank products over a batch whose
/// sequences each apply their own adapter to one Linear (S-LoRA and
/// Punica's "BGMV"), as `Kernels::lora_shrink` / `lora_expand` and
/// their twins take them: the shrink h[row, j] = A_a[j]·x[row] (j below
/// adapter a's rank, 0 past it), the expand out[row] = y[row] + scale_a ·
/// Σ_j h[row, j]·B_a[:, j], where a = index[s] is the adapter of the
/// sequence owning the row (rows s·T .. s·T + T for T = rows / seqs); a
/// sequence whose index is not below the adapters (
/// [`NO_ADAPTER`]) adds nothing. Every adapter's A [r_a, in] is stacked
/// row-wise into a [ranks, in] and its Bᵀ [r_a, out] into bt [ranks,
/// out]; `meta` [adapters, 3] holds each one's (first row, rank, scale)
/// ([`LORA_META`]), the first two whole numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoraShape {
    /// S: sequences, one adapter index each.
    pub seqs: usize,
    /// Rows of x, y and h: S·T.
    pub rows: usize,
    /// The Linear's input features (the shrink's x) or output features
    /// (the expand's y).
    pub cols: usize,
    /// Columns of h: the largest rank at this layer.
    pub width: usize,
    /// N: the adapters `meta` describes.
    pub adapters: usize,
    /// Rows of the stacked a and bt: every adapter's rank at this layer.
    pub ranks: usize,
}

impl LoraShape {
    /// Elements of (x or y [rows, cols], the stacked a or bt [ranks, cols],
    /// h [rows, width], meta [adapters, 3]); None when a product
    /// overflows.
    pub fn lengths(&self) -> Option<[usize; 4]> {
        Some([
            self.rows.checked_mul(self.cols)?,
            self.ranks.checked_mul(self.cols)?,
            self.rows.checked_mul(self.width)?,
            self.adapters.checked_mul(LORA_META)?,
        ])
    }

    /// The stacked rows (first, count) of an adapter whose meta holds
    /// (`first`, `rank`): whole numbers as the kernels read them (u32 of
    /// the f32, rounded toward zero), the count cut to `width` and to the
    /// rows past `first`, so nothing is read out of bounds whatever meta
    /// holds.
    pub fn segment(&self, first: f32, rank: f32) -> (usize, usize) {
        let whole = |v: f32| if v.is_finite() && v > 0.0 { v as usize } else { 0 };
        let first = whole(first);
        (first, whole(rank).min(self.width).min(self.ranks.saturating_sub(first)))
    }
}

/// The eps of a normalization (LayerNorm, RMSNorm): positive and finite,
/// since a zero eps divides by zero on a constant row. The graph's builder
/// and the kernels' entries both check it here, so they agree.
pub fn check_norm_eps(op: &'static str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("eps must be positive and finite, got {eps}"),
        });
    }
    Ok(())
}

/// Dropout's mask (inverted dropout, as `torch.nn.Dropout` in training):
/// each element of x is zeroed with probability `p` and the others are
/// multiplied by 1/(1 − p). The mask is a counter-based hash, not a stored
/// tensor (the backward draws it again): of the run's key, the op's `salt`
/// and the element's number in the whole tensor. x is viewed as [rows,
/// cols] (cols its last dimension, its first dimension counting examples);
/// element (r, c) is number `(first_example · rows_per_example + r) ·
/// row_width + col_offset + c`, where `first_example` (a control word) says
/// where a device's rows of a split batch start and `row_width`,
/// `col_offset` where a tensor-parallel share's columns lie in the whole
/// rows: a split run draws the single device's mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    /// The probability of zeroing an element, in [0, 1).
    pub p: f32,
    /// Tells apart the masks of different sites drawn with one key (each
    /// LoRA adapter's input).
    pub salt: u32,
    /// The whole rows' width: cols for a whole tensor.
    pub row_width: usize,
    /// Where this tensor's columns start in the whole rows: 0 for a whole
    /// tensor.
    pub col_offset: usize,
}

/// Words of a dropout control input, which the executor writes before
/// each run (`Graph::dropout_control`): the run's key (the training step),
/// whether dropout applies (0: the identity, as in evaluation), the number
/// of the first example, and one unused.
pub const DROPOUT_CONTROL_WORDS: usize = 4;

impl DropoutMask {
    /// A whole tensor's mask: rows `cols` wide.
    pub fn whole(p: f32, salt: u32, cols: usize) -> Self {
        DropoutMask {
            p,
            salt,
            row_width: cols,
            col_offset: 0,
        }
    }

    /// `p` in [0, 1), and `cols` columns from `col_offset` within the rows.
    pub fn check(&self, op: &'static str, cols: usize) -> Result<()> {
        if !(self.p.is_finite() && (0.0..1.0).contains(&self.p)) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("the dropout probability must be in [0, 1), got {}", self.p),
            });
        }
        let end = self.col_offset.checked_add(cols);
        if cols == 0 || end.is_none_or(|e| e > self.row_width) || u32::try_from(self.row_width).is_err() {
            return Err(Error::shape(
                op,
                format!(
                    "{cols} columns from column {} do not lie within rows of {}",
                    self.col_offset, self.row_width
                ),
                &[&[cols], &[self.row_width]],
            ));
        }
        Ok(())
    }

    /// Elements whose hash is below this are zeroed: p · 2³².
    pub fn threshold(&self) -> u32 {
        (f64::from(self.p) * 4_294_967_296.0).min(f64::from(u32::MAX)) as u32
    }

    /// What a kept element is multiplied by: 1 / (1 − p), in f32.
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }
}

/// The NumPy broadcast of two shapes aligned at their trailing dimension:
/// each pair of dimensions must be equal or one of them 1. None when they
/// are incompatible. Shared by the broadcasting kernels, their CPU twins
/// and the graph's shape inference.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| if i + s.len() >= rank { s[i + s.len() - rank] } else { 1 };
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// A block-quantized weight format (ggml's). The kernels see every format
/// as blocks of [`QuantFormat::BLOCK`] consecutive values of a row, each
/// with a scale (and minimum) and one small integer per value; a GGUF file
/// stores the k-quants in super-blocks of 256 values
/// ([`QuantFormat::super_block`]) whose 32-value blocks share f16 scales
/// and carry small integer sub-scales. The kernels read these weights
/// without widening them in memory (`MatmulOperand::Quant`); the
/// graph stores them as `DType::Quant`.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// value = q·d, q an i8.
    Q8_0,
    /// value = (q − 8)·d, q a nibble.
    Q4_0,
    /// value = q·d + m, q a nibble.
    Q4_1,
    /// value = (q − 16)·d, q 5 bits.
    Q5_0,
    /// value = q·d + m, q 5 bits.
    Q5_1,
    /// value = levels[q]·d, q a nibble indexing 16 fixed i8 levels.
    IQ4_NL,
    /// value = (d·s)·q − dmin·m per 16 values, s and m 4 bits, q 2 bits.
    Q2_K,
    /// value = (d·(s − 32))·(q − 4) per 16 values, s 6 bits, q 3 bits.
    Q3_K,
    /// value = (d·s)·q − dmin·m per 32 values, s and m 6 bits, q 4 bits.
    Q4_K,
    /// As Q4_K with q 5 bits.
    Q5_K,
    /// value = (d·s)·(q − 32) per 16 values, s an i8, q 6 bits.
    Q6_K,
}

impl QuantFormat {
    /// Whole GGUF blocks decoded to f32 (bit-exact against gguf-py); an
    /// error for a length that is not whole blocks.
    pub fn dequantize(self, raw: &[u8]) -> std::result::Result<Vec<f32>, String> {
        let unit = self.block_bytes();
        if raw.len() % unit != 0 {
            return Err(format!(
                "{} bytes are not a whole number of {}'s {unit}-byte blocks",
                raw.len(),
                self.name()
            ));
        }
        Ok(match self {
            QuantFormat::Q8_0 => dequantize_blocks::<Q8_0_BYTES>(raw, decode_q8_0),
            QuantFormat::Q4_0 => dequantize_blocks::<Q4_0_BYTES>(raw, decode_q4_0),
            QuantFormat::Q4_1 => dequantize_blocks::<Q4_1_BYTES>(raw, decode_q4_1),
            _ => {
                let mut out = vec![0f32; raw.len() / unit * self.super_block()];
                for (block, values) in raw.chunks_exact(unit).zip(out.chunks_exact_mut(self.super_block())) {
                    quant_blocks::decode(self, block, values);
                }
                out
            }
        })
    }

    pub const ALL: [QuantFormat; 11] = [
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::IQ4_NL,
        QuantFormat::Q2_K,
        QuantFormat::Q3_K,
        QuantFormat::Q4_K,
        QuantFormat::Q5_K,
        QuantFormat::Q6_K,
    ];

    /// Values per block as the kernels see it (every format here).
    pub const BLOCK: usize = 32;

    /// ggml's name (`Q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "Q8_0",
            QuantFormat::Q4_0 => "Q4_0",
            QuantFormat::Q4_1 => "Q4_1",
            QuantFormat::Q5_0 => "Q5_0",
            QuantFormat::Q5_1 => "Q5_1",
            QuantFormat::IQ4_NL => "IQ4_NL",
            QuantFormat::Q2_K => "Q2_K",
            QuantFormat::Q3_K => "Q3_K",
            QuantFormat::Q4_K => "Q4_K",
            QuantFormat::Q5_K => "Q5_K",
            QuantFormat::Q6_K => "Q6_K",
        }
    }

    /// Values per GGUF block: 32, or a k-quant's 256-value super-block. A
    /// row is whole GGUF blocks.
    pub fn super_block(self) -> usize {
        if self.is_k_quant() {
            quant_blocks::QK_K
        } else {
            Self::BLOCK
        }
    }

    fn is_k_quant(self) -> bool {
        use QuantFormat::*;
        matches!(self, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
    }

    /// Bytes of one GGUF block ([`QuantFormat::super_block`] values) as a
    /// file stores it (ggml's type size).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => Q8_0_BYTES,
            QuantFormat::Q4_0 | QuantFormat::IQ4_NL => Q4_0_BYTES,
            QuantFormat::Q4_1 => Q4_1_BYTES,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q2_K => 84,
            QuantFormat::Q3_K => 110,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_K => 176,
            QuantFormat::Q6_K => 210,
        }
    }

    /// Words of one 32-value block's integers in the kernels' layout: Q8_0's
    /// 32 i8, every other format's 32 nibbles (the low 4 bits; higher bits
    /// are side words).
    pub fn quant_words(self) -> usize {
        if self == QuantFormat::Q8_0 {
            8
        } else {
            4
        }
    }

    /// Words per 32-value block after the integers in the kernels' layout
    /// (scales, and the 5- and 6-bit formats' high bits): see
    /// [`pack_quantized`].
    pub fn side_words(self) -> usize {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::IQ4_NL | QuantFormat::Q3_K => 1,
            QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::Q2_K | QuantFormat::Q4_K => 2,
            QuantFormat::Q5_K | QuantFormat::Q6_K => 3,
        }
    }

    /// The `QUANT_*` code of quant_weights.wgsl (its `QUANT_FORMAT`
    /// override).
    pub fn code(self) -> u32 {
        match self {
            QuantFormat::Q8_0 => 0,
            QuantFormat::Q4_0 => 1,
            QuantFormat::Q4_1 => 2,
            QuantFormat::Q5_0 => 3,
            QuantFormat::Q5_1 => 4,
            QuantFormat::IQ4_NL => 5,
            QuantFormat::Q2_K => 6,
            QuantFormat::Q3_K => 7,
            QuantFormat::Q4_K => 8,
            QuantFormat::Q5_K => 9,
            QuantFormat::Q6_K => 10,
        }
    }

    /// Words `len` values take in the kernels' layout
    /// ([`pack_quantized`]): per 32-value block its integer words and its
    /// side words. `len` is a multiple of [`QuantFormat::BLOCK`].
    pub fn stored_words(self, len: usize) -> usize {
        len / Self::BLOCK * (self.quant_words() + self.side_words())
    }

    /// A quantized matrix is [rows, cols] with whole GGUF blocks per row (a
    /// GGUF file's rule: 256 values for the k-quants), as the kernels and
    /// the graph need it.
    pub fn check_shape(self, op: &'static str, rows: usize, cols: usize) -> Result<()> {
        if rows == 0 || cols == 0 || cols % self.super_block() != 0 {
            let reason = format!(
                "a {} matrix needs rows ≥ 1 and a row length that is a multiple of {} values",
                self.name(),
                self.super_block()
            );
            return Err(Error::shape(op, reason, &[&[rows, cols]]));
        }
        Ok(())
    }

    /// The byte offsets of a GGUF block's f16 scales (d, and m or dmin
    /// where the format has one).
    pub fn scale_offsets(self) -> &'static [usize] {
        quant_blocks::scale_offsets(self)
    }

    /// The first GGUF block of `raw` (whole blocks) whose f16 scale (d, or
    /// its minimum or dmin) is NaN or infinite, with that value: such a
    /// block decodes to NaN or infinity, which no model file means.
    pub fn first_bad_scale(self, raw: &[u8]) -> Option<(usize, f32)> {
        raw.chunks_exact(self.block_bytes()).enumerate().find_map(|(i, block)| {
            quant_blocks::block_scales(self, block)
                .find(|s| !s.is_finite())
                .map(|s| (i, s))
        })
    }
}

/// GGUF's bytes of a [rows, cols] `format` matrix (blocks in row order,
/// [`QuantFormat::block_bytes`] each) re-packed for the kernels, which
/// need aligned u32 loads (a file's 34-, 18- or 144-byte blocks are not
/// 4-byte aligned) and see every format as 32-value blocks (block j of
/// row r is block r·cols/32 + j; a k-quant super-block is 8 of them).
/// First every block's integers ([`QuantFormat::quant_words`] words):
/// Q8_0's value i in byte i; every other format's low 4 bits in ggml's
/// nibble order, value i in the low nibble of byte i and value 16 + i in
/// its high nibble. Then [`QuantFormat::side_words`] words per block:
/// - Q8_0, Q4_0, IQ4_NL: the f16 d in the low half; Q4_1: d | m << 16.
/// - Q5_0: d, then the 32 fifth bits (bit i: value i); Q5_1: d | m << 16,
///   then the fifth bits.
/// - Q4_K: d | dmin << 16 (the super-block's), then s | m << 8 (this
///   block's 6-bit scale and min); Q5_K: those, then the fifth bits.
/// - Q6_K: d | s₀ << 16 | s₁ << 24 (the i8 scales of its two 16-value
///   halves), then two words of the values' top 2 bits (value i's at bit
///   2·(i % 16) of word i / 16).
/// - Q2_K: d | dmin << 16, then ggml's two scale bytes of its halves
///   (s | m << 4 each) in the low 16 bits.
/// - Q3_K: d | s₀ << 16 | s₁ << 24 (its halves' 6-bit scales, before the
///   − 32); its 3-bit integers are nibbles.
///
/// [`unpack_quantized`] is its inverse.
pub fn pack_quantized(format: QuantFormat, raw: &[u8], rows: usize, cols: usize) -> Result<Vec<u32>> {
    const OP: &str = "pack_quantized";
    format.check_shape(OP, rows, cols)?;
    let unit = format.block_bytes();
    let blocks = rows
        .checked_mul(cols / format.super_block())
        .filter(|&b| b.checked_mul(unit) == Some(raw.len()));
    let Some(blocks) = blocks else {
        let reason = format!(
            "[{rows}, {cols}] in {} takes {unit} bytes per block of {} values; got {} bytes",
            format.name(),
            format.super_block(),
            raw.len()
        );
        return Err(Error::shape(OP, reason, &[&[rows, cols], &[raw.len()]]));
    };
    let subs = format.super_block() / QuantFormat::BLOCK;
    let (qw, sw) = (format.quant_words() * subs, format.side_words() * subs);
    let mut words = vec![0u32; format.stored_words(blocks * format.super_block())];
    let (quants, side) = words.split_at_mut(blocks * qw);
    for ((block, q), s) in raw
        .chunks_exact(unit)
        .zip(quants.chunks_exact_mut(qw))
        .zip(side.chunks_exact_mut(sw))
    {
        match format {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                let header = unit - qw * 4;
                for (word, bytes) in q.iter_mut().zip(block[header..].chunks_exact(4)) {
                    *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                }
                let half = |i: usize| u32::from(u16::from_le_bytes([block[i], block[i + 1]]));
                s[0] = if format == QuantFormat::Q4_1 {
                    half(0) | half(2) << 16
                } else {
                    half(0)
                };
            }
            _ => quant_blocks::split(format, block, q, s),
        }
    }
    Ok(words)
}

/// The GGUF bytes of a [rows, cols] `format` matrix from the kernels'
/// words ([`pack_quantized`]'s inverse): the CPU twins and the graph's
/// reference decode these.
pub fn unpack_quantized(format: QuantFormat, words: &[u32], rows: usize, cols: usize) -> Result<Vec<u8>> {
    const OP: &str = "unpack_quantized";
    format.check_shape(OP, rows, cols)?;
    let len = rows
        .checked_mul(cols)
        .filter(|&len| format.stored_words(len) == words.len());
    let Some(len) = len else {
        let reason = format!(
            "[{rows}, {cols}] in {} takes {} words per block of 32 values; got {} words",
            format.name(),
            format.quant_words() + format.side_words(),
            words.len()
        );
        return Err(Error::shape(OP, reason, &[&[rows, cols], &[words.len()]]));
    };
    let blocks = len / format.super_block();
    let subs = format.super_block() / QuantFormat::BLOCK;
    let (qw, sw) = (format.quant_words() * subs, format.side_words() * subs);
    let (quants, side) = words.split_at(blocks * qw);
    let mut raw = Vec::with_capacity(blocks * format.block_bytes());
    for (q, s) in quants.chunks_exact(qw).zip(side.chunks_exact(sw)) {
        match format {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                let header = format.block_bytes() - qw * 4;
                raw.extend_from_slice(&s[0].to_le_bytes()[..header]);
                q.iter().for_each(|w| raw.extend_from_slice(&w.to_le_bytes()));
            }
            _ => quant_blocks::join(format, q, s, &mut raw),
        }
    }
    Ok(raw)
}

// ---------------------------------------------------------------------------
// GGUF's block formats decoded on the host: the plain-Rust reference for the
// quantized kernels, and the GGUF reader's de-quantization.

/// Values per block of Q8_0, Q4_0 and Q4_1.
pub const QK: usize = 32;
pub const Q8_0_BYTES: usize = 2 + QK;
pub const Q4_0_BYTES: usize = 2 + QK / 2;
pub const Q4_1_BYTES: usize = 2 + 2 + QK / 2;

pub(crate) fn f16_from_le(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// One Q8_0 block: an f16 scale `d`, then 32 i8 `q`; value = q·d.
pub fn decode_q8_0(block: &[u8; Q8_0_BYTES], out: &mut [f32; QK]) {
    let d = f16_from_le(block[0], block[1]);
    for (o, &q) in out.iter_mut().zip(&block[2..]) {
        *o = f32::from(q as i8) * d;
    }
}

/// One Q4_0 block: an f16 scale `d`, then 16 bytes whose low nibbles are
/// values 0..16 and high nibbles values 16..32; value = (q − 8)·d.
pub fn decode_q4_0(block: &[u8; Q4_0_BYTES], out: &mut [f32; QK]) {
    let d = f16_from_le(block[0], block[1]);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&block[2..]) {
        *l = (i16::from(q & 0x0f) - 8) as f32 * d;
        *h = (i16::from(q >> 4) - 8) as f32 * d;
    }
}

/// One Q4_1 block: an f16 scale `d`, an f16 minimum `m`, then 16 bytes of
/// nibbles as in Q4_0; value = q·d + m (a product, then a sum, each
/// rounded to f32, as ggml and gguf-py compute it).
pub fn decode_q4_1(block: &[u8; Q4_1_BYTES], out: &mut [f32; QK]) {
    let d = f16_from_le(block[0], block[1]);
    let m = f16_from_le(block[2], block[3]);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&block[4..]) {
        *l = f32::from(q & 0x0f) * d + m;
        *h = f32::from(q >> 4) * d + m;
    }
}

/// Applies `decode` to each `B`-byte block of `raw`, 32 values each.
pub(crate) fn dequantize_blocks<const B: usize>(raw: &[u8], decode: fn(&[u8; B], &mut [f32; QK])) -> Vec<f32> {
    let mut out = vec![0f32; raw.len() / B * QK];
    for (block, values) in raw.chunks_exact(B).zip(out.chunks_exact_mut(QK)) {
        // chunks_exact gives exactly B and QK items: both conversions hold.
        if let (Ok(block), Ok(values)) = (<&[u8; B]>::try_from(block), <&mut [f32; QK]>::try_from(values)) {
            decode(block, values);
        }
    }
    out
}
