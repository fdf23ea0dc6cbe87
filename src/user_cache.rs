//! wgrad's per-user cache directory and atomic writes into it, shared by
//! the matmul tuning table (`kernels::autotune`) and the pipeline cache
//! (`pipeline_cache`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Environment variable naming wgrad's cache directory outright.
pub const ENV_CACHE_DIR: &str = "WGRAD_CACHE_DIR";

/// `$WGRAD_CACHE_DIR`, else `$XDG_CACHE_HOME/wgrad`, else
/// `~/.cache/wgrad`; `None` when none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    let non_empty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    non_empty(ENV_CACHE_DIR)
        .or_else(|| non_empty("XDG_CACHE_HOME").map(|d| d.join("wgrad")))
        .or_else(|| non_empty("HOME").map(|d| d.join(".cache").join("wgrad")))
}

/// FNV-1a over bytes: stable across Rust releases and platforms, so a
/// cache key or checksum written by one build reads the same in another.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Writes `bytes` to `path` through a temporary file in the same directory
/// and a rename, creating the directory first: a reader (another process,
/// or this one after a crash) sees the old file or the new one, never half
/// of one. The temporary name is unique per process and call, so
/// concurrent writers do not write into each other's file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        // On disk before the rename makes it visible: a crash then leaves
        // the old file, not an empty new one.
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
