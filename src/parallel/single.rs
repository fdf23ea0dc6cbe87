//! The training loop as PyTorch users write it, over a define-then-run graph:
//!
//! ```no_run
//! # fn main() -> wgrad::Result<()> {
//! use std::sync::Arc;
//! use wgrad::nn::{Layer, Linear, MSELoss, Sequential};
//! use wgrad::optim::SGD;
//! use wgrad::trainer::{Targets, Trainer};
//! let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
//! let model = Sequential::new(vec![Layer::Linear(Linear::new(10, 1))]);
//! let mut trainer = Trainer::new(kernels, &model, MSELoss, SGD::new(0.01), 64)?;
//! # let (x, y) = (vec![0.0f32; 640], vec![0.0f32; 64]);
//! trainer.zero_grad();
//! trainer.forward(&x)?;
//! trainer.loss(Targets::Values(&y))?;
//! trainer.backward()?;
//! trainer.step()?; // everything above runs here, as one GPU submission
//! # Ok(()) }
//! ```
//!
//! Each call records what the step should do; `step()` submits forward,
//! backward and the optimizer update as one command buffer.

use std::path::Path;
use std::sync::Arc;

use crate::io::checkpoint::{self, Checkpoint, NamedTensor};
use crate::error::{Error, Result};
use crate::graph::{Block, DType, Executor, Graph, PlanOptions, Precision, Tensor};
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{Criterion, Module, Staged};
use crate::optim;

/// What the loss compares the model's output with.
#[derive(Clone, Copy, Debug)]
pub enum Targets<'a> {
    /// Regression targets, [batch, out_features].
    Values(&'a [f32]),
    /// Class indices, [batch].
    Classes(&'a [u32]),
}

/// A batch of examples as a model reads them: f32 features or u32 token
/// ids, row-major, examples one after another.
#[derive(Clone, Copy, Debug)]
pub enum Examples<'a> {
    Features(&'a [f32]),
    Ids(&'a [u32]),
}

impl<'a> Examples<'a> {
    pub fn len(&self) -> usize {
        match self {
            Examples::Features(x) => x.len(),
            Examples::Ids(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `start..end` (not examples: the caller multiplies by the
    /// values per example).
    pub fn slice(&self, start: usize, end: usize) -> Examples<'a> {
        match *self {
            Examples::Features(x) => Examples::Features(&x[start..end]),
            Examples::Ids(x) => Examples::Ids(&x[start..end]),
        }
    }
}

impl<'a> From<&'a [f32]> for Examples<'a> {
    fn from(x: &'a [f32]) -> Self {
        Examples::Features(x)
    }
}

impl<'a> From<&'a Vec<f32>> for Examples<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        Examples::Features(x)
    }
}

impl<'a> From<&'a [u32]> for Examples<'a> {
    fn from(x: &'a [u32]) -> Self {
        Examples::Ids(x)
    }
}

impl<'a> From<&'a Vec<u32>> for Examples<'a> {
    fn from(x: &'a Vec<u32>) -> Self {
        Examples::Ids(x)
    }
}

/// Per-example widths of a model: the values it reads, the values it
/// outputs, and the rows of its output (1 for an MLP, the sequence length
/// for a language model: the class labels per example).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelWidths {
    pub inputs: usize,
    pub outputs: usize,
    pub output_rows: usize,
    pub reads_ids: bool,
}

impl ModelWidths {
    /// Builds `model` for one example in a scratch graph (no GPU work).
    pub fn of(model: &dyn Module) -> Result<Self> {
        let mut g = Graph::new();
        let Built { input, output, in_per_example, out_per_example } = build_model(&mut g, model, 1)?;
        let last = g.shape_of(output).and_then(|s| s.last().copied()).unwrap_or(1).max(1);
        let reads_ids = g.get(input).is_some_and(|n| n.dtype == DType::U32);
        Ok(ModelWidths { inputs: in_per_example, outputs: out_per_example, output_rows: out_per_example / last, reads_ids })
    }

    /// Target values per example the criterion compares against: the
    /// outputs (MSE) or one class per output row (cross-entropy).
    pub fn target_width(&self, criterion: Criterion) -> usize {
        match criterion {
            Criterion::Mse => self.outputs,
            Criterion::CrossEntropy => self.output_rows,
        }
    }
}

pub struct Trainer {
    exec: Executor,
    input: Tensor,
    target: Tensor,
    output: Tensor,
    loss: Tensor,
    prediction: Tensor,
    batch_size: usize,
    /// Input values per example (features, or token ids of a sequence).
    in_features: usize,
    /// Output values per example.
    out_features: usize,
    criterion: Criterion,
    model_description: String,
    optimizer: OptimizerConfig,
    zero_grad_pending: bool,
    forward_done: bool,
    targets_done: bool,
    backward_done: bool,
}

/// The model's input, output and its per-example widths.
pub(crate) struct Built {
    pub(crate) input: Tensor,
    pub(crate) output: Tensor,
    pub(crate) in_per_example: usize,
    pub(crate) out_per_example: usize,
}

fn check_batch(batch_size: usize) -> Result<()> {
    if batch_size == 0 {
        return Err(Error::InvalidArgument { op: "Trainer::new", reason: "the batch size must be at least 1".into() });
    }
    Ok(())
}

pub(crate) fn build_model(g: &mut Graph, model: &dyn Module, batch_size: usize) -> Result<Built> {
    check_batch(batch_size)?;
    let input = model.input(g, batch_size)?;
    let output = model.forward(g, input, "")?;
    Ok(built(g, input, output, batch_size))
}

fn built(g: &Graph, input: Tensor, output: Tensor, batch_size: usize) -> Built {
    let len = |t: Tensor| g.shape_of(t).map_or(0, |s| s.iter().product::<usize>());
    Built { input, output, in_per_example: len(input) / batch_size, out_per_example: len(output) / batch_size }
}

/// [`build_model`] unit by unit, with the node range each block added.
fn build_blocks(g: &mut Graph, model: &dyn Staged, batch_size: usize) -> Result<(Built, Vec<Block>)> {
    check_batch(batch_size)?;
    let input = model.input(g, batch_size)?;
    let (output, blocks) = model.forward_blocks(g, input, 0..model.stage_costs().blocks.len(), true, true)?;
    Ok((built(g, input, output, batch_size), blocks))
}

/// What a trainer runs, before any device: `model → criterion` on
/// `batch_size` examples, the argmax and the backward pass.
pub(crate) struct TrainingGraph {
    pub(crate) graph: Graph,
    pub(crate) built: Built,
    pub(crate) target: Tensor,
    pub(crate) loss: Tensor,
    pub(crate) prediction: Tensor,
    pub(crate) grads: crate::graph::Gradients,
}

impl TrainingGraph {
    /// What a trainer's executor is planned to keep readable.
    pub(crate) fn outputs(&self) -> [Tensor; 3] {
        [self.built.output, self.prediction, self.loss]
    }

    /// The graph a rewriting pass (recomputed blocks, f16 activations)
    /// makes of this one, with every tensor the trainer names carried over.
    fn remapped(self, pass: impl FnOnce(&Graph, &crate::graph::Gradients) -> Result<(Graph, crate::graph::Gradients, crate::graph::Remap)>) -> Result<Self> {
        let (graph, grads, at) = pass(&self.graph, &self.grads)?;
        let built = Built { input: at.tensor(self.built.input), output: at.tensor(self.built.output), ..self.built };
        Ok(TrainingGraph { graph, built, target: at.tensor(self.target), loss: at.tensor(self.loss), prediction: at.tensor(self.prediction), grads })
    }
}

pub(crate) fn training_graph(model: &dyn Module, checkpointed: Option<&dyn Staged>, criterion: Criterion, batch_size: usize) -> Result<TrainingGraph> {
    let mut graph = Graph::new();
    let (built, blocks) = match checkpointed {
        Some(m) => build_blocks(&mut graph, m, batch_size)?,
        None => (build_model(&mut graph, model, batch_size)?, Vec::new()),
    };
    let target = criterion.targets(&mut graph, built.output)?;
    let loss = criterion.loss(&mut graph, built.output, target)?;
    let prediction = graph.argmax(built.output)?;
    let grads = graph.backward(loss)?;
    let t = TrainingGraph { graph, built, target, loss, prediction, grads };
    if blocks.is_empty() {
        Ok(t)
    } else {
        t.remapped(|g, grads| g.with_recomputed_blocks(grads, &blocks))
    }
}

/// [`training_graph`] with the passes a trainer applies: `staged`'s
/// blocks recomputed in the backward when `checkpoint`, the activations
/// the backward reads stored in f16 when `f16` (the caller knows whether
/// the device has SHADER_F16; a plan without a device assumes it).
pub(crate) fn training_graph_with_passes(model: &dyn Module, staged: Option<&dyn Staged>, criterion: Criterion, batch_size: usize, checkpoint: bool, f16: bool) -> Result<TrainingGraph> {
    let t = training_graph(model, staged.filter(|_| checkpoint), criterion, batch_size)?;
    if f16 {
        t.remapped(|g, grads| g.with_f16_activations(grads))
    } else {
        Ok(t)
    }
}

impl Trainer {
    /// Builds the graph `model → criterion`, its backward pass and the
    /// optimizer update, plans memory and allocates everything once.
    pub fn new(
        kernels: Arc<Kernels>,
        model: &dyn Module,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch_size: usize,
    ) -> Result<Self> {
        Self::with_options(kernels, model, criterion, optimizer, batch_size, PlanOptions::default())
    }

    /// [`Trainer::new`] with explicit planning options (fusion off gives the
    /// one-dispatch-per-node reference the fused step is tested against).
    pub fn with_options(
        kernels: Arc<Kernels>,
        model: &dyn Module,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch_size: usize,
        options: PlanOptions,
    ) -> Result<Self> {
        Self::build(kernels, model, None, criterion.into(), optimizer.into(), batch_size, options, true)
    }

    /// [`Trainer::with_options`] for a model cut into blocks, which
    /// `options.checkpoint_activations` recomputes one by one in the
    /// backward (torch.utils.checkpoint around each block).
    pub fn with_blocks(
        kernels: Arc<Kernels>,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch_size: usize,
        options: PlanOptions,
    ) -> Result<Self> {
        Self::build(kernels, model, Some(model), criterion.into(), optimizer.into(), batch_size, options, true)
    }

    /// [`Trainer::with_options`] without the optimizer's state and update:
    /// forward and backward only ([`Trainer::forward_backward`]), the
    /// arenas laid out (weight-decayed parameters first) as `optimizer`
    /// lays them out, for an engine that keeps the optimizer elsewhere
    /// (ZeRO: each device the state of its shard of the arena only).
    /// `options.checkpoint_activations` recomputes the model's blocks as
    /// [`Trainer::with_blocks`] does.
    pub fn without_optimizer(
        kernels: Arc<Kernels>,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch_size: usize,
        options: PlanOptions,
    ) -> Result<Self> {
        Self::build(kernels, model, Some(model), criterion.into(), optimizer.into(), batch_size, options, false)
    }

    /// The graph of `model` (by its blocks when checkpointing a `staged`
    /// one), its loss, backward and the passes `options` asks for, with the
    /// optimizer's update when `own_optimizer`.
    #[allow(clippy::too_many_arguments)]
    fn build(
        kernels: Arc<Kernels>,
        model: &dyn Module,
        staged: Option<&dyn Staged>,
        criterion: Criterion,
        optimizer: OptimizerConfig,
        batch_size: usize,
        options: PlanOptions,
        own_optimizer: bool,
    ) -> Result<Self> {
        // f16 storage needs the adapter's SHADER_F16; without it the step
        // stays f32 (`Trainer::precision` tells the caller).
        let f16 = options.precision == Precision::F16 && kernels.supports_f16();
        let t = training_graph_with_passes(model, staged, criterion, batch_size, options.checkpoint_activations, f16)?;
        let outputs = t.outputs();
        let TrainingGraph { graph: mut g, built: Built { input, output, in_per_example: in_features, out_per_example: out_features }, target, loss, prediction, grads } = t;
        let exec = if own_optimizer {
            Executor::with_options(kernels, g, &outputs, Some(grads), Some(optimizer), options)?
        } else {
            // The groups the executor applies for its own optimizer, so the
            // arena's layout and decayed prefix are the same.
            optim::apply_parameter_groups(&mut g, &optimizer)?;
            Executor::with_options(kernels, g, &outputs, Some(grads), None, options)?
        };
        Ok(Trainer {
            exec,
            input,
            target,
            output,
            loss,
            prediction,
            batch_size,
            in_features,
            out_features,
            criterion,
            model_description: model.describe(),
            optimizer,
            zero_grad_pending: false,
            forward_done: false,
            targets_done: false,
            backward_done: false,
        })
    }

    /// Where the step keeps the activations its backward reads: f16 only
    /// when asked for and the adapter has SHADER_F16.
    pub fn precision(&self) -> Precision {
        let f16 = self.exec.graph().nodes().iter().any(|n| n.dtype == DType::F16);
        if f16 { Precision::F16 } else { Precision::F32 }
    }

    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    pub fn model_description(&self) -> &str {
        &self.model_description
    }

    pub fn optimizer(&self) -> &OptimizerConfig {
        &self.optimizer
    }

    /// Clears the gradients at the start of the next step (`optimizer.zero_grad()`).
    /// Without it gradients accumulate across steps, as in PyTorch.
    pub fn zero_grad(&mut self) {
        self.zero_grad_pending = true;
    }

    /// Sets the batch, [batch_size, in_features] row-major (`model(x)`).
    pub fn forward(&mut self, x: &[f32]) -> Result<()> {
        self.exec.set_input(self.input, x)?;
        self.forward_done = true;
        Ok(())
    }

    /// Sets the batch, features or ids ([`Trainer::forward`] or
    /// [`Trainer::forward_ids`]).
    pub fn forward_examples(&mut self, x: Examples<'_>) -> Result<()> {
        match x {
            Examples::Features(f) => self.forward(f),
            Examples::Ids(ids) => self.forward_ids(ids),
        }
    }

    /// Sets a batch of token ids, [batch_size, sequence] row-major, for a
    /// model whose input is u32 ids (`model(idx)`).
    pub fn forward_ids(&mut self, ids: &[u32]) -> Result<()> {
        self.exec.set_labels(self.input, ids)?;
        self.forward_done = true;
        Ok(())
    }

    /// Sets what the loss compares against (`criterion(output, y)`).
    pub fn loss(&mut self, targets: Targets<'_>) -> Result<()> {
        match (self.criterion, targets) {
            (Criterion::Mse, Targets::Values(v)) => self.exec.set_input(self.target, v)?,
            (Criterion::CrossEntropy, Targets::Classes(c)) => self.exec.set_labels(self.target, c)?,
            (c, _) => {
                return Err(Error::InvalidArgument { op: "Trainer::loss", reason: format!("{c:?} loss got the other kind of targets") });
            }
        }
        self.targets_done = true;
        Ok(())
    }

    /// Marks the backward pass for this step (`loss.backward()`).
    pub fn backward(&mut self) -> Result<()> {
        if !(self.forward_done && self.targets_done) {
            return Err(Error::InvalidArgument { op: "backward", reason: "call forward() and loss() first".into() });
        }
        self.backward_done = true;
        Ok(())
    }

    fn submit(&mut self, read_loss: bool) -> Result<Option<f32>> {
        if !self.backward_done {
            return Err(Error::InvalidArgument { op: "step", reason: "call backward() before step()".into() });
        }
        let loss = self.exec.train_step(self.zero_grad_pending, true, read_loss)?;
        self.zero_grad_pending = false;
        self.forward_done = false;
        self.targets_done = false;
        self.backward_done = false;
        Ok(loss)
    }

    /// Forward and backward only, gradients zeroed first, no optimizer
    /// update (data parallel all-reduces the gradients in between). Returns
    /// the loss when `read_loss`.
    pub fn forward_backward(&mut self, read_loss: bool) -> Result<Option<f32>> {
        if !(self.forward_done && self.targets_done) {
            return Err(Error::InvalidArgument { op: "forward_backward", reason: "call forward() and loss() first".into() });
        }
        let loss = self.exec.train_step(true, false, read_loss)?;
        self.forward_done = false;
        self.targets_done = false;
        self.backward_done = false;
        self.zero_grad_pending = false;
        Ok(loss)
    }

    /// The loss of one batch without training on it (`model.eval()` with
    /// `torch.no_grad()`): forward and loss only, in one submission, then
    /// read back. Between steps only: it replaces a batch set with
    /// [`Trainer::forward`] and [`Trainer::loss`] and not yet stepped.
    pub fn evaluate_loss(&mut self, x: Examples<'_>, targets: Targets<'_>) -> Result<f32> {
        self.forward_examples(x)?;
        self.loss(targets)?;
        self.forward_done = false;
        self.targets_done = false;
        self.exec.run(&[self.loss])?;
        let value = self.exec.read(self.loss)?.first().copied().unwrap_or(f32::NAN);
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss { value, step: self.exec.step_count() });
        }
        Ok(value)
    }

    pub fn executor_mut(&mut self) -> &mut Executor {
        &mut self.exec
    }

    /// Runs the recorded step — forward, backward, optimizer update — as one
    /// GPU submission (`optimizer.step()`). Does not wait for the GPU.
    pub fn step(&mut self) -> Result<()> {
        self.submit(false).map(|_| ())
    }

    /// As [`Trainer::step`], also copying the loss back in the same
    /// submission; waits for it. A NaN or infinite loss is an error.
    pub fn step_reading_loss(&mut self) -> Result<f32> {
        self.submit(true)?.ok_or_else(|| Error::Readback { op: "step", message: "no loss came back".into() })
    }

    /// The loss of the last step (`loss.item()`); waits for the GPU.
    pub fn loss_item(&self) -> Result<f32> {
        let v = self.exec.read(self.loss)?;
        let value = v.first().copied().unwrap_or(f32::NAN);
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss { value, step: self.exec.step_count() });
        }
        Ok(value)
    }

    /// Model outputs for any number of rows of features (run in
    /// batch-sized chunks, the last one padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        chunked_outputs(&mut self.exec, (self.input, self.output), (self.batch_size, self.in_features, self.out_features), features)
    }

    /// The class with the largest output for each row (argmax).
    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        chunked_predictions(&mut self.exec, (self.input, self.prediction), (self.batch_size, self.in_features), features)
    }

    /// [`Trainer::predict`] or [`Trainer::predict_ids`].
    pub fn predict_examples(&mut self, x: Examples<'_>) -> Result<Vec<u32>> {
        match x {
            Examples::Features(f) => self.predict(f),
            Examples::Ids(ids) => self.predict_ids(ids),
        }
    }

    /// The argmax over the last output dimension for every position of
    /// every sequence of token `ids` (run in batch-sized chunks).
    pub fn predict_ids(&mut self, ids: &[u32]) -> Result<Vec<u32>> {
        chunked_predictions(&mut self.exec, (self.input, self.prediction), (self.batch_size, self.in_features), ids)
    }

    /// Parameters (state_dict names), optimizer state (`optim.<param>.<state>`)
    /// and metadata (model, optimizer, criterion, step).
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        let about = CheckpointAbout { model: &self.model_description, criterion: self.criterion, optimizer: &self.optimizer, step: self.exec.step_count(), loss_scale: self.exec.read_loss_scale()? };
        assemble_checkpoint(self.exec.parameters()?, self.exec.optimizer_state()?, &about)
    }

    /// Writes [`Trainer::checkpoint`] atomically as safetensors.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        checkpoint::save(path, &self.checkpoint()?)
    }

    /// Restores parameters, optimizer state (when the checkpoint's optimizer
    /// is the same kind) and the step count. Every name and shape is checked
    /// before anything on the GPU changes.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let ckpt = checkpoint::load(path)?;
        check_model(&ckpt, &self.model_description)?;
        let params = checked_parameters(&ckpt, &self.exec)?;
        let kind = |d: &str| d.split_whitespace().next().unwrap_or_default().to_string();
        let ours = optim::describe(&self.optimizer);
        let same_optimizer = ckpt.meta("optimizer").map(kind) == Some(kind(&ours));
        let mut state = Vec::new();
        if same_optimizer {
            for t in ckpt.tensors.iter().filter(|t| t.name.starts_with("optim.")) {
                let rest = &t.name["optim.".len()..];
                let Some((param, state_name)) = rest.rsplit_once('.') else { continue };
                state.push((param.to_string(), state_name.to_string(), t.data.clone()));
            }
        } else {
            log::warn!("checkpoint optimizer {:?} differs from {ours:?}: loading parameters only", ckpt.meta("optimizer"));
        }
        // The step count only means something with the moments it belongs
        // to: without complete state, start the optimizer afresh.
        let names = self.exec.optimizer_state_names();
        let complete = same_optimizer
            && params.iter().all(|(p, _, _)| names.iter().all(|n| state.iter().any(|(sp, sn, _)| sp == p && sn == n)));
        if !complete {
            state.clear();
        }
        let step = ckpt.meta("step").and_then(|s| s.parse::<u64>().ok());
        // Read before anything on the GPU changes: corrupt metadata loses nothing.
        let scale = if complete { optim::LossScaleState::from_metadata(|key| ckpt.meta(key))? } else { None };
        self.exec.load_state(&params, &state, if complete { step } else { None })?;
        match scale {
            Some(scale) => self.exec.load_loss_scale(&scale),
            None => Ok(()),
        }
    }
}

/// What a checkpoint's metadata says besides its tensors.
pub(crate) struct CheckpointAbout<'a> {
    pub model: &'a str,
    pub criterion: Criterion,
    pub optimizer: &'a OptimizerConfig,
    pub step: u64,
    /// Dynamic loss scaling's state, written beside the rest (f16 runs).
    pub loss_scale: Option<optim::LossScaleState>,
}

/// A checkpoint of parameters (state_dict names), optimizer state
/// (`optim.<param>.<state>`, shaped as its parameter) and metadata, from
/// whatever holds them (one executor, or shards gathered to the host).
pub(crate) fn assemble_checkpoint(params: Vec<(String, Vec<usize>, Vec<f32>)>, state: Vec<(String, &'static str, Vec<f32>)>, about: &CheckpointAbout<'_>) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint::new();
    let shapes: Vec<(String, Vec<usize>)> = params.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
    for (name, shape, data) in params {
        ckpt.push(NamedTensor::new(name, shape, data)?);
    }
    for (param, state, data) in state {
        let shape = shapes.iter().find(|(n, _)| *n == param).map(|(_, s)| s.clone()).unwrap_or_else(|| vec![data.len()]);
        ckpt.push(NamedTensor::new(format!("optim.{param}.{state}"), shape, data)?);
    }
    ckpt.set_meta("format", "wgrad");
    ckpt.set_meta("model", about.model.to_string());
    ckpt.set_meta("criterion", format!("{:?}", about.criterion));
    ckpt.set_meta("optimizer", optim::describe(about.optimizer));
    ckpt.set_meta("step", about.step.to_string());
    for (key, value) in about.loss_scale.iter().flat_map(optim::LossScaleState::metadata) {
        ckpt.set_meta(key, value);
    }
    Ok(ckpt)
}

/// Runs `run_chunk` over batch-sized chunks of `examples` (the last one
/// zero-padded) and concatenates what it returns for the real rows.
pub(crate) fn in_chunks<T: bytemuck::Pod + Default, R>(
    exec: &mut Executor,
    input: Tensor,
    batch_size: usize,
    in_features: usize,
    examples: &[T],
    mut run_chunk: impl FnMut(&mut Executor, usize) -> Result<Vec<R>>,
) -> Result<Vec<R>> {
    if examples.is_empty() || examples.len() % in_features != 0 {
        return Err(Error::shape("predict", format!("inputs must be rows × {in_features}"), &[&[examples.len()]]));
    }
    let rows = examples.len() / in_features;
    let mut out = Vec::with_capacity(rows);
    let mut chunk = vec![T::default(); batch_size * in_features];
    let is_ids = exec.graph().get(input).is_some_and(|n| n.dtype == DType::U32);
    for start in (0..rows).step_by(batch_size) {
        let n = (rows - start).min(batch_size);
        chunk.fill(T::default());
        chunk[..n * in_features].copy_from_slice(&examples[start * in_features..(start + n) * in_features]);
        if is_ids {
            exec.set_labels(input, bytemuck::cast_slice(&chunk))?;
        } else {
            exec.set_input(input, bytemuck::cast_slice(&chunk))?;
        }
        out.extend(run_chunk(exec, n)?);
    }
    Ok(out)
}

/// Outputs of `output` for every example, batch by batch.
pub(crate) fn chunked_outputs<T: bytemuck::Pod + Default>(exec: &mut Executor, (input, output): (Tensor, Tensor), (batch, in_features, width): (usize, usize, usize), features: &[T]) -> Result<Vec<f32>> {
    in_chunks(exec, input, batch, in_features, features, |exec, n| {
        exec.run(&[output])?;
        Ok(exec.read(output)?[..n * width].to_vec())
    })
}

/// The argmax node's values for every example, batch by batch.
pub(crate) fn chunked_predictions<T: bytemuck::Pod + Default>(exec: &mut Executor, (input, prediction): (Tensor, Tensor), (batch, in_features): (usize, usize), examples: &[T]) -> Result<Vec<u32>> {
    let per_example = exec.graph().get(prediction).map_or(0, |n| n.len()) / batch.max(1);
    in_chunks(exec, input, batch, in_features, examples, |exec, n| {
        exec.run(&[prediction])?;
        Ok(exec.read_u32(prediction)?[..n * per_example].to_vec())
    })
}

pub(crate) fn check_model(ckpt: &Checkpoint, description: &str) -> Result<()> {
    match ckpt.meta("model") {
        Some(m) if m != description => Err(Error::InvalidArgument {
            op: "load checkpoint",
            reason: format!("the checkpoint holds `{m}`, the model is `{description}`"),
        }),
        _ => Ok(()),
    }
}

pub(crate) fn checked_parameters(ckpt: &Checkpoint, exec: &Executor) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
    exec.parameters_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let t = ckpt.get_checked(&name, &shape)?;
            Ok((name, shape, t.data.clone()))
        })
        .collect()
}

/// Fraction of `predictions` equal to `labels`.
pub fn accuracy(predictions: &[u32], labels: &[u32]) -> f32 {
    if labels.is_empty() {
        return 0.0;
    }
    let right = predictions.iter().zip(labels).filter(|(p, l)| p == l).count();
    right as f32 / labels.len() as f32
}
