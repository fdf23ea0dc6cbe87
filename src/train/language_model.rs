//! A causal language model trained on text, as `wgrad train --model
//! gpt|llama` runs it (nanoGPT's `train.py` on shakespeare_char): the text
//! and its tokenizer, the held-out split, random windows, AdamW with
//! nanoGPT's parameter groups, warmup and cosine decay, gradient clipping,
//! the validation loss every few steps and at the end. It is a
//! [`Task`] of the one run ([`crate::train`]); the model is any
//! [`TrainableLm`] (the GPT, Llama), which says how it is built, saved and
//! resumed.
//!
//! Fine-tuning ([`LanguageModel::init`], `wgrad train --init`) starts from
//! a [`Pretrained`] model instead: its weights (a GGUF file de-quantized to
//! f32, or a Hugging Face folder), its own tokenizer, windows of a context
//! no longer than its own (a GPT's position table cropped to them, as
//! nanoGPT's `crop_block_size`), fresh AdamW state, and a saved folder
//! with the full context and the source's tokenizer files, which
//! `transformers` loads.
//!
//! The validation loss is the mean over a fixed set of windows of the
//! held-out text, `eval_batches × batch_size` windows evenly spaced from
//! its start ([`validation_windows`]), so two runs — or this engine and
//! `scripts/train_reference.py` in PyTorch — are scored on the same text.

use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::io::bpe::BpeTokenizer;
use crate::io::gemma_folder::{load_gemma_folder, save_gemma_folder_with_files};
use crate::io::gguf::Gguf;
use crate::io::gguf_model::GgufModel;
use crate::io::gpt_folder::{
    load_gpt_folder, read_tokenizer, save_gpt_folder_with_files, OptimizerState, TokenizerSpec,
};
use crate::io::hf_folder::{ExtraFile, TOKENIZER_FILES};
use crate::io::llama_folder::{load_llama_folder, save_llama_folder_with_files};
use crate::io::lm_folder::is_gguf_path;
use crate::io::text::{self, CharTokenizer, Gpt2Bpe, Tokenizer};
use crate::kernels::{Kernels, LrSchedule, OptimizerConfig};
use crate::models::{Gemma, GemmaConfig, Gpt, GptConfig, Llama, LlamaConfig};
use crate::nn::{AttentionKernel, LmConfig};
use crate::optim::{self, Adam, AdamW, SGD};
use crate::parallel::distributed::ProcessGroup;
use crate::parallel::engine::{EngineFuture, Parallelizable, TrainEngine};
use crate::parallel::stage::NamedParameters;
use crate::parallel::{Examples, Targets};
use crate::train::{Evaluation, Prepared, Resumed, Task, TrainConfig};

/// A causal language model the run can build, save and resume: what
/// [`LanguageModel`] needs of a model family, implemented beside each one.
pub trait TrainableLm: Parallelizable + crate::nn::CausalLm {
    /// The sizes (`GptConfig`, `LlamaConfig`), vocabulary included.
    type Config: Clone + Debug + PartialEq + LmConfig;
    /// `config` with the data's vocabulary.
    fn with_vocab(config: Self::Config, vocab_size: usize) -> Self::Config;
    /// `config` with a context of `positions` (fine-tuning's windows).
    fn with_context(config: Self::Config, positions: usize) -> Self::Config;
    /// A model of these sizes, initialised from the seeded generator.
    fn build(config: &Self::Config) -> Result<Self>;
    /// A model of these sizes with each parameter from `take(name, shape)`.
    fn assemble(config: &Self::Config, take: &mut dyn FnMut(&str, &[usize]) -> Result<Vec<f32>>) -> Result<Self>;
    /// The pretrained model at `path`: a GGUF file (de-quantized to f32)
    /// or a Hugging Face folder of this family; another family's is an
    /// error naming it.
    fn load_pretrained(path: &Path) -> Result<Self>;
    /// Every attention computed as `kernel` says.
    fn set_attention_kernel(&mut self, kernel: AttentionKernel);
    fn config(&self) -> Self::Config;
    /// This model's sizes with the parameters `params` gives by name.
    fn with_parameters(&self, params: &NamedParameters) -> Result<Self>;
    /// Writes a model folder (atomically) with the tokenizer, the
    /// optimizer state to resume from where given, and `files` (Hugging
    /// Face tokenizer files) beside the weights.
    fn save_folder(
        &self,
        dir: &Path,
        tokenizer: &TokenizerSpec,
        state: Option<&OptimizerState>,
        files: &[ExtraFile],
    ) -> Result<()>;
    /// Reads a folder [`TrainableLm::save_folder`] wrote: the model, its
    /// tokenizer and optimizer state where the folder has them.
    fn load_folder(dir: &Path) -> Result<(Self, Option<TokenizerSpec>, Option<OptimizerState>)>;
    /// Whether a fine-tune of this model (`--init`) saves its optimizer
    /// state and can be resumed over the same pretrained model
    /// ([`TrainableLm::resume_fine_tune`]): an adapter run's can; a whole
    /// model's moments cover its cropped windows, so it starts afresh.
    const RESUMES_FINE_TUNES: bool = false;
    /// `self` (the `--init` model on the run's windows, as a fresh
    /// fine-tune starts) with what an earlier fine-tune of it saved in
    /// `dir`, and that run's optimizer state.
    fn resume_fine_tune(self, dir: &Path) -> Result<(Self, OptimizerState)> {
        Err(Error::InvalidArgument {
            op: "train --resume",
            reason: format!(
                "`{}`: a fine-tuned model keeps no optimizer state; --init starts a fresh fine-tune",
                dir.display()
            ),
        })
    }
}

/// The families `wgrad train --model` knows: what each [`TrainableLm`]
/// method means is the same for both, only the types and folder functions
/// differ.
macro_rules! trainable_lm {
    ($model:ident, $config:ident, $save:expr, $load:path, $from_gguf:path) => {
        impl TrainableLm for $model {
            type Config = $config;
            fn with_vocab(config: $config, vocab_size: usize) -> $config {
                $config { vocab_size, ..config }
            }
            fn with_context(config: $config, block_size: usize) -> $config {
                $config { block_size, ..config }
            }
            fn build(config: &$config) -> Result<Self> {
                $model::new(*config)
            }
            fn assemble(config: &$config, take: &mut dyn FnMut(&str, &[usize]) -> Result<Vec<f32>>) -> Result<Self> {
                $model::from_parameters(*config, take)
            }
            fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
                $model::set_attention_kernel(self, kernel)
            }
            fn load_pretrained(path: &Path) -> Result<Self> {
                if is_gguf_path(path) {
                    $from_gguf(&GgufModel::open(path)?)
                } else {
                    Ok($load(path)?.model)
                }
            }
            fn config(&self) -> $config {
                self.config
            }
            fn with_parameters(&self, params: &NamedParameters) -> Result<Self> {
                $model::from_parameters(self.config, |name, shape| take_parameter(params, name, shape))
            }
            fn save_folder(
                &self,
                dir: &Path,
                tokenizer: &TokenizerSpec,
                state: Option<&OptimizerState>,
                files: &[ExtraFile],
            ) -> Result<()> {
                $save(dir, self, tokenizer, state, files)
            }
            fn load_folder(dir: &Path) -> Result<(Self, Option<TokenizerSpec>, Option<OptimizerState>)> {
                let loaded = $load(dir)?;
                Ok((loaded.model, loaded.tokenizer, loaded.optimizer))
            }
        }
    };
}

trainable_lm!(
    Gpt,
    GptConfig,
    |dir: &Path, model, tokenizer, state, files| save_gpt_folder_with_files(dir, model, tokenizer, state, files),
    load_gpt_folder,
    GgufModel::to_gpt
);
trainable_lm!(
    Llama,
    LlamaConfig,
    |dir: &Path, model, tokenizer, state, files| save_llama_folder_with_files(
        dir,
        model,
        Some(tokenizer),
        state,
        files
    ),
    load_llama_folder,
    GgufModel::to_llama
);
trainable_lm!(
    Gemma,
    GemmaConfig,
    |dir: &Path, model, tokenizer, state, files| save_gemma_folder_with_files(
        dir,
        model,
        Some(tokenizer),
        state,
        files
    ),
    load_gemma_folder,
    GgufModel::to_gemma
);

/// A pretrained model to fine-tune: its weights, its own tokenizer, and
/// the Hugging Face tokenizer files its fine-tuned folder carries.
#[derive(Clone)]
pub struct Pretrained<M> {
    /// With its full context.
    pub model: M,
    pub tokenizer: Tokenizer,
    /// Copied from a folder, or written from a GGUF file's tokenizer.
    pub files: Vec<ExtraFile>,
    pub source: PathBuf,
}

impl<M: TrainableLm> Debug for Pretrained<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<&str> = self.files.iter().map(|(name, _)| name.as_str()).collect();
        f.debug_struct("Pretrained")
            .field("source", &self.source)
            .field("config", &self.model.config())
            .field("tokenizer", &self.tokenizer.kind())
            .field("files", &files)
            .finish()
    }
}

impl<M: TrainableLm> Pretrained<M> {
    /// The model at `path` with its tokenizer: a GGUF file's (its
    /// metadata's BPE), or a folder's `tokenizer.json` (its tokenizer files
    /// copied), else the folder's wgrad tokenizer (or GPT-2's BPE for
    /// GPT-2's vocabulary). A model with no tokenizer, or one with more
    /// tokens than the model's vocabulary, is an error.
    pub fn load(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "train --init",
            reason,
        };
        if !path.exists() {
            return Err(bad(format!(
                "`{}` does not exist (give a GGUF file or a Hugging Face model folder)",
                path.display()
            )));
        }
        let model = M::load_pretrained(path)?;
        let (tokenizer, files) = if is_gguf_path(path) {
            let bpe = BpeTokenizer::from_gguf(&Gguf::open(path)?)?;
            let files = bpe.hugging_face_files()?;
            (Tokenizer::Bpe(Box::new(bpe)), files)
        } else if let Some(bpe) = BpeTokenizer::from_folder(path)? {
            let mut files = Vec::new();
            for name in TOKENIZER_FILES.iter().filter(|name| path.join(name).is_file()) {
                let file = path.join(name);
                files.push((
                    name.to_string(),
                    std::fs::read(&file).map_err(|source| Error::DataIo {
                        op: "train --init",
                        path: file,
                        source,
                    })?,
                ));
            }
            (Tokenizer::Bpe(Box::new(bpe)), files)
        } else {
            let spec = read_tokenizer(path, model.vocab_size())?.ok_or_else(|| {
                bad(format!(
                    "`{}` has no tokenizer: no tokenizer.json, no {} and not GPT-2's vocabulary",
                    path.display(),
                    crate::io::gpt_folder::TOKENIZER_FILE
                ))
            })?;
            (spec.tokenizer()?, Vec::new())
        };
        if tokenizer.vocab_size() > model.vocab_size() {
            return Err(bad(format!(
                "`{}`: the tokenizer has {} tokens, more than the model's vocabulary of {}",
                path.display(),
                tokenizer.vocab_size(),
                model.vocab_size()
            )));
        }
        Ok(Pretrained {
            model,
            tokenizer,
            files,
            source: path.to_path_buf(),
        })
    }

    /// The model on windows of `positions` tokens, at most its context: a
    /// table over positions keeps its first rows (nanoGPT's
    /// `crop_block_size`).
    pub fn cropped(&self, positions: usize) -> Result<M> {
        let context = self.model.context_len();
        if positions == 0 || positions > context {
            return Err(Error::InvalidArgument {
                op: "train --init",
                reason: format!("windows of {positions} tokens: the model's context is {context}"),
            });
        }
        let params = self.model.parameter_values();
        M::assemble(&M::with_context(self.model.config(), positions), &mut |name, shape| {
            let values = params
                .iter()
                .find(|p| p.0 == name)
                .map(|p| p.2)
                .ok_or_else(|| missing_parameter(name, shape))?;
            values
                .get(..shape.iter().product())
                .map(<[f32]>::to_vec)
                .ok_or_else(|| missing_parameter(name, shape))
        })
    }

    /// `trained` (a [`Pretrained::cropped`] model after training) with the
    /// full context back: rows of a position table past the windows are
    /// the pretrained ones, which training never reached.
    pub fn uncropped<'p>(&'p self, trained: &'p M) -> Result<M> {
        let (trained, pretrained) = (trained.parameter_values(), self.model.parameter_values());
        M::assemble(&self.model.config(), &mut |name, shape| {
            let find = |params: &[(String, Vec<usize>, &'p [f32])]| -> Option<&'p [f32]> {
                params.iter().find(|p| p.0 == name).map(|p| p.2)
            };
            let (Some(t), Some(p)) = (find(&trained), find(&pretrained)) else {
                return Err(missing_parameter(name, shape));
            };
            let rest = p
                .get(t.len()..shape.iter().product())
                .ok_or_else(|| missing_parameter(name, shape))?;
            Ok([t, rest].concat())
        })
    }
}

fn missing_parameter(name: &str, shape: &[usize]) -> Error {
    Error::InvalidArgument {
        op: "Pretrained",
        reason: format!("the model has no parameter `{name}` with {shape:?} values"),
    }
}

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

/// The values of parameter `name` in `params`, for
/// [`TrainableLm::with_parameters`].
pub fn take_parameter(params: &NamedParameters, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    params
        .iter()
        .find(|p| p.0 == name)
        .map(|p| p.2.clone())
        .ok_or_else(|| Error::InvalidArgument {
            op: "TrainableLm::with_parameters",
            reason: format!("the trainer has no parameter `{name}` {shape:?}"),
        })
}

/// AdamW as nanoGPT trains: decay on weight matrices only, linear warmup,
/// cosine decay to `min_lr` at the last step, gradient clipping.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWSchedule {
    /// Peak learning rate, reached after `warmup_steps`.
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    pub weight_decay: f32,
    pub betas: (f32, f32),
    pub clip_grad_norm: Option<f32>,
}

impl Default for AdamWSchedule {
    fn default() -> Self {
        AdamWSchedule {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 40,
            weight_decay: 0.1,
            betas: (0.9, 0.99),
            clip_grad_norm: Some(1.0),
        }
    }
}

/// The update rule a language model's run steps with; the schedule, the
/// clipping and the weight-decay groups of [`AdamWSchedule`] apply to each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LmUpdate {
    /// Decoupled weight decay: nanoGPT's, and the default.
    AdamW,
    /// Weight decay as an L2 term of the gradient, as torch.optim.Adam.
    Adam,
    Sgd {
        momentum: f32,
    },
}

impl AdamWSchedule {
    /// The optimizer of a run of `max_steps`; a run shorter than the warmup
    /// warms up over the whole run.
    pub fn optimizer(&self, max_steps: u64) -> OptimizerConfig {
        self.optimizer_for(LmUpdate::AdamW, max_steps)
    }

    /// [`AdamWSchedule::optimizer`] with another update rule (`betas` are
    /// Adam's and AdamW's only).
    pub fn optimizer_for(&self, update: LmUpdate, max_steps: u64) -> OptimizerConfig {
        let schedule = LrSchedule::WarmupCosine {
            warmup_steps: self.warmup_steps.min(max_steps),
            total_steps: max_steps,
            min_lr: self.min_lr,
        };
        // Each builder takes the settings every optimizer shares.
        macro_rules! shared {
            ($optimizer:expr) => {{
                let o = $optimizer
                    .weight_decay(self.weight_decay)
                    .schedule(schedule)
                    .decay_matrices_only();
                match self.clip_grad_norm {
                    Some(max_norm) => o.clip_grad_norm(max_norm).into(),
                    None => o.into(),
                }
            }};
        }
        let (b1, b2) = self.betas;
        match update {
            LmUpdate::AdamW => shared!(AdamW::new(self.lr).betas(b1, b2)),
            LmUpdate::Adam => shared!(Adam::new(self.lr).betas(b1, b2)),
            LmUpdate::Sgd { momentum } => shared!(SGD::new(self.lr).momentum(momentum)),
        }
    }
}

/// `make train`'s GPT: 0.8M parameters, nanoGPT's shakespeare_char scaled
/// down to train in under 10 minutes on two CPU cores' software adapter
/// (the vocabulary is the data's).
pub const MAKE_TRAIN_GPT: crate::models::GptConfig = crate::models::GptConfig {
    vocab_size: 0,
    block_size: 64,
    n_layer: 4,
    n_head: 4,
    n_embd: 128,
};

/// `make train`'s run: 750 steps of 8 windows, nanoGPT's AdamW, the
/// validation loss every 125 steps. Sizes and steps measured on the 2-core
/// machine's lavapipe: about 0.6 s per step, 750 steps in under 8 minutes.
/// More, shorter steps beat fewer long ones in a fixed time: PyTorch
/// reaches validation 2.2 with these and 2.54 with the same tokens as 200
/// steps of 16 × 128 (scripts/train_reference.py).
pub fn language_model_run() -> TrainConfig {
    const STEPS: u64 = 750;
    TrainConfig {
        batch_size: 8,
        max_steps: Some(STEPS),
        optimizer: AdamWSchedule::default().optimizer(STEPS),
        eval_every: 125,
        ..TrainConfig::default()
    }
}

/// A causal language model `M` on text: random windows to train on, the
/// validation loss on fixed held-out windows, a model folder to save to
/// and resume from (the training windows continue where they stopped, so
/// a resumed run equals an uninterrupted one).
#[derive(Clone, Debug)]
pub struct LanguageModel<M: TrainableLm> {
    pub text: TextSource,
    pub tokenizer: TokenizerKind,
    /// The model's sizes; the vocabulary is the tokenizer's.
    pub model: M::Config,
    /// Batches of fixed held-out windows per validation loss.
    pub eval_batches: usize,
    /// The share of the text, at its end, held out for validation.
    pub validation_fraction: f64,
    /// Fine-tune this model (with its tokenizer) instead of training one
    /// from scratch; `model` is then its config with the windows' context
    /// ([`TrainableLm::with_context`]).
    pub init: Option<Pretrained<M>>,
    /// How the attention layers train; `None` picks by the devices and
    /// the context ([`AttentionKernel::for_devices`]).
    pub attention: Option<AttentionKernel>,
    /// Filled by [`Task::prepare`]; `None` before (`..LanguageModel::new(..)`).
    pub prepared: Option<LmData>,
}

/// A prepared language model's text, windows and generator.
#[derive(Clone, Debug)]
pub struct LmData {
    text: TokenizedText,
    validation: (Vec<u32>, Vec<u32>),
    block_size: usize,
    rng: ChaCha8Rng,
    batch: (Vec<u32>, Vec<u32>),
}

impl<M: TrainableLm> LanguageModel<M> {
    /// `model`'s sizes on the shipped Shakespeare with the char tokenizer.
    pub fn new(model: M::Config) -> Self {
        LanguageModel {
            text: TextSource::Shakespeare,
            tokenizer: TokenizerKind::Char,
            model,
            eval_batches: 16,
            validation_fraction: 0.1,
            init: None,
            attention: None,
            prepared: None,
        }
    }

    fn data_ready(&self) -> Result<&LmData> {
        self.prepared.as_ref().ok_or_else(|| Error::InvalidArgument {
            op: "LanguageModel",
            reason: "the task is not prepared (TrainingRun::new prepares it)".into(),
        })
    }

    /// The tokenizer, once the text is read.
    pub fn text_tokenizer(&self) -> Option<&Tokenizer> {
        self.prepared.as_ref().map(|d| &d.text.tokenizer)
    }

    /// The model with the parameters `engine` trained so far (a
    /// fine-tuned one with its full context).
    pub fn trained_model(&self, engine: &dyn TrainEngine, model: &M) -> Result<M> {
        self.model_with(model, &engine.parameters()?)
    }

    /// The model with `params` (the engine's, as
    /// `TrainingRun::parameters_async` reads them), a fine-tuned one with
    /// its full context.
    pub fn model_with(&self, model: &M, params: &NamedParameters) -> Result<M> {
        let trained = model.with_parameters(params)?;
        match &self.init {
            Some(pretrained) => pretrained.uncropped(&trained),
            None => Ok(trained),
        }
    }

    /// The pretrained model on windows of `block_size`, which must have
    /// the task's `sizes`.
    fn fine_tune_start(&self, block_size: usize, sizes: &M::Config) -> Result<M> {
        let pretrained = self.init.as_ref().ok_or_else(|| Error::InvalidArgument {
            op: "train (language model)",
            reason: "the run fine-tunes no pretrained model".into(),
        })?;
        let model = pretrained.cropped(block_size)?;
        if model.config() != *sizes {
            return Err(Error::InvalidArgument {
                op: "train (language model)",
                reason: format!(
                    "the task's sizes {sizes:?} are not the pretrained model's {:?} on windows of {block_size}",
                    model.config()
                ),
            });
        }
        Ok(model)
    }

    /// The optimizer state `engine` holds after its steps, with what a
    /// resumed run needs to draw the same windows next (the seed and the
    /// batch size; the step is the state's).
    fn resumable_state(&self, engine: &dyn TrainEngine, config: &TrainConfig) -> Result<OptimizerState> {
        let state = engine
            .optimizer_state()?
            .into_iter()
            .map(|(param, name, values)| (param, name.to_string(), values))
            .collect();
        let mut metadata: std::collections::BTreeMap<String, String> = engine
            .read_loss_scale()?
            .map(|s| s.metadata().into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            .unwrap_or_default();
        metadata.insert(DATA_SEED_KEY.into(), config.seed.to_string());
        metadata.insert(DATA_BATCH_KEY.into(), config.batch_size.to_string());
        Ok(OptimizerState {
            optimizer: optim::describe(&config.optimizer),
            step: engine.step_count(),
            state,
            metadata,
        })
    }

    /// Where a sample starts: a newline (nanoGPT's default), or the text's
    /// first token when the vocabulary has none.
    /// A fine-tuned model's starts at the held-out text's first tokens.
    pub fn sample_prompt(&self) -> Result<String> {
        let d = self.data_ready()?;
        if self.init.is_some() {
            return d
                .text
                .tokenizer
                .decode(&d.text.validation[..d.text.validation.len().min(16)]);
        }
        if d.text.tokenizer.encode("\n").is_ok_and(|ids| ids.len() == 1) {
            return Ok("\n".into());
        }
        d.text.tokenizer.decode(&d.text.train[..1])
    }
}

impl<M: TrainableLm> Task for LanguageModel<M> {
    type Model = M;
    const UNIT: &'static str = "tokens";

    fn suit_devices(&self, model: &mut M, devices: &[Arc<Kernels>]) {
        let sizes = model.lm_sizes();
        model.set_attention_kernel(
            self.attention
                .unwrap_or_else(|| AttentionKernel::for_devices(devices, sizes.context, sizes.head_dim)),
        );
    }

    fn prepare(&mut self, config: &TrainConfig, processes: Option<&dyn ProcessGroup>) -> Result<Prepared<M>> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "train (language model)",
                reason,
            })
        };
        if self.eval_batches == 0 || config.max_steps.is_none() {
            return bad("eval_batches and max_steps must be given and positive".into());
        }
        let root = processes.is_none_or(|g| g.rank() == 0);
        if self.init.is_some() && config.resume.is_some() && !M::RESUMES_FINE_TUNES {
            return bad("--init starts from pretrained weights with fresh optimizer state, --resume continues a wgrad run: give one (an adapter run, --lora, resumes over its --init)".into());
        }
        let text = shared_text(processes, &self.text)?;
        let (text, sizes) = match &self.init {
            Some(pretrained) => (
                split_tokens(pretrained.tokenizer.clone(), &text, self.validation_fraction)?,
                self.model.clone(),
            ),
            None => {
                let text = tokenize_text(&text, self.tokenizer, self.validation_fraction)?;
                let sizes = M::with_vocab(self.model.clone(), text.tokenizer.vocab_size());
                (text, sizes)
            }
        };
        let block_size = sizes.lm_sizes().context;
        if text.train.len() <= block_size {
            return bad(format!(
                "{} training tokens cannot give windows of {}",
                text.train.len(),
                block_size + 1
            ));
        }
        let validation = validation_windows(&text.validation, self.eval_batches * config.batch_size, block_size)?;
        // Across processes rank 0 reads the folder; the other ranks take
        // its parameters and state when the engine starts.
        let (model, resumed) = match &config.resume {
            Some(dir) if root && self.init.is_some() => {
                let base = self.fine_tune_start(block_size, &sizes)?;
                let (model, state) = base.resume_fine_tune(dir)?;
                check_data_position(&state, config, dir)?;
                (
                    model,
                    Some(Resumed {
                        parameters: Vec::new(),
                        state,
                    }),
                )
            }
            Some(dir) if root => {
                let (model, tokenizer, state) = M::load_folder(dir)?;
                let state = state.ok_or_else(|| Error::InvalidArgument {
                    op: "train --resume",
                    reason: format!("`{}` has no optimizer state to resume from", dir.display()),
                })?;
                check_data_position(&state, config, dir)?;
                if model.config() != sizes || tokenizer.as_ref() != Some(&TokenizerSpec::from(&text.tokenizer)) {
                    return Err(Error::InvalidArgument {
                        op: "train --resume",
                        reason: format!(
                            "`{}` holds {:?} with another tokenizer or size than this run's {sizes:?}",
                            dir.display(),
                            model.config()
                        ),
                    });
                }
                (
                    model,
                    Some(Resumed {
                        parameters: Vec::new(),
                        state,
                    }),
                )
            }
            _ => match &self.init {
                Some(_) => (self.fine_tune_start(block_size, &sizes)?, None),
                None => (M::build(&sizes)?, None),
            },
        };
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        self.prepared = Some(LmData {
            text,
            validation,
            block_size,
            rng,
            batch: (Vec::new(), Vec::new()),
        });
        Ok(Prepared { model, resumed })
    }

    /// A one-token vocabulary stands in for the text's: splits and stages
    /// do not depend on it.
    fn model_before_data(&self) -> Result<Option<M>> {
        M::build(&M::with_vocab(self.model.clone(), 1)).map(Some)
    }

    fn describe_data(&self) -> String {
        self.prepared.as_ref().map_or_else(String::new, |d| {
            let t = &d.text;
            format!(
                "{} tokenizer, vocabulary {}, {} train / {} validation tokens",
                t.tokenizer.kind(),
                t.tokenizer.vocab_size(),
                t.train.len(),
                t.validation.len()
            )
        })
    }

    fn last_step(&self, config: &TrainConfig, _first_step: u64) -> Result<u64> {
        config.max_steps.ok_or_else(|| Error::InvalidArgument {
            op: "train (language model)",
            reason: "max_steps must be given".into(),
        })
    }

    fn per_step(&self, config: &TrainConfig) -> usize {
        config.batch_size * self.prepared.as_ref().map_or(0, |d| d.block_size)
    }

    /// Draws the windows the first run already trained on, so a resumed
    /// run continues the same sequence.
    fn skip(&mut self, config: &TrainConfig, steps: u64) -> Result<()> {
        for _ in 0..steps {
            self.batch(config)?;
        }
        Ok(())
    }

    fn batch(&mut self, config: &TrainConfig) -> Result<(Examples<'_>, Targets<'_>)> {
        let d = self.prepared.as_mut().ok_or_else(|| Error::InvalidArgument {
            op: "LanguageModel",
            reason: "the task is not prepared".into(),
        })?;
        d.batch = text::random_windows(&d.text.train, config.batch_size, d.block_size, &mut d.rng)?;
        Ok((Examples::Ids(&d.batch.0), Targets::Classes(&d.batch.1)))
    }

    /// The mean loss over the fixed validation windows.
    fn validation_loss(&mut self, engine: &mut dyn TrainEngine, config: &TrainConfig) -> Result<Option<f32>> {
        crate::device::wait("validation_loss", self.validation_loss_async(engine, config))
    }

    fn validation_loss_async<'a>(
        &'a mut self,
        engine: &'a mut dyn TrainEngine,
        config: &'a TrainConfig,
    ) -> EngineFuture<'a, Option<f32>> {
        Box::pin(async move {
            let d = self.data_ready()?;
            let per_batch = config.batch_size * d.block_size;
            let (inputs, targets) = &d.validation;
            let mut total = 0.0f64;
            for (x, y) in inputs.chunks(per_batch).zip(targets.chunks(per_batch)) {
                total += f64::from(
                    engine
                        .evaluate_loss_async(Examples::Ids(x), Targets::Classes(y))
                        .await?,
                );
            }
            Ok(Some((total / self.eval_batches as f64) as f32))
        })
    }

    fn evaluate(&mut self, _engine: &mut dyn TrainEngine, last_validation: Option<f32>) -> Result<Evaluation> {
        Ok(Evaluation::ValidationLoss(last_validation.unwrap_or(f32::NAN)))
    }

    /// The trained model's folder with the tokenizer and the optimizer
    /// state to resume from; a fine-tuned model's with its source's
    /// tokenizer files and no optimizer state (its moments cover the
    /// cropped windows; `--init` again starts a fresh fine-tune).
    fn save(
        &self,
        engine: &dyn TrainEngine,
        model: &M,
        config: &TrainConfig,
        _evaluation: Option<&Evaluation>,
        path: &Path,
    ) -> Result<()> {
        let trained = self.trained_model(engine, model)?;
        let tokenizer = TokenizerSpec::from(&self.data_ready()?.text.tokenizer);
        let state = if self.init.is_none() || M::RESUMES_FINE_TUNES {
            Some(self.resumable_state(engine, config)?)
        } else {
            None
        };
        let files = self.init.as_ref().map_or(&[][..], |p| &p.files[..]);
        trained.save_folder(path, &tokenizer, state.as_ref(), files)
    }
}

/// The seed of a saved run's windows, in its optimizer state's metadata.
const DATA_SEED_KEY: &str = "data.seed";
/// The batch size (windows per step) of a saved run, beside the seed.
const DATA_BATCH_KEY: &str = "data.batch_size";

/// A resumed run draws the windows the saved run would have drawn next
/// only with its seed and batch size: another is refused (a folder saved
/// before these were recorded is taken as it is).
fn check_data_position(state: &OptimizerState, config: &TrainConfig, dir: &Path) -> Result<()> {
    for (key, flag, now) in [
        (DATA_SEED_KEY, "--seed", config.seed.to_string()),
        (DATA_BATCH_KEY, "--batch-size", config.batch_size.to_string()),
    ] {
        if let Some(saved) = state.metadata.get(key).filter(|saved| **saved != now) {
            return Err(Error::InvalidArgument {
                op: "train --resume",
                reason: format!(
                    "`{}` was trained with {flag} {saved}, this run gives {now}: the resumed run would draw other \
                     windows than the saved one (give {flag} {saved})",
                    dir.display()
                ),
            });
        }
    }
    Ok(())
}

/// Tokens of a text, split into training and held-out validation.
#[derive(Clone, Debug)]
pub struct TokenizedText {
    pub tokenizer: Tokenizer,
    pub train: Vec<u32>,
    pub validation: Vec<u32>,
}

/// The text `source` names.
pub fn read_text(source: &TextSource) -> Result<String> {
    match source {
        TextSource::Shakespeare => text::shakespeare(),
        TextSource::Text(text) => Ok(text.clone()),
        // A gzip file (the shipped data/shakespeare.txt.gz) is read decompressed.
        TextSource::File(path) if path.extension().is_some_and(|e| e == "gz") => {
            let file = std::fs::File::open(path).map_err(|source| Error::DataIo {
                op: "train --text",
                path: path.clone(),
                source,
            })?;
            let mut text = String::new();
            std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text).map_err(|source| {
                Error::DataIo {
                    op: "train --text (gzip)",
                    path: path.clone(),
                    source,
                }
            })?;
            Ok(text)
        }
        TextSource::File(path) => std::fs::read_to_string(path).map_err(|source| Error::DataIo {
            op: "train --text",
            path: path.clone(),
            source,
        }),
    }
}

/// The tokens of `text`, split into training and held-out validation: the
/// char vocabulary is every character of the whole text, sorted (nanoGPT's
/// `prepare.py`).
pub fn tokenize_text(text: &str, kind: TokenizerKind, validation_fraction: f64) -> Result<TokenizedText> {
    let tokenizer = match kind {
        TokenizerKind::Char => Tokenizer::Char(CharTokenizer::from_text(text)?),
        TokenizerKind::Gpt2 => Tokenizer::Gpt2(Gpt2Bpe::new()?),
    };
    split_tokens(tokenizer, text, validation_fraction)
}

/// The tokens of `text` by `tokenizer`, split into training and held-out
/// validation.
pub fn split_tokens(tokenizer: Tokenizer, text: &str, validation_fraction: f64) -> Result<TokenizedText> {
    let tokens = tokenizer.encode(text)?;
    let (train, validation) = text::held_out_split(&tokens, validation_fraction)?;
    Ok(TokenizedText {
        tokenizer,
        train: train.to_vec(),
        validation: validation.to_vec(),
    })
}

/// `count` windows of `block_size + 1` tokens spread evenly over `tokens`,
/// window i starting at `i·stride` with `stride = (len − block_size − 1) /
/// count`: inputs and targets, [count, block_size] each.
pub fn validation_windows(tokens: &[u32], count: usize, block_size: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let room = tokens
        .len()
        .checked_sub(block_size + 1)
        .filter(|&r| r >= count && count > 0)
        .ok_or_else(|| Error::InvalidArgument {
            op: "validation_windows",
            reason: format!(
                "{} held-out tokens cannot give {count} windows of {}",
                tokens.len(),
                block_size + 1
            ),
        })?;
    let stride = room / count;
    let (mut inputs, mut targets) = (
        Vec::with_capacity(count * block_size),
        Vec::with_capacity(count * block_size),
    );
    for i in 0..count {
        let start = i * stride;
        inputs.extend_from_slice(&tokens[start..start + block_size]);
        targets.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
    }
    Ok((inputs, targets))
}

/// The text `source` names; across processes rank 0's on every rank, so
/// only rank 0 reads a file (another host may not have it), collectively.
fn shared_text(processes: Option<&dyn ProcessGroup>, source: &TextSource) -> Result<String> {
    let Some(group) = processes else {
        return read_text(source);
    };
    let mut bytes = if group.rank() == 0 {
        read_text(source)?.into_bytes()
    } else {
        Vec::new()
    };
    group.broadcast_bytes(0, &mut bytes)?;
    String::from_utf8(bytes).map_err(|e| Error::InvalidArgument {
        op: "train --text",
        reason: format!("rank 0 sent a text that is not UTF-8: {e}"),
    })
}
