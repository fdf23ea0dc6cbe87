//! `wgrad generate` on a Hugging Face GPT-2 folder: with `--prompt-ids` and
//! `--print-ids`, the greedy ids transformers' `generate` gives
//! (tests/fixtures/hf-greedy-gpt2, see tests/suite/generate.rs).

use std::path::PathBuf;
use std::process::Command;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The numbers of the JSON array `key` holds in `json` (a flat file of
/// arrays of integers, as scripts/check_greedy.py writes it).
fn json_ids(json: &str, key: &str) -> Vec<u32> {
    let start = json.find(&format!("\"{key}\"")).expect("key") + key.len() + 2;
    let open = start + json[start..].find('[').expect("[") + 1;
    let close = open + json[open..].find(']').expect("]");
    json[open..close].split(',').map(|s| s.trim().parse().expect("an id")).collect()
}

#[test]
fn greedy_ids_printed_equal_transformers() {
    let json = std::fs::read_to_string(fixtures().join("hf-greedy-gpt2-ids.json")).unwrap();
    let (prompt, greedy) = (json_ids(&json, "prompt"), json_ids(&json, "greedy"));
    let prompt_arg: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("generate")
        .arg("--model")
        .arg(fixtures().join("hf-greedy-gpt2"))
        .args(["--prompt-ids", &prompt_arg.join(","), "--temperature", "0", "--max-new-tokens", &greedy.len().to_string(), "--print-ids"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line = |tag: &str| -> Vec<u32> {
        let found = stdout.lines().find(|l| l.starts_with(tag)).unwrap_or_else(|| panic!("no {tag} line: {stdout}"));
        found[tag.len()..].split_whitespace().map(|t| t.parse().unwrap()).collect()
    };
    assert_eq!(line("prompt_ids"), prompt);
    assert_eq!(line("new_ids"), greedy, "wgrad's greedy ids against transformers'");
    assert!(stderr.contains("20 tokens in"), "{stderr}");

    // The same prompt three times in one batch: three sequences, each transformers' ids.
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("generate")
        .arg("--model")
        .arg(fixtures().join("hf-greedy-gpt2"))
        .args(["--prompt-ids", &prompt_arg.join(","), "--temperature", "0", "--max-new-tokens", &greedy.len().to_string(), "--print-ids", "--batch", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for s in 0..3 {
        let tag = format!("new_ids {s} ");
        let found = stdout.lines().find(|l| l.starts_with(&tag)).unwrap_or_else(|| panic!("no {tag} line: {stdout}"));
        let ids: Vec<u32> = found[tag.len()..].split_whitespace().map(|t| t.parse().unwrap()).collect();
        assert_eq!(ids, greedy, "sequence {s} of the batch against transformers'");
    }
}

#[test]
fn prompt_ids_without_print_ids_and_bad_ids_are_errors() {
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_wgrad")).arg("generate").arg("--model").arg(fixtures().join("hf-greedy-gpt2")).args(args).output().unwrap();
        assert!(!output.status.success() && output.stdout.is_empty(), "{args:?} succeeded or printed");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let err = run(&["--prompt-ids", "1,2"]);
    assert!(err.contains("--print-ids"), "{err}");
    let err = run(&["--prompt-ids", "1,x", "--print-ids"]);
    assert!(err.contains("`x`"), "{err}");
    // The fixture's vocabulary is 96.
    let err = run(&["--prompt-ids", "1,96", "--print-ids"]);
    assert!(err.contains("96") && err.contains("vocabulary"), "{err}");
    // No tokenizer for a 96-token vocabulary: text needs one.
    let err = run(&["--prompt", "hello"]);
    assert!(err.contains("no tokenizer"), "{err}");
}

/// `--dtype f16`: the weights in f16 where the adapter has SHADER_F16
/// (lavapipe), else f32 with a one-line notice (llvmpipe through GL). The
/// ids are not compared with transformers' here: rounding the weights may
/// move a greedy choice (tests/suite/f16_weights.rs checks the logits).
#[test]
fn dtype_f16_generates_or_falls_back_with_a_notice() {
    for backend in ["vulkan", "gl"] {
        let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .args(["--backend", backend, "generate", "--model"])
            .arg(fixtures().join("hf-greedy-gpt2"))
            .args(["--prompt-ids", "5,17,42", "--temperature", "0", "--max-new-tokens", "6", "--print-ids", "--dtype", "f16"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() && stderr.contains("adapter") && !stdout.contains("new_ids") {
            eprintln!("SKIP --backend {backend}: no such adapter here ({stderr})");
            continue;
        }
        assert!(output.status.success(), "{backend}: {stdout}\n{stderr}");
        let new_ids = stdout.lines().find(|l| l.starts_with("new_ids")).unwrap_or_else(|| panic!("no new_ids line: {stdout}"));
        assert_eq!(new_ids.split_whitespace().count(), 7, "{new_ids}");
        let notices = stderr.lines().filter(|l| l.contains("--dtype f16 needs SHADER_F16")).count();
        // wgpu's GL backend never offers SHADER_F16; a Vulkan adapter
        // (lavapipe) usually does, and says so once if not.
        if backend == "gl" {
            assert_eq!(notices, 1, "{backend}: {stderr}");
        } else {
            assert!(notices <= 1, "{backend}: {stderr}");
        }
    }
}
