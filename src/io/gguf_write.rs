//! GGUF files written on the host ([`GgufWriter`]): version 3, metadata of
//! every value type, tensor infos and the tensor data, each tensor at an
//! offset that is a multiple of the alignment (`general.alignment`, 32 by
//! default), as llama.cpp's and gguf-py's writers lay it out (see
//! [`crate::io::gguf`] for the format). The quantizers write ggml's blocks
//! bit for bit as ggml's reference quantizers (and gguf-py's `quantize`)
//! do: Q8_0, Q4_0 and Q4_1, and F16 and F32 values.
//!
//! [`merged_gguf`] is what `wgrad export --format gguf` writes: a base
//! GGUF file's metadata (architecture, sizes, tokenizer, chat template)
//! and tensors, with the weights a LoRA adapter was merged into replaced
//! and every matrix stored as one type.
//!
//! Everything here works on bytes ([`GgufWriter::to_bytes`]); only
//! [`GgufWriter::write`] touches the disk.

use std::collections::HashMap;
use std::path::Path;

use half::f16;

use crate::error::{Error, Result};
use crate::io::gguf::{GgmlType, Value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_DIMS};
use crate::io::gguf_model::GgufModel;

/// ggml's GGML_MAX_NAME: a tensor name is at most 63 bytes.
pub const MAX_NAME_BYTES: usize = 63;
/// The metadata key of the file's main tensor type (llama.cpp's `llama_ftype`).
pub const FILE_TYPE_KEY: &str = "general.file_type";
/// The metadata key of the quantization scheme's version (2 since ggml's
/// current legacy block layouts).
pub const QUANTIZATION_VERSION_KEY: &str = "general.quantization_version";
const GGUF_VERSION: u32 = 3;

/// The types [`quantize`] writes.
pub const WRITTEN_TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
];

/// One tensor to write: its name, shape in ggml's order (`dims[0]`, a row's
/// length, first) and its bytes as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: Vec<u8>,
}

/// A GGUF file being assembled: metadata in insertion order, then tensors
/// in insertion order. Every entry is checked as it is added.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorData>,
}

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "GgufWriter",
        reason,
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the metadata `key` (replacing its value where set, keeping its
    /// place); `general.alignment` must be a u32 power of two.
    pub fn set(&mut self, key: &str, value: Value) -> Result<()> {
        if key.is_empty() {
            return Err(invalid("an empty metadata key".into()));
        }
        if key == ALIGNMENT_KEY && !matches!(value, Value::U32(a) if a.is_power_of_two()) {
            return Err(invalid(format!(
                "`{ALIGNMENT_KEY}` must be a u32 power of two, not {value:?}"
            )));
        }
        check_value(key, &value, 0)?;
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        Ok(())
    }

    /// The metadata set so far.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The tensors added so far.
    pub fn tensors(&self) -> &[TensorData] {
        &self.tensors
    }

    /// Adds a tensor of row-major `shape` (a matrix [out, in]) stored as
    /// `data`, which must be `ty`'s bytes for that shape (whole blocks per
    /// row).
    pub fn add_tensor(&mut self, name: &str, shape: &[usize], ty: GgmlType, data: Vec<u8>) -> Result<()> {
        let bad = |reason: String| invalid(format!("tensor `{name}` {shape:?} {ty}: {reason}"));
        if name.is_empty() || name.len() > MAX_NAME_BYTES {
            return Err(bad(format!("a name of 1 to {MAX_NAME_BYTES} bytes (ggml's limit)")));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(bad("the name is taken by an earlier tensor".into()));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return Err(bad(format!("1 to {MAX_DIMS} dimensions")));
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let expected = stored_bytes(ty, &dims).map_err(bad)?;
        if data.len() as u64 != expected {
            return Err(bad(format!("{} bytes given, {expected} expected", data.len())));
        }
        self.tensors.push(TensorData {
            name: name.to_string(),
            dims,
            ty,
            data,
        });
        Ok(())
    }

    /// Adds `values` (row-major `shape`) stored as `ty` ([`quantize`]).
    pub fn add_values(&mut self, name: &str, shape: &[usize], ty: GgmlType, values: &[f32]) -> Result<()> {
        if values.len() != shape.iter().product::<usize>() {
            return Err(invalid(format!(
                "tensor `{name}` {shape:?}: {} values given",
                values.len()
            )));
        }
        let row = shape.last().copied().unwrap_or(1);
        let data =
            quantize(ty, values, row).map_err(|reason| invalid(format!("tensor `{name}` {shape:?}: {reason}")))?;
        self.add_tensor(name, shape, ty, data)
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, Value::U32(a))) => u64::from(*a),
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let alignment = self.alignment();
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = align(offset + t.data.len() as u64, alignment);
        }
        pad_to(&mut out, alignment);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad_to(&mut out, alignment);
        }
        Ok(out)
    }

    /// Writes the file at `path`, atomically (the previous file, or the
    /// whole new one).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        crate::atomic_write::write_atomic(path, &self.to_bytes()?).map_err(|(action, source)| Error::CheckpointIo {
            path: path.to_path_buf(),
            action,
            source,
        })
    }
}

/// A metadata value GGUF can hold: arrays nest no deeper than the reader
/// accepts, an array of arrays holds arrays only.
fn check_value(key: &str, value: &Value, depth: usize) -> Result<()> {
    let Value::Array(array) = value else {
        return Ok(());
    };
    check_array(key, array, depth)
}

fn check_array(key: &str, array: &crate::io::gguf::Array, depth: usize) -> Result<()> {
    use crate::io::gguf::{Array, MAX_NESTING};
    if depth >= MAX_NESTING {
        return Err(invalid(format!(
            "`{key}` nests arrays deeper than {MAX_NESTING} levels"
        )));
    }
    if let Array::Array(items) = array {
        for item in items {
            check_array(key, item, depth + 1)?;
        }
    }
    Ok(())
}

fn align(x: u64, alignment: u64) -> u64 {
    x.div_ceil(alignment) * alignment
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    let len = align(out.len() as u64, alignment) as usize;
    out.resize(len, 0);
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// An array value: element type, count, elements (an array of arrays
/// writes each element array with its own type and count).
fn put_array(out: &mut Vec<u8>, array: &crate::io::gguf::Array) {
    use crate::io::gguf::Array;
    out.extend_from_slice(&array.element_type().id().to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    fn each<T>(out: &mut Vec<u8>, items: &[T], f: impl Fn(&T) -> Vec<u8>) {
        for item in items {
            out.extend_from_slice(&f(item));
        }
    }
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::U16(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::I16(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::U32(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::I32(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::F32(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::Bool(v) => each(out, v, |x| vec![u8::from(*x)]),
        Array::String(v) => {
            for s in v {
                put_string(out, s);
            }
        }
        Array::Array(v) => {
            for a in v {
                put_array(out, a);
            }
        }
        Array::U64(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::I64(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
        Array::F64(v) => each(out, v, |x| x.to_le_bytes().to_vec()),
    }
}

/// Bytes of a tensor of `ty` with ggml `dims`, or why it cannot be stored
/// (a row that is not whole blocks, a size past u64).
fn stored_bytes(ty: GgmlType, dims: &[u64]) -> std::result::Result<u64, String> {
    let row = dims.first().copied().unwrap_or(1);
    if row % ty.block_size() != 0 {
        return Err(format!(
            "rows of {row} values are not whole {ty} blocks of {}",
            ty.block_size()
        ));
    }
    dims.iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|n| (n / ty.block_size()).checked_mul(ty.type_size()))
        .ok_or_else(|| "the size overflows".to_string())
}

// ---------------------------------------------------------------------------
// Quantizers

/// `values` (rows of `row_len` values) stored as `ty`, one of
/// [`WRITTEN_TYPES`], as ggml's reference quantizers write them. The
/// error is a reason: a row that is not whole blocks, a value that is not
/// finite, one past f16's range for an f16 tensor or scale.
pub fn quantize(ty: GgmlType, values: &[f32], row_len: usize) -> std::result::Result<Vec<u8>, String> {
    if let Some(v) = values.iter().find(|v| !v.is_finite()) {
        return Err(format!("a value of {v} cannot be stored"));
    }
    let block = ty.block_size() as usize;
    if row_len == 0 || row_len % block != 0 || values.len() % row_len != 0 {
        return Err(format!("rows of {row_len} values are not whole {ty} blocks of {block}"));
    }
    let out: Vec<u8> = match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        GgmlType::Q8_0 => values.chunks(block).flat_map(quantize_q8_0_block).collect(),
        GgmlType::Q4_0 => values.chunks(block).flat_map(quantize_q4_0_block).collect(),
        GgmlType::Q4_1 => values.chunks(block).flat_map(quantize_q4_1_block).collect(),
        other => {
            return Err(format!(
                "wgrad writes {} tensors, not {other}",
                WRITTEN_TYPES.map(GgmlType::name).join(", ")
            ))
        }
    };
    // f16 has no infinity a model means: a value or a scale past ±65504.
    let f16_overflow = match ty {
        GgmlType::F16 => values.iter().any(|&v| f16::from_f32(v).is_infinite()),
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let per_block = ty.type_size() as usize;
            let scales = if ty == GgmlType::Q4_1 { 2 } else { 1 };
            out.chunks(per_block)
                .any(|b| (0..scales).any(|s| f16::from_le_bytes([b[2 * s], b[2 * s + 1]]).is_infinite()))
        }
        _ => false,
    };
    if f16_overflow {
        return Err(format!(
            "a value is too large for {ty}'s f16 values or scales (past ±65504)"
        ));
    }
    Ok(out)
}

/// ggml's `quantize_row_q8_0_ref`: d = max|x| / 127, q = round(x / d)
/// (halves away from zero), d stored as f16.
fn quantize_q8_0_block(x: &[f32]) -> Vec<u8> {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend(x.iter().map(|&v| ((v * id).round() as i8) as u8));
    out
}

/// ggml's `quantize_row_q4_0_ref`: the value of largest magnitude (the
/// first, on a tie) gives d = max / -8; q = min(15, trunc(x / d + 8.5));
/// value j of the block's first half in byte j's low nibble, of the second
/// half in its high nibble.
fn quantize_q4_0_block(x: &[f32]) -> Vec<u8> {
    let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| ((v * id + 8.5) as u8).min(15);
    let half = x.len() / 2;
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend((0..half).map(|j| q(x[j]) | (q(x[half + j]) << 4)));
    out
}

/// ggml's `quantize_row_q4_1_ref`: d = (max − min) / 15, m = min,
/// q = min(15, trunc((x − min) / d + 0.5)); d then m as f16, nibbles as Q4_0.
fn quantize_q4_1_block(x: &[f32]) -> Vec<u8> {
    let (min, max) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    });
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
    let half = x.len() / 2;
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
    out.extend((0..half).map(|j| q(x[j]) | (q(x[half + j]) << 4)));
    out
}

/// llama.cpp's `llama_ftype` of a file whose matrices are `ty`.
pub fn file_type(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::F32 => Some(0),
        GgmlType::F16 => Some(1),
        GgmlType::Q4_0 => Some(2),
        GgmlType::Q4_1 => Some(3),
        GgmlType::Q8_0 => Some(7),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// A merged model

/// What [`merged_gguf`] did, for the caller to report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MergedGguf {
    /// Tensors by the type they are stored as, in ggml's names.
    pub types: Vec<(GgmlType, usize)>,
    /// Matrices that are not whole blocks of the asked type, stored F16
    /// instead (as llama.cpp's converter falls back).
    pub fallbacks: Vec<String>,
    /// Tensors whose merged weights replaced the base's.
    pub merged: usize,
}

/// The base file `base` with the parameters in `weights` (wgrad names,
/// row-major values in the model's layout, which for every Linear is the
/// file's: [`Lora::merged_weights`](crate::nn::Lora::merged_weights) over
/// the model the file builds) replaced, every matrix stored as `ty` and
/// every other tensor (norms, biases) as the base stores it; the base's
/// metadata (tokenizer and chat template included) with
/// `general.file_type` set to `ty`'s. A matrix the adapter did not change
/// that the base already stores as `ty` keeps its bytes. Rows that are not
/// whole blocks of `ty` are stored F16 ([`MergedGguf::fallbacks`]).
pub fn merged_gguf(base: &GgufModel, weights: &[(String, Vec<f32>)], ty: GgmlType) -> Result<(GgufWriter, MergedGguf)> {
    let file_type = file_type(ty).ok_or_else(|| {
        invalid(format!(
            "a merged model is written as F32, F16, Q8_0, Q4_0 or Q4_1, not {ty}"
        ))
    })?;
    let gguf = base.gguf();
    let mut writer = GgufWriter::new();
    for (key, value) in gguf.metadata() {
        writer.set(key, value.clone())?;
    }
    writer.set(FILE_TYPE_KEY, Value::U32(file_type))?;
    if !matches!(ty, GgmlType::F32 | GgmlType::F16) {
        writer.set(QUANTIZATION_VERSION_KEY, Value::U32(2))?;
    }
    let param_of: HashMap<&str, &str> = base
        .parameters()
        .iter()
        .map(|(param, tensor)| (tensor.as_str(), param.as_str()))
        .collect();
    let mut report = MergedGguf::default();
    for (param, _) in weights {
        if !base.parameters().iter().any(|(p, _)| p == param) {
            return Err(invalid(format!(
                "merged weight `{param}` is not a parameter of {}",
                gguf.path().display()
            )));
        }
    }
    for info in gguf.tensors() {
        let merged = param_of
            .get(info.name.as_str())
            .and_then(|p| weights.iter().find(|(name, _)| name == p))
            .map(|(_, values)| values);
        let shape = info.shape();
        let target = if info.dims.len() != 2 {
            info.ty
        } else if info.row_len() % ty.block_size() != 0 {
            report.fallbacks.push(info.name.clone());
            GgmlType::F16
        } else {
            ty
        };
        match merged {
            Some(values) => {
                report.merged += 1;
                writer.add_values(&info.name, &shape, target, values)?
            }
            None if target == info.ty => writer.add_tensor(&info.name, &shape, target, gguf.read_raw(&info.name)?)?,
            None => writer.add_values(&info.name, &shape, target, &gguf.read_f32(&info.name)?)?,
        }
        match report.types.iter_mut().find(|(t, _)| *t == target) {
            Some(entry) => entry.1 += 1,
            None => report.types.push((target, 1)),
        }
    }
    Ok((writer, report))
}
