//! Writes a GPT or Llama model folder and the logits wgrad computes with
//! it, for `scripts/check_hf_folder.py` to compare with what Hugging Face
//! transformers computes from the same folder.
//!
//! Every parameter (norms and biases too) is random, so a swapped name or
//! a missing transpose would show in the logits; the Llama has
//! grouped-query attention and an untied head.
//!
//! Run: `cargo run --release --example hf_folder -- gpt out/gpt-folder`
//! (or `-- llama out/llama-folder`, `-- qwen2 …`, `-- qwen3 …`, `-- mistral …`: the Qwen2
//! with q/k/v biases, the Qwen3 with q/k norms and heads of 12 channels
//! over 32 / 4, the Mistral with heads of 12 and a window of 5; `-- gemma3 …`: a Gemma 3 with a local and a global
//! layer), then
//! `python3 scripts/check_hf_folder.py out/gpt-folder` (the logits go to
//! `out/gpt-folder.logits.safetensors`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::infer::Predictor;
use wgrad::io::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::io::gemma_folder::save_gemma_folder;
use wgrad::io::gpt_folder::{save_gpt_folder, TokenizerSpec};
use wgrad::io::llama_folder::save_llama_folder;
use wgrad::models::{Gemma, GemmaConfig, Gpt, GptConfig};
use wgrad::models::{Llama, LlamaConfig, LlamaVariant};
use wgrad::nn::Module;

const GPT: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 16,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};
const LLAMA: LlamaConfig = LlamaConfig {
    vocab_size: 37,
    block_size: 16,
    n_layer: 2,
    n_head: 4,
    n_kv_head: 2,
    n_embd: 32,
    intermediate_size: 56,
    ..LlamaConfig::small(37)
};
const SEQUENCES: usize = 3;

fn main() -> wgrad::Result<()> {
    let mut args = std::env::args().skip(1);
    let family = args.next().unwrap_or_else(|| "gpt".into());
    let dir = PathBuf::from(args.next().unwrap_or_else(|| format!("out/{family}-folder")));
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut random = |_: &str, shape: &[usize]| {
        Ok((0..shape.iter().product())
            .map(|_| rng.random_range(-0.5..0.5))
            .collect())
    };
    match family.as_str() {
        "gpt" => {
            let model = Gpt::from_parameters(GPT, &mut random)?;
            write(
                &model,
                GPT.block_size,
                GPT.vocab_size,
                &dir,
                &mut rng,
                |dir, tokenizer| save_gpt_folder(dir, &model, tokenizer, None),
            )
        }
        "llama" | "qwen2" | "qwen3" | "mistral" => {
            let config = match family.as_str() {
                "qwen2" => LlamaConfig {
                    variant: LlamaVariant::Qwen2,
                    ..LLAMA
                },
                "qwen3" => LlamaConfig {
                    variant: LlamaVariant::Qwen3,
                    head_dim: Some(12),
                    ..LLAMA
                },
                // Heads of their own width, a window of 5 of the 16 positions.
                "mistral" => LlamaConfig {
                    variant: LlamaVariant::Mistral,
                    head_dim: Some(12),
                    sliding_window: Some(5),
                    ..LLAMA
                },
                _ => LLAMA,
            };
            let model = Llama::from_parameters(config, &mut random)?;
            write(
                &model,
                LLAMA.block_size,
                LLAMA.vocab_size,
                &dir,
                &mut rng,
                |dir, tokenizer| save_llama_folder(dir, &model, Some(tokenizer)),
            )
        }
        "gemma3" => {
            // A local and a global layer, heads of 12 over 32 / 4, a score
            // scale of its own (query_pre_attn_scalar 10).
            let config = GemmaConfig {
                vocab_size: LLAMA.vocab_size,
                block_size: LLAMA.block_size,
                n_layer: 2,
                n_head: 4,
                n_kv_head: 2,
                n_embd: 32,
                head_dim: 12,
                intermediate_size: 56,
                query_pre_attn_scalar: 10.0,
                sliding_window: LLAMA.block_size,
                sliding_window_pattern: 2,
                ..GemmaConfig::small(LLAMA.vocab_size)
            };
            let model = Gemma::from_parameters(config, &mut random)?;
            write(
                &model,
                LLAMA.block_size,
                LLAMA.vocab_size,
                &dir,
                &mut rng,
                |dir, tokenizer| save_gemma_folder(dir, &model, Some(tokenizer)),
            )
        }
        other => Err(wgrad::Error::InvalidArgument {
            op: "hf_folder example",
            reason: format!("unknown model `{other}`: gpt, llama, qwen2, qwen3, mistral or gemma3"),
        }),
    }
}

/// Computes `model`'s logits on random ids, saves the folder with `save`
/// and the ids and logits beside it.
fn write(
    model: &dyn Module,
    block_size: usize,
    vocab_size: usize,
    dir: &Path,
    rng: &mut ChaCha8Rng,
    save: impl FnOnce(&Path, &TokenizerSpec) -> wgrad::Result<()>,
) -> wgrad::Result<()> {
    let ids: Vec<u32> = (0..SEQUENCES * block_size)
        .map(|_| rng.random_range(0..vocab_size as u32))
        .collect();
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    let logits = Predictor::new(kernels.clone(), model, SEQUENCES)?.outputs_ids(&ids)?;

    // Printable characters from `!`, one per token.
    let vocabulary: String = (0..vocab_size as u8).map(|i| (b'!' + i) as char).collect();
    save(dir, &TokenizerSpec::Char { vocabulary })?;
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new(
        "ids",
        vec![SEQUENCES, block_size],
        ids.iter().map(|&i| i as f32).collect(),
    )?);
    out.push(NamedTensor::new(
        "logits",
        vec![SEQUENCES, block_size, vocab_size],
        logits,
    )?);
    out.set_meta("adapter", kernels.device().label());
    let mut logits_path = dir.to_path_buf().into_os_string();
    logits_path.push(".logits.safetensors");
    checkpoint::save(&logits_path, &out)?;
    println!(
        "wrote {} and {} ({})",
        dir.display(),
        PathBuf::from(&logits_path).display(),
        kernels.device().label()
    );
    Ok(())
}
