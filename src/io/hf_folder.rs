//! What every Hugging Face model folder shares, whatever the model:
//! `config.json` read with clear errors per field, `model.safetensors` or
//! shards listed in `model.safetensors.index.json`, F32/F16/BF16/F64
//! tensors converted to f32, and atomic saving (a temporary sibling folder,
//! each file fsynced, renamed into place; a folder holding anything that is
//! not part of a model folder is refused rather than replaced). The model
//! files (`gpt_folder`, `llama_folder`) say which tensors and fields a
//! model has.
//!
//! This module works on host copies only; it knows no devices.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use crate::atomic_write::{sync_dir, unique_sibling};

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::io::checkpoint;
/// Sizes a config.json may give, refused above these before anything is
/// allocated, so a corrupt file cannot make a loader allocate for an absurd
/// model. Every family's folder reader checks them.
pub(crate) const MAX_LAYERS: usize = 1 << 16;
// On 32-bit targets (wasm32), 2^30 f32 values already fill the 4 GiB address space.
pub(crate) const MAX_PARAMETERS: usize = if usize::BITS > 40 { 1 << 40 } else { 1 << 30 };

/// Whether a model of `n_layer` layers and `parameters` parameters (None:
/// the count overflowed) is within [`MAX_LAYERS`] and [`MAX_PARAMETERS`].
pub(crate) fn within_size_limits(n_layer: usize, parameters: Option<usize>) -> bool {
    n_layer <= MAX_LAYERS && parameters.is_some_and(|n| n <= MAX_PARAMETERS)
}

/// The model's configuration, as transformers writes it.
pub const CONFIG_FILE: &str = "config.json";
/// The weights in one file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The map from tensor name to shard, for sharded weights.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// Files Hugging Face puts beside the weights, which saving may replace.
const HUGGING_FACE_FILES: [&str; 10] = [
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

/// Hugging Face's tokenizer and generation files, which a saved model
/// folder may carry beside its weights (a fine-tuned model's, copied from
/// or written for its pretrained source).
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
];

/// A file saved beside a model's weights: one of [`TOKENIZER_FILES`] by
/// name, and its bytes.
pub type ExtraFile = (String, Vec<u8>);

/// Refuses an extra file that is not one of [`TOKENIZER_FILES`] (a saved
/// folder holds only files saving may later replace), before the disk is
/// touched.
pub(crate) fn check_extra_files(op: &'static str, files: &[ExtraFile]) -> Result<()> {
    match files.iter().find(|(name, _)| !TOKENIZER_FILES.contains(&name.as_str())) {
        Some((name, _)) => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "`{name}` is not a tokenizer or generation file ({})",
                TOKENIZER_FILES.join(", ")
            ),
        }),
        None => Ok(()),
    }
}

/// Writes each extra file into `dir`, fsynced.
pub(crate) fn write_extra_files(dir: &Path, files: &[ExtraFile]) -> Result<()> {
    files
        .iter()
        .try_for_each(|(name, bytes)| write_synced(&dir.join(name), bytes))
}

// ---------------------------------------------------------------- saving

/// Saves a folder at `dir` atomically: `write` fills a temporary sibling
/// folder, which then takes `dir`'s name. An existing `dir` is moved aside
/// first and deleted once the new folder is in place (a crash between the
/// two renames leaves it, whole, under a `.NAME.old-…` name beside the
/// target), and is replaced only when every entry is a file a model folder
/// holds (Hugging Face's, or one of `own_files`). `op` names the caller in
/// errors. A failure leaves the previous folder as it was.
pub(crate) fn save_atomically(
    dir: &Path,
    op: &'static str,
    own_files: &[&str],
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let name = dir.file_name().ok_or_else(|| Error::InvalidArgument {
        op,
        reason: format!("`{}` does not name a folder", dir.display()),
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let existing = match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {
            check_replaceable(dir, op, own_files)?;
            true
        }
        Ok(_) => {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("`{}` exists and is not a folder; refusing to replace it", dir.display()),
            })
        }
        Err(e) if e.kind() == ErrorKind::NotFound => false,
        Err(e) => return Err(io_err(dir, "inspect the target folder", e)),
    };
    fs::create_dir_all(&parent).map_err(|e| io_err(&parent, "create the parent folder", e))?;

    let temp = TempDir::create(&parent, name, "tmp", dir)?;
    write(&temp.0)?;
    sync_dir(&temp.0);

    if existing {
        let old = unique_sibling(&parent, name, "old");
        fs::rename(dir, &old).map_err(|e| io_err(dir, "move the previous folder aside", e))?;
        if let Err(e) = fs::rename(&temp.0, dir) {
            // Put the previous folder back; the new one is still removed by the guard.
            if let Err(back) = fs::rename(&old, dir) {
                log::error!(
                    "{op}: could not move `{}` back to `{}`: {back}",
                    old.display(),
                    dir.display()
                );
            }
            return Err(io_err(dir, "move the new folder into place", e));
        }
        temp.disarm();
        sync_dir(&parent);
        if let Err(e) = fs::remove_dir_all(&old) {
            log::warn!(
                "{op}: the new folder is in place, but the previous one at `{}` could not be removed: {e}",
                old.display()
            );
        }
    } else {
        fs::rename(&temp.0, dir).map_err(|e| io_err(dir, "move the new folder into place", e))?;
        temp.disarm();
        sync_dir(&parent);
    }
    Ok(())
}

/// Only a folder whose every entry a model folder may hold is replaced, so
/// a mistyped path cannot delete someone's files.
fn check_replaceable(dir: &Path, op: &'static str, own_files: &[&str]) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| io_err(dir, "list the target folder", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(dir, "list the target folder", e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        let shard = name.starts_with("model-") && name.ends_with(".safetensors");
        if !is_file || !(HUGGING_FACE_FILES.contains(&name.as_ref()) || own_files.contains(&name.as_ref()) || shard) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("refusing to replace `{}`: it holds `{name}`, which is not part of a model folder; move it away or save elsewhere", dir.display()),
            });
        }
    }
    Ok(())
}

pub(crate) fn io_err(path: &Path, action: &'static str, source: std::io::Error) -> Error {
    Error::CheckpointIo {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Writes `bytes` to a new file and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create(path).map_err(|e| io_err(path, "create", e))?;
    file.write_all(bytes).map_err(|e| io_err(path, "write", e))?;
    file.sync_all().map_err(|e| io_err(path, "fsync", e))
}

/// Pretty JSON with a final newline, as `save_pretrained` writes it.
pub(crate) fn pretty_json(value: &impl serde::Serialize, op: &'static str) -> Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(|e| Error::InvalidArgument {
        op,
        reason: format!("could not write JSON: {e}"),
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The shortest decimal that reads back as `x` (1e-05, not the f64
/// widening 9.999999747378752e-06), for config.json.
pub(crate) fn json_f32(x: f32) -> f64 {
    x.to_string().parse::<f64>().unwrap_or(f64::from(x))
}

/// The temporary folder, removed with its contents when dropped unless
/// disarmed after the rename.
struct TempDir(PathBuf);

impl TempDir {
    fn create(parent: &Path, name: &std::ffi::OsStr, kind: &str, target: &Path) -> Result<Self> {
        for _ in 0..16 {
            let path = unique_sibling(parent, name, kind);
            match fs::create_dir(&path) {
                Ok(()) => return Ok(TempDir(path)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(target, "create a temporary folder beside it", e)),
            }
        }
        Err(io_err(
            target,
            "create a temporary folder with a unique name",
            std::io::Error::new(ErrorKind::AlreadyExists, "name collision"),
        ))
    }

    fn disarm(mut self) {
        self.0 = PathBuf::new();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            // Best effort: the original error is what the caller needs.
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

// ---------------------------------------------------------------- loading

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = fs::read(path).map_err(|e| io_err(path, "read", e))?;
    serde_json::from_slice(&text).map_err(|e| Error::CheckpointFormat {
        path: path.to_path_buf(),
        reason: format!("not valid JSON: {e}"),
    })
}

/// config.json's fields, each read with an error naming the field.
pub(crate) struct ConfigFields {
    pub path: PathBuf,
    map: Map<String, Value>,
    /// The transformers class that needs the fields, for errors.
    class: &'static str,
}

impl ConfigFields {
    /// Reads `dir`'s config.json, which must be a JSON object.
    pub fn read(dir: &Path, class: &'static str) -> Result<Self> {
        let path = dir.join(CONFIG_FILE);
        let value = read_json(&path)?;
        let Value::Object(map) = value else {
            return Err(Error::CheckpointFormat {
                path,
                reason: "not a JSON object".into(),
            });
        };
        Ok(ConfigFields { path, map, class })
    }

    pub fn bad(&self, reason: String) -> Error {
        Error::CheckpointFormat {
            path: self.path.clone(),
            reason,
        }
    }

    /// A non-negative integer field; absent or null is `None`.
    pub fn size(&self, key: &str) -> Result<Option<usize>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.bad(format!("`{key}` is {v}, not a size"))),
        }
    }

    pub fn required(&self, key: &str) -> Result<usize> {
        self.size(key)?
            .ok_or_else(|| self.bad(format!("no `{key}` field ({} needs it)", self.class)))
    }

    pub fn text(&self, key: &str) -> Result<Option<&str>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(format!("`{key}` is {v}, not a string"))),
        }
    }

    pub fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(format!("`{key}` is {v}, not true or false"))),
        }
    }

    /// A positive finite number (an epsilon, a base), `default` when absent.
    pub fn positive(&self, key: &str, default: f32) -> Result<f32> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match v.as_f64() {
                Some(e) if e > 0.0 && e.is_finite() && (e as f32).is_finite() => Ok(e as f32),
                _ => Err(self.bad(format!("`{key}` is {v}, not a positive number"))),
            },
        }
    }

    /// Whether config.json names `key` at all (null included).
    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
}

/// One tensor read from a weights file, converted to f32.
pub(crate) struct LoadedTensor {
    pub data: Vec<f32>,
    /// The file it came from, for errors.
    pub path: PathBuf,
}

/// The weights by model name, and the file errors about the whole set name
/// (the single file or the index).
pub(crate) struct Weights {
    pub tensors: HashMap<String, LoadedTensor>,
    pub source: PathBuf,
}

/// Where a folder's weights are: one file, or shards an index lists.
enum WeightFiles {
    Single(PathBuf),
    /// The index, and the tensor names it lists in each shard file.
    Sharded(PathBuf, BTreeMap<String, Vec<String>>),
}

impl WeightFiles {
    /// `model.safetensors`, or the shards `model.safetensors.index.json`
    /// lists, each checked to exist.
    fn locate(dir: &Path) -> Result<Self> {
        let single = dir.join(WEIGHTS_FILE);
        let index = dir.join(WEIGHTS_INDEX_FILE);
        if single.is_file() {
            return Ok(WeightFiles::Single(single));
        }
        if !index.is_file() {
            let reason = if dir.join("pytorch_model.bin").exists() {
                format!("no {WEIGHTS_FILE}, only pytorch_model.bin: save the model with safe_serialization (the default in transformers) to get safetensors")
            } else {
                format!("no {WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE}")
            };
            return Err(Error::CheckpointFormat {
                path: dir.to_path_buf(),
                reason,
            });
        }

        let value = read_json(&index)?;
        let bad = |reason: String| Error::CheckpointFormat {
            path: index.clone(),
            reason,
        };
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`{name}` maps to {file}, not a file name")))?;
            // The index comes with the folder: it may only name files in it.
            if file.is_empty() || file == "." || file == ".." || file.contains(['/', '\\']) {
                return Err(bad(format!(
                    "`{name}` maps to `{file}`, which is not a file name in the folder"
                )));
            }
            shards.entry(file.to_string()).or_default().push(name.clone());
        }
        for file in shards.keys() {
            let path = dir.join(file);
            if !path.exists() {
                return Err(io_err(
                    &path,
                    "read the shard model.safetensors.index.json lists",
                    std::io::Error::new(ErrorKind::NotFound, "missing shard"),
                ));
            }
        }
        Ok(WeightFiles::Sharded(index, shards))
    }
}

/// Models up to this size are built before their weights are read
/// whatever the files hold (their empty model allocates a few megabytes at
/// most), so a broken weights file gets its own error, which names it
/// (GGUF files too: [`crate::io::gguf_model`]).
pub(crate) const SIZE_CHECKED_ABOVE: usize = 1 << 20;

/// Refuses sizes from `config` (a config.json) that make a model of more
/// `parameters` than the folder's weight files could hold, at 2 bytes a
/// value (F16, BF16), before anything is allocated for the model: a
/// 200-byte config.json may name 2^40 parameters, and even an empty model
/// of that size allocates gigabytes of norm weights.
pub(crate) fn check_weights_hold(dir: &Path, config: &Path, parameters: usize) -> Result<()> {
    if parameters <= SIZE_CHECKED_ABOVE {
        return Ok(());
    }
    let paths = match WeightFiles::locate(dir)? {
        WeightFiles::Single(path) => vec![path],
        WeightFiles::Sharded(_, shards) => shards.keys().map(|file| dir.join(file)).collect(),
    };
    let mut held = 0u64;
    for path in &paths {
        held = held.saturating_add(fs::metadata(path).map_err(|e| io_err(path, "inspect", e))?.len());
    }
    let needed = u64::try_from(parameters).unwrap_or(u64::MAX).saturating_mul(2);
    if needed > held {
        return Err(Error::CheckpointFormat {
            path: config.to_path_buf(),
            reason: format!("its sizes make a model of {parameters} parameters, {needed} bytes at 2 a value, but the folder's weights are {held} bytes"),
        });
    }
    Ok(())
}

/// Reads `model.safetensors`, or the shards `model.safetensors.index.json`
/// lists. `name_of` maps a stored name to the model's name for it (`None`:
/// a tensor the model drops, such as an old mask buffer); each mapped name
/// must be in `expected` with that shape.
pub(crate) fn read_weights(
    dir: &Path,
    expected: &HashMap<String, Vec<usize>>,
    name_of: &dyn Fn(&str) -> Option<String>,
) -> Result<Weights> {
    match WeightFiles::locate(dir)? {
        WeightFiles::Single(path) => {
            let mut weights = Weights {
                tensors: HashMap::new(),
                source: path.clone(),
            };
            read_weights_file(&path, expected, name_of, &mut weights, None)?;
            Ok(weights)
        }
        WeightFiles::Sharded(index, shards) => {
            let mut weights = Weights {
                tensors: HashMap::new(),
                source: index,
            };
            for (file, names) in &shards {
                read_weights_file(&dir.join(file), expected, name_of, &mut weights, Some(names))?;
            }
            Ok(weights)
        }
    }
}

/// Reads one safetensors file into `weights`. A shard must hold every name
/// the index lists for it (`listed`).
fn read_weights_file(
    path: &Path,
    expected: &HashMap<String, Vec<usize>>,
    name_of: &dyn Fn(&str) -> Option<String>,
    weights: &mut Weights,
    listed: Option<&[String]>,
) -> Result<()> {
    let bytes = fs::read(path).map_err(|e| io_err(path, "read", e))?;
    let bad = |reason: String| Error::CheckpointFormat {
        path: path.to_path_buf(),
        reason,
    };
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| bad(checkpoint::describe_safetensors_error(&e, bytes.len())))?;
    if let Some(listed) = listed {
        let held: BTreeSet<&str> = st.names().into_iter().collect();
        if let Some(absent) = listed.iter().find(|n| !held.contains(n.as_str())) {
            return Err(bad(format!(
                "{WEIGHTS_INDEX_FILE} lists `{absent}` in this shard, which does not hold it"
            )));
        }
    }
    for (file_name, view) in st.tensors() {
        let Some(name) = name_of(&file_name) else { continue };
        let shape = view.shape().to_vec();
        let want = expected.get(&name).ok_or_else(|| Error::FolderTensorUnexpected {
            path: path.to_path_buf(),
            name: file_name.clone(),
            shape: shape.clone(),
        })?;
        if *want != shape {
            return Err(Error::FolderTensorShape {
                path: path.to_path_buf(),
                name: file_name.clone(),
                expected: want.clone(),
                found: shape,
            });
        }
        if weights.tensors.contains_key(&name) {
            return Err(bad(format!(
                "`{name}` appears twice (under two stored names, or in two shards)"
            )));
        }
        let data = decode(&file_name, &view, path)?;
        weights.tensors.insert(
            name,
            LoadedTensor {
                data,
                path: path.to_path_buf(),
            },
        );
    }
    Ok(())
}

/// A tensor's values as f32: F32 as is, F16 and BF16 exactly, F64 rounded
/// to nearest (as `tensor.float()` does).
pub(crate) fn decode(name: &str, view: &safetensors::tensor::TensorView<'_>, path: &Path) -> Result<Vec<f32>> {
    let raw = view.data();
    let width = match view.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::F64 => 8,
        other => {
            return Err(Error::CheckpointFormat {
                path: path.to_path_buf(),
                reason: format!("tensor `{name}` has dtype {other}; wgrad reads F32, F16, BF16 and F64 weights"),
            })
        }
    };
    let count = view.shape().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    // safetensors checked the offsets against shape × dtype; re-check so a
    // bug there cannot become silently short data.
    if count.and_then(|n| n.checked_mul(width)) != Some(raw.len()) {
        return Err(Error::CheckpointFormat {
            path: path.to_path_buf(),
            reason: format!(
                "tensor `{name}`: {} data bytes do not fit shape {:?}",
                raw.len(),
                view.shape()
            ),
        });
    }
    // The data may sit at any byte offset, so decode element-wise.
    Ok(match view.dtype() {
        Dtype::F16 => raw
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F64 => raw
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        _ => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    })
}
