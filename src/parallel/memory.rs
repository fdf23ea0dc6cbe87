//! Bytes per device of training under each strategy, by what they hold.
//! A run prints its engine's ([`super::engine::TrainEngine::memory`], read
//! from its executors' plans); [`strategy_memory`] computes the same for
//! any strategy without a device, by planning the graphs that strategy's
//! engine would build (the plan fixes the arenas and the intermediate
//! slots). Nothing is allocated but those graphs on the host, which hold
//! the model's initial values.

use super::data::ARENA_ALIGNMENT;
use super::engine::{Parallelizable, Strategy};
use super::pipeline::{partition, unit_graph_blocks};
use super::stage::{StageEnd, StageGraph};
use super::tensor::{build_rank, TensorParallel};
use super::zero::{shard_ranges, ZeroStage};
use crate::error::Result;
use crate::graph::{Block, Gradients, Graph, Plan, PlanOptions, Precision, Tensor};
use crate::kernels::OptimizerConfig;
use crate::nn::training_graph_with_passes;
use crate::nn::Criterion;
use crate::optim::apply_parameter_groups;

const BYTES: u64 = 4;

/// Bytes on one device, by what they hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    /// Inputs and the planned intermediates of a step.
    pub activations: u64,
}

impl DeviceMemory {
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state + self.activations
    }

    /// An executor's: its plan's parameter arena, the gradient arena and
    /// one arena per optimizer state when training (both the trainable
    /// parameters' length: a frozen base has neither), inputs and slots.
    pub fn of_plan(plan: &Plan, training: bool, state_arenas: usize) -> Self {
        let arena = plan.param_arena_len as u64 * BYTES;
        let trainable = plan.trainable_len as u64 * BYTES;
        let gradients = if training { trainable } else { 0 };
        DeviceMemory {
            parameters: arena,
            gradients,
            optimizer_state: trainable * state_arenas as u64,
            activations: plan.input_bytes + plan.slot_bytes,
        }
    }

    pub fn plus(self, other: DeviceMemory) -> Self {
        DeviceMemory {
            parameters: self.parameters + other.parameters,
            gradients: self.gradients + other.gradients,
            optimizer_state: self.optimizer_state + other.optimizer_state,
            activations: self.activations + other.activations,
        }
    }

    /// The device holding the most of `devices` (none: zeros).
    pub fn fullest(devices: impl IntoIterator<Item = DeviceMemory>) -> Self {
        devices.into_iter().max_by_key(DeviceMemory::total).unwrap_or_default()
    }

    /// What ZeRO's `stage` keeps on a device whose shard of the arena has
    /// `shard_len` elements, the replica holding `replica`: the optimizer
    /// state, and from stage 2 the gradients, at 3 the parameters, of its
    /// shard only.
    /// The shards cover the trainable parameters (the gradient arena's
    /// length); a frozen base stays whole on every device.
    pub fn zero_kept(replica: DeviceMemory, stage: ZeroStage, shard_len: usize) -> Self {
        let shard = shard_len as u64 * BYTES;
        let trainable = replica.gradients.max(1);
        let frozen = replica.parameters.saturating_sub(replica.gradients);
        let sharded = |bytes: u64, from: ZeroStage| if stage >= from { shard } else { bytes };
        DeviceMemory {
            parameters: frozen + sharded(replica.gradients, ZeroStage::Parameters),
            gradients: sharded(replica.gradients, ZeroStage::Gradients),
            optimizer_state: replica.optimizer_state / trainable * shard,
            activations: replica.activations,
        }
    }
}

/// What a planned run trains with, besides the model and the strategy.
#[derive(Clone, Copy, Debug)]
pub struct Planning {
    pub criterion: Criterion,
    pub optimizer: OptimizerConfig,
    /// Global batch per step.
    pub batch: usize,
    /// Pipeline micro-batches per step.
    pub micro_batches: usize,
    /// Least byte alignment of each parameter in the arenas on the device:
    /// a single-device executor uses the device's own
    /// `min_storage_buffer_offset_alignment`; every multi-device engine
    /// the group's largest, at least [`ARENA_ALIGNMENT`] (so unlike
    /// adapters plan alike). 256 where the device is not known (the
    /// largest any API allows).
    pub device_alignment: u32,
    /// Where the activations the backward reads are kept. f16 is planned
    /// as a device with SHADER_F16 runs it (a run on devices without it
    /// falls back to f32).
    pub precision: Precision,
    /// `--checkpoint-activations`: each engine recomputes what it
    /// recomputes under [`PlanOptions::checkpoint_activations`].
    pub checkpoint_activations: bool,
}

impl Planning {
    fn f16(&self) -> bool {
        self.precision == Precision::F16
    }
}

/// `graph` planned as an executor with an optimizer would plan it.
fn plan(
    mut graph: Graph,
    outputs: &[Tensor],
    grads: &Gradients,
    optimizer: &OptimizerConfig,
    alignment: u32,
) -> Result<Plan> {
    apply_parameter_groups(&mut graph, optimizer)?;
    Ok(Plan::with_options(
        &graph,
        outputs,
        Some(grads),
        (alignment as usize / BYTES as usize).max(1),
        PlanOptions::default(),
    ))
}

/// One replica's executor for `rows` rows (a single-device, data
/// parallel or ZeRO-1 trainer's, with the same passes), and its arena
/// length.
fn replica<M: Parallelizable>(model: &M, p: &Planning, rows: usize, alignment: u32) -> Result<(DeviceMemory, usize)> {
    let t = training_graph_with_passes(model, Some(model), p.criterion, rows, p.checkpoint_activations, p.f16())?;
    let outputs = t.outputs();
    let plan = plan(t.graph, &outputs, &t.grads, &p.optimizer, alignment)?;
    Ok((
        DeviceMemory::of_plan(&plan, true, p.optimizer.state_names().len()),
        plan.trainable_len,
    ))
}

/// A stage's executor over `graph` (`input -> output`, made of
/// `blocks`), with the passes [`super::stage::Stage::with_options`]
/// applies.
fn stage(
    graph: Graph,
    blocks: &[Block],
    input: Tensor,
    output: Tensor,
    input_grad: bool,
    end: StageEnd,
    p: &Planning,
) -> Result<DeviceMemory> {
    let s = StageGraph::complete(graph, input, output, input_grad, end)?.with_passes(
        blocks,
        p.checkpoint_activations,
        p.f16(),
        &mut [input, output],
    )?;
    let plan = plan(
        s.graph,
        &s.outputs,
        &s.grads,
        &p.optimizer,
        p.device_alignment.max(ARENA_ALIGNMENT),
    )?;
    Ok(DeviceMemory::of_plan(&plan, true, p.optimizer.state_names().len()))
}

/// The device holding the most under `strategy` on `devices` devices,
/// planned without a device: an error where the strategy cannot share
/// the model so (tensor parallel's splits, the pipeline's stages, rows
/// per device). ZeRO-1's is the whole-arena engine's (whole parameters
/// and gradients, the state's shard: [`DeviceMemory::zero_kept`]); ZeRO-2's
/// and 3's are what the stage-by-stage engine allocates
/// ([`super::zero_stages::planned_memory`]). Every graph takes the passes
/// its engine applies under `p`'s precision and checkpointing.
pub fn strategy_memory<M: Parallelizable>(
    model: &M,
    strategy: Strategy,
    devices: usize,
    p: &Planning,
) -> Result<DeviceMemory> {
    strategy.check_devices(devices, model, p.batch, None, p.micro_batches)?;
    let group_alignment = p.device_alignment.max(ARENA_ALIGNMENT);
    // Data parallel's and ZeRO's even split: the first devices take a row more.
    let rows = p.batch.div_ceil(devices);
    match strategy {
        Strategy::Single => Ok(replica(model, p, p.batch, p.device_alignment)?.0),
        Strategy::Data => Ok(replica(model, p, rows, group_alignment)?.0),
        Strategy::Zero(stage @ (ZeroStage::Gradients | ZeroStage::Parameters)) => {
            super::zero_stages::planned_memory(model, stage, devices, p)
        }
        Strategy::Zero(stage) => {
            let (memory, arena_len) = replica(model, p, rows, group_alignment)?;
            let largest = shard_ranges(arena_len, devices, group_alignment as usize / BYTES as usize)?
                .iter()
                .map(|r| r.len())
                .max()
                .unwrap_or(0);
            Ok(DeviceMemory::zero_kept(memory, stage, largest))
        }
        Strategy::Tensor => {
            TensorParallel::check(model, devices, p.batch)?;
            let mut per_device = vec![DeviceMemory::default(); devices];
            for (r, held) in per_device.iter_mut().enumerate() {
                let build = build_rank(model, r, devices, p.batch)?;
                let last = build.segments.len() - 1;
                for (i, seg) in build.segments.into_iter().enumerate() {
                    // As the engine: the last segment and the loss on #0 only.
                    if i == last && r > 0 {
                        continue;
                    }
                    let end = if i == last {
                        StageEnd::Last(p.criterion)
                    } else {
                        StageEnd::Middle
                    };
                    *held = held.plus(stage(seg.graph, &[], seg.input, seg.output, i > 0, end, p)?);
                }
            }
            Ok(DeviceMemory::fullest(per_device))
        }
        Strategy::Pipeline => {
            let blocks = partition(&model.stage_costs(), devices)?;
            let (last, micro_rows) = (devices - 1, p.batch / p.micro_batches);
            let (mut start, mut stream) = (0, Vec::new());
            let mut per_device = Vec::with_capacity(devices);
            for (i, &count) in blocks.iter().enumerate() {
                let (g, input, output, units) =
                    unit_graph_blocks(model, i == 0, i == last, start..start + count, micro_rows, &mut stream)?;
                let end = if i == last {
                    StageEnd::Last(p.criterion)
                } else {
                    StageEnd::Middle
                };
                per_device.push(stage(g, &units, input, output, i > 0, end, p)?);
                start += count;
            }
            Ok(DeviceMemory::fullest(per_device))
        }
    }
}

/// Every strategy's name and value, in the order a table lists them.
pub fn every_strategy() -> Vec<(String, Strategy)> {
    let mut all = vec![("data".to_string(), Strategy::Data)];
    for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients, ZeroStage::Parameters] {
        all.push((format!("zero-{}", stage.number()), Strategy::Zero(stage)));
    }
    all.push(("tensor".into(), Strategy::Tensor));
    all.push(("pipeline".into(), Strategy::Pipeline));
    all
}
