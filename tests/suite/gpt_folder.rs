//! GPT model folders: wgrad's round trip, folders written by transformers
//! (tests/fixtures, made by scripts/make_hf_fixture.py) run to their
//! logits, the exact names and layouts transformers writes, optimizer state
//! that resumes training bit for bit, and a clear error for each broken
//! folder.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, rng};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::gpt_folder::{load_gpt_folder, read_gpt_config, save_gpt_folder, OptimizerState, TokenizerSpec};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module};
use wgrad::optim::AdamW;
use wgrad::Error;
use wgrad::{Targets, Trainer};

/// The fixture's sizes.
const TINY: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 16,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};

pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// A fresh folder per test, removed afterwards.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "wgrad-folder-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub(crate) fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A copy of a fixture folder inside `tmp`, to break.
pub(crate) fn copy_fixture(name: &str, tmp: &TempDir) -> PathBuf {
    let to = tmp.path(name);
    fs::create_dir_all(&to).unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

/// A GPT whose every parameter (norms and biases too) is random, so a
/// swapped name or a missing transpose shows.
fn random_gpt(config: GptConfig, seed: u64) -> Gpt {
    let mut r = rng(seed);
    Gpt::from_parameters(config, |_, shape| {
        Ok(random_vec(&mut r, shape.iter().product(), -0.5, 0.5))
    })
    .unwrap()
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The same model (its description states every size) with the same
/// parameters, names and shapes, bit for bit.
pub(crate) fn assert_same_parameters(a: &dyn Module, b: &dyn Module) {
    assert_eq!(a.describe(), b.describe());
    let (pa, pb) = (a.parameter_values(), b.parameter_values());
    assert_eq!(pa.len(), pb.len());
    for ((na, sa, va), (nb, sb, vb)) in pa.iter().zip(&pb) {
        assert_eq!((na, sa), (nb, sb));
        assert!(bits(va) == bits(vb), "{na} differs");
    }
}

/// Every tensor of a safetensors file: (name, dtype, shape, bytes), and its metadata.
pub(crate) type RawTensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

pub(crate) fn read_raw(path: &Path) -> (RawTensors, HashMap<String, String>) {
    let bytes = fs::read(path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: RawTensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    (tensors, header.metadata().clone().unwrap_or_default())
}

pub(crate) fn write_raw(path: &Path, tensors: &RawTensors, metadata: HashMap<String, String>) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, Some(metadata)).unwrap()).unwrap();
}

/// Rewrites a folder's model.safetensors through `edit`.
pub(crate) fn edit_weights(dir: &Path, edit: impl FnOnce(&mut RawTensors)) {
    let path = dir.join("model.safetensors");
    let (mut tensors, metadata) = read_raw(&path);
    edit(&mut tensors);
    write_raw(&path, &tensors, metadata);
}

/// Rewrites a folder's config.json through `edit`.
pub(crate) fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut value: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(value.as_object_mut().unwrap());
    fs::write(&path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The fixture's ids [2, 16] and its logits (`logits` or `logits_f16`).
fn fixture_logits(which: &str) -> (Vec<u32>, Vec<f32>) {
    let ckpt = checkpoint::load(fixture("hf-tiny-gpt2-logits.safetensors")).unwrap();
    let ids = ckpt.get("ids").unwrap().data.iter().map(|&v| v as u32).collect();
    (ids, ckpt.get(which).unwrap().data.clone())
}

/// Random AdamW-like moments for every parameter, in the executor's order.
fn random_optimizer_state(model: &Gpt, seed: u64) -> OptimizerState {
    let mut r = rng(seed);
    let mut state = Vec::new();
    for name in ["exp_avg", "exp_avg_sq"] {
        for (param, shape) in model.named_parameters() {
            state.push((
                param,
                name.to_string(),
                random_vec(&mut r, shape.iter().product(), 0.0, 1e-3),
            ));
        }
    }
    let metadata = BTreeMap::from([("data_position".to_string(), "4096".to_string())]);
    OptimizerState {
        optimizer: "AdamW lr=0.001".into(),
        step: 123,
        state,
        metadata,
    }
}

#[test]
fn a_saved_folder_loads_back_bit_identically_with_its_tokenizer_and_optimizer_state() {
    let tmp = TempDir::new("roundtrip");
    let dir = tmp.path("model");
    let model = random_gpt(TINY, 1);
    let vocabulary: String = (0..TINY.vocab_size as u8).map(|i| (b' ' + i) as char).collect();
    let tokenizer = TokenizerSpec::Char { vocabulary };
    let state = random_optimizer_state(&model, 2);
    save_gpt_folder(&dir, &model, &tokenizer, Some(&state)).unwrap();

    let mut files: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "model.safetensors",
            "optimizer.safetensors",
            "wgrad_tokenizer.json"
        ]
    );
    assert_eq!(
        tmp.entries(),
        ["model"],
        "no temporary folder is left beside the target"
    );

    let loaded = load_gpt_folder(&dir).unwrap();
    assert_same_parameters(&loaded.model, &model);
    assert_eq!(loaded.model.ln_f.eps, 1e-5);
    assert_eq!(loaded.tokenizer.as_ref(), Some(&tokenizer));
    assert_eq!(
        loaded.tokenizer.unwrap().char_tokenizer().unwrap().vocab_size(),
        TINY.vocab_size
    );
    let got = loaded.optimizer.expect("the optimizer state");
    assert_eq!(
        (got.optimizer.as_str(), got.step, &got.metadata),
        (state.optimizer.as_str(), state.step, &state.metadata)
    );
    assert_eq!(got.state.len(), state.state.len());
    for ((pa, na, va), (pb, nb, vb)) in got.state.iter().zip(&state.state) {
        assert_eq!((pa, na), (pb, nb));
        assert!(bits(va) == bits(vb), "{pa}.{na} differs");
    }
    assert_eq!(read_gpt_config(&dir).unwrap(), TINY);

    // GPT-2's fields, as transformers.GPT2Config reads them.
    let config: serde_json::Value = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(config["layer_norm_epsilon"].as_f64(), Some(1e-5));
    assert_eq!(config["eos_token_id"], 36);
    assert_eq!(config["tie_word_embeddings"], true);

    // Saving again replaces the folder whole, still with nothing left beside it.
    let other = random_gpt(TINY, 3);
    save_gpt_folder(
        &dir,
        &other,
        &TokenizerSpec::Char {
            vocabulary: "ab".into(),
        },
        None,
    )
    .unwrap();
    let reloaded = load_gpt_folder(&dir).unwrap();
    assert_same_parameters(&reloaded.model, &other);
    assert!(
        reloaded.optimizer.is_none(),
        "the previous optimizer.safetensors went with the previous folder"
    );
    assert_eq!(tmp.entries(), ["model"]);

    // An optimizer without state keeps its step.
    let sgd = OptimizerState {
        optimizer: "SGD lr=0.1".into(),
        step: 7,
        ..OptimizerState::default()
    };
    save_gpt_folder(
        &dir,
        &other,
        &TokenizerSpec::Char {
            vocabulary: "ab".into(),
        },
        Some(&sgd),
    )
    .unwrap();
    assert_eq!(load_gpt_folder(&dir).unwrap().optimizer, Some(sgd));
}

#[test]
fn a_layer_norm_epsilon_other_than_gpt2s_survives_the_round_trip() {
    let tmp = TempDir::new("eps");
    let mut model = random_gpt(
        GptConfig {
            vocab_size: 5,
            block_size: 3,
            n_layer: 1,
            n_head: 1,
            n_embd: 2,
        },
        4,
    );
    for block in &mut model.h {
        block.ln_1.eps = 1e-6;
        block.ln_2.eps = 1e-6;
    }
    model.ln_f.eps = 1e-6;
    save_gpt_folder(
        tmp.path("m"),
        &model,
        &TokenizerSpec::Char {
            vocabulary: "abcde".into(),
        },
        None,
    )
    .unwrap();
    let loaded = load_gpt_folder(tmp.path("m")).unwrap();
    assert_eq!(loaded.model, model);
}

#[test]
fn folders_written_by_transformers_give_transformers_logits() {
    // F32 as saved, and the same weights sharded over three files.
    let single = load_gpt_folder(fixture("hf-tiny-gpt2")).unwrap();
    let sharded = load_gpt_folder(fixture("hf-tiny-gpt2-sharded")).unwrap();
    assert_same_parameters(&sharded.model, &single.model);
    assert_eq!(single.model.config, TINY);
    assert_eq!(
        single.tokenizer, None,
        "a folder without wgrad_tokenizer.json and a vocabulary that is not GPT-2's has no known tokenizer"
    );
    assert!(single.optimizer.is_none());
    let half = load_gpt_folder(fixture("hf-tiny-gpt2-f16")).unwrap();

    let (ids, logits) = fixture_logits("logits");
    let (_, logits_f16) = fixture_logits("logits_f16");
    for_each_adapter("hf fixture logits", |k| {
        // f32 against PyTorch's f32 CPU logits (|logits| < 1.5): the sums
        // run in another order. lavapipe and llvmpipe agree to 6e-7; the
        // bound leaves room for GPUs' own reduction orders and tanh/exp.
        let mut p = Predictor::new(k.clone(), &single.model, 2)?;
        assert_close("logits", &p.outputs_ids(&ids)?, &logits, 1e-4, 1e-4);
        // The F16 weights, widened exactly, against PyTorch running the same
        // widened weights in f32.
        let mut p = Predictor::new(k.clone(), &half.model, 2)?;
        assert_close(
            "logits of the f16 folder",
            &p.outputs_ids(&ids)?,
            &logits_f16,
            1e-4,
            1e-4,
        );
        Ok(())
    });
}

#[test]
fn bf16_and_f64_weights_convert_to_f32() {
    let tmp = TempDir::new("dtypes");
    let reference = load_gpt_folder(fixture("hf-tiny-gpt2")).unwrap().model;
    for (name, dtype) in [("bf16", Dtype::BF16), ("f64", Dtype::F64)] {
        let dir = copy_fixture("hf-tiny-gpt2", &tmp);
        let renamed = tmp.path(name);
        fs::rename(&dir, &renamed).unwrap();
        edit_weights(&renamed, |tensors| {
            for (_, d, _, bytes) in tensors.iter_mut() {
                let values = f32_values(bytes);
                *bytes = match dtype {
                    Dtype::BF16 => values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => values.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect(),
                };
                *d = dtype;
            }
        });
        let loaded = load_gpt_folder(&renamed).unwrap().model;
        for ((n, _, got), (_, _, want)) in loaded.parameter_values().iter().zip(reference.parameter_values()) {
            // F64 holds every f32 exactly; BF16 keeps the top 16 bits, rounded.
            let want: Vec<f32> = match dtype {
                Dtype::BF16 => want.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
                _ => want.to_vec(),
            };
            assert!(bits(got) == bits(&want), "{name}: {n}");
        }
    }
}

#[test]
fn what_wgrad_writes_has_the_names_shapes_dtypes_and_layouts_transformers_writes() {
    let tmp = TempDir::new("layout");
    let (hf, hf_meta) = read_raw(&fixture("hf-tiny-gpt2").join("model.safetensors"));

    // A fresh model: the same names, shapes and dtypes, and the same metadata.
    let dir = tmp.path("fresh");
    save_gpt_folder(
        &dir,
        &random_gpt(TINY, 5),
        &TokenizerSpec::Char {
            vocabulary: "xyz".into(),
        },
        None,
    )
    .unwrap();
    let (ours, our_meta) = read_raw(&dir.join("model.safetensors"));
    let header = |t: &RawTensors| {
        t.iter()
            .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(header(&ours), header(&hf));
    assert_eq!(our_meta, hf_meta);

    // The transformers model loaded and saved again: every tensor's bytes as
    // transformers wrote them, so each layout (Conv1D [in, out]) is right.
    let hf_model = load_gpt_folder(fixture("hf-tiny-gpt2")).unwrap().model;
    let dir = tmp.path("resaved");
    save_gpt_folder(
        &dir,
        &hf_model,
        &TokenizerSpec::Char {
            vocabulary: "xyz".into(),
        },
        None,
    )
    .unwrap();
    let (resaved, _) = read_raw(&dir.join("model.safetensors"));
    assert!(resaved == hf, "the bytes differ from what transformers wrote");

    // config.json states what transformers' does for every field GPT2Config
    // turns into the model's shape and arithmetic.
    let read = |p: PathBuf| -> serde_json::Value { serde_json::from_slice(&fs::read(p).unwrap()).unwrap() };
    let (ours, theirs) = (
        read(dir.join("config.json")),
        read(fixture("hf-tiny-gpt2").join("config.json")),
    );
    for key in [
        "model_type",
        "architectures",
        "vocab_size",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(ours[key], theirs[key], "config.json `{key}`");
    }
}

#[test]
fn what_transformers_may_add_is_accepted_a_different_head_is_not() {
    let tmp = TempDir::new("variants");
    let reference = load_gpt_folder(fixture("hf-tiny-gpt2")).unwrap().model;

    // Older checkpoints: no `transformer.` prefix, the mask buffers, and the
    // tied head written out.
    let dir = copy_fixture("hf-tiny-gpt2", &tmp);
    edit_weights(&dir, |tensors| {
        let wte = tensors
            .iter()
            .find(|t| t.0 == "transformer.wte.weight")
            .unwrap()
            .clone();
        for t in tensors.iter_mut() {
            t.0 = t.0.trim_start_matches("transformer.").to_string();
        }
        tensors.push(("lm_head.weight".into(), wte.1, wte.2, wte.3));
        for layer in 0..TINY.n_layer {
            let mask: Vec<f32> = (0..16 * 16).map(|i| if i % 16 <= i / 16 { 1.0 } else { 0.0 }).collect();
            tensors.push((
                format!("h.{layer}.attn.bias"),
                Dtype::F32,
                vec![1, 1, 16, 16],
                f32_bytes(mask),
            ));
            tensors.push((
                format!("h.{layer}.attn.masked_bias"),
                Dtype::F32,
                vec![],
                f32_bytes([-1e4]),
            ));
        }
    });
    assert_same_parameters(&load_gpt_folder(&dir).unwrap().model, &reference);

    // A head that is not the token embedding cannot run tied.
    edit_weights(&dir, |tensors| {
        let head = tensors.iter_mut().find(|t| t.0 == "lm_head.weight").unwrap();
        head.3[0] ^= 1;
    });
    let err = load_gpt_folder(&dir).unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("lm_head.weight")),
        "{err}"
    );

    // GPT-2's vocabulary with no wgrad_tokenizer.json is GPT-2's BPE.
    let dir = tmp.path("gpt2-vocab");
    save_gpt_folder(
        &dir,
        &random_gpt(
            GptConfig {
                vocab_size: 50257,
                block_size: 2,
                n_layer: 1,
                n_head: 1,
                n_embd: 1,
            },
            6,
        ),
        &TokenizerSpec::gpt2(),
        None,
    )
    .unwrap();
    fs::remove_file(dir.join("wgrad_tokenizer.json")).unwrap();
    assert_eq!(load_gpt_folder(&dir).unwrap().tokenizer, Some(TokenizerSpec::gpt2()));
}

/// The error `load_gpt_folder` gives for the fixture copy `edit` breaks.
fn load_broken(fixture_name: &str, edit: impl FnOnce(&Path)) -> Error {
    let tmp = TempDir::new("broken");
    let dir = copy_fixture(fixture_name, &tmp);
    edit(&dir);
    load_gpt_folder(&dir).expect_err("a broken folder must not load")
}

pub(crate) fn ends_with(path: &Path, name: &str) -> bool {
    path.file_name().is_some_and(|n| n == name)
}

#[test]
fn each_broken_folder_is_a_clear_error() {
    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_weights(d, |t| t.retain(|t| t.0 != "transformer.h.1.ln_2.bias"))
    });
    assert!(
        matches!(&err, Error::FolderTensorMissing { path, name, expected } if ends_with(path, "model.safetensors") && name == "transformer.h.1.ln_2.bias" && *expected == [24]),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_weights(d, |t| {
            t.push((
                "transformer.h.2.ln_1.weight".into(),
                Dtype::F32,
                vec![24],
                f32_bytes([0.0; 24]),
            ))
        })
    });
    assert!(
        matches!(&err, Error::FolderTensorUnexpected { name, shape, .. } if name == "transformer.h.2.ln_1.weight" && *shape == [24]),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_config(d, |c| {
            c.insert("vocab_size".into(), 38.into());
        })
    });
    assert!(
        matches!(&err, Error::FolderTensorShape { name, expected, found, .. } if name == "transformer.wte.weight" && *expected == [38, 24] && *found == [37, 24]),
        "{err}"
    );

    // A Conv1D weight stored [out, in] (as torch.nn.Linear would) is caught by its shape.
    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_weights(d, |t| {
            let w = t
                .iter_mut()
                .find(|t| t.0 == "transformer.h.0.attn.c_attn.weight")
                .unwrap();
            w.2 = vec![72, 24];
        })
    });
    assert!(
        matches!(&err, Error::FolderTensorShape { name, expected, found, .. } if name == "transformer.h.0.attn.c_attn.weight" && *expected == [24, 72] && *found == [72, 24]),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_config(d, |c| {
            c.remove("n_layer");
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("n_layer")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_config(d, |c| {
            c.insert("n_head".into(), "three".into());
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("n_head")),
        "{err}"
    );

    // Absurd sizes are refused before anything is allocated for them.
    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_config(d, |c| {
            c.insert("n_layer".into(), 1_000_000_000.into());
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("layers")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        fs::write(d.join("config.json"), b"{\"n_embd\": 24,").unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("JSON")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| fs::remove_file(d.join("config.json")).unwrap());
    assert!(
        matches!(&err, Error::CheckpointIo { path, .. } if ends_with(path, "config.json")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_config(d, |c| {
            c.insert("activation_function".into(), "gelu".into());
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("activation_function")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        edit_weights(d, |t| {
            let w = t.iter_mut().find(|t| t.0 == "transformer.ln_f.bias").unwrap();
            w.1 = Dtype::I64;
            w.3 = (0..24i64).flat_map(i64::to_le_bytes).collect();
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "model.safetensors") && reason.contains("transformer.ln_f.bias") && reason.contains("I64")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        let path = d.join("model.safetensors");
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "model.safetensors") && reason.contains("truncated")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        fs::write(d.join("model.safetensors"), b"not a safetensors file at all").unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, .. } if ends_with(path, "model.safetensors")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2-sharded", |d| {
        fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointIo { path, .. } if ends_with(path, "model-00002-of-00003.safetensors")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2-sharded", |d| {
        let path = d.join("model.safetensors.index.json");
        let text = fs::read_to_string(&path)
            .unwrap()
            .replace("model-00003-of-00003.safetensors", "../elsewhere.safetensors");
        fs::write(&path, text).unwrap();
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "model.safetensors.index.json") && reason.contains("elsewhere")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("model.safetensors")),
        "{err}"
    );

    let err = load_broken("hf-tiny-gpt2", |d| {
        fs::write(d.join("wgrad_tokenizer.json"), br#"{"kind":"sentencepiece"}"#).unwrap()
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, .. } if ends_with(path, "wgrad_tokenizer.json")),
        "{err}"
    );
}

/// Sizes config.json may give (at most 2^16 layers and 2^40 parameters)
/// that the folder's weights are far too small for are refused before the
/// model is built: an empty GPT of 65,536 layers of 1,180 channels
/// allocated 1.2 GB of LayerNorm weights for a 200-byte config.json (found
/// reading the loader, reproduced with fuzz/'s hf_folder target).
#[test]
fn sizes_the_weights_cannot_hold_are_refused_before_allocating() {
    let (err, total, _) = crate::gguf::counted(|| {
        load_broken("hf-tiny-gpt2", |d| {
            edit_config(d, |c| {
                c.insert("n_layer".into(), 65536.into());
                c.insert("n_embd".into(), 1180.into());
                c.insert("n_head".into(), 1.into());
            })
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { path, reason } if ends_with(path, "config.json") && reason.contains("1096033303940 parameters") && reason.contains("65640 bytes")),
        "{err}"
    );
    // The fixture's copy and the messages: far below the model's 1.2 GB.
    assert!(total < 16 << 20, "{total} bytes allocated");
    // Sharded weights count every shard.
    let err = load_broken("hf-tiny-gpt2-sharded", |d| {
        edit_config(d, |c| {
            c.insert("n_layer".into(), 600.into());
        })
    });
    assert!(
        matches!(&err, Error::CheckpointFormat { reason, .. } if reason.contains("65704 bytes")),
        "{err}"
    );
}

#[test]
fn a_refused_save_leaves_the_previous_folder_as_it_was() {
    let tmp = TempDir::new("refused");
    let dir = tmp.path("model");
    let model = random_gpt(TINY, 7);
    let chars = TokenizerSpec::Char {
        vocabulary: "abc".into(),
    };
    save_gpt_folder(&dir, &model, &chars, None).unwrap();
    let before: Vec<(PathBuf, Vec<u8>)> = {
        let mut files: Vec<PathBuf> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        files.into_iter().map(|p| (p.clone(), fs::read(&p).unwrap())).collect()
    };
    let unchanged = || {
        for (path, bytes) in &before {
            assert!(fs::read(path).unwrap() == *bytes, "{} changed", path.display());
        }
        assert_eq!(tmp.entries(), ["model"], "nothing is left beside the folder");
    };

    let other = random_gpt(TINY, 8);
    // A tokenizer with more ids than the model's embedding has rows.
    let err = save_gpt_folder(&dir, &other, &TokenizerSpec::gpt2(), None).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("50257")),
        "{err}"
    );
    unchanged();

    // Optimizer state that misses a parameter would not resume exactly.
    let mut partial = random_optimizer_state(&other, 9);
    partial
        .state
        .retain(|(p, n, _)| !(p == "h.1.mlp.c_fc.bias" && n == "exp_avg_sq"));
    let err = save_gpt_folder(&dir, &other, &chars, Some(&partial)).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("h.1.mlp.c_fc.bias")),
        "{err}"
    );
    unchanged();

    // Sizes the config does not describe.
    let mut inconsistent = other.clone();
    if let Some(bias) = inconsistent.h[0].mlp.c_fc.bias.as_mut() {
        bias.pop();
    }
    assert!(save_gpt_folder(&dir, &inconsistent, &chars, None).is_err());
    unchanged();

    // A folder holding anything else is not a model folder to replace.
    fs::write(dir.join("notes.txt"), b"mine").unwrap();
    let err = save_gpt_folder(&dir, &other, &chars, None).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("notes.txt")),
        "{err}"
    );
    fs::remove_file(dir.join("notes.txt")).unwrap();
    unchanged();
    assert_same_parameters(&load_gpt_folder(&dir).unwrap().model, &model);

    // Nor is a file.
    fs::write(tmp.path("file"), b"x").unwrap();
    assert!(save_gpt_folder(tmp.path("file"), &other, &chars, None).is_err());
    assert_eq!(fs::read(tmp.path("file")).unwrap(), b"x");
}

#[test]
fn training_resumed_from_a_folder_continues_bit_identically() {
    const CONFIG: GptConfig = GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
    };
    const BATCH: usize = 3;
    let batch = |step: u64| -> (Vec<u32>, Vec<u32>) {
        let ids: Vec<u32> = (0..BATCH * CONFIG.block_size)
            .map(|i| ((i as u64 * 7 + step * 3) % CONFIG.vocab_size as u64) as u32)
            .collect();
        let targets = ids.iter().map(|&t| (t + 1) % CONFIG.vocab_size as u32).collect();
        (ids, targets)
    };
    let step = |t: &mut Trainer, s: u64| -> wgrad::Result<()> {
        let (x, y) = batch(s);
        t.zero_grad();
        t.forward_ids(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        t.step()
    };
    let optimizer = AdamW::new(1e-2);
    for_each_adapter("resume from a folder", |k| {
        let tmp = TempDir::new("resume");
        nn::manual_seed(11);
        let start = Gpt::new(CONFIG)?;
        let mut trainer = Trainer::new(k.clone(), &start, CrossEntropyLoss, optimizer, BATCH)?;
        for s in 0..3 {
            step(&mut trainer, s)?;
        }
        // The trained model and its optimizer state, as a folder.
        let params = trainer.executor().parameters()?;
        let trained = Gpt::from_parameters(CONFIG, |name, _| {
            Ok(params
                .iter()
                .find(|p| p.0 == name)
                .map(|p| p.2.clone())
                .unwrap_or_default())
        })?;
        let state = OptimizerState::from_checkpoint(&trainer.checkpoint()?)?;
        assert_eq!(state.step, 3);
        save_gpt_folder(
            tmp.path("run"),
            &trained,
            &TokenizerSpec::Char {
                vocabulary: "abcdefghijk".into(),
            },
            Some(&state),
        )?;

        let loaded = load_gpt_folder(tmp.path("run"))?;
        let state = loaded.optimizer.expect("optimizer state");
        assert_eq!(state.optimizer, wgrad::optim::describe(&optimizer.into()));
        let mut resumed = Trainer::new(k.clone(), &loaded.model, CrossEntropyLoss, optimizer, BATCH)?;
        resumed.executor_mut().load_state(&[], &state.state, Some(state.step))?;
        for s in 3..5 {
            step(&mut trainer, s)?;
            step(&mut resumed, s)?;
        }
        for ((name, _, a), (_, _, b)) in trainer
            .executor()
            .parameters()?
            .iter()
            .zip(resumed.executor().parameters()?)
        {
            assert!(bits(a) == bits(&b), "{name} differs after resuming");
        }
        Ok(())
    });
}
