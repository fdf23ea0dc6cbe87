//! Optimizers with PyTorch's names and defaults. They run as GPU kernels over
//! the parameter arena; their state lives on the GPU.
//!
//! Every optimizer also takes a learning-rate schedule, global gradient-norm
//! clipping and nanoGPT's weight-decay groups, all applied on the GPU
//! inside the training step:
//!
//! ```
//! use wgrad::optim::{Adam, AdamW, LrSchedule, SGD};
//! let sgd = SGD::new(0.01).momentum(0.9).weight_decay(1e-4);
//! let adam = Adam::new(1e-3);
//! let gpt = AdamW::new(6e-4)
//!     .weight_decay(0.1)
//!     .decay_matrices_only() // no decay on biases and norm gains
//!     .clip_grad_norm(1.0)
//!     .schedule(LrSchedule::WarmupCosine { warmup_steps: 700, total_steps: 19_073, min_lr: 6e-5 });
//! ```

mod executor;
mod optimizer;

pub use crate::graph::ParamSpan;
use crate::kernels::{AdamConfig, OptimizerConfig, SgdConfig};
pub use crate::ops::{LossScaling, LrSchedule};
pub(crate) use optimizer::{apply_parameter_groups, stage_state};
pub use optimizer::{LossScaleState, Optimizer};

/// The builder methods every optimizer shares (the last three fields of
/// [`SgdConfig`] and [`AdamConfig`]).
macro_rules! shared_settings {
    () => {
        /// Learning-rate schedule (default [`LrSchedule::Constant`]).
        pub fn schedule(mut self, schedule: LrSchedule) -> Self {
            self.0.schedule = schedule;
            self
        }
        /// torch.nn.utils.clip_grad_norm_(max_norm) before every step.
        pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
            self.0.clip_grad_norm = Some(max_norm);
            self
        }
        /// Dynamic loss scaling for f16 training (torch.amp.GradScaler).
        pub fn loss_scaling(mut self, scaling: LossScaling) -> Self {
            self.0.loss_scaling = Some(scaling);
            self
        }
        /// Weight decay only on parameters of two or more dimensions.
        pub fn decay_matrices_only(mut self) -> Self {
            self.0.decay_matrices_only = true;
            self
        }
    };
}

/// torch.optim.SGD(lr, momentum=0, dampening=0, weight_decay=0, nesterov=False)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SGD(pub SgdConfig);

impl SGD {
    pub fn new(lr: f32) -> Self {
        SGD(SgdConfig {
            lr,
            ..SgdConfig::default()
        })
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
    shared_settings!();
}

/// The builder methods Adam and AdamW share beyond [`shared_settings`]
/// (both hold an [`AdamConfig`]; only their defaults differ).
macro_rules! adam_settings {
    () => {
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
        shared_settings!();
    };
}

/// torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam(pub AdamConfig);

impl Adam {
    pub fn new(lr: f32) -> Self {
        Adam(AdamConfig {
            lr,
            ..AdamConfig::adam()
        })
    }
    adam_settings!();
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
        AdamW(AdamConfig {
            lr,
            ..AdamConfig::adamw()
        })
    }
    adam_settings!();
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

/// A short description for checkpoints and logs, e.g. `adam lr=0.001`,
/// followed by the schedule, clipping and groups when set.
pub fn describe(cfg: &OptimizerConfig) -> String {
    let mut text = describe_update(cfg);
    if let LrSchedule::WarmupCosine {
        warmup_steps,
        total_steps,
        min_lr,
    } = cfg.schedule()
    {
        text += &format!(
            " schedule=warmup_cosine(warmup_steps={warmup_steps}, total_steps={total_steps}, min_lr={min_lr})"
        );
    }
    if let Some(max_norm) = cfg.clip_grad_norm() {
        text += &format!(" clip_grad_norm={max_norm}");
    }
    if cfg.decay_matrices_only() {
        text += " decay_matrices_only";
    }
    if let Some(l) = cfg.loss_scaling() {
        text += &format!(
            " loss_scaling(init={}, growth_interval={})",
            l.init_scale, l.growth_interval
        );
    }
    text
}

fn describe_update(cfg: &OptimizerConfig) -> String {
    match cfg {
        OptimizerConfig::Sgd(c) => format!(
            "sgd lr={} momentum={} dampening={} weight_decay={} nesterov={}",
            c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov
        ),
        OptimizerConfig::Adam(c) => format!(
            "{} lr={} betas=({}, {}) eps={} weight_decay={}",
            if c.decoupled_weight_decay { "adamw" } else { "adam" },
            c.lr,
            c.betas.0,
            c.betas.1,
            c.eps,
            c.weight_decay
        ),
    }
}
