//! The SwiGLU MLP (Llama's): down(silu(gate(x)) · up(x)), no biases.

use super::parameter_tree::{child_prefix, parameter_tree};
use super::{Linear, Module};
use crate::error::Result;
use crate::graph::{Graph, Tensor};
use crate::kernels::Activation;

/// transformers' LlamaMLP: `gate_proj` and `up_proj` to the intermediate
/// width, `down_proj` back.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGluMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl SwiGluMlp {
    /// Weights N(0, std²), no biases (Llama's init).
    pub fn normal(hidden: usize, intermediate: usize, std: f32) -> Self {
        SwiGluMlp {
            gate_proj: Linear::normal_no_bias(hidden, intermediate, std),
            up_proj: Linear::normal_no_bias(hidden, intermediate, std),
            down_proj: Linear::normal_no_bias(intermediate, hidden, std),
        }
    }
}

impl Module for SwiGluMlp {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let gate = self.gate_proj.forward(g, x, &child_prefix!(prefix, self.gate_proj))?;
        let up = self.up_proj.forward(g, x, &child_prefix!(prefix, self.up_proj))?;
        let gate = g.activation(Activation::Silu, gate)?;
        let hidden = g.mul(gate, up)?;
        self.down_proj.forward(g, hidden, &child_prefix!(prefix, self.down_proj))
    }

    fn describe(&self) -> String {
        format!("SwiGluMlp({}, {})", self.gate_proj.in_features, self.gate_proj.out_features)
    }
}

parameter_tree!(SwiGluMlp { gate_proj, up_proj, down_proj });
