//! fuzz/'s gguf target without cargo-fuzz: every committed seed
//! (fuzz/seeds/gguf) through the target's own body
//! (fuzz/fuzz_targets/gguf_input.rs), so a seed that panics fails here on
//! every machine; the seeds of issue 37's broken files (a k-quant
//! super-block cut short, a row not whole super-blocks, NaN and infinite
//! scales, a family's tensor missing or misshapen) are each the clear
//! error they stand for, and the tiny Gemma 3 of every format loads with
//! each format kept as the kernels read it (scripts/make_fuzz_seeds.py
//! writes them).

use std::path::PathBuf;

use wgrad::io::gguf::{GgmlType, Gguf};
use wgrad::io::gguf_model::{GgufArchitecture, GgufModel};
use wgrad::ops::QuantFormat;

#[path = "../../fuzz/fuzz_targets/gguf_input.rs"]
mod gguf_input;

fn seeds() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/gguf")
}

fn seed(name: &str) -> Vec<u8> {
    std::fs::read(seeds().join(name)).unwrap()
}

/// The error `run` gives a seed, as text.
#[track_caller]
fn error_of(name: &str) -> String {
    match gguf_input::run(&seed(name)) {
        Ok(()) => panic!("{name}: the broken file loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_gguf_seed_ends_in_a_value_or_an_error() {
    let mut names: Vec<_> = std::fs::read_dir(seeds())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    // The seeds of scripts/make_fuzz_seeds.py and tests/fixtures.
    assert!(names.len() >= 18, "{names:?}");
    for name in names {
        // A panic fails the test, naming nothing: say which seed ran.
        println!(
            "{name}: {:?}",
            gguf_input::run(&seed(&name)).err().map(|e| e.to_string())
        );
    }
}

#[test]
fn the_families_seeds_load() {
    for name in ["gemma3-every-format.gguf", "qwen2.gguf", "qwen3.gguf", "mistral.gguf"] {
        if let Err(e) = gguf_input::run(&seed(name)) {
            panic!("{name}: {e}");
        }
    }
}

/// The tiny Gemma 3 keeps every block format quantized (the kernels'
/// path) and de-quantizes its BF16 and F16 matrices.
#[test]
fn the_gemma3_seed_holds_every_format() {
    let model = GgufModel::from_gguf(Gguf::from_bytes("seed.gguf", seed("gemma3-every-format.gguf")).unwrap()).unwrap();
    assert!(matches!(model.architecture(), GgufArchitecture::Gemma3(_)));
    let quantized = model.quantized_weights().unwrap();
    let mut formats: Vec<QuantFormat> = quantized.values().map(|m| m.format).collect();
    formats.sort_by_key(|f| format!("{f:?}"));
    formats.dedup();
    assert_eq!(formats.len(), 9, "{formats:?}");
    let types: Vec<GgmlType> = model.gguf().tensors().iter().map(|t| t.ty).collect();
    for ty in [GgmlType::BF16, GgmlType::F16] {
        assert!(types.contains(&ty), "{ty}");
    }
    // 15 matrices (7 a block, and the token table), all but the BF16 and
    // the F16 one kept quantized.
    assert_eq!(quantized.len(), 13, "{:?}", quantized.keys().collect::<Vec<_>>());
}

#[test]
fn the_broken_family_seeds_are_clear_errors() {
    for (name, wanted) in [
        (
            "gemma3-q2k-cut-short.gguf",
            &["blk.1.ffn_up.weight", "past the end of the file"][..],
        ),
        (
            "gemma3-q4k-row-half-a-super-block.gguf",
            &["blk.0.attn_q.weight", "not a whole number", "Q4_K"],
        ),
        ("gemma3-q4k-nan-d.gguf", &["blk.0.attn_q.weight", "non-finite", "NaN"]),
        ("gemma3-q6k-inf-d.gguf", &["blk.0.attn_v.weight", "non-finite", "inf"]),
        (
            "gemma3-q2k-inf-dmin.gguf",
            &["blk.0.ffn_gate.weight", "non-finite", "inf"],
        ),
        ("gemma3-missing-ffn-up.gguf", &["blk.1.ffn_up.weight"]),
        ("gemma3-misshapen-attn-k.gguf", &["blk.0.attn_k.weight"]),
        ("qwen2-no-q-bias.gguf", &["blk.0.attn_q.bias"]),
        ("qwen3-no-q-norm.gguf", &["blk.1.attn_q_norm.weight"]),
    ] {
        let error = error_of(name);
        for part in wanted {
            assert!(error.contains(part), "{name}: {error:?} does not say {part:?}");
        }
    }
}
