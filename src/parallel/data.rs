//! Data parallel training: a replica of the model on every device, the
//! global batch split among them in proportion to their measured speed,
//! gradients all-reduced weighted by shard size, and the same optimizer step
//! on every replica, so replicas stay identical.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

use super::collectives::{all_reduce_then, Part};
use super::distributed::SYNC_EVERY;
use super::engine::{own_steps, Holding, TrainEngine};
use super::stage::{check_batch, NamedParameters};
use super::{on_device, DeviceGroup};
use super::{Examples, ModelWidths, Targets, Trainer};
use crate::error::{Error, Result};
use crate::graph::PlanOptions;
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{Criterion, Staged};
use crate::optim::LossScaleState;

/// How the global batch is divided among devices.
#[derive(Clone, Debug, PartialEq)]
pub enum Split {
    /// Calibrate each device's step time (fixed + per row) at start, split
    /// so all finish together, and re-estimate from the step times every
    /// `every` steps (0: never).
    Measured { every: u64 },
    /// Fixed rows per device (must sum to the global batch).
    Rows(Vec<usize>),
}

/// Time spent per step, for the bench and the training output.
#[derive(Clone, Debug, Default)]
pub struct DataParallelStats {
    pub steps: u64,
    /// Longest forward+backward among devices (the step's compute time).
    pub compute: Duration,
    /// Gradient all-reduce after the slowest device finished, plus updates.
    pub communication: Duration,
    /// How many times the split changed.
    pub resplits: u64,
}

pub struct DataParallel {
    devices: Vec<Arc<Kernels>>,
    replicas: Vec<Trainer>,
    shares: Vec<usize>,
    global_batch: usize,
    widths: ModelWidths,
    criterion: Criterion,
    /// Per device, seconds per step ≈ fixed + per_row · rows (measured).
    costs: Vec<Option<Cost>>,
    split: Split,
    bucket: usize,
    model: Arc<dyn Staged + Send + Sync>,
    optimizer: OptimizerConfig,
    /// Every replica's plan options: one arena alignment for the group.
    options: PlanOptions,
    stats: DataParallelStats,
    /// Where this engine's batch starts in a job's (a process's rows).
    first_example: usize,
}

/// Least byte alignment of every data-parallel replica's parameter,
/// gradient and optimizer-state arenas. The all-reduce and the broadcasts
/// copy whole arenas by offset, so every replica must lay them out alike,
/// and each device's own `min_storage_buffer_offset_alignment` differs
/// (32 B on lavapipe and llvmpipe-GL, 256 B on SwiftShader). 256 B is the
/// largest that WebGPU, Vulkan, D3D12 and GL allow an adapter to require, so
/// any device binds at it and replicas in other processes, on adapters this
/// one never sees, lay out the same. It costs under 256 B of padding per
/// parameter tensor and arena.
pub const ARENA_ALIGNMENT: u32 = 256;

/// The arena alignment for replicas on `devices`: [`ARENA_ALIGNMENT`], or a
/// device's own where (against every API's rules) it is larger.
pub fn group_arena_alignment(devices: &[Arc<Kernels>]) -> u32 {
    devices
        .iter()
        .map(|k| k.device().limits().min_storage_buffer_offset_alignment)
        .fold(ARENA_ALIGNMENT, u32::max)
}

/// A device's measured step time: `fixed + per_row · rows` seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    pub fixed: f64,
    pub per_row: f64,
}

impl Cost {
    fn at(&self, rows: f64) -> f64 {
        self.fixed + self.per_row * rows
    }

    /// The cost of several devices working together on a balanced split:
    /// with every device busy until T, Σ (T − fixed_d) / per_row_d = rows,
    /// so T = (rows + Σ fixed_d/per_row_d) / Σ 1/per_row_d.
    pub fn combined(costs: &[Cost]) -> Cost {
        let speed: f64 = costs.iter().map(|c| 1.0 / c.per_row.max(1e-12)).sum();
        let offset: f64 = costs.iter().map(|c| c.fixed / c.per_row.max(1e-12)).sum();
        if speed <= 0.0 {
            return Cost {
                fixed: 0.0,
                per_row: 1.0,
            };
        }
        Cost {
            fixed: offset / speed,
            per_row: 1.0 / speed,
        }
    }
}

/// Divides `total` rows so every device finishes at about the same time
/// given its cost (≥ 1 row each): a fast device with a high fixed cost per
/// dispatch gets fewer rows than its per-row speed alone would suggest.
pub fn balanced_split(total: usize, costs: &[Cost]) -> Result<Vec<usize>> {
    if costs.is_empty() || total < costs.len() {
        return Err(Error::InvalidArgument {
            op: "data parallel split",
            reason: format!("{total} rows cannot give each of {} devices at least one", costs.len()),
        });
    }
    let rows_by = |t: f64| -> Vec<f64> {
        costs
            .iter()
            .map(|c| ((t - c.fixed) / c.per_row.max(1e-12)).max(1.0))
            .collect()
    };
    let (mut lo, mut hi) = (0.0f64, costs.iter().map(|c| c.at(total as f64)).fold(0.0, f64::max));
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if rows_by(mid).iter().sum::<f64>() < total as f64 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let exact = rows_by(hi);
    // Round to whole rows summing to `total`, at least one each.
    let mut rows: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).max(1)).collect();
    while rows.iter().sum::<usize>() > total {
        let (i, _) = rows
            .iter()
            .enumerate()
            .filter(|(_, &r)| r > 1)
            .max_by_key(|(_, &r)| r)
            .ok_or_else(|| Error::Internal {
                op: "data parallel split",
                reason: format!("{total} rows cannot give each of {} devices at least one", costs.len()),
            })?;
        rows[i] -= 1;
    }
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - rows[b] as f64)
            .total_cmp(&(exact[a] - rows[a] as f64))
            .then(a.cmp(&b))
    });
    let mut k = 0;
    while rows.iter().sum::<usize>() < total {
        rows[order[k % order.len()]] += 1;
        k += 1;
    }
    Ok(rows)
}

/// The predicted step time of a split: its slowest device.
pub(super) fn makespan(costs: &[Cost], shares: &[usize]) -> f64 {
    costs
        .iter()
        .zip(shares)
        .map(|(c, &n)| c.at(n as f64))
        .fold(0.0, f64::max)
}

/// Divides `total` rows in proportion to `weights`, at least one row each
/// (largest remainders get the leftover rows).
pub fn proportional_split(total: usize, weights: &[f64]) -> Result<Vec<usize>> {
    let n = weights.len();
    if n == 0 || total < n {
        return Err(Error::InvalidArgument {
            op: "data parallel split",
            reason: format!("{total} rows cannot give each of {n} devices at least one"),
        });
    }
    let clean: Vec<f64> = weights
        .iter()
        .map(|w| if w.is_finite() && *w > 0.0 { *w } else { 0.0 })
        .collect();
    let sum: f64 = clean.iter().sum();
    let clean = if sum > 0.0 { clean } else { vec![1.0; n] };
    let sum: f64 = clean.iter().sum();
    let spare = (total - n) as f64;
    let exact: Vec<f64> = clean.iter().map(|w| spare * w / sum).collect();
    let mut shares: Vec<usize> = exact.iter().map(|e| 1 + e.floor() as usize).collect();
    let mut left = total - shares.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    Ok(shares)
}

/// `rows` as fixed rows per part (device or process) of a batch of
/// `total`: one entry per part, each ≥ 1, summing to `total`.
pub(super) fn fixed_rows(
    op: &'static str,
    rows: &[usize],
    parts: usize,
    what: &str,
    total: usize,
) -> Result<Vec<usize>> {
    if rows.len() != parts || rows.iter().sum::<usize>() != total || rows.contains(&0) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("rows {rows:?} must give each of {parts} {what} ≥ 1 row and sum to {total}"),
        });
    }
    Ok(rows.to_vec())
}

/// A replica's parameter arena, then its optimizer state arenas: what
/// the broadcasts of replica state copy.
pub(super) fn arenas(t: &Trainer) -> Vec<crate::kernels::View<'_>> {
    let e = t.executor();
    let mut v = vec![e.parameter_arena()];
    v.extend(e.state_arenas());
    v
}

/// Rows `row..row + n` of `targets`, `width` values per row.
pub(super) fn shard<'t>(targets: Targets<'t>, row: usize, n: usize, width: usize) -> Targets<'t> {
    match targets {
        Targets::Values(v) => Targets::Values(&v[row * width..(row + n) * width]),
        Targets::Classes(c) => Targets::Classes(&c[row * width..(row + n) * width]),
    }
}

/// Checks that `x` and `targets` hold `rows` rows of what a model of
/// `widths` reads and compares against; returns the values per row of `x`
/// and of the targets.
pub(super) fn check_rows(
    widths: &ModelWidths,
    op: &'static str,
    rows: usize,
    x: Examples<'_>,
    targets: Targets<'_>,
) -> Result<(usize, usize)> {
    let f = widths.inputs;
    if x.is_empty() || matches!(x, Examples::Ids(_)) != widths.reads_ids {
        return Err(Error::InvalidArgument {
            op,
            reason: "the model reads the other kind of input (features or token ids)".into(),
        });
    }
    let width = match targets {
        Targets::Values(_) => widths.outputs,
        Targets::Classes(_) => widths.output_rows,
    };
    check_batch(op, rows, f, width, x, targets)?;
    Ok((f, width))
}

/// Forward and backward of each replica on its `shares` of the batch `x`
/// (`f` values per row) against `targets` (`width` per row), gradients
/// zeroed first: one submission each, all in flight together. `x` starts
/// at example `first` of the whole batch (a process's rows of a job's):
/// each replica's dropout masks are those of its rows in the whole batch.
pub(super) fn backward_on_rows(
    replicas: &mut [Trainer],
    devices: &[Arc<Kernels>],
    shares: &[usize],
    (x, f): (Examples<'_>, usize),
    (targets, width): (Targets<'_>, usize),
    first: usize,
) -> Result<()> {
    let mut row = 0;
    for (i, (t, &n)) in replicas.iter_mut().zip(shares).enumerate() {
        let k = &devices[i];
        t.executor_mut().set_dropout_first_example(first + row);
        t.forward_examples(x.slice(row * f, (row + n) * f))
            .map_err(|e| on_device(i, k, e))?;
        t.loss(shard(targets, row, n, width)).map_err(|e| on_device(i, k, e))?;
        t.forward_backward(false).map_err(|e| on_device(i, k, e))?;
        row += n;
    }
    Ok(())
}

/// The mean loss of a batch split as [`backward_on_rows`] splits it: each
/// replica evaluates its rows and the shard means are weighted by rows.
pub(super) fn evaluate_on_rows(
    replicas: &mut [Trainer],
    devices: &[Arc<Kernels>],
    shares: &[usize],
    (x, f): (Examples<'_>, usize),
    (targets, width): (Targets<'_>, usize),
) -> Result<f32> {
    let total_rows: usize = shares.iter().sum();
    let mut total = 0.0f64;
    let mut row = 0;
    for (i, (t, &n)) in replicas.iter_mut().zip(shares).enumerate() {
        let loss = t
            .evaluate_loss(x.slice(row * f, (row + n) * f), shard(targets, row, n, width))
            .map_err(|e| on_device(i, &devices[i], e))?;
        total += n as f64 / total_rows as f64 * f64::from(loss);
        row += n;
    }
    Ok(total as f32)
}

/// A replica's parameters, optimizer state, step and dynamic loss
/// scaling's state (f16), on the host.
type HostState = (
    NamedParameters,
    Vec<(String, String, Vec<f32>)>,
    u64,
    Option<LossScaleState>,
);

fn host_state(t: &Trainer) -> Result<HostState> {
    let exec = t.executor();
    let params = exec.parameters()?;
    let state = exec
        .optimizer_state()?
        .into_iter()
        .map(|(p, s, v)| (p, s.to_string(), v))
        .collect();
    Ok((params, state, exec.step_count(), exec.read_loss_scale()?))
}

impl DataParallel {
    /// A replica of `model` on every device of `group`; `global_batch` rows per step.
    pub fn new<M: Staged + Clone + Send + Sync + 'static>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        split: Split,
    ) -> Result<Self> {
        Self::with_options(
            group,
            model,
            criterion,
            optimizer,
            global_batch,
            split,
            PlanOptions::default(),
        )
    }

    /// [`DataParallel::new`] with every replica planned with `options`
    /// (f16 activations, activation checkpointing block by block); the
    /// arena alignment is the group's ([`group_arena_alignment`]), whatever
    /// `options` says. With f16 the optimizer's loss scaler runs on every
    /// replica after the all-reduce, so all of them see the same gradients
    /// and skip the same steps.
    #[allow(clippy::too_many_arguments)]
    pub fn with_options<M: Staged + Clone + Send + Sync + 'static>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        split: Split,
        options: PlanOptions,
    ) -> Result<Self> {
        let devices = group.members().to_vec();
        let mut shares = match &split {
            Split::Rows(rows) => fixed_rows("data parallel split", rows, devices.len(), "devices", global_batch)?,
            Split::Measured { .. } => proportional_split(global_batch, &vec![1.0; devices.len()])?,
        };
        let widths = ModelWidths::of(model)?;
        let options = PlanOptions {
            arena_alignment: group_arena_alignment(&devices),
            ..options
        };
        let mut dp = DataParallel {
            costs: vec![None; devices.len()],
            devices,
            replicas: Vec::new(),
            shares: Vec::new(),
            global_batch,
            widths,
            criterion: criterion.into(),
            split,
            bucket: 1 << 18,
            model: Arc::new(model.clone()),
            optimizer: optimizer.into(),
            options,
            stats: DataParallelStats::default(),
            first_example: 0,
        };
        if matches!(dp.split, Split::Measured { .. }) && dp.devices.len() > 1 {
            dp.calibrate()?;
            let costs: Vec<Cost> = dp.costs.iter().flatten().copied().collect();
            let balanced = balanced_split(global_batch, &costs)?;
            if makespan(&costs, &balanced) < 0.9 * makespan(&costs, &shares) {
                shares = balanced;
            }
        }
        dp.build_replicas(shares, None)?;
        Ok(dp)
    }

    /// Times forward+backward on each device alone at two batch sizes, to
    /// separate its fixed cost per step from its cost per row.
    fn calibrate(&mut self) -> Result<()> {
        let n = self.global_batch;
        let small = (n / (2 * self.devices.len())).max(1);
        let large = n.max(small + 1);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let w = self.widths;
        let x: Vec<f32> = (0..large * w.inputs).map(|_| rng.random_range(-1.0..1.0)).collect();
        // Id 0 exists in every vocabulary.
        let ids = vec![0u32; large * w.inputs];
        let values: Vec<f32> = (0..large * w.outputs).map(|_| rng.random_range(-1.0..1.0)).collect();
        let classes_per_row = (w.outputs / w.output_rows.max(1)).max(1);
        let classes: Vec<u32> = (0..large * w.output_rows)
            .map(|i| (i % classes_per_row) as u32)
            .collect();
        for (i, k) in self.devices.iter().enumerate() {
            let time_at = |rows: usize| -> Result<f64> {
                let mut t = Trainer::with_blocks(
                    k.clone(),
                    self.model.as_ref(),
                    self.criterion,
                    self.optimizer,
                    rows,
                    self.options,
                )?;
                let targets = match self.criterion {
                    Criterion::Mse => Targets::Values(&values[..rows * w.outputs]),
                    Criterion::CrossEntropy => Targets::Classes(&classes[..rows * w.output_rows]),
                };
                let run = |t: &mut Trainer| -> Result<()> {
                    if w.reads_ids {
                        t.forward_ids(&ids[..rows * w.inputs])?;
                    } else {
                        t.forward(&x[..rows * w.inputs])?;
                    }
                    t.loss(targets)?;
                    t.forward_backward(false)?;
                    k.device().wait_idle("calibrate")
                };
                run(&mut t)?;
                let reps = 3;
                let start = Instant::now();
                for _ in 0..reps {
                    run(&mut t)?;
                }
                Ok(start.elapsed().as_secs_f64() / reps as f64)
            };
            let (t_small, t_large) = (
                time_at(small).map_err(|e| on_device(i, k, e))?,
                time_at(large).map_err(|e| on_device(i, k, e))?,
            );
            // Small models are latency-bound and the difference is noise;
            // attributing at least 5% of the step to its rows keeps the
            // split well-conditioned.
            let per_row = ((t_large - t_small) / (large - small) as f64)
                .max(0.05 * t_large / large as f64)
                .max(1e-9);
            let fixed = (t_small - per_row * small as f64).max(0.0);
            self.costs[i] = Some(Cost { fixed, per_row });
        }
        log::info!("data parallel calibration: {:?}", self.costs);
        Ok(())
    }

    /// Each device's cost model, calibrating first when it was not measured
    /// yet (a single device, or a fixed split).
    pub fn calibrated_costs(&mut self) -> Result<Vec<Cost>> {
        if self.costs.iter().any(Option::is_none) {
            self.calibrate()?;
        }
        Ok(self.costs.iter().flatten().copied().collect())
    }

    /// Takes `rows` rows per step from now on (a new share of a larger
    /// job), split over the devices by their costs when measured; the
    /// replicas keep their parameters, optimizer state and step.
    pub fn set_global_batch(&mut self, rows: usize) -> Result<()> {
        if rows == self.global_batch {
            return Ok(());
        }
        let shares = match (&self.split, self.costs.iter().all(Option::is_some)) {
            (Split::Rows(_), _) => {
                return Err(Error::InvalidArgument {
                    op: "data parallel split",
                    reason: format!(
                        "the rows per device are fixed ({:?}); the batch cannot become {rows}",
                        self.shares
                    ),
                })
            }
            (Split::Measured { .. }, true) => {
                balanced_split(rows, &self.costs.iter().flatten().copied().collect::<Vec<_>>())?
            }
            (Split::Measured { .. }, false) => proportional_split(rows, &vec![1.0; self.devices.len()])?,
        };
        let state = host_state(&self.replicas[0])?;
        self.global_batch = rows;
        self.build_replicas(shares, Some(state))
    }

    /// (Re)creates one trainer per device with `shares` rows, loading
    /// `state` (parameters, optimizer state, step) into each when given.
    fn build_replicas(&mut self, shares: Vec<usize>, state: Option<HostState>) -> Result<()> {
        let mut replicas = Vec::with_capacity(self.devices.len());
        for (i, (k, &rows)) in self.devices.iter().zip(&shares).enumerate() {
            let mut t = Trainer::with_blocks(
                k.clone(),
                self.model.as_ref(),
                self.criterion,
                self.optimizer,
                rows,
                self.options,
            )
            .map_err(|e| on_device(i, k, e))?;
            if let Some((params, opt, step, scale)) = &state {
                t.executor_mut()
                    .load_state(params, opt, Some(*step))
                    .map_err(|e| on_device(i, k, e))?;
                if let Some(scale) = scale {
                    t.executor_mut()
                        .load_loss_scale(scale)
                        .map_err(|e| on_device(i, k, e))?;
                }
            }
            replicas.push(t);
        }
        self.replicas = replicas;
        self.shares = shares;
        Ok(())
    }

    /// Where this engine's batch starts in the whole batch of a job (this
    /// process's rows), in examples: its dropout masks are those rows'.
    pub(super) fn set_first_example(&mut self, first: usize) {
        self.first_example = first;
    }

    /// Rows of the global batch each device takes now.
    pub fn shares(&self) -> &[usize] {
        &self.shares
    }

    pub fn stats(&self) -> &DataParallelStats {
        &self.stats
    }

    pub fn replicas(&self) -> &[Trainer] {
        &self.replicas
    }

    pub fn replicas_mut(&mut self) -> &mut [Trainer] {
        &mut self.replicas
    }

    pub fn devices(&self) -> &[Arc<Kernels>] {
        &self.devices
    }

    /// The byte alignment every replica's arenas are laid out with
    /// ([`group_arena_alignment`]).
    pub fn arena_alignment(&self) -> u32 {
        self.options.arena_alignment
    }

    /// Checks that `x` and `targets` hold `rows` rows of what the model
    /// reads and compares against; returns the values per row of `x` and
    /// of the targets.
    pub(super) fn check_rows(
        &self,
        op: &'static str,
        rows: usize,
        x: Examples<'_>,
        targets: Targets<'_>,
    ) -> Result<(usize, usize)> {
        check_rows(&self.widths, op, rows, x, targets)
    }

    /// One step on `global_batch` rows: each device runs forward and
    /// backward on its shard (one submit each, all in flight together), the
    /// gradients are all-reduced weighted by shard size, and every replica
    /// takes the same optimizer step. Returns the global mean loss when
    /// `read_loss`.
    /// `x`: f32 features or u32 token ids ([`Examples`]), as the model reads.
    pub fn step<'x>(
        &mut self,
        x: impl Into<Examples<'x>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        self.step_across(x, targets, read_loss, 1.0, &mut |_| Ok(()))
    }

    /// [`DataParallel::step`] as one process of several: the gradient is
    /// weighted by `scale` (this process's share of the job's batch) and
    /// each bucket of the local sum goes through `across` (a sum over
    /// processes) before it reaches the devices. The loss returned is this
    /// process's own mean, unscaled.
    pub fn step_across<'x>(
        &mut self,
        x: impl Into<Examples<'x>>,
        targets: Targets<'_>,
        read_loss: bool,
        scale: f64,
        across: &mut dyn FnMut(&mut [f64]) -> Result<()>,
    ) -> Result<Option<f32>> {
        let x = x.into();
        let (f, width) = self.check_rows("DataParallel::step", self.global_batch, x, targets)?;
        let start = Instant::now();
        backward_on_rows(
            &mut self.replicas,
            &self.devices,
            &self.shares,
            (x, f),
            (targets, width),
            self.first_example,
        )?;
        let weights: Vec<f64> = self
            .shares
            .iter()
            .map(|&n| n as f64 / self.global_batch as f64)
            .collect();
        let scaled: Vec<f64> = weights.iter().map(|w| w * scale).collect();
        let parts = (self.replicas.iter().zip(&self.devices))
            .map(|(t, k)| {
                t.executor()
                    .gradient_arena()
                    .map(|view| Part::new(k, view))
                    .ok_or_else(|| Error::Internal {
                        op: "DataParallel::step",
                        reason: "replica without gradients".into(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let arrivals = all_reduce_then(&parts, Some(&scaled), self.bucket, start, across)?;
        for (i, t) in self.replicas.iter_mut().enumerate() {
            t.executor_mut()
                .optimizer_step()
                .map_err(|e| on_device(i, &self.devices[i], e))?;
        }
        let slowest = arrivals.iter().copied().max().unwrap_or_default();
        self.stats.steps += 1;
        self.stats.compute += slowest;
        self.stats.communication += start.elapsed().saturating_sub(slowest);
        // Devices that ran slower (or faster) than their model predicts get
        // their cost scaled, smoothed over steps.
        for (i, d) in arrivals.iter().enumerate() {
            if let Some(c) = &mut self.costs[i] {
                let ratio = d.as_secs_f64() / c.at(self.shares[i] as f64).max(1e-9);
                let scale = 0.8 + 0.2 * ratio.clamp(0.25, 4.0);
                c.fixed *= scale;
                c.per_row *= scale;
            }
        }
        if self.stats.steps % SYNC_EVERY == 0 {
            self.synchronise()?;
        }
        let loss = if read_loss {
            let mut total = 0.0f64;
            for (i, t) in self.replicas.iter().enumerate() {
                total += weights[i] * f64::from(t.loss_item().map_err(|e| on_device(i, &self.devices[i], e))?);
            }
            Some(total as f32)
        } else {
            None
        };
        self.maybe_resplit()?;
        Ok(loss)
    }

    /// Copies replica 0's parameters and optimizer state to the others.
    /// Replicas on one kind of device stay bit-identical without it; on
    /// different backends, division and square roots may round differently
    /// (WGSL allows a few ulp), and this stops the drift accumulating.
    pub fn synchronise(&mut self) -> Result<()> {
        if self.replicas.len() < 2 {
            return Ok(());
        }
        let source = arenas(&self.replicas[0]);
        for (a, src) in source.iter().enumerate() {
            let dsts: Vec<Part<'_>> = self.replicas[1..]
                .iter()
                .enumerate()
                .map(|(i, t)| Part::new(&self.devices[i + 1], arenas(t)[a]))
                .collect();
            super::collectives::broadcast(Part::new(&self.devices[0], *src), &dsts)?;
        }
        Ok(())
    }

    /// Follows the measured speeds when they call for a split that moves
    /// more than 5% of the batch (rebuilding the replicas carries the
    /// parameters and optimizer state over through the host).
    fn maybe_resplit(&mut self) -> Result<()> {
        let Split::Measured { every } = self.split else {
            return Ok(());
        };
        if every == 0 || self.stats.steps % every != 0 || self.costs.iter().any(Option::is_none) {
            return Ok(());
        }
        let costs: Vec<Cost> = self.costs.iter().flatten().copied().collect();
        let proposal = balanced_split(self.global_batch, &costs)?;
        // Move only for a clear gain: a predicted step 10% shorter.
        if makespan(&costs, &proposal) >= 0.9 * makespan(&costs, &self.shares) {
            return Ok(());
        }
        let state = host_state(&self.replicas[0])?;
        log::info!(
            "data parallel: split {:?} -> {:?} (costs {:?})",
            self.shares,
            proposal,
            costs
        );
        self.build_replicas(proposal, Some(state))?;
        self.stats.resplits += 1;
        Ok(())
    }

    /// The mean loss of one global batch without training on it: each
    /// replica evaluates its rows (the same split as a step), and the shard
    /// means are weighted by their rows, as the loss a step reads is.
    pub fn evaluate_loss<'x>(&mut self, x: impl Into<Examples<'x>>, targets: Targets<'_>) -> Result<f32> {
        let x = x.into();
        let (f, width) = self.check_rows("DataParallel::evaluate_loss", self.global_batch, x, targets)?;
        evaluate_on_rows(
            &mut self.replicas,
            &self.devices,
            &self.shares,
            (x, f),
            (targets, width),
        )
    }

    /// Predictions from replica 0 (all replicas hold the same weights).
    pub fn predict<'x>(&mut self, x: impl Into<Examples<'x>>) -> Result<Vec<u32>> {
        self.replicas[0].predict_examples(x.into())
    }
}

impl TrainEngine for DataParallel {
    own_steps!(DataParallel);
    fn holding(&self) -> Holding<'_> {
        Holding::Replica(&self.replicas[0])
    }
    /// Loads parameters (by name), optimizer state and the step count into
    /// every replica (resuming a run), each checked as
    /// [`Executor::load_state`](crate::graph::Executor::load_state) checks.
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        optimizer_state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        for (i, t) in self.replicas.iter_mut().enumerate() {
            t.executor_mut()
                .load_state(params, optimizer_state, step)
                .map_err(|e| on_device(i, &self.devices[i], e))?;
        }
        Ok(())
    }
    fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        for (i, t) in self.replicas.iter_mut().enumerate() {
            t.executor_mut()
                .load_loss_scale(state)
                .map_err(|e| on_device(i, &self.devices[i], e))?;
        }
        Ok(())
    }
    /// One line: the rows each device takes and, once measured, each
    /// device's step cost.
    fn describe(&self) -> String {
        let shares: Vec<String> = self
            .devices
            .iter()
            .zip(&self.shares)
            .enumerate()
            .map(|(i, (k, n))| format!("#{i} {} {n} rows", k.device().label()))
            .collect();
        let costs: Vec<String> = self
            .costs
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.map(|c| format!("#{i} {:.2} ms + {:.3} ms/row", 1e3 * c.fixed, 1e3 * c.per_row)))
            .collect();
        let measured = if costs.is_empty() {
            String::new()
        } else {
            format!(" (measured step cost {})", costs.join(", "))
        };
        format!("data parallel, batch split {}{measured}", shares.join(", "))
    }
    /// [`DataParallel::describe`] with the share of step time spent on
    /// communication and the re-splits, for the end of a run.
    fn report(&self) -> String {
        let s = &self.stats;
        let communication =
            100.0 * s.communication.as_secs_f64() / (s.compute + s.communication).as_secs_f64().max(1e-9);
        format!(
            "{}; communication {communication:.0}% of step time; {} re-splits",
            self.describe(),
            s.resplits
        )
    }
    fn shares(&self) -> Vec<usize> {
        self.shares.clone()
    }
}
