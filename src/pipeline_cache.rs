//! A persistent `wgpu::PipelineCache` per device, so a driver that keeps
//! compiled pipelines in it can skip compiling them in the next process.
//!
//! wgpu supports these caches on Vulkan only, and only where the adapter
//! offers `Features::PIPELINE_CACHE`; [`crate::Device`] requests the
//! feature, and [`crate::Kernels::pipeline`] creates every compute
//! pipeline through the device's cache.
//!
//! The file lives in [`crate::user_cache::cache_dir`], named by
//! `wgpu::util::pipeline_cache_key` (the adapter's vendor and device), and
//! starts with wgrad's own header: a magic, the key it was written for
//! (adapter name, backend, driver, driver info, wgrad version), the data's
//! length and an FNV-1a checksum. A file that fails any of these checks,
//! e.g. truncated by a full disk or written by another driver or wgrad
//! version, is ignored with a warning and replaced at the next save; wgpu
//! checks its own header inside the data again. wgpu does not checksum the
//! driver's data, so without wgrad's checksum a corrupt body would reach the
//! driver.
//!
//! The data is written atomically ([`crate::user_cache::write_cache_file`])
//! when a device has created pipelines since the cache was loaded or last
//! saved, and only if the data differs from the file's: once an executor
//! has built its dispatches (every pipeline of a training step exists by
//! then), and when the device is dropped. Two
//! processes on one adapter that both compile new pipelines each write
//! their own cache, the last one wins; the other's new pipelines compile
//! again next time. A cache problem never fails a run: it is logged and
//! the run goes on without the cache.
//!
//! `WGRAD_PIPELINE_CACHE=off` turns the cache off for devices opened with
//! [`PipelineCacheSetting::FromEnv`] (the default).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Environment variable: `off` (or `0`, `false`, `no`) disables the
/// pipeline cache of devices opened with [`PipelineCacheSetting::FromEnv`].
pub const ENV_PIPELINE_CACHE: &str = "WGRAD_PIPELINE_CACHE";

/// Where a device keeps its pipeline cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PipelineCacheSetting {
    /// In [`crate::user_cache::cache_dir`], unless `WGRAD_PIPELINE_CACHE`
    /// says `off`.
    #[default]
    FromEnv,
    /// No cache: every pipeline is compiled afresh.
    Off,
    /// In this directory, whatever the environment says (tests, or a
    /// program with a cache location of its own).
    Dir(PathBuf),
}

impl PipelineCacheSetting {
    /// The directory the cache file goes in, `None` when off.
    pub fn dir(&self) -> Option<PathBuf> {
        match self {
            PipelineCacheSetting::FromEnv if disabled_by_env() => None,
            PipelineCacheSetting::FromEnv => crate::user_cache::cache_dir(),
            PipelineCacheSetting::Off => None,
            PipelineCacheSetting::Dir(dir) => Some(dir.clone()),
        }
    }
}

fn disabled_by_env() -> bool {
    std::env::var(ENV_PIPELINE_CACHE)
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no"))
}

/// The cache file's name for an adapter: wgpu's key for the adapter class
/// plus `.bin`; `None` where wgpu has no pipeline cache for the backend.
pub fn file_name(info: &wgpu::AdapterInfo) -> Option<String> {
    wgpu::util::pipeline_cache_key(info).map(|key| format!("{key}.bin"))
}

/// What a cache file must have been written for: the adapter, its driver
/// and this wgrad version.
pub fn cache_key(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} | {:?} | vendor {:#x} device {:#x} | {} {} | wgrad {}",
        info.name,
        info.backend,
        info.vendor,
        info.device,
        info.driver,
        info.driver_info,
        env!("CARGO_PKG_VERSION")
    )
}

const MAGIC: &[u8; 8] = b"WGRADPC\0";
const FORMAT: u32 = 1;

/// The file's bytes: magic, format, key length and key, data length,
/// checksum of the data, data (integers little-endian).
fn encode(key: &str, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(36 + key.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(&crate::user_cache::fnv1a(data).to_le_bytes());
    out.extend_from_slice(data);
    out
}

/// The data inside a file written by [`encode`] for `key`, or why the file
/// cannot be used.
fn decode<'a>(key: &str, bytes: &'a [u8]) -> std::result::Result<&'a [u8], String> {
    let truncated = || format!("truncated ({} bytes)", bytes.len());
    let mut rest = bytes;
    let mut take = |n: usize| -> std::result::Result<&'a [u8], String> {
        if rest.len() < n {
            return Err(truncated());
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    if take(MAGIC.len())? != MAGIC {
        return Err("not a wgrad pipeline cache".into());
    }
    let u32_at = |b: &[u8]| b.try_into().map(u32::from_le_bytes).map_err(|_| truncated());
    let u64_at = |b: &[u8]| b.try_into().map(u64::from_le_bytes).map_err(|_| truncated());
    let format = u32_at(take(4)?)?;
    if format != FORMAT {
        return Err(format!("format {format}, this wgrad reads {FORMAT}"));
    }
    let key_len = u32_at(take(4)?)? as usize;
    let written_for = take(key_len)?;
    if written_for != key.as_bytes() {
        return Err(format!(
            "written for `{}`, not `{key}`",
            String::from_utf8_lossy(written_for)
        ));
    }
    let len = u64_at(take(8)?)?;
    let checksum = u64_at(take(8)?)?;
    let data = rest;
    if data.len() as u64 != len {
        return Err(format!(
            "{} bytes of data where the header says {len} (truncated or corrupt)",
            data.len()
        ));
    }
    if crate::user_cache::fnv1a(data) != checksum {
        return Err("checksum mismatch (corrupt)".into());
    }
    Ok(data)
}

/// What opening a device found in its cache file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheLoad {
    /// No file yet: the cache starts empty.
    Missing,
    /// The file's data (`bytes` of it) was handed to the driver.
    Loaded { bytes: usize },
    /// The file could not be used (unreadable, corrupt, truncated, or
    /// written for another adapter, driver or wgrad version): the cache
    /// starts empty and the next save replaces the file.
    Rejected { reason: String },
}

/// A device's pipeline cache as [`crate::Device::pipeline_cache_info`]
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineCacheInfo {
    /// The file it is loaded from and saved to.
    pub path: PathBuf,
    /// What the device found there when it opened.
    pub load: CacheLoad,
}

/// One device's cache, its file, and whether it holds unsaved pipelines.
pub(crate) struct PipelineCacheStore {
    cache: wgpu::PipelineCache,
    info: PipelineCacheInfo,
    key: String,
    /// Pipelines created through the cache since it was loaded or saved.
    unsaved: AtomicU64,
    /// Checksum of the data the file holds (loaded or last written), so
    /// a save of the same data writes nothing: a driver that found every
    /// pipeline in the cache gives back what it was given. Also one save
    /// at a time per device.
    on_disk: Mutex<Option<u64>>,
}

impl PipelineCacheStore {
    /// Loads the cache for `device` as `setting` says; `None` when the
    /// device has no PIPELINE_CACHE feature, wgpu none for the backend,
    /// the setting is off, or the cache cannot be created (logged). Async
    /// because it pops error scopes; the device's opening awaits it.
    pub(crate) async fn open(
        device: &wgpu::Device,
        info: &wgpu::AdapterInfo,
        setting: &PipelineCacheSetting,
    ) -> Option<Self> {
        if !device.features().contains(wgpu::Features::PIPELINE_CACHE) {
            return None;
        }
        let path = setting.dir()?.join(file_name(info)?);
        let key = cache_key(info);
        let (data, load) = match std::fs::read(&path) {
            Ok(bytes) => match decode(&key, &bytes) {
                Ok(data) => (Some(data.to_vec()), CacheLoad::Loaded { bytes: data.len() }),
                Err(reason) => (None, CacheLoad::Rejected { reason }),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, CacheLoad::Missing),
            Err(e) => (
                None,
                CacheLoad::Rejected {
                    reason: format!("cannot read it: {e}"),
                },
            ),
        };
        if let CacheLoad::Rejected { reason } = &load {
            log::warn!(
                "pipeline cache {}: {reason}; starting an empty one, which replaces it",
                path.display()
            );
        }
        let cache = match create(device, data.as_deref()).await {
            Ok(cache) => cache,
            Err(message) if data.is_some() => {
                log::warn!(
                    "pipeline cache {}: the driver refused its data ({message}); starting an empty one",
                    path.display()
                );
                create(device, None)
                    .await
                    .map_err(|message| log::warn!("no pipeline cache: {message}"))
                    .ok()?
            }
            Err(message) => {
                log::warn!("no pipeline cache: {message}");
                return None;
            }
        };
        log::debug!("pipeline cache {}: {load:?}", path.display());
        let on_disk = Mutex::new(data.as_deref().map(crate::user_cache::fnv1a));
        Some(PipelineCacheStore {
            cache,
            info: PipelineCacheInfo { path, load },
            key,
            unsaved: AtomicU64::new(0),
            on_disk,
        })
    }

    pub(crate) fn cache(&self) -> &wgpu::PipelineCache {
        &self.cache
    }

    pub(crate) fn info(&self) -> &PipelineCacheInfo {
        &self.info
    }

    pub(crate) fn path(&self) -> &Path {
        &self.info.path
    }

    /// Counts a pipeline created through the cache, for the next save.
    pub(crate) fn note_created(&self) {
        self.unsaved.fetch_add(1, Ordering::AcqRel);
    }

    /// Writes the cache when pipelines were created through it since it
    /// was loaded or saved and its data differs from the file's: the bytes
    /// written, `None` when there was nothing new.
    pub(crate) fn save(&self) -> Result<Option<usize>> {
        let mut on_disk = self.on_disk.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let pending = self.unsaved.swap(0, Ordering::AcqRel);
        if pending == 0 {
            return Ok(None);
        }
        let Some(data) = self.cache.get_data() else {
            return Ok(None);
        };
        let checksum = crate::user_cache::fnv1a(&data);
        if *on_disk == Some(checksum) {
            return Ok(None);
        }
        let bytes = encode(&self.key, &data);
        match crate::user_cache::write_cache_file(self.path(), &bytes) {
            Ok(()) => {
                *on_disk = Some(checksum);
                log::debug!("pipeline cache {}: saved {} bytes", self.path().display(), bytes.len());
                Ok(Some(bytes.len()))
            }
            Err((_, source)) => {
                // Still unsaved: a later save may succeed.
                self.unsaved.fetch_add(pending, Ordering::AcqRel);
                Err(Error::CacheIo {
                    op: "saving the pipeline cache",
                    path: self.path().to_path_buf(),
                    source,
                })
            }
        }
    }
}

/// A pipeline cache on `device` from `data` (`None`: empty), or wgpu's
/// error message.
async fn create(device: &wgpu::Device, data: Option<&[u8]>) -> std::result::Result<wgpu::PipelineCache, String> {
    // Every kind of error is caught here, so none reaches the device's
    // uncaptured errors and fails the run's next checked operation.
    let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    // SAFETY: `data` is what `PipelineCache::get_data` returned on an
    // adapter with the same cache key (wgrad's header checked the key and
    // the data's checksum); wgpu validates its own header inside it again
    // and, with `fallback`, starts empty on data it cannot use.
    let cache = unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
            label: Some("wgrad pipeline cache"),
            data,
            fallback: true,
        })
    };
    let errors = [scope.pop().await, oom.pop().await, internal.pop().await];
    match errors.into_iter().flatten().next() {
        Some(error) => Err(error.to_string()),
        None => Ok(cache),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_round_trips_and_rejects_damage() {
        let data: Vec<u8> = (0..200u8).collect();
        let file = encode("adapter | wgrad 1", &data);
        assert_eq!(decode("adapter | wgrad 1", &file), Ok(&data[..]));
        assert!(decode("adapter | wgrad 2", &file).unwrap_err().contains("written for"));
        for cut in [0, 5, 20, file.len() - 1] {
            assert!(decode("adapter | wgrad 1", &file[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = file.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(decode("adapter | wgrad 1", &flipped).unwrap_err().contains("checksum"));
        let mut longer = file;
        longer.push(0);
        assert!(decode("adapter | wgrad 1", &longer).is_err());
        assert!(decode("k", b"garbage that is long enough to hold a header")
            .unwrap_err()
            .contains("not a wgrad"));
    }
}
