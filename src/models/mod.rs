//! Whole models, one file each, built from [`crate::nn`] modules.

pub mod llama;

pub use llama::{Llama, LlamaConfig, LlamaDecoderLayer};
