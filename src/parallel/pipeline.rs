//! Model (pipeline) parallel training, GPipe style: the layers are split
//! into contiguous stages, one per device; the global batch is cut into M
//! micro-batches that flow through the stages so devices overlap. Each
//! tick, every stage with work submits it before any result is waited on.
//! Backward recomputes each stage's forward from its saved input
//! (re-materialisation, as in GPipe), accumulates parameter gradients over
//! the micro-batches, and every stage then takes its optimizer step.

use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::stage::{width_after, Stage, StageEnd};
use super::{on_device, DeviceGroup};
use crate::error::{Error, Result};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, Layer, Sequential};
use crate::trainer::Targets;

/// Splits `layers` into `stages` contiguous, non-empty groups with about
/// equal parameter counts; activations stay with the layer before them.
/// Returns the number of layers in each stage.
pub fn balance_by_parameters(layers: &[Layer], stages: usize) -> Result<Vec<usize>> {
    let weights: Vec<usize> = layers
        .iter()
        .map(|l| match l {
            Layer::Linear(l) => l.in_features * l.out_features + l.out_features,
            _ => 0,
        })
        .collect();
    let linear_positions: Vec<usize> = (0..layers.len()).filter(|&i| weights[i] > 0).collect();
    if stages == 0 || linear_positions.len() < stages {
        return Err(Error::InvalidArgument {
            op: "pipeline partition",
            reason: format!("{} Linear layers cannot fill {stages} stages", linear_positions.len()),
        });
    }
    let total: usize = weights.iter().sum();
    let mut cuts = Vec::new();
    let mut acc = 0usize;
    let mut next_stage = 1;
    for (k, &pos) in linear_positions.iter().enumerate() {
        if next_stage >= stages {
            break;
        }
        let linears_left = linear_positions.len() - k;
        let stages_left = stages - next_stage;
        // Cut before this Linear when the running share reached the target,
        // or when every remaining Linear is needed for the remaining stages.
        if k > 0 && (acc * stages >= total * next_stage || linears_left == stages_left) {
            cuts.push(pos);
            next_stage += 1;
        }
        acc += weights[pos];
    }
    let mut sizes = Vec::with_capacity(stages);
    let mut start = 0;
    for &c in cuts.iter().chain(std::iter::once(&layers.len())) {
        sizes.push(c - start);
        start = c;
    }
    Ok(sizes)
}

/// Time accounting for the last steps.
#[derive(Clone, Debug, Default)]
pub struct PipelineStats {
    pub steps: u64,
    pub wall: Duration,
    /// Per stage: time from a tick's start until its results arrived, summed.
    pub busy: Vec<Duration>,
    /// Host transfers between stages: writing each tick's inputs (with the
    /// submits), and reading results after the slowest stage finished.
    pub communication: Duration,
}

pub struct Pipeline {
    stages: Vec<Stage>,
    micro_batches: usize,
    micro_rows: usize,
    global_batch: usize,
    in_features: usize,
    out_features: usize,
    /// Host copies of each stage's input per micro-batch.
    activations: Vec<Vec<Vec<f32>>>,
    /// Gradient of each stage's output per micro-batch.
    gradients: Vec<Vec<Vec<f32>>>,
    layer_counts: Vec<usize>,
    stats: PipelineStats,
}

impl Pipeline {
    /// `model` over the devices of `group` (one stage each), `global_batch`
    /// rows per step cut into `micro_batches`. `layer_counts` (layers per
    /// stage) overrides the parameter-balanced partition.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        group: &DeviceGroup,
        model: &Sequential,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        micro_batches: usize,
        layer_counts: Option<Vec<usize>>,
    ) -> Result<Self> {
        let criterion = criterion.into();
        let optimizer = optimizer.into();
        if optimizer.clip_grad_norm().is_some() {
            // Each device would clip by the norm of its own share of the
            // parameters, not torch's global norm.
            return Err(Error::InvalidArgument { op: "Pipeline", reason: "clip_grad_norm is not supported here (data parallel only)".into() });
        }
        let s = group.len();
        if micro_batches == 0 || global_batch % micro_batches != 0 {
            return Err(Error::InvalidArgument {
                op: "Pipeline",
                reason: format!("the global batch {global_batch} must split into {micro_batches} equal micro-batches"),
            });
        }
        let counts = match layer_counts {
            Some(c) => {
                if c.len() != s || c.contains(&0) || c.iter().sum::<usize>() != model.layers.len() {
                    return Err(Error::InvalidArgument {
                        op: "Pipeline",
                        reason: format!("layer counts {c:?} must give each of {s} stages ≥ 1 layer and sum to {}", model.layers.len()),
                    });
                }
                c
            }
            None => balance_by_parameters(&model.layers, s)?,
        };
        let in_features = model.in_features().ok_or_else(|| Error::InvalidArgument { op: "Pipeline", reason: "no Linear layer".into() })?;
        let micro_rows = global_batch / micro_batches;
        let indexed: Vec<(usize, Layer)> = model.layers.iter().cloned().enumerate().collect();
        let mut stages = Vec::with_capacity(s);
        let (mut start, mut width) = (0, in_features);
        for (i, (&count, k)) in counts.iter().zip(group.members()).enumerate() {
            let layers = &indexed[start..start + count];
            let end = if i + 1 == s { StageEnd::Last(criterion) } else { StageEnd::Middle };
            let stage = Stage::new(k.clone(), layers, micro_rows, width, i > 0, end, optimizer).map_err(|e| on_device(i, k, e))?;
            width = width_after(layers, width);
            start += count;
            stages.push(stage);
        }
        Ok(Pipeline {
            activations: vec![vec![Vec::new(); micro_batches]; s],
            gradients: vec![vec![Vec::new(); micro_batches]; s],
            stages,
            micro_batches,
            micro_rows,
            global_batch,
            in_features,
            out_features: width,
            layer_counts: counts,
            stats: PipelineStats { busy: vec![Duration::ZERO; s], ..PipelineStats::default() },
        })
    }

    pub fn layer_counts(&self) -> &[usize] {
        &self.layer_counts
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// GPipe's idle share with S stages and M micro-batches: (S-1)/(M+S-1).
    /// The measured figure runs higher: here the last stage's forward runs
    /// inside its backward, so it idles through the forward ticks.
    pub fn ideal_bubble_fraction(&self) -> f64 {
        ideal_bubble(self.stages.len(), self.micro_batches)
    }

    /// The measured idle share: 1 - busy time / (stages × wall time).
    pub fn measured_bubble_fraction(&self) -> f64 {
        measured_bubble(self.stats.wall, &self.stats.busy)
    }

    fn device(&self, s: usize) -> &Kernels {
        &self.stages[s].kernels
    }

    /// Runs one tick: `work(s, m)` submits for every active (stage, micro)
    /// pair, then the views `result(s)` are copied to the host together.
    fn tick(
        &mut self,
        active: &[(usize, usize)],
        submit: &mut dyn FnMut(&mut Stage, usize, usize) -> Result<()>,
        result: fn(&Stage) -> Option<Result<View<'_>>>,
    ) -> Result<Vec<(usize, usize, Vec<f32>)>> {
        let start = Instant::now();
        for &(s, m) in active {
            let k = self.stages[s].kernels.clone();
            submit(&mut self.stages[s], s, m).map_err(|e| on_device(s, &k, e))?;
        }
        // Writing the inputs and gradients dominates submitting.
        self.stats.communication += start.elapsed();
        let mut views = Vec::new();
        let mut owners = Vec::new();
        for &(s, m) in active {
            if let Some(v) = result(&self.stages[s]) {
                views.push((self.device(s), v.map_err(|e| on_device(s, self.device(s), e))?));
                owners.push((s, m));
            }
        }
        let (values, arrived) = if views.is_empty() {
            // Nothing to move (last stage only): wait for the stages' work.
            for &(s, _) in active {
                self.device(s).device().wait_idle("pipeline").map_err(|e| on_device(s, self.device(s), e))?;
            }
            (Vec::new(), Vec::new())
        } else {
            to_host(&views, start)?
        };
        let elapsed = start.elapsed();
        for &(s, _) in active {
            let busy = owners.iter().position(|o| o.0 == s).map_or(elapsed, |i| arrived[i]);
            self.stats.busy[s] += busy;
        }
        if let Some(slowest) = arrived.iter().max() {
            self.stats.communication += elapsed.saturating_sub(*slowest);
        }
        Ok(owners.into_iter().zip(values).map(|((s, m), v)| (s, m, v)).collect())
    }

    /// One optimizer step on `global_batch` rows. Returns the global mean
    /// loss when `read_loss`.
    pub fn step(&mut self, x: &[f32], targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
        let (f, s_count, m_count, rows) = (self.in_features, self.stages.len(), self.micro_batches, self.micro_rows);
        if x.len() != self.global_batch * f {
            return Err(Error::shape("Pipeline::step", format!("x must be {} × {f}", self.global_batch), &[&[x.len()]]));
        }
        let target_width = match targets {
            Targets::Values(v) if v.len() == self.global_batch * self.out_features => self.out_features,
            Targets::Classes(c) if c.len() == self.global_batch => 1,
            _ => return Err(Error::shape("Pipeline::step", "targets do not match the global batch", &[&[self.global_batch]])),
        };
        let wall = Instant::now();
        for m in 0..m_count {
            self.activations[0][m].clear();
            self.activations[0][m].extend_from_slice(&x[m * rows * f..(m + 1) * rows * f]);
        }
        // Forward: stage s works on micro-batch t - s at tick t. The last
        // stage's forward happens inside its backward run.
        for t in 0..m_count + s_count - 2 {
            let active: Vec<(usize, usize)> =
                (0..s_count - 1).filter(|&s| t >= s && t - s < m_count).map(|s| (s, t - s)).collect();
            if active.is_empty() {
                continue;
            }
            let acts = &self.activations;
            let inputs: Vec<Vec<f32>> = active.iter().map(|&(s, m)| acts[s][m].clone()).collect();
            let mut submit = |stage: &mut Stage, s: usize, m: usize| -> Result<()> {
                let k = active.iter().position(|&p| p == (s, m)).unwrap_or(0);
                stage.set_input(&inputs[k])?;
                stage.forward()
            };
            for (s, m, out) in self.tick(&active, &mut submit, |st| Some(st.output_view()))? {
                self.activations[s + 1][m] = out;
            }
        }
        // Backward: the last stage starts micro-batch t at tick t; stage s
        // works on micro-batch t - (S-1-s).
        let mut loss = 0.0f64;
        for t in 0..m_count + s_count - 1 {
            let active: Vec<(usize, usize)> = (0..s_count)
                .rev()
                .filter(|&s| t + s + 1 >= s_count && t + s + 1 - s_count < m_count)
                .map(|s| (s, t + s + 1 - s_count))
                .collect();
            let inputs: Vec<Vec<f32>> = active.iter().map(|&(s, m)| self.activations[s][m].clone()).collect();
            let grads: Vec<Vec<f32>> = active.iter().map(|&(s, m)| self.gradients[s][m].clone()).collect();
            let scale = rows as f32 / self.global_batch as f32;
            let mut submit = |stage: &mut Stage, s: usize, m: usize| -> Result<()> {
                let k = active.iter().position(|&p| p == (s, m)).unwrap_or(0);
                stage.set_input(&inputs[k])?;
                if s + 1 == s_count {
                    let tgt = match targets {
                        Targets::Values(v) => Targets::Values(&v[m * rows * target_width..(m + 1) * rows * target_width]),
                        Targets::Classes(c) => Targets::Classes(&c[m * rows..(m + 1) * rows]),
                    };
                    stage.set_targets(tgt, scale)?;
                } else {
                    stage.set_output_gradient(&grads[k])?;
                }
                stage.backward(m == 0)
            };
            for (s, m, grad) in self.tick(&active, &mut submit, |st| st.input_gradient_view())? {
                self.gradients[s - 1][m] = grad;
            }
            if read_loss {
                if let Some(&(s, _)) = active.iter().find(|(s, _)| s + 1 == s_count) {
                    let l = self.stages[s].loss_value().map_err(|e| on_device(s, self.device(s), e))?;
                    loss += f64::from(scale) * f64::from(l);
                }
            }
        }
        for s in 0..s_count {
            let k = self.stages[s].kernels.clone();
            self.stages[s].optimizer_step().map_err(|e| on_device(s, &k, e))?;
        }
        self.stats.steps += 1;
        self.stats.wall += wall.elapsed();
        if read_loss && !loss.is_finite() {
            return Err(Error::NonFiniteLoss { value: loss as f32, step: self.stats.steps });
        }
        Ok(read_loss.then_some(loss as f32))
    }

    /// Model outputs for any number of rows, micro-batch by micro-batch
    /// through the stages (the last chunk zero-padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        let (f, rows, width) = (self.in_features, self.micro_rows, self.out_features);
        let stages = &mut self.stages;
        super::outputs_in_chunks("Pipeline::outputs", features, f, rows, width, |chunk| {
            let last = feed_last_stage(stages, chunk)?;
            let stage = &mut stages[last];
            let k = stage.kernels.clone();
            stage.forward().map_err(|e| on_device(last, &k, e))?;
            k.read(stage.output_view()?).map_err(|e| on_device(last, &k, e))
        })
    }

    /// Argmax of [`Pipeline::outputs`], computed by the last stage's device,
    /// which reads back one index per row instead of the outputs.
    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        let (f, rows) = (self.in_features, self.micro_rows);
        let stages = &mut self.stages;
        super::outputs_in_chunks("Pipeline::predict", features, f, rows, 1, |chunk| {
            let last = feed_last_stage(stages, chunk)?;
            let stage = &mut stages[last];
            let k = stage.kernels.clone();
            stage.predictions().map_err(|e| on_device(last, &k, e))
        })
    }

    /// Every stage's parameters, with their whole-model names.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
        let mut all = Vec::new();
        for (s, stage) in self.stages.iter().enumerate() {
            all.extend(stage.executor().parameters().map_err(|e| on_device(s, &stage.kernels, e))?);
        }
        Ok(all)
    }
}

/// Feeds one chunk forward through every stage but the last and sets the
/// last one's input; returns the last stage's index.
fn feed_last_stage(stages: &mut [Stage], chunk: &[f32]) -> Result<usize> {
    let Some(last) = stages.len().checked_sub(1) else {
        return Err(Error::InvalidArgument { op: "Pipeline", reason: "no stages".into() });
    };
    let mut h = chunk.to_vec();
    for (s, stage) in stages[..last].iter_mut().enumerate() {
        let k = stage.kernels.clone();
        stage.set_input(&h).map_err(|e| on_device(s, &k, e))?;
        stage.forward().map_err(|e| on_device(s, &k, e))?;
        h = k.read(stage.output_view()?).map_err(|e| on_device(s, &k, e))?;
    }
    let stage = &stages[last];
    stage.set_input(&h).map_err(|e| on_device(last, &stage.kernels, e))?;
    Ok(last)
}

/// GPipe's idle share with `stages` stages and `micro_batches`
/// micro-batches: (S−1)/(M+S−1).
pub(crate) fn ideal_bubble(stages: usize, micro_batches: usize) -> f64 {
    let s = stages as f64;
    (s - 1.0) / (micro_batches as f64 + s - 1.0)
}

/// The measured idle share: 1 − Σ busy / (stages × wall), `busy` holding
/// one entry per stage.
pub(crate) fn measured_bubble(wall: Duration, busy: &[Duration]) -> f64 {
    let wall = wall.as_secs_f64() * busy.len() as f64;
    if wall <= 0.0 {
        return 0.0;
    }
    let busy: f64 = busy.iter().map(Duration::as_secs_f64).sum();
    (1.0 - busy / wall).clamp(0.0, 1.0)
}
