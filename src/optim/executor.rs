//! An executor that trains with an optimizer: built with one attached as its
//! [`StepUpdate`], and the optimizer's side of it — steps outside a training
//! step, clipping and loss scaling across executors, its state by parameter
//! and its loading — as methods of [`Executor`]. The graph layer knows the
//! optimizer only as a step update; everything optimizer-shaped lives here.

use std::any::Any;
use std::sync::Arc;

use super::optimizer::{apply_parameter_groups, LossScaleState, Optimizer};
use crate::error::{Error, Result};
use crate::graph::{Executor, Gradients, Graph, PlanOptions, StepUpdate, Tensor, UpdateSpec};
use crate::kernels::{loss_scale_word, Dispatch, Kernels, OptimizerConfig, View};

impl StepUpdate for Optimizer {
    fn dispatches(&self) -> Box<dyn Iterator<Item = &Dispatch> + '_> {
        Box::new(Optimizer::dispatches(self))
    }

    fn prepare(&self, kernels: &Kernels) -> Result<()> {
        self.prepare_step(kernels)
    }

    fn finish(&mut self) {
        self.finish_step();
    }

    fn steps_taken(&self) -> u64 {
        self.step_count()
    }

    /// With loss scaling, the scale seeds each step's loss gradient.
    fn loss_seed(&self) -> Option<View<'_>> {
        self.loss_scale_view()
    }

    /// With loss scaling, its state comes back with each loss read.
    fn readback(&self) -> Option<View<'_>> {
        self.loss_scale_state_view()
    }

    fn read_back(&mut self, words: &[f32]) {
        // The words are the loss-scale block's from SCALE on.
        let mut block = vec![0.0; loss_scale_word::SCALE];
        block.extend_from_slice(words);
        self.set_last_loss_scale(LossScaleState::from_block(&block));
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

fn no_optimizer(op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        reason: "no optimizer was given".into(),
    }
}

impl Executor {
    /// Plans `graph` for `outputs` (and, when training, the gradients and the
    /// optimizer), then allocates every buffer and builds every dispatch.
    pub fn new(
        kernels: Arc<Kernels>,
        graph: Graph,
        outputs: &[Tensor],
        gradients: Option<Gradients>,
        optimizer: Option<OptimizerConfig>,
    ) -> Result<Self> {
        Self::with_options(kernels, graph, outputs, gradients, optimizer, PlanOptions::default())
    }

    /// [`Executor::new`] with explicit planning options (fusion off gives
    /// the one-dispatch-per-node reference).
    pub fn with_options(
        kernels: Arc<Kernels>,
        graph: Graph,
        outputs: &[Tensor],
        gradients: Option<Gradients>,
        optimizer: Option<OptimizerConfig>,
        options: PlanOptions,
    ) -> Result<Self> {
        let Some(cfg) = optimizer else {
            return Self::with_update(kernels, graph, outputs, gradients, options, None);
        };
        if gradients.is_none() {
            return Err(Error::InvalidArgument {
                op: "Executor::new",
                reason: "an optimizer needs the gradients from backward()".into(),
            });
        }
        cfg.validate()?;
        // The optimizer's parameter groups, before planning lays them out.
        let mut graph = graph;
        apply_parameter_groups(&mut graph, &cfg)?;
        let spec = UpdateSpec {
            state_arenas: cfg.state_names().len(),
            seeds_loss: cfg.loss_scaling().is_some(),
            build: Box::new(move |kernels, arenas| {
                let o = Optimizer::new(kernels, cfg, arenas.params, arenas.grads, arenas.len, arenas.decay_len)?;
                Ok(Box::new(o) as Box<dyn StepUpdate>)
            }),
        };
        Self::with_update(kernels, graph, outputs, gradients, options, Some(spec))
    }

    /// The optimizer this executor steps with, if any: its state,
    /// clipping and schedule.
    pub fn optimizer(&self) -> Option<&Optimizer> {
        self.update().and_then(|u| u.as_any().downcast_ref::<Optimizer>())
    }

    /// The optimizer and this executor's kernels, to change the optimizer.
    fn optimizer_mut(&mut self, op: &'static str) -> Result<(Arc<Kernels>, &mut Optimizer)> {
        let kernels = self.kernels().clone();
        let o = self
            .update_mut()
            .and_then(|u| u.as_any_mut().downcast_mut::<Optimizer>())
            .ok_or_else(|| no_optimizer(op))?;
        Ok((kernels, o))
    }

    /// Optimizer steps taken so far (0 without an optimizer).
    pub fn step_count(&self) -> u64 {
        self.optimizer().map_or(0, Optimizer::step_count)
    }

    /// The learning rate the last optimizer step used (before any step,
    /// the first step's): the schedule at [`Executor::step_count`].
    /// `None` without an optimizer.
    pub fn learning_rate(&self) -> Option<f32> {
        self.optimizer().map(Optimizer::learning_rate)
    }

    /// The global L2 norm of the gradients the last optimizer step clipped
    /// (before clipping: torch.nn.utils.clip_grad_norm_'s return value).
    /// Steps never wait for it; this call waits for the GPU. `None` when
    /// the optimizer does not clip or no step was taken.
    pub fn read_grad_norm(&self) -> Result<Option<f32>> {
        match self.optimizer() {
            Some(o) => o.read_grad_norm(self.kernels()),
            None => Ok(None),
        }
    }

    /// Dynamic loss scaling's state as read back with the last loss read
    /// by [`Executor::train_step`] (no extra wait); `None` without loss
    /// scaling or before a loss was read. [`Optimizer::read_loss_scale`]
    /// reads it now.
    pub fn loss_scale(&self) -> Option<&LossScaleState> {
        self.optimizer().and_then(Optimizer::last_loss_scale)
    }

    /// Dynamic loss scaling's state now (waits for the GPU), for a
    /// checkpoint; `None` without loss scaling.
    pub fn read_loss_scale(&self) -> Result<Option<LossScaleState>> {
        match self.optimizer() {
            Some(o) => o.read_loss_scale(self.kernels()),
            None => Ok(None),
        }
    }

    /// Restores dynamic loss scaling's state (a checkpoint's, after
    /// [`Executor::load_state`]); nothing where the optimizer does not
    /// scale (an f16 run's checkpoint resumed in f32).
    pub fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        if let Ok((kernels, o)) = self.optimizer_mut("load_loss_scale") {
            if o.import_loss_scale(&kernels, state)? {
                o.set_last_loss_scale(state.clone());
            }
        }
        Ok(())
    }

    /// The optimizer this executor steps with, if any.
    pub fn optimizer_config(&self) -> Option<&OptimizerConfig> {
        self.optimizer().map(Optimizer::config)
    }

    /// The squared L2 norm of the gradients as they stand: the clipping
    /// norm's kernels run alone and the norm is read back (waits). A model
    /// spread over several executors (tensor-parallel shards, pipeline
    /// stages) sums these into its global norm and passes it to
    /// [`Executor::optimizer_step_with_grad_norm`], so every part clips by
    /// the whole model's norm, as torch.nn.utils.clip_grad_norm_ does.
    pub fn grad_norm_squared(&mut self) -> Result<f64> {
        match self.optimizer() {
            Some(o) => o.grad_norm_squared(self.kernels()),
            None => Err(no_optimizer("grad_norm_squared")),
        }
    }

    /// The optimizer step with clip_grad_norm_'s factor computed from
    /// `total_norm`, the norm of a whole model's gradients gathered from
    /// several executors, instead of this executor's own.
    pub fn optimizer_step_with_grad_norm(&mut self, total_norm: f32) -> Result<()> {
        let op = "optimizer_step_with_grad_norm";
        let (kernels, o) = self.optimizer_mut(op).map_err(|_| Error::InvalidArgument {
            op,
            reason: "needs an optimizer with clip_grad_norm".into(),
        })?;
        o.step_with_grad_norm(&kernels, total_norm)
    }

    /// Loss scaling over a model spread across executors: this one's
    /// (Σ (grad / scale)², count of inf and NaN gradients); waits. The
    /// totals over every executor go to
    /// [`Executor::optimizer_step_with_loss_scale_sums`].
    pub fn loss_scale_sums(&self) -> Result<(f64, f64)> {
        match self.optimizer() {
            Some(o) => o.loss_scale_sums(self.kernels()),
            None => Err(no_optimizer("loss_scale_sums")),
        }
    }

    /// The loss-scaled optimizer step deciding (skip, clip, next scale) by
    /// totals of [`Executor::loss_scale_sums`] over every executor of a
    /// model, so all of them take or skip it together.
    pub fn optimizer_step_with_loss_scale_sums(&mut self, squares: f64, non_finite: f64) -> Result<()> {
        let (kernels, o) = self.optimizer_mut("optimizer_step_with_loss_scale_sums")?;
        o.step_with_loss_scale_sums(&kernels, squares, non_finite)
    }

    /// Applies the optimizer to the gradients as they stand, in one
    /// submission (data parallel: after the gradients were all-reduced).
    pub fn optimizer_step(&mut self) -> Result<()> {
        let (kernels, o) = self.optimizer_mut("optimizer_step")?;
        o.step(&kernels)
    }

    /// The optimizer's state arenas (same layout as the parameters).
    pub fn state_arenas(&self) -> Vec<View<'_>> {
        self.optimizer().map_or_else(Vec::new, Optimizer::state_arenas)
    }

    /// PyTorch's names for the optimizer's per-parameter state, in arena
    /// order (as the optimizer names them; empty without one).
    pub fn optimizer_state_names(&self) -> &'static [&'static str] {
        self.optimizer().map_or(&[], Optimizer::state_names)
    }

    /// Optimizer state as (parameter name, state name, values).
    pub fn optimizer_state(&self) -> Result<Vec<(String, &'static str, Vec<f32>)>> {
        match self.optimizer() {
            Some(o) => o.export_state(self.kernels(), &self.parameter_spans()),
            None => Ok(Vec::new()),
        }
    }

    /// Replaces parameters (by name) and, when given, the optimizer state
    /// and step count. Checks every name and shape before writing anything.
    pub fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        optimizer_state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        let host = self.arena_with_parameters(params)?;
        // The optimizer checks its state before writing any; then the
        // parameters, all checked above, are written.
        let spans = self.parameter_spans();
        match (self.optimizer_mut("load_state"), optimizer_state.first()) {
            (Ok((kernels, o)), _) => o.import_state(&kernels, &spans, optimizer_state, step)?,
            (Err(_), Some((_, state_name, _))) => {
                return Err(Error::InvalidArgument {
                    op: "load_state",
                    reason: format!("this optimizer has no state `{state_name}`"),
                });
            }
            (Err(_), None) => {}
        }
        self.write_parameter_arena(&host)
    }
}
