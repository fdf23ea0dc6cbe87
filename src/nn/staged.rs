//! A whole model cut into the units a pipeline places on devices: a
//! prologue (the model's input to the residual stream), blocks (stream to
//! stream) and an epilogue (stream to the output the loss reads), as
//! GPipe and Megatron cut a transformer into layers.

use super::Module;
use crate::error::Result;
use crate::graph::{Block, Graph, Tensor};

/// The forward work of each unit, in any one unit of measure (multiply-adds
/// per example): what a pipeline partitioner evens out over its stages.
/// A prologue or epilogue of cost 0 does nothing worth a stage of its own
/// (an MLP's identity); it goes with its neighbouring block.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    pub prologue: f64,
    pub blocks: Vec<f64>,
    pub epilogue: f64,
}

/// A model a pipeline can cut into stages. Each unit declares its
/// parameters by its full name in the whole model (`h.3.attn.c_attn.`), so
/// a stage's graph holds the single-device model's names; a unit that
/// reads a parameter another unit also declares (a head tied to the token
/// embedding) declares it again by the same name, and the pipeline finds
/// the copies. [`Module::forward`] of such a model is
/// [`Staged::forward_units`]; [`Module::input`] declares the prologue's
/// input.
///
/// Implementing it for a model (Llama, for instance): `prologue` looks up
/// the token embedding (`model.embed_tokens.`), `block(i)` runs decoder
/// layer i (`model.layers.{i}.`), `epilogue` the final norm and the head
/// (`lm_head.`, or the embedding table again when tied), and `stage_costs`
/// gives each one's multiply-adds per sequence.
pub trait Staged: Module {
    /// The model input (as [`Module::input`] declared it) to the stream.
    fn prologue(&self, g: &mut Graph, input: Tensor) -> Result<Tensor>;

    /// Block `index` on the stream.
    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor>;

    /// The stream to the output the loss reads (logits).
    fn epilogue(&self, g: &mut Graph, x: Tensor) -> Result<Tensor>;

    /// Each unit's forward work; `blocks.len()` is the number of blocks.
    fn stage_costs(&self) -> StageCosts;

    /// Blocks `blocks` of the model, with the prologue first when `first`
    /// and the epilogue last when `last`: one pipeline stage.
    fn forward_units(
        &self,
        g: &mut Graph,
        x: Tensor,
        blocks: std::ops::Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<Tensor> {
        self.forward_blocks(g, x, blocks, first, last).map(|(output, _)| output)
    }

    /// [`Staged::forward_units`] with the nodes each block added to `g`
    /// and its output: what activation checkpointing recomputes.
    fn forward_blocks(
        &self,
        g: &mut Graph,
        x: Tensor,
        blocks: std::ops::Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<(Tensor, Vec<Block>)> {
        let mut x = if first { self.prologue(g, x)? } else { x };
        let mut added = Vec::with_capacity(blocks.len());
        for i in blocks {
            let start = g.len();
            x = self.block(g, i, x)?;
            added.push(Block {
                nodes: start..g.len(),
                output: x,
            });
        }
        let output = if last { self.epilogue(g, x)? } else { x };
        Ok((output, added))
    }
}
