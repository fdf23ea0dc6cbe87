//! The adapter and its kernels: `wgrad adapters`, `tune`, `matmul` and
//! `shaders --dump` (every module as composed, and the browser cases).

use std::path::Path;
use std::time::Instant;

use wgrad::kernels::{MatmulForm, MatmulRequest};
use wgrad::{Device, DeviceOptions, Kernels};

use crate::common::open_kernels;
use crate::webgpu_cases;

pub fn shaders(opts: &DeviceOptions, dir: &Path, check_native: bool) -> wgrad::Result<()> {
    let written = wgrad::kernels::dump::write_modules(dir)?;
    for m in &written {
        println!("{} ({} entry points)", m.path.display(), m.entries.len());
    }
    println!("{} modules in {}", written.len(), dir.display());
    // The cases are built as a browser would run them, with WebGPU's
    // default limits; the few entries over those get the adapter's.
    let web_opts = DeviceOptions {
        limits: Some(wgrad::LimitsMode::WebGpu),
        ..opts.clone()
    };
    let web = Kernels::new(Device::open(&web_opts)?);
    let full = Kernels::new(Device::open(&DeviceOptions {
        limits: Some(wgrad::LimitsMode::Adapter),
        ..opts.clone()
    })?);
    let lowered = wgrad::kernels::LimitOverrides {
        max_storage_buffer_binding_size: Some(webgpu_cases::SPLIT_BINDING),
        ..Default::default()
    };
    let split = Kernels::with_limits(Device::open(&web_opts)?, lowered)?;
    let gpu_shaped = wgrad::kernels::LimitOverrides {
        gpu_shaping: Some(true),
        ..Default::default()
    };
    let gpu = Kernels::with_limits(Device::open(&web_opts)?, gpu_shaped)?;
    let cases = webgpu_cases::write_cases(
        dir,
        &webgpu_cases::CaseKernels {
            web: &web,
            full: &full,
            split: &split,
            gpu: &gpu,
        },
        check_native,
    )?;
    for reason in &cases.unbuilt {
        println!("not built on {}: {reason}", web.device().label());
    }
    let checked = if check_native {
        ", each checked there against the CPU twin"
    } else {
        ""
    };
    println!(
        "{} cases in {} (built on {}{checked})",
        cases.built,
        dir.join("cases.json").display(),
        web.device().label()
    );
    if !cases.native_failures.is_empty() {
        return Err(wgrad::Error::Validation {
            op: "shaders --dump".into(),
            message: format!(
                "{} case(s) disagree with the CPU twin on {} itself:\n{}",
                cases.native_failures.len(),
                web.device().label(),
                cases.native_failures.join("\n")
            ),
        });
    }
    Ok(())
}

pub fn tune(opts: &DeviceOptions) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    println!("tuning matmul on {}", kernels.device().label());
    let table = kernels.autotune()?;
    print!("{}", table.table());
    match wgrad::kernels::autotune::cache_path() {
        Some(path) => println!("cached in {}", path.display()),
        None => println!("no cache directory (set WGRAD_CACHE_DIR); kept for this run only"),
    }
    Ok(())
}

pub fn adapters() -> wgrad::Result<()> {
    let list = wgrad::device::list_adapters();
    if list.is_empty() {
        return Err(wgrad::Error::NoAdapter { filter: String::new() });
    }
    for report in &list {
        println!("{report}");
    }
    Ok(())
}

/// A small deterministic generator so the CLI needs no RNG crate.
fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn matmul(opts: &DeviceOptions, n: usize, reps: usize) -> wgrad::Result<()> {
    let kernels = Kernels::new(Device::open(opts)?);
    println!(
        "adapter: {} — {:?} kernel",
        kernels.device().label(),
        kernels.matmul_variant()
    );
    let a_host = pseudo_random(n * n, 1);
    let b_host = pseudo_random(n * n, 2);
    let a = kernels.upload(&a_host)?;
    let b = kernels.upload(&b_host)?;
    let c = kernels.zeros(n * n)?;
    let dispatch = kernels.matmul(
        &MatmulRequest::new(MatmulForm::AB, n, n, n),
        c.view(),
        a.view(),
        b.view(),
    )?;
    kernels.run(&[&dispatch])?;
    let gpu = kernels.read::<f32>(c.view())?;
    let start = Instant::now();
    for _ in 0..reps {
        kernels.run(&[&dispatch])?;
    }
    kernels.device().wait_idle("matmul")?;
    let seconds = start.elapsed().as_secs_f64() / reps.max(1) as f64;
    let reference = wgrad::cpu::matmul(MatmulForm::AB, &a_host, &b_host, n, n, n);
    let max_err = gpu
        .iter()
        .zip(&reference)
        .map(|(g, r)| (g - r).abs())
        .fold(0.0f32, f32::max);
    let gflops = 2.0 * (n as f64).powi(3) / seconds / 1e9;
    println!(
        "matmul n={n}: {:.2} ms, {gflops:.2} GFLOPS, max |gpu - cpu| = {max_err:.2e}",
        seconds * 1e3
    );
    let tolerance = 1e-6 * n as f32 + 1e-5;
    if max_err > tolerance {
        return Err(wgrad::Error::Validation {
            op: "matmul".into(),
            message: format!("GPU result differs from the CPU reference by {max_err} (> {tolerance})"),
        });
    }
    Ok(())
}
