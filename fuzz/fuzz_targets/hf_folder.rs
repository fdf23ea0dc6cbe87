//! The Hugging Face folder loaders (GPT-2, Llama, and every family through
//! `load_lm_folder`) on arbitrary files.
//!
//! An input is a bundle of files: each starts with `\0FILE:NAME\n` and runs
//! to the next such marker (fuzz/README.md says how the seeds are
//! made). NAME must be a plain file name (letters, digits, `._-`, not
//! starting with a dot, at most 64 bytes); other parts are dropped, so the
//! target writes nowhere but its own folder. The files are written to a
//! fresh folder under the temporary directory (TMPDIR; scripts/fuzz.sh
//! points it at /dev/shm) and every loader entry point reads it.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use wgrad::io::gpt_folder::load_gpt_folder;
use wgrad::io::llama_folder::load_llama_folder;
use wgrad::io::lm_folder::{lm_family, load_lm_folder, read_lm_config};

const MARKER: &[u8] = b"\0FILE:";
const MAX_FILES: usize = 16;

fn plain_name(name: &[u8]) -> Option<&str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name[0] != b'.'
        && name.iter().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(b));
    ok.then(|| std::str::from_utf8(name).ok()).flatten()
}

/// (name, contents) of each well-named part, the first of a name winning.
fn files(data: &[u8]) -> Vec<(&str, &[u8])> {
    let mut out: Vec<(&str, &[u8])> = Vec::new();
    let mut starts: Vec<usize> = data
        .windows(MARKER.len())
        .enumerate()
        .filter(|(_, w)| *w == MARKER)
        .map(|(i, _)| i)
        .collect();
    starts.push(data.len());
    for pair in starts.windows(2) {
        let part = &data[pair[0] + MARKER.len()..pair[1].max(pair[0] + MARKER.len())];
        let Some(newline) = part.iter().position(|&b| b == b'\n') else {
            continue;
        };
        let Some(name) = plain_name(&part[..newline]) else {
            continue;
        };
        if out.len() < MAX_FILES && !out.iter().any(|(n, _)| *n == name) {
            out.push((name, &part[newline + 1..]));
        }
    }
    out
}

/// This process's folder, emptied before each input.
fn folder() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| std::env::temp_dir().join(format!("wgrad-fuzz-hf-folder-{}", std::process::id())))
}

fuzz_target!(|data: &[u8]| {
    let dir = folder();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("create the fuzz folder");
    for (name, contents) in files(data) {
        std::fs::write(dir.join(name), contents).expect("write a fuzz file");
    }
    let _ = lm_family(dir);
    let _ = read_lm_config(dir);
    let _ = load_gpt_folder(dir);
    let _ = load_llama_folder(dir);
    // Every family by its config.json (Gemma 3, Qwen2/Qwen3, Mistral too).
    let _ = load_lm_folder(dir);
});
