//! GGUF files (llama.cpp's model format), versions 2 and 3, read on the
//! host: the header, metadata of every value type, tensor infos, and the
//! tensors of types F32, F16, BF16, Q8_0, Q4_0 and Q4_1 decoded to f32 (or
//! their raw block bytes, for kernels that decode them on the GPU).
//!
//! A GGUF file is, all little-endian:
//!
//! ```text
//! "GGUF"  version: u32  tensor_count: u64  kv_count: u64
//! kv_count × (key: string, value_type: u32, value)
//! tensor_count × (name: string, n_dims: u32, dims: n_dims × u64, type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data: each tensor at data start + offset
//! ```
//!
//! where a string is a u64 byte length and UTF-8 bytes, and an array value is
//! an element type (u32), a count (u64) and the elements (arrays nest).
//! `dims` are ggml's order, fastest-varying first: a Hugging Face weight of
//! shape [out, in] has dims [in, out] ([`TensorInfo::shape`] gives the
//! row-major shape). Version 1 used u32 counts and lengths; version 2 moved
//! to u64 and version 3 only added big-endian files, so v2 and v3 read alike.
//!
//! Model files come from the internet, so the reader trusts nothing in one:
//! every count and length is checked against the bytes the file has left
//! before anything is allocated for it (a header claiming 2^40 tensors or a
//! 2^60-byte string is an error, not an allocation), every size is computed
//! with checked arithmetic, arrays nest at most [`MAX_NESTING`] deep (no
//! stack overflow), and every tensor's data must lie inside the file,
//! aligned, without overlapping another's. Failures are [`Error::Gguf`] or
//! [`Error::GgufTensor`], naming the file (and the tensor and its type).
//!
//! Why no crate: the GGUF readers on crates.io were checked (December 2026)
//! and none meets those rules. `ggus` 0.5 reserves `header.tensor_count`
//! and `kv_count` entries up front (a lying header aborts the process) and
//! reads only v3; `gguf-rs` 0.1 allocates each string at its declared length
//! up to a fixed cap before reading it; `gguf-rs-lib` 0.3 is hardened with
//! fixed budgets (256 MiB of metadata, 100 000 keys) rather than the file's
//! size, so a 100-byte file can still make it allocate hundreds of MiB;
//! candle-core's reader comes with a whole tensor framework. The format is
//! small, so wgrad reads it itself; the block decoders below are also the
//! plain-Rust reference the GPU kernels are tested against.
//!
//! [`llama`] maps a llama.cpp Llama file to Hugging Face's names and row
//! order (the converter permutes the rows of attn_q and attn_k).
//!
//! This module works on host copies only; it knows no devices.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};

/// Data alignment when the file has no `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the data alignment (a u32 power of two).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of arrays inside arrays accepted (llama.cpp's writers
/// use one level), so a file cannot recurse the parser off its stack.
pub const MAX_NESTING: usize = 8;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;

const MAGIC: [u8; 4] = *b"GGUF";
/// The smallest encoding of one metadata entry: key length (u64), value
/// type (u32), a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// The smallest tensor info: name length (u64), n_dims (u32), type (u32),
/// offset (u64).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

// ---------------------------------------------------------------------------
// Tensor types

/// A ggml tensor type, as GGUF stores it (ids from ggml.h). All are
/// readable as tensor infos; [`GgmlType::is_decoded`] says which wgrad
/// decodes.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, id, name, values per block, bytes per block), from ggml's type
/// traits (gguf-py's GGML_QUANT_SIZES). Ids 4, 5, 31–33 and 36–38 belonged
/// to types ggml has removed and are unknown here, as in llama.cpp.
const TYPES: [(GgmlType, u32, &str, u64, u64); 34] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 40),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 36),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 18),
];

/// The types [`Gguf::read_f32`] decodes.
pub const DECODED_TYPES: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

impl GgmlType {
    /// The type of a GGUF type id; `None` for ids ggml does not (or no
    /// longer) define.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    fn traits(self) -> (u32, &'static str, u64, u64) {
        // Every variant is in TYPES; the fallback is never taken.
        TYPES
            .iter()
            .find(|t| t.0 == self)
            .map(|t| (t.1, t.2, t.3, t.4))
            .unwrap_or((u32::MAX, "?", 1, 1))
    }

    /// The id GGUF stores.
    pub fn id(self) -> u32 {
        self.traits().0
    }

    /// ggml's name (`Q4_1`, `BF16`).
    pub fn name(self) -> &'static str {
        self.traits().1
    }

    /// Values per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.traits().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.traits().3
    }

    /// Whether [`Gguf::read_f32`] decodes this type.
    pub fn is_decoded(self) -> bool {
        DECODED_TYPES.contains(&self)
    }
}

/// The block-quantized formats the kernels read as they are stored; any
/// other type is handed back (to be decoded to f32 or refused).
impl TryFrom<GgmlType> for crate::ops::QuantFormat {
    type Error = GgmlType;

    fn try_from(ty: GgmlType) -> std::result::Result<Self, GgmlType> {
        match ty {
            GgmlType::Q8_0 => Ok(crate::ops::QuantFormat::Q8_0),
            GgmlType::Q4_0 => Ok(crate::ops::QuantFormat::Q4_0),
            GgmlType::Q4_1 => Ok(crate::ops::QuantFormat::Q4_1),
            GgmlType::Q5_0 => Ok(crate::ops::QuantFormat::Q5_0),
            GgmlType::Q5_1 => Ok(crate::ops::QuantFormat::Q5_1),
            GgmlType::IQ4_NL => Ok(crate::ops::QuantFormat::IQ4_NL),
            GgmlType::Q2_K => Ok(crate::ops::QuantFormat::Q2_K),
            GgmlType::Q3_K => Ok(crate::ops::QuantFormat::Q3_K),
            GgmlType::Q4_K => Ok(crate::ops::QuantFormat::Q4_K),
            GgmlType::Q5_K => Ok(crate::ops::QuantFormat::Q5_K),
            GgmlType::Q6_K => Ok(crate::ops::QuantFormat::Q6_K),
            other => Err(other),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------
// Metadata values

/// The type of a metadata value (ids from the GGUF spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id GGUF stores (the inverse of [`ValueType::from_id`]).
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The spec's name (`u32`, `string`, `array`).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in a file: its size,
    /// a string's length field, an array's element type and count. Counts
    /// are checked against this before anything is allocated for them.
    fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements of one type. An array of arrays holds
/// arrays whose element types may differ from one another.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer of any width, as i128 (holds every u64 and i64).
    fn integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type holding a value ≥ 0 (writers differ in the width
    /// and signedness they give counts).
    pub fn as_u64(&self) -> Option<u64> {
        self.integer().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer type holding a value that fits i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.integer().and_then(|v| i64::try_from(v).ok())
    }

    /// An f32 or f64 (the latter rounded to f32).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// `u32`, or `array of string` for arrays.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.element_type().name()),
            v => v.value_type().name().to_string(),
        }
    }
}

impl Array {
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---------------------------------------------------------------------------
// Tensor infos

/// One tensor's entry in the header. Sizes were checked when the file was
/// opened: the data lies inside the file, aligned, overlapping no other
/// tensor's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's order: `dims[0]` varies fastest (a row's length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The row-major shape (dims reversed): [out, in] for a weight matrix,
    /// as numpy and Hugging Face hold it.
    pub fn shape(&self) -> Vec<usize> {
        // Every dim fits usize: n_elements, their product, was checked to.
        self.dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect()
    }

    /// Values per row (`dims[0]`; 1 for a tensor with no dims).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Bytes per row: whole blocks, since a row's length is a multiple of
    /// the block size.
    pub fn row_bytes(&self) -> u64 {
        self.row_len() / self.ty.block_size() * self.ty.type_size()
    }

    /// `Q4_1 [64, 32]` (type and dims), for messages.
    pub fn describe(&self) -> String {
        format!("{} {:?}", self.ty, self.dims)
    }
}

// ---------------------------------------------------------------------------
// The file

/// Where the tensor data is read from.
#[derive(Clone, Debug)]
enum Source {
    File,
    Memory(Arc<[u8]>),
}

/// A GGUF file's header, metadata and tensor infos; tensor data is read on
/// request ([`Gguf::read_f32`], [`Gguf::read_raw`]).
#[derive(Clone, Debug)]
pub struct Gguf {
    path: PathBuf,
    source: Source,
    version: u32,
    file_size: u64,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl Gguf {
    /// Reads the header, metadata and tensor infos of the file at `path`
    /// (not the tensor data) and checks the layout.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::DataIo {
            op: "gguf",
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let parser = Parser {
            path,
            r: BufReader::new(file),
            pos: 0,
            len,
        };
        parser.parse(Source::File)
    }

    /// The same from bytes in memory; `label` stands for the file's path in
    /// messages.
    pub fn from_bytes(label: impl AsRef<Path>, bytes: impl Into<Arc<[u8]>>) -> Result<Self> {
        let bytes: Arc<[u8]> = bytes.into();
        let parser = Parser {
            path: label.as_ref(),
            r: &bytes[..],
            pos: 0,
            len: bytes.len() as u64,
        };
        parser.parse(Source::Memory(bytes.clone()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts, in bytes from the file's start.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index
            .get(key)
            .and_then(|&i| self.metadata.get(i))
            .map(|(_, v)| v)
    }

    /// Every tensor info, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).and_then(|&i| self.tensors.get(i))
    }

    fn bad(&self, reason: String) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            reason,
        }
    }

    /// The value under `key`, or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| self.bad(format!("has no metadata `{key}`")))
    }

    fn typed<'a, T>(&'a self, key: &str, expected: &str, f: impl FnOnce(&'a Value) -> Option<T>) -> Result<T> {
        let v = self.require(key)?;
        f(v).ok_or_else(|| {
            self.bad(format!(
                "metadata `{key}` is {} {}, expected {expected}",
                article(&v.type_description()),
                describe_value(v)
            ))
        })
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "a string", Value::as_str)
    }

    /// An integer value ≥ 0, of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "an integer ≥ 0", Value::as_u64)
    }

    /// An f32 or f64 value, as f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "a float", Value::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "a bool", Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Result<&Array> {
        self.typed(key, "an array", Value::as_array)
    }

    /// An array of strings (a tokenizer's tokens or merges).
    pub fn get_strings(&self, key: &str) -> Result<&[String]> {
        self.typed(key, "an array of strings", |v| match v {
            Value::Array(Array::String(s)) => Some(&s[..]),
            _ => None,
        })
    }

    /// An error about `info`'s tensor in this file.
    pub fn tensor_error(&self, info: &TensorInfo, reason: String) -> Error {
        Error::GgufTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            dtype: info.describe(),
            reason,
        }
    }

    /// The tensor info of `name`, or an error naming it.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| Error::GgufTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            dtype: "absent".into(),
            reason: "the file has no tensor of this name".into(),
        })
    }

    /// The tensor's bytes as stored (ggml's blocks for quantized types), for
    /// any type. The size was checked against the file when it was opened.
    pub fn read_raw(&self, name: &str) -> Result<Vec<u8>> {
        let info = self.require_tensor(name)?;
        let n = usize::try_from(info.n_bytes)
            .map_err(|_| self.tensor_error(info, "does not fit this machine's memory".into()))?;
        let start = self
            .data_offset
            .checked_add(info.offset)
            .ok_or_else(|| self.tensor_error(info, "offset overflows".into()))?;
        match &self.source {
            Source::Memory(bytes) => usize::try_from(start)
                .ok()
                .and_then(|s| bytes.get(s..s.checked_add(n)?))
                .map(<[u8]>::to_vec)
                .ok_or_else(|| self.tensor_error(info, "data runs past the end of the file".into())),
            Source::File => {
                let io = |source| Error::DataIo {
                    op: "gguf: read tensor data",
                    path: self.path.clone(),
                    source,
                };
                let mut file = File::open(&self.path).map_err(io)?;
                // The file may have changed since it was opened: recheck
                // its length before allocating for the tensor.
                let len = file.metadata().map_err(io)?.len();
                if start.checked_add(info.n_bytes).is_none_or(|end| end > len) {
                    return Err(
                        self.tensor_error(info, format!("data runs past the end of the file ({len} bytes now)"))
                    );
                }
                file.seek(SeekFrom::Start(start)).map_err(io)?;
                let mut data = vec![0u8; n];
                file.read_exact(&mut data).map_err(io)?;
                Ok(data)
            }
        }
    }

    /// The tensor decoded to f32, in row-major order ([`TensorInfo::shape`]).
    /// Types other than [`DECODED_TYPES`] are an error naming the type.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require_tensor(name)?;
        if !info.ty.is_decoded() {
            return Err(self.tensor_error(info, unsupported(info.ty)));
        }
        let raw = self.read_raw(name)?;
        if let Ok(format) = crate::ops::QuantFormat::try_from(info.ty) {
            check_scales(format, &raw).map_err(|reason| self.tensor_error(info, reason))?;
        }
        dequantize(info.ty, &raw).map_err(|reason| self.tensor_error(info, reason))
    }

    /// A block-quantized tensor's bytes as stored, for kernels that read
    /// them as they are, with its format; checked first for what would
    /// only show once a kernel ran (a NaN or infinite f16 scale). An error
    /// naming the tensor, its type and dims for any other type.
    pub fn read_quantized(&self, name: &str) -> Result<(crate::ops::QuantFormat, Vec<u8>)> {
        let info = self.require_tensor(name)?;
        let format = crate::ops::QuantFormat::try_from(info.ty)
            .map_err(|ty| self.tensor_error(info, format!("type {ty} is not block-quantized")))?;
        let raw = self.read_raw(name)?;
        check_scales(format, &raw).map_err(|reason| self.tensor_error(info, reason))?;
        Ok((format, raw))
    }
}

/// Every f16 scale (d, m, dmin) of `raw`'s blocks is finite: a NaN or
/// infinite one makes its block's values NaN or infinite, which no model
/// file means (a corrupt or truncated-and-padded file does).
fn check_scales(format: crate::ops::QuantFormat, raw: &[u8]) -> std::result::Result<(), String> {
    match format.first_bad_scale(raw) {
        Some((block, scale)) => {
            let (sb, first) = (format.super_block(), block * format.super_block());
            let end = first + sb;
            Err(format!(
                "block {block} (values {first}..{end}) has a non-finite f16 scale ({scale}): the file is corrupt"
            ))
        }
        None => Ok(()),
    }
}

fn article(s: &str) -> String {
    match s.chars().next() {
        Some('a' | 'e' | 'i' | 'o' | 'u') => format!("an {s}"),
        _ => format!("a {s}"),
    }
}

/// A short rendering of a value for messages (arrays by length only).
fn describe_value(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("of {} elements", a.len()),
        Value::String(s) if s.len() > 40 => format!("({} bytes)", s.len()),
        Value::String(s) => format!("{s:?}"),
        v => format!("{v:?}"),
    }
}

/// Why a tensor of type `ty` cannot be decoded (for an error naming it).
pub(crate) fn unsupported(ty: GgmlType) -> String {
    let names: Vec<&str> = DECODED_TYPES.iter().map(|t| t.name()).collect();
    format!("type {ty} is not supported: wgrad decodes {}", names.join(", "))
}

// ---------------------------------------------------------------------------
// Parsing

/// A reader over the file that knows its length and position, so every
/// read is checked against the bytes left before it allocates.
struct Parser<'p, R> {
    path: &'p Path,
    r: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Parser<'_, R> {
    fn bad(&self, reason: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// Fails unless `n` more bytes are in the file; `what` names what is
    /// being read (built only on failure).
    fn need(&self, n: u64, what: &dyn Fn() -> String) -> Result<()> {
        if n > self.left() {
            return Err(self.bad(format!(
                "truncated: {} needs {n} bytes at byte {}, but the file ends at byte {}",
                what(),
                self.pos,
                self.len
            )));
        }
        Ok(())
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<()> {
        self.r.read_exact(buf).map_err(|source| Error::DataIo {
            op: "gguf",
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        self.need(N as u64, what)?;
        let mut buf = [0u8; N];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// `n` bytes, allocated only once the file is known to hold them.
    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<Vec<u8>> {
        self.need(n, what)?;
        let n = usize::try_from(n).map_err(|_| self.bad(format!("{} is too large for this machine", what())))?;
        let mut buf = vec![0u8; n];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(&|| format!("the length of {}", what()))?;
        let pos = self.pos;
        let bytes = self.bytes(n, what)?;
        String::from_utf8(bytes).map_err(|e| self.bad(format!("{} at byte {pos} is not UTF-8: {e}", what())))
    }

    fn parse(mut self, source: Source) -> Result<Gguf> {
        let magic: [u8; 4] = self.array(&|| "the magic number".into())?;
        if magic != MAGIC {
            return Err(self.bad(format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\"")));
        }
        let version = self.u32(&|| "the version".into())?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(self
                    .bad("GGUF version 1 (u32 counts) is not supported; convert the model with a current llama.cpp"))
            }
            // A big-endian file's version reads byte-swapped here.
            v if v & 0xffff == 0 && matches!(v.swap_bytes(), 1..=3) => {
                return Err(self.bad(format!(
                    "a big-endian GGUF file (version {}); wgrad reads little-endian files",
                    v.swap_bytes()
                )))
            }
            v => return Err(self.bad(format!("unknown GGUF version {v} (wgrad reads versions 2 and 3)"))),
        }
        let tensor_count = self.u64(&|| "the tensor count".into())?;
        let kv_count = self.u64(&|| "the metadata count".into())?;
        // Counts the file cannot hold are refused before any loop or
        // allocation sized by them.
        if kv_count.checked_mul(MIN_KV_BYTES).is_none_or(|n| n > self.left()) {
            return Err(self.bad(format!(
                "the header claims {kv_count} metadata entries, more than the {} bytes left could hold ({MIN_KV_BYTES} bytes each at least)",
                self.left()
            )));
        }
        if tensor_count
            .checked_mul(MIN_TENSOR_INFO_BYTES)
            .is_none_or(|n| n > self.left())
        {
            return Err(self.bad(format!(
                "the header claims {tensor_count} tensors, more than the {} bytes left could hold ({MIN_TENSOR_INFO_BYTES} bytes each at least)",
                self.left()
            )));
        }

        let mut metadata = Vec::new();
        let mut metadata_index = HashMap::new();
        for i in 0..kv_count {
            let key = self.string(&|| format!("metadata key {i}"))?;
            let ty = self.u32(&|| format!("the value type of metadata `{key}`"))?;
            let value = self.value(ty, 0, &|| format!("metadata `{key}`"))?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(self.bad(format!("metadata `{key}` appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get(ALIGNMENT_KEY).and_then(|&i| metadata.get(i)) {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => {
                return Err(self.bad(format!(
                    "`{ALIGNMENT_KEY}` must be a u32 power of two, not {} {}",
                    article(&v.type_description()),
                    describe_value(v)
                )))
            }
        };

        // Rechecked now that the metadata's bytes are known.
        if tensor_count
            .checked_mul(MIN_TENSOR_INFO_BYTES)
            .is_none_or(|n| n > self.left())
        {
            return Err(self.bad(format!(
                "the header claims {tensor_count} tensors, but only {} bytes follow the metadata ({MIN_TENSOR_INFO_BYTES} bytes each at least)",
                self.left()
            )));
        }
        // Bounded by the check above: at most one entry per 24 bytes left.
        let mut tensors = Vec::with_capacity(usize::try_from(tensor_count).unwrap_or(0));
        let mut tensor_index = HashMap::new();
        for i in 0..tensor_count {
            let info = self.tensor_info(i, alignment)?;
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(self.tensor_bad(&info.name, &info.describe(), "appears twice in the file".into()));
            }
            tensors.push(info);
        }

        let data_offset =
            align_up(self.pos, alignment).ok_or_else(|| self.bad("the data section's offset overflows"))?;
        self.check_layout(&tensors, data_offset)?;
        Ok(Gguf {
            path: self.path.to_path_buf(),
            source,
            version,
            file_size: self.len,
            alignment,
            data_offset,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
        })
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        let Some(ty) = ValueType::from_id(ty) else {
            return Err(self.bad(format!("{} has an unknown value type {ty}", what())));
        };
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let [b] = self.array(what)?;
                Value::Bool(self.bool(b, what)?)
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(depth, what)?),
        })
    }

    fn bool(&self, b: u8, what: &dyn Fn() -> String) -> Result<bool> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.bad(format!("{} is a bool of value {b}, neither 0 nor 1", what()))),
        }
    }

    fn array_value(&mut self, depth: usize, what: &dyn Fn() -> String) -> Result<Array> {
        if depth >= MAX_NESTING {
            return Err(self.bad(format!("{} nests arrays deeper than {MAX_NESTING} levels", what())));
        }
        let ety = self.u32(&|| format!("the element type of {}", what()))?;
        let Some(ety) = ValueType::from_id(ety) else {
            return Err(self.bad(format!("{} is an array of unknown value type {ety}", what())));
        };
        let n = self.u64(&|| format!("the length of {}", what()))?;
        // The smallest the elements could be; allocation below is bounded
        // by the bytes the file has left.
        let Some(min) = n.checked_mul(ety.min_bytes()).filter(|&b| b <= self.left()) else {
            return Err(self.bad(format!(
                "{} claims {n} elements of type {}, more than the {} bytes left in the file could hold",
                what(),
                ety.name(),
                self.left()
            )));
        };
        let count = usize::try_from(n).map_err(|_| self.bad(format!("{} is too long for this machine", what())))?;
        let elem = |i: usize| move || format!("element {i} of {}", what());
        Ok(match ety {
            ValueType::U8 => Array::U8(self.bytes(min, what)?),
            ValueType::I8 => Array::I8(fixed(&self.bytes(min, what)?, i8::from_le_bytes)),
            ValueType::U16 => Array::U16(fixed(&self.bytes(min, what)?, u16::from_le_bytes)),
            ValueType::I16 => Array::I16(fixed(&self.bytes(min, what)?, i16::from_le_bytes)),
            ValueType::U32 => Array::U32(fixed(&self.bytes(min, what)?, u32::from_le_bytes)),
            ValueType::I32 => Array::I32(fixed(&self.bytes(min, what)?, i32::from_le_bytes)),
            ValueType::F32 => Array::F32(fixed(&self.bytes(min, what)?, f32::from_le_bytes)),
            ValueType::U64 => Array::U64(fixed(&self.bytes(min, what)?, u64::from_le_bytes)),
            ValueType::I64 => Array::I64(fixed(&self.bytes(min, what)?, i64::from_le_bytes)),
            ValueType::F64 => Array::F64(fixed(&self.bytes(min, what)?, f64::from_le_bytes)),
            ValueType::Bool => {
                let raw = self.bytes(min, what)?;
                let mut out = Vec::with_capacity(count);
                for (i, &b) in raw.iter().enumerate() {
                    out.push(self.bool(b, &elem(i))?);
                }
                Array::Bool(out)
            }
            ValueType::String => {
                let mut out = Vec::with_capacity(count);
                for i in 0..count {
                    out.push(self.string(&elem(i))?);
                }
                Array::String(out)
            }
            ValueType::Array => {
                let mut out = Vec::with_capacity(count);
                for i in 0..count {
                    out.push(self.array_value(depth + 1, &elem(i))?);
                }
                Array::Array(out)
            }
        })
    }

    fn tensor_bad(&self, name: &str, dtype: &str, reason: String) -> Error {
        Error::GgufTensor {
            path: self.path.to_path_buf(),
            tensor: name.to_string(),
            dtype: dtype.to_string(),
            reason,
        }
    }

    fn tensor_info(&mut self, i: u64, alignment: u64) -> Result<TensorInfo> {
        let name = self.string(&|| format!("the name of tensor {i}"))?;
        let not_read = "type not read yet";
        let n_dims = self.u32(&|| format!("the dimension count of tensor `{name}`"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(self.tensor_bad(
                &name,
                not_read,
                format!("has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(self.u64(&|| format!("dimension {d} of tensor `{name}`"))?);
        }
        let id = self.u32(&|| format!("the type of tensor `{name}`"))?;
        let Some(ty) = GgmlType::from_id(id) else {
            return Err(self.tensor_bad(
                &name,
                &format!("type id {id}"),
                format!("unknown tensor type id {id} (dims {dims:?})"),
            ));
        };
        let offset = self.u64(&|| format!("the data offset of tensor `{name}`"))?;
        let dtype = format!("{ty} {dims:?}");
        let bad = |reason: String| self.tensor_bad(&name, &dtype, reason);
        // ggml holds each dim and the element count in int64 (and
        // llama.cpp refuses more), even when another dim is 0.
        let n_elements = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d).filter(|_| d <= i64::MAX as u64))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("the dims {dims:?} pass 2^63 elements (ggml's int64)")))?;
        usize::try_from(n_elements)
            .map_err(|_| bad(format!("{n_elements} elements do not fit this machine's memory")))?;
        let row = dims.first().copied().unwrap_or(1);
        if row % ty.block_size() != 0 {
            return Err(bad(format!(
                "a row of {row} values is not a whole number of {ty}'s {}-value blocks",
                ty.block_size()
            )));
        }
        let n_bytes = (n_elements / ty.block_size())
            .checked_mul(ty.type_size())
            .ok_or_else(|| bad(format!("{n_elements} elements of {ty} overflow a byte count")))?;
        if offset % alignment != 0 {
            return Err(bad(format!(
                "data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            n_bytes,
        })
    }

    /// Every tensor's data inside the file, none overlapping another.
    fn check_layout(&self, tensors: &[TensorInfo], data_offset: u64) -> Result<()> {
        let bad = |t: &TensorInfo, reason: String| self.tensor_bad(&t.name, &t.describe(), reason);
        for t in tensors {
            let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > self.len) {
                return Err(bad(
                    t,
                    format!(
                        "data runs past the end of the file: {} bytes at offset {} of the data section (which starts at byte {data_offset}), but the file has {} bytes",
                        t.n_bytes, t.offset, self.len
                    ),
                ));
            }
        }
        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| (t.offset, t.n_bytes));
        // Ends are in the file (checked above), so these sums do not overflow.
        let mut last: Option<&TensorInfo> = None;
        for t in order {
            if let Some(p) = last {
                if p.offset + p.n_bytes > t.offset {
                    return Err(bad(
                        t,
                        format!(
                            "data at offset {} overlaps tensor `{}` ({}, offset {}, {} bytes)",
                            t.offset,
                            p.name,
                            p.describe(),
                            p.offset,
                            p.n_bytes
                        ),
                    ));
                }
            }
            if last.is_none_or(|p| t.offset + t.n_bytes >= p.offset + p.n_bytes) {
                last = Some(t);
            }
        }
        Ok(())
    }
}

/// Little-endian values of `N` bytes each (`raw` is a whole number of them).
fn fixed<T, const N: usize>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_add(alignment - 1).map(|y| y / alignment * alignment)
}

// ---------------------------------------------------------------------------
// Decoding: the reference decoders live with the format vocabulary (ops),
// which the kernels' CPU twins share.

pub use crate::ops::{decode_q4_0, decode_q4_1, decode_q8_0, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, QK};
use crate::ops::{dequantize_blocks as blocks, f16_from_le as f16};

/// `raw` (a tensor's bytes as stored) decoded to f32. The error is a
/// reason, for the caller to name the tensor with.
pub fn dequantize(ty: GgmlType, raw: &[u8]) -> std::result::Result<Vec<f32>, String> {
    let unit = ty.type_size() as usize;
    if raw.len() % unit != 0 {
        return Err(format!(
            "{} bytes are not a whole number of {ty}'s {unit}-byte blocks",
            raw.len()
        ));
    }
    Ok(match ty {
        GgmlType::F32 => fixed(raw, f32::from_le_bytes),
        GgmlType::F16 => fixed(raw, |b: [u8; 2]| f16(b[0], b[1])),
        // bf16 is the top half of an f32.
        GgmlType::BF16 => fixed(raw, |b: [u8; 2]| f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)),
        GgmlType::Q8_0 => blocks::<Q8_0_BYTES>(raw, decode_q8_0),
        GgmlType::Q4_0 => blocks::<Q4_0_BYTES>(raw, decode_q4_0),
        GgmlType::Q4_1 => blocks::<Q4_1_BYTES>(raw, decode_q4_1),
        ty => match crate::ops::QuantFormat::try_from(ty) {
            Ok(format) => format.dequantize(raw)?,
            Err(ty) => return Err(unsupported(ty)),
        },
    })
}

// ---------------------------------------------------------------------------
// Llama files

/// llama.cpp's Llama files in Hugging Face's terms: tensor names, the row
/// order of q and k, and the model's sizes from the metadata.
pub mod llama {
    use super::{Error, Gguf, Result};

    /// GGUF's names of the Llama's whole-model tensors and Hugging Face's
    /// (`LlamaForCausalLM`'s) for them.
    const MODEL_TENSORS: [(&str, &str); 3] = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ];

    /// The modules of block N: `blk.N.{gguf}` is `model.layers.N.{hf}`.
    const BLOCK_MODULES: [(&str, &str); 9] = [
        ("attn_norm", "input_layernorm"),
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"),
        ("ffn_norm", "post_attention_layernorm"),
        ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"),
    ];

    /// `(layer, module, suffix)` of `{prefix}{layer}.{module}.{weight|bias}`
    /// with a decimal layer number.
    fn split_block_name<'a>(name: &'a str, prefix: &str) -> Option<(&'a str, &'a str, &'a str)> {
        let (layer, part) = name.strip_prefix(prefix)?.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (module, suffix) = part.rsplit_once('.')?;
        (suffix == "weight" || suffix == "bias").then_some((layer, module, suffix))
    }

    /// A name in one naming translated to the other: GGUF's to Hugging
    /// Face's when `to_hf`, else back.
    fn translate(name: &str, to_hf: bool) -> Option<String> {
        let direct = |pair: &(&'static str, &'static str)| if to_hf { *pair } else { (pair.1, pair.0) };
        if let Some((_, to)) = MODEL_TENSORS.iter().map(direct).find(|(f, _)| *f == name) {
            return Some(to.to_string());
        }
        let (from_prefix, to_prefix) = if to_hf {
            ("blk.", "model.layers.")
        } else {
            ("model.layers.", "blk.")
        };
        let (layer, module, suffix) = split_block_name(name, from_prefix)?;
        let (_, to) = BLOCK_MODULES.iter().map(direct).find(|(f, _)| *f == module)?;
        Some(format!("{to_prefix}{layer}.{to}.{suffix}"))
    }

    /// The Hugging Face (`LlamaForCausalLM`) name of a GGUF tensor name, or
    /// `None` for a name with no counterpart (`rope_freqs.weight`).
    pub fn hf_name(gguf_name: &str) -> Option<String> {
        translate(gguf_name, true)
    }

    /// The GGUF name of a Hugging Face Llama parameter name: the inverse of
    /// [`hf_name`].
    pub fn gguf_name(hf_name: &str) -> Option<String> {
        translate(hf_name, false)
    }

    /// How many heads the converter permuted this tensor's rows over:
    /// `n_head` for attn_q, `n_kv_head` for attn_k (weight and bias), `None`
    /// for tensors stored in Hugging Face's order.
    pub fn permuted_heads(gguf_name: &str, hp: &Hparams) -> Option<usize> {
        let module = gguf_name.strip_prefix("blk.")?.split('.').nth(1)?;
        match module {
            "attn_q" => Some(hp.n_head),
            "attn_k" => Some(hp.n_kv_head),
            _ => None,
        }
    }

    fn check(len: usize, rows: usize, n_head: usize) -> Result<usize> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "gguf::llama::unpermute_rows",
            reason,
        };
        if rows == 0 || n_head == 0 || rows % (2 * n_head) != 0 {
            return Err(bad(format!(
                "{rows} rows do not split into {n_head} heads of an even size"
            )));
        }
        if len % rows != 0 {
            return Err(bad(format!("{len} values do not make {rows} rows")));
        }
        Ok(len / rows)
    }

    /// Moves whole rows of `data` (`rows` rows): row `to(r)` of the result
    /// is row `r` of `data`.
    fn move_rows<T: Copy>(data: &[T], rows: usize, n_head: usize, to_hf: bool) -> Result<Vec<T>> {
        let width = check(data.len(), rows, n_head)?;
        // A tensor with a zero dim: nothing to move, however many rows the
        // other dim claims (a file may claim 2^62 of them for free).
        if width == 0 {
            return Ok(Vec::new());
        }
        let head = rows / n_head;
        let half = head / 2;
        let mut out = data.to_vec();
        // Within a head, Hugging Face's row i·half + j (i ∈ {0, 1}, the
        // two rotary halves) is the converter's row 2j + i (interleaved).
        for h in 0..n_head {
            for i in 0..2 {
                for j in 0..half {
                    let hf = h * head + i * half + j;
                    let gg = h * head + 2 * j + i;
                    let (src, dst) = if to_hf { (gg, hf) } else { (hf, gg) };
                    if let (Some(s), Some(d)) = (
                        data.get(src * width..(src + 1) * width),
                        out.get_mut(dst * width..(dst + 1) * width),
                    ) {
                        d.copy_from_slice(s);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The inverse of convert_hf_to_gguf.py's `permute(w, n_head)`
    /// (`w.reshape(n_head, 2, rows/n_head/2, …).swapaxes(1, 2)`): rows of a
    /// GGUF attn_q (with `n_head`) or attn_k (with the KV head count), in
    /// any element type (f32 values, or a quantized row's bytes: pass the
    /// raw bytes and the row count), back in Hugging Face's q_proj/k_proj
    /// order.
    pub fn unpermute_rows<T: Copy>(data: &[T], rows: usize, n_head: usize) -> Result<Vec<T>> {
        move_rows(data, rows, n_head, true)
    }

    /// The converter's `permute` itself, Hugging Face's order to GGUF's.
    pub fn permute_rows<T: Copy>(data: &[T], rows: usize, n_head: usize) -> Result<Vec<T>> {
        move_rows(data, rows, n_head, false)
    }

    /// A Llama file's sizes, from `llama.*` metadata.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Hparams {
        pub n_layer: usize,
        pub n_embd: usize,
        pub n_head: usize,
        pub n_kv_head: usize,
        pub n_ff: usize,
        pub n_ctx: usize,
        pub vocab_size: usize,
        pub rope_base: f32,
        /// Dimensions of each head that rotate (all of them in Llama).
        pub rope_dims: usize,
        pub rms_eps: f32,
        /// No `output.weight`: the head is the token embedding.
        pub tied_embeddings: bool,
    }

    /// Sizes far above any Llama, so a corrupt file cannot make a caller
    /// allocate for an absurd model.
    const MAX_SIZE: u64 = 1 << 24;

    impl Hparams {
        /// Reads the sizes; an architecture other than `llama` is an error.
        pub fn from_gguf(g: &Gguf) -> Result<Self> {
            let bad = |reason: String| Error::Gguf {
                path: g.path().to_path_buf(),
                reason,
            };
            let arch = g.get_str("general.architecture")?;
            if arch != "llama" {
                return Err(bad(format!(
                    "architecture `{arch}` is not a Llama; wgrad runs `llama` GGUF files"
                )));
            }
            let size = |key: &str| -> Result<usize> {
                let v = g.get_u64(&format!("llama.{key}"))?;
                if v == 0 || v > MAX_SIZE {
                    return Err(bad(format!("metadata `llama.{key}` = {v} is outside 1..={MAX_SIZE}")));
                }
                Ok(v as usize)
            };
            let n_embd = size("embedding_length")?;
            let n_head = size("attention.head_count")?;
            let n_kv_head = if g.get("llama.attention.head_count_kv").is_some() {
                size("attention.head_count_kv")?
            } else {
                n_head
            };
            if n_embd % n_head != 0 || (n_embd / n_head) % 2 != 0 {
                return Err(bad(format!(
                    "{n_embd} channels do not split into {n_head} heads of an even size"
                )));
            }
            if n_head % n_kv_head != 0 {
                return Err(bad(format!(
                    "{n_head} heads are not a multiple of {n_kv_head} KV heads"
                )));
            }
            let head_dim = n_embd / n_head;
            let rope_dims = if g.get("llama.rope.dimension_count").is_some() {
                size("rope.dimension_count")?
            } else {
                head_dim
            };
            if rope_dims != head_dim {
                return Err(bad(format!("rotary embedding over {rope_dims} of each head's {head_dim} dimensions (wgrad's Llama rotates them all)")));
            }
            let vocab_size = match g.get("llama.vocab_size") {
                Some(_) => size("vocab_size")?,
                None => g.get_strings("tokenizer.ggml.tokens")?.len(),
            };
            let rope_base = match g.get("llama.rope.freq_base") {
                Some(_) => g.get_f32("llama.rope.freq_base")?,
                None => 10000.0,
            };
            let rms_eps = g.get_f32("llama.attention.layer_norm_rms_epsilon")?;
            if !(rope_base.is_finite() && rope_base > 0.0 && rms_eps.is_finite() && rms_eps >= 0.0) {
                return Err(bad(format!(
                    "rope base {rope_base} or RMSNorm epsilon {rms_eps} is out of range"
                )));
            }
            Ok(Hparams {
                n_layer: size("block_count")?,
                n_embd,
                n_head,
                n_kv_head,
                n_ff: size("feed_forward_length")?,
                n_ctx: size("context_length")?,
                vocab_size,
                rope_base,
                rope_dims,
                rms_eps,
                tied_embeddings: g.tensor("output.weight").is_none(),
            })
        }
    }

    /// A tensor decoded to f32 in Hugging Face's layout: its name there,
    /// its row-major shape, and q/k rows back in Hugging Face's order.
    pub fn read_hf_f32(g: &Gguf, gguf_name: &str, hp: &Hparams) -> Result<(String, Vec<usize>, Vec<f32>)> {
        let info = g.require_tensor(gguf_name)?;
        let name = hf_name(gguf_name).ok_or_else(|| Error::GgufTensor {
            path: g.path().to_path_buf(),
            tensor: gguf_name.to_string(),
            dtype: info.describe(),
            reason: "is not a tensor of a Llama model".into(),
        })?;
        let shape = info.shape();
        let data = g.read_f32(gguf_name)?;
        let data = match permuted_heads(gguf_name, hp) {
            Some(heads) => {
                let rows = shape.first().copied().unwrap_or(1);
                unpermute_rows(&data, rows, heads).map_err(|e| Error::GgufTensor {
                    path: g.path().to_path_buf(),
                    tensor: gguf_name.to_string(),
                    dtype: info.describe(),
                    reason: e.to_string(),
                })?
            }
            None => data,
        };
        Ok((name, shape, data))
    }
}
