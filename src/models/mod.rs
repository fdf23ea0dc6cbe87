//! Whole models, one file each, built from [`crate::nn`] modules.

pub mod gemma;
pub mod gpt;
pub mod llama;
pub mod mistral;
pub mod qwen;

pub use gemma::{Gemma, GemmaConfig, GemmaDecoderLayer};
pub use gpt::{Gpt, GptConfig};
pub use llama::{Llama, LlamaConfig, LlamaDecoderLayer, LlamaVariant};
