//! Data parallel training: a replica of the model on every device, the
//! global batch split among them in proportion to their measured speed,
//! gradients all-reduced weighted by shard size, and the same optimizer step
//! on every replica, so replicas stay identical.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::collectives::{all_reduce, Part};
use super::{on_device, DeviceGroup};
use crate::error::{Error, Result};
use crate::kernels::{Kernels, OptimizerConfig};
use crate::nn::{Criterion, Sequential};
use crate::trainer::{Targets, Trainer};

/// How the global batch is divided among devices.
#[derive(Clone, Debug, PartialEq)]
pub enum Split {
    /// Start even, then follow each device's measured rows per second,
    /// re-estimated every `every` steps.
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
    in_features: usize,
    out_features: usize,
    criterion: Criterion,
    /// Rows per second per device, smoothed.
    rates: Vec<Option<f64>>,
    split: Split,
    bucket: usize,
    model: Sequential,
    optimizer: OptimizerConfig,
    stats: DataParallelStats,
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
    let clean: Vec<f64> = weights.iter().map(|w| if w.is_finite() && *w > 0.0 { *w } else { 0.0 }).collect();
    let sum: f64 = clean.iter().sum();
    let clean = if sum > 0.0 { clean } else { vec![1.0; n] };
    let sum: f64 = clean.iter().sum();
    let spare = (total - n) as f64;
    let exact: Vec<f64> = clean.iter().map(|w| spare * w / sum).collect();
    let mut shares: Vec<usize> = exact.iter().map(|e| 1 + e.floor() as usize).collect();
    let mut left = total - shares.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    Ok(shares)
}

fn host_state(t: &Trainer) -> Result<(Vec<(String, Vec<usize>, Vec<f32>)>, Vec<(String, String, Vec<f32>)>, u64)> {
    let exec = t.executor();
    let params = exec.parameters()?;
    let state = exec.optimizer_state()?.into_iter().map(|(p, s, v)| (p, s.to_string(), v)).collect();
    Ok((params, state, exec.step_count()))
}

impl DataParallel {
    /// A replica of `model` on every device of `group`; `global_batch` rows per step.
    pub fn new(
        group: &DeviceGroup,
        model: &Sequential,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        split: Split,
    ) -> Result<Self> {
        let devices = group.members().to_vec();
        let shares = match &split {
            Split::Rows(rows) => {
                if rows.len() != devices.len() || rows.iter().sum::<usize>() != global_batch || rows.contains(&0) {
                    return Err(Error::InvalidArgument {
                        op: "data parallel split",
                        reason: format!("rows {rows:?} must give each of {} devices ≥ 1 row and sum to {global_batch}", devices.len()),
                    });
                }
                rows.clone()
            }
            Split::Measured { .. } => proportional_split(global_batch, &vec![1.0; devices.len()])?,
        };
        let (in_features, out_features) = match (model.in_features(), model.out_features()) {
            (Some(i), Some(o)) => (i, o),
            _ => return Err(Error::InvalidArgument { op: "DataParallel", reason: "the model has no Linear layer".into() }),
        };
        let mut dp = DataParallel {
            rates: vec![None; devices.len()],
            devices,
            replicas: Vec::new(),
            shares: Vec::new(),
            global_batch,
            in_features,
            out_features,
            criterion: criterion.into(),
            split,
            bucket: 1 << 18,
            model: model.clone(),
            optimizer: optimizer.into(),
            stats: DataParallelStats::default(),
        };
        dp.build_replicas(shares, None)?;
        Ok(dp)
    }

    /// (Re)creates one trainer per device with `shares` rows, loading
    /// `state` (parameters, optimizer state, step) into each when given.
    fn build_replicas(
        &mut self,
        shares: Vec<usize>,
        state: Option<(Vec<(String, Vec<usize>, Vec<f32>)>, Vec<(String, String, Vec<f32>)>, u64)>,
    ) -> Result<()> {
        let mut replicas = Vec::with_capacity(self.devices.len());
        for (i, (k, &rows)) in self.devices.iter().zip(&shares).enumerate() {
            let mut t = Trainer::new(k.clone(), &self.model, self.criterion, self.optimizer, rows).map_err(|e| on_device(i, k, e))?;
            if let Some((params, opt, step)) = &state {
                t.executor_mut().load_state(params, opt, Some(*step)).map_err(|e| on_device(i, k, e))?;
            }
            replicas.push(t);
        }
        self.replicas = replicas;
        self.shares = shares;
        Ok(())
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

    /// Rows of host memory moved per all-reduce bucket (elements).
    pub fn set_bucket(&mut self, elements: usize) {
        self.bucket = elements;
    }

    /// One step on `global_batch` rows: each device runs forward and
    /// backward on its shard (one submit each, all in flight together), the
    /// gradients are all-reduced weighted by shard size, and every replica
    /// takes the same optimizer step. Returns the global mean loss when
    /// `read_loss`.
    pub fn step(&mut self, x: &[f32], targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
        let f = self.in_features;
        let width = match targets {
            Targets::Values(v) => {
                if v.len() != self.global_batch * self.out_features {
                    return Err(Error::shape("DataParallel::step", "targets must be batch × outputs", &[&[v.len()]]));
                }
                self.out_features
            }
            Targets::Classes(c) => {
                if c.len() != self.global_batch {
                    return Err(Error::shape("DataParallel::step", "one label per row", &[&[c.len()]]));
                }
                1
            }
        };
        if x.len() != self.global_batch * f {
            return Err(Error::shape("DataParallel::step", format!("x must be {} × {f}", self.global_batch), &[&[x.len()]]));
        }
        let start = Instant::now();
        let mut row = 0;
        for (i, (t, &n)) in self.replicas.iter_mut().zip(&self.shares).enumerate() {
            let k = &self.devices[i];
            let shard_targets = match targets {
                Targets::Values(v) => Targets::Values(&v[row * width..(row + n) * width]),
                Targets::Classes(c) => Targets::Classes(&c[row..row + n]),
            };
            t.forward(&x[row * f..(row + n) * f]).map_err(|e| on_device(i, k, e))?;
            t.loss(shard_targets).map_err(|e| on_device(i, k, e))?;
            t.forward_backward(false).map_err(|e| on_device(i, k, e))?;
            row += n;
        }
        let weights: Vec<f64> = self.shares.iter().map(|&n| n as f64 / self.global_batch as f64).collect();
        let arrivals = {
            let mut parts = Vec::with_capacity(self.replicas.len());
            for (i, t) in self.replicas.iter().enumerate() {
                let view = t.executor().gradient_arena().ok_or_else(|| Error::InvalidArgument {
                    op: "DataParallel::step",
                    reason: "replica without gradients".into(),
                })?;
                parts.push(Part::new(&self.devices[i], view));
            }
            all_reduce(&parts, Some(&weights), self.bucket, start)?
        };
        for (i, t) in self.replicas.iter_mut().enumerate() {
            t.executor_mut().optimizer_step().map_err(|e| on_device(i, &self.devices[i], e))?;
        }
        let slowest = arrivals.iter().copied().max().unwrap_or_default();
        self.stats.steps += 1;
        self.stats.compute += slowest;
        self.stats.communication += start.elapsed().saturating_sub(slowest);
        for (i, d) in arrivals.iter().enumerate() {
            let rate = self.shares[i] as f64 / d.as_secs_f64().max(1e-6);
            self.rates[i] = Some(self.rates[i].map_or(rate, |old| 0.7 * old + 0.3 * rate));
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

    /// Follows the measured speeds when they call for a split that moves
    /// more than 5% of the batch (rebuilding the replicas carries the
    /// parameters and optimizer state over through the host).
    fn maybe_resplit(&mut self) -> Result<()> {
        let Split::Measured { every } = self.split else { return Ok(()) };
        if every == 0 || self.stats.steps % every != 0 || self.rates.iter().any(Option::is_none) {
            return Ok(());
        }
        let rates: Vec<f64> = self.rates.iter().map(|r| r.unwrap_or(1.0)).collect();
        let proposal = proportional_split(self.global_batch, &rates)?;
        let moved: usize = proposal.iter().zip(&self.shares).map(|(a, b)| a.abs_diff(*b)).sum::<usize>() / 2;
        if moved * 20 <= self.global_batch {
            return Ok(());
        }
        let state = host_state(&self.replicas[0])?;
        log::info!("data parallel: split {:?} -> {:?} (rows/s {:?})", self.shares, proposal, rates);
        self.build_replicas(proposal, Some(state))?;
        self.stats.resplits += 1;
        Ok(())
    }

    /// Predictions from replica 0 (all replicas hold the same weights).
    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        self.replicas[0].predict(features)
    }
}
