//! Checkpoints: named f32 tensors (parameters and optimizer state) plus
//! free-form string metadata, stored as a safetensors file so PyTorch and
//! Hugging Face tools can read them.
//!
//! This module knows nothing about devices or graphs: callers hand it host
//! copies of their tensors and get host copies back.
//!
//! Naming follows PyTorch's `state_dict`: parameters as `0.weight`, `0.bias`,
//! `2.weight`…; optimizer state under a prefix, e.g. `optim.0.weight.exp_avg`.
//! Metadata goes into the header's `__metadata__` map, e.g. `format=wgrad`,
//! `optimizer=adam`, `step=123`, the architecture and hyper-parameters.
//!
//! Order: safetensors stores tensors sorted by name, and [`load`] returns them
//! sorted by name (byte-wise, so `10.weight` comes before `2.weight`) whatever
//! order the file's writer used. Look tensors up with [`Checkpoint::get`]
//! rather than by position.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensorError, View};
use safetensors::SafeTensors;

use crate::error::{Error, Result};

/// The header key safetensors reserves for metadata; a tensor with this name
/// would produce a header no reader can parse.
const METADATA_KEY: &str = "__metadata__";

/// One f32 tensor, row-major, with its state-dict name.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl NamedTensor {
    /// A tensor whose element count is checked against `shape`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let t = NamedTensor {
            name: name.into(),
            shape,
            data,
        };
        t.validate("checkpoint::NamedTensor::new")?;
        Ok(t)
    }

    /// Number of elements `shape` describes; `None` if the product overflows.
    pub fn numel(&self) -> Option<usize> {
        numel(&self.shape)
    }

    fn validate(&self, op: &'static str) -> Result<()> {
        if self.name == METADATA_KEY {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("`{METADATA_KEY}` is reserved by safetensors and cannot name a tensor"),
            });
        }
        match self.numel() {
            Some(n) if n == self.data.len() => Ok(()),
            Some(n) => Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "tensor `{}`: shape {:?} has {n} elements but data has {}",
                    self.name,
                    self.shape,
                    self.data.len()
                ),
            }),
            None => Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "tensor `{}`: shape {:?} overflows the element count",
                    self.name, self.shape
                ),
            }),
        }
    }
}

/// Tensors plus string metadata: everything needed to resume training.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    pub tensors: Vec<NamedTensor>,
    pub metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a tensor; duplicates are reported by [`save`], not here, so
    /// building stays infallible.
    pub fn push(&mut self, tensor: NamedTensor) {
        self.tensors.push(tensor);
    }

    /// Sets one metadata entry, replacing any previous value.
    pub fn set_meta(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// The metadata value for `key`.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor called `name`, which must have exactly `shape`.
    pub fn get_checked(&self, name: &str, shape: &[usize]) -> Result<&NamedTensor> {
        let t = self.get(name).ok_or_else(|| Error::CheckpointMissing {
            name: name.to_string(),
            expected: shape.to_vec(),
        })?;
        if t.shape != shape {
            return Err(Error::CheckpointMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// Checks that every `(name, shape)` the model expects is present with
    /// that shape; reports the first one that is not, in the order given.
    /// Extra tensors in the checkpoint are allowed (a caller may load only the
    /// parameters and ignore optimizer state).
    pub fn expect_shapes(&self, expected: &[(&str, &[usize])]) -> Result<()> {
        for (name, shape) in expected {
            self.get_checked(name, shape)?;
        }
        Ok(())
    }
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Borrowed f32 data presented to safetensors as little-endian bytes.
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        // On little-endian hosts the in-memory bytes already are the file's
        // bytes, so skip the copy.
        #[cfg(target_endian = "little")]
        {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        }
        #[cfg(not(target_endian = "little"))]
        {
            Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

/// Validates the checkpoint: no duplicate or reserved names, every shape
/// matches its data. Runs before anything touches the disk.
fn validate(ckpt: &Checkpoint) -> Result<()> {
    const OP: &str = "checkpoint::save";
    let mut seen = BTreeSet::new();
    for t in &ckpt.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("duplicate tensor name `{}`", t.name),
            });
        }
        t.validate(OP)?;
    }
    Ok(())
}

/// Serializes `ckpt` into the bytes of a safetensors file.
fn to_bytes(ckpt: &Checkpoint, path: &Path) -> Result<Vec<u8>> {
    validate(ckpt)?;
    let views = ckpt.tensors.iter().map(|t| {
        (
            t.name.as_str(),
            F32View {
                shape: &t.shape,
                data: &t.data,
            },
        )
    });
    // Always write the map (even empty) so every wgrad file has a header
    // section readers can look for.
    let meta: HashMap<String, String> = ckpt.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    safetensors::serialize(views, Some(meta)).map_err(|e| Error::CheckpointFormat {
        path: path.to_path_buf(),
        reason: format!("could not serialize: {e}"),
    })
}

/// Writes `ckpt` to `path` as a safetensors file (F32, little-endian,
/// metadata in `__metadata__`).
///
/// The write is atomic: the bytes go to a uniquely named temporary file in
/// the same directory, which is fsynced and then renamed over `path`. On any
/// error the temporary file is removed and an existing `path` is left as it
/// was. Invalid input (duplicate names, a shape that does not match its data)
/// is refused before the disk is touched. The whole file is built in memory
/// first, so saving needs about one extra copy of the tensors' bytes.
pub fn save(path: impl AsRef<Path>, ckpt: &Checkpoint) -> Result<()> {
    let path = path.as_ref();
    if path.file_name().is_none() {
        return Err(Error::InvalidArgument {
            op: "checkpoint::save",
            reason: format!("`{}` does not name a file", path.display()),
        });
    }
    let bytes = to_bytes(ckpt, path)?;
    crate::atomic_write::write_atomic(path, &bytes).map_err(|(action, e)| io_err(path, action, e))
}

fn io_err(path: &Path, action: &'static str, source: std::io::Error) -> Error {
    Error::CheckpointIo {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Reads a checkpoint written by [`save`] or any safetensors file whose
/// tensors are all F32. Tensors come back sorted by name; a file without
/// `__metadata__` gives empty metadata.
pub fn load(path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(|e| Error::CheckpointIo {
        path: path.to_path_buf(),
        action: "read",
        source: e,
    })?;
    from_bytes(&bytes, path)
}

fn from_bytes(bytes: &[u8], path: &Path) -> Result<Checkpoint> {
    let bad = |reason: String| Error::CheckpointFormat {
        path: path.to_path_buf(),
        reason,
    };
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(describe(&e, bytes.len())))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(describe(&e, bytes.len())))?;

    let mut tensors = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor `{name}` has dtype {}; wgrad checkpoints hold F32 only",
                view.dtype()
            )));
        }
        let raw = view.data();
        // safetensors has checked offsets against shape × dtype; re-check so
        // a bug there cannot turn into silently short data.
        if Some(raw.len()) != numel(view.shape()).and_then(|n| n.checked_mul(4)) {
            return Err(bad(format!(
                "tensor `{name}`: {} data bytes do not fit shape {:?}",
                raw.len(),
                view.shape()
            )));
        }
        // The slice may sit at any byte offset in the file, so decode
        // element-wise rather than casting.
        let data = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            data,
        });
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));

    let metadata = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    Ok(Checkpoint { tensors, metadata })
}

/// [`describe`] for other readers of safetensors files in the crate.
pub(crate) fn describe_safetensors_error(e: &SafeTensorError, len: usize) -> String {
    describe(e, len)
}

/// A reason a user can act on, with the crate's own wording after it.
fn describe(e: &SafeTensorError, len: usize) -> String {
    use SafeTensorError as E;
    let hint = match e {
        E::HeaderTooSmall => format!(
            "file is {len} bytes, too short for the 8-byte header length (empty, truncated, or not a safetensors file)"
        ),
        E::HeaderTooLarge | E::InvalidHeaderLength => {
            format!("header length does not fit the file of {len} bytes (truncated, or not a safetensors file)")
        }
        E::InvalidHeader(_) | E::InvalidHeaderDeserialization(_) | E::JsonError(_) => {
            "header is not valid safetensors JSON (corrupt, or not a safetensors file)".to_string()
        }
        E::MetadataIncompleteBuffer => format!(
            "tensor data does not match the header's offsets: the file ({len} bytes) is truncated or has trailing bytes"
        ),
        _ => "header describes tensors inconsistently (corrupt file)".to_string(),
    };
    format!("{hint}: {e}")
}
