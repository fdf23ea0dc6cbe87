//! Writes the logits wgrad computes with a model folder that has its own
//! tokenizer (what `wgrad train --init` saves: config.json,
//! model.safetensors, tokenizer.json), for `scripts/check_hf_folder.py` to
//! compare with what transformers computes from the same folder and text.
//!
//! Run: `cargo run --release --example folder_logits -- out/tuned [TEXT]`,
//! then `python3 scripts/check_hf_folder.py out/tuned` (the ids, logits
//! and text go to `out/tuned.logits.safetensors`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use wgrad::infer::Predictor;
use wgrad::io::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::io::lm_folder::{lm_family, LmFamily};
use wgrad::models::{Gemma, Gpt, Llama};
use wgrad::train::{Pretrained, TrainableLm};

const TEXT: &str =
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.";

fn main() -> wgrad::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "out/tuned".into()));
    let text = args.next().unwrap_or_else(|| TEXT.into());
    match lm_family(&dir)? {
        LmFamily::Llama => write::<Llama>(&dir, &text),
        LmFamily::Gpt2 => write::<Gpt>(&dir, &text),
        LmFamily::Gemma3 => write::<Gemma>(&dir, &text),
    }
}

/// The folder's model on its tokenizer's ids of `text` (one sequence, the
/// model cropped to its length), saved beside the folder.
fn write<M: TrainableLm>(dir: &Path, text: &str) -> wgrad::Result<()> {
    let folder = Pretrained::<M>::load(dir)?;
    let ids = folder.tokenizer.encode(text)?;
    let model = folder.cropped(ids.len())?;
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    let logits = Predictor::new(kernels.clone(), &model, 1)?.outputs_ids(&ids)?;
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new(
        "ids",
        vec![1, ids.len()],
        ids.iter().map(|&i| i as f32).collect(),
    )?);
    out.push(NamedTensor::new(
        "logits",
        vec![1, ids.len(), model.vocab_size()],
        logits,
    )?);
    out.set_meta("adapter", kernels.device().label());
    out.set_meta("text", text);
    let mut path = dir.to_path_buf().into_os_string();
    path.push(".logits.safetensors");
    checkpoint::save(&path, &out)?;
    println!(
        "wrote {} ({} tokens, {})",
        PathBuf::from(&path).display(),
        ids.len(),
        kernels.device().label()
    );
    Ok(())
}
