//! Parameters reached through the module tree by name, so a model that
//! loads or exports weights derives its names from its modules instead of
//! listing them (candle's `VarBuilder::pp` in both directions).

use super::{Embedding, Linear};
use crate::error::Result;

/// A module whose parameters can be read and written by hierarchical name.
/// Each composite names its children once, in `visit` and `visit_mut`,
/// which list the same children in the same order.
pub trait ParameterTree {
    /// Calls `f(name, shape, values)` for every parameter, in the order
    /// `Module::forward` declares them, names under `prefix`.
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32]));

    /// The same walk with the values writable (loading weights).
    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>) -> Result<()>;

    /// (name, shape, values) of every parameter, in visiting order.
    fn parameter_values(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut all = Vec::new();
        self.visit("", &mut |name, shape, values| all.push((name, shape, values)));
        all
    }

    /// (name, shape) of every parameter: `Module::named_parameters` for
    /// a module that is a `ParameterTree`.
    fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut all = Vec::new();
        self.visit("", &mut |name, shape, _| all.push((name, shape)));
        all
    }
}

impl ParameterTree for Linear {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        f(format!("{prefix}weight"), vec![self.out_features, self.in_features], &self.weight);
        if let Some(bias) = &self.bias {
            f(format!("{prefix}bias"), vec![self.out_features], bias);
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>) -> Result<()> {
        f(format!("{prefix}weight"), vec![self.out_features, self.in_features], &mut self.weight)?;
        if let Some(bias) = &mut self.bias {
            f(format!("{prefix}bias"), vec![self.out_features], bias)?;
        }
        Ok(())
    }
}

impl ParameterTree for Embedding {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        f(format!("{prefix}weight"), vec![self.num_embeddings, self.embedding_dim], &self.weight);
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>) -> Result<()> {
        f(format!("{prefix}weight"), vec![self.num_embeddings, self.embedding_dim], &mut self.weight)
    }
}
