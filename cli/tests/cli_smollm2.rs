//! `wgrad generate` and `wgrad chat` on SmolLM2-135M-Instruct's GGUF file
//! (Q4_1 matrices, a Q8_0 token table, all kept quantized on the GPU):
//! transformers' greedy tokens (tests/fixtures/smollm2-reference.json,
//! from the same file de-quantized), a chat that names Paris, and the
//! errors a user can cause. The file is needed: missing, these tests fail
//! and say how to fetch it.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `$WGRAD_SMOLLM2`, else wgrad's cache, where scripts/fetch-smollm2.sh
/// puts it.
fn smollm2() -> PathBuf {
    let path = wgrad_benches::smollm2_path().expect("no WGRAD_SMOLLM2 and no cache directory (HOME unset)");
    assert!(path.is_file(), "SmolLM2-135M-Instruct's GGUF file is missing at {}: fetch it with scripts/fetch-smollm2.sh, or point WGRAD_SMOLLM2 at a copy", path.display());
    path
}

fn wgrad(args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    // A command refused before it reads its input closes the pipe: that
    // write fails, and the exit status below is what the test checks.
    let _ = input.write_all(stdin.unwrap_or("").as_bytes());
    drop(input);
    child.wait_with_output().unwrap()
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The ids of `key` in the fixture's first prompt ("The capital of France is").
fn reference(key: &str) -> Vec<u32> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/smollm2-reference.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let case = &json["prompts"][0];
    assert_eq!(case["text"], "The capital of France is");
    case[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn generate_on_the_quantized_file_gives_transformers_greedy_tokens() {
    let model = smollm2();
    let output = wgrad(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "24",
            "--temperature",
            "0",
            "--print-ids",
        ],
        None,
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line = |tag: &str| -> Vec<u32> {
        let found = stdout
            .lines()
            .find(|l| l.starts_with(tag))
            .unwrap_or_else(|| panic!("no {tag} line: {stdout}"));
        found[tag.len()..]
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect()
    };
    assert_eq!(
        line("prompt_ids"),
        reference("ids"),
        "the file's tokenizer against transformers'"
    );
    let new = line("new_ids");
    assert_eq!(new.len(), 24, "no stop token in this continuation");
    // Measured: all 16 equal on the Q4_1 path too (the smallest margin
    // between the first and second logit is 0.15).
    assert_eq!(
        new[..16],
        reference("greedy")[..],
        "wgrad's greedy ids on the quantized weights against transformers' on the de-quantized ones"
    );
    for part in ["load", "prefill 5 tokens", "decode 23 tokens", "tokens/s"] {
        assert!(stderr.contains(part), "stderr does not report {part}: {stderr}");
    }
}

#[test]
fn chat_answers_that_paris_is_the_capital_of_france() {
    let model = smollm2();
    let output = wgrad(
        &["chat", "--model", model.to_str().unwrap(), "--temperature", "0"],
        Some("What is the capital of France?\n"),
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Paris"), "{stdout}");
    assert!(
        !stdout.contains("<|im_end|>"),
        "the end-of-turn token ends the answer unprinted: {stdout}"
    );
}

#[test]
fn bad_models_prompts_and_flags_are_clear_errors() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let cargo_toml = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let long_prompt = "a ".repeat(9000);
    let cases: [(&[&str], &[&str]); 7] = [
        (
            &["generate", "--model", "/nonexistent/model.gguf", "--prompt", "x"],
            &["/nonexistent/model.gguf"],
        ),
        (
            &["chat", "--model", "/nonexistent/model.gguf"],
            &["/nonexistent/model.gguf"],
        ),
        (&["generate", "--model", cargo_toml, "--prompt", "x"], &["Cargo.toml"]),
        (
            &["generate", "--model", model, "--prompt", &long_prompt],
            &["more than the context of 8192"],
        ),
        (
            &["generate", "--model", model, "--top-p", "1.5"],
            &["top_p must be in (0, 1]", "1.5"],
        ),
        (&["chat", "--model", model, "--temperature=-1"], &["temperature", "-1"]),
        (&["generate", "--model", model, "--top-k", "three"], &["--top-k"]),
    ];
    for (args, parts) in cases {
        let output = wgrad(args, Some("hello\n"));
        let (stdout, stderr) = text(&output);
        let code = output.status.code().expect("an exit code, not a signal");
        assert!(
            (1..100).contains(&code),
            "{:?}: exit code {code}\n{stdout}\n{stderr}",
            &args[..2]
        );
        for part in parts {
            assert!(
                stderr.contains(part),
                "{:?}: stderr does not mention {part}: {stderr}",
                &args[..2]
            );
        }
    }
}
