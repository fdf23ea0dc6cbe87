//! Data parallel training across processes — and so across hosts. Each
//! process drives its own [`DataParallel`] over its local devices; a
//! [`ProcessGroup`] (MPI under the `mpi` feature, see [`super::mpi`]) joins
//! them. A step is a hierarchical all-reduce: the local devices' gradients
//! are summed on the host (the existing collectives), each bucket of that
//! sum goes through one cross-process all-reduce, and the result is written
//! back to every local device, so every replica on every host takes the same
//! optimizer step.
//!
//! The global batch is split across processes and, inside each, across
//! devices. Both splits follow measured step costs: a slower host gets a
//! smaller share. Every rank starts from rank 0's parameters and optimizer
//! state (broadcast), and rank 0's state is broadcast again every
//! [`SYNC_EVERY`] steps, so hosts whose drivers round differently cannot
//! drift apart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::data::{arenas, balanced_split, fixed_rows, makespan, proportional_split, shard, Cost, DataParallel, Split};
use super::engine::{own_steps, Holding, TrainEngine};
use super::DeviceGroup;
use super::{Examples, Targets, Trainer};
use crate::error::{Error, Result};
use crate::graph::PlanOptions;
use crate::kernels::OptimizerConfig;
use crate::nn::{Criterion, Staged};
use crate::optim::LossScaleState;

/// The processes of one job, and the few collectives data parallel
/// training needs between them. Every call is collective: every rank must
/// make it, in the same order.
pub trait ProcessGroup {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise sum over all processes, in place.
    fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()>;
    /// Makes every rank's `bytes` a copy of `root`'s (lengths may differ
    /// before the call).
    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()>;
    /// Every rank's `values` (the same length on each), concatenated in rank order.
    fn all_gather(&self, values: &[f64]) -> Result<Vec<f64>>;
    /// Reduce-scatter: the element-wise sum over all processes of
    /// `values` (the same length on each), rank `r` receiving segment `r`
    /// of lengths `counts` (one per rank, adding up to the length).
    fn reduce_scatter_sum(&self, values: &[f64], counts: &[usize]) -> Result<Vec<f64>>;
    /// Every rank's `values` (rank `r` holding `counts[r]`), concatenated
    /// in rank order: uneven shards gathered.
    fn all_gather_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>>;
    /// Ends the whole job now with `code` (every rank, not just this one):
    /// the way out of any error once ranks may be waiting in a collective.
    fn abort(&self, code: i32) -> !;
    /// One line: implementation, rank, size, host.
    fn describe(&self) -> String;
}

/// A job of one process: every collective is the identity. Lets the
/// distributed engine run (and be tested) without MPI.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl ProcessGroup for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn broadcast_bytes(&self, root: usize, _bytes: &mut Vec<u8>) -> Result<()> {
        if root != 0 {
            return Err(Error::Distributed {
                op: "broadcast",
                rank: 0,
                size: 1,
                message: format!("no rank {root} in a job of 1"),
            });
        }
        Ok(())
    }
    fn all_gather(&self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }
    fn reduce_scatter_sum(&self, values: &[f64], counts: &[usize]) -> Result<Vec<f64>> {
        check_counts("reduce_scatter", self, values.len(), counts)?;
        Ok(values.to_vec())
    }
    fn all_gather_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts("all_gather", self, values.len(), &counts[..1.min(counts.len())])?;
        Ok(values.to_vec())
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
    fn describe(&self) -> String {
        "single process".into()
    }
}

/// Checks `counts` has one entry per rank of `group` adding up to `total`.
pub(crate) fn check_counts(
    op: &'static str,
    group: &(impl ProcessGroup + ?Sized),
    total: usize,
    counts: &[usize],
) -> Result<()> {
    if counts.len() != group.size() || counts.iter().sum::<usize>() != total {
        return Err(Error::Distributed {
            op,
            rank: group.rank(),
            size: group.size(),
            message: format!("segments {counts:?} must name each rank and add up to {total}"),
        });
    }
    Ok(())
}

/// `root`'s `values` on every rank (lengths may differ before the call).
pub fn broadcast_f32(group: &dyn ProcessGroup, root: usize, values: &mut Vec<f32>) -> Result<()> {
    let mut bytes = if group.rank() == root {
        bytemuck::cast_slice::<f32, u8>(values).to_vec()
    } else {
        Vec::new()
    };
    group.broadcast_bytes(root, &mut bytes)?;
    *values = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(())
}

/// `root`'s `values` on every rank.
pub fn broadcast_u64(group: &dyn ProcessGroup, root: usize, values: &mut Vec<u64>) -> Result<()> {
    let mut bytes: Vec<u8> = if group.rank() == root {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    } else {
        Vec::new()
    };
    group.broadcast_bytes(root, &mut bytes)?;
    *values = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    Ok(())
}

/// Rank `root`'s loss scaling `state` (`None` where it does not scale;
/// other ranks pass anything) on every rank, sent as a checkpoint's
/// metadata (`key=value` lines) and checked as a checkpoint's is.
pub fn broadcast_loss_scale(
    group: &dyn ProcessGroup,
    root: usize,
    state: Option<LossScaleState>,
) -> Result<Option<LossScaleState>> {
    let state = if group.rank() == root { state } else { None };
    let mut bytes = state
        .iter()
        .flat_map(LossScaleState::metadata)
        .map(|(key, value)| format!("{key}={value}\n"))
        .collect::<String>()
        .into_bytes();
    group.broadcast_bytes(root, &mut bytes)?;
    let text = std::str::from_utf8(&bytes).map_err(|e| Error::InvalidArgument {
        op: "broadcast loss scale",
        reason: format!("not text: {e}"),
    })?;
    let pairs: Vec<(&str, &str)> = text.lines().filter_map(|line| line.split_once('=')).collect();
    LossScaleState::from_metadata(|key| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| *v))
}

/// Steps between broadcasts of rank 0's state to every replica (and, in
/// a process, of replica 0's to the others).
pub const SYNC_EVERY: u64 = 50;

/// Steps between re-measurements of the split across processes. A new
/// split rebuilds every local replica, and one process's step time is
/// noisy (±30% on a shared machine), so this is rarer than the split
/// inside a process, averaged over the window, and smoothed.
pub const RESPLIT_EVERY: u64 = 100;

/// A new split across processes must promise a step this much shorter.
const RESPLIT_GAIN: f64 = 0.15;

/// What a test asks a rank to do at a step, to prove a failing rank stops
/// the whole job instead of hanging it. Only in builds with the
/// `fault-injection` feature, so a default build has no way to panic here.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectedFailure {
    /// The step returns an error (as a lost device would).
    Error,
    /// The step panics (as a bug would).
    Panic,
}

/// Time spent per step, for the training report.
#[derive(Clone, Debug, Default)]
pub struct DistributedStats {
    pub steps: u64,
    /// This process's local forward, backward and device all-reduce.
    pub local: Duration,
    /// Waiting for and running the cross-process reductions.
    pub across: Duration,
    /// How many times the split between processes changed.
    pub resplits: u64,
    /// Gradient values the last step summed across processes (as f64):
    /// the trainable parameters' gradient arena, so a LoRA run sends its
    /// adapters' gradients only.
    pub gradient_values: u64,
}

/// One model trained by every process of a [`ProcessGroup`], each over its
/// local devices. Every rank calls every method in the same order.
pub struct DistributedDataParallel {
    /// Shared: the caller keeps a handle to end the job (finalise or
    /// abort) after the engine is gone.
    group: Arc<dyn ProcessGroup>,
    local: DataParallel,
    global_batch: usize,
    /// Rows of the global batch per process, in rank order.
    process_shares: Vec<usize>,
    process_costs: Vec<Cost>,
    fixed_split: bool,
    window: (Duration, u64),
    stats: DistributedStats,
    #[cfg(feature = "fault-injection")]
    failure: Option<(usize, u64, InjectedFailure)>,
}

impl DistributedDataParallel {
    /// Replicas of `model` on every local device of every process;
    /// `global_batch` rows per step over the whole job. `process_rows`
    /// fixes the rows per process (rank order); otherwise each process
    /// measures its step cost and the batch is split so all finish together.
    /// Every replica then starts from rank 0's parameters.
    pub fn new<M: Staged + Clone + Send + Sync + 'static>(
        group: Arc<dyn ProcessGroup>,
        local_devices: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        process_rows: Option<Vec<usize>>,
    ) -> Result<Self> {
        Self::with_options(
            group,
            local_devices,
            model,
            criterion,
            optimizer,
            global_batch,
            process_rows,
            PlanOptions::default(),
        )
    }

    /// [`DistributedDataParallel::new`] with every local replica planned
    /// with `options` ([`DataParallel::with_options`]: f16 activations,
    /// activation checkpointing). Every rank must pass the same options and
    /// optimizer: with loss scaling each rank's scaler reads the same
    /// all-reduced gradients (an overflow anywhere is an inf or NaN in the
    /// sum everywhere), so every replica of every process skips the same
    /// steps, and [`TrainEngine::sync_from_root`] carries rank 0's scale.
    #[allow(clippy::too_many_arguments)]
    pub fn with_options<M: Staged + Clone + Send + Sync + 'static>(
        group: Arc<dyn ProcessGroup>,
        local_devices: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        process_rows: Option<Vec<usize>>,
        options: PlanOptions,
    ) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        let fixed_split = process_rows.is_some();
        let shares = match process_rows {
            Some(rows) => fixed_rows("distributed split", &rows, size, "processes", global_batch)?,
            None => proportional_split(global_batch, &vec![1.0; size])?,
        };
        let devices = local_devices.members().len();
        if shares[rank] < devices {
            return Err(Error::InvalidArgument {
                op: "distributed split",
                reason: format!(
                    "rank {rank} gets {} rows for {devices} local devices; use a larger batch",
                    shares[rank]
                ),
            });
        }
        let local = DataParallel::with_options(
            local_devices,
            model,
            criterion,
            optimizer,
            shares[rank],
            Split::Measured { every: 20 },
            options,
        )?;
        log::info!("rank {rank}: replicas built");
        let mut ddp = DistributedDataParallel {
            group,
            local,
            global_batch,
            process_shares: shares,
            process_costs: Vec::new(),
            fixed_split,
            window: (Duration::ZERO, 0),
            stats: DistributedStats::default(),
            #[cfg(feature = "fault-injection")]
            failure: None,
        };
        if !fixed_split && size > 1 {
            let own = ddp.on_rank(|d| d.local.calibrated_costs())?;
            ddp.process_costs = ddp.gather_costs(Cost::combined(&own))?;
            let balanced = balanced_split(global_batch, &ddp.process_costs)?;
            ddp.adopt_if_better(balanced)?;
        }
        ddp.sync_from_root()?;
        Ok(ddp)
    }

    fn on_rank<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let rank = self.group.rank();
        f(self).map_err(|e| match e {
            e @ (Error::Distributed { .. } | Error::OnRank { .. }) => e,
            e => Error::OnRank {
                rank,
                source: Box::new(e),
            },
        })
    }

    /// Every process's cost, in rank order.
    fn gather_costs(&self, own: Cost) -> Result<Vec<Cost>> {
        let all = self.group.all_gather(&[own.fixed, own.per_row])?;
        Ok(all
            .chunks_exact(2)
            .map(|c| Cost {
                fixed: c[0],
                per_row: c[1],
            })
            .collect())
    }

    /// Moves to `proposal` when rank 0 predicts a step at least 15% shorter
    /// (rank 0 decides, so every rank agrees even if their floating point
    /// would not).
    fn adopt_if_better(&mut self, proposal: Vec<usize>) -> Result<()> {
        let mut chosen: Vec<u64> = if makespan(&self.process_costs, &proposal)
            < (1.0 - RESPLIT_GAIN) * makespan(&self.process_costs, &self.process_shares)
        {
            proposal.iter().map(|&n| n as u64).collect()
        } else {
            self.process_shares.iter().map(|&n| n as u64).collect()
        };
        broadcast_u64(self.group.as_ref(), 0, &mut chosen)?;
        let chosen: Vec<usize> = chosen.into_iter().map(|n| n as usize).collect();
        if chosen.len() != self.group.size() || chosen.iter().sum::<usize>() != self.global_batch {
            return Err(self.error("split", format!("rank 0 sent the split {chosen:?}")));
        }
        if chosen != self.process_shares {
            let rank = self.group.rank();
            log::info!(
                "rank {rank}: process split {:?} -> {chosen:?} (costs {:?})",
                self.process_shares,
                self.process_costs
            );
            let rows = chosen[rank];
            self.on_rank(|d| d.local.set_global_batch(rows))?;
            self.process_shares = chosen;
            self.stats.resplits += 1;
        }
        Ok(())
    }

    fn error(&self, op: &'static str, message: String) -> Error {
        Error::Distributed {
            op,
            rank: self.group.rank(),
            size: self.group.size(),
            message,
        }
    }

    /// This process's rows of a global batch (`x` and `targets` hold all of
    /// it, in the same order on every rank) and its share of the batch.
    fn own_rows<'x, 't>(
        &self,
        op: &'static str,
        x: Examples<'x>,
        targets: Targets<'t>,
    ) -> Result<(Examples<'x>, Targets<'t>, f64)> {
        let (f, w) = self.local.check_rows(op, self.global_batch, x, targets)?;
        let rank = self.group.rank();
        let (start, rows) = (
            self.process_shares[..rank].iter().sum::<usize>(),
            self.process_shares[rank],
        );
        Ok((
            x.slice(start * f, (start + rows) * f),
            shard(targets, start, rows, w),
            rows as f64 / self.global_batch as f64,
        ))
    }

    /// The job's mean of each process's `local` mean weighted by its
    /// `scale` (a cross-process sum).
    fn global_mean(&self, scale: f64, local: f32) -> Result<f32> {
        let mut weighted = [scale * f64::from(local)];
        self.group.all_reduce_sum(&mut weighted)?;
        Ok(weighted[0] as f32)
    }

    /// One optimizer step on the global batch (`x` and `targets` hold all
    /// of it, in the same order on every rank; each process takes its rows).
    /// Returns the global mean loss when `read_loss`.
    pub fn step<'x>(
        &mut self,
        x: impl Into<Examples<'x>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        let x = x.into();
        let (rank, size) = (self.group.rank(), self.group.size());
        #[cfg(feature = "fault-injection")]
        if let Some((r, s, how)) = self.failure {
            if r == rank && s == self.stats.steps + 1 {
                match how {
                    InjectedFailure::Error => return Err(self.error("step", format!("failure injected at step {s}"))),
                    InjectedFailure::Panic => panic!("rank {rank}: failure injected at step {s}"),
                }
            }
        }
        let (own_x, own_targets, scale) = self.own_rows("DistributedDataParallel::step", x, targets)?;
        self.local
            .set_first_example(self.process_shares[..rank].iter().sum::<usize>());
        let began = Instant::now();
        let mut across = Duration::ZERO;
        let group = &self.group;
        let mut sent = 0u64;
        let mut reduce = |values: &mut [f64]| -> Result<()> {
            let t = Instant::now();
            let result = group.all_reduce_sum(values);
            across += t.elapsed();
            sent += values.len() as u64;
            result
        };
        let local_loss = self
            .local
            .step_across(own_x, own_targets, read_loss, scale, &mut reduce)
            .map_err(|e| Error::OnRank {
                rank,
                source: Box::new(e),
            })?;
        self.stats.gradient_values = sent;
        let t = Instant::now();
        let loss = local_loss.map(|l| self.global_mean(scale, l)).transpose()?;
        across += t.elapsed();
        let local_time = began.elapsed().saturating_sub(across);
        self.stats.steps += 1;
        self.stats.local += local_time;
        self.stats.across += across;
        self.window.0 += local_time;
        self.window.1 += 1;
        if size > 1 && self.stats.steps % SYNC_EVERY == 0 {
            let t = Instant::now();
            self.sync_from_root()?;
            self.stats.across += t.elapsed();
        }
        if size > 1 && !self.fixed_split && self.stats.steps % RESPLIT_EVERY == 0 {
            self.follow_measured_speeds()?;
        }
        Ok(loss)
    }

    /// Moves each process's cost model halfway towards its measured local
    /// step time over the last window, then re-splits when that clearly pays.
    fn follow_measured_speeds(&mut self) -> Result<()> {
        let rank = self.group.rank();
        let mean = self.window.0.as_secs_f64() / self.window.1.max(1) as f64;
        self.window = (Duration::ZERO, 0);
        let own = match self.process_costs.get(rank) {
            Some(c) => {
                let predicted = c.fixed + c.per_row * self.process_shares[rank] as f64;
                let s = 0.5 + 0.5 * mean / predicted.max(1e-9);
                Cost {
                    fixed: c.fixed * s,
                    per_row: c.per_row * s,
                }
            }
            None => Cost {
                fixed: 0.0,
                per_row: mean / self.process_shares[rank].max(1) as f64,
            },
        };
        self.process_costs = self.gather_costs(own)?;
        let proposal = balanced_split(self.global_batch, &self.process_costs)?;
        self.adopt_if_better(proposal)
    }

    /// The mean loss of one global batch without training on it: each
    /// process evaluates its rows over its devices, and one cross-process
    /// sum weights them by rows. Collective: every rank calls it.
    pub fn evaluate_loss<'x>(&mut self, x: impl Into<Examples<'x>>, targets: Targets<'_>) -> Result<f32> {
        let rank = self.group.rank();
        let (own_x, own_targets, scale) = self.own_rows("DistributedDataParallel::evaluate_loss", x.into(), targets)?;
        let local = self
            .local
            .evaluate_loss(own_x, own_targets)
            .map_err(|e| Error::OnRank {
                rank,
                source: Box::new(e),
            })?;
        self.global_mean(scale, local)
    }

    pub fn local(&self) -> &DataParallel {
        &self.local
    }

    pub fn local_mut(&mut self) -> &mut DataParallel {
        &mut self.local
    }

    /// Rows of the global batch per process, in rank order.
    pub fn process_shares(&self) -> &[usize] {
        &self.process_shares
    }

    pub fn stats(&self) -> &DistributedStats {
        &self.stats
    }

    /// This process's replica 0 (every replica holds the same weights).
    pub fn replica(&self) -> &Trainer {
        &self.local.replicas()[0]
    }

    pub fn predict<'x>(&mut self, x: impl Into<Examples<'x>>) -> Result<Vec<u32>> {
        self.local.predict(x)
    }
}

impl TrainEngine for DistributedDataParallel {
    own_steps!(DistributedDataParallel);
    fn holding(&self) -> Holding<'_> {
        Holding::Replica(self.replica())
    }
    /// This process's replicas only; [`TrainEngine::sync_from_root`] then
    /// hands rank 0's to every rank.
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        self.local.load_state(params, state, step)
    }
    fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        self.local.load_loss_scale(state)
    }
    /// Copies rank 0's replica-0 parameters, optimizer state, step count
    /// and loss scaling's state to every process's replica 0, then to its
    /// other replicas.
    fn sync_from_root(&mut self) -> Result<()> {
        let root = self.group.rank() == 0;
        let replica0 = &self.local.replicas()[0];
        let mut step = vec![replica0.executor().step_count()];
        let scale = if root {
            replica0.executor().read_loss_scale()?
        } else {
            None
        };
        let device0 = &self.local.devices()[0];
        for view in &arenas(replica0) {
            let mut values = if root {
                to_host(&[(device0.as_ref(), *view)], Instant::now())?.0.remove(0)
            } else {
                Vec::new()
            };
            broadcast_f32(self.group.as_ref(), 0, &mut values)?;
            if values.len() != view.len {
                let (sent, here, align) = (values.len(), view.len, self.local.arena_alignment());
                return Err(self.error("broadcast state", format!("rank 0 sent {sent} values for an arena of {here} (aligned to {align} B here): are the models the same?")));
            }
            if !root {
                device0
                    .write(*view, &values)
                    .map_err(|e| super::on_device(0, device0, e))?;
            }
        }
        broadcast_u64(self.group.as_ref(), 0, &mut step)?;
        let step = step
            .first()
            .copied()
            .ok_or_else(|| self.error("broadcast state", "no step count from rank 0".into()))?;
        let scale = broadcast_loss_scale(self.group.as_ref(), 0, scale)
            .map_err(|e| self.error("broadcast state", format!("rank 0's loss scale: {e}")))?;
        for t in self.local.replicas_mut() {
            // Setting the step starts loss scaling afresh at that step;
            // rank 0's state (its scale, skips and bias-correction count)
            // then replaces it.
            t.executor_mut().load_state(&[], &[], Some(step))?;
            if let Some(scale) = &scale {
                t.executor_mut().load_loss_scale(scale)?;
            }
        }
        self.local.synchronise()
    }
    /// One line: rows per process, each process's measured step cost, and
    /// this process's own devices.
    fn describe(&self) -> String {
        let costs: Vec<String> = self
            .process_costs
            .iter()
            .enumerate()
            .map(|(r, c)| format!("rank {r} {:.2} ms + {:.3} ms/row", 1e3 * c.fixed, 1e3 * c.per_row))
            .collect();
        let measured = if costs.is_empty() {
            String::new()
        } else {
            format!(" (measured step cost {})", costs.join(", "))
        };
        format!(
            "distributed data parallel over {} processes, rows per process {:?}{measured}; this process ({}): {}",
            self.group.size(),
            self.process_shares,
            self.group.describe(),
            self.local.describe()
        )
    }
    /// [`DistributedDataParallel::describe`] with the share of step time
    /// spent in cross-process reductions and the re-splits.
    fn report(&self) -> String {
        let s = &self.stats;
        let across = 100.0 * s.across.as_secs_f64() / (s.local + s.across).as_secs_f64().max(1e-9);
        format!(
            "{}; cross-process reductions {across:.0}% of step time, {} gradient values ({:.3} MB as f64) per step; {} process re-splits",
            self.describe(),
            s.gradient_values,
            s.gradient_values as f64 * 8.0 / 1e6,
            s.resplits
        )
    }
    fn shares(&self) -> Vec<usize> {
        self.process_shares.clone()
    }
    /// A test hook: make `rank` fail at `step` (1-based) with `how`.
    #[cfg(feature = "fault-injection")]
    fn inject_failure(&mut self, rank: usize, step: u64, how: InjectedFailure) {
        self.failure = Some((rank, step, how));
    }
}
