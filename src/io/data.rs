//! Datasets and batching: the shipped UCI digits CSV, MNIST IDX files when the
//! user has them, and synthetic regression data.
//!
//! Everything here runs on the host. A training step must not allocate, so
//! the step-time path is [`Sampler`] (an index permutation reshuffled in
//! place) plus [`Dataset::fill_batch`] (copies rows into caller buffers);
//! [`Batches`] is the allocating convenience for everything else.
//!
//! Randomness is `ChaCha8Rng` seeded from a `u64`, so a seed gives the same
//! split and the same batch order on every platform.

use std::borrow::Cow;
use std::io::Read;
use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
pub use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// The UCI digits CSV, embedded so the binary needs no data file at run time.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// gzip streams start with these two bytes; checking them (not the file name)
/// accepts `.gz` files however they are named.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

// ---------------------------------------------------------------------------
// Dataset
// ---------------------------------------------------------------------------

/// A classification dataset: `n` rows of `features` f32 values, each with a
/// class label in `0..classes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Row-major `[n, features]`.
    x: Vec<f32>,
    /// `[n]`, every value `< classes`.
    labels: Vec<u32>,
    features: usize,
    classes: usize,
}

impl Dataset {
    /// Checks that `x` holds `labels.len()` rows of `features` values and that
    /// every label is below `classes`.
    pub fn new(x: Vec<f32>, labels: Vec<u32>, features: usize, classes: usize) -> Result<Self> {
        const OP: &str = "Dataset::new";
        if features == 0 || classes == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("features ({features}) and classes ({classes}) must be at least 1"),
            });
        }
        if labels.len().checked_mul(features) != Some(x.len()) {
            return Err(Error::shape(
                OP,
                format!("x must hold {} rows of {features} features", labels.len()),
                &[&[x.len()], &[labels.len()]],
            ));
        }
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l as usize >= classes) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("label {l} of row {i} is not below classes = {classes}"),
            });
        }
        Ok(Self {
            x,
            labels,
            features,
            classes,
        })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per row.
    pub fn features(&self) -> usize {
        self.features
    }

    /// Number of classes; every label is below it.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// All features, row-major `[len, features]`.
    pub fn x(&self) -> &[f32] {
        &self.x
    }

    /// All labels, `[len]`.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// Row `i`'s features, or `None` past the end.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let start = i.checked_mul(self.features)?;
        self.x.get(start..start.checked_add(self.features)?)
    }

    /// Row `i`'s label, or `None` past the end.
    pub fn label(&self, i: usize) -> Option<u32> {
        self.labels.get(i).copied()
    }

    /// Row `i`'s features and label, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<(&[f32], u32)> {
        Some((self.row(i)?, self.label(i)?))
    }

    /// How many rows carry each class, `[classes]`.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }

    /// `(x, labels, features, classes)`.
    pub fn into_parts(self) -> (Vec<f32>, Vec<u32>, usize, usize) {
        (self.x, self.labels, self.features, self.classes)
    }

    /// A new dataset holding the given rows in the given order (repeats allowed).
    pub fn subset(&self, indices: &[usize]) -> Result<Dataset> {
        let Some(x_len) = indices.len().checked_mul(self.features) else {
            return Err(Error::InvalidArgument {
                op: "Dataset::subset",
                reason: format!("{} rows of {} features overflow", indices.len(), self.features),
            });
        };
        let mut x = vec![0.0; x_len];
        let mut labels = vec![0; indices.len()];
        self.gather("Dataset::subset", indices, &mut x, &mut labels)?;
        Ok(Dataset {
            x,
            labels,
            features: self.features,
            classes: self.classes,
        })
    }

    /// Shuffles the rows with `seed` and returns `(train, test)`, the test part
    /// holding `round(len · test_fraction)` rows. The same seed gives the same
    /// split.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        if !(0.0..=1.0).contains(&test_fraction) {
            return Err(Error::InvalidArgument {
                op: "Dataset::split",
                reason: format!("test_fraction must be in [0, 1], got {test_fraction}"),
            });
        }
        let n = self.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        // The product is at most n, so the cast back cannot overflow.
        let n_test = ((n as f64) * test_fraction).round() as usize;
        let (test, train) = order.split_at(n_test.min(n));
        Ok((self.subset(train)?, self.subset(test)?))
    }

    /// Copies the rows `indices` into `x_out` (`[indices.len(), features]`) and
    /// their labels into `labels_out` (`[indices.len()]`). Allocates nothing,
    /// so a training step can call it every step with buffers made once.
    pub fn fill_batch(&self, indices: &[usize], x_out: &mut [f32], labels_out: &mut [u32]) -> Result<()> {
        self.gather("Dataset::fill_batch", indices, x_out, labels_out)
    }

    /// The rows in a random order drawn from `seed`, cut into batches of
    /// `batch_size`; the last, shorter batch is kept unless `drop_last`.
    /// Use a different seed per epoch (e.g. `seed + epoch`) for a new order.
    pub fn batches(&self, batch_size: usize, seed: u64, drop_last: bool) -> Result<Batches<'_>> {
        self.batches_with_rng(batch_size, &mut ChaCha8Rng::seed_from_u64(seed), drop_last)
    }

    /// As [`Dataset::batches`], drawing the order from `rng`, so successive
    /// calls with one generator give successive epochs.
    pub fn batches_with_rng<R: Rng + ?Sized>(
        &self,
        batch_size: usize,
        rng: &mut R,
        drop_last: bool,
    ) -> Result<Batches<'_>> {
        check_batch_size("Dataset::batches", batch_size)?;
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(rng);
        Ok(Batches {
            data: self,
            order,
            batch_size,
            drop_last,
            next: 0,
        })
    }

    /// An allocation-free sampler over this dataset's rows; see [`Sampler`].
    pub fn sampler(&self, batch_size: usize, seed: u64, drop_last: bool) -> Result<Sampler> {
        Sampler::new(self.len(), batch_size, seed, drop_last)
    }

    fn gather(&self, op: &'static str, indices: &[usize], x_out: &mut [f32], labels_out: &mut [u32]) -> Result<()> {
        let f = self.features;
        if indices.len().checked_mul(f) != Some(x_out.len()) || labels_out.len() != indices.len() {
            return Err(Error::shape(
                op,
                format!(
                    "x_out must hold {} rows of {f} features and labels_out {} labels",
                    indices.len(),
                    indices.len()
                ),
                &[&[indices.len()], &[x_out.len()], &[labels_out.len()]],
            ));
        }
        for (slot, &i) in indices.iter().enumerate() {
            let (Some(row), Some(label)) = (self.row(i), self.label(i)) else {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("index {i} at position {slot} is out of range for {} rows", self.len()),
                });
            };
            x_out[slot * f..(slot + 1) * f].copy_from_slice(row);
            labels_out[slot] = label;
        }
        Ok(())
    }
}

fn check_batch_size(op: &'static str, batch_size: usize) -> Result<()> {
    if batch_size == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "batch_size must be at least 1".into(),
        });
    }
    Ok(())
}

/// Number of batches of `batch_size` over `n` rows.
fn batch_count(n: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        n / batch_size
    } else {
        n.div_ceil(batch_size)
    }
}

// ---------------------------------------------------------------------------
// Batching
// ---------------------------------------------------------------------------

/// One batch from [`Batches`]: the row indices it was drawn from, their
/// features `[len, features]` and labels `[len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub indices: Vec<usize>,
    pub x: Vec<f32>,
    pub labels: Vec<u32>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// One epoch of shuffled batches; made by [`Dataset::batches`]. Allocates each
/// batch; use [`Sampler`] + [`Dataset::fill_batch`] inside a training step.
#[derive(Debug, Clone)]
pub struct Batches<'a> {
    data: &'a Dataset,
    order: Vec<usize>,
    batch_size: usize,
    drop_last: bool,
    next: usize,
}

impl Batches<'_> {
    /// The epoch's row order.
    pub fn order(&self) -> &[usize] {
        &self.order
    }
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let remaining = self.order.len() - self.next;
        if remaining == 0 || (self.drop_last && remaining < self.batch_size) {
            return None;
        }
        let take = remaining.min(self.batch_size);
        let indices = self.order[self.next..self.next + take].to_vec();
        self.next += take;
        let f = self.data.features;
        let mut x = vec![0.0; take * f];
        let mut labels = vec![0; take];
        for (slot, &i) in indices.iter().enumerate() {
            // `order` is a permutation of 0..len, so every index is in range.
            x[slot * f..(slot + 1) * f].copy_from_slice(&self.data.x[i * f..(i + 1) * f]);
            labels[slot] = self.data.labels[i];
        }
        Some(Batch { indices, x, labels })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = batch_count(self.order.len() - self.next, self.batch_size, self.drop_last);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Batches<'_> {}

/// A shuffled permutation of `0..n` cut into batches, reshuffled in place by
/// [`Sampler::next_epoch`]: after [`Sampler::new`] nothing allocates, so it
/// fits a training loop that must keep memory flat.
///
/// ```no_run
/// # fn main() -> wgrad::Result<()> {
/// let data = wgrad::io::data::digits()?;
/// let mut sampler = data.sampler(32, 7, true)?;
/// let (mut x, mut y) = (vec![0.0; 32 * data.features()], vec![0; 32]);
/// for _epoch in 0..10 {
///     for idx in sampler.iter() {
///         data.fill_batch(idx, &mut x, &mut y)?;
///         // upload x, y and run the step
///     }
///     sampler.next_epoch();
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Sampler {
    order: Vec<usize>,
    rng: ChaCha8Rng,
    batch_size: usize,
    drop_last: bool,
}

impl Sampler {
    /// A sampler over `n` rows, already shuffled for the first epoch.
    pub fn new(n: usize, batch_size: usize, seed: u64, drop_last: bool) -> Result<Self> {
        check_batch_size("Sampler::new", batch_size)?;
        let mut sampler = Self {
            order: (0..n).collect(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            batch_size,
            drop_last,
        };
        sampler.next_epoch();
        Ok(sampler)
    }

    /// Draws the next epoch's order (in place; no allocation).
    pub fn next_epoch(&mut self) {
        self.order.shuffle(&mut self.rng);
    }

    /// The current epoch's row order.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches in the current epoch.
    pub fn num_batches(&self) -> usize {
        batch_count(self.order.len(), self.batch_size, self.drop_last)
    }

    /// Row indices of batch `b` of the current epoch, or `None` past the end.
    pub fn batch(&self, b: usize) -> Option<&[usize]> {
        if b >= self.num_batches() {
            return None;
        }
        let start = b * self.batch_size;
        let end = (start + self.batch_size).min(self.order.len());
        Some(&self.order[start..end])
    }

    /// Row indices of every batch of the current epoch, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[usize]> + '_ {
        self.order.chunks(self.batch_size).take(self.num_batches())
    }
}

// ---------------------------------------------------------------------------
// CSV (UCI digits)
// ---------------------------------------------------------------------------

/// The layout of a classification CSV: each line holds `features` numbers
/// then one integer label in `0..classes`; features are multiplied by `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CsvSpec {
    pub features: usize,
    pub classes: usize,
    pub scale: f32,
}

impl CsvSpec {
    /// UCI optical digits: 8×8 pixels in 0..16, scaled to [0, 1]; labels 0..9.
    pub const DIGITS: CsvSpec = CsvSpec {
        features: 64,
        classes: 10,
        scale: 1.0 / 16.0,
    };
}

/// The UCI optical digits (1797 rows, 64 features in [0, 1], 10 classes) from
/// the copy embedded in the binary; see `data/README.md` for its source and
/// license (CC BY 4.0).
pub fn digits() -> Result<Dataset> {
    parse_csv(DIGITS_CSV_GZ, CsvSpec::DIGITS, "digits.csv.gz (embedded)")
}

/// Reads a CSV laid out as `spec`, gzip-compressed or not.
pub fn load_csv(path: impl AsRef<Path>, spec: CsvSpec) -> Result<Dataset> {
    const OP: &str = "load_csv";
    let path = path.as_ref();
    let bytes = read_file(OP, path)?;
    parse_csv(&bytes, spec, &path.display().to_string())
}

/// Parses CSV bytes (gzip-compressed or not) laid out as `spec`; `file` names
/// the source in errors. Blank lines are skipped; there is no header.
pub fn parse_csv(bytes: &[u8], spec: CsvSpec, file: &str) -> Result<Dataset> {
    const OP: &str = "parse_csv";
    let text = gunzip_if_gzip(OP, Path::new(file), bytes)?;
    let parse_err = |line: usize, reason: String| Error::DataParse {
        op: OP,
        file: file.to_string(),
        line,
        reason,
    };
    if spec.features == 0 || spec.classes == 0 || !spec.scale.is_finite() {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("bad CsvSpec {spec:?}"),
        });
    }
    let mut x = Vec::new();
    let mut labels = Vec::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let line = std::str::from_utf8(raw)
            .map_err(|_| parse_err(line_no, "not valid UTF-8".into()))?
            .trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != spec.features + 1 {
            return Err(parse_err(
                line_no,
                format!(
                    "{} columns, expected {} ({} features and a label)",
                    fields.len(),
                    spec.features + 1,
                    spec.features
                ),
            ));
        }
        for (col, field) in fields[..spec.features].iter().enumerate() {
            let v: f32 = field
                .parse()
                .map_err(|_| parse_err(line_no, format!("column {}: `{field}` is not a number", col + 1)))?;
            if !v.is_finite() {
                return Err(parse_err(
                    line_no,
                    format!("column {}: `{field}` is not finite", col + 1),
                ));
            }
            x.push(v * spec.scale);
        }
        labels.push(parse_label(fields[spec.features], spec.classes).map_err(|reason| parse_err(line_no, reason))?);
    }
    Dataset::new(x, labels, spec.features, spec.classes)
}

/// A label is an integer in `0..classes`; `3.0` is accepted as 3 since some
/// exporters write every column as float.
fn parse_label(field: &str, classes: usize) -> std::result::Result<u32, String> {
    let value: f64 = field.parse().map_err(|_| format!("label `{field}` is not a number"))?;
    if value.fract() != 0.0 || value < 0.0 || value >= classes as f64 {
        return Err(format!("label `{field}` is not an integer in 0..{classes}"));
    }
    Ok(value as u32)
}

// ---------------------------------------------------------------------------
// Files and gzip
// ---------------------------------------------------------------------------

fn read_file(op: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::DataIo {
        op,
        path: path.to_path_buf(),
        source,
    })
}

fn gunzip_if_gzip<'a>(op: &'static str, path: &Path, bytes: &'a [u8]) -> Result<Cow<'a, [u8]>> {
    if !bytes.starts_with(&GZIP_MAGIC) {
        return Ok(Cow::Borrowed(bytes));
    }
    let mut out = Vec::new();
    // MultiGzDecoder also reads files made by concatenating gzip members.
    flate2::read::MultiGzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(|source| Error::DataIo {
            op,
            path: path.to_path_buf(),
            source,
        })?;
    Ok(Cow::Owned(out))
}

// ---------------------------------------------------------------------------
// MNIST IDX
// ---------------------------------------------------------------------------

/// IDX magic: two zero bytes, data type 0x08 (unsigned byte), dimension count.
const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

/// Images read from an IDX3 file: `n` images of `rows × cols` pixels, row-major
/// `[n, rows·cols]`, scaled from 0..255 to [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct IdxImages {
    pub n: usize,
    pub rows: usize,
    pub cols: usize,
    pub pixels: Vec<f32>,
}

/// Reads the payload of an IDX file of unsigned bytes with `dims` dimensions,
/// after checking the magic number and that the file size matches the header.
/// Returns the dimensions and the payload.
fn read_idx(op: &'static str, path: &Path, magic: u32, what: &str) -> Result<(Vec<usize>, Vec<u8>)> {
    let file = path.display().to_string();
    let bad = |reason: String| Error::DataFormat {
        op,
        file: file.clone(),
        reason,
    };
    let raw = read_file(op, path)?;
    let bytes = gunzip_if_gzip(op, path, &raw)?;
    let dims = (magic & 0xff) as usize;
    let header_len = 4 + 4 * dims;
    // The magic first, so a wrong kind of file is named as such even when it
    // is shorter than this kind's header.
    if bytes.len() < 4 {
        return Err(bad(format!(
            "truncated: {} bytes, too short for an IDX magic number",
            bytes.len()
        )));
    }
    let word = |i: usize| u32::from_be_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    let found = word(0);
    if found != magic {
        let hint = match found {
            IDX_IMAGES_MAGIC => " (this is an IDX images file)",
            IDX_LABELS_MAGIC => " (this is an IDX labels file)",
            _ => "",
        };
        return Err(bad(format!(
            "wrong magic number {found:#010x}, expected {magic:#010x} for IDX {what}{hint}"
        )));
    }
    if bytes.len() < header_len {
        return Err(bad(format!(
            "truncated: {} bytes, shorter than the {header_len}-byte IDX header",
            bytes.len()
        )));
    }
    let shape: Vec<usize> = (1..=dims).map(|i| word(i) as usize).collect();
    // u64 so a hostile header cannot overflow the product on 32-bit targets.
    let payload = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    let actual = (bytes.len() - header_len) as u64;
    match payload {
        Some(expected) if expected == actual => {}
        Some(expected) if expected > actual => {
            return Err(bad(format!(
                "truncated: header {shape:?} needs {expected} data bytes, file has {actual}"
            )));
        }
        Some(expected) => {
            return Err(bad(format!(
                "size mismatch: header {shape:?} needs {expected} data bytes, file has {actual}"
            )));
        }
        None => return Err(bad(format!("header dimensions {shape:?} overflow"))),
    }
    let data = match bytes {
        Cow::Owned(mut v) => {
            v.drain(..header_len);
            v
        }
        Cow::Borrowed(b) => b[header_len..].to_vec(),
    };
    Ok((shape, data))
}

/// Reads an IDX3 unsigned-byte images file (magic 0x00000803), gzip or not.
pub fn load_idx_images(path: impl AsRef<Path>) -> Result<IdxImages> {
    let (shape, data) = read_idx("load_idx_images", path.as_ref(), IDX_IMAGES_MAGIC, "images")?;
    let pixels = data.iter().map(|&p| p as f32 / 255.0).collect();
    Ok(IdxImages {
        n: shape[0],
        rows: shape[1],
        cols: shape[2],
        pixels,
    })
}

/// Reads an IDX1 unsigned-byte labels file (magic 0x00000801), gzip or not.
pub fn load_idx_labels(path: impl AsRef<Path>) -> Result<Vec<u32>> {
    let (_, data) = read_idx("load_idx_labels", path.as_ref(), IDX_LABELS_MAGIC, "labels")?;
    Ok(data.into_iter().map(u32::from).collect())
}

/// MNIST `(train, test)` from the four standard IDX files in `dir`
/// (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
/// `t10k-labels-idx1-ubyte`), each also accepted with `.gz` or with `.idx` in
/// place of `-idx` as some mirrors name them. Pixels in [0, 1], 10 classes.
pub fn mnist(dir: impl AsRef<Path>) -> Result<(Dataset, Dataset)> {
    let dir = dir.as_ref();
    let train = mnist_part(dir, "train")?;
    let test = mnist_part(dir, "t10k")?;
    Ok((train, test))
}

fn mnist_part(dir: &Path, prefix: &str) -> Result<Dataset> {
    const OP: &str = "mnist";
    let images_path = find_file(OP, dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels_path = find_file(OP, dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let images = load_idx_images(&images_path)?;
    let labels = load_idx_labels(&labels_path)?;
    if images.n != labels.len() {
        return Err(Error::DataFormat {
            op: OP,
            file: labels_path.display().to_string(),
            reason: format!(
                "{} labels but `{}` holds {} images",
                labels.len(),
                images_path.display(),
                images.n
            ),
        });
    }
    if let Some((i, l)) = labels.iter().enumerate().find(|(_, &l)| l >= 10) {
        return Err(Error::DataFormat {
            op: OP,
            file: labels_path.display().to_string(),
            reason: format!("label {l} at index {i} is not a digit 0..9"),
        });
    }
    let Some(features) = images.rows.checked_mul(images.cols) else {
        return Err(Error::DataFormat {
            op: OP,
            file: images_path.display().to_string(),
            reason: format!("{}×{} images overflow", images.rows, images.cols),
        });
    };
    Dataset::new(images.pixels, labels, features, 10)
}

/// The first of `name`, `name.gz` and their `.idx` spellings that exists in `dir`.
fn find_file(op: &'static str, dir: &Path, name: &str) -> Result<PathBuf> {
    let dotted = name.replacen("-idx", ".idx", 1);
    let candidates: Vec<PathBuf> = [
        name.to_string(),
        format!("{name}.gz"),
        dotted.clone(),
        format!("{dotted}.gz"),
    ]
    .iter()
    .map(|n| dir.join(n))
    .collect();
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    Err(Error::DataNotFound {
        op,
        tried: tried.join(", "),
    })
}

// ---------------------------------------------------------------------------
// Synthetic regression
// ---------------------------------------------------------------------------

/// Regression data with a known answer: `y = x·Wᵀ + b + noise`.
#[derive(Debug, Clone, PartialEq)]
pub struct RegressionData {
    /// Inputs, row-major `[n, in_features]`, each drawn from N(0, 1).
    pub x: Vec<f32>,
    /// Targets, row-major `[n, out_features]`.
    pub y: Vec<f32>,
    pub n: usize,
    pub in_features: usize,
    pub out_features: usize,
    /// The true weight `[out_features, in_features]`, drawn from U(-1, 1).
    pub weight: Vec<f32>,
    /// The true bias `[out_features]`, drawn from U(-1, 1).
    pub bias: Vec<f32>,
}

impl RegressionData {
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies rows `indices` of `x` and `y` into caller buffers
    /// (`[indices.len(), in_features]`, `[indices.len(), out_features]`)
    /// without allocating.
    pub fn fill_batch(&self, indices: &[usize], x_out: &mut [f32], y_out: &mut [f32]) -> Result<()> {
        const OP: &str = "RegressionData::fill_batch";
        let (fi, fo) = (self.in_features, self.out_features);
        if indices.len().checked_mul(fi) != Some(x_out.len()) || indices.len().checked_mul(fo) != Some(y_out.len()) {
            return Err(Error::shape(
                OP,
                format!(
                    "x_out must hold {} rows of {fi} and y_out {} rows of {fo}",
                    indices.len(),
                    indices.len()
                ),
                &[&[indices.len()], &[x_out.len()], &[y_out.len()]],
            ));
        }
        for (slot, &i) in indices.iter().enumerate() {
            if i >= self.n {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: format!("index {i} at position {slot} is out of range for {} rows", self.n),
                });
            }
            x_out[slot * fi..(slot + 1) * fi].copy_from_slice(&self.x[i * fi..(i + 1) * fi]);
            y_out[slot * fo..(slot + 1) * fo].copy_from_slice(&self.y[i * fo..(i + 1) * fo]);
        }
        Ok(())
    }
}

/// `n` samples of `y = x·Wᵀ + b + ε` with x ~ N(0, 1), W and b ~ U(-1, 1) and
/// ε ~ N(0, noise_std²), all drawn from `seed`. With `noise_std = 0` a least
/// squares fit recovers W and b up to f32 rounding.
pub fn synthetic_regression(
    n: usize,
    in_features: usize,
    out_features: usize,
    noise_std: f32,
    seed: u64,
) -> Result<RegressionData> {
    const OP: &str = "synthetic_regression";
    if in_features == 0 || out_features == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("in_features ({in_features}) and out_features ({out_features}) must be at least 1"),
        });
    }
    if !(noise_std >= 0.0 && noise_std.is_finite()) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("noise_std must be finite and >= 0, got {noise_std}"),
        });
    }
    let (Some(x_len), Some(y_len), Some(_)) = (
        n.checked_mul(in_features),
        n.checked_mul(out_features),
        in_features.checked_mul(out_features),
    ) else {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("n = {n} × features does not fit in memory"),
        });
    };

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let weight: Vec<f32> = (0..in_features * out_features)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let bias: Vec<f32> = (0..out_features).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let x: Vec<f32> = (0..x_len).map(|_| standard_normal(&mut rng) as f32).collect();
    let mut y = Vec::with_capacity(y_len);
    for row in x.chunks_exact(in_features) {
        for (w_row, &b) in weight.chunks_exact(in_features).zip(&bias) {
            // Accumulate in f64 so the only error left against W, b is the
            // final rounding to f32.
            let dot: f64 = row.iter().zip(w_row).map(|(&xi, &wi)| xi as f64 * wi as f64).sum();
            let noise = if noise_std > 0.0 {
                noise_std as f64 * standard_normal(&mut rng)
            } else {
                0.0
            };
            y.push((dot + b as f64 + noise) as f32);
        }
    }
    Ok(RegressionData {
        x,
        y,
        n,
        in_features,
        out_features,
        weight,
        bias,
    })
}

/// Box–Muller; avoids a dependency on `rand_distr` for one distribution.
fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    // 1 - U lies in (0, 1], so the log is finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
