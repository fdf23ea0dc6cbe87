//! A slice of a model on one device: the unit pipeline and tensor
//! parallelism are built from. A stage takes activations in, produces
//! activations (or, last, a loss), and in its backward run receives the
//! gradient of its output and yields the gradient of its input.

use std::sync::Arc;

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
        let (target, loss, seed, grads, criterion, prediction) = match end {
            StageEnd::Middle => {
                let seed = g.input("d_output", &[rows, out_features])?;
                let grads = g.backward_from(output, seed, &wanted)?;
                (None, None, seed, grads, None, None)
            }
            StageEnd::Last(criterion) => {
                let (t, loss) = match criterion {
                    Criterion::Mse => {
                        let t = g.input("target", &[rows, out_features])?;
                        (t, g.mse_loss(output, t)?)
                    }
                    Criterion::CrossEntropy => {
                        let t = g.labels("target", rows)?;
                        (t, g.cross_entropy_loss(output, t)?)
                    }
                };
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

    pub fn optimizer_step(&mut self) -> Result<()> {
        self.exec.optimizer_step()
    }
}
