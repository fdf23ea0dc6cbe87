//! The gated MLP: down(act(gate(x)) · up(x)), no biases; SwiGLU (SiLU,
//! Llama's) or GeGLU (GELU-tanh, Gemma's).

use super::causal_lm::{one_quantized_product, unsharded_generation};
use super::parameter_tree::{child_prefix, parameter_tree};
use super::{Linear, Module, ParameterTree, TensorSplit};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::Activation;

/// transformers' LlamaMLP: `gate_proj` and `up_proj` to the intermediate
/// width, `down_proj` back.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGluMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    /// The gate's activation: [`Activation::Silu`] (SwiGLU) or
    /// [`Activation::Gelu`], the tanh approximation (Gemma's
    /// `gelu_pytorch_tanh`).
    pub activation: Activation,
}

impl SwiGluMlp {
    /// Weights N(0, std²), no biases (Llama's init).
    pub fn normal(hidden: usize, intermediate: usize, std: f32) -> Self {
        SwiGluMlp {
            gate_proj: Linear::normal_no_bias(hidden, intermediate, std),
            up_proj: Linear::normal_no_bias(hidden, intermediate, std),
            down_proj: Linear::normal_no_bias(intermediate, hidden, std),
            activation: Activation::Silu,
        }
    }

    /// The structure with no values, gated by `activation`, for a model's
    /// `from_parameters` to fill.
    pub fn empty(hidden: usize, intermediate: usize, activation: Activation) -> Self {
        SwiGluMlp {
            gate_proj: Linear::empty(hidden, intermediate, false),
            up_proj: Linear::empty(hidden, intermediate, false),
            down_proj: Linear::empty(intermediate, hidden, false),
            activation,
        }
    }
}

impl Module for SwiGluMlp {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        // Megatron's MLP: gate and up column-parallel (a device's hidden
        // units), down row-parallel (their partial sum).
        if let Some(hidden) = self.quantized_gated(g, x, prefix)? {
            return self
                .down_proj
                .forward(g, hidden, &child_prefix!(prefix, self.down_proj));
        }
        let column = TensorSplit::Column { groups: 1, unit: 1 };
        let gate = self
            .gate_proj
            .forward_split(g, x, &child_prefix!(prefix, self.gate_proj), column)?;
        let up = self
            .up_proj
            .forward_split(g, x, &child_prefix!(prefix, self.up_proj), column)?;
        let gate = g.activation(self.activation, gate)?;
        let hidden = g.mul(gate, up)?;
        self.down_proj.forward_split(
            g,
            hidden,
            &child_prefix!(prefix, self.down_proj),
            TensorSplit::Row { unit: 1 },
        )
    }

    fn describe(&self) -> String {
        let gate = match self.activation {
            Activation::Silu => String::new(),
            other => format!(", {other:?}"),
        };
        format!(
            "SwiGluMlp({}, {}{gate})",
            self.gate_proj.in_features, self.gate_proj.out_features
        )
    }
}

impl SwiGluMlp {
    /// Generation with block-quantized gate and up projections without
    /// biases: silu(gate(x)) · up(x) as one gated product (one dispatch
    /// for three; its kernel gates with SiLU only). None where that does
    /// not apply.
    fn quantized_gated(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Option<Tensor>> {
        let plain = self.gate_proj.bias.is_none() && self.up_proj.bias.is_none() && self.activation == Activation::Silu;
        if !unsharded_generation() || !plain {
            return Ok(None);
        }
        let mut weights = self
            .gate_proj
            .declare_weights(g, &child_prefix!(prefix, self.gate_proj))?;
        weights.extend(self.up_proj.declare_weights(g, &child_prefix!(prefix, self.up_proj))?);
        if weights.len() != 2 || !one_quantized_product(g, &weights) {
            return Ok(None);
        }
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let Some((&c, lead)) = shape.split_last() else {
            return Err(Error::shape("SwiGluMlp", "expects x [.., channels]", &[&shape]));
        };
        let rows = g.reshape(x, &[lead.iter().product(), c])?;
        let hidden = g.matmul_quant_parts(rows, &weights, true)?;
        let mut out = lead.to_vec();
        out.push(self.gate_proj.out_features);
        g.reshape(hidden, &out).map(Some)
    }
}

parameter_tree!(SwiGluMlp {
    gate_proj,
    up_proj,
    down_proj
});
