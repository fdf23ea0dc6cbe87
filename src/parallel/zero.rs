//! Sharded data parallel (ZeRO, as DeepSpeed names its stages; PyTorch's
//! FSDP shards the same way): data parallel where each device keeps the
//! optimizer's moments for one shard of the flat parameter arena only,
//! from stage 2 also only that shard's summed gradient, and at stage 3
//! only that shard's parameters between steps.
//!
//! A step: every device runs forward and backward on its rows of the
//! global batch (one submission each, all in flight together); then
//! - stage 1: the gradients are all-reduced (weighted by rows);
//! - stages 2 and 3: they are reduce-scattered instead, so a device
//!   receives the sum for its own shard only;
//!
//! and each device clips by the global norm (the squares of every shard's
//! summed gradient, added on the host in shard order, then one scale),
//! runs AdamW over its shard, and the updated shards are all-gathered into
//! every device's parameters. At stage 3 the gather happens instead just
//! before the next forward and backward (or evaluation), and a device's
//! other shards are cleared once its step is submitted.
//!
//! What the GPU holds: this engine's executors record forward and
//! backward as one submission over one parameter arena and one gradient
//! arena, so every device allocates both whole. Stage 1 saves real memory
//! (each device's optimizer-state arenas are its shard's length); stages
//! 2 and 3 here add the traffic pattern and the state a device relies on
//! between steps (its shard's gradient; its shard's parameters), but the
//! whole arenas stay allocated. A run prints what is allocated
//! ([`TrainEngine::memory`]) and what the stage keeps
//! ([`Zero::kept_memory`]).
//!
//! Within one process, stages 2 and 3 are
//! [`super::zero_stages::ZeroStages`] instead
//! ([`super::engine::Strategy::build`] picks it): the model runs as one
//! stage graph per block over pooled arenas, each stage's gradient
//! reduce-scattered right after its backward (and at stage 3 its
//! parameters gathered just before its forward and backward), so a device
//! allocates its gradient shard plus one stage's gradient arena, and at
//! stage 3 likewise for the parameters. This engine's whole-arena stages 2
//! and 3 remain the path across MPI processes, where every device still
//! allocates the whole gradient arena.
//!
//! Across the processes of an MPI job ([`Zero::across`]) the arena is cut
//! into a range per rank and each range over that rank's devices; a step
//! sums the local devices' gradients on the host, then reduce-scatters
//! (stage 1: all-reduces) the sums over processes (MPI, in f64), and the
//! updated ranges are all-gathered over processes. Each rank holds shards,
//! so the parameters and state are read on rank 0 after the collective
//! [`TrainEngine::settle`] gathered them.
//!
//! With f16 activations the optimizers scale the loss dynamically, one
//! scale for every device and rank: each replica's loss gradient is
//! seeded with the scale the shards' optimizers hold (they hold the
//! same), and before the update the host's sums of the whole gradient's
//! squares and inf/NaN count (it reads the summed gradients anyway)
//! replace each shard's own ([`step_shards`]), so an overflow anywhere
//! skips the step on every device.
//!
//! Shards are whole blocks of [`group_arena_alignment`] bytes (an
//! optimizer's views must start at a device's storage-offset alignment),
//! as even as that allows: the last devices may hold a block less.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::collectives::{all_gather, all_reduce_then, reduce_scatter_then, sum_to_host, to_host, Part};
use super::data::{
    backward_on_rows, check_rows, evaluate_on_rows, fixed_rows, group_arena_alignment, proportional_split, shard,
};
use super::distributed::{broadcast_f32, broadcast_loss_scale, broadcast_u64, ProcessGroup};
use super::engine::{own_steps, Footprint, Holding, TrainEngine};
use super::memory::DeviceMemory;
use super::stage::{NamedParameters, NamedState};
use super::{on_device, DeviceGroup};
use super::{Examples, ModelWidths, Targets, Trainer};
use crate::error::{Error, Result};
use crate::graph::PlanOptions;
use crate::io::checkpoint::Checkpoint;
use crate::io::state_dict::{assemble_checkpoint, CheckpointAbout};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, Staged};
use crate::optim::{stage_state, LossScaleState, Optimizer, ParamSpan};

/// What each device keeps only a shard of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Stage 1: the optimizer state.
    OptimizerState,
    /// Stage 2: also the summed gradients.
    Gradients,
    /// Stage 3: also the parameters between steps.
    Parameters,
}

impl ZeroStage {
    /// Stage 1, 2 or 3.
    pub fn new(stage: u32) -> Result<Self> {
        match stage {
            1 => Ok(ZeroStage::OptimizerState),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            other => Err(Error::InvalidArgument {
                op: "zero stage",
                reason: format!("ZeRO has stages 1, 2 and 3, not {other}"),
            }),
        }
    }

    pub fn number(self) -> u32 {
        match self {
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }
}

/// Each of `parts` devices' range of an arena of `len` elements: whole
/// blocks of `block` elements, as even as that allows, the earlier devices
/// taking the extra blocks (the last range ends at `len`). An error when
/// there are fewer blocks than devices.
pub fn shard_ranges(len: usize, parts: usize, block: usize) -> Result<Vec<Range<usize>>> {
    let block = block.max(1);
    let blocks = len.div_ceil(block);
    if parts == 0 || blocks < parts {
        return Err(Error::InvalidArgument {
            op: "zero shards",
            reason: format!("an arena of {len} elements holds {blocks} blocks of {block}: too few for a shard on each of {parts} devices"),
        });
    }
    let (each, extra) = (blocks / parts, blocks % parts);
    let mut start = 0;
    Ok((0..parts)
        .map(|d| {
            let end = (start + (each + usize::from(d < extra)) * block).min(len);
            let range = start..end;
            start = end;
            range
        })
        .collect())
}

const BYTES: u64 = 4;

/// What the shards' optimizers need of the whole summed gradient, added
/// shard by shard: Σ g² over its finite values (as the f32 values the
/// devices receive) and how many are inf or NaN.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GradSums {
    squares: f64,
    non_finite: u64,
}

impl GradSums {
    pub(super) fn of(values: impl IntoIterator<Item = f32>) -> Self {
        values
            .into_iter()
            .fold(GradSums::default(), |sums, v| match v.is_finite() {
                true => GradSums {
                    squares: sums.squares + f64::from(v).powi(2),
                    ..sums
                },
                false => GradSums {
                    non_finite: sums.non_finite + 1,
                    ..sums
                },
            })
    }

    pub(super) fn plus(self, other: GradSums) -> Self {
        GradSums {
            squares: self.squares + other.squares,
            non_finite: self.non_finite + other.non_finite,
        }
    }
}

/// The loss scale the next step seeds its loss gradient with, where the
/// optimizers scale (every shard's block holds the same: device 0's is
/// read; waits for its queue).
pub(super) fn next_loss_scale(optimizers: &[Optimizer], devices: &[Arc<Kernels>]) -> Result<Option<f32>> {
    match (optimizers.first(), devices.first()) {
        (Some(o), Some(k)) => Ok(o.read_loss_scale(k).map_err(|e| on_device(0, k, e))?.map(|s| s.scale)),
        _ => Ok(None),
    }
}

/// Every shard's optimizer steps on the whole gradient's `sums`: with
/// loss scaling (the gradients computed at `scale`) each takes the same
/// overflow count and unscaled norm, so every device skips or takes the
/// step alike and keeps the same scale; otherwise each clips by the
/// global norm (when clipping). Returns that norm (of the unscaled
/// gradient, before clipping).
pub(super) fn step_shards(
    optimizers: &mut [Optimizer],
    devices: &[Arc<Kernels>],
    sums: GradSums,
    scale: Option<f32>,
) -> Result<f32> {
    let norm = match (scale, sums.non_finite) {
        (Some(scale), _) => (sums.squares.sqrt() / f64::from(scale)) as f32,
        (None, 0) => sums.squares.sqrt() as f32,
        (None, _) => f32::INFINITY,
    };
    for (i, (o, k)) in optimizers.iter_mut().zip(devices).enumerate() {
        let clips = o.config().clip_grad_norm().is_some();
        match scale {
            Some(scale) => {
                o.step_with_loss_scale_sums(k, sums.squares / f64::from(scale).powi(2), sums.non_finite as f64)
            }
            None if clips => o.step_with_grad_norm(k, norm),
            None => o.step(k),
        }
        .map_err(|e| on_device(i, k, e))?;
    }
    Ok(norm)
}

pub struct Zero {
    stage: ZeroStage,
    devices: Vec<Arc<Kernels>>,
    /// Forward and backward on each device, without optimizer state.
    replicas: Vec<Trainer>,
    /// Each device's optimizer over its shard of the arenas.
    optimizers: Vec<Optimizer>,
    shards: Vec<Range<usize>>,
    shares: Vec<usize>,
    global_batch: usize,
    widths: ModelWidths,
    criterion: Criterion,
    optimizer: OptimizerConfig,
    bucket: usize,
    /// Stage 3: whether every device holds every shard's parameters now.
    gathered: bool,
    last_grad_norm: Option<f32>,
    /// Across processes: the job, each rank's rows of the global batch and
    /// its range of the arena (the local devices' shards cut it further).
    processes: Option<Arc<dyn ProcessGroup>>,
    process_shares: Vec<usize>,
    process_shards: Vec<Range<usize>>,
    /// Across processes, after [`TrainEngine::settle`]: everything gathered.
    settled: Option<(NamedParameters, NamedState)>,
    /// Across processes, on rank 0 after loading: the whole state arenas
    /// and step, for [`TrainEngine::sync_from_root`] to send.
    loaded: Option<(Vec<Vec<f32>>, Option<u64>)>,
}

impl Zero {
    /// A replica of `model`'s step on every device of `group`, each
    /// holding the optimizer state of its shard; `global_batch` rows per
    /// step, split evenly or as `rows` fixes.
    pub fn new(
        group: &DeviceGroup,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        stage: ZeroStage,
        rows: Option<Vec<usize>>,
    ) -> Result<Self> {
        Self::across(
            None,
            group,
            model,
            criterion,
            optimizer,
            global_batch,
            stage,
            rows,
            PlanOptions::default(),
        )
    }

    /// [`Zero::new`] over the local devices of every process of
    /// `processes` (when given): the arena is cut into a range per rank,
    /// each cut again over that rank's devices, and `rows` fixes the rows
    /// per process (else even); a process splits its rows evenly over its
    /// devices. Every rank starts from rank 0's parameters. Every replica
    /// is planned with `options`: f16 activations (the optimizer then
    /// scales the loss: see [`step_shards`]) and activation checkpointing
    /// block by block; the arena alignment is the group's, whatever
    /// `options` says.
    #[allow(clippy::too_many_arguments)]
    pub fn across(
        processes: Option<Arc<dyn ProcessGroup>>,
        group: &DeviceGroup,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        stage: ZeroStage,
        rows: Option<Vec<usize>>,
        options: PlanOptions,
    ) -> Result<Self> {
        let (criterion, optimizer) = (criterion.into(), optimizer.into());
        let devices = group.members().to_vec();
        let (rank, size) = processes.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        let (process_shares, shares) = match (&processes, &rows) {
            (None, Some(rows)) => (
                vec![global_batch],
                fixed_rows("zero split", rows, devices.len(), "devices", global_batch)?,
            ),
            (None, None) => (
                vec![global_batch],
                proportional_split(global_batch, &vec![1.0; devices.len()])?,
            ),
            (Some(_), rows) => {
                let per_process = match rows {
                    Some(rows) => fixed_rows("zero split", rows, size, "processes", global_batch)?,
                    None => proportional_split(global_batch, &vec![1.0; size])?,
                };
                let local =
                    proportional_split(per_process[rank], &vec![1.0; devices.len()]).map_err(|e| Error::OnRank {
                        rank,
                        source: Box::new(e),
                    })?;
                (per_process, local)
            }
        };
        let alignment = group_arena_alignment(&devices);
        let options = PlanOptions {
            arena_alignment: alignment,
            ..options
        };
        let replicas = devices
            .iter()
            .zip(&shares)
            .enumerate()
            .map(|(i, (k, &n))| {
                Trainer::without_optimizer(k.clone(), model, criterion, optimizer, n, options)
                    .map_err(|e| on_device(i, k, e))
            })
            .collect::<Result<Vec<_>>>()?;
        let plan = replicas[0].executor().plan();
        let (arena_len, decay_len) = (plan.trainable_len, plan.decay_len);
        let block = alignment as usize / BYTES as usize;
        let process_shards = shard_ranges(arena_len, size, block)?;
        let mine = process_shards[rank].clone();
        let shards: Vec<Range<usize>> = shard_ranges(mine.len(), devices.len(), block)?
            .into_iter()
            .map(|r| r.start + mine.start..r.end + mine.start)
            .collect();
        let mut optimizers = Vec::with_capacity(devices.len());
        for (i, (t, range)) in replicas.iter().zip(&shards).enumerate() {
            let k = &devices[i];
            let exec = t.executor();
            let grads = exec.gradient_arena().ok_or_else(|| Error::Internal {
                op: "Zero::new",
                reason: "a replica without gradients".into(),
            })?;
            let (params, grads) = (shard_of(k, exec.trainable_arena(), range), shard_of(k, grads, range));
            let decay = decay_len.clamp(range.start, range.end) - range.start;
            optimizers
                .push(Optimizer::new(k, optimizer, params, grads, range.len(), decay).map_err(|e| on_device(i, k, e))?);
        }
        let mut zero = Zero {
            stage,
            devices,
            replicas,
            optimizers,
            shards,
            shares,
            global_batch,
            widths: ModelWidths::of(model)?,
            criterion,
            optimizer,
            bucket: 1 << 18,
            gathered: true,
            last_grad_norm: None,
            processes,
            process_shares,
            process_shards,
            settled: None,
            loaded: None,
        };
        zero.sync_from_root()?;
        Ok(zero)
    }

    /// Across processes, this rank's rows of a global batch (`x` and
    /// `targets` hold all of it, in the same order on every rank).
    fn own_rows<'x, 't>(
        &self,
        op: &'static str,
        x: Examples<'x>,
        targets: Targets<'t>,
    ) -> Result<((Examples<'x>, usize), (Targets<'t>, usize))> {
        let (f, width) = check_rows(&self.widths, op, self.global_batch, x, targets)?;
        let rank = self.processes.as_ref().map_or(0, |g| g.rank());
        let (start, rows) = (
            self.process_shares[..rank].iter().sum::<usize>(),
            self.process_shares[rank],
        );
        Ok((
            (x.slice(start * f, (start + rows) * f), f),
            (shard(targets, start, rows, width), width),
        ))
    }

    /// Where this process's rows start in the job's batch (0 alone).
    fn process_first_example(&self) -> usize {
        let rank = self.processes.as_ref().map_or(0, |g| g.rank());
        self.process_shares[..rank].iter().sum()
    }

    /// The job's sum of every rank's `local` (this process's alone without processes).
    fn sum_over_processes(&self, local: f64) -> Result<f64> {
        let mut value = [local];
        if let Some(g) = &self.processes {
            g.all_reduce_sum(&mut value)?;
        }
        Ok(value[0])
    }

    /// The whole arena from every process's range of it (collective
    /// across processes; this process's devices alone without).
    fn whole_on_host<'a>(&'a self, arena: impl Fn(usize) -> View<'a>) -> Result<Vec<f32>> {
        let own = self.gathered_arena(arena)?;
        match &self.processes {
            None => Ok(own),
            Some(g) => g.all_gather_f32(&own, &self.process_shards.iter().map(|r| r.len()).collect::<Vec<_>>()),
        }
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Each device's element range of the parameter arena.
    pub fn shards(&self) -> &[Range<usize>] {
        &self.shards
    }

    pub fn replicas(&self) -> &[Trainer] {
        &self.replicas
    }

    /// The global gradient norm (before clipping) of the last step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_grad_norm
    }

    /// Each device's loss scaling state (f16; `None` where the optimizer
    /// does not scale): every shard's optimizer keeps its own, and a step
    /// keeps them equal. Waits for every device.
    pub fn loss_scales(&self) -> Result<Vec<Option<LossScaleState>>> {
        read_loss_scales(&self.optimizers, &self.devices)
    }

    /// Every device's shard of `arena` (one view per device).
    fn shard_parts<'a>(&'a self, arena: impl Fn(&'a Trainer) -> Option<View<'a>>) -> Result<Vec<Part<'a>>> {
        self.replicas
            .iter()
            .zip(&self.devices)
            .zip(&self.shards)
            .map(|((t, k), range)| {
                let view = arena(t).ok_or_else(|| Error::Internal {
                    op: "Zero",
                    reason: "a replica without gradients".into(),
                })?;
                Ok(Part::new(k, shard_of(k, view, range)))
            })
            .collect()
    }

    fn whole_parts<'a>(&'a self, arena: impl Fn(&'a Trainer) -> Option<View<'a>>) -> Result<Vec<Part<'a>>> {
        self.replicas
            .iter()
            .zip(&self.devices)
            .map(|(t, k)| {
                arena(t).map(|v| Part::new(k, v)).ok_or_else(|| Error::Internal {
                    op: "Zero",
                    reason: "a replica without gradients".into(),
                })
            })
            .collect()
    }

    /// Every device's parameters become the concatenation of the shards.
    fn gather_parameters(&mut self) -> Result<()> {
        if self.gathered {
            return Ok(());
        }
        if self.processes.is_some() {
            let whole = self.whole_on_host(|i| {
                shard_of(
                    &self.devices[i],
                    self.replicas[i].executor().trainable_arena(),
                    &self.shards[i],
                )
            })?;
            self.write_everywhere(&whole)?;
        } else {
            let srcs = self.shard_parts(|t| Some(t.executor().trainable_arena()))?;
            let dsts = self.whole_parts(|t| Some(t.executor().trainable_arena()))?;
            all_gather(&srcs, &dsts)?;
        }
        self.gathered = true;
        Ok(())
    }

    /// Every local device's parameter arena becomes `whole`.
    fn write_everywhere(&self, whole: &[f32]) -> Result<()> {
        for (i, (t, k)) in self.replicas.iter().zip(&self.devices).enumerate() {
            k.write(t.executor().trainable_arena(), whole)
                .map_err(|e| on_device(i, k, e))?;
        }
        Ok(())
    }

    /// Stage 3, once a device's step is submitted: its other shards'
    /// parameters are cleared (the next step gathers them again).
    fn release_parameters(&mut self) -> Result<()> {
        if self.stage != ZeroStage::Parameters {
            return Ok(());
        }
        for (i, (t, range)) in self.replicas.iter().zip(&self.shards).enumerate() {
            let k = &self.devices[i];
            let arena = Part::new(k, t.executor().trainable_arena());
            for (start, end) in [(0, range.start), (range.end, arena.view.len)] {
                if end > start {
                    k.write(arena.sub(start, end - start), &vec![0.0f32; end - start])
                        .map_err(|e| on_device(i, k, e))?;
                }
            }
        }
        self.gathered = false;
        Ok(())
    }

    /// One step on `global_batch` rows (see the module comment); the mean
    /// loss when `read_loss`.
    pub fn step<'x>(
        &mut self,
        x: impl Into<Examples<'x>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        let (x, targets) = self.own_rows("Zero::step", x.into(), targets)?;
        let since = Instant::now();
        self.settled = None;
        self.gather_parameters()?;
        let scale = next_loss_scale(&self.optimizers, &self.devices)?;
        if let Some(scale) = scale {
            self.seed_loss(scale)?;
        }
        // The replicas step no optimizer of their own: their dropout masks
        // follow the shards' step count.
        let (first, step) = (self.process_first_example(), self.optimizers[0].step_count());
        for t in &mut self.replicas {
            t.executor_mut().set_dropout_step(Some(step));
        }
        backward_on_rows(&mut self.replicas, &self.devices, &self.shares, x, targets, first)?;
        self.release_parameters()?;
        let weights: Vec<f64> = self
            .shares
            .iter()
            .map(|&n| n as f64 / self.global_batch as f64)
            .collect();
        let sums = self.reduce_gradients(&weights, since)?;
        self.last_grad_norm = Some(step_shards(&mut self.optimizers, &self.devices, sums, scale)?);
        if self.stage != ZeroStage::Parameters {
            self.gathered = false;
            self.gather_parameters()?;
        }
        if !read_loss {
            return Ok(None);
        }
        let mut total = 0.0f64;
        for (i, t) in self.replicas.iter().enumerate() {
            total += weights[i] * f64::from(t.loss_item().map_err(|e| on_device(i, &self.devices[i], e))?);
        }
        Ok(Some(self.sum_over_processes(total)? as f32))
    }

    /// Every replica's loss gradient becomes `scale` (f16: the loss
    /// scale every shard's optimizer holds).
    fn seed_loss(&self, scale: f32) -> Result<()> {
        for (i, (t, k)) in self.replicas.iter().zip(&self.devices).enumerate() {
            let seed = t.executor().loss_seed_view().ok_or_else(|| Error::InvalidArgument {
                op: "Zero",
                reason: "loss scaling needs a backward seeded from a loss".into(),
            })?;
            k.write(seed, &[scale]).map_err(|e| on_device(i, k, e))?;
        }
        Ok(())
    }

    /// Sums the devices' gradients weighted by `weights` (all-reduced at
    /// stage 1, reduce-scattered after: see the module comment) and returns
    /// the whole summed gradient's squares and overflows ([`GradSums`]),
    /// added shard by shard (each as the f32 values the devices receive).
    fn reduce_gradients(&mut self, weights: &[f64], since: Instant) -> Result<GradSums> {
        let square = |sum: &[f64]| GradSums::of(sum.iter().map(|&v| v as f32));
        let grads = self.whole_parts(|t| t.executor().gradient_arena())?;
        let Some(g) = &self.processes else {
            let mut sums = vec![GradSums::default(); self.devices.len()];
            if self.stage == ZeroStage::OptimizerState {
                all_reduce_then(&grads, Some(weights), self.bucket, since, &mut |sum| {
                    sums[0] = sums[0].plus(square(sum));
                    Ok(())
                })?;
            } else {
                let dsts = self.shard_parts(|t| t.executor().gradient_arena())?;
                reduce_scatter_then(&grads, Some(weights), &dsts, self.bucket, since, &mut |shard, sum| {
                    sums[shard] = sums[shard].plus(square(sum));
                    Ok(())
                })?;
            }
            return Ok(sums.into_iter().fold(GradSums::default(), GradSums::plus));
        };
        // Across processes: this process's devices summed on the host, then
        // the sum over processes of this rank's range (of all of it at stage 1).
        let local = sum_to_host(&grads, Some(weights), since)?;
        let mine = self.process_shards[g.rank()].clone();
        let own: Vec<f64> = if self.stage == ZeroStage::OptimizerState {
            let mut all = local;
            g.all_reduce_sum(&mut all)?;
            let whole: Vec<f32> = all.iter().map(|&v| v as f32).collect();
            for (i, part) in grads.iter().enumerate() {
                part.kernels
                    .write(part.view, &whole)
                    .map_err(|e| on_device(i, part.kernels, e))?;
            }
            all[mine.clone()].to_vec()
        } else {
            let own = g.reduce_scatter_sum(&local, &self.process_shards.iter().map(|r| r.len()).collect::<Vec<_>>())?;
            for (i, (part, range)) in grads.iter().zip(&self.shards).enumerate() {
                let values: Vec<f32> = own[range.start - mine.start..range.end - mine.start]
                    .iter()
                    .map(|&v| v as f32)
                    .collect();
                part.kernels
                    .write(part.sub(range.start, range.len()), &values)
                    .map_err(|e| on_device(i, part.kernels, e))?;
            }
            own
        };
        let own = square(&own);
        let mut both = [own.squares, own.non_finite as f64];
        g.all_reduce_sum(&mut both)?;
        Ok(GradSums {
            squares: both[0],
            non_finite: both[1] as u64,
        })
    }

    /// The mean loss of one global batch without training, split as a step.
    pub fn evaluate_loss<'x>(&mut self, x: impl Into<Examples<'x>>, targets: Targets<'_>) -> Result<f32> {
        let (x, targets) = self.own_rows("Zero::evaluate_loss", x.into(), targets)?;
        self.gather_parameters()?;
        let own = evaluate_on_rows(&mut self.replicas, &self.devices, &self.shares, x, targets)?;
        self.release_parameters()?;
        let rank = self.processes.as_ref().map_or(0, |g| g.rank());
        let loss =
            self.sum_over_processes(self.process_shares[rank] as f64 / self.global_batch as f64 * f64::from(own))?;
        Ok(loss as f32)
    }

    /// Predictions from device 0, its parameters gathered first.
    pub fn predict<'x>(&mut self, x: impl Into<Examples<'x>>) -> Result<Vec<u32>> {
        self.gather_parameters()?;
        let classes = self.replicas[0].predict_examples(x.into())?;
        self.release_parameters()?;
        Ok(classes)
    }

    /// This process's range of the arena on the host: each device's shard
    /// of `arena`, in order (the whole arena within one process).
    fn gathered_arena<'a>(&'a self, arena: impl Fn(usize) -> View<'a>) -> Result<Vec<f32>> {
        let pairs: Vec<(&Kernels, View<'_>)> = self
            .devices
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_ref(), arena(i)))
            .collect();
        Ok(to_host(&pairs, Instant::now())?.0.concat())
    }

    fn spans(&self) -> Vec<ParamSpan> {
        self.replicas[0].executor().parameter_spans()
    }

    /// Every parameter under its name: the trainable ones from every
    /// shard (collective across processes), then the frozen ones (a LoRA
    /// adapter's base), whole on every device, from device 0's.
    fn gather_named_parameters(&self) -> Result<NamedParameters> {
        let arena = self.whole_on_host(|i| {
            shard_of(
                &self.devices[i],
                self.replicas[i].executor().trainable_arena(),
                &self.shards[i],
            )
        })?;
        let spans = self.spans();
        let mut all: NamedParameters = spans
            .iter()
            .map(|p| {
                (
                    p.name.clone(),
                    p.shape.clone(),
                    arena[p.offset..p.offset + p.len()].to_vec(),
                )
            })
            .collect();
        let exec = self.replicas[0].executor();
        if exec.plan().trainable_len < exec.plan().param_arena_len {
            let frozen = exec.parameters().map_err(|e| on_device(0, &self.devices[0], e))?;
            all.extend(
                frozen
                    .into_iter()
                    .filter(|(n, _, _)| !spans.iter().any(|p| &p.name == n)),
            );
        }
        Ok(all)
    }

    /// The optimizer state by parameter and state name, state by state,
    /// from every shard (collective across processes).
    fn gather_named_state(&self) -> Result<NamedState> {
        let spans = self.spans();
        let mut out = Vec::new();
        for (s, &name) in self.optimizer.state_names().iter().enumerate() {
            let arena = self.whole_on_host(|i| self.optimizers[i].state_arenas()[s])?;
            out.extend(
                spans
                    .iter()
                    .map(|p| (p.name.clone(), name, arena[p.offset..p.offset + p.len()].to_vec())),
            );
        }
        Ok(out)
    }

    /// Each device's shard of the whole state `arenas` (none: kept as is)
    /// and the step count (when given).
    fn write_state(&mut self, arenas: &[Vec<f32>], step: Option<u64>) -> Result<()> {
        for (i, (o, range)) in self.optimizers.iter_mut().zip(&self.shards).enumerate() {
            let k = &self.devices[i];
            for (arena, values) in o.state_arenas().into_iter().zip(arenas) {
                k.write(arena, &values[range.clone()]).map_err(|e| on_device(i, k, e))?;
            }
            o.import_state(k, &[], &[], step).map_err(|e| on_device(i, k, e))?;
        }
        Ok(())
    }

    /// What the device with the largest shard keeps for the whole run:
    /// the optimizer state of its shard, and from stage 2 the gradients,
    /// at 3 the parameters, of its shard only. What it allocates is
    /// [`TrainEngine::memory`] (the executor's whole arenas: see the
    /// module comment).
    pub fn kept_memory(&self) -> DeviceMemory {
        let allocated = DeviceMemory::fullest(
            self.replicas
                .iter()
                .map(|t| DeviceMemory::of_plan(t.executor().plan(), true, self.optimizer.state_names().len())),
        );
        DeviceMemory::zero_kept(
            allocated,
            self.stage,
            self.shards.iter().map(|r| r.len()).max().unwrap_or(0),
        )
    }
}

/// Every shard's optimizer's loss scaling state (waits for every device).
pub(super) fn read_loss_scales(
    optimizers: &[Optimizer],
    devices: &[Arc<Kernels>],
) -> Result<Vec<Option<LossScaleState>>> {
    optimizers
        .iter()
        .zip(devices)
        .enumerate()
        .map(|(d, (o, k))| o.read_loss_scale(k).map_err(|e| on_device(d, k, e)))
        .collect()
}

/// Loss scaling's `state` into every shard's optimizer (nothing where
/// they do not scale).
pub(super) fn load_loss_scale(
    optimizers: &mut [Optimizer],
    devices: &[Arc<Kernels>],
    state: &LossScaleState,
) -> Result<()> {
    for (i, (o, k)) in optimizers.iter_mut().zip(devices).enumerate() {
        o.import_loss_scale(k, state).map_err(|e| on_device(i, k, e))?;
    }
    Ok(())
}

fn unsettled() -> Error {
    Error::InvalidArgument {
        op: "Zero across processes",
        reason: "each rank holds shards: call settle() on every rank before reading parameters or state".into(),
    }
}

/// `range` of the arena `view` on device `k`.
fn shard_of<'a>(k: &'a Kernels, view: View<'a>, range: &Range<usize>) -> View<'a> {
    Part::new(k, view).sub(range.start, range.len())
}

impl TrainEngine for Zero {
    own_steps!(Zero);
    /// Device 0's replica, for what reads its plan; the parameters, state
    /// and checkpoint come from every shard (the methods below).
    fn holding(&self) -> Holding<'_> {
        Holding::Replica(&self.replicas[0])
    }
    /// Gathered from every shard; across processes, what
    /// [`TrainEngine::settle`] gathered (an error before it).
    fn parameters(&self) -> Result<NamedParameters> {
        if self.processes.is_some() {
            return self.settled.as_ref().map(|(p, _)| p.clone()).ok_or_else(unsettled);
        }
        self.gather_named_parameters()
    }
    fn optimizer_state(&self) -> Result<NamedState> {
        if self.processes.is_some() {
            return self.settled.as_ref().map(|(_, s)| s.clone()).ok_or_else(unsettled);
        }
        self.gather_named_state()
    }
    fn settle(&mut self) -> Result<()> {
        if self.processes.is_some() && self.settled.is_none() {
            self.settled = Some((self.gather_named_parameters()?, self.gather_named_state()?));
        }
        Ok(())
    }
    /// Rank 0's parameters (whole after loading), state and step on every
    /// rank (collective), the parameters left whole until the next step;
    /// nothing within one process.
    fn sync_from_root(&mut self) -> Result<()> {
        let Some(g) = self.processes.clone() else { return Ok(()) };
        let root = g.rank() == 0;
        // Read before `write_state` below resets it to its step's fresh state.
        let scale = broadcast_loss_scale(g.as_ref(), 0, if root { self.read_loss_scale()? } else { None })?;
        let mut whole = if root {
            self.devices[0].read(self.replicas[0].executor().trainable_arena())?
        } else {
            Vec::new()
        };
        broadcast_f32(g.as_ref(), 0, &mut whole)?;
        self.write_everywhere(&whole)?;
        self.gathered = true;
        let (arenas, step) = self.loaded.take().unzip();
        let mut header = vec![u64::from(arenas.is_some()), step.flatten().map_or(u64::MAX, |s| s)];
        broadcast_u64(g.as_ref(), 0, &mut header)?;
        if header.first() == Some(&1) {
            let mut arenas = arenas.unwrap_or_else(|| vec![Vec::new(); self.optimizer.state_names().len()]);
            for arena in &mut arenas {
                broadcast_f32(g.as_ref(), 0, arena)?;
            }
            let step = header.get(1).copied().filter(|&s| s != u64::MAX);
            self.write_state(&arenas, step)?;
        }
        if let Some(scale) = &scale {
            load_loss_scale(&mut self.optimizers, &self.devices, scale)?;
        }
        // Whole until the next step releases them, so a load on rank 0
        // before it (resuming) reads whole parameters.
        Ok(())
    }
    fn step_count(&self) -> u64 {
        self.optimizers[0].step_count()
    }
    fn checkpoint(&self) -> Result<Checkpoint> {
        let about = CheckpointAbout {
            model: self.replicas[0].model_description(),
            criterion: self.criterion,
            optimizer: &self.optimizer,
            step: self.step_count(),
            loss_scale: self.read_loss_scale()?,
        };
        assemble_checkpoint(self.parameters()?, self.optimizer_state()?, &about)
    }
    /// Device 0's shard's: every shard's optimizer holds the same state.
    fn read_loss_scale(&self) -> Result<Option<LossScaleState>> {
        self.optimizers[0].read_loss_scale(&self.devices[0])
    }
    fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        load_loss_scale(&mut self.optimizers, &self.devices, state)
    }
    /// Parameters (by name) on every device, each device's shard of the
    /// optimizer state (checked whole first), and the step.
    /// Across processes, rank 0 also keeps the whole state for
    /// [`TrainEngine::sync_from_root`], which the run calls next.
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        // The parameters not in `params` keep their values: whole first.
        if !self.gathered {
            if self.processes.is_some() {
                return Err(Error::InvalidArgument {
                    op: "Zero::load_state",
                    reason: "across processes ZeRO-3 loads on rank 0 before its first step only (then sync_from_root)"
                        .into(),
                });
            }
            self.gather_parameters()?;
        }
        let spans = self.spans();
        let arena_len = self.replicas[0].executor().plan().trainable_len;
        let host = stage_state(self.optimizer.state_names(), arena_len, &spans, state)?;
        for (i, t) in self.replicas.iter_mut().enumerate() {
            t.executor_mut()
                .load_state(params, &[], None)
                .map_err(|e| on_device(i, &self.devices[i], e))?;
        }
        self.gathered = true;
        self.settled = None;
        let host = if state.is_empty() { Vec::new() } else { host };
        self.write_state(&host, step)?;
        if self.processes.is_some() {
            // Stage 3 releases in sync_from_root, after rank 0 sent them.
            self.loaded = Some((host, step));
            return Ok(());
        }
        self.release_parameters()
    }
    fn describe(&self) -> String {
        let rows: Vec<String> = self
            .devices
            .iter()
            .zip(&self.shares)
            .enumerate()
            .map(|(i, (k, n))| format!("#{i} {} {n} rows", k.device().label()))
            .collect();
        let shards: Vec<String> = self.shards.iter().map(|r| r.len().to_string()).collect();
        let kept = {
            let m = self.kept_memory();
            let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0));
            format!(
                "parameters {}, gradients {}, optimizer state {}",
                mib(m.parameters),
                mib(m.gradients),
                mib(m.optimizer_state)
            )
        };
        // Across processes the gradient arena (the trainable parameters'
        // only) is what each step sums, rank by rank.
        let across = self.processes.as_ref().map_or_else(String::new, |g| {
            let values: usize = self.process_shards.iter().map(|r| r.len()).sum();
            format!(
                " over {} processes (rank {}'s devices shown; {values} gradient values reduced across processes per step)",
                g.size(),
                g.rank()
            )
        });
        format!(
            "ZeRO stage {} (sharded data parallel){across}, batch split {}, arena shards of [{}] elements; kept per device between steps: {kept}",
            self.stage.number(),
            rows.join(", "),
            shards.join(", ")
        )
    }
    /// One device's step dispatches (its optimizer's over its shard) and
    /// the bytes of the device allocating the most.
    fn footprint(&self) -> Footprint {
        let exec = self.replicas[0].executor();
        let dispatches = exec.dispatches_per_step() + self.optimizers[0].dispatches().count();
        let states = self.optimizer.state_names().len() as u64;
        let peak = self
            .replicas
            .iter()
            .zip(&self.shards)
            .map(|(t, r)| t.executor().peak_bytes() + states * r.len() as u64 * BYTES)
            .max()
            .unwrap_or(0);
        Footprint {
            dispatches_per_step: dispatches,
            peak_bytes: peak,
            intermediates: Some((exec.plan().slot_bytes, exec.plan().naive_intermediate_bytes)),
        }
    }
    fn shares(&self) -> Vec<usize> {
        self.shares.clone()
    }
    /// The executor's whole arenas and each device's shard of the state.
    fn memory(&self) -> DeviceMemory {
        let states = self.optimizer.state_names().len() as u64;
        DeviceMemory::fullest(self.replicas.iter().zip(&self.shards).map(|(t, r)| DeviceMemory {
            optimizer_state: states * r.len() as u64 * BYTES,
            ..DeviceMemory::of_plan(t.executor().plan(), true, 0)
        }))
    }
}
