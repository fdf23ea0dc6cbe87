//! One front for every strategy: [`TrainEngine`] is what a training run
//! asks of single-device, data, distributed (MPI), tensor and pipeline
//! training, so the run is written once; [`Strategy::build`] picks one.

use std::sync::Arc;

use super::data::{DataParallel, Split};
#[cfg(feature = "fault-injection")]
use super::distributed::InjectedFailure;
use super::distributed::{DistributedDataParallel, ProcessGroup};
use super::memory::DeviceMemory;
use super::pipeline::{partition, Pipeline, Schedule};
use super::stage::{NamedParameters, NamedState, Spread, Stage};
use super::tensor::TensorParallel;
use super::zero::{Zero, ZeroStage};
use super::zero_stages::ZeroStages;
use super::DeviceGroup;
use super::{Examples, Targets, Trainer};
use crate::error::{Error, Result};
use crate::graph::PlanOptions;
use crate::io::checkpoint::Checkpoint;
use crate::kernels::OptimizerConfig;
use crate::nn::{Criterion, Staged};
use crate::optim::LossScaleState;

/// How the work is spread over devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    Single,
    Data,
    Pipeline,
    Tensor,
    /// Sharded data parallel ([`super::zero`]).
    Zero(ZeroStage),
}

/// A model every strategy can train: any [`Staged`] model trains on one
/// device, data, tensor and pipeline parallel.
pub trait Parallelizable: Staged + Clone + Send + Sync + 'static {}

impl<M: Staged + Clone + Send + Sync + 'static> Parallelizable for M {}

impl Strategy {
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "none" | "single" => Ok(Strategy::Single),
            "data" => Ok(Strategy::Data),
            "pipeline" | "model" => Ok(Strategy::Pipeline),
            "tensor" => Ok(Strategy::Tensor),
            // Stage 1 unless named (`zero-2`, `zero3`); the CLI's
            // --zero-stage picks it too.
            "zero" => Ok(Strategy::Zero(ZeroStage::OptimizerState)),
            other => match other
                .strip_prefix("zero")
                .map(|n| n.trim_start_matches(['-', '_']))
                .and_then(|n| n.parse::<u32>().ok())
            {
                Some(stage) => Ok(Strategy::Zero(ZeroStage::new(stage)?)),
                None => Err(Error::InvalidArgument {
                    op: "parallel",
                    reason: format!("unknown strategy `{other}`: use data, zero, pipeline or tensor"),
                }),
            },
        }
    }

    /// Whether `devices` devices can share `model` this way, checked before
    /// any is opened (the constructors check again on the opened group):
    /// data parallel needs a row of the `batch` per device (and one entry
    /// per device in a fixed `split`), the pipeline a unit of work per
    /// stage and micro-batches that divide the batch, tensor parallel a
    /// share of every split layer per device.
    pub fn check_devices<M: Parallelizable>(
        self,
        devices: usize,
        model: &M,
        batch: usize,
        split: Option<&[usize]>,
        micro_batches: usize,
    ) -> Result<()> {
        self.check_counts(devices, batch, split, micro_batches)?;
        match self {
            Strategy::Single | Strategy::Data | Strategy::Zero(_) => Ok(()),
            Strategy::Pipeline => partition(&model.stage_costs(), devices).map(|_| ()),
            Strategy::Tensor => TensorParallel::check(model, devices, batch),
        }
    }

    /// The part of [`Strategy::check_devices`] no model is needed for (so
    /// a run refuses before it reads its data): the device limit, rows per
    /// device and a split's length, micro-batches dividing the batch.
    pub fn check_counts(
        self,
        devices: usize,
        batch: usize,
        split: Option<&[usize]>,
        micro_batches: usize,
    ) -> Result<()> {
        super::check_limit(devices)?;
        match self {
            Strategy::Data | Strategy::Zero(_) if devices > batch => Err(Error::InvalidArgument {
                op: "data parallel",
                reason: format!("{devices} devices need at least one row each, but the global batch has {batch} rows: use at most {batch} devices or a larger batch"),
            }),
            Strategy::Data | Strategy::Zero(_) => match split {
                Some(rows) if rows.len() != devices => Err(Error::InvalidArgument {
                    op: "data parallel split",
                    reason: format!("rows {rows:?} name {} devices, but {devices} devices are selected", rows.len()),
                }),
                _ => Ok(()),
            },
            Strategy::Pipeline if micro_batches == 0 || batch == 0 || batch % micro_batches != 0 => Err(Error::InvalidArgument {
                op: "pipeline",
                reason: format!("the global batch of {batch} rows must split into {micro_batches} equal micro-batches (--micro-batches)"),
            }),
            _ => Ok(()),
        }
    }

    /// This strategy over `group` (Single uses its first device), across
    /// the processes of `processes` when given (data parallel only).
    /// `split` fixes data-parallel rows per device (per process across
    /// processes); otherwise they are measured. `options` asks for f16
    /// activations and activation checkpointing (its arena alignment is
    /// the engine's own); an engine that does not plan them yet says so.
    #[allow(clippy::too_many_arguments)]
    pub fn build<M: Parallelizable>(
        self,
        group: &DeviceGroup,
        processes: Option<Arc<dyn ProcessGroup>>,
        model: &M,
        criterion: Criterion,
        optimizer: OptimizerConfig,
        batch: usize,
        micro_batches: usize,
        schedule: Schedule,
        split: Option<Vec<usize>>,
        options: PlanOptions,
    ) -> Result<Box<dyn TrainEngine>> {
        Ok(match (self, processes) {
            (Strategy::Single, None) => Box::new(Trainer::with_blocks(
                group.members()[0].clone(),
                model,
                criterion,
                optimizer,
                batch,
                options,
            )?),
            (Strategy::Data, None) => Box::new(DataParallel::with_options(
                group,
                model,
                criterion,
                optimizer,
                batch,
                split.map_or(Split::Measured { every: 20 }, Split::Rows),
                options,
            )?),
            (Strategy::Data, Some(g)) => Box::new(DistributedDataParallel::with_options(
                g, group, model, criterion, optimizer, batch, split, options,
            )?),
            (Strategy::Tensor, None) => Box::new(TensorParallel::with_options(
                group, model, criterion, optimizer, batch, options,
            )?),
            (Strategy::Pipeline, None) => Box::new(Pipeline::with_options(
                group,
                model,
                criterion,
                optimizer,
                batch,
                micro_batches,
                schedule,
                None,
                options,
            )?),
            // In one process stages 2 and 3 run block by block, holding
            // one stage's gradients at a time; across processes they keep
            // whole arenas ([`super::zero`]).
            (Strategy::Zero(stage @ (ZeroStage::Gradients | ZeroStage::Parameters)), None) => Box::new(
                ZeroStages::with_options(group, model, criterion, optimizer, batch, stage, split, options)?,
            ),
            (Strategy::Zero(stage), processes) => Box::new(Zero::across(
                processes, group, model, criterion, optimizer, batch, stage, split, options,
            )?),
            (_, Some(_)) => {
                return Err(Error::InvalidArgument {
                    op: "train --distributed",
                    reason: "across processes wgrad trains data parallel or ZeRO: use --parallel data or zero".into(),
                })
            }
        })
    }
}

/// Dispatches and GPU bytes of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// On every device together.
    pub dispatches_per_step: usize,
    /// Of the device holding the most.
    pub peak_bytes: u64,
    /// One device's intermediates (planned, naive), where one graph holds
    /// the whole model.
    pub intermediates: Option<(u64, u64)>,
}

/// Where an engine's model lies, for what every engine reads the same way.
pub enum Holding<'a> {
    /// Whole on every replica (they hold the same weights): this one's.
    Replica(&'a Trainer),
    /// Across stages, each on a device ([`Spread`]).
    Stages(&'a Spread, &'a [Stage]),
}

/// What [`TrainEngine`]'s async forms return: boxed, so the trait stays
/// usable as `dyn`, and not `Send`, as a browser's WebGPU futures are not.
pub type EngineFuture<'a, T> = futures::future::LocalBoxFuture<'a, Result<T>>;

/// What a training run asks of an engine, whatever spreads the work.
pub trait TrainEngine {
    /// One optimizer step on a global batch; the mean loss when `read_loss`.
    fn step(&mut self, x: Examples<'_>, targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>>;
    /// [`TrainEngine::step`], awaited (what a browser calls). One device's
    /// engine awaits its read-back; the engines over several devices wait
    /// across them natively and run their blocking form here.
    fn step_async<'a>(
        &'a mut self,
        x: Examples<'a>,
        targets: Targets<'a>,
        read_loss: bool,
    ) -> EngineFuture<'a, Option<f32>> {
        Box::pin(async move { self.step(x, targets, read_loss) })
    }
    /// The mean loss of a global batch, without training (collective
    /// across processes).
    fn evaluate_loss(&mut self, x: Examples<'_>, targets: Targets<'_>) -> Result<f32>;
    /// [`TrainEngine::evaluate_loss`], awaited (as [`TrainEngine::step_async`]).
    fn evaluate_loss_async<'a>(&'a mut self, x: Examples<'a>, targets: Targets<'a>) -> EngineFuture<'a, f32> {
        Box::pin(async move { self.evaluate_loss(x, targets) })
    }
    /// A classifier's predicted classes.
    fn predict(&mut self, x: Examples<'_>) -> Result<Vec<u32>>;
    fn holding(&self) -> Holding<'_>;
    /// Every parameter under its single-device name (gathered from stages
    /// or shards; a replica's).
    fn parameters(&self) -> Result<NamedParameters> {
        match self.holding() {
            Holding::Replica(t) => t.executor().parameters(),
            Holding::Stages(spread, stages) => spread.parameters(stages),
        }
    }
    /// (parameter, state name, values) of the optimizer.
    fn optimizer_state(&self) -> Result<NamedState> {
        match self.holding() {
            Holding::Replica(t) => t.executor().optimizer_state(),
            Holding::Stages(spread, stages) => spread.optimizer_state(stages),
        }
    }
    /// Optimizer steps taken (a resumed run's included; every stage takes each).
    fn step_count(&self) -> u64 {
        match self.holding() {
            Holding::Replica(t) => t.executor().step_count(),
            Holding::Stages(_, stages) => stages.first().map_or(0, |s| s.executor().step_count()),
        }
    }
    /// Parameters, optimizer state and metadata under single-device names,
    /// so a run resumes on any strategy.
    fn checkpoint(&self) -> Result<Checkpoint> {
        match self.holding() {
            Holding::Replica(t) => t.checkpoint(),
            Holding::Stages(spread, stages) => spread.checkpoint(stages),
        }
    }
    /// Loads parameters (by name), optimizer state and step everywhere.
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()>;
    /// Dynamic loss scaling's state now, for a save; `None` where the
    /// engine does not scale.
    fn read_loss_scale(&self) -> Result<Option<LossScaleState>> {
        match self.holding() {
            Holding::Replica(t) => t.executor().read_loss_scale(),
            Holding::Stages(..) => Ok(None),
        }
    }
    /// Restores loss scaling's state (a save's) after
    /// [`TrainEngine::load_state`]; nothing where the engine does not scale.
    fn load_loss_scale(&mut self, _state: &LossScaleState) -> Result<()> {
        Ok(())
    }
    /// Across processes, every rank takes rank 0's parameters, state and
    /// step (collective); nothing otherwise.
    fn sync_from_root(&mut self) -> Result<()> {
        Ok(())
    }
    /// Collective across processes once training is done: afterwards
    /// rank 0 alone may read the parameters, optimizer state and
    /// checkpoint (an engine whose ranks hold shards gathers them here).
    fn settle(&mut self) -> Result<()> {
        Ok(())
    }
    /// One line on how the work is spread.
    fn describe(&self) -> String;
    /// What the parallelism cost, for the end of a run (empty for one device).
    fn report(&self) -> String {
        String::new()
    }
    /// A replica's, or all stages' dispatches with the bytes of the device
    /// holding the most.
    fn footprint(&self) -> Footprint {
        match self.holding() {
            Holding::Replica(t) => {
                let exec = t.executor();
                Footprint {
                    dispatches_per_step: exec.dispatches_per_step(),
                    peak_bytes: exec.peak_bytes(),
                    intermediates: Some((exec.plan().slot_bytes, exec.plan().naive_intermediate_bytes)),
                }
            }
            Holding::Stages(spread, stages) => {
                let mut per_device = vec![0u64; spread.devices().iter().max().map_or(0, |d| d + 1)];
                for (&device, stage) in spread.devices().iter().zip(stages) {
                    per_device[device] += stage.executor().peak_bytes();
                }
                let dispatches = stages.iter().map(|s| s.executor().dispatches_per_step()).sum();
                Footprint {
                    dispatches_per_step: dispatches,
                    peak_bytes: per_device.into_iter().max().unwrap_or(0),
                    intermediates: None,
                }
            }
        }
    }
    /// Bytes of the device holding the most, by what they hold: a
    /// replica's plan, or the stages on each device added up.
    fn memory(&self) -> DeviceMemory {
        match self.holding() {
            Holding::Replica(t) => {
                DeviceMemory::of_plan(t.executor().plan(), true, t.executor().optimizer_state_names().len())
            }
            Holding::Stages(spread, stages) => {
                let mut per_device = vec![DeviceMemory::default(); spread.devices().iter().max().map_or(0, |d| d + 1)];
                for (&device, stage) in spread.devices().iter().zip(stages) {
                    let exec = stage.executor();
                    per_device[device] = per_device[device].plus(DeviceMemory::of_plan(
                        exec.plan(),
                        true,
                        exec.optimizer_state_names().len(),
                    ));
                }
                DeviceMemory::fullest(per_device)
            }
        }
    }
    /// Data parallel's rows per device (or process); empty elsewhere.
    fn shares(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Testing the failure path across processes.
    #[cfg(feature = "fault-injection")]
    fn inject_failure(&mut self, _rank: usize, _step: u64, _how: InjectedFailure) {}
}

/// The trait's `step`, `evaluate_loss` and `predict` as the engine's own
/// methods of those names (which take anything that converts into
/// [`Examples`], so callers pass `&x`).
macro_rules! own_steps {
    ($engine:ty) => {
        fn step(&mut self, x: Examples<'_>, targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
            <$engine>::step(self, x, targets, read_loss)
        }
        fn evaluate_loss(&mut self, x: Examples<'_>, targets: Targets<'_>) -> Result<f32> {
            <$engine>::evaluate_loss(self, x, targets)
        }
        fn predict(&mut self, x: Examples<'_>) -> Result<Vec<u32>> {
            <$engine>::predict(self, x)
        }
    };
}
pub(super) use own_steps;

pub(super) fn features<'a>(x: Examples<'a>, op: &'static str) -> Result<&'a [f32]> {
    match x {
        Examples::Features(f) => Ok(f),
        Examples::Ids(_) => Err(Error::InvalidArgument {
            op,
            reason: "predicts classes of feature rows, not token ids".into(),
        }),
    }
}

impl TrainEngine for Trainer {
    fn step(&mut self, x: Examples<'_>, targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
        crate::device::wait("step", TrainEngine::step_async(self, x, targets, read_loss))
    }
    fn step_async<'a>(
        &'a mut self,
        x: Examples<'a>,
        targets: Targets<'a>,
        read_loss: bool,
    ) -> EngineFuture<'a, Option<f32>> {
        Box::pin(async move {
            self.zero_grad();
            self.forward_examples(x)?;
            self.loss(targets)?;
            self.backward()?;
            if read_loss {
                self.step_reading_loss_async().await.map(Some)
            } else {
                Trainer::step(self).map(|()| None)
            }
        })
    }
    fn evaluate_loss(&mut self, x: Examples<'_>, targets: Targets<'_>) -> Result<f32> {
        Trainer::evaluate_loss(self, x, targets)
    }
    fn evaluate_loss_async<'a>(&'a mut self, x: Examples<'a>, targets: Targets<'a>) -> EngineFuture<'a, f32> {
        Box::pin(Trainer::evaluate_loss_async(self, x, targets))
    }
    fn predict(&mut self, x: Examples<'_>) -> Result<Vec<u32>> {
        self.predict_examples(x)
    }
    fn holding(&self) -> Holding<'_> {
        Holding::Replica(self)
    }
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        self.executor_mut().load_state(params, state, step)
    }
    fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        self.executor_mut().load_loss_scale(state)
    }
    fn describe(&self) -> String {
        format!(
            "single device, {} dispatches per step in one submit",
            self.executor().dispatches_per_step()
        )
    }
}
