//! RMSNorm (Llama's norm): y = x / sqrt(mean(x²) + eps) · weight over the
//! last dimension, weight ones at init, no bias.

use super::parameter_tree::parameter_tree;
use super::{Module, ParameterTree};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::MatmulForm;

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
        RmsNorm { normalized_shape, eps, weight: vec![1.0; normalized_shape] }
    }
}

impl Module for RmsNorm {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let c = self.normalized_shape;
        if self.weight.len() != c {
            return Err(Error::shape("RmsNorm", "weight must have normalized_shape values", &[&[c], &[self.weight.len()]]));
        }
        let [w] = self.declare(g, prefix)?[..] else {
            return Err(Error::InvalidArgument { op: "RmsNorm", reason: "declares exactly one weight".into() });
        };
        rms_norm(g, x, w, self.eps)
    }

    fn describe(&self) -> String {
        format!("RMSNorm({}, eps={})", self.normalized_shape, self.eps)
    }
}

parameter_tree!(RmsNorm, |m| parameters { weight: [m.normalized_shape] });

/// x [.., C] / sqrt(mean(x²) + eps) · weight [C], composed from graph ops
/// (the row mean is a product with a column of ones). One call site, so a
/// fused RMSNorm op replaces it in one line.
pub(crate) fn rms_norm(g: &mut Graph, x: Tensor, weight: Tensor, eps: f32) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
    let c = shape.last().copied().unwrap_or(0);
    if g.shape_of(weight) != Some(&[c][..]) || c == 0 {
        return Err(Error::shape(OP, format!("weight must be [{c}] for x's last dimension"), &[&shape, g.shape_of(weight).unwrap_or(&[])]));
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::InvalidArgument { op: OP, reason: format!("eps must be positive and finite, got {eps}") });
    }
    let squares = g.mul(x, x)?;
    let ones = g.constant("rms_norm.ones", &[c, 1], vec![1.0; c])?;
    let sums = g.rows_matmul(MatmulForm::AB, squares, ones)?;
    let mean = g.scale(sums, 1.0 / c as f32)?;
    let eps = g.constant("rms_norm.eps", &[1], vec![eps])?;
    let shifted = g.add(mean, eps)?;
    let inverse = g.rsqrt(shifted)?;
    let normed = g.mul(x, inverse)?;
    g.mul(normed, weight)
}
