//! `wgrad::io::data`: the embedded digits, splits, batching, MNIST IDX files
//! (written by the tests into a temp dir) and synthetic regression. CPU only.

use std::io::Write;
use std::path::{Path, PathBuf};

use wgrad::io::data::{self, CsvSpec, Dataset, Sampler};
use wgrad::Error;

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("wgrad-data-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small dataset whose row i has features [i, i + 0.5] and label i % 3, so a
/// row can be recognised from its features.
fn toy(n: usize) -> Dataset {
    let x = (0..n).flat_map(|i| [i as f32, i as f32 + 0.5]).collect();
    let labels = (0..n).map(|i| (i % 3) as u32).collect();
    Dataset::new(x, labels, 2, 3).unwrap()
}

// ---------------------------------------------------------------------------
// digits
// ---------------------------------------------------------------------------

#[test]
fn digits_shape_range_and_balance() {
    let d = data::digits().unwrap();
    assert_eq!((d.len(), d.features(), d.classes()), (1797, 64, 10));
    assert_eq!(d.x().len(), 1797 * 64);
    assert!(
        d.x().iter().all(|&v| (0.0..=1.0).contains(&v)),
        "pixels must be scaled to [0, 1]"
    );
    // Raw pixels reach 16, so the maximum after scaling is exactly 1.
    assert_eq!(d.x().iter().cloned().fold(0.0f32, f32::max), 1.0);
    // The UCI test set holds 174..=183 rows per class.
    let counts = d.class_counts();
    assert_eq!(counts.iter().sum::<usize>(), 1797);
    assert!(
        counts.iter().all(|&c| (170..=190).contains(&c)),
        "class counts {counts:?}"
    );
    // First row of the file: 0,0,5,13,9,1,0,0,... label 0.
    let (row0, label0) = d.get(0).unwrap();
    assert_eq!(&row0[..4], &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]);
    assert_eq!(label0, 0);
    assert!(d.get(1797).is_none());
}

#[test]
fn csv_from_path_plain_and_gz_match_embedded() {
    let dir = TempDir::new("csv");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/digits.csv.gz");
    let from_gz = data::load_csv(shipped, CsvSpec::DIGITS).unwrap();
    assert_eq!(from_gz, data::digits().unwrap());

    let plain = dir.path().join("tiny.csv");
    std::fs::write(&plain, "1,2,0\n3,4,1\n\n5,6.5,2.0\n").unwrap();
    let spec = CsvSpec {
        features: 2,
        classes: 3,
        scale: 0.5,
    };
    let d = data::load_csv(&plain, spec).unwrap();
    assert_eq!(d.x(), &[0.5, 1.0, 1.5, 2.0, 2.5, 3.25]);
    assert_eq!(d.labels(), &[0, 1, 2]);

    let missing = data::load_csv(dir.path().join("nope.csv"), spec).unwrap_err();
    assert!(matches!(missing, Error::DataIo { .. }), "{missing}");
}

#[test]
fn csv_errors_name_the_line() {
    let spec = CsvSpec {
        features: 2,
        classes: 3,
        scale: 1.0,
    };
    let cases = [
        ("1,2,0\n1,2\n", 2, "columns"),
        ("1,2,0\n1,2,0\n1,x,1\n", 3, "not a number"),
        ("1,2,3\n", 1, "0..3"),
        ("1,2,-1\n", 1, "0..3"),
        ("1,2,1.5\n", 1, "integer"),
        ("1,NaN,1\n", 1, "finite"),
    ];
    for (text, want_line, want_reason) in cases {
        match data::parse_csv(text.as_bytes(), spec, "t.csv") {
            Err(e @ Error::DataParse { line, .. }) => {
                assert_eq!(line, want_line, "{text:?}: {e}");
                let msg = e.to_string();
                assert!(msg.contains(want_reason) && msg.contains("t.csv"), "{text:?}: {msg}");
            }
            other => panic!("{text:?}: expected DataParse, got {other:?}"),
        }
    }
}

#[test]
fn dataset_new_rejects_inconsistent_parts() {
    assert!(Dataset::new(vec![0.0; 5], vec![0, 1], 2, 2).is_err());
    assert!(Dataset::new(vec![0.0; 4], vec![0, 2], 2, 2).is_err());
    assert!(Dataset::new(vec![], vec![], 0, 2).is_err());
    assert!(Dataset::new(vec![], vec![], 3, 2).unwrap().is_empty());
}

// ---------------------------------------------------------------------------
// split
// ---------------------------------------------------------------------------

/// Recovers each row's original index from the toy features.
fn toy_ids(d: &Dataset) -> Vec<usize> {
    (0..d.len()).map(|i| d.row(i).unwrap()[0] as usize).collect()
}

#[test]
fn split_is_deterministic_disjoint_and_complete() {
    let d = toy(101);
    let (train, test) = d.split(0.2, 42).unwrap();
    assert_eq!((train.len(), test.len()), (81, 20));
    let (train2, test2) = d.split(0.2, 42).unwrap();
    assert_eq!((&train, &test), (&train2, &test2), "same seed, same split");

    let mut all: Vec<usize> = toy_ids(&train).into_iter().chain(toy_ids(&test)).collect();
    all.sort_unstable();
    assert_eq!(all, (0..101).collect::<Vec<_>>(), "disjoint and covering");
    // Labels travel with their rows.
    for part in [&train, &test] {
        for (i, id) in toy_ids(part).into_iter().enumerate() {
            assert_eq!(part.label(i).unwrap(), (id % 3) as u32);
        }
    }

    let (_, test3) = d.split(0.2, 43).unwrap();
    assert_ne!(toy_ids(&test), toy_ids(&test3), "different seeds give different splits");
}

#[test]
fn split_edges_and_bad_fractions() {
    let d = toy(10);
    let (train, test) = d.split(0.0, 1).unwrap();
    assert_eq!((train.len(), test.len()), (10, 0));
    let (train, test) = d.split(1.0, 1).unwrap();
    assert_eq!((train.len(), test.len()), (0, 10));
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(d.split(bad, 1), Err(Error::InvalidArgument { .. })), "{bad}");
    }
    let digits = data::digits().unwrap();
    let (train, test) = digits.split(0.2, 0).unwrap();
    assert_eq!((train.len(), test.len()), (1438, 359));
}

// ---------------------------------------------------------------------------
// batching
// ---------------------------------------------------------------------------

fn check_epoch(n: usize, batch_size: usize, drop_last: bool) {
    let d = toy(n);
    let batches: Vec<_> = d.batches(batch_size, 9, drop_last).unwrap().collect();
    let full = n / batch_size;
    let rest = n % batch_size;
    let expected_batches = if drop_last || rest == 0 { full } else { full + 1 };
    assert_eq!(
        batches.len(),
        expected_batches,
        "n={n} bs={batch_size} drop_last={drop_last}"
    );

    let mut seen = vec![0usize; n];
    for (b, batch) in batches.iter().enumerate() {
        let want = if b < full { batch_size } else { rest };
        assert_eq!(batch.len(), want, "batch {b} size");
        assert_eq!((batch.x.len(), batch.labels.len()), (want * 2, want));
        for (slot, &i) in batch.indices.iter().enumerate() {
            seen[i] += 1;
            assert_eq!(
                &batch.x[slot * 2..slot * 2 + 2],
                d.row(i).unwrap(),
                "features of row {i}"
            );
            assert_eq!(batch.labels[slot], d.label(i).unwrap(), "label of row {i}");
        }
    }
    if drop_last {
        assert_eq!(seen.iter().sum::<usize>(), full * batch_size);
        assert!(seen.iter().all(|&c| c <= 1), "no row twice");
    } else {
        assert!(seen.iter().all(|&c| c == 1), "every row exactly once: {seen:?}");
    }
}

#[test]
fn batches_cover_every_row_once() {
    for (n, bs) in [(10, 3), (10, 5), (10, 1), (10, 10), (10, 11), (7, 100), (1, 1), (97, 8)] {
        check_epoch(n, bs, false);
        check_epoch(n, bs, true);
    }
    assert_eq!(toy(0).batches(4, 0, false).unwrap().count(), 0);
}

#[test]
fn batches_are_seeded_and_shuffled() {
    let d = toy(50);
    let order = |seed| d.batches(7, seed, false).unwrap().order().to_vec();
    assert_eq!(order(1), order(1));
    assert_ne!(order(1), order(2));
    assert_ne!(order(1), (0..50).collect::<Vec<_>>(), "order must be shuffled");
    let it = d.batches(7, 1, false).unwrap();
    assert_eq!(it.len(), 8);
    assert!(matches!(d.batches(0, 1, false), Err(Error::InvalidArgument { .. })));

    // One generator over several epochs gives a different order each epoch.
    let mut rng = <data::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(3);
    let e0 = d.batches_with_rng(7, &mut rng, false).unwrap().order().to_vec();
    let e1 = d.batches_with_rng(7, &mut rng, false).unwrap().order().to_vec();
    assert_ne!(e0, e1);
}

#[test]
fn sampler_and_fill_batch() {
    let d = toy(23);
    let mut s = d.sampler(5, 11, true).unwrap();
    assert_eq!(s.num_batches(), 4);
    assert_eq!(s.iter().len(), 4);
    let (mut x, mut y) = (vec![0.0; 5 * 2], vec![0u32; 5]);
    let mut epochs = Vec::new();
    for _ in 0..3 {
        let mut seen = [false; 23];
        for idx in s.iter() {
            assert_eq!(idx.len(), 5);
            d.fill_batch(idx, &mut x, &mut y).unwrap();
            for (slot, &i) in idx.iter().enumerate() {
                assert!(!seen[i]);
                seen[i] = true;
                assert_eq!(x[slot * 2], i as f32);
                assert_eq!(y[slot], (i % 3) as u32);
            }
        }
        assert_eq!(seen.iter().filter(|&&v| v).count(), 20);
        epochs.push(s.order().to_vec());
        s.next_epoch();
    }
    assert_ne!(epochs[0], epochs[1], "each epoch reshuffles");
    // Same seed replays the same epochs.
    let mut again = Sampler::new(23, 5, 11, true).unwrap();
    assert_eq!(again.order(), &epochs[0][..]);
    again.next_epoch();
    assert_eq!(again.order(), &epochs[1][..]);

    let keep = Sampler::new(23, 5, 11, false).unwrap();
    assert_eq!(keep.num_batches(), 5);
    assert_eq!(keep.batch(4).unwrap().len(), 3);
    assert!(keep.batch(5).is_none());

    // Wrong buffer sizes and out-of-range indices are errors, not panics.
    assert!(matches!(
        d.fill_batch(&[0, 1], &mut x, &mut y),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        d.fill_batch(&[0, 1, 2, 3, 23], &mut x, &mut y),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(Sampler::new(5, 0, 0, false).is_err());
}

// ---------------------------------------------------------------------------
// MNIST IDX
// ---------------------------------------------------------------------------

fn idx_images(n: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 8, 3];
    for d in [n, rows, cols] {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(pixels);
    v
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 8, 1];
    v.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    v.extend_from_slice(labels);
    v
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// `n` images of 2×3 pixels where pixel j of image i is (i·6 + j) mod 256.
fn pixels(n: usize) -> Vec<u8> {
    (0..n * 6).map(|k| (k % 256) as u8).collect()
}

fn write_mnist(dir: &Path, gz: bool, train_n: usize, test_n: usize) {
    let write = |name: &str, bytes: Vec<u8>| {
        let (name, bytes) = if gz {
            (format!("{name}.gz"), gzip(&bytes))
        } else {
            (name.to_string(), bytes)
        };
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    let labels = |n: usize| (0..n).map(|i| (i % 10) as u8).collect::<Vec<_>>();
    write(
        "train-images-idx3-ubyte",
        idx_images(train_n as u32, 2, 3, &pixels(train_n)),
    );
    write("train-labels-idx1-ubyte", idx_labels(&labels(train_n)));
    write(
        "t10k-images-idx3-ubyte",
        idx_images(test_n as u32, 2, 3, &pixels(test_n)),
    );
    write("t10k-labels-idx1-ubyte", idx_labels(&labels(test_n)));
}

#[test]
fn idx_loaders_read_plain_and_gz() {
    let dir = TempDir::new("idx");
    let raw = idx_images(4, 2, 3, &pixels(4));
    std::fs::write(dir.path().join("img"), &raw).unwrap();
    std::fs::write(dir.path().join("img.gz"), gzip(&raw)).unwrap();
    for name in ["img", "img.gz"] {
        let im = data::load_idx_images(dir.path().join(name)).unwrap();
        assert_eq!((im.n, im.rows, im.cols, im.pixels.len()), (4, 2, 3, 24));
        assert_eq!(im.pixels[7], 7.0 / 255.0);
    }
    std::fs::write(dir.path().join("lab.gz"), gzip(&idx_labels(&[3, 1, 4]))).unwrap();
    assert_eq!(data::load_idx_labels(dir.path().join("lab.gz")).unwrap(), vec![3, 1, 4]);
}

#[test]
fn mnist_reads_the_standard_names() {
    for gz in [false, true] {
        let dir = TempDir::new(if gz { "mnist-gz" } else { "mnist" });
        write_mnist(dir.path(), gz, 12, 5);
        let (train, test) = data::mnist(dir.path()).unwrap();
        assert_eq!((train.len(), train.features(), train.classes()), (12, 6, 10));
        assert_eq!(test.len(), 5);
        assert_eq!(train.label(11), Some(1));
        assert_eq!(
            train.row(1).unwrap(),
            &[6.0f32, 7.0, 8.0, 9.0, 10.0, 11.0].map(|p| p / 255.0)
        );
        assert!(train.x().iter().all(|&v| (0.0..=1.0).contains(&v)));
    }
}

/// The error's message, checked to name `file` and contain `what`.
fn assert_format_err(result: wgrad::Result<impl std::fmt::Debug>, file: &str, what: &str) {
    match result {
        Err(e @ Error::DataFormat { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(file) && msg.contains(what),
                "message `{msg}` should name `{file}` and say `{what}`"
            );
        }
        other => panic!("expected DataFormat about {file} ({what}), got {other:?}"),
    }
}

#[test]
fn idx_bad_files_are_errors() {
    let dir = TempDir::new("idx-bad");
    let p = |name: &str| dir.path().join(name);

    // Payload shorter than the header says (plain and gz).
    let mut short = idx_images(4, 2, 3, &pixels(4));
    short.truncate(short.len() - 1);
    std::fs::write(p("short"), &short).unwrap();
    assert_format_err(data::load_idx_images(p("short")), "short", "truncated");
    std::fs::write(p("short.gz"), gzip(&short)).unwrap();
    assert_format_err(data::load_idx_images(p("short.gz")), "short.gz", "truncated");
    // Shorter than the header itself.
    std::fs::write(p("stub"), [0u8, 0, 8, 3, 0, 0]).unwrap();
    assert_format_err(data::load_idx_images(p("stub")), "stub", "truncated");
    // Extra bytes after the payload.
    let mut long = idx_labels(&[1, 2]);
    long.push(0);
    std::fs::write(p("long"), &long).unwrap();
    assert_format_err(data::load_idx_labels(p("long")), "long", "size mismatch");
    // A labels file where images are expected, and garbage.
    std::fs::write(p("labels"), idx_labels(&[1, 2])).unwrap();
    assert_format_err(data::load_idx_images(p("labels")), "labels", "magic");
    std::fs::write(p("junk"), b"hello world, not idx").unwrap();
    assert_format_err(data::load_idx_labels(p("junk")), "junk", "magic");
    // A corrupt gzip stream and a missing file.
    let mut bad_gz = gzip(&idx_labels(&[1, 2, 3]));
    let mid = bad_gz.len() / 2;
    bad_gz[mid..].fill(0xff);
    std::fs::write(p("bad.gz"), bad_gz).unwrap();
    assert!(matches!(data::load_idx_labels(p("bad.gz")), Err(Error::DataIo { .. })));
    assert!(matches!(data::load_idx_labels(p("absent")), Err(Error::DataIo { .. })));
}

#[test]
fn mnist_mismatches_are_errors() {
    // Images and labels disagree on the count.
    let dir = TempDir::new("mnist-count");
    write_mnist(dir.path(), false, 12, 5);
    std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), idx_labels(&[1, 2, 3, 4])).unwrap();
    assert_format_err(data::mnist(dir.path()), "t10k-labels-idx1-ubyte", "5 images");

    // A label that is not a digit.
    let dir = TempDir::new("mnist-label");
    write_mnist(dir.path(), true, 3, 2);
    std::fs::write(
        dir.path().join("train-labels-idx1-ubyte.gz"),
        gzip(&idx_labels(&[1, 12, 3])),
    )
    .unwrap();
    assert_format_err(data::mnist(dir.path()), "train-labels-idx1-ubyte.gz", "label 12");

    // A missing file names what was looked for.
    let dir = TempDir::new("mnist-missing");
    write_mnist(dir.path(), false, 3, 2);
    std::fs::remove_file(dir.path().join("t10k-images-idx3-ubyte")).unwrap();
    match data::mnist(dir.path()) {
        Err(e @ Error::DataNotFound { .. }) => assert!(e.to_string().contains("t10k-images-idx3-ubyte.gz"), "{e}"),
        other => panic!("expected DataNotFound, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// synthetic regression
// ---------------------------------------------------------------------------

/// Least squares for one output column: solves the normal equations of
/// `[x 1] β = y` in f64 by Gaussian elimination; returns `(w, b)`.
fn least_squares(x: &[f32], y: &[f32], n: usize, fi: usize, fo: usize, out: usize) -> (Vec<f64>, f64) {
    let m = fi + 1;
    let mut a = vec![vec![0.0f64; m + 1]; m];
    for r in 0..n {
        let row: Vec<f64> = x[r * fi..(r + 1) * fi].iter().map(|&v| v as f64).chain([1.0]).collect();
        let t = y[r * fo + out] as f64;
        for i in 0..m {
            for j in 0..m {
                a[i][j] += row[i] * row[j];
            }
            a[i][m] += row[i] * t;
        }
    }
    for c in 0..m {
        let p = (c..m).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs())).unwrap();
        a.swap(c, p);
        let pivot = a[c].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (v, pv) in row[c..].iter_mut().zip(&pivot[c..]) {
                    *v -= f * pv;
                }
            }
        }
    }
    let beta: Vec<f64> = (0..m).map(|i| a[i][m] / a[i][i]).collect();
    (beta[..fi].to_vec(), beta[fi])
}

#[test]
fn synthetic_regression_recovers_weights_without_noise() {
    let (n, fi, fo) = (200, 10, 3);
    let r = data::synthetic_regression(n, fi, fo, 0.0, 5).unwrap();
    assert_eq!(
        (r.x.len(), r.y.len(), r.weight.len(), r.bias.len()),
        (n * fi, n * fo, fo * fi, fo)
    );
    assert_eq!(r, data::synthetic_regression(n, fi, fo, 0.0, 5).unwrap(), "seeded");
    assert_ne!(r.weight, data::synthetic_regression(n, fi, fo, 0.0, 6).unwrap().weight);
    for o in 0..fo {
        let (w, b) = least_squares(&r.x, &r.y, n, fi, fo, o);
        // y is the f64 product rounded once to f32 (relative 6e-8 of |y| ≲ 10),
        // so the fit is exact to well under 1e-4.
        for (k, (&got, &want)) in w.iter().zip(&r.weight[o * fi..(o + 1) * fi]).enumerate() {
            assert!((got - want as f64).abs() < 1e-4, "w[{o}][{k}] = {got}, true {want}");
        }
        assert!((b - r.bias[o] as f64).abs() < 1e-4, "b[{o}] = {b}, true {}", r.bias[o]);
    }
    // The inputs look like N(0, 1).
    let mean = r.x.iter().map(|&v| v as f64).sum::<f64>() / r.x.len() as f64;
    let var = r.x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / r.x.len() as f64;
    assert!(mean.abs() < 0.1 && (var - 1.0).abs() < 0.1, "mean {mean}, var {var}");
}

#[test]
fn synthetic_regression_residual_is_the_noise() {
    let (n, fi, fo, noise) = (4000, 10, 1, 0.3f32);
    let r = data::synthetic_regression(n, fi, fo, noise, 8).unwrap();
    let mut sq = 0.0f64;
    for i in 0..n {
        let pred: f64 = (0..fi)
            .map(|k| r.x[i * fi + k] as f64 * r.weight[k] as f64)
            .sum::<f64>()
            + r.bias[0] as f64;
        sq += (r.y[i] as f64 - pred).powi(2);
    }
    let std = (sq / n as f64).sqrt();
    // The sample std of 4000 normals is within ±1.1% (1 sigma) of the true one; allow 5%.
    assert!(
        (std / noise as f64 - 1.0).abs() < 0.05,
        "residual std {std}, noise {noise}"
    );

    let (mut xb, mut yb) = (vec![0.0; 2 * fi], vec![0.0; 2]);
    r.fill_batch(&[3, 0], &mut xb, &mut yb).unwrap();
    assert_eq!((&xb[..fi], yb[0]), (&r.x[3 * fi..4 * fi], r.y[3]));
    assert!(r.fill_batch(&[n], &mut xb[..fi], &mut yb[..1]).is_err());

    for (fi, fo, noise) in [(0, 1, 0.0), (1, 0, 0.0), (1, 1, -1.0), (1, 1, f32::NAN)] {
        assert!(matches!(
            data::synthetic_regression(4, fi, fo, noise, 0),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
