//! An optimizer running over an executor's arenas: its state (one arena per
//! state name, in the parameters' layout), the gradient-norm clipping, the
//! update dispatch, the schedule's position (the step counter), and the
//! export and import of its state by parameter. An executor holds one as
//! its step update (`super::executor`) and records its dispatches into a
//! training step; it knows no state names.

use crate::error::{Error, Result};
use crate::graph::{Graph, ParamSpan};
use crate::kernels::{
    grad_norm_groups, loss_scale_block, loss_scale_word, ArenaGroups, Dispatch, GpuTensor, Kernels, OptimizerConfig,
    View, LOSS_SCALE_WORDS,
};
use crate::ops::LossScaling;

/// nanoGPT's groups: with `decay_matrices_only`, parameters of fewer than
/// 2 dimensions (biases, norm gains), and those their module put in the
/// no-decay group (embeddings), get no weight decay. Run before planning,
/// which lays the groups out.
pub(crate) fn apply_parameter_groups(graph: &mut Graph, cfg: &OptimizerConfig) -> Result<()> {
    if cfg.decay_matrices_only() {
        for p in graph.parameters() {
            let matrix = graph.shape_of(p).is_some_and(|s| s.len() >= 2);
            if !matrix || graph.in_no_decay_group(p) {
                graph.exclude_from_weight_decay(p)?;
            }
        }
    }
    Ok(())
}

/// Buffers and dispatches of the gradient-norm reduction.
struct ClipNorm {
    /// Per-workgroup sums of squares (kept alive for the dispatches).
    _partials: GpuTensor,
    /// [total norm, clip factor], read by the update.
    norm: GpuTensor,
    dispatches: [Dispatch; 2],
}

/// Buffers and dispatches of dynamic loss scaling (which also clips, by
/// the unscaled norm, when the optimizer clips).
struct LossScaler {
    /// Per-chunk (Σ (grad / scale)², non-finite count) pairs.
    partials: GpuTensor,
    /// The loss-scale block (`kernels::loss_scale_word`).
    block: GpuTensor,
    dispatches: [Dispatch; 2],
}

/// Dynamic loss scaling's state, as read back from the GPU.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossScaleState {
    /// The scale the next step seeds its loss gradient with.
    pub scale: f32,
    /// Clean steps since the scale last changed.
    pub growth_tracker: u64,
    /// Optimizer steps taken (skipped steps not counted).
    pub steps_taken: u64,
    /// Steps run, taken or skipped.
    pub steps_run: u64,
    /// How many steps were skipped, and the first of them (numbered from 1
    /// by `steps_run`; at most `kernels::loss_scale_word::HISTORY_LEN`).
    pub skipped: u64,
    pub skipped_steps: Vec<u64>,
}

/// Checkpoint metadata keys of [`LossScaleState::metadata`].
pub mod meta {
    pub const SCALE: &str = "loss_scale";
    pub const GROWTH_TRACKER: &str = "loss_scale_growth_tracker";
    pub const STEPS_TAKEN: &str = "loss_scale_steps_taken";
    pub const STEPS_RUN: &str = "loss_scale_steps_run";
    pub const SKIPPED: &str = "loss_scale_skipped";
    pub const SKIPPED_STEPS: &str = "loss_scale_skipped_steps";
}

impl LossScaleState {
    /// The state in the block's words (`kernels::loss_scale_word`).
    pub fn from_block(block: &[f32]) -> LossScaleState {
        use loss_scale_word as w;
        let at = |i: usize| block.get(i).copied().unwrap_or(0.0);
        let skipped = at(w::SKIPPED) as u64;
        LossScaleState {
            scale: at(w::SCALE),
            growth_tracker: at(w::TRACKER) as u64,
            steps_taken: at(w::STEP) as u64,
            steps_run: at(w::ITERATIONS) as u64,
            skipped,
            skipped_steps: (0..(skipped as usize).min(w::HISTORY_LEN))
                .map(|k| at(w::HISTORY + k) as u64)
                .collect(),
        }
    }

    /// The checkpoint metadata that carries the state (a run resumed from
    /// it scales, counts and bias-corrects as if it had not stopped).
    pub fn metadata(&self) -> Vec<(&'static str, String)> {
        let skipped_steps: Vec<String> = self.skipped_steps.iter().map(u64::to_string).collect();
        vec![
            (meta::SCALE, self.scale.to_string()),
            (meta::GROWTH_TRACKER, self.growth_tracker.to_string()),
            (meta::STEPS_TAKEN, self.steps_taken.to_string()),
            (meta::STEPS_RUN, self.steps_run.to_string()),
            (meta::SKIPPED, self.skipped.to_string()),
            (meta::SKIPPED_STEPS, skipped_steps.join(",")),
        ]
    }

    /// The state [`LossScaleState::metadata`] wrote, read through `get`;
    /// `None` where the checkpoint has none (an f32 run's). Values that
    /// are not numbers, a scale that is not a positive finite number, or
    /// counts that disagree are an error naming the key.
    pub fn from_metadata<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<Option<LossScaleState>> {
        let Some(scale) = get(meta::SCALE) else { return Ok(None) };
        let bad = |key: &str, why: String| Error::InvalidArgument {
            op: "load loss scale",
            reason: format!("checkpoint metadata `{key}`: {why}"),
        };
        let count = |key: &str| -> Result<u64> {
            let text = get(key).ok_or_else(|| bad(key, "missing beside `loss_scale`".into()))?;
            text.parse::<u64>()
                .map_err(|_| bad(key, format!("`{text}` is not a count")))
        };
        let scale = scale
            .parse::<f32>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .ok_or_else(|| bad(meta::SCALE, format!("`{scale}` is not a positive finite scale")))?;
        let (steps_taken, steps_run, skipped) = (
            count(meta::STEPS_TAKEN)?,
            count(meta::STEPS_RUN)?,
            count(meta::SKIPPED)?,
        );
        if steps_taken.checked_add(skipped) != Some(steps_run) {
            return Err(bad(
                meta::STEPS_RUN,
                format!("{steps_run} steps run, but {steps_taken} taken and {skipped} skipped"),
            ));
        }
        let list = get(meta::SKIPPED_STEPS).unwrap_or_default();
        let skipped_steps = list
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u64>()
                    .map_err(|_| bad(meta::SKIPPED_STEPS, format!("`{s}` is not a step")))
            })
            .collect::<Result<Vec<u64>>>()?;
        if skipped_steps.len() > (skipped as usize).min(loss_scale_word::HISTORY_LEN)
            || skipped_steps.iter().any(|&s| s == 0 || s > steps_run)
        {
            return Err(bad(
                meta::SKIPPED_STEPS,
                format!("`{list}` does not fit {skipped} skipped of {steps_run} steps"),
            ));
        }
        Ok(Some(LossScaleState {
            scale,
            growth_tracker: count(meta::GROWTH_TRACKER)?,
            steps_taken,
            steps_run,
            skipped,
            skipped_steps,
        }))
    }

    /// The loss-scale block holding this state, for an optimizer scaling
    /// by `scaling` with Adam's `betas` ((0, 0) for SGD): the bias
    /// corrections' powers are the products the GPU would have formed,
    /// one f32 multiplication per step taken, so a resumed run's bits
    /// equal an unbroken run's.
    fn block(&self, scaling: &LossScaling, (beta1, beta2): (f32, f32)) -> Vec<f32> {
        use loss_scale_word as w;
        let mut block = loss_scale_block(scaling);
        let power = |beta: f32| (0..self.steps_taken).fold(1.0f32, |p, _| p * beta);
        block[w::SCALE] = self.scale;
        block[w::TRACKER] = self.growth_tracker as f32;
        block[w::STEP] = self.steps_taken as f32;
        block[w::SKIPPED] = self.skipped as f32;
        block[w::ITERATIONS] = self.steps_run as f32;
        block[w::BETA1_POW] = power(beta1);
        block[w::BETA2_POW] = power(beta2);
        for (k, &step) in self.skipped_steps.iter().take(w::HISTORY_LEN).enumerate() {
            block[w::HISTORY + k] = step as f32;
        }
        block
    }

    /// `loss scale: final 32768, 3 steps skipped (steps 1, 2, 5)`.
    pub fn summary(&self) -> String {
        let mut text = format!(
            "loss scale: final {}, {} step{} skipped",
            self.scale,
            self.skipped,
            if self.skipped == 1 { "" } else { "s" }
        );
        if !self.skipped_steps.is_empty() {
            let steps: Vec<String> = self.skipped_steps.iter().map(u64::to_string).collect();
            let more = if (self.skipped as usize) > steps.len() {
                ", …"
            } else {
                ""
            };
            text += &format!(
                " (step{} {}{more})",
                if steps.len() == 1 { "" } else { "s" },
                steps.join(", ")
            );
        }
        text
    }
}

pub struct Optimizer {
    config: OptimizerConfig,
    state: Vec<GpuTensor>,
    clip: Option<ClipNorm>,
    scaler: Option<LossScaler>,
    update: Dispatch,
    /// Elements the update covers (the parameter arena's length).
    arena_len: usize,
    /// Optimizer steps taken (PyTorch's `step`, from 1).
    step: u64,
    /// Loss scaling's state as read back with the last loss a training
    /// step read (or as last loaded).
    last_loss_scale: Option<LossScaleState>,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("config", &self.config)
            .field("step", &self.step)
            .finish()
    }
}

impl Optimizer {
    /// State arenas, clipping buffers and the update over the `params` and
    /// `grads` arenas of `arena_len` elements, whose first `decay_len`
    /// elements are the weight-decayed group. Alignment gaps hold zeros
    /// that every optimizer keeps at zero, so one update covers the arena.
    pub(crate) fn new(
        kernels: &Kernels,
        config: OptimizerConfig,
        params: View<'_>,
        grads: View<'_>,
        arena_len: usize,
        decay_len: usize,
    ) -> Result<Self> {
        config.validate()?;
        let state = (0..config.state_names().len())
            .map(|_| kernels.zeros(arena_len))
            .collect::<Result<Vec<_>>>()?;
        // Loss scaling clips too (by the unscaled norm), in its own kernels.
        let scaler = match config.loss_scaling() {
            Some(scaling) => {
                let (partials, block) = (
                    kernels.zeros(2 * grad_norm_groups(arena_len))?,
                    kernels.upload(&loss_scale_block(&scaling))?,
                );
                let dispatches = kernels.loss_scale(block.view(), partials.view(), grads, &config)?;
                Some(LossScaler {
                    partials,
                    block,
                    dispatches,
                })
            }
            None => None,
        };
        let clip = match config.clip_grad_norm().filter(|_| scaler.is_none()) {
            Some(max_norm) => {
                let (partials, norm) = (kernels.zeros(grad_norm_groups(arena_len))?, kernels.zeros(2)?);
                let dispatches = kernels.grad_norm(norm.view(), partials.view(), grads, max_norm)?;
                Some(ClipNorm {
                    _partials: partials,
                    norm,
                    dispatches,
                })
            }
            None => None,
        };
        let state_views: Vec<View<'_>> = state.iter().map(|s| s.view()).collect();
        let grad_norm = scaler
            .as_ref()
            .map(|s| s.block.view())
            .or(clip.as_ref().map(|c| c.norm.view()));
        let arena = ArenaGroups { decay_len, grad_norm };
        let update = kernels.optimizer_update(&config, params, grads, &state_views, arena, 1)?;
        Ok(Optimizer {
            config,
            state,
            clip,
            scaler,
            update,
            arena_len,
            step: 0,
            last_loss_scale: None,
        })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The learning rate the last step used (before any step, the first
    /// step's): the schedule at [`Optimizer::step_count`].
    pub fn learning_rate(&self) -> f32 {
        self.config.lr_at(self.step.max(1))
    }

    /// PyTorch's names for the per-parameter state, in arena order.
    pub fn state_names(&self) -> &'static [&'static str] {
        self.config.state_names()
    }

    /// The state arenas (the parameters' layout), one per state name.
    pub fn state_arenas(&self) -> Vec<View<'_>> {
        self.state.iter().map(|s| s.view()).collect()
    }

    /// The dispatches of one step in order: the gradient norm (when
    /// clipping), then the update.
    pub(crate) fn dispatches(&self) -> impl Iterator<Item = &Dispatch> {
        let scaling = self.scaler.iter().flat_map(|s| s.dispatches.iter());
        self.clip
            .iter()
            .flat_map(|c| c.dispatches.iter())
            .chain(scaling)
            .chain(std::iter::once(&self.update))
    }

    /// Where the loss scale is (one f32) while scaling: what seeds the
    /// loss gradient of the next step, copied there inside the step.
    pub(crate) fn loss_scale_view(&self) -> Option<View<'_>> {
        self.scaler
            .as_ref()
            .and_then(|s| s.block.slice(loss_scale_word::SCALE, 1).ok())
    }

    /// The loss-scale block's words from the scale on (what a step copies
    /// out with its loss), while scaling.
    pub(crate) fn loss_scale_state_view(&self) -> Option<View<'_>> {
        let start = loss_scale_word::SCALE;
        self.scaler
            .as_ref()
            .and_then(|s| s.block.slice(start, LOSS_SCALE_WORDS - start).ok())
    }

    /// Loss scaling's state as read back with the last loss a training
    /// step read, or as last loaded; `None` before either, or without
    /// loss scaling.
    pub fn last_loss_scale(&self) -> Option<&LossScaleState> {
        self.last_loss_scale.as_ref()
    }

    pub(crate) fn set_last_loss_scale(&mut self, state: LossScaleState) {
        self.last_loss_scale = Some(state);
    }

    /// Dynamic loss scaling's state now (waits for the GPU); `None`
    /// without loss scaling.
    pub fn read_loss_scale(&self, kernels: &Kernels) -> Result<Option<LossScaleState>> {
        match &self.scaler {
            Some(s) => Ok(Some(LossScaleState::from_block(&kernels.read::<f32>(s.block.view())?))),
            None => Ok(None),
        }
    }

    /// Writes the next step's scalars (its learning rate, bias
    /// corrections) before a submission that runs [`Optimizer::dispatches`].
    pub(crate) fn prepare_step(&self, kernels: &Kernels) -> Result<()> {
        kernels.set_optimizer_step(&self.update, self.arena_len, &self.config, self.step + 1)
    }

    /// Counts a step once its submission is made.
    pub(crate) fn finish_step(&mut self) {
        self.step += 1;
    }

    /// One step over the gradients as they stand, in one submission: the
    /// norm (when clipping, over this optimizer's arena) and the update.
    pub(crate) fn step(&mut self, kernels: &Kernels) -> Result<()> {
        self.prepare_step(kernels)?;
        kernels.submit_pass("optimizer_step", self.dispatches(), |_| {}, |_| {})?;
        self.finish_step();
        Ok(())
    }

    /// The global L2 norm of the gradients the last step clipped (before
    /// clipping: torch.nn.utils.clip_grad_norm_'s return value); waits for
    /// the GPU. `None` when not clipping or before the first step.
    pub fn read_grad_norm(&self, kernels: &Kernels) -> Result<Option<f32>> {
        let norm = self
            .scaler
            .as_ref()
            .map(|s| &s.block)
            .or(self.clip.as_ref().map(|c| &c.norm));
        match norm {
            Some(n) if self.step > 0 && self.config.clip_grad_norm().is_some() => {
                Ok(kernels.read::<f32>(n.slice(0, 1)?)?.first().copied())
            }
            _ => Ok(None),
        }
    }

    /// The squared L2 norm of the gradients as they stand: the clipping
    /// norm's kernels run alone and the norm is read back (waits).
    pub(crate) fn grad_norm_squared(&self, kernels: &Kernels) -> Result<f64> {
        self.not_loss_scaled("grad_norm_squared")?;
        let c = self.clip.as_ref().ok_or_else(|| Error::InvalidArgument {
            op: "grad_norm_squared",
            reason: "the optimizer does not clip (clip_grad_norm), so no norm kernels were built".into(),
        })?;
        kernels.submit_pass("grad_norm", c.dispatches.iter(), |_| {}, |_| {})?;
        let norm = kernels.read::<f32>(c.norm.slice(0, 1)?)?;
        Ok(norm.first().map_or(f64::NAN, |&n| f64::from(n) * f64::from(n)))
    }

    /// One step with clip_grad_norm_'s factor computed from `total_norm`,
    /// a whole model's norm gathered from several executors, instead of
    /// this arena's own: only the update runs.
    pub(crate) fn step_with_grad_norm(&mut self, kernels: &Kernels, total_norm: f32) -> Result<()> {
        self.not_loss_scaled("optimizer_step_with_grad_norm")?;
        let Some(c) = &self.clip else {
            return Err(Error::InvalidArgument {
                op: "optimizer_step_with_grad_norm",
                reason: "needs an optimizer with clip_grad_norm".into(),
            });
        };
        let max_norm = self.config.clip_grad_norm().unwrap_or(f32::INFINITY);
        if !total_norm.is_finite() || total_norm < 0.0 {
            return Err(Error::NonFiniteLoss {
                value: total_norm,
                step: self.step + 1,
            });
        }
        // The same f32 arithmetic as grad_norm_finish in optim.wgsl.
        let factor = (max_norm / (total_norm + 1e-6)).min(1.0);
        kernels.write(c.norm.view(), &[total_norm, factor])?;
        self.prepare_step(kernels)?;
        kernels.submit_pass("optimizer_step", std::iter::once(&self.update), |_| {}, |_| {})?;
        self.finish_step();
        Ok(())
    }

    /// A norm gathered across executors knows nothing of one executor's
    /// loss scale: a loss-scaled model spread over executors gathers
    /// [`Optimizer::loss_scale_sums`] instead.
    fn not_loss_scaled(&self, op: &'static str) -> Result<()> {
        match self.scaler {
            Some(_) => Err(Error::InvalidArgument {
                op,
                reason: "not with loss scaling, which trains on one executor".into(),
            }),
            None => Ok(()),
        }
    }

    fn scaler(&self, op: &'static str) -> Result<&LossScaler> {
        self.scaler.as_ref().ok_or_else(|| Error::InvalidArgument {
            op,
            reason: "the optimizer has no loss_scaling".into(),
        })
    }

    /// Loss scaling over a model spread across executors (pipeline
    /// stages, tensor-parallel shards): this arena's share of what the
    /// scaler sums, (Σ (grad / scale)², count of inf and NaN gradients),
    /// from its partial sums run alone and read back (waits). Their totals
    /// over every executor go to [`Optimizer::step_with_loss_scale_sums`].
    pub(crate) fn loss_scale_sums(&self, kernels: &Kernels) -> Result<(f64, f64)> {
        let s = self.scaler("loss_scale_sums")?;
        kernels.submit_pass("loss_scale_partials", std::iter::once(&s.dispatches[0]), |_| {}, |_| {})?;
        let partials: Vec<f32> = kernels.read(s.partials.view())?;
        Ok(partials.chunks_exact(2).fold((0.0, 0.0), |(squares, bad), p| {
            (squares + f64::from(p[0]), bad + f64::from(p[1]))
        }))
    }

    /// One loss-scaled step deciding by `squares` and `non_finite`, totals
    /// of [`Optimizer::loss_scale_sums`] over every executor of a model (or
    /// over the shards of a ZeRO arena): they are written as this arena's
    /// only partial sums, then the scaler's finish and the update run as on
    /// one executor. Executors holding the same scale state so take or skip
    /// the step together, clip by the whole model's norm and move their
    /// scales alike.
    pub(crate) fn step_with_loss_scale_sums(&mut self, kernels: &Kernels, squares: f64, non_finite: f64) -> Result<()> {
        let s = self.scaler("optimizer_step_with_loss_scale_sums")?;
        let mut partials = vec![0.0f32; s.partials.view().len];
        if let [sum, count, ..] = partials.as_mut_slice() {
            (*sum, *count) = (squares as f32, non_finite as f32);
        }
        kernels.write(s.partials.view(), &partials)?;
        self.prepare_step(kernels)?;
        kernels.submit_pass(
            "optimizer_step",
            std::iter::once(&s.dispatches[1]).chain(std::iter::once(&self.update)),
            |_| {},
            |_| {},
        )?;
        self.finish_step();
        Ok(())
    }

    /// The state as (parameter name, state name, values) for each of
    /// `params`, state by state.
    pub(crate) fn export_state(
        &self,
        kernels: &Kernels,
        params: &[ParamSpan],
    ) -> Result<Vec<(String, &'static str, Vec<f32>)>> {
        let mut out = Vec::new();
        for (arena, &state_name) in self.state.iter().zip(self.state_names()) {
            let all: Vec<f32> = kernels.read(arena.view())?;
            for p in params {
                out.push((p.name.clone(), state_name, all[p.offset..p.offset + p.len()].to_vec()));
            }
        }
        Ok(out)
    }

    /// Checks every entry of `state` (parameter name, state name, values)
    /// against `params` before writing any, then replaces the state (when
    /// given) and the step count (when given). A parameter absent from
    /// `state` gets zeros.
    pub(crate) fn import_state(
        &mut self,
        kernels: &Kernels,
        params: &[ParamSpan],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        let staged = stage_state(self.state_names(), self.arena_len, params, state)?;
        if !state.is_empty() {
            for (arena, values) in self.state.iter().zip(&staged) {
                kernels.write(arena.view(), values)?;
            }
        }
        if let Some(s) = step {
            self.step = s;
            // A loss-scaled update counts its steps (and forms its bias
            // corrections) on the GPU: a checkpoint without scaling's state
            // (an f32 run's) took every step it ran, at the initial scale.
            if let Some(scaling) = self.config.loss_scaling() {
                let fresh = LossScaleState {
                    scale: scaling.init_scale,
                    steps_taken: s,
                    steps_run: s,
                    ..LossScaleState::default()
                };
                self.import_loss_scale(kernels, &fresh)?;
            }
        }
        Ok(())
    }

    /// Sets dynamic loss scaling's state (a resumed run's, after
    /// [`Optimizer::import_state`]); `false`, and nothing changes, where
    /// this optimizer does not scale.
    pub(crate) fn import_loss_scale(&mut self, kernels: &Kernels, state: &LossScaleState) -> Result<bool> {
        let (Some(scaler), Some(scaling)) = (&self.scaler, self.config.loss_scaling()) else {
            return Ok(false);
        };
        kernels.write(
            scaler.block.view(),
            &state.block(&scaling, self.config.bias_correction_betas()),
        )?;
        Ok(true)
    }
}

/// Host copies of the state arenas `state` fills, each entry checked: a
/// known state name, a known parameter, its length.
pub(crate) fn stage_state(
    names: &[&str],
    arena_len: usize,
    params: &[ParamSpan],
    state: &[(String, String, Vec<f32>)],
) -> Result<Vec<Vec<f32>>> {
    let mut host = vec![vec![0.0; arena_len]; names.len()];
    for (param_name, state_name, values) in state {
        let k = names
            .iter()
            .position(|n| n == state_name)
            .ok_or_else(|| Error::InvalidArgument {
                op: "load_state",
                reason: format!("this optimizer has no state `{state_name}`"),
            })?;
        let p = params
            .iter()
            .find(|p| &p.name == param_name)
            .ok_or_else(|| Error::InvalidArgument {
                op: "load_state",
                reason: format!("optimizer state for unknown parameter `{param_name}`"),
            })?;
        if values.len() != p.len() {
            return Err(Error::shape(
                "load_state",
                format!("state `{param_name}.{state_name}` has {} values", values.len()),
                &[&p.shape],
            ));
        }
        host[k][p.offset..p.offset + values.len()].copy_from_slice(values);
    }
    Ok(host)
}
