//! `wgrad bench`'s matmul case: GPU GFLOPS beside a CPU sgemm measured in
//! the same run. Here, not in the library, so only the CLI depends on the
//! sgemm crate; and the serve case, which runs `wgrad serve` itself. The
//! other cases are `wgrad_benches`'s.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::infer::generate::{GeneratorOptions, Sampling};
use wgrad::kernels::{MatmulForm, MatmulRequest};
use wgrad::nn::{Lora, LoraConfig, ParameterTree};
use wgrad::{DeviceOptions, Kernels};
use wgrad_benches::{median_time, BenchLine};

use crate::common::open_kernels;
use crate::generate::BoxedLm;

fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn cpu_sgemm(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let n_i = n as isize;
    // SAFETY: a, b, c hold n·n elements each, row-major with the given strides.
    unsafe {
        matrixmultiply::sgemm(
            n,
            n,
            n,
            1.0,
            a.as_ptr(),
            n_i,
            1,
            b.as_ptr(),
            n_i,
            1,
            0.0,
            c.as_mut_ptr(),
            n_i,
            1,
        );
    }
}

/// GPU matmul GFLOPS for an n×n×n product beside the CPU sgemm.
pub fn matmul(kernels: &Kernels, n: usize, reps: usize) -> wgrad::Result<BenchLine> {
    let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
    let (a_host, b_host) = (random(n * n, &mut rng), random(n * n, &mut rng));
    let (a, b, c) = (
        kernels.upload(&a_host)?,
        kernels.upload(&b_host)?,
        kernels.zeros(n * n)?,
    );
    let dispatch = kernels.matmul(
        &MatmulRequest::new(MatmulForm::AB, n, n, n),
        c.view(),
        a.view(),
        b.view(),
    )?;
    // Several launches per timing so the submit-and-wait cost is amortised.
    let per = if n <= 256 { 8 } else { 2 };
    let gpu = median_time(reps, || {
        for _ in 0..per {
            kernels.run(&[&dispatch])?;
        }
        kernels.device().wait_idle("bench")
    })? / per as u32;
    let mut c_host = vec![0.0f32; n * n];
    let cpu = median_time(reps, || {
        for _ in 0..per {
            cpu_sgemm(n, &a_host, &b_host, &mut c_host);
        }
        Ok(())
    })? / per as u32;
    let flops = 2.0 * (n as f64).powi(3);
    let (g, c) = (flops / gpu.as_secs_f64() / 1e9, flops / cpu.as_secs_f64() / 1e9);
    Ok(BenchLine {
        case: "matmul".into(),
        values: vec![
            ("n", n.to_string()),
            ("variant", format!("{:?}", kernels.matmul_variant_for(MatmulForm::AB))),
            (
                "tuning",
                kernels
                    .matmul_tuning()
                    .source
                    .split(' ')
                    .next()
                    .unwrap_or("")
                    .to_string(),
            ),
            ("gflops", format!("{g:.2}")),
            ("cpu_gflops", format!("{c:.2}")),
            ("ratio", format!("{:.3}", g / c)),
        ],
    })
}

/// Prompts the serve bench's clients send, in turn.
const SERVE_PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The quick brown fox",
    "A good recipe for pancakes starts with",
    "The largest planet in the solar system is",
    "In computer science, a hash table is",
];

/// One streamed completion over HTTP/1.0 (the body ends with the
/// connection): the time to its first chunk and its completion tokens
/// (the final chunk's usage).
fn stream_completion(port: u16, body: &str) -> wgrad::Result<(Duration, usize)> {
    let fail = |e: String| wgrad::Error::InvalidArgument {
        op: "bench serve",
        reason: e,
    };
    let start = Instant::now();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| fail(format!("connecting: {e}")))?;
    let request = format!(
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| fail(format!("sending: {e}")))?;
    let mut first = None;
    let mut tokens = None;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| fail(format!("reading: {e}")))?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        first.get_or_insert_with(|| start.elapsed());
        if data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value =
            serde_json::from_str(data).map_err(|e| fail(format!("a chunk that is not JSON ({e}): {data}")))?;
        if chunk.get("error").is_some() {
            return Err(fail(format!("the server answered {data}")));
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = Some(n as usize);
        }
    }
    match (first, tokens) {
        (Some(first), Some(tokens)) => Ok((first, tokens)),
        _ => Err(fail("a stream without chunks or usage".into())),
    }
}

fn health(port: u16) -> wgrad::Result<serde_json::Value> {
    let fail = |e: String| wgrad::Error::InvalidArgument {
        op: "bench serve",
        reason: format!("/health: {e}"),
    };
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| fail(e.to_string()))?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\n\r\n")
        .map_err(|e| fail(e.to_string()))?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|e| fail(e.to_string()))?;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).map_err(|e| fail(format!("{e}: {answer}")))
}

/// A `wgrad serve` child of this binary, killed when dropped.
struct ServeChild(std::process::Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `p`-quantile of `sorted` (nearest rank).
fn quantile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// `wgrad bench --only serve`: `wgrad serve` on `model` (a child process
/// of this binary on a loopback port, `max_batch` slots of `context`
/// positions), then for each count in `clients` that many concurrent
/// clients, each sending `requests` streamed completions one after the
/// other (fixed prompts, `max_tokens` greedy tokens, EOS ignored):
/// aggregate completion tokens/s over the phase's wall time, the median
/// and p95 time to first token, and the decode steps' mean batch (from
/// /health). Before the server starts, the single-stream `wgrad generate`
/// path on the same model and context, for comparison.
pub fn serve(
    kernels: &Arc<Kernels>,
    model: &Path,
    clients: &[usize],
    requests: usize,
    max_tokens: usize,
) -> wgrad::Result<Vec<BenchLine>> {
    let max_batch = clients.iter().copied().max().unwrap_or(1);
    let context = 512;
    let mut lines = Vec::new();
    {
        let options = GeneratorOptions {
            context: Some(context),
            ..GeneratorOptions::default()
        };
        let lm = crate::generate::load_bpe_lm(kernels, model, None, &options)?;
        let mut generator = crate::generate::bpe_generator(kernels.clone(), &lm, None, &options)?;
        let prompt = lm.tokenizer.encode(SERVE_PROMPTS[0], true)?;
        // Once to compile, once timed.
        generator.generate(&prompt, 2, &Sampling::greedy(), |_| Ok(()))?;
        let start = Instant::now();
        let mut first = None;
        generator.generate(&prompt, max_tokens, &Sampling::greedy(), |_| {
            first.get_or_insert_with(Instant::now);
            Ok(())
        })?;
        let decode = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
        lines.push(BenchLine {
            case: "serve_generate".into(),
            values: vec![
                ("tokens", max_tokens.to_string()),
                (
                    "tokens_per_s",
                    format!("{:.2}", max_tokens as f64 / start.elapsed().as_secs_f64()),
                ),
                (
                    "decode_tokens_per_s",
                    format!("{:.2}", (max_tokens - 1) as f64 / decode.max(1e-9)),
                ),
            ],
        });
    }
    let args: Vec<String> = [
        "--max-batch",
        &max_batch.to_string(),
        "--max-context",
        &context.to_string(),
        "--max-queue",
        "0",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let (child, port) = start_serve(model, &args)?;
    for &n in clients {
        let mut values = vec![("clients", n.to_string())];
        values.extend(client_phase(port, n, requests, max_tokens, &|_| None)?);
        lines.push(BenchLine {
            case: "serve".into(),
            values,
        });
    }
    drop(child);
    Ok(lines)
}

/// `wgrad serve` on `model` with `args` after it, a child of this binary
/// on a loopback port: the child (killed when dropped) and its port.
fn start_serve(model: &Path, args: &[String]) -> wgrad::Result<(ServeChild, u16)> {
    let fail = |e: String| wgrad::Error::InvalidArgument {
        op: "bench serve",
        reason: e,
    };
    let exe = std::env::current_exe().map_err(|e| fail(e.to_string()))?;
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("starting wgrad serve: {e}")))?;
    let stdout = child.stdout.take();
    let child = ServeChild(child);
    let mut line = String::new();
    if let Some(stdout) = stdout {
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| fail(e.to_string()))?;
    }
    let port: u16 = line
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| fail(format!("the server printed {line:?}, not its address")))?;
    Ok((child, port))
}

/// `n` concurrent clients on the server at `port`, each sending `requests`
/// streamed completions one after the other (fixed prompts, `max_tokens`
/// greedy tokens, EOS ignored), client c naming the model `model(c)` (None:
/// the server's base): aggregate completion tokens/s over the phase's wall
/// time, the median and p95 time to first token, and the decode steps'
/// mean batch (from /health).
fn client_phase(
    port: u16,
    n: usize,
    requests: usize,
    max_tokens: usize,
    model: &dyn Fn(usize) -> Option<String>,
) -> wgrad::Result<Vec<(&'static str, String)>> {
    let fail = |e: String| wgrad::Error::InvalidArgument {
        op: "bench serve",
        reason: e,
    };
    let before = health(port)?;
    let start = Instant::now();
    let threads: Vec<_> = (0..n)
        .map(|c| {
            let model = model(c);
            std::thread::spawn(move || -> wgrad::Result<Vec<(Duration, usize)>> {
                (0..requests)
                    .map(|r| {
                        let prompt = SERVE_PROMPTS[(c * requests + r) % SERVE_PROMPTS.len()];
                        let mut body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true });
                        if let Some(model) = &model {
                            body["model"] = serde_json::json!(model);
                        }
                        stream_completion(port, &body.to_string())
                    })
                    .collect()
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in threads {
        results.extend(t.join().map_err(|_| fail("a client thread panicked".into()))??);
    }
    let seconds = start.elapsed().as_secs_f64();
    let after = health(port)?;
    let delta = |key: &str| {
        after[key]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(before[key].as_u64().unwrap_or(0))
    };
    let mut ttfts: Vec<Duration> = results.iter().map(|r| r.0).collect();
    ttfts.sort();
    let tokens: usize = results.iter().map(|r| r.1).sum();
    let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1e3);
    Ok(vec![
        ("requests", results.len().to_string()),
        ("tokens_per_s", format!("{:.2}", tokens as f64 / seconds)),
        ("ttft_p50_ms", ms(quantile(&ttfts, 0.5))),
        ("ttft_p95_ms", ms(quantile(&ttfts, 0.95))),
        (
            "mean_batch",
            format!(
                "{:.2}",
                delta("decoded_rows") as f64 / delta("decode_steps").max(1) as f64
            ),
        ),
    ])
}

/// Adapters of rank 16 on every Linear but the head, alpha 32, over
/// `model` (PEFT's init for A, B random in ±0.02 so the path is not zero),
/// written as PEFT folders `lora0`, `lora1`, .. under `dir`.
fn write_bench_adapters(kernels: &Kernels, model: &Path, dir: &Path, count: usize) -> wgrad::Result<Vec<PathBuf>> {
    let options = GeneratorOptions {
        context: Some(64),
        ..GeneratorOptions::default()
    };
    let mut lm = crate::generate::load_bpe_lm(kernels, model, None, &options)?;
    let config = LoraConfig::parse("r=16,alpha=32,targets=all-linear")?;
    let mut dirs = Vec::new();
    for i in 0..count {
        wgrad::nn::manual_seed(300 + i as u64);
        let mut lora = Lora::new(BoxedLm(lm.model), config.clone())?;
        let mut rng = ChaCha8Rng::seed_from_u64(400 + i as u64);
        lora.visit_mut("", &mut |name, _, values| {
            if name.ends_with("lora_B.weight") {
                values.iter_mut().for_each(|v| *v = rng.random_range(-0.02f32..0.02));
            }
            Ok(())
        })?;
        let folder = dir.join(format!("lora{i}"));
        wgrad::io::peft::save_lora(&folder, &lora, &model.display().to_string())?;
        dirs.push(folder);
        lm.model = lora.base.0;
    }
    Ok(dirs)
}

/// `wgrad bench --only serve_lora`: `clients` concurrent streams over the
/// base alone (a server without adapters), then the same streams over 4
/// adapters of rank 16 on every Linear (client c asks for adapter c mod 4,
/// so every decode step mixes them), and over the base on that server
/// (what carrying adapters costs requests that use none): tokens/s each.
pub fn serve_lora(
    kernels: &Arc<Kernels>,
    model: &Path,
    clients: usize,
    requests: usize,
    max_tokens: usize,
) -> wgrad::Result<Vec<BenchLine>> {
    const ADAPTERS: usize = 4;
    let dir = std::env::temp_dir().join(format!("wgrad-bench-serve-lora-{}", std::process::id()));
    let adapters = write_bench_adapters(kernels, model, &dir, ADAPTERS)?;
    let base_args: Vec<String> = [
        "--max-batch",
        &clients.to_string(),
        "--max-context",
        "512",
        "--max-queue",
        "0",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let mut lines = Vec::new();
    let (child, port) = start_serve(model, &base_args)?;
    let mut values = vec![("adapters", "0".to_string()), ("clients", clients.to_string())];
    values.extend(client_phase(port, clients, requests, max_tokens, &|_| None)?);
    lines.push(BenchLine {
        case: "serve_lora".into(),
        values,
    });
    drop(child);
    let mut args = base_args;
    for (i, folder) in adapters.iter().enumerate() {
        args.extend(["--lora".to_string(), format!("lora{i}={}", folder.display())]);
    }
    let (child, port) = start_serve(model, &args)?;
    let phases: [(&str, &dyn Fn(usize) -> Option<String>); 2] = [
        ("mixed", &|c| Some(format!("lora{}", c % ADAPTERS))),
        ("base", &|_| None),
    ];
    for (asked, model) in phases {
        let mut values = vec![
            ("adapters", ADAPTERS.to_string()),
            ("requests_ask", asked.to_string()),
            ("clients", clients.to_string()),
        ];
        values.extend(client_phase(port, clients, requests, max_tokens, model)?);
        lines.push(BenchLine {
            case: "serve_lora".into(),
            values,
        });
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(lines)
}

/// What `wgrad bench --only` may name (any substring of one).
const CASES: [&str; 15] = [
    "matmul",
    "mlp_step",
    "gpt_train_step",
    "gpt_generate",
    "linear_step",
    "gpt2_124m_prefill",
    "gpt2_124m_decode",
    "smollm2_prefill",
    "smollm2_decode",
    "smollm2_decode_rows",
    "gemma3_prefill",
    "gemma3_decode",
    "serve",
    "serve_lora",
    "attention",
];

pub fn bench(opts: &DeviceOptions, quick: bool, compile: bool, profile: bool, only: &[String]) -> wgrad::Result<()> {
    if let Some(unknown) = only
        .iter()
        .find(|w| w.is_empty() || !CASES.iter().any(|c| c.contains(w.as_str())))
    {
        return Err(wgrad::Error::InvalidArgument {
            op: "bench --only",
            reason: format!("no case is named like `{unknown}`; the cases are {}", CASES.join(", ")),
        });
    }
    let runs = |case: &str| only.is_empty() || only.iter().any(|w| case.contains(w.as_str()));
    let kernels = open_kernels(opts)?;
    let threads = std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    println!("adapter: {} (LP_NUM_THREADS={threads})", kernels.device().label());
    if compile {
        for l in wgrad_benches::compile_times(&kernels)? {
            println!("{l}");
        }
        return Ok(());
    }
    let sizes: &[usize] = if quick { &[256, 512] } else { &[256, 512, 1024, 2048] };
    let reps = if quick { 3 } else { 5 };
    let mut lines = Vec::new();
    if runs("matmul") {
        for &n in sizes {
            lines.push(matmul(&kernels, n, reps)?);
        }
    }
    if runs("mlp_step") {
        lines.push(wgrad_benches::mlp_step(&kernels, if quick { 5 } else { 20 })?);
    }
    if runs("gpt_train_step") {
        // The GPT step's mfu is against the best matmul measured in this run.
        let gflops = |ls: &[wgrad_benches::BenchLine]| {
            ls.iter()
                .filter_map(|l| l.values.iter().find(|v| v.0 == "gflops"))
                .filter_map(|v| v.1.parse::<f64>().ok())
                .fold(0.0, f64::max)
        };
        let mut best_gflops = gflops(&lines);
        if best_gflops == 0.0 {
            best_gflops = gflops(&[matmul(&kernels, 512, reps)?]);
        }
        lines.push(wgrad_benches::gpt_train_step(
            &kernels,
            wgrad_benches::gpt_bench_config(),
            16,
            if quick { 2 } else { 5 },
            best_gflops,
        )?);
        if kernels.supports_f16() {
            let f16 = wgrad::graph::PlanOptions {
                precision: wgrad::graph::Precision::F16,
                ..Default::default()
            };
            lines.push(wgrad_benches::gpt_train_step_with(
                &kernels,
                wgrad_benches::gpt_bench_config(),
                16,
                if quick { 2 } else { 5 },
                best_gflops,
                f16,
            )?);
        }
    }
    if runs("gpt_generate") {
        lines.push(wgrad_benches::gpt_generate(
            &kernels,
            wgrad_benches::gpt_bench_config(),
            if quick { 16 } else { 48 },
        )?);
    }
    if runs("linear_step") {
        lines.push(wgrad_benches::linear_step(&kernels, if quick { 100 } else { 1000 })?);
    }
    if runs("attention") {
        // Fused against unfused attention training at a fixed B·T = 1024
        // tokens, 4 heads of 64 channels (SmolLM2's and GPT-2's width).
        for t in [64, 256, 1024] {
            lines.push(wgrad_benches::attention_train(
                &kernels,
                t,
                1024,
                4,
                64,
                if quick { 2 } else { 5 },
            )?);
        }
    }
    if runs("gpt2_124m_prefill") || runs("gpt2_124m_decode") {
        // GPT-2 124M's shape: a 16-token prompt and 8 decoded tokens when quick.
        let (prompt, decoded) = if quick { (16, 8) } else { (64, 32) };
        lines.extend(wgrad_benches::gpt2_124m_generate(&kernels, prompt, decoded, profile)?);
    }
    if runs("smollm2_prefill") || runs("smollm2_decode") {
        // The 128-token prompt; fewer decoded tokens when quick.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench smollm2",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        lines.extend(wgrad_benches::smollm2_generate(
            &kernels,
            &path,
            128,
            if quick { 8 } else { 32 },
            profile,
        )?);
    }
    if runs("gemma3_prefill") || runs("gemma3_decode") {
        lines.extend(gemma3(&kernels, quick, profile)?);
    }
    if only.iter().any(|w| w == "smollm2_decode_rows") {
        // Only by its name: it builds a SmolLM2 generator per row count.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench smollm2_decode_rows",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        lines.extend(wgrad_benches::smollm2_decode_rows(
            &kernels,
            &path,
            &[1, 2, 4, 8, 16],
            if quick { 4 } else { 8 },
            profile,
        )?);
    }
    if only.iter().any(|w| w == "serve") {
        // Only when asked for by name: it needs SmolLM2 and runs minutes.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench serve",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        let (requests, max_tokens) = if quick { (1, 16) } else { (2, 32) };
        lines.extend(serve(&kernels, &path, &[1, 4, 16], requests, max_tokens)?);
    }
    if only.iter().any(|w| w == "serve_lora") {
        // Only by its name, as serve: SmolLM2 and minutes.
        let path = wgrad_benches::smollm2_path().ok_or_else(|| wgrad::Error::InvalidArgument {
            op: "bench serve_lora",
            reason: "no cache directory to find SmolLM2's GGUF file in (HOME unset): set WGRAD_SMOLLM2 to the file"
                .into(),
        })?;
        let (requests, max_tokens) = if quick { (1, 16) } else { (2, 32) };
        lines.extend(serve_lora(&kernels, &path, 16, requests, max_tokens)?);
    }
    println!("{:<32} measurements", "case");
    for l in &lines {
        let values: Vec<String> = l.values.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("{:<32} {}", l.case, values.join(", "));
    }
    println!();
    for l in &lines {
        println!("{l}");
    }
    Ok(())
}

#[cfg(feature = "mpi")]
pub fn allreduce_bench(sizes: &[usize], reps: usize) -> wgrad::Result<()> {
    use wgrad::parallel::distributed::ProcessGroup;
    let group = wgrad::parallel::mpi::MpiGroup::init()?;
    // Training reduces the gradient bucket by bucket: 2^18 f64 sums each.
    const BUCKET: usize = 1 << 18;
    let mut rows = Vec::new();
    for &n in sizes {
        let mut values = vec![1.0f64; n];
        let mut times = Vec::with_capacity(reps.max(1));
        for rep in 0..=reps.max(1) {
            let start = Instant::now();
            for chunk in values.chunks_mut(BUCKET) {
                if let Err(e) = group.all_reduce_sum(chunk) {
                    eprintln!("error: rank {}: {e}", group.rank());
                    group.abort(1);
                }
            }
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        rows.push((n, times[times.len() / 2], times[0]));
    }
    if group.rank() == 0 {
        println!("{}", group.describe());
        println!(
            "{:>12} {:>12} {:>12} {:>12} {:>10}",
            "parameters", "f32 MiB", "median ms", "min ms", "GB/s f64"
        );
        for (n, median, min) in &rows {
            let bytes = 8.0 * *n as f64;
            println!(
                "{n:>12} {:>12.2} {:>12.3} {:>12.3} {:>10.2}",
                4.0 * *n as f64 / (1 << 20) as f64,
                1e3 * median,
                1e3 * min,
                bytes / median / 1e9
            );
        }
        for (n, median, _) in &rows {
            println!(
                "bench allreduce processes={} parameters={n} ms={:.3}",
                group.size(),
                1e3 * median
            );
        }
    }
    group.finalize();
    Ok(())
}

#[cfg(not(feature = "mpi"))]
pub fn allreduce_bench(_sizes: &[usize], _reps: usize) -> wgrad::Result<()> {
    crate::train::train_mpi_missing("allreduce")
}

/// Gemma 3 270M's Q4_K_M file with the cache `wgrad generate` gives one
/// prompt (its tokens and the new ones, rounded up to a power of two): the
/// whole 32,768 positions would be a gigabyte of cache.
fn gemma3(kernels: &Arc<Kernels>, quick: bool, profile: bool) -> wgrad::Result<Vec<BenchLine>> {
    let path = wgrad_benches::gemma3_path().ok_or_else(|| wgrad::Error::InvalidArgument {
        op: "bench gemma3",
        reason: "no cache directory to find Gemma 3's GGUF file in (HOME unset): set WGRAD_GEMMA3 to the file".into(),
    })?;
    let (prompt, decoded): (usize, usize) = (128, if quick { 8 } else { 32 });
    let bench = wgrad_benches::GgufBench {
        family: "gemma3",
        fetch: "fetch it with scripts/fetch-gemma3.sh, or set WGRAD_GEMMA3 to a copy",
        context: Some((prompt + decoded).next_power_of_two()),
        with_f32: false,
    };
    wgrad_benches::gguf_generate(kernels, &path, &bench, prompt, decoded, profile)
}
