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
    json[open..close]
        .split(',')
        .map(|s| s.trim().parse().expect("an id"))
        .collect()
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
        .args([
            "--prompt-ids",
            &prompt_arg.join(","),
            "--temperature",
            "0",
            "--max-new-tokens",
            &greedy.len().to_string(),
            "--print-ids",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
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
    assert_eq!(line("prompt_ids"), prompt);
    assert_eq!(line("new_ids"), greedy, "wgrad's greedy ids against transformers'");
    assert!(stderr.contains("20 tokens in"), "{stderr}");

    // The same prompt three times in one batch: three sequences, each transformers' ids.
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("generate")
        .arg("--model")
        .arg(fixtures().join("hf-greedy-gpt2"))
        .args([
            "--prompt-ids",
            &prompt_arg.join(","),
            "--temperature",
            "0",
            "--max-new-tokens",
            &greedy.len().to_string(),
            "--print-ids",
            "--batch",
            "3",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for s in 0..3 {
        let tag = format!("new_ids {s} ");
        let found = stdout
            .lines()
            .find(|l| l.starts_with(&tag))
            .unwrap_or_else(|| panic!("no {tag} line: {stdout}"));
        let ids: Vec<u32> = found[tag.len()..]
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        assert_eq!(ids, greedy, "sequence {s} of the batch against transformers'");
    }
}

#[test]
fn prompt_ids_without_print_ids_and_bad_ids_are_errors() {
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .arg("generate")
            .arg("--model")
            .arg(fixtures().join("hf-greedy-gpt2"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            !output.status.success() && output.stdout.is_empty(),
            "{args:?} succeeded or printed"
        );
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
            .args([
                "--prompt-ids",
                "5,17,42",
                "--temperature",
                "0",
                "--max-new-tokens",
                "6",
                "--print-ids",
                "--dtype",
                "f16",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() && stderr.contains("adapter") && !stdout.contains("new_ids") {
            eprintln!("SKIP --backend {backend}: no such adapter here ({stderr})");
            continue;
        }
        assert!(output.status.success(), "{backend}: {stdout}\n{stderr}");
        let new_ids = stdout
            .lines()
            .find(|l| l.starts_with("new_ids"))
            .unwrap_or_else(|| panic!("no new_ids line: {stdout}"));
        assert_eq!(new_ids.split_whitespace().count(), 7, "{new_ids}");
        let notices = stderr
            .lines()
            .filter(|l| l.contains("--dtype f16 needs SHADER_F16"))
            .count();
        // wgpu's GL backend never offers SHADER_F16; a Vulkan adapter
        // (lavapipe) usually does, and says so once if not.
        if backend == "gl" {
            assert_eq!(notices, 1, "{backend}: {stderr}");
        } else {
            assert!(notices <= 1, "{backend}: {stderr}");
        }
    }
}

/// A random Llama with grouped-query attention (4 heads over 2 KV heads)
/// and a character vocabulary, saved by `save_llama_folder` with its
/// tokenizer (and once without): `wgrad generate` reads the architecture
/// from config.json and runs it with its KV cache. Greedy ids equal the
/// library's generator on the same default adapter (the same kernels: the
/// same ids), text comes out in the tokenizer's alphabet, and a folder
/// without a tokenizer needs --prompt-ids.
#[test]
fn a_llama_folder_saved_by_wgrad_generates() {
    use std::sync::Arc;
    use wgrad::infer::generate::{Generator, Sampling};
    use wgrad::io::gpt_folder::TokenizerSpec;
    use wgrad::models::{Llama, LlamaConfig};

    let vocabulary = " abcdefghijklmnopqrstuvwxyz.,";
    let config = LlamaConfig {
        vocab_size: vocabulary.chars().count(),
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        intermediate_size: 48,
        ..LlamaConfig::small(1)
    };
    wgrad::nn::manual_seed(5);
    let mut model = Llama::new(config).unwrap();
    // Far from uniform, so greedy picks are not near-ties.
    model.embed_tokens.weight.iter_mut().for_each(|w| *w *= 50.0);
    model
        .lm_head
        .as_mut()
        .unwrap()
        .weight
        .iter_mut()
        .for_each(|w| *w *= 50.0);
    let dir = std::env::temp_dir().join(format!("wgrad-llama-generate-{}", std::process::id()));
    let (with, without) = (dir.join("llama"), dir.join("no-tokenizer"));
    wgrad::io::llama_folder::save_llama_folder(
        &with,
        &model,
        Some(&TokenizerSpec::Char {
            vocabulary: vocabulary.into(),
        }),
    )
    .unwrap();
    wgrad::io::llama_folder::save_llama_folder(&without, &model, None).unwrap();
    let generate = |folder: &std::path::Path, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .arg("generate")
            .arg("--model")
            .arg(folder)
            .args(args)
            .output()
            .unwrap()
    };

    // Past the context of 16: the cache slides.
    let (prompt, new) = ([8u32, 5, 12, 12, 15], 24);
    let output = generate(
        &without,
        &[
            "--prompt-ids",
            "8,5,12,12,15",
            "--temperature",
            "0",
            "--max-new-tokens",
            &new.to_string(),
            "--print-ids",
        ],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let found = stdout
        .lines()
        .find(|l| l.starts_with("new_ids"))
        .unwrap_or_else(|| panic!("no new_ids line: {stdout}"));
    let ids: Vec<u32> = found["new_ids".len()..]
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default().unwrap()));
    let mut generator = Generator::new(kernels, &model, 1).unwrap();
    let want = generator
        .generate(&prompt, new, &Sampling::greedy(), |_| Ok(()))
        .unwrap();
    assert_eq!(ids, want, "the CLI's greedy ids against the library's generator");

    let output = generate(
        &with,
        &["--prompt", "hello", "--temperature", "0", "--max-new-tokens", "20"],
    );
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        text.starts_with("hello") && text.trim_end_matches('\n').chars().count() == 25,
        "{text:?}"
    );
    assert!(
        text.trim_end_matches('\n').chars().all(|c| vocabulary.contains(c)),
        "{text:?}"
    );
    // The char tokenizer's ids are the ones above: the same continuation.
    let decoded: String = want[..20]
        .iter()
        .map(|&i| vocabulary.chars().nth(i as usize).unwrap())
        .collect();
    assert_eq!(text.trim_end_matches('\n'), format!("hello{decoded}"));

    let output = generate(&without, &["--prompt", "hello"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("no tokenizer") && output.stdout.is_empty(),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn context_sizes_the_kv_cache() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .arg("generate")
            .arg("--model")
            .arg(fixtures().join("hf-greedy-gpt2"))
            .args(args)
            .output()
            .unwrap()
    };
    let ids = [
        "--prompt-ids",
        "1,2,3,4,5",
        "--print-ids",
        "--temperature",
        "0",
        "--max-new-tokens",
        "3",
    ];
    let output = run(&[&ids[..], &["--context", "4"]].concat());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("5 tokens") && err.contains("context of 4"),
        "{err}"
    );
    let output = run(&[&ids[..], &["--context", "0"]].concat());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("a context of 0 positions"),
        "{err}"
    );
    let output = run(&[&ids[..], &["--context", "6"]].concat());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let new_ids = stdout
        .lines()
        .find_map(|l| l.strip_prefix("new_ids"))
        .expect("a new_ids line");
    assert_eq!(
        new_ids.split_whitespace().count(),
        3,
        "three tokens through a 6-position cache (it rolls past its end): {stdout}"
    );
}
