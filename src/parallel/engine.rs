//! One front for every strategy, so a training loop (the CLI's, an
//! example's) is written once: step, predict, checkpoint.

use std::sync::Arc;

use super::data::{DataParallel, Split};
use super::distributed::{DistributedDataParallel, ProcessGroup};
use super::pipeline::Pipeline;
use super::tensor::TensorParallel;
use super::DeviceGroup;
use crate::checkpoint::{Checkpoint, NamedTensor};
use crate::error::{Error, Result};
use crate::kernels::OptimizerConfig;
use crate::nn::{Criterion, Layer, Sequential};
use crate::optim;
use crate::trainer::{Targets, Trainer};

/// How the work is spread over devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    Single,
    Data,
    Pipeline,
    Tensor,
}

impl Strategy {
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "none" | "single" => Ok(Strategy::Single),
            "data" => Ok(Strategy::Data),
            "pipeline" | "model" => Ok(Strategy::Pipeline),
            "tensor" => Ok(Strategy::Tensor),
            other => Err(Error::InvalidArgument { op: "parallel", reason: format!("unknown strategy `{other}`: use data, pipeline or tensor") }),
        }
    }

    /// Whether `devices` devices can split a global batch of `batch` rows
    /// (one row each at least, and one entry per device in a fixed
    /// `split`), for any model: [`Strategy::check_devices`] for a
    /// Sequential, and the GPT's run, use it.
    pub fn check_data_devices(devices: usize, batch: usize, split: Option<&[usize]>) -> Result<()> {
        super::check_limit(devices)?;
        if devices > batch {
            return Err(Error::InvalidArgument {
                op: "data parallel",
                reason: format!("{devices} devices need at least one row each, but the global batch has {batch} rows: use at most {batch} devices or a larger batch"),
            });
        }
        match split {
            Some(rows) if rows.len() != devices => Err(Error::InvalidArgument {
                op: "data parallel split",
                reason: format!("rows {rows:?} name {} devices, but {devices} devices are selected", rows.len()),
            }),
            _ => Ok(()),
        }
    }

    /// Whether `devices` devices can share `model` this way, checked before
    /// any is opened (the constructors check again on the opened group):
    /// data parallel needs a row of the `batch` per device (and one entry
    /// per device in a fixed `split`), the pipeline a Linear layer per
    /// stage, tensor parallel a hidden unit of the split block per device.
    pub fn check_devices(self, devices: usize, model: &Sequential, batch: usize, split: Option<&[usize]>) -> Result<()> {
        super::check_limit(devices)?;
        match self {
            Strategy::Single => Ok(()),
            Strategy::Data => Self::check_data_devices(devices, batch, split),
            Strategy::Pipeline => {
                let linears = model.layers.iter().filter(|l| matches!(l, Layer::Linear(_))).count();
                if devices > linears {
                    return Err(Error::InvalidArgument {
                        op: "pipeline parallel",
                        reason: format!("{devices} devices need a stage with a Linear layer each, but the model has {linears} Linear layers: use at most {linears} devices or more layers"),
                    });
                }
                Ok(())
            }
            Strategy::Tensor => {
                let hidden = match &model.layers[tensor_block(model)?] {
                    Layer::Linear(l) => l.out_features,
                    _ => 0,
                };
                if devices > hidden {
                    return Err(Error::InvalidArgument {
                        op: "tensor parallel",
                        reason: format!("{devices} devices need at least one hidden unit each, but the split block has {hidden}: use at most {hidden} devices or a wider layer"),
                    });
                }
                Ok(())
            }
        }
    }
}

/// The block tensor parallel splits: the first Linear-activation-Linear.
fn tensor_block(model: &Sequential) -> Result<usize> {
    (0..model.layers.len().saturating_sub(2))
        .find(|&i| TensorParallel::is_block(&model.layers[i..i + 3]))
        .ok_or_else(|| Error::InvalidArgument { op: "tensor parallel", reason: "the model has no Linear-activation-Linear block".into() })
}

pub enum Engine {
    Single(Box<Trainer>),
    Data(DataParallel),
    Pipeline(Pipeline),
    /// Boxed: it is several times the size of the other variants.
    Tensor(Box<TensorParallel>),
    /// Data parallel over the processes of a job (MPI) and, inside each,
    /// over its local devices.
    Distributed(DistributedDataParallel<Arc<dyn ProcessGroup>>),
}

impl Engine {
    /// Builds `strategy` over `group` (Single uses its first device).
    /// `micro_batches` is for the pipeline; `split` fixes data-parallel
    /// shares (otherwise measured); the tensor-parallel block is the first
    /// Linear-activation-Linear of the model.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        strategy: Strategy,
        group: &DeviceGroup,
        model: &Sequential,
        criterion: Criterion,
        optimizer: OptimizerConfig,
        batch: usize,
        micro_batches: usize,
        split: Option<Vec<usize>>,
    ) -> Result<Self> {
        Ok(match strategy {
            Strategy::Single => Engine::Single(Box::new(Trainer::new(group.members()[0].clone(), model, criterion, optimizer, batch)?)),
            Strategy::Data => {
                let split = split.map_or(Split::Measured { every: 20 }, Split::Rows);
                Engine::Data(DataParallel::new(group, model, criterion, optimizer, batch, split)?)
            }
            Strategy::Pipeline => Engine::Pipeline(Pipeline::new(group, model, criterion, optimizer, batch, micro_batches, None)?),
            Strategy::Tensor => Engine::Tensor(Box::new(TensorParallel::new(group, model, criterion, optimizer, batch, tensor_block(model)?)?)),
        })
    }

    /// One optimizer step on a batch; the mean loss when `read_loss`.
    pub fn step(&mut self, x: &[f32], targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
        match self {
            Engine::Single(t) => {
                t.zero_grad();
                t.forward(x)?;
                t.loss(targets)?;
                t.backward()?;
                if read_loss {
                    t.step_reading_loss().map(Some)
                } else {
                    t.step().map(|_| None)
                }
            }
            Engine::Data(d) => d.step(x, targets, read_loss),
            Engine::Pipeline(p) => p.step(x, targets, read_loss),
            Engine::Tensor(t) => t.step(x, targets, read_loss),
            Engine::Distributed(d) => d.step(x, targets, read_loss),
        }
    }

    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        match self {
            Engine::Single(t) => t.predict(features),
            Engine::Data(d) => d.predict(features),
            Engine::Pipeline(p) => p.predict(features),
            Engine::Tensor(t) => t.predict(features),
            Engine::Distributed(d) => d.predict(features),
        }
    }

    /// Parameters under their single-device names (gathered from stages or
    /// shards), optimizer state where one replica holds all of it, and
    /// metadata, so `wgrad infer` loads any of them the same way.
    pub fn checkpoint(&self, model: &Sequential, optimizer: &OptimizerConfig) -> Result<Checkpoint> {
        let (mut ckpt, steps) = match self {
            Engine::Single(t) => return t.checkpoint(),
            Engine::Data(d) => return d.replicas()[0].checkpoint(),
            Engine::Distributed(d) => return d.replica().checkpoint(),
            Engine::Pipeline(p) => (Checkpoint::new(), p.stats().steps),
            Engine::Tensor(t) => (Checkpoint::new(), t.stats().steps),
        };
        let params = match self {
            Engine::Pipeline(p) => p.parameters()?,
            Engine::Tensor(t) => t.parameters()?,
            _ => Vec::new(),
        };
        for (name, shape, data) in params {
            ckpt.push(NamedTensor::new(name, shape, data)?);
        }
        ckpt.set_meta("format", "wgrad");
        ckpt.set_meta("model", model.describe());
        ckpt.set_meta("optimizer", optim::describe(optimizer));
        ckpt.set_meta("step", steps.to_string());
        Ok(ckpt)
    }

    /// One line on how the work is spread.
    pub fn describe(&self) -> String {
        match self {
            Engine::Single(t) => format!("single device, {} dispatches per step in one submit", t.executor().dispatches_per_step()),
            Engine::Data(d) => d.describe(),
            Engine::Pipeline(p) => format!(
                "pipeline parallel, {} stages of {:?} layers, ideal bubble {:.0}%",
                p.stages().len(), p.layer_counts(), 100.0 * p.ideal_bubble_fraction()
            ),
            Engine::Tensor(t) => format!("tensor parallel, hidden units per device {:?}", t.hidden_split()),
            Engine::Distributed(d) => d.describe(),
        }
    }

    /// What the run cost, for the end of training.
    pub fn report(&self) -> String {
        fn share(part: std::time::Duration, whole: std::time::Duration) -> f64 {
            100.0 * part.as_secs_f64() / whole.as_secs_f64().max(1e-9)
        }
        match self {
            Engine::Single(_) => String::new(),
            Engine::Data(d) => d.report(),
            Engine::Pipeline(p) => format!(
                "{}; measured bubble {:.0}%; communication {:.0}% of step time",
                self.describe(), 100.0 * p.measured_bubble_fraction(), share(p.stats().communication, p.stats().wall)
            ),
            Engine::Tensor(t) => format!("{}; communication {:.0}% of step time", self.describe(), share(t.stats().communication, t.stats().wall)),
            Engine::Distributed(d) => d.report(),
        }
    }
}
