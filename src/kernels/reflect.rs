//! What each entry point asks of an adapter, read from its WGSL module by
//! naga: which binding slots it uses and whether each is writable, its
//! workgroup memory and its invocations per workgroup. WebGPU's rules are
//! checked against these where a dispatch is built (no writable binding
//! aliases another binding of the same buffer) and before a plan fuses
//! kernels (storage buffers per stage, workgroup memory and invocations
//! within the device's limits), so every adapter, lavapipe included,
//! refuses what Dawn would refuse.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::registry::{Family, Kernel};
use crate::error::{Error, Result};

/// One binding slot of an entry point (group 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotUse {
    pub slot: u32,
    /// A `read_write` storage binding.
    pub writable: bool,
    /// A storage binding (else uniform).
    pub storage: bool,
}

/// What one entry point needs from the device.
#[derive(Clone, Debug)]
pub struct EntryNeeds {
    pub slots: Vec<SlotUse>,
    /// Bytes of `var<workgroup>` the entry point uses.
    pub workgroup_bytes: u32,
    /// The workgroup size with every override at its default.
    pub workgroup_size: [u32; 3],
    /// For each dimension sized by an override: its name.
    pub workgroup_size_overrides: [Option<String>; 3],
}

impl EntryNeeds {
    /// Storage buffers the entry point binds (WebGPU counts them per stage).
    pub fn storage_buffers(&self) -> u32 {
        self.slots.iter().filter(|s| s.storage).count() as u32
    }

    pub fn is_writable(&self, slot: u32) -> bool {
        self.slots.iter().any(|s| s.slot == slot && s.writable)
    }

    /// Invocations per workgroup once `constants` (pipeline overrides) are
    /// applied to the sizes that depend on them.
    pub fn invocations(&self, constants: &[(&'static str, f64)]) -> u64 {
        let mut size = self.workgroup_size.map(u64::from);
        for (dim, name) in self.workgroup_size_overrides.iter().enumerate() {
            if let Some(name) = name {
                if let Some((_, value)) = constants.iter().find(|(k, _)| k == name) {
                    size[dim] = *value as u64;
                }
            }
        }
        size.iter().product()
    }
}

type FamilyNeeds = HashMap<String, EntryNeeds>;

fn reflect_family(family: Family) -> Result<FamilyNeeds> {
    let source = family.source();
    let invalid = |message: String| Error::Validation {
        op: family.file_name().to_string(),
        message,
    };
    let module = naga::front::wgsl::parse_str(source).map_err(|e| invalid(e.emit_to_string(source)))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
        .validate(&module)
        .map_err(|e| invalid(e.emit_to_string(source)))?;
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).map_err(|e| invalid(e.to_string()))?;
    let mut needs = HashMap::new();
    for (index, entry) in module.entry_points.iter().enumerate() {
        let uses = info.get_entry_point(index);
        let mut slots = Vec::new();
        let mut workgroup_bytes = 0u32;
        for (handle, global) in module.global_variables.iter() {
            if uses[handle].is_empty() {
                continue;
            }
            match global.space {
                naga::AddressSpace::WorkGroup => workgroup_bytes += layouter[global.ty].size,
                naga::AddressSpace::Storage { access } => {
                    if let Some(binding) = &global.binding {
                        slots.push(SlotUse {
                            slot: binding.binding,
                            writable: access.contains(naga::StorageAccess::STORE),
                            storage: true,
                        });
                    }
                }
                naga::AddressSpace::Uniform => {
                    if let Some(binding) = &global.binding {
                        slots.push(SlotUse {
                            slot: binding.binding,
                            writable: false,
                            storage: false,
                        });
                    }
                }
                _ => {}
            }
        }
        let override_name =
            |expr: Option<naga::Handle<naga::Expression>>| match expr.map(|e| &module.global_expressions[e]) {
                Some(naga::Expression::Override(o)) => module.overrides[*o].name.clone(),
                _ => None,
            };
        let workgroup_size_overrides = match entry.workgroup_size_overrides {
            Some(dims) => dims.map(override_name),
            None => [None, None, None],
        };
        // An override-sized dimension's default, from the override's own
        // initializer (naga leaves workgroup_size at 0 for it).
        let mut workgroup_size = entry.workgroup_size;
        if let Some(dims) = entry.workgroup_size_overrides {
            for (dim, expr) in dims.iter().enumerate() {
                if let Some(naga::Expression::Override(o)) = expr.map(|e| &module.global_expressions[e]) {
                    if let Some(init) = module.overrides[*o].init {
                        if let naga::Expression::Literal(naga::Literal::U32(v)) = module.global_expressions[init] {
                            workgroup_size[dim] = v;
                        }
                    }
                }
            }
        }
        slots.sort_by_key(|s| s.slot);
        needs.insert(
            entry.name.clone(),
            EntryNeeds {
                slots,
                workgroup_bytes,
                workgroup_size,
                workgroup_size_overrides,
            },
        );
    }
    Ok(needs)
}

/// The needs of `kernel`'s entry point, read from its family's module once
/// per process.
pub fn entry_needs(kernel: Kernel) -> Result<EntryNeeds> {
    static CACHE: OnceLock<Mutex<HashMap<Family, Arc<FamilyNeeds>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let cached = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&kernel.family)
        .cloned();
    let family = match cached {
        Some(f) => f,
        None => {
            let f = Arc::new(reflect_family(kernel.family)?);
            cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(kernel.family, Arc::clone(&f));
            f
        }
    };
    family.get(kernel.entry).cloned().ok_or_else(|| Error::Validation {
        op: kernel.entry.to_string(),
        message: format!("no entry point `{}` in {}", kernel.entry, kernel.family.file_name()),
    })
}

/// Checks `kernel` (with `constants`) against `limits`: storage buffers per
/// stage, workgroup memory and invocations per workgroup. A fused kernel
/// over them is an error here, before wgpu (or Dawn) refuses its pipeline;
/// the plan asks first and takes the unfused path.
pub fn check_limits(kernel: Kernel, constants: &[(&'static str, f64)], limits: &wgpu::Limits) -> Result<()> {
    let needs = entry_needs(kernel)?;
    let over = |what: &str, needed: u64, limit: u64, limit_name: &str| Error::InvalidArgument {
        op: kernel.entry,
        reason: format!("needs {needed} {what}, over this device's {limit_name} of {limit}"),
    };
    let storage = u64::from(needs.storage_buffers());
    if storage > u64::from(limits.max_storage_buffers_per_shader_stage) {
        return Err(over(
            "storage buffers",
            storage,
            limits.max_storage_buffers_per_shader_stage.into(),
            "max_storage_buffers_per_shader_stage",
        ));
    }
    let memory = u64::from(needs.workgroup_bytes);
    if memory > u64::from(limits.max_compute_workgroup_storage_size) {
        return Err(over(
            "bytes of workgroup memory",
            memory,
            limits.max_compute_workgroup_storage_size.into(),
            "max_compute_workgroup_storage_size",
        ));
    }
    let invocations = needs.invocations(constants);
    if invocations > u64::from(limits.max_compute_invocations_per_workgroup) {
        return Err(over(
            "invocations per workgroup",
            invocations,
            limits.max_compute_invocations_per_workgroup.into(),
            "max_compute_invocations_per_workgroup",
        ));
    }
    Ok(())
}
