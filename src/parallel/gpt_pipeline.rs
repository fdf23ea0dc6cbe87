//! A GPT trained pipeline parallel: whole blocks per stage, one stage per
//! device; the token and position embeddings on the first stage, the final
//! norm, the head and the loss on the last. The head is tied to the token
//! embedding, so `wte.weight` lives on both the first and the last stage;
//! after each step's backward passes, [`reduce_and_step`] gives both copies
//! the sum of their gradients (Megatron's embedding all-reduce) and every
//! stage steps, clipping by the whole model's gradient norm, so the copies
//! stay equal and training equals single-device training.
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
//! 1F1B bounds is the host stash ([`GptPipelineStats::peak_in_flight`]).
//! The last stage's forward runs inside its backward.
//!
//! Work goes in ticks: each stage with its next micro-batch ready submits
//! it, then the results of every stage in the tick are copied to the host
//! together and passed on.

use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::stage::{reduce_and_step, SharedParameter, Stage, StageEnd};
use super::{on_device, DeviceGroup};
use crate::checkpoint::{Checkpoint, NamedTensor};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::kernels::{Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, Gpt, GptConfig, Module};
use crate::optim;
use crate::trainer::Targets;

/// The tied token embedding, held by the first and the last stage.
const TIED: &str = "wte.weight";

/// Parameters as (name, shape, values), as [`crate::graph::Executor::parameters`].
type NamedParameters = Vec<(String, Vec<usize>, Vec<f32>)>;

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
            other => Err(Error::InvalidArgument { op: "pipeline schedule", reason: format!("unknown schedule `{other}`: use gpipe or 1f1b") }),
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
                Schedule::GPipe => (0..micro).map(Work::Forward).chain((0..micro).map(Work::Backward)).collect(),
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
pub struct GptPipelineStats {
    pub steps: u64,
    /// Whole steps, the optimizer's included.
    pub wall: Duration,
    /// Per stage: time from each tick's start until its results arrived.
    pub busy: Vec<Duration>,
    /// Host transfers between stages: writing each tick's inputs, reading
    /// results after the slowest stage finished, and the tied embedding's
    /// gradient sum (with clipping, the norms' waits too).
    pub communication: Duration,
    /// Per stage: the most micro-batches forwarded and not yet backwarded
    /// at once, between ticks: the stash 1F1B bounds by S − s and GPipe
    /// fills with all M. The last stage, whose forward runs inside its
    /// backward, counts the inputs it received; the first re-reads its
    /// token ids from the caller's batch, so its stash costs no copy.
    pub peak_in_flight: Vec<usize>,
    /// Per stage: the most host bytes held at once for later ticks: the
    /// inputs of those micro-batches, inputs received ahead of their
    /// forward, and output gradients waiting for the backward.
    pub peak_stash_bytes: Vec<u64>,
    /// The whole model's gradient norm before clipping, of the last step
    /// (`None` when the optimizer does not clip).
    pub last_grad_norm: Option<f32>,
}

/// A [`Gpt`] over the devices of a group, one stage each.
pub struct GptPipeline {
    stages: Vec<Stage>,
    config: GptConfig,
    schedule: Schedule,
    micro_batches: usize,
    micro_rows: usize,
    global_batch: usize,
    blocks: Vec<usize>,
    shared: Vec<SharedParameter>,
    /// The single-device model's parameter names, in its order.
    names: Vec<(String, Vec<usize>)>,
    model_description: String,
    optimizer: OptimizerConfig,
    work: Vec<Vec<Work>>,
    /// Host copies of each stage's input per micro-batch, held until its
    /// backward.
    activations: Vec<Vec<Option<Vec<f32>>>>,
    /// Gradient of each stage's output per micro-batch.
    gradients: Vec<Vec<Option<Vec<f32>>>>,
    stats: GptPipelineStats,
}

/// Forward multiply-adds per token of the embedding, one block and the
/// head with its loss: what [`balance_blocks`] evens out.
fn costs(config: &GptConfig) -> (f64, f64, f64) {
    let (c, t, v) = (config.n_embd as f64, config.block_size as f64, config.vocab_size as f64);
    // q, k, v and the output projection, the MLP's two matmuls, and the
    // attention scores and their weighted sum.
    let block = 12.0 * c * c + 2.0 * t * c;
    (2.0 * c, block, v * c + 3.0 * v + 4.0 * c)
}

/// Blocks per stage that even out the stages' work (see [`costs`]): the
/// embedding counts on the first stage and the head with its loss on the
/// last, so a GPT with a large vocabulary gets fewer blocks on its last
/// stage (GPT-2 on two stages: 8 and 4). Every middle stage gets at least
/// one block; the first may hold only the embedding and the last only the
/// head.
pub fn balance_blocks(config: &GptConfig, stages: usize) -> Result<Vec<usize>> {
    let layers = config.n_layer;
    if stages == 0 || stages > layers + 2 {
        return Err(Error::InvalidArgument {
            op: "GptPipeline",
            reason: format!(
                "{stages} stages cannot be filled by {layers} blocks plus the embedding and the head: every stage needs a block, the embedding or the head (at most {} stages)",
                layers + 2
            ),
        });
    }
    let (embedding, block, head) = costs(config);
    let units: Vec<f64> = std::iter::once(embedding).chain(std::iter::repeat_n(block, layers)).chain(std::iter::once(head)).collect();
    let n = units.len();
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
    // Units to blocks: the first stage's first unit is the embedding, the
    // last stage's last the head.
    sizes[0] -= 1;
    sizes[stages - 1] -= 1;
    Ok(sizes)
}

/// `h.2-3`, `h.1`, or nothing.
fn block_range(start: usize, count: usize) -> Option<String> {
    match count {
        0 => None,
        1 => Some(format!("h.{start}")),
        _ => Some(format!("h.{start}-{}", start + count - 1)),
    }
}

impl GptPipeline {
    /// `model` over the devices of `group` (one stage each, blocks balanced
    /// by [`balance_blocks`]), trained on `global_batch` sequences per step
    /// cut into `micro_batches`, with the cross-entropy loss.
    pub fn new(group: &DeviceGroup, model: &Gpt, optimizer: OptimizerConfig, global_batch: usize, micro_batches: usize, schedule: Schedule) -> Result<Self> {
        Self::with_blocks(group, model, optimizer, global_batch, micro_batches, schedule, None)
    }

    /// [`GptPipeline::new`] with `blocks_per_stage` overriding the balanced
    /// split: one count per device, summing to the model's blocks, at least
    /// one on every middle stage.
    #[allow(clippy::too_many_arguments)]
    pub fn with_blocks(
        group: &DeviceGroup,
        model: &Gpt,
        optimizer: OptimizerConfig,
        global_batch: usize,
        micro_batches: usize,
        schedule: Schedule,
        blocks_per_stage: Option<Vec<usize>>,
    ) -> Result<Self> {
        let s_count = group.len();
        let layers = model.h.len();
        if layers != model.config.n_layer {
            return Err(Error::InvalidArgument { op: "GptPipeline", reason: format!("the model has {layers} blocks but its config says n_layer = {}", model.config.n_layer) });
        }
        if micro_batches == 0 || global_batch == 0 || global_batch % micro_batches != 0 {
            return Err(Error::InvalidArgument {
                op: "GptPipeline",
                reason: format!("the global batch of {global_batch} sequences must split into {micro_batches} equal micro-batches"),
            });
        }
        let blocks = match blocks_per_stage {
            None => balance_blocks(&model.config, s_count)?,
            Some(counts) => {
                let middle_empty = counts.len() > 2 && counts[1..counts.len() - 1].contains(&0);
                if counts.len() != s_count || counts.iter().sum::<usize>() != layers || middle_empty {
                    return Err(Error::InvalidArgument {
                        op: "GptPipeline",
                        reason: format!("blocks per stage {counts:?} must give each of {s_count} stages a count, at least one on every middle stage, summing to the model's {layers} blocks"),
                    });
                }
                counts
            }
        };
        let micro_rows = global_batch / micro_batches;
        let (t, c) = (model.config.block_size, model.config.n_embd);
        let last = s_count - 1;
        let mut stages = Vec::with_capacity(s_count);
        let mut start = 0;
        for (i, (&count, k)) in blocks.iter().zip(group.members()).enumerate() {
            let build = || -> Result<Stage> {
                let mut g = Graph::new();
                let (input, mut x, mut wte) = if i == 0 {
                    let idx = g.ids("idx", &[micro_rows, t])?;
                    let wte = model.wte.table(&mut g, "wte.")?;
                    (idx, model.embed(&mut g, wte, idx, "")?, Some(wte))
                } else {
                    let input = g.input("stage_input", &[micro_rows, t, c])?;
                    (input, input, None)
                };
                for b in start..start + count {
                    x = model.h[b].forward(&mut g, x, &format!("h.{b}."))?;
                }
                let (output, end, out_features) = if i == last {
                    let wte = match wte.take() {
                        Some(w) => w,
                        None => model.wte.table(&mut g, "wte.")?,
                    };
                    (model.head(&mut g, wte, x, "")?, StageEnd::Last(Criterion::CrossEntropy), t * model.config.vocab_size)
                } else {
                    (x, StageEnd::Middle, t * c)
                };
                let in_features = if i == 0 { t } else { t * c };
                Stage::from_graph(k.clone(), g, input, output, i > 0, end, optimizer, micro_rows, in_features, out_features)
            };
            stages.push(build().map_err(|e| on_device(i, k, e))?);
            start += count;
        }
        let shared = if s_count > 1 { vec![SharedParameter { name: TIED.into(), holders: vec![0, last] }] } else { Vec::new() };
        let mut pipeline = GptPipeline {
            stages,
            config: model.config,
            schedule,
            micro_batches,
            micro_rows,
            global_batch,
            blocks,
            shared,
            names: model.named_parameters(),
            model_description: model.describe(),
            optimizer,
            work: training_work(schedule, s_count, micro_batches),
            activations: vec![vec![None; micro_batches]; s_count],
            gradients: vec![vec![None; micro_batches]; s_count],
            stats: GptPipelineStats::default(),
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

    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    pub fn global_batch(&self) -> usize {
        self.global_batch
    }

    pub fn config(&self) -> GptConfig {
        self.config
    }

    pub fn optimizer(&self) -> &OptimizerConfig {
        &self.optimizer
    }

    pub fn stats(&self) -> &GptPipelineStats {
        &self.stats
    }

    /// Starts the stats afresh (after warm-up steps, which compile).
    pub fn reset_stats(&mut self) {
        let s_count = self.stages.len();
        self.stats = GptPipelineStats {
            busy: vec![Duration::ZERO; s_count],
            peak_in_flight: vec![0; s_count],
            peak_stash_bytes: vec![0; s_count],
            ..GptPipelineStats::default()
        };
    }

    /// Optimizer steps taken (every stage takes each).
    pub fn step_count(&self) -> u64 {
        self.stages.first().map_or(0, |s| s.executor().step_count())
    }

    /// The learning rate of the last step (the first step's before any).
    pub fn learning_rate(&self) -> Option<f32> {
        self.stages.first().and_then(|s| s.executor().learning_rate())
    }

    /// Device memory each stage's executor holds ([`crate::graph::Executor::peak_bytes`]).
    pub fn stage_gpu_bytes(&self) -> Vec<u64> {
        self.stages.iter().map(|s| s.executor().peak_bytes()).collect()
    }

    /// The idle share of an ideal pipeline, (S−1)/(M+S−1), for both
    /// schedules.
    pub fn ideal_bubble_fraction(&self) -> f64 {
        super::pipeline::ideal_bubble(self.stages.len(), self.micro_batches)
    }

    /// The measured idle share: 1 − busy time / (stages × step time).
    pub fn measured_bubble_fraction(&self) -> f64 {
        super::pipeline::measured_bubble(self.stats.wall, &self.stats.busy)
    }

    /// The share of step time spent moving data between devices.
    pub fn communication_share(&self) -> f64 {
        let wall = self.stats.wall.as_secs_f64();
        if wall <= 0.0 {
            return 0.0;
        }
        (self.stats.communication.as_secs_f64() / wall).clamp(0.0, 1.0)
    }

    /// One line: schedule, micro-batches and what each stage holds on which
    /// device.
    pub fn describe(&self) -> String {
        let last = self.stages.len() - 1;
        let mut start = 0;
        let mut parts = Vec::with_capacity(self.stages.len());
        for (i, (stage, &count)) in self.stages.iter().zip(&self.blocks).enumerate() {
            let mut holds = Vec::new();
            if i == 0 {
                holds.push("wte, wpe".to_string());
            }
            holds.extend(block_range(start, count));
            if i == last {
                holds.push(if last > 0 { "ln_f, head (tied wte), loss".into() } else { "ln_f, head, loss".into() });
            }
            parts.push(format!("stage {i} on #{i} {}: {}", stage.kernels.device().label(), holds.join(", ")));
            start += count;
        }
        format!(
            "pipeline ({}) over {} stage(s), {} micro-batches of {} sequences: {}",
            self.schedule,
            self.stages.len(),
            self.micro_batches,
            self.micro_rows,
            parts.join("; ")
        )
    }

    /// One line of what the steps so far measured.
    pub fn report(&self) -> String {
        let steps = self.stats.steps.max(1) as f64;
        let kib: Vec<String> = self.stats.peak_stash_bytes.iter().map(|b| format!("{:.0}", *b as f64 / 1024.0)).collect();
        format!(
            "{} steps, {:.1} ms/step, bubble {:.2} (ideal {:.2}), communication {:.0}% of step time, peak stash per stage {:?} micro-batches ([{}] KiB host)",
            self.stats.steps,
            self.stats.wall.as_secs_f64() * 1e3 / steps,
            self.measured_bubble_fraction(),
            self.ideal_bubble_fraction(),
            100.0 * self.communication_share(),
            self.stats.peak_in_flight,
            kib.join(", ")
        )
    }

    fn check_batch(&self, op: &'static str, ids: &[u32], targets: &[u32]) -> Result<()> {
        let want = self.global_batch * self.config.block_size;
        if ids.len() != want || targets.len() != want {
            return Err(Error::shape(
                op,
                format!("ids and targets must each be {} × {} token ids", self.global_batch, self.config.block_size),
                &[&[ids.len()], &[targets.len()]],
            ));
        }
        Ok(())
    }

    /// One optimizer step on `ids` and `targets` ([global_batch, T] token
    /// ids each). Returns the mean loss over the whole batch when
    /// `read_loss`.
    pub fn step(&mut self, ids: &[u32], targets: &[u32], read_loss: bool) -> Result<Option<f32>> {
        self.check_batch("GptPipeline::step", ids, targets)?;
        let wall = Instant::now();
        let work = std::mem::take(&mut self.work);
        let loss = self.run(&work, ids, targets, true, read_loss);
        self.work = work;
        let loss = loss?;
        let reduced = Instant::now();
        let mut stages: Vec<&mut Stage> = self.stages.iter_mut().collect();
        let devices: Vec<usize> = (0..stages.len()).collect();
        self.stats.last_grad_norm = reduce_and_step(&mut stages, &devices, &self.shared)?;
        if !self.shared.is_empty() {
            // Reading and writing the tied gradient; with clipping, the
            // norms too (compute, but a wait on every device).
            self.stats.communication += reduced.elapsed();
        }
        self.stats.steps += 1;
        self.stats.wall += wall.elapsed();
        if read_loss && !loss.is_finite() {
            return Err(Error::NonFiniteLoss { value: loss as f32, step: self.step_count() });
        }
        Ok(read_loss.then_some(loss as f32))
    }

    /// The mean loss over `ids` and `targets` ([global_batch, T] each),
    /// forward only, the micro-batches pipelined through the stages; no
    /// gradient, no update.
    pub fn evaluate_loss(&mut self, ids: &[u32], targets: &[u32]) -> Result<f32> {
        self.check_batch("GptPipeline::evaluate_loss", ids, targets)?;
        let s_count = self.stages.len();
        let work: Vec<Vec<Work>> = (0..s_count)
            .map(|s| if s + 1 == s_count { (0..self.micro_batches).map(Work::Loss).collect() } else { (0..self.micro_batches).map(Work::Forward).collect() })
            .collect();
        let loss = self.run(&work, ids, targets, false, true)? as f32;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss { value: loss, step: self.step_count() });
        }
        Ok(loss)
    }

    /// Runs `work` tick by tick; returns the weighted sum of the
    /// micro-batches' losses (the global mean) when read.
    fn run(&mut self, work: &[Vec<Work>], ids: &[u32], targets: &[u32], training: bool, read_loss: bool) -> Result<f64> {
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
                    s == 0 || (forwarded[s - 1][m] && (self.schedule == Schedule::OneFOneB || forwarded[s - 1][m_count - 1]))
                }
                Work::Backward(m) => backwarded[s + 1][m],
            };
            let active: Vec<(usize, Work)> = (0..s_count).filter_map(|s| work[s].get(next[s]).copied().filter(|&w| ready(s, w)).map(|w| (s, w))).collect();
            if active.is_empty() {
                if (0..s_count).all(|s| next[s] == work[s].len()) {
                    return Ok(loss);
                }
                return Err(Error::InvalidArgument { op: "GptPipeline", reason: format!("the {} schedule stalled with work left at {next:?}", self.schedule) });
            }
            let results = self.tick(&active, ids, targets, training)?;
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
                    let bytes: usize = self.activations[s].iter().chain(&self.gradients[s]).flatten().map(|v| 4 * v.len()).sum();
                    self.stats.peak_in_flight[s] = self.stats.peak_in_flight[s].max(in_flight);
                    self.stats.peak_stash_bytes[s] = self.stats.peak_stash_bytes[s].max(bytes as u64);
                }
            }
        }
    }

    /// Submits `active`'s work on every stage, then copies the stages'
    /// results (outputs, input gradients, evaluation losses) to the host
    /// together. One result per active stage, `None` where there is none.
    fn tick(&mut self, active: &[(usize, Work)], ids: &[u32], targets: &[u32], training: bool) -> Result<Vec<Option<Vec<f32>>>> {
        let start = Instant::now();
        let last = self.stages.len() - 1;
        let tokens = self.micro_rows * self.config.block_size;
        let scale = self.micro_rows as f32 / self.global_batch as f32;
        let mut writing = Duration::ZERO;
        // A GL device runs its work inside the submit, on this thread: the
        // others submit first, so their work overlaps it.
        let mut order: Vec<usize> = (0..active.len()).collect();
        order.sort_by_key(|&k| self.stages[active[k].0].kernels.device().is_gl());
        for (s, w) in order.into_iter().map(|k| active[k]) {
            let m = w.micro();
            let batch = m * tokens..(m + 1) * tokens;
            let input = if s == 0 { StageInput::Ids(&ids[batch.clone()]) } else { StageInput::Activations(stashed(&self.activations[s][m], "input", s, m)?) };
            let gradient = match w {
                Work::Backward(_) if s < last => Some(stashed(&self.gradients[s][m], "output gradient", s, m)?),
                _ => None,
            };
            let stage = &mut self.stages[s];
            let wrote = Instant::now();
            write_inputs(stage, w, input, gradient, &targets[batch], scale).map_err(|e| on_device(s, &stage.kernels, e))?;
            writing += wrote.elapsed();
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
                k.device().wait_idle("GptPipeline").map_err(|e| on_device(s, k, e))?;
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
            self.stats.communication += writing + arrived.iter().max().map_or(Duration::ZERO, |slowest| elapsed.saturating_sub(*slowest));
        }
        let mut results: Vec<Option<Vec<f32>>> = vec![None; active.len()];
        for (k, v) in owners.into_iter().zip(values) {
            results[k] = Some(v);
        }
        Ok(results)
    }

    /// Every parameter with the single-device [`Gpt`]'s names, in its order
    /// (`wte.weight` once: the copies are equal).
    pub fn parameters(&self) -> Result<NamedParameters> {
        let mut all = Vec::new();
        for (s, stage) in self.stages.iter().enumerate() {
            all.extend(stage.executor().parameters().map_err(|e| on_device(s, &stage.kernels, e))?);
        }
        let mut ordered = Vec::with_capacity(self.names.len());
        for (name, _) in &self.names {
            let k = all.iter().position(|(n, _, _)| n == name).ok_or_else(|| Error::InvalidArgument {
                op: "GptPipeline::parameters",
                reason: format!("no stage holds `{name}`"),
            })?;
            ordered.push(all.swap_remove(k));
        }
        Ok(ordered)
    }

    /// The optimizer state as (parameter, state, values) with the
    /// single-device names, each parameter once (as
    /// [`crate::graph::Executor::optimizer_state`]).
    pub fn optimizer_state(&self) -> Result<Vec<(String, &'static str, Vec<f32>)>> {
        let mut all: Vec<(String, &'static str, Vec<f32>)> = Vec::new();
        for (s, stage) in self.stages.iter().enumerate() {
            for entry in stage.executor().optimizer_state().map_err(|e| on_device(s, &stage.kernels, e))? {
                if !all.iter().any(|(p, n, _)| *p == entry.0 && *n == entry.1) {
                    all.push(entry);
                }
            }
        }
        Ok(all)
    }

    /// Parameters, optimizer state (`optim.<param>.<state>`) and metadata
    /// as [`crate::trainer::Trainer::checkpoint`] writes them for the
    /// single-device model, so a folder saved from a pipeline resumes on
    /// one device and the other way round.
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        let mut ckpt = Checkpoint::new();
        let params = self.parameters()?;
        for (name, shape, data) in &params {
            ckpt.push(NamedTensor::new(name.clone(), shape.clone(), data.clone())?);
        }
        for (param, state, data) in self.optimizer_state()? {
            let shape = params.iter().find(|(n, _, _)| *n == param).map_or_else(|| vec![data.len()], |(_, s, _)| s.clone());
            ckpt.push(NamedTensor::new(format!("optim.{param}.{state}"), shape, data)?);
        }
        ckpt.set_meta("format", "wgrad");
        ckpt.set_meta("model", self.model_description.clone());
        ckpt.set_meta("criterion", format!("{:?}", Criterion::CrossEntropy));
        ckpt.set_meta("optimizer", optim::describe(&self.optimizer));
        ckpt.set_meta("step", self.step_count().to_string());
        Ok(ckpt)
    }

    /// The trained model as a single-device [`Gpt`].
    pub fn model(&self) -> Result<Gpt> {
        let mut params = self.parameters()?;
        Gpt::from_parameters(self.config, |name, shape| {
            let k = params.iter().position(|(n, _, _)| n == name).ok_or_else(|| Error::InvalidArgument {
                op: "GptPipeline::model",
                reason: format!("no parameter `{name}` {shape:?}"),
            })?;
            Ok(params.swap_remove(k).2)
        })
    }

    /// Replaces parameters and, when given, the optimizer state and step
    /// count, by single-device names (as
    /// [`crate::graph::Executor::load_state`]; the tied embedding goes to
    /// both its stages). Every name and size is checked before any device
    /// changes.
    pub fn load_state(&mut self, params: &[(String, Vec<usize>, Vec<f32>)], optimizer_state: &[(String, String, Vec<f32>)], step: Option<u64>) -> Result<()> {
        let shapes: Vec<Vec<(String, Vec<usize>)>> = self.stages.iter().map(|s| s.executor().parameters_shapes()).collect();
        let shape_of = |name: &str| shapes.iter().flatten().find(|(n, _)| n == name).map(|(_, s)| s.clone());
        for (name, shape, values) in params {
            let want = shape_of(name).ok_or_else(|| Error::InvalidArgument { op: "GptPipeline::load_state", reason: format!("the model has no parameter `{name}`") })?;
            if *shape != want || values.len() != want.iter().product::<usize>() {
                return Err(Error::shape("GptPipeline::load_state", format!("parameter `{name}` with {} values", values.len()), &[&want, shape]));
            }
        }
        for (name, state, values) in optimizer_state {
            let want = shape_of(name).ok_or_else(|| Error::InvalidArgument {
                op: "GptPipeline::load_state",
                reason: format!("optimizer state `{state}` for unknown parameter `{name}`"),
            })?;
            if values.len() != want.iter().product::<usize>() {
                return Err(Error::shape("GptPipeline::load_state", format!("state `{name}.{state}` has {} values", values.len()), &[&want]));
            }
        }
        for (s, stage) in self.stages.iter_mut().enumerate() {
            let holds = |name: &str| shapes[s].iter().any(|(n, _)| n == name);
            let own_params: Vec<_> = params.iter().filter(|p| holds(&p.0)).cloned().collect();
            let own_state: Vec<_> = optimizer_state.iter().filter(|p| holds(&p.0)).cloned().collect();
            let k = stage.kernels.clone();
            stage.executor_mut().load_state(&own_params, &own_state, step).map_err(|e| on_device(s, &k, e))?;
        }
        Ok(())
    }
}

/// What a stage reads: the first stage token ids, the others activations.
enum StageInput<'a> {
    Ids(&'a [u32]),
    Activations(&'a [f32]),
}

fn stashed<'a>(slot: &'a Option<Vec<f32>>, what: &str, s: usize, m: usize) -> Result<&'a [f32]> {
    slot.as_deref().ok_or_else(|| Error::InvalidArgument { op: "GptPipeline", reason: format!("stage {s} has no {what} for micro-batch {m}: the schedule ran out of order") })
}

/// Writes what a stage reads for `work`: its input, and the gradient of
/// its output or its targets.
fn write_inputs(stage: &mut Stage, work: Work, input: StageInput<'_>, gradient: Option<&[f32]>, targets: &[u32], scale: f32) -> Result<()> {
    match input {
        StageInput::Ids(ids) => stage.set_input_ids(ids)?,
        StageInput::Activations(x) => stage.set_input(x)?,
    }
    match (work, gradient) {
        (Work::Forward(_), _) => Ok(()),
        (Work::Backward(_), Some(g)) => stage.set_output_gradient(g),
        // The last stage: backward or evaluation from its loss.
        (Work::Backward(_) | Work::Loss(_), _) => stage.set_targets(Targets::Classes(targets), scale),
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
            Error::OnDevice { device: renamed.unwrap_or(device), source }
        }
        other => other,
    }
}
