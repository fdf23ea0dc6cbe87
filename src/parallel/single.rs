//! The single-device engine, beside the engines over several devices: the
//! training loop as PyTorch users write it, over a define-then-run graph:
//!
//! ```no_run
//! # fn main() -> wgrad::Result<()> {
//! use std::sync::Arc;
//! use wgrad::nn::{Layer, Linear, MSELoss, Sequential};
//! use wgrad::optim::SGD;
//! use wgrad::{Targets, Trainer};
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

use super::examples::{Examples, Targets};
use crate::error::{Error, Result};
use crate::graph::{chunked_outputs, chunked_predictions, DType, Executor, PlanOptions, Precision, Tensor};
use crate::io::checkpoint::{self, Checkpoint};
use crate::io::state_dict::{assemble_checkpoint, check_model, checked_parameters, CheckpointAbout};
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{training_graph_with_passes, Built, Criterion, Module, Staged, TrainingGraph};
use crate::optim;

/// One model training on one device: its step's executor (with the
/// optimizer), and what the batch, loss and checkpoints need of the model.
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
        Self::build(
            kernels,
            model,
            None,
            criterion.into(),
            optimizer.into(),
            batch_size,
            options,
            true,
        )
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
        Self::build(
            kernels,
            model,
            Some(model),
            criterion.into(),
            optimizer.into(),
            batch_size,
            options,
            true,
        )
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
        Self::build(
            kernels,
            model,
            Some(model),
            criterion.into(),
            optimizer.into(),
            batch_size,
            options,
            false,
        )
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
        let t = training_graph_with_passes(
            model,
            staged,
            criterion,
            batch_size,
            options.checkpoint_activations,
            f16,
        )?;
        let outputs = t.outputs();
        let TrainingGraph {
            graph: mut g,
            built:
                Built {
                    input,
                    output,
                    in_per_example: in_features,
                    out_per_example: out_features,
                },
            target,
            loss,
            prediction,
            grads,
        } = t;
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
        if f16 {
            Precision::F16
        } else {
            Precision::F32
        }
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
                return Err(Error::InvalidArgument {
                    op: "Trainer::loss",
                    reason: format!("{c:?} loss got the other kind of targets"),
                });
            }
        }
        self.targets_done = true;
        Ok(())
    }

    /// Marks the backward pass for this step (`loss.backward()`).
    pub fn backward(&mut self) -> Result<()> {
        if !(self.forward_done && self.targets_done) {
            return Err(Error::InvalidArgument {
                op: "backward",
                reason: "call forward() and loss() first".into(),
            });
        }
        self.backward_done = true;
        Ok(())
    }

    fn submit(&mut self, read_loss: bool) -> Result<Option<f32>> {
        crate::device::wait("step", self.submit_async(read_loss))
    }

    async fn submit_async(&mut self, read_loss: bool) -> Result<Option<f32>> {
        if !self.backward_done {
            return Err(Error::InvalidArgument {
                op: "step",
                reason: "call backward() before step()".into(),
            });
        }
        let loss = self
            .exec
            .train_step_async(self.zero_grad_pending, true, read_loss)
            .await?;
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
            return Err(Error::InvalidArgument {
                op: "forward_backward",
                reason: "call forward() and loss() first".into(),
            });
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
        crate::device::wait("evaluate_loss", self.evaluate_loss_async(x, targets))
    }

    /// [`Trainer::evaluate_loss`], awaited.
    pub async fn evaluate_loss_async(&mut self, x: Examples<'_>, targets: Targets<'_>) -> Result<f32> {
        self.forward_examples(x)?;
        self.loss(targets)?;
        self.forward_done = false;
        self.targets_done = false;
        self.exec.run(&[self.loss])?;
        let value = self
            .exec
            .read_async(self.loss)
            .await?
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
        crate::device::wait("step", self.step_reading_loss_async())
    }

    /// [`Trainer::step_reading_loss`], awaited: the step is submitted when
    /// the future is first polled, and only the loss's read-back waits.
    pub async fn step_reading_loss_async(&mut self) -> Result<f32> {
        self.submit_async(true).await?.ok_or_else(|| Error::Readback {
            op: "step",
            message: "no loss came back".into(),
        })
    }

    /// The loss of the last step (`loss.item()`); waits for the GPU.
    pub fn loss_item(&self) -> Result<f32> {
        crate::device::wait("loss_item", self.loss_item_async())
    }

    /// [`Trainer::loss_item`], awaited.
    pub async fn loss_item_async(&self) -> Result<f32> {
        let v = self.exec.read_async(self.loss).await?;
        let value = v.first().copied().unwrap_or(f32::NAN);
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                value,
                step: self.exec.step_count(),
            });
        }
        Ok(value)
    }

    /// Model outputs for any number of rows of features (run in
    /// batch-sized chunks, the last one padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        chunked_outputs(
            &mut self.exec,
            (self.input, self.output),
            (self.batch_size, self.in_features, self.out_features),
            features,
        )
    }

    /// The class with the largest output for each row (argmax).
    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        chunked_predictions(
            &mut self.exec,
            (self.input, self.prediction),
            (self.batch_size, self.in_features),
            features,
        )
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
        chunked_predictions(
            &mut self.exec,
            (self.input, self.prediction),
            (self.batch_size, self.in_features),
            ids,
        )
    }

    /// Parameters (state_dict names), optimizer state (`optim.<param>.<state>`)
    /// and metadata (model, optimizer, criterion, step).
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        let about = CheckpointAbout {
            model: &self.model_description,
            criterion: self.criterion,
            optimizer: &self.optimizer,
            step: self.exec.step_count(),
            loss_scale: self.exec.read_loss_scale()?,
        };
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
        let params = checked_parameters(&ckpt, self.exec.parameters_shapes())?;
        let kind = |d: &str| d.split_whitespace().next().unwrap_or_default().to_string();
        let ours = optim::describe(&self.optimizer);
        let same_optimizer = ckpt.meta("optimizer").map(kind) == Some(kind(&ours));
        let mut state = Vec::new();
        if same_optimizer {
            for t in ckpt.tensors.iter().filter(|t| t.name.starts_with("optim.")) {
                let rest = &t.name["optim.".len()..];
                let Some((param, state_name)) = rest.rsplit_once('.') else {
                    continue;
                };
                state.push((param.to_string(), state_name.to_string(), t.data.clone()));
            }
        } else {
            log::warn!(
                "checkpoint optimizer {:?} differs from {ours:?}: loading parameters only",
                ckpt.meta("optimizer")
            );
        }
        // The step count only means something with the moments it belongs
        // to: without complete state, start the optimizer afresh.
        let names = self.exec.optimizer_state_names();
        let complete = same_optimizer
            && params
                .iter()
                .all(|(p, _, _)| names.iter().all(|n| state.iter().any(|(sp, sn, _)| sp == p && sn == n)));
        if !complete {
            state.clear();
        }
        let step = ckpt.meta("step").and_then(|s| s.parse::<u64>().ok());
        // Read before anything on the GPU changes: corrupt metadata loses nothing.
        let scale = if complete {
            optim::LossScaleState::from_metadata(|key| ckpt.meta(key))?
        } else {
            None
        };
        self.exec
            .load_state(&params, &state, if complete { step } else { None })?;
        match scale {
            Some(scale) => self.exec.load_loss_scale(&scale),
            None => Ok(()),
        }
    }
}
