//! The one training run, as `wgrad train` performs it for every model: the
//! data (read by rank 0 and shared across processes), the devices and the
//! parallel strategy, resuming, the loop over steps, evaluation and saving
//! at the end. What is trained on what is a [`Task`]: the digits
//! [`Classifier`] here, a causal language model on text in
//! [`crate::lm_training`]. The caller parses and prints: progress comes
//! back through [`Progress`], the result as a [`Summary`].
//!
//! It sits above [`crate::parallel`]: it builds a [`TrainEngine`] with
//! [`Strategy::build`] and drives it only through that trait.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::checkpoint;
use crate::data::{self, Dataset, Sampler};
use crate::device::{Device, DeviceOptions};
use crate::error::{Error, Result};
use crate::gpt_folder::OptimizerState;
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{self, CrossEntropyLoss, Layer, Module, Sequential};
use crate::optim::{self, Adam};
#[cfg(feature = "fault-injection")]
use crate::parallel::distributed::InjectedFailure;
use crate::parallel::distributed::{broadcast_f32, broadcast_u64, ProcessGroup};
use crate::parallel::engine::{Footprint, Parallelizable, Strategy, TrainEngine};
use crate::parallel::pipeline::Schedule;
use crate::parallel::stage::NamedParameters;
use crate::parallel::{DeviceGroup, DeviceSelection};
use crate::trainer::{accuracy, Examples, Targets};

/// How to train, whatever the task. [`Default`] gives `wgrad train --model
/// mlp`'s run; [`crate::lm_training::language_model_run`] the language
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
    /// The verdict at the end, on rank 0; `last_validation` is the
    /// validation loss of the last step, where the task has one.
    fn evaluate(&mut self, engine: &mut dyn TrainEngine, last_validation: Option<f32>) -> Result<Evaluation>;
    /// Writes what the run trained to `path`, for inference and resuming.
    fn save(&self, engine: &dyn TrainEngine, model: &Self::Model, config: &TrainConfig, evaluation: Option<&Evaluation>, path: &Path) -> Result<()>;
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
    /// Time in training steps (validation excluded).
    pub seconds: f64,
    /// Units ([`RunInfo::unit`]) per second.
    pub per_s: f64,
    pub ms_per_step: f64,
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
    pub fn new(device: &DeviceOptions, config: TrainConfig, task: T, processes: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn Progress) -> Result<Self> {
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
    pub fn with_devices(group: DeviceGroup, config: TrainConfig, task: T, processes: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn Progress) -> Result<Self> {
        let count = if Self::strategy(&config, processes.is_some())? == Strategy::Single { None } else { Some(group.len()) };
        Self::build(config, task, processes, progress, count, |_| Ok(group))
    }

    /// [`TrainingRun::new`] on one device already open.
    pub fn with_kernels(kernels: Arc<Kernels>, config: TrainConfig, task: T, progress: &mut dyn Progress) -> Result<Self> {
        Self::with_devices(DeviceGroup::from_kernels(vec![kernels])?, config, task, None, progress)
    }

    fn strategy(config: &TrainConfig, across_processes: bool) -> Result<Strategy> {
        let strategy = config.strategy.unwrap_or(if across_processes { Strategy::Data } else { Strategy::Single });
        if across_processes && strategy != Strategy::Data {
            return Err(Error::InvalidArgument { op: "train --distributed", reason: "across processes wgrad trains data parallel: use --parallel data".into() });
        }
        if config.batch_size == 0 || config.max_steps == Some(0) || config.loss_every == 0 || config.eval_every == 0 {
            return Err(Error::InvalidArgument {
                op: "train",
                reason: format!("batch size {}, steps {:?}, loss_every and eval_every must be positive", config.batch_size, config.max_steps),
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
        let split = if processes.is_some() { None } else { config.split.as_deref() };
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
        let Prepared { model, resumed } = task.prepare(&config, processes.as_deref())?;
        if let Some(count) = devices {
            strategy.check_devices(count, &model, config.batch_size, split, config.micro_batches)?;
        }
        let group = open(())?;
        if root {
            progress.preparing();
        }
        #[allow(unused_mut)]
        let mut engine = strategy.build(&group, processes, &model, CrossEntropyLoss.into(), config.optimizer, config.batch_size, config.micro_batches, config.schedule, config.split.clone())?;
        #[cfg(feature = "fault-injection")]
        if let Some((rank, step, how)) = config.fail_at {
            engine.inject_failure(rank, step, how);
        }
        if let Some(r) = &resumed {
            engine.load_state(&r.parameters, &r.state.state, Some(r.state.step))?;
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
        };
        Ok(TrainingRun { config, task, model, group, engine, root, info })
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

    /// Writes what the run trained so far to `path` (the task's format).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.task.save(self.engine.as_ref(), &self.model, &self.config, None, path)
    }

    /// Runs every step (the validation loss every `eval_every` and after
    /// the last), waits for the devices, and on rank 0 evaluates and saves
    /// to `config.save`. Other ranks return `None` once their steps are done.
    pub fn fit(&mut self, progress: &mut dyn Progress) -> Result<Option<Summary>> {
        let root = self.root;
        if root {
            progress.started(&self.info);
        }
        let (first, last) = (self.info.first_step, self.info.steps);
        let per_step = self.info.per_step as f64;
        let (mut train_curve, mut validation_curve) = (Vec::new(), Vec::new());
        let mut seconds = 0.0f64;
        let mut last_shares = self.engine.shares();
        let mut last_validation = None;
        for step in first..=last {
            let started = Instant::now();
            let read = step % self.config.loss_every == 0 || step == last;
            let (x, y) = self.task.batch(&self.config)?;
            let loss = self.engine.step(x, y, read)?;
            seconds += started.elapsed().as_secs_f64();
            if let Some(loss) = loss {
                train_curve.push((step, loss));
                if root {
                    progress.loss(step, loss, (step + 1 - first) as f64 * per_step / seconds.max(1e-9));
                }
            }
            let shares = self.engine.shares();
            if shares != last_shares {
                if root {
                    progress.rebalanced(step, &self.engine.describe());
                }
                last_shares = shares;
            }
            if root {
                progress.step(step);
            }
            if step % self.config.eval_every == 0 || step == last {
                if let Some(loss) = self.task.validation_loss(self.engine.as_mut(), &self.config)? {
                    validation_curve.push((step, loss));
                    last_validation = Some(loss);
                    if root {
                        progress.validation(step, loss);
                    }
                }
            }
        }
        for k in self.group.members() {
            k.device().wait_idle("train")?;
        }
        if !root {
            return Ok(None);
        }
        progress.trained();
        let evaluation = self.task.evaluate(self.engine.as_mut(), last_validation)?;
        if let Some(path) = &self.config.save {
            self.task.save(self.engine.as_ref(), &self.model, &self.config, Some(&evaluation), path)?;
        }
        let steps = (last + 1).saturating_sub(first);
        Ok(Some(Summary {
            steps,
            seconds,
            per_s: steps as f64 * per_step / seconds.max(1e-9),
            ms_per_step: 1e3 * seconds / steps.max(1) as f64,
            train_curve,
            validation_curve,
            evaluation,
            report: self.engine.report(),
            model: self.info.model.clone(),
            saved: self.config.save.clone(),
        }))
    }
}

/// [`TrainingRun::new`] then [`TrainingRun::fit`]. `None` on ranks other
/// than 0.
pub fn train<T: Task>(device: &DeviceOptions, config: TrainConfig, task: T, processes: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn Progress) -> Result<Option<Summary>> {
    TrainingRun::new(device, config, task, processes, progress)?.fit(progress)
}

// ---------------------------------------------------------------- the classifier

/// A train/test split and the name it is reported and checkpointed under.
#[derive(Clone, Debug)]
pub struct DataSplit {
    pub train: Dataset,
    pub test: Dataset,
    /// `digits`, or `mnist:DIR`.
    pub name: String,
}

/// The train/test split `wgrad train` and `wgrad infer` agree on: MNIST's
/// own split when `mnist` names a folder of IDX files, otherwise the
/// shipped digits split by `test_fraction` with `seed`.
pub fn load_data(mnist: Option<&Path>, test_fraction: f64, seed: u64) -> Result<DataSplit> {
    match mnist {
        Some(dir) => {
            let (train, test) = data::mnist(dir)?;
            Ok(DataSplit { train, test, name: format!("mnist:{}", dir.display()) })
        }
        None => {
            let (train, test) = data::digits()?.split(test_fraction, seed)?;
            Ok(DataSplit { train, test, name: "digits".to_string() })
        }
    }
}

/// Rank 0's data on every rank, so only rank 0 reads files: rank 0 passes
/// `Some`, the others `None`. Every rank calls it (it is a collective).
pub fn share_data(group: &dyn ProcessGroup, loaded: Option<DataSplit>) -> Result<DataSplit> {
    let root = group.rank() == 0;
    let (train, test, name) = match loaded {
        Some(DataSplit { train, test, name }) => (Some(train), Some(test), name),
        None => (None, None, String::new()),
    };
    let mut name_bytes = name.into_bytes();
    group.broadcast_bytes(0, &mut name_bytes)?;
    let share = |set: Option<Dataset>| -> Result<Dataset> {
        let (mut x, labels, features, classes) = match set {
            Some(d) if root => d.into_parts(),
            _ => (Vec::new(), Vec::new(), 0, 0),
        };
        let mut meta = vec![features as u64, classes as u64];
        let mut labels: Vec<u64> = labels.into_iter().map(u64::from).collect();
        broadcast_u64(group, 0, &mut meta)?;
        broadcast_f32(group, 0, &mut x)?;
        broadcast_u64(group, 0, &mut labels)?;
        let labels = labels.into_iter().map(|l| l as u32).collect();
        Dataset::new(x, labels, meta[0] as usize, meta[1] as usize)
    };
    let train = share(train)?;
    let test = share(test)?;
    Ok(DataSplit { train, test, name: String::from_utf8_lossy(&name_bytes).into_owned() })
}

/// The ReLU MLP classifier on the digits (or MNIST): accuracy on both
/// splits at the end, a safetensors checkpoint (with the data name, split
/// seed, test fraction and test accuracy as metadata) to save to and
/// resume from.
#[derive(Clone, Debug)]
pub struct Classifier {
    /// Hidden layer widths; input and output widths come from the data.
    pub hidden: Vec<usize>,
    /// Passes over the training set (`max_steps` may stop earlier).
    pub epochs: usize,
    /// Share of the digits held out for testing (MNIST has its own split).
    pub test_fraction: f64,
    /// Train on the MNIST IDX files in this folder instead of the digits.
    pub mnist: Option<PathBuf>,
    /// Filled by [`Task::prepare`]; `None` before (`..Classifier::default()`).
    pub prepared: Option<ClassifierData>,
}

/// A prepared classifier's data and batch order.
#[derive(Clone, Debug)]
pub struct ClassifierData {
    split: DataSplit,
    sampler: Sampler,
    /// The next batch's index in the epoch.
    next: usize,
    x: Vec<f32>,
    y: Vec<u32>,
}

impl Default for Classifier {
    fn default() -> Self {
        Classifier { hidden: vec![128], epochs: 40, test_fraction: 0.2, mnist: None, prepared: None }
    }
}

impl Classifier {
    /// The train/test split, once prepared.
    pub fn data(&self) -> Option<&DataSplit> {
        self.prepared.as_ref().map(|d| &d.split)
    }

    fn data_ready(&self) -> Result<&ClassifierData> {
        self.prepared.as_ref().ok_or_else(|| Error::InvalidArgument { op: "Classifier", reason: "the task is not prepared (TrainingRun::new prepares it)".into() })
    }
}

impl Task for Classifier {
    type Model = Sequential;
    const UNIT: &'static str = "samples";

    fn prepare(&mut self, config: &TrainConfig, processes: Option<&dyn ProcessGroup>) -> Result<Prepared<Sequential>> {
        let root = processes.is_none_or(|g| g.rank() == 0);
        let load = || load_data(self.mnist.as_deref(), self.test_fraction, config.seed);
        let split = match processes {
            None => load()?,
            Some(g) => share_data(g, if root { Some(load()?) } else { None })?,
        };
        let mut widths = vec![split.train.features()];
        widths.extend(&self.hidden);
        widths.push(split.train.classes());
        let model = Sequential::mlp(&widths, Layer::ReLU)?;
        let resumed = match &config.resume {
            Some(path) if root => Some(read_checkpoint(path, &model, &config.optimizer)?),
            _ => None,
        };
        let sampler = Sampler::new(split.train.len(), config.batch_size, config.seed, true)?;
        let (x, y) = (vec![0.0; config.batch_size * split.train.features()], vec![0; config.batch_size]);
        self.prepared = Some(ClassifierData { split, sampler, next: 0, x, y });
        Ok(Prepared { model, resumed })
    }

    fn describe_data(&self) -> String {
        self.data().map_or_else(String::new, |d| format!("{}, {} train / {} test rows", d.name, d.train.len(), d.test.len()))
    }

    /// `max_steps` more steps, at most `epochs` passes.
    fn last_step(&self, config: &TrainConfig, first_step: u64) -> Result<u64> {
        let all = (self.data_ready()?.sampler.num_batches() * self.epochs) as u64;
        Ok(first_step - 1 + config.max_steps.map_or(all, |m| m.min(all)))
    }

    fn per_step(&self, config: &TrainConfig) -> usize {
        config.batch_size
    }

    fn batch(&mut self, _config: &TrainConfig) -> Result<(Examples<'_>, Targets<'_>)> {
        let d = self.prepared.as_mut().ok_or_else(|| Error::InvalidArgument { op: "Classifier", reason: "the task is not prepared".into() })?;
        if d.next == d.sampler.num_batches() {
            d.sampler.next_epoch();
            d.next = 0;
        }
        let indices = d.sampler.batch(d.next).ok_or_else(|| Error::InvalidArgument { op: "Classifier", reason: "the sampler has no batch".into() })?;
        d.split.train.fill_batch(indices, &mut d.x, &mut d.y)?;
        d.next += 1;
        Ok((Examples::Features(&d.x), Targets::Classes(&d.y)))
    }

    fn evaluate(&mut self, engine: &mut dyn TrainEngine, _last_validation: Option<f32>) -> Result<Evaluation> {
        let split = &self.data_ready()?.split;
        let test = accuracy(&engine.predict(Examples::Features(split.test.x()))?, split.test.labels());
        let train = accuracy(&engine.predict(Examples::Features(split.train.x()))?, split.train.labels());
        Ok(Evaluation::Accuracy { train, test })
    }

    fn save(&self, engine: &dyn TrainEngine, _model: &Sequential, config: &TrainConfig, evaluation: Option<&Evaluation>, path: &Path) -> Result<()> {
        let mut ckpt = engine.checkpoint()?;
        ckpt.set_meta("data", self.data_ready()?.split.name.clone());
        ckpt.set_meta("split_seed", config.seed.to_string());
        ckpt.set_meta("test_fraction", self.test_fraction.to_string());
        if let Some(Evaluation::Accuracy { test, .. }) = evaluation {
            ckpt.set_meta("test_accuracy", format!("{test:.6}"));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| Error::CheckpointIo { path: dir.to_path_buf(), action: "create the directory", source })?;
        }
        checkpoint::save(path, &ckpt)
    }
}

/// A classifier checkpoint's parameters and, when it was written by the
/// same kind of optimizer, its state and step (otherwise the optimizer
/// starts afresh).
fn read_checkpoint(path: &Path, model: &Sequential, optimizer: &OptimizerConfig) -> Result<Resumed> {
    let ckpt = checkpoint::load(path)?;
    if let Some(saved) = ckpt.meta("model").filter(|m| *m != model.describe()) {
        return Err(Error::InvalidArgument { op: "train --resume", reason: format!("`{}` holds {saved}, not this run's {}", path.display(), model.describe()) });
    }
    let parameters = ckpt.tensors.iter().filter(|t| !t.name.starts_with("optim.")).map(|t| (t.name.clone(), t.shape.clone(), t.data.clone())).collect();
    let kind = |d: &str| d.split_whitespace().next().unwrap_or_default().to_string();
    let ours = optim::describe(optimizer);
    let state = match OptimizerState::from_checkpoint(&ckpt) {
        Ok(state) if kind(&state.optimizer) == kind(&ours) => state,
        _ => {
            log::warn!("checkpoint optimizer {:?} differs from {ours:?}: loading parameters only", ckpt.meta("optimizer"));
            OptimizerState { step: 0, ..Default::default() }
        }
    };
    Ok(Resumed { parameters, state })
}
