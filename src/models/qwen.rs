//! Qwen2 / Qwen2.5 and Qwen3 as transformers' `Qwen2ForCausalLM` and
//! `Qwen3ForCausalLM` write them: Llama's decoder ([`Llama`]) with the
//! attention options of their variant ([`LlamaVariant`], built by
//! [`crate::nn::GroupedQueryAttention::with_options`]), under the same
//! parameter names, so every engine, the generator and the folders serve
//! them as they serve a Llama:
//!
//! - **Qwen2** (Qwen2, Qwen2.5): biases on `q_proj`, `k_proj` and `v_proj`
//!   (`model.layers.N.self_attn.q_proj.bias`, …), none on `o_proj` or the
//!   MLP; the head tied or not as `tie_word_embeddings` says (tied in the
//!   0.5B–3B models).
//! - **Qwen3**: no biases; an RMSNorm (weight [head_dim], `q_norm` and
//!   `k_norm`) over each query and key head, after the projection and
//!   before the rotation; `head_dim` from the config, which need not be
//!   hidden / heads (Qwen3-0.6B: 16 heads of 128 over 1024 channels).
//!
//! Both rotate half-split pairs (transformers' `rotate_half`, llama.cpp's
//! NEOX mode), so their GGUF files keep Hugging Face's q/k row order.
//!
//! The published checkpoints pad the embedding past the tokenizer's
//! vocabulary (Qwen2.5-0.5B: 151,936 rows for 151,665 tokens). The padding
//! rows are trained towards nothing: a sampler must never pick an id at or
//! above the tokenizer's size, nor a decoder be asked for one — mask those
//! logits where generation samples (the generator's vocabulary mask, and
//! the server's, which masks the ids its tokenizer has no text for).
//!
//! Under tensor parallelism the q/k/v biases split with their weights'
//! rows (column-parallel: a device holds its heads' biases), and the q/k
//! norms, whose one weight serves every head, are replicated: each device
//! normalises its own heads, and the engine sums the weight's gradient
//! over the devices as it does for every replicated parameter.

use crate::error::{Error, Result};
use crate::models::llama::{LlamaConfig, LlamaVariant};
use crate::nn::RopeLayout;

pub use crate::models::llama::Llama as Qwen;

/// Qwen/Qwen2.5-0.5B: 24 layers of 896 channels, 14 heads over 2 KV heads,
/// MLP 4864, vocabulary 151,936 (the tokenizer's 151,665 padded), tied
/// head, RoPE base 1,000,000, context 32,768.
pub const fn qwen2_5_0_5b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 151936,
        block_size: 32768,
        n_layer: 24,
        n_head: 14,
        n_kv_head: 2,
        n_embd: 896,
        intermediate_size: 4864,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: LlamaVariant::Qwen2,
    }
}

/// Qwen/Qwen2.5-1.5B: 28 layers of 1536 channels, 12 heads of 128 over 2
/// KV heads, MLP 8960, vocabulary 151,936, tied head, RoPE base
/// 1,000,000, context 131,072 — 1,543,714,304 parameters, as transformers
/// counts them.
pub const fn qwen2_5_1_5b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 151936,
        block_size: 131072,
        n_layer: 28,
        n_head: 12,
        n_kv_head: 2,
        n_embd: 1536,
        intermediate_size: 8960,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: LlamaVariant::Qwen2,
    }
}

/// Qwen/Qwen3-0.6B: 28 layers of 1024 channels, 16 heads of 128 over 8 KV
/// heads, MLP 3072, vocabulary 151,936, tied head, RoPE base 1,000,000,
/// context 40,960.
pub const fn qwen3_0_6b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 151936,
        block_size: 40960,
        n_layer: 28,
        n_head: 16,
        n_kv_head: 8,
        n_embd: 1024,
        intermediate_size: 3072,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: Some(128),
        sliding_window: None,
        variant: LlamaVariant::Qwen3,
    }
}

/// A small model of `variant` for a character-level corpus of
/// `vocab_size` symbols, as [`LlamaConfig::small`] (4 layers × 128
/// channels, 4 heads over 2 KV heads, MLP 384, 64 positions, untied head);
/// Qwen3's heads are 48 channels wide (not 128 / 4), as its own heads
/// differ from hidden / heads.
pub const fn small(variant: LlamaVariant, vocab_size: usize) -> LlamaConfig {
    let head_dim = match variant {
        LlamaVariant::Qwen3 => Some(48),
        _ => None,
    };
    LlamaConfig {
        head_dim,
        variant,
        rms_norm_eps: 1e-6,
        ..LlamaConfig::small(vocab_size)
    }
}

/// Context of the real presets when trained: a step's activations grow
/// with it, and a software adapter cannot hold 32,768 positions.
pub const TRAINING_CONTEXT: usize = 2048;

/// A preset of `variant` by name: `small` (whose vocabulary `vocab_size`
/// gives: the data's), `qwen2.5-0.5b` or `qwen2.5-1.5b` (Qwen2) or
/// `qwen3-0.6b` (Qwen3), the real ones trained on [`TRAINING_CONTEXT`]
/// tokens.
pub fn preset(variant: LlamaVariant, name: &str, vocab_size: usize) -> Result<LlamaConfig> {
    match (variant, name) {
        (_, "small") if variant != LlamaVariant::Llama => Ok(small(variant, vocab_size)),
        (LlamaVariant::Qwen2, "qwen2.5-0.5b") => Ok(LlamaConfig {
            block_size: TRAINING_CONTEXT,
            ..qwen2_5_0_5b()
        }),
        (LlamaVariant::Qwen2, "qwen2.5-1.5b") => Ok(LlamaConfig {
            block_size: TRAINING_CONTEXT,
            ..qwen2_5_1_5b()
        }),
        (LlamaVariant::Qwen3, "qwen3-0.6b") => Ok(LlamaConfig {
            block_size: TRAINING_CONTEXT,
            ..qwen3_0_6b()
        }),
        (LlamaVariant::Llama, _) => LlamaConfig::preset(name, vocab_size),
        (_, other) => {
            let known = if variant == LlamaVariant::Qwen2 {
                "small, qwen2.5-0.5b, qwen2.5-1.5b"
            } else {
                "small, qwen3-0.6b"
            };
            Err(Error::InvalidArgument {
                op: "qwen::preset",
                reason: format!("unknown {} preset `{other}`; known: {known}", variant.names().2),
            })
        }
    }
}
