//! The one training run, as `wgrad train` performs it for every model: the
//! data (read by rank 0 and shared across processes), the devices and the
//! parallel strategy, resuming, the loop over steps, evaluation and saving
//! at the end. What is trained on what is a [`Task`]: the digits
//! [`Classifier`] here, a causal language model on text in
//! [`crate::train`]. The caller parses and prints: progress comes
//! back through [`Progress`], the result as a [`Summary`].
//!
//! It sits above [`crate::parallel`]: it builds a [`TrainEngine`] with
//! [`Strategy::build`] and drives it only through that trait.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::device::{Device, DeviceOptions};
use crate::error::{Error, Result};
use crate::graph::{PlanOptions, Precision};
use crate::io::gpt_folder::OptimizerState;
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{self, CrossEntropyLoss, Module};
use crate::optim::{self, Adam};
use crate::optim::{LossScaleState, LossScaling};
#[cfg(feature = "fault-injection")]
use crate::parallel::distributed::InjectedFailure;
use crate::parallel::distributed::ProcessGroup;
use crate::parallel::engine::{EngineFuture, Footprint, Holding, Parallelizable, Strategy, TrainEngine};
use crate::parallel::memory::DeviceMemory;
use crate::parallel::pipeline::Schedule;
use crate::parallel::stage::NamedParameters;
use crate::parallel::{DeviceGroup, DeviceSelection};
use crate::parallel::{Examples, Targets};

/// How to train, whatever the task. [`Default`] gives `wgrad train --model
/// mlp`'s run; [`crate::train::language_model_run`] the language
/// model's.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The global batch (across every device and process).
    pub batch_size: usize,
    /// The task's step count otherwise (the classifier's epochs; the
    /// language model's last step).
    pub max_steps: Option<u64>,
    pub optimizer: OptimizerConfig,
    /// Seeds the parameters, the data split and the batch order.
    pub seed: u64,
    /// Read the loss back every this many steps (and at the last step);
    /// other steps never wait for the GPU.
    pub loss_every: u64,
    /// The task's validation loss every this many steps and after the
    /// last (tasks that have one).
    pub eval_every: u64,
    /// Continue from what [`TrainingRun::save`] wrote: parameters,
    /// optimizer state, step. Across processes only rank 0 reads it.
    pub resume: Option<PathBuf>,
    /// Where rank 0 saves at the end; `None` saves nothing.
    pub save: Option<PathBuf>,
    /// `None`: one device, or data parallel across processes.
    pub strategy: Option<Strategy>,
    /// `None`: the default device for a single device, one adapter per
    /// process across processes, otherwise `WGRAD_DEVICES` or 2 devices.
    pub devices: Option<DeviceSelection>,
    /// Data parallel: fixed rows per device instead of the measured split;
    /// across processes, rows per process.
    pub split: Option<Vec<usize>>,
    /// Pipeline micro-batches per step (dividing the batch).
    pub micro_batches: usize,
    /// Pipeline: GPipe or 1F1B.
    pub schedule: Schedule,
    /// Where a step keeps the activations its backward reads
    /// ([`crate::graph::precision`]); f16 (one device) also scales the
    /// loss dynamically with `loss_scaling`. An adapter without SHADER_F16
    /// trains in f32 ([`RunInfo::precision`] says which).
    pub precision: Precision,
    /// The loss scaling of an f16 run (GradScaler's defaults).
    pub loss_scaling: LossScaling,
    /// Recompute each block's forward in its backward (one device).
    pub checkpoint_activations: bool,
    /// Testing the failure path: (rank, step, how) fails that rank at that
    /// step of a run across processes.
    #[cfg(feature = "fault-injection")]
    pub fail_at: Option<(usize, u64, InjectedFailure)>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 32,
            max_steps: None,
            optimizer: Adam::new(2e-3).into(),
            seed: 0,
            loss_every: 10,
            eval_every: 125,
            resume: None,
            save: None,
            strategy: None,
            devices: None,
            split: None,
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            precision: Precision::F32,
            loss_scaling: LossScaling::default(),
            checkpoint_activations: false,
            #[cfg(feature = "fault-injection")]
            fail_at: None,
        }
    }
}

/// What [`Task::prepare`] hands the run: the model to train and, on the
/// rank that read it, the state to resume from.
pub struct Prepared<M> {
    pub model: M,
    pub resumed: Option<Resumed>,
}

/// Parameters (empty when the model was built from them) and optimizer
/// state read from a save.
pub struct Resumed {
    pub parameters: NamedParameters,
    pub state: OptimizerState,
}

/// The task's verdict at the end of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Evaluation {
    /// A classifier's share of correct predictions on each split.
    Accuracy { train: f32, test: f32 },
    /// A language model's mean loss on held-out text.
    ValidationLoss(f32),
}

/// What is trained on what: the data, the model, batches, evaluation and
/// saving. The run does the rest, the same for every task.
pub trait Task {
    type Model: Parallelizable;
    /// What the loss rate counts (`samples`, `tokens`).
    const UNIT: &'static str;

    /// Reads the data (rank 0 reads and shares it across `processes`),
    /// builds the model (parameters seeded by the run) and, on rank 0,
    /// reads `config.resume`.
    fn prepare(&mut self, config: &TrainConfig, processes: Option<&dyn ProcessGroup>) -> Result<Prepared<Self::Model>>;
    /// The model of these sizes before the data is read, where the task
    /// can build it (a stand-in vocabulary), so device counts the model
    /// cannot split are refused before the data is read.
    fn model_before_data(&self) -> Result<Option<Self::Model>> {
        Ok(None)
    }
    /// Fits the model's kernel choices to the devices it will train on
    /// (attention fused or not); nothing by default.
    fn suit_devices(&self, _model: &mut Self::Model, _devices: &[Arc<Kernels>]) {}
    /// One line on the data, for the caller to print.
    fn describe_data(&self) -> String;
    /// The last step of a run whose first is `first_step`.
    fn last_step(&self, config: &TrainConfig, first_step: u64) -> Result<u64>;
    /// Units of [`Self::UNIT`] in one step.
    fn per_step(&self, config: &TrainConfig) -> usize;
    /// Positions the data after the steps a resumed run already took.
    fn skip(&mut self, _config: &TrainConfig, _steps: u64) -> Result<()> {
        Ok(())
    }
    /// The next global batch.
    fn batch(&mut self, config: &TrainConfig) -> Result<(Examples<'_>, Targets<'_>)>;
    /// The loss on held-out data, for tasks that track one during the run
    /// (collective across processes).
    fn validation_loss(&mut self, _engine: &mut dyn TrainEngine, _config: &TrainConfig) -> Result<Option<f32>> {
        Ok(None)
    }
    /// [`Task::validation_loss`], awaited (what a browser calls); a task
    /// without an async form runs its blocking one.
    fn validation_loss_async<'a>(
        &'a mut self,
        engine: &'a mut dyn TrainEngine,
        config: &'a TrainConfig,
    ) -> EngineFuture<'a, Option<f32>> {
        Box::pin(async move { self.validation_loss(engine, config) })
    }
    /// The verdict at the end, on rank 0; `last_validation` is the
    /// validation loss of the last step, where the task has one.
    fn evaluate(&mut self, engine: &mut dyn TrainEngine, last_validation: Option<f32>) -> Result<Evaluation>;
    /// Writes what the run trained to `path`, for inference and resuming.
    fn save(
        &self,
        engine: &dyn TrainEngine,
        model: &Self::Model,
        config: &TrainConfig,
        evaluation: Option<&Evaluation>,
        path: &Path,
    ) -> Result<()>;
}

/// What a prepared run is about to do, for the caller to print.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// What the run resumed from.
    pub resumed_from: Option<PathBuf>,
    /// This process's devices, `#i name (backend)` each.
    pub devices: Vec<String>,
    /// How the work is spread.
    pub engine: String,
    pub model: String,
    pub parameters: usize,
    pub optimizer: String,
    pub batch_size: usize,
    pub data: String,
    /// 1, or the step after a resumed run's.
    pub first_step: u64,
    /// The last step.
    pub steps: u64,
    /// What a step's work counts (`samples`, `tokens`) and how many.
    pub unit: &'static str,
    pub per_step: usize,
    pub footprint: Footprint,
    /// Bytes of the device holding the most, by what they hold.
    pub memory: DeviceMemory,
    /// The precision the run trains in: f32 where f16 was asked for on an
    /// adapter without SHADER_F16.
    pub precision: Precision,
    /// Why it is not the precision asked for, when it is not.
    pub precision_note: Option<String>,
    /// Bytes of activations a step holds from forward to backward
    /// (`Plan::held_activation_bytes`): a replica's, or the stages' on the
    /// fullest device.
    pub held_activation_bytes: Option<u64>,
}

/// Where a run reports progress. Only rank 0 of a run across processes
/// reports. Every method defaults to nothing.
pub trait Progress {
    /// Devices are open and the engine is being built: its pipelines may
    /// compile for seconds.
    fn preparing(&mut self) {}
    /// The engine is built (and resumed); steps follow.
    fn started(&mut self, _info: &RunInfo) {}
    /// The loss read back at `step`, and units ([`RunInfo::unit`]) per
    /// second so far.
    fn loss(&mut self, _step: u64, _loss: f32, _per_s: f64) {}
    /// The validation loss after `step`.
    fn validation(&mut self, _step: u64, _loss: f32) {}
    /// The data-parallel split changed at `step`; `engine` describes it.
    fn rebalanced(&mut self, _step: u64, _engine: &str) {}
    /// `step` is queued.
    fn step(&mut self, _step: u64) {}
    /// Every step has run and the devices are idle; evaluation follows.
    fn trained(&mut self) {}
}

/// No progress reports.
impl Progress for () {}

/// The result of a run, on rank 0.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Steps this run took.
    pub steps: u64,
    /// Time in training steps (validation excluded), the first included.
    pub seconds: f64,
    /// Units ([`RunInfo::unit`]) per second.
    pub per_s: f64,
    pub ms_per_step: f64,
    /// The first step's time alone, to the devices' end of it: it builds
    /// and compiles what the engine's build left (pipelines that compile
    /// at their first dispatch, the plan's first use), so a run's rate is
    /// the other steps'.
    pub first_step_seconds: f64,
    /// (step, loss) wherever the training loss was read.
    pub train_curve: Vec<(u64, f32)>,
    /// (step, loss) of every validation.
    pub validation_curve: Vec<(u64, f32)>,
    pub evaluation: Evaluation,
    /// What the engine's parallelism cost (empty for a single device).
    pub report: String,
    pub model: String,
    /// Where the run saved, if anywhere.
    pub saved: Option<PathBuf>,
    /// Dynamic loss scaling's state at the end (an f16 run).
    pub loss_scale: Option<LossScaleState>,
}

/// A run with its data loaded, devices open and engine built (and
/// resumed), ready to [`fit`](Self::fit).
pub struct TrainingRun<T: Task> {
    config: TrainConfig,
    task: T,
    model: T::Model,
    group: DeviceGroup,
    engine: Box<dyn TrainEngine>,
    root: bool,
    info: RunInfo,
}

impl<T: Task> TrainingRun<T> {
    /// Prepares `task`, checks the device count against the strategy,
    /// opens the devices, builds the engine and resumes. Across the
    /// processes of `processes` the run is data parallel, and every rank
    /// calls this and [`fit`](Self::fit).
    pub fn new(
        device: &DeviceOptions,
        config: TrainConfig,
        task: T,
        processes: Option<Arc<dyn ProcessGroup>>,
        progress: &mut dyn Progress,
    ) -> Result<Self> {
        let strategy = Self::strategy(&config, processes.is_some())?;
        let selection = match (&config.devices, strategy) {
            (Some(d), _) => Some(d.clone()),
            (None, Strategy::Single) => None,
            (None, _) if processes.is_some() => None,
            (None, _) => Some(DeviceSelection::from_env(DeviceSelection::Count(2))?),
        };
        // A device count that cannot work fails before devices open one by
        // one (minutes for a large count).
        let count = selection.as_ref().map(DeviceSelection::check).transpose()?;
        Self::build(config, task, processes, progress, count, |_| match &selection {
            Some(selection) => DeviceGroup::open(selection),
            None => DeviceGroup::from_kernels(vec![Arc::new(Kernels::new(Device::open(device)?))]),
        })
    }

    /// [`TrainingRun::new`] on devices already open.
    pub fn with_devices(
        group: DeviceGroup,
        config: TrainConfig,
        task: T,
        processes: Option<Arc<dyn ProcessGroup>>,
        progress: &mut dyn Progress,
    ) -> Result<Self> {
        let count = if Self::strategy(&config, processes.is_some())? == Strategy::Single {
            None
        } else {
            Some(group.len())
        };
        Self::build(config, task, processes, progress, count, |_| Ok(group))
    }

    /// [`TrainingRun::new`] on one device already open.
    pub fn with_kernels(
        kernels: Arc<Kernels>,
        config: TrainConfig,
        task: T,
        progress: &mut dyn Progress,
    ) -> Result<Self> {
        Self::with_devices(DeviceGroup::from_kernels(vec![kernels])?, config, task, None, progress)
    }

    fn strategy(config: &TrainConfig, across_processes: bool) -> Result<Strategy> {
        let strategy = config.strategy.unwrap_or(if across_processes {
            Strategy::Data
        } else {
            Strategy::Single
        });
        if across_processes && !matches!(strategy, Strategy::Data | Strategy::Zero(_)) {
            return Err(Error::InvalidArgument {
                op: "train --distributed",
                reason: "across processes wgrad trains data parallel or ZeRO: use --parallel data or zero".into(),
            });
        }
        if config.batch_size == 0 || config.max_steps == Some(0) || config.loss_every == 0 || config.eval_every == 0 {
            return Err(Error::InvalidArgument {
                op: "train",
                reason: format!(
                    "batch size {}, steps {:?}, loss_every and eval_every must be positive",
                    config.batch_size, config.max_steps
                ),
            });
        }
        Ok(strategy)
    }

    fn build(
        config: TrainConfig,
        mut task: T,
        processes: Option<Arc<dyn ProcessGroup>>,
        progress: &mut dyn Progress,
        devices: Option<usize>,
        open: impl FnOnce(()) -> Result<DeviceGroup>,
    ) -> Result<Self> {
        let strategy = Self::strategy(&config, processes.is_some())?;
        let root = processes.as_ref().is_none_or(|g| g.rank() == 0);
        // Across processes the split holds rows per process, which the
        // engine checks once the job's size is known.
        let split = if processes.is_some() {
            None
        } else {
            config.split.as_deref()
        };
        if let Some(count) = devices {
            strategy.check_counts(count, config.batch_size, split, config.micro_batches)?;
            // Only tensor and pipeline parallel ask the model whether it
            // splits; the others need no stand-in built.
            if matches!(strategy, Strategy::Tensor | Strategy::Pipeline) {
                if let Some(model) = task.model_before_data()? {
                    strategy.check_devices(count, &model, config.batch_size, split, config.micro_batches)?;
                }
            }
        }
        nn::manual_seed(config.seed);
        let Prepared { mut model, resumed } = task.prepare(&config, processes.as_deref())?;
        if let Some(count) = devices {
            strategy.check_devices(count, &model, config.batch_size, split, config.micro_batches)?;
        }
        let group = open(())?;
        task.suit_devices(&mut model, group.members());
        if root {
            progress.preparing();
        }
        // f16 where every device has SHADER_F16, so replicas and stages
        // compute alike; f32 everywhere otherwise (the run says so).
        let mut f16 = config.precision == Precision::F16 && group.members().iter().all(|k| k.supports_f16());
        // Across processes too: a rank in f32 would add unscaled gradients
        // to the others' scaled ones.
        if let (Some(g), Precision::F16) = (&processes, config.precision) {
            let mut ranks_with_f16 = [f64::from(u8::from(f16))];
            g.all_reduce_sum(&mut ranks_with_f16)?;
            f16 = ranks_with_f16[0] as usize == g.size();
        }
        let optimizer = if f16 {
            config.optimizer.with_loss_scaling(Some(config.loss_scaling))
        } else {
            config.optimizer
        };
        let precision = if f16 { Precision::F16 } else { Precision::F32 };
        let options = PlanOptions {
            precision,
            checkpoint_activations: config.checkpoint_activations,
            ..PlanOptions::default()
        };
        #[allow(unused_mut)]
        let mut engine: Box<dyn TrainEngine> = strategy.build(
            &group,
            processes,
            &model,
            CrossEntropyLoss.into(),
            optimizer,
            config.batch_size,
            config.micro_batches,
            config.schedule,
            config.split.clone(),
            options,
        )?;
        #[cfg(feature = "fault-injection")]
        if let Some((rank, step, how)) = config.fail_at {
            engine.inject_failure(rank, step, how);
        }
        if let Some(r) = &resumed {
            let scale = LossScaleState::from_metadata(|key| r.state.metadata.get(key).map(String::as_str))?;
            engine.load_state(&r.parameters, &r.state.state, Some(r.state.step))?;
            if let Some(scale) = scale {
                engine.load_loss_scale(&scale)?;
            }
        }
        if config.resume.is_some() {
            engine.sync_from_root()?;
        }
        let first_step = engine.step_count() + 1;
        task.skip(&config, first_step - 1)?;
        let info = RunInfo {
            resumed_from: config.resume.clone(),
            devices: group.labels(),
            engine: engine.describe(),
            model: model.describe(),
            parameters: model.num_parameters(),
            optimizer: optim::describe(&config.optimizer),
            batch_size: config.batch_size,
            data: task.describe_data(),
            first_step,
            steps: task.last_step(&config, first_step)?,
            unit: T::UNIT,
            per_step: task.per_step(&config),
            footprint: engine.footprint(),
            memory: engine.memory(),
            precision: if f16 { Precision::F16 } else { Precision::F32 },
            held_activation_bytes: match engine.holding() {
                Holding::Replica(t) => Some(t.executor().plan().held_activation_bytes),
                // A stage's executor holds one micro-batch's (one
                // segment's): the stages on each device added up.
                Holding::Stages(spread, stages) => {
                    let mut per_device = std::collections::HashMap::<usize, u64>::new();
                    for (&device, stage) in spread.devices().iter().zip(stages) {
                        *per_device.entry(device).or_default() += stage.executor().plan().held_activation_bytes;
                    }
                    per_device.into_values().max()
                }
            },
            precision_note: (config.precision == Precision::F16 && !f16).then(|| {
                let without: Vec<String> = group
                    .members()
                    .iter()
                    .zip(group.labels())
                    .filter(|(k, _)| !k.supports_f16())
                    .map(|(_, label)| label)
                    .collect();
                let without = if without.is_empty() {
                    "a device of another process".to_string()
                } else {
                    without.join(", ")
                };
                format!("--precision f16: {without} has no SHADER_F16, so this run trains in f32")
            }),
        };
        Ok(TrainingRun {
            config,
            task,
            model,
            group,
            engine,
            root,
            info,
        })
    }

    pub fn info(&self) -> &RunInfo {
        &self.info
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    pub fn task(&self) -> &T {
        &self.task
    }

    pub fn engine(&self) -> &dyn TrainEngine {
        self.engine.as_ref()
    }

    /// The model as built, before training.
    pub fn model(&self) -> &T::Model {
        &self.model
    }

    /// The first device (where a caller samples or predicts).
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.group.members()[0]
    }

    /// The task's validation loss now (collective across processes).
    pub fn validation_loss(&mut self) -> Result<Option<f32>> {
        self.task.validation_loss(self.engine.as_mut(), &self.config)
    }

    /// The next step: the task's next batch and the engine's step, with
    /// its loss when `read_loss` (waiting for it); [`TrainingRun::fit`]
    /// takes its steps so.
    pub fn step(&mut self, read_loss: bool) -> Result<Option<f32>> {
        crate::device::wait("TrainingRun::step", self.step_async(read_loss))
    }

    /// [`TrainingRun::step`], awaited: the task's next batch and the engine's
    /// step, with its loss when `read_loss`. What a page drives one step
    /// at a time ([`TrainingRun::fit`] runs the same steps, blocking);
    /// validation is the caller's ([`TrainingRun::validation_loss_async`]).
    pub async fn step_async(&mut self, read_loss: bool) -> Result<Option<f32>> {
        let (x, y) = self.task.batch(&self.config)?;
        self.engine.step_async(x, y, read_loss).await
    }

    /// Every parameter as trained so far ([`TrainEngine::parameters`]),
    /// awaited: one device's are read back without blocking; an engine
    /// over several devices gathers them with its blocking form.
    pub async fn parameters_async(&self) -> Result<NamedParameters> {
        match self.engine.holding() {
            Holding::Replica(trainer) => trainer.executor().parameters_async().await,
            Holding::Stages(..) => self.engine.parameters(),
        }
    }

    /// [`TrainingRun::validation_loss`], awaited.
    pub async fn validation_loss_async(&mut self) -> Result<Option<f32>> {
        self.task
            .validation_loss_async(self.engine.as_mut(), &self.config)
            .await
    }

    /// Writes what the run trained so far to `path` (the task's format).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.task
            .save(self.engine.as_ref(), &self.model, &self.config, None, path)
    }

    /// Runs every step (the validation loss every `eval_every` and after
    /// the last), waits for the devices, and on rank 0 evaluates and saves
    /// to `config.save`. Other ranks return `None` once their steps are done.
    pub fn fit(&mut self, progress: &mut dyn Progress) -> Result<Option<Summary>> {
        let root = self.root;
        // Only rank 0 reports.
        let mut silent = ();
        let progress: &mut dyn Progress = if root { progress } else { &mut silent };
        progress.started(&self.info);
        let (first, last) = (self.info.first_step, self.info.steps);
        let per_step = self.info.per_step as f64;
        let (mut train_curve, mut validation_curve) = (Vec::new(), Vec::new());
        let (mut seconds, mut first_step_seconds) = (0.0f64, 0.0f64);
        let mut last_shares = self.engine.shares();
        let mut last_validation = None;
        for step in first..=last {
            let started = Instant::now();
            let read = step % self.config.loss_every == 0 || step == last;
            let loss = self.step(read)?;
            if step == first {
                // Timed to its end on the devices, apart from the rest.
                for k in self.group.members() {
                    k.device().wait_idle("train")?;
                }
                first_step_seconds = started.elapsed().as_secs_f64();
            }
            seconds += started.elapsed().as_secs_f64();
            if let Some(loss) = loss {
                train_curve.push((step, loss));
                progress.loss(step, loss, (step + 1 - first) as f64 * per_step / seconds.max(1e-9));
            }
            let shares = self.engine.shares();
            if shares != last_shares {
                progress.rebalanced(step, &self.engine.describe());
                last_shares = shares;
            }
            progress.step(step);
            if step % self.config.eval_every == 0 || step == last {
                if let Some(loss) = self.task.validation_loss(self.engine.as_mut(), &self.config)? {
                    validation_curve.push((step, loss));
                    last_validation = Some(loss);
                    progress.validation(step, loss);
                }
            }
        }
        // The steps' time runs to the devices' end of the last.
        let drained = Instant::now();
        for k in self.group.members() {
            k.device().wait_idle("train")?;
        }
        seconds += drained.elapsed().as_secs_f64();
        self.engine.settle()?;
        if !root {
            return Ok(None);
        }
        progress.trained();
        let evaluation = self.task.evaluate(self.engine.as_mut(), last_validation)?;
        if let Some(path) = &self.config.save {
            self.task
                .save(self.engine.as_ref(), &self.model, &self.config, Some(&evaluation), path)?;
        }
        let loss_scale = self.engine.read_loss_scale()?;
        let steps = (last + 1).saturating_sub(first);
        Ok(Some(Summary {
            steps,
            seconds,
            per_s: steps as f64 * per_step / seconds.max(1e-9),
            ms_per_step: 1e3 * seconds / steps.max(1) as f64,
            first_step_seconds,
            train_curve,
            validation_curve,
            evaluation,
            report: self.engine.report(),
            model: self.info.model.clone(),
            saved: self.config.save.clone(),
            loss_scale,
        }))
    }
}

/// [`TrainingRun::new`] then [`TrainingRun::fit`]. `None` on ranks other
/// than 0.
pub fn train<T: Task>(
    device: &DeviceOptions,
    config: TrainConfig,
    task: T,
    processes: Option<Arc<dyn ProcessGroup>>,
    progress: &mut dyn Progress,
) -> Result<Option<Summary>> {
    TrainingRun::new(device, config, task, processes, progress)?.fit(progress)
}
