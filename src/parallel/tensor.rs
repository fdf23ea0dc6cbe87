//! Tensor parallel training, Megatron style, for an MLP block
//! `Linear(d, h) → activation → Linear(h, o)` inside a model:
//!
//! - the first Linear is split by columns (its h outputs): device p holds
//!   rows p of W1 [h, d] and b1, and computes its slice of the hidden layer;
//! - the activation is applied locally to that slice;
//! - the second Linear is split by rows (its h inputs): device p holds the
//!   matching columns of W2 [o, h] and produces a partial output [B, o];
//! - one all-reduce sums the partial outputs in the forward pass (then the
//!   bias b2 is added once), and one all-reduce sums the partial input
//!   gradients in the backward pass.
//!
//! Layers before and after the block run as plain stages on device 0.

use std::time::{Duration, Instant};

use super::collectives::to_host;
use super::data::proportional_split;
use super::stage::{add_layers, width_after, Stage, StageEnd};
use super::{on_device, DeviceGroup};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::kernels::{Kernels, MatmulForm, OptimizerConfig, View};
use crate::nn::{Criterion, Layer, Sequential};
use crate::trainer::Targets;

/// Time accounting for the last steps.
#[derive(Clone, Debug, Default)]
pub struct TensorParallelStats {
    pub steps: u64,
    pub wall: Duration,
    /// Host transfers: writes of activations and gradients to the shards,
    /// and the two all-reduces after the slowest shard finished.
    pub communication: Duration,
}

pub struct TensorParallel {
    pre: Option<Stage>,
    shards: Vec<Stage>,
    post: Stage,
    /// Hidden units held by each device.
    hidden_split: Vec<usize>,
    batch: usize,
    in_features: usize,
    block_in: usize,
    block_out: usize,
    out_features: usize,
    block_start: usize,
    stats: TensorParallelStats,
}

/// Sums the views on the host; also returns the time spent after the
/// slowest device's data arrived (the transfer and sum, not the compute).
pub(super) fn sum_on_host(views: &[(&Kernels, View<'_>)]) -> Result<(Vec<f32>, Duration)> {
    let start = Instant::now();
    let (values, arrived) = to_host(views, start)?;
    let n = values.first().map_or(0, Vec::len);
    let sum = (0..n).map(|j| values.iter().map(|v| f64::from(v[j])).sum::<f64>() as f32).collect();
    let slowest = arrived.into_iter().max().unwrap_or_default();
    Ok((sum, start.elapsed().saturating_sub(slowest)))
}

impl TensorParallel {
    /// True for `Linear, activation, Linear`, the block this splits.
    pub fn is_block(layers: &[Layer]) -> bool {
        matches!(layers, [Layer::Linear(_), act, Layer::Linear(_)] if !matches!(act, Layer::Linear(_)))
    }

    /// Splits the block whose first Linear is `model.layers[block_start]`
    /// over every device of `group`.
    pub fn new(
        group: &DeviceGroup,
        model: &Sequential,
        criterion: impl Into<Criterion>,
        optimizer: impl Into<OptimizerConfig>,
        batch: usize,
        block_start: usize,
    ) -> Result<Self> {
        let criterion = criterion.into();
        let optimizer = optimizer.into();
        if optimizer.clip_grad_norm().is_some() {
            // Each device would clip by the norm of its own share of the
            // parameters, not torch's global norm.
            return Err(Error::InvalidArgument { op: "TensorParallel", reason: "clip_grad_norm is not supported here (data parallel only)".into() });
        }
        let layers = &model.layers;
        let bad = |reason: String| Error::InvalidArgument { op: "TensorParallel", reason };
        let (first, act, second) = match layers.get(block_start..block_start + 3) {
            Some(block @ [Layer::Linear(a), act, Layer::Linear(b)]) if Self::is_block(block) => (a, act.clone(), b),
            _ => return Err(bad(format!("layers {block_start}..{} must be Linear, activation, Linear", block_start + 3))),
        };
        let p = group.len();
        let hidden = first.out_features;
        if hidden < p {
            return Err(bad(format!("{hidden} hidden units cannot be split over {p} devices")));
        }
        let hidden_split = proportional_split(hidden, &vec![1.0; p])?;
        let in_features = model.in_features().ok_or_else(|| bad("no Linear layer".into()))?;
        let indexed: Vec<(usize, Layer)> = layers.iter().cloned().enumerate().collect();
        let pre_layers = &indexed[..block_start];
        let post_layers = &indexed[block_start + 3..];
        let block_in = width_after(pre_layers, in_features);
        let block_out = second.out_features;
        let consistent = first.in_features == block_in
            && second.in_features == hidden
            && first.weight.len() == hidden * block_in
            && first.bias.as_ref().is_some_and(|b| b.len() == hidden)
            && second.weight.len() == block_out * hidden
            && second.bias.as_ref().is_some_and(|b| b.len() == block_out);
        if !consistent {
            return Err(bad(format!(
                "the block's Linear layers do not fit together: Linear({}, {}) after width {block_in}, then Linear({}, {})",
                first.in_features, hidden, second.in_features, block_out
            )));
        }
        let k0 = group.members()[0].clone();

        let pre = if pre_layers.is_empty() {
            None
        } else {
            Some(Stage::new(k0.clone(), pre_layers, batch, in_features, false, StageEnd::Middle, optimizer).map_err(|e| on_device(0, &k0, e))?)
        };

        let (i1, i2) = (block_start, block_start + 2);
        let mut shards = Vec::with_capacity(p);
        let mut start = 0;
        for (d, (k, &width)) in group.members().iter().zip(&hidden_split).enumerate() {
            // Column-parallel W1: rows start..start+width of [h, d_in].
            let w1: Vec<f32> = first.weight[start * block_in..(start + width) * block_in].to_vec();
            let b1: Vec<f32> = first.bias.as_deref().unwrap_or_default()[start..start + width].to_vec();
            // Row-parallel W2: columns start..start+width of [o, h].
            let w2: Vec<f32> = (0..block_out).flat_map(|r| second.weight[r * hidden + start..r * hidden + start + width].to_vec()).collect();
            let mut g = Graph::new();
            let x = g.input("block_input", &[batch, block_in])?;
            let w1 = g.parameter(&format!("{i1}.weight"), &[width, block_in], w1)?;
            let b1 = g.parameter(&format!("{i1}.bias"), &[width], b1)?;
            let h = g.matmul_form(MatmulForm::ABt, x, w1)?;
            let h = g.bias_add(h, b1)?;
            let a = add_layers(&mut g, &[(block_start + 1, act.clone())], h)?;
            let w2 = g.parameter(&format!("{i2}.weight"), &[block_out, width], w2)?;
            let partial = g.matmul_form(MatmulForm::ABt, a, w2)?;
            let stage = Stage::from_graph(k.clone(), g, x, partial, true, StageEnd::Middle, optimizer, batch, block_in, block_out)
                .map_err(|e| on_device(d, k, e))?;
            shards.push(stage);
            start += width;
        }

        // The post stage adds b2 once, then the plain layers after the block, then the loss.
        let mut g = Graph::new();
        let y = g.input("block_output", &[batch, block_out])?;
        let b2 = g.parameter(&format!("{i2}.bias"), &[block_out], second.bias.clone().unwrap_or_default())?;
        let h = g.bias_add(y, b2)?;
        let out = add_layers(&mut g, post_layers, h)?;
        let out_features = g.shape(out)[1];
        let post = Stage::from_graph(k0.clone(), g, y, out, true, StageEnd::Last(criterion), optimizer, batch, block_out, out_features)
            .map_err(|e| on_device(0, &k0, e))?;
        Ok(TensorParallel {
            pre,
            shards,
            post,
            hidden_split,
            batch,
            in_features,
            block_in,
            block_out,
            out_features,
            block_start,
            stats: TensorParallelStats::default(),
        })
    }

    /// Hidden units of the block held by each device.
    pub fn hidden_split(&self) -> &[usize] {
        &self.hidden_split
    }

    pub fn stats(&self) -> &TensorParallelStats {
        &self.stats
    }

    /// The block's input for `x`: x itself, or the pre stage's output.
    fn block_input(&mut self, x: &[f32]) -> Result<Vec<f32>> {
        match &mut self.pre {
            None => Ok(x.to_vec()),
            Some(pre) => {
                let k = pre.kernels.clone();
                pre.set_input(x).map_err(|e| on_device(0, &k, e))?;
                pre.forward().map_err(|e| on_device(0, &k, e))?;
                k.read(pre.output_view()?).map_err(|e| on_device(0, &k, e))
            }
        }
    }

    /// Forward through the shards: the summed partial outputs (the forward
    /// all-reduce, on the host).
    fn block_forward(&mut self, block_x: &[f32]) -> Result<Vec<f32>> {
        let writes = Instant::now();
        for (d, shard) in self.shards.iter().enumerate() {
            shard.set_input(block_x).map_err(|e| on_device(d, &shard.kernels, e))?;
        }
        self.stats.communication += writes.elapsed();
        for (d, shard) in self.shards.iter_mut().enumerate() {
            let k = shard.kernels.clone();
            shard.forward().map_err(|e| on_device(d, &k, e))?;
        }
        let views: Vec<(&Kernels, View<'_>)> =
            self.shards.iter().map(|s| Ok((&*s.kernels, s.output_view()?))).collect::<Result<_>>()?;
        let (y, transfer) = sum_on_host(&views)?;
        self.stats.communication += transfer;
        Ok(y)
    }

    /// One optimizer step on `batch` rows; the mean loss when `read_loss`.
    pub fn step(&mut self, x: &[f32], targets: Targets<'_>, read_loss: bool) -> Result<Option<f32>> {
        if x.len() != self.batch * self.in_features {
            return Err(Error::shape("TensorParallel::step", format!("x must be {} × {}", self.batch, self.in_features), &[&[x.len()]]));
        }
        let wall = Instant::now();
        let block_x = self.block_input(x)?;
        let y = self.block_forward(&block_x)?;
        let k0 = self.post.kernels.clone();
        self.post.set_input(&y).map_err(|e| on_device(0, &k0, e))?;
        self.post.set_targets(targets, 1.0).map_err(|e| on_device(0, &k0, e))?;
        self.post.backward(true).map_err(|e| on_device(0, &k0, e))?;
        let dy = match self.post.input_gradient_view() {
            Some(v) => k0.read(v?).map_err(|e| on_device(0, &k0, e))?,
            None => return Err(Error::InvalidArgument { op: "TensorParallel", reason: "post stage without input gradient".into() }),
        };
        let writes = Instant::now();
        for (d, shard) in self.shards.iter().enumerate() {
            shard.set_input(&block_x).map_err(|e| on_device(d, &shard.kernels, e))?;
            shard.set_output_gradient(&dy).map_err(|e| on_device(d, &shard.kernels, e))?;
        }
        self.stats.communication += writes.elapsed();
        for (d, shard) in self.shards.iter_mut().enumerate() {
            let k = shard.kernels.clone();
            shard.backward(true).map_err(|e| on_device(d, &k, e))?;
        }
        if self.pre.is_some() {
            // The backward all-reduce: partial input gradients summed.
            let views: Vec<(&Kernels, View<'_>)> = self
                .shards
                .iter()
                .map(|s| match s.input_gradient_view() {
                    Some(v) => Ok((&*s.kernels, v?)),
                    None => Err(Error::InvalidArgument { op: "TensorParallel", reason: "shard without input gradient".into() }),
                })
                .collect::<Result<_>>()?;
            let (dx, transfer) = sum_on_host(&views)?;
            self.stats.communication += transfer;
            if let Some(pre) = &mut self.pre {
                pre.set_input(x).map_err(|e| on_device(0, &k0, e))?;
                pre.set_output_gradient(&dx).map_err(|e| on_device(0, &k0, e))?;
                pre.backward(true).map_err(|e| on_device(0, &k0, e))?;
                pre.optimizer_step().map_err(|e| on_device(0, &k0, e))?;
            }
        }
        for (d, shard) in self.shards.iter_mut().enumerate() {
            let k = shard.kernels.clone();
            shard.optimizer_step().map_err(|e| on_device(d, &k, e))?;
        }
        self.post.optimizer_step().map_err(|e| on_device(0, &k0, e))?;
        let loss = if read_loss {
            let l = self.post.loss_value().map_err(|e| on_device(0, &k0, e))?;
            if !l.is_finite() {
                return Err(Error::NonFiniteLoss { value: l, step: self.stats.steps + 1 });
            }
            Some(l)
        } else {
            None
        };
        self.stats.steps += 1;
        self.stats.wall += wall.elapsed();
        Ok(loss)
    }

    /// Model outputs for any number of rows (batch-sized chunks, padded).
    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        let (f, batch, width) = (self.in_features, self.batch, self.out_features);
        super::outputs_in_chunks("TensorParallel::outputs", features, f, batch, width, |chunk| {
            self.feed_post(chunk)?;
            let k0 = self.post.kernels.clone();
            self.post.forward().map_err(|e| on_device(0, &k0, e))?;
            k0.read(self.post.output_view()?).map_err(|e| on_device(0, &k0, e))
        })
    }

    /// Argmax of [`TensorParallel::outputs`], computed on device 0 after the
    /// last layers, which reads back one index per row instead of the outputs.
    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        let (f, batch) = (self.in_features, self.batch);
        super::outputs_in_chunks("TensorParallel::predict", features, f, batch, 1, |chunk| {
            self.feed_post(chunk)?;
            let k0 = self.post.kernels.clone();
            self.post.predictions().map_err(|e| on_device(0, &k0, e))
        })
    }

    /// Runs one chunk through the layers before and in the split block and
    /// sets the result as the last layers' input.
    fn feed_post(&mut self, chunk: &[f32]) -> Result<()> {
        let block_x = self.block_input(chunk)?;
        let y = self.block_forward(&block_x)?;
        let k0 = self.post.kernels.clone();
        self.post.set_input(&y).map_err(|e| on_device(0, &k0, e))
    }

    /// The whole model's parameters with single-device names and shapes:
    /// the shards of the block are gathered back into full matrices.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
        let mut all = Vec::new();
        if let Some(pre) = &self.pre {
            all.extend(pre.executor().parameters()?);
        }
        let (i1, i2) = (self.block_start, self.block_start + 2);
        let hidden: usize = self.hidden_split.iter().sum();
        let (mut w1, mut b1, mut w2) = (Vec::new(), Vec::new(), vec![0.0f32; self.block_out * hidden]);
        let mut col = 0;
        for (d, shard) in self.shards.iter().enumerate() {
            let width = self.hidden_split[d];
            for (name, _, values) in shard.executor().parameters().map_err(|e| on_device(d, &shard.kernels, e))? {
                if name == format!("{i1}.weight") {
                    w1.extend(values);
                } else if name == format!("{i1}.bias") {
                    b1.extend(values);
                } else if name == format!("{i2}.weight") {
                    for r in 0..self.block_out {
                        w2[r * hidden + col..r * hidden + col + width].copy_from_slice(&values[r * width..(r + 1) * width]);
                    }
                }
            }
            col += width;
        }
        all.push((format!("{i1}.weight"), vec![hidden, self.block_in], w1));
        all.push((format!("{i1}.bias"), vec![hidden], b1));
        all.push((format!("{i2}.weight"), vec![self.block_out, hidden], w2));
        all.extend(self.post.executor().parameters()?);
        Ok(all)
    }
}
