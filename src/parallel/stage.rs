//! A slice of a model on one device: the unit pipeline and tensor
//! parallelism are built from. A stage takes activations in, produces
//! activations (or, last, a loss), and in its backward run receives the
//! gradient of its output and yields the gradient of its input.

use std::sync::Arc;

use super::on_device;
use crate::error::{Error, Result};
use crate::graph::{Executor, Graph, Tensor};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, Layer, Module};
use crate::trainer::Targets;

/// What ends a stage.
#[derive(Clone, Copy, Debug)]
pub enum StageEnd {
    /// Its output goes on; backward starts from a gradient fed in.
    Middle,
    /// It computes the loss; backward starts from a loss scale fed in.
    Last(Criterion),
}

pub struct Stage {
    pub kernels: Arc<Kernels>,
    exec: Executor,
    input: Tensor,
    output: Tensor,
    seed: Tensor,
    input_grad: Option<Tensor>,
    target: Option<Tensor>,
    loss: Option<Tensor>,
    /// Last stage: argmax of the output per row, computed on the device.
    prediction: Option<Tensor>,
    criterion: Option<Criterion>,
    pub rows: usize,
    pub in_features: usize,
    pub out_features: usize,
}

/// Width after `layers`, starting from `width`.
pub fn width_after(layers: &[(usize, Layer)], width: usize) -> usize {
    layers.iter().fold(width, |w, (_, l)| match l {
        Layer::Linear(lin) => lin.out_features,
        _ => w,
    })
}

/// Adds `layers` to `g`; each keeps its position in the whole model as its
/// parameter prefix (`2.weight`), so names match the single-device model.
pub fn add_layers(g: &mut Graph, layers: &[(usize, Layer)], x: Tensor) -> Result<Tensor> {
    layers.iter().try_fold(x, |h, (index, layer)| layer.forward(g, h, &format!("{index}.")))
}

impl Stage {
    /// A stage of `layers` for `rows` rows of `in_features`; with
    /// `input_grad` its backward also yields d loss / d input.
    pub fn new(
        kernels: Arc<Kernels>,
        layers: &[(usize, Layer)],
        rows: usize,
        in_features: usize,
        input_grad: bool,
        end: StageEnd,
        optimizer: OptimizerConfig,
    ) -> Result<Self> {
        let mut g = Graph::new();
        let input = g.input("stage_input", &[rows, in_features])?;
        let output = add_layers(&mut g, layers, input)?;
        let out_features = g.shape(output)[1];
        Self::from_graph(kernels, g, input, output, input_grad, end, optimizer, rows, in_features, out_features)
    }

    /// A stage over a graph already holding `input -> output`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_graph(
        kernels: Arc<Kernels>,
        mut g: Graph,
        input: Tensor,
        output: Tensor,
        input_grad: bool,
        end: StageEnd,
        optimizer: OptimizerConfig,
        rows: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<Self> {
        let wanted: Vec<Tensor> = if input_grad { vec![input] } else { vec![] };
        let output_shape = g.shape(output).to_vec();
        let (target, loss, seed, grads, criterion, prediction) = match end {
            StageEnd::Middle => {
                let seed = g.input("d_output", &output_shape)?;
                let grads = g.backward_from(output, seed, &wanted)?;
                (None, None, seed, grads, None, None)
            }
            StageEnd::Last(criterion) => {
                // Values of the output's shape, or one class per output
                // row ([B, T] token targets for [B, T, vocab] logits).
                let t = criterion.targets(&mut g, output)?;
                let loss = criterion.loss(&mut g, output, t)?;
                let seed = g.input("loss_scale", &[1])?;
                let grads = g.backward_from(loss, seed, &wanted)?;
                // Not part of a training step (the executor runs only what
                // the loss and gradients need); `predictions` runs it.
                let prediction = g.argmax(output)?;
                (Some(t), Some(loss), seed, grads, Some(criterion), Some(prediction))
            }
        };
        let input_grad = if input_grad { grads.input(input) } else { None };
        let mut outputs = vec![output];
        outputs.extend(loss);
        outputs.extend(prediction);
        let exec = Executor::new(kernels.clone(), g, &outputs, Some(grads), Some(optimizer))?;
        Ok(Stage { kernels, exec, input, output, seed, input_grad, target, loss, prediction, criterion, rows, in_features, out_features })
    }

    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    pub fn executor_mut(&mut self) -> &mut Executor {
        &mut self.exec
    }

    pub fn set_input(&self, x: &[f32]) -> Result<()> {
        self.exec.set_input(self.input, x)
    }

    /// A first stage reading token ids (its input declared with
    /// [`Graph::ids`]).
    pub fn set_input_ids(&self, ids: &[u32]) -> Result<()> {
        self.exec.set_labels(self.input, ids)
    }

    /// Submits the forward pass (no wait).
    pub fn forward(&mut self) -> Result<()> {
        let output = self.output;
        self.exec.run(&[output])
    }

    pub fn output_view(&self) -> Result<View<'_>> {
        self.exec.tensor_view(self.output)
    }

    /// Last stage: runs the forward pass and the argmax of each output row
    /// on the device and reads back only the class indices (waits).
    pub fn predictions(&mut self) -> Result<Vec<u32>> {
        let prediction = self.prediction.ok_or_else(|| Error::InvalidArgument { op: "Stage", reason: "only the last stage predicts".into() })?;
        self.exec.run(&[prediction])?;
        self.exec.read_u32(prediction)
    }

    /// Middle stages: the gradient of the output.
    pub fn set_output_gradient(&self, d_output: &[f32]) -> Result<()> {
        if self.loss.is_some() {
            return Err(Error::InvalidArgument { op: "Stage", reason: "the last stage starts backward from its loss".into() });
        }
        self.exec.set_input(self.seed, d_output)
    }

    /// Last stage: targets and the weight of this micro-batch's mean loss
    /// in the global loss.
    pub fn set_targets(&self, targets: Targets<'_>, loss_scale: f32) -> Result<()> {
        let (Some(t), Some(criterion)) = (self.target, self.criterion) else {
            return Err(Error::InvalidArgument { op: "Stage", reason: "only the last stage has targets".into() });
        };
        match (criterion, targets) {
            (Criterion::Mse, Targets::Values(v)) => self.exec.set_input(t, v)?,
            (Criterion::CrossEntropy, Targets::Classes(c)) => self.exec.set_labels(t, c)?,
            _ => return Err(Error::InvalidArgument { op: "Stage", reason: "targets of the other kind for this loss".into() }),
        }
        self.exec.set_input(self.seed, &[loss_scale])
    }

    /// Submits forward (recomputed) and backward; gradients accumulate
    /// unless `zero_grad`.
    pub fn backward(&mut self, zero_grad: bool) -> Result<()> {
        self.exec.train_step(zero_grad, false, false).map(|_| ())
    }

    pub fn input_gradient_view(&self) -> Option<Result<View<'_>>> {
        self.input_grad.map(|g| self.exec.tensor_view(g))
    }

    /// The last stage's mean loss of its last backward run (waits).
    pub fn loss_value(&self) -> Result<f32> {
        let loss = self.loss.ok_or_else(|| Error::InvalidArgument { op: "Stage", reason: "not the last stage".into() })?;
        let v = self.exec.read(loss)?;
        Ok(v.first().copied().unwrap_or(f32::NAN))
    }

    /// Last stage: submits the forward pass up to the loss only, for the
    /// input and targets set (evaluation: no gradients; no wait).
    pub fn forward_loss(&mut self) -> Result<()> {
        let loss = self.loss.ok_or_else(|| Error::InvalidArgument { op: "Stage", reason: "only the last stage has a loss".into() })?;
        self.exec.run(&[loss])
    }

    /// Last stage: where its loss lands, to copy to the host together with
    /// other stages' results.
    pub fn loss_view(&self) -> Option<Result<View<'_>>> {
        self.loss.map(|l| self.exec.tensor_view(l))
    }

    pub fn optimizer_step(&mut self) -> Result<()> {
        self.exec.optimizer_step()
    }

    /// Last stage: the mean loss of its current input against `targets`,
    /// forward only (evaluation: no backward, gradients untouched); waits.
    pub fn evaluate_loss(&mut self, targets: Targets<'_>) -> Result<f32> {
        let loss = self.loss.ok_or_else(|| Error::InvalidArgument { op: "Stage", reason: "only the last stage has a loss".into() })?;
        self.set_targets(targets, 1.0)?;
        let value = self.exec.run_and_read(&[loss], loss)?.first().copied().unwrap_or(f32::NAN);
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss { value, step: self.exec.step_count() });
        }
        Ok(value)
    }
}

/// A parameter held by several stages: the tied token embedding on the
/// first and last pipeline stage, or a norm or embedding replicated over
/// tensor-parallel shards. Each copy's backward yields only its own
/// contribution to the gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedParameter {
    pub name: String,
    /// Indexes of the stages holding a copy.
    pub holders: Vec<usize>,
}

/// Ends a step of a model spread over `stages` (on devices `devices[i]`,
/// for error messages): every shared parameter's copies get the sum of
/// all copies' gradients (added on the host in f64, in holder order, so
/// every copy takes the same optimizer step and the copies stay equal),
/// then every stage steps. When the optimizer clips, it clips by the
/// whole model's gradient norm, each shared parameter counted once, as
/// torch.nn.utils.clip_grad_norm_ over the single-device model would;
/// that norm is returned.
pub fn reduce_and_step(stages: &mut [&mut Stage], devices: &[usize], shared: &[SharedParameter]) -> Result<Option<f32>> {
    if devices.len() != stages.len() {
        return Err(Error::InvalidArgument { op: "reduce_and_step", reason: format!("{} stages but {} device indexes", stages.len(), devices.len()) });
    }
    let fail = |i: usize, stage: &Stage, e: Error| on_device(devices[i], &stage.kernels, e);
    // Σ over shared parameters of (copies - 1)·‖sum‖²: what the per-stage
    // norms count more than once.
    let mut counted_twice = 0.0f64;
    for parameter in shared {
        let mut sum: Vec<f64> = Vec::new();
        for &h in &parameter.holders {
            let stage = stages.get(h).ok_or_else(|| Error::InvalidArgument {
                op: "reduce_and_step",
                reason: format!("`{}` names stage {h} of {}", parameter.name, devices.len()),
            })?;
            let grad = stage.exec.read_grad_named(&parameter.name).map_err(|e| fail(h, stage, e))?;
            if sum.is_empty() {
                sum = grad.iter().map(|&v| f64::from(v)).collect();
            } else if sum.len() == grad.len() {
                sum.iter_mut().zip(&grad).for_each(|(s, &v)| *s += f64::from(v));
            } else {
                return Err(Error::shape("reduce_and_step", format!("copies of `{}` differ in size", parameter.name), &[&[sum.len()], &[grad.len()]]));
            }
        }
        let total: Vec<f32> = sum.iter().map(|&v| v as f32).collect();
        for &h in &parameter.holders {
            stages[h].exec.write_grad_named(&parameter.name, &total).map_err(|e| fail(h, stages[h], e))?;
        }
        let squared: f64 = total.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        counted_twice += parameter.holders.len().saturating_sub(1) as f64 * squared;
    }
    let clips = stages.first().and_then(|s| s.exec.optimizer_config()).is_some_and(|c| c.clip_grad_norm().is_some());
    if !clips {
        for (i, stage) in stages.iter_mut().enumerate() {
            stage.exec.optimizer_step().map_err(|e| on_device(devices[i], &stage.kernels, e))?;
        }
        return Ok(None);
    }
    let mut squared = -counted_twice;
    for (i, stage) in stages.iter_mut().enumerate() {
        squared += stage.exec.grad_norm_squared().map_err(|e| on_device(devices[i], &stage.kernels, e))?;
    }
    let norm = squared.max(0.0).sqrt() as f32;
    for (i, stage) in stages.iter_mut().enumerate() {
        stage.exec.optimizer_step_with_grad_norm(norm).map_err(|e| on_device(devices[i], &stage.kernels, e))?;
    }
    Ok(Some(norm))
}
