//! Typed entries for every WGSL kernel, a pipeline cache keyed by
//! (entry point, override constants), and the buffer plumbing they need.
//!
//! Each typed entry (`Kernels::matmul`, `Kernels::activation_forward`, ...)
//! checks shapes and limits in Rust, then returns a [`Dispatch`]: a pipeline,
//! a bind group and a workgroup count, created once and recordable into any
//! number of command encoders. [`Kernels::run`] records a list of dispatches
//! into one compute pass and submits it once.

mod attention;
pub mod autotune;
pub mod dump;
mod elementwise;
mod f16_weights;
mod flash_attention;
mod lora;
mod loss;
mod matmul;
mod matmul_ext;
mod matmul_request;
mod optim;
mod quant_weights;
mod reduce;
pub mod reflect;
pub mod registry;
mod rope;
mod rowwise;
mod sampling;
mod tensor;
mod timing;

pub use attention::{CachedAttentionKernel, DECODE_LANES, GROUPED_MAX_HEAD_DIM, MAX_HEAD_DIM};
pub use f16_weights::F16WeightsKernel;
pub use flash_attention::FLASH_MAX_HEAD_DIM;
pub use loss::{
    LossLinear, LossTargets, FUSED_LOSS_MAX, FUSED_LOSS_MAX_GPU, LINEAR_IN_LOSS_MAX_MACS, LINEAR_IN_LOSS_MAX_MACS_GPU,
};
pub use matmul::{MatmulEpilogue, MatmulVariant, MATVEC_MAX_ROWS};
use matmul::{Pick, Stored};
pub(crate) use matmul_ext::{pack_f16, unpack_f16};
pub use matmul_ext::{F16Tensor, F16View, SUBGROUP_MATMUL_LANES};
pub use matmul_request::{MatmulKernel, MatmulOperand, MatmulRequest};
pub use optim::{grad_norm_groups, loss_scale_block, loss_scale_word, ArenaGroups, LOSS_SCALE_WORDS};
pub use quant_weights::{QuantView, QuantWeightsKernel, QUANT_ROWS_MAX_ROWS};
// The op vocabulary, defined below the kernels and the CPU twins; kept
// here too so `wgrad::kernels::{Activation, MatmulForm, ..}` still works.
pub use crate::ops::{
    pack_quantized, unpack_quantized, Activation, AdamConfig, Binary, CachedAttentionLengths, CachedAttentionShape,
    FlashAttentionShape, LossScaling, LrSchedule, MatmulForm, OptimizerConfig, QkvLayout, QuantFormat, RopeLayout,
    RopeShape, SgdConfig, Unary,
};
pub use crate::ops::{DropoutMask, DROPOUT_CONTROL_WORDS};
pub use crate::ops::{LoraShape, LORA_META, NO_ADAPTER, NO_TOKEN};
pub use registry::{Dialect, Family, Kernel, Shared, KERNELS};
pub use rowwise::{check_token_ids, SHORT_ROW_MAX, SHORT_ROW_MAX_GPU};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

use crate::device::Device;
use crate::error::{Error, Result};

/// Unused writable slots one dispatch may fill (see `Kernels::unused_writable`).
const UNUSED_WRITABLE_SLOTS: u64 = 4;

/// Invocations per workgroup of the one-element-per-invocation kernels.
pub(crate) const FLAT_WORKGROUP: u64 = 256;

const ELEMENT_BYTES: u64 = 4;
/// Elements of the parts an op over a whole arena splits into: 256 bytes,
/// WebGPU's largest storage offset alignment, so every part of an aligned
/// view binds at an aligned offset on every adapter.
pub(crate) const ARENA_GRANULE: usize = 64;

/// A range of 4-byte elements (f32 or u32) inside a GPU buffer.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub buffer: &'a wgpu::Buffer,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in elements.
    pub len: usize,
}

impl<'a> View<'a> {
    pub fn bytes(&self) -> u64 {
        self.len as u64 * ELEMENT_BYTES
    }

    /// Elements `start..start + len` of this view.
    pub fn slice(&self, start: usize, len: usize) -> Result<View<'a>> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::shape(
                "View::slice",
                format!("elements {start}..{} outside a view of {}", start + len, self.len),
                &[&[self.len]],
            ));
        }
        Ok(View {
            buffer: self.buffer,
            offset: self.offset + start as u64 * ELEMENT_BYTES,
            len,
        })
    }
}

/// A GPU buffer of `len` 4-byte elements, usable as storage, copy source and
/// copy destination.
#[derive(Debug)]
pub struct GpuTensor {
    buffer: std::mem::ManuallyDrop<wgpu::Buffer>,
    len: usize,
    /// On a GL device: destroying the buffer takes wgpu's one GL context,
    /// so the drop queues on wgrad's GL lock (see `device::lock_gl`).
    gl: bool,
}

impl Drop for GpuTensor {
    fn drop(&mut self) {
        let _gl = self.gl.then(crate::device::lock_gl);
        // SAFETY: the buffer is dropped exactly once, here; `self` is not
        // used afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.buffer) };
    }
}

impl GpuTensor {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Elements `0..len` as a tensor of their own over the same buffer:
    /// executors that take turns on one pooled arena (ZeRO-3's stages).
    pub fn share_prefix(&self, len: usize) -> Result<GpuTensor> {
        if len > self.len {
            return Err(Error::shape(
                "GpuTensor::share_prefix",
                format!("{len} elements of a tensor of {}", self.len),
                &[&[self.len], &[len]],
            ));
        }
        Ok(GpuTensor {
            buffer: std::mem::ManuallyDrop::new((*self.buffer).clone()),
            len,
            gl: self.gl,
        })
    }

    /// The whole buffer.
    pub fn view(&self) -> View<'_> {
        View {
            buffer: &self.buffer,
            offset: 0,
            len: self.len,
        }
    }

    /// Elements `start..start + len`.
    pub fn slice(&self, start: usize, len: usize) -> Result<View<'_>> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::shape(
                "GpuTensor::slice",
                format!("elements {start}..{} outside a tensor of {}", start + len, self.len),
                &[&[self.len]],
            ));
        }
        Ok(View {
            buffer: &self.buffer,
            offset: start as u64 * ELEMENT_BYTES,
            len,
        })
    }
}

/// One recorded-once kernel launch: pipeline, bind group and grid; or,
/// for an op whose operand exceeds one storage binding, several launches
/// recorded one after the other, each binding a part that fits (see
/// [`Dispatch::launches`]).
#[derive(Debug)]
pub struct Dispatch {
    kernel: Kernel,
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    workgroups: [u32; 3],
    /// The uniform parameter buffer, kept so per-step values (optimizer step
    /// counts) can be rewritten without rebuilding the bind group.
    params: std::mem::ManuallyDrop<wgpu::Buffer>,
    /// See [`GpuTensor`]'s `gl`.
    gl: bool,
    /// The op's other launches when its work is split over bindings,
    /// recorded right after this one.
    rest: Vec<Dispatch>,
    /// What the launch binds and is specialised with, so a dispatch can be
    /// written out and replayed elsewhere (`wgrad shaders --dump` runs it
    /// in a browser's WebGPU).
    recipe: DispatchRecipe,
}

/// A storage binding as a dispatch holds it: slot, buffer and byte range.
#[derive(Clone, Debug)]
pub struct BoundRange {
    pub slot: u32,
    pub name: &'static str,
    pub buffer: wgpu::Buffer,
    /// Offset and size in bytes.
    pub offset: u64,
    pub bytes: u64,
}

/// Everything one launch is made of besides its pipeline: the override
/// constants, the storage bindings, the uniform block's slot and bytes, as
/// the dispatch was built (`Kernels::rewrite_params` does not update it).
#[derive(Clone, Debug, Default)]
pub struct DispatchRecipe {
    pub constants: Vec<(&'static str, f64)>,
    pub bindings: Vec<BoundRange>,
    pub params_slot: u32,
    pub params: Vec<u8>,
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        let _gl = self.gl.then(crate::device::lock_gl);
        // SAFETY: as in `GpuTensor`'s drop.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.params) };
        // The recipe's buffer handles may be the last ones: release them
        // under the GL lock too.
        drop(std::mem::take(&mut self.recipe));
    }
}

impl Dispatch {
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// The first launch's grid.
    pub fn workgroups(&self) -> [u32; 3] {
        self.workgroups
    }

    /// This launch's constants, bindings and uniform block.
    pub fn recipe(&self) -> &DispatchRecipe {
        &self.recipe
    }

    /// The launches this dispatch records, in order (see [`Dispatch::launches`]).
    pub fn each_launch(&self) -> impl Iterator<Item = &Dispatch> {
        std::iter::once(self).chain(&self.rest)
    }

    /// Kernel launches this dispatch records: 1, or the number of parts of
    /// an op split because an operand exceeds the storage binding limit.
    pub fn launches(&self) -> usize {
        1 + self.rest.len()
    }

    /// The split op's launches as one dispatch; `None` for no parts.
    pub(crate) fn chain(parts: Vec<Dispatch>) -> Option<Dispatch> {
        let mut parts = parts.into_iter();
        let mut first = parts.next()?;
        first.rest.extend(parts);
        Some(first)
    }

    /// This dispatch's launches, then `next`'s: one op in stages (a
    /// two-stage sum), recorded back to back.
    pub(crate) fn then(mut self, mut next: Dispatch) -> Dispatch {
        let tail = std::mem::take(&mut next.rest);
        self.rest.push(next);
        self.rest.extend(tail);
        self
    }

    /// Records this dispatch (every launch) into an open compute pass.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        for launch in std::iter::once(self).chain(&self.rest) {
            pass.set_pipeline(&launch.pipeline);
            pass.set_bind_group(0, &launch.bind_group, &[]);
            let [x, y, z] = launch.workgroups;
            pass.dispatch_workgroups(x, y, z);
        }
    }
}

/// Limits below the adapter's, so that tests can run the paths taken by
/// tensors too large for the adapter (split bindings, memory checks) on
/// small tensors: [`Kernels::with_limits`]. `None` keeps the adapter's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitOverrides {
    /// Bytes one storage binding may hold, at most the adapter's
    /// `max_storage_buffer_binding_size`.
    pub max_storage_buffer_binding_size: Option<u64>,
    /// Bytes one buffer may hold, at most the adapter's `max_buffer_size`.
    pub max_buffer_size: Option<u64>,
    /// GPU memory a model may use, in bytes: the host's available memory
    /// by default on a CPU adapter (whose buffers live there), and no
    /// check elsewhere (wgpu does not report a GPU's memory).
    pub memory_bytes: Option<u64>,
    /// Which kernel shapes and thresholds to use: `None` goes by the
    /// adapter (the GPU ones unless `Device::is_cpu()`), `Some(true)`
    /// forces the GPU ones, so tests run those paths on the software
    /// adapters, `Some(false)` the CPU ones. See [`Kernels::gpu_shaped`].
    pub gpu_shaping: Option<bool>,
    /// Loop iterations one invocation may run in one launch before a
    /// kernel with long loops (the fused attention's) splits them over
    /// launches: `None` is llvmpipe's limit on a CPU adapter and no split
    /// on a GPU; tests lower it to run the split on small shapes.
    pub loop_iterations: Option<usize>,
}

/// A storage binding: its slot in the WGSL file, a name for messages, and the
/// range it binds.
pub(crate) struct Binding<'a> {
    pub slot: u32,
    pub name: &'static str,
    pub view: View<'a>,
}

pub(crate) fn bind<'a>(slot: u32, name: &'static str, view: View<'a>) -> Binding<'a> {
    Binding { slot, name, view }
}

type PipelineKey = (Kernel, Vec<(&'static str, u64)>);

/// The kernels of one device: shader modules and pipelines are compiled on
/// first use and cached for the life of the device.
pub struct Kernels {
    device: Device,
    modules: Mutex<HashMap<Family, wgpu::ShaderModule>>,
    /// One slot per pipeline, locked while it compiles: threads building
    /// different pipelines compile them at once, a second thread asking
    /// for one being compiled waits for it instead of compiling it again.
    pipelines: Mutex<HashMap<PipelineKey, Arc<Mutex<Option<wgpu::ComputePipeline>>>>>,
    /// Reused for every readback; grown on demand.
    staging: Mutex<Option<wgpu::Buffer>>,
    submits: AtomicU64,
    buffers: AtomicU64,
    /// Bound where a kernel's layout has a read-only slot the dispatch does
    /// not use.
    placeholder: wgpu::Buffer,
    /// Bound where a kernel's layout has a writable slot the dispatch does
    /// not use: [`UNUSED_WRITABLE_SLOTS`] disjoint, aligned parts, so no
    /// two writable bindings of one dispatch overlap (WebGPU's rule).
    unused_writable: wgpu::Buffer,
    overrides: LimitOverrides,
    /// The partial sums of the two-stage reductions (column sums, losses;
    /// `reduction_scratch`): one buffer shared by every such dispatch of
    /// this device.
    reduction_scratch: Mutex<Option<wgpu::Buffer>>,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("device", &self.device).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the maps
    // half-written (inserts are single calls), so poisoning is ignored.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Kernels {
    pub fn new(device: Device) -> Self {
        Self::build(device, LimitOverrides::default())
    }

    /// Kernels that act as if the adapter's limits were `overrides`: ops
    /// split their work over smaller bindings and executors refuse models
    /// over the lowered memory, on tensors small enough for a test. An
    /// override above the adapter's own limit is an error.
    pub fn with_limits(device: Device, overrides: LimitOverrides) -> Result<Self> {
        let limits = device.limits();
        let checks = [
            (
                "max_storage_buffer_binding_size",
                overrides.max_storage_buffer_binding_size,
                limits.max_storage_buffer_binding_size,
            ),
            ("max_buffer_size", overrides.max_buffer_size, limits.max_buffer_size),
        ];
        for (name, wanted, adapter) in checks {
            match wanted {
                Some(w) if w > adapter || w < 16 => {
                    return Err(Error::InvalidArgument {
                        op: "Kernels::with_limits",
                        reason: format!("{name} {w} is outside 16..={adapter} (the adapter's)"),
                    });
                }
                _ => {}
            }
        }
        Ok(Self::build(device, overrides))
    }

    fn build(device: Device, overrides: LimitOverrides) -> Self {
        let _gl = device.lock_gl();
        let placeholder = device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("placeholder"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let align = u64::from(device.limits().min_storage_buffer_offset_alignment).max(ELEMENT_BYTES);
        let unused_writable = device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused writable slots"),
            size: align * UNUSED_WRITABLE_SLOTS,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Kernels {
            placeholder,
            unused_writable,
            device,
            modules: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            staging: Mutex::new(None),
            submits: AtomicU64::new(0),
            buffers: AtomicU64::new(0),
            overrides,
            reduction_scratch: Mutex::new(None),
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The most bytes one storage binding holds: the adapter's
    /// `max_storage_buffer_binding_size`, or the lower override.
    pub fn binding_limit(&self) -> u64 {
        let adapter = self.device.limits().max_storage_buffer_binding_size;
        self.overrides
            .max_storage_buffer_binding_size
            .map_or(adapter, |o| o.min(adapter))
    }

    /// The most bytes one buffer holds: the adapter's `max_buffer_size`,
    /// or the lower override.
    pub fn buffer_limit(&self) -> u64 {
        let adapter = self.device.limits().max_buffer_size;
        self.overrides.max_buffer_size.map_or(adapter, |o| o.min(adapter))
    }

    /// GPU memory a model may take, in bytes, and what the figure is: the
    /// override, else on a CPU adapter the host's available memory (its
    /// buffers are host memory). `None` where nothing tells: wgpu does not
    /// report a GPU's memory, and running out there is an
    /// `Error::OutOfMemory` from the allocation itself.
    pub fn memory_budget(&self) -> Option<(u64, &'static str)> {
        if let Some(bytes) = self.overrides.memory_bytes {
            return Some((bytes, "the memory limit set for these kernels"));
        }
        if self.device.is_cpu() {
            return host_available_memory().map(|bytes| {
                (
                    bytes,
                    "the host's available memory, which this CPU adapter allocates from",
                )
            });
        }
        None
    }

    /// Whether kernels take the shapes and thresholds meant for a GPU
    /// (many workgroups, barrier trees, two-stage reductions) rather than
    /// those tuned for a CPU adapter, where a workgroup runs on one thread
    /// and every barrier switches fibers: by `Device::is_cpu()`, unless
    /// [`LimitOverrides::gpu_shaping`] says otherwise.
    pub fn gpu_shaped(&self) -> bool {
        self.overrides.gpu_shaping.unwrap_or(!self.device.is_cpu())
    }

    /// A buffer of at least `len` elements, this device's reduction
    /// scratch, for the partial sums a two-stage reduction (a column sum on
    /// a GPU, a loss) passes from its first launch to its second. One buffer serves every dispatch: a
    /// dispatch records its launches back to back, and wgpu orders
    /// dispatches that write the same buffer, so no two sums interleave. It
    /// grows (to a power of two) when a dispatch is built, never in a step;
    /// dispatches built earlier keep the smaller buffer they bound. The
    /// handle returned is a clone: drop it under the device's GL lock.
    pub(crate) fn reduction_scratch(&self, op: &'static str, len: usize) -> Result<wgpu::Buffer> {
        let _gl = self.device.lock_gl();
        let mut slot = lock(&self.reduction_scratch);
        let bytes = len.max(1) as u64 * ELEMENT_BYTES;
        if let Some(buffer) = slot.as_ref().filter(|b| b.size() >= bytes) {
            return Ok(buffer.clone());
        }
        let grown = len.max(1).next_power_of_two();
        let len = if grown as u64 * ELEMENT_BYTES <= self.binding_limit() {
            grown
        } else {
            len
        };
        let buffer = self.create_buffer(op, len)?;
        *slot = Some(buffer.clone());
        Ok(buffer)
    }

    /// Checks, before any is allocated, that the buffers a model needs fit
    /// this adapter: `parts` are (what, bytes in all, bytes of its largest
    /// buffer); each buffer within the buffer limit, all together within
    /// [`Kernels::memory_budget`]. `op` names the caller.
    pub fn check_allocation(&self, op: &'static str, parts: &[(&'static str, u64, u64)]) -> Result<()> {
        let buffer_limit = self.buffer_limit();
        if let Some(&(name, _, bytes)) = parts.iter().find(|(_, _, largest)| *largest > buffer_limit) {
            return Err(Error::TooLarge {
                op,
                operand: name,
                bytes,
                limit: buffer_limit,
                limit_name: self.limit_name(LimitKind::Buffer),
            });
        }
        let total: u64 = parts.iter().map(|(_, b, _)| b).sum();
        if let Some((available, source)) = self.memory_budget() {
            if total > available {
                let parts: Vec<String> = parts
                    .iter()
                    .filter(|(_, b, _)| *b > 0)
                    .map(|(name, b, _)| format!("{name} {b}"))
                    .collect();
                return Err(Error::MemoryTooSmall {
                    op,
                    needed: total,
                    available,
                    memory: source.to_string(),
                    parts: parts.join(", "),
                });
            }
        }
        Ok(())
    }

    fn limit_name(&self, kind: LimitKind) -> &'static str {
        match kind {
            LimitKind::Binding if self.overrides.max_storage_buffer_binding_size.is_some() => {
                "max_storage_buffer_binding_size, lowered by Kernels::with_limits"
            }
            LimitKind::Binding => "max_storage_buffer_binding_size",
            LimitKind::Buffer if self.overrides.max_buffer_size.is_some() => {
                "max_buffer_size, lowered by Kernels::with_limits"
            }
            LimitKind::Buffer => "max_buffer_size",
        }
    }

    /// [`Error::TooLarge`] for `operand` of `bytes` over the binding limit.
    pub(crate) fn binding_too_large(&self, op: &'static str, operand: &'static str, bytes: u64) -> Error {
        Error::TooLarge {
            op,
            operand,
            bytes,
            limit: self.binding_limit(),
            limit_name: self.limit_name(LimitKind::Binding),
        }
    }

    /// Where a part `start..start + len` (elements) of `view` can be bound:
    /// the binding starts at the nearest storage-offset-aligned element at
    /// or before it; returns the binding and the part's first element in
    /// it. The binding may reach before `view` (inside its buffer).
    pub(crate) fn bind_part<'a>(&self, view: View<'a>, start: usize, len: usize) -> (View<'a>, usize) {
        let align = (u64::from(self.device.limits().min_storage_buffer_offset_alignment) / ELEMENT_BYTES).max(1);
        let absolute = view.offset / ELEMENT_BYTES + start as u64;
        let base = (absolute % align) as usize;
        (
            View {
                buffer: view.buffer,
                offset: (absolute - base as u64) * ELEMENT_BYTES,
                len: base + len,
            },
            base,
        )
    }

    /// Elements a part may hold so that [`Kernels::bind_part`]'s binding
    /// fits the binding limit wherever the part starts.
    pub(crate) fn part_capacity(&self) -> usize {
        let align = (u64::from(self.device.limits().min_storage_buffer_offset_alignment) / ELEMENT_BYTES).max(1);
        (self.binding_limit() / ELEMENT_BYTES).saturating_sub(align - 1) as usize
    }

    /// `n` elements (of a view starting at an aligned offset) in parts of
    /// whole `granule`s (a multiple of [`ARENA_GRANULE`], so every part
    /// starts aligned), each within the binding limit: (start, len) of each;
    /// one part when all of `n` fits. For the ops over whole arenas
    /// (optimizer updates, the gradient norm), which a model over one
    /// binding needs.
    pub(crate) fn arena_parts(&self, op: &'static str, n: usize, granule: usize) -> Result<Vec<(usize, usize)>> {
        if n as u64 * ELEMENT_BYTES <= self.binding_limit() {
            return Ok(vec![(0, n)]);
        }
        let per_part = (self.binding_limit() / ELEMENT_BYTES) as usize / granule * granule;
        if per_part == 0 {
            return Err(self.binding_too_large(op, "one aligned part of the arena", granule as u64 * ELEMENT_BYTES));
        }
        Ok((0..n)
            .step_by(per_part)
            .map(|start| (start, per_part.min(n - start)))
            .collect())
    }

    /// `x` [rows, cols] (over one binding) in parts of whole rows that
    /// each fit one: (first row, rows, part's binding, where its first row
    /// starts in it) of each; `operand` names x in the error when one row
    /// is over the limit. For the kernels with a row per invocation (a
    /// loss over an LM's logits, their argmax).
    pub(crate) fn whole_row_parts<'v>(
        &self,
        op: &'static str,
        operand: &'static str,
        x: View<'v>,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<(usize, usize, View<'v>, usize)>> {
        let per_part = self.part_capacity() / cols.max(1);
        if per_part == 0 {
            return Err(self.binding_too_large(op, operand, cols as u64 * ELEMENT_BYTES));
        }
        Ok((0..rows)
            .step_by(per_part)
            .map(|first| {
                let count = per_part.min(rows - first);
                let (part, base) = self.bind_part(x, first * cols, count * cols);
                (first, count, part, base)
            })
            .collect())
    }

    pub(crate) fn placeholder(&self) -> &wgpu::Buffer {
        &self.placeholder
    }

    /// A one-element view for an unused writable slot, part `index` (below
    /// [`UNUSED_WRITABLE_SLOTS`]) of its own buffer: it aliases no other
    /// binding, as a second view of a written buffer would.
    pub(crate) fn unused_writable(&self, index: u64) -> View<'_> {
        let align = u64::from(self.device.limits().min_storage_buffer_offset_alignment).max(ELEMENT_BYTES);
        View {
            buffer: &self.unused_writable,
            offset: align * index.min(UNUSED_WRITABLE_SLOTS - 1),
            len: 1,
        }
    }

    /// Queue submits made through this object so far.
    pub fn submit_count(&self) -> u64 {
        self.submits.load(Ordering::Relaxed)
    }

    fn module(&self, family: Family) -> Result<wgpu::ShaderModule> {
        if let Some(m) = lock(&self.modules).get(&family) {
            return Ok(m.clone());
        }
        // Two of wgpu's guards against broken shaders, a counter in every
        // loop that breaks out of one that never ends and a check around
        // every integer division (x / 0 = x, as WGSL defines it), cost the
        // driver time in every loop and index computation: on lavapipe
        // they were 22% of a warm run's CPU in the quantized kernels'
        // tests (creating a pipeline is mostly NIR passes over that code)
        // and 5% of a cold one's, and SmolLM2's decoding ~3% slower.
        // wgrad's kernels end every loop at a count from their parameters
        // and divide by shapes the host has checked (a zero one is refused
        // before a launch) or by constants; buffer and array bounds checks
        // stay as wgpu sets them. A browser keeps its own checks.
        let checks = wgpu::ShaderRuntimeChecks {
            force_loop_bounding: false,
            int_div_checks: false,
            ..wgpu::ShaderRuntimeChecks::checked()
        };
        let module = self.device.scoped(family.file_name(), || {
            // SAFETY: the shaders are wgrad's own; their loops terminate
            // and no divisor is zero (above).
            unsafe {
                self.device.wgpu_device().create_shader_module_trusted(
                    wgpu::ShaderModuleDescriptor {
                        label: Some(family.file_name()),
                        source: wgpu::ShaderSource::Wgsl(
                            family.source_for(Dialect::for_backend(self.device.info().backend)),
                        ),
                    },
                    checks,
                )
            }
        })?;
        lock(&self.modules).insert(family, module.clone());
        Ok(module)
    }

    /// Whether `kernel` (with its default overrides) fits this device's
    /// limits: storage buffers per stage, workgroup memory, invocations.
    /// The plan asks before choosing a fused kernel.
    pub fn fits_limits(&self, kernel: Kernel) -> bool {
        reflect::check_limits(kernel, &[], self.device.limits()).is_ok()
    }

    /// The pipeline for `kernel` specialised with `constants` (WGSL
    /// `override`s), compiled once.
    pub fn pipeline(&self, kernel: Kernel, constants: &[(&'static str, f64)]) -> Result<wgpu::ComputePipeline> {
        let key: PipelineKey = (kernel, constants.iter().map(|(k, v)| (*k, v.to_bits())).collect());
        let slot = lock(&self.pipelines).entry(key).or_default().clone();
        let mut compiled = match slot.try_lock() {
            Ok(compiled) => compiled,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                // Another thread is compiling it; the wait shows in the
                // debug log, where a start-up's idle threads can be seen.
                let started = crate::device::Instant::now();
                let compiled = lock(&slot);
                log::debug!(
                    "pipeline {}: waited {:.1} ms for another thread compiling it",
                    kernel.entry,
                    started.elapsed().as_secs_f64() * 1e3
                );
                compiled
            }
        };
        if let Some(p) = compiled.as_ref() {
            return Ok(p.clone());
        }
        reflect::check_limits(kernel, constants, self.device.limits())?;
        let module = self.module(kernel.family)?;
        let started = crate::device::Instant::now();
        let pipeline = self.device.scoped(kernel.entry, || {
            self.device
                .wgpu_device()
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(kernel.entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(kernel.entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: self.device.pipeline_cache(),
                })
        })?;
        self.device.pipeline_created();
        log::debug!(
            "pipeline {} {:?}: {:.1} ms",
            kernel.entry,
            constants,
            started.elapsed().as_secs_f64() * 1e3
        );
        *compiled = Some(pipeline.clone());
        Ok(pipeline)
    }

    /// Spreads `groups` workgroups over x and y so that neither exceeds the
    /// per-dimension limit; kernels rebuild the linear index as
    /// `wid.y * num_workgroups.x + wid.x` and ignore the overshoot.
    pub fn grid(&self, op: &'static str, groups: u64) -> Result<[u32; 3]> {
        let max = u64::from(self.device.limits().max_compute_workgroups_per_dimension).max(1);
        let groups = groups.max(1);
        if groups <= max {
            return Ok([groups as u32, 1, 1]);
        }
        let y = groups.div_ceil(max);
        if y > max {
            return Err(Error::TooLarge {
                op,
                operand: "workgroup grid",
                bytes: groups,
                limit: max * max,
                limit_name: "max_compute_workgroups_per_dimension squared",
            });
        }
        Ok([max as u32, y as u32, 1])
    }

    fn check_binding(&self, op: &'static str, b: &Binding<'_>) -> Result<()> {
        let limits = self.device.limits();
        if b.view.len == 0 {
            return Err(Error::shape(op, format!("`{}` is empty", b.name), &[&[0]]));
        }
        if b.view.bytes() > self.binding_limit() {
            return Err(self.binding_too_large(op, b.name, b.view.bytes()));
        }
        let align = u64::from(limits.min_storage_buffer_offset_alignment);
        if b.view.offset % align != 0 {
            return Err(Error::shape(
                op,
                format!(
                    "`{}` starts at byte {}, not a multiple of the adapter's storage offset \
                     alignment {align}",
                    b.name, b.view.offset
                ),
                &[&[b.view.len]],
            ));
        }
        if b.view.offset + b.view.bytes() > b.view.buffer.size() {
            return Err(Error::shape(
                op,
                format!("`{}` runs past the end of its buffer", b.name),
                &[&[b.view.len]],
            ));
        }
        Ok(())
    }

    /// Builds a dispatch: checks every binding against the adapter's limits,
    /// uploads the parameter block and creates the bind group.
    pub(crate) fn prepare<P: bytemuck::Pod>(
        &self,
        kernel: Kernel,
        constants: &[(&'static str, f64)],
        bindings: &[Binding<'_>],
        params_slot: u32,
        params: &P,
        groups: u64,
    ) -> Result<Dispatch> {
        for b in bindings {
            self.check_binding(kernel.entry, b)?;
        }
        let workgroups = self.grid(kernel.entry, groups)?;
        self.build_dispatch(kernel, constants, bindings, params_slot, params, workgroups)
    }

    /// [`Kernels::prepare`] with the workgroup grid given (a batched kernel's
    /// z); the caller has checked it against the adapter's limits.
    pub(crate) fn prepare_grid<P: bytemuck::Pod>(
        &self,
        kernel: Kernel,
        constants: &[(&'static str, f64)],
        bindings: &[Binding<'_>],
        params_slot: u32,
        params: &P,
        workgroups: [u32; 3],
    ) -> Result<Dispatch> {
        for b in bindings {
            self.check_binding(kernel.entry, b)?;
        }
        self.build_dispatch(kernel, constants, bindings, params_slot, params, workgroups)
    }

    fn build_dispatch<P: bytemuck::Pod>(
        &self,
        kernel: Kernel,
        constants: &[(&'static str, f64)],
        bindings: &[Binding<'_>],
        params_slot: u32,
        params: &P,
        workgroups: [u32; 3],
    ) -> Result<Dispatch> {
        check_aliasing(kernel, bindings)?;
        let pipeline = self.pipeline(kernel, constants)?;
        let device = self.device.wgpu_device();
        self.buffers.fetch_add(1, Ordering::Relaxed);
        self.device.scoped(kernel.entry, || {
            let params_buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(kernel.entry),
                contents: bytemuck::bytes_of(params),
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            });
            let mut entries: Vec<wgpu::BindGroupEntry<'_>> = bindings
                .iter()
                .map(|b| wgpu::BindGroupEntry {
                    binding: b.slot,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: b.view.buffer,
                        offset: b.view.offset,
                        size: wgpu::BufferSize::new(b.view.bytes()),
                    }),
                })
                .collect();
            entries.push(wgpu::BindGroupEntry {
                binding: params_slot,
                resource: params_buffer.as_entire_binding(),
            });
            let layout = pipeline.get_bind_group_layout(0);
            let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(kernel.entry),
                layout: &layout,
                entries: &entries,
            });
            Dispatch {
                kernel,
                pipeline: pipeline.clone(),
                bind_group,
                workgroups,
                params: std::mem::ManuallyDrop::new(params_buffer),
                gl: self.device.is_gl(),
                rest: Vec::new(),
                recipe: DispatchRecipe {
                    constants: constants.to_vec(),
                    bindings: bindings
                        .iter()
                        .map(|b| BoundRange {
                            slot: b.slot,
                            name: b.name,
                            buffer: b.view.buffer.clone(),
                            offset: b.view.offset,
                            bytes: b.view.bytes(),
                        })
                        .collect(),
                    params_slot,
                    params: bytemuck::bytes_of(params).to_vec(),
                },
            }
        })
    }

    /// Rewrites a dispatch's parameter block (the type it was built with, or
    /// a prefix of it: the bytes past `params` stay), e.g. the
    /// step-dependent scalars of an optimizer update.
    pub(crate) fn rewrite_params<P: bytemuck::Pod>(&self, dispatch: &Dispatch, params: &P) {
        let _gl = self.device.lock_gl();
        self.device
            .queue()
            .write_buffer(&dispatch.params, 0, bytemuck::bytes_of(params));
    }

    /// Runs one dispatch alone and waits for it: its wall time, for
    /// profiling (a step's timing would otherwise hide each kernel's share).
    pub fn time_dispatch(&self, dispatch: &Dispatch) -> Result<std::time::Duration> {
        let start = crate::device::Instant::now();
        self.run(&[dispatch])?;
        self.device.wait_idle(dispatch.kernel.entry)?;
        Ok(start.elapsed())
    }

    /// Submits a finished encoder, counting the submit.
    pub fn submit(&self, op: &str, encoder: wgpu::CommandEncoder) -> Result<()> {
        self.device.scoped(op, || {
            self.device.queue().submit([encoder.finish()]);
        })?;
        self.submits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Buffers created through this object so far (a training step must not
    /// add any).
    pub fn buffers_created(&self) -> u64 {
        self.buffers.load(Ordering::Relaxed)
    }

    /// Maps a 4-byte MAP_READ buffer that a submitted copy has written and
    /// returns its value (waits for the GPU).
    pub fn map_read_scalar(&self, staging: &wgpu::Buffer) -> Result<f32> {
        crate::device::wait("map_read_scalar", self.map_read_scalar_async(staging))
    }

    /// [`Kernels::map_read_scalar`], awaited.
    pub async fn map_read_scalar_async(&self, staging: &wgpu::Buffer) -> Result<f32> {
        let values: Vec<f32> = self.map_read_async(staging, 4).await?;
        values.first().copied().ok_or_else(|| Error::Readback {
            op: "read",
            message: "empty".into(),
        })
    }

    pub(crate) async fn map_read_async<T: bytemuck::Pod>(&self, staging: &wgpu::Buffer, bytes: u64) -> Result<Vec<T>> {
        let receiver = request_map(staging, bytes);
        self.finish_map(staging, bytes, receiver).await
    }

    /// Waits for a requested mapping and copies it out: the one read-back
    /// path every blocking and async read goes through.
    async fn finish_map<T: bytemuck::Pod>(
        &self,
        staging: &wgpu::Buffer,
        bytes: u64,
        receiver: MapReceiver,
    ) -> Result<Vec<T>> {
        self.device.idle("read").await?;
        let _gl = self.device.lock_gl();
        let mapped: Result<()> = receiver
            .await
            .map_err(|_| Error::Readback {
                op: "read",
                message: "the map callback never ran".into(),
            })?
            .map_err(|e| Error::Readback {
                op: "read",
                message: e.to_string(),
            });
        mapped?;
        let data = {
            let range = staging
                .slice(0..bytes)
                .get_mapped_range()
                .map_err(|e| Error::Readback {
                    op: "read",
                    message: e.to_string(),
                })?;
            bytemuck::pod_collect_to_vec::<u8, T>(&range)
        };
        staging.unmap();
        Ok(data)
    }

    /// Records `dispatches` in order into one compute pass and submits once.
    /// Does not wait for the GPU.
    pub fn run(&self, dispatches: &[&Dispatch]) -> Result<()> {
        let op = dispatches.first().map(|d| d.kernel.entry).unwrap_or("run");
        self.submit_pass(op, dispatches.iter().copied(), |_| {}, |_| {})
    }

    /// The one way work reaches the queue: `before` (clears), one compute
    /// pass recording `dispatches`, `after` (copies), one submit. Recording
    /// errors surface when the encoder is finished inside the submit's
    /// error scope.
    pub fn submit_pass<'d>(
        &self,
        op: &str,
        dispatches: impl IntoIterator<Item = &'d Dispatch>,
        before: impl FnOnce(&mut wgpu::CommandEncoder),
        after: impl FnOnce(&mut wgpu::CommandEncoder),
    ) -> Result<()> {
        let mut encoder = self
            .device
            .wgpu_device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(op) });
        before(&mut encoder);
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(op),
                timestamp_writes: None,
            });
            for d in dispatches {
                d.record(&mut pass);
            }
        }
        after(&mut encoder);
        self.submit(op, encoder)
    }

    fn create_buffer(&self, op: &'static str, len: usize) -> Result<wgpu::Buffer> {
        let bytes = (len as u64).max(1) * ELEMENT_BYTES;
        let limit = self.buffer_limit();
        if bytes > limit {
            return Err(Error::TooLarge {
                op,
                operand: "buffer",
                bytes,
                limit,
                limit_name: self.limit_name(LimitKind::Buffer),
            });
        }
        self.buffers.fetch_add(1, Ordering::Relaxed);
        self.device.scoped(op, || {
            self.device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
                label: Some(op),
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// A zero-filled tensor of `len` elements.
    pub fn zeros(&self, len: usize) -> Result<GpuTensor> {
        let buffer = self.create_buffer("zeros", len)?;
        Ok(GpuTensor {
            buffer: std::mem::ManuallyDrop::new(buffer),
            len,
            gl: self.device.is_gl(),
        })
    }

    /// Uploads f32 or u32 data (any 4-byte `Pod`).
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<GpuTensor> {
        if std::mem::size_of::<T>() != ELEMENT_BYTES as usize {
            return Err(Error::shape(
                "upload",
                format!("elements must be 4 bytes, not {}", std::mem::size_of::<T>()),
                &[&[data.len()]],
            ));
        }
        let buffer = self.create_buffer("upload", data.len())?;
        self.device.scoped("upload", || {
            self.device.queue().write_buffer(&buffer, 0, bytemuck::cast_slice(data))
        })?;
        Ok(GpuTensor {
            buffer: std::mem::ManuallyDrop::new(buffer),
            len: data.len(),
            gl: self.device.is_gl(),
        })
    }

    /// Overwrites `view` with `data` (queued; ordered before later submits).
    /// Runs on every training step, so it skips error scopes (a pair costs
    /// about as much as the write): with the size checked here, the one
    /// failure left is a destroyed buffer, which the uncaptured-error
    /// handler records and the next submit reports.
    pub fn write<T: bytemuck::Pod>(&self, view: View<'_>, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() as u64 != view.bytes() {
            return Err(Error::shape(
                "write",
                format!("{} bytes of data for a view of {} bytes", bytes.len(), view.bytes()),
                &[&[view.len]],
            ));
        }
        self.device.check("write")?;
        let _gl = self.device.lock_gl();
        self.device.queue().write_buffer(view.buffer, view.offset, bytes);
        Ok(())
    }

    /// Copies `view` back to the host, waiting for all submitted work.
    pub fn read<T: bytemuck::Pod>(&self, view: View<'_>) -> Result<Vec<T>> {
        crate::device::wait("read", self.read_async(view))
    }

    /// [`Kernels::read`], awaited.
    pub async fn read_async<T: bytemuck::Pod>(&self, view: View<'_>) -> Result<Vec<T>> {
        self.begin_read(view)?.finish_async().await
    }

    /// Starts copying `view` to the reused staging buffer and requests the
    /// mapping, without waiting. Start reads on several devices, then
    /// finish them, and no device idles while another is waited on.
    pub fn begin_read(&self, view: View<'_>) -> Result<PendingRead<'_>> {
        let bytes = view.bytes();
        let staging_slot = self.staging_for(bytes)?;
        let staging = staging_slot.as_ref().ok_or_else(|| Error::Readback {
            op: "read",
            message: "no staging buffer".into(),
        })?;
        let receiver = if bytes == 0 {
            None
        } else {
            let device = self.device.wgpu_device();
            let encoder = self.device.scoped("read", || {
                let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("readback"),
                });
                encoder.copy_buffer_to_buffer(view.buffer, view.offset, staging, 0, bytes);
                encoder
            })?;
            self.submit("read", encoder)?;
            Some(request_map(staging, bytes))
        };
        Ok(PendingRead {
            kernels: self,
            staging: staging_slot,
            bytes,
            receiver,
        })
    }

    /// [`Kernels::submit_pass`] with a copy of `view` to the staging buffer
    /// recorded after the pass, in the same submission; waits for it and
    /// returns the values. A step whose result the host needs at once (a
    /// generation step's logits) then costs one submit, not two.
    pub fn submit_pass_and_read<'d, T: bytemuck::Pod>(
        &self,
        op: &str,
        dispatches: impl IntoIterator<Item = &'d Dispatch>,
        before: impl FnOnce(&mut wgpu::CommandEncoder),
        view: View<'_>,
    ) -> Result<Vec<T>> {
        crate::device::wait(
            "submit_pass_and_read",
            self.submit_pass_and_read_async(op, dispatches, before, view),
        )
    }

    /// [`Kernels::submit_pass_and_read`], awaited (the submit happens when
    /// the future is first polled).
    // The staging buffer's guard is held until the read finishes, as in
    // `PendingRead`: the buffer is mapped until then, and a second read on
    // this device must wait for it (natively that wait is another thread's;
    // a page awaits its reads one after another).
    #[allow(clippy::await_holding_lock)]
    pub async fn submit_pass_and_read_async<'d, T: bytemuck::Pod>(
        &self,
        op: &str,
        dispatches: impl IntoIterator<Item = &'d Dispatch>,
        before: impl FnOnce(&mut wgpu::CommandEncoder),
        view: View<'_>,
    ) -> Result<Vec<T>> {
        let bytes = view.bytes();
        let staging_slot = self.staging_for(bytes)?;
        let staging = staging_slot.as_ref().ok_or_else(|| Error::Readback {
            op: "read",
            message: "no staging buffer".into(),
        })?;
        self.submit_pass(op, dispatches, before, |encoder| {
            if bytes > 0 {
                encoder.copy_buffer_to_buffer(view.buffer, view.offset, staging, 0, bytes);
            }
        })?;
        let receiver = (bytes > 0).then(|| request_map(staging, bytes));
        PendingRead {
            kernels: self,
            staging: staging_slot,
            bytes,
            receiver,
        }
        .finish_async()
        .await
    }

    /// The reused readback staging buffer, grown to hold `bytes`; held
    /// until the read finishes.
    fn staging_for(&self, bytes: u64) -> Result<std::sync::MutexGuard<'_, Option<wgpu::Buffer>>> {
        let mut staging_slot = lock(&self.staging);
        if staging_slot.as_ref().is_none_or(|s| s.size() < bytes.max(4)) {
            let size = bytes
                .max(4)
                .next_power_of_two()
                .min(self.device.limits().max_buffer_size.max(bytes));
            self.buffers.fetch_add(1, Ordering::Relaxed);
            *staging_slot = Some(self.device.scoped("read", || {
                self.device.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
                    label: Some("readback staging"),
                    size,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })?);
        }
        Ok(staging_slot)
    }
}

/// WebGPU's rule, which Dawn enforces and wgpu-core does not: a writable
/// storage binding must not overlap another binding of the same buffer in
/// one dispatch. Checked on every adapter where a dispatch is built, so the
/// software adapters catch what a browser would refuse.
fn check_aliasing(kernel: Kernel, bindings: &[Binding<'_>]) -> Result<()> {
    let needs = reflect::entry_needs(kernel)?;
    for (i, written) in bindings.iter().enumerate() {
        if !needs.is_writable(written.slot) {
            continue;
        }
        let range = written.view.offset..written.view.offset + written.view.bytes();
        for (j, other) in bindings.iter().enumerate() {
            if i == j || written.view.buffer != other.view.buffer {
                continue;
            }
            let other_range = other.view.offset..other.view.offset + other.view.bytes();
            if range.start < other_range.end && other_range.start < range.end {
                return Err(Error::InvalidArgument {
                    op: kernel.entry,
                    reason: format!(
                        "the writable binding `{}` (slot {}, bytes {range:?}) overlaps `{}` (slot {}, bytes {other_range:?}) \
                         of the same buffer, which WebGPU forbids",
                        written.name, written.slot, other.name, other.slot
                    ),
                });
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum LimitKind {
    Binding,
    Buffer,
}

/// `MemAvailable` of /proc/meminfo in bytes (Linux); `None` elsewhere.
fn host_available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Requests the mapping of a staging buffer's first `bytes` once the copies
/// submitted before it are done.
fn request_map(staging: &wgpu::Buffer, bytes: u64) -> MapReceiver {
    let (sender, receiver) = futures::channel::oneshot::channel();
    staging.slice(0..bytes).map_async(wgpu::MapMode::Read, move |result| {
        let _ = sender.send(result);
    });
    receiver
}

type MapReceiver = futures::channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>;

/// A readback started by [`Kernels::begin_read`]; holds the device's staging
/// buffer until finished.
pub struct PendingRead<'a> {
    kernels: &'a Kernels,
    staging: std::sync::MutexGuard<'a, Option<wgpu::Buffer>>,
    bytes: u64,
    receiver: Option<MapReceiver>,
}

impl PendingRead<'_> {
    /// Polls the device without blocking; true once the data has arrived
    /// (finishing is then immediate).
    pub fn is_ready(&mut self) -> Result<bool> {
        let Some(receiver) = self.receiver.as_mut() else {
            return Ok(true);
        };
        let device = self.kernels.device();
        let _gl = device.lock_gl();
        device
            .wgpu_device()
            .poll(wgpu::PollType::Poll)
            .map_err(|e| Error::Readback {
                op: "read",
                message: e.to_string(),
            })?;
        device.check("read")?;
        match receiver.try_recv() {
            Ok(Some(result)) => {
                // Hand the result on to `finish` through a fresh channel.
                let (sender, fresh) = futures::channel::oneshot::channel();
                let _ = sender.send(result);
                self.receiver = Some(fresh);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(_) => Err(Error::Readback {
                op: "read",
                message: "the map callback was dropped".into(),
            }),
        }
    }

    /// Waits for the copy and returns the values.
    pub fn finish<T: bytemuck::Pod>(self) -> Result<Vec<T>> {
        crate::device::wait("read", self.finish_async())
    }

    /// [`PendingRead::finish`], awaited.
    pub async fn finish_async<T: bytemuck::Pod>(self) -> Result<Vec<T>> {
        let (Some(receiver), Some(staging)) = (self.receiver, self.staging.as_ref()) else {
            return Ok(Vec::new());
        };
        self.kernels.finish_map(staging, self.bytes, receiver).await
    }
}

/// Invocations per workgroup of the column-sum kernels (`COLUMN_WG` in
/// common.wgsl).
pub(crate) const COLUMN_WORKGROUP: u64 = 64;

/// Number of column-kernel workgroups covering `cols` columns.
pub(crate) fn column_groups(cols: usize) -> u64 {
    (cols as u64).div_ceil(COLUMN_WORKGROUP)
}

/// Number of 256-wide workgroups covering `n` elements.
pub(crate) fn flat_groups(n: usize) -> u64 {
    (n as u64).div_ceil(FLAT_WORKGROUP)
}

/// Dimension to `u32` for a parameter block; every dimension has already
/// been checked to fit a binding, so this only fails on absurd inputs.
pub(crate) fn dim(op: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::shape(op, format!("dimension {value} exceeds u32"), &[&[value]]))
}
