//! Pipeline parallel training of any [`Staged`] model: its prologue,
//! blocks and epilogue cut into contiguous stages, one per device
//! ([`partition`] evens out their work), the global batch cut into
//! micro-batches that flow through the stages so devices overlap.
//! A parameter two stages declare (a head tied to the token embedding on
//! the first and last stage) is found, and after each step's backward
//! passes [`Spread::step`] gives every copy the sum of their gradients
//! (Megatron's embedding all-reduce) and every stage steps, clipping by
//! the whole model's gradient norm, so training equals single-device
//! training.
//!
//! Two schedules run the micro-batches:
//! - [`Schedule::GPipe`]: every forward, then every backward;
//! - [`Schedule::OneFOneB`]: after S−1−s warm-up forwards, stage s
//!   alternates one forward and one backward, so it holds the inputs of at
//!   most S−s micro-batches instead of all M.
//!
//! Each stage keeps a host copy of its input per micro-batch until that
//! micro-batch's backward, which recomputes the stage's forward (GPipe's
//! re-materialisation), and each stage's graph is sized for one
//! micro-batch: device memory is the same under both schedules, and what
//! 1F1B bounds is the host stash ([`PipelineStats::peak_in_flight`]).
//! The last stage's forward runs inside its backward.
//!
//! Work goes in ticks: each stage with its next micro-batch ready submits
//! it, then the results of every stage in the tick are copied to the host
//! together and passed on.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::data::{group_arena_alignment, shard};
use super::engine::{features, own_steps, Holding, Strategy, TrainEngine};
use super::stage::{check_batch, Spread, Stage, StageEnd};
use super::{on_device, DeviceGroup};
use super::{Examples, ModelWidths, Targets};
use crate::error::{Error, Result};
use crate::graph::{Block, Graph, PlanOptions, Tensor};
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, StageCosts, Staged};
use crate::optim::LossScaleState;

/// The order micro-batches go through the stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards (Huang et al., 2019).
    GPipe,
    /// One forward, one backward (PipeDream-Flush, Megatron's default).
    OneFOneB,
}

impl Schedule {
    /// `gpipe` or `1f1b` (any case).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" | "onefoneb" => Ok(Schedule::OneFOneB),
            other => Err(Error::InvalidArgument {
                op: "pipeline schedule",
                reason: format!("unknown schedule `{other}`: use gpipe or 1f1b"),
            }),
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "GPipe",
            Schedule::OneFOneB => "1F1B",
        })
    }
}

/// One stage's work on one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    Forward(usize),
    /// Forward (recomputed) and backward; the last stage's starts from its
    /// loss.
    Backward(usize),
    /// Evaluation, last stage: forward to the loss.
    Loss(usize),
}

impl Work {
    fn micro(self) -> usize {
        match self {
            Work::Forward(m) | Work::Backward(m) | Work::Loss(m) => m,
        }
    }
}

/// Each stage's training work in order under `schedule`.
fn training_work(schedule: Schedule, stages: usize, micro: usize) -> Vec<Vec<Work>> {
    (0..stages)
        .map(|s| {
            if s + 1 == stages {
                return (0..micro).map(Work::Backward).collect();
            }
            match schedule {
                Schedule::GPipe => (0..micro)
                    .map(Work::Forward)
                    .chain((0..micro).map(Work::Backward))
                    .collect(),
                Schedule::OneFOneB => {
                    let warmup = (stages - 1 - s).min(micro);
                    let mut work: Vec<Work> = (0..warmup).map(Work::Forward).collect();
                    for m in warmup..micro {
                        work.push(Work::Forward(m));
                        work.push(Work::Backward(m - warmup));
                    }
                    work.extend((micro - warmup..micro).map(Work::Backward));
                    work
                }
            }
        })
        .collect()
}

/// Time and memory accounting over the steps taken.
#[derive(Clone, Debug, Default)]
pub struct PipelineStats {
    pub steps: u64,
    /// Whole steps, the optimizer's included.
    pub wall: Duration,
    /// Per stage: time from each tick's start until its results arrived.
    pub busy: Vec<Duration>,
    /// Host transfers between stages: writing each tick's inputs, reading
    /// results after the slowest stage finished, and the tied embedding's
    /// gradients' sum (with clipping, the norms' waits too).
    pub communication: Duration,
    /// Per stage: the most micro-batches forwarded and not yet backwarded
    /// at once, between ticks: the stash 1F1B bounds by S − s and GPipe
    /// fills with all M. The last stage, whose forward runs inside its
    /// backward, counts the inputs it received; the first re-reads its
    /// input from the caller's batch, so its stash costs no copy.
    pub peak_in_flight: Vec<usize>,
    /// Per stage: the most host bytes held at once for later ticks: the
    /// inputs of those micro-batches, inputs received ahead of their
    /// forward, and output gradients waiting for the backward.
    pub peak_stash_bytes: Vec<u64>,
    /// The whole model's gradient norm before clipping, of the last step
    /// (`None` when the optimizer does not clip).
    pub last_grad_norm: Option<f32>,
}

/// Blocks per stage that even out the stages' work (the largest stage's
/// cost is the smallest possible): the prologue counts on the first stage
/// and the epilogue on the last, so a language model with a large
/// vocabulary gets fewer blocks on its last stage (12 blocks of 768
/// channels and a 50257-token head on two stages: 8 and 4). Every
/// middle stage gets at least one block; the first may hold only the
/// prologue and the last only the epilogue when they do work.
pub fn partition(costs: &StageCosts, stages: usize) -> Result<Vec<usize>> {
    let blocks = costs.blocks.len();
    let (prologue, epilogue) = (costs.prologue > 0.0, costs.epilogue > 0.0);
    let mut units: Vec<f64> = Vec::with_capacity(blocks + 2);
    units.extend(prologue.then_some(costs.prologue));
    units.extend(&costs.blocks);
    units.extend(epilogue.then_some(costs.epilogue));
    let n = units.len();
    if stages == 0 || stages > n {
        return Err(Error::InvalidArgument {
            op: "pipeline partition",
            reason: format!("{stages} stages cannot be filled by {blocks} blocks plus the prologue and the epilogue: every stage needs a block, or a prologue or epilogue that does work (at most {n} stages)"),
        });
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, w) in units.iter().enumerate() {
        prefix[i + 1] = prefix[i] + w;
    }
    // best[k][j]: the smallest largest stage cost with the first j units
    // in k stages; cut[k][j]: where the last of those stages starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for j in k..=n {
            for i in k - 1..j {
                let cost = best[k - 1][i].max(prefix[j] - prefix[i]);
                if cost < best[k][j] {
                    best[k][j] = cost;
                    cut[k][j] = i;
                }
            }
        }
    }
    let mut sizes = vec![0usize; stages];
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        sizes[k - 1] = end - start;
        end = start;
    }
    // Units to blocks.
    sizes[0] -= usize::from(prologue);
    sizes[stages - 1] -= usize::from(epilogue);
    Ok(sizes)
}

/// Blocks `start..start + count` as `blocks 2-3`, `block 1`, or nothing.
fn block_range(start: usize, count: usize) -> Option<String> {
    match count {
        0 => None,
        1 => Some(format!("block {start}")),
        _ => Some(format!("blocks {start}-{}", start + count - 1)),
    }
}

/// A [`Staged`] model over the devices of a group, one stage each.
pub struct Pipeline {
    stages: Vec<Stage>,
    spread: Spread,
    schedule: Schedule,
    micro_batches: usize,
    micro_rows: usize,
    global_batch: usize,
    blocks: Vec<usize>,
    costs: StageCosts,
    widths: ModelWidths,
    /// Target values per example: the outputs (MSE) or output rows (classes).
    target_width: usize,
    work: Vec<Vec<Work>>,
    /// Host copies of each stage's input per micro-batch, held until its
    /// backward.
    activations: Vec<Vec<Option<Vec<f32>>>>,
    /// Gradient of each stage's output per micro-batch.
    gradients: Vec<Vec<Option<Vec<f32>>>>,
    /// The loss scale this step's last-stage backward is seeded with (1
    /// without loss scaling).
    seed_scale: f32,
    stats: PipelineStats,
}

/// The graph of `model`'s units `blocks`, after the prologue when `first`
/// and before the epilogue when `last`, on `rows` rows: (graph, input,
/// output). `stream` holds the shape the units before passed on, and
/// takes these units'.
pub(super) fn unit_graph<M: Staged + ?Sized>(
    model: &M,
    first: bool,
    last: bool,
    blocks: std::ops::Range<usize>,
    rows: usize,
    stream: &mut Vec<usize>,
) -> Result<(Graph, Tensor, Tensor)> {
    unit_graph_blocks(model, first, last, blocks, rows, stream).map(|(g, input, output, _)| (g, input, output))
}

/// [`unit_graph`] with the nodes each block added, which activation
/// checkpointing recomputes in the backward.
pub(super) fn unit_graph_blocks<M: Staged + ?Sized>(
    model: &M,
    first: bool,
    last: bool,
    blocks: std::ops::Range<usize>,
    rows: usize,
    stream: &mut Vec<usize>,
) -> Result<(Graph, Tensor, Tensor, Vec<Block>)> {
    let mut g = Graph::new();
    let input = if first {
        model.input(&mut g, rows)?
    } else {
        g.input("stage_input", stream)?
    };
    let (output, units) = model.forward_blocks(&mut g, input, blocks, first, last)?;
    *stream = g.shape_of(output).map(<[usize]>::to_vec).unwrap_or_default();
    Ok((g, input, output, units))
}

impl Pipeline {
    /// `model` over the devices of `group` (one stage each, blocks placed
    /// by [`partition`]), trained on `global_batch` examples per step cut
    /// into `micro_batches`.
    pub fn new<M: Staged>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        micro_batches: usize,
        schedule: Schedule,
    ) -> Result<Self> {
        Self::with_blocks(
            group,
            model,
            criterion,
            optimizer,
            global_batch,
            micro_batches,
            schedule,
            None,
        )
    }

    /// [`Pipeline::new`] with `blocks_per_stage` overriding the balanced
    /// split: one count per device, summing to the model's blocks, at least
    /// one on every middle stage (and on the first or last whose prologue
    /// or epilogue does no work).
    #[allow(clippy::too_many_arguments)]
    pub fn with_blocks<M: Staged>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        micro_batches: usize,
        schedule: Schedule,
        blocks_per_stage: Option<Vec<usize>>,
    ) -> Result<Self> {
        Self::with_options(
            group,
            model,
            criterion,
            optimizer,
            global_batch,
            micro_batches,
            schedule,
            blocks_per_stage,
            PlanOptions::default(),
        )
    }

    /// [`Pipeline::with_blocks`] with every stage planned by `options`
    /// ([`Stage::with_options`]): with `checkpoint_activations` each
    /// stage recomputes its blocks one by one in its backward, holding
    /// their boundaries instead of every block's activations; with f16
    /// precision each stage stores those activations in f16 while what
    /// passes between stages stays f32. A loss-scaled `optimizer` seeds
    /// the last stage with the scale and keeps one scale on all stages
    /// ([`reduce_and_step`](super::stage::reduce_and_step)).
    #[allow(clippy::too_many_arguments)]
    pub fn with_options<M: Staged>(
        group: &DeviceGroup,
        model: &M,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        micro_batches: usize,
        schedule: Schedule,
        blocks_per_stage: Option<Vec<usize>>,
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
        let s_count = group.len();
        let costs = model.stage_costs();
        let layers = costs.blocks.len();
        Strategy::Pipeline.check_counts(s_count, global_batch, None, micro_batches)?;
        let blocks = match blocks_per_stage {
            None => partition(&costs, s_count)?,
            Some(counts) => {
                let last = counts.len().saturating_sub(1);
                let empty = counts.iter().enumerate().any(|(i, &c)| {
                    c == 0 && !((i == 0 && costs.prologue > 0.0) || (i == last && costs.epilogue > 0.0))
                });
                if counts.len() != s_count || counts.iter().sum::<usize>() != layers || empty {
                    return Err(Error::InvalidArgument {
                        op: "Pipeline",
                        reason: format!("blocks per stage {counts:?} must give each of {s_count} stages a count, at least one on every middle stage, summing to the model's {layers} blocks"),
                    });
                }
                counts
            }
        };
        let micro_rows = global_batch / micro_batches;
        let widths = ModelWidths::of(model)?;
        let last = s_count - 1;
        let mut stages = Vec::with_capacity(s_count);
        let (mut start, mut stream) = (0, Vec::new());
        for (i, (&count, k)) in blocks.iter().zip(group.members()).enumerate() {
            let mut build = || -> Result<Stage> {
                let (g, input, output, units) =
                    unit_graph_blocks(model, i == 0, i == last, start..start + count, micro_rows, &mut stream)?;
                let end = if i == last {
                    StageEnd::Last(criterion)
                } else {
                    StageEnd::Middle
                };
                Stage::with_options(k.clone(), g, &units, input, output, i > 0, end, optimizer, options)
            };
            stages.push(build().map_err(|e| on_device(i, k, e))?);
            start += count;
        }
        let spread = Spread::new(
            model.named_parameters(),
            model.describe(),
            criterion,
            optimizer,
            &stages,
            (0..s_count).collect(),
            vec![HashMap::new(); s_count],
        )?;
        let target_width = widths.target_width(criterion);
        let mut pipeline = Pipeline {
            stages,
            spread,
            schedule,
            micro_batches,
            micro_rows,
            global_batch,
            blocks,
            costs,
            widths,
            target_width,
            work: training_work(schedule, s_count, micro_batches),
            activations: vec![vec![None; micro_batches]; s_count],
            gradients: vec![vec![None; micro_batches]; s_count],
            seed_scale: 1.0,
            stats: PipelineStats::default(),
        };
        pipeline.reset_stats();
        Ok(pipeline)
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Blocks on each stage.
    pub fn blocks_per_stage(&self) -> &[usize] {
        &self.blocks
    }

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// Starts the stats afresh (after warm-up steps, which compile).
    pub fn reset_stats(&mut self) {
        let s_count = self.stages.len();
        self.stats = PipelineStats {
            busy: vec![Duration::ZERO; s_count],
            peak_in_flight: vec![0; s_count],
            peak_stash_bytes: vec![0; s_count],
            ..PipelineStats::default()
        };
    }

    /// Bytes of activations each stage holds from its forward to its
    /// backward ([`crate::graph::Plan::held_activation_bytes`]), which
    /// activation checkpointing and f16 storage lower.
    pub fn held_activation_bytes(&self) -> Vec<u64> {
        self.stages
            .iter()
            .map(|s| s.executor().plan().held_activation_bytes)
            .collect()
    }

    /// Device memory each stage's executor holds ([`crate::graph::Executor::peak_bytes`]).
    pub fn stage_gpu_bytes(&self) -> Vec<u64> {
        self.stages.iter().map(|s| s.executor().peak_bytes()).collect()
    }

    /// The idle share of an ideal pipeline, (S−1)/(M+S−1), for both
    /// schedules.
    pub fn ideal_bubble_fraction(&self) -> f64 {
        let s = self.stages.len() as f64;
        (s - 1.0) / (self.micro_batches as f64 + s - 1.0)
    }

    /// The measured idle share: 1 − busy time / (stages × step time).
    pub fn measured_bubble_fraction(&self) -> f64 {
        let wall = self.stats.wall.as_secs_f64() * self.stats.busy.len() as f64;
        if wall <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.stats.busy.iter().map(Duration::as_secs_f64).sum();
        (1.0 - busy / wall).clamp(0.0, 1.0)
    }

    /// The share of step time spent moving data between devices.
    pub fn communication_share(&self) -> f64 {
        let wall = self.stats.wall.as_secs_f64();
        if wall <= 0.0 {
            return 0.0;
        }
        (self.stats.communication.as_secs_f64() / wall).clamp(0.0, 1.0)
    }

    /// One line of what the steps so far measured.
    pub fn report(&self) -> String {
        let steps = self.stats.steps.max(1) as f64;
        let kib = |bytes: &[u64]| {
            bytes
                .iter()
                .map(|b| format!("{:.0}", *b as f64 / 1024.0))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "{} steps, {:.1} ms/step, bubble {:.2} (ideal {:.2}), communication {:.0}% of step time, peak stash per stage {:?} micro-batches ([{}] KiB host), activations held per stage [{}] KiB",
            self.stats.steps,
            self.stats.wall.as_secs_f64() * 1e3 / steps,
            self.measured_bubble_fraction(),
            self.ideal_bubble_fraction(),
            100.0 * self.communication_share(),
            self.stats.peak_in_flight,
            kib(&self.stats.peak_stash_bytes),
            kib(&self.held_activation_bytes())
        )
    }

    /// Micro-batch `m` of the model input.
    fn micro_input<'a>(&self, input: Examples<'a>, m: usize) -> Examples<'a> {
        let n = self.micro_rows * self.widths.inputs;
        input.slice(m * n, (m + 1) * n)
    }

    /// One optimizer step on `input` and `targets` (`global_batch`
    /// examples each). Returns the mean loss over the whole batch when
    /// `read_loss`.
    pub fn step<'a>(
        &mut self,
        input: impl Into<Examples<'a>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        let input = input.into();
        check_batch(
            "Pipeline::step",
            self.global_batch,
            self.widths.inputs,
            self.target_width,
            input,
            targets,
        )?;
        let wall = Instant::now();
        self.seed_scale = self.spread.seed_scale(&self.stages)?;
        let work = std::mem::take(&mut self.work);
        let loss = self.run(&work, input, targets, true, read_loss);
        self.work = work;
        let loss = loss?;
        let reduced = Instant::now();
        self.stats.last_grad_norm = self.spread.step(&mut self.stages)?;
        if !self.spread.shared().is_empty() {
            // Reading and writing the shared gradients; with clipping, the
            // norms too (compute, but a wait on every device).
            self.stats.communication += reduced.elapsed();
        }
        self.stats.steps += 1;
        self.stats.wall += wall.elapsed();
        if read_loss && !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                value: loss as f32,
                step: self.step_count(),
            });
        }
        Ok(read_loss.then_some(loss as f32))
    }

    /// The mean loss over `input` and `targets` (`global_batch` examples),
    /// forward only, the micro-batches pipelined through the stages; no
    /// gradient, no update.
    pub fn evaluate_loss<'a>(&mut self, input: impl Into<Examples<'a>>, targets: Targets<'_>) -> Result<f32> {
        let input = input.into();
        check_batch(
            "Pipeline::evaluate_loss",
            self.global_batch,
            self.widths.inputs,
            self.target_width,
            input,
            targets,
        )?;
        let s_count = self.stages.len();
        let work: Vec<Vec<Work>> = (0..s_count)
            .map(|s| {
                if s + 1 == s_count {
                    (0..self.micro_batches).map(Work::Loss).collect()
                } else {
                    (0..self.micro_batches).map(Work::Forward).collect()
                }
            })
            .collect();
        let loss = self.run(&work, input, targets, false, true)? as f32;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                value: loss,
                step: self.step_count(),
            });
        }
        Ok(loss)
    }

    /// Runs `work` tick by tick; returns the weighted sum of the
    /// micro-batches' losses (the global mean) when read.
    fn run(
        &mut self,
        work: &[Vec<Work>],
        input: Examples<'_>,
        targets: Targets<'_>,
        training: bool,
        read_loss: bool,
    ) -> Result<f64> {
        let (s_count, m_count) = (self.stages.len(), self.micro_batches);
        let mut next = vec![0usize; s_count];
        let mut forwarded = vec![vec![false; m_count]; s_count];
        let mut backwarded = vec![vec![false; m_count]; s_count];
        let weight = self.micro_rows as f64 / self.global_batch as f64;
        let mut loss = 0.0f64;
        for stash in self.activations.iter_mut().chain(self.gradients.iter_mut()) {
            stash.iter_mut().for_each(|v| *v = None);
        }
        loop {
            let ready = |s: usize, w: Work| match w {
                Work::Forward(m) | Work::Loss(m) => s == 0 || forwarded[s - 1][m],
                Work::Backward(m) if s + 1 == s_count => {
                    // GPipe flushes: backward starts once every forward ran.
                    s == 0
                        || (forwarded[s - 1][m]
                            && (self.schedule == Schedule::OneFOneB || forwarded[s - 1][m_count - 1]))
                }
                Work::Backward(m) => backwarded[s + 1][m],
            };
            let active: Vec<(usize, Work)> = (0..s_count)
                .filter_map(|s| work[s].get(next[s]).copied().filter(|&w| ready(s, w)).map(|w| (s, w)))
                .collect();
            if active.is_empty() {
                if (0..s_count).all(|s| next[s] == work[s].len()) {
                    return Ok(loss);
                }
                return Err(Error::Internal {
                    op: "Pipeline",
                    reason: format!("the {} schedule stalled with work left at {next:?}", self.schedule),
                });
            }
            let results = self.tick(&active, input, targets, training)?;
            for (&(s, w), value) in active.iter().zip(results) {
                let m = w.micro();
                match (w, value) {
                    (Work::Forward(_), Some(v)) => self.activations[s + 1][m] = Some(v),
                    (Work::Backward(_), Some(v)) => self.gradients[s - 1][m] = Some(v),
                    (Work::Loss(_), Some(v)) => loss += weight * f64::from(v.first().copied().unwrap_or(f32::NAN)),
                    _ => {}
                }
                match w {
                    Work::Forward(_) => forwarded[s][m] = true,
                    Work::Backward(_) => backwarded[s][m] = true,
                    Work::Loss(_) => {}
                }
                next[s] += 1;
                if training && read_loss && s + 1 == s_count && matches!(w, Work::Backward(_)) {
                    let stage = &self.stages[s];
                    loss += weight * f64::from(stage.loss_value().map_err(|e| on_device(s, &stage.kernels, e))?);
                }
            }
            if training {
                for s in 0..s_count {
                    let in_flight = if s + 1 < s_count {
                        (0..m_count).filter(|&m| forwarded[s][m] && !backwarded[s][m]).count()
                    } else {
                        // The last stage's forward runs inside its backward:
                        // what it holds is the inputs received.
                        self.activations[s].iter().flatten().count()
                    };
                    let bytes: usize = self.activations[s]
                        .iter()
                        .chain(&self.gradients[s])
                        .flatten()
                        .map(|v| 4 * v.len())
                        .sum();
                    self.stats.peak_in_flight[s] = self.stats.peak_in_flight[s].max(in_flight);
                    self.stats.peak_stash_bytes[s] = self.stats.peak_stash_bytes[s].max(bytes as u64);
                }
            }
        }
    }

    /// Submits `active`'s work on every stage, then copies the stages'
    /// results (outputs, input gradients, evaluation losses) to the host
    /// together. One result per active stage, `None` where there is none.
    fn tick(
        &mut self,
        active: &[(usize, Work)],
        input: Examples<'_>,
        targets: Targets<'_>,
        training: bool,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let start = Instant::now();
        let last = self.stages.len() - 1;
        let scale = self.seed_scale * (self.micro_rows as f32 / self.global_batch as f32);
        let mut writing = Duration::ZERO;
        // A GL device runs its work inside the submit, on this thread: the
        // others submit first, so their work overlaps it.
        let mut order: Vec<usize> = (0..active.len()).collect();
        order.sort_by_key(|&k| self.stages[active[k].0].kernels.device().is_gl());
        for (s, w) in order.into_iter().map(|k| active[k]) {
            let m = w.micro();
            let micro_input = self.micro_input(input, m);
            let activations = if s == 0 {
                None
            } else {
                Some(stashed(&self.activations[s][m], "input", s, m)?)
            };
            let gradient = match w {
                Work::Backward(_) if s < last => Some(stashed(&self.gradients[s][m], "output gradient", s, m)?),
                _ => None,
            };
            let stage = &mut self.stages[s];
            let wrote = Instant::now();
            write_inputs(
                stage,
                w,
                micro_input,
                activations,
                gradient,
                shard(targets, m * self.micro_rows, self.micro_rows, self.target_width),
                scale,
            )
            .map_err(|e| on_device(s, &stage.kernels, e))?;
            writing += wrote.elapsed();
            // Evaluation's forwards draw no dropout; a step's draw their
            // micro-batch's masks.
            stage.set_dropout(training, m * self.micro_rows);
            launch(stage, w).map_err(|e| on_device(s, &stage.kernels, e))?;
            if matches!(w, Work::Backward(_) | Work::Loss(_)) {
                // Written to the device: the stash is free.
                self.activations[s][m] = None;
                self.gradients[s][m] = None;
            }
        }
        let mut views: Vec<(&Kernels, View<'_>)> = Vec::new();
        let mut owners = Vec::new();
        for (k, &(s, w)) in active.iter().enumerate() {
            let stage = &self.stages[s];
            let view = match w {
                Work::Forward(_) => Some(stage.output_view()),
                Work::Backward(_) if s > 0 => stage.input_gradient_view(),
                Work::Loss(_) => stage.loss_view(),
                Work::Backward(_) => None,
            };
            if let Some(v) = view {
                views.push((&*stage.kernels, v.map_err(|e| on_device(s, &stage.kernels, e))?));
                owners.push(k);
            }
        }
        let (values, arrived) = if views.is_empty() {
            // Nothing to move (the first stage's backward): wait for it.
            for &(s, _) in active {
                let k = &self.stages[s].kernels;
                k.device().wait_idle("Pipeline").map_err(|e| on_device(s, k, e))?;
            }
            (Vec::new(), Vec::new())
        } else {
            let stage_of: Vec<usize> = owners.iter().map(|&k| active[k].0).collect();
            to_host(&views, start).map_err(|e| name_stage(e, &views, &stage_of))?
        };
        if training {
            let elapsed = start.elapsed();
            for (k, &(s, _)) in active.iter().enumerate() {
                self.stats.busy[s] += owners.iter().position(|&o| o == k).map_or(elapsed, |i| arrived[i]);
            }
            self.stats.communication += writing
                + arrived
                    .iter()
                    .max()
                    .map_or(Duration::ZERO, |slowest| elapsed.saturating_sub(*slowest));
        }
        let mut results: Vec<Option<Vec<f32>>> = vec![None; active.len()];
        for (k, v) in owners.into_iter().zip(values) {
            results[k] = Some(v);
        }
        Ok(results)
    }

    /// Model outputs for any number of rows of features, micro-batch by
    /// micro-batch through the stages (the last chunk zero-padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        self.in_chunks("Pipeline::outputs", features, self.widths.outputs, Stage::outputs)
    }

    /// Argmax of [`Pipeline::outputs`], computed by the last stage's device,
    /// which reads back one index per row instead of the outputs.
    pub fn predict<'a>(&mut self, x: impl Into<Examples<'a>>) -> Result<Vec<u32>> {
        self.in_chunks(
            "Pipeline::predict",
            features(x.into(), "Pipeline::predict")?,
            1,
            Stage::predictions,
        )
    }

    /// `read` of the last stage for each micro-batch-sized chunk of
    /// `features` fed through the others.
    fn in_chunks<T: Copy>(
        &mut self,
        op: &'static str,
        features: &[f32],
        width: usize,
        read: impl Fn(&mut Stage) -> Result<Vec<T>>,
    ) -> Result<Vec<T>> {
        let stages = &mut self.stages;
        super::outputs_in_chunks(op, features, self.widths.inputs, self.micro_rows, width, |chunk| {
            let last = feed_last_stage(stages, chunk)?;
            let k = stages[last].kernels.clone();
            read(&mut stages[last]).map_err(|e| on_device(last, &k, e))
        })
    }
}

/// Feeds one chunk of features forward through every stage but the last
/// and sets the last one's input; returns the last stage's index.
fn feed_last_stage(stages: &mut [Stage], chunk: &[f32]) -> Result<usize> {
    let Some(last) = stages.len().checked_sub(1) else {
        return Err(Error::InvalidArgument {
            op: "Pipeline",
            reason: "no stages".into(),
        });
    };
    let mut h: Option<Vec<f32>> = None;
    for stage in stages.iter_mut() {
        stage.set_dropout(false, 0);
    }
    for (s, stage) in stages[..last].iter_mut().enumerate() {
        let k = stage.kernels.clone();
        stage
            .feed(Examples::Features(chunk), h.as_deref())
            .map_err(|e| on_device(s, &k, e))?;
        stage.forward().map_err(|e| on_device(s, &k, e))?;
        h = Some(k.read(stage.output_view()?).map_err(|e| on_device(s, &k, e))?);
    }
    let stage = &stages[last];
    stage
        .feed(Examples::Features(chunk), h.as_deref())
        .map_err(|e| on_device(last, &stage.kernels, e))?;
    Ok(last)
}

fn stashed<'a>(slot: &'a Option<Vec<f32>>, what: &str, s: usize, m: usize) -> Result<&'a [f32]> {
    slot.as_deref().ok_or_else(|| Error::Internal {
        op: "Pipeline",
        reason: format!("stage {s} has no {what} for micro-batch {m}: the schedule ran out of order"),
    })
}

/// Writes what a stage reads for `work`: its input, and the gradient of
/// its output or its targets.
fn write_inputs(
    stage: &mut Stage,
    work: Work,
    input: Examples<'_>,
    activations: Option<&[f32]>,
    gradient: Option<&[f32]>,
    targets: Targets<'_>,
    scale: f32,
) -> Result<()> {
    stage.feed(input, activations)?;
    match (work, gradient) {
        (Work::Forward(_), _) => Ok(()),
        (Work::Backward(_), Some(g)) => stage.set_output_gradient(g),
        // The last stage: backward or evaluation from its loss.
        (Work::Backward(_) | Work::Loss(_), _) => stage.set_targets(targets, scale),
    }
}

/// Submits `work` on a stage whose inputs are written (no wait).
fn launch(stage: &mut Stage, work: Work) -> Result<()> {
    match work {
        Work::Forward(_) => stage.forward(),
        Work::Backward(m) => stage.backward(m == 0),
        Work::Loss(_) => stage.forward_loss(),
    }
}

/// [`to_host`] names a failing device by its place among the parts; name
/// it by its stage's device instead.
fn name_stage(error: Error, parts: &[(&Kernels, View<'_>)], stage_of: &[usize]) -> Error {
    match error {
        Error::OnDevice { device, source } => {
            let renamed = parts.iter().zip(stage_of).enumerate().find_map(|(i, ((k, _), &s))| {
                let label = k.device().label();
                (device == format!("#{i} {label}")).then(|| format!("#{s} {label}"))
            });
            Error::OnDevice {
                device: renamed.unwrap_or(device),
                source,
            }
        }
        other => other,
    }
}

impl TrainEngine for Pipeline {
    own_steps!(Pipeline);
    fn holding(&self) -> Holding<'_> {
        Holding::Stages(&self.spread, &self.stages)
    }
    /// A shared parameter on every stage holding it ([`Spread::load_state`]).
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
    /// One line: schedule, micro-batches, what each stage holds on which
    /// device, and the parameters stages share.
    fn describe(&self) -> String {
        let last = self.stages.len() - 1;
        let mut start = 0;
        let mut parts = Vec::with_capacity(self.stages.len());
        for (i, (stage, &count)) in self.stages.iter().zip(&self.blocks).enumerate() {
            let mut holds = Vec::new();
            if i == 0 && self.costs.prologue > 0.0 {
                holds.push("prologue".to_string());
            }
            holds.extend(block_range(start, count));
            if i == last {
                holds.push(if self.costs.epilogue > 0.0 {
                    "epilogue, loss".into()
                } else {
                    "loss".into()
                });
            }
            parts.push(format!(
                "stage {i} on #{i} {}: {}",
                stage.kernels.device().label(),
                holds.join(", ")
            ));
            start += count;
        }
        let shared: Vec<&str> = self.spread.shared().iter().map(|s| s.name.as_str()).collect();
        let shared = if shared.is_empty() {
            String::new()
        } else {
            format!("; shared between stages: {}", shared.join(", "))
        };
        format!(
            "pipeline ({}) over {} stage(s), {} micro-batches of {} examples: {}{shared}",
            self.schedule,
            self.stages.len(),
            self.micro_batches,
            self.micro_rows,
            parts.join("; ")
        )
    }
    fn report(&self) -> String {
        format!("{}; {}", self.describe(), Pipeline::report(self))
    }
}
