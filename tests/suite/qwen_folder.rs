//! Qwen2 and Qwen3 folders both ways, as llama_folder.rs checks the
//! Llama's: folders transformers' `save_pretrained` wrote
//! (tests/fixtures/hf-tiny-qwen2, hf-tiny-qwen3, by
//! scripts/make_qwen_fixture.py) load and give transformers' logits; a
//! saved Qwen loads back bit for bit with Hugging Face's names and
//! config fields; what wgrad's Qwen does not compute is refused.
//! scripts/check_hf_folder.py checks the other direction in transformers
//! itself (`examples/hf_folder.rs qwen2|qwen3` writes its input).

use std::fs;

use crate::common;
use crate::gpt_folder::{assert_same_parameters, copy_fixture, edit_config, fixture, read_raw, TempDir};

use common::{assert_close, for_each_adapter, random_vec, rng};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::llama_folder::{load_llama_folder, save_llama_folder};
use wgrad::io::lm_folder::{lm_family, LmFamily};
use wgrad::models::{qwen, Llama, LlamaConfig, LlamaVariant};
use wgrad::nn::{Module, RopeLayout};
use wgrad::Error;

/// The fixtures' sizes: Qwen2 tied, Qwen3 untied with heads of 12.
fn tiny(variant: LlamaVariant) -> LlamaConfig {
    let base = LlamaConfig {
        vocab_size: 37,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 32,
        intermediate_size: 56,
        rms_norm_eps: 1e-6,
        ..LlamaConfig::small(37)
    };
    match variant {
        LlamaVariant::Qwen3 => LlamaConfig {
            variant,
            head_dim: Some(12),
            ..base
        },
        _ => LlamaConfig {
            variant,
            tie_word_embeddings: true,
            ..base
        },
    }
}

#[test]
fn the_presets_have_their_published_sizes() {
    // The model cards: Qwen2.5-0.5B has 0.49B parameters (494,032,768),
    // Qwen3-0.6B 0.6B (596,049,920), both with tied heads.
    assert_eq!(qwen::qwen2_5_0_5b().num_parameters(), Some(494_032_768));
    assert_eq!(qwen::qwen3_0_6b().num_parameters(), Some(596_049_920));
    for variant in [LlamaVariant::Qwen2, LlamaVariant::Qwen3] {
        let small = qwen::preset(variant, "small", 65).unwrap();
        assert!(small.check().is_ok() && small.variant == variant);
        assert!(matches!(
            qwen::preset(variant, "qwen-9000", 65),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(
        qwen::preset(LlamaVariant::Qwen3, "qwen3-0.6b", 0).unwrap().head_dim(),
        128
    );
}

#[test]
fn folders_written_by_transformers_give_transformers_logits() {
    let logits = checkpoint::load(fixture("hf-tiny-qwen-logits.safetensors")).unwrap();
    let ids: Vec<u32> = logits.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    for (variant, name) in [(LlamaVariant::Qwen2, "qwen2"), (LlamaVariant::Qwen3, "qwen3")] {
        let dir = fixture(&format!("hf-tiny-{name}"));
        assert_eq!(lm_family(&dir).unwrap(), LmFamily::Llama, "{name}");
        let model = load_llama_folder(&dir).unwrap_or_else(|e| panic!("{name}: {e}")).model;
        assert_eq!(model.config, tiny(variant), "{name}");
        let want = logits.get(name).unwrap().data.clone();
        for_each_adapter("qwen folders from transformers", |k| {
            let got = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
            // Logits within ±3: float32 sums in another order, a few ulps
            // (the Llama folder's tolerance).
            assert_close(name, &got, &want, 2e-5, 1e-5);
            Ok(())
        });
    }
}

#[test]
fn a_saved_folder_loads_back_bit_identically_with_the_variants_config() {
    let tmp = TempDir::new("qwen");
    for variant in [LlamaVariant::Qwen2, LlamaVariant::Qwen3] {
        let mut r = rng(7);
        let model = Llama::from_parameters(tiny(variant), |_, shape| {
            Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
        })
        .unwrap();
        let dir = tmp.path(variant.names().1);
        save_llama_folder(&dir, &model, None).unwrap();
        let loaded = load_llama_folder(&dir).unwrap();
        assert_same_parameters(&model, &loaded.model);
        assert_eq!(loaded.model.config, model.config);
        let (tensors, _) = read_raw(&dir.join("model.safetensors"));
        let mut names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
        names.sort();
        assert_eq!(tensors.iter().map(|t| t.0.clone()).collect::<Vec<_>>(), names);
        let config: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["model_type"], variant.names().1);
        assert_eq!(config["architectures"][0], variant.names().0);
        assert_eq!(config["head_dim"], model.config.head_dim());
        assert_eq!(config["use_sliding_window"], false);
        let has = |suffix: &str| names.iter().any(|n| n.ends_with(suffix));
        assert_eq!(
            (has("q_proj.bias"), has("q_norm.weight")),
            (variant == LlamaVariant::Qwen2, variant == LlamaVariant::Qwen3)
        );
    }
}

#[test]
fn an_interleaved_qwen_is_saved_in_hugging_faces_layout_with_the_same_logits() {
    // q/k biases and q/k norm weights move with their rows.
    for variant in [LlamaVariant::Qwen2, LlamaVariant::Qwen3] {
        let mut r = rng(9);
        let mut model = Llama::from_parameters(tiny(variant), |_, shape| {
            Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
        })
        .unwrap();
        model.config.rope_layout = RopeLayout::Interleaved;
        for layer in &mut model.layers {
            layer.self_attn.rotary.layout = RopeLayout::Interleaved;
        }
        let tmp = TempDir::new("qwen-interleaved");
        let dir = tmp.path("model");
        save_llama_folder(&dir, &model, None).unwrap();
        let loaded = load_llama_folder(&dir).unwrap().model;
        assert_eq!(loaded.config.rope_layout, RopeLayout::HalfSplit);
        let ids: Vec<u32> = (0..32).map(|i| (i * 7 % 37) as u32).collect();
        for_each_adapter("interleaved qwen folder", |k| {
            let want = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
            let got = Predictor::new(k.clone(), &loaded, 2)?.outputs_ids(&ids)?;
            // The same products with q/k channels in another order: a few ulps.
            assert_close(
                &format!("{variant:?} logits after the layout change"),
                &got,
                &want,
                1e-5,
                1e-5,
            );
            Ok(())
        });
    }
}

#[test]
fn what_wgrads_qwen_does_not_compute_is_refused() {
    let cases = [
        ("hf-tiny-qwen3", "attention_bias", serde_json::json!(true), "bias"),
        ("hf-tiny-qwen3", "head_dim", serde_json::json!(0), "head_dim"),
        ("hf-tiny-qwen2", "model_type", serde_json::json!("qwen9"), "qwen9"),
    ];
    for (name, key, value, words) in cases {
        let tmp = TempDir::new("qwen-broken");
        let dir = copy_fixture(name, &tmp);
        edit_config(&dir, |c| {
            c.insert(key.into(), value.clone());
        });
        let err = load_llama_folder(&dir).expect_err("a broken folder must not load");
        assert!(
            matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains(words)),
            "{name} {key}: {err}"
        );
    }
    // A window over some layers but not all is refused (wgrad's Qwen
    // attends alike in every layer); one over all of them is read, and a
    // window transformers ignores (use_sliding_window false) is too.
    let window = |name: &str, used: bool, edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let tmp = TempDir::new("qwen-window");
        let dir = copy_fixture(name, &tmp);
        edit_config(&dir, |c| {
            c.insert("use_sliding_window".into(), used.into());
            c.insert("sliding_window".into(), 4.into());
            edit(c);
        });
        load_llama_folder(&dir).map(|l| l.model.config.sliding_window)
    };
    let some = |c: &mut serde_json::Map<String, serde_json::Value>| {
        c.insert(
            "layer_types".into(),
            serde_json::json!(["sliding_attention", "full_attention"]),
        );
    };
    let by_count = |c: &mut serde_json::Map<String, serde_json::Value>| {
        c.remove("layer_types");
        c.insert("max_window_layers".into(), 1.into());
    };
    let all = |c: &mut serde_json::Map<String, serde_json::Value>| {
        c.insert(
            "layer_types".into(),
            serde_json::json!(["sliding_attention", "sliding_attention"]),
        );
    };
    for (name, edit) in [
        ("hf-tiny-qwen2", &some as &dyn Fn(&mut _)),
        ("hf-tiny-qwen3", &by_count),
    ] {
        let err = window(name, true, edit).expect_err("a window over one of two layers");
        assert!(
            matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("1 of 2 layers slide")),
            "{name}: {err}"
        );
    }
    assert_eq!(window("hf-tiny-qwen3", true, &all).unwrap(), Some(4));
    assert_eq!(window("hf-tiny-qwen2", false, &some).unwrap(), None);
    // Qwen2's biases are part of the model: a folder without them is missing a tensor.
    let tmp = TempDir::new("qwen-no-bias");
    let dir = copy_fixture("hf-tiny-qwen2", &tmp);
    crate::gpt_folder::edit_weights(&dir, |t| t.retain(|t| !t.0.ends_with("v_proj.bias")));
    let err = load_llama_folder(&dir).expect_err("biases are required");
    assert!(
        matches!(&err, Error::FolderTensorMissing { name, .. } if name.ends_with("v_proj.bias")),
        "{err}"
    );
}

#[test]
fn gguf_files_give_transformers_logits() {
    // scripts/make_qwen_gguf_fixture.py converts the folders above as
    // llama.cpp's converter does (F32 tensors, q/k rows in Hugging Face's
    // order, `qwen3.attention.key_length` for the head width).
    use wgrad::io::gguf_model::{GgufArchitecture, GgufModel};
    let logits = checkpoint::load(fixture("hf-tiny-qwen-logits.safetensors")).unwrap();
    let ids: Vec<u32> = logits.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    for (variant, name, extra) in [
        (LlamaVariant::Qwen2, "qwen2", ("q_proj.bias", "attn_q.bias")),
        (LlamaVariant::Qwen3, "qwen3", ("q_norm.weight", "attn_q_norm.weight")),
    ] {
        let file = GgufModel::open(fixture(&format!("gguf-{name}.gguf"))).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(*file.architecture(), GgufArchitecture::Llama(tiny(variant)), "{name}");
        let (ours, theirs) = (
            format!("model.layers.1.self_attn.{}", extra.0),
            format!("blk.1.{}", extra.1),
        );
        assert!(
            file.parameters().iter().any(|(n, t)| *n == ours && *t == theirs),
            "{name}: {ours} is {theirs}"
        );
        let model = file.to_llama().unwrap();
        let want = logits.get(name).unwrap().data.clone();
        for_each_adapter("qwen gguf files", |k| {
            let got = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
            // The folder's tolerance: the same f32 values.
            assert_close(name, &got, &want, 2e-5, 1e-5);
            Ok(())
        });
    }
}
