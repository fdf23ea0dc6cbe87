//! `wgrad generate` and `wgrad serve` on the Mistral GGUF fixture
//! (tests/fixtures/gguf-mistral.gguf: the tiny Llama of gguf-llama.gguf
//! with `llama.attention.sliding_window` = 3, as llama.cpp stores a
//! Mistral): for a prompt three windows long, the greedy ids are
//! transformers' (a MistralForCausalLM with the file's weights and window,
//! tests/fixtures/gguf-mistral-greedy.json, from
//! scripts/gguf_mistral_reference.py, each step's top-two margin above
//! 1e-3), and the Llama file (the same weights, no window) continues the
//! same prompt with transformers' other ids: the window takes effect in
//! generation, through the KV cache, the prefill and the server's slots.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// The reference: (prompt, greedy ids with the window, without it).
fn reference() -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let json: Value = serde_json::from_slice(&std::fs::read(fixture("gguf-mistral-greedy.json")).unwrap()).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap_or_else(|| panic!("no {key}"))
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    assert_eq!(json["window"], 3, "the fixture's window");
    let (prompt, greedy, without) = (ids("prompt"), ids("greedy"), ids("greedy_without_window"));
    assert!(prompt.len() > 3, "a prompt longer than the window");
    assert_ne!(greedy, without, "the window changes the continuation");
    (prompt, greedy, without)
}

/// `wgrad generate --prompt-ids … --print-ids` greedy on `model`: its new ids.
fn generate(model: &Path, prompt: &[u32], new: usize) -> Vec<u32> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt-ids", &ids.join(","), "--print-ids", "--temperature", "0"])
        .args(["--max-new-tokens", &new.to_string()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("new_ids"))
        .unwrap_or_else(|| panic!("no new_ids line: {stdout}\n{stderr}"));
    line.split_whitespace().map(|t| t.parse().unwrap()).collect()
}

#[test]
fn generate_gives_transformers_greedy_ids_through_the_window() {
    let (prompt, greedy, without) = reference();
    let mistral = fixture("gguf-mistral.gguf");
    assert_eq!(
        generate(&mistral, &prompt, greedy.len()),
        greedy,
        "the Mistral file against transformers' MistralForCausalLM"
    );
    assert_eq!(
        generate(&fixture("gguf-llama.gguf"), &prompt, without.len()),
        without,
        "the same weights without the window against transformers' Llama"
    );
}

/// A running `wgrad serve`, killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0", "--max-batch", "2"])
        .env_remove("WGRAD_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address in the first line: {line:?}"));
    Server { child, port }
}

/// POSTs `body` to `path` over HTTP/1.0: (status, JSON body).
fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = answer
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str(body).ok())
        .unwrap_or_else(|| panic!("no JSON body: {answer}"));
    (status, json)
}

#[test]
fn serve_completes_with_transformers_greedy_ids_through_the_window() {
    let (prompt, greedy, _) = reference();
    let model = fixture("gguf-mistral.gguf");
    // The text the server streams for `ids`: its tokenizer's, piece by piece.
    let gguf = wgrad::io::gguf::Gguf::open(&model).unwrap();
    let tokenizer = wgrad::io::bpe::BpeTokenizer::from_gguf(&gguf).unwrap();
    let mut stream = tokenizer.stream(true);
    let mut want = String::new();
    for &id in &greedy {
        want += &stream.push(id).unwrap();
    }
    want += &stream.finish();
    let server = serve(&model);
    // Twice: the second request runs in a slot the first one left, its
    // cache overwritten from position 0.
    for round in 0..2 {
        let (status, answer) = post(
            server.port,
            "/v1/completions",
            &json!({ "prompt": prompt, "max_tokens": greedy.len(), "temperature": 0 }),
        );
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["choices"][0]["text"], want.as_str(), "round {round}: {answer}");
        assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], greedy.len(), "{answer}");
        assert_eq!(answer["usage"]["prompt_tokens"], prompt.len(), "{answer}");
    }
}
