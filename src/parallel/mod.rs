//! Several devices working on one model. wgpu has no peer-to-peer copies or
//! collectives, so data moves through host staging buffers
//! ([`collectives`]). Strategies, each over any model: [`data`] parallel,
//! [`pipeline`] parallel (a [`crate::nn::Staged`] model's units over
//! stages) and [`tensor`] parallel (Megatron-style, as the modules declare
//! their splits); the pipeline and tensor parallel are built from
//! [`stage`]s. [`single`]'s [`Trainer`] is the one-device engine each is
//! tested equal to, and [`examples`] holds the batch types they all take.

pub mod collectives;
pub mod data;
pub mod distributed;
pub mod engine;
pub mod examples;
pub mod memory;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pipeline;
pub mod single;
pub mod stage;
pub mod tensor;
pub mod zero;
pub mod zero_stages;

pub use examples::{Examples, ModelWidths, Targets};
pub use single::Trainer;

use std::sync::Arc;

use crate::device::{list_adapters, Device, DeviceOptions};
use crate::error::{Error, Result};
use crate::kernels::Kernels;

/// Environment variable read by [`DeviceGroup::from_env`]: a count (`3`),
/// `all`, or a comma-separated list of adapter indexes or names (`0,1,1`).
pub const ENV_DEVICES: &str = "WGRAD_DEVICES";

/// Most devices one group opens. Devices open one after another, each a
/// full wgpu device with its own kernels (a fraction of a second on
/// lavapipe), and the largest machines hold 8–16 GPUs, so a larger count is
/// a typo that would otherwise block for minutes before failing.
pub const MAX_DEVICES: usize = 64;

/// An error naming `n` when it is over [`MAX_DEVICES`].
pub(crate) fn check_limit(n: usize) -> Result<()> {
    if n > MAX_DEVICES {
        return Err(Error::InvalidArgument {
            op: "devices",
            reason: format!(
                "{n} devices requested, over the limit of {MAX_DEVICES} per process (wgrad::parallel::MAX_DEVICES)"
            ),
        });
    }
    Ok(())
}

/// The adapters `all` and a count choose from, as indexes in policy order:
/// one per physical GPU, through its best backend (a GPU that Vulkan and GL
/// both list is one device, not two sharing it), and no software adapter
/// when a GPU is present (it would slow every step to its pace). On a
/// machine without a GPU every software adapter counts (lavapipe-Vulkan,
/// llvmpipe-GL, SwiftShader): different drivers, the only devices there.
pub fn physical_adapters(reports: &[crate::device::AdapterReport]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..reports.len()).collect();
    order.sort_by_key(|&i| (crate::device::policy_rank(&reports[i].info), i));
    let has_gpu = reports.iter().any(|r| r.info.device_type != wgpu::DeviceType::Cpu);
    // A GPU's identity across backends: PCI vendor and device where the
    // driver reports them, else its name.
    let identity = |r: &crate::device::AdapterReport| match (r.info.vendor, r.info.device) {
        (v, d) if v != 0 && d != 0 => format!("{v:x}:{d:x}"),
        _ => r.info.name.clone(),
    };
    let mut seen = Vec::new();
    order
        .into_iter()
        .filter(|&i| {
            let r = &reports[i];
            if !has_gpu {
                return true;
            }
            if r.info.device_type == wgpu::DeviceType::Cpu {
                return false;
            }
            let id = identity(r);
            if seen.contains(&id) {
                return false;
            }
            seen.push(id);
            true
        })
        .collect()
}

/// Which devices a group opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSelection {
    /// N devices: every physical adapter in policy order first (see
    /// [`physical_adapters`]; on a CPU-only machine lavapipe-Vulkan, then
    /// llvmpipe-GL), then round again.
    Count(usize),
    /// One device per physical adapter (see [`physical_adapters`]).
    All,
    /// One device per entry: an adapter index or name substring (repeats open
    /// several devices on one adapter).
    Adapters(Vec<String>),
}

impl DeviceSelection {
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("all") {
            return Ok(DeviceSelection::All);
        }
        if let Ok(n) = text.parse::<usize>() {
            if n == 0 {
                return Err(Error::InvalidArgument {
                    op: "devices",
                    reason: "a group needs at least one device".into(),
                });
            }
            return Ok(DeviceSelection::Count(n));
        }
        let list: Vec<String> = text
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if list.is_empty() {
            return Err(Error::InvalidArgument {
                op: "devices",
                reason: format!("cannot read `{text}`: use N, all, or a list like 0,1"),
            });
        }
        Ok(DeviceSelection::Adapters(list))
    }

    /// The adapter each device of the selection opens on, in group order
    /// (an index into [`list_adapters`] or a name substring, as
    /// `DeviceOptions::adapter` takes it), after [`DeviceSelection::check`]:
    /// what [`DeviceGroup::open`] opens, for a caller that keeps devices
    /// open across groups ([`DeviceGroup::from_kernels`]).
    pub fn selectors(&self) -> Result<Vec<String>> {
        self.check()?;
        let reports = list_adapters();
        if reports.is_empty() {
            return Err(Error::NoAdapter { filter: String::new() });
        }
        let physical = physical_adapters(&reports);
        let selectors: Vec<String> = match self {
            DeviceSelection::All => physical.iter().map(|i| i.to_string()).collect(),
            DeviceSelection::Adapters(list) => list.clone(),
            DeviceSelection::Count(n) if !physical.is_empty() => {
                (0..*n).map(|k| physical[k % physical.len()].to_string()).collect()
            }
            DeviceSelection::Count(_) => Vec::new(),
        };
        if selectors.is_empty() {
            return Err(Error::InvalidArgument {
                op: "DeviceGroup",
                reason: "a group needs at least one device".into(),
            });
        }
        Ok(selectors)
    }

    /// `WGRAD_DEVICES`, or `default` when unset.
    pub fn from_env(default: DeviceSelection) -> Result<Self> {
        match std::env::var(ENV_DEVICES) {
            Ok(text) if !text.trim().is_empty() => Self::parse(&text),
            _ => Ok(default),
        }
    }

    /// How many devices this selection opens, checked without opening any:
    /// at most [`MAX_DEVICES`], and every listed adapter index or name
    /// present. [`DeviceGroup::open`] runs it first, so a bad selection
    /// fails at once instead of after the devices before it opened.
    pub fn check(&self) -> Result<usize> {
        let n = match self {
            DeviceSelection::Count(n) => *n,
            DeviceSelection::Adapters(list) => list.len(),
            DeviceSelection::All => physical_adapters(&list_adapters()).len(),
        };
        if n == 0 {
            return match self {
                DeviceSelection::All => Err(Error::NoAdapter { filter: String::new() }),
                _ => Err(Error::InvalidArgument {
                    op: "devices",
                    reason: "a group needs at least one device".into(),
                }),
            };
        }
        check_limit(n)?;
        if let DeviceSelection::Adapters(list) = self {
            let reports = list_adapters();
            if reports.is_empty() {
                return Err(Error::NoAdapter { filter: String::new() });
            }
            // The same matching as `Device::open`: an index into the full
            // list, or a case-insensitive name substring.
            let present = |entry: &str| match entry.parse::<usize>() {
                Ok(index) => index < reports.len(),
                Err(_) => {
                    let needle = entry.to_ascii_lowercase();
                    reports
                        .iter()
                        .any(|r| r.info.name.to_ascii_lowercase().contains(&needle))
                }
            };
            if let Some(missing) = list.iter().find(|e| !present(e.trim())) {
                let available = reports
                    .iter()
                    .enumerate()
                    .map(|(i, r)| format!("[{i}] {} ({:?})", r.info.name, r.info.backend))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(Error::AdapterNotFound {
                    selector: missing.clone(),
                    available,
                });
            }
        }
        Ok(n)
    }
}

/// The devices of one job, each with its kernels and pipeline cache.
pub struct DeviceGroup {
    members: Vec<Arc<Kernels>>,
}

impl DeviceGroup {
    /// Opens the devices of `selection` after [`DeviceSelection::check`].
    pub fn open(selection: &DeviceSelection) -> Result<Self> {
        let open = |selector: String| -> Result<Arc<Kernels>> {
            let device = Device::open(&DeviceOptions {
                backends: None,
                adapter: Some(selector),
                ..Default::default()
            })?;
            Ok(Arc::new(Kernels::new(device)))
        };
        let members = selection
            .selectors()?
            .into_iter()
            .map(open)
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceGroup { members })
    }

    /// `WGRAD_DEVICES`, or `default` when unset.
    pub fn from_env(default: DeviceSelection) -> Result<Self> {
        Self::open(&DeviceSelection::from_env(default)?)
    }

    /// A group of already opened devices.
    pub fn from_kernels(members: Vec<Arc<Kernels>>) -> Result<Self> {
        if members.is_empty() {
            return Err(Error::InvalidArgument {
                op: "DeviceGroup",
                reason: "a group needs at least one device".into(),
            });
        }
        // Collectives hold each device's staging buffer while they wait: the
        // same device twice would wait on itself.
        for (i, a) in members.iter().enumerate() {
            if members[..i].iter().any(|b| Arc::ptr_eq(a, b)) {
                return Err(Error::InvalidArgument {
                    op: "DeviceGroup",
                    reason: format!("device #{i} appears twice; open a second device instead"),
                });
            }
        }
        Ok(DeviceGroup { members })
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn members(&self) -> &[Arc<Kernels>] {
        &self.members
    }

    /// `#i name (backend)` for each device.
    pub fn labels(&self) -> Vec<String> {
        self.members
            .iter()
            .enumerate()
            .map(|(i, k)| format!("#{i} {}", k.device().label()))
            .collect()
    }
}

/// Wraps an error with the device it happened on.
pub(crate) fn on_device(index: usize, kernels: &Kernels, error: Error) -> Error {
    match error {
        Error::OnDevice { .. } => error,
        other => Error::OnDevice {
            device: format!("#{index} {}", kernels.device().label()),
            source: Box::new(other),
        },
    }
}

/// Runs `forward` over batch-sized, zero-padded chunks of `features` (rows
/// of `in_features`) and keeps each chunk's real rows of output (values, or
/// one class index per row).
pub(crate) fn outputs_in_chunks<T: Copy>(
    op: &'static str,
    features: &[f32],
    in_features: usize,
    batch: usize,
    out_features: usize,
    mut forward: impl FnMut(&[f32]) -> Result<Vec<T>>,
) -> Result<Vec<T>> {
    if features.is_empty() || features.len() % in_features != 0 {
        return Err(Error::shape(
            op,
            format!("features must be rows × {in_features}"),
            &[&[features.len()]],
        ));
    }
    let total = features.len() / in_features;
    let mut out = Vec::with_capacity(total * out_features);
    let mut chunk = vec![0.0f32; batch * in_features];
    for start in (0..total).step_by(batch) {
        let n = (total - start).min(batch);
        chunk.fill(0.0);
        chunk[..n * in_features].copy_from_slice(&features[start * in_features..(start + n) * in_features]);
        let o = forward(&chunk)?;
        out.extend_from_slice(&o[..n * out_features]);
    }
    Ok(out)
}
