//! Writes every shader module out exactly as the registry composes it, for
//! compilers other than the one wgpu runs here (`wgrad shaders --dump DIR`):
//! Tint (Chrome, Dawn) validates them in the tests, and a browser's WebGPU
//! compiles them.

use std::path::{Path, PathBuf};

use super::registry::{Dialect, Family, KERNELS};
use crate::error::{Error, Result};

/// One module written by [`write_modules`].
#[derive(Clone, Debug)]
pub struct ModuleFile {
    pub family: Family,
    pub path: PathBuf,
    /// The entry points wgrad dispatches from this module.
    pub entries: Vec<&'static str>,
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| Error::DataIo {
        op: "shaders --dump",
        path: path.to_path_buf(),
        source,
    })
}

/// Writes each family's module into `dir/modules/NAME.wgsl` as WebGPU
/// (Tint) takes it, and `dir/modules.json`, listing each module's entry
/// points and the device features it needs. naga's dialect differs only by
/// the subgroup module's `enable subgroups;` (`Family::source_for`), which
/// naga 30 refuses and Tint requires, so every file here is a module Tint
/// accepts. Returns what it wrote.
pub fn write_modules(dir: &Path) -> Result<Vec<ModuleFile>> {
    let modules_dir = dir.join("modules");
    std::fs::create_dir_all(&modules_dir).map_err(|source| Error::DataIo {
        op: "shaders --dump",
        path: modules_dir.clone(),
        source,
    })?;
    let mut written = Vec::new();
    let mut manifest = Vec::new();
    for family in Family::ALL {
        let entries: Vec<&'static str> = KERNELS.iter().filter(|k| k.family == family).map(|k| k.entry).collect();
        let web = family.source_for(Dialect::WebGpu);
        let path = modules_dir.join(format!("{}.wgsl", family.name()));
        write(&path, &web)?;
        written.push(ModuleFile {
            family,
            path,
            entries: entries.clone(),
        });
        let features: Vec<&str> = crate::device::REPORTED_FEATURES
            .iter()
            .filter(|(f, _)| family.required_features().contains(*f))
            .map(|(_, name)| *name)
            .collect();
        manifest.push(serde_json::json!({
            "module": format!("modules/{}.wgsl", family.name()),
            "family": family.name(),
            "entries": entries,
            "features": features,
        }));
    }
    let text =
        serde_json::to_string_pretty(&serde_json::json!({ "modules": manifest })).map_err(|e| Error::Internal {
            op: "shaders --dump",
            reason: e.to_string(),
        })?;
    write(&dir.join("modules.json"), &text)?;
    Ok(written)
}
