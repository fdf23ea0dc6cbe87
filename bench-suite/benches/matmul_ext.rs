//! The opt-in matmuls against the f32 register kernel, in the same run:
//! `MatmulKernel::NativeF16` (f16 storage, f32 accumulation) and
//! `MatmulKernel::Tiled(MatmulVariant::Subgroup)`, every `MatmulForm`, square n×n×n.
//!
//! Kernels are timed in turns inside each trial (f32, f16, subgroup, then
//! again), so load from other work on the machine hits all of them alike;
//! the reported figure is each kernel's median over the trials, and the
//! ratios to f32 are the numbers to compare. One line per case:
//!
//! ```text
//! matmul_ext form=AB n=1024 f32_gflops=12.1 f16_gflops=10.2 subgroup_gflops=14.0 f16_ratio=0.84 subgroup_ratio=1.16 load=1.9
//! ```
//!
//! A kernel the adapter cannot run prints `unsupported` with the reason.
//! Each case first checks both opt-in results against the f32 kernel's.
//!
//! Environment: `WGRAD_ADAPTER` / `WGRAD_BACKEND` (adapter), `WGRAD_BENCH_N`
//! (sizes, default 256,512,1024), `WGRAD_BENCH_TRIALS` (default 5),
//! `LP_NUM_THREADS` (llvmpipe threads).
//!
//! Run: `LP_NUM_THREADS=2 cargo bench -p wgrad-benches --bench matmul_ext`

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::kernels::{Dispatch, MatmulForm, MatmulVariant};
use wgrad::kernels::{MatmulKernel, MatmulRequest};
use wgrad::{Device, Kernels};

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    let parsed: Vec<usize> = std::env::var(name)
        .map(|s| {
            s.split(',')
                .filter_map(|v| v.trim().parse().ok())
                .filter(|&v| v > 0)
                .collect()
        })
        .unwrap_or_default();
    if parsed.is_empty() {
        default.to_vec()
    } else {
        parsed
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Products per timing: enough that the submit-and-wait cost is small.
fn reps(n: usize) -> usize {
    match n {
        0..=256 => 8,
        257..=512 => 4,
        _ => 2,
    }
}

/// Seconds per product: `reps` submits, one wait.
fn time(k: &Kernels, d: &Dispatch, reps: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..reps {
        k.run(&[d]).expect("run");
    }
    k.device().wait_idle("bench").expect("wait");
    start.elapsed().as_secs_f64() / reps as f64
}

fn max_abs_diff(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    std::env::set_var(
        "XDG_RUNTIME_DIR",
        std::env::var("XDG_RUNTIME_DIR").unwrap_or_else(|_| "/tmp".into()),
    );
    let device = match Device::open_default() {
        Ok(d) => d,
        Err(e) => {
            println!("matmul_ext skipped: {e}");
            return;
        }
    };
    let k = Kernels::new(device);
    println!("adapter: {}", k.device().label());
    let trials = env_list("WGRAD_BENCH_TRIALS", &[5])[0];
    let mut lines = Vec::new();
    for n in env_list("WGRAD_BENCH_N", &[256, 512, 1024]) {
        let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
        let a_host: Vec<f32> = (0..n * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b_host: Vec<f32> = (0..n * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let a = k.upload(&a_host).expect("upload");
        let b = k.upload(&b_host).expect("upload");
        let a16 = k.upload_f16(&wgrad::cpu::to_f16(&a_host)).expect("upload");
        let b16 = k.upload_f16(&wgrad::cpu::to_f16(&b_host)).expect("upload");
        let c_ref = k.zeros(n * n).expect("zeros");
        let c = k.zeros(n * n).expect("zeros");
        for form in MatmulForm::ALL {
            let f32_kernel = k
                .matmul(
                    &MatmulRequest::new(form, n, n, n).with_kernel(MatmulKernel::Tiled(MatmulVariant::Register)),
                    c_ref.view(),
                    a.view(),
                    b.view(),
                )
                .expect("f32 matmul");
            k.run(&[&f32_kernel]).expect("run");
            let want: Vec<f32> = k.read(c_ref.view()).expect("read");
            let f16_kernel = k.matmul(
                &MatmulRequest::new(form, n, n, n).with_kernel(MatmulKernel::NativeF16),
                c.view(),
                a16.view(),
                b16.view(),
            );
            let subgroup_kernel = k.matmul(
                &MatmulRequest::new(form, n, n, n).with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup)),
                c.view(),
                a.view(),
                b.view(),
            );
            // Correctness first; the f16 bound is loose (inputs rounded to
            // f16, |values| < 1): a wrong kernel is off by O(1).
            let check = |name: &str, d: &Dispatch, tol: f32| {
                k.run(&[d]).expect("run");
                let got: Vec<f32> = k.read(c.view()).expect("read");
                let diff = max_abs_diff(&got, &want);
                assert!(
                    diff <= tol,
                    "{name} {form:?} n={n}: max |diff| {diff} vs f32 kernel > {tol}"
                );
            };
            if let Ok(d) = &f16_kernel {
                check("f16", d, 2e-3 * n as f32);
            }
            if let Ok(d) = &subgroup_kernel {
                check("subgroup", d, 1e-6 * n as f32);
            }
            let mut times: [Vec<f64>; 3] = Default::default();
            for _ in 0..trials {
                times[0].push(time(&k, &f32_kernel, reps(n)));
                if let Ok(d) = &f16_kernel {
                    times[1].push(time(&k, d, reps(n)));
                }
                if let Ok(d) = &subgroup_kernel {
                    times[2].push(time(&k, d, reps(n)));
                }
            }
            let gflops = |t: &Vec<f64>| (!t.is_empty()).then(|| 2.0 * (n as f64).powi(3) / median(t.clone()) / 1e9);
            let base = gflops(&times[0]).unwrap_or(f64::NAN);
            let mut line = format!("matmul_ext form={form:?} n={n} f32_gflops={base:.2}");
            for (name, t, result) in [
                ("f16", &times[1], f16_kernel.as_ref().err()),
                ("subgroup", &times[2], subgroup_kernel.as_ref().err()),
            ] {
                match (gflops(t), result) {
                    (Some(g), _) => line += &format!(" {name}_gflops={g:.2} {name}_ratio={:.2}", g / base),
                    (None, Some(e)) => line += &format!(" {name}=unsupported({e})"),
                    (None, None) => {}
                }
            }
            line += &format!(" load={}", load_average());
            println!("{line}");
            lines.push(line);
        }
    }
    println!("--- summary ---");
    for line in lines {
        println!("{line}");
    }
}
