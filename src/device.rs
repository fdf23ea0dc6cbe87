//! Adapter discovery and selection across every backend compiled in, and one
//! long-lived `Device` per adapter that turns wgpu's error reporting
//! (error scopes, uncaptured errors, device loss) into `wgrad::Error` values.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

use crate::error::{Error, Result};
use crate::pipeline_cache::{PipelineCacheInfo, PipelineCacheSetting, PipelineCacheStore};

/// Environment variable: adapter index (as `wgrad adapters` numbers them) or a
/// case-insensitive substring of the adapter's name.
pub const ENV_ADAPTER: &str = "WGRAD_ADAPTER";
/// Environment variable: `vulkan`, `metal`, `dx12` or `gl`.
pub const ENV_BACKEND: &str = "WGRAD_BACKEND";

/// The features wgrad reports and requests when an adapter offers them.
pub const REPORTED_FEATURES: [(wgpu::Features, &str); 5] = [
    (wgpu::Features::SHADER_F16, "SHADER_F16"),
    (wgpu::Features::SUBGROUP, "SUBGROUP"),
    (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
    (wgpu::Features::SHADER_F64, "SHADER_F64"),
    // Pipelines kept across processes (crate::pipeline_cache).
    (wgpu::Features::PIPELINE_CACHE, "PIPELINE_CACHE"),
];

/// A clock that also runs in a browser, where `std::time::Instant::now`
/// panics (wasm32 has no clock of its own; `web-time` reads
/// `performance.now()`).
#[cfg(not(target_arch = "wasm32"))]
pub use std::time::Instant;
#[cfg(target_arch = "wasm32")]
pub use web_time::Instant;

/// wgrad's one blocking wait on the GPU: every host-side wait (device
/// creation, read-back, a queue drained) is an async function, and the
/// blocking API calls it through here, so native and browser builds run the
/// same code. Native only: the web build cannot name it, so nothing it
/// compiles blocks.
#[cfg(not(target_arch = "wasm32"))]
pub fn block_on<F: Future>(future: F) -> F::Output {
    pollster::block_on(future)
}

/// The blocking form of an async wgrad call (`op` names it in errors).
/// Natively it waits ([`block_on`]). A browser cannot block: there the
/// future is polled once, and one that has not finished (it waits for the
/// GPU) is an error saying to call the `_async` form instead.
pub fn wait<T>(op: &'static str, future: impl Future<Output = Result<T>>) -> Result<T> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = op;
        block_on(future)
    }
    #[cfg(target_arch = "wasm32")]
    {
        let mut future = std::pin::pin!(future);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(value) => value,
            std::task::Poll::Pending => Err(Error::InvalidArgument {
                op,
                reason: "a browser cannot block waiting for the GPU: call the `_async` form and await it".into(),
            }),
        }
    }
}

/// One process-wide instance: creating a GL instance initialises EGL, which is
/// slow and gains nothing when repeated.
fn instance() -> &'static wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::all();
        desc.flags = wgpu::InstanceFlags::from_build_config();
        wgpu::Instance::new(desc)
    })
}

/// wgpu's GL backend gives all devices on a GL adapter one EGL context behind
/// a mutex, and panics ("Could not lock adapter context. This is most-likely
/// a deadlock.") when a thread waits more than 6 s for it. One call can hold
/// it far longer with no deadlock: llvmpipe JIT-compiles each shader at its
/// first dispatch, inside the queue submit, and with a cold Mesa shader cache
/// one training-step submit held it for 50 s on a 2-core machine. So GL work
/// first queues here, without a time limit, and reaches wgpu's mutex only
/// when no other thread holds it. Re-entrant, because work inside
/// [`Device::scoped`] calls other methods that take it. Process-wide, not
/// per adapter: wgrad has one instance, and a GL instance has one context.
struct GlLock {
    /// The holding thread and how many times it has taken the lock.
    owner: Mutex<(Option<ThreadId>, usize)>,
    released: Condvar,
}

static GL_LOCK: GlLock = GlLock {
    owner: Mutex::new((None, 0)),
    released: Condvar::new(),
};

impl GlLock {
    fn owner(&self) -> MutexGuard<'_, (Option<ThreadId>, usize)> {
        // Updates are single assignments, so a poisoned state is still valid.
        self.owner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Held while this thread may use the GL context; see [`lock_gl`]. Not
/// `Send`: it must be released by the thread that took it.
#[must_use = "the GL lock is released when the guard is dropped"]
pub struct GlGuard {
    held: bool,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for GlGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GlGuard").field("held", &self.held).finish()
    }
}

impl Drop for GlGuard {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let mut owner = GL_LOCK.owner();
        owner.1 = owner.1.saturating_sub(1);
        if owner.1 == 0 {
            owner.0 = None;
            GL_LOCK.released.notify_one();
        }
    }
}

/// Takes wgrad's process-wide GL lock (re-entrant, no time limit). wgrad
/// takes it itself in [`Device::open`], [`Device::scoped`],
/// [`Device::check`] and [`Device::wait_idle`] on GL devices. Hold it around
/// other wgpu calls on a GL device (`write_buffer`, `poll`, `unmap`, dropping
/// buffers or devices) when other threads may be using a GL device at the
/// same time; otherwise wgpu can panic after waiting 6 s for the GL context
/// (see [`Device::lock_gl`] for the per-device form). Do not hold it while
/// waiting for another thread that uses a GL device.
pub fn lock_gl() -> GlGuard {
    let me = std::thread::current().id();
    let mut owner = GL_LOCK.owner();
    loop {
        match owner.0 {
            None => {
                *owner = (Some(me), 1);
                break;
            }
            Some(holder) if holder == me => {
                owner.1 += 1;
                break;
            }
            Some(_) => {
                owner = GL_LOCK
                    .released
                    .wait(owner)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
    }
    GlGuard {
        held: true,
        _not_send: PhantomData,
    }
}

/// [`lock_gl`] for GL adapters, nothing for the others (their drivers lock
/// internally without a time limit).
fn lock_gl_for(backend: wgpu::Backend) -> GlGuard {
    if backend == wgpu::Backend::Gl {
        lock_gl()
    } else {
        GlGuard {
            held: false,
            _not_send: PhantomData,
        }
    }
}

/// Parses a backend name as accepted by `WGRAD_BACKEND` and `--backend`.
pub fn parse_backend(name: &str) -> Result<wgpu::Backends> {
    match name.trim().to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => Ok(wgpu::Backends::VULKAN),
        "metal" | "mtl" => Ok(wgpu::Backends::METAL),
        "dx12" | "d3d12" => Ok(wgpu::Backends::DX12),
        "gl" | "gles" | "opengl" => Ok(wgpu::Backends::GL),
        other => Err(Error::UnknownBackend(other.to_string())),
    }
}

/// Environment variable: `webgpu` opens every device with WebGPU's default
/// limits ([`LimitsMode::WebGpu`]); `adapter` (the default) with the
/// adapter's own.
pub const ENV_LIMITS: &str = "WGRAD_LIMITS";

/// Which limits a device is opened with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LimitsMode {
    /// Everything the adapter offers (larger bindings, more storage
    /// buffers per stage).
    #[default]
    Adapter,
    /// What every WebGPU implementation guarantees (`wgpu::Limits::default()`:
    /// 8 storage buffers per stage, 16 KiB of workgroup memory, 128 MiB
    /// bindings, 256-byte offset alignment) and no feature a browser lacks
    /// (SHADER_F64): a run that passes here runs in any browser's WebGPU.
    /// PIPELINE_CACHE stays: no shader sees it.
    WebGpu,
}

impl LimitsMode {
    /// Parses `adapter` or `webgpu` (as `WGRAD_LIMITS` takes them).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "" | "adapter" | "native" => Ok(LimitsMode::Adapter),
            "webgpu" | "strict" => Ok(LimitsMode::WebGpu),
            other => Err(Error::InvalidArgument {
                op: ENV_LIMITS,
                reason: format!("`{other}` is not a limits mode: expected `adapter` or `webgpu`"),
            }),
        }
    }

    /// `WGRAD_LIMITS`, or the adapter's limits when unset.
    pub fn from_env() -> Result<Self> {
        std::env::var(ENV_LIMITS).map_or(Ok(LimitsMode::Adapter), |v| Self::parse(&v))
    }
}

/// Which adapter to open. `Default` means "the best one by policy".
#[derive(Clone, Debug, Default)]
pub struct DeviceOptions {
    /// Restrict the search to these backends (all when `None`).
    pub backends: Option<wgpu::Backends>,
    /// An adapter index (as listed by [`list_adapters`]) or a name substring.
    pub adapter: Option<String>,
    /// The limits to open it with; `None` reads `WGRAD_LIMITS`.
    pub limits: Option<LimitsMode>,
    /// Where the device keeps its pipeline cache (see
    /// [`crate::pipeline_cache`]).
    pub pipeline_cache: PipelineCacheSetting,
}

impl DeviceOptions {
    /// Reads `WGRAD_BACKEND` and `WGRAD_ADAPTER`.
    pub fn from_env() -> Result<Self> {
        let backends = match std::env::var(ENV_BACKEND) {
            Ok(name) if !name.trim().is_empty() => Some(parse_backend(&name)?),
            _ => None,
        };
        let adapter = std::env::var(ENV_ADAPTER).ok().filter(|s| !s.trim().is_empty());
        Ok(DeviceOptions {
            backends,
            adapter,
            limits: Some(LimitsMode::from_env()?),
            pipeline_cache: PipelineCacheSetting::FromEnv,
        })
    }
}

/// What `wgrad adapters` prints for one adapter.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub index: usize,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
}

impl fmt::Display for AdapterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.info;
        let l = &self.limits;
        writeln!(f, "[{}] {}", self.index, i.name)?;
        writeln!(f, "    backend: {:?}, type: {:?}", i.backend, i.device_type)?;
        writeln!(f, "    driver: {} {}", i.driver, i.driver_info)?;
        writeln!(
            f,
            "    limits: storage binding {} MiB, buffer {} MiB, workgroup storage {} KiB, \
             invocations/workgroup {}, workgroups/dimension {}, storage buffers/stage {}, \
             storage offset alignment {} B",
            l.max_storage_buffer_binding_size / (1 << 20),
            l.max_buffer_size / (1 << 20),
            l.max_compute_workgroup_storage_size / 1024,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension,
            l.max_storage_buffers_per_shader_stage,
            l.min_storage_buffer_offset_alignment,
        )?;
        let feats: Vec<String> = REPORTED_FEATURES
            .iter()
            .map(|(flag, name)| {
                let mark = if self.features.contains(*flag) { "yes" } else { "no" };
                format!("{name}={mark}")
            })
            .collect();
        write!(f, "    features: {}", feats.join(" "))?;
        if self.features.contains(wgpu::Features::SUBGROUP) {
            write!(f, " (subgroup size {}..{})", i.subgroup_min_size, i.subgroup_max_size)?;
        }
        Ok(())
    }
}

/// Every adapter, enumerated once per process. Enumerating again while
/// another thread drives a GL device makes EGL's make-current fail inside
/// wgpu (a panic), so the list is taken once and reused.
///
/// A browser lists none: it hands a page one adapter, through
/// [`Device::open_async`].
fn all_adapters() -> &'static [wgpu::Adapter] {
    static ADAPTERS: OnceLock<Vec<wgpu::Adapter>> = OnceLock::new();
    #[cfg(not(target_arch = "wasm32"))]
    return ADAPTERS.get_or_init(|| block_on(instance().enumerate_adapters(wgpu::Backends::all())));
    #[cfg(target_arch = "wasm32")]
    return ADAPTERS.get_or_init(Vec::new);
}

fn report(index: usize, adapter: &wgpu::Adapter) -> AdapterReport {
    AdapterReport {
        index,
        info: adapter.get_info(),
        limits: adapter.limits(),
        features: adapter.features(),
    }
}

/// Every adapter on every backend compiled in, in the order `WGRAD_ADAPTER`
/// indexes them.
pub fn list_adapters() -> Vec<AdapterReport> {
    all_adapters().iter().enumerate().map(|(i, a)| report(i, a)).collect()
}

/// Lower is better: discrete > integrated > virtual > CPU, then native APIs
/// before GL (GL lacks subgroups and f16 and compiles shaders lazily).
pub(crate) fn policy_rank(info: &wgpu::AdapterInfo) -> (u8, u8) {
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    let api = match info.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    };
    (kind, api)
}

/// Picks an adapter: by index or name substring when `options.adapter` is
/// set, otherwise the best by policy. Indexes refer to the full list (all
/// backends) so they match `wgrad adapters` whatever `backends` says.
pub fn select_adapter(options: &DeviceOptions) -> Result<wgpu::Adapter> {
    let all = all_adapters();
    let backends = options.backends.unwrap_or(wgpu::Backends::all());
    let in_backend = |a: &wgpu::Adapter| backends.contains(wgpu::Backends::from(a.get_info().backend));
    let describe = |list: &[wgpu::Adapter]| {
        list.iter()
            .enumerate()
            .map(|(i, a)| {
                let info = a.get_info();
                format!("[{i}] {} ({:?})", info.name, info.backend)
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !all.iter().any(in_backend) {
        let filter = match options.backends {
            Some(b) => format!(" for backends {b:?}"),
            None => String::new(),
        };
        return Err(Error::NoAdapter { filter });
    }
    let mut candidates: Vec<(usize, &wgpu::Adapter)> = match options.adapter.as_deref() {
        Some(sel) => {
            let sel = sel.trim();
            if let Ok(index) = sel.parse::<usize>() {
                all.get(index).map(|a| vec![(index, a)]).unwrap_or_default()
            } else {
                let needle = sel.to_ascii_lowercase();
                all.iter()
                    .enumerate()
                    .filter(|(_, a)| a.get_info().name.to_ascii_lowercase().contains(&needle))
                    .collect()
            }
        }
        None => all.iter().enumerate().collect(),
    };
    candidates.retain(|(_, a)| in_backend(a));
    candidates.sort_by_key(|(i, a)| (policy_rank(&a.get_info()), *i));
    match candidates.first() {
        Some((_, adapter)) => Ok((*adapter).clone()),
        None => Err(Error::AdapterNotFound {
            selector: format!(
                "{}{}",
                options.adapter.as_deref().unwrap_or("<best>"),
                options.backends.map(|b| format!(" on {b:?}")).unwrap_or_default()
            ),
            available: describe(all),
        }),
    }
}

/// How long a wait for the GPU may take before it is an error:
/// `WGRAD_TIMEOUT_S` seconds, default 300.
pub fn wait_timeout() -> std::time::Duration {
    let seconds = std::env::var("WGRAD_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0);
    std::time::Duration::from_secs_f64(seconds.unwrap_or(300.0))
}

/// One opened device with its queue, plus the error state wgpu reports
/// asynchronously. Long-lived: create one per adapter and share it.
pub struct Device {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    features: wgpu::Features,
    lost: Arc<Mutex<Option<String>>>,
    uncaptured: Arc<Mutex<Vec<String>>>,
    /// Compiled pipelines kept across processes, where the driver has a
    /// cache (Vulkan with PIPELINE_CACHE).
    pipeline_cache: Option<PipelineCacheStore>,
}

impl Drop for Device {
    /// Saves pipelines compiled since the last save, so the next process
    /// finds them.
    fn drop(&mut self) {
        self.persist_pipeline_cache();
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .finish()
    }
}

impl Device {
    /// Opens the adapter chosen by `options`.
    pub fn open(options: &DeviceOptions) -> Result<Self> {
        wait("Device::open", Self::open_async(options))
    }

    /// [`Device::open`], awaited. In a browser the adapter is the one the
    /// page's WebGPU hands out (high-performance preferred); `options`'
    /// backend and adapter selection do not apply there.
    pub async fn open_async(options: &DeviceOptions) -> Result<Self> {
        let mode = match options.limits {
            Some(mode) => mode,
            None => LimitsMode::from_env()?,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let adapter = select_adapter(options)?;
        #[cfg(target_arch = "wasm32")]
        let adapter = instance()
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|_| Error::NoAdapter {
                filter: " (the browser offers no WebGPU adapter: WebGPU is off or unsupported here)".into(),
            })?;
        Self::from_adapter_with_cache_async(&adapter, mode, &options.pipeline_cache).await
    }

    /// Opens the adapter chosen by `WGRAD_BACKEND` / `WGRAD_ADAPTER`, or the
    /// best one by policy.
    pub fn open_default() -> Result<Self> {
        Self::open(&DeviceOptions::from_env()?)
    }

    /// Opens one device on every adapter present (one per backend and GPU).
    pub fn open_all() -> Result<Vec<Self>> {
        all_adapters().iter().map(Self::from_adapter).collect()
    }

    /// Opens a device on `adapter` with the limits `WGRAD_LIMITS` names
    /// (see [`Device::from_adapter_with`]).
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Result<Self> {
        Self::from_adapter_with(adapter, LimitsMode::from_env()?)
    }

    /// Opens a device on `adapter`, requesting the adapter's full limits (the
    /// defaults cap storage bindings at 128 MiB) and the optional features it
    /// has that wgrad can use; or, in [`LimitsMode::WebGpu`], WebGPU's
    /// default limits (no better than the adapter's) and WebGPU's features.
    /// Its pipeline cache is where `WGRAD_PIPELINE_CACHE` and the cache
    /// directory say ([`PipelineCacheSetting::FromEnv`]).
    pub fn from_adapter_with(adapter: &wgpu::Adapter, mode: LimitsMode) -> Result<Self> {
        Self::from_adapter_with_cache(adapter, mode, &PipelineCacheSetting::FromEnv)
    }

    /// [`Device::from_adapter_with`], with the pipeline cache kept where
    /// `cache` says. PIPELINE_CACHE is requested in both limit modes when
    /// offered: it changes how fast pipelines are created, never what a
    /// shader may do.
    pub fn from_adapter_with_cache(
        adapter: &wgpu::Adapter,
        mode: LimitsMode,
        cache: &PipelineCacheSetting,
    ) -> Result<Self> {
        wait(
            "request_device",
            Self::from_adapter_with_cache_async(adapter, mode, cache),
        )
    }

    /// [`Device::from_adapter_with_cache`], awaited.
    pub async fn from_adapter_with_cache_async(
        adapter: &wgpu::Adapter,
        mode: LimitsMode,
        cache: &PipelineCacheSetting,
    ) -> Result<Self> {
        let info = adapter.get_info();
        let offered = adapter.features();
        let wanted = REPORTED_FEATURES
            .iter()
            .fold(wgpu::Features::empty(), |acc, (f, _)| acc | *f);
        let (features, limits) = match mode {
            LimitsMode::Adapter => (offered & wanted, adapter.limits()),
            LimitsMode::WebGpu => (
                offered & wanted & !wgpu::Features::SHADER_F64,
                wgpu::Limits::default().or_worse_values_from(&adapter.limits()),
            ),
        };
        let desc = wgpu::DeviceDescriptor {
            label: Some("wgrad device"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let gl = lock_gl_for(info.backend);
        let (device, queue) = adapter
            .request_device(&desc)
            .await
            .map_err(|source| Error::RequestDevice {
                adapter: info.name.clone(),
                source,
            })?;

        let lost = Arc::new(Mutex::new(None));
        let lost_slot = Arc::clone(&lost);
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut slot) = lost_slot.lock() {
                *slot = Some(format!("{reason:?}: {message}"));
            }
        });
        drop(gl);
        // wgpu's default handler panics; keep errors that escape a scope so
        // the next checked operation can report them.
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&uncaptured);
        device.on_uncaptured_error(Arc::new(move |error: wgpu::Error| {
            if let Ok(mut errors) = sink.lock() {
                errors.push(error.to_string());
            }
        }));
        let pipeline_cache = PipelineCacheStore::open(&device, &info, cache).await;
        Ok(Device {
            device,
            queue,
            info,
            limits,
            features,
            lost,
            uncaptured,
            pipeline_cache,
        })
    }

    /// The pipeline cache every compute pipeline of this device is created
    /// through; `None` where there is none (see [`crate::pipeline_cache`]).
    pub fn pipeline_cache(&self) -> Option<&wgpu::PipelineCache> {
        self.pipeline_cache.as_ref().map(PipelineCacheStore::cache)
    }

    /// The pipeline cache's file and what opening the device found in it.
    pub fn pipeline_cache_info(&self) -> Option<&PipelineCacheInfo> {
        self.pipeline_cache.as_ref().map(PipelineCacheStore::info)
    }

    /// Writes the pipeline cache if pipelines were created since it was
    /// loaded or last saved and its data changed: the bytes written, or
    /// `None` for nothing to write. wgrad saves by itself once an executor is built and when the
    /// device is dropped; this is for callers that want it earlier.
    pub fn save_pipeline_cache(&self) -> Result<Option<usize>> {
        match &self.pipeline_cache {
            Some(store) => store.save(),
            None => Ok(None),
        }
    }

    /// [`Device::save_pipeline_cache`] for wgrad's own saves: a failure is
    /// logged, never an error of the run.
    pub(crate) fn persist_pipeline_cache(&self) {
        if let Err(e) = self.save_pipeline_cache() {
            log::warn!("{e}; the next run compiles its pipelines again");
        }
    }

    /// Counts a pipeline created through the cache, so the next save
    /// writes it.
    pub(crate) fn pipeline_created(&self) {
        if let Some(store) = &self.pipeline_cache {
            store.note_created();
        }
    }

    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    pub fn info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    pub fn features(&self) -> wgpu::Features {
        self.features
    }

    /// Whether this device runs on wgpu's GL backend (one shared context).
    pub fn is_gl(&self) -> bool {
        self.info().backend == wgpu::Backend::Gl
    }

    /// [`lock_gl`] when this is a GL device; otherwise a guard that holds
    /// nothing.
    pub fn lock_gl(&self) -> GlGuard {
        lock_gl_for(self.info.backend)
    }

    /// A short name for messages: adapter name and backend.
    pub fn label(&self) -> String {
        format!("{} ({:?})", self.info.name, self.info.backend)
    }

    /// True for software rasterisers (lavapipe, llvmpipe, WARP).
    pub fn is_cpu(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    fn lost_error(&self) -> Option<Error> {
        let reason = self.lost.lock().ok().and_then(|slot| slot.clone())?;
        Some(Error::DeviceLost {
            adapter: self.label(),
            reason,
        })
    }

    /// A validation failure, unless it was caused by the device being lost:
    /// loss is reported through a callback that runs on the next poll.
    fn validation_or_lost(&self, op: &str, message: String) -> Error {
        let _ = self.device.poll(wgpu::PollType::Poll);
        self.lost_error().unwrap_or(Error::Validation {
            op: op.to_string(),
            message,
        })
    }

    /// `Err(DeviceLost)` once the device has been lost, and any error that
    /// escaped an error scope since the last check.
    pub fn check(&self, op: &str) -> Result<()> {
        let _gl = self.lock_gl();
        if let Some(lost) = self.lost_error() {
            return Err(lost);
        }
        let escaped: Vec<String> = match self.uncaptured.lock() {
            Ok(mut errors) => errors.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        if !escaped.is_empty() {
            return Err(self.validation_or_lost(op, escaped.join("; ")));
        }
        Ok(())
    }

    /// Runs `work` inside validation and out-of-memory error scopes, so a
    /// wgpu error becomes an `Error` naming `op` instead of a panic.
    pub fn scoped<T>(&self, op: &str, work: impl FnOnce() -> T) -> Result<T> {
        let _gl = self.lock_gl();
        self.check(op)?;
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = work();
        #[cfg(target_arch = "wasm32")]
        {
            // A browser resolves error scopes later, on its event loop: a
            // task there keeps what they caught for the next check (every
            // read-back checks), as for errors outside a scope.
            let sink = Arc::clone(&self.uncaptured);
            let (validation, oom) = (validation.pop(), oom.pop());
            wasm_bindgen_futures::spawn_local(async move {
                let caught: Vec<String> = [oom.await, validation.await]
                    .into_iter()
                    .flatten()
                    .map(|e| e.to_string())
                    .collect();
                if let (false, Ok(mut errors)) = (caught.is_empty(), sink.lock()) {
                    errors.extend(caught);
                }
            });
            Ok(value)
        }
        #[cfg(not(target_arch = "wasm32"))]
        self.settle_scopes(op, value, block_on(validation.pop()), block_on(oom.pop()))
    }

    /// What a native [`Device::scoped`] returns once its scopes are popped.
    #[cfg(not(target_arch = "wasm32"))]
    fn settle_scopes<T>(
        &self,
        op: &str,
        value: T,
        validation_error: Option<wgpu::Error>,
        oom_error: Option<wgpu::Error>,
    ) -> Result<T> {
        if let Some(e) = oom_error {
            return Err(Error::OutOfMemory {
                op: op.to_string(),
                message: e.to_string(),
            });
        }
        if let Some(e) = validation_error {
            return Err(self.validation_or_lost(op, e.to_string()));
        }
        self.check(op)?;
        Ok(value)
    }

    /// Blocks until the queue is idle, at most [`wait_timeout`] (so a hung
    /// device becomes an error, not a hang).
    pub fn wait_idle(&self, op: &str) -> Result<()> {
        wait("wait_idle", self.idle(op))
    }

    /// [`Device::wait_idle`], awaited: done once the work submitted so far
    /// has finished. Natively wgpu runs completions (map callbacks) inside a
    /// poll, so this polls until idle; a browser resolves them on its event
    /// loop, which the await yields to.
    pub async fn idle(&self, op: &str) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let _gl = self.lock_gl();
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: None,
                    timeout: Some(wait_timeout()),
                })
                .map_err(|e| self.validation_or_lost(op, format!("waiting for the GPU: {e}")))?;
        }
        #[cfg(target_arch = "wasm32")]
        {
            let (sender, receiver) = futures::channel::oneshot::channel();
            self.queue.on_submitted_work_done(move || {
                let _ = sender.send(());
            });
            receiver.await.map_err(|_| Error::Readback {
                op: "idle",
                message: "the queue's completion callback never ran".into(),
            })?;
        }
        self.check(op)
    }
}
