//! `wgrad serve` over loopback with the tiny GGUF Llama
//! (tests/fixtures/gguf-llama.gguf: its own BPE tokenizer and ChatML
//! template, random weights): OpenAI's objects streamed and not, the
//! errors and their statuses, the API key, a full queue, a client that
//! goes away, concurrent requests, and SIGTERM mid-stream.
//!
//! The fixture's context is 32 positions, shorter than a request needs to
//! still run when a test interrupts it, so the tests serve a copy whose
//! header says 4096 (a Llama's rotary positions extend to any context;
//! the weights are the fixture's). The client is std's TcpStream speaking
//! HTTP/1.0, which the server answers without chunking (the body ends at
//! the connection's end): enough for status, headers, JSON and SSE lines.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A copy of the fixture with `llama.context_length` = `context`, in a
/// folder of its own; the model's id is `tiny-llama`.
fn long_fixture(test: &str, context: u32) -> PathBuf {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf-llama.gguf");
    let mut bytes = std::fs::read(fixture).unwrap();
    let key = b"llama.context_length";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the context's key")
        + key.len();
    // GGUF metadata: the key, its value type (4: u32), the value.
    assert_eq!(
        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()),
        4,
        "a u32 context"
    );
    assert_eq!(u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()), 32);
    bytes[at + 4..at + 8].copy_from_slice(&context.to_le_bytes());
    let dir = std::env::temp_dir().join(format!("wgrad-serve-test-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-llama.gguf");
    std::fs::write(&path, bytes).unwrap();
    path
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

fn serve(test: &str, args: &[&str]) -> Server {
    serve_model(&long_fixture(test, 4096), args)
}

fn serve_model(model: &std::path::Path, args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0"])
        .args(args)
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
        .and_then(|p| p.parse().ok());
    let port = port.unwrap_or_else(|| panic!("no address in the first line: {line:?}"));
    Server { child, port }
}

/// An answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The OpenAI error body's `error` object, checked to have its four keys.
    fn error(&self) -> Value {
        let error = self.json()["error"].clone();
        for key in ["message", "type", "param", "code"] {
            assert!(error.get(key).is_some(), "no `{key}` in {}", self.body);
        }
        error
    }
}

/// Sends a request and returns the stream positioned at the body.
fn send(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> (BufReader<TcpStream>, u16, Vec<(String, String)>) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n");
    if let Some(key) = key {
        request += &format!("Authorization: Bearer {key}\r\n");
    }
    let body = body.unwrap_or("");
    if method == "POST" {
        request += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    request += "\r\n";
    request += body;
    stream.write_all(request.as_bytes()).unwrap();
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    (reader, status, headers)
}

fn request(port: u16, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> Answer {
    let (mut reader, status, headers) = send(port, method, path, body, key);
    let mut body = String::new();
    reader.read_to_string(&mut body).unwrap();
    Answer { status, headers, body }
}

fn post(port: u16, path: &str, body: &Value) -> Answer {
    request(port, "POST", path, Some(&body.to_string()), None)
}

fn health(port: u16) -> Value {
    let answer = request(port, "GET", "/health", None, None);
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()
}

/// Polls /health until `done` holds, for up to 20 s.
fn wait_for_health(port: u16, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let h = health(port);
        if done(&h) {
            return h;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: /health still says {h}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A streamed completion of `max_tokens` (EOS ignored), read up to its
/// first chunk: a request that runs on while the test acts.
fn start_stream(port: u16, max_tokens: usize) -> BufReader<TcpStream> {
    let long = json!({ "prompt": "x", "max_tokens": max_tokens, "ignore_eos": true, "stream": true }).to_string();
    let (mut reader, status, _) = send(port, "POST", "/v1/completions", Some(&long), None);
    assert_eq!(status, 200);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    reader
}

/// A short chat: a system message keeps the template's default one (longer
/// than the fixture's vocabulary makes cheap) out.
fn chat(extra: Value) -> Value {
    let mut body = json!({ "model": "tiny-llama", "messages": [{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "Hi!" }] });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The content of a streamed chat's chunks, and its last chunk before [DONE].
fn streamed_content(answer: &Answer) -> (String, Value) {
    let events = answer.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", answer.body);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(text) = c["choices"][0]["delta"]["content"].as_str() {
            content += text;
        }
    }
    let last = chunks
        .iter()
        .rev()
        .find(|c| !c["choices"].as_array().unwrap().is_empty())
        .unwrap()
        .clone();
    (content, last)
}

#[test]
fn serves_openai_requests_and_errors() {
    let server = serve(
        "api",
        &["--max-batch", "3", "--max-context", "256", "--max-body-bytes", "16384"],
    );
    let port = server.port;
    let h = health(port);
    assert_eq!(
        (
            h["status"].as_str(),
            h["slots_total"].as_u64(),
            h["slots_free"].as_u64(),
            h["context"].as_u64()
        ),
        (Some("ok"), Some(3), Some(3), Some(256))
    );
    let models = request(port, "GET", "/v1/models", None, None).json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    assert_eq!(
        request(port, "GET", "/v1/models/tiny-llama", None, None).json()["object"],
        "model"
    );

    let content = check_chat_completions(port);
    // A seed reproduces a sampled answer.
    let sampled = |seed: u64| {
        post(
            port,
            "/v1/chat/completions",
            &chat(json!({ "temperature": 1.0, "seed": seed, "max_tokens": 8, "ignore_eos": true })),
        )
        .json()["choices"][0]["message"]["content"]
            .clone()
    };
    assert_eq!(sampled(7), sampled(7));

    check_text_completions(port);
    check_errors(port, &content);
    // Concurrent streams, more than the slots, and a bad request among
    // them: every good stream completes.
    let threads: Vec<_> = (0..7)
        .map(|i| {
            std::thread::spawn(move || {
                let body = if i == 3 { json!({ "prompt": vec![5; 400] }) } else { json!({ "prompt": format!("request {i}"), "max_tokens": 20 + i, "ignore_eos": true, "stream": true }) };
                post(port, "/v1/completions", &body)
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let answer = t.join().unwrap();
        if i == 3 {
            assert_eq!(answer.status, 400);
            continue;
        }
        let events = answer.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "stream {i}: {}",
            answer.body
        );
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(last["usage"]["completion_tokens"], 20 + i, "stream {i}");
    }

    // A client that goes away mid-stream frees its slot.
    let reader = start_stream(port, 250);
    wait_for_health(port, "a running stream", |h| h["slots_free"] == 2);
    drop(reader);
    wait_for_health(port, "the slot after the client left", |h| {
        h["slots_free"] == 3 && h["in_flight"] == 0
    });
}

/// Whole and streamed chat completions, greedy: the same answer, with
/// usage. Returns the greedy answer.
fn check_chat_completions(port: u16) -> String {
    let whole = post(
        port,
        "/v1/chat/completions",
        &chat(json!({ "temperature": 0, "max_tokens": 6, "ignore_eos": true })),
    );
    assert_eq!(whole.status, 200, "{}", whole.body);
    let reply = whole.json();
    assert_eq!(reply["object"], "chat.completion");
    assert!(reply["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(reply["choices"][0]["message"]["role"], "assistant");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    let usage = &reply["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 5);
    assert_eq!(
        (usage["completion_tokens"].as_u64(), usage["total_tokens"].as_u64()),
        (Some(6), Some(prompt_tokens + 6))
    );
    let content = reply["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let streamed = post(
        port,
        "/v1/chat/completions",
        &chat(json!({ "temperature": 0, "max_tokens": 6, "ignore_eos": true, "stream": true })),
    );
    assert_eq!(streamed.status, 200);
    assert!(streamed
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let (streamed_text, last) = streamed_content(&streamed);
    assert_eq!(streamed_text, content, "streamed and whole greedy answers");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"], *usage, "usage in the final chunk");
    // stream_options.include_usage: OpenAI's usage-only chunk too.
    let with_usage = post(
        port,
        "/v1/chat/completions",
        &chat(
            json!({ "temperature": 0, "max_tokens": 2, "stream": true, "ignore_eos": true, "stream_options": { "include_usage": true } }),
        ),
    );
    let events = with_usage.events();
    let usage_only: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage_only["choices"], json!([]));
    assert_eq!(usage_only["usage"]["completion_tokens"], 2);

    content
}

/// Text completions, whole and streamed, and a stop string.
fn check_text_completions(port: u16) {
    let completion = post(
        port,
        "/v1/completions",
        &json!({ "model": "tiny-llama", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": true }),
    );
    assert_eq!(completion.status, 200, "{}", completion.body);
    let completion = completion.json();
    assert_eq!(completion["object"], "text_completion");
    assert_eq!(completion["choices"][0]["finish_reason"], "length");
    assert_eq!(completion["usage"]["completion_tokens"], 12);
    let text = completion["choices"][0]["text"].as_str().unwrap().to_string();
    let streamed = post(
        port,
        "/v1/completions",
        &json!({ "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": true }),
    );
    let events = streamed.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let pieces: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(pieces, text);
    // A stop string cuts the answer before it: the greedy text's second
    // and third characters.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "the greedy completion {text:?} is too short to cut");
    let stop: String = chars[1..3].iter().collect();
    let cut = post(
        port,
        "/v1/completions",
        &json!({ "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stop": [stop] }),
    )
    .json();
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        cut["choices"][0]["text"].as_str().unwrap(),
        &text[..text.find(&stop).unwrap()]
    );
}

/// Errors: OpenAI's body and status, and the next request is served
/// (`content`: the greedy chat answer before the errors).
fn check_errors(port: u16, content: &str) {
    let malformed = request(port, "POST", "/v1/chat/completions", Some("{\"messages\": [}"), None);
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.error()["type"], "invalid_request_error");
    let missing = post(port, "/v1/chat/completions", &json!({ "model": "tiny-llama" }));
    assert_eq!(
        (missing.status, missing.error()["param"].as_str()),
        (400, Some("messages"))
    );
    let long_prompt: Vec<u32> = (0..300).map(|i| 3 + i % 200).collect();
    let over = post(port, "/v1/completions", &json!({ "prompt": long_prompt }));
    assert_eq!(over.status, 400, "{}", over.body);
    let message = over.error()["message"].as_str().unwrap().to_string();
    assert!(message.contains("256") && message.contains("300"), "{message}");
    assert_eq!(over.error()["code"], "context_length_exceeded");
    let unknown = post(port, "/v1/chat/completions", &chat(json!({ "model": "gpt-9" })));
    assert_eq!(
        (unknown.status, unknown.error()["code"].as_str()),
        (404, Some("model_not_found"))
    );
    assert_eq!(post(port, "/v1/chat/completions", &chat(json!({ "n": 2 }))).status, 400);
    assert_eq!(
        post(port, "/v1/chat/completions", &chat(json!({ "temperature": 3 }))).status,
        400
    );
    let huge = post(port, "/v1/completions", &json!({ "prompt": "a".repeat(20_000) }));
    assert_eq!(huge.status, 413, "a body over --max-body-bytes");
    huge.error();
    let route = request(port, "GET", "/v1/nothing", None, None);
    assert_eq!(route.status, 404);
    route.error();
    let again = post(
        port,
        "/v1/chat/completions",
        &chat(json!({ "temperature": 0, "max_tokens": 6, "ignore_eos": true })),
    );
    assert_eq!(
        again.json()["choices"][0]["message"]["content"].as_str(),
        Some(content),
        "served after the errors, the same answer"
    );
}

#[test]
fn an_api_key_guards_every_route_but_health() {
    let server = serve("key", &["--api-key", "sesame", "--max-context", "64"]);
    let port = server.port;
    assert_eq!(request(port, "GET", "/health", None, None).status, 200);
    for key in [None, Some("open")] {
        let refused = request(port, "GET", "/v1/models", None, key);
        assert_eq!(refused.status, 401, "{key:?}");
        assert_eq!(refused.error()["code"], "invalid_api_key");
    }
    let body = chat(json!({ "max_tokens": 2 })).to_string();
    assert_eq!(
        request(port, "POST", "/v1/chat/completions", Some(&body), None).status,
        401
    );
    assert_eq!(request(port, "GET", "/v1/models", None, Some("sesame")).status, 200);
    assert_eq!(
        request(port, "POST", "/v1/chat/completions", Some(&body), Some("sesame")).status,
        200
    );
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let server = serve(
        "queue",
        &["--max-batch", "1", "--max-queue", "1", "--max-context", "2048"],
    );
    let port = server.port;
    // One request runs (2047 tokens, seconds here), one waits: the third
    // is refused.
    let long = json!({ "prompt": "x", "max_tokens": 2047, "ignore_eos": true, "stream": true }).to_string();
    let (running, status, _) = send(port, "POST", "/v1/completions", Some(&long), None);
    assert_eq!(status, 200);
    let waiting = std::thread::spawn(move || send(port, "POST", "/v1/completions", Some(&long), None));
    wait_for_health(port, "one running, one waiting", |h| h["in_flight"] == 2);
    let refused = post(port, "/v1/completions", &json!({ "prompt": "y", "max_tokens": 1 }));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.error()["type"], "rate_limit_error");
    drop(running);
    drop(waiting.join().unwrap());
    wait_for_health(port, "both gone", |h| h["in_flight"] == 0 && h["slots_free"] == 1);
    assert_eq!(
        post(port, "/v1/completions", &json!({ "prompt": "y", "max_tokens": 1 })).status,
        200
    );
}

#[cfg(unix)]
#[test]
fn sigterm_mid_stream_exits_zero() {
    let mut server = serve("sigterm", &["--max-context", "2048"]);
    let port = server.port;
    let mut reader = start_stream(port, 2047);
    let start = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap()
        .success());
    // The stream ends (an error event: the server is shutting down)...
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("shutting down"), "{rest}");
    // ...and the process exits 0 within a few seconds.
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bad requests, each OpenAI's error body with a 4xx: a message of a role
/// OpenAI does not take, a route asked with a method it does not take
/// (405, `Allow` kept), and a request the GPU worker refuses (an empty
/// prompt: the scheduler's check), streamed or not; `developer` is a
/// role (the system prompt's newer name).
#[test]
fn bad_requests_get_openai_errors_not_500s() {
    let server = serve("bad", &["--max-context", "64"]);
    let port = server.port;
    let wizard = json!({ "messages": [{ "role": "wizard", "content": "Hi!" }], "max_tokens": 2 });
    let refused = post(port, "/v1/chat/completions", &wizard);
    assert_eq!(refused.status, 400, "{}", refused.body);
    let error = refused.error();
    assert_eq!(
        (error["type"].as_str(), error["param"].as_str()),
        (Some("invalid_request_error"), Some("messages"))
    );
    assert!(error["message"].as_str().unwrap().contains("wizard"), "{error}");
    let messages = json!([{ "role": "developer", "content": "Be brief." }, { "role": "user", "content": "Hi!" }]);
    let developer = json!({ "messages": messages, "max_tokens": 2, "ignore_eos": true });
    assert_eq!(post(port, "/v1/chat/completions", &developer).status, 200);

    for (method, path, allowed) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/health", "GET"),
    ] {
        let answer = request(port, method, path, (method == "POST").then_some("{}"), None);
        assert_eq!(answer.status, 405, "{method} {path}: {}", answer.body);
        assert!(
            answer.header("allow").is_some_and(|a| a.contains(allowed)),
            "{method} {path}: {:?}",
            answer.headers
        );
        let error = answer.error();
        assert_eq!(error["code"], "method_not_allowed", "{method} {path}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(method) && message.contains(path), "{message}");
    }

    // The fixture's tokenizer adds no BOS: "" is no token at all.
    for stream in [false, true] {
        let empty = post(
            port,
            "/v1/completions",
            &json!({ "prompt": "", "max_tokens": 2, "stream": stream }),
        );
        assert_eq!(empty.status, 400, "stream {stream}: {}", empty.body);
        let error = empty.error();
        assert_eq!(error["type"], "invalid_request_error");
        assert!(error["message"].as_str().unwrap().contains("empty"), "{error}");
    }
    let after = post(
        port,
        "/v1/completions",
        &json!({ "prompt": "hello", "max_tokens": 2, "ignore_eos": true }),
    );
    assert_eq!(after.status, 200, "served after the refusals: {}", after.body);
    wait_for_health(port, "nothing left in flight", |h| h["in_flight"] == 0);
}

/// tests/fixtures/hf-tiny-llama (random weights, vocabulary 37, 16
/// positions) in a folder of its own with the byte-level BPE tokenizer
/// whose ids 0..n are spelled `spell(id)` (no merges: requests give ids).
fn tiny_llama_with_tokenizer(test: &str, n: usize, spell: impl Fn(usize) -> String) -> PathBuf {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny-llama");
    let dir = std::env::temp_dir()
        .join(format!("wgrad-serve-test-{test}-{}", std::process::id()))
        .join("tiny-llama");
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> = (0..n).map(|id| (spell(id), json!(id))).collect();
    assert_eq!(vocab.len(), n, "distinct spellings");
    let byte_level = json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true });
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [] },
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// The greedy next id of the tiny Llama after each of `prompts`, by
/// `wgrad generate` (one batch).
fn greedy_next(test: &str, prompts: &[Vec<u32>]) -> Vec<u32> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny-llama");
    let file = std::env::temp_dir().join(format!("wgrad-serve-test-{test}-{}-prompts.txt", std::process::id()));
    let line = |p: &Vec<u32>| p.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let lines: Vec<String> = prompts.iter().map(line).collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args([
            "generate",
            "--print-ids",
            "--max-new-tokens",
            "1",
            "--temperature",
            "0",
            "--model",
        ])
        .arg(fixture)
        .arg("--prompts-file")
        .arg(&file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let next = |s: usize| -> u32 {
        let tag = format!("new_ids {s} ");
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(tag.as_str()))
            .unwrap_or_else(|| panic!("{stdout}"));
        line.trim().parse().unwrap()
    };
    (0..prompts.len()).map(next).collect()
}

/// A model whose greedy pick has no text in its tokenizer (the tokenizer
/// holds the ids below it only): the server never samples such ids, so a
/// greedy and a hot sampled request complete, where sampling one ended
/// the request with a 500.
#[test]
fn ids_the_tokenizer_lacks_are_never_sampled() {
    // The prompt of two ids below 4 whose greedy id is the largest above
    // both: the tokenizer holds the prompt's ids, not the greedy one.
    let prompts: Vec<Vec<u32>> = (0..16).map(|i| vec![i / 4, i % 4]).collect();
    let next = greedy_next("lacking", &prompts);
    let above = prompts.iter().zip(&next).filter(|(p, &n)| n > p[0].max(p[1]));
    let (ids, lacking) = above.max_by_key(|(_, &n)| n).expect("a greedy id above its prompt's");
    let lacking = *lacking as usize;
    let model = tiny_llama_with_tokenizer("lacking", lacking, |id| format!("t{id}"));
    let server = serve_model(&model, &["--max-batch", "1"]);
    for (temperature, seed) in [(0.0, 0), (2.0, 1), (2.0, 2)] {
        let body = json!({ "prompt": ids, "max_tokens": 10, "temperature": temperature, "seed": seed,
            "ignore_eos": true });
        let answer = post(server.port, "/v1/completions", &body);
        assert_eq!(answer.status, 200, "temperature {temperature}: {}", answer.body);
        let reply = answer.json();
        assert_eq!(reply["usage"]["completion_tokens"], 10, "{reply}");
        // Each token's text is `t` and its id, every id below `lacking`.
        let text = reply["choices"][0]["text"].as_str().unwrap();
        let picked: Vec<usize> = text.split('t').skip(1).map(|id| id.parse().unwrap()).collect();
        assert!(
            picked.len() == 10 && picked.iter().all(|&id| id < lacking),
            "{text:?}, ids below {lacking}"
        );
    }
}

/// Every token of the tokenizer spelled a letter and the first byte of a
/// two-byte character (Ã is byte 0xC3 in byte-level BPE): a stop string
/// that a token's letter completes ends the text there, the byte after it
/// dropped, where it came out as U+FFFD after the stop.
#[test]
fn a_stop_ends_the_text_before_the_character_its_token_began() {
    let letters: Vec<char> = ('a'..='z').collect();
    let spell = |id: usize| format!("{}{}Ã", letters[id % 26], if id < 26 { "" } else { "q" });
    let model = tiny_llama_with_tokenizer("stop-utf8", 37, spell);
    let server = serve_model(&model, &["--max-batch", "1"]);
    let request = |stop: Option<&str>, stream: bool| {
        let mut body =
            json!({ "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": true, "stream": stream });
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        post(server.port, "/v1/completions", &body)
    };
    let whole = request(None, false).json();
    let greedy = whole["choices"][0]["text"].as_str().unwrap().to_string();
    // Each token's letters then U+FFFD (its 0xC3 went unfinished), the
    // last one's at the end too.
    assert!(greedy.ends_with('\u{FFFD}'), "{greedy:?}");
    let chars: Vec<char> = greedy.chars().collect();
    // The first letter, and the first other letter, as stops.
    let second = chars.iter().copied().find(|&c| c != chars[0] && c != '\u{FFFD}');
    for stop in [Some(chars[0]), second].into_iter().flatten() {
        let stop = stop.to_string();
        let want = &greedy[..greedy.find(&stop).unwrap()];
        let cut = request(Some(&stop), false).json();
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            cut["choices"][0]["text"].as_str(),
            Some(want),
            "stop {stop:?} in {greedy:?}"
        );
        let streamed = request(Some(&stop), true);
        let events = streamed.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", streamed.body);
        let pieces: String = events[..events.len() - 1]
            .iter()
            .map(|e| {
                serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(pieces, want, "streamed, stop {stop:?} in {greedy:?}");
    }
}
