//! The batches every engine takes: examples (f32 features or u32 token
//! ids), the targets the loss compares with, and a model's per-example
//! widths that size them.

use crate::error::Result;
use crate::graph::{DType, Graph};
use crate::nn::{build_model, Built, Criterion, Module};

/// What the loss compares the model's output with.
#[derive(Clone, Copy, Debug)]
pub enum Targets<'a> {
    /// Regression targets, [batch, out_features].
    Values(&'a [f32]),
    /// Class indices, [batch].
    Classes(&'a [u32]),
}

/// A batch of examples as a model reads them: f32 features or u32 token
/// ids, row-major, examples one after another.
#[derive(Clone, Copy, Debug)]
pub enum Examples<'a> {
    Features(&'a [f32]),
    Ids(&'a [u32]),
}

impl<'a> Examples<'a> {
    pub fn len(&self) -> usize {
        match self {
            Examples::Features(x) => x.len(),
            Examples::Ids(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `start..end` (not examples: the caller multiplies by the
    /// values per example).
    pub fn slice(&self, start: usize, end: usize) -> Examples<'a> {
        match *self {
            Examples::Features(x) => Examples::Features(&x[start..end]),
            Examples::Ids(x) => Examples::Ids(&x[start..end]),
        }
    }
}

impl<'a> From<&'a [f32]> for Examples<'a> {
    fn from(x: &'a [f32]) -> Self {
        Examples::Features(x)
    }
}

impl<'a> From<&'a Vec<f32>> for Examples<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        Examples::Features(x)
    }
}

impl<'a> From<&'a [u32]> for Examples<'a> {
    fn from(x: &'a [u32]) -> Self {
        Examples::Ids(x)
    }
}

impl<'a> From<&'a Vec<u32>> for Examples<'a> {
    fn from(x: &'a Vec<u32>) -> Self {
        Examples::Ids(x)
    }
}

/// Per-example widths of a model: the values it reads, the values it
/// outputs, and the rows of its output (1 for an MLP, the sequence length
/// for a language model: the class labels per example).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelWidths {
    pub inputs: usize,
    pub outputs: usize,
    pub output_rows: usize,
    pub reads_ids: bool,
}

impl ModelWidths {
    /// Builds `model` for one example in a scratch graph (no GPU work).
    pub fn of(model: &dyn Module) -> Result<Self> {
        let mut g = Graph::new();
        let Built {
            input,
            output,
            in_per_example,
            out_per_example,
        } = build_model(&mut g, model, 1)?;
        let last = g.shape_of(output).and_then(|s| s.last().copied()).unwrap_or(1).max(1);
        let reads_ids = g.get(input).is_some_and(|n| n.dtype == DType::U32);
        Ok(ModelWidths {
            inputs: in_per_example,
            outputs: out_per_example,
            output_rows: out_per_example / last,
            reads_ids,
        })
    }

    /// Target values per example the criterion compares against: the
    /// outputs (MSE) or one class per output row (cross-entropy).
    pub fn target_width(&self, criterion: Criterion) -> usize {
        match criterion {
            Criterion::Mse => self.outputs,
            Criterion::CrossEntropy => self.output_rows,
        }
    }
}
