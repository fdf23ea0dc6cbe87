//! Llama folders both ways: folders transformers' `save_pretrained` wrote
//! (tests/fixtures/hf-tiny-llama*, by scripts/make_llama_fixture.py) load
//! and give transformers' logits; a saved Llama loads back bit for bit
//! with Hugging Face's names; broken folders are the same clear errors the
//! GPT's are. scripts/check_hf_folder.py checks the other direction in
//! transformers itself (`examples/hf_folder.rs llama` writes its input).

use std::fs;
use std::path::Path;

use crate::common;
use crate::gpt_folder::{
    assert_same_parameters, copy_fixture, edit_config, edit_weights, ends_with, fixture, read_raw, TempDir,
};

use common::{assert_close, for_each_adapter, random_vec, rng};
use safetensors::Dtype;
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::gpt_folder::TokenizerSpec;
use wgrad::io::llama_folder::{load_llama_folder, read_llama_config, save_llama_folder};
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{Module, RopeLayout};
use wgrad::Error;

fn tiny(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 37,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        intermediate_size: 56,
        tie_word_embeddings: tied,
        ..LlamaConfig::small(37)
    }
}

fn random_llama(config: LlamaConfig, seed: u64) -> Llama {
    let mut r = rng(seed);
    Llama::from_parameters(config, |_, shape| {
        Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
    })
    .unwrap()
}

fn fixture_logits(which: &str) -> (Vec<u32>, Vec<f32>) {
    let ckpt = checkpoint::load(fixture("hf-tiny-llama-logits.safetensors")).unwrap();
    let ids = ckpt.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    (ids, ckpt.get(which).unwrap().data.clone())
}

#[test]
fn the_presets_have_their_published_sizes() {
    // SmolLM2-135M's model card: 134,515,008 parameters (tied head).
    assert_eq!(LlamaConfig::smollm2_135m().num_parameters(), Some(134_515_008));
    assert!(LlamaConfig::preset("small", 65).unwrap().check().is_ok());
    assert!(matches!(
        LlamaConfig::preset("llama-9000", 65),
        Err(Error::InvalidArgument { .. })
    ));
    let gqa = LlamaConfig {
        n_kv_head: 3,
        ..LlamaConfig::small(65)
    };
    assert!(matches!(Llama::new(gqa), Err(Error::InvalidArgument { reason, .. }) if reason.contains("n_kv_head")));
}

#[test]
fn folders_written_by_transformers_give_transformers_logits() {
    let (ids, want) = fixture_logits("logits");
    let (_, want_bf16) = fixture_logits("logits_bf16");
    let models: Vec<(&str, Llama, &[f32])> = ["hf-tiny-llama", "hf-tiny-llama-sharded", "hf-tiny-llama-bf16"]
        .into_iter()
        .map(|name| {
            let loaded = load_llama_folder(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                loaded.model.config,
                LlamaConfig {
                    rope_theta: 10000.0,
                    rms_norm_eps: 1e-5,
                    ..tiny(false)
                },
                "{name}"
            );
            let want: &[f32] = if name.ends_with("bf16") { &want_bf16 } else { &want };
            (name, loaded.model, want)
        })
        .collect();
    assert_same_parameters(&models[0].1, &models[1].1);
    for_each_adapter("llama folders from transformers", |k| {
        for (name, model, want) in &models {
            let logits = Predictor::new(k.clone(), model, 2)?.outputs_ids(&ids)?;
            // Logits within ±3: float32 sums in another order, a few ulps.
            assert_close(name, &logits, want, 2e-5, 1e-5);
        }
        Ok(())
    });
}

#[test]
fn a_saved_folder_loads_back_bit_identically_with_hugging_faces_names() {
    let tmp = TempDir::new("llama");
    for tied in [false, true] {
        let model = random_llama(tiny(tied), 5);
        let dir = tmp.path(&format!("tied-{tied}"));
        let vocabulary: String = (0..37u8).map(|i| (b'!' + i) as char).collect();
        let tokenizer = TokenizerSpec::Char { vocabulary };
        save_llama_folder(&dir, &model, Some(&tokenizer)).unwrap();
        let loaded = load_llama_folder(&dir).unwrap();
        assert_same_parameters(&model, &loaded.model);
        assert_eq!(loaded.tokenizer, Some(tokenizer));
        // The stored names are the module tree's, F32, as transformers writes them.
        let (tensors, metadata) = read_raw(&dir.join("model.safetensors"));
        let mut names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
        names.sort();
        assert_eq!(tensors.iter().map(|t| t.0.clone()).collect::<Vec<_>>(), names);
        assert!(tensors.iter().all(|t| t.1 == Dtype::F32));
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied);
        assert_eq!(metadata.get("format").map(String::as_str), Some("pt"));
        let config: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["model_type"], "llama");
        assert_eq!(config["architectures"][0], "LlamaForCausalLM");
        assert_eq!(config["num_key_value_heads"], 2);
        assert_eq!(config["rms_norm_eps"], 1e-5);
        assert_eq!(config["tie_word_embeddings"], tied);
    }
}

#[test]
fn an_interleaved_model_is_saved_in_hugging_faces_layout_with_the_same_logits() {
    let mut model = random_llama(tiny(false), 9);
    model.config.rope_layout = RopeLayout::Interleaved;
    for layer in &mut model.layers {
        layer.self_attn.rotary.layout = RopeLayout::Interleaved;
    }
    let tmp = TempDir::new("llama-interleaved");
    let dir = tmp.path("model");
    save_llama_folder(&dir, &model, None).unwrap();
    let loaded = load_llama_folder(&dir).unwrap().model;
    assert_eq!(loaded.config.rope_layout, RopeLayout::HalfSplit);
    let (ids, _) = fixture_logits("logits");
    for_each_adapter("interleaved llama folder", |k| {
        let want = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
        let got = Predictor::new(k.clone(), &loaded, 2)?.outputs_ids(&ids)?;
        // The same products with q/k channels in another order: a few ulps.
        assert_close("logits after the layout change", &got, &want, 1e-5, 1e-5);
        Ok(())
    });
}

/// The error `load_llama_folder` gives for the fixture copy `edit` breaks.
fn load_broken(fixture_name: &str, edit: impl FnOnce(&Path)) -> Error {
    let tmp = TempDir::new("llama-broken");
    let dir = copy_fixture(fixture_name, &tmp);
    edit(&dir);
    load_llama_folder(&dir).expect_err("a broken folder must not load")
}

#[test]
fn each_broken_folder_is_a_clear_error() {
    let err = load_broken("hf-tiny-llama", |d| {
        edit_weights(d, |t| t.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight"))
    });
    assert!(
        matches!(&err, Error::FolderTensorMissing { name, expected, .. } if name == "model.layers.1.mlp.up_proj.weight" && expected == &[56, 32]),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        edit_weights(d, |t| t.retain(|t| t.0 != "lm_head.weight"))
    });
    assert!(
        matches!(&err, Error::FolderTensorMissing { name, .. } if name == "lm_head.weight"),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        edit_config(d, |c| {
            c.insert("num_key_value_heads".into(), 4.into());
        })
    });
    assert!(
        matches!(&err, Error::FolderTensorShape { name, expected, found, .. } if (name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight")) && expected == &[32, 32] && found == &[16, 32]),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        edit_weights(d, |t| {
            t.push((
                "model.layers.0.self_attn.q_proj.bias".into(),
                Dtype::F32,
                vec![32],
                vec![0; 128],
            ))
        })
    });
    assert!(
        matches!(&err, Error::FolderTensorUnexpected { name, .. } if name == "model.layers.0.self_attn.q_proj.bias"),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        edit_weights(d, |t| {
            let norm = t.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
            (norm.1, norm.3) = (Dtype::I32, vec![0; 128]);
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "model.safetensors") && reason.contains("model.norm.weight") && reason.contains("I32")),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        fs::write(d.join("model.safetensors"), b"\x10\0\0\0\0\0\0\0{\"a\":").unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, .. } if ends_with(path, "model.safetensors")),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama-sharded", |d| {
        fs::remove_file(d.join("model-00002-of-00006.safetensors")).unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointIo { path, .. } if ends_with(path, "model-00002-of-00006.safetensors")),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| {
        fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("model.safetensors")),
        "{err}"
    );
    let err = load_broken("hf-tiny-llama", |d| fs::remove_file(d.join("config.json")).unwrap());
    assert!(
        matches!(&err, Error::CheckpointIo { path, .. } if ends_with(path, "config.json")),
        "{err}"
    );
    for (key, value, words) in [
        ("model_type", serde_json::json!("gpt2"), "model_type"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("attention_bias", serde_json::json!(true), "bias"),
        ("num_attention_heads", serde_json::json!(5), "num_attention_heads"),
        ("num_key_value_heads", serde_json::json!(3), "n_kv_head"),
        ("hidden_size", serde_json::json!(-1), "hidden_size"),
        ("head_dim", serde_json::json!(16), "head_dim"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5}),
            "llama3",
        ),
        ("rms_norm_eps", serde_json::json!(0), "rms_norm_eps"),
    ] {
        let err = load_broken("hf-tiny-llama", |d| {
            edit_config(d, |c| {
                c.insert(key.into(), value.clone());
            })
        });
        assert!(
            matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains(words)),
            "{key}: {err}"
        );
    }
    // A tied config whose stored head is not the token table.
    let err = load_broken("hf-tiny-llama", |d| {
        edit_config(d, |c| {
            c.insert("tie_word_embeddings".into(), true.into());
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("lm_head.weight")),
        "{err}"
    );
    assert!(read_llama_config(fixture("hf-tiny-llama")).is_ok());
}

/// As for the GPT's folders: a 65,536-layer Llama of 2,880 channels is
/// within config.json's limits, and its empty model allocated 1.5 GB of
/// RMSNorm weights before the 80 KB of weights were read.
#[test]
fn sizes_the_weights_cannot_hold_are_refused_before_allocating() {
    let (err, total, _) = crate::gguf::counted(|| {
        load_broken("hf-tiny-llama", |d| {
            edit_config(d, |c| {
                c.remove("head_dim");
                c.insert("num_hidden_layers".into(), 65536.into());
                c.insert("hidden_size".into(), 2880.into());
                c.insert("num_attention_heads".into(), 1440.into());
                c.insert("num_key_value_heads".into(), 1.into());
                c.insert("intermediate_size".into(), 1.into());
            })
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("bytes at 2 a value") && reason.contains("79792 bytes")),
        "{err}"
    );
    assert!(total < 16 << 20, "{total} bytes allocated");
}

#[test]
fn saving_refuses_to_replace_a_folder_with_other_files() {
    let tmp = TempDir::new("llama-replace");
    let dir = tmp.path("model");
    let model = random_llama(tiny(true), 3);
    save_llama_folder(&dir, &model, None).unwrap();
    fs::write(dir.join("notes.txt"), "mine").unwrap();
    let err = save_llama_folder(&dir, &random_llama(tiny(true), 4), None).expect_err("notes.txt is not a model file");
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("notes.txt")),
        "{err}"
    );
    assert_same_parameters(&load_llama_folder(&dir).unwrap().model, &model);
    assert_eq!(
        tmp.entries(),
        vec!["model".to_string()],
        "no temporary folder is left behind"
    );
}
