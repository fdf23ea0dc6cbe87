//! Time per dispatch of every kernel family except matmul (which has
//! `benches/matmul.rs`), on the default adapter:
//!
//! - `overhead`: an empty submit + wait, one tiny dispatch, and 16 tiny
//!   dispatches in one pass: the fixed costs every small kernel pays;
//! - `elementwise`: add/sub/mul, each activation forward and backward,
//!   bias_add;
//! - `reduce`: sum_rows, sum, max_rows, argmax_rows;
//! - `loss`: MSE and cross-entropy forward, backward and the fused
//!   single-workgroup forward_backward;
//! - `optim`: SGD, SGD with momentum and Adam over a flat parameter arena.
//!
//! Each family runs at a tiny size (the time is the dispatch + submit + wait
//! overhead) and at large sizes (the time is the kernel's own work;
//! criterion reports Throughput::Bytes, the bytes each kernel must read and
//! write at least, so GB/s compares kernels with memory bandwidth). Every iteration submits once and waits for the GPU, so the time
//! is the real completion time, not the queueing time.
//!
//! No adapter: prints why and exits successfully.
//!
//! Environment: `WGRAD_ADAPTER` / `WGRAD_BACKEND` (adapter choice, see
//! `Device::open_default`), `LP_NUM_THREADS` (llvmpipe/lavapipe threads).
//!
//! Run: `LP_NUM_THREADS=2 cargo bench --bench kernels` (about 2 minutes on
//! 2 cores); one family: `cargo bench --bench kernels -- optim`.

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::kernels::{Activation, AdamConfig, Binary, Dispatch, SgdConfig};
use wgrad::{Device, GpuTensor, Kernels};

const F32: u64 = 4;

/// Elementwise and reduction sizes as (rows, cols): tiny is all overhead,
/// large (16 MiB per operand) is all the kernel's own work.
const TINY: (usize, usize) = (10, 100);
const LARGE: (usize, usize) = (4096, 1024);
/// A loss sees [batch, classes]: the MLP's 256×10, and an ImageNet-sized
/// 1024×1000 that shows how the one-workgroup fused kernels scale.
const LOSS_SHAPES: [(usize, usize); 2] = [(256, 10), (1024, 1000)];
/// Parameter arenas: tiny, ~1M (the 784-512-512-10 MLP has 0.67M) and ~10M.
const ARENAS: [usize; 3] = [1_000, 1 << 20, 10 << 20];

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "n/a".into())
}

fn random(rng: &mut ChaCha8Rng, len: usize, bound: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-bound..bound)).collect()
}

/// Buffers with seeded random contents, and one way to time a dispatch list.
struct Bench {
    kernels: Kernels,
    rng: ChaCha8Rng,
}

impl Bench {
    fn tensor(&mut self, len: usize) -> GpuTensor {
        let data = random(&mut self.rng, len, 3.0);
        self.kernels.upload(&data).expect("upload")
    }

    fn labels(&mut self, rows: usize, cols: usize) -> GpuTensor {
        let data: Vec<u32> = (0..rows)
            .map(|_| self.rng.random_range(0..cols as u32))
            .collect();
        self.kernels.upload(&data).expect("upload labels")
    }

    /// One pass holding `dispatches`, one submit, then wait until the GPU is
    /// done; `bytes`: the least memory traffic of one run, for throughput.
    /// The first run, outside the timing, lets GL compile (it builds shaders
    /// lazily at the first dispatch); it runs even when a criterion filter
    /// skips the case.
    fn time(
        &self,
        group: &mut BenchmarkGroup<'_, WallTime>,
        name: impl Into<String>,
        size: &str,
        bytes: Option<u64>,
        dispatches: &[&Dispatch],
    ) {
        let run = || {
            self.kernels.run(dispatches).expect("run");
            self.kernels
                .device()
                .wait_idle("bench kernels")
                .expect("wait");
        };
        run();
        if let Some(b) = bytes {
            group.throughput(Throughput::Bytes(b));
        }
        group.bench_function(BenchmarkId::new(name, size), |bench| bench.iter(run));
    }
}

/// Flat sampling: the large cases take milliseconds per iteration, and
/// criterion's default linear sampling would multiply the run time.
fn family<'c>(c: &'c mut Criterion, name: &str) -> BenchmarkGroup<'c, WallTime> {
    let mut group = c.benchmark_group(name);
    group.sampling_mode(SamplingMode::Flat);
    group
}

fn size_label((rows, cols): (usize, usize)) -> String {
    format!("{rows}x{cols}")
}

fn overhead(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "overhead");
    let n = TINY.0 * TINY.1;
    let (x, out) = (b.tensor(n), b.kernels.zeros(n).expect("zeros"));
    let relu = b
        .kernels
        .activation_forward(Activation::Relu, out.view(), x.view())
        .expect("relu");
    b.time(&mut group, "empty_submit_wait", "0", None, &[]);
    b.time(&mut group, "relu_tiny_dispatches", "1", None, &[&relu]);
    // The difference to one dispatch, over 15, is the cost of a dispatch
    // inside a pass (llvmpipe wakes its thread pool for each).
    let sixteen = [&relu; 16];
    b.time(&mut group, "relu_tiny_dispatches", "16", None, &sixteen);
    group.finish();
}

fn elementwise(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "elementwise");
    for shape in [TINY, LARGE] {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let (x, y, out) = (b.tensor(n), b.tensor(n), b.kernels.zeros(n).expect("zeros"));
        for op in Binary::ALL {
            let d = b
                .kernels
                .binary(op, out.view(), x.view(), y.view())
                .expect("binary");
            b.time(
                &mut group,
                format!("{op:?}"),
                &label,
                Some(3 * n as u64 * F32),
                &[&d],
            );
        }
        for act in Activation::ALL {
            let fwd = b
                .kernels
                .activation_forward(act, out.view(), x.view())
                .expect("activation forward");
            b.time(
                &mut group,
                format!("{act:?}_forward"),
                &label,
                Some(2 * n as u64 * F32),
                &[&fwd],
            );
            let bwd = b
                .kernels
                .activation_backward(act, out.view(), x.view(), y.view())
                .expect("activation backward");
            b.time(
                &mut group,
                format!("{act:?}_backward"),
                &label,
                Some(3 * n as u64 * F32),
                &[&bwd],
            );
        }
        let bias = b.tensor(cols);
        let d = b
            .kernels
            .bias_add(out.view(), x.view(), bias.view(), rows, cols)
            .expect("bias_add");
        b.time(
            &mut group,
            "bias_add",
            &label,
            Some((2 * n + cols) as u64 * F32),
            &[&d],
        );
    }
    group.finish();
}

fn reduce(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "reduce");
    for shape in [TINY, LARGE] {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let x = b.tensor(n);
        let (col_out, row_out, scalar) = (
            b.kernels.zeros(cols).expect("zeros"),
            b.kernels.zeros(rows).expect("zeros"),
            b.kernels.zeros(1).expect("zeros"),
        );
        let d = b
            .kernels
            .sum_rows(col_out.view(), x.view(), rows, cols)
            .expect("sum_rows");
        b.time(
            &mut group,
            "sum_rows",
            &label,
            Some((n + cols) as u64 * F32),
            &[&d],
        );
        // One workgroup by design (deterministic order): shows its ceiling.
        let d = b.kernels.sum(scalar.view(), x.view()).expect("sum");
        b.time(&mut group, "sum", &label, Some((n + 1) as u64 * F32), &[&d]);
        let d = b
            .kernels
            .max_rows(row_out.view(), x.view(), rows, cols)
            .expect("max_rows");
        b.time(
            &mut group,
            "max_rows",
            &label,
            Some((n + rows) as u64 * F32),
            &[&d],
        );
        let d = b
            .kernels
            .argmax_rows(row_out.view(), x.view(), rows, cols)
            .expect("argmax_rows");
        b.time(
            &mut group,
            "argmax_rows",
            &label,
            Some((n + rows) as u64 * F32),
            &[&d],
        );
    }
    group.finish();
}

fn loss(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "loss");
    for shape in LOSS_SHAPES {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let (pred, target, grad) = (b.tensor(n), b.tensor(n), b.kernels.zeros(n).expect("zeros"));
        let labels = b.labels(rows, cols);
        let (loss, dloss) = (
            b.kernels.zeros(1).expect("zeros"),
            b.kernels.upload(&[1.0f32]).expect("upload"),
        );
        let k = &b.kernels;

        let d = k
            .mse_forward(loss.view(), pred.view(), target.view())
            .expect("mse_forward");
        b.time(
            &mut group,
            "mse_forward",
            &label,
            Some(2 * n as u64 * F32),
            &[&d],
        );
        let d = k
            .mse_backward(grad.view(), pred.view(), target.view(), dloss.view())
            .expect("mse_backward");
        b.time(
            &mut group,
            "mse_backward",
            &label,
            Some(3 * n as u64 * F32),
            &[&d],
        );
        let d = k
            .mse_forward_backward(
                loss.view(),
                grad.view(),
                pred.view(),
                target.view(),
                dloss.view(),
            )
            .expect("mse_forward_backward");
        b.time(
            &mut group,
            "mse_forward_backward",
            &label,
            Some(3 * n as u64 * F32),
            &[&d],
        );

        let (logits_labels, logits_grad) = ((n + rows) as u64 * F32, (2 * n + rows) as u64 * F32);
        let d = k
            .cross_entropy_forward(loss.view(), pred.view(), labels.view(), rows, cols)
            .expect("cross_entropy_forward");
        b.time(
            &mut group,
            "cross_entropy_forward",
            &label,
            Some(logits_labels),
            &[&d],
        );
        let d = k
            .cross_entropy_backward(
                grad.view(),
                pred.view(),
                labels.view(),
                dloss.view(),
                rows,
                cols,
            )
            .expect("cross_entropy_backward");
        b.time(
            &mut group,
            "cross_entropy_backward",
            &label,
            Some(logits_grad),
            &[&d],
        );
        let d = k
            .cross_entropy_forward_backward(
                loss.view(),
                grad.view(),
                pred.view(),
                labels.view(),
                dloss.view(),
                rows,
                cols,
            )
            .expect("cross_entropy_forward_backward");
        b.time(
            &mut group,
            "cross_entropy_forward_backward",
            &label,
            Some(logits_grad),
            &[&d],
        );
    }
    group.finish();
}

fn optim(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "optim");
    let sgd = SgdConfig::default();
    let momentum = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let adam = AdamConfig::adam();
    for n in ARENAS {
        let label = n.to_string();
        // Gradients in [-3, 3] and lr ≤ 0.01: thousands of repeated updates
        // keep every value finite, so the timing never hits denormal or NaN paths.
        let (param, grad) = (b.tensor(n), b.tensor(n));
        let (state_a, state_b) = (
            b.kernels.zeros(n).expect("zeros"),
            b.kernels.zeros(n).expect("zeros"),
        );
        let k = &b.kernels;
        // Step 2: the steady-state path (step 1 initialises the momentum buffer).
        let d = k
            .sgd_update(param.view(), grad.view(), state_a.view(), &sgd, 2)
            .expect("sgd_update");
        b.time(&mut group, "sgd", &label, Some(3 * n as u64 * F32), &[&d]);
        let d = k
            .sgd_update(param.view(), grad.view(), state_a.view(), &momentum, 2)
            .expect("sgd_update momentum");
        b.time(
            &mut group,
            "sgd_momentum",
            &label,
            Some(5 * n as u64 * F32),
            &[&d],
        );
        let d = k
            .adam_update(
                param.view(),
                grad.view(),
                state_a.view(),
                state_b.view(),
                &adam,
                2,
            )
            .expect("adam_update");
        b.time(&mut group, "adam", &label, Some(7 * n as u64 * F32), &[&d]);
    }
    group.finish();
}

fn main() {
    let device = match Device::open_default() {
        Ok(d) => d,
        Err(e) => {
            println!("kernels bench skipped: no usable adapter ({e})");
            return;
        }
    };
    println!(
        "kernels bench on {}, LP_NUM_THREADS={}, load average {}",
        device.label(),
        std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        load_average(),
    );
    let mut bench = Bench {
        kernels: Kernels::new(device),
        rng: ChaCha8Rng::seed_from_u64(0x5eed),
    };
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500))
        .without_plots()
        .configure_from_args();
    overhead(&mut criterion, &mut bench);
    elementwise(&mut criterion, &mut bench);
    reduce(&mut criterion, &mut bench);
    loss(&mut criterion, &mut bench);
    optim(&mut criterion, &mut bench);
    criterion.final_summary();
    println!("kernels bench done, load average now {}", load_average());
}
