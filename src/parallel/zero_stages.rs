//! ZeRO stages 2 and 3 block by block (as FSDP wraps each block): every
//! device runs the whole model on its rows of the batch as a sequence of
//! stage graphs (the prologue, each block, the epilogue: the units a
//! [`Staged`] model declares), and between steps keeps only its shard of
//! the gradients and of AdamW's moments, and at stage 3 of the parameters
//! too (at stage 2 it keeps them all).
//!
//! The stages' executors take turns on one pool per device: a parameter
//! arena and a gradient arena as long as the largest stage's, and the
//! intermediate slots, each as long as any stage's
//! ([`crate::graph::Executor::with_arenas`]): a device's intermediates
//! are those of its largest stage, not of the whole model. A step:
//! - forward, stage by stage: the stage's parameters are put in every
//!   device's pool (stage 2: copied on the device from its whole
//!   parameters; stage 3: all-gathered from the shards through the host),
//!   each device runs the stage on its rows and its output goes to the
//!   host (the next stage's input);
//! - backward, in reverse: the stage's parameters are put in the pool
//!   again, the stage recomputes its forward and runs its backward from
//!   the gradient of its output (the last stage from its loss), and its
//!   gradient is reduce-scattered at once (summed over devices weighted by
//!   rows, each device receiving its shard's part), so the pool is free
//!   for the next stage: no device ever holds more of the gradients than
//!   its shard and one stage's arena. A parameter two stages declare (a
//!   head tied to the embedding) takes the sum of both stages' gradients
//!   before it is sent;
//! - each device clips by the global norm (the squares of the reduced
//!   gradients, added on the host) and runs AdamW over its shard; at
//!   stage 2 the updated shards are then all-gathered into every device's
//!   whole parameters (at stage 3 they stay shards until the next gather).
//!
//! This trades the one-submission step of [`super::zero::Zero`] for one
//! forward and one backward submission per stage, each waited for, plus
//! host round trips (stage 3's gathers; both stages' reduce-scatters), and
//! recomputes every stage's forward in its backward (as activation
//! checkpointing by block): keeping each stage's forward would need each
//! stage's own intermediates, all of the model's at once, which is the
//! memory this engine exists to save. What a device holds: its shard of
//! the flat arena's gradients and moments, its shard (stage 3) or all
//! (stage 2) of the parameters, the pool, and every stage executor's
//! inputs ([`ZeroStages::memory`], which
//! [`super::memory::strategy_memory`] computes without a device).
//!
//! So activation checkpointing is what this engine always does; f16
//! stores what each stage's backward reads in f16 (boundaries stay f32),
//! and one loss scale serves every device as in [`super::zero`].
//!
//! The flat arena packs every trainable parameter once, weight-decayed
//! first, in the order the stages declare them (the single-device
//! executor's order), so parameters and moments read, save and load under
//! single-device names. Frozen parameters (a LoRA adapter's base) have no
//! gradient and no state: each device keeps them whole in a buffer of
//! their own and copies a stage's into its pool on the device, so only
//! the trainable ones are sharded, reduce-scattered and gathered.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::collectives::{all_gather, to_host, Part};
use super::data::{check_rows, fixed_rows, group_arena_alignment, proportional_split, shard, ARENA_ALIGNMENT};
use super::engine::{features, own_steps, Footprint, Holding, TrainEngine};
use super::memory::{DeviceMemory, Planning};
use super::pipeline::unit_graph;
use super::stage::{NamedParameters, NamedState, Spread, Stage, StageEnd, StageGraph};
use super::zero::{load_loss_scale, next_loss_scale, read_loss_scales, shard_ranges, step_shards, GradSums, ZeroStage};
use super::{on_device, DeviceGroup};
use super::{Examples, ModelWidths, Targets};
use crate::error::{Error, Result};
use crate::graph::{stored_words, ArenaPool, DType, Graph, Plan, PlanOptions, Precision, Tensor};
use crate::io::checkpoint::Checkpoint;
use crate::io::state_dict::{assemble_checkpoint, CheckpointAbout};
use crate::kernels::{GpuTensor, Kernels, OptimizerConfig, View};
use crate::nn::{Criterion, Staged};
use crate::optim::{apply_parameter_groups, stage_state, LossScaleState, Optimizer, ParamSpan};

const BYTES: u64 = 4;

/// The stages a device runs `model` as: the prologue and the epilogue
/// each alone where they do work (else with the first or last block),
/// and every block alone. (blocks, first, last) per stage.
fn stage_units<M: Staged + ?Sized>(model: &M) -> Vec<(Range<usize>, bool, bool)> {
    let costs = model.stage_costs();
    let blocks = costs.blocks.len();
    if blocks == 0 {
        return vec![(0..0, true, true)];
    }
    let (own_prologue, own_epilogue) = (costs.prologue > 0.0, costs.epilogue > 0.0);
    let mut units = Vec::with_capacity(blocks + 2);
    if own_prologue {
        units.push((0..0, true, false));
    }
    units.extend((0..blocks).map(|b| (b..b + 1, b == 0 && !own_prologue, b + 1 == blocks && !own_epilogue)));
    if own_epilogue {
        units.push((blocks..blocks, false, true));
    }
    units
}

/// Each stage's trainable graph on `rows` rows, its parameters grouped as
/// `optimizer` groups them, the activations its backward reads stored in
/// `precision`: (graph, input, output).
fn stage_graphs<M: Staged + ?Sized>(
    model: &M,
    rows: usize,
    criterion: Criterion,
    optimizer: &OptimizerConfig,
    precision: Precision,
) -> Result<Vec<(StageGraph, Tensor, Tensor)>> {
    let units = stage_units(model);
    let mut stream = Vec::new();
    units
        .into_iter()
        .map(|(blocks, first, last)| {
            let (g, input, output) = unit_graph(model, first, last, blocks, rows, &mut stream)?;
            let end = if last {
                StageEnd::Last(criterion)
            } else {
                StageEnd::Middle
            };
            // Its input, output and the gradients it takes and yields stay f32.
            let mut ends = [input, output];
            let mut s = StageGraph::complete(g, input, output, !first, end)?.with_passes(
                &[],
                false,
                precision == Precision::F16,
                &mut ends,
            )?;
            apply_parameter_groups(&mut s.graph, optimizer)?;
            let [input, output] = ends;
            Ok((s, input, output))
        })
        .collect()
}

/// A stage graph planned as its executor plans it on a device of
/// `alignment` bytes.
fn plan_stage(s: &StageGraph, alignment: u32) -> Plan {
    Plan::with_options(
        &s.graph,
        &s.outputs,
        Some(&s.grads),
        (alignment as usize / BYTES as usize).max(1),
        PlanOptions::default(),
    )
}

/// Elements of the pooled buffers stages planned as `plans` share: the
/// longest parameter arena, the longest gradient arena (its trainable
/// part: frozen parameters have none), and slot by slot the longest
/// intermediate.
fn pool_lengths<'p>(plans: impl IntoIterator<Item = &'p Plan>) -> (usize, usize, Vec<usize>) {
    let (mut arena, mut grads, mut slots) = (1, 1, Vec::new());
    for plan in plans {
        arena = arena.max(plan.param_arena_len);
        grads = grads.max(plan.trainable_len);
        slots.resize(slots.len().max(plan.slot_len.len()), 0);
        slots
            .iter_mut()
            .zip(&plan.slot_len)
            .for_each(|(s, &len)| *s = (*s).max(len));
    }
    (arena, grads, slots)
}

/// A frozen parameter (a LoRA adapter's base) in a device's frozen buffer:
/// whole on every device, copied into the pool on the device before each
/// stage that reads it, never sharded, gathered or reduced.
#[derive(Clone, Debug)]
struct FrozenSpan {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    /// Where its words start in the buffer, and how many it stores.
    offset: usize,
    words: usize,
}

/// Every parameter the stage graphs declare, once, in declaration order:
/// the trainable ones (name, shape, whether weight decay applies) and the
/// frozen ones, laid out one after another in a frozen buffer of the
/// returned length.
#[allow(clippy::type_complexity)]
fn declared_parameters<'g>(
    graphs: impl IntoIterator<Item = &'g Graph>,
) -> (Vec<(String, Vec<usize>, bool)>, Vec<FrozenSpan>, usize) {
    let (mut trainable, mut frozen, mut words): (Vec<(String, Vec<usize>, bool)>, Vec<FrozenSpan>, usize) =
        (Vec::new(), Vec::new(), 0);
    for g in graphs {
        for p in g.parameters() {
            let node = g.node(p);
            let known =
                trainable.iter().any(|(name, _, _)| *name == node.name) || frozen.iter().any(|f| f.name == node.name);
            if known {
                continue;
            }
            if g.is_frozen(p) {
                let stored = stored_words(node.dtype, node.len());
                frozen.push(FrozenSpan {
                    name: node.name.clone(),
                    shape: node.shape.clone(),
                    dtype: node.dtype,
                    offset: words,
                    words: stored,
                });
                words += stored;
            } else {
                trainable.push((node.name.clone(), node.shape.clone(), g.weight_decay_applies(p)));
            }
        }
    }
    (trainable, frozen, words)
}

/// What one device holds: `held` elements of the flat parameters (its
/// shard at stage 3, all of them at 2), `frozen` words of frozen ones, its
/// shard of `shard` elements of the gradients and moments, the pooled
/// parameter and gradient arenas of `pool` elements and slots of `slots`,
/// and the stages' inputs (`inputs` bytes).
fn device_memory(
    (held, frozen): (usize, usize),
    shard: usize,
    pool: (usize, usize),
    slots: &[usize],
    inputs: u64,
    state_arenas: usize,
) -> DeviceMemory {
    let (held, shard) = ((held + frozen) as u64 * BYTES, shard as u64 * BYTES);
    let (arena, grad_arena) = (pool.0 as u64 * BYTES, pool.1 as u64 * BYTES);
    DeviceMemory {
        parameters: held + arena,
        gradients: shard + grad_arena,
        optimizer_state: state_arenas as u64 * shard,
        activations: inputs + slots.iter().map(|&len| len as u64 * BYTES).sum::<u64>(),
    }
}

/// [`ZeroStages::memory`] at `stage` planned without a device, for
/// `devices` devices splitting the batch evenly (the first take a row
/// more).
pub fn planned_memory<M: Staged + ?Sized>(
    model: &M,
    stage: ZeroStage,
    devices: usize,
    p: &Planning,
) -> Result<DeviceMemory> {
    let rows = p.batch.div_ceil(devices.max(1));
    let graphs = stage_graphs(model, rows, p.criterion, &p.optimizer, p.precision)?;
    let plans: Vec<Plan> = graphs
        .iter()
        .map(|(s, _, _)| plan_stage(s, p.device_alignment.max(ARENA_ALIGNMENT)))
        .collect();
    let (arena, grad_arena, slots) = pool_lengths(&plans);
    // Only the trainable parameters are sharded; the frozen stay whole.
    let (trainable, _, frozen) = declared_parameters(graphs.iter().map(|(s, _, _)| &s.graph));
    let flat: usize = trainable
        .iter()
        .map(|(_, shape, _)| shape.iter().product::<usize>())
        .sum();
    let block = p.device_alignment.max(ARENA_ALIGNMENT) as usize / BYTES as usize;
    let largest = shard_ranges(flat, devices, block)?
        .iter()
        .map(|r| r.len())
        .max()
        .unwrap_or(0);
    let held = if stage == ZeroStage::Gradients { flat } else { largest };
    Ok(device_memory(
        (held, frozen),
        largest,
        (arena, grad_arena),
        &slots,
        plans.iter().map(|p| p.input_bytes).sum(),
        p.optimizer.state_names().len(),
    ))
}

/// ZeRO-2 or ZeRO-3 over the devices of a group, stage by stage (module
/// comment).
pub struct ZeroStages {
    /// What a device keeps only its shard of: the gradients (stage 2) or
    /// also the parameters (stage 3).
    stage: ZeroStage,
    devices: Vec<Arc<Kernels>>,
    /// Per device, its stages in order.
    stages: Vec<Vec<Stage>>,
    /// Per device: the arenas and slots its stages share.
    pools: Vec<ArenaPool>,
    /// Per device: the part of the flat parameters it holds (its shard at
    /// stage 3, all of them at 2: [`Self::held`]) and its shard of the
    /// gradients.
    params: Vec<GpuTensor>,
    shard_grads: Vec<GpuTensor>,
    optimizers: Vec<Optimizer>,
    shards: Vec<Range<usize>>,
    /// Every parameter in the flat arena, in single-device order.
    spans: Vec<ParamSpan>,
    flat_len: usize,
    /// Per device, per stage: (span index, offset in the stage's arena).
    placed: Vec<Vec<Vec<(usize, usize)>>>,
    /// Per span: how many stages declare it.
    holders: Vec<usize>,
    /// The frozen parameters, and per device its buffer of them (whole)
    /// and per stage where each lies in the stage's arena: (frozen index,
    /// word offset).
    frozen: Vec<FrozenSpan>,
    frozen_words: usize,
    frozen_buffers: Vec<GpuTensor>,
    frozen_placed: Vec<Vec<Vec<(usize, usize)>>>,
    /// Device 0's stages as a [`Spread`], for what reads an engine's layout.
    spread: Spread,
    shares: Vec<usize>,
    global_batch: usize,
    widths: ModelWidths,
    description: String,
    criterion: Criterion,
    optimizer: OptimizerConfig,
    last_grad_norm: Option<f32>,
}

impl ZeroStages {
    /// `model`'s stages on every device of `group`, each device keeping
    /// its shard of the gradients and optimizer state and, at `stage` 3,
    /// of the parameters (at 2 it keeps them whole); `global_batch` rows
    /// per step, split evenly or as `rows` fixes. Stage 1 keeps whole
    /// gradients, which this engine never holds: an error (the whole-arena
    /// [`super::zero::Zero`] runs it).
    pub fn new(
        group: &DeviceGroup,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        stage: ZeroStage,
        rows: Option<Vec<usize>>,
    ) -> Result<Self> {
        Self::with_options(
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

    /// [`ZeroStages::new`] with `options`: f16 stores the activations each
    /// stage's backward reads in f16 on devices with SHADER_F16 (stage
    /// boundaries stay f32; the optimizer then scales the loss, one scale
    /// for every device: see [`super::zero::step_shards`]).
    /// `checkpoint_activations` changes nothing: every stage (one block)
    /// already recomputes its forward in its backward, holding only the
    /// stages' inputs between the passes (module comment).
    #[allow(clippy::too_many_arguments)]
    pub fn with_options(
        group: &DeviceGroup,
        model: &dyn Staged,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        global_batch: usize,
        stage: ZeroStage,
        rows: Option<Vec<usize>>,
        options: PlanOptions,
    ) -> Result<Self> {
        if stage == ZeroStage::OptimizerState {
            return Err(Error::InvalidArgument {
                op: "ZeroStages",
                reason: "ZeRO-1 keeps whole gradients: run it with the whole-arena Zero engine".into(),
            });
        }
        let (criterion, optimizer) = (criterion.into(), optimizer.into());
        let devices = group.members().to_vec();
        let shares = match &rows {
            Some(rows) => fixed_rows("zero split", rows, devices.len(), "devices", global_batch)?,
            None => proportional_split(global_batch, &vec![1.0; devices.len()])?,
        };
        let mut stages = Vec::with_capacity(devices.len());
        let mut pools = Vec::with_capacity(devices.len());
        // Each parameter's initial words (device 0's, read from its pool).
        let mut initial: HashMap<String, Vec<f32>> = HashMap::new();
        let group_alignment = group_arena_alignment(&devices);
        for (d, (k, &n)) in devices.iter().zip(&shares).enumerate() {
            let precision = if k.supports_f16() {
                options.precision
            } else {
                Precision::F32
            };
            let read = (d == 0).then_some(&mut initial);
            let (own, pool) = device_stages(k, model, n, (criterion, &optimizer), precision, group_alignment, read)
                .map_err(|e| on_device(d, k, e))?;
            stages.push(own);
            pools.push(pool);
        }
        // Only the trainable parameters are sharded; the frozen stay whole.
        let (declared, frozen, frozen_words) = declared_parameters(stages[0].iter().map(|s| s.executor().graph()));
        let mut frozen_flat = vec![0.0f32; frozen_words.max(1)];
        for f in &frozen {
            let words = initial.get(&f.name).ok_or_else(|| undeclared(&f.name))?;
            frozen_flat[f.offset..f.offset + f.words].copy_from_slice(words);
        }
        let frozen_buffers = devices
            .iter()
            .enumerate()
            .map(|(d, k)| k.upload(&frozen_flat).map_err(|e| on_device(d, k, e)))
            .collect::<Result<Vec<_>>>()?;
        drop(frozen_flat);
        let frozen_placed = frozen_placements(&stages, &frozen)?;
        let (spans, flat_len, decay_len) = flat_layout(&declared);
        let placed = placements(&stages, &spans)?;
        let holders: Vec<usize> = (0..spans.len())
            .map(|i| {
                placed[0]
                    .iter()
                    .filter(|stage| stage.iter().any(|&(j, _)| j == i))
                    .count()
            })
            .collect();
        let mut flat = vec![0.0f32; flat_len];
        for span in &spans {
            let values = initial.get(&span.name).ok_or_else(|| undeclared(&span.name))?;
            flat[span.offset..span.offset + span.len()].copy_from_slice(values);
        }
        let block = group_arena_alignment(&devices) as usize / BYTES as usize;
        let shards = shard_ranges(flat_len, devices.len(), block)?;
        let (mut params, mut shard_grads, mut optimizers) = (Vec::new(), Vec::new(), Vec::new());
        for (d, (k, range)) in devices.iter().zip(&shards).enumerate() {
            let mut build = || -> Result<()> {
                let held = held_range(stage, flat_len, range);
                let (whole, grads) = (k.upload(&flat[held.clone()])?, k.zeros(range.len())?);
                // AdamW updates the shard where it lies among the held
                // parameters (shards start on the alignment's blocks).
                let shard = whole.slice(range.start - held.start, range.len())?;
                let decay = decay_len.clamp(range.start, range.end) - range.start;
                optimizers.push(Optimizer::new(k, optimizer, shard, grads.view(), range.len(), decay)?);
                params.push(whole);
                shard_grads.push(grads);
                Ok(())
            };
            build().map_err(|e| on_device(d, k, e))?;
        }
        let count = stages[0].len();
        let spread = Spread::new(
            model.named_parameters(),
            model.describe(),
            criterion,
            optimizer,
            &stages[0],
            vec![0; count],
            vec![HashMap::new(); count],
        )?;
        Ok(ZeroStages {
            stage,
            devices,
            stages,
            pools,
            params,
            shard_grads,
            optimizers,
            shards,
            spans,
            flat_len,
            placed,
            holders,
            frozen,
            frozen_words,
            frozen_buffers,
            frozen_placed,
            spread,
            shares,
            global_batch,
            widths: ModelWidths::of(model)?,
            description: model.describe(),
            criterion,
            optimizer,
            last_grad_norm: None,
        })
    }

    /// Each device's element range of the flat arena.
    pub fn shards(&self) -> &[Range<usize>] {
        &self.shards
    }

    /// The frozen parameters among `params`, each with its new values,
    /// checked: only an f32 one loads (an f16 or block-quantized base
    /// comes from its file).
    fn frozen_words_of<'p>(
        &self,
        params: &'p [(String, Vec<usize>, Vec<f32>)],
    ) -> Result<Vec<(&FrozenSpan, &'p [f32])>> {
        let op = "ZeroStages::load_state";
        params
            .iter()
            .filter_map(|(name, shape, values)| {
                self.frozen.iter().find(|f| &f.name == name).map(|f| (f, shape, values))
            })
            .map(|(f, shape, values)| {
                if f.dtype != DType::F32 {
                    return Err(Error::InvalidArgument {
                        op,
                        reason: format!(
                            "frozen parameter `{}` holds {}: it loads from its file",
                            f.name,
                            f.dtype.describe()
                        ),
                    });
                }
                if *shape != f.shape || values.len() != f.words {
                    return Err(Error::shape(
                        op,
                        format!("parameter `{}` with {} values", f.name, values.len()),
                        &[&f.shape, shape],
                    ));
                }
                Ok((f, values.as_slice()))
            })
            .collect()
    }

    /// Every stage's dropout: in its forward runs when `training` (a
    /// step's, which its backward recomputes), with the masks of the step
    /// (this engine steps the optimizer outside the stages' executors) and
    /// of each device's rows of the batch, as one device would draw them.
    fn set_dropout(&mut self, training: bool) {
        let step = self.step_count();
        let mut first = 0;
        for (own, &rows) in self.stages.iter_mut().zip(&self.shares) {
            for stage in own.iter_mut() {
                stage.set_dropout(training, first);
                stage.executor_mut().set_dropout_step(Some(step));
            }
            first += rows;
        }
    }

    /// The element range of the flat arena device `d`'s parameters hold.
    fn held(&self, d: usize) -> Range<usize> {
        held_range(self.stage, self.flat_len, &self.shards[d])
    }

    /// Device `d`'s shard of the flat parameters.
    fn shard_params(&self, d: usize) -> Result<View<'_>> {
        let (shard, held) = (&self.shards[d], self.held(d));
        self.params[d].slice(shard.start - held.start, shard.len())
    }

    /// Stages each device runs the model as.
    pub fn stage_count(&self) -> usize {
        self.stages.first().map_or(0, Vec::len)
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

    /// The part of the flat range `range` each device's shard holds:
    /// (device, offset in its shard, offset in `range`, length).
    fn pieces(&self, range: Range<usize>) -> Vec<(usize, usize, usize, usize)> {
        self.shards
            .iter()
            .enumerate()
            .filter_map(|(d, shard)| {
                let (start, end) = (range.start.max(shard.start), range.end.min(shard.end));
                (start < end).then(|| (d, start - shard.start, start - range.start, end - start))
            })
            .collect()
    }

    /// Stage `s`'s parameters into every device's pool: at stage 2 copied
    /// on each device from its whole parameters, at 3 all-gathered from
    /// the shards through the host.
    fn gather(&self, s: usize) -> Result<()> {
        if self.stage == ZeroStage::Gradients {
            return self.copy_into_pool(s, true);
        }
        // The flat runs the stage's parameters lie in, merged.
        let mut runs: Vec<Range<usize>> = self.placed[0][s]
            .iter()
            .map(|&(i, _)| self.spans[i].offset..self.spans[i].offset + self.spans[i].len())
            .collect();
        runs.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(runs.len());
        for r in runs {
            match merged.last_mut() {
                Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        // Every device's pieces of them, read together round by round (a
        // read holds its device's staging buffer: one per device at once).
        let mut reads: Vec<Vec<(View<'_>, usize, usize)>> = vec![Vec::new(); self.devices.len()];
        for (run, range) in merged.iter().enumerate() {
            for (d, at, within, len) in self.pieces(range.clone()) {
                reads[d].push((self.params[d].slice(at, len)?, run, within));
            }
        }
        let mut values: Vec<Vec<f32>> = merged.iter().map(|r| vec![0.0; r.len()]).collect();
        let since = Instant::now();
        for round in 0..reads.iter().map(Vec::len).max().unwrap_or(0) {
            let this: Vec<(usize, (View<'_>, usize, usize))> = reads
                .iter()
                .enumerate()
                .filter_map(|(d, list)| list.get(round).map(|&r| (d, r)))
                .collect();
            let pairs: Vec<(&Kernels, View<'_>)> = this
                .iter()
                .map(|&(d, (view, _, _))| (self.devices[d].as_ref(), view))
                .collect();
            let (got, _) = to_host(&pairs, since)?;
            for ((_, (_, run, within)), part) in this.iter().zip(got) {
                values[*run][*within..*within + part.len()].copy_from_slice(&part);
            }
        }
        let flat_at = |offset: usize| {
            merged
                .iter()
                .position(|r| r.contains(&offset))
                .map(|run| (run, offset - merged[run].start))
        };
        for (d, k) in self.devices.iter().enumerate() {
            // The trainable parameters lie first in a stage's arena; the
            // frozen ones after them come from the device's own copy.
            let len = self.stages[d][s].executor().plan().trainable_len;
            let mut arena = vec![0.0f32; len];
            for &(i, local) in &self.placed[d][s] {
                let span = &self.spans[i];
                let (run, at) = flat_at(span.offset).ok_or_else(|| undeclared(&span.name))?;
                arena[local..local + span.len()].copy_from_slice(&values[run][at..at + span.len()]);
            }
            if len > 0 {
                k.write(self.pools[d].params.slice(0, len)?, &arena)
                    .map_err(|e| on_device(d, k, e))?;
            }
        }
        self.copy_into_pool(s, false)
    }

    /// Stage `s`'s frozen parameters and, when `trainable`, its trainable
    /// ones from each device's whole copies into its pool, one submission
    /// per device (queued after the stage that used the pool before).
    fn copy_into_pool(&self, s: usize, trainable: bool) -> Result<()> {
        for (d, k) in self.devices.iter().enumerate() {
            let to = self.pools[d].params.view();
            let (from, frozen) = (self.params[d].view(), self.frozen_buffers[d].view());
            let spans = self.placed[d][s].iter().filter(|_| trainable).map(|&(i, local)| {
                let span = &self.spans[i];
                (from, span.offset, local, span.len())
            });
            let frozen_spans = self.frozen_placed[d][s].iter().map(|&(i, local)| {
                let f = &self.frozen[i];
                (frozen, f.offset, local, f.words)
            });
            let copies: Vec<(View<'_>, usize, usize, usize)> = spans.chain(frozen_spans).collect();
            if copies.is_empty() {
                continue;
            }
            k.submit_pass(
                "ZeroStages::copy_into_pool",
                std::iter::empty(),
                |encoder| {
                    for (source, at, local, words) in copies {
                        encoder.copy_buffer_to_buffer(
                            source.buffer,
                            source.offset + at as u64 * BYTES,
                            to.buffer,
                            to.offset + local as u64 * BYTES,
                            words as u64 * BYTES,
                        );
                    }
                },
                |_| {},
            )
            .map_err(|e| on_device(d, k, e))?;
        }
        Ok(())
    }

    /// Every device's whole parameters become the concatenation of the
    /// shards AdamW just updated (stage 2; an all-gather through the host).
    fn gather_updated_shards(&self) -> Result<()> {
        let srcs = (0..self.devices.len())
            .map(|d| Ok(Part::new(&self.devices[d], self.shard_params(d)?)))
            .collect::<Result<Vec<_>>>()?;
        let dsts: Vec<Part<'_>> = self
            .devices
            .iter()
            .zip(&self.params)
            .map(|(k, whole)| Part::new(k, whole.view()))
            .collect();
        all_gather(&srcs, &dsts)
    }

    /// Stage `s`'s gradient, just computed on every device, summed over
    /// devices (weighted, in f64 in device order) and each device's part
    /// written to its shard. A parameter other stages also declare waits
    /// in `pending` until every stage added its part. Returns the squares
    /// and overflows of the gradients completed (as the f32 values sent).
    fn reduce_scatter_stage(
        &self,
        s: usize,
        weights: &[f64],
        pending: &mut HashMap<usize, (usize, Vec<f64>)>,
        since: Instant,
    ) -> Result<GradSums> {
        // A stage of frozen parameters only (a LoRA model's embedding) has
        // no gradient to send.
        if self.placed[0][s].is_empty() {
            return Ok(GradSums::default());
        }
        let pairs: Vec<(&Kernels, View<'_>)> = self
            .devices
            .iter()
            .enumerate()
            .map(|(d, k)| {
                Ok((
                    k.as_ref(),
                    self.pools[d]
                        .grads
                        .slice(0, self.stages[d][s].executor().plan().trainable_len)?,
                ))
            })
            .collect::<Result<_>>()?;
        let (grads, _) = to_host(&pairs, since)?;
        let mut sums = GradSums::default();
        for (p, &(i, _)) in self.placed[0][s].iter().enumerate() {
            let len = self.spans[i].len();
            let (count, sum) = pending.entry(i).or_insert_with(|| (0, vec![0.0; len]));
            for (d, g) in grads.iter().enumerate() {
                let local = self.placed[d][s][p].1;
                sum.iter_mut()
                    .zip(&g[local..local + len])
                    .for_each(|(t, &v)| *t += weights[d] * f64::from(v));
            }
            *count += 1;
            if *count < self.holders[i] {
                continue;
            }
            let (_, sum) = pending.remove(&i).unwrap_or_default();
            let values: Vec<f32> = sum.iter().map(|&v| v as f32).collect();
            sums = sums.plus(GradSums::of(values.iter().copied()));
            let offset = self.spans[i].offset;
            for (d, at, within, n) in self.pieces(offset..offset + len) {
                let k = &self.devices[d];
                k.write(self.shard_grads[d].slice(at, n)?, &values[within..within + n])
                    .map_err(|e| on_device(d, k, e))?;
            }
        }
        Ok(sums)
    }

    /// Each device's rows of `x` and `targets` (checked whole first).
    fn split<'x, 't>(
        &self,
        op: &'static str,
        x: Examples<'x>,
        targets: Targets<'t>,
    ) -> Result<Vec<(Examples<'x>, Targets<'t>)>> {
        let (f, width) = check_rows(&self.widths, op, self.global_batch, x, targets)?;
        let mut row = 0;
        Ok(self
            .shares
            .iter()
            .map(|&n| {
                let part = (x.slice(row * f, (row + n) * f), shard(targets, row, n, width));
                row += n;
                part
            })
            .collect())
    }

    fn weights(&self) -> Vec<f64> {
        self.shares
            .iter()
            .map(|&n| n as f64 / self.global_batch as f64)
            .collect()
    }

    /// Each device's rows of the global batch, run forward through every
    /// stage but the last (each gathered first): the rows, every stage's
    /// input per device (stage 0 reads the examples: none), and when the
    /// work started.
    #[allow(clippy::type_complexity)]
    fn forward_to_last<'x, 't>(
        &mut self,
        op: &'static str,
        x: Examples<'x>,
        targets: Targets<'t>,
    ) -> Result<(Vec<(Examples<'x>, Targets<'t>)>, Vec<Vec<Option<Vec<f32>>>>, Instant)> {
        let rows = self.split(op, x, targets)?;
        let since = Instant::now();
        let count = self.stage_count();
        let mut inputs: Vec<Vec<Option<Vec<f32>>>> = vec![vec![None; self.devices.len()]; count];
        for s in 0..count - 1 {
            self.gather(s)?;
            for (d, stage) in self.stages.iter_mut().map(|own| &mut own[s]).enumerate() {
                let k = stage.kernels.clone();
                stage
                    .feed(rows[d].0, inputs[s][d].as_deref())
                    .and_then(|()| stage.forward())
                    .map_err(|e| on_device(d, &k, e))?;
            }
            let views = self
                .stages
                .iter()
                .map(|own| Ok((own[s].kernels.as_ref(), own[s].output_view()?)))
                .collect::<Result<Vec<_>>>()?;
            let (outputs, _) = to_host(&views, since)?;
            inputs[s + 1] = outputs.into_iter().map(Some).collect();
        }
        Ok((rows, inputs, since))
    }

    /// One step on `global_batch` rows (see the module comment); the mean
    /// loss when `read_loss`.
    pub fn step<'x>(
        &mut self,
        x: impl Into<Examples<'x>>,
        targets: Targets<'_>,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        self.set_dropout(true);
        let (rows, mut inputs, since) = self.forward_to_last("ZeroStages::step", x.into(), targets)?;
        let (count, devices) = (self.stage_count(), self.devices.len());
        let last = count - 1;
        let weights = self.weights();
        let scale = next_loss_scale(&self.optimizers, &self.devices)?;
        let (mut pending, mut sums, mut loss) = (HashMap::new(), GradSums::default(), 0.0f64);
        let mut output_grads: Vec<Option<Vec<f32>>> = vec![None; devices];
        for s in (0..count).rev() {
            // A first stage with nothing to train (a LoRA model's frozen
            // embedding) has no gradient to compute: no backward.
            if s == 0 && s < last && self.placed[0][s].is_empty() {
                continue;
            }
            self.gather(s)?;
            for (d, stage) in self.stages.iter_mut().map(|own| &mut own[s]).enumerate() {
                let k = stage.kernels.clone();
                let mut run = || -> Result<()> {
                    stage.feed(rows[d].0, inputs[s][d].as_deref())?;
                    match output_grads[d].as_deref() {
                        Some(g) => stage.set_output_gradient(g)?,
                        None => stage.set_targets(rows[d].1, scale.unwrap_or(1.0))?,
                    }
                    stage.backward(true)
                };
                run().map_err(|e| on_device(d, &k, e))?;
            }
            inputs[s] = vec![None; devices];
            if s == last && read_loss {
                for (d, own) in self.stages.iter().enumerate() {
                    loss += weights[d] * f64::from(own[s].loss_value().map_err(|e| on_device(d, &own[s].kernels, e))?);
                }
            }
            if s > 0 {
                let views = self
                    .stages
                    .iter()
                    .map(|own| {
                        let view = own[s].input_gradient_view().ok_or_else(|| Error::Internal {
                            op: "ZeroStages",
                            reason: format!("stage {s} yields no input gradient"),
                        })??;
                        Ok((own[s].kernels.as_ref(), view))
                    })
                    .collect::<Result<Vec<_>>>()?;
                output_grads = to_host(&views, since)?.0.into_iter().map(Some).collect();
            }
            sums = sums.plus(self.reduce_scatter_stage(s, &weights, &mut pending, since)?);
        }
        self.last_grad_norm = Some(step_shards(&mut self.optimizers, &self.devices, sums, scale)?);
        if self.stage == ZeroStage::Gradients {
            self.gather_updated_shards()?;
        }
        if read_loss && !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                value: loss as f32,
                step: self.step_count(),
            });
        }
        Ok(read_loss.then_some(loss as f32))
    }

    /// The mean loss of one global batch without training, split as a step.
    pub fn evaluate_loss<'x>(&mut self, x: impl Into<Examples<'x>>, targets: Targets<'_>) -> Result<f32> {
        self.set_dropout(false);
        let (rows, inputs, since) = self.forward_to_last("ZeroStages::evaluate_loss", x.into(), targets)?;
        let last = self.stage_count() - 1;
        self.gather(last)?;
        for (d, stage) in self.stages.iter_mut().map(|own| &mut own[last]).enumerate() {
            let k = stage.kernels.clone();
            let mut run = || -> Result<()> {
                stage.feed(rows[d].0, inputs[last][d].as_deref())?;
                stage.set_targets(rows[d].1, 1.0)?;
                stage.forward_loss()
            };
            run().map_err(|e| on_device(d, &k, e))?;
        }
        let views = self
            .stages
            .iter()
            .map(|own| {
                let view = own[last].loss_view().ok_or_else(|| Error::Internal {
                    op: "ZeroStages",
                    reason: "the last stage has no loss".into(),
                })??;
                Ok((own[last].kernels.as_ref(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let (losses, _) = to_host(&views, since)?;
        let loss: f64 = losses
            .iter()
            .zip(self.weights())
            .map(|(l, w)| w * f64::from(l.first().copied().unwrap_or(f32::NAN)))
            .sum();
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                value: loss as f32,
                step: self.step_count(),
            });
        }
        Ok(loss as f32)
    }

    /// Predicted classes of feature rows, on device 0 in chunks of its rows.
    pub fn predict<'x>(&mut self, x: impl Into<Examples<'x>>) -> Result<Vec<u32>> {
        let features = features(x.into(), "ZeroStages::predict")?;
        let (inputs, rows) = (self.widths.inputs, self.shares[0]);
        super::outputs_in_chunks("ZeroStages::predict", features, inputs, rows, 1, |chunk| {
            self.predict_chunk(chunk)
        })
    }

    fn predict_chunk(&mut self, chunk: &[f32]) -> Result<Vec<u32>> {
        self.set_dropout(false);
        let last = self.stage_count() - 1;
        let mut h: Option<Vec<f32>> = None;
        for s in 0..=last {
            self.gather(s)?;
            let stage = &mut self.stages[0][s];
            let k = stage.kernels.clone();
            stage
                .feed(Examples::Features(chunk), h.as_deref())
                .map_err(|e| on_device(0, &k, e))?;
            if s == last {
                return stage.predictions().map_err(|e| on_device(0, &k, e));
            }
            stage.forward().map_err(|e| on_device(0, &k, e))?;
            h = Some(k.read(stage.output_view()?).map_err(|e| on_device(0, &k, e))?);
        }
        Err(Error::InvalidArgument {
            op: "ZeroStages::predict",
            reason: "no stages".into(),
        })
    }

    /// The whole flat arena on the host from every device's `arena`.
    fn flat_on_host<'a>(&'a self, arena: impl Fn(usize) -> Result<View<'a>>) -> Result<Vec<f32>> {
        let pairs: Vec<(&Kernels, View<'_>)> = self
            .devices
            .iter()
            .enumerate()
            .map(|(d, k)| Ok((k.as_ref(), arena(d)?)))
            .collect::<Result<_>>()?;
        Ok(to_host(&pairs, Instant::now())?.0.concat())
    }

    /// Each device's shard of the whole state `arenas` (none: kept as is)
    /// and the step count (when given).
    fn write_state(&mut self, arenas: &[Vec<f32>], step: Option<u64>) -> Result<()> {
        for (d, (o, range)) in self.optimizers.iter_mut().zip(&self.shards).enumerate() {
            let k = &self.devices[d];
            for (arena, values) in o.state_arenas().into_iter().zip(arenas) {
                k.write(arena, &values[range.clone()]).map_err(|e| on_device(d, k, e))?;
            }
            o.import_state(k, &[], &[], step).map_err(|e| on_device(d, k, e))?;
        }
        Ok(())
    }
}

/// The part of the flat arena (`flat_len` elements) a device whose shard
/// is `shard` holds the parameters of at `stage`.
fn held_range(stage: ZeroStage, flat_len: usize, shard: &Range<usize>) -> Range<usize> {
    if stage == ZeroStage::Gradients {
        0..flat_len
    } else {
        shard.clone()
    }
}

/// A frozen parameter's values from its device buffer's `words` (f32 as
/// they are, f16 decoded); a block-quantized one has no f32 copy.
fn frozen_values(f: &FrozenSpan, words: &[f32]) -> Result<Vec<f32>> {
    let stored = &words[f.offset..f.offset + f.words];
    let len = f.shape.iter().product();
    match f.dtype {
        DType::F32 | DType::U32 => Ok(stored.to_vec()),
        DType::F16 => {
            let bits: Vec<u32> = stored.iter().map(|v| v.to_bits()).collect();
            Ok(crate::kernels::unpack_f16(&bits, len)
                .iter()
                .map(|h| h.to_f32())
                .collect())
        }
        DType::Quant(_) => Err(Error::InvalidArgument {
            op: "ZeroStages::parameters",
            reason: format!(
                "frozen parameter `{}` holds {}, which have no f32 copy to read",
                f.name,
                f.dtype.describe()
            ),
        }),
    }
}

fn undeclared(name: &str) -> Error {
    Error::InvalidArgument {
        op: "ZeroStages",
        reason: format!("the stages disagree on parameter `{name}`"),
    }
}

impl TrainEngine for ZeroStages {
    own_steps!(ZeroStages);
    /// Device 0's stages, for what reads an engine's layout; parameters,
    /// state and checkpoint come from the shards (the methods below).
    fn holding(&self) -> Holding<'_> {
        Holding::Stages(&self.spread, &self.stages[0])
    }
    /// The trainable parameters from the shards, then the frozen ones
    /// from device 0's copy.
    fn parameters(&self) -> Result<NamedParameters> {
        let flat = self.flat_on_host(|d| self.shard_params(d))?;
        let mut all: NamedParameters = self
            .spans
            .iter()
            .map(|p| {
                (
                    p.name.clone(),
                    p.shape.clone(),
                    flat[p.offset..p.offset + p.len()].to_vec(),
                )
            })
            .collect();
        if !self.frozen.is_empty() {
            let words: Vec<f32> = self.devices[0]
                .read(self.frozen_buffers[0].view())
                .map_err(|e| on_device(0, &self.devices[0], e))?;
            // A block-quantized base has no f32 values: it stays in its
            // file, as Executor::parameters leaves it out.
            for f in self.frozen.iter().filter(|f| !matches!(f.dtype, DType::Quant(_))) {
                all.push((f.name.clone(), f.shape.clone(), frozen_values(f, &words)?));
            }
        }
        Ok(all)
    }
    fn optimizer_state(&self) -> Result<NamedState> {
        let mut out = Vec::new();
        for (s, &name) in self.optimizer.state_names().iter().enumerate() {
            let flat = self.flat_on_host(|d| Ok(self.optimizers[d].state_arenas()[s]))?;
            out.extend(
                self.spans
                    .iter()
                    .map(|p| (p.name.clone(), name, flat[p.offset..p.offset + p.len()].to_vec())),
            );
        }
        Ok(out)
    }
    fn step_count(&self) -> u64 {
        self.optimizers[0].step_count()
    }
    fn checkpoint(&self) -> Result<Checkpoint> {
        let about = CheckpointAbout {
            model: &self.description,
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
    /// Parameters by name (the others keep their values) and the whole
    /// optimizer state, each checked before any device changes, then
    /// each device's shard of them.
    fn load_state(
        &mut self,
        params: &[(String, Vec<usize>, Vec<f32>)],
        state: &[(String, String, Vec<f32>)],
        step: Option<u64>,
    ) -> Result<()> {
        let op = "ZeroStages::load_state";
        let host = stage_state(self.optimizer.state_names(), self.flat_len, &self.spans, state)?;
        let mut flat = self.flat_on_host(|d| self.shard_params(d))?;
        let frozen = self.frozen_words_of(params)?;
        for (name, shape, values) in params
            .iter()
            .filter(|(n, _, _)| !self.frozen.iter().any(|f| &f.name == n))
        {
            let span = self
                .spans
                .iter()
                .find(|p| &p.name == name)
                .ok_or_else(|| Error::InvalidArgument {
                    op,
                    reason: format!("the model has no parameter `{name}`"),
                })?;
            if *shape != span.shape || values.len() != span.len() {
                return Err(Error::shape(
                    op,
                    format!("parameter `{name}` with {} values", values.len()),
                    &[&span.shape, shape],
                ));
            }
            flat[span.offset..span.offset + span.len()].copy_from_slice(values);
        }
        for (d, k) in self.devices.iter().enumerate() {
            k.write(self.params[d].view(), &flat[self.held(d)])
                .map_err(|e| on_device(d, k, e))?;
            for (f, words) in &frozen {
                k.write(self.frozen_buffers[d].slice(f.offset, f.words)?, words)
                    .map_err(|e| on_device(d, k, e))?;
            }
        }
        let host = if state.is_empty() { Vec::new() } else { host };
        self.write_state(&host, step)
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
        let pool = self.pools.iter().map(|p| p.params.len()).max().unwrap_or(0);
        let (parameters, gathered) = match self.stage {
            ZeroStage::Gradients => ("whole parameters", "copied from the device's whole parameters"),
            _ => ("a shard of the parameters", "gathered from the shards"),
        };
        let m = self.memory();
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0));
        let parameters = if self.frozen.is_empty() {
            parameters.to_string()
        } else {
            format!("{parameters} (trainable; {} frozen ones whole)", self.frozen.len())
        };
        format!(
            "ZeRO stage {} (sharded data parallel) stage by stage, {parameters} on each device: {} stages {gathered} into a pooled arena of {pool} elements before their forward and backward, gradients reduce-scattered after each stage's backward; batch split {}, flat arena shards of [{}] elements; kept per device between steps: parameters {}, gradients {} (the shard and one stage's arena), optimizer state {}",
            self.stage.number(),
            self.stage_count(),
            rows.join(", "),
            shards.join(", "),
            mib(m.parameters),
            mib(m.gradients),
            mib(m.optimizer_state)
        )
    }
    /// One device's dispatches (its stages' and its optimizer's) and the
    /// bytes of the device holding the most.
    fn footprint(&self) -> Footprint {
        let dispatches = self.stages[0]
            .iter()
            .map(|s| s.executor().dispatches_per_step())
            .sum::<usize>()
            + self.optimizers[0].dispatches().count();
        Footprint {
            dispatches_per_step: dispatches,
            peak_bytes: self.memory().total(),
            intermediates: None,
        }
    }
    fn shares(&self) -> Vec<usize> {
        self.shares.clone()
    }
    /// What each device allocated: its shards, its pools, its stages'
    /// inputs and intermediates (the device holding the most).
    fn memory(&self) -> DeviceMemory {
        let states = self.optimizer.state_names().len();
        DeviceMemory::fullest((0..self.devices.len()).map(|d| {
            let pool = &self.pools[d];
            let slots: Vec<usize> = pool.slots.iter().map(GpuTensor::len).collect();
            let inputs = self.stages[d].iter().map(|s| s.executor().plan().input_bytes).sum();
            device_memory(
                (self.params[d].len(), self.frozen_words),
                self.shards[d].len(),
                (pool.params.len(), pool.grads.len()),
                &slots,
                inputs,
                states,
            )
        }))
    }
}

/// Device `k`'s stages of `model` on `rows` rows over one pool of arenas
/// and slots, planned at `alignment` bytes; with `initial`, each
/// parameter's first words (as its stage's arena stores them) read back
/// from the pool as each stage is made.
fn device_stages(
    k: &Arc<Kernels>,
    model: &dyn Staged,
    rows: usize,
    (criterion, optimizer): (Criterion, &OptimizerConfig),
    precision: Precision,
    alignment: u32,
    mut initial: Option<&mut HashMap<String, Vec<f32>>>,
) -> Result<(Vec<Stage>, ArenaPool)> {
    let graphs = stage_graphs(model, rows, criterion, optimizer, precision)?;
    // The group's alignment on every device, so the plan made without
    // devices is exact on unlike adapters too.
    let plans: Vec<Plan> = graphs.iter().map(|(s, _, _)| plan_stage(s, alignment)).collect();
    let (arena, grad_arena, slots) = pool_lengths(&plans);
    let pool = ArenaPool {
        params: k.zeros(arena)?,
        grads: k.zeros(grad_arena)?,
        slots: slots.into_iter().map(|len| k.zeros(len)).collect::<Result<_>>()?,
    };
    let mut own = Vec::with_capacity(graphs.len());
    for (s, input, output) in graphs {
        let stage = Stage::with_arenas(k.clone(), s, input, output, &pool, alignment)?;
        if let Some(initial) = initial.as_deref_mut() {
            let arena = k.read::<f32>(pool.params.view())?;
            let (exec, g) = (stage.executor(), stage.executor().graph());
            for &(p, offset) in &exec.plan().param_offsets {
                let node = g.node(p);
                let words = stored_words(node.dtype, node.len());
                initial
                    .entry(node.name.clone())
                    .or_insert_with(|| arena[offset..offset + words].to_vec());
            }
        }
        own.push(stage);
    }
    Ok((own, pool))
}

/// Where each device's stages hold each frozen parameter: (index in
/// `frozen`, word offset in the stage's arena), stage by stage.
fn frozen_placements(stages: &[Vec<Stage>], frozen: &[FrozenSpan]) -> Result<Vec<Vec<Vec<(usize, usize)>>>> {
    stages
        .iter()
        .map(|own| {
            own.iter()
                .map(|stage| {
                    let (exec, g) = (stage.executor(), stage.executor().graph());
                    exec.plan()
                        .param_offsets
                        .iter()
                        .filter(|&&(p, _)| g.is_frozen(p))
                        .map(|&(p, offset)| {
                            let name = &g.node(p).name;
                            frozen
                                .iter()
                                .position(|f| &f.name == name)
                                .map(|i| (i, offset))
                                .ok_or_else(|| undeclared(name))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect()
}

/// The flat arena of `declared` (name, shape, weight decay applies):
/// weight-decayed parameters first (AdamW's one boundary), each group in
/// declaration order; the spans listed in declaration order (as an
/// executor's), the arena's length and the decayed prefix's.
fn flat_layout(declared: &[(String, Vec<usize>, bool)]) -> (Vec<ParamSpan>, usize, usize) {
    let mut offsets = vec![0; declared.len()];
    let mut offset = 0;
    for decayed in [true, false] {
        for (i, (_, shape, _)) in declared
            .iter()
            .enumerate()
            .filter(|(_, (_, _, decays))| *decays == decayed)
        {
            offsets[i] = offset;
            offset += shape.iter().product::<usize>();
        }
    }
    let spans: Vec<ParamSpan> = declared
        .iter()
        .zip(offsets)
        .map(|((name, shape, _), offset)| ParamSpan {
            name: name.clone(),
            shape: shape.clone(),
            offset,
        })
        .collect();
    let (flat_len, decay_len) = (
        offset,
        declared
            .iter()
            .filter(|(_, _, decays)| *decays)
            .map(|(_, shape, _)| shape.iter().product::<usize>())
            .sum::<usize>(),
    );
    (spans, flat_len, decay_len)
}

/// Where each device's stages hold each span: (span index, offset in the
/// stage's arena), stage by stage.
fn placements(stages: &[Vec<Stage>], spans: &[ParamSpan]) -> Result<Vec<Vec<Vec<(usize, usize)>>>> {
    let index: HashMap<&str, usize> = spans.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
    stages
        .iter()
        .map(|own| {
            own.iter()
                .map(|stage| {
                    stage
                        .executor()
                        .parameter_spans()
                        .into_iter()
                        .map(|p| {
                            index
                                .get(p.name.as_str())
                                .map(|&i| (i, p.offset))
                                .ok_or_else(|| undeclared(&p.name))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()
}
