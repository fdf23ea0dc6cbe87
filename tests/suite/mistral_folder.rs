//! Mistral folders both ways, as qwen_folder.rs checks Qwen's: a folder
//! transformers' `save_pretrained` wrote (scripts/make_mistral_fixture.py:
//! a window of 5 over 16 positions, heads of 12 channels over 32 / 4)
//! loads with its window and gives transformers' logits on every adapter;
//! a folder wgrad saves loads back with the same config and says
//! `MistralForCausalLM` and its window (scripts/check_hf_folder.py opens
//! one in transformers: examples/hf_folder.rs `mistral`); `sliding_window`
//! null, absent (transformers' default 4096) and invalid.

use std::fs;

use crate::common;
use crate::gpt_folder::{assert_same_parameters, copy_fixture, edit_config, fixture, TempDir};

use common::{assert_close, for_each_adapter, random_vec, rng};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::llama_folder::{load_llama_folder, read_llama_config, save_llama_folder};
use wgrad::io::lm_folder::{lm_family, LmFamily};
use wgrad::models::{mistral, Llama, LlamaConfig, LlamaVariant};
use wgrad::nn::{Module, RopeLayout};
use wgrad::Error;

fn tiny() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 37,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        intermediate_size: 56,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: Some(12),
        sliding_window: Some(5),
        variant: LlamaVariant::Mistral,
    }
}

#[test]
fn the_presets_have_their_published_sizes() {
    let seven = mistral::mistral_7b_v0_1();
    assert_eq!(seven.num_parameters(), Some(7_241_732_096));
    assert_eq!(seven.sliding_window, Some(4096));
    assert_eq!(mistral::preset("mistral-7b-v0.1", 0).unwrap().block_size, 2048);
    let small = mistral::preset("small", 65).unwrap();
    assert_eq!((small.vocab_size, small.sliding_window), (65, Some(16)));
    assert!(matches!(
        mistral::preset("mistral-9000", 65),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn a_folder_written_by_transformers_gives_transformers_logits() {
    let logits = checkpoint::load(fixture("hf-tiny-mistral-logits.safetensors")).unwrap();
    let ids: Vec<u32> = logits.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    let dir = fixture("hf-tiny-mistral");
    assert_eq!(lm_family(&dir).unwrap(), LmFamily::Llama);
    let model = load_llama_folder(&dir).unwrap().model;
    assert_eq!(model.config, tiny());
    let want = &logits.get("mistral").unwrap().data;
    let full = &logits.get("mistral_full").unwrap().data;
    // The window matters here: without it transformers' logits move by far
    // more than the tolerance.
    assert!(want.iter().zip(full).any(|(a, b)| (a - b).abs() > 0.1));
    for_each_adapter("mistral folder from transformers", |k| {
        let got = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
        // Logits within ±3: float32 sums in another order, a few ulps (the
        // Llama and Qwen folders' tolerance).
        assert_close("mistral", &got, want, 2e-5, 1e-5);
        Ok(())
    });
}

#[test]
fn a_saved_folder_loads_back_bit_identically_with_its_window() {
    let tmp = TempDir::new("mistral");
    for window in [Some(5), None] {
        let mut r = rng(7);
        let config = LlamaConfig {
            sliding_window: window,
            ..tiny()
        };
        let model = Llama::from_parameters(config, |_, shape| {
            Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
        })
        .unwrap();
        let dir = tmp.path(&format!("{window:?}"));
        save_llama_folder(&dir, &model, None).unwrap();
        let loaded = load_llama_folder(&dir).unwrap();
        assert_same_parameters(&model, &loaded.model);
        assert_eq!(loaded.model.config, model.config);
        let config: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["model_type"], "mistral");
        assert_eq!(config["architectures"][0], "MistralForCausalLM");
        assert_eq!(config["sliding_window"], serde_json::json!(window));
        assert_eq!(config["head_dim"], 12);
    }
}

#[test]
fn the_window_is_read_as_transformers_reads_it() {
    let window = |name: &str, edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let tmp = TempDir::new(&format!("mistral-window-{name}"));
        let dir = copy_fixture("hf-tiny-mistral", &tmp);
        edit_config(&dir, |c| edit(c));
        read_llama_config(&dir).map(|c| c.sliding_window)
    };
    assert_eq!(
        window("null", &|c| {
            c.insert("sliding_window".into(), serde_json::Value::Null);
        })
        .unwrap(),
        None
    );
    // MistralConfig's default when the field is absent.
    assert_eq!(
        window("absent", &|c| {
            c.remove("sliding_window");
        })
        .unwrap(),
        Some(4096)
    );
    for (name, value) in [("zero", serde_json::json!(0)), ("text", serde_json::json!("5"))] {
        let err = window(name, &|c| {
            c.insert("sliding_window".into(), value.clone());
        })
        .expect_err("an invalid window");
        assert!(
            matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("sliding window") || reason.contains("sliding_window")),
            "{name}: {err}"
        );
    }
}

/// llama.cpp stores Mistral as a `llama` file; scripts/make_mistral_gguf_fixture.py
/// adds `llama.attention.sliding_window` = 3 to the Llama GGUF fixture. The
/// file loads as a Mistral over that window: the logits are the Llama
/// file's model's with the window set (the same weights and kernels:
/// equal), and differ from the unwindowed ones.
#[test]
fn a_gguf_llama_with_a_window_is_a_mistral() {
    use wgrad::io::gguf_model::{GgufArchitecture, GgufModel};
    let mistral = GgufModel::open(fixture("gguf-mistral.gguf")).unwrap();
    let llama = GgufModel::open(fixture("gguf-llama.gguf")).unwrap();
    let (GgufArchitecture::Llama(windowed), GgufArchitecture::Llama(full)) =
        (*mistral.architecture(), *llama.architecture())
    else {
        panic!("both files are llama")
    };
    assert_eq!(
        windowed,
        LlamaConfig {
            sliding_window: Some(3),
            variant: LlamaVariant::Mistral,
            ..full
        }
    );
    let ids: Vec<u32> = (0..full.block_size as u32)
        .map(|i| (i * 7 + 3) % full.vocab_size as u32)
        .collect();
    let (mistral, llama) = (mistral.to_llama().unwrap(), llama.to_llama().unwrap());
    let values: std::collections::HashMap<String, Vec<f32>> = llama
        .parameter_values()
        .into_iter()
        .map(|(n, _, v)| (n, v.to_vec()))
        .collect();
    let windowed_llama = Llama::from_parameters(windowed, |name, _| Ok(values[name].clone())).unwrap();
    for_each_adapter("a GGUF Mistral", |k| {
        let got = Predictor::new(k.clone(), &mistral, 1)?.outputs_ids(&ids)?;
        let want = Predictor::new(k.clone(), &windowed_llama, 1)?.outputs_ids(&ids)?;
        let full = Predictor::new(k.clone(), &llama, 1)?.outputs_ids(&ids)?;
        assert_close("windowed", &got, &want, 0.0, 0.0);
        assert!(
            got.iter().zip(&full).any(|(a, b)| (a - b).abs() > 1e-3),
            "the window matters"
        );
        Ok(())
    });
}
