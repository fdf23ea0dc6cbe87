//! `wgrad bench`'s matmul case: GPU GFLOPS beside a CPU sgemm measured in
//! the same run. Here, not in the library, so only the CLI depends on the
//! sgemm crate; the other cases are `wgrad_benches`'s.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad_benches::{median_time, BenchLine};
use wgrad::kernels::MatmulForm;
use wgrad::Kernels;

fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn cpu_sgemm(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let n_i = n as isize;
    // SAFETY: a, b, c hold n·n elements each, row-major with the given strides.
    unsafe {
        matrixmultiply::sgemm(n, n, n, 1.0, a.as_ptr(), n_i, 1, b.as_ptr(), n_i, 1, 0.0, c.as_mut_ptr(), n_i, 1);
    }
}

/// GPU matmul GFLOPS for an n×n×n product beside the CPU sgemm.
pub fn matmul(kernels: &Kernels, n: usize, reps: usize) -> wgrad::Result<BenchLine> {
    let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
    let (a_host, b_host) = (random(n * n, &mut rng), random(n * n, &mut rng));
    let (a, b, c) = (kernels.upload(&a_host)?, kernels.upload(&b_host)?, kernels.zeros(n * n)?);
    let dispatch = kernels.matmul(MatmulForm::AB, c.view(), a.view(), b.view(), n, n, n)?;
    // Several launches per timing so the submit-and-wait cost is amortised.
    let per = if n <= 256 { 8 } else { 2 };
    let gpu = median_time(reps, || {
        for _ in 0..per {
            kernels.run(&[&dispatch])?;
        }
        kernels.device().wait_idle("bench")
    })? / per as u32;
    let mut c_host = vec![0.0f32; n * n];
    let cpu = median_time(reps, || {
        for _ in 0..per {
            cpu_sgemm(n, &a_host, &b_host, &mut c_host);
        }
        Ok(())
    })? / per as u32;
    let flops = 2.0 * (n as f64).powi(3);
    let (g, c) = (flops / gpu.as_secs_f64() / 1e9, flops / cpu.as_secs_f64() / 1e9);
    Ok(BenchLine {
        case: "matmul".into(),
        values: vec![
            ("n", n.to_string()),
            ("variant", format!("{:?}", kernels.matmul_variant_for(MatmulForm::AB))),
            ("tuning", kernels.matmul_tuning().source.split(' ').next().unwrap_or("").to_string()),
            ("gflops", format!("{g:.2}")),
            ("cpu_gflops", format!("{c:.2}")),
            ("ratio", format!("{:.3}", g / c)),
        ],
    })
}
