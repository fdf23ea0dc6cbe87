//! `wgrad train`: failing before it does any work, the GPT end to end, and
//! the GPT data parallel against one device. (The library's checks
//! themselves are in tests/suite/parallel.rs and gpt_data_parallel.rs;
//! cli/tests/mpi.rs runs the binary under mpirun.)

use wgrad::parallel::MAX_DEVICES;

/// `Strategy::check_devices` runs before any device opens (the run fails
/// at once, not after opening devices one by one).
#[test]
fn wgrad_train_with_100000_devices_fails_at_once() {
    let dir = std::env::temp_dir().join(format!("wgrad-devices-{}", std::process::id()));
    let (ckpt, plot) = (dir.join("never.safetensors"), dir.join("never.png"));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args([
            "train",
            "--model",
            "mlp",
            "--parallel",
            "data",
            "--devices",
            "100000",
            "--max-steps",
            "1",
        ])
        .arg("--checkpoint")
        .arg(&ckpt)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{err}");
    assert!(
        err.contains("100000") && err.contains(&MAX_DEVICES.to_string()),
        "{err}"
    );
    assert!(!ckpt.exists());
}

/// `wgrad train --model gpt` end to end on a tiny model and text: the
/// validation losses, the final one, and the PNG with both curves.
#[test]
fn wgrad_train_gpt_prints_validation_losses_and_plots() {
    let dir = std::env::temp_dir().join(format!("wgrad-gpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (text, plot, out) = (dir.join("text.txt"), dir.join("loss.png"), dir.join("gpt"));
    std::fs::write(&text, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args([
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
        ])
        .args([
            "--batch-size",
            "4",
            "--max-steps",
            "6",
            "--eval-every",
            "3",
            "--eval-batches",
            "1",
            "--sample-tokens",
            "20",
        ])
        .arg("--text")
        .arg(&text)
        .arg("--plot")
        .arg(&plot)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("step 3: validation loss") && stdout.contains("step 6: validation loss"),
        "{stdout}"
    );
    assert!(stdout.contains("final validation loss"), "{stdout}");
    assert!(
        std::fs::metadata(&plot).map(|m| m.len() > 0).unwrap_or(false),
        "no plot at {}",
        plot.display()
    );
    for file in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "wgrad_tokenizer.json",
    ] {
        assert!(out.join(file).is_file(), "the model folder lacks {file}");
    }
    assert!(stdout.contains("(20 tokens at"), "no sample at the end: {stdout}");

    // `wgrad generate` on the folder: the prompt and 30 new characters of
    // the text's alphabet, greedy twice the same, tokens/s on stderr.
    let generate = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .arg("generate")
            .arg("--model")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    let greedy = ["--prompt", "to be", "--max-new-tokens", "30", "--temperature", "0"];
    let (first, second) = (generate(&greedy), generate(&greedy));
    let text = String::from_utf8_lossy(&first.stdout).into_owned();
    assert!(
        first.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(
        text.starts_with("to be") && text.trim_end_matches('\n').chars().count() == 35,
        "{text:?}"
    );
    assert!(text.chars().all(|c| "to be or n,thaiqus.\n".contains(c)), "{text:?}");
    assert_eq!(first.stdout, second.stdout, "greedy generation is deterministic");
    assert!(String::from_utf8_lossy(&first.stderr).contains("tokens/s"));
    // Several prompts in one batch: each sequence as it comes alone.
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "to be\n\nthat is\n").unwrap();
    let batch = generate(&[
        "--prompts-file",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "30",
        "--temperature",
        "0",
    ]);
    let batch_text = String::from_utf8_lossy(&batch.stdout).into_owned();
    assert!(
        batch.status.success(),
        "{batch_text}\n{}",
        String::from_utf8_lossy(&batch.stderr)
    );
    assert_eq!(batch_text.matches("=== sequence ").count(), 2, "{batch_text}");
    assert!(
        batch_text.contains(&format!("=== sequence 0 ===\n{text}")),
        "the batch's first sequence against the prompt alone: {batch_text:?} vs {text:?}"
    );
    assert!(batch_text.contains("=== sequence 1 ===\nthat is"), "{batch_text}");
    // Bad input: each a clear error, no text.
    for (args, says) in [
        (vec!["--prompt", "to be!", "--max-new-tokens", "5"], "'!'"),
        (vec!["--prompt", "to be", "--max-new-tokens", "0"], "max-new-tokens"),
        (
            vec!["--prompt", &"to be ".repeat(4), "--max-new-tokens", "5"],
            "context of 16",
        ),
        (vec!["--prompt", "to be", "--batch", "0"], "--batch"),
        (
            vec!["--prompts-file", "/nonexistent/prompts.txt"],
            "/nonexistent/prompts.txt",
        ),
    ] {
        let output = generate(&args);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && err.contains(says), "{args:?}: {err}");
        assert!(
            output.stdout.is_empty(),
            "{args:?} printed {:?}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The flags of a tiny GPT run on `text` (quick: L1 H2 C16 T16, batch 4).
fn tiny_gpt_args(text: &std::path::Path, dir: &std::path::Path, name: &str) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
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
        "8",
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--text",
    ]
    .iter()
    .map(Into::into)
    .collect();
    args.push(text.into());
    args.extend([
        "--plot".into(),
        dir.join(format!("{name}.png")).into_os_string(),
        "--out".into(),
        dir.join(name).into_os_string(),
    ]);
    args
}

/// The number after `final validation loss` in the output.
fn final_validation_loss(stdout: &str) -> f32 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("final validation loss"))
        .unwrap_or_else(|| panic!("no final validation loss in {stdout}"));
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("cannot read {line:?}"))
}

/// `wgrad train --model gpt --parallel data|tensor|pipeline --devices 2`
/// each end with the single-device run's validation loss and report how
/// the work was spread and what communication cost.
#[test]
fn wgrad_train_gpt_in_parallel_ends_where_one_device_ends() {
    let dir = std::env::temp_dir().join(format!("wgrad-gpt-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .args(tiny_gpt_args(&text, &dir, name))
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let single = run("single", &[]);
    let data = run("data", &["--parallel", "data", "--devices", "2"]);
    assert!(
        data.contains("data parallel, batch split #0") && data.contains("#1 "),
        "{data}"
    );
    assert!(
        data.contains("communication") && data.contains("% of step time"),
        "no report at the end: {data}"
    );
    let tensor = run("tensor", &["--parallel", "tensor", "--devices", "2"]);
    assert!(
        tensor.contains("tensor parallel over 2 devices")
            && tensor.contains("split per device")
            && tensor.contains("communication"),
        "{tensor}"
    );
    let pipeline = run(
        "pipeline",
        &[
            "--parallel",
            "pipeline",
            "--devices",
            "2",
            "--micro-batches",
            "2",
            "--schedule",
            "gpipe",
        ],
    );
    assert!(pipeline.contains("GPipe") && pipeline.contains("bubble"), "{pipeline}");
    let zero = run("zero", &["--parallel", "zero", "--zero-stage", "2", "--devices", "2"]);
    assert!(
        zero.contains("ZeRO stage 2") && zero.contains("kept per device between steps"),
        "{zero}"
    );
    let want = final_validation_loss(&single);
    for (strategy, output) in [
        ("data", &data),
        ("tensor", &tensor),
        ("pipeline", &pipeline),
        ("ZeRO-2", &zero),
    ] {
        let got = final_validation_loss(output);
        // The same training up to the f32 summation order of the batch and
        // of the split matmuls (tests/suite/gpt_data_parallel.rs,
        // gpt_tensor.rs, gpt_pipeline.rs): relative 1e-3.
        assert!(
            (got - want).abs() <= 1e-3 * want,
            "{strategy} parallel {got} against one device {want}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPT run with more devices than its strategy can use, or a batch the
/// pipeline cannot cut into micro-batches, fails before any device opens,
/// naming the numbers.
#[test]
fn wgrad_train_gpt_with_impossible_devices_fails_at_once() {
    let dir = std::env::temp_dir().join(format!("wgrad-gpt-devices-{}", std::process::id()));
    let text = dir.join("never-read.txt");
    for (extra, says) in [
        (
            vec!["--parallel", "data", "--devices", "100000"],
            vec!["100000".to_string(), MAX_DEVICES.to_string()],
        ),
        (
            vec!["--parallel", "data", "--devices", "5"],
            vec!["5 devices".into(), "4 rows".into()],
        ),
        (
            vec!["--parallel", "tensor", "--devices", "3"],
            vec!["3 devices".into(), "2 heads".into()],
        ),
        (
            vec!["--parallel", "pipeline", "--devices", "4"],
            vec!["4 stages".into(), "at most 3".into()],
        ),
        (
            vec!["--parallel", "pipeline", "--micro-batches", "3"],
            vec!["4 rows".into(), "3 equal micro-batches".into()],
        ),
        (
            vec!["--parallel", "data", "--zero-stage", "2"],
            vec!["--parallel zero".into()],
        ),
        (
            vec!["--parallel", "zero", "--zero-stage", "4"],
            vec!["stages 1, 2 and 3".into()],
        ),
    ] {
        let start = std::time::Instant::now();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .args(tiny_gpt_args(&text, &dir, "never"))
            .args(&extra)
            .output()
            .unwrap();
        let took = start.elapsed();
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{extra:?}: {err}");
        assert!(
            says.iter().all(|s| err.contains(s.as_str())),
            "{extra:?} should say {says:?}: {err}"
        );
        // Not a speed measurement: opening devices one by one (or reading
        // the text, which does not exist) would take far longer, or fail
        // with another message.
        assert!(took < std::time::Duration::from_secs(5), "{extra:?} took {took:?}");
        assert!(!dir.join("never").exists());
    }
}

/// `--dry-run` prints every strategy's bytes per device at 1, 2 and 4
/// devices without training: ZeRO's optimizer state at most 0.55× data
/// parallel's at 2 devices, tensor and pipeline parallel refused where 4
/// devices cannot share the GPT's 2 heads and 1 block, and no model folder
/// written; with `--precision f16 --checkpoint-activations` the plan
/// says so and changes.
#[test]
fn wgrad_train_dry_run_prints_the_memory_of_every_strategy() {
    let dir = std::env::temp_dir().join(format!("wgrad-dry-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args(tiny_gpt_args(&text, &dir, "never"))
        .args(["--dry-run", "--devices", "4"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // devices, strategy, parameters, gradients, optimizer, activations, total (MiB)
    let row = |devices: &str, strategy: &str| -> Vec<String> {
        let line = stdout
            .lines()
            .find(|l| l.split_whitespace().take(2).eq([devices, strategy]))
            .unwrap_or_else(|| panic!("no {strategy} row at {devices}: {stdout}"));
        line.split_whitespace().map(str::to_string).collect()
    };
    assert_eq!(row("1", "single").len(), 7, "{stdout}");
    for strategy in ["data", "zero-1", "zero-2", "zero-3", "tensor", "pipeline"] {
        assert_eq!(row("2", strategy).len(), 7, "{stdout}");
    }
    for strategy in ["data", "zero-1", "zero-2", "zero-3"] {
        assert_eq!(row("4", strategy).len(), 7, "{stdout}");
    }
    // 2 heads, and 1 block with its embedding and head: at most 3 stages.
    assert!(
        row("4", "tensor").join(" ").contains("cannot") && row("4", "pipeline").join(" ").contains("cannot"),
        "{stdout}"
    );
    let optimizer = |strategy: &str| row("2", strategy)[4].parse::<f64>().unwrap();
    assert!(optimizer("data") > 0.0, "{stdout}");
    assert!(optimizer("zero-1") <= 0.55 * optimizer("data"), "{stdout}");
    assert!(
        !stdout.contains("final validation loss") && !dir.join("never").exists(),
        "{stdout}"
    );
    // Both flags planned in: the header says f16 assumes SHADER_F16, and
    // one device's activations are planned anew.
    let flagged = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
        .args(tiny_gpt_args(&text, &dir, "never"))
        .args([
            "--dry-run",
            "--devices",
            "2",
            "--precision",
            "f16",
            "--checkpoint-activations",
        ])
        .output()
        .unwrap();
    let flagged_out = String::from_utf8_lossy(&flagged.stdout).into_owned();
    assert!(
        flagged.status.success(),
        "{flagged_out}\n{}",
        String::from_utf8_lossy(&flagged.stderr)
    );
    assert!(
        flagged_out.contains("SHADER_F16") && flagged_out.contains("checkpointed activations"),
        "{flagged_out}"
    );
    let single = |out: &str| {
        out.lines()
            .find(|l| l.split_whitespace().take(2).eq(["1", "single"]))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no single row: {out}"))
    };
    assert_ne!(
        single(&flagged_out),
        single(&stdout),
        "f16 and checkpointing planned as f32"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny Llama run's flags (the small preset on 16 positions, batch 2,
/// 4 steps) on `text`, writing into `dir`.
fn tiny_llama_args(text: &std::path::Path, dir: &std::path::Path, name: &str) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "train",
        "--model",
        "llama",
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "4",
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--text",
    ]
    .iter()
    .map(Into::into)
    .collect();
    args.push(text.into());
    let plot = dir.join(format!("{name}.png")).into_os_string();
    args.extend(["--plot".into(), plot, "--out".into(), dir.join(name).into_os_string()]);
    args
}

/// `--optimizer` picks a language model's update rule (AdamW by default):
/// the run says which in its header, and SGD's and Adam's validation
/// losses differ from AdamW's. Every run prints its first step's time
/// apart from the others' mean.
#[test]
fn wgrad_train_llama_takes_the_optimizer() {
    let dir = std::env::temp_dir().join(format!("wgrad-llama-optimizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question. ".repeat(100)).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"));
        let output = command
            .args(tiny_llama_args(&text, &dir, name))
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let header = |stdout: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with("model: "))
            .unwrap_or_else(|| panic!("{stdout}"))
            .to_string()
    };
    let adamw = run("adamw", &[]);
    assert!(
        header(&adamw).contains("| adamw lr=0.003") && header(&adamw).contains("weight_decay=0.1"),
        "{adamw}"
    );
    let sgd = run("sgd", &["--optimizer", "sgd", "--momentum", "0.8"]);
    assert!(
        header(&sgd).contains("| sgd lr=0.003 momentum=0.8") && header(&sgd).contains("weight_decay=0 "),
        "{sgd}"
    );
    let adam = run("adam", &["--optimizer", "adam"]);
    assert!(header(&adam).contains("| adam lr=0.003"), "{adam}");
    for stdout in [&adamw, &sgd, &adam] {
        let header = header(stdout);
        assert!(
            header.contains("schedule=warmup_cosine") && header.contains("clip_grad_norm=1"),
            "{stdout}"
        );
        let line = stdout
            .lines()
            .find(|l| l.starts_with("trained 4 steps"))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(
            line.contains("first step") && line.contains("then") && line.contains("ms/step"),
            "{line}"
        );
    }
    let (adamw, sgd, adam) = (
        final_validation_loss(&adamw),
        final_validation_loss(&sgd),
        final_validation_loss(&adam),
    );
    assert!(
        adamw != sgd && adamw != adam && sgd != adam,
        "adamw {adamw}, sgd {sgd}, adam {adam}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A preset's context is --block-size's, up to the preset's largest:
/// SmolLM2's preset plans 128 positions (it trains 2048 of its 8192), and
/// 9000 or GPT-2's 2048 is refused naming the most, as is 0.
#[test]
fn wgrad_train_preset_takes_a_block_size() {
    let wgrad = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
            .args(args)
            .output()
            .unwrap()
    };
    let planned = wgrad(&[
        "train",
        "--model",
        "llama",
        "--preset",
        "smollm2-135m",
        "--block-size",
        "128",
        "--dry-run",
    ]);
    let stdout = String::from_utf8_lossy(&planned.stdout);
    assert!(
        planned.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&planned.stderr)
    );
    assert!(
        stdout.contains("Llama L30 H9/3 C576 T128") && stdout.contains("128 tokens"),
        "{stdout}"
    );
    for (args, says) in [
        (
            vec!["--model", "llama", "--preset", "smollm2-135m", "--block-size", "9000"],
            "8192",
        ),
        (
            vec!["--model", "gpt", "--preset", "gpt2", "--block-size", "2048"],
            "1024",
        ),
        (vec!["--model", "llama", "--block-size", "0"], "at least 1"),
    ] {
        let refused = wgrad(&[&["train", "--dry-run"], &args[..]].concat());
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success() && err.contains("--block-size") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

/// Each flag that does not apply to the run the other flags describe is
/// an error naming the flag and why, before any work: no device opens,
/// nothing is read or written.
#[test]
fn wgrad_train_refuses_flags_that_do_not_apply() {
    let dir = std::env::temp_dir().join(format!("wgrad-flags-{}", std::process::id()));
    let never = dir.join("never");
    let never = never.to_str().unwrap();
    let init = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf-tiny-gpt2");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--model", "gpt", "--epochs", "3"], "MLP's passes"),
        (vec!["--model", "llama", "--hidden", "64"], "hidden widths"),
        (vec!["--model", "gpt", "--test-fraction", "0.5"], "test split"),
        (vec!["--model", "gpt", "--checkpoint", never], "--out"),
        (vec!["--model", "llama", "--mnist", never], "--text"),
        (vec!["--model", "mlp", "--text", never], "language models"),
        (vec!["--model", "mlp", "--block-size", "16"], "language models"),
        (vec!["--model", "mlp", "--preset", "gpt2"], "language models"),
        (vec!["--model", "mlp", "--tokenizer", "gpt2"], "language models"),
        (vec!["--model", "mlp", "--warmup-steps", "3"], "language models"),
        (vec!["--model", "mlp", "--min-lr", "1e-4"], "language models"),
        (vec!["--model", "mlp", "--weight-decay", "0.1"], "language models"),
        (vec!["--model", "mlp", "--clip", "0.5"], "language models"),
        (vec!["--model", "mlp", "--eval-every", "5"], "language models"),
        (vec!["--model", "mlp", "--eval-batches", "2"], "language models"),
        (vec!["--model", "mlp", "--out", never], "language models"),
        (vec!["--model", "mlp", "--sample-tokens", "5"], "language models"),
        (vec!["--model", "mlp", "--attention", "fused"], "language models"),
        (vec!["--model", "mlp", "--checkpoint-activations"], "language models"),
        (vec!["--model", "mlp", "--dry-run"], "language models"),
        (vec!["--model", "mlp", "--n-embd", "8"], "language models"),
        (vec!["--model", "llama", "--n-layer", "2"], "--preset"),
        (vec!["--model", "gpt", "--momentum", "0.5"], "optimizer is adamw"),
        (vec!["--model", "mlp", "--momentum", "0.5"], "optimizer is adam:"),
        (
            vec!["--model", "mlp", "--optimizer", "adamw", "--momentum", "0.5"],
            "optimizer is adamw",
        ),
        (vec!["--model", "gpt", "--micro-batches", "2"], "--parallel pipeline"),
        (
            vec!["--model", "gpt", "--parallel", "data", "--schedule", "gpipe"],
            "--parallel pipeline",
        ),
        (vec!["--model", "gpt", "--split", "2,2"], "--parallel data or zero"),
        (
            vec!["--model", "gpt", "--parallel", "tensor", "--split", "2,2"],
            "--parallel data or zero",
        ),
        (vec!["--model", "gpt", "--devices", "2"], "--adapter"),
        (
            vec!["--model", "mlp", "--loss-scale-interval", "100"],
            "--precision f16",
        ),
        (vec!["--init", init, "--dry-run"], "--init"),
    ];
    for (args, says) in cases {
        let flag = args.iter().rev().find(|a| a.starts_with("--")).unwrap();
        let start = std::time::Instant::now();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"));
        command
            .arg("train")
            .args(&args)
            .args(["--plot", &format!("{never}.png"), "--max-steps", "1"]);
        let output = command.output().unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        let refused = err.contains(&format!("{flag} does not apply")) && err.contains(says);
        assert!(refused, "{args:?} should refuse {flag}, saying {says:?}: {err}");
        // Not a speed measurement: opening a device, reading data or
        // training would take far longer, or fail with another message.
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{args:?} took {:?}",
            start.elapsed()
        );
        assert!(!dir.exists(), "{args:?} wrote into {}", dir.display());
    }
}

/// `wgrad train --model qwen2|qwen3|mistral` on the shipped text (the
/// small presets: Qwen2's q/k/v biases, Qwen3's q/k norms and heads of 48
/// over 128 / 4, Mistral's window of 16) trains, and tensor parallel over 2 devices (a KV head each,
/// biases split with their rows, the q/k norms replicated) ends where one
/// device ends: the library's equality (tests/suite/qwen_parallel.rs) through
/// the command line. Four steps at batch 4 keep it quick.
#[test]
fn wgrad_train_qwen_tensor_parallel_ends_where_one_device_ends() {
    let dir = std::env::temp_dir().join(format!("wgrad-qwen-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for model in ["qwen2", "qwen3", "mistral"] {
        let run = |name: &str, extra: &[&str]| {
            let output = std::process::Command::new(env!("CARGO_BIN_EXE_wgrad"))
                .args([
                    "train",
                    "--model",
                    model,
                    "--max-steps",
                    "4",
                    "--batch-size",
                    "4",
                    "--eval-every",
                    "4",
                    "--eval-batches",
                    "1",
                    "--sample-tokens",
                    "0",
                    "--seed",
                    "3",
                ])
                .args(extra)
                .arg("--plot")
                .arg(dir.join(format!("{model}-{name}.png")))
                .arg("--out")
                .arg(dir.join(format!("{model}-{name}")))
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                output.status.success(),
                "{model} {name}: {stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            stdout
        };
        let single = run("single", &[]);
        let title = match model {
            "qwen2" => "Qwen2 L4",
            "qwen3" => "Qwen3 L4",
            _ => "Mistral L4",
        };
        assert!(
            single.contains(title) || dir.join(format!("{model}-single.png")).exists(),
            "{single}"
        );
        let tensor = run("tensor", &["--parallel", "tensor", "--devices", "2"]);
        let (want, got) = (final_validation_loss(&single), final_validation_loss(&tensor));
        // Sums split over the devices' heads: relative 1e-3, as the GPT's.
        assert!(
            (got - want).abs() <= 1e-3 * want,
            "{model}: tensor parallel {got} against one device {want}"
        );
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{model}-single/config.json"))).unwrap()).unwrap();
        assert_eq!(config["model_type"], model);
        // The small Mistral attends over 16 of its 64 positions.
        let window = (model == "mistral").then_some(16);
        assert_eq!(config["sliding_window"], serde_json::json!(window), "{model}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
