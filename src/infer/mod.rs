//! Running a trained model: [`Predictor`] for the classifier,
//! [`generate`]'s `Generator` for any causal language model, and
//! [`batch`]'s `Scheduler`, continuous batching over a generator.

pub mod batch;
pub mod generate;
mod predictor;

pub use predictor::Predictor;
