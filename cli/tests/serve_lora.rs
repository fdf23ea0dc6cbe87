//! `wgrad serve --lora NAME=DIR` (repeated): four PEFT adapters over the
//! tiny Llama fixture (tests/fixtures/hf-tiny-llama, random weights,
//! vocabulary 37, 16 positions), written here with ranks 1, 4, 8 and 16 on
//! different Linears. Each adapter's greedy answer is `wgrad generate
//! --lora` with it, asked one at a time and with the four (and the base) in
//! flight together, when their rows share decode steps; /v1/models lists
//! the base and every adapter; an unknown model is a 404; a bad adapter
//! folder stops the server at start-up naming it. The client is std's
//! TcpStream speaking HTTP/1.0 (the body ends with the connection).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf-tiny-llama");
/// The fixture's sizes: hidden 32, KV projections 16 wide, MLP 56, 2 layers.
const HIDDEN: usize = 32;
const KV: usize = 16;
const MLP: usize = 56;
const VOCAB: usize = 37;
/// Tokens asked of each request: the prompt's 3 and these fill 13 of the
/// 16 positions.
const NEW: usize = 10;

fn work_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-serve-lora-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The fixture with a byte-level BPE tokenizer spelling id i as `<i>`
/// (serve needs one; requests give ids, and the answer's text spells
/// them), in `dir`/tiny-llama: the base's model id.
fn base_with_tokenizer(dir: &Path) -> PathBuf {
    let base = dir.join("tiny-llama");
    std::fs::create_dir_all(&base).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(FIXTURE).join(file), base.join(file)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> = (0..VOCAB).map(|id| (format!("<{id}>"), json!(id))).collect();
    let byte_level = json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true });
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [] },
    });
    std::fs::write(base.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    base
}

/// A Linear's (module suffix, in, out).
fn linear(name: &str) -> (usize, usize) {
    match name {
        "self_attn.q_proj" | "self_attn.o_proj" => (HIDDEN, HIDDEN),
        "self_attn.k_proj" | "self_attn.v_proj" => (HIDDEN, KV),
        "mlp.gate_proj" | "mlp.up_proj" => (HIDDEN, MLP),
        "mlp.down_proj" => (MLP, HIDDEN),
        other => panic!("no Linear {other}"),
    }
}

/// A PEFT adapter folder over the fixture: rank `r`, alpha 2r, on the
/// Linears `targets` of both layers, A and B uniform in ±`bound` from
/// `seed`; `layers` names the layers (a wrong one makes a bad adapter).
fn write_adapter(dir: &Path, r: usize, targets: &[&str], seed: u64, layers: &[usize]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let short: Vec<&str> = targets.iter().map(|t| t.rsplit('.').next().unwrap()).collect();
    let config = json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": FIXTURE,
        "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0, "target_modules": short, "bias": "none",
        "use_dora": false, "use_rslora": false,
    });
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for layer in layers {
        for target in targets {
            let (i, o) = linear(target);
            let module = format!("base_model.model.model.layers.{layer}.{target}");
            for (matrix, shape) in [("lora_A", [r, i]), ("lora_B", [o, r])] {
                let start = data.len();
                for _ in 0..shape[0] * shape[1] {
                    data.extend(rng.random_range(-0.5f32..0.5).to_le_bytes());
                }
                header.insert(
                    format!("{module}.{matrix}.weight"),
                    json!({ "dtype": "F32", "shape": shape, "data_offsets": [start, data.len()] }),
                );
            }
        }
    }
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut text = Value::Object(header).to_string();
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend(text.as_bytes());
    file.extend(data);
    std::fs::write(dir.join("adapter_model.safetensors"), file).unwrap();
    dir.to_path_buf()
}

/// The four adapters: (name, folder).
fn four_adapters(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let spec: [(&str, usize, &[&str]); 4] = [
        ("alpha", 1, &["self_attn.q_proj", "self_attn.v_proj"]),
        (
            "beta",
            8,
            &[
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ],
        ),
        ("gamma", 16, &["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
        ("delta", 4, &["self_attn.k_proj", "self_attn.o_proj"]),
    ];
    spec.iter()
        .enumerate()
        .map(|(i, &(name, r, targets))| {
            (
                name,
                write_adapter(&dir.join(name), r, targets, 100 + i as u64, &[0, 1]),
            )
        })
        .collect()
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wgrad")).args(args).output().unwrap()
}

/// `wgrad generate`'s greedy ids after `prompt` on the fixture, with
/// `--lora dir` when given.
fn generate_ids(prompt: &[u32], lora: Option<&Path>) -> Vec<u32> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let new = NEW.to_string();
    let mut args = vec!["generate", "--model", FIXTURE, "--prompt-ids"];
    let joined = ids.join(" ");
    args.extend([
        joined.as_str(),
        "--print-ids",
        "--max-new-tokens",
        &new,
        "--temperature",
        "0",
    ]);
    let lora_s = lora.map(|p| p.to_str().unwrap().to_string());
    if let Some(l) = &lora_s {
        args.extend(["--lora", l.as_str()]);
    }
    let output = run(&args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("new_ids"))
        .unwrap_or_else(|| panic!("{stdout}"));
    line.split_whitespace().map(|t| t.parse().unwrap()).collect()
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

fn serve(base: &Path, args: &[String]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("serve")
        .arg("--model")
        .arg(base)
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
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address in the first line: {line:?}"));
    assert!(line.contains("with adapters alpha, beta, gamma, delta"), "{line}");
    Server { child, port }
}

/// (status, body) of a request.
fn request(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut text = format!("{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n");
    if method == "POST" {
        text += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    text += "\r\n";
    text += &body;
    stream.write_all(text.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The ids a completion's text spells (`<i>` each).
fn ids_of(text: &str) -> Vec<u32> {
    text.split(['<', '>'])
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

/// A greedy completion of `prompt` by `model`: (its model field, its ids).
fn complete(port: u16, model: &str, prompt: &[u32]) -> (String, Vec<u32>) {
    let body = json!({ "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": true });
    let (status, answer) = request(port, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 200, "{model}: {answer}");
    let reply = json_of(&answer);
    let text = reply["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{reply}"));
    (reply["model"].as_str().unwrap_or_default().to_string(), ids_of(text))
}

#[test]
fn each_adapter_answers_as_generate_with_it_alone_and_together() {
    let dir = work_dir("four");
    let base = base_with_tokenizer(&dir);
    let adapters = four_adapters(&dir);
    let prompts: [Vec<u32>; 5] = [
        vec![1, 2, 3],
        vec![4, 5, 6],
        vec![7, 8, 9],
        vec![10, 11, 12],
        vec![13, 14, 15],
    ];
    // (the API's model name, its folder) for the base and each adapter.
    let mut models: Vec<(String, Option<PathBuf>)> =
        adapters.iter().map(|(n, d)| (n.to_string(), Some(d.clone()))).collect();
    models.push(("tiny-llama".into(), None));
    let want: Vec<Vec<u32>> = models
        .iter()
        .zip(&prompts)
        .map(|((_, d), p)| generate_ids(p, d.as_deref()))
        .collect();
    // Every adapter changes the base's answer to its prompt (else the
    // comparison shows nothing).
    for (i, (name, _)) in models[..4].iter().enumerate() {
        assert_ne!(
            want[i],
            generate_ids(&prompts[i], None),
            "adapter {name} changes the answer"
        );
    }

    let mut args: Vec<String> = vec!["--max-batch".into(), "5".into()];
    for (name, folder) in &adapters {
        args.extend(["--lora".into(), format!("{name}={}", folder.display())]);
    }
    let server = serve(&base, &args);
    let port = server.port;

    let (status, listed) = request(port, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{listed}");
    let listed = json_of(&listed);
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["tiny-llama", "alpha", "beta", "gamma", "delta"], "{listed}");
    assert_eq!(listed["data"][2]["parent"], "tiny-llama", "{listed}");
    let (status, one) = request(port, "GET", "/v1/models/gamma", None);
    assert_eq!((status, json_of(&one)["id"].clone()), (200, json!("gamma")), "{one}");

    // One at a time.
    for ((name, _), (prompt, want)) in models.iter().zip(prompts.iter().zip(&want)) {
        let (model, got) = complete(port, name, prompt);
        assert_eq!(model, *name);
        assert_eq!(&got, want, "{name} alone");
    }

    // All five in flight together: their rows share decode steps.
    let health = |key: &str| json_of(&request(port, "GET", "/health", None).1)[key].as_u64().unwrap();
    let (steps, rows) = (health("decode_steps"), health("decoded_rows"));
    let start = Arc::new(Barrier::new(models.len()));
    let threads: Vec<_> = models
        .iter()
        .zip(&prompts)
        .map(|((name, _), prompt)| {
            let (name, prompt, start) = (name.clone(), prompt.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                complete(port, &name, &prompt).1
            })
        })
        .collect();
    for ((name, _), (thread, want)) in models.iter().zip(threads.into_iter().zip(&want)) {
        assert_eq!(&thread.join().unwrap(), want, "{name} beside the others");
    }
    let (steps, rows) = (health("decode_steps") - steps, health("decoded_rows") - rows);
    assert!(
        rows > steps,
        "the requests decoded together: {rows} rows in {steps} steps"
    );

    // An unknown model is OpenAI's 404, naming what is served.
    let body = json!({ "model": "epsilon", "prompt": [1], "max_tokens": 1 });
    let (status, answer) = request(port, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 404, "{answer}");
    let error = json_of(&answer)["error"].clone();
    assert_eq!(error["code"], "model_not_found", "{error}");
    assert!(error["message"].as_str().unwrap().contains("`delta`"), "{error}");
    let (status, _) = request(port, "GET", "/v1/models/epsilon", None);
    assert_eq!(status, 404);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Refused at start-up, each naming what is wrong: a folder that is not
/// there, an adapter for Linears the base lacks, a name used twice, the
/// base's own name, a spec without `=`.
#[test]
fn bad_adapters_stop_the_server_at_start_up() {
    let dir = work_dir("bad");
    let base = base_with_tokenizer(&dir);
    let good = write_adapter(&dir.join("good"), 2, &["self_attn.q_proj"], 1, &[0, 1]);
    let foreign = write_adapter(&dir.join("foreign"), 2, &["self_attn.q_proj"], 2, &[0, 1, 7]);
    let good_s = good.display().to_string();
    let foreign_s = foreign.display().to_string();
    let cases: [(Vec<String>, &str); 5] = [
        (vec![format!("a=/nonexistent/adapter")], "/nonexistent/adapter"),
        (vec![format!("b={foreign_s}")], &foreign_s),
        (
            vec![format!("c={good_s}"), format!("c={good_s}")],
            "two adapters are named `c`",
        ),
        (vec![format!("tiny-llama={good_s}")], "the base model's name"),
        (vec![good_s.clone()], "is not NAME=DIR"),
    ];
    for (specs, says) in cases {
        let mut args = vec![
            "serve".to_string(),
            "--model".into(),
            base.display().to_string(),
            "--port".into(),
            "0".into(),
        ];
        for s in &specs {
            args.extend(["--lora".into(), s.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = run(&args);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{specs:?} was served");
        assert!(err.contains(says), "{specs:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
