//! A whole training run of the MLP classifier, as `wgrad train` performs
//! it: the data (read by rank 0 and shared across processes), the devices
//! and the parallel strategy, resuming from a checkpoint, the loop over
//! epochs and steps, evaluation and the checkpoint at the end. The caller
//! parses and prints: progress comes back through [`Progress`], the result
//! as a [`TrainingSummary`].
//!
//! It sits above [`crate::parallel`] (it picks the [`Engine`]) and drives
//! [`crate::trainer::Trainer`] only through its public API.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::checkpoint;
use crate::gpt_folder::OptimizerState;
use crate::data::{self, Dataset, Sampler};
use crate::device::{Device, DeviceOptions};
use crate::error::{Error, Result};
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{self, CrossEntropyLoss, Layer, Sequential};
use crate::optim::{self, Adam};
#[cfg(feature = "fault-injection")]
use crate::parallel::distributed::InjectedFailure;
use crate::parallel::distributed::{broadcast_f32, broadcast_u64, DistributedDataParallel, ProcessGroup};
use crate::parallel::engine::{Engine, Strategy};
use crate::parallel::{DeviceGroup, DeviceSelection};
use crate::trainer::{accuracy, Targets};

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

/// What to train and how. [`Default`] gives `wgrad train`'s defaults.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub epochs: usize,
    /// The global batch (across every device and process).
    pub batch_size: usize,
    /// Hidden layer widths of the ReLU MLP; input and output widths come
    /// from the data.
    pub hidden: Vec<usize>,
    pub optimizer: OptimizerConfig,
    /// Seeds the parameters, the digits train/test split and the batch order.
    pub seed: u64,
    /// Share of the digits held out for testing (MNIST has its own split).
    pub test_fraction: f64,
    /// Train on the MNIST IDX files in this folder instead of the digits.
    pub mnist: Option<PathBuf>,
    /// Read the loss back every this many steps (and at the last step);
    /// other steps never wait for the GPU.
    pub loss_every: u64,
    /// Stop after this many steps (otherwise every epoch runs).
    pub max_steps: Option<u64>,
    /// Continue from this checkpoint: parameters, optimizer state, step.
    pub resume: Option<PathBuf>,
    /// Where rank 0 writes the checkpoint at the end; `None` writes none.
    pub checkpoint: Option<PathBuf>,
    /// `None`: one device, or data parallel across processes.
    pub strategy: Option<Strategy>,
    /// `None`: the default device for a single device, one adapter per
    /// process across processes, otherwise `WGRAD_DEVICES` or 2 devices.
    pub devices: Option<DeviceSelection>,
    /// Pipeline micro-batches per step.
    pub micro_batches: usize,
    /// Data parallel: fixed rows per device instead of the measured split;
    /// across processes, rows per process.
    pub split: Option<Vec<usize>>,
    /// Testing the failure path: (rank, step, how) fails that rank at that
    /// step of a run across processes.
    #[cfg(feature = "fault-injection")]
    pub fail_at: Option<(usize, u64, InjectedFailure)>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 40,
            batch_size: 32,
            hidden: vec![128],
            optimizer: Adam::new(2e-3).into(),
            seed: 0,
            test_fraction: 0.2,
            mnist: None,
            loss_every: 10,
            max_steps: None,
            resume: None,
            checkpoint: None,
            strategy: None,
            devices: None,
            micro_batches: 4,
            split: None,
            #[cfg(feature = "fault-injection")]
            fail_at: None,
        }
    }
}

/// GPU memory of a single-device run, from its executor's plan.
#[derive(Clone, Copy, Debug)]
pub struct MemoryInfo {
    pub peak_bytes: u64,
    /// Intermediates as planned (buffers shared by liveness).
    pub planned_intermediate_bytes: u64,
    /// Intermediates with one buffer each.
    pub naive_intermediate_bytes: u64,
}

/// What a prepared run is about to do, for the caller to print.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The checkpoint the run resumed from.
    pub resumed_from: Option<PathBuf>,
    /// This process's devices.
    pub devices: Vec<String>,
    /// Single-device runs only.
    pub memory: Option<MemoryInfo>,
    pub model: String,
    pub optimizer: String,
    pub batch_size: usize,
    /// The strategy and its split.
    pub engine: String,
    pub data: String,
    pub train_rows: usize,
    pub test_rows: usize,
    /// Steps the run will take.
    pub steps: u64,
}

/// Where a run reports progress. Only rank 0 of a run across processes
/// reports; the other ranks train silently. Every method defaults to
/// nothing.
pub trait Progress {
    /// Devices are open and the engine is being built: its pipelines may
    /// compile for seconds.
    fn preparing(&mut self) {}
    /// The engine is built (and resumed); steps follow.
    fn started(&mut self, _info: &RunInfo) {}
    /// The loss read back at `step`, and the samples per second so far.
    fn loss(&mut self, _step: u64, _loss: f32, _samples_per_s: f64) {}
    /// The data-parallel split changed at `step`; `engine` describes it.
    fn rebalanced(&mut self, _step: u64, _engine: &str) {}
    /// `step` (counted from 1) is queued.
    fn step(&mut self, _step: u64) {}
    /// Every step has run and the devices are idle; evaluation follows.
    fn trained(&mut self) {}
}

/// No progress reports.
impl Progress for () {}

/// The result of a run, on rank 0.
#[derive(Clone, Debug)]
pub struct TrainingSummary {
    pub steps: u64,
    pub seconds: f64,
    pub samples_per_s: f64,
    pub train_accuracy: f32,
    pub test_accuracy: f32,
    /// The engine's timing report (empty for a single device).
    pub report: String,
    /// (step, loss) at every step that read the loss back.
    pub curve: Vec<(u64, f32)>,
    /// The model's description.
    pub model: String,
    /// Where the checkpoint was written, if anywhere.
    pub checkpoint: Option<PathBuf>,
}

/// A run with its data loaded, devices open and engine built (and resumed),
/// ready to [`fit`](Self::fit).
pub struct TrainingRun {
    config: TrainConfig,
    root: bool,
    data: DataSplit,
    group: DeviceGroup,
    engine: Engine,
    info: RunInfo,
}

impl TrainingRun {
    /// Loads the data (rank 0 reads it and shares it when `process_group`
    /// is given), checks the device count, opens the devices, builds the
    /// engine and resumes from `config.resume`. Across processes the run
    /// is data parallel, and every rank calls this and [`fit`](Self::fit).
    pub fn new(device: &DeviceOptions, config: TrainConfig, process_group: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn Progress) -> Result<Self> {
        let rank = process_group.as_ref().map_or(0, |g| g.rank());
        let root = rank == 0;
        let data = match &process_group {
            None => load_data(config.mnist.as_deref(), config.test_fraction, config.seed)?,
            Some(g) => {
                let loaded = if root { Some(load_data(config.mnist.as_deref(), config.test_fraction, config.seed)?) } else { None };
                share_data(g.as_ref(), loaded)?
            }
        };
        log::info!("rank {rank}: data ready");
        let strategy = match (config.strategy, &process_group) {
            (Some(s), _) => s,
            (None, Some(_)) => Strategy::Data,
            (None, None) => Strategy::Single,
        };
        if process_group.is_some() && strategy != Strategy::Data {
            return Err(Error::InvalidArgument {
                op: "train --distributed",
                reason: "across processes wgrad trains data parallel: use --parallel data".into(),
            });
        }
        let selection = match (&config.devices, strategy, &process_group) {
            (Some(d), _, _) => Some(d.clone()),
            (None, Strategy::Single, _) | (None, _, Some(_)) => None,
            (None, _, None) => Some(DeviceSelection::from_env(DeviceSelection::Count(2))?),
        };
        let mut widths = vec![data.train.features()];
        widths.extend(&config.hidden);
        widths.push(data.train.classes());
        nn::manual_seed(config.seed);
        let model = Sequential::mlp(&widths, Layer::ReLU)?;
        // A device count that cannot work fails here, before devices open one
        // by one (minutes for a large count). Across processes the split holds
        // rows per process, not per device.
        if let Some(selection) = &selection {
            let split = if process_group.is_some() { None } else { config.split.as_deref() };
            strategy.check_devices(selection.check()?, &model, config.batch_size, split)?;
        }
        let group = match &selection {
            Some(selection) => DeviceGroup::open(selection)?,
            None => DeviceGroup::from_kernels(vec![Arc::new(Kernels::new(Device::open(device)?))])?,
        };
        log::info!("rank {rank}: devices open");
        // Pipelines compile while the engine is built (lavapipe) or at their
        // first dispatch (llvmpipe-GL, and lavapipe with a cold shader cache):
        // both can take seconds, so the caller can say so.
        if root {
            progress.preparing();
        }
        let optimizer = config.optimizer;
        #[allow(unused_mut)]
        let mut engine = match process_group {
            Some(g) => Engine::Distributed(DistributedDataParallel::new(g, &group, &model, CrossEntropyLoss, optimizer, config.batch_size, config.split.clone())?),
            None => Engine::new(strategy, &group, &model, CrossEntropyLoss.into(), optimizer, config.batch_size, config.micro_batches, config.split.clone())?,
        };
        #[cfg(feature = "fault-injection")]
        if let (Some((fail_rank, step, how)), Engine::Distributed(d)) = (config.fail_at, &mut engine) {
            d.inject_failure(fail_rank, step, how);
        }
        if let Some(path) = &config.resume {
            resume(&mut engine, path, root)?;
        }
        let memory = match &engine {
            Engine::Single(t) => {
                let exec = t.executor();
                Some(MemoryInfo {
                    peak_bytes: exec.peak_bytes(),
                    planned_intermediate_bytes: exec.plan().slot_bytes,
                    naive_intermediate_bytes: exec.plan().naive_intermediate_bytes,
                })
            }
            _ => None,
        };
        let batches = Sampler::new(data.train.len(), config.batch_size, config.seed, true)?.num_batches();
        let all_steps = (batches * config.epochs) as u64;
        let info = RunInfo {
            resumed_from: config.resume.clone(),
            devices: group.labels(),
            memory,
            model: model.describe(),
            optimizer: optim::describe(&optimizer),
            batch_size: config.batch_size,
            engine: engine.describe(),
            data: data.name.clone(),
            train_rows: data.train.len(),
            test_rows: data.test.len(),
            steps: config.max_steps.map_or(all_steps, |m| m.min(all_steps)),
        };
        Ok(TrainingRun { config, root, data, group, engine, info })
    }

    pub fn info(&self) -> &RunInfo {
        &self.info
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    pub fn data(&self) -> &DataSplit {
        &self.data
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Runs every step, waits for the devices, and on rank 0 evaluates on
    /// both splits and writes the checkpoint (with the data name, split
    /// seed, test fraction and test accuracy as metadata). Other ranks
    /// return `None` once their steps are done.
    pub fn fit(mut self, progress: &mut dyn Progress) -> Result<Option<TrainingSummary>> {
        let root = self.root;
        let config = &self.config;
        let train_set = &self.data.train;
        if root {
            progress.started(&self.info);
        }
        let steps = self.info.steps;
        let mut sampler = Sampler::new(train_set.len(), config.batch_size, config.seed, true)?;
        let mut x = vec![0.0f32; config.batch_size * train_set.features()];
        let mut y = vec![0u32; config.batch_size];
        let mut curve: Vec<(u64, f32)> = Vec::new();
        let start = Instant::now();
        let mut done = 0u64;
        let shares_of = |e: &Engine| match e {
            Engine::Data(d) => d.shares().to_vec(),
            Engine::Distributed(d) => d.process_shares().to_vec(),
            _ => Vec::new(),
        };
        let mut last_shares = shares_of(&self.engine);
        'epochs: for _ in 0..config.epochs {
            for b in 0..sampler.num_batches() {
                if done >= steps {
                    break 'epochs;
                }
                let Some(indices) = sampler.batch(b) else { break };
                train_set.fill_batch(indices, &mut x, &mut y)?;
                done += 1;
                let read = done % config.loss_every.max(1) == 0 || done == steps;
                if let Some(loss) = self.engine.step(&x, Targets::Classes(&y), read)? {
                    curve.push((done, loss));
                    if root {
                        let rate = (done * config.batch_size as u64) as f64 / start.elapsed().as_secs_f64();
                        progress.loss(done, loss, rate);
                    }
                }
                let shares = shares_of(&self.engine);
                if shares != last_shares {
                    if root {
                        progress.rebalanced(done, &self.engine.describe());
                    }
                    last_shares = shares;
                }
                if root {
                    progress.step(done);
                }
            }
            sampler.next_epoch();
        }
        for k in self.group.members() {
            k.device().wait_idle("train")?;
        }
        let seconds = start.elapsed().as_secs_f64();
        if !root {
            return Ok(None);
        }
        progress.trained();
        let test_set = &self.data.test;
        let test_accuracy = accuracy(&self.engine.predict(test_set.x())?, test_set.labels());
        let train_accuracy = accuracy(&self.engine.predict(train_set.x())?, train_set.labels());
        if let Some(path) = &config.checkpoint {
            let mut ckpt = self.engine.checkpoint()?;
            ckpt.set_meta("data", self.data.name.clone());
            ckpt.set_meta("split_seed", config.seed.to_string());
            ckpt.set_meta("test_fraction", config.test_fraction.to_string());
            ckpt.set_meta("test_accuracy", format!("{test_accuracy:.6}"));
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|source| Error::CheckpointIo {
                    path: dir.to_path_buf(),
                    action: "create the directory",
                    source,
                })?;
            }
            checkpoint::save(path, &ckpt)?;
        }
        Ok(Some(TrainingSummary {
            steps: done,
            seconds,
            samples_per_s: (done * config.batch_size as u64) as f64 / seconds,
            train_accuracy,
            test_accuracy,
            report: self.engine.report(),
            curve,
            model: self.info.model.clone(),
            checkpoint: config.checkpoint.clone(),
        }))
    }
}

/// Loads `path` into every replica. Across processes rank 0 reads the
/// checkpoint and every rank takes its state, whatever the number of
/// processes that wrote it.
fn resume(engine: &mut Engine, path: &Path, root: bool) -> Result<()> {
    match engine {
        Engine::Single(t) => t.load(path),
        Engine::Data(d) => {
            for t in d.replicas_mut() {
                t.load(path)?;
            }
            Ok(())
        }
        Engine::Distributed(d) => {
            if root {
                for t in d.local_mut().replicas_mut() {
                    t.load(path)?;
                }
            }
            d.sync_from_root()
        }
        Engine::Pipeline(_) | Engine::Tensor(_) => {
            let ckpt = checkpoint::load(path)?;
            let state = OptimizerState::from_checkpoint(&ckpt)?;
            let params: Vec<(String, Vec<usize>, Vec<f32>)> =
                ckpt.tensors.iter().filter(|t| !t.name.starts_with("optim.")).map(|t| (t.name.clone(), t.shape.clone(), t.data.clone())).collect();
            match engine {
                Engine::Pipeline(p) => p.load_state(&params, &state.state, Some(state.step)),
                Engine::Tensor(t) => t.load_state(&params, &state.state, Some(state.step)),
                _ => Ok(()),
            }
        }
    }
}

/// [`TrainingRun::new`] then [`TrainingRun::fit`]: the whole of
/// `wgrad train`. `None` on ranks other than 0.
pub fn train(device: &DeviceOptions, config: TrainConfig, process_group: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn Progress) -> Result<Option<TrainingSummary>> {
    TrainingRun::new(device, config, process_group, progress)?.fit(progress)
}
