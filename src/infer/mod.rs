//! Running a trained model: [`Predictor`] for the classifier, and
//! [`generate`]'s `Generator` for any causal language model.

pub mod generate;
mod predictor;

pub use predictor::Predictor;
