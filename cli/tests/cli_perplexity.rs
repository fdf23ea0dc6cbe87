//! `wgrad perplexity` against transformers: the mean next-token loss on
//! llama-perplexity's windows (each window's second half scored, BOS first
//! where the tokenizer adds one) of the shipped Shakespeare (a `.gz` file),
//! beside tests/fixtures/perplexity-reference.json, which
//! scripts/perplexity_reference.py writes from the same GGUF file
//! de-quantized to float32. The model file is needed: missing, the test
//! fails and says how to fetch it (as tests/cli_smollm2.rs does).

use std::path::PathBuf;
use std::process::{Command, Output};

/// wgrad's loss within 1% of transformers' (relative): the windows' losses
/// are float32 sums over 30 layers in another order, and wgrad reads the
/// quantized blocks where transformers reads them de-quantized; measured
/// 2026-12-06 on llvmpipe: see the fixture's case and the note printed.
const RELATIVE: f64 = 0.01;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn wgrad(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wgrad")).args(args).output().unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn smollm2() -> PathBuf {
    let path = wgrad_benches::smollm2_path().expect("no WGRAD_SMOLLM2 and no cache directory (HOME unset)");
    assert!(path.is_file(), "SmolLM2-135M-Instruct's GGUF file is missing at {}: fetch it with scripts/fetch-smollm2.sh, or point WGRAD_SMOLLM2 at a copy", path.display());
    path
}

/// The value after `label` on its line of wgrad's output.
fn value(out: &str, label: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{out}"));
    line[label.len()..].split_whitespace().next().unwrap().parse().unwrap()
}

/// Runs the fixture's case `name` on `model` and compares.
fn check_case(name: &str, model: &std::path::Path) {
    let fixture = repo().join("tests/fixtures/perplexity-reference.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture).unwrap()).unwrap();
    let case = json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no case `{name}` in the fixture"));
    let text_path = repo().join(case["text"].as_str().unwrap());
    let (context, max_tokens) = (case["context"].to_string(), case["max_tokens"].to_string());
    let output = wgrad(&[
        "perplexity",
        "--model",
        model.to_str().unwrap(),
        "--text",
        text_path.to_str().unwrap(),
        "--context",
        &context,
        "--max-tokens",
        &max_tokens,
    ]);
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert_eq!(value(&out, "windows "), case["windows"].as_f64().unwrap(), "{out}");
    assert_eq!(value(&out, "tokens scored "), case["scored"].as_f64().unwrap(), "{out}");
    let (loss, expected) = (value(&out, "mean loss "), case["mean_loss"].as_f64().unwrap());
    let relative = (loss - expected).abs() / expected;
    eprintln!("{name}: wgrad {loss:.6} nats, transformers {expected:.6}: relative {relative:.2e}");
    assert!(
        relative < RELATIVE,
        "{name}: wgrad {loss} against transformers' {expected}\n{out}"
    );
    let perplexity = value(&out, "perplexity ");
    assert!((perplexity - loss.exp()).abs() < 1e-3 * perplexity, "{out}");
}

#[test]
fn smollm2_perplexity_is_transformers_within_one_percent() {
    check_case("smollm2", &smollm2());
}

/// Gemma 3 270M's Q4_K_M file: `$WGRAD_GEMMA3`, else where
/// scripts/fetch-gemma3.sh caches it (`make test` runs it).
fn gemma3() -> PathBuf {
    let path = std::env::var_os("WGRAD_GEMMA3")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| wgrad::user_cache::models_dir().map(|d| d.join("gemma-3-270m-q4_k_m.gguf")))
        .expect("no WGRAD_GEMMA3 and no cache directory (HOME unset)");
    assert!(
        path.is_file(),
        "Gemma 3's GGUF file is missing at {}: fetch it with scripts/fetch-gemma3.sh, or point WGRAD_GEMMA3 at a copy",
        path.display()
    );
    path
}

#[test]
fn gemma3_perplexity_is_transformers_within_one_percent() {
    check_case("gemma3", &gemma3());
}

#[test]
fn perplexity_refuses_what_cannot_be_scored() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let shakespeare = repo().join("data/shakespeare.txt.gz");
    let shakespeare = shakespeare.to_str().unwrap();
    let refused = |args: &[&str], expected: &str| {
        let output = wgrad(args);
        let out = text(&output);
        assert!(!output.status.success(), "{out}");
        assert!(out.contains(expected), "expected `{expected}` in:\n{out}");
    };
    refused(
        &[
            "perplexity",
            "--model",
            model,
            "--text",
            shakespeare,
            "--max-tokens",
            "0",
        ],
        "--max-tokens must be at least 1",
    );
    refused(
        &["perplexity", "--model", model, "--text", "no-such-text.txt"],
        "is not a file",
    );
    // A window of 2 tokens scores no prediction of its second half.
    refused(
        &[
            "perplexity",
            "--model",
            model,
            "--text",
            shakespeare,
            "--context",
            "2",
            "--max-tokens",
            "8",
        ],
        "give 3",
    );
    // 100 tokens fill no window of 128.
    refused(
        &[
            "perplexity",
            "--model",
            model,
            "--text",
            shakespeare,
            "--context",
            "128",
            "--max-tokens",
            "100",
        ],
        "fewer than one window of 128",
    );
}
