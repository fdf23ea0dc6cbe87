//! Optimizers with PyTorch's names and defaults. They run as GPU kernels over
//! the parameter arena; their state lives on the GPU.
//!
//! ```
//! use wgrad::optim::{Adam, SGD};
//! let sgd = SGD::new(0.01).momentum(0.9).weight_decay(1e-4);
//! let adam = Adam::new(1e-3);
//! ```

use crate::kernels::{AdamConfig, OptimizerConfig, SgdConfig};

/// torch.optim.SGD(lr, momentum=0, dampening=0, weight_decay=0, nesterov=False)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SGD(pub SgdConfig);

impl SGD {
    pub fn new(lr: f32) -> Self {
        SGD(SgdConfig { lr, ..SgdConfig::default() })
    }
    pub fn momentum(mut self, momentum: f32) -> Self {
        self.0.momentum = momentum;
        self
    }
    pub fn dampening(mut self, dampening: f32) -> Self {
        self.0.dampening = dampening;
        self
    }
    pub fn weight_decay(mut self, weight_decay: f32) -> Self {
        self.0.weight_decay = weight_decay;
        self
    }
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.0.nesterov = nesterov;
        self
    }
}

/// torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam(pub AdamConfig);

impl Adam {
    pub fn new(lr: f32) -> Self {
        Adam(AdamConfig { lr, ..AdamConfig::adam() })
    }
    pub fn betas(mut self, beta1: f32, beta2: f32) -> Self {
        self.0.betas = (beta1, beta2);
        self
    }
    pub fn eps(mut self, eps: f32) -> Self {
        self.0.eps = eps;
        self
    }
    pub fn weight_decay(mut self, weight_decay: f32) -> Self {
        self.0.weight_decay = weight_decay;
        self
    }
}

impl Default for Adam {
    fn default() -> Self {
        Adam(AdamConfig::adam())
    }
}

/// torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW(pub AdamConfig);

impl AdamW {
    pub fn new(lr: f32) -> Self {
        AdamW(AdamConfig { lr, ..AdamConfig::adamw() })
    }
    pub fn betas(mut self, beta1: f32, beta2: f32) -> Self {
        self.0.betas = (beta1, beta2);
        self
    }
    pub fn eps(mut self, eps: f32) -> Self {
        self.0.eps = eps;
        self
    }
    pub fn weight_decay(mut self, weight_decay: f32) -> Self {
        self.0.weight_decay = weight_decay;
        self
    }
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW(AdamConfig::adamw())
    }
}

impl From<SGD> for OptimizerConfig {
    fn from(o: SGD) -> Self {
        OptimizerConfig::Sgd(o.0)
    }
}
impl From<Adam> for OptimizerConfig {
    fn from(o: Adam) -> Self {
        OptimizerConfig::Adam(o.0)
    }
}
impl From<AdamW> for OptimizerConfig {
    fn from(o: AdamW) -> Self {
        OptimizerConfig::Adam(o.0)
    }
}

/// A short description for checkpoints and logs, e.g. `adam lr=0.001`.
pub fn describe(cfg: &OptimizerConfig) -> String {
    match cfg {
        OptimizerConfig::Sgd(c) => format!(
            "sgd lr={} momentum={} dampening={} weight_decay={} nesterov={}",
            c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov
        ),
        OptimizerConfig::Adam(c) => format!(
            "{} lr={} betas=({}, {}) eps={} weight_decay={}",
            if c.decoupled_weight_decay { "adamw" } else { "adam" },
            c.lr, c.betas.0, c.betas.1, c.eps, c.weight_decay
        ),
    }
}
