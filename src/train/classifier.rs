//! The digits (or MNIST) classifier as a [`Task`] of the one training run:
//! `wgrad train --model mlp`.

use std::path::{Path, PathBuf};

use super::accuracy;
use super::run::{Evaluation, Prepared, Resumed, Task, TrainConfig};
use crate::error::{Error, Result};
use crate::io::checkpoint;
use crate::io::data::{self, Dataset, Sampler};
use crate::io::gpt_folder::OptimizerState;
use crate::kernels::OptimizerConfig;
use crate::nn::{Layer, Sequential};
use crate::optim::{self};
use crate::parallel::distributed::{broadcast_f32, broadcast_u64, ProcessGroup};
use crate::parallel::engine::TrainEngine;
use crate::parallel::{Examples, Targets};

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
            Ok(DataSplit {
                train,
                test,
                name: format!("mnist:{}", dir.display()),
            })
        }
        None => {
            let (train, test) = data::digits()?.split(test_fraction, seed)?;
            Ok(DataSplit {
                train,
                test,
                name: "digits".to_string(),
            })
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
    Ok(DataSplit {
        train,
        test,
        name: String::from_utf8_lossy(&name_bytes).into_owned(),
    })
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
        Classifier {
            hidden: vec![128],
            epochs: 40,
            test_fraction: 0.2,
            mnist: None,
            prepared: None,
        }
    }
}

impl Classifier {
    /// The train/test split, once prepared.
    pub fn data(&self) -> Option<&DataSplit> {
        self.prepared.as_ref().map(|d| &d.split)
    }

    fn data_ready(&self) -> Result<&ClassifierData> {
        self.prepared.as_ref().ok_or_else(|| Error::InvalidArgument {
            op: "Classifier",
            reason: "the task is not prepared (TrainingRun::new prepares it)".into(),
        })
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
        let (x, y) = (
            vec![0.0; config.batch_size * split.train.features()],
            vec![0; config.batch_size],
        );
        self.prepared = Some(ClassifierData {
            split,
            sampler,
            next: 0,
            x,
            y,
        });
        Ok(Prepared { model, resumed })
    }

    fn describe_data(&self) -> String {
        self.data().map_or_else(String::new, |d| {
            format!("{}, {} train / {} test rows", d.name, d.train.len(), d.test.len())
        })
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
        let d = self.prepared.as_mut().ok_or_else(|| Error::InvalidArgument {
            op: "Classifier",
            reason: "the task is not prepared".into(),
        })?;
        if d.next == d.sampler.num_batches() {
            d.sampler.next_epoch();
            d.next = 0;
        }
        let indices = d.sampler.batch(d.next).ok_or_else(|| Error::Internal {
            op: "Classifier",
            reason: "the sampler has no batch".into(),
        })?;
        d.split.train.fill_batch(indices, &mut d.x, &mut d.y)?;
        d.next += 1;
        Ok((Examples::Features(&d.x), Targets::Classes(&d.y)))
    }

    fn evaluate(&mut self, engine: &mut dyn TrainEngine, _last_validation: Option<f32>) -> Result<Evaluation> {
        let split = &self.data_ready()?.split;
        let test = accuracy(
            &engine.predict(Examples::Features(split.test.x()))?,
            split.test.labels(),
        );
        let train = accuracy(
            &engine.predict(Examples::Features(split.train.x()))?,
            split.train.labels(),
        );
        Ok(Evaluation::Accuracy { train, test })
    }

    fn save(
        &self,
        engine: &dyn TrainEngine,
        _model: &Sequential,
        config: &TrainConfig,
        evaluation: Option<&Evaluation>,
        path: &Path,
    ) -> Result<()> {
        let mut ckpt = engine.checkpoint()?;
        ckpt.set_meta("data", self.data_ready()?.split.name.clone());
        ckpt.set_meta("split_seed", config.seed.to_string());
        ckpt.set_meta("test_fraction", self.test_fraction.to_string());
        if let Some(Evaluation::Accuracy { test, .. }) = evaluation {
            ckpt.set_meta("test_accuracy", format!("{test:.6}"));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| Error::CheckpointIo {
                path: dir.to_path_buf(),
                action: "create the directory",
                source,
            })?;
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
        return Err(Error::InvalidArgument {
            op: "train --resume",
            reason: format!(
                "`{}` holds {saved}, not this run's {}",
                path.display(),
                model.describe()
            ),
        });
    }
    let parameters = ckpt
        .tensors
        .iter()
        .filter(|t| !t.name.starts_with("optim."))
        .map(|t| (t.name.clone(), t.shape.clone(), t.data.clone()))
        .collect();
    let kind = |d: &str| d.split_whitespace().next().unwrap_or_default().to_string();
    let ours = optim::describe(optimizer);
    let state = match OptimizerState::from_checkpoint(&ckpt) {
        Ok(state) if kind(&state.optimizer) == kind(&ours) => state,
        _ => {
            log::warn!(
                "checkpoint optimizer {:?} differs from {ours:?}: loading parameters only",
                ckpt.meta("optimizer")
            );
            OptimizerState {
                step: 0,
                ..Default::default()
            }
        }
    };
    Ok(Resumed { parameters, state })
}
