//! `wgrad train`'s memory for adapter runs: how `--base-dtype` stores the
//! frozen base (QLoRA keeps a GGUF file's blocks), and `--dry-run`'s
//! table of the same strategies under full fine-tuning, with the GPU
//! memory each single-device run needs.

use std::path::Path;
use std::sync::Arc;

use wgrad::io::gguf_model::GgufModel;
use wgrad::io::lm_folder::is_gguf_path;
use wgrad::kernels::QuantFormat;
use wgrad::nn::BaseStorage;
use wgrad::parallel::engine::Strategy;
use wgrad::parallel::memory::{DeviceMemory, Planning};

use crate::train::CliModel;

/// `--base-dtype`'s storage for a base read from `init` (None: a model
/// planned from a preset's sizes, `--dry-run`).
pub(crate) fn base_storage(spec: &str, init: Option<&Path>) -> wgrad::Result<BaseStorage> {
    let bad = |reason: String| wgrad::Error::InvalidArgument {
        op: "train --base-dtype",
        reason,
    };
    let format = QuantFormat::ALL
        .into_iter()
        .find(|f| f.name().eq_ignore_ascii_case(spec));
    Ok(match (spec.to_ascii_lowercase().as_str(), format, init) {
        ("auto", _, Some(path)) if is_gguf_path(path) => {
            let quantized = GgufModel::open(path)?.lora_base_weights()?;
            if quantized.is_empty() {
                BaseStorage::F32
            } else {
                BaseStorage::Quantized(Arc::new(quantized))
            }
        }
        ("auto" | "f32", ..) => BaseStorage::F32,
        ("f16", ..) => BaseStorage::F16,
        (_, Some(format), None) => BaseStorage::QuantizedAs(format),
        (_, Some(format), Some(path)) => {
            return Err(bad(format!(
                "{} plans a preset's base in --dry-run; `{}` is stored as the file holds it (auto), or f32 or f16",
                format.name(),
                path.display()
            )))
        }
        (other, None, _) => {
            let formats: Vec<String> = QuantFormat::ALL.iter().map(|f| f.name().to_lowercase()).collect();
            return Err(bad(format!(
                "`{other}` is not auto, f32, f16 or a format ({})",
                formats.join(", ")
            )));
        }
    })
}

/// The line an adapter run prints under PEFT's trainable-parameters line.
pub(crate) fn base_line(storage: &BaseStorage) -> String {
    let how = match storage {
        BaseStorage::F32 => "f32".to_string(),
        BaseStorage::Quantized(_) => format!(
            "{} as the file stores it (--base-dtype f32 de-quantizes it)",
            storage.describe()
        ),
        other => other.describe(),
    };
    format!("frozen base on the device: {how}; adapters f32")
}

/// GPU memory sizes a user may have, in GiB: the smallest that holds a
/// run is printed beside it.
const GPU_GIB: [u64; 11] = [4, 6, 8, 12, 16, 24, 32, 48, 80, 141, 192];

/// The smallest of [`GPU_GIB`] holding `bytes`, as a phrase.
fn fits(bytes: u64) -> String {
    match GPU_GIB.iter().find(|&&gib| bytes <= gib << 30) {
        Some(gib) => format!("a {gib} GiB GPU"),
        None => format!("no single GPU of up to {} GiB", GPU_GIB[GPU_GIB.len() - 1]),
    }
}

/// After `--dry-run`'s table of an adapter run (`rows`: devices, name,
/// strategy and what it planned): each strategy under full fine-tuning
/// of the same model (every weight trained in f32, with its gradient and
/// optimizer state), the adapters' share of it, and the GPU that one
/// device needs for each. Nothing for a run that trains every weight.
pub(crate) fn beside_full_fine_tuning<M: CliModel>(
    model: &M,
    rows: &[(usize, String, Strategy, wgrad::Result<DeviceMemory>)],
    planning: &Planning,
    attention: wgrad::nn::AttentionKernel,
    (unit, scale): (&str, f64),
) -> wgrad::Result<()> {
    let mut full_rows = Vec::new();
    for (n, name, strategy, memory) in rows {
        let Some(full) = model.full_memory(*strategy, *n, planning, attention) else {
            return Ok(());
        };
        full_rows.push((*n, name, memory, full));
    }
    println!("beside full fine-tuning of the same model (every weight trained, f32) on the fullest device ({unit}):");
    println!(
        "{:>7}  {:<9} {:>11} {:>11} {:>10}",
        "devices", "strategy", "adapters", "full", "share"
    );
    let v = |b: u64| format!("{:.1}", b as f64 / scale);
    for (n, name, memory, full) in &full_rows {
        match (memory, full) {
            (Ok(m), Ok(f)) => println!(
                "{n:>7}  {name:<9} {:>11} {:>11} {:>9.3}×",
                v(m.total()),
                v(f.total()),
                m.total() as f64 / f.total().max(1) as f64
            ),
            (Ok(m), Err(_)) => println!("{n:>7}  {name:<9} {:>11} {:>11}", v(m.total()), "cannot"),
            (Err(_), Ok(f)) => println!("{n:>7}  {name:<9} {:>11} {:>11}", "cannot", v(f.total())),
            (Err(_), Err(_)) => println!("{n:>7}  {name:<9} {:>11} {:>11}", "cannot", "cannot"),
        }
    }
    if let Some((_, _, Ok(m), Ok(f))) = full_rows.first() {
        println!(
            "one device: the adapters fit {}, full fine-tuning {} (planned bytes; the driver and the \
             runtime take some more)",
            fits(m.total()),
            fits(f.total())
        );
    }
    Ok(())
}
