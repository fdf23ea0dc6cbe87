//! Shared test support: one long-lived `Kernels` per adapter present, a
//! runner that executes one test body on each, and tolerance checks.
#![allow(dead_code)]

mod gradcheck;
mod training;

use std::sync::{Arc, OnceLock};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::device::{AdapterReport, GlGuard};
use wgrad::{Device, Kernels};

pub use gradcheck::{central_differences, gradcheck, mse_to_random, param, param_in, wide};
pub use training::{
    assert_same_parameters, clipped_adamw, columns_held, copies_held, rows_held, train_on_one_device, Parameters,
};

/// What to install when there is no adapter (as scripts/ensure-vulkan.sh).
pub const INSTALL_HINT: &str = "on Debian/Ubuntu: sudo apt-get install mesa-vulkan-drivers libvulkan1 \
     libegl1 libegl-mesa0 libgl1-mesa-dri (or run scripts/ensure-vulkan.sh as root)";

fn truthy(name: &str) -> Option<bool> {
    let value = std::env::var(name).ok()?;
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// True when a machine without an adapter must fail the tests instead of
/// skipping them: `WGRAD_REQUIRE_ADAPTER=1`, or `CI=true`/`1` unless
/// `WGRAD_REQUIRE_ADAPTER=0` says otherwise. A CI runner that lost its
/// drivers would otherwise pass every GPU test without running one.
pub fn adapter_required() -> bool {
    truthy("WGRAD_REQUIRE_ADAPTER")
        .or_else(|| truthy("CI"))
        .unwrap_or(false)
}

/// Reports that `test` has no adapter to run on: panics with what to install
/// when an adapter is required, otherwise prints SKIP.
pub fn no_adapter(test: &str) {
    let filter = match std::env::var("WGRAD_TEST_BACKEND") {
        Ok(b) if !b.is_empty() => format!(" for WGRAD_TEST_BACKEND={b}"),
        _ => String::new(),
    };
    if adapter_required() {
        panic!(
            "{test}: no GPU adapter{filter}, and CI / WGRAD_REQUIRE_ADAPTER require one. \
             Install the software adapters (lavapipe, llvmpipe) {INSTALL_HINT}"
        );
    }
    eprintln!("SKIP {test}: no GPU adapter{filter} on this machine; install {INSTALL_HINT}");
}

/// The backends `WGRAD_TEST_BACKEND` names: a comma-separated list
/// (`vulkan`, `metal`, `dx12`, `gl`), or `primary`: Vulkan, Metal and DX12,
/// or every backend where none of those has an adapter (a machine with GL
/// alone). `make test` runs the suite on the primary adapters; GL's pass is
/// `make test-swiftshader`'s, beside SwiftShader (see the Makefile).
fn backends_chosen(listed: &[AdapterReport]) -> Option<wgpu::Backends> {
    let value = std::env::var("WGRAD_TEST_BACKEND").ok()?;
    let value = value.trim().to_ascii_lowercase();
    if value.is_empty() {
        return None;
    }
    if value == "primary" {
        let primary = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
        let any = listed
            .iter()
            .any(|r| primary.contains(wgpu::Backends::from(r.info.backend)));
        return any.then_some(primary);
    }
    let mut chosen = wgpu::Backends::empty();
    for name in value.split(',') {
        chosen |= wgrad::device::parse_backend(name).expect("WGRAD_TEST_BACKEND: vulkan, metal, dx12, gl or primary");
    }
    Some(chosen)
}

/// The adapters the tests use: every one listed, or those of
/// `WGRAD_TEST_BACKEND` (see [`backends_chosen`]), or those whose index or
/// name `WGRAD_TEST_ADAPTER` gives (comma-separated indexes, or a name
/// substring: scripts/gpu-check.sh runs the suite on one GPU this way).
pub fn reports() -> Vec<AdapterReport> {
    init_log();
    let listed = wgrad::device::list_adapters();
    let only = backends_chosen(&listed);
    let chosen = std::env::var("WGRAD_TEST_ADAPTER")
        .ok()
        .filter(|s| !s.trim().is_empty());
    let picked = |r: &AdapterReport| match &chosen {
        None => true,
        Some(sel) => sel.split(',').map(str::trim).any(|s| match s.parse::<usize>() {
            Ok(index) => index == r.index,
            Err(_) => r.info.name.to_ascii_lowercase().contains(&s.to_ascii_lowercase()),
        }),
    };
    listed
        .into_iter()
        .filter(|r| only.is_none_or(|b| b.contains(wgpu::Backends::from(r.info.backend))))
        .filter(picked)
        .collect()
}

/// True when there is an adapter to test; otherwise fails or skips `test`
/// (see [`no_adapter`]).
pub fn any_adapter(test: &str) -> bool {
    if reports().is_empty() {
        no_adapter(test);
        return false;
    }
    true
}

/// wgrad's GL lock when any adapter the tests use is a GL one, for tests
/// that drive several devices: it keeps their drops and direct wgpu calls
/// from waiting on wgpu's GL context while another test's submit holds it
/// (see `wgrad::device::lock_gl`).
pub fn lock_gl_if_any() -> Option<GlGuard> {
    reports()
        .iter()
        .any(|r| r.info.backend == wgpu::Backend::Gl)
        .then(wgrad::device::lock_gl)
}

/// `RUST_LOG` for the suite, each line led by the test that logged it:
/// `RUST_LOG=wgrad::kernels=debug` lists every pipeline each test creates
/// (llvmpipe compiles one at its first dispatch, so a cold run's compile
/// time shows in the test's time, not in the logged creation time).
fn init_log() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        use std::io::Write;
        let _ = env_logger::Builder::from_default_env()
            .format(|out, record| {
                writeln!(
                    out,
                    "[{}] {}",
                    std::thread::current().name().unwrap_or("main"),
                    record.args()
                )
            })
            .try_init();
    });
}

fn open_kernels(index: usize) -> Arc<Kernels> {
    let opts = wgrad::DeviceOptions {
        backends: None,
        adapter: Some(index.to_string()),
        ..Default::default()
    };
    let device = Device::open(&opts).expect("open adapter");
    // Kernels::new creates a buffer directly on the device.
    let _gl = device.lock_gl();
    Arc::new(Kernels::new(device))
}

/// Every adapter on the machine (on a CPU-only machine: lavapipe through
/// Vulkan and llvmpipe through GL). `WGRAD_TEST_BACKEND` restricts the
/// set (see [`backends_chosen`]).
pub fn adapters() -> &'static [Arc<Kernels>] {
    static ALL: OnceLock<Vec<Arc<Kernels>>> = OnceLock::new();
    ALL.get_or_init(|| reports().iter().map(|r| open_kernels(r.index)).collect())
}

/// A new device on the same adapter as `k`, for tests that count what
/// happens on a device and must not see other tests' work. Call it inside
/// [`for_each_adapter`], which holds the GL lock the new device needs.
pub fn private_kernels(k: &Kernels) -> Arc<Kernels> {
    let index = wgrad::device::list_adapters()
        .iter()
        .position(|r| r.info == *k.device().info())
        .expect("adapter still listed");
    open_kernels(index)
}

/// A new device on the same adapter as `k` whose kernels act as if the
/// adapter's limits were `overrides` (split bindings, memory checks on
/// small tensors). Call it inside [`for_each_adapter`], like
/// [`private_kernels`].
pub fn limited_kernels(k: &Kernels, overrides: wgrad::kernels::LimitOverrides) -> Arc<Kernels> {
    let index = wgrad::device::list_adapters()
        .iter()
        .position(|r| r.info == *k.device().info())
        .expect("adapter still listed");
    let opts = wgrad::DeviceOptions {
        backends: None,
        adapter: Some(index.to_string()),
        ..Default::default()
    };
    let device = Device::open(&opts).expect("open adapter");
    let _gl = device.lock_gl();
    Arc::new(Kernels::with_limits(device, overrides).expect("limits below the adapter's"))
}

/// Runs `body` once per adapter; without one, fails in CI and skips
/// elsewhere (see [`no_adapter`]). On a GL adapter the body holds wgrad's
/// GL lock throughout, so what it does outside wgrad's own locked calls
/// (drops of tensors and devices, direct wgpu calls) never waits on wgpu's
/// GL context while another test thread holds it.
pub fn for_each_adapter(test: &str, body: impl Fn(&Arc<Kernels>) -> wgrad::Result<()>) {
    let all = adapters();
    if all.is_empty() {
        no_adapter(test);
        return;
    }
    for k in all {
        let _gl = k.device().lock_gl();
        if let Err(e) = body(k) {
            panic!("{test} on {}: {e}", k.device().label());
        }
    }
}

/// Each adapter's kernels with the other shaping forced
/// (`LimitOverrides::gpu_shaping`): the GPU shapes and thresholds on a CPU
/// adapter, the CPU ones on a GPU. In the order of [`adapters`], one
/// device each, opened once.
pub fn other_shaping_adapters() -> &'static [Arc<Kernels>] {
    static ALL: OnceLock<Vec<Arc<Kernels>>> = OnceLock::new();
    ALL.get_or_init(|| {
        reports()
            .iter()
            .map(|r| {
                let opts = wgrad::DeviceOptions {
                    backends: None,
                    adapter: Some(r.index.to_string()),
                    ..Default::default()
                };
                let device = Device::open(&opts).expect("open adapter");
                let _gl = device.lock_gl();
                let gpu_shaping = Some(device.is_cpu());
                let overrides = wgrad::kernels::LimitOverrides {
                    gpu_shaping,
                    ..Default::default()
                };
                Arc::new(Kernels::with_limits(device, overrides).expect("no limit lowered"))
            })
            .collect()
    })
}

/// [`for_each_adapter`], twice per adapter: with its own kernel shaping
/// and with the other one ([`other_shaping_adapters`]), so the GPU
/// shapes (workgroup attention, two-stage sums, GPU thresholds) run on
/// the software adapters too. `body` may ask `k.gpu_shaped()`.
pub fn for_each_shaping(test: &str, body: impl Fn(&Arc<Kernels>) -> wgrad::Result<()>) {
    let all = adapters();
    if all.is_empty() {
        no_adapter(test);
        return;
    }
    for k in all.iter().chain(other_shaping_adapters()) {
        let _gl = k.device().lock_gl();
        if let Err(e) = body(k) {
            let shaping = if k.gpu_shaped() { "GPU" } else { "CPU" };
            panic!("{test} on {} ({shaping} shaping): {e}", k.device().label());
        }
    }
}

/// `|got - want| <= atol + rtol * |want|` elementwise, NaN only where NaN is wanted.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0.0f32);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g - w).abs();
        let bound = atol + rtol * w.abs();
        assert!(err <= bound, "{what}[{i}]: got {g}, want {w} (|err| {err} > {bound})");
        if err > worst.1 {
            worst = (i, err);
        }
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn random_vec(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Every (variant, form) the adapter runs on a Vulkan (or Metal, DX12)
/// adapter; on a GL adapter, the ones it runs untuned (small, and each
/// form's default) and the workgroup-memory kernel, every GPU's default
/// (GL on a GPU runs it; its pipelines compile in a fraction of a second).
/// A register-blocked pipeline costs 5–9 s to compile on a cold llvmpipe,
/// and the GL adapter runs the same WGSL, whose translation to GLSL
/// tests/suite/shaders.rs checks for every entry point.
pub fn variant_forms_to_test(k: &Kernels) -> Vec<(wgrad::kernels::MatmulVariant, wgrad::kernels::MatmulForm)> {
    use wgrad::kernels::{MatmulForm, MatmulVariant};
    let gl = k.device().is_gl();
    MatmulVariant::ALL
        .into_iter()
        .filter(|&v| k.supports_matmul_variant(v))
        .flat_map(|v| MatmulForm::ALL.into_iter().map(move |f| (v, f)))
        .filter(|&(v, f)| {
            !gl || matches!(v, MatmulVariant::Small | MatmulVariant::Shared) || k.matmul_variant_for(f) == v
        })
        .collect()
}

/// A whole tensor's values (waits for the GPU).
pub fn read(k: &Kernels, t: &wgrad::GpuTensor) -> wgrad::Result<Vec<f32>> {
    k.read::<f32>(t.view())
}
