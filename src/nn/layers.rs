//! Embedding and LayerNorm, as torch.nn names and initialises them.

use super::parameter_tree::parameter_tree;
use super::{normal, Module, ParameterTree};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};

/// torch.nn.Embedding: rows of `weight` [num_embeddings, embedding_dim]
/// picked by u32 ids [..] -> [.., embedding_dim].
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    pub num_embeddings: usize,
    pub embedding_dim: usize,
    pub weight: Vec<f32>,
}

impl Embedding {
    /// PyTorch's default init, N(0, 1).
    pub fn new(num_embeddings: usize, embedding_dim: usize) -> Self {
        Self::normal(num_embeddings, embedding_dim, 1.0)
    }

    /// Weights N(0, std²) (GPT-2 uses 0.02).
    pub fn normal(num_embeddings: usize, embedding_dim: usize, std: f32) -> Self {
        Embedding {
            num_embeddings,
            embedding_dim,
            weight: normal(num_embeddings * embedding_dim, std),
        }
    }

    /// The structure with no values, for a model's `from_parameters` to fill.
    pub fn empty(num_embeddings: usize, embedding_dim: usize) -> Self {
        Embedding {
            num_embeddings,
            embedding_dim,
            weight: Vec::new(),
        }
    }

    /// The table as a parameter `{prefix}weight`, for a module that also
    /// reads it another way (a position table sliced to the sequence). In
    /// the no-decay group, as nanoGPT leaves embeddings undecayed.
    pub fn table(&self, g: &mut Graph, prefix: &str) -> Result<Tensor> {
        let [table] = self.declare(g, prefix)?[..] else {
            return Err(Error::InvalidArgument {
                op: "Embedding",
                reason: "declares exactly one table".into(),
            });
        };
        g.mark_no_decay_group(table)?;
        Ok(table)
    }

    /// [`Embedding::table`] for a table the head also reads (tied
    /// weights): a weight matrix, which an f16 forward context stores in
    /// f16.
    pub fn tied_table(&self, g: &mut Graph, prefix: &str) -> Result<Tensor> {
        let [table] = self.declare_weights(g, prefix)?[..] else {
            return Err(Error::InvalidArgument {
                op: "Embedding",
                reason: "declares exactly one table".into(),
            });
        };
        g.mark_no_decay_group(table)?;
        Ok(table)
    }
}

parameter_tree!(Embedding, |m| parameters {
    weight: [m.num_embeddings, m.embedding_dim]
});

impl Module for Embedding {
    /// `ids` is a u32 tensor ([`Graph::ids`]).
    fn forward(&self, g: &mut Graph, ids: Tensor, prefix: &str) -> Result<Tensor> {
        let table = self.table(g, prefix)?;
        g.embedding(table, ids)
    }

    fn describe(&self) -> String {
        format!("Embedding({}, {})", self.num_embeddings, self.embedding_dim)
    }
}

/// torch.nn.LayerNorm over the last dimension, weight ones and bias zeros.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub normalized_shape: usize,
    pub eps: f32,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

impl LayerNorm {
    /// eps = 1e-5, PyTorch's default.
    pub fn new(normalized_shape: usize) -> Self {
        LayerNorm {
            normalized_shape,
            eps: 1e-5,
            weight: vec![1.0; normalized_shape],
            bias: vec![0.0; normalized_shape],
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let c = self.normalized_shape;
        if self.weight.len() != c || self.bias.len() != c {
            return Err(Error::shape(
                "LayerNorm",
                "weight and bias must have normalized_shape values",
                &[&[c], &[self.weight.len()], &[self.bias.len()]],
            ));
        }
        let [w, b] = self.declare(g, prefix)?[..] else {
            return Err(Error::InvalidArgument {
                op: "LayerNorm",
                reason: "declares exactly a weight and a bias".into(),
            });
        };
        g.layer_norm(x, w, b, self.eps)
    }

    fn describe(&self) -> String {
        format!("LayerNorm({}, eps={})", self.normalized_shape, self.eps)
    }
}

parameter_tree!(LayerNorm, |m| parameters {
    weight: [m.normalized_shape],
    bias: [m.normalized_shape]
});
