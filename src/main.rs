//! The `wgrad` command line.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use wgrad::kernels::MatmulForm;
use wgrad::{Device, DeviceOptions, Kernels};

#[derive(Parser)]
#[command(name = "wgrad", version, about = "Train and run neural networks on any GPU vendor through wgpu")]
struct Cli {
    /// Backend to search: vulkan, metal, dx12 or gl (default: all; env WGRAD_BACKEND).
    #[arg(long, global = true)]
    backend: Option<String>,
    /// Adapter index from `wgrad adapters`, or a name substring (env WGRAD_ADAPTER).
    #[arg(long, global = true)]
    adapter: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend with its limits and features.
    Adapters,
    /// Multiply two random n×n matrices on the GPU, check the result against
    /// the CPU and print the speed.
    Matmul {
        #[arg(long, default_value_t = 512)]
        n: usize,
        /// Timed repetitions after one warm-up.
        #[arg(long, default_value_t = 5)]
        reps: usize,
    },
}

fn device_options(cli: &Cli) -> wgrad::Result<DeviceOptions> {
    let mut opts = DeviceOptions::from_env()?;
    if let Some(b) = &cli.backend {
        opts.backends = Some(wgrad::device::parse_backend(b)?);
    }
    if let Some(a) = &cli.adapter {
        opts.adapter = Some(a.clone());
    }
    Ok(opts)
}

fn adapters() -> wgrad::Result<()> {
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
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matmul(opts: &DeviceOptions, n: usize, reps: usize) -> wgrad::Result<()> {
    let kernels = Kernels::new(Device::open(opts)?);
    println!("adapter: {} — {:?} kernel", kernels.device().label(), kernels.matmul_variant());
    let a_host = pseudo_random(n * n, 1);
    let b_host = pseudo_random(n * n, 2);
    let a = kernels.upload(&a_host)?;
    let b = kernels.upload(&b_host)?;
    let c = kernels.zeros(n * n)?;
    let dispatch = kernels.matmul(MatmulForm::AB, c.view(), a.view(), b.view(), n, n, n)?;
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
    println!("matmul n={n}: {:.2} ms, {gflops:.2} GFLOPS, max |gpu - cpu| = {max_err:.2e}", seconds * 1e3);
    let tolerance = 1e-6 * n as f32 + 1e-5;
    if max_err > tolerance {
        return Err(wgrad::Error::Validation {
            op: "matmul".into(),
            message: format!("GPU result differs from the CPU reference by {max_err} (> {tolerance})"),
        });
    }
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn,wgpu_hal::gles::egl=off")).init();
    let cli = Cli::parse();
    let result = device_options(&cli).and_then(|opts| match cli.command {
        Command::Adapters => adapters(),
        Command::Matmul { n, reps } => matmul(&opts, n, reps),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
