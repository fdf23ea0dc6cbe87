//! One front for every strategy, so a training loop (the CLI's, an
//! example's) is written once: step, predict, checkpoint.

use std::sync::Arc;

use super::data::{DataParallel, Split};
use super::distributed::{DistributedDataParallel, ProcessGroup};
use super::pipeline::{partition, Pipeline, Schedule};
use super::tensor::TensorParallel;
use super::DeviceGroup;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::kernels::OptimizerConfig;
use crate::nn::{Criterion, Staged};
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
    /// `split`), for any model: [`Strategy::check_devices`] and the
    /// language-model run use it.
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
    /// per device in a fixed `split`), the pipeline a unit of work per
    /// stage, tensor parallel a share of every split layer per device.
    pub fn check_devices<M: Staged>(self, devices: usize, model: &M, batch: usize, split: Option<&[usize]>) -> Result<()> {
        super::check_limit(devices)?;
        match self {
            Strategy::Single => Ok(()),
            Strategy::Data => Self::check_data_devices(devices, batch, split),
            Strategy::Pipeline => partition(&model.stage_costs(), devices).map(|_| ()),
            Strategy::Tensor => TensorParallel::check(model, devices, batch),
        }
    }
}

pub enum Engine {
    Single(Box<Trainer>),
    Data(DataParallel),
    Pipeline(Box<Pipeline>),
    /// Boxed: it is several times the size of the other variants.
    Tensor(Box<TensorParallel>),
    /// Data parallel over the processes of a job (MPI) and, inside each,
    /// over its local devices.
    Distributed(DistributedDataParallel<Arc<dyn ProcessGroup>>),
}

impl Engine {
    /// Builds `strategy` over `group` (Single uses its first device).
    /// `micro_batches` is for the pipeline; `split` fixes data-parallel
    /// shares (otherwise measured).
    #[allow(clippy::too_many_arguments)]
    pub fn new<M: Staged + Clone + Send + Sync + 'static>(
        strategy: Strategy,
        group: &DeviceGroup,
        model: &M,
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
            Strategy::Pipeline => Engine::Pipeline(Box::new(Pipeline::new(group, model, criterion, optimizer, batch, micro_batches, Schedule::OneFOneB)?)),
            Strategy::Tensor => Engine::Tensor(Box::new(TensorParallel::new(group, model, criterion, optimizer, batch)?)),
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
    /// shards), the optimizer state and metadata, so `wgrad infer` loads
    /// any of them the same way and a run resumes on any strategy.
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        match self {
            Engine::Single(t) => t.checkpoint(),
            Engine::Data(d) => d.replicas()[0].checkpoint(),
            Engine::Distributed(d) => d.replica().checkpoint(),
            Engine::Pipeline(p) => p.checkpoint(),
            Engine::Tensor(t) => t.checkpoint(),
        }
    }

    /// One line on how the work is spread.
    pub fn describe(&self) -> String {
        match self {
            Engine::Single(t) => format!("single device, {} dispatches per step in one submit", t.executor().dispatches_per_step()),
            Engine::Data(d) => d.describe(),
            Engine::Pipeline(p) => p.describe(),
            Engine::Tensor(t) => t.describe(),
            Engine::Distributed(d) => d.describe(),
        }
    }

    /// What the run cost, for the end of training.
    pub fn report(&self) -> String {
        match self {
            Engine::Single(_) => String::new(),
            Engine::Data(d) => d.report(),
            Engine::Pipeline(p) => format!("{}; {}", p.describe(), p.report()),
            Engine::Tensor(t) => t.report(),
            Engine::Distributed(d) => d.report(),
        }
    }
}
