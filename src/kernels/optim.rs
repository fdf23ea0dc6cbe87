//! `optim.wgsl`: SGD (momentum, Nesterov, weight decay), Adam and AdamW,
//! updating parameters and state in place with PyTorch's formulas; the
//! global gradient norm for clipping, reduced on the GPU.

use super::registry::entry_points;
use super::{bind, dim, flat_groups, Dispatch, Kernels, View, ARENA_GRANULE, FLAT_WORKGROUP};
use crate::error::{Error, Result};
use crate::ops::{AdamConfig, LossScaling, OptimizerConfig, SgdConfig};

entry_points! {
    Optim {
        SGD_UPDATE = "sgd_update",
        ADAM_UPDATE = "adam_update",
        ADAMW_UPDATE = "adamw_update",
        GRAD_NORM_PARTIALS = "grad_norm_partials",
        GRAD_NORM_FINISH = "grad_norm_finish",
        LOSS_SCALE_PARTIALS = "loss_scale_partials",
        LOSS_SCALE_FINISH = "loss_scale_finish",
    }
}

/// Most workgroups `grad_norm_partials` uses: enough to fill a large GPU;
/// `grad_norm_finish` (one workgroup) then sums at most this many partials.
const NORM_GROUPS_MAX: usize = 1024;

/// The scalars a step changes: the first bytes of a dispatch's parameter
/// block, so `set_optimizer_step` rewrites them and leaves [`Groups`].
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SgdStep {
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
struct AdamStep {
    n: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
}

/// The tail of an update's parameter block, fixed when it is built.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Groups {
    decay_end: u32,
    clip: u32,
    scaled: u32,
    _pad: u32,
}

/// A whole parameter block: step scalars first (see [`SgdStep`]).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SgdParams {
    step: SgdStep,
    groups: Groups,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AdamParams {
    step: AdamStep,
    groups: Groups,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ScaleParams {
    n: u32,
    chunk: u32,
    groups: u32,
    clip: u32,
    max_norm: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    beta1: f32,
    beta2: f32,
    _pad: [u32; 2],
}

/// The words of the loss-scale block `optim.wgsl`'s loss_scale kernels keep
/// (its `LS_*` constants): the first for the step's update, the rest kept
/// from step to step. [`LOSS_SCALE_WORDS`] long.
pub mod loss_scale_word {
    /// ‖grad / scale‖₂ of the last step.
    pub const NORM: usize = 0;
    /// 1 when the last step was skipped.
    pub const SKIP: usize = 2;
    /// The loss scale the next step seeds its loss gradient with.
    pub const SCALE: usize = 8;
    /// Clean steps since the scale last changed.
    pub const TRACKER: usize = 9;
    /// Optimizer steps taken (skipped ones not counted).
    pub const STEP: usize = 10;
    /// Steps skipped.
    pub const SKIPPED: usize = 11;
    /// Steps run, taken or skipped.
    pub const ITERATIONS: usize = 12;
    pub const BETA1_POW: usize = 13;
    pub const BETA2_POW: usize = 14;
    /// The first [`HISTORY_LEN`] skipped steps, numbered from 1 by
    /// [`ITERATIONS`].
    pub const HISTORY: usize = 16;
    pub const HISTORY_LEN: usize = 32;
}

/// Length of the loss-scale block in 4-byte words.
pub const LOSS_SCALE_WORDS: usize = loss_scale_word::HISTORY + loss_scale_word::HISTORY_LEN;

/// The block's starting words for `scaling`: the initial scale, beta
/// powers of 1 (t = 0), counters at 0.
pub fn loss_scale_block(scaling: &LossScaling) -> Vec<f32> {
    let mut block = vec![0.0; LOSS_SCALE_WORDS];
    block[loss_scale_word::SCALE] = scaling.init_scale;
    block[loss_scale_word::BETA1_POW] = 1.0;
    block[loss_scale_word::BETA2_POW] = 1.0;
    block
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct NormParams {
    n: u32,
    chunk: u32,
    groups: u32,
    max_norm: f32,
    first: u32,
    _pad: [u32; 3],
}

/// What an update over a whole parameter arena needs besides the
/// hyper-parameters: where the weight-decayed group ends and, when the
/// optimizer clips, the gradient norm computed by [`Kernels::grad_norm`].
#[derive(Clone, Copy, Debug)]
pub struct ArenaGroups<'a> {
    /// Elements `0..decay_len` get weight decay, the rest none.
    pub decay_len: usize,
    /// `[total norm, clip scale]` from [`Kernels::grad_norm`]; needed when
    /// the config's `clip_grad_norm` is set.
    pub grad_norm: Option<View<'a>>,
}

/// Workgroups (and partial sums) of `grad_norm_partials` for `n` gradients:
/// at most this many, [`grad_norm_chunk`] elements each.
pub fn grad_norm_groups(n: usize) -> usize {
    (n.div_ceil(FLAT_WORKGROUP as usize)).clamp(1, NORM_GROUPS_MAX)
}

/// Elements per partial sum of the gradient norm: a whole number of
/// [`ARENA_GRANULE`]s, so a gradient over the binding limit splits at
/// chunk boundaries into aligned parts, and the split sums equal the
/// unsplit ones bit for bit.
fn grad_norm_chunk(n: usize) -> usize {
    n.div_ceil(grad_norm_groups(n)).div_ceil(ARENA_GRANULE) * ARENA_GRANULE
}

fn check_step(op: &'static str, step: u64) -> Result<()> {
    if step == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "steps are counted from 1".into(),
        });
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

fn sgd_step(op: &'static str, n: usize, cfg: &SgdConfig, step: u64) -> Result<SgdStep> {
    cfg.validate()?;
    check_step(op, step)?;
    Ok(SgdStep {
        n: dim(op, n)?,
        lr: cfg.schedule.lr_at(cfg.lr, step),
        momentum: cfg.momentum,
        dampening: cfg.dampening,
        weight_decay: cfg.weight_decay,
        nesterov: u32::from(cfg.nesterov),
        first_step: u32::from(step == 1),
        _pad: 0,
    })
}

fn adam_step(op: &'static str, n: usize, cfg: &AdamConfig, step: u64) -> Result<AdamStep> {
    cfg.validate()?;
    check_step(op, step)?;
    // Bias corrections in f64 on the host, as PyTorch computes them in Python floats.
    let t = step.min(i32::MAX as u64) as i32;
    let bias_correction1 = 1.0 - f64::from(cfg.betas.0).powi(t);
    let bias_correction2 = 1.0 - f64::from(cfg.betas.1).powi(t);
    let lr = cfg.schedule.lr_at(cfg.lr, step);
    Ok(AdamStep {
        n: dim(op, n)?,
        lr,
        beta1: cfg.betas.0,
        beta2: cfg.betas.1,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
        step_size: (f64::from(lr) / bias_correction1) as f32,
        bias_correction2_sqrt: bias_correction2.sqrt() as f32,
    })
}

/// The fixed tail of an update over `n` elements: checks the decay
/// boundary and that a clipping config has its norm.
fn groups(op: &'static str, n: usize, clip: Option<f32>, scaled: bool, arena: &ArenaGroups<'_>) -> Result<Groups> {
    if arena.decay_len > n {
        return Err(Error::shape(
            op,
            format!("decay_len {} exceeds the {n} parameters", arena.decay_len),
            &[&[arena.decay_len], &[n]],
        ));
    }
    if scaled && arena.grad_norm.is_none_or(|v| v.len < LOSS_SCALE_WORDS) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("loss scaling needs the loss-scale block ({LOSS_SCALE_WORDS} words) of Kernels::loss_scale as grad_norm"),
        });
    }
    if let (Some(_), None) = (clip, arena.grad_norm) {
        return Err(Error::InvalidArgument {
            op,
            reason:
                "clip_grad_norm needs the norm of all gradients: build the update with Kernels::optimizer_update and \
                     a grad_norm buffer (as the executor does)"
                    .into(),
        });
    }
    if let Some(v) = arena.grad_norm.filter(|v| v.len < 2) {
        return Err(Error::shape(
            op,
            "grad_norm holds [norm, scale]: 2 elements",
            &[&[v.len]],
        ));
    }
    Ok(Groups {
        decay_end: dim(op, arena.decay_len)?,
        clip: u32::from(clip.is_some()),
        scaled: u32::from(scaled),
        _pad: 0,
    })
}

impl Kernels {
    /// One SGD step (step counts from 1) on `param` in place; `momentum_buf`
    /// is the optimizer state (unused without momentum, but still bound).
    /// Weight decay applies to every element; clipping is refused here (it
    /// needs [`Kernels::optimizer_update`]).
    pub fn sgd_update(
        &self,
        param: View<'_>,
        grad: View<'_>,
        momentum_buf: View<'_>,
        cfg: &SgdConfig,
        step: u64,
    ) -> Result<Dispatch> {
        let all = ArenaGroups {
            decay_len: param.len,
            grad_norm: None,
        };
        self.optimizer_update(&OptimizerConfig::Sgd(*cfg), param, grad, &[momentum_buf], all, step)
    }

    /// One Adam or AdamW step (by `cfg.decoupled_weight_decay`), weight
    /// decay on every element, no clipping (see [`Kernels::sgd_update`]).
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
        let all = ArenaGroups {
            decay_len: param.len,
            grad_norm: None,
        };
        self.optimizer_update(
            &OptimizerConfig::Adam(*cfg),
            param,
            grad,
            &[exp_avg, exp_avg_sq],
            all,
            step,
        )
    }

    /// One step of `optimizer` over a parameter arena: `state` holds its
    /// arenas in `state_names()` order; weight decay applies below
    /// `arena.decay_len`; with `clip_grad_norm` set the gradients are scaled
    /// by the factor in `arena.grad_norm` (written earlier in the same
    /// submission by [`Kernels::grad_norm`]). With `loss_scaling` set,
    /// `arena.grad_norm` is the block of [`Kernels::loss_scale`] instead:
    /// the update unscales (and clips) by its factor, and does nothing on
    /// a step it marks skipped. The groups and clipping are
    /// fixed here; [`Kernels::set_optimizer_step`] changes only the step.
    pub fn optimizer_update(
        &self,
        optimizer: &OptimizerConfig,
        param: View<'_>,
        grad: View<'_>,
        state: &[View<'_>],
        arena: ArenaGroups<'_>,
        step: u64,
    ) -> Result<Dispatch> {
        let kernel = match optimizer {
            OptimizerConfig::Sgd(_) => SGD_UPDATE,
            OptimizerConfig::Adam(c) if c.decoupled_weight_decay => ADAMW_UPDATE,
            OptimizerConfig::Adam(_) => ADAM_UPDATE,
        };
        let op = kernel.entry;
        let names = optimizer.state_names();
        if state.len() != names.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("takes {} state arenas ({names:?}), got {}", names.len(), state.len()),
            });
        }
        let mut others: Vec<(&str, &View<'_>)> = vec![("grad", &grad)];
        others.extend(names.iter().copied().zip(state));
        check_state(op, &param, &others)?;
        let all = groups(
            op,
            param.len,
            optimizer.clip_grad_norm(),
            optimizer.loss_scaling().is_some(),
            &arena,
        )?;
        // Bound even when not clipping: the shader's layout has the slot.
        let norm = arena.grad_norm.unwrap_or(View {
            buffer: self.placeholder(),
            offset: 0,
            len: 2,
        });
        // An arena over the binding limit: one launch per aligned part,
        // each with its part of every arena and of the decayed group.
        let mut launches = Vec::new();
        for (start, len) in self.arena_parts(op, param.len, ARENA_GRANULE)? {
            let groups = Groups {
                decay_end: dim(op, arena.decay_len.clamp(start, start + len) - start)?,
                ..all
            };
            let mut bindings = vec![
                bind(0, "param", param.slice(start, len)?),
                bind(1, "grad", grad.slice(start, len)?),
                bind(6, "grad_norm", norm),
            ];
            launches.push(match optimizer {
                OptimizerConfig::Sgd(cfg) => {
                    bindings.push(bind(2, "momentum_buf", state[0].slice(start, len)?));
                    let params = SgdParams {
                        step: sgd_step(op, len, cfg, step)?,
                        groups,
                    };
                    self.prepare(kernel, &[], &bindings, 3, &params, flat_groups(len))?
                }
                OptimizerConfig::Adam(cfg) => {
                    bindings.extend([
                        bind(2, "exp_avg", state[0].slice(start, len)?),
                        bind(4, "exp_avg_sq", state[1].slice(start, len)?),
                    ]);
                    let params = AdamParams {
                        step: adam_step(op, len, cfg, step)?,
                        groups,
                    };
                    self.prepare(kernel, &[], &bindings, 5, &params, flat_groups(len))?
                }
            });
        }
        Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "an empty arena", &[&[param.len]]))
    }

    /// The L2 norm of all of `grad` and clip_grad_norm_'s factor
    /// `min(1, max_norm / (norm + 1e-6))`, written to `norm_out` = [norm,
    /// factor] by two dispatches (per-chunk sums of squares into `partials`,
    /// [`grad_norm_groups`] long, then their sum) in a fixed order, so the
    /// result is deterministic. Run them before the update that reads it.
    pub fn grad_norm(
        &self,
        norm_out: View<'_>,
        partials: View<'_>,
        grad: View<'_>,
        max_norm: f32,
    ) -> Result<[Dispatch; 2]> {
        let op = GRAD_NORM_PARTIALS.entry;
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("invalid max_norm {max_norm}"),
            });
        }
        if partials.len != grad_norm_groups(grad.len) || norm_out.len != 2 {
            return Err(Error::shape(
                op,
                format!(
                    "{} gradients need {} partials and a norm_out of 2",
                    grad.len,
                    grad_norm_groups(grad.len)
                ),
                &[&[grad.len], &[partials.len], &[norm_out.len]],
            ));
        }
        // Whole chunks of at most `partials.len` cover the gradients.
        let chunk = grad_norm_chunk(grad.len);
        let groups = grad.len.div_ceil(chunk);
        let params = |n: usize, first: usize| -> Result<NormParams> {
            Ok(NormParams {
                n: dim(op, n)?,
                chunk: dim(op, chunk)?,
                groups: dim(op, groups)?,
                max_norm,
                first: dim(op, first)?,
                _pad: [0; 3],
            })
        };
        // A gradient over the binding limit: one launch per part of whole
        // chunks, writing its own partials; the same sums in the same order.
        let mut launches = Vec::new();
        for (start, len) in self.arena_parts(op, grad.len, chunk)? {
            let part = [bind(1, "grad", grad.slice(start, len)?), bind(7, "partials", partials)];
            launches.push(self.prepare(
                GRAD_NORM_PARTIALS,
                &[],
                &part,
                8,
                &params(len, start / chunk)?,
                len.div_ceil(chunk) as u64,
            )?);
        }
        let sums = Dispatch::chain(launches).ok_or_else(|| Error::shape(op, "no gradients", &[&[grad.len]]))?;
        let finish = self.prepare(
            GRAD_NORM_FINISH,
            &[],
            &[bind(7, "partials", partials), bind(9, "norm_out", norm_out)],
            8,
            &params(grad.len, 0)?,
            1,
        )?;
        Ok([sums, finish])
    }

    /// GradScaler's unscale, inf/NaN check and scale update over `grad`,
    /// scaled by the `block`'s scale (see [`loss_scale_word`]; start it
    /// from [`loss_scale_block`]), in two dispatches (per-chunk sums into
    /// `partials`, 2·[`grad_norm_groups`] long, then one workgroup): the
    /// block then holds what the update of `optimizer` (which must have
    /// `loss_scaling`) reads, with clipping by the unscaled norm when it
    /// clips. Run them after the backward and before that update.
    pub fn loss_scale(
        &self,
        block: View<'_>,
        partials: View<'_>,
        grad: View<'_>,
        optimizer: &OptimizerConfig,
    ) -> Result<[Dispatch; 2]> {
        let op = LOSS_SCALE_PARTIALS.entry;
        let Some(scaling) = optimizer.loss_scaling() else {
            return Err(Error::InvalidArgument {
                op,
                reason: "the optimizer has no loss_scaling".into(),
            });
        };
        scaling.validate()?;
        let groups = grad_norm_groups(grad.len);
        if partials.len != 2 * groups || block.len != LOSS_SCALE_WORDS {
            return Err(Error::shape(
                op,
                format!(
                    "{} gradients need {} partials and a block of {LOSS_SCALE_WORDS}",
                    grad.len,
                    2 * groups
                ),
                &[&[grad.len], &[partials.len], &[block.len]],
            ));
        }
        let (beta1, beta2) = optimizer.bias_correction_betas();
        let params = ScaleParams {
            n: dim(op, grad.len)?,
            chunk: dim(op, grad.len.div_ceil(groups))?,
            groups: dim(op, groups)?,
            clip: u32::from(optimizer.clip_grad_norm().is_some()),
            max_norm: optimizer.clip_grad_norm().unwrap_or(f32::INFINITY),
            growth_factor: scaling.growth_factor,
            backoff_factor: scaling.backoff_factor,
            growth_interval: scaling.growth_interval,
            beta1,
            beta2,
            _pad: [0; 2],
        };
        let sums = self.prepare(
            LOSS_SCALE_PARTIALS,
            &[],
            &[
                bind(1, "grad", grad),
                bind(6, "block", block),
                bind(7, "partials", partials),
            ],
            10,
            &params,
            groups as u64,
        )?;
        let finish = self.prepare(
            LOSS_SCALE_FINISH,
            &[],
            &[bind(7, "partials", partials), bind(9, "block", block)],
            10,
            &params,
            1,
        )?;
        Ok([sums, finish])
    }

    /// Points a prepared update at another step number (its learning rate
    /// from the schedule, its bias corrections), so one dispatch serves
    /// every step of a training run. Only the step's scalars are rewritten:
    /// the decay group and clipping stay as built.
    pub fn set_optimizer_step(
        &self,
        dispatch: &Dispatch,
        n: usize,
        optimizer: &OptimizerConfig,
        step: u64,
    ) -> Result<()> {
        let kernel = dispatch.kernel();
        for launch in dispatch.each_launch() {
            // A split update's launch covers its part: what it binds as `param`.
            let n = if dispatch.launches() == 1 {
                n
            } else {
                launch
                    .recipe()
                    .bindings
                    .iter()
                    .find(|b| b.name == "param")
                    .map_or(n, |b| (b.bytes / 4) as usize)
            };
            // The step scalars are the block's first bytes (`SgdParams`, `AdamParams`).
            match optimizer {
                OptimizerConfig::Sgd(cfg) if kernel == SGD_UPDATE => {
                    self.rewrite_params(launch, &sgd_step(kernel.entry, n, cfg, step)?)
                }
                OptimizerConfig::Adam(cfg) if kernel == ADAM_UPDATE || kernel == ADAMW_UPDATE => {
                    self.rewrite_params(launch, &adam_step(kernel.entry, n, cfg, step)?)
                }
                _ => {
                    return Err(Error::InvalidArgument {
                        op: "set_optimizer_step",
                        reason: format!("{optimizer:?} does not match the dispatch of `{}`", kernel.entry),
                    })
                }
            }
        }
        Ok(())
    }
}
