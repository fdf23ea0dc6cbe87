//! Every kernel in Chrome's WebGPU: `wgrad shaders --dump` writes a case
//! per entry point (inputs, uniform block, constants, grid, the CPU twin's
//! expected output), a tiny HTTP server here serves them with
//! scripts/webgpu/, and headless Chromium on SwiftShader replays them
//! through Dawn and Tint and POSTs its report back. Every case must pass,
//! or be skipped for a feature, subgroup size or limit the browser's
//! adapter lacks (SwiftShader has no shader-f16 and 4-lane subgroups).
//!
//! Without Chromium the test fails in CI (`CI`, `WGRAD_REQUIRE_ADAPTER` or
//! `WGRAD_REQUIRE_CHROMIUM` set) and prints SKIP elsewhere
//! (scripts/ensure-chromium.sh installs it). `WGRAD_CHROMIUM` names the
//! binary when it is not `chromium` on the PATH.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long the page may take, from Chromium's start to the report.
const PAGE_TIMEOUT: Duration = Duration::from_secs(120);

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
    progress: usize,
}

/// Files from `roots` (the first that has the path) for GET; the page's
/// POSTs to /report and /progress into `received`.
fn serve(listener: TcpListener, roots: Vec<PathBuf>, received: Arc<Mutex<Received>>) {
    for stream in listener.incoming().flatten() {
        let (roots, received) = (roots.clone(), Arc::clone(&received));
        // A thread per connection: Chromium opens sockets it may never
        // send on, which must not hold up the others.
        std::thread::spawn(move || {
            let _ = handle(stream, &roots, &received);
        });
    }
}

fn handle(stream: TcpStream, roots: &[PathBuf], received: &Mutex<Received>) -> std::io::Result<()> {
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
        {
            let mut got = received.lock().unwrap();
            match path {
                "/report" => got.report = Some(text),
                "/progress" => {
                    got.progress += 1;
                    let case: Value = serde_json::from_str(&text).unwrap_or_default();
                    eprintln!(
                        "  [{}] {} {}",
                        got.progress,
                        case["status"].as_str().unwrap_or("?"),
                        case["name"].as_str().unwrap_or("?")
                    );
                }
                _ => {}
            }
        }
        return respond(&mut stream, "200 OK", "text/plain", b"ok");
    }
    let relative = if path == "/" {
        "index.html"
    } else {
        path.trim_start_matches('/')
    };
    let file = (!relative.split('/').any(|p| p == ".." || p.is_empty()))
        .then(|| roots.iter().map(|r| r.join(relative)).find(|p| p.is_file()))
        .flatten();
    match file {
        Some(file) => {
            let kind = match file.extension().and_then(|e| e.to_str()) {
                Some("html") => "text/html; charset=utf-8",
                Some("js") => "text/javascript",
                Some("json") => "application/json",
                Some("wgsl") => "text/plain; charset=utf-8",
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

fn table(report: &Value) -> String {
    let mut out = String::new();
    for case in report["cases"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<5} {:<84} {:>9} {:>6} ms  {}\n",
            case["status"].as_str().unwrap_or("?"),
            case["name"].as_str().unwrap_or("?"),
            format!("{:.1e}", case["max_error"].as_f64().unwrap_or(0.0)),
            case["ms"].as_u64().unwrap_or(0),
            case["reason"].as_str().unwrap_or("")
        );
        for list in ["validation", "compilation"] {
            for message in case[list].as_array().into_iter().flatten() {
                out += &format!("      {list}: {}\n", message.as_str().unwrap_or(""));
            }
        }
    }
    out
}

#[test]
fn every_kernel_matches_its_cpu_twin_in_chromium_webgpu() {
    let test = "every_kernel_matches_its_cpu_twin_in_chromium_webgpu";
    let Some(chromium) = chromium() else {
        return skip(
            test,
            "Chromium is not installed (scripts/ensure-chromium.sh; or set WGRAD_CHROMIUM)",
        );
    };
    let started = Instant::now();
    let dir = scratch_dir("webgpu-cases");
    let dump = Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .arg("shaders")
        .arg("--dump")
        .arg(&dir)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&dump.stdout),
        String::from_utf8_lossy(&dump.stderr),
    );
    if !dump.status.success() && stderr.contains("no GPU adapter found") {
        return skip(test, "no native adapter to build the cases on");
    }
    assert!(
        dump.status.success(),
        "wgrad shaders --dump failed:\n{stdout}\n{stderr}"
    );
    let dumped = started.elapsed();

    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/webgpu");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = Arc::new(Mutex::new(Received::default()));
    {
        let (roots, received) = (vec![page, dir.clone()], Arc::clone(&received));
        std::thread::spawn(move || serve(listener, roots, received));
    }
    let profile = scratch_dir("webgpu-chromium-profile");
    let log = std::fs::File::create(dir.join("chromium.log")).unwrap();
    let mut command = Command::new(&chromium);
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
        .arg(format!("http://127.0.0.1:{port}/index.html"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().unwrap();
    let browser_started = Instant::now();
    let report = loop {
        if let Some(report) = received.lock().unwrap().report.take() {
            break Some(report);
        }
        if browser_started.elapsed() > PAGE_TIMEOUT || child.try_wait().ok().flatten().is_some() {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    kill_chromium(&mut child);
    let _ = std::fs::remove_dir_all(&profile);
    let browser_log = std::fs::read_to_string(dir.join("chromium.log")).unwrap_or_default();
    let Some(report) = report else {
        let progress = received.lock().unwrap().progress;
        panic!("no report from Chromium within {PAGE_TIMEOUT:?} ({progress} cases reported progress; the cases are in {}); its log:\n{browser_log}", dir.display());
    };
    let report: Value = serde_json::from_str(&report).unwrap();
    eprintln!(
        "{test}: Chromium's adapter {} {} ({} storage buffers/stage, subgroups {}..{}), features {}; cases built on {}",
        report["adapter"]["vendor"].as_str().unwrap_or("?"),
        report["adapter"]["architecture"].as_str().unwrap_or("?"),
        report["adapter"]["max_storage_buffers_per_shader_stage"],
        report["adapter"]["subgroup_min_size"],
        report["adapter"]["subgroup_max_size"],
        report["features"],
        report["built_on"].as_str().unwrap_or("?"),
    );
    let printed = table(&report);
    eprint!("{printed}");
    assert!(
        report["error"].is_null(),
        "the page failed: {}\n{printed}",
        report["error"]
    );
    let cases = report["cases"].as_array().cloned().unwrap_or_default();
    let count = |status: &str| cases.iter().filter(|c| c["status"] == status).count();
    eprintln!(
        "{test}: {} cases: {} pass, {} skip, {} fail; dump {:.1} s, Chromium {:.1} s (page {} ms)",
        cases.len(),
        count("pass"),
        count("skip"),
        count("fail"),
        dumped.as_secs_f64(),
        browser_started.elapsed().as_secs_f64(),
        report["ms"]
    );
    // Every entry point wgrad dispatches has a case in the report.
    for kernel in wgrad::kernels::KERNELS {
        assert!(
            cases.iter().any(|c| c["entries"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e == kernel.entry))),
            "no case in Chromium's report covers `{}`",
            kernel.entry
        );
    }
    let bad: Vec<String> = cases
        .iter()
        .filter(|c| match c["status"].as_str() {
            Some("pass") => false,
            // Skipped only for what the browser's (or the native) adapter lacks.
            Some("skip") => !c["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("missing ") || r.starts_with("not built by wgrad")),
            _ => true,
        })
        .map(|c| {
            format!(
                "{} ({})",
                c["name"].as_str().unwrap_or("?"),
                c["reason"].as_str().unwrap_or("")
            )
        })
        .collect();
    let uncaptured = report["uncaptured"].as_array().cloned().unwrap_or_default();
    assert!(
        uncaptured.is_empty(),
        "WebGPU errors outside the cases' error scopes: {uncaptured:?}"
    );
    assert!(
        bad.is_empty(),
        "{} case(s) failed in Chromium (the cases and its log are in {}):\n{}\n{printed}",
        bad.len(),
        dir.display(),
        bad.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
