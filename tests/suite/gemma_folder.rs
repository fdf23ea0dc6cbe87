//! Gemma 3 folders both ways, as qwen_folder.rs checks Qwen's: a folder
//! transformers' `save_pretrained` wrote (tests/fixtures/hf-tiny-gemma3,
//! by scripts/make_gemma_fixture.py: local, global and local layers, heads
//! of 12 over 32 / 4, query_pre_attn_scalar 10, noise on every norm)
//! loads and gives transformers' logits; a saved Gemma loads back bit for
//! bit with Hugging Face's names and config fields; what wgrad's Gemma
//! does not compute is refused. scripts/check_hf_folder.py checks the
//! other direction in transformers itself (`examples/hf_folder.rs gemma3`
//! writes its input).

use std::fs;

use crate::common;
use crate::gpt_folder::{assert_same_parameters, copy_fixture, edit_config, fixture, read_raw, TempDir};

use common::{assert_close, for_each_adapter, random_vec, rng};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::gemma_folder::{load_gemma_folder, save_gemma_folder};
use wgrad::io::lm_folder::{lm_family, load_lm_folder, LmFamily};
use wgrad::models::{Gemma, GemmaConfig};
use wgrad::nn::Module;
use wgrad::Error;

/// The fixture's sizes.
fn tiny() -> GemmaConfig {
    GemmaConfig {
        vocab_size: 37,
        block_size: 16,
        n_layer: 3,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        head_dim: 12,
        intermediate_size: 56,
        rope_theta: 1e6,
        rope_local_theta: 1e4,
        rms_norm_eps: 1e-6,
        query_pre_attn_scalar: 10.0,
        sliding_window: 16,
        sliding_window_pattern: 2,
    }
}

#[test]
fn the_gemma_presets_have_their_published_sizes() {
    // google/gemma-3-270m: 268,098,176 parameters (the model card's 270M;
    // 170M of them the tied 262,144 × 640 table).
    assert_eq!(GemmaConfig::gemma3_270m().num_parameters(), Some(268_098_176));
    let small = GemmaConfig::preset("small", 65).unwrap();
    assert!(small.check().is_ok() && small.vocab_size == 65);
    assert!(matches!(
        GemmaConfig::preset("gemma-9000", 65),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn a_gemma_folder_written_by_transformers_gives_transformers_logits() {
    let logits = checkpoint::load(fixture("hf-tiny-gemma3-logits.safetensors")).unwrap();
    let ids: Vec<u32> = logits.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    let dir = fixture("hf-tiny-gemma3");
    assert_eq!(lm_family(&dir).unwrap(), LmFamily::Gemma3);
    let model = load_gemma_folder(&dir).unwrap().model;
    assert_eq!(model.config, tiny());
    let any = load_lm_folder(&dir).unwrap();
    assert_eq!(any.model.describe(), model.describe());
    let want = logits.get("gemma3").unwrap().data.clone();
    for_each_adapter("gemma folder from transformers", |k| {
        let got = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
        // Logits within ±3: float32 sums in another order, a few ulps.
        assert_close("gemma3", &got, &want, 2e-5, 1e-5);
        Ok(())
    });
}

#[test]
fn a_saved_gemma_folder_loads_back_bit_identically() {
    let tmp = TempDir::new("gemma");
    let mut r = rng(8);
    let model = Gemma::from_parameters(tiny(), |_, shape| {
        Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
    })
    .unwrap();
    let dir = tmp.path("gemma3");
    save_gemma_folder(&dir, &model, None).unwrap();
    let loaded = load_gemma_folder(&dir).unwrap();
    assert_same_parameters(&model, &loaded.model);
    assert_eq!(loaded.model.config, model.config);
    let (tensors, _) = read_raw(&dir.join("model.safetensors"));
    let mut names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(tensors.iter().map(|t| t.0.clone()).collect::<Vec<_>>(), names);
    let config: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gemma3_text");
    assert_eq!(config["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(config["query_pre_attn_scalar"], 10);
    assert_eq!(
        config["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"])
    );
}

#[test]
fn what_wgrads_gemma_does_not_compute_is_refused() {
    let tmp = TempDir::new("gemma-refused");
    let cases: [(&str, fn(&mut serde_json::Map<String, serde_json::Value>), &str); 4] = [
        (
            "softcap",
            |c| {
                c.insert("final_logit_softcapping".into(), 30.0.into());
            },
            "final_logit_softcapping",
        ),
        (
            "act",
            |c| {
                c.insert("hidden_activation".into(), "silu".into());
            },
            "hidden_activation",
        ),
        (
            "types",
            |c| {
                c.insert(
                    "layer_types".into(),
                    serde_json::json!(["full_attention", "sliding_attention", "sliding_attention"]),
                );
            },
            "layer_types",
        ),
        (
            "untied",
            |c| {
                c.insert("tie_word_embeddings".into(), false.into());
            },
            "tie_word_embeddings",
        ),
    ];
    for (name, edit, field) in cases {
        let dir = copy_fixture("hf-tiny-gemma3", &tmp);
        let dir = {
            let to = tmp.path(name);
            fs::rename(&dir, &to).unwrap();
            to
        };
        edit_config(&dir, edit);
        match load_gemma_folder(&dir) {
            Err(e) => assert!(e.to_string().contains(field), "{name}: {e}"),
            Ok(_) => panic!("{name}: loaded"),
        }
    }
}
