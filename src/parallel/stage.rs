//! A slice of a model on one device: the unit pipeline and tensor
//! parallelism are built from. A stage takes activations in, produces
//! activations (or, last, a loss), and in its backward run receives the
//! gradient of its output and yields the gradient of its input.

use std::collections::HashMap;
use std::sync::Arc;

use super::on_device;
use super::{Examples, Targets};
use crate::error::{Error, Result};
use crate::graph::{ArenaPool, Block, Executor, Gradients, Graph, PlanOptions, Precision, Remap, Tensor};
use crate::io::checkpoint::Checkpoint;
use crate::io::state_dict::{assemble_checkpoint, CheckpointAbout};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::shard::Slice;
use crate::nn::Criterion;
use crate::optim::{self, LossScaleState};

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
    ends: StageEnds,
}

/// The tensors a stage's backward starts from and ends in.
#[derive(Clone, Copy)]
struct StageEnds {
    seed: Tensor,
    input_grad: Option<Tensor>,
    target: Option<Tensor>,
    loss: Option<Tensor>,
    /// Last stage: argmax of the output per row, computed on the device.
    prediction: Option<Tensor>,
    criterion: Option<Criterion>,
}

/// A stage's graph made trainable, before any device: its backward from
/// a fed gradient (or from its loss), and what its executor is planned for.
pub struct StageGraph {
    pub graph: Graph,
    /// What the executor keeps readable: the output, the loss, the argmax.
    pub outputs: Vec<Tensor>,
    pub grads: Gradients,
    ends: StageEnds,
}

impl StageGraph {
    /// `g` holding `input -> output`, completed as [`StageEnd`] says; with
    /// `input_grad` its backward also yields d loss / d input.
    pub fn complete(mut g: Graph, input: Tensor, output: Tensor, input_grad: bool, end: StageEnd) -> Result<Self> {
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
        Ok(StageGraph {
            graph: g,
            outputs,
            grads,
            ends: StageEnds {
                seed,
                input_grad,
                target,
                loss,
                prediction,
                criterion,
            },
        })
    }

    /// This stage with the passes a single-device trainer applies:
    /// `blocks` (the nodes each of the model's blocks added) recomputed in
    /// the backward when `checkpoint`, the activations the backward reads
    /// stored in f16 when `f16`. The stage's ends, and `carried` (its
    /// input and output), move to the new graph. What a stage passes on
    /// (its output, its input's gradient) stays f32: the f16 pass adds
    /// copies and changes no tensor's type.
    pub fn with_passes(
        mut self,
        blocks: &[Block],
        checkpoint: bool,
        f16: bool,
        carried: &mut [Tensor],
    ) -> Result<Self> {
        if checkpoint && !blocks.is_empty() {
            self = self.remapped(|g, grads| g.with_recomputed_blocks(grads, blocks), carried)?;
        }
        if f16 {
            self = self.remapped(|g, grads| g.with_f16_activations(grads), carried)?;
        }
        Ok(self)
    }

    fn remapped(
        self,
        pass: impl FnOnce(&Graph, &Gradients) -> Result<(Graph, Gradients, Remap)>,
        carried: &mut [Tensor],
    ) -> Result<Self> {
        let (graph, grads, at) = pass(&self.graph, &self.grads)?;
        let moved = |t: Option<Tensor>| t.map(|t| at.tensor(t));
        carried.iter_mut().for_each(|t| *t = at.tensor(*t));
        let e = self.ends;
        let ends = StageEnds {
            seed: at.tensor(e.seed),
            input_grad: moved(e.input_grad),
            target: moved(e.target),
            loss: moved(e.loss),
            prediction: moved(e.prediction),
            criterion: e.criterion,
        };
        Ok(StageGraph {
            graph,
            outputs: self.outputs.iter().map(|&t| at.tensor(t)).collect(),
            grads,
            ends,
        })
    }
}

impl Stage {
    /// A stage over a graph already holding `input -> output`; with
    /// `input_grad` its backward also yields d loss / d input.
    pub fn from_graph(
        kernels: Arc<Kernels>,
        g: Graph,
        input: Tensor,
        output: Tensor,
        input_grad: bool,
        end: StageEnd,
        optimizer: OptimizerConfig,
    ) -> Result<Self> {
        Self::with_options(
            kernels,
            g,
            &[],
            input,
            output,
            input_grad,
            end,
            optimizer,
            PlanOptions::default(),
        )
    }

    /// [`Stage::from_graph`] planned with `options`: with
    /// `checkpoint_activations` each of `blocks` (the nodes each of the
    /// model's blocks added to `g`) is recomputed in the stage's backward;
    /// with f16 precision, on an adapter with SHADER_F16, the activations
    /// its backward reads are stored in f16 (f32 elsewhere, as a
    /// [`crate::parallel::Trainer`] does). A loss-scaled `optimizer` leaves
    /// the seed to the engine ([`Stage::set_targets`]) and steps through
    /// [`reduce_and_step`], which combines the scaling across stages.
    #[allow(clippy::too_many_arguments)]
    pub fn with_options(
        kernels: Arc<Kernels>,
        g: Graph,
        blocks: &[Block],
        input: Tensor,
        output: Tensor,
        input_grad: bool,
        end: StageEnd,
        optimizer: OptimizerConfig,
        options: PlanOptions,
    ) -> Result<Self> {
        let f16 = options.precision == Precision::F16 && kernels.supports_f16();
        let mut ends = [input, output];
        let stage = StageGraph::complete(g, input, output, input_grad, end)?.with_passes(
            blocks,
            options.checkpoint_activations,
            f16,
            &mut ends,
        )?;
        let StageGraph {
            graph,
            outputs,
            grads,
            ends: stage_ends,
        } = stage;
        let exec = Executor::with_options(kernels.clone(), graph, &outputs, Some(grads), Some(optimizer), options)?;
        let [input, output] = ends;
        Ok(Stage {
            kernels,
            exec,
            input,
            output,
            ends: stage_ends,
        })
    }

    /// A stage over the completed `stage` (`input -> output`) whose
    /// arenas and intermediates lie at the start of `pool`'s buffers
    /// ([`Executor::with_arenas`]), its parameters at least
    /// `arena_alignment` bytes apart (0: the device's own). It has no
    /// optimizer: its owner keeps and updates the parameters elsewhere.
    pub fn with_arenas(
        kernels: Arc<Kernels>,
        stage: StageGraph,
        input: Tensor,
        output: Tensor,
        pool: &ArenaPool,
        arena_alignment: u32,
    ) -> Result<Self> {
        let StageGraph {
            graph,
            outputs,
            grads: gradients,
            ends,
        } = stage;
        let options = PlanOptions {
            arena_alignment,
            ..PlanOptions::default()
        };
        let exec = Executor::with_arenas(kernels.clone(), graph, &outputs, gradients, options, pool)?;
        Ok(Stage {
            kernels,
            exec,
            input,
            output,
            ends,
        })
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

    /// A first stage's input: features, or token ids (declared with
    /// [`Graph::ids`]).
    pub fn set_examples(&self, examples: Examples<'_>) -> Result<()> {
        match examples {
            Examples::Features(x) => self.exec.set_input(self.input, x),
            Examples::Ids(ids) => self.exec.set_labels(self.input, ids),
        }
    }

    /// The model input `examples` on a first stage, else `activations`.
    pub fn feed(&self, examples: Examples<'_>, activations: Option<&[f32]>) -> Result<()> {
        match activations {
            None => self.set_examples(examples),
            Some(x) => self.set_input(x),
        }
    }

    /// Dropout in this stage's forward runs (`training`: a step's forward,
    /// which its backward recomputes with the same masks; otherwise only
    /// its backward draws them) and where its rows start in the whole
    /// batch, in examples ([`crate::graph::DropoutRun`]).
    pub fn set_dropout(&mut self, training: bool, first_example: usize) {
        self.exec.set_training(training);
        self.exec.set_dropout_first_example(first_example);
    }

    /// Submits the forward pass (no wait).
    pub fn forward(&mut self) -> Result<()> {
        let output = self.output;
        self.exec.run(&[output])
    }

    pub fn output_view(&self) -> Result<View<'_>> {
        self.exec.tensor_view(self.output)
    }

    /// Runs the forward pass and reads its output back (waits).
    pub fn outputs(&mut self) -> Result<Vec<f32>> {
        self.forward()?;
        self.kernels.read(self.output_view()?)
    }

    /// Last stage: runs the forward pass and the argmax of each output row
    /// on the device and reads back only the class indices (waits).
    pub fn predictions(&mut self) -> Result<Vec<u32>> {
        let prediction = self.ends.prediction.ok_or_else(|| Error::InvalidArgument {
            op: "Stage",
            reason: "only the last stage predicts".into(),
        })?;
        self.exec.run(&[prediction])?;
        self.exec.read_u32(prediction)
    }

    /// Middle stages: the gradient of the output.
    pub fn set_output_gradient(&self, d_output: &[f32]) -> Result<()> {
        if self.ends.loss.is_some() {
            return Err(Error::InvalidArgument {
                op: "Stage",
                reason: "the last stage starts backward from its loss".into(),
            });
        }
        self.exec.set_input(self.ends.seed, d_output)
    }

    /// Last stage: targets and the weight of this micro-batch's mean loss
    /// in the global loss (times the loss scale, when scaling: the seed of
    /// the backward).
    pub fn set_targets(&self, targets: Targets<'_>, loss_scale: f32) -> Result<()> {
        let (Some(t), Some(criterion)) = (self.ends.target, self.ends.criterion) else {
            return Err(Error::InvalidArgument {
                op: "Stage",
                reason: "only the last stage has targets".into(),
            });
        };
        match (criterion, targets) {
            (Criterion::Mse, Targets::Values(v)) => self.exec.set_input(t, v)?,
            (Criterion::CrossEntropy, Targets::Classes(c)) => self.exec.set_labels(t, c)?,
            _ => {
                return Err(Error::InvalidArgument {
                    op: "Stage",
                    reason: "targets of the other kind for this loss".into(),
                })
            }
        }
        self.exec.set_input(self.ends.seed, &[loss_scale])
    }

    /// Submits forward (recomputed) and backward; gradients accumulate
    /// unless `zero_grad`.
    pub fn backward(&mut self, zero_grad: bool) -> Result<()> {
        self.exec.train_step(zero_grad, false, false).map(|_| ())
    }

    pub fn input_gradient_view(&self) -> Option<Result<View<'_>>> {
        self.ends.input_grad.map(|g| self.exec.tensor_view(g))
    }

    /// The last stage's mean loss of its last backward run (waits).
    pub fn loss_value(&self) -> Result<f32> {
        let loss = self.ends.loss.ok_or_else(|| Error::InvalidArgument {
            op: "Stage",
            reason: "not the last stage".into(),
        })?;
        let v = self.exec.read(loss)?;
        Ok(v.first().copied().unwrap_or(f32::NAN))
    }

    /// Last stage: submits the forward pass up to the loss only, for the
    /// input and targets set (evaluation: no gradients; no wait).
    pub fn forward_loss(&mut self) -> Result<()> {
        let loss = self.ends.loss.ok_or_else(|| Error::InvalidArgument {
            op: "Stage",
            reason: "only the last stage has a loss".into(),
        })?;
        self.exec.run(&[loss])
    }

    /// Last stage: where its loss lands, to copy to the host together with
    /// other stages' results.
    pub fn loss_view(&self) -> Option<Result<View<'_>>> {
        self.ends.loss.map(|l| self.exec.tensor_view(l))
    }

    pub fn optimizer_step(&mut self) -> Result<()> {
        self.exec.optimizer_step()
    }

    /// Last stage: the mean loss of its current input against `targets`,
    /// forward only (evaluation: no backward, gradients untouched); waits.
    pub fn evaluate_loss(&mut self, targets: Targets<'_>) -> Result<f32> {
        let loss = self.ends.loss.ok_or_else(|| Error::InvalidArgument {
            op: "Stage",
            reason: "only the last stage has a loss".into(),
        })?;
        self.set_targets(targets, 1.0)?;
        let value = self
            .exec
            .run_and_read(&[loss], loss)?
            .first()
            .copied()
            .unwrap_or(f32::NAN);
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                value,
                step: self.exec.step_count(),
            });
        }
        Ok(value)
    }
}

/// Checks that `input` and `targets` hold `rows` examples of `inputs`
/// values and `target_width` targets each.
pub fn check_batch(
    op: &'static str,
    rows: usize,
    inputs: usize,
    target_width: usize,
    input: Examples<'_>,
    targets: Targets<'_>,
) -> Result<()> {
    let got = match targets {
        Targets::Values(v) => v.len(),
        Targets::Classes(c) => c.len(),
    };
    if input.len() != rows * inputs || got != rows * target_width {
        return Err(Error::shape(
            op,
            format!("the input must be {rows} × {inputs} values and the targets {rows} × {target_width}"),
            &[&[rows, inputs], &[input.len()], &[got]],
        ));
    }
    Ok(())
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
pub fn reduce_and_step(
    stages: &mut [&mut Stage],
    devices: &[usize],
    shared: &[SharedParameter],
) -> Result<Option<f32>> {
    if devices.len() != stages.len() {
        return Err(Error::InvalidArgument {
            op: "reduce_and_step",
            reason: format!("{} stages but {} device indexes", stages.len(), devices.len()),
        });
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
            let grad = stage
                .exec
                .read_grad_named(&parameter.name)
                .map_err(|e| fail(h, stage, e))?;
            if sum.is_empty() {
                sum = grad.iter().map(|&v| f64::from(v)).collect();
            } else if sum.len() == grad.len() {
                sum.iter_mut().zip(&grad).for_each(|(s, &v)| *s += f64::from(v));
            } else {
                return Err(Error::shape(
                    "reduce_and_step",
                    format!("copies of `{}` differ in size", parameter.name),
                    &[&[sum.len()], &[grad.len()]],
                ));
            }
        }
        let total: Vec<f32> = sum.iter().map(|&v| v as f32).collect();
        for &h in &parameter.holders {
            stages[h]
                .exec
                .write_grad_named(&parameter.name, &total)
                .map_err(|e| fail(h, stages[h], e))?;
        }
        let squared: f64 = total.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        counted_twice += parameter.holders.len().saturating_sub(1) as f64 * squared;
    }
    let config = stages.first().and_then(|s| s.exec.optimizer_config()).copied();
    let clips = config.is_some_and(|c| c.clip_grad_norm().is_some());
    if config.is_some_and(|c| c.loss_scaling().is_some()) {
        return step_loss_scaled(stages, devices, counted_twice, clips);
    }
    if !clips {
        for (i, stage) in stages.iter_mut().enumerate() {
            stage
                .exec
                .optimizer_step()
                .map_err(|e| on_device(devices[i], &stage.kernels, e))?;
        }
        return Ok(None);
    }
    let mut squared = -counted_twice;
    for (i, stage) in stages.iter_mut().enumerate() {
        squared += stage
            .exec
            .grad_norm_squared()
            .map_err(|e| on_device(devices[i], &stage.kernels, e))?;
    }
    let norm = squared.max(0.0).sqrt() as f32;
    for (i, stage) in stages.iter_mut().enumerate() {
        stage
            .exec
            .optimizer_step_with_grad_norm(norm)
            .map_err(|e| on_device(devices[i], &stage.kernels, e))?;
    }
    Ok(Some(norm))
}

/// [`reduce_and_step`] under dynamic loss scaling: every stage's scaled
/// sums of squares and inf/NaN counts added on the host (the shared
/// parameters' extra copies taken off, unscaled), then every stage steps
/// by those totals, so an overflow on any stage skips the step on all,
/// all clip by the whole model's norm, and their scales stay one value.
fn step_loss_scaled(
    stages: &mut [&mut Stage],
    devices: &[usize],
    counted_twice: f64,
    clips: bool,
) -> Result<Option<f32>> {
    let (mut squares, mut non_finite) = (0.0f64, 0.0f64);
    for (i, stage) in stages.iter().enumerate() {
        let (s, n) = stage
            .exec
            .loss_scale_sums()
            .map_err(|e| on_device(devices[i], &stage.kernels, e))?;
        squares += s;
        non_finite += n;
    }
    // The shared gradients' copies were summed as scaled values.
    if let Some(first) = stages
        .first()
        .filter(|_| counted_twice > 0.0 && counted_twice.is_finite() && non_finite == 0.0)
    {
        let scale = f64::from(loss_scale_of(first)?);
        squares -= counted_twice / (scale * scale);
    }
    let squares = squares.max(0.0);
    for (i, stage) in stages.iter_mut().enumerate() {
        stage
            .exec
            .optimizer_step_with_loss_scale_sums(squares, non_finite)
            .map_err(|e| on_device(devices[i], &stage.kernels, e))?;
    }
    Ok(clips.then(|| squares.sqrt() as f32))
}

/// The loss scale `stage` seeds its next backward with (waits).
fn loss_scale_of(stage: &Stage) -> Result<f32> {
    let state = stage.exec.read_loss_scale()?;
    state.map(|s| s.scale).ok_or_else(|| Error::InvalidArgument {
        op: "loss scale",
        reason: "the stage's optimizer does not scale its loss".into(),
    })
}

/// Parameters as (name, shape, values), as [`Executor::parameters`].
pub type NamedParameters = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Optimizer state as (parameter, state, values), as
/// [`Executor::optimizer_state`].
pub type NamedState = Vec<(String, &'static str, Vec<f32>)>;

/// How a whole model lies across the stages of an engine: each stage
/// holds some of its parameters whole (a pipeline's, or copies of a
/// replicated one) or a slice of them (tensor parallel). The engines read,
/// save and load parameters and optimizer state through it under the
/// single-device model's names, so a run resumes on any strategy.
pub struct Spread {
    /// The single-device model's (name, shape), in its order.
    names: Vec<(String, Vec<usize>)>,
    /// Per stage: where its share of each split parameter lies.
    slices: Vec<HashMap<String, Slice>>,
    /// Per stage: the names its graph declares.
    held: Vec<Vec<String>>,
    /// Whole parameters several stages declare: found, not listed.
    shared: Vec<SharedParameter>,
    /// Per stage: its device's index in the group (for errors).
    devices: Vec<usize>,
    description: String,
    criterion: Criterion,
    optimizer: OptimizerConfig,
}

impl Spread {
    /// `stages` (on `devices[i]`) holding `names`, the single-device
    /// model's parameters; `slices[i]`: stage i's split parameters.
    pub fn new(
        names: Vec<(String, Vec<usize>)>,
        description: String,
        criterion: Criterion,
        optimizer: OptimizerConfig,
        stages: &[Stage],
        devices: Vec<usize>,
        slices: Vec<HashMap<String, Slice>>,
    ) -> Result<Self> {
        if devices.len() != stages.len() || slices.len() != stages.len() {
            return Err(Error::InvalidArgument {
                op: "Spread",
                reason: format!(
                    "{} stages, {} device indexes, {} slice maps",
                    stages.len(),
                    devices.len(),
                    slices.len()
                ),
            });
        }
        let held: Vec<Vec<String>> = stages
            .iter()
            .map(|s| s.exec.parameters_shapes().into_iter().map(|(n, _)| n).collect())
            .collect();
        // A frozen parameter (a LoRA adapter's base) has no gradient to sum.
        let trainable: Vec<Vec<String>> = stages
            .iter()
            .map(|s| s.exec.parameter_spans().into_iter().map(|p| p.name).collect())
            .collect();
        let mut shared = Vec::new();
        for (name, _) in &names {
            let holders: Vec<usize> = (0..stages.len()).filter(|&i| held[i].contains(name)).collect();
            if holders.is_empty() {
                return Err(Error::InvalidArgument {
                    op: "Spread",
                    reason: format!("no stage declares `{name}`"),
                });
            }
            let trains = holders.iter().any(|&i| trainable[i].contains(name));
            if trains && holders.len() > 1 && holders.iter().all(|&i| !slices[i].contains_key(name)) {
                shared.push(SharedParameter {
                    name: name.clone(),
                    holders,
                });
            }
        }
        if let Some(stray) = held.iter().flatten().find(|h| !names.iter().any(|(n, _)| n == *h)) {
            return Err(Error::InvalidArgument {
                op: "Spread",
                reason: format!("a stage declares `{stray}`, which the model does not name"),
            });
        }
        Ok(Spread {
            names,
            slices,
            held,
            shared,
            devices,
            description,
            criterion,
            optimizer,
        })
    }

    pub fn shared(&self) -> &[SharedParameter] {
        &self.shared
    }

    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// Sums the shared gradients and steps every stage (see [`reduce_and_step`]).
    pub fn step(&self, stages: &mut [Stage]) -> Result<Option<f32>> {
        let mut all: Vec<&mut Stage> = stages.iter_mut().collect();
        reduce_and_step(&mut all, &self.devices, &self.shared)
    }

    /// What the last stage's loss gradient is seeded with this step: the
    /// loss scale all stages share (read from the first; waits), 1 when
    /// the optimizer does not scale.
    pub fn seed_scale(&self, stages: &[Stage]) -> Result<f32> {
        match stages.first() {
            Some(first) if self.optimizer.loss_scaling().is_some() => {
                loss_scale_of(first).map_err(|e| on_device(self.devices[0], &first.kernels, e))
            }
            _ => Ok(1.0),
        }
    }

    /// Loss scaling's state, one for every stage (the first's); `None`
    /// when the optimizer does not scale.
    pub fn read_loss_scale(&self, stages: &[Stage]) -> Result<Option<LossScaleState>> {
        match stages.first() {
            Some(first) => first
                .exec
                .read_loss_scale()
                .map_err(|e| on_device(self.devices[0], &first.kernels, e)),
            None => Ok(None),
        }
    }

    /// Restores loss scaling's state (a checkpoint's) on every stage.
    pub fn load_loss_scale(&self, stages: &mut [Stage], state: &LossScaleState) -> Result<()> {
        for (i, stage) in stages.iter_mut().enumerate() {
            let kernels = stage.kernels.clone();
            stage
                .exec
                .load_loss_scale(state)
                .map_err(|e| on_device(self.devices[i], &kernels, e))?;
        }
        Ok(())
    }

    fn shape_of(&self, name: &str) -> Option<&Vec<usize>> {
        self.names.iter().find(|(n, _)| n == name).map(|(_, s)| s)
    }

    /// Every parameter whole that `wanted` keeps, in the model's order,
    /// from what `per_stage` read of each stage (name to values; the
    /// state has none for a frozen parameter).
    fn gather_named(
        &self,
        per_stage: &[HashMap<String, Vec<f32>>],
        wanted: impl Fn(&str) -> bool,
    ) -> Result<NamedParameters> {
        let missing = |name: &str| Error::InvalidArgument {
            op: "Spread",
            reason: format!("the stages' shares of `{name}` are missing or of the wrong size"),
        };
        self.names
            .iter()
            .filter(|(name, _)| wanted(name))
            .map(|(name, shape)| {
                let holders = (0..per_stage.len()).filter(|&i| self.held[i].contains(name));
                let mut full: Option<Vec<f32>> = None;
                for i in holders {
                    let values = per_stage[i].get(name).ok_or_else(|| missing(name))?;
                    match self.slices[i].get(name) {
                        None => {
                            full.get_or_insert_with(|| values.clone());
                        }
                        Some(slice) => {
                            let whole = full.get_or_insert_with(|| vec![0.0; shape.iter().product()]);
                            slice.put(whole, shape, values).ok_or_else(|| missing(name))?;
                        }
                    }
                }
                let full = full
                    .filter(|v| v.len() == shape.iter().product::<usize>())
                    .ok_or_else(|| missing(name))?;
                Ok((name.clone(), shape.clone(), full))
            })
            .collect()
    }

    /// Every parameter whole under the single-device names, in its order.
    pub fn parameters(&self, stages: &[Stage]) -> Result<NamedParameters> {
        let per_stage = stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.exec
                    .parameters()
                    .map(|all| all.into_iter().map(|(n, _, v)| (n, v)).collect::<HashMap<_, _>>())
                    .map_err(|e| on_device(self.devices[i], &s.kernels, e))
            })
            .collect::<Result<Vec<_>>>()?;
        // A stage's block-quantized frozen weights have no f32 values
        // (Executor::parameters leaves them out): the gathered set does too.
        let quantized: std::collections::HashSet<String> = stages
            .iter()
            .zip(&per_stage)
            .flat_map(|(s, got)| {
                s.exec
                    .parameters_shapes()
                    .into_iter()
                    .map(|(n, _)| n)
                    .filter(|n| !got.contains_key(n))
                    .collect::<Vec<_>>()
            })
            .collect();
        self.gather_named(&per_stage, |name| !quantized.contains(name))
    }

    /// The optimizer state whole under the single-device names, each
    /// parameter once.
    pub fn optimizer_state(&self, stages: &[Stage]) -> Result<NamedState> {
        let Some(first) = stages.first() else {
            return Ok(Vec::new());
        };
        let per_stage = stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.exec
                    .optimizer_state()
                    .map_err(|e| on_device(self.devices[i], &s.kernels, e))
            })
            .collect::<Result<Vec<_>>>()?;
        // Frozen parameters (a LoRA base) are frozen on every stage alike.
        let trainable: Vec<String> = stages
            .iter()
            .flat_map(|s| s.exec.parameter_spans())
            .map(|span| span.name)
            .collect();
        let mut all = Vec::new();
        for &state in first.exec.optimizer_state_names() {
            let of_state: Vec<HashMap<String, Vec<f32>>> = per_stage
                .iter()
                .map(|list| {
                    list.iter()
                        .filter(|(_, s, _)| *s == state)
                        .map(|(p, _, v)| (p.clone(), v.clone()))
                        .collect()
                })
                .collect();
            all.extend(
                self.gather_named(&of_state, |name| trainable.iter().any(|t| t == name))?
                    .into_iter()
                    .map(|(name, _, values)| (name, state, values)),
            );
        }
        Ok(all)
    }

    /// Replaces parameters and, when given, the optimizer state (complete:
    /// every state of every parameter) and step count, by single-device
    /// names: each stage takes its copy or slice. Every name and size is
    /// checked before any device changes.
    pub fn load_state(
        &self,
        stages: &mut [Stage],
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        let op = "load_state";
        for (name, shape, values) in params {
            let want = self.shape_of(name).ok_or_else(|| Error::InvalidArgument {
                op,
                reason: format!("the model has no parameter `{name}`"),
            })?;
            if shape != want || values.len() != want.iter().product::<usize>() {
                return Err(Error::shape(
                    op,
                    format!("parameter `{name}` with {} values", values.len()),
                    &[want, shape],
                ));
            }
        }
        let state_names = stages.first().map_or(&[][..], |s| s.exec.optimizer_state_names());
        for (name, state_name, values) in state {
            if !state_names.contains(&state_name.as_str()) {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "this optimizer ({}) has no state `{state_name}`",
                        optim::describe(&self.optimizer)
                    ),
                });
            }
            let want = self.shape_of(name).ok_or_else(|| Error::InvalidArgument {
                op,
                reason: format!("optimizer state `{state_name}` for unknown parameter `{name}`"),
            })?;
            if values.len() != want.iter().product::<usize>() {
                return Err(Error::shape(
                    op,
                    format!("state `{name}.{state_name}` has {} values", values.len()),
                    &[want],
                ));
            }
        }
        if !state.is_empty() {
            for (name, _) in &self.names {
                if let Some(absent) = state_names
                    .iter()
                    .find(|s| !state.iter().any(|(p, n, _)| p == name && n == *s))
                {
                    return Err(Error::InvalidArgument {
                        op,
                        reason: format!("the optimizer state has no `{absent}` for `{name}`"),
                    });
                }
            }
        }
        let share = |i: usize, name: &str, full: &[f32]| match (self.slices[i].get(name), self.shape_of(name)) {
            (Some(slice), Some(shape)) => slice.take(full, shape),
            _ => full.to_vec(),
        };
        for (i, stage) in stages.iter_mut().enumerate() {
            let holds = |name: &str| self.held[i].iter().any(|h| h == name);
            let own_params: Vec<_> = params
                .iter()
                .filter(|p| holds(&p.0))
                .map(|(n, _, v)| {
                    let values = share(i, n, v);
                    let shape = match self.slices[i].get(n) {
                        Some(_) => stage
                            .exec
                            .parameters_shapes()
                            .into_iter()
                            .find(|(m, _)| m == n)
                            .map_or_else(Vec::new, |(_, s)| s),
                        None => self.shape_of(n).cloned().unwrap_or_default(),
                    };
                    (n.clone(), shape, values)
                })
                .collect();
            let own_state: Vec<_> = state
                .iter()
                .filter(|p| holds(&p.0))
                .map(|(n, s, v)| (n.clone(), s.clone(), share(i, n, v)))
                .collect();
            let device = self.devices[i];
            let kernels = stage.kernels.clone();
            stage
                .exec
                .load_state(&own_params, &own_state, step)
                .map_err(|e| on_device(device, &kernels, e))?;
        }
        Ok(())
    }

    /// Parameters, optimizer state (`optim.<param>.<state>`) and metadata
    /// as [`crate::parallel::Trainer::checkpoint`] writes them for the
    /// single-device model, so a checkpoint resumes on any strategy.
    pub fn checkpoint(&self, stages: &[Stage]) -> Result<Checkpoint> {
        let step = stages.first().map_or(0, |s| s.exec.step_count());
        let about = CheckpointAbout {
            model: &self.description,
            criterion: self.criterion,
            optimizer: &self.optimizer,
            step,
            loss_scale: self.read_loss_scale(stages)?,
        };
        assemble_checkpoint(self.parameters(stages)?, self.optimizer_state(stages)?, &about)
    }
}
