//! Writing files so that a reader — another process, or this one after a
//! crash — sees the old contents or the new, never half of either: the
//! bytes go to a uniquely named hidden sibling, are fsynced, and a rename
//! puts them in place; the folder is then fsynced so the rename lasts.
//! Checkpoints, the autotune and pipeline caches, and Hugging Face folders
//! (which swap a whole temporary folder the same way) all write through it.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `bytes` to `path` atomically, in a folder that exists (a
/// mistyped path is an error, not a new folder). On any error the
/// temporary file is removed and an existing `path` is left as it was.
/// The error says which step failed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), (&'static str, std::io::Error)> {
    let name = path.file_name().ok_or((
        "name a file",
        std::io::Error::new(
            ErrorKind::InvalidInput,
            format!("`{}` does not name a file", path.display()),
        ),
    ))?;
    let dir = parent_or_current(path);
    let (mut file, tmp) = create_unique(&dir, name)?;
    let written = (|| {
        file.write_all(bytes).map_err(|e| ("write the temporary file", e))?;
        // On disk before the rename makes it visible: a crash then leaves
        // the old file, not an empty new one.
        file.sync_all().map_err(|e| ("fsync the temporary file", e))?;
        fs::rename(&tmp, path).map_err(|e| ("rename the temporary file over it", e))
    })();
    match written {
        Ok(()) => {
            sync_dir(&dir);
            Ok(())
        }
        Err(e) => {
            // Best effort: the original error is what the caller needs.
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The folder `path` is in; `.` for a bare name (whose parent is "").
pub(crate) fn parent_or_current(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A new file `.NAME.tmp-…` beside the target; `create_new` plus a
/// per-process counter keeps concurrent writers out of each other's file.
fn create_unique(dir: &Path, name: &OsStr) -> Result<(File, PathBuf), (&'static str, std::io::Error)> {
    let mut last = None;
    for _ in 0..16 {
        let tmp = unique_sibling(dir, name, "tmp");
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(file) => return Ok((file, tmp)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(("create a temporary file in its folder", e)),
        }
    }
    Err((
        "create a temporary file with a unique name",
        last.unwrap_or_else(|| std::io::Error::new(ErrorKind::AlreadyExists, "name collision")),
    ))
}

/// `.NAME.KIND-PID-N-NANOS` in `parent`: hidden, and unique per process
/// and call.
pub(crate) fn unique_sibling(parent: &Path, name: &OsStr, kind: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut sibling = OsString::from(".");
    sibling.push(name);
    sibling.push(format!(".{kind}-{}-{n}-{nanos}", std::process::id()));
    parent.join(sibling)
}

/// Makes renames and new entries in `dir` durable. Best effort: some
/// filesystems refuse fsync on a folder, and the files are already synced.
pub(crate) fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        log::warn!("could not fsync folder {}: {e}", dir.display());
    }
    #[cfg(not(unix))]
    let _ = dir;
}
