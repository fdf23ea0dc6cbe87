//! Matmul throughput: the WGSL kernel `Kernels::matmul` picks for the adapter
//! against the CPU reference `matrixmultiply::sgemm`, for every
//! `MatmulForm` and n in 256, 512, 1024, 2048 (square M = N = K = n).
//!
//! Criterion reports elements/s with Throughput::Elements(2·n³ per product),
//! i.e. FLOP/s. After each case a plain line is printed from a separate
//! median-of-k timing of the same setup, and all of them again at the end:
//!
//! ```text
//! matmul form=AB n=1024 gflops=12.3 cpu_gflops=71.0 ratio=0.173 max_abs_err=7.4e-5
//! ```
//!
//! Each case first checks the GPU result against sgemm (the bench panics on a
//! wrong kernel). No adapter: it prints why and exits successfully. GFLOPS
//! on a shared 2-core machine swing ±40% with other load (the 1-minute load
//! average is printed); `ratio`, measured back to back, is steadier.
//!
//! Environment:
//! - `WGRAD_ADAPTER` / `WGRAD_BACKEND`: adapter choice (see `Device::open_default`).
//! - `WGRAD_BENCH_QUICK=1`: only n = 256 and 512.
//! - `WGRAD_BENCH_N=256,1024`: explicit list of sizes (overrides quick mode).
//! - `LP_NUM_THREADS`: llvmpipe/lavapipe worker threads.
//! - `MATMUL_NUM_THREADS`: threads of the CPU reference (default: physical cores, max 4).
//!
//! Run: `LP_NUM_THREADS=2 cargo bench -p wgrad-benches --bench matmul`

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::kernels::MatmulForm;
use wgrad::kernels::MatmulRequest;
use wgrad::{Device, Kernels};

const SIZES: [usize; 4] = [256, 512, 1024, 2048];
const QUICK_SIZES: [usize; 2] = [256, 512];

fn sizes() -> Vec<usize> {
    if let Ok(list) = std::env::var("WGRAD_BENCH_N") {
        let parsed: Vec<usize> = list
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .filter(|&n| n > 0)
            .collect();
        if !parsed.is_empty() {
            return parsed;
        }
    }
    let quick = std::env::var("WGRAD_BENCH_QUICK")
        .map(|v| !v.trim().is_empty() && v.trim() != "0")
        .unwrap_or(false);
    if quick {
        QUICK_SIZES.to_vec()
    } else {
        SIZES.to_vec()
    }
}

/// Products per timed GPU iteration: one submit each, then one wait. Small
/// sizes batch several so the wait's fixed cost is amortised.
fn gpu_reps(n: usize) -> u64 {
    match n {
        0..=256 => 8,
        257..=512 => 4,
        513..=1024 => 2,
        _ => 1,
    }
}

/// Repeats of the separate median timing behind the summary line.
fn summary_repeats(n: usize) -> usize {
    if n >= 2048 {
        3
    } else {
        5
    }
}

fn flops(n: usize) -> u64 {
    2 * (n as u64).pow(3)
}

fn random_matrix(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// C = op(A)·op(B) on the CPU with matrixmultiply; the transposes are
/// expressed with strides, exactly as the GPU kernel reads the stored data.
fn cpu_matmul(form: MatmulForm, n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, k) = (n, n);
    let ni = n as isize;
    let (mi, ki) = (m as isize, k as isize);
    // (row stride, column stride) of op(A) [m,k] and op(B) [k,n].
    let (rsa, csa) = match form {
        MatmulForm::AtB => (1, mi), // A stored [k,m]
        _ => (ki, 1),               // A stored [m,k]
    };
    let (rsb, csb) = match form {
        MatmulForm::ABt => (1, ki), // B stored [n,k]
        _ => (ni, 1),               // B stored [k,n]
    };
    // SAFETY: every index i·rs + j·cs with i, j inside the logical shapes
    // lies inside the n·n slices, and c does not alias a or b.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            ni,
            1,
        );
    }
}

/// The 1-minute load average, printed beside the results: on a shared
/// 2-core machine other processes easily halve the numbers.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "n/a".into())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|x, y| x.total_cmp(y));
    v[v.len() / 2]
}

struct Summary {
    form: MatmulForm,
    n: usize,
    gflops: f64,
    cpu_gflops: f64,
    max_err: f32,
}

impl Summary {
    fn line(&self) -> String {
        format!(
            "matmul form={:?} n={} gflops={:.2} cpu_gflops={:.1} ratio={:.3} max_abs_err={:.2e}",
            self.form,
            self.n,
            self.gflops,
            self.cpu_gflops,
            self.gflops / self.cpu_gflops,
            self.max_err
        )
    }
}

fn main() {
    let device = match Device::open_default() {
        Ok(d) => d,
        Err(e) => {
            println!("matmul bench skipped: no usable adapter ({e})");
            return;
        }
    };
    let label = device.label();
    let kernels = Kernels::new(device);
    let variant = kernels.matmul_variant();
    println!(
        "matmul bench on {label}, variant {variant:?}, LP_NUM_THREADS={}, MATMUL_NUM_THREADS={}, load average {}",
        std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        std::env::var("MATMUL_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        load_average(),
    );

    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .without_plots()
        .configure_from_args();

    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let mut summaries = Vec::new();
    for n in sizes() {
        let mut group = criterion.benchmark_group(format!("matmul_n{n}"));
        group.sample_size(10).sampling_mode(SamplingMode::Flat);
        if n >= 2048 {
            group.warm_up_time(Duration::from_millis(100));
        }
        for form in MatmulForm::ALL {
            let a_host = random_matrix(&mut rng, n * n);
            let b_host = random_matrix(&mut rng, n * n);
            let a = kernels.upload(&a_host).expect("upload A");
            let b = kernels.upload(&b_host).expect("upload B");
            let c = kernels.zeros(n * n).expect("allocate C");
            let dispatch = kernels
                .matmul(&MatmulRequest::new(form, n, n, n), c.view(), a.view(), b.view())
                .expect("build matmul dispatch");

            // Warm-up (GL compiles shaders lazily at the first dispatch) and a
            // correctness check against the CPU reference.
            kernels.run(&[&dispatch]).expect("run");
            let gpu_c: Vec<f32> = kernels.read(c.view()).expect("read C");
            let mut cpu_c = vec![0.0f32; n * n];
            cpu_matmul(form, n, &a_host, &b_host, &mut cpu_c);
            let max_err = gpu_c
                .iter()
                .zip(&cpu_c)
                .map(|(g, r)| (g - r).abs())
                .fold(0.0f32, f32::max);
            // Entries are sums of n products of values in [-1, 1].
            let tolerance = 1e-5 * n as f32;
            assert!(
                max_err <= tolerance,
                "{form:?} n={n}: GPU result differs from sgemm by {max_err} (> {tolerance})"
            );

            let reps = gpu_reps(n);
            let gpu_round = || {
                for _ in 0..reps {
                    kernels.run(&[&dispatch]).expect("run");
                }
                kernels.device().wait_idle("bench").expect("wait");
            };

            group.throughput(Throughput::Elements(flops(n) * reps));
            group.bench_function(BenchmarkId::new(format!("gpu_{form:?}"), n), |bench| {
                bench.iter(gpu_round)
            });
            group.throughput(Throughput::Elements(flops(n)));
            group.bench_function(BenchmarkId::new(format!("cpu_{form:?}"), n), |bench| {
                bench.iter(|| cpu_matmul(form, n, &a_host, &b_host, &mut cpu_c))
            });

            // Own median-of-k timing of the same work for the summary line.
            let k = summary_repeats(n);
            let gpu_secs = median(
                (0..k)
                    .map(|_| {
                        let t = Instant::now();
                        gpu_round();
                        t.elapsed().as_secs_f64() / reps as f64
                    })
                    .collect(),
            );
            let cpu_reps = (reps * 2) as usize;
            let cpu_secs = median(
                (0..k)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..cpu_reps {
                            cpu_matmul(form, n, &a_host, &b_host, &mut cpu_c);
                        }
                        t.elapsed().as_secs_f64() / cpu_reps as f64
                    })
                    .collect(),
            );
            let summary = Summary {
                form,
                n,
                gflops: flops(n) as f64 / gpu_secs / 1e9,
                cpu_gflops: flops(n) as f64 / cpu_secs / 1e9,
                max_err,
            };
            println!("{}", summary.line());
            summaries.push(summary);
        }
        group.finish();
    }
    criterion.final_summary();

    println!(
        "\nsummary ({label}, variant {variant:?}, load average now {}):",
        load_average()
    );
    for s in &summaries {
        println!("{}", s.line());
    }
}
