//! `wgrad train --lora` over a quantized GGUF base (QLoRA): the tiny Llama
//! fixture (tests/fixtures/gguf-llama.gguf: Q4_0, Q4_1 and Q8_0 matrices
//! beside F32, F16 and BF16 ones) stays quantized by default and trains
//! as over its de-quantized base (`--base-dtype f32`); `--dry-run` plans
//! the adapters beside full fine-tuning, over the file or over the 1B
//! presets with a quantized base.

use std::path::Path;
use std::process::{Command, Output};

const GGUF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/gguf-llama.gguf");

fn wgrad(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wgrad")).args(args).output().unwrap()
}

fn ok(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The value after `key` on the line starting with `key`.
fn number_after(stdout: &str, key: &str) -> f64 {
    let line = stdout.lines().find(|l| l.starts_with(key)).unwrap_or_default();
    line[key.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after {key:?}: {stdout}"))
}

/// Four adapter steps over the fixture with its base kept quantized, and
/// the same run over the base de-quantized to f32: each says how its base
/// is stored, both lower the held-out loss, and the two start from the
/// same loss (the same weights: the kernels' f32 sums differ in order,
/// a few 1e-5 of it) and end within 1e-3 of each other.
#[test]
fn train_lora_over_a_gguf_file_keeps_the_base_quantized() {
    let dir = std::env::temp_dir().join(format!("wgrad-qlora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let (out, plot) = (dir.join(name), dir.join(format!("{name}.png")));
        let mut args = vec!["train", "--init", GGUF, "--lora", "r=2,alpha=4,targets=all-linear"];
        args.extend([
            "--text",
            text.to_str().unwrap(),
            "--block-size",
            "16",
            "--batch-size",
            "2",
        ]);
        args.extend(["--max-steps", "4", "--eval-every", "4", "--eval-batches", "1"]);
        args.extend(["--sample-tokens", "0", "--lr", "1e-2", "--seed", "3"]);
        args.extend(["--out", out.to_str().unwrap(), "--plot", plot.to_str().unwrap()]);
        args.extend(extra);
        let stdout = ok(&wgrad(&args));
        assert!(out.join("adapter_model.safetensors").is_file(), "{stdout}");
        stdout
    };
    let quantized = run("quantized", &[]);
    assert!(
        quantized.contains("frozen base on the device: quantized (Q4_0, Q4_1, Q8_0) as the file stores it"),
        "{quantized}"
    );
    assert!(quantized.contains("memory per device (the fullest)"), "{quantized}");
    // QLoRA checkpoints activations unless told not to; LoRA over f32 does not.
    let checkpointing = "activation checkpointing: on, as QLoRA trains";
    assert!(quantized.contains(checkpointing), "{quantized}");
    let f32_base = run("f32", &["--base-dtype", "f32"]);
    assert!(
        f32_base.contains("frozen base on the device: f32; adapters f32"),
        "{f32_base}"
    );
    assert!(!f32_base.contains(checkpointing), "{f32_base}");
    let start = |s: &str| number_after(s, "held-out loss at step 0:");
    let end = |s: &str| number_after(s, "final validation loss");
    assert!(
        (start(&quantized) - start(&f32_base)).abs() < 1e-3,
        "{quantized}\n{f32_base}"
    );
    assert!(
        (end(&quantized) - end(&f32_base)).abs() < 1e-3,
        "{quantized}\n{f32_base}"
    );
    assert!(end(&quantized) < start(&quantized), "{quantized}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--dry-run --init FILE --lora`: the adapters over the file's quantized
/// base per strategy, then the same strategies under full fine-tuning,
/// each adapter run a fraction of its full run, and the GPU one device
/// needs; planned with activation checkpointing (QLoRA's default), and
/// without it where --checkpoint-activations=false says so.
#[test]
fn dry_run_plans_adapters_over_a_file_beside_full_fine_tuning() {
    let plan = |extra: &[&str]| {
        let mut args = vec!["train", "--init", GGUF, "--lora", "r=2", "--dry-run"];
        args.extend(["--block-size", "16", "--batch-size", "2"]);
        args.extend(extra);
        ok(&wgrad(&args))
    };
    let planned_with = "planned with checkpointed activations";
    let plain = plan(&["--checkpoint-activations=false"]);
    assert!(!plain.contains(planned_with), "{plain}");
    let stdout = plan(&[]);
    assert!(stdout.contains(planned_with), "{stdout}");
    assert!(stdout.contains("frozen base on the device: quantized"), "{stdout}");
    let table = stdout
        .split("beside full fine-tuning")
        .nth(1)
        .unwrap_or_else(|| panic!("no comparison: {stdout}"));
    let single = table
        .lines()
        .find(|l| l.trim_start().starts_with("1  single"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let share: f64 = single
        .split_whitespace()
        .last()
        .and_then(|v| v.trim_end_matches('×').parse().ok())
        .unwrap_or_else(|| panic!("{single}"));
    assert!(share > 0.0 && share < 1.0, "{single}");
    assert!(table.contains("one device: the adapters fit a 4 GiB GPU"), "{stdout}");
}

/// The 1B presets planned with a quantized base (no file: the shapes and
/// --base-dtype's format): QLoRA of Llama 3.2 1B fits a GPU that full
/// fine-tuning does not, and Qwen2.5 1.5B plans alike.
#[test]
fn dry_run_plans_the_1b_presets_under_qlora() {
    let plan = |model: &str, preset: &str| {
        ok(&wgrad(&[
            "train",
            "--model",
            model,
            "--preset",
            preset,
            "--block-size",
            "256",
            "--batch-size",
            "1",
            "--lora",
            "r=16,alpha=32",
            "--base-dtype",
            "q4_0",
            "--dry-run",
            "--devices",
            "1",
        ]))
    };
    let llama = plan("llama", "llama3.2-1b");
    // PEFT's line: r = 16 on 7 Linears of 16 layers.
    assert!(
        llama.contains("trainable params: 11,272,192 || all params: 1,247,086,592"),
        "{llama}"
    );
    assert!(llama.contains("frozen base on the device: quantized (Q4_0)"), "{llama}");
    let fit = llama
        .lines()
        .find(|l| l.starts_with("one device:"))
        .unwrap_or_else(|| panic!("{llama}"));
    assert!(
        fit.contains("the adapters fit a 4 GiB GPU, full fine-tuning a 24 GiB GPU"),
        "{fit}"
    );
    let qwen = plan("qwen2", "qwen2.5-1.5b");
    assert!(qwen.contains("all params: 1,562,179,072"), "{qwen}");
    assert!(qwen.contains("one device: the adapters fit"), "{qwen}");
}

/// `--base-dtype` where it cannot apply: without --lora, a format over a
/// file (which is stored as it holds it), an unknown name; and tensor
/// parallel over a quantized base, which wgrad does not cut into shares.
#[test]
fn base_dtype_is_refused_where_it_does_not_apply() {
    let cases: [(&[&str], &str); 4] = [
        (&["--init", GGUF, "--base-dtype", "f16"], "give --lora"),
        (
            &["--model", "llama", "--dry-run", "--lora", "r=2", "--base-dtype", "q3"],
            "not auto, f32, f16 or a format",
        ),
        (
            &["--init", GGUF, "--lora", "r=2", "--base-dtype", "q4_0"],
            "as the file holds it",
        ),
        (
            &[
                "--init",
                GGUF,
                "--lora",
                "r=2",
                "--parallel",
                "tensor",
                "--devices",
                "2",
            ],
            "tensor parallel over a quantized base is not supported",
        ),
    ];
    for (args, says) in cases {
        let mut all = vec!["train"];
        all.extend(args);
        all.extend(["--plot", "/nonexistent/never.png", "--max-steps", "1"]);
        let output = wgrad(&all);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    assert!(Path::new(GGUF).is_file());
}

/// What `--dry-run` plans for one device is what the run then allocates:
/// the single-device total of the plan (KiB, this model being small)
/// against the run's own bytes, with the base quantized and checkpointed
/// (QLoRA's default) and without checkpointing, and with each attention
/// kernel named (auto picks by device, which a dry run has none of). The
/// plan aligns its slots to 256 bytes, WebGPU's default, where the device
/// aligns to its own (lavapipe's is smaller): the plan is the larger, by
/// under 1 KiB here (tests/suite/qlora.rs checks equality to the byte at
/// the device's alignment).
#[test]
fn the_dry_run_plans_the_bytes_the_run_allocates() {
    let dir = std::env::temp_dir().join(format!("wgrad-qlora-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let (out, plot) = (dir.join("out"), dir.join("loss.png"));
    for attention in ["fused", "unfused"] {
        for extra in [&[][..], &["--checkpoint-activations=false"][..]] {
            let mut args = vec![
                "train",
                "--init",
                GGUF,
                "--lora",
                "r=2,alpha=4",
                "--attention",
                attention,
            ];
            args.extend(["--block-size", "16", "--batch-size", "2"]);
            args.extend(extra);
            let mut dry = args.clone();
            dry.extend(["--dry-run", "--devices", "1"]);
            let planned = ok(&wgrad(&dry));
            let single = planned
                .lines()
                .find(|l| l.trim_start().starts_with("1  single"))
                .unwrap_or_else(|| panic!("{planned}"));
            assert!(planned.contains("bytes on the fullest device (KiB)"), "{planned}");
            let planned_kib = single.split_whitespace().last().unwrap_or_default().to_string();
            args.extend([
                "--text",
                text.to_str().unwrap(),
                "--max-steps",
                "1",
                "--eval-batches",
                "1",
            ]);
            args.extend(["--sample-tokens", "0", "--out", out.to_str().unwrap()]);
            args.extend(["--plot", plot.to_str().unwrap()]);
            let run = ok(&wgrad(&args));
            let line = run
                .lines()
                .find(|l| l.starts_with("memory per device (the fullest)"))
                .unwrap_or_else(|| panic!("{run}"));
            let bytes: f64 = line
                .rsplit('(')
                .next()
                .and_then(|b| b.trim_end_matches(" bytes)").parse().ok())
                .unwrap_or_else(|| panic!("{line}"));
            let planned_kib: f64 = planned_kib.parse().unwrap_or_else(|_| panic!("{single}"));
            let slack = planned_kib - bytes / 1024.0;
            assert!(
                (-0.05..1.0).contains(&slack),
                "{attention} {extra:?}: planned {single}, ran {line}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
