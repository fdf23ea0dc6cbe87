//! Rotary position embeddings (RoPE) with a configurable base and rotated
//! width, in both layouts checkpoints use: Meta's, rotating interleaved
//! pairs (x[2i], x[2i+1]), and Hugging Face's, rotating x[i] with
//! x[i + d/2] (`rotate_half`). The two differ only by a permutation of each
//! head's q/k projection rows (what GGUF converters undo). The rotation is
//! the graph's fused [`Graph::rope`].

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
pub use crate::ops::RopeLayout;

/// Rotates the first `rotary_dim` channels of every head by angles
/// position · base^(-2i/rotary_dim); the rest pass through. `positions`
/// is the longest context (the angle table's rows).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotary {
    pub base: f32,
    pub rotary_dim: usize,
    pub layout: RopeLayout,
    pub positions: usize,
}

impl Rotary {
    fn check(&self, head_dim: usize) -> Result<()> {
        if self.rotary_dim == 0
            || self.rotary_dim % 2 != 0
            || self.rotary_dim > head_dim
            || !(self.base.is_finite() && self.base > 1.0)
        {
            return Err(Error::InvalidArgument {
                op: "Rotary",
                reason: format!(
                    "rotary_dim {} must be even, positive and at most the head width {head_dim}; base {} must exceed 1",
                    self.rotary_dim, self.base
                ),
            });
        }
        Ok(())
    }

    /// Rotates x [B, T, H, d] (the heads of a query or key projection,
    /// before they are moved ahead of time) at positions starts[b] + t;
    /// `starts` None is every sequence from 0 (training).
    pub fn forward(&self, g: &mut Graph, x: Tensor, starts: Option<Tensor>) -> Result<Tensor> {
        let heads = g.shape_of(x).and_then(|s| s.get(2).copied()).unwrap_or(0);
        self.forward_heads(g, x, starts, heads)
    }

    /// [`Rotary::forward`] over heads 0..rotated only, the rest passing
    /// through (a fused q | k | v row: q's and k's heads rotate, v's not).
    pub fn forward_heads(&self, g: &mut Graph, x: Tensor, starts: Option<Tensor>, rotated: usize) -> Result<Tensor> {
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        let [_, _, _, d] = shape[..] else {
            return Err(Error::shape(
                "Rotary",
                "expects x [batch, time, heads, head_dim]",
                &[&shape],
            ));
        };
        self.check(d)?;
        g.rope_heads(
            x,
            starts,
            self.layout,
            self.base,
            self.rotary_dim,
            self.positions,
            rotated,
        )
    }
}
