//! A GPT trained on text, as `wgrad train --model gpt` runs it (nanoGPT's
//! `train.py` on shakespeare_char): the text and its tokenizer, the
//! held-out split, random windows, AdamW with nanoGPT's parameter groups,
//! warmup and cosine decay, gradient clipping, the validation loss every
//! few steps and at the end. The caller prints: progress comes back through
//! [`LmProgress`], the result as an [`LmSummary`].
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
use crate::optim::AdamW;
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
    pub resume: Option<PathBuf>,
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
        Ok(())
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
    let text = match source {
        TextSource::Shakespeare => text::shakespeare()?,
        TextSource::Text(text) => text.clone(),
        TextSource::File(path) => std::fs::read_to_string(path).map_err(|source| Error::DataIo { op: "train --text", path: path.clone(), source })?,
    };
    let tokenizer = match kind {
        TokenizerKind::Char => Tokenizer::Char(CharTokenizer::from_text(&text)?),
        TokenizerKind::Gpt2 => Tokenizer::Gpt2(Gpt2Bpe::new()?),
    };
    let tokens = tokenizer.encode(&text)?;
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
    pub device: String,
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
}

/// A run with its text tokenized, device open and trainer built, ready to
/// [`fit`](Self::fit).
pub struct LmTrainingRun {
    config: LmTrainConfig,
    data: TokenizedText,
    model: Gpt,
    trainer: Trainer,
    kernels: Arc<Kernels>,
    info: LmRunInfo,
    validation: (Vec<u32>, Vec<u32>),
}

impl LmTrainingRun {
    /// Tokenizes the text, opens the device and builds the trainer.
    pub fn new(device: &DeviceOptions, config: LmTrainConfig, progress: &mut dyn LmProgress) -> Result<Self> {
        config.check()?;
        let kernels = Arc::new(Kernels::new(Device::open(device)?));
        Self::with_kernels(kernels, config, progress)
    }

    /// [`LmTrainingRun::new`] on a device already open.
    pub fn with_kernels(kernels: Arc<Kernels>, config: LmTrainConfig, progress: &mut dyn LmProgress) -> Result<Self> {
        config.check()?;
        let data = tokenize(&config.text, config.tokenizer, config.validation_fraction)?;
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
        let (model, resumed) = match &config.resume {
            None => (Gpt::new(gpt_config)?, None),
            Some(dir) => {
                let loaded = gpt_folder::load_gpt_folder(dir)?;
                let state = loaded.optimizer.ok_or_else(|| Error::InvalidArgument {
                    op: "train --resume",
                    reason: format!("`{}` has no optimizer state to resume from", dir.display()),
                })?;
                let spec = TokenizerSpec::from(&data.tokenizer);
                if loaded.model.config != gpt_config || loaded.tokenizer.as_ref() != Some(&spec) {
                    return Err(Error::InvalidArgument {
                        op: "train --resume",
                        reason: format!(
                            "`{}` holds {:?} with another tokenizer or size than this run's {gpt_config:?}",
                            dir.display(),
                            loaded.model.config
                        ),
                    });
                }
                (loaded.model, Some(state))
            }
        };
        progress.preparing();
        let mut trainer = Trainer::new(kernels.clone(), &model, CrossEntropyLoss, config.optimizer(), config.batch_size)?;
        if let Some(state) = &resumed {
            trainer.executor_mut().load_state(&[], &state.state, Some(state.step))?;
        }
        let info = LmRunInfo {
            device: kernels.device().label(),
            model: model.describe(),
            parameters: model.num_parameters(),
            tokenizer: data.tokenizer.kind(),
            vocab_size: data.tokenizer.vocab_size(),
            train_tokens: data.train.len(),
            validation_tokens: data.validation.len(),
            steps: config.max_steps,
            first_step: resumed.as_ref().map_or(1, |s| s.step + 1),
            tokens_per_step: config.batch_size * config.block_size,
            dispatches_per_step: trainer.executor().dispatches_per_step(),
            peak_gpu_bytes: trainer.executor().peak_bytes(),
        };
        progress.started(&info);
        Ok(LmTrainingRun { config, data, model, trainer, kernels, info, validation })
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

    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    pub fn trainer(&self) -> &Trainer {
        &self.trainer
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
        let params = self.trainer.executor().parameters()?;
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
        let checkpoint = self.trainer.checkpoint()?;
        let model = self.model_with(|name| checkpoint.get(name).map(|t| t.data.clone()))?;
        let state = OptimizerState::from_checkpoint(&checkpoint)?;
        gpt_folder::save_gpt_folder(dir, &model, &TokenizerSpec::from(&self.data.tokenizer), Some(&state))?;
        Ok(model)
    }

    /// The mean loss over the fixed validation windows.
    pub fn validation_loss(&mut self) -> Result<f32> {
        let per_batch = self.config.batch_size * self.config.block_size;
        let (inputs, targets) = &self.validation;
        let mut total = 0.0f64;
        for (x, y) in inputs.chunks(per_batch).zip(targets.chunks(per_batch)) {
            total += f64::from(self.trainer.evaluate_loss(Examples::Ids(x), Targets::Classes(y))?);
        }
        Ok((total / self.config.eval_batches as f64) as f32)
    }

    /// Trains for `max_steps`, with the validation loss every `eval_every`
    /// steps and at the end.
    pub fn fit(&mut self, progress: &mut dyn LmProgress) -> Result<LmSummary> {
        let config = self.config.clone();
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
            self.trainer.zero_grad();
            self.trainer.forward_ids(&x)?;
            self.trainer.loss(Targets::Classes(&y))?;
            self.trainer.backward()?;
            progress.step(step);
            if step % config.loss_every == 0 || step == config.max_steps {
                let loss = self.trainer.step_reading_loss()?;
                train_seconds += started.elapsed().as_secs_f64();
                train_curve.push((step, loss));
                progress.loss(step, loss, ((step + 1 - first) as usize * tokens_per_step) as f64 / train_seconds.max(1e-9));
            } else {
                self.trainer.step()?;
                train_seconds += started.elapsed().as_secs_f64();
            }
            if step % config.eval_every == 0 || step == config.max_steps {
                let loss = self.validation_loss()?;
                validation_curve.push((step, loss));
                progress.validation(step, loss);
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
        })
    }
}
