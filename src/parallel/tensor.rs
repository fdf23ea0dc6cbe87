//! Tensor parallel training of any module, Megatron style (Shoeybi et al.,
//! 2019): every device holds a share of every split layer, as the module
//! declares it ([`crate::nn::shard`]): column-parallel Linears hold some
//! outputs (attention heads, MLP hidden units), row-parallel ones the
//! matching inputs and yield partial sums; norms and embeddings are
//! replicated.
//!
//! Each device runs the model's own forward, cut at its all-reduces into a
//! chain of segments ([`Stage`]s); the last segment (after the last
//! all-reduce: a transformer's final norm, head and loss) runs on device 0
//! only. The sum of the devices' outputs of a segment (an all-reduce
//! through the host, in f64 and device order: Megatron's g) is the next
//! segment's input on every device. Backward runs the chain in reverse:
//! the sum of the devices' input gradients of a segment (Megatron's f) is
//! the output gradient of the segment before. Split parameters then hold
//! exact gradients; each copy of a replicated one holds its device's part,
//! which [`Spread::step`] sums before every stage steps, clipping by the
//! whole model's gradient norm.
//!
//! Why the vocabulary is not split as well: the char-level tables here
//! have 65–84 rows (84 × 128 floats, less than one block's q, k, v
//! projection), so a vocabulary-parallel embedding and head would save
//! almost no memory, yet
//! cost an all-reduce of [B, T, C] after the lookup and, for the
//! cross-entropy over split logits, all-reduces of each row's max and sum
//! of exponentials in the forward pass — each a host round trip, which
//! wgpu (no peer copies) pays as a full synchronisation. At a 50257-token
//! vocabulary the table is 31% of a 124M-parameter model (replicated on every
//! device) and the head about a quarter of the forward's multiply-adds at
//! T = 1024, all on device 0; a vocabulary-parallel embedding and head
//! would then pay for their extra all-reduces.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::data::group_arena_alignment;
use super::engine::{features, own_steps, Holding, TrainEngine};
use super::stage::{check_batch, Spread, Stage, StageEnd};
use super::{on_device, DeviceGroup};
use super::{Examples, ModelWidths, Targets};
use crate::error::{Error, Result};
use crate::graph::{Graph, PlanOptions};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::shard::{self, Slice};
use crate::nn::{Criterion, Module};
use crate::optim::LossScaleState;

/// Time accounting for the steps taken.
#[derive(Clone, Debug, Default)]
pub struct TensorParallelStats {
    pub steps: u64,
    pub wall: Duration,
    /// Host transfers: writes of activations and gradients to the shards,
    /// the all-reduces after the slowest shard finished, and the
    /// replicated parameters' gradient sums.
    pub communication: Duration,
}

/// Sums the views on the host; also returns the time spent after the
/// slowest device's data arrived (the transfer and sum, not the compute).
fn sum_on_host(views: &[(&Kernels, View<'_>)]) -> Result<(Vec<f32>, Duration)> {
    let start = Instant::now();
    let (values, arrived) = to_host(views, start)?;
    let n = values.first().map_or(0, Vec::len);
    let sum = (0..n)
        .map(|j| values.iter().map(|v| f64::from(v[j])).sum::<f64>() as f32)
        .collect();
    let slowest = arrived.into_iter().max().unwrap_or_default();
    Ok((sum, start.elapsed().saturating_sub(slowest)))
}

/// A module trained Megatron-style over every device of a group (see the
/// module docs).
pub struct TensorParallel {
    /// Device r's segment k at `r * segments + k`; last, the final segment
    /// on device 0 (the head).
    stages: Vec<Stage>,
    ranks: usize,
    /// Segments per device before the head (all-reduces per forward).
    segments: usize,
    /// Per device: where its share of each split parameter lies.
    slices: Vec<HashMap<String, Slice>>,
    spread: Spread,
    batch: usize,
    widths: ModelWidths,
    target_width: usize,
    labels: Vec<String>,
    last_grad_norm: Option<f32>,
    stats: TensorParallelStats,
}

impl TensorParallel {
    /// Splits `model` over every device of `group` as it declares, each
    /// step taking `batch` examples.
    pub fn new<M: Module>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch: usize,
    ) -> Result<Self> {
        Self::with_options(group, model, criterion, optimizer, batch, PlanOptions::default())
    }

    /// [`TensorParallel::new`] with every segment planned by `options`
    /// ([`Stage::with_options`]). With f16 precision each segment stores
    /// the activations its backward reads in f16, while the all-reduced
    /// sums and gradients between segments stay f32; a loss-scaled
    /// `optimizer` seeds the head with the scale and keeps one scale on
    /// every segment. `checkpoint_activations` changes nothing here:
    /// each segment's backward already recomputes its forward from its
    /// input (the segments are cut at every all-reduce, so none holds a
    /// whole block to recompute on its own).
    pub fn with_options<M: Module>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch: usize,
        options: PlanOptions,
    ) -> Result<Self> {
        let (criterion, optimizer) = (criterion.into(), optimizer.into());
        // Every stage lays out its arenas at the group's alignment (as data
        // parallel does), so a plan made without the devices (`--dry-run`)
        // is exact on unlike adapters too.
        let options = PlanOptions {
            arena_alignment: options.arena_alignment.max(group_arena_alignment(group.members())),
            ..options
        };
        if batch == 0 {
            return Err(Error::InvalidArgument {
                op: "TensorParallel",
                reason: "the batch needs at least one example".into(),
            });
        }
        let ranks = group.len();
        let builds = (0..ranks)
            .map(|r| build_rank(model, r, ranks, batch))
            .collect::<Result<Vec<_>>>()?;
        let segments = builds[0].segments.len() - 1;
        if let Some(r) = builds.iter().position(|b| b.segments.len() != segments + 1) {
            return Err(Error::InvalidArgument {
                op: "TensorParallel",
                reason: format!(
                    "rank {r}'s forward has {} all-reduces, rank 0's {segments}",
                    builds[r].segments.len() - 1
                ),
            });
        }
        let mut stages = Vec::with_capacity(ranks * segments + 1);
        let mut slices = Vec::with_capacity(ranks);
        let mut head = None;
        for (r, (build, k)) in builds.into_iter().zip(group.members()).enumerate() {
            for (i, seg) in build.segments.into_iter().enumerate() {
                // The other devices' copies of the last segment go unused.
                if i == segments && r > 0 {
                    continue;
                }
                let end = if i == segments {
                    StageEnd::Last(criterion)
                } else {
                    StageEnd::Middle
                };
                let stage = Stage::with_options(
                    k.clone(),
                    seg.graph,
                    &[],
                    seg.input,
                    seg.output,
                    i > 0,
                    end,
                    optimizer,
                    options,
                )
                .map_err(|e| on_device(r, k, e))?;
                if i == segments {
                    head = Some(stage);
                } else {
                    stages.push(stage);
                }
            }
            slices.push(
                build
                    .slices
                    .into_iter()
                    .map(|(name, _, slice)| (name, slice))
                    .collect::<HashMap<_, _>>(),
            );
        }
        stages.extend(head);
        let mut devices: Vec<usize> = (0..ranks).flat_map(|r| std::iter::repeat_n(r, segments)).collect();
        devices.push(0);
        let stage_slices = devices.iter().map(|&r| slices[r].clone()).collect();
        let spread = Spread::new(
            model.named_parameters(),
            model.describe(),
            criterion,
            optimizer,
            &stages,
            devices,
            stage_slices,
        )?;
        let widths = ModelWidths::of(model)?;
        let target_width = widths.target_width(criterion);
        Ok(TensorParallel {
            stages,
            ranks,
            segments,
            slices,
            spread,
            batch,
            widths,
            target_width,
            labels: group.labels(),
            last_grad_norm: None,
            stats: TensorParallelStats::default(),
        })
    }

    /// Whether `model` splits over `ranks` devices, checked on the host
    /// before any device opens (each rank's graph is built and dropped).
    pub fn check<M: Module>(model: &M, ranks: usize, batch: usize) -> Result<()> {
        (0..ranks).try_for_each(|r| build_rank(model, r, ranks, batch.max(1)).map(|_| ()))
    }

    pub fn stats(&self) -> &TensorParallelStats {
        &self.stats
    }

    /// The whole model's gradient norm before the last step's clipping
    /// (torch.nn.utils.clip_grad_norm_'s return value); `None` when the
    /// optimizer does not clip or before the first step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_grad_norm
    }

    /// Every stage with its device index: each device's segments in order,
    /// device by device, then the last segment on device 0.
    pub fn stages(&self) -> impl Iterator<Item = (usize, &Stage)> {
        self.spread.devices().iter().copied().zip(&self.stages)
    }

    /// Each device's share of the split parameter `name` (`None` for a
    /// parameter that is not split).
    pub fn slices(&self, name: &str) -> Vec<Option<&Slice>> {
        self.slices.iter().map(|m| m.get(name)).collect()
    }

    fn head(&self) -> &Stage {
        &self.stages[self.stages.len() - 1]
    }

    /// The devices' outputs (`input_gradient`: input gradients) of
    /// segment `k`, summed: an all-reduce's host half.
    fn sum_segment(&self, k: usize, input_gradient: bool) -> Result<(Vec<f32>, Duration)> {
        let views: Vec<(&Kernels, View<'_>)> = (0..self.ranks)
            .map(|r| {
                let stage = &self.stages[r * self.segments + k];
                let view = if input_gradient {
                    stage.input_gradient_view()
                } else {
                    Some(stage.output_view())
                };
                let view = view.ok_or_else(|| Error::Internal {
                    op: "TensorParallel",
                    reason: format!("segment {k} yields no input gradient"),
                })?;
                Ok((&*stage.kernels, view.map_err(|e| on_device(r, &stage.kernels, e))?))
            })
            .collect::<Result<_>>()?;
        sum_on_host(&views)
    }

    /// Dropout in every segment's forward (a step's, which each backward
    /// recomputes) or in none (evaluation). Every device holds the whole
    /// batch's rows, and a row-parallel share's adapter input draws its
    /// columns' part of the whole mask, so the ranks draw one device's.
    fn set_training(&mut self, training: bool) {
        for stage in &mut self.stages {
            stage.set_dropout(training, 0);
        }
    }

    /// Runs every segment's forward and sets the head's input; returns the
    /// time spent moving activations.
    fn forward(&mut self, input: Examples<'_>) -> Result<Duration> {
        let mut communication = Duration::ZERO;
        let mut x: Option<Vec<f32>> = None;
        for k in 0..self.segments {
            for r in 0..self.ranks {
                let stage = &mut self.stages[r * self.segments + k];
                let kernels = stage.kernels.clone();
                let writes = Instant::now();
                stage.feed(input, x.as_deref()).map_err(|e| on_device(r, &kernels, e))?;
                communication += writes.elapsed();
                stage.forward().map_err(|e| on_device(r, &kernels, e))?;
            }
            let (sum, transfer) = self.sum_segment(k, false)?;
            x = Some(sum);
            communication += transfer;
        }
        let head = self.stages.len() - 1;
        let stage = &self.stages[head];
        let writes = Instant::now();
        stage
            .feed(input, x.as_deref())
            .map_err(|e| on_device(0, &stage.kernels, e))?;
        Ok(communication + writes.elapsed())
    }

    /// One optimizer step on `batch` examples; the mean loss when
    /// `read_loss`.
    pub fn step<'a>(
        &mut self,
        input: impl Into<Examples<'a>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        let input = input.into();
        check_batch(
            "TensorParallel::step",
            self.batch,
            self.widths.inputs,
            self.target_width,
            input,
            targets,
        )?;
        let wall = Instant::now();
        let seed = self.spread.seed_scale(&self.stages)?;
        self.set_training(true);
        let mut communication = self.forward(input)?;
        let head = self.stages.len() - 1;
        let k0 = self.stages[head].kernels.clone();
        self.stages[head]
            .set_targets(targets, seed)
            .map_err(|e| on_device(0, &k0, e))?;
        self.stages[head].backward(true).map_err(|e| on_device(0, &k0, e))?;
        if self.segments > 0 {
            let view = self.stages[head].input_gradient_view().ok_or_else(|| Error::Internal {
                op: "TensorParallel",
                reason: "the last segment yields no input gradient".into(),
            })?;
            let (mut grad, transfer) = sum_on_host(&[(&*k0, view.map_err(|e| on_device(0, &k0, e))?)])?;
            communication += transfer;
            for k in (0..self.segments).rev() {
                for r in 0..self.ranks {
                    let stage = &mut self.stages[r * self.segments + k];
                    let kernels = stage.kernels.clone();
                    let writes = Instant::now();
                    stage
                        .set_output_gradient(&grad)
                        .map_err(|e| on_device(r, &kernels, e))?;
                    communication += writes.elapsed();
                    stage.backward(true).map_err(|e| on_device(r, &kernels, e))?;
                }
                if k > 0 {
                    // The backward all-reduce: the devices' input gradients summed.
                    let (sum, transfer) = self.sum_segment(k, true)?;
                    grad = sum;
                    communication += transfer;
                }
            }
        }
        // Compute ends when every device is idle; what follows (the
        // replicated parameters' gradient sums, the norms) is communication.
        for (r, k) in (0..self.ranks).map(|r| (r, &self.stages[r * self.segments].kernels)) {
            k.device()
                .wait_idle("TensorParallel::step")
                .map_err(|e| on_device(r, k, e))?;
        }
        let reduce = Instant::now();
        self.last_grad_norm = self.spread.step(&mut self.stages)?;
        communication += reduce.elapsed();
        let loss = if read_loss {
            let l = self.head().loss_value().map_err(|e| on_device(0, &k0, e))?;
            if !l.is_finite() {
                return Err(Error::NonFiniteLoss {
                    value: l,
                    step: self.stats.steps + 1,
                });
            }
            Some(l)
        } else {
            None
        };
        self.stats.steps += 1;
        self.stats.communication += communication;
        self.stats.wall += wall.elapsed();
        Ok(loss)
    }

    /// The mean loss of one batch without training on it (forward only).
    pub fn evaluate_loss<'a>(&mut self, input: impl Into<Examples<'a>>, targets: Targets<'_>) -> Result<f32> {
        let input = input.into();
        check_batch(
            "TensorParallel::evaluate_loss",
            self.batch,
            self.widths.inputs,
            self.target_width,
            input,
            targets,
        )?;
        self.set_training(false);
        self.forward(input)?;
        let head = self.stages.len() - 1;
        let k0 = self.stages[head].kernels.clone();
        self.stages[head]
            .evaluate_loss(targets)
            .map_err(|e| on_device(0, &k0, e))
    }

    /// Model outputs for any number of rows of features (batch-sized
    /// chunks, the last zero-padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        self.in_chunks("TensorParallel::outputs", features, self.widths.outputs, Stage::outputs)
    }

    /// Argmax of [`TensorParallel::outputs`], computed on device 0, which
    /// reads back one index per row instead of the outputs.
    pub fn predict<'a>(&mut self, x: impl Into<Examples<'a>>) -> Result<Vec<u32>> {
        self.in_chunks(
            "TensorParallel::predict",
            features(x.into(), "TensorParallel::predict")?,
            1,
            Stage::predictions,
        )
    }

    /// `read` of the head for each batch-sized chunk of `features` fed
    /// through the segments.
    fn in_chunks<T: Copy>(
        &mut self,
        op: &'static str,
        features: &[f32],
        width: usize,
        read: impl Fn(&mut Stage) -> Result<Vec<T>>,
    ) -> Result<Vec<T>> {
        let (f, batch) = (self.widths.inputs, self.batch);
        self.set_training(false);
        super::outputs_in_chunks(op, features, f, batch, width, |chunk| {
            self.forward(Examples::Features(chunk))?;
            let head = self.stages.len() - 1;
            let k0 = self.stages[head].kernels.clone();
            read(&mut self.stages[head]).map_err(|e| on_device(0, &k0, e))
        })
    }

    /// Values moved between the host and the devices in one step: each
    /// segment's output read from every device and the sum written to the
    /// next segment on every device (the last one's to the head); backward,
    /// the head's input gradient read and written to every device, and each
    /// other boundary's input gradients read and their sum written; plus
    /// the replicated parameters' gradients read from and written back to
    /// every copy.
    pub fn floats_moved_per_step(&self) -> usize {
        let outputs: Vec<usize> = (0..self.segments)
            .map(|k| self.stages[k].output_view().map_or(0, |v| v.len))
            .collect();
        let (all, last) = (outputs.iter().sum::<usize>(), outputs.last().copied().unwrap_or(0));
        let activations = 4 * self.ranks * all + 2 * last - 2 * self.ranks * last;
        let sizes: HashMap<String, usize> = self
            .stages
            .iter()
            .flat_map(|s| s.executor().parameters_shapes())
            .map(|(n, s)| (n, s.iter().product()))
            .collect();
        let replicated: usize = self
            .spread
            .shared()
            .iter()
            .map(|s| 2 * s.holders.len() * sizes.get(&s.name).copied().unwrap_or(0))
            .sum();
        activations + replicated
    }
}

/// Rank `rank`'s graphs of `model` for `batch` examples.
pub(super) fn build_rank<M: Module>(model: &M, rank: usize, ranks: usize, batch: usize) -> Result<shard::RankBuild> {
    let mut g = Graph::new();
    let input = model.input(&mut g, batch)?;
    shard::build_rank(rank, ranks, g, input, |g, x| model.forward(g, x, ""))
}

impl TrainEngine for TensorParallel {
    own_steps!(TensorParallel);
    fn holding(&self) -> Holding<'_> {
        Holding::Stages(&self.spread, &self.stages)
    }
    /// Each split parameter's state split as it is ([`Spread::load_state`]).
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        self.spread.load_state(&mut self.stages, params, state, step)
    }
    fn read_loss_scale(&self) -> Result<Option<LossScaleState>> {
        self.spread.read_loss_scale(&self.stages)
    }
    fn load_loss_scale(&mut self, state: &LossScaleState) -> Result<()> {
        self.spread.load_loss_scale(&mut self.stages, state)
    }
    /// One line: how the model is split.
    fn describe(&self) -> String {
        let split = self.slices.first().map_or(0, HashMap::len);
        format!(
            "tensor parallel over {} devices ({}): {} all-reduces per forward, {split} parameters split per device, {} replicated; the last segment and the loss on #0",
            self.ranks,
            self.labels.join(", "),
            self.segments,
            self.spread.shared().len()
        )
    }
    /// [`TensorParallel::describe`] with what the steps so far cost.
    fn report(&self) -> String {
        let s = &self.stats;
        let ms = 1e3 * s.wall.as_secs_f64() / s.steps.max(1) as f64;
        let share = 100.0 * s.communication.as_secs_f64() / s.wall.as_secs_f64().max(1e-9);
        let mb = self.floats_moved_per_step() as f64 * 4.0 / 1e6;
        format!("{}; {} steps, {ms:.1} ms/step, communication {share:.0}% of step time ({mb:.1} MB through the host per step)", self.describe(), s.steps)
    }
}
