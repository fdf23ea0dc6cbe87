//! Writes the logits wgrad computes with a pretrained model that has its
//! own tokenizer (what `wgrad train --init` saves: config.json,
//! model.safetensors, tokenizer.json; or a GGUF file), optionally with a
//! PEFT LoRA adapter over it, for a script to compare with what
//! transformers (and PEFT) compute from the same files and text:
//! `scripts/check_hf_folder.py` for a folder, `scripts/check_peft_adapter.py`
//! for an adapter.
//!
//! Run: `cargo run --release --example folder_logits -- MODEL [TEXT] [--lora ADAPTER]`,
//! then `python3 scripts/check_hf_folder.py MODEL` (the ids, logits and
//! text go to `MODEL.logits.safetensors`), or with `--lora`
//! `python3 scripts/check_peft_adapter.py MODEL ADAPTER` (to
//! `ADAPTER.logits.safetensors`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use wgrad::infer::Predictor;
use wgrad::io::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::io::lm_folder::{model_family, LmFamily};
use wgrad::models::{Gemma, Gpt, Llama};
use wgrad::nn::CausalLm;
use wgrad::train::{Pretrained, TrainableLm};

const TEXT: &str =
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.";

fn main() -> wgrad::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let lora = match args.iter().position(|a| a == "--lora") {
        Some(i) if i + 1 < args.len() => {
            let dir = PathBuf::from(args.remove(i + 1));
            args.remove(i);
            Some(dir)
        }
        Some(_) => {
            return Err(wgrad::Error::InvalidArgument {
                op: "folder_logits",
                reason: "--lora needs an adapter folder".into(),
            })
        }
        None => None,
    };
    let mut args = args.into_iter();
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "out/tuned".into()));
    let text = args.next().unwrap_or_else(|| TEXT.into());
    let lora = lora.as_deref();
    match model_family(&dir)? {
        LmFamily::Llama => write::<Llama>(&dir, &text, lora),
        LmFamily::Gpt2 => write::<Gpt>(&dir, &text, lora),
        LmFamily::Gemma3 => write::<Gemma>(&dir, &text, lora),
    }
}

/// The model's (and adapter's) logits on its tokenizer's ids of `text`
/// (one sequence, the model cropped to its length), saved beside the
/// adapter, or beside the model without one.
fn write<M: TrainableLm>(dir: &Path, text: &str, lora: Option<&Path>) -> wgrad::Result<()> {
    let folder = Pretrained::<M>::load(dir)?;
    let ids = folder.tokenizer.encode(text)?;
    let model = folder.cropped(ids.len())?;
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    let (logits, vocab) = match lora {
        Some(adapter) => {
            let model = wgrad::io::peft::load(model, adapter)?;
            (
                Predictor::new(kernels.clone(), &model, 1)?.outputs_ids(&ids)?,
                model.vocab_size(),
            )
        }
        None => (
            Predictor::new(kernels.clone(), &model, 1)?.outputs_ids(&ids)?,
            model.vocab_size(),
        ),
    };
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new(
        "ids",
        vec![1, ids.len()],
        ids.iter().map(|&i| i as f32).collect(),
    )?);
    out.push(NamedTensor::new("logits", vec![1, ids.len(), vocab], logits)?);
    out.set_meta("adapter", kernels.device().label());
    out.set_meta("text", text);
    let mut path = lora.unwrap_or(dir).to_path_buf().into_os_string();
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
