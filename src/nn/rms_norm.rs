//! RMSNorm (Llama's norm): y = x / sqrt(mean(x²) + eps) · weight over the
//! last dimension, weight ones at init, no bias.

use super::parameter_tree::parameter_tree;
use super::{Module, ParameterTree};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};

/// torch.nn.RMSNorm / transformers' LlamaRMSNorm over the last dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNorm {
    pub normalized_shape: usize,
    pub eps: f32,
    pub weight: Vec<f32>,
}

impl RmsNorm {
    /// Weight ones, as LlamaRMSNorm initialises it.
    pub fn new(normalized_shape: usize, eps: f32) -> Self {
        RmsNorm {
            normalized_shape,
            eps,
            weight: vec![1.0; normalized_shape],
        }
    }
}

impl Module for RmsNorm {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let c = self.normalized_shape;
        if self.weight.len() != c {
            return Err(Error::shape(
                "RmsNorm",
                "weight must have normalized_shape values",
                &[&[c], &[self.weight.len()]],
            ));
        }
        let [w] = self.declare(g, prefix)?[..] else {
            return Err(Error::InvalidArgument {
                op: "RmsNorm",
                reason: "declares exactly one weight".into(),
            });
        };
        g.rms_norm(x, w, self.eps)
    }

    fn describe(&self) -> String {
        format!("RMSNorm({}, eps={})", self.normalized_shape, self.eps)
    }
}

parameter_tree!(RmsNorm, |m| parameters {
    weight: [m.normalized_shape]
});
