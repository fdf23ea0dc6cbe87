//! What a trainer runs, before any device: a model's graph for a batch, its
//! loss, the argmax and the backward pass, with the rewriting passes
//! (recomputed blocks, f16 activations) a step asks for. The engines
//! (`crate::parallel`) and the predictor (`crate::infer`) build from here.

use crate::error::{Error, Result};
use crate::graph::{Block, Gradients, Graph, Remap, Tensor};
use crate::nn::{Criterion, Module, Staged};

/// The model's input, output and its per-example widths.
pub(crate) struct Built {
    pub(crate) input: Tensor,
    pub(crate) output: Tensor,
    pub(crate) in_per_example: usize,
    pub(crate) out_per_example: usize,
}

fn check_batch(batch_size: usize) -> Result<()> {
    if batch_size == 0 {
        return Err(Error::InvalidArgument {
            op: "Trainer::new",
            reason: "the batch size must be at least 1".into(),
        });
    }
    Ok(())
}

pub(crate) fn build_model(g: &mut Graph, model: &dyn Module, batch_size: usize) -> Result<Built> {
    check_batch(batch_size)?;
    let input = model.input(g, batch_size)?;
    let output = model.forward(g, input, "")?;
    Ok(built(g, input, output, batch_size))
}

fn built(g: &Graph, input: Tensor, output: Tensor, batch_size: usize) -> Built {
    let len = |t: Tensor| g.shape_of(t).map_or(0, |s| s.iter().product::<usize>());
    Built {
        input,
        output,
        in_per_example: len(input) / batch_size,
        out_per_example: len(output) / batch_size,
    }
}

/// [`build_model`] unit by unit, with the node range each block added.
fn build_blocks(g: &mut Graph, model: &dyn Staged, batch_size: usize) -> Result<(Built, Vec<Block>)> {
    check_batch(batch_size)?;
    let input = model.input(g, batch_size)?;
    let (output, blocks) = model.forward_blocks(g, input, 0..model.stage_costs().blocks.len(), true, true)?;
    Ok((built(g, input, output, batch_size), blocks))
}

/// What a trainer runs, before any device: `model → criterion` on
/// `batch_size` examples, the argmax and the backward pass.
pub(crate) struct TrainingGraph {
    pub(crate) graph: Graph,
    pub(crate) built: Built,
    pub(crate) target: Tensor,
    pub(crate) loss: Tensor,
    pub(crate) prediction: Tensor,
    pub(crate) grads: Gradients,
}

impl TrainingGraph {
    /// What a trainer's executor is planned to keep readable.
    pub(crate) fn outputs(&self) -> [Tensor; 3] {
        [self.built.output, self.prediction, self.loss]
    }

    /// The graph a rewriting pass (recomputed blocks, f16 activations)
    /// makes of this one, with every tensor the trainer names carried over.
    fn remapped(self, pass: impl FnOnce(&Graph, &Gradients) -> Result<(Graph, Gradients, Remap)>) -> Result<Self> {
        let (graph, grads, at) = pass(&self.graph, &self.grads)?;
        let built = Built {
            input: at.tensor(self.built.input),
            output: at.tensor(self.built.output),
            ..self.built
        };
        Ok(TrainingGraph {
            graph,
            built,
            target: at.tensor(self.target),
            loss: at.tensor(self.loss),
            prediction: at.tensor(self.prediction),
            grads,
        })
    }
}

pub(crate) fn training_graph(
    model: &dyn Module,
    checkpointed: Option<&dyn Staged>,
    criterion: Criterion,
    batch_size: usize,
) -> Result<TrainingGraph> {
    let mut graph = Graph::new();
    let (built, blocks) = match checkpointed {
        Some(m) => build_blocks(&mut graph, m, batch_size)?,
        None => (build_model(&mut graph, model, batch_size)?, Vec::new()),
    };
    let target = criterion.targets(&mut graph, built.output)?;
    let loss = criterion.loss(&mut graph, built.output, target)?;
    let prediction = graph.argmax(built.output)?;
    let grads = graph.backward(loss)?;
    let t = TrainingGraph {
        graph,
        built,
        target,
        loss,
        prediction,
        grads,
    };
    if blocks.is_empty() {
        Ok(t)
    } else {
        t.remapped(|g, grads| g.with_recomputed_blocks(grads, &blocks))
    }
}

/// [`training_graph`] with the passes a trainer applies: `staged`'s
/// blocks recomputed in the backward when `checkpoint`, the activations
/// the backward reads stored in f16 when `f16` (the caller knows whether
/// the device has SHADER_F16; a plan without a device assumes it).
pub(crate) fn training_graph_with_passes(
    model: &dyn Module,
    staged: Option<&dyn Staged>,
    criterion: Criterion,
    batch_size: usize,
    checkpoint: bool,
    f16: bool,
) -> Result<TrainingGraph> {
    let t = training_graph(model, staged.filter(|_| checkpoint), criterion, batch_size)?;
    if f16 {
        t.remapped(|g, grads| g.with_f16_activations(grads))
    } else {
        Ok(t)
    }
}
