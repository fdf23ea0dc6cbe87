//! PEFT adapters both ways over a GGUF Llama's row order, merged adapters
//! (`Lora::merged`), the GGUF writer and its quantizers (read back by
//! wgrad's reader here, and by gguf-py where Python has it:
//! scripts/check_gguf_writer.py), and a wgrad-trained adapter loaded by
//! PEFT (scripts/check_peft_adapter.py, where torch and peft import).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{assert_close, for_each_adapter, random_vec, rng};
use crate::gpt_folder::{fixture, TempDir};
use wgrad::infer::Predictor;
use wgrad::io::checkpoint::{self, Checkpoint, NamedTensor};
use wgrad::io::gguf::llama::permute_rows;
use wgrad::io::gguf::{dequantize, Array, GgmlType, Gguf, Value};
use wgrad::io::gguf_write::{quantize, GgufWriter};
use wgrad::io::llama_folder::load_llama_folder;
use wgrad::io::peft;
use wgrad::models::Llama;
use wgrad::nn::{CausalLm, Lora, LoraConfig, Module, ParameterTree, RopeLayout};

/// The committed tiny Llama (hf-tiny-llama: 2 layers, 32 channels, 4
/// heads over 2 KV heads, vocabulary 37).
fn tiny_llama() -> Llama {
    load_llama_folder(fixture("hf-tiny-llama")).unwrap().model
}

/// The same function in a GGUF file's layout: q and k rows permuted as
/// llama.cpp's converter permutes them, rotating interleaved pairs.
fn interleaved(model: &Llama) -> Llama {
    let mut config = model.config;
    config.rope_layout = RopeLayout::Interleaved;
    let values = model.parameter_values();
    Llama::from_parameters(config, |name, shape| {
        let v = values.iter().find(|p| p.0 == name).unwrap().2;
        Ok(if name.ends_with("q_proj.weight") {
            permute_rows(v, shape[0], config.n_head)?
        } else if name.ends_with("k_proj.weight") {
            permute_rows(v, shape[0], config.n_kv_head)?
        } else {
            v.to_vec()
        })
    })
    .unwrap()
}

fn ids() -> Vec<u32> {
    (0..16).map(|i| (i * 7 + 3) % 37).collect()
}

/// The PEFT fixture (q, v, o, up, down; random non-zero B) over the
/// Hugging Face layout and over the GGUF layout gives the same logits: its
/// q_proj B rows move with the base's. Saved back from the GGUF layout,
/// the adapter is PEFT's again, bit for bit.
#[test]
fn a_peft_adapter_runs_alike_over_a_gguf_llamas_row_order() {
    let hf = peft::load(tiny_llama(), fixture("peft-tiny-llama-lora")).unwrap();
    let gguf = peft::load(interleaved(&tiny_llama()), fixture("peft-tiny-llama-lora")).unwrap();
    let q = |m: &Lora<Llama>| {
        m.adapters()
            .iter()
            .find(|a| a.module.ends_with("0.self_attn.q_proj"))
            .unwrap()
            .b
            .clone()
    };
    assert_ne!(q(&hf), q(&gguf), "the GGUF layout's q_proj B rows moved");
    let tmp = TempDir::new("peft-gguf-layout");
    peft::save_lora(tmp.path("back"), &gguf, "tiny").unwrap();
    let back = peft::read(tmp.path("back")).unwrap();
    let original = peft::read(fixture("peft-tiny-llama-lora")).unwrap();
    for a in &original.adapters {
        let b = back.adapters.iter().find(|b| b.module == a.module).unwrap();
        assert!(a.a == b.a && a.b == b.b, "{} differs after a round trip", a.module);
    }
    let ids = ids();
    for_each_adapter("peft over a gguf layout", |k| {
        let want = Predictor::new(k.clone(), &hf, 1)?.outputs_ids(&ids)?;
        let got = Predictor::new(k.clone(), &gguf, 1)?.outputs_ids(&ids)?;
        // Logits within ±4; the head dot products sum in another order.
        assert_close("logits over the GGUF layout", &got, &want, 2e-5, 1e-5);
        Ok(())
    });
}

/// A merged model (W + α/r·B·A) computes what the model with its adapter
/// computes, in both layouts.
#[test]
fn a_merged_adapter_computes_the_adapted_model() {
    let ids = ids();
    for base in [tiny_llama(), interleaved(&tiny_llama())] {
        let adapted = peft::load(base, fixture("peft-tiny-llama-lora")).unwrap();
        let merged = adapted.merged().unwrap();
        let changed = adapted.merged_weights().unwrap();
        assert_eq!(changed.len(), 10);
        for_each_adapter("merged adapter", |k| {
            let want = Predictor::new(k.clone(), &adapted, 1)?.outputs_ids(&ids)?;
            let got = Predictor::new(k.clone(), &merged, 1)?.outputs_ids(&ids)?;
            // One product instead of two: f32 rounding of logits within ±4.
            assert_close("merged logits", &got, &want, 5e-5, 1e-5);
            Ok(())
        });
    }
}

/// Values of every sign and scale, rows of `row` values (a multiple of
/// 32), with blocks that test the quantizers' edges: all zero, a tie for
/// the largest magnitude (the first wins), one value only, halves.
fn quantizer_cases(rows: usize, row: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    let mut v = random_vec(&mut r, rows * row, -3.0, 3.0);
    v[..32].fill(0.0);
    if v.len() >= 96 {
        v[32..64].copy_from_slice(&random_vec(&mut r, 32, -1.0, 1.0));
        v[40] = 2.0;
        v[50] = -2.0;
        v[64..96].fill(0.0);
        v[70] = -5.5;
    }
    if v.len() >= 128 {
        // x / d lands on .5 exactly for Q8_0 (d = 127/127 = 1).
        for (i, x) in v[96..128].iter_mut().enumerate() {
            *x = (i as f32 - 16.0) + 0.5;
        }
        v[96] = 127.0;
    }
    v
}

/// Each quantizer's blocks decode (by the reader's decoders) to within
/// half a step of the input, and the edge blocks are ggml's: a zero block
/// is scale 0 and codes 0 (Q8_0) or 8 (Q4_0), the first of two equal
/// magnitudes sets Q4_0's sign, and a value on a half rounds away from 0.
#[test]
fn quantizers_write_ggmls_blocks() {
    let v = quantizer_cases(3, 128, 1);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F16] {
        let raw = quantize(ty, &v, 128).unwrap();
        assert_eq!(raw.len() as u64, v.len() as u64 / ty.block_size() * ty.type_size());
        let back = dequantize(ty, &raw).unwrap();
        for (block, (x, y)) in v.chunks(32).zip(back.chunks(32)).enumerate() {
            let (lo, hi) = x.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let amax = lo.abs().max(hi.abs());
            // Half a step of each format (Q4_0's codes reach 7·d on the
            // side opposite its largest value: a whole step there), and
            // f16's rounding of the scales.
            let error = match ty {
                GgmlType::Q8_0 => 0.5 * amax / 127.0,
                GgmlType::Q4_0 => amax / 8.0,
                GgmlType::Q4_1 => 0.5 * (hi - lo) / 15.0,
                _ => 0.5 * amax / 1024.0,
            };
            let bound = error * 1.01 + amax * 2e-3 + 1e-6;
            for (a, b) in x.iter().zip(y) {
                assert!(
                    (a - b).abs() <= bound,
                    "{ty} block {block}: {a} decoded as {b} (bound {bound})"
                );
            }
        }
    }
    let q8 = quantize(GgmlType::Q8_0, &v, 128).unwrap();
    assert!(
        q8[..34].iter().all(|&b| b == 0),
        "a zero block is all zero bytes in Q8_0"
    );
    // Block 3: d = 127 / 127 = 1, so x·(1/d) = k + 0.5 rounds away from zero.
    let codes: Vec<i8> = q8[3 * 34 + 2..4 * 34].iter().map(|&b| b as i8).collect();
    assert_eq!(codes[0], 127);
    assert_eq!(codes[1], -15, "-14.5 rounds to -15");
    assert_eq!(codes[31], 16, "15.5 rounds to 16");
    let q4 = quantize(GgmlType::Q4_0, &v, 128).unwrap();
    // A zero block: d = 0 / -8 = -0.0 (ggml's arithmetic), every code 8.
    assert_eq!(
        half::f16::from_le_bytes([q4[0], q4[1]]).to_bits(),
        0x8000,
        "zero block in Q4_0"
    );
    assert!(q4[2..18].iter().all(|&b| b == 0x88), "zero block in Q4_0");
    // Block 1: 2.0 comes first, so d = 2 / -8 < 0.
    let d = half::f16::from_le_bytes([q4[18], q4[19]]).to_f32();
    assert_eq!(d, -0.25);
    // Block 2: one value -5.5, d = 0.6875: it is code 0, the zeros code 8.
    let (d2, codes2) = (half::f16::from_le_bytes([q4[36], q4[37]]).to_f32(), &q4[38..54]);
    assert_eq!(d2, 0.6875);
    assert_eq!(codes2[70 - 64] & 0x0f, 0);
    assert_eq!(codes2[0], 0x88);
}

#[test]
fn quantizers_refuse_what_they_cannot_store() {
    let cases: [(GgmlType, Vec<f32>, usize, &str); 6] = [
        (GgmlType::Q8_0, vec![0.0; 48], 48, "not whole Q8_0 blocks"),
        (GgmlType::Q4_0, vec![0.0; 64], 0, "not whole"),
        (GgmlType::F16, vec![1e6; 4], 4, "too large"),
        (GgmlType::Q8_0, vec![1e9; 32], 32, "too large"),
        (GgmlType::F32, vec![f32::NAN; 2], 2, "cannot be stored"),
        (GgmlType::Q6_K, vec![0.0; 256], 256, "not Q6_K"),
    ];
    for (ty, values, row, says) in cases {
        let e = quantize(ty, &values, row).unwrap_err();
        assert!(e.contains(says), "{ty}: want `{says}` in: {e}");
    }
}

/// Metadata of every value type (nested arrays too) and tensors of every
/// written type at odd shapes.
fn sample_writer(alignment: Option<u32>) -> (GgufWriter, Vec<(String, Vec<usize>, GgmlType, Vec<f32>)>) {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.set("general.alignment", Value::U32(a)).unwrap();
    }
    let entries = [
        ("test.u8", Value::U8(200)),
        ("test.i8", Value::I8(-100)),
        ("test.u16", Value::U16(65000)),
        ("test.i16", Value::I16(-32000)),
        ("test.u32", Value::U32(4_000_000_000)),
        ("test.i32", Value::I32(-2_000_000_000)),
        ("test.f32", Value::F32(0.1)),
        ("test.bool", Value::Bool(true)),
        ("test.string", Value::String("ünïcödé ✓".into())),
        ("test.u64", Value::U64(u64::MAX - 1)),
        ("test.i64", Value::I64(i64::MIN + 1)),
        ("test.f64", Value::F64(-1.0e-300)),
        ("test.empty", Value::Array(Array::U32(Vec::new()))),
        (
            "test.strings",
            Value::Array(Array::String(vec!["a".into(), String::new(), "ccc".into()])),
        ),
        ("test.floats", Value::Array(Array::F32(vec![1.5, -0.0, 3.25]))),
        ("test.bools", Value::Array(Array::Bool(vec![true, false]))),
        (
            "test.nested",
            Value::Array(Array::Array(vec![
                Array::I16(vec![-1, 2]),
                Array::String(vec!["x".into()]),
            ])),
        ),
    ];
    for (key, value) in entries {
        w.set(key, value).unwrap();
    }
    let mut r = rng(3);
    let mut tensors = Vec::new();
    let shapes: [(&str, Vec<usize>, GgmlType); 8] = [
        ("plain.f32", vec![7], GgmlType::F32),
        ("plain.f32.rank3", vec![2, 3, 5], GgmlType::F32),
        ("matrix.f16", vec![3, 5], GgmlType::F16),
        ("matrix.q8_0", vec![5, 64], GgmlType::Q8_0),
        ("matrix.q4_0", vec![3, 128], GgmlType::Q4_0),
        ("matrix.q4_1", vec![1, 32], GgmlType::Q4_1),
        ("rank4.q8_0", vec![2, 1, 3, 32], GgmlType::Q8_0),
        ("edges.q4_0", vec![1, 128], GgmlType::Q4_0),
    ];
    for (i, (name, shape, ty)) in shapes.into_iter().enumerate() {
        let n = shape.iter().product();
        let values = if name.starts_with("edges") {
            quantizer_cases(1, 128, 9)
        } else {
            random_vec(&mut r, n, -2.0 - i as f32, 2.0)
        };
        w.add_values(name, &shape, ty, &values).unwrap();
        tensors.push((name.to_string(), shape, ty, values));
    }
    (w, tensors)
}

/// What the writer writes, wgrad's reader reads: every metadata entry,
/// every tensor's type, shape and bytes, at aligned offsets.
#[test]
fn the_gguf_writer_round_trips_through_the_reader() {
    for alignment in [None, Some(64)] {
        let (w, tensors) = sample_writer(alignment);
        let bytes = w.to_bytes().unwrap();
        let g = Gguf::from_bytes("written.gguf", bytes).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), u64::from(alignment.unwrap_or(32)));
        assert_eq!(g.metadata(), w.metadata());
        assert_eq!(g.tensors().len(), tensors.len());
        for ((info, written), (name, shape, ty, _)) in g.tensors().iter().zip(w.tensors()).zip(&tensors) {
            assert_eq!((&info.name, info.shape(), info.ty), (name, shape.clone(), *ty));
            assert_eq!(info.offset % g.alignment(), 0, "{name} is aligned");
            assert!(g.read_raw(name).unwrap() == written.data, "{name}'s bytes");
        }
        assert_eq!(g.data_offset() % g.alignment(), 0);
    }
}

#[test]
fn the_gguf_writer_refuses_what_a_reader_could_not_take() {
    let mut w = GgufWriter::new();
    w.add_values("t", &[32], GgmlType::F32, &[0.0; 32]).unwrap();
    let long = "x".repeat(64);
    let cases: Vec<(wgrad::Result<()>, &str)> = vec![
        (w.clone().add_values("t", &[32], GgmlType::F32, &[0.0; 32]), "taken"),
        (
            w.clone().add_values(&long, &[32], GgmlType::F32, &[0.0; 32]),
            "1 to 63 bytes",
        ),
        (
            w.clone().add_values("u", &[2, 16], GgmlType::Q8_0, &[0.0; 32]),
            "not whole Q8_0 blocks",
        ),
        (w.clone().add_values("u", &[4], GgmlType::F32, &[0.0; 3]), "3 values"),
        (
            w.clone().add_tensor("u", &[32], GgmlType::Q8_0, vec![0; 33]),
            "34 expected",
        ),
        (
            w.clone()
                .add_tensor("u", &[1, 1, 1, 1, 32], GgmlType::F32, vec![0; 128]),
            "1 to 4 dimensions",
        ),
        (w.clone().set("general.alignment", Value::U32(48)), "power of two"),
        (w.clone().set("general.alignment", Value::U64(64)), "power of two"),
        (w.clone().set("", Value::U8(0)), "empty metadata key"),
    ];
    for (result, says) in cases {
        let e = result.unwrap_err().to_string();
        assert!(e.contains(says), "want `{says}` in: {e}");
    }
}

/// A Python interpreter that imports `modules`, or None (and one line
/// saying which test skips): the checks against gguf-py, PEFT and
/// llama.cpp run where they are installed ($WGRAD_PYTHON, else python3).
pub fn python_with(test: &str, modules: &[&str]) -> Option<PathBuf> {
    let python = PathBuf::from(std::env::var("WGRAD_PYTHON").unwrap_or_else(|_| "python3".into()));
    let imports = format!("import {}", modules.join(", "));
    let ok = Command::new(&python)
        .args(["-c", &imports])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("{test}: skipped ({} cannot `{imports}`)", python.display());
    }
    ok.then_some(python)
}

/// Runs `script` (under scripts/) with `args`; panics with its output
/// when it fails.
pub fn run_script(python: &Path, script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(script);
    let out = Command::new(python).arg(&path).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} {args:?} failed:\n{text}");
    text
}

/// gguf-py (llama.cpp's own reader) reads the written file: the same
/// metadata, and each quantized tensor's bytes are what gguf-py's
/// `quantize` makes of the same f32 values, bit for bit.
#[test]
fn gguf_py_reads_the_written_file_bit_exactly() {
    let Some(python) = python_with("gguf_py_reads_the_written_file_bit_exactly", &["gguf", "numpy"]) else {
        return;
    };
    let tmp = TempDir::new("gguf-writer-py");
    let (mut w, tensors) = sample_writer(Some(64));
    // Each quantized tensor's source values, as F32, for gguf-py to quantize.
    for (name, shape, ty, values) in &tensors {
        if *ty != GgmlType::F32 {
            w.add_values(&format!("{name}.source"), shape, GgmlType::F32, values)
                .unwrap();
        }
    }
    let file = tmp.path("written.gguf");
    w.write(&file).unwrap();
    let expected: Vec<serde_json::Value> = w
        .metadata()
        .iter()
        .map(|(k, v)| serde_json::json!([k, json_value(v)]))
        .collect();
    let json = tmp.path("written.json");
    std::fs::write(&json, serde_json::to_vec(&expected).unwrap()).unwrap();
    let out = run_script(
        &python,
        "check_gguf_writer.py",
        &[file.to_str().unwrap(), json.to_str().unwrap()],
    );
    assert!(out.contains("6 quantized tensors equal gguf-py's"), "{out}");
}

/// A metadata value as JSON: `[type name, value]` (arrays nest).
fn json_value(v: &Value) -> serde_json::Value {
    use serde_json::json;
    let array = |a: &Array| -> serde_json::Value {
        match a {
            Array::U8(x) => json!(x),
            Array::I8(x) => json!(x),
            Array::U16(x) => json!(x),
            Array::I16(x) => json!(x),
            Array::U32(x) => json!(x),
            Array::I32(x) => json!(x),
            Array::F32(x) => json!(x),
            Array::Bool(x) => json!(x),
            Array::String(x) => json!(x),
            Array::Array(x) => json!(x
                .iter()
                .map(|a| json_value(&Value::Array(a.clone())))
                .collect::<Vec<_>>()),
            Array::U64(x) => json!(x),
            Array::I64(x) => json!(x),
            Array::F64(x) => json!(x),
        }
    };
    let value = match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => return json!(["array", a.element_type().name(), array(a)]),
    };
    json!([v.value_type().name(), value])
}

/// `model` with random B matrices (as trained steps leave them), saved as
/// a PEFT folder, and its logits on `ids` saved beside it for the check
/// script.
fn saved_with_logits<M: CausalLm + Clone>(model: Lora<M>, ids: &[u32], dir: &Path, base_name: &str) -> Option<PathBuf> {
    let mut model = model;
    let mut r = rng(17);
    model
        .visit_mut("", &mut |name, _, values| {
            if name.ends_with("lora_B.weight") {
                *values = random_vec(&mut r, values.len(), -0.2, 0.2);
            }
            Ok(())
        })
        .unwrap();
    peft::save_lora(dir, &model, base_name).unwrap();
    let found = std::cell::RefCell::new(None);
    for_each_adapter("peft check logits", |k| {
        let logits = Predictor::new(k.clone(), &model, 1)?.outputs_ids(ids)?;
        found.borrow_mut().get_or_insert(logits);
        Ok(())
    });
    let logits = found.into_inner()?;
    let mut out = Checkpoint::new();
    out.push(NamedTensor::new("ids", vec![1, ids.len()], ids.iter().map(|&i| i as f32).collect()).unwrap());
    out.push(NamedTensor::new("logits", vec![1, ids.len(), model.vocab_size()], logits).unwrap());
    let path = dir.with_extension("logits.safetensors");
    checkpoint::save(&path, &out).unwrap();
    Some(path)
}

/// Adapters wgrad saved load in PEFT over transformers' model and give
/// wgrad's logits: over the GGUF Llama fixture (q and k rows in llama.cpp's
/// order in wgrad; transformers de-quantizes and un-permutes them), and
/// over the Hugging Face GPT-2 fixture (Conv1D layers under `transformer.`).
#[test]
fn peft_loads_wgrad_saved_adapters_with_wgrads_logits() {
    let Some(python) = python_with(
        "peft_loads_wgrad_saved_adapters_with_wgrads_logits",
        &["torch", "peft", "transformers", "gguf"],
    ) else {
        return;
    };
    let tmp = TempDir::new("peft-check");
    let gguf = fixture("gguf-llama.gguf");
    let llama = wgrad::io::gguf_model::GgufModel::open(&gguf)
        .unwrap()
        .to_llama()
        .unwrap();
    wgrad::nn::manual_seed(4);
    let llama = Lora::new(llama, LoraConfig::new(4, 8.0, &["all-linear"])).unwrap();
    // The fixture's whole context of 32 positions.
    let ids: Vec<u32> = (0..32).map(|i| (i * 31 + 5) % 271).collect();
    let gpt2 = fixture("hf-tiny-gpt2");
    let gpt = wgrad::io::gpt_folder::load_gpt_folder(&gpt2).unwrap().model;
    let gpt = Lora::new(gpt, LoraConfig::new(2, 4.0, &["c_attn", "c_proj", "c_fc"])).unwrap();
    let gpt_ids: Vec<u32> = (0..16).map(|i| (i * 5 + 2) % 37).collect();
    for (base, model_dir, logits) in [
        (
            &gguf,
            tmp.path("llama"),
            saved_with_logits(llama, &ids, &tmp.path("llama"), "gguf-llama"),
        ),
        (
            &gpt2,
            tmp.path("gpt2"),
            saved_with_logits(gpt, &gpt_ids, &tmp.path("gpt2"), "hf-tiny-gpt2"),
        ),
    ] {
        let Some(logits) = logits else { return };
        let text = run_script(
            &python,
            "check_peft_adapter.py",
            &[
                base.to_str().unwrap(),
                model_dir.to_str().unwrap(),
                logits.to_str().unwrap(),
                // Logits within ±5; f32 sums in another order.
                "--atol",
                "1e-4",
            ],
        );
        eprintln!("{text}");
        assert!(text.contains("max |PEFT - wgrad|"), "{text}");
    }
}

/// A GPT-2's adapter carries Hugging Face's module names
/// (`transformer.h.0.attn.c_attn`) and reads back onto wgrad's.
#[test]
fn a_gpt2_adapter_carries_hugging_faces_names() {
    let gpt = wgrad::io::gpt_folder::load_gpt_folder(fixture("hf-tiny-gpt2"))
        .unwrap()
        .model;
    let model = Lora::new(gpt.clone(), LoraConfig::new(2, 4.0, &["c_attn"])).unwrap();
    let tmp = TempDir::new("gpt2-names");
    peft::save_lora(tmp.path("a"), &model, "gpt2").unwrap();
    let saved = checkpoint::load(tmp.path("a").join(peft::WEIGHTS_FILE)).unwrap();
    assert_eq!(
        saved.tensors[0].name,
        "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    );
    let back = peft::load(gpt, tmp.path("a")).unwrap();
    assert_eq!(back.adapters(), model.adapters());
}
