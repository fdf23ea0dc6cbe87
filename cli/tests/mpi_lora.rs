//! LoRA across processes with MPI: `mpirun -n 2 wgrad train --init …
//! --lora …` under data parallel and ZeRO-2 and -3 against one process on
//! the same global batches, on the tiny Llama fixture. The adapters have
//! dropout, so the ranks must draw the masks one process draws for their
//! rows; and only the adapters' gradients cross processes.
//! Runs with `--features mpi` when `mpirun` is installed (`make test`).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const WGRAD: &str = env!("CARGO_BIN_EXE_wgrad");
const BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf-tiny-llama");

/// The adapters' values: r = 2 on every Linear but the head of 2 layers
/// (cli_lora.rs's count); and their matrices, each padded to 64 values in
/// the gradient arena at most.
const ADAPTER_VALUES: u64 = 1_952;
const ADAPTER_MATRICES: u64 = 2 * 7 * 2;
/// The base's values: what full fine-tuning would send.
const BASE_VALUES: u64 = 19_424;

fn mpi_available() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `program args` under a time limit, with what OpenMPI needs as root on
/// a small machine (as cli/tests/mpi.rs runs it).
fn run(program: &str, args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["--kill-after=10", "240", program])
        .args(args)
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
        .expect("run timeout")
}

fn ok(o: &Output) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// The fixture with a char tokenizer, so `--init` reads text (cli_lora.rs).
fn base_with_tokenizer(dir: &Path) -> PathBuf {
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(Path::new(BASE).join(file), base.join(file)).unwrap();
    }
    std::fs::write(
        base.join("wgrad_tokenizer.json"),
        r#"{"kind":"char","vocabulary":"\n abehinorstTquw.,"}"#,
    )
    .unwrap();
    base
}

/// Four AdamW steps of adapters with dropout 0.1 on batches of 4 windows.
fn train_args<'a>(base: &'a str, text: &'a str, out: &'a str, plot: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--init",
        base,
        "--lora",
        "r=2,alpha=4,dropout=0.1,targets=all-linear",
        "--text",
        text,
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-steps",
        "4",
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--lr",
        "1e-2",
        "--seed",
        "5",
        "--out",
        out,
        "--plot",
        plot,
    ]
}

/// max |a − b| over the adapter tensors two PEFT folders hold.
fn max_adapter_difference(a: &Path, b: &Path) -> f32 {
    let load = |dir: &Path| wgrad::io::checkpoint::load(dir.join("adapter_model.safetensors")).unwrap();
    let (a, b) = (load(a), load(b));
    assert_eq!(a.tensors.len(), ADAPTER_MATRICES as usize, "an A and a B per adapter");
    let mut worst = 0.0f32;
    for t in &a.tensors {
        let other = b.get(&t.name).unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!(t.shape, other.shape, "{}", t.name);
        for (x, y) in t.data.iter().zip(&other.data) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

#[test]
fn mpi_lora_matches_single_process_and_sends_adapter_gradients_only() {
    if !mpi_available() {
        eprintln!("mpirun not found: skipping");
        return;
    }
    let dir = std::env::temp_dir().join(format!("wgrad-mpi-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = base_with_tokenizer(&dir);
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (base_s, text, plot) = (base.to_string_lossy().into_owned(), p("text.txt"), p("loss.png"));
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let single = p("single");
    ok(&run(WGRAD, &train_args(&base_s, &text, &single, &plot)));
    for flags in [
        &["--parallel", "data"][..],
        &["--parallel", "zero", "--zero-stage", "2"],
        &["--parallel", "zero", "--zero-stage", "3"],
    ] {
        let out = p(&flags.join("-"));
        let mut args = vec!["-n", "2", WGRAD];
        args.extend(train_args(&base_s, &text, &out, &plot));
        args.extend(["--distributed", "mpi"]);
        args.extend(flags);
        let stdout = ok(&run("mpirun", &args));
        // Sums in another order over 2 processes, four steps of lr 1e-2
        // on adapters of |p| < 1: 1e-5.
        let diff = max_adapter_difference(Path::new(&out), Path::new(&single));
        assert!(diff <= 1e-5, "{flags:?}: max |Δadapter| = {diff}\n{stdout}");
        eprintln!("LoRA {flags:?} over mpirun -n 2 vs one process: max |Δadapter| = {diff:.3e}");
        // What crosses processes: the adapters' gradient arena, not the base.
        let marker = if flags[1] == "data" {
            " gradient values ("
        } else {
            " gradient values reduced across processes"
        };
        let at = stdout.find(marker).expect("the report counts what crosses processes");
        let count = stdout[..at].rsplit([' ', ';']).next().unwrap_or_default();
        let sent: u64 = count.parse().unwrap_or_else(|_| panic!("`{count}`: {stdout}"));
        assert!(
            (ADAPTER_VALUES..ADAPTER_VALUES + 64 * ADAPTER_MATRICES).contains(&sent),
            "{flags:?}: {sent} values cross processes per step, the base has {BASE_VALUES}\n{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
