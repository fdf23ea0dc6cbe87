//! Every WGSL file parses and validates with naga and translates to the
//! shading language of each backend (SPIR-V for Vulkan, MSL for Metal, HLSL
//! for DX12, GLSL for GL), per entry point and per override combination, so a
//! shader one backend would reject fails here, not on a user's machine.

use naga::back::PipelineConstants;
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga::ShaderStage;
use std::collections::BTreeSet;

use wgrad::kernels::{Activation, Family, Shared, KERNELS};

/// What naga may accept in a family: the baseline every adapter has, plus
/// what its required device features enable (so an f16 or subgroup
/// operation in a baseline file fails here).
fn capabilities(family: Family) -> Capabilities {
    let features = family.required_features();
    let mut caps = Capabilities::default();
    if features.contains(wgpu::Features::SHADER_F16) {
        // unpack2x16float too: wgpu grants it (DownlevelFlags::SHADER_F16_IN_F32)
        // on every backend that offers SHADER_F16 (Vulkan, lavapipe only
        // with SHADER_F16; DX12; Metal).
        caps |= Capabilities::SHADER_FLOAT16 | Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    }
    if features.contains(wgpu::Features::SUBGROUP) {
        caps |= Capabilities::SUBGROUP;
    }
    caps
}

fn parse(family: Family) -> (naga::Module, ModuleInfo) {
    let src = family.source();
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{}: {}", family.file_name(), e.emit_to_string(src)));
    let info = Validator::new(ValidationFlags::all(), capabilities(family))
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {}", family.file_name(), e.emit_to_string(src)));
    (module, info)
}

/// Every assignment of the module's boolean overrides (matmul's transposes);
/// numeric ones (the matrix-vector kernel's rows and lanes) keep their
/// defaults.
fn override_combinations(module: &naga::Module) -> Vec<PipelineConstants> {
    let is_bool = |ty: naga::Handle<naga::Type>| {
        matches!(
            module.types[ty].inner,
            naga::TypeInner::Scalar(naga::Scalar {
                kind: naga::ScalarKind::Bool,
                ..
            })
        )
    };
    let names: Vec<String> = module
        .overrides
        .iter()
        .filter(|(_, o)| is_bool(o.ty))
        .filter_map(|(_, o)| o.name.clone())
        .collect();
    (0..1u32 << names.len())
        .map(|bits| {
            let mut constants = PipelineConstants::default();
            for (i, name) in names.iter().enumerate() {
                constants.insert(name.clone(), f64::from((bits >> i) & 1));
            }
            constants
        })
        .collect()
}

fn translate_everywhere(
    family: Family,
    module: &naga::Module,
    info: &ModuleInfo,
    entry: &str,
    constants: &PipelineConstants,
) {
    let what = format!("{}::{entry} with {constants:?}", family.file_name());
    let (module, info) =
        naga::back::pipeline_constants::process_overrides(module, info, Some((ShaderStage::Compute, entry)), constants)
            .unwrap_or_else(|e| panic!("{what}: overrides: {e}"));

    let spv_pipeline = naga::back::spv::PipelineOptions {
        shader_stage: ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let words = naga::back::spv::write_vec(
        &module,
        &info,
        &naga::back::spv::Options::default(),
        Some(&spv_pipeline),
    )
    .unwrap_or_else(|e| panic!("{what}: SPIR-V: {e}"));
    assert!(words.len() > 5, "{what}: empty SPIR-V");

    let msl_pipeline = naga::back::msl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, entry.to_string())),
        ..Default::default()
    };
    let (msl, _) = naga::back::msl::write_string(&module, &info, &naga::back::msl::Options::default(), &msl_pipeline)
        .unwrap_or_else(|e| panic!("{what}: MSL: {e}"));
    assert!(msl.contains("kernel"), "{what}: MSL has no kernel");

    let hlsl_options = naga::back::hlsl::Options::default();
    let hlsl_pipeline = naga::back::hlsl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, entry.to_string())),
    };
    let mut hlsl = String::new();
    naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
        .write(&module, &info, None)
        .unwrap_or_else(|e| panic!("{what}: HLSL: {e}"));
    assert!(hlsl.contains("numthreads"), "{what}: HLSL has no compute entry");

    // naga's GLSL writer has no f16, and wgpu's GL backend never offers
    // SHADER_F16, so a GL device never compiles such a file.
    if family.required_features().contains(wgpu::Features::SHADER_F16) {
        return;
    }

    let glsl_options = naga::back::glsl::Options::default();
    let glsl_pipeline = naga::back::glsl::PipelineOptions {
        shader_stage: ShaderStage::Compute,
        entry_point: entry.to_string(),
        multiview: None,
    };
    let mut glsl = String::new();
    naga::back::glsl::Writer::new(
        &mut glsl,
        &module,
        &info,
        &glsl_options,
        &glsl_pipeline,
        naga::proc::BoundsCheckPolicies::default(),
    )
    .and_then(|mut w| w.write())
    .unwrap_or_else(|e| panic!("{what}: GLSL: {e}"));
    assert!(glsl.contains("local_size_x"), "{what}: GLSL has no compute layout");
}

/// Entry points a composed family's source holds because it starts with its
/// base family's file (see `Family::base`); they are registered, and
/// translated, under the base family.
fn inherited_entries(family: Family) -> Vec<String> {
    family.base().map_or_else(Vec::new, |base| {
        parse(base).0.entry_points.iter().map(|e| e.name.clone()).collect()
    })
}

#[test]
fn a_composed_family_starts_with_its_base_file_and_only_it_uses_subgroups() {
    for family in Family::ALL {
        if let Some(base) = family.base() {
            assert!(
                family.source().starts_with(base.source()),
                "{} does not start with {}",
                family.file_name(),
                base.file_name()
            );
        }
    }
    // matmul.wgsl must validate without SUBGROUP (GL runs it); the subgroup
    // family's extra part is what needs the capability.
    let base_src = Family::Matmul.source();
    let module = naga::front::wgsl::parse_str(base_src).expect("matmul.wgsl parses");
    Validator::new(ValidationFlags::all(), Capabilities::default())
        .validate(&module)
        .expect("matmul.wgsl validates without SUBGROUP");
    let composed = naga::front::wgsl::parse_str(Family::MatmulSubgroup.source()).expect("the subgroup family parses");
    assert!(
        Validator::new(ValidationFlags::all(), Capabilities::default())
            .validate(&composed)
            .is_err(),
        "the subgroup family should need the SUBGROUP capability"
    );
}

#[test]
fn every_shader_validates_and_translates_to_spirv_msl_hlsl_and_glsl() {
    for family in Family::ALL {
        let (module, info) = parse(family);
        assert!(
            !module.entry_points.is_empty(),
            "{}: no entry points",
            family.file_name()
        );
        let inherited = inherited_entries(family);
        for ep in module.entry_points.iter().filter(|ep| !inherited.contains(&ep.name)) {
            assert_eq!(ep.stage, ShaderStage::Compute, "{}::{}", family.file_name(), ep.name);
            for constants in override_combinations(&module) {
                translate_everywhere(family, &module, &info, &ep.name, &constants);
            }
        }
    }
}

#[test]
fn the_registry_and_the_wgsl_files_list_the_same_entry_points() {
    for family in Family::ALL {
        let (module, _) = parse(family);
        let inherited = inherited_entries(family);
        let in_wgsl: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .filter(|name| !inherited.iter().any(|i| i == name))
            .collect();
        let registered: Vec<&str> = KERNELS.iter().filter(|k| k.family == family).map(|k| k.entry).collect();
        for name in &in_wgsl {
            assert!(
                registered.contains(name),
                "{}::{name} is not in registry::KERNELS",
                family.file_name()
            );
        }
        for name in &registered {
            assert!(
                in_wgsl.contains(name),
                "registry lists {name}, missing from {}",
                family.file_name()
            );
        }
    }
}

/// Identifiers a WGSL text mentions outside comments.
fn identifiers(src: &str) -> BTreeSet<String> {
    let mut code = String::new();
    let mut rest = src;
    // Block comments first (WGSL nests them; none of ours do), then line comments.
    while let Some(start) = rest.find("/*") {
        code.push_str(&rest[..start]);
        rest = rest[start..].find("*/").map_or("", |end| &rest[start + end + 2..]);
    }
    code.push_str(rest);
    code.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .flat_map(|line| line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|word| word.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_'))
        .map(str::to_string)
        .collect()
}

/// The families that compose a shared file (directly or through their base).
fn composers(shared: Shared) -> Vec<Family> {
    Family::ALL
        .iter()
        .copied()
        .filter(|f| f.shared().contains(&shared) || f.base().is_some_and(|b| b.shared().contains(&shared)))
        .collect()
}

/// A family's composed module, and the byte range of `shared`'s text in
/// its source. A shared file may use names its composing families declare
/// (matvec.wgsl's `matvec_row` stores through each family's `write_c`), so
/// it is parsed where it is composed, not alone.
fn composed_with(family: Family, shared: Shared) -> (naga::Module, std::ops::Range<usize>) {
    let src = family.source();
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{}: {}", family.file_name(), e.emit_to_string(src)));
    let start = src
        .find(shared.source())
        .unwrap_or_else(|| panic!("{} does not contain {}", family.file_name(), shared.file_name()));
    (module, start..start + shared.source().len())
}

/// What a shared file declares at module scope (functions, constants and
/// overrides): the declarations whose text lies in its part of a composing
/// family's module.
fn declared_names(shared: Shared) -> BTreeSet<String> {
    let family = *composers(shared)
        .first()
        .unwrap_or_else(|| panic!("no family composes {}", shared.file_name()));
    let (module, range) = composed_with(family, shared);
    let inside = |span: naga::Span| span.to_range().is_some_and(|r| range.contains(&r.start));
    let functions = module
        .functions
        .iter()
        .filter(|(h, _)| inside(module.functions.get_span(*h)))
        .filter_map(|(_, f)| f.name.clone());
    let constants = module
        .constants
        .iter()
        .filter(|(h, _)| inside(module.constants.get_span(*h)))
        .filter_map(|(_, c)| c.name.clone());
    let overrides = module
        .overrides
        .iter()
        .filter(|(h, _)| inside(module.overrides.get_span(*h)))
        .filter_map(|(_, o)| o.name.clone());
    functions.chain(constants).chain(overrides).collect()
}

fn shaders_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shaders")
}

#[test]
fn each_family_source_is_its_base_its_own_file_and_its_shared_files() {
    for family in Family::ALL {
        let mut expected = family.base().map_or_else(String::new, |b| b.source().to_string());
        expected.push_str(family.own_source());
        for shared in family.shared() {
            expected.push_str(shared.source());
        }
        assert!(
            family.source() == expected,
            "{}: Family::source is out of step with Family::base / Family::shared",
            family.file_name()
        );
        let on_disk = std::fs::read_to_string(shaders_dir().join(family.file_name())).expect("family file");
        assert_eq!(
            family.own_source(),
            format!("{on_disk}\n"),
            "{}: own_source embeds another file",
            family.file_name()
        );
    }
    // Every .wgsl file is a family or a shared file, so none is forgotten.
    let known: BTreeSet<&str> = Family::ALL
        .iter()
        .map(|f| f.file_name())
        .chain(Shared::ALL.iter().map(|s| s.file_name()))
        .collect();
    for entry in std::fs::read_dir(shaders_dir()).expect("shaders/") {
        let name = entry.expect("entry").file_name().to_string_lossy().into_owned();
        if name.ends_with(".wgsl") {
            assert!(
                known.contains(name.as_str()),
                "shaders/{name} is neither a Family nor a Shared file"
            );
        }
    }
}

#[test]
fn shared_wgsl_has_one_source_composed_where_it_is_used() {
    // Each shared file validates inside every family that composes it
    // (every_shader_validates_and_translates_to_spirv_msl_hlsl_and_glsl),
    // not alone: it may use names its composing families declare. It has
    // no entry points of its own.
    for shared in Shared::ALL {
        assert!(
            !composers(shared).is_empty(),
            "no family composes {}",
            shared.file_name()
        );
        let words = identifiers(shared.source());
        assert!(
            !["compute", "vertex", "fragment"].iter().any(|s| words.contains(*s)),
            "{} is shared and must have no entry points",
            shared.file_name()
        );
    }
    for family in Family::ALL {
        let used = identifiers(family.own_source());
        let composed: Vec<Shared> = family
            .shared()
            .iter()
            .chain(family.base().map_or(&[][..], |b| b.shared()))
            .copied()
            .collect();
        for shared in Shared::ALL {
            let names = declared_names(shared);
            let mentioned: Vec<&String> = names.iter().filter(|n| used.contains(*n)).collect();
            // A family file that names a shared function or constant without
            // composing its file holds a copy of it (or would not compile).
            assert!(
                mentioned.is_empty() || composed.contains(&shared),
                "{} uses {mentioned:?} of {} but does not compose it (list it in Family::shared and Family::source; do not copy it)",
                family.file_name(),
                shared.file_name()
            );
        }
        // And nothing is composed that the family (or one built on it), or
        // another shared file it composes (matmul_register.wgsl stores
        // through matmul_rows.wgsl), never uses.
        for shared in family.shared() {
            let names = declared_names(*shared);
            let users: Vec<&str> = Family::ALL
                .iter()
                .filter(|f| **f == family || f.base() == Some(family))
                .map(|f| f.own_source())
                .chain(family.shared().iter().filter(|s| *s != shared).map(|s| s.source()))
                .collect();
            assert!(
                users
                    .iter()
                    .any(|src| identifiers(src).iter().any(|id| names.contains(id))),
                "{} composes {} but uses none of it",
                family.file_name(),
                shared.file_name()
            );
        }
    }
}

#[test]
fn activation_codes_agree_between_rust_and_activations_wgsl() {
    let src = Shared::Activations.source();
    let module = naga::front::wgsl::parse_str(src).expect("activations.wgsl parses");
    let codes: Vec<(String, u32)> = module
        .constants
        .iter()
        .filter_map(|(_, c)| {
            let name = c.name.clone()?;
            let value = match module.global_expressions[c.init] {
                naga::Expression::Literal(naga::Literal::U32(v)) => v,
                _ => return None,
            };
            name.starts_with("ACT_").then_some((name, value))
        })
        .collect();
    assert_eq!(
        codes.len(),
        Activation::ALL.len(),
        "one ACT_* constant per Activation: {codes:?}"
    );
    for act in Activation::ALL {
        let name = format!("ACT_{act:?}").to_uppercase();
        let wgsl = codes
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("activations.wgsl has no {name}"));
        assert_eq!(
            wgsl.1,
            act.code(),
            "{name}: activations.wgsl and Activation::code disagree"
        );
        assert_ne!(act.code(), 0, "code 0 is the identity");
    }
}
