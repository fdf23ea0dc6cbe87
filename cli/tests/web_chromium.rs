//! The page of `make web` in headless Chromium (Dawn, Tint, SwiftShader,
//! under WebGPU's default limits), against the native engine in the same
//! test: scripts/build-web.sh builds wgrad-web for wasm32 with its
//! bindings, a tiny HTTP server here serves it, and the page's self-test
//! (web/www/selftest.js) trains make train's GPT for 20 steps, generates
//! greedily with SmolLM2 and answers one chat turn, then POSTs its report.
//!
//! Native is the library on lavapipe (Mesa's Vulkan driver on the CPU;
//! SwiftShader's, the one Chromium ships, where lavapipe is missing)
//! opened with WebGPU's limits: the same run, seed and windows stepped
//! through `TrainingRun::step_async`, and `wgrad generate`'s greedy tokens.
//! Two drivers and two compilers (naga natively, Tint in Chromium) on the
//! same kernels: SwiftShader natively ran the same test at about 80 s of
//! CPU beside the build and the browser, lavapipe at a few.
//!
//! Without Chromium the test says SKIP in one line, and fails where CI
//! requires it (`CI`, `WGRAD_REQUIRE_ADAPTER` or `WGRAD_REQUIRE_CHROMIUM`
//! set), as the kernels' browser test does; without the wasm32 target or
//! wasm-bindgen at Cargo.lock's version it says SKIP too, and fails only
//! where `WGRAD_REQUIRE_WASM` is set (.ci/run sets it once it installed
//! them: a machine may be unable to).
//! SmolLM2's GGUF file is needed as by the other SmolLM2 tests
//! (scripts/fetch-smollm2.sh).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling};
use wgrad::models::Gpt;
use wgrad::train::{language_model_run, LanguageModel, TrainConfig, TrainingRun, MAKE_TRAIN_GPT};
use wgrad::{Device, DeviceOptions, Kernels, LimitsMode};

/// Training steps the page takes and compares.
const STEPS: usize = 20;
/// Greedy tokens compared after the prompt.
const TOKENS: usize = 16;
/// The KV cache's positions on both sides (the chat turn fits).
const CONTEXT: usize = 128;
const PROMPT: &str = "The capital of France is";
/// Characters of the trained GPT's sample compared.
const SAMPLE: usize = 32;
/// How long the page may take, from Chromium's start to the report.
const PAGE_TIMEOUT: Duration = Duration::from_secs(420);
/// Each step's loss, and the validation loss after the last, may differ
/// from native by this much (nats, on losses of 3 to 4.4). The two run the
/// same WGSL with the same kernel shapes (both CPU adapters, both under
/// WebGPU's limits), compiled by Tint for SwiftShader in Chromium and by
/// naga for lavapipe natively, which may order or contract a multiply-add
/// differently: rounding, compounded over 20 AdamW steps. Measured on
/// Debian's Chromium 156 (2026-12-07): at most 4.8e-7 on a step, the
/// validation loss, the sample and the greedy tokens equal.
const LOSS_TOLERANCE: f32 = 1e-4;

const SWIFTSHADER_ICD: &str = "/usr/lib/chromium/vk_swiftshader_icd.json";
/// Lavapipe's adapter name (on Vulkan; llvmpipe through GL has it too).
const LAVAPIPE: &str = "llvmpipe";

fn truthy(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

fn required() -> bool {
    truthy("CI") || truthy("WGRAD_REQUIRE_ADAPTER") || truthy("WGRAD_REQUIRE_CHROMIUM")
}

/// Fails when the environment requires what is missing, else says SKIP.
fn skip(test: &str, why: &str) {
    assert!(!required(), "{test}: {why}, and CI requires it");
    eprintln!("SKIP {test}: {why}");
}

fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("WGRAD_CHROMIUM") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .flat_map(|dir| ["chromium", "chromium-browser", "google-chrome"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Why the page cannot be built here, if it cannot: the wasm32 target and
/// wasm-bindgen at the version Cargo.lock pins.
fn missing_tools() -> Option<String> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l == "wasm32-unknown-unknown")
        });
    if !installed {
        return Some(
            "the wasm32-unknown-unknown target is not installed (rustup target add wasm32-unknown-unknown)".into(),
        );
    }
    let lock = std::fs::read_to_string(repo().join("Cargo.lock")).unwrap();
    let want = lock
        .split("\n\n")
        .find(|block| block.contains("name = \"wasm-bindgen\"\n"))
        .and_then(|block| block.lines().find_map(|l| l.strip_prefix("version = \"")))
        .map(|v| v.trim_end_matches('"').to_string())
        .unwrap();
    let have = Command::new("wasm-bindgen")
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match have {
        Some(line) if line.ends_with(&format!(" {want}")) => None,
        other => Some(format!(
            "wasm-bindgen {want} is not installed (found {other:?}; cargo install wasm-bindgen-cli --version {want})"
        )),
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the page sent back.
#[derive(Default)]
struct Received {
    report: Option<String>,
}

/// Files under `root` for GET (links followed: the model is one); the
/// page's POSTs to /report and /progress.
fn serve(listener: TcpListener, root: PathBuf, received: Arc<Mutex<Received>>) {
    for stream in listener.incoming().flatten() {
        let (root, received) = (root.clone(), Arc::clone(&received));
        // A thread per connection: Chromium opens sockets it may never
        // send on, which must not hold up the others.
        std::thread::spawn(move || {
            let _ = handle(stream, &root, &received);
        });
    }
}

fn handle(stream: TcpStream, root: &Path, received: &Mutex<Received>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    let path = target.split('?').next().unwrap_or("/");
    let mut stream = stream;
    let respond = |stream: &mut TcpStream, status: &str, kind: &str, body: &[u8]| -> std::io::Result<()> {
        let head = format!("HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n", body.len());
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)
    };
    if method == "POST" {
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        let text = String::from_utf8_lossy(&body).into_owned();
        match path {
            "/report" => received.lock().unwrap().report = Some(text),
            "/progress" => eprintln!("  page: {text}"),
            _ => {}
        }
        return respond(&mut stream, "200 OK", "text/plain", b"ok");
    }
    let relative = if path == "/" {
        "index.html"
    } else {
        path.trim_start_matches('/')
    };
    let file = (!relative.split('/').any(|p| p == ".." || p.is_empty()))
        .then(|| root.join(relative))
        .filter(|p| p.is_file());
    match file {
        Some(file) => {
            let kind = match file.extension().and_then(|e| e.to_str()) {
                Some("html") => "text/html; charset=utf-8",
                Some("js") => "text/javascript",
                Some("json") => "application/json",
                Some("wasm") => "application/wasm",
                _ => "application/octet-stream",
            };
            respond(&mut stream, "200 OK", kind, &std::fs::read(file)?)
        }
        None => respond(&mut stream, "404 Not Found", "text/plain", b"not found"),
    }
}

/// Kills Chromium and the helpers it started (its process group, which
/// `process_group(0)` made its own).
fn kill_chromium(child: &mut std::process::Child) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.kill();
    let _ = child.wait();
}

/// What the native run gives after `STEPS` steps.
struct NativeRun {
    losses: Vec<f32>,
    validation: f32,
    /// `SAMPLE` characters after the prompt, as `wgrad train` samples.
    sample: String,
}

/// `wgrad train`'s default run on the native adapter for `STEPS` steps.
fn native_training(kernels: Arc<Kernels>) -> wgrad::Result<NativeRun> {
    let config = TrainConfig {
        seed: 0,
        ..language_model_run()
    };
    let task = LanguageModel::<Gpt>::new(MAKE_TRAIN_GPT);
    let mut run = TrainingRun::with_kernels(kernels.clone(), config, task, &mut ())?;
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        losses.push(run.step(true)?.expect("the loss was asked for"));
    }
    let validation = run.validation_loss()?.expect("a language model's validation loss");
    let task = run.task();
    let model = task.trained_model(run.engine(), run.model())?;
    let tokenizer = task.text_tokenizer().expect("a prepared run's tokenizer");
    let prompt = task.sample_prompt()?;
    let mut generator = Generator::with_options(kernels, &model, &GeneratorOptions::default())?;
    let sampling = Sampling {
        temperature: 0.8,
        top_k: Some(40),
        top_p: None,
        seed: 0,
    };
    let new = generator.generate(&tokenizer.encode(&prompt)?, SAMPLE, &sampling, |_| Ok(()))?;
    Ok(NativeRun {
        losses,
        validation,
        sample: prompt + &tokenizer.decode(&new)?,
    })
}

/// `wgrad generate`'s greedy ids after the prompt, under WebGPU's limits.
fn native_greedy(model: &Path, lavapipe: bool) -> Vec<u32> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_wgrad"));
    command.args(["generate", "--backend", "vulkan"]);
    if lavapipe {
        command.args(["--adapter", LAVAPIPE]);
    }
    let output = command
        .arg("--model")
        .arg(model)
        .args(["--prompt", PROMPT, "--temperature", "0", "--print-ids"])
        .args([
            "--max-new-tokens",
            &TOKENS.to_string(),
            "--context",
            &CONTEXT.to_string(),
        ])
        .env("WGRAD_LIMITS", "webgpu")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "wgrad generate failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("new_ids"))
        .unwrap_or_else(|| panic!("no new_ids line in:\n{stdout}"))
        .split_whitespace()
        .map(|id| id.parse().unwrap())
        .collect()
}

/// CPU seconds the processes of group `group` have used so far (Linux's
/// /proc; 0 elsewhere).
fn group_cpu_seconds(group: u32) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let ticks: u64 = entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|stat| {
            // After the command's closing parenthesis: state, ppid, pgrp,
            // ..., then utime, stime, and the reaped children's cutime and
            // cstime (fields 14 to 17 of the whole line).
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
            (fields.get(2)?.parse::<u32>().ok()? == group)
                .then(|| Some(ticks(11)? + ticks(12)? + ticks(13)? + ticks(14)?))
                .flatten()
        })
        .sum();
    // The kernel's USER_HZ, 100 on every Linux this runs on.
    ticks as f64 / 100.0
}

/// Runs the page's self-test in headless Chromium; its report, and the CPU
/// seconds Chromium's processes used.
fn page_report(chromium: &Path, site: &Path, query: &str) -> (Value, f64) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = Arc::new(Mutex::new(Received::default()));
    {
        let (root, received) = (site.to_path_buf(), Arc::clone(&received));
        std::thread::spawn(move || serve(listener, root, received));
    }
    let profile = scratch_dir("web-chromium-profile");
    let log_path = site.join("chromium.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut command = Command::new(chromium);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"])
        .arg(format!("http://127.0.0.1:{port}/index.html?{query}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().unwrap();
    let started = Instant::now();
    let report = loop {
        if let Some(report) = received.lock().unwrap().report.take() {
            break Some(report);
        }
        if started.elapsed() > PAGE_TIMEOUT || child.try_wait().ok().flatten().is_some() {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let cpu = group_cpu_seconds(child.id());
    kill_chromium(&mut child);
    let _ = std::fs::remove_dir_all(&profile);
    let Some(report) = report else {
        let browser_log = std::fs::read_to_string(&log_path).unwrap_or_default();
        panic!("no report from Chromium within {PAGE_TIMEOUT:?}; its log:\n{browser_log}");
    };
    (serde_json::from_str(&report).unwrap(), cpu)
}

fn numbers(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

#[test]
fn the_page_trains_and_generates_in_chromium_as_the_native_engine_does() {
    let test = "the_page_trains_and_generates_in_chromium_as_the_native_engine_does";
    let Some(chromium) = chromium() else {
        return skip(
            test,
            "Chromium is not installed (scripts/ensure-chromium.sh; or set WGRAD_CHROMIUM)",
        );
    };
    if let Some(why) = missing_tools() {
        assert!(
            !truthy("WGRAD_REQUIRE_WASM"),
            "{test}: {why}, and WGRAD_REQUIRE_WASM requires it"
        );
        eprintln!("SKIP {test}: {why}");
        return;
    }
    let model = wgrad_benches::smollm2_path().expect("no WGRAD_SMOLLM2 and no cache directory (HOME unset)");
    assert!(model.is_file(), "SmolLM2-135M-Instruct's GGUF file is missing at {}: fetch it with scripts/fetch-smollm2.sh, or point WGRAD_SMOLLM2 at a copy", model.display());
    // Natively on lavapipe; without it on the SwiftShader Chromium ships
    // (its Vulkan ICD; the only thread of this test binary, before any
    // instance exists), as the page runs on it.
    let lavapipe = wgrad::device::list_adapters()
        .iter()
        .any(|r| r.info.backend == wgpu::Backend::Vulkan && r.info.name.contains(LAVAPIPE));
    if !lavapipe && Path::new(SWIFTSHADER_ICD).is_file() {
        std::env::set_var("VK_ICD_FILENAMES", SWIFTSHADER_ICD);
    }
    let started = Instant::now();
    let options = DeviceOptions {
        backends: Some(wgpu::Backends::VULKAN),
        adapter: lavapipe.then(|| LAVAPIPE.to_string()),
        limits: Some(LimitsMode::WebGpu),
        ..DeviceOptions::default()
    };
    let device = match Device::open(&options) {
        Ok(device) => device,
        Err(e @ (wgrad::Error::NoAdapter { .. } | wgrad::Error::AdapterNotFound { .. })) => {
            return skip(test, &format!("no native adapter to compare with: {e}"));
        }
        Err(e) => panic!("{e}"),
    };
    let adapter = device.label();
    // Native runs beside the build and the browser: each compiles its
    // pipelines mostly on one thread.
    let native = {
        let model = model.clone();
        std::thread::spawn(move || {
            let run = native_training(Arc::new(Kernels::new(device)));
            let greedy = native_greedy(&model, lavapipe);
            (run, greedy, started.elapsed().as_secs_f64())
        })
    };

    let started = Instant::now();
    let site = scratch_dir("web-site");
    let build = Command::new("bash")
        .arg(repo().join("scripts/build-web.sh"))
        .arg(&site)
        .env("WGRAD_SMOLLM2", &model)
        // The `web-test` profile, not the shipped `web` one (LTO over one
        // codegen unit): minutes less of make test on two cores, the
        // same kernels and numbers; `.ci/run` builds the shipped page too.
        .env("WGRAD_WEB_PROFILE", "web-test")
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "scripts/build-web.sh failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let build_seconds = started.elapsed().as_secs_f64();
    let file = model.file_name().unwrap().to_string_lossy();
    let query = format!("selftest&steps={STEPS}&sample={SAMPLE}&tokens={TOKENS}&context={CONTEXT}&model=models/{file}");
    let started = Instant::now();
    let (report, page_cpu) = page_report(&chromium, &site, &query);
    let page_seconds = started.elapsed().as_secs_f64();
    let (run, greedy, native_seconds) = native.join().expect("the native run panicked");
    let NativeRun {
        losses,
        validation,
        sample,
    } = run.unwrap();
    let printed = serde_json::to_string_pretty(&report).unwrap();
    assert!(
        report["error"].is_null(),
        "the page failed: {}\n{printed}",
        report["error"]
    );

    let page_losses = numbers(&report["train"]["losses"]);
    eprintln!("{test}: native on {adapter}, page on {}", report["adapter"]["name"]);
    eprintln!("  step  native     page       difference");
    let mut worst = 0.0f32;
    for (step, (native, page)) in losses.iter().zip(&page_losses).enumerate() {
        let difference = (native - *page as f32).abs();
        worst = worst.max(difference);
        eprintln!("  {:>4}  {native:.6}  {page:.6}  {difference:.1e}", step + 1);
    }
    let page_validation = report["train"]["validation"].as_f64().unwrap_or(f64::NAN) as f32;
    eprintln!("  validation: native {validation:.6}, page {page_validation:.6}");
    assert_eq!(page_losses.len(), STEPS, "{printed}");
    assert!(
        worst <= LOSS_TOLERANCE && (validation - page_validation).abs() <= LOSS_TOLERANCE,
        "the page's losses differ from native's by up to {worst:.2e} (validation {validation} vs {page_validation}), more than {LOSS_TOLERANCE}"
    );

    // The same parameters and draws give the same characters.
    eprintln!(
        "  sample: native {sample:?}\n          page   {}",
        report["train"]["sample"]
    );
    assert_eq!(
        report["train"]["sample"],
        sample.as_str(),
        "the page's sample is not native's"
    );

    let page_greedy: Vec<u32> = numbers(&report["generate"]["ids"])
        .iter()
        .map(|&id| id as u32)
        .collect();
    eprintln!(
        "  greedy native {greedy:?}\n  greedy page   {page_greedy:?} ({:?})",
        report["generate"]["text"]
    );
    assert_eq!(greedy.len(), TOKENS, "native stopped early: {greedy:?}");
    assert_eq!(page_greedy, greedy, "the page's greedy tokens are not native's");
    let answer = report["chat"]["text"].as_str().unwrap_or_default();
    eprintln!("  chat: {answer:?}");
    assert!(
        answer.contains("Paris"),
        "the page's chat answer does not name Paris: {answer:?}"
    );
    assert_eq!(
        report["chat"]["streamed"], report["chat"]["text"],
        "the streamed pieces are not the answer"
    );
    eprintln!(
        "{test}: native {native_seconds:.1} s, build {build_seconds:.1} s, Chromium {page_seconds:.1} s ({page_cpu:.0} s of CPU; first step {:.1} s, {:.2} steps/s, decode {:.1} tokens/s)",
        report["train"]["first_step_ms"].as_f64().unwrap_or(0.0) / 1e3,
        report["train"]["steps_per_s"].as_f64().unwrap_or(0.0),
        report["chat"]["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
    );
    let _ = std::fs::remove_dir_all(&site);
}
