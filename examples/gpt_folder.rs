//! Writes a GPT model folder and the logits wgrad computes with it, for
//! `scripts/check_hf_folder.py` to compare with what Hugging Face
//! transformers computes from the same folder.
//!
//! The model has random values in every parameter (norms and biases too),
//! so a swapped name or a missing transpose would show in the logits.
//!
//! Run: `cargo run --release --example gpt_folder -- out/gpt-folder`
//! then `/work/venv/bin/python scripts/check_hf_folder.py out/gpt-folder`
//! (the logits go to `out/gpt-folder.logits.safetensors`).

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::gpt_folder::{save_gpt_folder, TokenizerSpec};
use wgrad::nn::{Gpt, GptConfig};
use wgrad::trainer::Predictor;

const CONFIG: GptConfig = GptConfig { vocab_size: 37, block_size: 16, n_layer: 2, n_head: 3, n_embd: 24 };
const SEQUENCES: usize = 3;

fn main() -> wgrad::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "out/gpt-folder".into()));
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let model = Gpt::from_parameters(CONFIG, |_, shape| Ok((0..shape.iter().product()).map(|_| rng.random_range(-0.5..0.5)).collect()))?;
    let ids: Vec<u32> = (0..SEQUENCES * CONFIG.block_size).map(|_| rng.random_range(0..CONFIG.vocab_size as u32)).collect();

    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    let mut predictor = Predictor::new(kernels.clone(), &model, SEQUENCES)?;
    let logits = predictor.outputs_ids(&ids)?;

    // Printable characters from `!`, one per token.
    let vocabulary: String = (0..CONFIG.vocab_size as u8).map(|i| (b'!' + i) as char).collect();
    save_gpt_folder(&dir, &model, &TokenizerSpec::Char { vocabulary }, None)?;
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new("ids", vec![SEQUENCES, CONFIG.block_size], ids.iter().map(|&i| i as f32).collect())?);
    out.push(NamedTensor::new("logits", vec![SEQUENCES, CONFIG.block_size, CONFIG.vocab_size], logits)?);
    out.set_meta("adapter", kernels.device().label());
    let mut logits_path = dir.clone().into_os_string();
    logits_path.push(".logits.safetensors");
    checkpoint::save(&logits_path, &out)?;
    println!("wrote {} and {} ({})", dir.display(), PathBuf::from(&logits_path).display(), kernels.device().label());
    Ok(())
}
