//! RMSNorm (Llama's norm): y = x / sqrt(mean(x²) + eps) · weight over the
//! last dimension, weight ones at init, no bias.

use super::causal_lm::{cache_pass, declare_parameter};
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
    /// Gemma's norm: y = x / rms · (1 + weight).
    pub unit_offset: bool,
}

impl RmsNorm {
    /// Weight ones, as LlamaRMSNorm initialises it.
    pub fn new(normalized_shape: usize, eps: f32) -> Self {
        RmsNorm {
            normalized_shape,
            eps,
            weight: vec![1.0; normalized_shape],
            unit_offset: false,
        }
    }

    /// Gemma's RMSNorm (transformers' Gemma3RMSNorm): scales by
    /// 1 + weight, weight zeros at init.
    pub fn unit_offset(normalized_shape: usize, eps: f32) -> Self {
        RmsNorm {
            normalized_shape,
            eps,
            weight: vec![0.0; normalized_shape],
            unit_offset: true,
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
        if self.unit_offset && cache_pass().is_some() {
            // Generation takes no gradient: its graph's `weight` holds the
            // scale 1 + weight itself, not an add per norm per token.
            let scale: Vec<f32> = self.weight.iter().map(|w| 1.0 + w).collect();
            let w = declare_parameter(g, format!("{prefix}weight"), &[c], &scale, false)?;
            return g.rms_norm(x, w, self.eps);
        }
        let [w] = self.declare(g, prefix)?[..] else {
            return Err(Error::InvalidArgument {
                op: "RmsNorm",
                reason: "declares exactly one weight".into(),
            });
        };
        let w = if self.unit_offset {
            let one = g.constant("one", &[1], vec![1.0])?;
            g.add(w, one)?
        } else {
            w
        };
        g.rms_norm(x, w, self.eps)
    }

    fn describe(&self) -> String {
        let offset = if self.unit_offset { ", 1+weight" } else { "" };
        format!("RMSNorm({}, eps={}{offset})", self.normalized_shape, self.eps)
    }
}

parameter_tree!(RmsNorm, |m| parameters {
    weight: [m.normalized_shape]
});
