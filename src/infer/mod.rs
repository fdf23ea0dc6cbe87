//! Running a trained model: [`Predictor`] for the classifier,
//! [`generate`]'s `Generator` for any causal language model,
//! [`batch`]'s `Scheduler`, continuous batching over a generator,
//! [`perplexity`]'s `Scorer`, a model's loss over a text, and
//! [`pretrained`], a model file or folder with its own tokenizer.

pub mod batch;
pub mod generate;
pub mod perplexity;
mod predictor;
pub mod pretrained;

pub use predictor::Predictor;
