//! Mistral as transformers' `MistralForCausalLM` writes it: Llama's decoder
//! ([`Llama`]) under the same parameter names, every layer's attention
//! sliding over the last `sliding_window` positions when the config sets
//! one ([`LlamaConfig::sliding_window`]; Mistral 7B v0.1's 4096, `null` in
//! v0.2 and later, which then attend to the whole context). No biases and
//! no q/k norms; `head_dim` may differ from hidden / heads (Mistral NeMo's
//! 128 over 5120 / 32). The window is an attention option, so every
//! engine, the generator's cached decode and the folders serve Mistral as
//! they serve a Llama.
//!
//! llama.cpp converts Mistral to architecture `llama` (interleaved q/k
//! pairs, as Meta's), with the window as `llama.attention.sliding_window`
//! when the converter writes one.

use crate::error::{Error, Result};
use crate::models::llama::{LlamaConfig, LlamaVariant};
use crate::nn::RopeLayout;

pub use crate::models::llama::Llama as Mistral;

/// mistralai/Mistral-7B-v0.1: 32 layers of 4096 channels, 32 heads over 8
/// KV heads, MLP 14336, vocabulary 32,000, untied head, RoPE base 10,000,
/// context 32,768, a sliding window of 4096.
pub const fn mistral_7b_v0_1() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32000,
        block_size: 32768,
        n_layer: 32,
        n_head: 32,
        n_kv_head: 8,
        n_embd: 4096,
        intermediate_size: 14336,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: Some(4096),
        variant: LlamaVariant::Mistral,
    }
}

/// A small Mistral for a character-level corpus of `vocab_size` symbols,
/// as [`LlamaConfig::small`] (4 layers × 128 channels, 4 heads over 2 KV
/// heads, MLP 384, 64 positions, untied head) with a window of 16
/// positions, so the window shapes what it learns.
pub const fn small(vocab_size: usize) -> LlamaConfig {
    LlamaConfig {
        sliding_window: Some(16),
        variant: LlamaVariant::Mistral,
        ..LlamaConfig::small(vocab_size)
    }
}

/// Context of the 7B preset when trained: a step's activations grow with
/// it.
pub const TRAINING_CONTEXT: usize = 2048;

/// A preset by name: `small` (whose vocabulary `vocab_size` gives: the
/// data's) or `mistral-7b-v0.1`, trained on [`TRAINING_CONTEXT`] tokens.
pub fn preset(name: &str, vocab_size: usize) -> Result<LlamaConfig> {
    match name {
        "small" => Ok(small(vocab_size)),
        "mistral-7b-v0.1" => Ok(LlamaConfig {
            block_size: TRAINING_CONTEXT,
            ..mistral_7b_v0_1()
        }),
        other => Err(Error::InvalidArgument {
            op: "mistral::preset",
            reason: format!("unknown Mistral preset `{other}`; known: small, mistral-7b-v0.1"),
        }),
    }
}
