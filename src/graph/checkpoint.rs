//! Activation checkpointing (torch.utils.checkpoint per block): the
//! forward keeps only each block's input and output; whatever inside a
//! block the backward reads is computed again just before that block's
//! backward, from the block's input and the parameters. The caller names
//! the blocks (node ranges its model's `nn::Staged` units built), so this
//! pass knows no model.

use std::ops::Range;

use super::autodiff::Gradients;
use super::builder::{Graph, Node, Tensor};
use super::ops::{ElementwiseOp, Op};
use super::precision::Remap;
use crate::error::{Error, Result};

/// A block of the forward: the nodes its unit added and the tensor it
/// returned (kept, as the next block's input).
#[derive(Clone, Debug)]
pub struct Block {
    pub nodes: Range<usize>,
    pub output: Tensor,
}

impl Graph {
    /// This graph with each of `blocks` recomputed in the backward of
    /// `grads`: every node inside a block that the backward reads (and what
    /// it needs inside the block) is copied right before the first
    /// backward node that reads one of them (or before the fused dispatch
    /// that may compute that node), and the backward reads the copies, so
    /// the originals die as soon as the forward is done with them.
    pub fn with_recomputed_blocks(&self, grads: &Gradients, blocks: &[Block]) -> Result<(Graph, Gradients, Remap)> {
        let nodes = self.nodes();
        let count = nodes.len();
        let start = grads.backward_start().0;
        let mut block_of: Vec<Option<usize>> = vec![None; count];
        for (b, block) in blocks.iter().enumerate() {
            if block.nodes.end > start || block.output.0 >= count {
                return Err(Error::InvalidArgument {
                    op: "with_recomputed_blocks",
                    reason: format!("block {b} ({:?}) is not in this graph's forward", block.nodes),
                });
            }
            for i in block
                .nodes
                .clone()
                .filter(|&i| i != block.output.0 && !matches!(nodes[i].op, Op::Source(_)))
            {
                block_of[i] = Some(b);
            }
        }
        // What the backward reads inside blocks, with everything inside the
        // same block it depends on, and each writer with its companion.
        let mut recompute = vec![false; count];
        for node in &nodes[start..] {
            for t in &node.inputs {
                recompute[t.0] |= block_of[t.0].is_some();
            }
        }
        for _ in 0..2 {
            for i in (0..count).rev() {
                if recompute[i] {
                    for t in &nodes[i].inputs {
                        recompute[t.0] |= block_of[t.0].is_some() && block_of[t.0] == block_of[i];
                    }
                }
            }
            for i in 0..count {
                if let Some(c) = self.companion(Tensor(i)) {
                    let either = recompute[i] || recompute[c.0];
                    recompute[i] = either && block_of[i].is_some();
                    recompute[c.0] = either && block_of[c.0].is_some();
                }
            }
        }
        // Each block's copies go before the earliest place any of its
        // backward readers may run.
        let mut copies_at: Vec<Vec<usize>> = vec![Vec::new(); count];
        let mut anchor_of: Vec<Option<usize>> = vec![None; blocks.len()];
        for (r, node) in nodes.iter().enumerate().skip(start) {
            for t in node.inputs.iter().filter(|t| recompute[t.0]) {
                let Some(b) = block_of[t.0] else { continue };
                let anchor = self.backward_anchor(r, start);
                anchor_of[b] = Some(anchor_of[b].map_or(anchor, |a| a.min(anchor)));
            }
        }
        for (b, anchor) in anchor_of.iter().enumerate() {
            if let Some(a) = anchor {
                copies_at[*a].push(b);
            }
        }

        let mut out: Vec<Node> = Vec::with_capacity(count + recompute.iter().filter(|&&r| r).count());
        let mut map = vec![0usize; count];
        let mut copy: Vec<Option<usize>> = vec![None; count];
        let remapped_op = |op: &Op, map: &[usize]| match op {
            Op::Elementwise(ElementwiseOp::AccumulateGrad { param }) => ElementwiseOp::AccumulateGrad {
                param: Tensor(map[param.0]),
            }
            .into(),
            op => op.clone(),
        };
        for (i, node) in nodes.iter().enumerate() {
            for &b in &copies_at[i] {
                for j in blocks[b].nodes.clone().filter(|&j| recompute[j]) {
                    let inputs = nodes[j]
                        .inputs
                        .iter()
                        .map(|t| Tensor(copy[t.0].unwrap_or(map[t.0])))
                        .collect();
                    out.push(Node {
                        op: remapped_op(&nodes[j].op, &map),
                        inputs,
                        name: format!("{}.recomputed", nodes[j].name),
                        ..nodes[j].clone()
                    });
                    copy[j] = Some(out.len() - 1);
                }
            }
            let backward = i >= start;
            let inputs = node
                .inputs
                .iter()
                .map(|t| Tensor(copy[t.0].filter(|_| backward).unwrap_or(map[t.0])))
                .collect();
            out.push(Node {
                op: remapped_op(&node.op, &map),
                inputs,
                ..node.clone()
            });
            map[i] = out.len() - 1;
        }
        let graph = self.with_nodes(out, &map);
        Ok((graph, grads.remapped(&map), Remap::new(map)))
    }
}
