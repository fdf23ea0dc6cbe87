//! wgrad's per-user cache directory and atomic writes into it, shared by
//! the matmul tuning table (`kernels::autotune`), the pipeline cache
//! (`pipeline_cache`) and downloaded models (`models_dir`).

use std::path::PathBuf;

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

/// Where downloaded model files live: `<cache_dir>/models`
/// (`scripts/fetch-smollm2.sh` puts SmolLM2 there).
pub fn models_dir() -> Option<PathBuf> {
    cache_dir().map(|d| d.join("models"))
}

/// FNV-1a over bytes: stable across Rust releases and platforms, so a
/// cache key or checksum written by one build reads the same in another.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes a cache file atomically ([`crate::atomic_write::write_atomic`]),
/// creating the cache's folder first.
pub fn write_cache_file(path: &std::path::Path, bytes: &[u8]) -> Result<(), (&'static str, std::io::Error)> {
    std::fs::create_dir_all(crate::atomic_write::parent_or_current(path)).map_err(|e| ("create its folder", e))?;
    crate::atomic_write::write_atomic(path, bytes)
}
