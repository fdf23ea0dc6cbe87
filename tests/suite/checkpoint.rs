//! Checkpoints: safetensors round trip, atomic save, and clear errors for
//! corrupt, truncated or mismatched files.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use safetensors::{Dtype, SafeTensors};
use wgrad::io::checkpoint::{load, save, Checkpoint, NamedTensor};
use wgrad::Error;

/// A fresh directory per test, so tests can run in parallel and leave-behind
/// checks see only their own files.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "wgrad-ckpt-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn tensor(name: &str, shape: &[usize], seed: u32) -> NamedTensor {
    let n: usize = shape.iter().product();
    // Varied bit patterns, including awkward ones, so a lossy path would show.
    let data = (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            f32::from_bits(x & 0x7f7f_ffff) * if i % 2 == 0 { 1.0 } else { -1.0 }
        })
        .collect();
    NamedTensor::new(name, shape.to_vec(), data).unwrap()
}

/// A 64-32-10 MLP with Adam state, as the trainer would save it.
fn mlp_checkpoint(hidden: usize) -> Checkpoint {
    let mut c = Checkpoint::new();
    let params = [
        ("0.weight", vec![hidden, 64]),
        ("0.bias", vec![hidden]),
        ("2.weight", vec![10, hidden]),
        ("2.bias", vec![10]),
    ];
    for (i, (name, shape)) in params.iter().enumerate() {
        c.push(tensor(name, shape, i as u32));
        c.push(tensor(&format!("optim.{name}.exp_avg"), shape, 100 + i as u32));
        c.push(tensor(&format!("optim.{name}.exp_avg_sq"), shape, 200 + i as u32));
    }
    c.push(NamedTensor::new("scalar", vec![], vec![f32::NAN]).unwrap());
    c.push(NamedTensor::new("empty", vec![0, 3], vec![]).unwrap());
    c.push(
        NamedTensor::new(
            "specials",
            vec![6],
            vec![
                f32::INFINITY,
                f32::NEG_INFINITY,
                -0.0,
                f32::MIN_POSITIVE / 2.0,
                f32::MAX,
                f32::from_bits(0x7fc0_1234),
            ],
        )
        .unwrap(),
    );
    c.set_meta("format", "wgrad");
    c.set_meta("optimizer", "adam");
    c.set_meta("step", "123");
    c.set_meta("model", format!("mlp 64-{hidden}-10 relu"));
    c.set_meta(
        "hparams",
        r#"{"lr": 0.001, "betas": [0.9, 0.999], "note": "quotes \" and\nnewline ünïcode"}"#,
    );
    c
}

fn assert_bit_identical(a: &NamedTensor, b: &NamedTensor) {
    assert_eq!(a.name, b.name);
    assert_eq!(a.shape, b.shape, "{}", a.name);
    let ab: Vec<u32> = a.data.iter().map(|v| v.to_bits()).collect();
    let bb: Vec<u32> = b.data.iter().map(|v| v.to_bits()).collect();
    assert_eq!(ab, bb, "data of `{}` differs", a.name);
}

#[test]
fn round_trip_is_bit_identical_with_metadata() {
    let dir = TempDir::new("roundtrip");
    let path = dir.path("model.safetensors");
    let ckpt = mlp_checkpoint(32);
    save(&path, &ckpt).unwrap();
    let back = load(&path).unwrap();

    assert_eq!(back.metadata, ckpt.metadata);
    assert_eq!(back.meta("step"), Some("123"));
    assert_eq!(back.tensors.len(), ckpt.tensors.len());
    for t in &ckpt.tensors {
        let b = back
            .get(&t.name)
            .unwrap_or_else(|| panic!("`{}` missing after load", t.name));
        assert_bit_identical(t, b);
    }
    // Documented order: sorted by name.
    let names: Vec<&str> = back.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);

    // Saving what was loaded and loading again changes nothing. (Not compared
    // byte for byte: the safetensors crate writes `__metadata__` from a
    // HashMap, so its key order varies between saves.)
    let again = dir.path("again.safetensors");
    save(&again, &back).unwrap();
    let back2 = load(&again).unwrap();
    assert_eq!(back2.metadata, ckpt.metadata);
    assert_eq!(back2.tensors.len(), back.tensors.len());
    for (a, b) in back.tensors.iter().zip(&back2.tensors) {
        assert_bit_identical(a, b);
    }
}

#[test]
fn file_is_valid_safetensors() {
    let dir = TempDir::new("valid");
    let path = dir.path("m.safetensors");
    let ckpt = mlp_checkpoint(32);
    save(&path, &ckpt).unwrap();

    let bytes = fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), ckpt.tensors.len());
    for t in &ckpt.tensors {
        let v = st.tensor(&t.name).unwrap();
        assert_eq!(v.dtype(), Dtype::F32, "{}", t.name);
        assert_eq!(v.shape(), t.shape.as_slice(), "{}", t.name);
        let le: Vec<u8> = t.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(v.data(), le.as_slice(), "{}", t.name);
    }
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().as_ref().unwrap();
    assert_eq!(meta.get("format").map(String::as_str), Some("wgrad"));
    assert_eq!(meta.get("optimizer").map(String::as_str), Some("adam"));
    assert_eq!(meta.len(), ckpt.metadata.len());
}

#[test]
fn truncated_files_are_errors_naming_the_file() {
    let dir = TempDir::new("trunc");
    let good = dir.path("good.safetensors");
    let mut c = Checkpoint::new();
    c.push(tensor("0.weight", &[4, 3], 1));
    c.push(tensor("0.bias", &[4], 2));
    c.set_meta("format", "wgrad");
    save(&good, &c).unwrap();
    let bytes = fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;

    let cut = dir.path("cut.safetensors");
    let cuts = [
        0,
        1,
        7,
        8,
        9,
        8 + header_len / 2,
        8 + header_len - 1,
        8 + header_len,
        8 + header_len + 5,
        bytes.len() - 1,
    ];
    for &n in &cuts {
        fs::write(&cut, &bytes[..n]).unwrap();
        let err = load(&cut).expect_err(&format!("cut at {n} of {} bytes loaded", bytes.len()));
        assert!(matches!(err, Error::CheckpointFormat { .. }), "cut {n}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("cut.safetensors"), "cut {n}: {msg}");
    }
    // Trailing junk is as wrong as missing bytes.
    let mut long = bytes.clone();
    long.extend_from_slice(&[0; 4]);
    fs::write(&cut, &long).unwrap();
    assert!(matches!(load(&cut), Err(Error::CheckpointFormat { .. })));
    // The good file still loads, so the errors above came from the cuts.
    load(&good).unwrap();
}

#[test]
fn garbage_and_missing_files_are_errors() {
    let dir = TempDir::new("garbage");
    let p = dir.path("junk.safetensors");

    // A plausible header length followed by non-JSON.
    let mut junk = 16u64.to_le_bytes().to_vec();
    junk.extend_from_slice(b"\xff\xfe not json at all!");
    fs::write(&p, &junk).unwrap();
    let err = load(&p).unwrap_err();
    assert!(matches!(err, Error::CheckpointFormat { .. }), "{err:?}");
    assert!(err.to_string().contains("junk.safetensors"), "{err}");

    // Pseudo-random bytes.
    let mut x = 0x1234_5678u32;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    fs::write(&p, &noise).unwrap();
    assert!(matches!(load(&p), Err(Error::CheckpointFormat { .. })));

    // Valid JSON whose offsets lie about the data.
    let header = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,32]}}"#;
    let mut lying = (header.len() as u64).to_le_bytes().to_vec();
    lying.extend_from_slice(header);
    lying.extend_from_slice(&[0; 16]);
    fs::write(&p, &lying).unwrap();
    assert!(matches!(load(&p), Err(Error::CheckpointFormat { .. })));

    // A missing file names the path and keeps the OS error.
    let missing = dir.path("nope.safetensors");
    let err = load(&missing).unwrap_err();
    match &err {
        Error::CheckpointIo { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
        other => panic!("expected CheckpointIo, got {other:?}"),
    }
    assert!(err.to_string().contains("nope.safetensors"), "{err}");
}

#[test]
fn non_f32_dtype_is_an_error() {
    let dir = TempDir::new("dtype");
    let p = dir.path("half.safetensors");
    let data = [0u8; 8];
    let view = safetensors::tensor::TensorView::new(Dtype::F16, vec![2, 2], &data).unwrap();
    let bytes = safetensors::serialize([("w", view)], None).unwrap();
    fs::write(&p, bytes).unwrap();
    let err = load(&p).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::CheckpointFormat { .. }), "{err:?}");
    assert!(
        msg.contains("F16") && msg.contains("`w`") && msg.contains("half.safetensors"),
        "{msg}"
    );
}

#[test]
fn foreign_f32_file_without_metadata_loads() {
    // A file written by another tool (no `__metadata__`) is still readable.
    let dir = TempDir::new("foreign");
    let p = dir.path("hf.safetensors");
    let data: Vec<u8> = [1.5f32, -2.0, 3.25].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &data).unwrap();
    fs::write(&p, safetensors::serialize([("b", view)], None).unwrap()).unwrap();
    let c = load(&p).unwrap();
    assert!(c.metadata.is_empty());
    assert_eq!(c.get("b").unwrap().data, vec![1.5, -2.0, 3.25]);
}

#[test]
fn failed_save_leaves_existing_file_untouched() {
    let dir = TempDir::new("failsave");
    let path = dir.path("model.safetensors");
    save(&path, &mlp_checkpoint(32)).unwrap();
    let before = fs::read(&path).unwrap();

    // Shape and data disagree.
    let mut bad = mlp_checkpoint(16);
    bad.tensors[0].data.pop();
    let err = save(&path, &bad).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains(&bad.tensors[0].name), "{err}");
    assert_eq!(fs::read(&path).unwrap(), before);

    // Duplicate names.
    let mut dup = mlp_checkpoint(16);
    dup.push(tensor("0.bias", &[16], 9));
    let err = save(&path, &dup).unwrap_err();
    assert!(
        err.to_string().contains("duplicate") && err.to_string().contains("0.bias"),
        "{err}"
    );
    assert_eq!(fs::read(&path).unwrap(), before);

    // The reserved header key cannot name a tensor.
    let mut reserved = Checkpoint::new();
    reserved.push(NamedTensor {
        name: "__metadata__".into(),
        shape: vec![1],
        data: vec![0.0],
    });
    assert!(save(&path, &reserved).is_err());
    assert_eq!(fs::read(&path).unwrap(), before);

    // Nothing but the good file is in the directory.
    assert_eq!(dir.entries(), vec!["model.safetensors".to_string()]);
}

#[test]
fn io_failures_are_errors_and_leave_no_temp_files() {
    let dir = TempDir::new("io");
    let ckpt = mlp_checkpoint(16);

    // A directory that does not exist.
    let p = dir.path("no/such/dir/model.safetensors");
    let err = save(&p, &ckpt).unwrap_err();
    assert!(matches!(err, Error::CheckpointIo { .. }), "{err:?}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    assert!(!p.exists());

    // The target is a non-empty directory: the temp file gets written, the
    // rename fails, and the temp file must be cleaned up.
    let target = dir.path("occupied");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("keep"), b"x").unwrap();
    let err = save(&target, &ckpt).unwrap_err();
    assert!(matches!(err, Error::CheckpointIo { .. }), "{err:?}");
    assert_eq!(dir.entries(), vec!["occupied".to_string()]);
    assert_eq!(fs::read(target.join("keep")).unwrap(), b"x");

    // A path with no file name is refused before touching the disk.
    assert!(save(Path::new(""), &ckpt).is_err());
    assert!(save(dir.path(".."), &ckpt).is_err());
}

#[test]
fn save_overwrites_and_leaves_no_temp_files() {
    let dir = TempDir::new("overwrite");
    let path = dir.path("m.safetensors");
    for hidden in [32, 16, 8] {
        save(&path, &mlp_checkpoint(hidden)).unwrap();
        assert_eq!(dir.entries(), vec!["m.safetensors".to_string()]);
        let c = load(&path).unwrap();
        assert_eq!(c.get("0.weight").unwrap().shape, vec![hidden, 64]);
    }
}

#[test]
fn concurrent_saves_to_one_target_leave_one_valid_file() {
    let dir = TempDir::new("concurrent");
    let path = dir.path("m.safetensors");
    std::thread::scope(|s| {
        for hidden in [4, 8, 16, 32] {
            let path = &path;
            s.spawn(move || save(path, &mlp_checkpoint(hidden)).unwrap());
        }
    });
    assert_eq!(dir.entries(), vec!["m.safetensors".to_string()]);
    let c = load(&path).unwrap();
    // Whichever save won, the file is exactly that checkpoint, not a mix.
    let h = c.get("0.bias").unwrap().shape[0];
    let mut expect = mlp_checkpoint(h);
    expect.tensors.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(expect.tensors.len(), c.tensors.len());
    for (a, b) in expect.tensors.iter().zip(&c.tensors) {
        assert_bit_identical(a, b);
    }
    assert_eq!(expect.metadata, c.metadata);
}

#[test]
fn shape_mismatch_reports_expected_and_found() {
    let dir = TempDir::new("shapes");
    let path = dir.path("m.safetensors");
    save(&path, &mlp_checkpoint(32)).unwrap();
    let c = load(&path).unwrap();

    let ok: [(&str, &[usize]); 4] = [
        ("0.weight", &[32, 64]),
        ("0.bias", &[32]),
        ("2.weight", &[10, 32]),
        ("2.bias", &[10]),
    ];
    c.expect_shapes(&ok).unwrap();

    // A 64-32-10 checkpoint loaded into a 64-16-10 model.
    let want: [(&str, &[usize]); 4] = [
        ("0.weight", &[16, 64]),
        ("0.bias", &[16]),
        ("2.weight", &[10, 16]),
        ("2.bias", &[10]),
    ];
    let err = c.expect_shapes(&want).unwrap_err();
    match &err {
        Error::CheckpointMismatch { name, expected, found } => {
            assert_eq!(name, "0.weight");
            assert_eq!(expected, &vec![16, 64]);
            assert_eq!(found, &vec![32, 64]);
        }
        other => panic!("expected CheckpointMismatch, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("0.weight") && msg.contains("[16, 64]") && msg.contains("[32, 64]"),
        "{msg}"
    );

    // A tensor the model needs but the file lacks.
    let err = c.expect_shapes(&[("4.weight", &[10, 10])]).unwrap_err();
    assert!(
        matches!(err, Error::CheckpointMissing { ref name, .. } if name == "4.weight"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("4.weight") && err.to_string().contains("[10, 10]"),
        "{err}"
    );

    assert_eq!(c.get_checked("2.bias", &[10]).unwrap().data.len(), 10);
    assert!(c.get("nope").is_none());
}

#[test]
fn named_tensor_new_checks_element_count() {
    assert!(NamedTensor::new("a", vec![2, 3], vec![0.0; 6]).is_ok());
    let err = NamedTensor::new("a", vec![2, 3], vec![0.0; 5]).unwrap_err();
    assert!(
        err.to_string().contains("[2, 3]") && err.to_string().contains('5'),
        "{err}"
    );
    assert!(NamedTensor::new("big", vec![usize::MAX, 2], vec![]).is_err());
    let _: BTreeMap<String, String> = Checkpoint::new().metadata;
}
