//! `wgrad export`: a LoRA adapter merged into its base (W + scale·B·A for
//! every adapted Linear) and written as a model of its own: a Hugging Face
//! folder that transformers loads (config.json, model.safetensors, the
//! base's tokenizer files), or one GGUF file that llama.cpp runs (the base
//! GGUF file's metadata and tokenizer, every matrix stored as --type).

use std::path::{Path, PathBuf};

use clap::ValueEnum;
use wgrad::io::gguf::GgmlType;
use wgrad::io::gguf_model::GgufModel;
use wgrad::io::gpt_folder::TokenizerSpec;
use wgrad::io::lm_folder::{is_gguf_path, model_family, LmFamily};
use wgrad::models::{Gemma, Gpt, Llama};
use wgrad::train::{Pretrained, TrainableLm};

use crate::common::spinner;
use crate::generate::{invalid, read_adapter, BoxedLm};

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// A Hugging Face folder (config.json, model.safetensors in f32, the
    /// tokenizer's files).
    Hf,
    /// One GGUF file: the base GGUF file's metadata and tokenizer.
    Gguf,
}

/// `--type`: how a GGUF file stores its matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportType {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

impl ExportType {
    fn ggml(self) -> GgmlType {
        match self {
            ExportType::F32 => GgmlType::F32,
            ExportType::F16 => GgmlType::F16,
            ExportType::Q8_0 => GgmlType::Q8_0,
            ExportType::Q4_0 => GgmlType::Q4_0,
            ExportType::Q4_1 => GgmlType::Q4_1,
        }
    }
}

/// `wgrad export`'s flags.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The base model the adapter was trained over: a GGUF file or a
    /// Hugging Face folder (GPT-2, Llama, Qwen2/3, Mistral, Gemma 3).
    #[arg(long)]
    model: PathBuf,
    /// The PEFT LoRA adapter folder to merge in (adapter_config.json and
    /// adapter_model.safetensors, as `wgrad train --lora` or PEFT writes it).
    #[arg(long)]
    lora: PathBuf,
    /// Multiplies the adapter's product (its alpha / r) before merging:
    /// 1 (the default) is the adapter as trained.
    #[arg(long)]
    lora_scale: Option<f32>,
    /// Where to write: a folder (--format hf), or a file ending in .gguf
    /// (--format gguf). A folder wgrad wrote before is replaced.
    #[arg(long)]
    out: PathBuf,
    /// hf: a Hugging Face folder; gguf: one GGUF file, which needs a GGUF
    /// base (its metadata and tokenizer are copied) [default: gguf when
    /// --out ends in .gguf, else hf].
    #[arg(long, value_enum)]
    format: Option<ExportFormat>,
    /// --format gguf: how every matrix is stored (norms and biases keep the
    /// base's type; a matrix whose rows are not whole 32-value blocks is
    /// stored f16, as llama.cpp's converter does) [default: f16].
    #[arg(long = "type", value_enum)]
    tensor_type: Option<ExportType>,
}

fn refuse(reason: String) -> wgrad::Error {
    invalid("export", reason)
}

fn ends_in_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The format to write, from --format and --out, with every flag checked
/// against it before any file is read.
fn checked_format(args: &ExportArgs) -> wgrad::Result<ExportFormat> {
    let format = args.format.unwrap_or(if ends_in_gguf(&args.out) {
        ExportFormat::Gguf
    } else {
        ExportFormat::Hf
    });
    let out = args.out.display();
    match format {
        ExportFormat::Hf if args.tensor_type.is_some() => {
            return Err(refuse(
                "--type does not apply: it sets a GGUF file's tensor type, and --format hf writes a Hugging Face \
                 folder (f32); give --format gguf --out FILE.gguf"
                    .into(),
            ))
        }
        ExportFormat::Hf if ends_in_gguf(&args.out) => {
            return Err(refuse(format!(
                "--out `{out}` names a GGUF file, but --format hf writes a folder: give --format gguf or another --out"
            )))
        }
        ExportFormat::Gguf if !ends_in_gguf(&args.out) => {
            return Err(refuse(format!(
                "--out `{out}`: a GGUF file's name ends in .gguf (how wgrad and llama.cpp's tools recognise it)"
            )))
        }
        ExportFormat::Gguf if !is_gguf_path(&args.model) => {
            return Err(refuse(format!(
                "--format gguf copies the base GGUF file's metadata and tokenizer, but `{}` is a folder: give the \
                 base's GGUF file, or export --format hf and convert that folder with llama.cpp's \
                 convert_hf_to_gguf.py",
                args.model.display()
            )))
        }
        _ => {}
    }
    if !args.model.exists() {
        return Err(refuse(format!(
            "--model `{}` does not exist (give a GGUF file or a Hugging Face model folder)",
            args.model.display()
        )));
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(&args.model, &args.out) || same(&args.lora, &args.out) {
        return Err(refuse(format!(
            "--out `{out}` is the base model or the adapter itself: write the merged model elsewhere"
        )));
    }
    Ok(format)
}

pub fn export(args: &ExportArgs) -> wgrad::Result<()> {
    let format = checked_format(args)?;
    let scale = args.lora_scale.unwrap_or(1.0);
    // The adapter is read (and its format checked) before the base.
    let adapter = read_adapter(&args.lora, scale)?;
    let config = adapter.config.clone();
    let named = adapter.base_model.clone().filter(|b| !b.is_empty());
    let what = match format {
        ExportFormat::Hf => match model_family(&args.model)? {
            LmFamily::Gpt2 => export_hf::<Gpt>(args, adapter)?,
            LmFamily::Llama => export_hf::<Llama>(args, adapter)?,
            LmFamily::Gemma3 => export_hf::<Gemma>(args, adapter)?,
        },
        ExportFormat::Gguf => export_gguf(args, adapter)?,
    };
    println!(
        "merged the LoRA adapter {} (r={}, alpha={}, scale {scale}) into {}",
        args.lora.display(),
        config.r,
        config.alpha,
        args.model.display()
    );
    if let Some(named) = named {
        println!("(the adapter names its base `{named}`)");
    }
    println!("{what}");
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The merged model as a Hugging Face folder of family `M`, with the
/// base's tokenizer files (a GGUF base's tokenizer written as
/// tokenizer.json). Returns a line on what was written.
fn export_hf<M: TrainableLm + Clone>(
    args: &ExportArgs,
    adapter: wgrad::io::peft::PeftAdapter,
) -> wgrad::Result<String> {
    let bar = spinner("loading the base model");
    let base = Pretrained::<M>::load(&args.model);
    bar.finish_and_clear();
    let base = base?;
    let tokenizer = TokenizerSpec::from(&base.tokenizer);
    let adapters = adapter.adapters.len();
    let merged = adapter.apply(base.model)?.merged()?;
    merged.save_folder(&args.out, &tokenizer, None, &base.files)?;
    Ok(format!(
        "{adapters} adapted Linears folded in; a Hugging Face folder ({}) with {} tokenizer file(s)",
        merged.describe(),
        base.files.len()
    ))
}

/// The merged model as one GGUF file: the base file's metadata and
/// tensors, the merged weights and every matrix stored as --type.
fn export_gguf(args: &ExportArgs, adapter: wgrad::io::peft::PeftAdapter) -> wgrad::Result<String> {
    let ty = args.tensor_type.unwrap_or(ExportType::F16).ggml();
    let bar = spinner("loading the base model");
    let base = GgufModel::open(&args.model).and_then(|gguf| {
        let model = gguf.to_causal_lm()?;
        Ok((gguf, model))
    });
    bar.finish_and_clear();
    let (gguf, model) = base?;
    let weights = adapter.apply(BoxedLm(model))?.merged_weights()?;
    let bar = spinner("quantizing");
    let written = wgrad::io::gguf_write::merged_gguf(&gguf, &weights, ty).and_then(|(writer, report)| {
        writer.write(&args.out)?;
        Ok(report)
    });
    bar.finish_and_clear();
    let report = written?;
    let types: Vec<String> = report.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    let mut line = format!(
        "{} merged matrices; a GGUF file of {} tensors ({})",
        report.merged,
        report.types.iter().map(|(_, n)| n).sum::<usize>(),
        types.join(", ")
    );
    if !report.fallbacks.is_empty() {
        line.push_str(&format!(
            "; stored F16, their rows not whole {ty} blocks: {}",
            report.fallbacks.join(", ")
        ));
    }
    Ok(line)
}
