//! Fine-tuning low-rank adapters in the one training run: a [`Lora`] over
//! any [`TrainableLm`] is itself one, so [`LanguageModel`](super::LanguageModel)
//! trains it as it trains the base, and the plan trains the adapters only
//! (the forward freezes the base). `wgrad train --init … --lora …` runs it.
//!
//! The adapters' sizes follow the base's: a pretrained model cropped to
//! shorter windows keeps every adapter whole ([`Pretrained::cropped`]
//! crops position tables only). A folder is a PEFT adapter folder
//! (`adapter_config.json`, `adapter_model.safetensors`) with the run's
//! optimizer state beside it (`optimizer.safetensors`: the adapters'
//! moments, the step, the data's seed and batch size). It holds no base,
//! so it is not loaded alone: `--resume` continues it over the same
//! `--init` ([`TrainableLm::resume_fine_tune`]).

use std::path::Path;

use super::language_model::{take_parameter, Pretrained, TrainableLm};
use crate::error::{Error, Result};
use crate::io::gpt_folder::{OptimizerState, TokenizerSpec};
use crate::io::hf_folder::{write_extra_files, ExtraFile};
use crate::nn::{AttentionKernel, BaseStorage, LmConfig, LmSizes, Lora, LoraConfig, ParameterTree};
use crate::parallel::stage::NamedParameters;

/// A base model's sizes with the adapters declared over it, and how the
/// frozen base is stored on the device (f32 by default; QLoRA keeps a
/// GGUF file's blocks).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraLmConfig<C> {
    pub base: C,
    pub lora: LoraConfig,
    pub storage: BaseStorage,
}

impl<C> LoraLmConfig<C> {
    /// Adapters `lora` over a base of sizes `base`, stored in f32.
    pub fn new(base: C, lora: LoraConfig) -> Self {
        LoraLmConfig {
            base,
            lora,
            storage: BaseStorage::F32,
        }
    }
}

impl<C: LmConfig> LmConfig for LoraLmConfig<C> {
    fn lm_sizes(&self) -> LmSizes {
        self.base.lm_sizes()
    }
}

fn no_folder(op: &'static str, path: &Path) -> Error {
    Error::InvalidArgument {
        op,
        reason: format!(
            "`{}`: a LoRA adapter folder holds no base model and no optimizer state; \
             load the base, then the adapter over it (wgrad::io::peft::load)",
            path.display()
        ),
    }
}

impl<M: TrainableLm> TrainableLm for Lora<M> {
    type Config = LoraLmConfig<M::Config>;

    fn with_vocab(config: Self::Config, vocab_size: usize) -> Self::Config {
        LoraLmConfig {
            base: M::with_vocab(config.base, vocab_size),
            ..config
        }
    }

    fn with_context(config: Self::Config, positions: usize) -> Self::Config {
        LoraLmConfig {
            base: M::with_context(config.base, positions),
            ..config
        }
    }

    /// The base built from the seeded generator, then adapters as PEFT
    /// initialises them (A random, B zero).
    fn build(config: &Self::Config) -> Result<Self> {
        Ok(Lora::new(M::build(&config.base)?, config.lora.clone())?.with_base_storage(config.storage.clone()))
    }

    /// The base and every adapter's A and B from `take`.
    fn assemble(config: &Self::Config, take: &mut dyn FnMut(&str, &[usize]) -> Result<Vec<f32>>) -> Result<Self> {
        let base = M::assemble(&config.base, take)?;
        let mut model = Lora::new(base, config.lora.clone())?.with_base_storage(config.storage.clone());
        let adapter = |name: &str| name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
        model.visit_mut("", &mut |name, shape, values| {
            if adapter(&name) {
                *values = take(&name, &shape)?;
            }
            Ok(())
        })?;
        Ok(model)
    }

    fn load_pretrained(path: &Path) -> Result<Self> {
        Err(no_folder("Lora::load_pretrained", path))
    }

    fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        self.base.set_attention_kernel(kernel);
    }

    fn config(&self) -> Self::Config {
        LoraLmConfig {
            base: self.base.config(),
            lora: self.config.clone(),
            storage: self.base_storage().clone(),
        }
    }

    /// This model with the adapters of `params`; the base is this one's
    /// (frozen: training never changes it, and a quantized base has no
    /// f32 values to read back).
    fn with_parameters(&self, params: &NamedParameters) -> Result<Self> {
        let mut model = self.clone();
        model.visit_mut("", &mut |name, shape, values| {
            if name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") {
                *values = take_parameter(params, &name, &shape)?;
            }
            Ok(())
        })?;
        Ok(model)
    }

    /// The PEFT adapter folder (no base model named; `files`, the base's
    /// tokenizer files, beside it) with the optimizer state to resume from
    /// where given ([`crate::io::peft::save_state`]).
    fn save_folder(
        &self,
        dir: &Path,
        _tokenizer: &TokenizerSpec,
        state: Option<&OptimizerState>,
        files: &[ExtraFile],
    ) -> Result<()> {
        crate::io::peft::save_lora(dir, self, "")?;
        if let Some(state) = state {
            crate::io::peft::save_state(dir, self, state)?;
        }
        write_extra_files(dir, files)
    }

    fn load_folder(dir: &Path) -> Result<(Self, Option<TokenizerSpec>, Option<OptimizerState>)> {
        Err(no_folder("train --resume", dir))
    }

    const RESUMES_FINE_TUNES: bool = true;

    /// The folder's adapters over this run's base, which must be declared
    /// as this run declares them (rank, alpha, dropout, targets), and the
    /// optimizer state the run saved beside them.
    fn resume_fine_tune(self, dir: &Path) -> Result<(Self, OptimizerState)> {
        let peft = crate::io::peft::read(dir)?;
        if peft.config != self.config {
            let show = |c: &LoraConfig| {
                format!(
                    "r={},alpha={},dropout={},targets={}",
                    c.r,
                    c.alpha,
                    c.dropout,
                    c.targets.join(",")
                )
            };
            return Err(Error::InvalidArgument {
                op: "train --resume",
                reason: format!(
                    "`{}` holds adapters {}, but --lora declares {}: give the saved run's --lora",
                    dir.display(),
                    show(&peft.config),
                    show(&self.config)
                ),
            });
        }
        let model = peft.apply(self.base)?;
        let state = crate::io::peft::read_state(dir, &model)?.ok_or_else(|| Error::InvalidArgument {
            op: "train --resume",
            reason: format!(
                "`{}` has no {}: only a folder `wgrad train --lora` saved can be resumed (an adapter PEFT wrote \
                 starts a new run: it holds no optimizer state)",
                dir.display(),
                crate::io::peft::STATE_FILE
            ),
        })?;
        Ok((model, state))
    }
}

impl<M: TrainableLm> Pretrained<M> {
    /// The pretrained model with adapters declared by `config` over it
    /// ([`Lora::new`]): the same tokenizer, files and source.
    pub fn with_lora(self, config: LoraConfig) -> Result<Pretrained<Lora<M>>> {
        self.with_lora_storage(config, BaseStorage::F32)
    }

    /// [`Pretrained::with_lora`] with the frozen base stored as `storage`
    /// on the device (QLoRA: a GGUF file's quantized blocks).
    pub fn with_lora_storage(self, config: LoraConfig, storage: BaseStorage) -> Result<Pretrained<Lora<M>>> {
        Ok(Pretrained {
            model: Lora::new(self.model, config)?.with_base_storage(storage),
            tokenizer: self.tokenizer,
            files: self.files,
            source: self.source,
        })
    }
}
