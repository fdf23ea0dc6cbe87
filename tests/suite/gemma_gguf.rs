//! Gemma 3 270M's real Q4_K_M file (`gemma-3-270m-q4_k_m.gguf`, fetched
//! into wgrad's cache by scripts/fetch-gemma3.sh; `$WGRAD_GEMMA3` points
//! elsewhere): its metadata reads as the published config, its own
//! tokenizer gives transformers' ids, and the weights as the file stores
//! them (Q4_K, Q5_0, Q6_K, Q8_0 decoded in the kernels, the 262,144-row
//! Q8_0 token table over more than one storage binding) give transformers'
//! greedy tokens of the de-quantized model
//! (scripts/gemma3_reference.py, tests/fixtures/gemma3-reference.json).
//! Without the file the tests say so and pass: it is 253 MB, never
//! committed, and not every machine has fetched it.

use std::path::PathBuf;
use std::sync::Arc;

use crate::gpt_folder::fixture;

use serde_json::Value as Json;
use wgrad::infer::generate::{Generator, Sampling, WeightDtype};
use wgrad::io::bpe::BpeTokenizer;
use wgrad::io::gguf_model::{GgufArchitecture, GgufModel};
use wgrad::models::{Gemma, GemmaConfig};

/// The file, or `None` (with a message) when it has not been fetched.
fn gemma3_path() -> Option<PathBuf> {
    let path = match std::env::var_os("WGRAD_GEMMA3") {
        Some(path) => PathBuf::from(path),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)?
            .join(".cache/wgrad/models/gemma-3-270m-q4_k_m.gguf"),
    };
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "skipped: Gemma 3 270M's GGUF file is not at {} (fetch it with scripts/fetch-gemma3.sh, or point WGRAD_GEMMA3 at a copy)",
            path.display()
        );
        None
    }
}

fn as_u32(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn gemma3_file_reads_as_the_published_config_and_tokenizes_as_transformers() {
    let Some(path) = gemma3_path() else { return };
    let file = GgufModel::open(&path).unwrap();
    assert_eq!(
        *file.architecture(),
        GgufArchitecture::Gemma3(GemmaConfig::gemma3_270m())
    );
    let reference: Json = serde_json::from_slice(&std::fs::read(fixture("gemma3-reference.json")).unwrap()).unwrap();
    let tokenizer = BpeTokenizer::from_gguf(file.gguf()).unwrap();
    for case in reference["prompts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tokenizer.encode(text, true).unwrap(), as_u32(&case["ids"]), "{text:?}");
    }
}

#[test]
fn gemma3_gives_transformers_greedy_tokens() {
    let Some(path) = gemma3_path() else { return };
    let reference: Json = serde_json::from_slice(&std::fs::read(fixture("gemma3-reference.json")).unwrap()).unwrap();
    let file = GgufModel::open(&path).unwrap();
    let GgufArchitecture::Gemma3(config) = *file.architecture() else {
        panic!("not a Gemma 3 file")
    };
    // The model's whole context of 32,768 positions, as `wgrad generate`
    // sizes its cache by default: 1.2 GB of keys and values, and prefill
    // passes of at most 512 rows (chunked prefill).
    let quantized = Arc::new(file.quantized_weights().unwrap());
    let mut model = Gemma::empty(config).unwrap();
    wgrad::nn::ParameterTree::visit_mut(&mut model, "", &mut |name, _, values| {
        if !quantized.contains_key(&name) {
            *values = file.parameter_f32(&name)?;
        }
        Ok(())
    })
    .unwrap();
    // One adapter per suite run: a 270M model decodes at a few tokens per
    // second on a CPU adapter; the fixture checks the numerics everywhere.
    let Some(k) = crate::common::adapters().first() else {
        return crate::common::no_adapter("Gemma 3 against transformers");
    };
    let run = || -> wgrad::Result<()> {
        let mut generator = Generator::new_with_weights(k.clone(), &model, 1, WeightDtype::F32, quantized.clone())?;
        println!(
            "Gemma 3 270M Q4_K_M on {}: {:.1} MiB on the GPU ({}-position cache)",
            k.device().label(),
            generator.executor().peak_bytes() as f64 / f64::from(1 << 20),
            generator.context_len(),
        );
        // The code prompt: 24 tokens (its smallest top-2 margin is in the
        // fixture); the prose one: its first 8 (its margins are smaller).
        for (case, tokens) in reference["prompts"].as_array().unwrap().iter().zip([24, 8]) {
            let want = &as_u32(&case["greedy"])[..tokens];
            let greedy = generator.generate(&as_u32(&case["ids"]), tokens, &Sampling::greedy(), |_| Ok(()))?;
            assert_eq!(
                greedy, want,
                "{:?}: transformers continues with {:?}",
                case["text"], case["greedy_text"]
            );
        }
        Ok(())
    };
    let _gl = k.device().lock_gl();
    if let Err(e) = run() {
        panic!("Gemma 3 against transformers on {}: {e}", k.device().label());
    }
}
