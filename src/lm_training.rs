//! A GPT trained on text, as `wgrad train --model gpt` runs it (nanoGPT's
//! `train.py` on shakespeare_char): the text and its tokenizer, the
//! held-out split, random windows, AdamW with nanoGPT's parameter groups,
//! warmup and cosine decay, gradient clipping, the validation loss every
//! few steps and at the end. The caller prints: progress comes back through
//! [`LmProgress`], the result as an [`LmSummary`]. The run is one device's,
//! or data parallel over several devices and over the processes of an MPI
//! job ([`LmTrainConfig::strategy`], [`LmTrainingRun::distributed`]).
//!
//! The validation loss is the mean over a fixed set of windows of the
//! held-out text, `eval_batches × batch_size` windows evenly spaced from
//! its start ([`validation_windows`]), so two runs — or this engine and
//! `scripts/train_reference.py` in PyTorch — are scored on the same text.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::device::{Device, DeviceOptions};
use crate::error::{Error, Result};
use crate::gpt_folder::{self, OptimizerState, TokenizerSpec};
use crate::kernels::{Kernels, LrSchedule, OptimizerConfig};
use crate::nn::{self, CrossEntropyLoss, Gpt, GptConfig, Module};
use crate::optim::{self, AdamW};
use crate::parallel::data::{DataParallel, Split};
#[cfg(feature = "fault-injection")]
use crate::parallel::distributed::InjectedFailure;
use crate::parallel::distributed::{DistributedDataParallel, ProcessGroup};
use crate::parallel::engine::Strategy;
use crate::parallel::pipeline::{Pipeline, Schedule};
use crate::parallel::tensor::TensorParallel;
use crate::parallel::{DeviceGroup, DeviceSelection};
use crate::text::{self, CharTokenizer, Gpt2Bpe, Tokenizer};
use crate::trainer::{Examples, Targets, Trainer};

/// The text to train on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextSource {
    /// The shipped Shakespeare ([`text::shakespeare`]).
    Shakespeare,
    /// A UTF-8 text file.
    File(PathBuf),
    /// Text in memory.
    Text(String),
}

/// `char`: one token per character of the training text; `gpt2`: GPT-2's
/// BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    Char,
    Gpt2,
}

/// What to train and how. [`Default`] is `make train`'s run: a 0.8M
/// parameter character-level GPT (nanoGPT's shakespeare_char, scaled down)
/// that trains in under 10 minutes on two CPU cores' software adapter.
#[derive(Clone, Debug)]
pub struct LmTrainConfig {
    pub text: TextSource,
    pub tokenizer: TokenizerKind,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub batch_size: usize,
    pub max_steps: u64,
    /// Peak learning rate, reached after `warmup_steps`, then cosine decay
    /// to `min_lr` at `max_steps`.
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    /// AdamW's decoupled decay on weight matrices only.
    pub weight_decay: f32,
    pub betas: (f32, f32),
    pub clip_grad_norm: Option<f32>,
    /// The validation loss every this many steps (and after the last).
    pub eval_every: u64,
    /// Batches of fixed held-out windows per validation loss.
    pub eval_batches: usize,
    /// The share of the text, at its end, held out for validation.
    pub validation_fraction: f64,
    /// Read the training loss back every this many steps (others never wait
    /// for the GPU).
    pub loss_every: u64,
    /// Seeds the parameters and the training windows.
    pub seed: u64,
    /// Continue from this model folder (written by [`LmTrainingRun::save`]):
    /// its model, optimizer state and step; the training windows continue
    /// where they stopped, so a resumed run equals an uninterrupted one.
    /// Across processes only rank 0 reads it.
    pub resume: Option<PathBuf>,
    /// How the work is spread over devices: `Single` (the default), `Data`
    /// (a replica per device, the batch split among them; the only strategy
    /// across processes), `Tensor` (Megatron: each device holds some heads
    /// and MLP units of every block, [`TensorParallel`]) or `Pipeline`
    /// (whole blocks per device, micro-batches, [`Pipeline`]).
    pub strategy: Strategy,
    /// The devices [`LmTrainingRun::new`] opens: `None` gives the default
    /// device for a single device, `WGRAD_DEVICES` or 2 devices for data
    /// parallel, and one device per process across processes.
    pub devices: Option<DeviceSelection>,
    /// Data parallel: fixed rows per device (summing to `batch_size`)
    /// instead of the measured split; across processes, rows per process.
    pub split: Option<Vec<usize>>,
    /// Pipeline parallel: micro-batches per step (dividing `batch_size`).
    pub micro_batches: usize,
    /// Pipeline parallel: GPipe or 1F1B.
    pub schedule: Schedule,
    /// Testing the failure path: (rank, step, how) fails that rank at that
    /// step of a run across processes.
    #[cfg(feature = "fault-injection")]
    pub fail_at: Option<(usize, u64, InjectedFailure)>,
}

impl Default for LmTrainConfig {
    /// Sizes and steps measured on the 2-core machine's lavapipe: about
    /// 0.6 s per step, 750 steps in under 8 minutes. More, shorter steps
    /// beat fewer long ones in a fixed time: PyTorch reaches validation
    /// 2.2 with these and 2.54 with the same tokens as 200 steps of 16 ×
    /// 128 (scripts/train_reference.py).
    fn default() -> Self {
        LmTrainConfig {
            text: TextSource::Shakespeare,
            tokenizer: TokenizerKind::Char,
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            batch_size: 8,
            max_steps: 750,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 40,
            weight_decay: 0.1,
            betas: (0.9, 0.99),
            clip_grad_norm: Some(1.0),
            eval_every: 125,
            eval_batches: 16,
            validation_fraction: 0.1,
            loss_every: 10,
            seed: 0,
            resume: None,
            strategy: Strategy::Single,
            devices: None,
            split: None,
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            #[cfg(feature = "fault-injection")]
            fail_at: None,
        }
    }
}

impl LmTrainConfig {
    /// The optimizer `wgrad train --model gpt` uses: AdamW with weight decay
    /// on matrices only, warmup plus cosine, and clipping. A run shorter
    /// than the warmup warms up over the whole run.
    pub fn optimizer(&self) -> OptimizerConfig {
        let schedule = LrSchedule::WarmupCosine { warmup_steps: self.warmup_steps.min(self.max_steps), total_steps: self.max_steps, min_lr: self.min_lr };
        let adamw = AdamW::new(self.lr).betas(self.betas.0, self.betas.1).weight_decay(self.weight_decay).schedule(schedule).decay_matrices_only();
        match self.clip_grad_norm {
            Some(max_norm) => adamw.clip_grad_norm(max_norm).into(),
            None => adamw.into(),
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "train --model gpt", reason });
        if self.batch_size == 0 || self.max_steps == 0 {
            return bad(format!("batch size {} and steps {} must be positive", self.batch_size, self.max_steps));
        }
        if self.eval_every == 0 || self.eval_batches == 0 || self.loss_every == 0 {
            return bad("eval_every, eval_batches and loss_every must be positive".into());
        }
        if self.strategy == Strategy::Pipeline && (self.micro_batches == 0 || self.batch_size % self.micro_batches != 0) {
            return Err(Error::InvalidArgument {
                op: "train --parallel pipeline",
                reason: format!("the batch of {} rows must split into {} equal micro-batches (--micro-batches)", self.batch_size, self.micro_batches),
            });
        }
        Ok(())
    }

    /// Whether `devices` devices can share this run's GPT, checked before
    /// any is opened: data parallel needs a row of the batch per device and
    /// one entry per device in a fixed split. `across_processes`: the split
    /// holds rows per process, which the engine checks once the job's size
    /// is known.
    pub fn check_devices(&self, devices: usize, across_processes: bool) -> Result<()> {
        crate::parallel::check_limit(devices)?;
        let refuse = |op: &'static str, reason: String| Err(Error::InvalidArgument { op, reason });
        match self.strategy {
            Strategy::Data => Strategy::check_data_devices(devices, self.batch_size, if across_processes { None } else { self.split.as_deref() }),
            Strategy::Tensor if devices > self.n_head => {
                refuse("tensor parallel", format!("{devices} devices need at least one attention head each, but the model has {} heads: use at most {} devices", self.n_head, self.n_head))
            }
            // Middle stages hold a block each; the first may hold only the
            // embedding and the last only the head.
            Strategy::Pipeline if devices > self.n_layer + 2 => refuse(
                "pipeline parallel",
                format!("{devices} stages asked for, but a model of {} block(s) fills at most {} (the embedding's, one per block, the head's): use fewer devices", self.n_layer, self.n_layer + 2),
            ),
            Strategy::Single | Strategy::Tensor | Strategy::Pipeline => Ok(()),
        }
    }
}

/// Tokens of a text, split into training and held-out validation.
#[derive(Clone, Debug)]
pub struct TokenizedText {
    pub tokenizer: Tokenizer,
    pub train: Vec<u32>,
    pub validation: Vec<u32>,
}

/// Reads and tokenizes the text: the char vocabulary is every character of
/// the whole text, sorted (nanoGPT's `prepare.py`).
pub fn tokenize(source: &TextSource, kind: TokenizerKind, validation_fraction: f64) -> Result<TokenizedText> {
    tokenize_text(&read_text(source)?, kind, validation_fraction)
}

/// The text `source` names.
pub fn read_text(source: &TextSource) -> Result<String> {
    match source {
        TextSource::Shakespeare => text::shakespeare(),
        TextSource::Text(text) => Ok(text.clone()),
        TextSource::File(path) => std::fs::read_to_string(path).map_err(|source| Error::DataIo { op: "train --text", path: path.clone(), source }),
    }
}

/// [`tokenize`] of a text already read.
pub fn tokenize_text(text: &str, kind: TokenizerKind, validation_fraction: f64) -> Result<TokenizedText> {
    let tokenizer = match kind {
        TokenizerKind::Char => Tokenizer::Char(CharTokenizer::from_text(text)?),
        TokenizerKind::Gpt2 => Tokenizer::Gpt2(Gpt2Bpe::new()?),
    };
    let tokens = tokenizer.encode(text)?;
    let (train, validation) = text::held_out_split(&tokens, validation_fraction)?;
    Ok(TokenizedText { tokenizer, train: train.to_vec(), validation: validation.to_vec() })
}

/// `count` windows of `block_size + 1` tokens spread evenly over `tokens`,
/// window i starting at `i·stride` with `stride = (len − block_size − 1) /
/// count`: inputs and targets, [count, block_size] each.
pub fn validation_windows(tokens: &[u32], count: usize, block_size: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let room = tokens.len().checked_sub(block_size + 1).filter(|&r| r >= count && count > 0).ok_or_else(|| Error::InvalidArgument {
        op: "validation_windows",
        reason: format!("{} held-out tokens cannot give {count} windows of {}", tokens.len(), block_size + 1),
    })?;
    let stride = room / count;
    let (mut inputs, mut targets) = (Vec::with_capacity(count * block_size), Vec::with_capacity(count * block_size));
    for i in 0..count {
        let start = i * stride;
        inputs.extend_from_slice(&tokens[start..start + block_size]);
        targets.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
    }
    Ok((inputs, targets))
}

/// What a prepared run is about to do, for the caller to print.
#[derive(Clone, Debug)]
pub struct LmRunInfo {
    /// This process's devices, `#i name (backend)` each.
    pub devices: Vec<String>,
    /// How the work is spread ([`Strategy`] and, for data parallel, the
    /// rows per device).
    pub engine: String,
    pub model: String,
    pub parameters: usize,
    pub tokenizer: &'static str,
    pub vocab_size: usize,
    pub train_tokens: usize,
    pub validation_tokens: usize,
    pub steps: u64,
    /// 1, or the step after a resumed folder's.
    pub first_step: u64,
    pub tokens_per_step: usize,
    /// On each device (the first one's for data parallel, whose replicas
    /// differ only in their rows).
    pub dispatches_per_step: usize,
    pub peak_gpu_bytes: u64,
}

/// Where a run reports progress. Every method defaults to nothing.
pub trait LmProgress {
    /// The device is open and the trainer is being built: its pipelines may
    /// compile for seconds.
    fn preparing(&mut self) {}
    fn started(&mut self, _info: &LmRunInfo) {}
    /// `step` (from 1) is queued.
    fn step(&mut self, _step: u64) {}
    /// The training loss read back at `step`, and tokens per second so far.
    fn loss(&mut self, _step: u64, _loss: f32, _tokens_per_s: f64) {}
    /// The validation loss after `step` (0: before training).
    fn validation(&mut self, _step: u64, _loss: f32) {}
}

impl LmProgress for () {}

/// The result of a run.
#[derive(Clone, Debug)]
pub struct LmSummary {
    pub steps: u64,
    /// Time in training steps, validation excluded.
    pub train_seconds: f64,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// (step, loss) wherever the training loss was read.
    pub train_curve: Vec<(u64, f32)>,
    /// (step, loss) of every validation.
    pub validation_curve: Vec<(u64, f32)>,
    pub final_validation_loss: f32,
    /// What the engine's parallelism cost (the split, the communication's
    /// share of step time); empty for a single device.
    pub report: String,
}

/// (name, shape, values) of each parameter, as `Executor::parameters` gives them.
type NamedParameters = Vec<(String, Vec<usize>, Vec<f32>)>;

/// How a run's steps are computed: one trainer, or a strategy spreading
/// the GPT over devices (and processes). Every method is one short arm per
/// strategy, so another strategy (tensor or pipeline parallel for the GPT)
/// is a variant and one arm in each.
enum LmEngine {
    Single(Box<Trainer>),
    /// A replica per device, the batch split among them.
    Data(DataParallel),
    /// Data parallel over the processes of a job (MPI) and, inside each,
    /// over its local devices.
    Distributed(DistributedDataParallel<Arc<dyn ProcessGroup>>),
    /// Megatron: heads and MLP units of every block split over devices.
    Tensor(Box<TensorParallel>),
    /// Whole blocks per device, micro-batches through the stages.
    Pipeline(Box<Pipeline>),
}

impl LmEngine {
    /// `config.strategy` over `devices` (Single uses the first), across
    /// the processes of `process_group` when given (data parallel only).
    fn new(config: &LmTrainConfig, devices: &DeviceGroup, process_group: Option<Arc<dyn ProcessGroup>>, model: &Gpt) -> Result<Self> {
        let (optimizer, batch) = (config.optimizer(), config.batch_size);
        Ok(match (config.strategy, process_group) {
            (Strategy::Single, None) => LmEngine::Single(Box::new(Trainer::new(devices.members()[0].clone(), model, CrossEntropyLoss, optimizer, batch)?)),
            (Strategy::Data, None) => {
                let split = config.split.clone().map_or(Split::Measured { every: 20 }, Split::Rows);
                LmEngine::Data(DataParallel::new(devices, model, CrossEntropyLoss, optimizer, batch, split)?)
            }
            (Strategy::Data, Some(group)) => {
                LmEngine::Distributed(DistributedDataParallel::new(group, devices, model, CrossEntropyLoss, optimizer, batch, config.split.clone())?)
            }
            (Strategy::Single, Some(_)) => {
                return Err(Error::InvalidArgument { op: "train --distributed", reason: "across processes wgrad trains data parallel: use --parallel data".into() })
            }
            (Strategy::Tensor, None) => LmEngine::Tensor(Box::new(TensorParallel::new(devices, model, CrossEntropyLoss, optimizer, batch)?)),
            (Strategy::Pipeline, None) => LmEngine::Pipeline(Box::new(Pipeline::new(devices, model, CrossEntropyLoss, optimizer, batch, config.micro_batches, config.schedule)?)),
            (Strategy::Tensor | Strategy::Pipeline, Some(_)) => {
                return Err(Error::InvalidArgument { op: "train --distributed", reason: "across processes wgrad trains data parallel: use --parallel data".into() })
            }
        })
    }

    /// One optimizer step on a global batch of token ids and the tokens
    /// that follow them; the mean loss when `read_loss`.
    fn step(&mut self, ids: &[u32], next: &[u32], read_loss: bool) -> Result<Option<f32>> {
        let targets = Targets::Classes(next);
        match self {
            LmEngine::Single(t) => {
                t.zero_grad();
                t.forward_ids(ids)?;
                t.loss(targets)?;
                t.backward()?;
                if read_loss {
                    t.step_reading_loss().map(Some)
                } else {
                    t.step().map(|()| None)
                }
            }
            LmEngine::Data(d) => d.step(ids, targets, read_loss),
            LmEngine::Distributed(d) => d.step(ids, targets, read_loss),
            LmEngine::Tensor(t) => t.step(ids, targets, read_loss),
            LmEngine::Pipeline(p) => p.step(ids, targets, read_loss),
        }
    }

    /// The mean loss of one global batch, without training on it
    /// (collective across processes).
    fn evaluate_loss(&mut self, ids: &[u32], next: &[u32]) -> Result<f32> {
        let targets = Targets::Classes(next);
        match self {
            LmEngine::Single(t) => t.evaluate_loss(Examples::Ids(ids), targets),
            LmEngine::Data(d) => d.evaluate_loss(ids, targets),
            LmEngine::Distributed(d) => d.evaluate_loss(ids, targets),
            LmEngine::Tensor(t) => t.evaluate_loss(ids, targets),
            LmEngine::Pipeline(p) => p.evaluate_loss(ids, targets),
        }
    }

    /// The parameters under the GPT's names (replicas hold the same ones:
    /// replica 0's).
    fn parameters(&self) -> Result<NamedParameters> {
        match self {
            LmEngine::Single(t) => t.executor().parameters(),
            LmEngine::Data(d) => d.replicas()[0].executor().parameters(),
            LmEngine::Distributed(d) => d.replica().executor().parameters(),
            LmEngine::Tensor(t) => t.parameters(),
            LmEngine::Pipeline(p) => p.parameters(),
        }
    }

    /// (parameter, state name, values) of the optimizer, replica 0's.
    fn optimizer_state(&self) -> Result<Vec<(String, String, Vec<f32>)>> {
        let state = match self {
            LmEngine::Single(t) => t.executor().optimizer_state()?,
            LmEngine::Data(d) => d.replicas()[0].executor().optimizer_state()?,
            LmEngine::Distributed(d) => d.replica().executor().optimizer_state()?,
            LmEngine::Tensor(t) => t.optimizer_state()?,
            LmEngine::Pipeline(p) => p.optimizer_state()?,
        };
        Ok(state.into_iter().map(|(param, name, values)| (param, name.to_string(), values)).collect())
    }

    /// Optimizer steps taken (a resumed run's included).
    fn step_count(&self) -> u64 {
        match self {
            LmEngine::Single(t) => t.executor().step_count(),
            LmEngine::Data(d) => d.replicas()[0].executor().step_count(),
            LmEngine::Distributed(d) => d.replica().executor().step_count(),
            LmEngine::Tensor(t) => t.step_count(),
            LmEngine::Pipeline(p) => p.step_count(),
        }
    }

    /// Loads a resumed folder's optimizer state and step into every
    /// replica. Across processes only rank 0 has `state`, and every rank
    /// then takes rank 0's parameters, state and step (collective).
    fn resume(&mut self, state: Option<&OptimizerState>) -> Result<()> {
        match (self, state) {
            (LmEngine::Single(t), Some(s)) => t.executor_mut().load_state(&[], &s.state, Some(s.step)),
            (LmEngine::Data(d), Some(s)) => d.load_state(&[], &s.state, Some(s.step)),
            (LmEngine::Tensor(t), Some(s)) => t.load_state(&[], &s.state, Some(s.step)),
            (LmEngine::Pipeline(p), Some(s)) => p.load_state(&[], &s.state, Some(s.step)),
            (LmEngine::Distributed(d), state) => {
                if let Some(s) = state {
                    d.local_mut().load_state(&[], &s.state, Some(s.step))?;
                }
                d.sync_from_root()
            }
            (_, None) => Err(Error::InvalidArgument { op: "train --resume", reason: "no optimizer state was read to resume from".into() }),
        }
    }

    /// Dispatches and GPU bytes of one device's step (replica 0's).
    /// For a model split over devices: the dispatches of all its stages,
    /// and the GPU bytes of the device holding the most.
    fn footprint(&self) -> (usize, u64) {
        let exec = match self {
            LmEngine::Single(t) => t.executor(),
            LmEngine::Data(d) => d.replicas()[0].executor(),
            LmEngine::Distributed(d) => d.replica().executor(),
            LmEngine::Tensor(t) => {
                let mut per_device: Vec<u64> = Vec::new();
                let mut dispatches = 0;
                for (device, stage) in t.stages() {
                    if per_device.len() <= device {
                        per_device.resize(device + 1, 0);
                    }
                    per_device[device] += stage.executor().peak_bytes();
                    dispatches += stage.executor().dispatches_per_step();
                }
                return (dispatches, per_device.into_iter().max().unwrap_or(0));
            }
            LmEngine::Pipeline(p) => {
                let dispatches = p.stages().iter().map(|s| s.executor().dispatches_per_step()).sum();
                return (dispatches, p.stage_gpu_bytes().into_iter().max().unwrap_or(0));
            }
        };
        (exec.dispatches_per_step(), exec.peak_bytes())
    }

    /// One line on how the work is spread.
    fn describe(&self) -> String {
        match self {
            LmEngine::Single(t) => format!("single device, {} dispatches per step in one submit", t.executor().dispatches_per_step()),
            LmEngine::Data(d) => d.describe(),
            LmEngine::Distributed(d) => d.describe(),
            LmEngine::Tensor(t) => t.describe(),
            LmEngine::Pipeline(p) => p.describe(),
        }
    }

    /// What the parallelism cost, for the end of a run (empty for one device).
    fn report(&self) -> String {
        match self {
            LmEngine::Single(_) => String::new(),
            LmEngine::Data(d) => d.report(),
            LmEngine::Distributed(d) => d.report(),
            LmEngine::Tensor(t) => t.report(),
            LmEngine::Pipeline(p) => p.report(),
        }
    }

    #[cfg(feature = "fault-injection")]
    fn inject_failure(&mut self, at: Option<(usize, u64, InjectedFailure)>) {
        if let (Some((rank, step, how)), LmEngine::Distributed(d)) = (at, self) {
            d.inject_failure(rank, step, how);
        }
    }
}

/// Opens the devices `config` asks for (see [`LmTrainConfig::devices`]),
/// after checking their number against the strategy and the batch, so an
/// impossible count fails at once instead of after devices open one by one.
fn open_devices(device: &DeviceOptions, config: &LmTrainConfig, across_processes: bool) -> Result<DeviceGroup> {
    config.check()?;
    let selection = match (&config.devices, config.strategy) {
        (Some(selection), _) => Some(selection.clone()),
        (None, Strategy::Data | Strategy::Tensor | Strategy::Pipeline) if !across_processes => Some(DeviceSelection::from_env(DeviceSelection::Count(2))?),
        (None, _) => None,
    };
    match selection {
        Some(selection) => {
            config.check_devices(selection.check()?, across_processes)?;
            DeviceGroup::open(&selection)
        }
        None => DeviceGroup::from_kernels(vec![Arc::new(Kernels::new(Device::open(device)?))]),
    }
}

/// Rank 0's text on every rank, so only rank 0 reads a file (another host
/// may not have it). Collective.
fn shared_text(group: &dyn ProcessGroup, source: &TextSource) -> Result<String> {
    let mut bytes = if group.rank() == 0 { read_text(source)?.into_bytes() } else { Vec::new() };
    group.broadcast_bytes(0, &mut bytes)?;
    String::from_utf8(bytes).map_err(|e| Error::InvalidArgument { op: "train --text", reason: format!("rank 0 sent a text that is not UTF-8: {e}") })
}

/// The model and optimizer state of the folder a run resumes from, checked
/// against this run's sizes and tokenizer.
fn load_resumed(dir: &std::path::Path, tokenizer: &Tokenizer, gpt_config: GptConfig) -> Result<(Gpt, OptimizerState)> {
    let loaded = gpt_folder::load_gpt_folder(dir)?;
    let state = loaded.optimizer.ok_or_else(|| Error::InvalidArgument {
        op: "train --resume",
        reason: format!("`{}` has no optimizer state to resume from", dir.display()),
    })?;
    let spec = TokenizerSpec::from(tokenizer);
    if loaded.model.config != gpt_config || loaded.tokenizer.as_ref() != Some(&spec) {
        return Err(Error::InvalidArgument {
            op: "train --resume",
            reason: format!("`{}` holds {:?} with another tokenizer or size than this run's {gpt_config:?}", dir.display(), loaded.model.config),
        });
    }
    Ok((loaded.model, state))
}

/// A run with its text tokenized, devices open and engine built, ready to
/// [`fit`](Self::fit).
pub struct LmTrainingRun {
    config: LmTrainConfig,
    data: TokenizedText,
    model: Gpt,
    engine: LmEngine,
    devices: DeviceGroup,
    /// Rank 0 of a job across processes, or the only process: the one
    /// that reports progress.
    root: bool,
    info: LmRunInfo,
    validation: (Vec<u32>, Vec<u32>),
}

impl LmTrainingRun {
    /// Tokenizes the text, opens the devices (`config.devices`, checked
    /// first) and builds the engine of `config.strategy`.
    pub fn new(device: &DeviceOptions, config: LmTrainConfig, progress: &mut dyn LmProgress) -> Result<Self> {
        let devices = open_devices(device, &config, false)?;
        Self::with_devices(devices, config, None, progress)
    }

    /// One process of a job across processes (MPI): data parallel over the
    /// devices of every process (`config.devices`, default one per process,
    /// `device`). Every rank calls this and then [`fit`](Self::fit); only
    /// rank 0 reads the text and the folder resumed from, and reports
    /// progress.
    pub fn distributed(device: &DeviceOptions, config: LmTrainConfig, process_group: Arc<dyn ProcessGroup>, progress: &mut dyn LmProgress) -> Result<Self> {
        let devices = open_devices(device, &config, true)?;
        Self::with_devices(devices, config, Some(process_group), progress)
    }

    /// [`LmTrainingRun::new`] on a device already open.
    pub fn with_kernels(kernels: Arc<Kernels>, config: LmTrainConfig, progress: &mut dyn LmProgress) -> Result<Self> {
        Self::with_devices(DeviceGroup::from_kernels(vec![kernels])?, config, None, progress)
    }

    /// On devices already open: `config.strategy` over `devices` (a single
    /// device uses the first), across the processes of `process_group`
    /// when given.
    pub fn with_devices(devices: DeviceGroup, config: LmTrainConfig, process_group: Option<Arc<dyn ProcessGroup>>, progress: &mut dyn LmProgress) -> Result<Self> {
        config.check()?;
        config.check_devices(devices.len(), process_group.is_some())?;
        let root = process_group.as_ref().is_none_or(|g| g.rank() == 0);
        let data = match &process_group {
            None => tokenize(&config.text, config.tokenizer, config.validation_fraction)?,
            Some(group) => tokenize_text(&shared_text(group.as_ref(), &config.text)?, config.tokenizer, config.validation_fraction)?,
        };
        let gpt_config = GptConfig {
            vocab_size: data.tokenizer.vocab_size(),
            block_size: config.block_size,
            n_layer: config.n_layer,
            n_head: config.n_head,
            n_embd: config.n_embd,
        };
        let validation = validation_windows(&data.validation, config.eval_batches * config.batch_size, config.block_size)?;
        if data.train.len() <= config.block_size {
            return Err(Error::InvalidArgument {
                op: "train --model gpt",
                reason: format!("{} training tokens cannot give windows of {}", data.train.len(), config.block_size + 1),
            });
        }
        nn::manual_seed(config.seed);
        // Across processes rank 0 reads the folder; the other ranks take
        // its parameters and state when the engine starts and resumes.
        let (model, resumed) = match &config.resume {
            Some(dir) if root => {
                let (model, state) = load_resumed(dir, &data.tokenizer, gpt_config)?;
                (model, Some(state))
            }
            _ => (Gpt::new(gpt_config)?, None),
        };
        if root {
            progress.preparing();
        }
        #[allow(unused_mut)]
        let mut engine = LmEngine::new(&config, &devices, process_group, &model)?;
        #[cfg(feature = "fault-injection")]
        engine.inject_failure(config.fail_at);
        if config.resume.is_some() {
            engine.resume(resumed.as_ref())?;
        }
        let (dispatches_per_step, peak_gpu_bytes) = engine.footprint();
        let info = LmRunInfo {
            devices: devices.labels(),
            engine: engine.describe(),
            model: model.describe(),
            parameters: model.num_parameters(),
            tokenizer: data.tokenizer.kind(),
            vocab_size: data.tokenizer.vocab_size(),
            train_tokens: data.train.len(),
            validation_tokens: data.validation.len(),
            steps: config.max_steps,
            first_step: engine.step_count() + 1,
            tokens_per_step: config.batch_size * config.block_size,
            dispatches_per_step,
            peak_gpu_bytes,
        };
        if root {
            progress.started(&info);
        }
        Ok(LmTrainingRun { config, data, model, engine, devices, root, info, validation })
    }

    /// The model's sizes (the vocabulary is the tokenizer's).
    pub fn config(&self) -> GptConfig {
        self.model.config
    }

    pub fn info(&self) -> &LmRunInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.data.tokenizer
    }

    /// The first device (where the CLI generates its sample).
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.devices.members()[0]
    }

    /// Whether this process reports and saves: rank 0 of a job across
    /// processes, or the only process.
    pub fn is_root(&self) -> bool {
        self.root
    }

    /// Where the sample at the end of a run starts: a newline (nanoGPT's
    /// default), or the text's first token when the vocabulary has none.
    pub fn sample_prompt(&self) -> Result<String> {
        if self.data.tokenizer.encode("\n").is_ok_and(|ids| ids.len() == 1) {
            return Ok("\n".into());
        }
        self.data.tokenizer.decode(&self.data.train[..1])
    }

    /// The model with the parameters trained so far.
    pub fn trained_model(&self) -> Result<Gpt> {
        let params = self.engine.parameters()?;
        self.model_with(|name| params.iter().find(|p| p.0 == name).map(|p| p.2.clone()))
    }

    /// This run's model with the parameters `values` gives by name.
    fn model_with(&self, values: impl Fn(&str) -> Option<Vec<f32>>) -> Result<Gpt> {
        Gpt::from_parameters(self.model.config, |name, shape| {
            values(name).ok_or_else(|| Error::InvalidArgument {
                op: "LmTrainingRun::trained_model",
                reason: format!("the trainer has no parameter `{name}` {shape:?}"),
            })
        })
    }

    /// Writes the model folder (atomically): the trained model with GPT-2's
    /// names, the tokenizer and the optimizer state to resume from. Returns
    /// the trained model, read back from the GPU once for both.
    pub fn save(&self, dir: impl AsRef<std::path::Path>) -> Result<Gpt> {
        let model = self.trained_model()?;
        let state = OptimizerState {
            optimizer: optim::describe(&self.config.optimizer()),
            step: self.engine.step_count(),
            state: self.engine.optimizer_state()?,
            metadata: Default::default(),
        };
        gpt_folder::save_gpt_folder(dir, &model, &TokenizerSpec::from(&self.data.tokenizer), Some(&state))?;
        Ok(model)
    }

    /// The mean loss over the fixed validation windows (across processes a
    /// collective: every rank calls it).
    pub fn validation_loss(&mut self) -> Result<f32> {
        let per_batch = self.config.batch_size * self.config.block_size;
        let (inputs, targets) = &self.validation;
        let mut total = 0.0f64;
        for (x, y) in inputs.chunks(per_batch).zip(targets.chunks(per_batch)) {
            total += f64::from(self.engine.evaluate_loss(x, y)?);
        }
        Ok((total / self.config.eval_batches as f64) as f32)
    }

    /// Trains for `max_steps`, with the validation loss every `eval_every`
    /// steps and at the end. Across processes every rank calls it; only
    /// rank 0 reports progress.
    pub fn fit(&mut self, progress: &mut dyn LmProgress) -> Result<LmSummary> {
        let config = self.config.clone();
        let root = self.root;
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let (mut train_curve, mut validation_curve) = (Vec::new(), Vec::new());
        let mut train_seconds = 0.0f64;
        let tokens_per_step = config.batch_size * config.block_size;
        let mut final_validation = f32::NAN;
        // A resumed run draws the windows the first run already trained on
        // first, so it continues the same sequence.
        for _ in 1..self.info.first_step {
            text::random_windows(&self.data.train, config.batch_size, config.block_size, &mut rng)?;
        }
        let first = self.info.first_step;
        for step in first..=config.max_steps {
            let started = Instant::now();
            let (x, y) = text::random_windows(&self.data.train, config.batch_size, config.block_size, &mut rng)?;
            let read = step % config.loss_every == 0 || step == config.max_steps;
            let loss = self.engine.step(&x, &y, read)?;
            train_seconds += started.elapsed().as_secs_f64();
            if root {
                progress.step(step);
            }
            if let Some(loss) = loss {
                train_curve.push((step, loss));
                if root {
                    progress.loss(step, loss, ((step + 1 - first) as usize * tokens_per_step) as f64 / train_seconds.max(1e-9));
                }
            }
            if step % config.eval_every == 0 || step == config.max_steps {
                let loss = self.validation_loss()?;
                validation_curve.push((step, loss));
                if root {
                    progress.validation(step, loss);
                }
                final_validation = loss;
            }
        }
        let steps = (config.max_steps + 1).saturating_sub(first);
        Ok(LmSummary {
            steps,
            train_seconds,
            tokens_per_s: (steps as usize * tokens_per_step) as f64 / train_seconds.max(1e-9),
            ms_per_step: 1e3 * train_seconds / steps.max(1) as f64,
            train_curve,
            validation_curve,
            final_validation_loss: final_validation,
            report: self.engine.report(),
        })
    }
}
