//! The persistent pipeline cache: saved by one device, loaded by the next
//! on the same adapter; a damaged file is a warning and replaced, never an
//! error; writes are atomic. Each test keeps its files in a directory of
//! its own, given through the API (`PipelineCacheSetting::Dir`), not
//! through `WGRAD_CACHE_DIR`, which would reach every test of this process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::common;
use wgrad::kernels::Activation;
use wgrad::pipeline_cache::{CacheLoad, PipelineCacheSetting};
use wgrad::{Device, DeviceOptions, Kernels};

/// An empty directory for one test.
fn temp_dir(test: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "wgrad-pipeline-cache-{test}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The adapters whose devices get a pipeline cache: wgpu has one on
/// Vulkan, where the adapter offers PIPELINE_CACHE.
fn cached_adapters() -> Vec<usize> {
    common::reports()
        .iter()
        .filter(|r| r.info.backend == wgpu::Backend::Vulkan && r.features.contains(wgpu::Features::PIPELINE_CACHE))
        .map(|r| r.index)
        .collect()
}

fn open(index: usize, dir: &Path) -> Kernels {
    let opts = DeviceOptions {
        adapter: Some(index.to_string()),
        pipeline_cache: PipelineCacheSetting::Dir(dir.to_path_buf()),
        ..Default::default()
    };
    Kernels::new(Device::open(&opts).expect("open adapter"))
}

/// Compiles a pipeline (the first time on a device) and checks its result.
fn relu_runs(k: &Kernels) {
    let x = k.upload(&[-1.0f32, 2.0, -3.0, 4.0]).expect("upload");
    let y = k.zeros(4).expect("zeros");
    let d = k
        .activation_forward(Activation::Relu, y.view(), x.view())
        .expect("relu dispatch");
    k.run(&[&d]).expect("run");
    assert_eq!(k.read::<f32>(y.view()).expect("read"), vec![0.0, 2.0, 0.0, 4.0]);
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_saved_pipeline_cache_loads_on_the_next_device_of_the_adapter() {
    if !common::any_adapter("pipeline cache round trip") {
        return;
    }
    for index in cached_adapters() {
        let dir = temp_dir("round-trip");
        let first = open(index, &dir);
        let info = first
            .device()
            .pipeline_cache_info()
            .expect("a Vulkan device with PIPELINE_CACHE has a cache")
            .clone();
        assert_eq!(info.load, CacheLoad::Missing);
        assert!(info.path.starts_with(&dir), "{info:?}");
        assert_eq!(
            first.device().save_pipeline_cache().expect("save"),
            None,
            "nothing compiled, nothing written"
        );
        relu_runs(&first);
        let written = first
            .device()
            .save_pipeline_cache()
            .expect("save")
            .expect("a new pipeline is written");
        assert_eq!(std::fs::metadata(&info.path).expect("the file").len() as usize, written);
        assert_eq!(
            first.device().save_pipeline_cache().expect("save"),
            None,
            "no new pipeline since"
        );
        // Only the cache file: the temporary file became it.
        assert_eq!(
            files_in(&dir),
            vec![info.path.file_name().expect("name").to_string_lossy().into_owned()]
        );

        let second = open(index, &dir);
        let loaded = second.device().pipeline_cache_info().expect("cache");
        assert!(
            matches!(loaded.load, CacheLoad::Loaded { bytes } if bytes > 0),
            "{loaded:?}"
        );
        relu_runs(&second);
        // Dropped first: a drop may save, which would recreate the directory.
        drop((first, second));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn dropping_a_device_saves_what_it_compiled() {
    if !common::any_adapter("pipeline cache on drop") {
        return;
    }
    for index in cached_adapters() {
        let dir = temp_dir("drop");
        let k = open(index, &dir);
        let path = k.device().pipeline_cache_info().expect("cache").path.clone();
        relu_runs(&k);
        assert!(!path.exists(), "not saved before the drop");
        drop(k);
        assert!(path.exists(), "the drop saves the new pipeline");
        assert!(matches!(
            open(index, &dir).device().pipeline_cache_info().expect("cache").load,
            CacheLoad::Loaded { .. }
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_corrupt_truncated_or_foreign_cache_file_is_ignored_and_replaced() {
    if !common::any_adapter("damaged pipeline cache") {
        return;
    }
    for index in cached_adapters() {
        let dir = temp_dir("damaged");
        let k = open(index, &dir);
        relu_runs(&k);
        k.device().save_pipeline_cache().expect("save");
        let path = k.device().pipeline_cache_info().expect("cache").path.clone();
        drop(k);
        let good = std::fs::read(&path).expect("saved file");
        let version = format!("wgrad {}", env!("CARGO_PKG_VERSION"));
        let at = good
            .windows(version.len())
            .position(|w| w == version.as_bytes())
            .expect("the key names the wgrad version");
        let mut other_version = good.clone();
        other_version[at + version.len() - 1] ^= 1;
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x55;
        let damaged: [(&str, Vec<u8>, &str); 5] = [
            (
                "garbage",
                b"not a cache at all, but long enough for a header".to_vec(),
                "not a wgrad",
            ),
            ("empty", Vec::new(), "truncated"),
            ("truncated", good[..good.len() - 1].to_vec(), "truncated"),
            ("corrupt", flipped, "checksum"),
            ("another wgrad version", other_version, "written for"),
        ];
        for (what, bytes, reason_has) in damaged {
            std::fs::write(&path, &bytes).expect("write damaged file");
            let k = open(index, &dir);
            match &k.device().pipeline_cache_info().expect("still a cache").load {
                CacheLoad::Rejected { reason } => assert!(reason.contains(reason_has), "{what}: {reason}"),
                other => panic!("{what}: {other:?}"),
            }
            relu_runs(&k);
            k.device()
                .save_pipeline_cache()
                .expect("save replaces the damaged file");
            drop(k);
            assert!(
                matches!(
                    open(index, &dir).device().pipeline_cache_info().expect("cache").load,
                    CacheLoad::Loaded { .. }
                ),
                "{what}: replaced by a good file"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn an_unwritable_cache_directory_is_not_an_error_of_the_run() {
    if !common::any_adapter("unwritable pipeline cache") {
        return;
    }
    for index in cached_adapters() {
        let dir = temp_dir("unwritable");
        // A file where the cache directory should be: nothing can be
        // created under it, whoever runs the test.
        let blocker = dir.join("not-a-directory");
        std::fs::write(&blocker, b"x").expect("write");
        let k = open(index, &blocker);
        relu_runs(&k);
        assert!(
            matches!(k.device().save_pipeline_cache(), Err(wgrad::Error::CacheIo { .. })),
            "an explicit save reports it"
        );
        // wgrad's own saves (executor built, drop) only log it.
        drop(k);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn no_pipeline_cache_when_off_or_where_wgpu_has_none() {
    if !common::any_adapter("pipeline cache off") {
        return;
    }
    assert_eq!(PipelineCacheSetting::Off.dir(), None);
    assert_eq!(PipelineCacheSetting::Dir("/x".into()).dir(), Some(PathBuf::from("/x")));
    for index in cached_adapters() {
        let opts = DeviceOptions {
            adapter: Some(index.to_string()),
            pipeline_cache: PipelineCacheSetting::Off,
            ..Default::default()
        };
        let k = Kernels::new(Device::open(&opts).expect("open"));
        assert!(k.device().pipeline_cache().is_none());
        relu_runs(&k);
        assert_eq!(k.device().save_pipeline_cache().expect("save"), None);
    }
    for k in common::adapters() {
        if k.device().info().backend != wgpu::Backend::Vulkan {
            assert!(
                k.device().pipeline_cache().is_none(),
                "{}: wgpu keeps pipeline caches on Vulkan only",
                k.device().label()
            );
        }
    }
}

#[test]
fn concurrent_atomic_writes_leave_one_whole_file() {
    let dir = temp_dir("atomic");
    let path = dir.join("cache.bin");
    let contents: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 1 << 18]).collect();
    std::thread::scope(|scope| {
        for bytes in &contents {
            let path = &path;
            scope.spawn(move || {
                for _ in 0..10 {
                    wgrad::user_cache::write_cache_file(path, bytes).expect("write");
                }
            });
        }
        scope.spawn(|| {
            for _ in 0..200 {
                if let Ok(read) = std::fs::read(&path) {
                    assert!(
                        contents.contains(&read),
                        "a reader saw a partial file ({} bytes)",
                        read.len()
                    );
                }
            }
        });
    });
    assert!(contents.contains(&std::fs::read(&path).expect("file")));
    assert_eq!(files_in(&dir), vec!["cache.bin".to_string()], "no temporary file left");
    let _ = std::fs::remove_dir_all(&dir);
}
