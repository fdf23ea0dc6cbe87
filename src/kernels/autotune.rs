//! Matmul autotuning: which [`MatmulVariant`] each [`MatmulForm`] runs on
//! this adapter.
//!
//! Tuning runs **only when asked** (`wgrad tune`, or [`Kernels::autotune`]):
//! on llvmpipe compiling one register-blocked pipeline alone takes 3–5 s, so
//! tuning at first use would hold a first training step up for tens of
//! seconds (Burn spends 84 s). Every other run reads the table:
//!
//! 1. `WGRAD_AUTOTUNE=0|off|false`: the fallback table, nothing read.
//! 2. Otherwise the cached result for this adapter, if one exists: a JSON
//!    file `matmul-tune.json` in `$WGRAD_CACHE_DIR`, else
//!    `$XDG_CACHE_HOME/wgrad/`, else `~/.cache/wgrad/`, keyed by adapter
//!    name, backend, driver, driver info, the wgrad version and a hash of
//!    `matmul.wgsl` (a new driver or kernel source tunes afresh).
//! 3. Otherwise the fallback table: CPU adapters (llvmpipe, WARP, SwiftShader)
//!    get [`MatmulVariant::Subgroup`] where it runs (SUBGROUP with 8-lane
//!    subgroups: lavapipe), else [`MatmulVariant::RegisterVec4`] for AB
//!    and ABᵀ and [`MatmulVariant::Register`] for AᵀB (llvmpipe-GL, which
//!    has no subgroups); every other adapter gets [`MatmulVariant::Shared`].
//!    On lavapipe the subgroup kernel timed 1.3–2.1× Register on every form
//!    at the MLP's shapes, and the MLP step took 0.6–0.8× the time in 7 of
//!    8 alternating pairs (BENCHMARKS.md).
//!    It stays off GPUs untuned: 512 accumulators per lane would spill
//!    there, where workgroup-memory tiling is the known good shape. On
//!    llvmpipe-GL the vec4 kernel for AB and ABᵀ made the default GPT's
//!    training step 1.35–1.65× faster than Register everywhere, and the
//!    MLP step no slower (alternating runs, BENCHMARKS.md); it is not used
//!    for AᵀB, which it made 2.5–5× slower inside the MLP step although
//!    AᵀB timed alone is on par.
//!
//! A tuning run times every candidate variant on one training-sized shape
//! per form (an MLP layer 784→512 at batch 256 on CPU adapters; on GPUs
//! GPT-2's MLP over 4096 tokens, timed by timestamp queries over many
//! launches in one pass, so the submit and wait are not what is measured)
//! within a time budget
//! (`WGRAD_TUNE_BUDGET_MS`, default 3000 ms of timed runs; pipeline
//! compilation is reported separately), checks each candidate's result
//! against an exact host product before timing it (a wrong kernel is never chosen),
//! and writes the winners to the cache. [`MatmulVariant::RegisterVec4`] is a
//! candidate for AB and ABᵀ only, because of that AᵀB slowdown in training
//! steps which a single timed AᵀB does not show; [`MatmulVariant::Subgroup`]
//! only on adapters that can run it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::matmul::MatmulVariant;
use super::registry::Family;
use super::Kernels;
use super::{MatmulKernel, MatmulRequest};
use crate::error::{Error, Result};
use crate::ops::MatmulForm;

const CACHE_FILE: &str = "matmul-tune.json";

/// The variant chosen for each form, and where the choice came from.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MatmulTuning {
    pub ab: MatmulVariant,
    pub atb: MatmulVariant,
    pub abt: MatmulVariant,
    /// "fallback" or "tuned <unix seconds>".
    pub source: String,
    /// What the tuning measured: one row per (form, variant).
    #[serde(default)]
    pub measurements: Vec<TuneMeasurement>,
}

/// One timed candidate.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TuneMeasurement {
    pub form: MatmulForm,
    pub variant: MatmulVariant,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub gflops: f64,
    pub compile_ms: f64,
}

impl MatmulTuning {
    pub fn variant(&self, form: MatmulForm) -> MatmulVariant {
        match form {
            MatmulForm::AB => self.ab,
            MatmulForm::AtB => self.atb,
            MatmulForm::ABt => self.abt,
        }
    }

    fn set(&mut self, form: MatmulForm, variant: MatmulVariant) {
        match form {
            MatmulForm::AB => self.ab = variant,
            MatmulForm::AtB => self.atb = variant,
            MatmulForm::ABt => self.abt = variant,
        }
    }

    /// The table used with no cache: see the module documentation.
    /// `subgroup_matmul`: whether the device runs [`MatmulVariant::Subgroup`]
    /// ([`Kernels::supports_subgroup_matmul`]).
    pub fn fallback(device_type: wgpu::DeviceType, subgroup_matmul: bool) -> Self {
        let (ab, atb, abt) = match device_type {
            wgpu::DeviceType::Cpu if subgroup_matmul => (
                MatmulVariant::Subgroup,
                MatmulVariant::Subgroup,
                MatmulVariant::Subgroup,
            ),
            wgpu::DeviceType::Cpu => (
                MatmulVariant::RegisterVec4,
                MatmulVariant::Register,
                MatmulVariant::RegisterVec4,
            ),
            _ => (MatmulVariant::Shared, MatmulVariant::Shared, MatmulVariant::Shared),
        };
        MatmulTuning {
            ab,
            atb,
            abt,
            source: "fallback".into(),
            measurements: Vec::new(),
        }
    }

    /// One line per form, then the measurements.
    pub fn table(&self) -> String {
        let mut out = format!("matmul tuning ({}):\n", self.source);
        for form in MatmulForm::ALL {
            out += &format!("  {form:?}: {:?}\n", self.variant(form));
        }
        for t in &self.measurements {
            out += &format!(
                "  measured {:?} {:?} {}x{}x{}: {:.2} GFLOPS (compile {:.0} ms)\n",
                t.form, t.variant, t.m, t.n, t.k, t.gflops, t.compile_ms
            );
        }
        out
    }
}

/// op(A)·op(B) on the host for tuning's check. The operands are small
/// integers, so every sum is exact in f32 in any order; this is its own
/// loop rather than `cpu::matmul`, which is for tests (the kernels do not
/// import the CPU twins), and indexes through `MatmulForm` like the twin.
fn exact_product(form: MatmulForm, a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for (i, row) in c.chunks_mut(n).enumerate() {
        for (j, out) in row.iter_mut().enumerate() {
            *out = (0..k)
                .map(|p| a[form.a_index(m, k, i, p)] * b[form.b_index(n, k, p, j)])
                .sum();
        }
    }
    c
}

/// Cache key of an adapter: name, backend, driver, wgrad version, shader hash
/// (of the subgroup family's source, which holds matmul.wgsl too).
pub fn cache_key(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} | {:?} | {} {} | wgrad {} | matmul kernels {:016x}",
        info.name,
        info.backend,
        info.driver,
        info.driver_info,
        env!("CARGO_PKG_VERSION"),
        crate::user_cache::fnv1a(Family::MatmulSubgroup.source().as_bytes())
    )
}

/// The cache file's path (in [`crate::user_cache::cache_dir`]), or None
/// when no cache directory can be named.
pub fn cache_path() -> Option<PathBuf> {
    crate::user_cache::cache_dir().map(|dir| dir.join(CACHE_FILE))
}

fn autotune_disabled() -> bool {
    std::env::var("WGRAD_AUTOTUNE")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"))
        .unwrap_or(false)
}

type CacheFile = BTreeMap<String, MatmulTuning>;

/// An unreadable or malformed cache is treated as empty: it only holds
/// measurements, and the next `wgrad tune` rewrites it.
fn read_cache(path: &Path) -> CacheFile {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// Tables already resolved in this process, by cache key.
fn resolved() -> &'static Mutex<BTreeMap<String, MatmulTuning>> {
    static TABLES: OnceLock<Mutex<BTreeMap<String, MatmulTuning>>> = OnceLock::new();
    TABLES.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn lock_resolved() -> std::sync::MutexGuard<'static, BTreeMap<String, MatmulTuning>> {
    resolved().lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The table for an adapter (see the module documentation for the order);
/// reads the cache file at most once per adapter and process.
/// The in-process table's key: two devices on one adapter may differ in the
/// features they requested, hence in their fallback.
fn resolved_key(cache_key: &str, subgroup_matmul: bool) -> String {
    format!("{cache_key} | subgroup matmul {subgroup_matmul}")
}

/// `subgroup_matmul` as in [`MatmulTuning::fallback`].
pub fn tuning_for(info: &wgpu::AdapterInfo, subgroup_matmul: bool) -> MatmulTuning {
    let fallback = || MatmulTuning::fallback(info.device_type, subgroup_matmul);
    if autotune_disabled() {
        return fallback();
    }
    let key = cache_key(info);
    let resolved_key = resolved_key(&key, subgroup_matmul);
    if let Some(t) = lock_resolved().get(&resolved_key) {
        return t.clone();
    }
    let table = cache_path()
        .and_then(|path| read_cache(&path).remove(&key))
        .unwrap_or_else(fallback);
    lock_resolved().insert(resolved_key, table.clone());
    table
}

/// One training-sized shape per form: an MLP layer 784→512 at batch 256
/// (forward, weight gradient, input gradient). Every candidate is checked
/// against an exact host product here, and CPU adapters are timed here.
pub const TUNE_SHAPES: [(MatmulForm, usize, usize, usize); 3] = [
    (MatmulForm::AB, 256, 512, 784),
    (MatmulForm::AtB, 784, 512, 256),
    (MatmulForm::ABt, 256, 784, 512),
];

/// The shapes GPUs are timed on: GPT-2's MLP (768→3072) over 4096 tokens
/// (19 GFLOP a product). 0.2 GFLOP, the CPU shape, is a few microseconds
/// on a GPU, so its timing would be the launch, not the kernel.
pub const GPU_TUNE_SHAPES: [(MatmulForm, usize, usize, usize); 3] = [
    (MatmulForm::AB, 4096, 3072, 768),
    (MatmulForm::AtB, 768, 3072, 4096),
    (MatmulForm::ABt, 4096, 768, 3072),
];

/// GPU time per timed round: launches of a candidate are repeated in one
/// pass until a round takes about this long.
const GPU_ROUND: Duration = Duration::from_millis(20);

/// The variants tuning times for a form (see the module documentation for
/// why AtB leaves out the vec4 kernel).
pub fn candidates_for(form: MatmulForm) -> Vec<MatmulVariant> {
    // Small is chosen by shape, never by tuning (it is slow at the tuned sizes).
    MatmulVariant::ALL
        .into_iter()
        .filter(|&v| v != MatmulVariant::Small && !(form == MatmulForm::AtB && v == MatmulVariant::RegisterVec4))
        .collect()
}

fn budget() -> Duration {
    let ms = std::env::var("WGRAD_TUNE_BUDGET_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(3000);
    Duration::from_millis(ms.max(1))
}

impl Kernels {
    /// The matmul variant for `form` on this adapter (tuned, cached or
    /// fallback).
    pub fn matmul_variant_for(&self, form: MatmulForm) -> MatmulVariant {
        let chosen = self.matmul_tuning().variant(form);
        // A cached table names a variant this device may not run, e.g. one
        // tuned on a device that requested SUBGROUP: fall back rather than fail.
        if self.supports_matmul_variant(chosen) {
            chosen
        } else {
            MatmulTuning::fallback(self.device().info().device_type, self.supports_subgroup_matmul()).variant(form)
        }
    }

    /// The table the matmul entries use on this adapter.
    pub fn matmul_tuning(&self) -> MatmulTuning {
        if self.gpu_shaped() == self.device().is_cpu() {
            // Kernels shaped for the other kind of adapter (a test forcing
            // GPU shapes on a software one): that kind's fallback table,
            // since a tuning of this adapter says nothing about it.
            let kind = if self.gpu_shaped() {
                wgpu::DeviceType::DiscreteGpu
            } else {
                wgpu::DeviceType::Cpu
            };
            return MatmulTuning::fallback(kind, self.supports_subgroup_matmul());
        }
        tuning_for(self.device().info(), self.supports_subgroup_matmul())
    }

    /// Times every variant on [`TUNE_SHAPES`] (each first checked against
    /// an exact host product), keeps the fastest per form for this process, and
    /// writes it to the cache file when one can be named. Returns the table.
    /// The candidates of a form are timed in turns (one run each per round,
    /// median over rounds), so load from other processes hits them alike.
    pub fn autotune(&self) -> Result<MatmulTuning> {
        let info = self.device().info();
        let mut table = MatmulTuning::fallback(info.device_type, self.supports_subgroup_matmul());
        let per_form = budget() / TUNE_SHAPES.len() as u32;
        let on_gpu = !self.device().is_cpu();
        for (shape, (form, m, n, k)) in TUNE_SHAPES.into_iter().enumerate() {
            let (sa, sb) = form.operand_shapes(m, n, k);
            // Small integers, so every product and sum is exact in f32 and
            // the check can demand equality with the reference.
            let pattern =
                |len: usize, seed: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + seed) % 5) as f32 - 2.0).collect() };
            let a_host = pattern(sa[0] * sa[1], 1);
            let b_host = pattern(sb[0] * sb[1], 3);
            let want = exact_product(form, &a_host, &b_host, m, n, k);
            let (a, b) = (self.upload(&a_host)?, self.upload(&b_host)?);
            let mut candidates = Vec::new();
            for variant in candidates_for(form)
                .into_iter()
                .filter(|&v| self.supports_matmul_variant(v))
            {
                let c = self.zeros(m * n)?;
                let started = Instant::now();
                // Weight gradients (AtB) accumulate into their buffer in a
                // training step, so they are timed that way (C starts at
                // zero, so the first result is still the plain product).
                let accumulate = form == MatmulForm::AtB;
                let dispatch = self.matmul(
                    &MatmulRequest::new(form, m, n, k)
                        .with_kernel(MatmulKernel::Tiled(variant))
                        .accumulating(accumulate),
                    c.view(),
                    a.view(),
                    b.view(),
                )?;
                self.run(&[&dispatch])?;
                let got: Vec<f32> = self.read(c.view())?;
                let compile_ms = started.elapsed().as_secs_f64() * 1e3;
                if got != want {
                    return Err(Error::InvalidArgument {
                        op: "autotune",
                        reason: format!(
                            "{variant:?} {form:?} {m}x{n}x{k} disagrees with the exact product; not tuning with it"
                        ),
                    });
                }
                candidates.push((variant, dispatch, compile_ms, Vec::new()));
            }
            // GPUs are timed on a GPU-sized product (checked above on the
            // small one: the same pipeline, other shapes).
            let (m, n, k) = if on_gpu {
                (
                    GPU_TUNE_SHAPES[shape].1,
                    GPU_TUNE_SHAPES[shape].2,
                    GPU_TUNE_SHAPES[shape].3,
                )
            } else {
                (m, n, k)
            };
            let timed_operands = if on_gpu {
                let (sa, sb) = form.operand_shapes(m, n, k);
                let fill = |len: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect() };
                Some((
                    self.upload(&fill(sa[0] * sa[1]))?,
                    self.upload(&fill(sb[0] * sb[1]))?,
                    self.zeros(m * n)?,
                ))
            } else {
                None
            };
            if let Some((a, b, c)) = &timed_operands {
                for (variant, dispatch, _, _) in candidates.iter_mut() {
                    *dispatch = self.matmul(
                        &MatmulRequest::new(form, m, n, k)
                            .with_kernel(MatmulKernel::Tiled(*variant))
                            .accumulating(form == MatmulForm::AtB),
                        c.view(),
                        a.view(),
                        b.view(),
                    )?;
                }
            }
            let deadline = Instant::now() + per_form;
            let mut rounds = 0;
            while rounds < 3 || (Instant::now() < deadline && rounds < 30) {
                for (_, dispatch, _, runs) in candidates.iter_mut() {
                    runs.push(self.time_candidate(dispatch)?);
                }
                rounds += 1;
            }
            let flops = 2.0 * (m * n * k) as f64;
            let mut best: Option<(f64, MatmulVariant)> = None;
            for (variant, _, compile_ms, mut runs) in candidates {
                runs.sort_by(f64::total_cmp);
                let gflops = flops / runs[runs.len() / 2] / 1e9;
                if best.is_none_or(|(g, _)| gflops > g) {
                    best = Some((gflops, variant));
                }
                table.measurements.push(TuneMeasurement {
                    form,
                    variant,
                    m,
                    n,
                    k,
                    gflops,
                    compile_ms,
                });
            }
            if let Some((_, variant)) = best {
                table.set(form, variant);
            }
        }
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        table.source = format!("tuned {since_epoch}");
        let key = cache_key(info);
        lock_resolved().insert(resolved_key(&key, self.supports_subgroup_matmul()), table.clone());
        if let Some(path) = cache_path() {
            let mut cache = read_cache(&path);
            cache.insert(key, table.clone());
            write_cache(&path, &cache)?;
        }
        Ok(table)
    }
}

impl Kernels {
    /// Seconds per launch of a tuning candidate: GPU time from timestamp
    /// queries over enough launches in one pass to fill [`GPU_ROUND`] on a
    /// GPU; elsewhere (and where timestamps are missing) the wall time of
    /// one launch with its submit and wait, which on a CPU adapter is
    /// dominated by the kernel.
    fn time_candidate(&self, dispatch: &super::Dispatch) -> Result<f64> {
        if !self.device().is_cpu() {
            if let Some(once) = self.time_on_gpu(dispatch, 1)? {
                let reps = (GPU_ROUND.as_secs_f64() / once.as_secs_f64().max(1e-7)).clamp(1.0, 256.0) as u32;
                if let Some(per_launch) = self.time_on_gpu(dispatch, reps)? {
                    return Ok(per_launch.as_secs_f64());
                }
            }
        }
        let t = Instant::now();
        self.run(&[dispatch])?;
        self.device().wait_idle("autotune")?;
        Ok(t.elapsed().as_secs_f64())
    }
}

fn write_cache(path: &Path, cache: &CacheFile) -> Result<()> {
    let text = serde_json::to_string_pretty(cache).map_err(|e| Error::Internal {
        op: "autotune",
        reason: format!("cannot encode the tuning cache: {e}"),
    })?;
    crate::user_cache::write_cache_file(path, text.as_bytes()).map_err(|(action, e)| Error::InvalidArgument {
        op: "autotune",
        reason: format!("cannot write the tuning cache {} ({action}): {e}", path.display()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_table_picks_subgroup_or_register_kernels_on_cpu_adapters_and_shared_elsewhere() {
        use MatmulVariant::{Register, RegisterVec4};
        let cpu_subgroup = MatmulTuning::fallback(wgpu::DeviceType::Cpu, true);
        let cpu = MatmulTuning::fallback(wgpu::DeviceType::Cpu, false);
        for subgroup_matmul in [false, true] {
            let gpu = MatmulTuning::fallback(wgpu::DeviceType::DiscreteGpu, subgroup_matmul);
            for form in MatmulForm::ALL {
                assert_eq!(gpu.variant(form), MatmulVariant::Shared);
            }
        }
        for form in MatmulForm::ALL {
            assert_eq!(cpu_subgroup.variant(form), MatmulVariant::Subgroup);
        }
        // Without subgroups: vec4 loads except for AᵀB (module documentation).
        assert_eq!(
            [
                cpu.variant(MatmulForm::AB),
                cpu.variant(MatmulForm::AtB),
                cpu.variant(MatmulForm::ABt)
            ],
            [RegisterVec4, Register, RegisterVec4]
        );
    }

    #[test]
    fn a_tuning_survives_the_json_cache_and_keys_name_the_adapter_and_version() {
        let mut table = MatmulTuning::fallback(wgpu::DeviceType::Cpu, false);
        table.set(MatmulForm::AtB, MatmulVariant::Register);
        table.measurements.push(TuneMeasurement {
            form: MatmulForm::AtB,
            variant: MatmulVariant::Register,
            m: 784,
            n: 512,
            k: 256,
            gflops: 9.5,
            compile_ms: 1200.0,
        });
        let dir = std::env::temp_dir().join(format!("wgrad-tune-test-{}", std::process::id()));
        let path = dir.join(CACHE_FILE);
        let mut cache = CacheFile::new();
        cache.insert("adapter".into(), table.clone());
        write_cache(&path, &cache).expect("write");
        assert_eq!(read_cache(&path).remove("adapter"), Some(table));
        std::fs::write(&path, "{ not json").expect("write");
        assert!(read_cache(&path).is_empty(), "a malformed cache reads as empty");
        let _ = std::fs::remove_dir_all(&dir);

        let info = wgpu::AdapterInfo {
            name: "llvmpipe (LLVM 15.0.6, 256 bits)".into(),
            driver: "llvmpipe".into(),
            driver_info: "Mesa 22.3.6".into(),
            ..wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan)
        };
        let key = cache_key(&info);
        for part in [
            "llvmpipe (LLVM 15.0.6, 256 bits)",
            "Vulkan",
            "Mesa 22.3.6",
            env!("CARGO_PKG_VERSION"),
        ] {
            assert!(key.contains(part), "{key} lacks {part}");
        }
        let other_driver = wgpu::AdapterInfo {
            driver_info: "Mesa 24.0".into(),
            ..info
        };
        assert_ne!(cache_key(&other_driver), key);
    }
}
