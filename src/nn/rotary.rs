//! Rotary position embeddings (RoPE) with a configurable base and rotated
//! width, in both layouts checkpoints use: Meta's, rotating interleaved
//! pairs (x[2i], x[2i+1]), and Hugging Face's, rotating x[i] with
//! x[i + d/2] (`rotate_half`). The two differ only by a permutation of each
//! head's q/k projection rows (what GGUF converters undo).

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::MatmulForm;

/// Which channels of a head rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1): Meta's Llama and GGUF.
    Interleaved,
    /// Pairs (i, i + rotary_dim/2): Hugging Face's `rotate_half`.
    HalfSplit,
}

/// Rotates the first `rotary_dim` channels of every head by angles
/// position · base^(-2i/rotary_dim); the rest pass through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotary {
    pub base: f32,
    pub rotary_dim: usize,
    pub layout: RopeLayout,
}

impl Rotary {
    fn check(&self, head_dim: usize) -> Result<()> {
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > head_dim || !(self.base.is_finite() && self.base > 1.0) {
            return Err(Error::InvalidArgument {
                op: "Rotary",
                reason: format!("rotary_dim {} must be even, positive and at most the head width {head_dim}; base {} must exceed 1", self.rotary_dim, self.base),
            });
        }
        Ok(())
    }

    /// cos and sin [t, head_dim] for positions 0..t, per channel in this
    /// layout (1 and 0 on channels that do not rotate). Frequencies and
    /// angles are rounded to f32 where transformers computes them in f32.
    pub fn tables(&self, t: usize, head_dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check(head_dim)?;
        let half = self.rotary_dim / 2;
        let inv_freq: Vec<f32> = (0..half).map(|i| (1.0 / f64::from(self.base).powf((2 * i) as f64 / self.rotary_dim as f64)) as f32).collect();
        let (mut cos, mut sin) = (vec![1.0f32; t * head_dim], vec![0.0f32; t * head_dim]);
        for pos in 0..t {
            for channel in 0..self.rotary_dim {
                let pair = match self.layout {
                    RopeLayout::Interleaved => channel / 2,
                    RopeLayout::HalfSplit => channel % half,
                };
                let angle = f64::from(pos as f32 * inv_freq[pair]);
                cos[pos * head_dim + channel] = angle.cos() as f32;
                sin[pos * head_dim + channel] = angle.sin() as f32;
            }
        }
        Ok((cos, sin))
    }

    /// R [head_dim, head_dim] with x·R the partner each channel rotates
    /// with, signed: (x·R)[a] = -x[b] and (x·R)[b] = x[a] for a pair (a, b).
    /// Entries are 0 and ±1, so the product is exact.
    pub fn rotation(&self, head_dim: usize) -> Result<Vec<f32>> {
        self.check(head_dim)?;
        let half = self.rotary_dim / 2;
        let mut r = vec![0.0f32; head_dim * head_dim];
        for i in 0..half {
            let (a, b) = match self.layout {
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                RopeLayout::HalfSplit => (i, i + half),
            };
            // Column a of x·R reads row b of R: -x[b]; column b reads x[a].
            r[b * head_dim + a] = -1.0;
            r[a * head_dim + b] = 1.0;
        }
        Ok(r)
    }

    /// Rotates x [B, H, T, d] (heads of a query or key) at positions 0..T.
    pub fn forward(&self, g: &mut Graph, x: Tensor) -> Result<Tensor> {
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [_, _, t, d] = shape[..] else {
            return Err(Error::shape("Rotary", "expects x [batch, heads, time, head_dim]", &[&shape]));
        };
        let (cos, sin) = self.tables(t, d)?;
        let rotation = self.rotation(d)?;
        let cos = g.constant("rope.cos", &[t, d], cos)?;
        let sin = g.constant("rope.sin", &[t, d], sin)?;
        let rotation = g.constant("rope.rotation", &[d, d], rotation)?;
        rope(g, x, cos, sin, rotation)
    }
}

/// x·cos + (x·R)·sin with cos, sin [T, d] broadcast over batch and heads,
/// composed from graph ops. One call site, so a fused RoPE op replaces it
/// in one line.
pub(crate) fn rope(g: &mut Graph, x: Tensor, cos: Tensor, sin: Tensor, rotation: Tensor) -> Result<Tensor> {
    let partner = g.rows_matmul(MatmulForm::AB, x, rotation)?;
    let straight = g.mul(x, cos)?;
    let turned = g.mul(partner, sin)?;
    g.add(straight, turned)
}
