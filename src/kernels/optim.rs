//! `optim.wgsl`: SGD (momentum, Nesterov, weight decay), Adam and AdamW,
//! updating parameters and state in place with PyTorch's formulas.

use super::registry::*;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View};
use crate::error::{Error, Result};
use crate::ops::{AdamConfig, OptimizerConfig, SgdConfig};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SgdParams {
    n: u32,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: u32,
    first_step: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AdamParams {
    n: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
}

fn check_step(op: &'static str, step: u64) -> Result<()> {
    if step == 0 {
        return Err(Error::InvalidArgument { op, reason: "steps are counted from 1".into() });
    }
    Ok(())
}

fn check_state(op: &'static str, param: &View<'_>, others: &[(&str, &View<'_>)]) -> Result<()> {
    if others.iter().any(|(_, v)| v.len != param.len) {
        let mut shapes = vec![vec![param.len]];
        shapes.extend(others.iter().map(|(_, v)| vec![v.len]));
        let names: Vec<&str> = others.iter().map(|(n, _)| *n).collect();
        return Err(Error::Shape {
            op,
            reason: format!("param, {} must have equal length", names.join(", ")),
            shapes,
        });
    }
    Ok(())
}

fn sgd_params(op: &'static str, n: usize, cfg: &SgdConfig, step: u64) -> Result<SgdParams> {
    cfg.validate()?;
    check_step(op, step)?;
    Ok(SgdParams {
        n: dim(op, n)?,
        lr: cfg.lr,
        momentum: cfg.momentum,
        dampening: cfg.dampening,
        weight_decay: cfg.weight_decay,
        nesterov: u32::from(cfg.nesterov),
        first_step: u32::from(step == 1),
        _pad: 0,
    })
}

fn adam_params(op: &'static str, n: usize, cfg: &AdamConfig, step: u64) -> Result<AdamParams> {
    cfg.validate()?;
    check_step(op, step)?;
    // Bias corrections in f64 on the host, as PyTorch computes them in Python floats.
    let t = step.min(i32::MAX as u64) as i32;
    let bias_correction1 = 1.0 - f64::from(cfg.betas.0).powi(t);
    let bias_correction2 = 1.0 - f64::from(cfg.betas.1).powi(t);
    Ok(AdamParams {
        n: dim(op, n)?,
        lr: cfg.lr,
        beta1: cfg.betas.0,
        beta2: cfg.betas.1,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
        step_size: (f64::from(cfg.lr) / bias_correction1) as f32,
        bias_correction2_sqrt: bias_correction2.sqrt() as f32,
    })
}

impl Kernels {
    /// One SGD step (step counts from 1) on `param` in place; `momentum_buf`
    /// is the optimizer state (unused without momentum, but still bound).
    pub fn sgd_update(
        &self,
        param: View<'_>,
        grad: View<'_>,
        momentum_buf: View<'_>,
        cfg: &SgdConfig,
        step: u64,
    ) -> Result<Dispatch> {
        let op = SGD_UPDATE.entry;
        check_state(op, &param, &[("grad", &grad), ("momentum_buf", &momentum_buf)])?;
        let params = sgd_params(op, param.len, cfg, step)?;
        self.prepare(
            SGD_UPDATE,
            &[],
            &[bind(0, "param", param), bind(1, "grad", grad), bind(2, "momentum_buf", momentum_buf)],
            3,
            &params,
            flat_groups(param.len),
        )
    }

    /// One Adam or AdamW step (by `cfg.decoupled_weight_decay`).
    #[allow(clippy::too_many_arguments)]
    pub fn adam_update(
        &self,
        param: View<'_>,
        grad: View<'_>,
        exp_avg: View<'_>,
        exp_avg_sq: View<'_>,
        cfg: &AdamConfig,
        step: u64,
    ) -> Result<Dispatch> {
        let kernel = if cfg.decoupled_weight_decay { ADAMW_UPDATE } else { ADAM_UPDATE };
        let op = kernel.entry;
        check_state(op, &param, &[("grad", &grad), ("exp_avg", &exp_avg), ("exp_avg_sq", &exp_avg_sq)])?;
        let params = adam_params(op, param.len, cfg, step)?;
        self.prepare(
            kernel,
            &[],
            &[
                bind(0, "param", param),
                bind(1, "grad", grad),
                bind(2, "exp_avg", exp_avg),
                bind(4, "exp_avg_sq", exp_avg_sq),
            ],
            5,
            &params,
            flat_groups(param.len),
        )
    }

    /// Points a prepared update at another step number, so one dispatch
    /// serves every step of a training run.
    pub fn set_optimizer_step(&self, dispatch: &Dispatch, n: usize, optimizer: &OptimizerConfig, step: u64) -> Result<()> {
        let kernel = dispatch.kernel();
        match optimizer {
            OptimizerConfig::Sgd(cfg) if kernel == SGD_UPDATE => {
                self.rewrite_params(dispatch, &sgd_params(kernel.entry, n, cfg, step)?)
            }
            OptimizerConfig::Adam(cfg) if kernel == ADAM_UPDATE || kernel == ADAMW_UPDATE => {
                self.rewrite_params(dispatch, &adam_params(kernel.entry, n, cfg, step)?)
            }
            _ => {
                return Err(Error::InvalidArgument {
                    op: "set_optimizer_step",
                    reason: format!("{optimizer:?} does not match the dispatch of `{}`", kernel.entry),
                })
            }
        }
        Ok(())
    }
}
