//! An optimizer running over an executor's arenas: its state (one arena per
//! state name, in the parameters' layout), the gradient-norm clipping, the
//! update dispatch, the schedule's position (the step counter), and the
//! export and import of its state by parameter. The executor holds one and
//! records its dispatches into a training step; it knows no state names.

use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::kernels::{grad_norm_groups, ArenaGroups, Dispatch, GpuTensor, Kernels, OptimizerConfig, View};

/// Where a parameter lives in the arenas, as the executor's plan laid
/// them out.
#[derive(Clone, Debug)]
pub struct ParamSpan {
    pub name: String,
    pub shape: Vec<usize>,
    /// Element offset in every arena.
    pub offset: usize,
}

impl ParamSpan {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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

pub struct Optimizer {
    config: OptimizerConfig,
    state: Vec<GpuTensor>,
    clip: Option<ClipNorm>,
    update: Dispatch,
    /// Elements the update covers (the parameter arena's length).
    arena_len: usize,
    /// Optimizer steps taken (PyTorch's `step`, from 1).
    step: u64,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer").field("config", &self.config).field("step", &self.step).finish()
    }
}

impl Optimizer {
    /// State arenas, clipping buffers and the update over the `params` and
    /// `grads` arenas of `arena_len` elements, whose first `decay_len`
    /// elements are the weight-decayed group. Alignment gaps hold zeros
    /// that every optimizer keeps at zero, so one update covers the arena.
    pub(crate) fn new(kernels: &Kernels, config: OptimizerConfig, params: View<'_>, grads: View<'_>, arena_len: usize, decay_len: usize) -> Result<Self> {
        config.validate()?;
        let state = (0..config.state_names().len()).map(|_| kernels.zeros(arena_len)).collect::<Result<Vec<_>>>()?;
        let clip = match config.clip_grad_norm() {
            Some(max_norm) => {
                let (partials, norm) = (kernels.zeros(grad_norm_groups(arena_len))?, kernels.zeros(2)?);
                let dispatches = kernels.grad_norm(norm.view(), partials.view(), grads, max_norm)?;
                Some(ClipNorm { _partials: partials, norm, dispatches })
            }
            None => None,
        };
        let state_views: Vec<View<'_>> = state.iter().map(|s| s.view()).collect();
        let arena = ArenaGroups { decay_len, grad_norm: clip.as_ref().map(|c| c.norm.view()) };
        let update = kernels.optimizer_update(&config, params, grads, &state_views, arena, 1)?;
        Ok(Optimizer { config, state, clip, update, arena_len, step: 0 })
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
        self.clip.iter().flat_map(|c| c.dispatches.iter()).chain(std::iter::once(&self.update))
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
        match &self.clip {
            Some(c) if self.step > 0 => Ok(kernels.read::<f32>(c.norm.slice(0, 1)?)?.first().copied()),
            _ => Ok(None),
        }
    }

    /// The squared L2 norm of the gradients as they stand: the clipping
    /// norm's kernels run alone and the norm is read back (waits).
    pub(crate) fn grad_norm_squared(&self, kernels: &Kernels) -> Result<f64> {
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
        let Some(c) = &self.clip else {
            return Err(Error::InvalidArgument { op: "optimizer_step_with_grad_norm", reason: "needs an optimizer with clip_grad_norm".into() });
        };
        let max_norm = self.config.clip_grad_norm().unwrap_or(f32::INFINITY);
        if !total_norm.is_finite() || total_norm < 0.0 {
            return Err(Error::NonFiniteLoss { value: total_norm, step: self.step + 1 });
        }
        // The same f32 arithmetic as grad_norm_finish in optim.wgsl.
        let factor = (max_norm / (total_norm + 1e-6)).min(1.0);
        kernels.write(c.norm.view(), &[total_norm, factor])?;
        self.prepare_step(kernels)?;
        kernels.submit_pass("optimizer_step", std::iter::once(&self.update), |_| {}, |_| {})?;
        self.finish_step();
        Ok(())
    }

    /// The state as (parameter name, state name, values) for each of
    /// `params`, state by state.
    pub(crate) fn export_state(&self, kernels: &Kernels, params: &[ParamSpan]) -> Result<Vec<(String, &'static str, Vec<f32>)>> {
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
    pub(crate) fn import_state(&mut self, kernels: &Kernels, params: &[ParamSpan], state: &[(String, String, Vec<f32>)], step: Option<u64>) -> Result<()> {
        let staged = stage_state(self.state_names(), self.arena_len, params, state)?;
        if !state.is_empty() {
            for (arena, values) in self.state.iter().zip(&staged) {
                kernels.write(arena.view(), values)?;
            }
        }
        if let Some(s) = step {
            self.step = s;
        }
        Ok(())
    }
}

/// Host copies of the state arenas `state` fills, each entry checked: a
/// known state name, a known parameter, its length.
pub(crate) fn stage_state(names: &[&str], arena_len: usize, params: &[ParamSpan], state: &[(String, String, Vec<f32>)]) -> Result<Vec<Vec<f32>>> {
    let mut host = vec![vec![0.0; arena_len]; names.len()];
    for (param_name, state_name, values) in state {
        let k = names.iter().position(|n| n == state_name).ok_or_else(|| Error::InvalidArgument {
            op: "load_state",
            reason: format!("this optimizer has no state `{state_name}`"),
        })?;
        let p = params.iter().find(|p| &p.name == param_name).ok_or_else(|| Error::InvalidArgument {
            op: "load_state",
            reason: format!("optimizer state for unknown parameter `{param_name}`"),
        })?;
        if values.len() != p.len() {
            return Err(Error::shape("load_state", format!("state `{param_name}.{state_name}` has {} values", values.len()), &[&p.shape]));
        }
        host[k][p.offset..p.offset + values.len()].copy_from_slice(values);
    }
    Ok(host)
}
