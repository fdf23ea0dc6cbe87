//! GGUF files as models (src/io/gguf_model.rs): the tiny Llamas of
//! scripts/gguf_reference.py, written with llama.cpp's `gguf` package in
//! every decoded type with the converter's q/k row permutation, and its
//! tiny GPT-2, give transformers' logits and greedy tokens; SmolLM2-135M-Instruct's own file
//! gives transformers' greedy tokens and logits (scripts/smollm2_reference.py;
//! the file is fetched, never committed, and its absence is a failure);
//! and broken model files are clear errors before the model is allocated.

use std::path::PathBuf;
use std::sync::Arc;

use crate::common::{assert_close, for_each_adapter};
use crate::gguf::{allowance, counted, fields, find, put_u32, put_u64, u64_at};
use crate::gpt_folder::fixture;

use serde_json::Value as Json;
use wgrad::infer::generate::{Generator, Sampling, WeightDtype};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint;
use wgrad::io::gguf::{dequantize, llama, GgmlType, Gguf};
use wgrad::io::gguf_model::{gpt2_gguf_name, load_llama_gguf, GgufArchitecture, GgufModel};
use wgrad::io::lm_folder::{is_gguf_path, load_model, read_model_config, LmFamily};
use wgrad::models::{Gpt, GptConfig, Llama, LlamaConfig};
use wgrad::nn::{Module, RopeLayout};
use wgrad::Error;

const UNTIED: &str = "gguf-llama.gguf";
const TIED: &str = "gguf-llama-tied.gguf";
const GPT2: &str = "gguf-gpt2.gguf";

/// The fixture's sizes, as scripts/gguf_reference.py writes them.
fn fixture_config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 271,
        block_size: 32,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 64,
        intermediate_size: 96,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        rope_layout: RopeLayout::Interleaved,
        head_dim: None,
        sliding_window: None,
        variant: wgrad::models::LlamaVariant::Llama,
    }
}

/// A reference tensor of gguf-llama-logits.safetensors.
fn reference(name: &str) -> Vec<f32> {
    checkpoint::load(fixture("gguf-llama-logits.safetensors"))
        .unwrap()
        .get(name)
        .unwrap()
        .data
        .clone()
}

fn ids(name: &str) -> Vec<u32> {
    reference(name).iter().map(|&v| v as u32).collect()
}

/// (file, logits key, greedy key, tied) of both fixtures.
const CASES: [(&str, &str, &str, bool); 2] = [
    (UNTIED, "logits", "greedy", false),
    (TIED, "logits_tied", "greedy_tied", true),
];

/// transformers computes in float32 too; the sums run in another order
/// through 2 layers. Measured worst on llvmpipe (Vulkan and GL): 2.9e-5
/// (untied, logits within ±8.5), 9.0e-5 (tied, logits within ±34).
const LOGITS_ATOL: f32 = 1e-4;
const LOGITS_RTOL: f32 = 2e-5;

#[test]
fn gguf_llamas_give_transformers_logits() {
    let want_ids = ids("ids");
    let models: Vec<(&str, Llama, Vec<f32>)> = CASES
        .iter()
        .map(|&(file, logits, _, tied)| {
            let loaded = GgufModel::open(fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(
                *loaded.architecture(),
                GgufArchitecture::Llama(fixture_config(tied)),
                "{file}"
            );
            (file, loaded.to_llama().unwrap(), reference(logits))
        })
        .collect();
    for_each_adapter("GGUF Llamas against transformers", |k| {
        for (file, model, want) in &models {
            let got = Predictor::new(k.clone(), model, 1)?.outputs_ids(&want_ids)?;
            assert_close(file, &got, want, LOGITS_ATOL, LOGITS_RTOL);
        }
        Ok(())
    });
}

/// The converter's row order is what the interleaved rotation needs: the
/// same rows rotated as Hugging Face's half-split pairs give other logits,
/// and the rows the reader moves back to Hugging Face's order, rotated
/// half-split, give the same ones.
#[test]
fn the_rotary_layout_is_the_files() {
    let want_ids = ids("ids");
    let want = reference("logits");
    let file = GgufModel::open(fixture(UNTIED)).unwrap();
    let half_split = LlamaConfig {
        rope_layout: RopeLayout::HalfSplit,
        ..fixture_config(false)
    };
    let misread = Llama::from_parameters(half_split, |name, _| file.parameter_f32(name)).unwrap();
    let hp = llama::Hparams::from_gguf(file.gguf()).unwrap();
    let hf_order = Llama::from_parameters(half_split, |name, shape| {
        let gguf_name = llama::gguf_name(name).unwrap();
        let (hf_name, hf_shape, values) = llama::read_hf_f32(file.gguf(), &gguf_name, &hp)?;
        assert_eq!((hf_name.as_str(), hf_shape.as_slice()), (name, shape));
        Ok(values)
    })
    .unwrap();
    for_each_adapter("GGUF rotary layout", |k| {
        let got = Predictor::new(k.clone(), &hf_order, 1)?.outputs_ids(&want_ids)?;
        assert_close(
            "rows in Hugging Face's order, half-split",
            &got,
            &want,
            LOGITS_ATOL,
            LOGITS_RTOL,
        );
        let got = Predictor::new(k.clone(), &misread, 1)?.outputs_ids(&want_ids)?;
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max);
        // Past the first position (where no rotation turns anything) the
        // wrong pairing moves logits by whole units.
        assert!(
            worst > 0.1,
            "the file's rows rotated half-split still give transformers' logits (worst {worst})"
        );
        Ok(())
    });
}

#[test]
fn gguf_llamas_give_transformers_greedy_tokens() {
    let prompt = ids("prompt");
    for (file, _, greedy, _) in CASES {
        let model = load_llama_gguf(fixture(file)).unwrap();
        let want = ids(greedy);
        for_each_adapter("GGUF Llamas' greedy tokens", |k| {
            let mut generator = Generator::new(k.clone(), &model, 1)?;
            let got = generator.generate(&prompt, want.len(), &Sampling::greedy(), |_| Ok(()))?;
            assert_eq!(
                got, want,
                "{file}: greedy tokens (transformers' margins were all above 1e-3)"
            );
            Ok(())
        });
    }
}

/// GPT-2's file: Conv1D weights stored [out, in], biases, the tied head
/// stored again. Measured worst on llvmpipe (Vulkan, GL): 1.1e-5 (logits
/// within ±22).
#[test]
fn a_gguf_gpt2_gives_transformers_logits_and_greedy_tokens() {
    let file = GgufModel::open(fixture(GPT2)).unwrap();
    let config = GptConfig {
        vocab_size: 271,
        block_size: 32,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
    };
    assert_eq!(
        *file.architecture(),
        GgufArchitecture::Gpt2 {
            config,
            layer_norm_eps: 1e-5
        }
    );
    assert!(matches!(file.to_llama(), Err(Error::Gguf { reason, .. }) if reason.contains("not a Llama")));
    let model: Gpt = file.to_gpt().unwrap();
    let (want_ids, want, prompt, want_greedy) =
        (ids("ids"), reference("logits_gpt2"), ids("prompt"), ids("greedy_gpt2"));
    for_each_adapter("GGUF GPT-2 against transformers", |k| {
        let got = Predictor::new(k.clone(), &model, 1)?.outputs_ids(&want_ids)?;
        assert_close("gguf-gpt2", &got, &want, LOGITS_ATOL, LOGITS_RTOL);
        let greedy =
            Generator::new(k.clone(), &model, 1)?
                .generate(&prompt, want_greedy.len(), &Sampling::greedy(), |_| Ok(()))?;
        assert_eq!(greedy, want_greedy, "gguf-gpt2: greedy tokens");
        Ok(())
    });
    assert_eq!(
        gpt2_gguf_name("h.1.mlp.c_fc.bias").as_deref(),
        Some("blk.1.ffn_up.bias")
    );
    assert_eq!(gpt2_gguf_name("h.1.mlp.gate.bias"), None);
}

#[test]
fn a_gpt2_head_other_than_the_token_table_is_refused() {
    let mut bytes = fixture_bytes(GPT2);
    let g = Gguf::from_bytes("x", bytes.clone()).unwrap();
    let head = g.tensor("output.weight").unwrap();
    // One quant of the stored head's first block changed.
    bytes[(g.data_offset() + head.offset) as usize + 5] ^= 0x11;
    let file = open_bounded(&bytes, "head").unwrap();
    match file.to_gpt() {
        Err(Error::GgufTensor { tensor, reason, .. }) => {
            assert_eq!(tensor, "output.weight");
            assert!(reason.contains("ties its head"), "{reason}");
        }
        r => panic!("{r:?}"),
    }
}

#[test]
fn load_model_takes_a_gguf_file_or_a_folder() {
    let path = fixture(TIED);
    assert!(is_gguf_path(&path) && !is_gguf_path(fixture("hf-tiny-llama")));
    assert!(is_gguf_path("/no/such/model.GGUF") && !is_gguf_path("/no/such/folder"));
    let loaded = load_model(&path).unwrap();
    assert_eq!(loaded.family, LmFamily::Llama);
    assert!(loaded.tokenizer.is_none());
    let gguf = loaded.gguf.as_ref().expect("a GGUF model keeps its file");
    assert_eq!(gguf.gguf().get_strings("tokenizer.ggml.tokens").unwrap().len(), 271);
    let sizes = loaded.model.lm_sizes();
    assert_eq!((sizes.vocab_size, sizes.context), (271, 32));
    assert_eq!(read_model_config(&path).unwrap().lm_sizes(), sizes);

    let gpt2 = load_model(fixture(GPT2)).unwrap();
    assert_eq!((gpt2.family, gpt2.model.lm_sizes().vocab_size), (LmFamily::Gpt2, 271));

    let folder = load_model(fixture("hf-tiny-llama")).unwrap();
    assert!(folder.gguf.is_none());
    assert_eq!(folder.family, LmFamily::Llama);
    assert_eq!(
        read_model_config(fixture("hf-tiny-llama")).unwrap().lm_sizes(),
        folder.model.lm_sizes()
    );
    match load_model("/no/such/model.gguf") {
        Err(e @ Error::DataIo { .. }) => assert!(e.to_string().contains("/no/such/model.gguf"), "{e}"),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a missing file loaded"),
    }
}

#[test]
fn raw_parameters_are_the_files_blocks() {
    let file = GgufModel::open(fixture(UNTIED)).unwrap();
    let names = Llama::empty(fixture_config(false)).unwrap().named_parameters();
    assert_eq!(
        file.parameters().iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        names.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()
    );
    let mut types = std::collections::BTreeSet::new();
    for (name, shape) in &names {
        let (info, raw) = file.raw_parameter(name).unwrap();
        assert_eq!(&info.shape(), shape, "{name}");
        assert_eq!(raw.len() as u64, info.n_bytes, "{name}");
        let decoded = dequantize(info.ty, &raw).unwrap();
        assert_eq!(decoded, file.parameter_f32(name).unwrap(), "{name}");
        types.insert(info.ty.name());
    }
    // Every decoded type is in the file (the blocks' matrices spread them).
    assert_eq!(types.len(), 6, "{types:?}");
    assert_eq!(file.parameter_info("lm_head.weight").unwrap().ty, GgmlType::Q4_1);
    assert!(matches!(
        file.raw_parameter("model.layers.7.mlp.up_proj.weight"),
        Err(Error::InvalidArgument { .. })
    ));
}

/// The quantized weight source takes exactly the matrices stored in a
/// format the kernels read, each as the file's blocks.
#[test]
fn quantized_weights_are_the_files_quantized_matrices() {
    use wgrad::ops::QuantFormat;
    let file = GgufModel::open(fixture(UNTIED)).unwrap();
    let quantized = file.quantized_weights().unwrap();
    let mut want = 0;
    for (name, shape) in Llama::empty(fixture_config(false)).unwrap().named_parameters() {
        let (info, raw) = file.raw_parameter(&name).unwrap();
        match (QuantFormat::try_from(info.ty), shape.len()) {
            (Ok(format), 2) => {
                want += 1;
                let matrix = quantized
                    .get(&name)
                    .unwrap_or_else(|| panic!("{name} ({}) is missing", info.ty.name()));
                assert_eq!((matrix.format, &matrix.raw[..]), (format, &raw[..]), "{name}");
            }
            _ => assert!(
                !quantized.contains_key(&name),
                "{name} ({}) is not a quantized matrix",
                info.ty.name()
            ),
        }
    }
    // The fixture spreads Q8_0, Q4_0 and Q4_1 over its matrices.
    assert!(want >= 3, "{want} quantized matrices");
    assert_eq!(quantized.len(), want);
}

// ---------------------------------------------------------------------------
// Broken model files

/// Opens `bytes` as a model (header checks only; nothing of the model is
/// built), checking what it allocated against the file's size.
#[track_caller]
fn open_bounded(bytes: &[u8], what: &str) -> Result<GgufModel, Error> {
    let (result, total, largest) = counted(|| GgufModel::from_gguf(Gguf::from_bytes("broken.gguf", bytes.to_vec())?));
    let (max_total, max_one) = allowance(bytes.len());
    assert!(
        total <= max_total && largest <= max_one,
        "{what}: allocated {total} bytes (largest {largest}) for a {}-byte file",
        bytes.len()
    );
    result
}

#[track_caller]
fn file_reason(bytes: &[u8], what: &str) -> String {
    match open_bounded(bytes, what) {
        Err(Error::Gguf { reason, .. }) => reason,
        Err(e) => panic!("{what}: expected Error::Gguf, got {e:?}"),
        Ok(_) => panic!("{what}: the broken file was accepted"),
    }
}

/// (tensor, dtype, reason) of a tensor error.
#[track_caller]
fn tensor_reason(bytes: &[u8], what: &str) -> (String, String, String) {
    match open_bounded(bytes, what) {
        Err(Error::GgufTensor {
            tensor, dtype, reason, ..
        }) => (tensor, dtype, reason),
        Err(e) => panic!("{what}: expected Error::GgufTensor, got {e:?}"),
        Ok(_) => panic!("{what}: the broken file was accepted"),
    }
}

fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap()
}

/// Overwrites the same-length string `from` (its first occurrence) with `to`.
fn replace(bytes: &mut [u8], from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let at = find(bytes, from.as_bytes());
    bytes[at..at + to.len()].copy_from_slice(to.as_bytes());
}

#[test]
fn the_unbroken_fixtures_open() {
    for name in [UNTIED, TIED, GPT2] {
        assert!(open_bounded(&fixture_bytes(name), name).is_ok(), "{name}");
    }
}

#[test]
fn truncated_tensor_data_names_the_tensor() {
    let mut bytes = fixture_bytes(UNTIED);
    let g = Gguf::from_bytes("x", bytes.clone()).unwrap();
    let last = g.tensors().iter().max_by_key(|t| t.offset).unwrap().clone();
    // 7 bytes short of the last tensor's end (the writer pads past it).
    bytes.truncate((g.data_offset() + last.offset + last.n_bytes) as usize - 7);
    let last = last.name;
    let (tensor, dtype, reason) = tensor_reason(&bytes, "truncated");
    assert_eq!(tensor, last);
    assert!(dtype.starts_with("Q4_1"), "{dtype}");
    assert!(reason.contains("past the end of the file"), "{reason}");
}

#[test]
fn a_header_count_beyond_the_file_is_refused() {
    let mut bytes = fixture_bytes(UNTIED);
    put_u64(&mut bytes, 8, 1 << 40);
    assert!(file_reason(&bytes, "tensor count").contains("tensor"));
    let mut bytes = fixture_bytes(UNTIED);
    let layers = fields(&bytes).kv("llama.block_count").value;
    put_u32(&mut bytes, layers, 1 << 20);
    let reason = file_reason(&bytes, "block count");
    assert!(
        reason.contains("1048576 blocks") && reason.contains("llama.block_count"),
        "{reason}"
    );
}

/// Sizes within the metadata's limits (2^24 channels) that the file's
/// data cannot hold are refused before the model's structure is built: the
/// empty Llama of the fixture's 2 blocks at 2^24 channels allocated 320
/// MiB of norms (a 3 KB file of 8 such blocks, 1.1 GB; found with fuzz/'s
/// gguf target, whose seeds keep that file as gguf-model-2-24-channels.gguf).
#[test]
fn sizes_the_data_cannot_hold_are_refused_before_allocating() {
    let mut bytes = fixture_bytes(UNTIED);
    let f = fields(&bytes);
    for (key, value) in [
        ("llama.embedding_length", 1u32 << 24),
        ("llama.attention.head_count", 1 << 23),
        ("llama.attention.head_count_kv", 1 << 23),
        ("llama.rope.dimension_count", 2),
        ("llama.feed_forward_length", 1),
    ] {
        put_u32(&mut bytes, f.kv(key).value, value);
    }
    let reason = file_reason(&bytes, "2^24 channels");
    assert!(
        reason.contains("parameters, more than") && reason.contains("bytes of tensor data"),
        "{reason}"
    );
}

/// The check above counts bytes at the densest type wgrad decodes: Q2_K's
/// 84 bytes a 256 values (2.625 bits), not Q4_0's 4.5. At Q4_0's a real
/// Q2_K or Q3_K_S file (a 7B Q2_K is about 3.4 bits a weight) was refused
/// as too small for its sizes. This Llama of 2.1M parameters (above the
/// 2^20 where the check starts), every matrix Q2_K, must open.
#[test]
fn a_model_stored_in_q2_k_is_not_refused_as_too_small() {
    use wgrad::io::gguf::Value;
    use wgrad::io::gguf_write::GgufWriter;
    let base = Gguf::open(fixture(UNTIED)).unwrap();
    let mut writer = GgufWriter::new();
    for (key, value) in base.metadata() {
        writer.set(key, value.clone()).unwrap();
    }
    let (c, ff, vocab) = (512usize, 512usize, 271usize);
    for (key, value) in [
        ("llama.embedding_length", c),
        ("llama.feed_forward_length", ff),
        ("llama.block_count", 1),
        ("llama.rope.dimension_count", c / 4),
    ] {
        writer.set(key, Value::U32(value as u32)).unwrap();
    }
    // All-zero Q2_K blocks decode to zeros (finite scales).
    let q2k = |rows: usize, cols: usize| vec![0u8; rows * cols / 256 * 84];
    let matrices = [
        ("token_embd.weight", vocab, c),
        ("blk.0.attn_q.weight", c, c),
        ("blk.0.attn_k.weight", c / 2, c),
        ("blk.0.attn_v.weight", c / 2, c),
        ("blk.0.attn_output.weight", c, c),
        ("blk.0.ffn_gate.weight", ff, c),
        ("blk.0.ffn_up.weight", ff, c),
        ("blk.0.ffn_down.weight", c, ff),
        ("output.weight", vocab, c),
    ];
    for (name, rows, cols) in matrices {
        writer
            .add_tensor(name, &[rows, cols], GgmlType::Q2_K, q2k(rows, cols))
            .unwrap();
    }
    for name in ["blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"] {
        writer.add_values(name, &[c], GgmlType::F32, &vec![1.0; c]).unwrap();
    }
    let bytes = writer.to_bytes().unwrap();
    let model = open_bounded(&bytes, "a Q2_K Llama").unwrap();
    let GgufArchitecture::Llama(config) = *model.architecture() else {
        panic!("not a Llama")
    };
    let parameters = config.num_parameters().unwrap();
    // Above where the check starts, and more than Q4_0's bytes could fit.
    assert!(
        parameters > 1 << 20 && parameters * 18 / 32 > bytes.len(),
        "{parameters}"
    );
    // Q2_K stays the densest type decoded, as the check assumes.
    for ty in wgrad::io::gguf::DECODED_TYPES {
        assert!(ty.type_size() * 256 >= 84 * ty.block_size(), "{ty} is denser than Q2_K");
    }
}

#[test]
fn an_unsupported_tensor_type_is_named() {
    let mut bytes = fixture_bytes(UNTIED);
    // F32 to I32: the same size, so the file stays well-formed.
    let ty = fields(&bytes).tensor("blk.1.ffn_norm.weight").ty;
    put_u32(&mut bytes, ty, GgmlType::I32.id());
    let (tensor, dtype, reason) = tensor_reason(&bytes, "I32 norm");
    assert_eq!(tensor, "blk.1.ffn_norm.weight");
    assert!(dtype.starts_with("I32"), "{dtype}");
    assert!(
        reason.contains("type I32 is not supported") && reason.contains("Q4_1"),
        "{reason}"
    );
}

#[test]
fn other_architectures_are_refused() {
    let mut bytes = fixture_bytes(UNTIED);
    replace(&mut bytes, "llama", "gemma");
    let reason = file_reason(&bytes, "gemma");
    assert!(
        reason.contains("architecture `gemma`") && reason.contains("`llama`, `qwen2`, `qwen3`, `gemma3` and `gpt2`"),
        "{reason}"
    );
    let mut bytes = fixture_bytes(GPT2);
    replace(&mut bytes, "gpt2", "bert");
    assert!(file_reason(&bytes, "bert").contains("architecture `bert`"));
}

#[test]
fn a_missing_tokenizer_is_refused() {
    for file in [TIED, GPT2] {
        let mut bytes = fixture_bytes(file);
        replace(&mut bytes, "tokenizer.ggml.tokens", "tokenizer.ggml.tokenz");
        let reason = file_reason(&bytes, file);
        assert!(
            reason.contains("no tokenizer") && reason.contains("`tokenizer.ggml.tokens`"),
            "{file}: {reason}"
        );
    }
    let mut bytes = fixture_bytes(TIED);
    replace(&mut bytes, "tokenizer.ggml.model", "tokenizer.ggml.mode_");
    assert!(file_reason(&bytes, "no model").contains("tokenizer.ggml.model"));
}

#[test]
fn a_tensor_of_the_wrong_shape_for_the_config_is_named() {
    // The q rows of layer 1 regrouped (Q4_1 [64, 64] as [32, 128]: the same
    // blocks, so the file stays well-formed).
    let mut bytes = fixture_bytes(UNTIED);
    let dims = fields(&bytes).tensor("blk.1.attn_q.weight").dims;
    assert_eq!((u64_at(&bytes, dims), u64_at(&bytes, dims + 8)), (64, 64));
    put_u64(&mut bytes, dims, 32);
    put_u64(&mut bytes, dims + 8, 128);
    let (tensor, dtype, reason) = tensor_reason(&bytes, "q shape");
    assert_eq!(
        (tensor.as_str(), dtype.as_str()),
        ("blk.1.attn_q.weight", "Q4_1 [32, 128]")
    );
    assert!(
        reason.contains("[128, 32]") && reason.contains("`model.layers.1.self_attn.q_proj.weight` [64, 64]"),
        "{reason}"
    );
    // The metadata's MLP width disagrees with every MLP tensor: the first
    // is named.
    let mut bytes = fixture_bytes(UNTIED);
    let ff = fields(&bytes).kv("llama.feed_forward_length").value;
    put_u32(&mut bytes, ff, 128);
    let (tensor, _, reason) = tensor_reason(&bytes, "ff width");
    assert_eq!(tensor, "blk.0.ffn_gate.weight");
    assert!(reason.contains("[128, 64]"), "{reason}");
}

#[test]
fn missing_and_extra_tensors_are_named() {
    let mut bytes = fixture_bytes(UNTIED);
    replace(&mut bytes, "output_norm.weight", "output_norm.weighx");
    let (tensor, dtype, reason) = tensor_reason(&bytes, "no final norm");
    assert_eq!((tensor.as_str(), dtype.as_str()), ("output_norm.weight", "absent"));
    assert!(reason.contains("model.norm.weight"), "{reason}");
    // An untied head renamed to a bias: the model is tied, and a tensor it
    // has no parameter for is not ignored.
    let mut bytes = fixture_bytes(UNTIED);
    replace(
        &mut bytes,
        "\x0d\0\0\0\0\0\0\0output.weight",
        "\x0d\0\0\0\0\0\0\0output.bias__",
    );
    let (tensor, _, reason) = tensor_reason(&bytes, "extra tensor");
    assert_eq!(tensor, "output.bias__");
    assert!(reason.contains("not a parameter"), "{reason}");
}

// ---------------------------------------------------------------------------
// SmolLM2-135M-Instruct

/// Where the real file is: `$WGRAD_SMOLLM2`, else wgrad's cache
/// (`scripts/fetch-smollm2.sh` puts it there). Missing, it is a failure.
fn smollm2_path() -> PathBuf {
    let path = wgrad_benches::smollm2_path().expect("no WGRAD_SMOLLM2 and no cache directory (HOME unset)");
    assert!(
        path.is_file(),
        "SmolLM2-135M-Instruct's GGUF file is missing at {}: fetch it with scripts/fetch-smollm2.sh, or point WGRAD_SMOLLM2 at a copy",
        path.display()
    );
    path
}

/// The float32 sums of 30 layers in another order: measured worst 5.2e-5
/// on the top logits (up to 28) of the prompts (llvmpipe against torch on
/// the CPU).
const SMOLLM2_ATOL: f32 = 1e-3;
const SMOLLM2_RTOL: f32 = 1e-4;

#[test]
fn smollm2_gives_transformers_greedy_tokens_and_logits() {
    let path = smollm2_path();
    let reference: Json = serde_json::from_slice(&std::fs::read(fixture("smollm2-reference.json")).unwrap()).unwrap();
    let file = GgufModel::open(&path).unwrap();
    assert_eq!(
        *file.architecture(),
        GgufArchitecture::Llama(LlamaConfig {
            rope_layout: RopeLayout::Interleaved,
            ..LlamaConfig::smollm2_135m()
        })
    );
    // A 256-position cache holds every case: the full 8192 would cost the
    // test 377 MB of KV cache and prefill passes up to 8192 long.
    let mut model = file.to_llama().unwrap();
    let (mut quantized_model, quantized) = file.to_quantized_llama().unwrap();
    model.config.block_size = 256;
    quantized_model.config.block_size = 256;
    let quantized = Arc::new(quantized);
    let as_u32 = |v: &Json| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let as_f32 = |v: &Json| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    // One adapter per suite run (lavapipe, then SwiftShader in make test):
    // the small GGUF fixtures above check the numerics on every adapter,
    // and a 135M model decodes at a few tokens per second on a CPU adapter.
    let Some(k) = crate::common::adapters().first() else {
        return crate::common::no_adapter("SmolLM2 against transformers");
    };
    let run = || -> wgrad::Result<()> {
        // The de-quantized model's 538 MB of f32 parameters are one buffer,
        // over WebGPU's default 256 MiB limit (the SwiftShader run): there
        // it must be refused clearly, and the quantized model (~100 MB)
        // still runs.
        let f32_generator = match Generator::new(k.clone(), &model, 1) {
            Ok(generator) => Some(generator),
            Err(e) if k.device().limits().max_buffer_size < 538_060_032 => {
                assert!(e.to_string().contains("max_buffer_size"), "{e}");
                None
            }
            Err(e) => return Err(e),
        };
        let ran_f32 = f32_generator.is_some();
        if let Some(mut generator) = f32_generator {
            for case in reference["prompts"].as_array().unwrap() {
                let text = case["text"].as_str().unwrap();
                let prompt = as_u32(&case["ids"]);
                let logits = generator.prefill(&[&prompt])?;
                let top_ids = as_u32(&case["top_ids"]);
                let got: Vec<f32> = top_ids.iter().map(|&i| logits[i as usize]).collect();
                assert_close(
                    &format!("{text:?}: top logits"),
                    &got,
                    &as_f32(&case["top_logits"]),
                    SMOLLM2_ATOL,
                    SMOLLM2_RTOL,
                );
                let want = as_u32(&case["greedy"]);
                let greedy = generator.generate(&prompt, want.len(), &Sampling::greedy(), |_| Ok(()))?;
                assert_eq!(
                    greedy, want,
                    "{text:?}: transformers continues with {:?}",
                    case["greedy_text"]
                );
            }
        }
        // The weights as the file stores them, decoded in the kernels: the
        // reference's greedy tokens (its smallest top-2 margin is 0.15).
        // Two prompts (plain and ChatML), one where the f32 model did not
        // fit (SwiftShader, where decoding 135M parameters is slowest).
        let mut generator =
            Generator::new_with_weights(k.clone(), &quantized_model, 1, WeightDtype::F32, quantized.clone())?;
        for case in reference["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .take(if ran_f32 { 2 } else { 1 })
        {
            let want = as_u32(&case["greedy"]);
            let greedy = generator.generate(&as_u32(&case["ids"]), want.len(), &Sampling::greedy(), |_| Ok(()))?;
            assert_eq!(
                greedy, want,
                "quantized, {:?}: transformers continues with {:?}",
                case["text"], case["greedy_text"]
            );
        }
        Ok(())
    };
    let _gl = k.device().lock_gl();
    if let Err(e) = run() {
        panic!("SmolLM2 against transformers on {}: {e}", k.device().label());
    }
}

/// A GGUF model's memory is checked with the matrices it keeps quantized at
/// their stored size (what the generator's arena holds), whether loaded
/// from its path or from its bytes (the browser page's load): under a
/// buffer limit between that size and every value as f32 the file loads,
/// and both loads generate the same tokens.
#[test]
fn a_quantized_gguf_is_checked_at_its_stored_size_from_a_path_or_its_bytes() {
    use wgrad::infer::generate::{
        check_fits_stored, check_fits_with_options, context_that_fits_stored, GeneratorOptions,
    };
    use wgrad::infer::pretrained::{load_pretrained, load_pretrained_gguf_bytes, PretrainedLm};
    use wgrad::kernels::LimitOverrides;
    use wgrad::nn::LmConfig;
    let path = fixture(UNTIED);
    let (values, bytes) = GgufModel::open(&path).unwrap().quantized_storage().unwrap();
    let config = fixture_config(false);
    let parameters = config.lm_sizes().parameters;
    assert!(
        values > 0 && bytes < values * 4,
        "{values} quantized values in {bytes} bytes"
    );
    // A GPT-2 keeps nothing quantized (its generator de-quantizes).
    assert_eq!(
        GgufModel::open(fixture(GPT2)).unwrap().quantized_storage().unwrap(),
        (0, 0)
    );
    let (as_f32, stored) = (parameters * 4, (parameters - values) * 4 + bytes);
    for_each_adapter("gguf_model::quantized_gguf_is_checked_at_its_stored_size", |k| {
        let overrides = LimitOverrides {
            max_buffer_size: Some((stored + as_f32) / 2),
            ..LimitOverrides::default()
        };
        let limited = crate::common::limited_kernels(k, overrides);
        let options = GeneratorOptions {
            context: Some(16),
            ..GeneratorOptions::default()
        };
        assert!(
            matches!(
                check_fits_with_options(&limited, &config, &options),
                Err(Error::TooLarge { .. })
            ),
            "{as_f32} bytes of f32 parameters fit a buffer limit of {}",
            (stored + as_f32) / 2
        );
        check_fits_stored(&limited, &config, &options, (values, bytes))?;
        // `wgrad generate` sizes its cache the same way (it failed under
        // WebGPU's limits on SmolLM2 when it counted every value as f32).
        let stored = wgrad::infer::pretrained::quantized_storage(&path, None)?;
        assert_eq!(stored, (values, bytes));
        assert_eq!(context_that_fits_stored(&limited, &config, &options, 1, stored)?, 16);
        assert!(context_that_fits_stored(&limited, &config, &options, 1, (0, 0)).is_err());
        let greedy = |lm: PretrainedLm| -> wgrad::Result<Vec<u32>> {
            let options = GeneratorOptions {
                quantized: Arc::new(lm.quantized.clone()),
                suppressed_tokens: lm.suppressed.clone(),
                ..options.clone()
            };
            let mut generator = Generator::with_options(limited.clone(), lm.model.as_ref(), &options)?;
            generator.generate(&[1, 5, 9], 6, &Sampling::greedy(), |_| Ok(()))
        };
        let from_path = greedy(load_pretrained(&limited, &path, None, &options)?)?;
        let bytes = fixture_bytes(UNTIED);
        let from_bytes = greedy(load_pretrained_gguf_bytes(&limited, UNTIED, bytes, None, &options)?)?;
        assert_eq!(
            from_path, from_bytes,
            "the file's path and its bytes generate differently"
        );
        Ok(())
    });
}
