//! Host-only input and output: checkpoints, model folders and GGUF files,
//! datasets, tokenizers and chat templates, atomic writes and the user cache. Everything
//! read here comes from outside, so a corrupt or mismatched file is a clear
//! [`crate::Error`], never a panic.

pub mod atomic_write;
pub mod bpe;
pub mod chat;
pub mod checkpoint;
pub mod data;
pub mod gguf;
pub mod gguf_model;
pub mod gpt_folder;
pub mod hf_folder;
pub mod llama_folder;
pub mod lm_folder;
pub mod text;
pub mod user_cache;
