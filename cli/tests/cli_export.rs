//! `wgrad export` (an adapter merged into a Hugging Face folder or a GGUF
//! file), `wgrad chat --lora` and `wgrad train --lora --resume`, end to
//! end on the GGUF Llama fixture (2 layers, 64 channels, vocabulary 271,
//! a byte-level BPE and a chat template; matrices of mixed types). Where
//! Python has them, transformers + PEFT and llama.cpp (llama-cpp-python)
//! check what was written: scripts/check_peft_adapter.py and
//! scripts/check_gguf_export.py.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use rand::{Rng, SeedableRng};
use wgrad::nn::{Lora, LoraConfig, ParameterTree};

const GGUF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/gguf-llama.gguf");
const HF_BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf-tiny-llama");
const PEFT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/peft-tiny-llama-lora");
const BIN: &str = env!("CARGO_BIN_EXE_wgrad");

fn wgrad(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn ok(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The error of a run that must fail.
fn refused(args: &[&str]) -> String {
    let output = wgrad(args);
    assert!(!output.status.success(), "{args:?} was accepted");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

struct Tmp(PathBuf);

impl Tmp {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("wgrad-cli-export-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tmp(dir)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An adapter over the GGUF fixture on every Linear but the head (r 4,
/// alpha 8) with B drawn at random, as trained steps would leave it: large
/// enough to change the greedy tokens.
fn random_adapter(dir: &str) {
    let base = wgrad::io::gguf_model::GgufModel::open(GGUF)
        .unwrap()
        .to_llama()
        .unwrap();
    wgrad::nn::manual_seed(3);
    let mut model = Lora::new(base, LoraConfig::new(4, 8.0, &["all-linear"])).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    model
        .visit_mut("", &mut |name, _, values| {
            if name.ends_with("lora_B.weight") {
                values.iter_mut().for_each(|v| *v = rng.random_range(-0.3..0.3));
            }
            Ok(())
        })
        .unwrap();
    wgrad::io::peft::save_lora(dir, &model, GGUF).unwrap();
}

const PROMPT: &str = "1 72 101 108 108 111";

/// Greedy ids after PROMPT from `model`, with `extra` flags.
fn greedy_ids(model: &str, new: usize, extra: &[&str]) -> String {
    let new = new.to_string();
    let mut args = vec!["generate", "--model", model, "--prompt-ids", PROMPT, "--print-ids"];
    args.extend(["--max-new-tokens", &new, "--temperature", "0"]);
    args.extend(extra);
    let stdout = ok(&wgrad(&args));
    stdout
        .lines()
        .find(|l| l.starts_with("new_ids"))
        .unwrap_or_default()
        .to_string()
}

/// A Python interpreter that imports `modules` ($WGRAD_PYTHON, else
/// python3), or None with one line saying what is skipped.
fn python_with(what: &str, modules: &[&str]) -> Option<String> {
    let python = std::env::var("WGRAD_PYTHON").unwrap_or_else(|_| "python3".into());
    let imports = format!("import {}", modules.join(", "));
    let ok = Command::new(&python)
        .args(["-c", &imports])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("{what}: skipped ({python} cannot `{imports}`)");
    }
    ok.then_some(python)
}

fn run_script(python: &str, script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(script);
    let out = Command::new(python).arg(&path).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} {args:?} failed:\n{text}");
    eprintln!("{text}");
    text
}

/// The merged GGUF file generates what the base with its adapter
/// generates (F32: the same values), and llama.cpp runs the Q8_0 and Q4_0
/// exports with wgrad's greedy tokens on the same file.
#[test]
fn an_exported_gguf_runs_in_wgrad_and_llama_cpp_alike() {
    let tmp = Tmp::new("gguf");
    let adapter = tmp.path("adapter");
    random_adapter(&adapter);
    let base = greedy_ids(GGUF, 8, &[]);
    let adapted = greedy_ids(GGUF, 8, &["--lora", &adapter]);
    assert_ne!(adapted, base, "the adapter changes the greedy tokens");

    let f32_file = tmp.path("merged-f32.gguf");
    let stdout = ok(&wgrad(&[
        "export", "--model", GGUF, "--lora", &adapter, "--out", &f32_file, "--type", "f32",
    ]));
    assert!(stdout.contains("14 merged matrices"), "{stdout}");
    assert_eq!(greedy_ids(&f32_file, 8, &[]), adapted);

    let python = python_with("llama.cpp on the exported files", &["llama_cpp", "gguf", "numpy"]);
    for ty in ["q8_0", "q4_0"] {
        let file = tmp.path(&format!("merged-{ty}.gguf"));
        let stdout = ok(&wgrad(&[
            "export", "--model", GGUF, "--lora", &adapter, "--out", &file, "--type", ty,
        ]));
        assert!(stdout.contains(&ty.to_uppercase()), "{stdout}");
        let Some(python) = &python else { continue };
        let out = run_script(
            python,
            "check_gguf_export.py",
            &[
                &file,
                "--base",
                GGUF,
                "--wgrad",
                BIN,
                "--prompt-ids",
                &PROMPT.replace(' ', ","),
                "--max-new-tokens",
                "12",
            ],
        );
        assert!(out.contains("greedy tokens equal"), "{out}");
    }
}

/// The folder `export` writes from a GGUF base loads in transformers
/// with the logits PEFT computes from the base and the adapter, and
/// generates in wgrad what the base with the adapter generates; from a
/// Hugging Face base with PEFT's own adapter, likewise.
#[test]
fn an_exported_folder_computes_the_adapted_model() {
    let tmp = Tmp::new("hf");
    let adapter = tmp.path("adapter");
    random_adapter(&adapter);
    let merged = tmp.path("merged");
    let stdout = ok(&wgrad(&[
        "export", "--model", GGUF, "--lora", &adapter, "--out", &merged,
    ]));
    assert!(stdout.contains("a Hugging Face folder"), "{stdout}");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(Path::new(&merged).join(file).is_file(), "{file} in {stdout}");
    }
    assert_eq!(greedy_ids(&merged, 8, &[]), greedy_ids(GGUF, 8, &["--lora", &adapter]));
    if let Some(python) = python_with(
        "PEFT against the merged folder",
        &["torch", "peft", "transformers", "gguf"],
    ) {
        let ids = PROMPT.replace(' ', ",") + ",40,50,60,70,80,90";
        let out = run_script(
            &python,
            "check_peft_adapter.py",
            &[GGUF, &adapter, "--merged", &merged, "--ids", &ids, "--atol", "1e-4"],
        );
        assert!(out.contains("max |merged - PEFT|"), "{out}");
    }

    // PEFT's fixture over the Hugging Face tiny Llama (no tokenizer: ids).
    let base = tmp.path("hf-base");
    std::fs::create_dir_all(&base).unwrap();
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(Path::new(HF_BASE).join(file), Path::new(&base).join(file)).unwrap();
    }
    std::fs::write(
        Path::new(&base).join("wgrad_tokenizer.json"),
        r#"{"kind":"char","vocabulary":"\n abehinorstTquw.,"}"#,
    )
    .unwrap();
    let merged = tmp.path("merged-peft");
    ok(&wgrad(&["export", "--model", &base, "--lora", PEFT, "--out", &merged]));
    let ids = |model: &str, extra: &[&str]| {
        let mut args = vec!["generate", "--model", model, "--prompt-ids", "1 2 3", "--print-ids"];
        args.extend(["--max-new-tokens", "6", "--temperature", "0"]);
        args.extend(extra);
        ok(&wgrad(&args))
    };
    let with_adapter = ids(&base, &["--lora", PEFT]);
    assert_eq!(ids(&merged, &[]), with_adapter);
    assert_ne!(ids(&base, &[]), with_adapter);
}

/// What export cannot do is refused before anything is written, naming why.
#[test]
fn export_refuses_what_it_cannot_write() {
    let tmp = Tmp::new("refusals");
    let adapter = tmp.path("adapter");
    random_adapter(&adapter);
    let out_gguf = tmp.path("m.gguf");
    let out_dir = tmp.path("m");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--model", GGUF, "--lora", &adapter, "--out", &out_dir, "--type", "q8_0"],
            "--type does not apply",
        ),
        (
            vec![
                "--model", GGUF, "--lora", &adapter, "--out", &out_gguf, "--format", "hf",
            ],
            "names a GGUF file",
        ),
        (
            vec![
                "--model", GGUF, "--lora", &adapter, "--out", &out_dir, "--format", "gguf",
            ],
            "ends in .gguf",
        ),
        (
            vec!["--model", HF_BASE, "--lora", PEFT, "--out", &out_gguf],
            "is a folder",
        ),
        (
            vec![
                "--model", GGUF, "--lora", &adapter, "--out", &out_gguf, "--type", "q6_k",
            ],
            "invalid value 'q6_k'",
        ),
        (
            vec!["--model", GGUF, "--lora", "/nonexistent/adapter", "--out", &out_gguf],
            "/nonexistent/adapter",
        ),
        // PEFT's adapter is for the Hugging Face tiny Llama: other shapes.
        (
            vec!["--model", GGUF, "--lora", PEFT, "--out", &out_gguf],
            "the base Linear is [64, 96]",
        ),
        (
            vec![
                "--model",
                GGUF,
                "--lora",
                &adapter,
                "--out",
                &out_gguf,
                "--lora-scale",
                "NaN",
            ],
            "not a finite number",
        ),
        (
            vec![
                "--model",
                "/nonexistent/base.gguf",
                "--lora",
                &adapter,
                "--out",
                &out_dir,
            ],
            "does not exist",
        ),
        (
            vec!["--model", GGUF, "--lora", &adapter, "--out", GGUF],
            "is the base model or the adapter",
        ),
    ];
    for (args, says) in cases {
        let mut all = vec!["export"];
        all.extend(&args);
        let err = refused(&all);
        assert!(err.contains(says), "{args:?}: want `{says}` in {err}");
    }
    assert!(!Path::new(&out_gguf).exists() && !Path::new(&out_dir).exists());
}

/// `chat --lora` answers with the adapter; scaled by 0 it is the base.
/// The fixture's 32 positions hold no chat turn: the same file with a
/// longer context (rotary positions take any) serves.
#[test]
fn chat_applies_a_lora_adapter() {
    let tmp = Tmp::new("chat");
    let adapter = tmp.path("adapter");
    random_adapter(&adapter);
    let model = tmp.path("long-context.gguf");
    let base = wgrad::io::gguf::Gguf::open(GGUF).unwrap();
    let mut writer = wgrad::io::gguf_write::GgufWriter::new();
    for (key, value) in base.metadata() {
        writer.set(key, value.clone()).unwrap();
    }
    writer
        .set("llama.context_length", wgrad::io::gguf::Value::U32(256))
        .unwrap();
    for t in base.tensors() {
        writer
            .add_tensor(&t.name, &t.shape(), t.ty, base.read_raw(&t.name).unwrap())
            .unwrap();
    }
    writer.write(&model).unwrap();
    let chat = |extra: &[&str]| -> String {
        let mut args = vec!["chat", "--model", &model, "--temperature", "0", "--max-new-tokens", "6"];
        args.extend(extra);
        let mut child = Command::new(BIN)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(b"hello there\n").unwrap();
        ok(&child.wait_with_output().unwrap())
    };
    let base = chat(&[]);
    assert_eq!(chat(&["--lora", &adapter, "--lora-scale", "0"]), base);
    assert_ne!(chat(&["--lora", &adapter]), base);
    let err = refused(&["chat", "--model", &model, "--lora-scale", "2"]);
    assert!(err.contains("--lora"), "{err}");
}

/// Train arguments for a small adapter run over the GGUF fixture.
fn train_args<'a>(text: &'a str, out: &'a str, plot: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--init",
        GGUF,
        "--lora",
        "r=2,alpha=4,targets=q_proj,k_proj,down_proj",
        "--text",
        text,
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        steps,
        "--loss-every",
        "1",
        "--eval-every",
        "100",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--lr",
        "1e-2",
        "--out",
        out,
        "--plot",
        plot,
    ]
}

fn final_loss(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("final training loss"))
        .unwrap_or_else(|| panic!("no final training loss in {stdout}"))
        .to_string()
}

/// Two adapter steps, then two more resumed from the folder, end where
/// four straight steps end: the same adapter and optimizer state, bit for
/// bit, and the same last loss. A resume that would not continue the same
/// run is refused.
#[test]
fn an_adapter_run_resumes_exactly() {
    let tmp = Tmp::new("resume");
    let text = tmp.path("text.txt");
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(40)).unwrap();
    let plot = tmp.path("loss.png");
    let (straight, first, resumed) = (tmp.path("straight"), tmp.path("first"), tmp.path("resumed"));
    let whole = ok(&wgrad(&train_args(&text, &straight, &plot, "4")));
    ok(&wgrad(&train_args(&text, &first, &plot, "2")));
    let mut args = train_args(&text, &resumed, &plot, "4");
    args.extend(["--resume", &first]);
    let again = ok(&wgrad(&args));
    assert!(again.contains(&format!("resumed from {first} at step 2")), "{again}");
    assert_eq!(final_loss(&again), final_loss(&whole));
    // Tensors bit for bit, and metadata (which a file may list in any order).
    for file in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let read = |dir: &str| wgrad::io::checkpoint::load(Path::new(dir).join(file)).unwrap();
        let (a, b) = (read(&straight), read(&resumed));
        assert_eq!(a.metadata, b.metadata, "{file}");
        assert_eq!(a.tensors.len(), b.tensors.len(), "{file}");
        for (x, y) in a.tensors.iter().zip(&b.tensors) {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(
                x.name == y.name && bits(&x.data) == bits(&y.data),
                "{file}: {} differs",
                x.name
            );
        }
    }
    let config = |dir: &str| std::fs::read(Path::new(dir).join("adapter_config.json")).unwrap();
    assert!(config(&straight) == config(&resumed));

    // Each flag of the resumed run as given, but `flag` (added or replaced).
    let rerun = |flag: &str, value: &str| -> String {
        let mut all = train_args(&text, &resumed, &plot, "4");
        all.extend(["--resume", first.as_str()]);
        match all.iter().position(|a| *a == flag) {
            Some(i) => all[i + 1] = value,
            None => all.extend([flag, value]),
        }
        refused(&all)
    };
    let err = rerun("--lora", "r=3,alpha=4,targets=q_proj,k_proj,down_proj");
    assert!(
        err.contains("holds adapters r=2") && err.contains("--lora declares r=3"),
        "{err}"
    );
    let err = rerun("--seed", "1");
    assert!(err.contains("--seed 0"), "{err}");
    let err = rerun("--batch-size", "4");
    assert!(err.contains("--batch-size 2"), "{err}");
    // An adapter without its optimizer state (as PEFT saves one).
    std::fs::remove_file(Path::new(&first).join("optimizer.safetensors")).unwrap();
    let err = rerun("--seed", "0");
    assert!(err.contains("has no optimizer.safetensors"), "{err}");
    // --resume over --init without --lora: a whole-model fine-tune.
    let err = refused(&[
        "train",
        "--init",
        GGUF,
        "--resume",
        &first,
        "--text",
        &text,
        "--max-steps",
        "1",
        "--plot",
        &plot,
    ]);
    assert!(err.contains("--resume does not apply"), "{err}");
}
