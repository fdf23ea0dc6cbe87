//! `wgrad train --lora` and `wgrad generate --lora` end to end on the tiny
//! Llama fixture (2 layers, 32 channels, vocabulary 37) and the PEFT
//! adapter fixture saved over it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf-tiny-llama");
const PEFT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/peft-tiny-llama-lora");

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

/// Greedy ids after `1 2 3` from the tiny Llama at `model`, with `extra` flags.
fn greedy_ids(model: &str, new: usize, extra: &[&str]) -> String {
    let new = new.to_string();
    let mut args = vec!["generate", "--model", model, "--prompt-ids", "1 2 3", "--print-ids"];
    args.extend(["--max-new-tokens", &new, "--temperature", "0"]);
    args.extend(extra);
    let stdout = ok(&wgrad(&args));
    let line = stdout.lines().find(|l| l.starts_with("new_ids")).unwrap_or_default();
    assert_eq!(
        line.split_whitespace().count(),
        new.parse::<usize>().unwrap() + 1,
        "{stdout}"
    );
    line.to_string()
}

/// The fixture with a char tokenizer of 18 symbols (its vocabulary is 37),
/// so `--init` can read text.
fn base_with_tokenizer(dir: &Path) -> PathBuf {
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(Path::new(BASE).join(file), base.join(file)).unwrap();
    }
    std::fs::write(
        base.join("wgrad_tokenizer.json"),
        r#"{"kind":"char","vocabulary":"\n abehinorstTquw.,"}"#,
    )
    .unwrap();
    base
}

/// Three adapter steps from a pretrained folder: PEFT's trainable line
/// (r = 2 on every Linear but the head: 2 layers × 2·(64 + 48 + 48 + 64 +
/// 88 + 88 + 88) = 1,952 of 19,424 + 1,952), a lower held-out loss, the
/// PEFT folder naming its base, which `generate --lora` then reads.
#[test]
fn train_lora_writes_a_peft_folder_that_generate_reads() {
    let dir = std::env::temp_dir().join(format!("wgrad-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = base_with_tokenizer(&dir);
    let (text, out, plot) = (dir.join("text.txt"), dir.join("adapter"), dir.join("loss.png"));
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let (base_s, text_s, out_s, plot_s) = (
        base.to_str().unwrap(),
        text.to_str().unwrap(),
        out.to_str().unwrap(),
        plot.to_str().unwrap(),
    );
    let stdout = ok(&wgrad(&[
        "train",
        "--init",
        base_s,
        "--lora",
        "r=2,alpha=4,dropout=0,targets=all-linear",
        "--text",
        text_s,
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--lr",
        "1e-2",
        "--out",
        out_s,
        "--plot",
        plot_s,
    ]));
    let line = "trainable params: 1,952 || all params: 21,376 || trainable%: 9.1317";
    let (at_line, at_start) = (stdout.find(line), stdout.find("held-out loss at step 0"));
    assert!(
        at_line.is_some() && at_line < at_start,
        "printed before training: {stdout}"
    );
    assert!(stdout.contains(&format!("adapter folder: {out_s}")), "{stdout}");
    let losses = stdout.lines().find(|l| l.starts_with("held-out loss: step 0")).unwrap();
    assert!(
        losses.contains("(-"),
        "the adapters lowered the held-out loss: {losses}"
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 2);
    assert_eq!(config["base_model_name_or_path"], base_s);
    let weights = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&weights[8..weights.len().min(8192)]).into_owned();
    assert!(
        header.contains("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
        "{header}"
    );

    let trained = greedy_ids(base_s, 6, &["--lora", out_s]);
    assert_eq!(trained, greedy_ids(base_s, 6, &["--lora", out_s]), "deterministic");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Adapters with dropout under tensor parallel over 2 devices: each splits
/// with its Linear, and the folder records PEFT's `lora_dropout`.
#[test]
fn train_lora_with_dropout_under_tensor_parallel() {
    let dir = std::env::temp_dir().join(format!("wgrad-lora-tp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = base_with_tokenizer(&dir);
    let (text, out, plot) = (dir.join("text.txt"), dir.join("adapter"), dir.join("loss.png"));
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let (base_s, text_s, out_s, plot_s) = (path(&base), path(&text), path(&out), path(&plot));
    let stdout = ok(&wgrad(&[
        "train",
        "--init",
        &base_s,
        "--lora",
        "r=2,alpha=4,dropout=0.1",
        "--parallel",
        "tensor",
        "--devices",
        "2",
        "--text",
        &text_s,
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--out",
        &out_s,
        "--plot",
        &plot_s,
    ]));
    assert!(stdout.contains("tensor parallel over 2 devices"), "{stdout}");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["lora_dropout"], serde_json::json!(0.1f32));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The PEFT fixture (non-zero B) changes the greedy tokens, the same each
/// time; scaled by 0 it is the base.
#[test]
fn generate_lora_applies_a_peft_adapter() {
    let base = greedy_ids(BASE, 6, &[]);
    // transformers' greedy continuation of [1, 2, 3] on this fixture.
    assert_eq!(base, "new_ids 1 24 24 24 24 24");
    let adapted = greedy_ids(BASE, 6, &["--lora", PEFT]);
    assert_ne!(adapted, base);
    assert_eq!(adapted, greedy_ids(BASE, 6, &["--lora", PEFT]));
    // The prefill's token (one new token: no cached decode step).
    assert_eq!(
        greedy_ids(BASE, 1, &["--lora", PEFT, "--lora-scale", "0"]),
        greedy_ids(BASE, 1, &[])
    );
    let missing = wgrad(&["generate", "--model", BASE, "--lora", "/nonexistent/adapter"]);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && err.contains("/nonexistent/adapter"),
        "{err}"
    );
}

/// A zero-B adapter (the fixture scaled by 0) decodes as the base does.
#[test]
fn generate_with_a_zero_adapter_equals_the_base() {
    assert_eq!(
        greedy_ids(BASE, 6, &["--lora", PEFT, "--lora-scale", "0"]),
        greedy_ids(BASE, 6, &[])
    );
}

/// `--lora` where it cannot run is refused before any device or file work.
#[test]
fn train_lora_refuses_runs_it_cannot_take() {
    let cases: [(&[&str], &str); 4] = [
        (&["--model", "mlp", "--lora", "r=2"], "not the MLP"),
        (&["--model", "llama", "--lora", "r=2"], "give --init"),
        (&["--init", BASE, "--lora", "r=2,dropout=1"], "not in [0, 1)"),
        (&["--init", BASE, "--lora", "r=0"], "at least 1"),
    ];
    for (args, says) in cases {
        let mut all = vec!["train"];
        all.extend(args);
        all.extend(["--plot", "/nonexistent/never.png", "--max-steps", "1"]);
        let output = wgrad(&all);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(
            err.contains("--lora does not apply") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

/// `--dry-run --lora`: the adapters' gradients and optimizer state only,
/// so one device needs fewer bytes than full training.
#[test]
fn dry_run_with_lora_plans_fewer_bytes() {
    let single_total = |extra: &[&str]| -> f64 {
        let mut args = vec!["train", "--model", "llama", "--dry-run", "--batch-size", "4"];
        args.extend(extra);
        let stdout = ok(&wgrad(&args));
        let row = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("1  single"))
            .unwrap();
        let fields: Vec<f64> = row.split_whitespace().skip(2).map(|v| v.parse().unwrap()).collect();
        // parameters, gradients, optimizer, activations, total
        assert_eq!(fields.len(), 5, "{row}");
        fields[1] + fields[2]
    };
    let full = single_total(&[]);
    let lora = single_total(&["--lora", "r=8,alpha=16"]);
    assert!(lora * 5.0 < full, "gradients and state: LoRA {lora} vs full {full}");
}
