//! Writes a Llama model folder and the logits wgrad computes with it, for
//! `scripts/check_llama_folder.py` to compare with what Hugging Face
//! transformers computes from the same folder (as examples/gpt_folder.rs
//! does for the GPT).
//!
//! Run: `cargo run --release --example llama_folder -- out/llama-folder`
//! then `python3 scripts/check_llama_folder.py out/llama-folder`
//! (the logits go to `out/llama-folder.logits.safetensors`).

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::llama_folder::save_llama_folder;
use wgrad::models::{Llama, LlamaConfig};
use wgrad::trainer::Predictor;

const SEQUENCES: usize = 3;

fn main() -> wgrad::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "out/llama-folder".into()));
    // Grouped-query attention and an untied head; every value random
    // (norms too), so a swapped name would show in the logits.
    let config = LlamaConfig { vocab_size: 37, block_size: 16, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, intermediate_size: 56, ..LlamaConfig::small(37) };
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let model = Llama::from_parameters(config, |_, shape| Ok((0..shape.iter().product()).map(|_| rng.random_range(-0.5..0.5)).collect()))?;
    let ids: Vec<u32> = (0..SEQUENCES * config.block_size).map(|_| rng.random_range(0..config.vocab_size as u32)).collect();

    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    let logits = Predictor::new(kernels.clone(), &model, SEQUENCES)?.outputs_ids(&ids)?;

    save_llama_folder(&dir, &model, None)?;
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new("ids", vec![SEQUENCES, config.block_size], ids.iter().map(|&i| i as f32).collect())?);
    out.push(NamedTensor::new("logits", vec![SEQUENCES, config.block_size, config.vocab_size], logits)?);
    out.set_meta("adapter", kernels.device().label());
    let mut logits_path = dir.clone().into_os_string();
    logits_path.push(".logits.safetensors");
    checkpoint::save(&logits_path, &out)?;
    println!("wrote {} and {} ({})", dir.display(), PathBuf::from(&logits_path).display(), kernels.device().label());
    Ok(())
}
