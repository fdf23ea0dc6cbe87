//! The op vocabulary: which matmul form, which activation, which binary op,
//! and the optimizers' hyper-parameters. It sits below both the GPU kernels
//! ([`crate::kernels`], which re-exports all of it) and their CPU twins
//! ([`crate::cpu`]), so neither of those imports the other.

use crate::error::{Error, Result};

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

    /// The op's code in shaders/tensor.wgsl (`BIN_*`); tests/tensor.rs
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
}

impl Activation {
    pub const ALL: [Activation; 4] = [
        Activation::Relu,
        Activation::Gelu,
        Activation::Sigmoid,
        Activation::Tanh,
    ];

    /// The activation's code in shaders/activations.wgsl (its `ACT_*`
    /// constant), which the matmul epilogue receives as `p.activation`;
    /// tests/shaders.rs checks the two agree. 0 there is the identity.
    pub fn code(self) -> u32 {
        match self {
            Activation::Relu => 1,
            Activation::Gelu => 2,
            Activation::Sigmoid => 3,
            Activation::Tanh => 4,
        }
    }
}

/// `v >= 0`, false for NaN: a NaN hyper-parameter is refused like a
/// negative one, as PyTorch's `not 0.0 <= v` checks do.
fn non_negative(v: f32) -> bool {
    v >= 0.0
}

/// torch.optim.SGD's hyper-parameters and defaults (lr has no default there;
/// 0.01 here).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 0.01, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdConfig {
    /// The same checks torch.optim.SGD makes.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "sgd_update", reason });
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
        Ok(())
    }
}

/// torch.optim.Adam / AdamW hyper-parameters. Use [`AdamConfig::adam`] or
/// [`AdamConfig::adamw`] for PyTorch's defaults (they differ in weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW (decay applied to the parameter) instead of Adam (L2 added to the gradient).
    pub decoupled_weight_decay: bool,
}

impl AdamConfig {
    pub fn adam() -> Self {
        AdamConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, decoupled_weight_decay: false }
    }

    pub fn adamw() -> Self {
        AdamConfig { weight_decay: 1e-2, decoupled_weight_decay: true, ..Self::adam() }
    }

    /// The same checks torch.optim.Adam makes.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "adam_update", reason });
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
        Ok(())
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
