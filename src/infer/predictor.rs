//! A forward-only model for inference, rebuilt from a wgrad checkpoint.

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::graph::{chunked_outputs, chunked_predictions, Executor, Graph, Tensor};
use crate::io::checkpoint::{self, Checkpoint};
use crate::io::state_dict::checked_parameters;
use crate::kernels::Kernels;
use crate::nn::{build_model, Built, Module, Sequential};

/// A forward-only model for inference: no gradient or optimizer buffers.
pub struct Predictor {
    exec: Executor,
    input: Tensor,
    output: Tensor,
    prediction: Tensor,
    batch_size: usize,
    in_features: usize,
    out_features: usize,
    model_description: String,
}

impl Predictor {
    pub fn new(kernels: Arc<Kernels>, model: &dyn Module, batch_size: usize) -> Result<Self> {
        let mut g = Graph::new();
        let Built {
            input,
            output,
            in_per_example: in_features,
            out_per_example: out_features,
        } = build_model(&mut g, model, batch_size)?;
        let prediction = g.argmax(output)?;
        let exec = Executor::new(kernels, g, &[output, prediction], None, None)?;
        Ok(Predictor {
            exec,
            input,
            output,
            prediction,
            batch_size,
            in_features,
            out_features,
            model_description: model.describe(),
        })
    }

    /// Rebuilds the model described in a checkpoint and loads its weights.
    pub fn from_checkpoint(
        kernels: Arc<Kernels>,
        path: impl AsRef<Path>,
        batch_size: usize,
    ) -> Result<(Self, Checkpoint)> {
        let path = path.as_ref();
        let ckpt = checkpoint::load(path)?;
        let description = ckpt.meta("model").ok_or_else(|| Error::CheckpointFormat {
            path: path.to_path_buf(),
            reason: "no `model` entry in the metadata: not written by wgrad".into(),
        })?;
        let model = Sequential::from_description(description)?;
        let mut predictor = Predictor::new(kernels, &model, batch_size)?;
        let params = checked_parameters(&ckpt, predictor.exec.parameters_shapes())?;
        predictor.exec.load_state(&params, &[], None)?;
        Ok((predictor, ckpt))
    }

    /// The model's [`Module::describe`] line.
    pub fn model_description(&self) -> &str {
        &self.model_description
    }

    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn outputs(&mut self, features: &[f32]) -> Result<Vec<f32>> {
        chunked_outputs(
            &mut self.exec,
            (self.input, self.output),
            (self.batch_size, self.in_features, self.out_features),
            features,
        )
    }

    pub fn predict(&mut self, features: &[f32]) -> Result<Vec<u32>> {
        chunked_predictions(
            &mut self.exec,
            (self.input, self.prediction),
            (self.batch_size, self.in_features),
            features,
        )
    }

    /// Model outputs (logits) for sequences of token `ids`, batch by batch.
    pub fn outputs_ids(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        chunked_outputs(
            &mut self.exec,
            (self.input, self.output),
            (self.batch_size, self.in_features, self.out_features),
            ids,
        )
    }

    /// See [`Trainer::predict_ids`].
    pub fn predict_ids(&mut self, ids: &[u32]) -> Result<Vec<u32>> {
        chunked_predictions(
            &mut self.exec,
            (self.input, self.prediction),
            (self.batch_size, self.in_features),
            ids,
        )
    }
}
