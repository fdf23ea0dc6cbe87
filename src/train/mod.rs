//! The one training run ([`run`]) over the parallel engines, and the tasks
//! it trains: the digits [`classifier`] and a causal [`language_model`].

pub mod classifier;
pub mod language_model;
pub mod lora;
pub mod run;

pub use classifier::{load_data, share_data, Classifier, ClassifierData, DataSplit};
pub use language_model::*;
pub use lora::LoraLmConfig;
pub use run::{train, Evaluation, Prepared, Progress, Resumed, RunInfo, Summary, Task, TrainConfig, TrainingRun};

/// Fraction of `predictions` equal to `labels`.
pub fn accuracy(predictions: &[u32], labels: &[u32]) -> f32 {
    if labels.is_empty() {
        return 0.0;
    }
    let right = predictions.iter().zip(labels).filter(|(p, l)| p == l).count();
    right as f32 / labels.len() as f32
}
