//! Host-only input and output: checkpoints, model folders and GGUF files,
//! datasets, tokenizers and chat templates. Everything read here comes from
//! outside, so a corrupt or mismatched file is a clear [`crate::Error`],
//! never a panic. (Atomic writes and the user cache sit at the crate root:
//! the device layer's pipeline cache uses them too.)

pub mod bpe;
pub mod chat;
pub mod checkpoint;
pub mod data;
pub mod gemma_folder;
pub mod gguf;
pub mod gguf_model;
pub mod gguf_write;
pub mod gpt_folder;
pub mod hf_folder;
pub mod llama_folder;
pub mod lm_folder;
pub mod peft;
pub mod spm;
pub(crate) mod state_dict;
pub mod text;
