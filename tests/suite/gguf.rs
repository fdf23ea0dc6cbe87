//! GGUF reading (src/io/gguf.rs), host only: the fixtures written by llama.cpp's
//! own Python package (scripts/make_gguf_fixture.py) read back to the
//! metadata and the de-quantized values that package reads, bit for bit;
//! the Llama row permutation undone; and every kind of broken file an error,
//! never a panic, and never an allocation larger than the file justifies.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::SafeTensors;
use serde_json::Value as Json;
use wgrad::io::gguf::{self, llama, Array, GgmlType, Gguf, Value};
use wgrad::Error;

// ---------------------------------------------------------------------------
// Allocation accounting
//
// The suite's global allocator: the system's, counting the bytes each thread
// allocates while a `Counting` scope is open on it (a thread-local `Cell`,
// so other tests running beside it neither count nor pay more than a check).

struct CountingAlloc;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static TOTAL: Cell<usize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // try_with: the thread may be tearing down its thread-locals.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = TOTAL.try_with(|t| t.set(t.get().saturating_add(size)));
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Runs `f`, returning its result, the bytes it allocated in all and its
/// largest single allocation (on this thread; other files' tests use it too).
pub(crate) fn counted<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    TOTAL.with(|t| t.set(0));
    LARGEST.with(|l| l.set(0));
    COUNTING.with(|c| c.set(true));
    let out = f();
    COUNTING.with(|c| c.set(false));
    (out, TOTAL.with(Cell::get), LARGEST.with(Cell::get))
}

/// What a file of `len` bytes may make the reader allocate, in all and in
/// one piece: copies of the file (the test's and the one `from_bytes`
/// keeps), each tensor's bytes and its f32 values (7.1 times Q4_0's 4.5 bits
/// a value), a bounded factor for the header's structures (a 24-byte
/// `String` per 8-byte empty string in the file, an 80-byte `TensorInfo`
/// per 24-byte tensor info), and a little fixed overhead.
pub(crate) fn allowance(len: usize) -> (usize, usize) {
    (16 * len + 64 * 1024, 4 * len + 4096)
}

/// Parses `bytes` and reads every tensor, checking the allocations against
/// the file's size; the result of the parse.
fn parse_bounded(bytes: &[u8], what: &str) -> Result<Gguf, Error> {
    let (result, total, largest) = counted(|| {
        let g = Gguf::from_bytes("broken.gguf", bytes.to_vec())?;
        for t in g.tensors() {
            let _ = g.read_raw(&t.name);
            let _ = g.read_f32(&t.name);
        }
        Ok(g)
    });
    let (max_total, max_one) = allowance(bytes.len());
    assert!(
        total <= max_total && largest <= max_one,
        "{what}: a {}-byte file made the reader allocate {total} bytes (largest {largest}); allowed {max_total} ({max_one})",
        bytes.len()
    );
    result
}

// ---------------------------------------------------------------------------
// Fixtures

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

fn tiny_path() -> PathBuf {
    fixture("gguf-tiny.gguf")
}

fn tiny_bytes() -> Vec<u8> {
    std::fs::read(tiny_path()).unwrap()
}

fn reference_json(stem: &str) -> Json {
    serde_json::from_slice(&std::fs::read(fixture(&format!("{stem}.json"))).unwrap()).unwrap()
}

/// The reference tensors: name → (shape, values).
fn reference_tensors(stem: &str) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture(&format!("{stem}.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// gguf-py's names for value types.
fn py_type(t: gguf::ValueType) -> &'static str {
    use gguf::ValueType::*;
    match t {
        U8 => "UINT8",
        I8 => "INT8",
        U16 => "UINT16",
        I16 => "INT16",
        U32 => "UINT32",
        I32 => "INT32",
        F32 => "FLOAT32",
        Bool => "BOOL",
        String => "STRING",
        Array => "ARRAY",
        U64 => "UINT64",
        I64 => "INT64",
        F64 => "FLOAT64",
    }
}

/// A float read from JSON equals `v`: f32 values exactly (JSON holds the
/// f32's value as a double, so even a one-ulp misparse of the double
/// rounds back to it); f64 values within a relative 1e-15 (serde_json's
/// default parser may be one ulp off; the exact bits are checked against
/// Rust literals in `metadata_of_every_type_exactly`).
fn same_float(json: &Json, v: f64, is_f32: bool) -> bool {
    let Some(j) = json.as_f64() else { return false };
    if is_f32 {
        (j as f32).to_bits() == (v as f32).to_bits()
    } else {
        j == v || ((j - v) / v).abs() < 1e-15
    }
}

fn array_matches(json: &Json, a: &Array) -> bool {
    let Some(items) = json.as_array() else { return false };
    if items.len() != a.len() {
        return false;
    }
    let ints = |xs: Vec<i128>| {
        items
            .iter()
            .zip(xs)
            .all(|(j, x)| j.as_i64().map(i128::from).or(j.as_u64().map(i128::from)) == Some(x))
    };
    match a {
        Array::U8(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::I8(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::U16(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::I16(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::U32(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::I32(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::U64(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::I64(v) => ints(v.iter().map(|&x| x.into()).collect()),
        Array::F32(v) => items.iter().zip(v).all(|(j, &x)| same_float(j, x.into(), true)),
        Array::F64(v) => items.iter().zip(v).all(|(j, &x)| same_float(j, x, false)),
        Array::Bool(v) => items.iter().zip(v).all(|(j, &x)| j.as_bool() == Some(x)),
        Array::String(v) => items.iter().zip(v).all(|(j, x)| j.as_str() == Some(x.as_str())),
        Array::Array(v) => items.iter().zip(v).all(|(j, x)| array_matches(j, x)),
    }
}

fn value_matches(json: &Json, v: &Value) -> bool {
    match v {
        Value::F32(x) => same_float(json, (*x).into(), true),
        Value::F64(x) => same_float(json, *x, false),
        Value::Bool(x) => json.as_bool() == Some(*x),
        Value::String(s) => json.as_str() == Some(s.as_str()),
        Value::Array(a) => array_matches(json, a),
        v => {
            let want = v.as_i64().map(|x| x as i128).or(v.as_u64().map(i128::from));
            let got = json.as_i64().map(i128::from).or(json.as_u64().map(i128::from));
            want.is_some() && want == got
        }
    }
}

// ---------------------------------------------------------------------------
// The fixtures read as gguf-py reads them

fn check_against_reference(g: &Gguf, stem: &str) {
    let reference = reference_json(stem);
    assert_eq!(u64::from(g.version()), reference["version"].as_u64().unwrap());
    assert_eq!(g.alignment(), reference["alignment"].as_u64().unwrap());
    assert_eq!(g.data_offset(), reference["data_offset"].as_u64().unwrap());
    assert_eq!(g.file_size(), reference["file_size"].as_u64().unwrap());

    let entries = reference["metadata"].as_array().unwrap();
    let keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    let want: Vec<&str> = entries.iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(keys, want, "metadata keys, in file order");
    for e in entries {
        let key = e["key"].as_str().unwrap();
        let v = g.get(key).unwrap();
        assert_eq!(py_type(v.value_type()), e["type"].as_str().unwrap(), "type of `{key}`");
        if let Value::Array(a) = v {
            assert_eq!(
                py_type(a.element_type()),
                e["element"].as_str().unwrap(),
                "element type of `{key}`"
            );
        }
        assert!(
            value_matches(&e["value"], v),
            "`{key}`: read {v:?}, gguf-py read {}",
            e["value"]
        );
    }

    let tensors = reference["tensors"].as_array().unwrap();
    assert_eq!(g.tensors().len(), tensors.len());
    for (t, r) in g.tensors().iter().zip(tensors) {
        assert_eq!(t.name, r["name"].as_str().unwrap());
        assert_eq!(t.ty.name(), r["type"].as_str().unwrap(), "{}", t.name);
        let dims: Vec<u64> = r["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, r["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_elements, r["n_elements"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_bytes, r["n_bytes"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(g.tensor(&t.name), Some(t));
    }

    let refs = reference_tensors(stem);
    let mut decoded = 0;
    for (name, (shape, values)) in &refs {
        if name.starts_with("hf.") {
            continue;
        }
        let info = g.tensor(name).unwrap_or_else(|| panic!("no tensor `{name}`"));
        assert_eq!(&info.shape(), shape, "{name}");
        let got = g.read_f32(name).unwrap();
        // Exact: each format's decoding is one or two f32 operations that
        // gguf-py's numpy code performs in the same order.
        assert_eq!(bits(&got), bits(values), "{name} ({})", info.ty);
        decoded += 1;
    }
    // gguf-tiny's Q5_K tensor predates wgrad's k-quants; gguf-kquants
    // holds their references.
    let decodable = g
        .tensors()
        .iter()
        .filter(|t| t.ty.is_decoded() && t.name != "test.q5_k.unsupported")
        .count();
    assert_eq!(decoded, decodable, "every decodable tensor has a reference");
}

#[test]
fn tiny_fixture_reads_as_gguf_py_reads_it() {
    let g = Gguf::open(tiny_path()).unwrap();
    check_against_reference(&g, "gguf-tiny");
    // The types it was written for are in the fixture, at more than one
    // shape (gguf-kquants holds the rest).
    for ty in &gguf::DECODED_TYPES[..6] {
        assert!(g.tensors().iter().filter(|t| t.ty == *ty).count() >= 2, "{ty}");
    }
    // The same bytes from memory read the same.
    let m = Gguf::from_bytes("tiny", tiny_bytes()).unwrap();
    assert_eq!(m.metadata(), g.metadata());
    assert_eq!(m.tensors(), g.tensors());
    for t in g.tensors() {
        assert_eq!(m.read_raw(&t.name).unwrap(), g.read_raw(&t.name).unwrap());
    }
}

/// Every block format beyond the first three (Q5_0, Q5_1, IQ4_NL and the
/// k-quants), random blocks with finite scales, decoded as gguf-py decodes
/// them, bit for bit; one file mixing the types per tensor, as a `_M`
/// file does.
#[test]
fn kquant_fixture_reads_as_gguf_py_reads_it() {
    let g = Gguf::open(fixture("gguf-kquants.gguf")).unwrap();
    let refs = reference_tensors("gguf-kquants");
    for ty in gguf::DECODED_TYPES
        .iter()
        .filter(|ty| !matches!(ty, GgmlType::F16 | GgmlType::BF16))
    {
        let name = format!("test.{}", ty.name().to_lowercase());
        let info = g.tensor(&name).unwrap_or_else(|| panic!("no tensor `{name}`"));
        assert_eq!(info.ty, *ty);
        let (shape, want) = &refs[&name];
        assert_eq!(&info.shape(), shape, "{name}");
        // Exact: each decoder performs gguf-py's f32 operations in its order.
        assert_eq!(bits(&g.read_f32(&name).unwrap()), bits(want), "{name}");
        if let Ok(format) = wgrad::ops::QuantFormat::try_from(*ty) {
            let raw = g.read_raw(&name).unwrap();
            assert_eq!(
                bits(&format.dequantize(&raw).unwrap()),
                bits(want),
                "{name} through QuantFormat"
            );
            assert_eq!(format.block_bytes() as u64, ty.type_size(), "{name}");
            assert_eq!(format.super_block() as u64, ty.block_size(), "{name}");
        }
    }
}

#[test]
fn alignment_64_fixture() {
    let g = Gguf::open(fixture("gguf-align64.gguf")).unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.get(gguf::ALIGNMENT_KEY), Some(&Value::U32(64)));
    check_against_reference(&g, "gguf-align64");
}

#[test]
fn version_2_reads_like_version_3() {
    let mut bytes = tiny_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = Gguf::from_bytes("v2.gguf", bytes).unwrap();
    let v3 = Gguf::open(tiny_path()).unwrap();
    assert_eq!(v2.version(), 2);
    assert_eq!(v2.metadata(), v3.metadata());
    assert_eq!(v2.tensors(), v3.tensors());
    for t in v3.tensors().iter().filter(|t| t.ty.is_decoded()) {
        assert_eq!(
            bits(&v2.read_f32(&t.name).unwrap()),
            bits(&v3.read_f32(&t.name).unwrap())
        );
    }
}

#[test]
fn metadata_of_every_type_exactly() {
    let g = Gguf::open(tiny_path()).unwrap();
    assert_eq!(g.get("wgrad.test.u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("wgrad.test.i8"), Some(&Value::I8(-100)));
    assert_eq!(g.get("wgrad.test.u16"), Some(&Value::U16(65000)));
    assert_eq!(g.get("wgrad.test.i16"), Some(&Value::I16(-32000)));
    assert_eq!(g.get("wgrad.test.u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(g.get("wgrad.test.i32"), Some(&Value::I32(-2_000_000_000)));
    assert_eq!(g.get("wgrad.test.f32"), Some(&Value::F32(std::f32::consts::PI)));
    assert_eq!(g.get("wgrad.test.bool_true"), Some(&Value::Bool(true)));
    assert_eq!(g.get("wgrad.test.bool_false"), Some(&Value::Bool(false)));
    assert_eq!(g.get_str("wgrad.test.string").unwrap(), "héllo, wörld ✓ \n\t\"quoted\"");
    assert_eq!(g.get("wgrad.test.u64"), Some(&Value::U64((1 << 63) + 12345)));
    assert_eq!(g.get("wgrad.test.i64"), Some(&Value::I64(-(1 << 62) - 7)));
    assert_eq!(
        g.get("wgrad.test.f64").and_then(Value::as_f64).map(f64::to_bits),
        Some(std::f64::consts::E.to_bits())
    );
    let f64s = match g.get_array("wgrad.test.array.f64").unwrap() {
        Array::F64(v) => v.clone(),
        a => panic!("{a:?}"),
    };
    assert_eq!(
        f64s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        [1.0f64 / 3.0, -0.0, 1e300].map(f64::to_bits)
    );
    assert_eq!(
        g.get_array("wgrad.test.array.u64").unwrap(),
        &Array::U64(vec![0, u64::MAX])
    );
    assert_eq!(
        g.get_array("wgrad.test.array.i64").unwrap(),
        &Array::I64(vec![i64::MIN, i64::MAX])
    );
    assert_eq!(
        g.get_array("wgrad.test.array.bool").unwrap(),
        &Array::Bool(vec![true, false, true])
    );
    assert_eq!(
        g.get_array("wgrad.test.array.nested_i32").unwrap(),
        &Array::Array(vec![
            Array::I32(vec![1, 2, 3]),
            Array::I32(vec![4]),
            Array::I32(vec![-5, 6])
        ])
    );
    assert_eq!(
        g.get_array("wgrad.test.array.nested_deep").unwrap(),
        &Array::Array(vec![
            Array::Array(vec![Array::I32(vec![1]), Array::I32(vec![2, 3])]),
            Array::Array(vec![Array::I32(vec![4, 5, 6])]),
        ])
    );
    // Typed getters widen integers and name the key and type when wrong.
    assert_eq!(g.get_u64("wgrad.test.u8").unwrap(), 200);
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 1);
    match g.get_u64("wgrad.test.i8") {
        Err(Error::Gguf { reason, .. }) => assert!(
            reason.contains("`wgrad.test.i8`") && reason.contains("an i8"),
            "{reason}"
        ),
        r => panic!("{r:?}"),
    }
    match g.get_str("wgrad.test.array.string") {
        Err(Error::Gguf { reason, .. }) => assert!(reason.contains("array of string"), "{reason}"),
        r => panic!("{r:?}"),
    }
    match g.get_str("no.such.key") {
        Err(Error::Gguf { reason, .. }) => assert!(reason.contains("no metadata `no.such.key`"), "{reason}"),
        r => panic!("{r:?}"),
    }
    // The tokenizer's metadata.
    let tokens = g.get_strings("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 3 + 256 + 12);
    assert_eq!(&tokens[..3], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    assert_eq!(g.get_strings("tokenizer.ggml.merges").unwrap()[0], "Ġ t");
    assert_eq!(g.get_u64("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(g.get_u64("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(g.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));
}

#[test]
fn raw_blocks_decode_as_the_tensor() {
    let g = Gguf::open(tiny_path()).unwrap();
    for t in g.tensors() {
        let raw = g.read_raw(&t.name).unwrap();
        assert_eq!(raw.len() as u64, t.n_bytes, "{}", t.name);
        assert_eq!(t.n_bytes, t.row_bytes() * (t.n_elements / t.row_len()), "{}", t.name);
        if !t.ty.is_decoded() {
            continue;
        }
        let values = g.read_f32(&t.name).unwrap();
        assert_eq!(
            bits(&gguf::dequantize(t.ty, &raw).unwrap()),
            bits(&values),
            "{}",
            t.name
        );
        // The block functions, one block at a time.
        let mut out = [0f32; gguf::QK];
        let blocks: Vec<f32> = match t.ty {
            GgmlType::Q8_0 => raw
                .chunks_exact(gguf::Q8_0_BYTES)
                .flat_map(|b| {
                    gguf::decode_q8_0(b.try_into().unwrap(), &mut out);
                    out
                })
                .collect(),
            GgmlType::Q4_0 => raw
                .chunks_exact(gguf::Q4_0_BYTES)
                .flat_map(|b| {
                    gguf::decode_q4_0(b.try_into().unwrap(), &mut out);
                    out
                })
                .collect(),
            GgmlType::Q4_1 => raw
                .chunks_exact(gguf::Q4_1_BYTES)
                .flat_map(|b| {
                    gguf::decode_q4_1(b.try_into().unwrap(), &mut out);
                    out
                })
                .collect(),
            _ => continue,
        };
        assert_eq!(bits(&blocks), bits(&values), "{}", t.name);
    }
}

#[test]
fn block_layouts_by_hand() {
    // Q4_0: d = 0.5 (f16 0x3800); byte j holds value j (low nibble) and
    // value j + 16 (high nibble).
    let mut b = [0u8; gguf::Q4_0_BYTES];
    b[..2].copy_from_slice(&0x3800u16.to_le_bytes());
    b[2] = 0xF0; // value 0: q 0 → -4; value 16: q 15 → 3.5
    b[3] = 0x29; // value 1: q 9 → 0.5; value 17: q 2 → -3
    let mut out = [0f32; 32];
    gguf::decode_q4_0(&b, &mut out);
    assert_eq!((out[0], out[16], out[1], out[17], out[2]), (-4.0, 3.5, 0.5, -3.0, -4.0));
    // Q4_1: d = 2, m = -1 (f16 0x4000, 0xBC00): value = 2q - 1.
    let mut b = [0u8; gguf::Q4_1_BYTES];
    b[..2].copy_from_slice(&0x4000u16.to_le_bytes());
    b[2..4].copy_from_slice(&0xBC00u16.to_le_bytes());
    b[4] = 0x3F;
    gguf::decode_q4_1(&b, &mut out);
    assert_eq!((out[0], out[16], out[1]), (29.0, 5.0, -1.0));
    // Q8_0: d = -0.25, q = -128, 127.
    let mut b = [0u8; gguf::Q8_0_BYTES];
    b[..2].copy_from_slice(&0xB400u16.to_le_bytes());
    b[2] = 0x80;
    b[3] = 0x7F;
    gguf::decode_q8_0(&b, &mut out);
    assert_eq!((out[0], out[1], out[2]), (32.0, -31.75, -0.0));
    // A length that is not whole blocks is an error, not a panic.
    assert!(gguf::dequantize(GgmlType::Q4_1, &[0u8; 21]).is_err());
    assert!(gguf::dequantize(GgmlType::F32, &[0u8; 6]).is_err());
}

#[test]
fn unsupported_type_reads_as_metadata_and_refuses_decoding() {
    // gguf-tiny's Q5_K tensor, once refused, now decodes.
    let g = Gguf::open(tiny_path()).unwrap();
    let t = g.tensor("test.q5_k.unsupported").unwrap();
    assert_eq!(
        (t.ty, t.dims.clone(), t.n_bytes),
        (GgmlType::Q5_K, vec![256, 2], 2 * 176)
    );
    let raw = g.read_raw(&t.name).unwrap();
    assert_eq!(raw.len(), 352);
    assert_eq!(
        bits(&g.read_f32(&t.name).unwrap()),
        bits(&gguf::dequantize(GgmlType::Q5_K, &raw).unwrap())
    );
    let k = Gguf::open(fixture("gguf-kquants.gguf")).unwrap();
    let t = k.tensor("test.iq4_xs.unsupported").unwrap();
    assert_eq!((t.ty, t.dims.clone(), t.n_bytes), (GgmlType::IQ4_XS, vec![256, 1], 136));
    assert_eq!(k.read_raw(&t.name).unwrap().len(), 136);
    match k.read_f32(&t.name) {
        Err(e @ Error::GgufTensor { .. }) => {
            let msg = e.to_string();
            let named = msg.contains("gguf-kquants.gguf") && msg.contains("test.iq4_xs.unsupported");
            assert!(named && msg.contains("type IQ4_XS is not supported"), "{msg}");
        }
        r => panic!("{r:?}"),
    }
    match g.read_f32("no.such.tensor") {
        Err(Error::GgufTensor { tensor, reason, .. }) => {
            assert!(tensor == "no.such.tensor" && reason.contains("no tensor"), "{reason}")
        }
        r => panic!("{r:?}"),
    }
}

// ---------------------------------------------------------------------------
// The Llama mapping

#[test]
fn llama_permutation_by_hand() {
    // One head of 4 rows: Hugging Face's rows [r0, r1 | r2, r3] are the two
    // rotary halves; the converter interleaves them as [r0, r2, r1, r3].
    let hf = [0, 1, 2, 3];
    assert_eq!(llama::permute_rows(&hf, 4, 1).unwrap(), [0, 2, 1, 3]);
    assert_eq!(llama::unpermute_rows(&[0, 2, 1, 3], 4, 1).unwrap(), hf);
    // Two heads of 6 rows, rows 2 wide: head h's row i·3 + j goes to 2j + i.
    let hf: Vec<u32> = (0..24).collect();
    let gguf_rows: Vec<u32> = [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
        .iter()
        .flat_map(|&r| [2 * r, 2 * r + 1])
        .collect();
    assert_eq!(llama::permute_rows(&hf, 12, 2).unwrap(), gguf_rows);
    assert_eq!(llama::unpermute_rows(&gguf_rows, 12, 2).unwrap(), hf);
    // Rows that do not split into heads of an even size are an error.
    assert!(llama::unpermute_rows(&[0f32; 6], 6, 2).is_err());
    assert!(llama::unpermute_rows(&[0f32; 7], 4, 1).is_err());
    assert!(llama::unpermute_rows(&[0f32; 8], 4, 0).is_err());
}

#[test]
fn llama_fixture_maps_to_hugging_face() {
    let g = Gguf::open(tiny_path()).unwrap();
    let hp = llama::Hparams::from_gguf(&g).unwrap();
    assert_eq!(
        hp,
        llama::Hparams {
            n_layer: 1,
            n_embd: 32,
            n_head: 4,
            n_kv_head: 2,
            n_ff: 64,
            n_ctx: 64,
            vocab_size: 271,
            rope_base: 100000.0,
            rope_dims: 8,
            rms_eps: 1e-5,
            tied_embeddings: true,
        }
    );
    let refs = reference_tensors("gguf-tiny");
    // q (F32, 4 heads) and k (Q4_1, 2 KV heads): the rows numpy permuted as
    // convert_hf_to_gguf.py does come back in Hugging Face's order.
    for (gguf_name, heads) in [("blk.0.attn_q.weight", 4), ("blk.0.attn_k.weight", 2)] {
        let hf = llama::hf_name(gguf_name).unwrap();
        let (_, want) = &refs[&format!("hf.{hf}")];
        assert_eq!(llama::permuted_heads(gguf_name, &hp), Some(heads));
        let (name, shape, got) = llama::read_hf_f32(&g, gguf_name, &hp).unwrap();
        assert_eq!((name.as_str(), shape[0] * shape[1]), (hf.as_str(), want.len()));
        assert_eq!(bits(&got), bits(want), "{gguf_name}");
        // Undone on the quantized rows' bytes, then decoded: the same.
        let t = g.tensor(gguf_name).unwrap();
        let raw = llama::unpermute_rows(&g.read_raw(gguf_name).unwrap(), shape[0], heads).unwrap();
        assert_eq!(
            bits(&gguf::dequantize(t.ty, &raw).unwrap()),
            bits(want),
            "{gguf_name} as blocks"
        );
        // And permuting again gives the file's rows.
        assert_eq!(
            bits(&llama::permute_rows(&got, shape[0], heads).unwrap()),
            bits(&g.read_f32(gguf_name).unwrap())
        );
    }
    // Other tensors keep their order.
    assert_eq!(llama::permuted_heads("blk.0.attn_v.weight", &hp), None);
    let (name, shape, v) = llama::read_hf_f32(&g, "blk.0.attn_v.weight", &hp).unwrap();
    assert_eq!(
        (name.as_str(), shape),
        ("model.layers.0.self_attn.v_proj.weight", vec![16, 32])
    );
    assert_eq!(bits(&v), bits(&refs["blk.0.attn_v.weight"].1));

    let names = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_norm.weight", "model.layers.12.input_layernorm.weight"),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        (
            "blk.0.ffn_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
        ),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
    ];
    for (from, to) in names {
        assert_eq!(llama::hf_name(from).as_deref(), Some(to));
    }
    for name in [
        "rope_freqs.weight",
        "blk.x.attn_q.weight",
        "blk..attn_q.weight",
        "blk.0.attn_q.scale",
        "test.f32.one",
    ] {
        assert_eq!(llama::hf_name(name), None, "{name}");
    }
    assert!(matches!(
        llama::read_hf_f32(&g, "test.f32.one", &hp),
        Err(Error::GgufTensor { .. })
    ));
}

/// A tensor with a zero dim holds no data whatever its other dim, so a
/// file may claim 2^40 rows of attn_k for free: undoing the q/k row order
/// must not walk them (it looped over every row, a hang found reading the
/// code and reproduced with fuzz/'s gguf target; the input is
/// fuzz/seeds/gguf/zero-width-attn-k.gguf).
#[test]
fn a_zero_size_q_or_k_tensor_unpermutes_at_once() {
    let mut b = tiny_bytes();
    let k = fields(&b).tensor("blk.0.attn_k.weight").dims;
    put_u64(&mut b, k, 0);
    put_u64(&mut b, k + 8, 1 << 40);
    let g = Gguf::from_bytes("zero.gguf", b).unwrap();
    let hp = llama::Hparams::from_gguf(&g).unwrap();
    let start = std::time::Instant::now();
    let (name, shape, data) = llama::read_hf_f32(&g, "blk.0.attn_k.weight", &hp).unwrap();
    assert_eq!(
        (name.as_str(), shape, data.len()),
        ("model.layers.0.self_attn.k_proj.weight", vec![1 << 40, 0], 0)
    );
    assert!(llama::unpermute_rows::<f32>(&[], 1 << 62, 4).unwrap().is_empty());
    assert!(llama::permute_rows::<u8>(&[], 1 << 62, 1).unwrap().is_empty());
    // Walking the rows took hours; nothing to move takes microseconds.
    assert!(
        start.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn llama_hparams_refuse_other_architectures() {
    let mut bytes = tiny_bytes();
    let at = find(&bytes, b"llama");
    bytes[at..at + 5].copy_from_slice(b"gemma");
    let g = Gguf::from_bytes("gemma.gguf", bytes).unwrap();
    match llama::Hparams::from_gguf(&g) {
        Err(Error::Gguf { reason, .. }) => assert!(reason.contains("architecture `gemma`"), "{reason}"),
        r => panic!("{r:?}"),
    }
}

// ---------------------------------------------------------------------------
// Broken files

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

/// Where each field of a (well-formed) GGUF file lies: a walk of the
/// format written here, independent of the reader, to corrupt fields by
/// position.
#[derive(Debug)]
pub(crate) struct Fields {
    pub(crate) kvs: Vec<KvAt>,
    pub(crate) tensors: Vec<TensorAt>,
    pub(crate) data_offset: usize,
}

#[derive(Debug)]
pub(crate) struct KvAt {
    pub(crate) key: String,
    pub(crate) key_len: usize,
    pub(crate) value_type: usize,
    pub(crate) value: usize,
}

#[derive(Debug)]
pub(crate) struct TensorAt {
    pub(crate) name: String,
    pub(crate) name_len: usize,
    pub(crate) n_dims: usize,
    pub(crate) dims: usize,
    pub(crate) ty: usize,
    pub(crate) offset: usize,
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The end of a value of type `ty` starting at `at`.
fn skip_value(b: &[u8], ty: u32, at: usize) -> usize {
    match ty {
        0 | 1 | 7 => at + 1,
        2 | 3 => at + 2,
        4..=6 => at + 4,
        10..=12 => at + 8,
        8 => at + 8 + u64_at(b, at) as usize,
        9 => {
            let ety = u32_at(b, at);
            let n = u64_at(b, at + 4);
            (0..n).fold(at + 12, |p, _| skip_value(b, ety, p))
        }
        _ => panic!("type {ty}"),
    }
}

pub(crate) fn fields(b: &[u8]) -> Fields {
    let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
    let mut at = 24;
    let mut kvs = Vec::new();
    for _ in 0..n_kv {
        let len = u64_at(b, at) as usize;
        let key = String::from_utf8(b[at + 8..at + 8 + len].to_vec()).unwrap();
        let ty_at = at + 8 + len;
        let end = skip_value(b, u32_at(b, ty_at), ty_at + 4);
        kvs.push(KvAt {
            key,
            key_len: at,
            value_type: ty_at,
            value: ty_at + 4,
        });
        at = end;
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let len = u64_at(b, at) as usize;
        let name = String::from_utf8(b[at + 8..at + 8 + len].to_vec()).unwrap();
        let n_dims_at = at + 8 + len;
        let n_dims = u32_at(b, n_dims_at) as usize;
        let ty = n_dims_at + 4 + 8 * n_dims;
        tensors.push(TensorAt {
            name,
            name_len: at,
            n_dims: n_dims_at,
            dims: n_dims_at + 4,
            ty,
            offset: ty + 4,
        });
        at = ty + 12;
    }
    Fields {
        kvs,
        tensors,
        data_offset: at.div_ceil(32) * 32,
    }
}

impl Fields {
    pub(crate) fn kv(&self, key: &str) -> &KvAt {
        self.kvs.iter().find(|k| k.key == key).unwrap()
    }
    pub(crate) fn tensor(&self, name: &str) -> &TensorAt {
        self.tensors.iter().find(|t| t.name == name).unwrap()
    }
}

/// The file-level error of a broken file, with its message.
#[track_caller]
fn file_error(bytes: &[u8], what: &str) -> String {
    match parse_bounded(bytes, what) {
        Err(e @ Error::Gguf { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("broken.gguf"), "{what}: {msg}");
            msg
        }
        Err(e) => panic!("{what}: expected Error::Gguf, got {e:?}"),
        Ok(_) => panic!("{what}: the broken file was accepted"),
    }
}

/// The tensor error of a broken file: (tensor, dtype, reason).
#[track_caller]
fn tensor_error(bytes: &[u8], what: &str) -> (String, String, String) {
    match parse_bounded(bytes, what) {
        Err(Error::GgufTensor {
            path,
            tensor,
            dtype,
            reason,
        }) => {
            assert_eq!(path, Path::new("broken.gguf"));
            (tensor, dtype, reason)
        }
        Err(e) => panic!("{what}: expected Error::GgufTensor, got {e:?}"),
        Ok(_) => panic!("{what}: the broken file was accepted"),
    }
}

#[test]
fn the_walk_matches_the_reader() {
    let bytes = tiny_bytes();
    let f = fields(&bytes);
    let g = Gguf::from_bytes("tiny", bytes.clone()).unwrap();
    assert_eq!(f.data_offset as u64, g.data_offset());
    assert_eq!(
        f.kvs.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
        g.metadata().iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()
    );
    assert_eq!(
        f.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        g.tensors().iter().map(|t| t.name.as_str()).collect::<Vec<_>>()
    );
}

#[test]
fn header_errors() {
    // The accounting sees an allocation (so the bounds checked below are not
    // vacuous).
    let (_, total, largest) = counted(|| std::hint::black_box(vec![1u8; 12345]));
    assert!(total >= 12345 && largest >= 12345, "{total} {largest}");
    let good = tiny_bytes();
    let mut b = good.clone();
    b[..4].copy_from_slice(b"GGML");
    assert!(file_error(&b, "bad magic").contains("not a GGUF file"));
    for (version, says) in [
        (1u32, "version 1"),
        (4, "unknown GGUF version 4"),
        (0x0300_0000, "big-endian"),
        (0, "unknown GGUF version 0"),
    ] {
        let mut b = good.clone();
        put_u32(&mut b, 4, version);
        let msg = file_error(&b, &format!("version {version:#x}"));
        assert!(msg.contains(says), "{msg}");
    }
    // Counts the file cannot hold: refused before anything is sized by them.
    for count in [1u64 << 40, u64::MAX, 1 << 62, 10_000] {
        let mut b = good.clone();
        put_u64(&mut b, 8, count);
        let msg = file_error(&b, &format!("{count} tensors"));
        assert!(msg.contains(&format!("claims {count} tensors")), "{msg}");
        let mut b = good.clone();
        put_u64(&mut b, 16, count);
        let msg = file_error(&b, &format!("{count} keys"));
        assert!(msg.contains(&format!("claims {count} metadata entries")), "{msg}");
    }
    // A tensor count the file could hold were the metadata smaller: found
    // once the metadata is read.
    let mut b = good.clone();
    let room = (good.len() - 24) / 24;
    put_u64(&mut b, 8, room as u64);
    assert!(file_error(&b, "tensor count after the metadata").contains("follow the metadata"));
}

#[test]
fn metadata_errors() {
    let good = tiny_bytes();
    let f = fields(&good);
    // A 2^60-byte string (a key, then a value).
    let mut b = good.clone();
    put_u64(&mut b, f.kvs[0].key_len, 1 << 60);
    let msg = file_error(&b, "2^60-byte key");
    assert!(
        msg.contains("truncated") && msg.contains("1152921504606846976 bytes"),
        "{msg}"
    );
    let mut b = good.clone();
    put_u64(&mut b, f.kv("general.name").value, 1 << 60);
    assert!(file_error(&b, "2^60-byte string").contains("metadata `general.name`"));
    // An array claiming 2^40 strings, or u64s.
    for key in [
        "tokenizer.ggml.tokens",
        "wgrad.test.array.u64",
        "wgrad.test.array.nested_i32",
    ] {
        let mut b = good.clone();
        put_u64(&mut b, f.kv(key).value + 4, 1 << 40);
        let msg = file_error(&b, &format!("2^40 elements in {key}"));
        assert!(msg.contains(&format!("`{key}` claims 1099511627776 elements")), "{msg}");
    }
    // Unknown value types, of a value and of an array's elements.
    let mut b = good.clone();
    put_u32(&mut b, f.kv("wgrad.test.u8").value_type, 13);
    assert!(file_error(&b, "value type 13").contains("unknown value type 13"));
    let mut b = good.clone();
    put_u32(&mut b, f.kv("wgrad.test.array.u8").value, 99);
    assert!(file_error(&b, "element type 99").contains("array of unknown value type 99"));
    // A bool that is neither 0 nor 1.
    let mut b = good.clone();
    b[f.kv("wgrad.test.bool_true").value] = 2;
    assert!(file_error(&b, "bool 2").contains("neither 0 nor 1"));
    // A string that is not UTF-8.
    let mut b = good.clone();
    b[f.kv("general.name").value + 8] = 0xff;
    assert!(file_error(&b, "not UTF-8").contains("not UTF-8"));
    // A key that appears twice: `wgrad.test.i8` renamed `wgrad.test.u8`.
    let mut b = good.clone();
    let (u8_key, i8_key) = (f.kv("wgrad.test.u8"), f.kv("wgrad.test.i8"));
    b.copy_within(u8_key.key_len + 8..u8_key.value_type, i8_key.key_len + 8);
    assert!(file_error(&b, "key twice").contains("metadata `wgrad.test.u8` appears twice"));
    // general.alignment: a u32 power of two (gguf-py and llama.cpp insist
    // on the u32).
    let a64 = std::fs::read(fixture("gguf-align64.gguf")).unwrap();
    let fa = fields(&a64);
    let at = fa.kv("general.alignment");
    for value in [0u32, 48, 3] {
        let mut b = a64.clone();
        put_u32(&mut b, at.value, value);
        assert!(file_error(&b, &format!("alignment {value}")).contains("power of two"));
    }
    let mut b = a64.clone();
    put_u32(&mut b, at.value_type, 5); // i32 64
    assert!(file_error(&b, "alignment as i32").contains("not an i32"));
}

#[test]
fn duplicate_key_and_deep_nesting() {
    // Files built here: a header of metadata only.
    fn file(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (key, ty, value) in kvs {
            b.extend((key.len() as u64).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        b
    }
    let ok = file(&[
        ("a", 4, 7u32.to_le_bytes().to_vec()),
        ("b", 4, 8u32.to_le_bytes().to_vec()),
    ]);
    let g = Gguf::from_bytes("ok", ok).unwrap();
    assert_eq!(g.get_u64("b").unwrap(), 8);
    assert!(g.tensors().is_empty());
    let twice = file(&[
        ("a", 4, 7u32.to_le_bytes().to_vec()),
        ("a", 4, 8u32.to_le_bytes().to_vec()),
    ]);
    assert!(file_error(&twice, "key twice").contains("`a` appears twice"));
    // Arrays nested `depth` deep, one element each, an empty u8 array inside.
    let nested = |depth: usize| {
        let mut v = Vec::new();
        for _ in 0..depth {
            v.extend(9u32.to_le_bytes());
            v.extend(1u64.to_le_bytes());
        }
        v.extend(0u32.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        v
    };
    let g = Gguf::from_bytes("deep", file(&[("n", 9, nested(gguf::MAX_NESTING - 1))])).unwrap();
    assert_eq!(g.get_array("n").unwrap().len(), 1);
    assert!(file_error(&file(&[("n", 9, nested(gguf::MAX_NESTING))]), "too deep").contains("nests arrays deeper"));
    // Far deeper than any stack would take, were it recursed.
    assert!(file_error(&file(&[("n", 9, nested(1_000_000))]), "a million deep").contains("nests arrays deeper"));
}

#[test]
fn tensor_info_errors() {
    let good = tiny_bytes();
    let f = fields(&good);
    let q = f.tensor("blk.0.attn_k.weight");
    // An unknown type id (and a removed one).
    for id in [4u32, 31, 77, u32::MAX] {
        let mut b = good.clone();
        put_u32(&mut b, q.ty, id);
        let (tensor, dtype, reason) = tensor_error(&b, &format!("type id {id}"));
        assert_eq!(
            (tensor.as_str(), dtype),
            ("blk.0.attn_k.weight", format!("type id {id}"))
        );
        assert!(reason.contains(&format!("unknown tensor type id {id}")), "{reason}");
    }
    // Data past the end of the file.
    let mut b = good.clone();
    put_u64(&mut b, q.offset, good.len() as u64);
    let (tensor, dtype, reason) = tensor_error(&b, "offset past the end");
    assert_eq!(
        (tensor.as_str(), dtype.as_str()),
        ("blk.0.attn_k.weight", "Q4_1 [32, 16]")
    );
    assert!(reason.contains("past the end of the file"), "{reason}");
    // An offset so large the end overflows.
    let mut b = good.clone();
    put_u64(&mut b, q.offset, u64::MAX - 31);
    assert!(tensor_error(&b, "offset overflow").2.contains("past the end"));
    // A misaligned offset.
    let mut b = good.clone();
    let off = u64_at(&good, q.offset);
    put_u64(&mut b, q.offset, off + 2);
    assert!(tensor_error(&b, "misaligned")
        .2
        .contains("not a multiple of the alignment 32"));
    // Overlapping another tensor's data.
    let mut b = good.clone();
    let other = f.tensor("blk.0.attn_v.weight");
    put_u64(&mut b, other.offset, off);
    let (tensor, _, reason) = tensor_error(&b, "overlap");
    assert!(reason.contains("overlaps tensor"), "{reason}");
    assert!(tensor == "blk.0.attn_k.weight" || tensor == "blk.0.attn_v.weight");
    // Dims whose product overflows, or passes 2^63.
    for (d0, d1) in [
        (1u64 << 32, 1u64 << 32),
        (32, 1 << 59),
        (u64::MAX - 31, 2),
        (32, 1 << 63),
        (0, u64::MAX),
    ] {
        let mut b = good.clone();
        put_u64(&mut b, q.dims, d0);
        put_u64(&mut b, q.dims + 8, d1);
        let (_, _, reason) = tensor_error(&b, &format!("dims {d0} × {d1}"));
        assert!(reason.contains("pass 2^63 elements"), "{reason}");
    }
    // Huge dims whose product fits: far more data than the file has.
    let mut b = good.clone();
    put_u64(&mut b, q.dims + 8, 1 << 40);
    assert!(tensor_error(&b, "huge tensor").2.contains("past the end"));
    // A quantized row that is not whole blocks.
    let mut b = good.clone();
    put_u64(&mut b, q.dims, 48);
    put_u64(&mut b, q.dims + 8, 8);
    assert!(tensor_error(&b, "row of 48")
        .2
        .contains("48 values is not a whole number of Q4_1's 32-value blocks"));
    // Too many dimensions.
    let mut b = good.clone();
    put_u32(&mut b, q.n_dims, 5);
    assert!(tensor_error(&b, "5 dims").2.contains("5 dimensions"));
    // A tensor name that appears twice.
    let mut b = good.clone();
    let v = f.tensor("blk.0.attn_v.weight");
    assert_eq!(u64_at(&b, v.name_len), u64_at(&b, q.name_len));
    b.copy_within(q.name_len + 8..q.n_dims, v.name_len + 8);
    let (tensor, _, reason) = tensor_error(&b, "name twice");
    assert_eq!(
        (tensor.as_str(), reason.as_str()),
        ("blk.0.attn_k.weight", "appears twice in the file")
    );
    // A 2^60-byte tensor name.
    let mut b = good.clone();
    put_u64(&mut b, q.name_len, 1 << 60);
    assert!(file_error(&b, "2^60-byte name").contains("the name of tensor"));
}

/// Broken files of the formats after Q4_1: a row that is not whole
/// super-blocks and a super-block cut short by the file's end refuse to
/// open; a NaN or infinite f16 scale (d, dmin) refuses to decode or load,
/// each naming the tensor, its type and dims.
#[test]
fn broken_kquant_tensors_are_clear_errors() {
    let good = std::fs::read(fixture("gguf-kquants.gguf")).unwrap();
    let f = fields(&good);
    let q4k = f.tensor("test.q4_k");
    // A row of 128 values (4 super-blocks' worth of values in 8 rows).
    let mut b = good.clone();
    put_u64(&mut b, q4k.dims, 128);
    put_u64(&mut b, q4k.dims + 8, 8);
    let (tensor, dtype, reason) = tensor_error(&b, "row of 128");
    assert_eq!((tensor.as_str(), dtype.as_str()), ("test.q4_k", "Q4_K [128, 8]"));
    assert!(
        reason.contains("128 values is not a whole number of Q4_K's 256-value blocks"),
        "{reason}"
    );
    // The file ends 100 bytes into Q6_K's last super-block.
    let q6k = f.tensor("test.q6_k");
    let end = f.data_offset + u64_at(&good, q6k.offset) as usize + 840 - 100;
    let (tensor, dtype, reason) = tensor_error(&good[..end], "cut short");
    assert_eq!((tensor.as_str(), dtype.as_str()), ("test.q6_k", "Q6_K [512, 2]"));
    assert!(reason.contains("past the end of the file"), "{reason}");
    // Non-finite scales: Q4_K's d of block 1 NaN, its dmin of block 3
    // infinite; Q6_K's d (at byte 208) of block 0 −inf.
    for (name, block, at, bits, shown) in [
        ("test.q4_k", 1, 0, 0x7e00u16, "NaN"),
        ("test.q4_k", 3, 2, 0x7c00, "inf"),
        ("test.q6_k", 0, 208, 0xfc00, "-inf"),
    ] {
        let t = f.tensor(name);
        let ty = if name == "test.q4_k" {
            GgmlType::Q4_K
        } else {
            GgmlType::Q6_K
        };
        let start = f.data_offset + u64_at(&good, t.offset) as usize + block * ty.type_size() as usize + at;
        let mut b = good.clone();
        b[start..start + 2].copy_from_slice(&bits.to_le_bytes());
        let g = Gguf::from_bytes("broken.gguf", b).unwrap();
        let errors = [g.read_f32(name).unwrap_err(), g.read_quantized(name).unwrap_err()];
        for err in errors {
            let Error::GgufTensor {
                tensor, dtype, reason, ..
            } = &err
            else {
                panic!("{err:?}")
            };
            assert_eq!(
                (tensor.as_str(), dtype.as_str()),
                (name, format!("{ty} [512, 2]").as_str())
            );
            let what = format!("block {block} (values {}..{})", 256 * block, 256 * (block + 1));
            assert!(
                reason.contains(&what) && reason.contains(&format!("non-finite f16 scale ({shown})")),
                "{reason}"
            );
        }
        // The other tensors still load.
        assert!(g.read_quantized("test.q5_k").is_ok());
    }
}

#[test]
fn every_truncation_of_the_header_is_an_error() {
    let good = tiny_bytes();
    let f = fields(&good);
    // Every length up to the data section: the header, metadata and tensor
    // infos cut at every byte, then into the padding.
    for len in 0..f.data_offset {
        let msg = match parse_bounded(&good[..len], &format!("truncated to {len}")) {
            Err(e @ (Error::Gguf { .. } | Error::GgufTensor { .. })) => e.to_string(),
            r => panic!("truncated to {len} bytes: {r:?}"),
        };
        assert!(msg.contains("broken.gguf"), "{msg}");
    }
    // Into the tensor data: the tensors whose data is cut are named.
    let g = Gguf::from_bytes("tiny", good.clone()).unwrap();
    let last = g.tensors().iter().max_by_key(|t| t.offset).unwrap();
    let end = (g.data_offset() + last.offset + last.n_bytes) as usize;
    for len in [f.data_offset, f.data_offset + 1, (f.data_offset + end) / 2, end - 1] {
        let (tensor, dtype, reason) = tensor_error(&good[..len], &format!("data truncated to {len}"));
        assert!(
            g.tensor(&tensor).is_some() && !dtype.is_empty() && reason.contains("past the end of the file"),
            "{reason}"
        );
    }
    // The file cut after its last tensor's data (before the padding) reads.
    assert!(Gguf::from_bytes("tiny", good[..end].to_vec()).is_ok());
}

#[test]
fn a_file_that_shrinks_after_opening_is_an_error() {
    let dir = std::env::temp_dir().join(format!("wgrad-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("shrinks.gguf");
    let good = tiny_bytes();
    std::fs::write(&path, &good).unwrap();
    let g = Gguf::open(&path).unwrap();
    let last = g.tensors().iter().max_by_key(|t| t.offset).unwrap().name.clone();
    std::fs::write(&path, &good[..good.len() - 200]).unwrap();
    let r = g.read_raw(&last);
    std::fs::remove_dir_all(&dir).unwrap();
    match r {
        Err(Error::GgufTensor { tensor, reason, .. }) => {
            assert!(tensor == last && reason.contains("past the end"), "{reason}")
        }
        r => panic!("{r:?}"),
    }
    match Gguf::open(dir.join("missing.gguf")) {
        Err(Error::DataIo { path, .. }) => assert!(path.ends_with("missing.gguf")),
        r => panic!("{r:?}"),
    }
}

/// Seeded random corruptions: 1–4 bytes set to random values, at random
/// places in `region`; each file parses to a value or an error, every
/// tensor of an accepted one reads or errs, and nothing panics or
/// allocates beyond the file's allowance.
fn random_flips(seed: u64, region: std::ops::Range<usize>, count: usize) -> usize {
    let good = tiny_bytes();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut accepted = 0;
    for i in 0..count {
        let mut b = good.clone();
        let flips = rng.random_range(1..=4);
        for _ in 0..flips {
            let at = rng.random_range(region.clone());
            b[at] = rng.random();
        }
        let r = std::panic::catch_unwind(|| parse_bounded(&b, &format!("flip {i} of seed {seed}")).is_ok());
        match r {
            Ok(ok) => accepted += usize::from(ok),
            Err(_) => panic!("corruption {i} of seed {seed} panicked"),
        }
    }
    accepted
}

#[test]
fn random_byte_flips_in_the_first_kilobyte() {
    let accepted = random_flips(25, 0..1024, 3000);
    eprintln!("{accepted} of 3000 corrupted files accepted");
    // Most flips in the metadata's strings keep the file valid; the count
    // shows both outcomes were exercised.
    assert!(accepted > 0 && accepted < 3000, "{accepted} of 3000 accepted");
}

#[test]
fn random_byte_flips_in_the_tensor_infos() {
    let f = fields(&tiny_bytes());
    let start = f.tensors[0].name_len;
    random_flips(26, start..f.data_offset, 1500);
}
