//! Every WGSL file parses and validates with naga and translates to the
//! shading language of each backend (SPIR-V for Vulkan, MSL for Metal, HLSL
//! for DX12, GLSL for GL), per entry point and per override combination, so a
//! shader one backend would reject fails here, not on a user's machine.

use naga::back::PipelineConstants;
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga::ShaderStage;
use wgrad::kernels::{Family, KERNELS};

/// What naga may accept in a family: the baseline every adapter has, plus
/// what its required device features enable (so an f16 or subgroup
/// operation in a baseline file fails here).
fn capabilities(family: Family) -> Capabilities {
    let features = family.required_features();
    let mut caps = Capabilities::default();
    if features.contains(wgpu::Features::SHADER_F16) {
        caps |= Capabilities::SHADER_FLOAT16;
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

/// Every assignment of the module's boolean overrides (matmul's transposes).
fn override_combinations(module: &naga::Module) -> Vec<PipelineConstants> {
    let names: Vec<String> = module.overrides.iter().filter_map(|(_, o)| o.name.clone()).collect();
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

fn translate_everywhere(family: Family, module: &naga::Module, info: &ModuleInfo, entry: &str, constants: &PipelineConstants) {
    let what = format!("{}::{entry} with {constants:?}", family.file_name());
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        module,
        info,
        Some((ShaderStage::Compute, entry)),
        constants,
    )
    .unwrap_or_else(|e| panic!("{what}: overrides: {e}"));

    let spv_pipeline = naga::back::spv::PipelineOptions {
        shader_stage: ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let words = naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), Some(&spv_pipeline))
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
    family.base().map_or_else(Vec::new, |base| parse(base).0.entry_points.iter().map(|e| e.name.clone()).collect())
}

#[test]
fn a_composed_family_starts_with_its_base_file_and_only_it_uses_subgroups() {
    for family in Family::ALL {
        if let Some(base) = family.base() {
            assert!(family.source().starts_with(base.source()), "{} does not start with {}", family.file_name(), base.file_name());
        }
    }
    // matmul.wgsl must validate without SUBGROUP (GL runs it); the subgroup
    // family's extra part is what needs the capability.
    let base_src = Family::Matmul.source();
    let module = naga::front::wgsl::parse_str(base_src).expect("matmul.wgsl parses");
    Validator::new(ValidationFlags::all(), Capabilities::default()).validate(&module).expect("matmul.wgsl validates without SUBGROUP");
    let composed = naga::front::wgsl::parse_str(Family::MatmulSubgroup.source()).expect("the subgroup family parses");
    assert!(
        Validator::new(ValidationFlags::all(), Capabilities::default()).validate(&composed).is_err(),
        "the subgroup family should need the SUBGROUP capability"
    );
}

#[test]
fn every_shader_validates_and_translates_to_spirv_msl_hlsl_and_glsl() {
    for family in Family::ALL {
        let (module, info) = parse(family);
        assert!(!module.entry_points.is_empty(), "{}: no entry points", family.file_name());
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
        let in_wgsl: Vec<&str> =
            module.entry_points.iter().map(|e| e.name.as_str()).filter(|name| !inherited.iter().any(|i| i == name)).collect();
        let registered: Vec<&str> = KERNELS.iter().filter(|k| k.family == family).map(|k| k.entry).collect();
        for name in &in_wgsl {
            assert!(registered.contains(name), "{}::{name} is not in registry::KERNELS", family.file_name());
        }
        for name in &registered {
            assert!(in_wgsl.contains(name), "registry lists {name}, missing from {}", family.file_name());
        }
    }
}
