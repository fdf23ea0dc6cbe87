//! Training across processes with MPI: `mpirun -n 2` and `-n 3` against
//! single-process training on the same global batch, resuming with a
//! different number of processes, and a failing rank stopping the job —
//! for the MLP and for the GPT.
//! Runs with `--features mpi` when `mpirun` is installed; the failure test
//! also needs `fault-injection` (`make test` passes both).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use wgrad::nn::Module;

const WGRAD: &str = env!("CARGO_BIN_EXE_wgrad");

/// Every launch is bounded: a hung job fails the test instead of CI.
const JOB_LIMIT: Duration = Duration::from_secs(240);

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-mpi-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `program args` under `timeout`, with the environment OpenMPI needs
/// as root on a small machine, and returns its output and wall time.
fn run(program: &str, args: &[&str]) -> (Output, Duration) {
    // One MPI job at a time, whatever libtest's thread count: two jobs of
    // several ranks on a 2-core machine would only starve each other.
    static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let start = Instant::now();
    let output = Command::new("timeout")
        .arg("--kill-after=10")
        .arg(JOB_LIMIT.as_secs().to_string())
        .arg(program)
        .args(args)
        // Root in CI; more ranks than cores; waiting ranks yield the CPU
        // to the working ones (each rank's lavapipe gets one thread).
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .env("LP_NUM_THREADS", "1")
        .env(
            "XDG_RUNTIME_DIR",
            std::env::var("XDG_RUNTIME_DIR").unwrap_or_else(|_| "/tmp".into()),
        )
        .stdin(Stdio::null())
        .output()
        .expect("run timeout/mpirun");
    (output, start.elapsed())
}

fn text(o: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The training flags every run here shares: SGD with momentum (no
/// division by a tiny second moment to magnify rounding differences),
/// digits MLP, batch 32, a fixed seed.
fn train_args<'a>(checkpoint: &'a str, plot: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        "mlp",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--batch-size",
        "32",
        "--seed",
        "3",
        "--max-steps",
        steps,
        "--checkpoint",
        checkpoint,
        "--plot",
        plot,
    ]
}

fn mpirun(ranks: usize, extra: &[&str], args: &[&str]) -> (Output, Duration) {
    let mut flags = vec!["--parallel", "data"];
    flags.extend_from_slice(extra);
    mpirun_with(ranks, &flags, args)
}

/// `mpirun -n ranks wgrad args --distributed mpi flags`.
fn mpirun_with(ranks: usize, flags: &[&str], args: &[&str]) -> (Output, Duration) {
    let n = ranks.to_string();
    let mut all = vec!["-n", n.as_str(), WGRAD];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--distributed", "mpi"]);
    all.extend_from_slice(flags);
    run("mpirun", &all)
}

/// max |a − b| over every parameter (not optimizer state) of two checkpoints.
fn max_parameter_difference(a: &Path, b: &Path) -> f32 {
    let (a, b) = (
        wgrad::io::checkpoint::load(a).unwrap(),
        wgrad::io::checkpoint::load(b).unwrap(),
    );
    let params: Vec<_> = a.tensors.iter().filter(|t| !t.name.starts_with("optim.")).collect();
    assert!(!params.is_empty());
    let mut worst = 0.0f32;
    for t in params {
        let other = b.get(&t.name).unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!(t.shape, other.shape, "{}", t.name);
        for (x, y) in t.data.iter().zip(&other.data) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

fn mpi_available() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// 2 processes × 2 local devices (a hierarchical all-reduce), then 3
/// processes × 1 device resuming from that checkpoint, each against one
/// process on one device taking the same steps on the same global batches.
#[test]
fn mpi_training_matches_single_process_and_resumes_with_another_process_count() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("equivalence");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (single_a, single_b, plot) = (p("single_a.safetensors"), p("single_b.safetensors"), p("loss.png"));
    let (mpi_a, mpi_b) = (p("mpi_a.safetensors"), p("mpi_b.safetensors"));

    let (o, _) = run(WGRAD, &train_args(&single_a, &plot, "20"));
    assert!(o.status.success(), "{}", text(&o));
    let (o, _) = mpirun(2, &["--devices", "0,0"], &train_args(&mpi_a, &plot, "20"));
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("over 2 processes"), "{stdout}");
    assert_eq!(
        stdout.matches("trained 20 steps").count(),
        1,
        "only rank 0 reports: {stdout}"
    );
    // Tolerance: the same f32 arithmetic summed in a different order (per
    // device, per process, in f64) — a few ulp per step over 20 steps.
    let diff = max_parameter_difference(Path::new(&single_a), Path::new(&mpi_a));
    assert!(diff <= 1e-4, "mpirun -n 2 vs single process: max |Δparam| = {diff}");

    let mut resumed_single = train_args(&single_b, &plot, "20");
    resumed_single.extend_from_slice(&["--resume", &single_a]);
    let (o, _) = run(WGRAD, &resumed_single);
    assert!(o.status.success(), "{}", text(&o));
    let mut resumed_mpi = train_args(&mpi_b, &plot, "20");
    resumed_mpi.extend_from_slice(&["--resume", &mpi_a]);
    let (o, _) = mpirun(3, &[], &resumed_mpi);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("over 3 processes"),
        "{}",
        text(&o)
    );
    let ckpt = wgrad::io::checkpoint::load(&mpi_b).unwrap();
    assert_eq!(
        ckpt.meta("step"),
        Some("40"),
        "the step count continues across process counts"
    );
    let diff = max_parameter_difference(Path::new(&single_b), Path::new(&mpi_b));
    assert!(
        diff <= 2e-4,
        "resumed under mpirun -n 3 vs single process: max |Δparam| = {diff}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank that errors or panics mid-training ends the whole job promptly
/// (MPI_Abort), with a message naming it, instead of hanging the others in
/// their next collective. Needs `--fail-at`, which only a
/// `fault-injection` build has.
#[cfg(feature = "fault-injection")]
#[test]
fn a_failing_rank_stops_the_job() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("failure");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (ckpt, plot) = (p("never.safetensors"), p("never.png"));
    for (ranks, fail_at, expect) in [(3, "1:5", "rank 1 of 3"), (2, "1:3:panic", "rank 1 of 2 panicked")] {
        let (o, took) = mpirun(ranks, &["--fail-at", fail_at], &train_args(&ckpt, &plot, "200"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "the job must fail: {}", text(&o));
        assert_ne!(
            o.status.code(),
            Some(124),
            "the job hung until the timeout: {}",
            text(&o)
        );
        assert!(
            err.contains(expect),
            "stderr should name the failing rank ({expect}): {}",
            text(&o)
        );
        // Start-up (two or three processes compiling shaders on two cores)
        // dominates; the abort itself takes about a second.
        assert!(took < Duration::from_secs(120), "took {took:?} to stop");
        assert!(!Path::new(&ckpt).exists(), "no checkpoint from a failed job");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The flags of a tiny GPT run (L1 H2 C16 T16, batch 4) on `text`,
/// writing its folder to `out`.
fn gpt_args<'a>(text: &'a str, out: &'a str, plot: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        "gpt",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-steps",
        steps,
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--seed",
        "3",
        "--text",
        text,
        "--out",
        out,
        "--plot",
        plot,
    ]
}

/// The number after `final validation loss` in a run's output.
fn final_validation_loss(o: &Output) -> f32 {
    let stdout = String::from_utf8_lossy(&o.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("final validation loss"))
        .unwrap_or_else(|| panic!("no final validation loss: {}", text(o)));
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("cannot read {line:?}"))
}

/// Checks two GPT model folders' parameters: the same training up to the
/// f32 summation order of the batch, |Δ| ≤ 1e-5 + 1e-4·|p|. Returns max |Δ|.
fn assert_same_gpt(what: &str, a: &str, b: &str) -> f32 {
    let (a, b) = (
        wgrad::io::gpt_folder::load_gpt_folder(a).unwrap().model,
        wgrad::io::gpt_folder::load_gpt_folder(b).unwrap().model,
    );
    let mut worst = 0.0f32;
    for ((name, _, x), (_, _, y)) in a.parameter_values().into_iter().zip(b.parameter_values()) {
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= 1e-5 + 1e-4 * q.abs(), "{what}: {name} {p} against {q}");
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

/// `mpirun -n 2 wgrad train --model gpt --parallel data --distributed mpi`
/// against one process on one device, then both resumed from the
/// single-process folder (rank 0 reads it; rank 1 takes its state).
#[test]
fn mpi_gpt_training_matches_single_process_and_resumes() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("gpt");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, plot) = (p("text.txt"), p("loss.png"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let (single_a, single_b, mpi_a, mpi_b) = (p("single_a"), p("single_b"), p("mpi_a"), p("mpi_b"));

    let (single, _) = run(WGRAD, &gpt_args(&text_file, &single_a, &plot, "8"));
    assert!(single.status.success(), "{}", text(&single));
    let (o, _) = mpirun(2, &[], &gpt_args(&text_file, &mpi_a, &plot, "8"));
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("over 2 processes") && stdout.contains("cross-process reductions"),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("trained 8 steps").count(),
        1,
        "only rank 0 reports: {stdout}"
    );
    let (want, got) = (final_validation_loss(&single), final_validation_loss(&o));
    // Relative 1e-3: summation order only (printed to 4 decimals).
    assert!(
        (got - want).abs() <= 1e-3 * want,
        "mpirun -n 2: validation loss {got} against one process's {want}"
    );
    let diff = assert_same_gpt("mpirun -n 2 vs one process", &mpi_a, &single_a);
    eprintln!("gpt mpirun -n 2 vs one process: max |Δparam| = {diff:.3e}");

    let mut resumed_single = gpt_args(&text_file, &single_b, &plot, "12");
    resumed_single.extend_from_slice(&["--resume", &single_a]);
    let (o, _) = run(WGRAD, &resumed_single);
    assert!(o.status.success(), "{}", text(&o));
    let mut resumed_mpi = gpt_args(&text_file, &mpi_b, &plot, "12");
    resumed_mpi.extend_from_slice(&["--resume", &single_a]);
    let (o, _) = mpirun(2, &[], &resumed_mpi);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("trained 4 steps"),
        "{}",
        text(&o)
    );
    let diff = assert_same_gpt("resumed under mpirun -n 2 vs one process", &mpi_b, &single_b);
    eprintln!("gpt resumed under mpirun -n 2 vs one process: max |Δparam| = {diff:.3e}");
    std::fs::remove_dir_all(&dir).ok();
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The `loss scale: final …` line of a run's output.
fn loss_scale_line(o: &Output) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout);
    stdout
        .lines()
        .find(|l| l.starts_with("loss scale: final"))
        .unwrap_or_else(|| panic!("no loss scale line: {}", text(o)))
        .to_string()
}

/// `--precision f16 --checkpoint-activations` across processes: `mpirun
/// -n 2` against one process with the same flags, then both resumed from
/// the single-process folder, whose loss scale (grown every 2 steps) rank 0
/// reads and sends to rank 1. Before rank 0's broadcast carried it, every
/// rank restarted at the initial scale.
#[test]
fn mpi_f16_checkpointed_gpt_matches_single_process_and_resumes_its_loss_scale() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("gpt-f16");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, plot) = (p("text.txt"), p("loss.png"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let single_a = p("single_a");
    let f16 = [
        "--precision",
        "f16",
        "--checkpoint-activations",
        "--loss-scale-interval",
        "2",
    ];
    let args = |out: &'static str, steps: &'static str, resume: Option<&str>| -> Vec<String> {
        let mut all: Vec<String> = gpt_args(&text_file, &p(out), &plot, steps)
            .into_iter()
            .map(String::from)
            .collect();
        all.extend(f16.iter().map(|s| s.to_string()));
        if let Some(from) = resume {
            all.extend(["--resume".to_string(), from.to_string()]);
        }
        all
    };

    let (single, _) = run(WGRAD, &strs(&args("single_a", "8", None)));
    assert!(single.status.success(), "{}", text(&single));
    let (o, _) = mpirun(2, &[], &strs(&args("mpi_a", "8", None)));
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("over 2 processes") && stdout.contains("precision f16"),
        "{stdout}"
    );
    let (want, got) = (final_validation_loss(&single), final_validation_loss(&o));
    // Relative 1e-3: summation order only (printed to 4 decimals).
    assert!(
        (got - want).abs() <= 1e-3 * want,
        "mpirun -n 2, f16 + checkpointing: validation loss {got} against one process's {want}"
    );
    assert_eq!(
        loss_scale_line(&o),
        loss_scale_line(&single),
        "mpirun -n 2: the loss scale"
    );
    let diff = assert_same_gpt(
        "mpirun -n 2 vs one process, f16 + checkpointing",
        &p("mpi_a"),
        &single_a,
    );
    eprintln!("gpt f16 + checkpointing: mpirun -n 2 vs one process: max |Δparam| = {diff:.3e}, validation loss {got} against {want}; {}", loss_scale_line(&o));

    let (o, _) = run(WGRAD, &strs(&args("single_b", "12", Some(&single_a))));
    assert!(o.status.success(), "{}", text(&o));
    let want_scale = loss_scale_line(&o);
    let want = final_validation_loss(&o);
    let (o, _) = mpirun(2, &[], &strs(&args("mpi_b", "12", Some(&single_a))));
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("trained 4 steps"),
        "{}",
        text(&o)
    );
    assert_eq!(
        loss_scale_line(&o),
        want_scale,
        "resumed under mpirun -n 2: the loss scale"
    );
    let got = final_validation_loss(&o);
    assert!(
        (got - want).abs() <= 1e-3 * want,
        "resumed under mpirun -n 2: validation loss {got} against one process's {want}"
    );
    let diff = assert_same_gpt(
        "resumed under mpirun -n 2 vs one process, f16 + checkpointing",
        &p("mpi_b"),
        &p("single_b"),
    );
    eprintln!("gpt f16 + checkpointing resumed: mpirun -n 2 vs one process: max |Δparam| = {diff:.3e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--precision f16` where one process's device has no SHADER_F16 (rank 0
/// on lavapipe, rank 1 on llvmpipe-GL, one mpirun of two programs): the
/// whole job trains in f32 and says why, ending where one process in f32
/// ends. Rank 0 alone in f16 would add loss-scaled gradients to rank 1's
/// unscaled ones.
#[test]
fn mpi_f16_falls_back_to_f32_everywhere_when_a_rank_lacks_shader_f16() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let (adapters, _) = run(WGRAD, &["adapters"]);
    let listing = String::from_utf8_lossy(&adapters.stdout);
    if !(listing.contains("SHADER_F16=yes") && listing.contains("backend: Gl")) {
        eprintln!("needs an adapter with SHADER_F16 and a GL one: skipping");
        return;
    }
    let dir = out_dir("gpt-f16-mixed");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, plot, single, mixed) = (p("text.txt"), p("loss.png"), p("single"), p("mixed"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let (o, _) = run(WGRAD, &gpt_args(&text_file, &single, &plot, "8"));
    assert!(o.status.success(), "{}", text(&o));
    let want = final_validation_loss(&o);
    let rank = |backend: &'static str| -> Vec<&str> {
        let mut args = vec!["-n", "1", WGRAD];
        args.extend(gpt_args(&text_file, &mixed, &plot, "8"));
        args.extend([
            "--precision",
            "f16",
            "--distributed",
            "mpi",
            "--parallel",
            "data",
            "--backend",
            backend,
        ]);
        args
    };
    let mut all = rank("vulkan");
    all.push(":");
    all.extend(rank("gl"));
    let (o, _) = run("mpirun", &all);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("another process has no SHADER_F16, so this run trains in f32")
            && !stdout.contains("loss scale: final"),
        "{stdout}"
    );
    let got = final_validation_loss(&o);
    // Relative 1e-3: summation order and two backends' rounding.
    assert!(
        (got - want).abs() <= 1e-3 * want,
        "f16 asked, f32 run over lavapipe + GL: validation loss {got} against one process's {want}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `mpirun -n 2|3 wgrad train --model gpt --parallel zero` at stages 2
/// and 3 (the arena cut between the ranks: reduce-scatter and all-gather
/// over MPI) against one process on one device, and ZeRO-3 resumed from the
/// single-process folder (rank 0 reads it and sends each rank its state).
#[test]
fn mpi_zero_matches_single_process_and_resumes() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("zero");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, plot) = (p("text.txt"), p("loss.png"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let (single_a, single_b) = (p("single_a"), p("single_b"));
    let (single, _) = run(WGRAD, &gpt_args(&text_file, &single_a, &plot, "8"));
    assert!(single.status.success(), "{}", text(&single));
    let want = final_validation_loss(&single);
    // 3 ranks: uneven rows (2 + 1 + 1) and uneven ranges of the arena.
    for (ranks, stage) in [(2, "2"), (3, "2"), (2, "3")] {
        let out = p(&format!("zero{stage}-{ranks}"));
        let (o, _) = mpirun_with(
            ranks,
            &["--parallel", "zero", "--zero-stage", stage],
            &gpt_args(&text_file, &out, &plot, "8"),
        );
        assert!(o.status.success(), "{}", text(&o));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(stdout.contains(&format!("ZeRO stage {stage}")), "{stdout}");
        let got = final_validation_loss(&o);
        // Relative 1e-3: summation order only (printed to 4 decimals).
        assert!(
            (got - want).abs() <= 1e-3 * want,
            "ZeRO-{stage} over {ranks} processes: validation loss {got} against one process's {want}"
        );
        let diff = assert_same_gpt(
            &format!("ZeRO-{stage} over mpirun -n {ranks} vs one process"),
            &out,
            &single_a,
        );
        eprintln!("gpt ZeRO-{stage} over mpirun -n {ranks} vs one process: max |Δparam| = {diff:.3e}");
    }
    let mut resumed_single = gpt_args(&text_file, &single_b, &plot, "12");
    resumed_single.extend_from_slice(&["--resume", &single_a]);
    let (o, _) = run(WGRAD, &resumed_single);
    assert!(o.status.success(), "{}", text(&o));
    let resumed = p("zero3_resumed");
    let mut args = gpt_args(&text_file, &resumed, &plot, "12");
    args.extend_from_slice(&["--resume", &single_a]);
    let (o, _) = mpirun_with(2, &["--parallel", "zero", "--zero-stage", "3"], &args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("trained 4 steps"),
        "{}",
        text(&o)
    );
    let diff = assert_same_gpt("ZeRO-3 resumed under mpirun -n 2 vs one process", &resumed, &single_b);
    eprintln!("gpt ZeRO-3 resumed under mpirun -n 2 vs one process: max |Δparam| = {diff:.3e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank failing mid-way through a GPT run ends the job with a message
/// naming it, as for the MLP.
#[cfg(feature = "fault-injection")]
#[test]
fn a_failing_rank_stops_a_gpt_job() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("gpt-failure");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, out, plot) = (p("text.txt"), p("never"), p("never.png"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let (o, took) = mpirun(2, &["--fail-at", "1:3"], &gpt_args(&text_file, &out, &plot, "200"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the job must fail: {}", text(&o));
    assert_ne!(
        o.status.code(),
        Some(124),
        "the job hung until the timeout: {}",
        text(&o)
    );
    assert!(
        err.contains("rank 1 of 2") && err.contains("failure injected at step 3"),
        "stderr should name the failing rank: {}",
        text(&o)
    );
    assert!(took < Duration::from_secs(120), "took {took:?} to stop");
    assert!(!Path::new(&out).exists(), "no model folder from a failed job");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--precision f16 --checkpoint-activations` (the loss scale doubling
/// every 2 clean steps) under `mpirun -n 2 wgrad train --model gpt
/// --parallel zero` at stages 1 and 3 against one process on one device
/// with the same flags: one loss scale across the ranks (the same final
/// scale printed) and the same validation loss (relative 1e-3: summation
/// order and the rows each rank stores in f16); then ZeRO-3 resumed from
/// the single-process folder, whose loss scale rank 0 reads and sends to
/// the other rank, against the single process resumed.
#[test]
fn mpi_zero_in_f16_with_checkpointing_matches_one_process() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = out_dir("zero-f16");
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text_file, plot) = (p("text.txt"), p("loss.png"));
    std::fs::write(&text_file, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let flags = [
        "--precision",
        "f16",
        "--checkpoint-activations",
        "--loss-scale-interval",
        "2",
    ];
    let with_flags = |out: &str, steps: &'static str| -> Vec<String> {
        gpt_args(&text_file, out, &plot, steps)
            .into_iter()
            .chain(flags)
            .map(String::from)
            .collect()
    };
    let (single_a, single_b) = (p("single_a"), p("single_b"));
    let args = with_flags(&single_a, "8");
    let (single, _) = run(WGRAD, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(single.status.success(), "{}", text(&single));
    let (want, want_scale) = (final_validation_loss(&single), loss_scale_line(&single));
    for stage in ["1", "3"] {
        let out = p(&format!("zero{stage}"));
        let args = with_flags(&out, "8");
        let (o, _) = mpirun_with(
            2,
            &["--parallel", "zero", "--zero-stage", stage],
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        assert!(o.status.success(), "{}", text(&o));
        let got = final_validation_loss(&o);
        assert!(
            (got - want).abs() <= 1e-3 * want,
            "f16 ZeRO-{stage} over 2 processes: validation loss {got} against one process's {want}"
        );
        assert_eq!(loss_scale_line(&o), want_scale, "f16 ZeRO-{stage} over 2 processes");
    }
    let mut args = with_flags(&single_b, "12");
    args.extend(["--resume".to_string(), single_a.clone()]);
    let (single, _) = run(WGRAD, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(single.status.success(), "{}", text(&single));
    let resumed = p("zero3_resumed");
    let mut args = with_flags(&resumed, "12");
    args.extend(["--resume".to_string(), single_a.clone()]);
    let (o, _) = mpirun_with(
        2,
        &["--parallel", "zero", "--zero-stage", "3"],
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let (got, want) = (final_validation_loss(&o), final_validation_loss(&single));
    assert!(
        (got - want).abs() <= 1e-3 * want,
        "f16 ZeRO-3 resumed over 2 processes: validation loss {got} against one process's {want}"
    );
    assert_eq!(
        loss_scale_line(&o),
        loss_scale_line(&single),
        "f16 ZeRO-3 resumed over 2 processes"
    );
    std::fs::remove_dir_all(&dir).ok();
}
