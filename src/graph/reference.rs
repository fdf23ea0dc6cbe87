//! The graph evaluated on the CPU in f64, node by node through each op's
//! CPU reference (`OpFamily::reference`): the independent forward that
//! gradients are checked against by central differences, and a reference
//! for any node a run computes.

use super::builder::{Graph, Tensor};
use super::ops::{ElementwiseOp, Op, ReferenceContext};
use crate::error::{Error, Result};

impl Graph {
    /// The values of `outputs` in f64, computing only the nodes they need
    /// (with the training step's semantics: gradients start at zero).
    /// `feeds` gives every input the outputs need (u32 ids and labels as
    /// their integer values) and, optionally, caches (zero otherwise).
    pub fn evaluate_f64(&self, outputs: &[Tensor], feeds: &[(Tensor, Vec<f64>)]) -> Result<Vec<Vec<f64>>> {
        let count = self.len();
        if let Some(bad) = outputs
            .iter()
            .chain(feeds.iter().map(|(t, _)| t))
            .find(|t| t.0 >= count)
        {
            return Err(Error::InvalidArgument {
                op: "evaluate_f64",
                reason: format!("tensor #{} is not in this graph", bad.0),
            });
        }
        let mut needed = vec![false; count];
        for t in outputs {
            needed[t.0] = true;
        }
        for i in (0..count).rev() {
            if needed[i] {
                for t in &self.nodes[i].inputs {
                    needed[t.0] = true;
                }
                // An accumulation adds onto what the earlier ones into the
                // same gradient left there.
                if let Op::Elementwise(ElementwiseOp::AccumulateGrad { param }) = self.nodes[i].op {
                    for (needs, node) in needed[..i].iter_mut().zip(&self.nodes[..i]) {
                        *needs |= node.op == ElementwiseOp::AccumulateGrad { param };
                    }
                }
            }
        }
        let mut values: Vec<Option<Vec<f64>>> = vec![None; count];
        for i in (0..count).filter(|&i| needed[i]) {
            let op = &self.nodes[i].op;
            let cx = ReferenceContext {
                graph: self,
                node: Tensor(i),
                values: &values,
                feeds,
            };
            let value = op.family().reference(&cx)?;
            if value.len() != self.nodes[i].len() {
                return Err(Error::shape(
                    "evaluate_f64",
                    format!("the reference of `{}` gave {} values", self.nodes[i].name, value.len()),
                    &[&self.nodes[i].shape],
                ));
            }
            values[i] = Some(value);
        }
        Ok(outputs
            .iter()
            .map(|t| values[t.0].clone().unwrap_or_default())
            .collect())
    }
}
