//! `wgrad chat` on a model without a chat template (a base model, as the
//! Gemma 3 270M file is): a clear message that suggests `wgrad generate`,
//! given before any device is opened or weight read, instead of a guessed
//! format. The file is a tokenizer fixture: a GGUF header with a
//! SentencePiece vocabulary and no template (and no tensors, which a chat
//! would need: the message comes first).

use std::path::PathBuf;
use std::process::{Command, Stdio};

#[test]
fn a_model_without_a_chat_template_is_refused_with_a_pointer_to_generate() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/spm-llama.gguf");
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("chat")
        .arg("--model")
        .arg(&model)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("has no chat template"), "{stderr}");
    assert!(stderr.contains("wgrad generate --model"), "{stderr}");
    assert!(stderr.contains("spm-llama.gguf"), "{stderr}");
}
