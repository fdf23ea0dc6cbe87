//! WebGPU's rules, checked here so a browser (Chrome's Tint compiler and
//! Dawn's run-time validation) does not find what wgpu-core lets through:
//! every module as the registry composes it compiles with Tint, no
//! writable binding aliases another, and every entry point's storage
//! buffers, workgroup memory and invocations are checked against the
//! device's limits, with WebGPU's default limits as a mode of their own.

use std::path::{Path, PathBuf};
use std::process::Command;

use wgrad::kernels::{reflect, Dialect, Family, KERNELS};

use crate::common::{adapter_required, for_each_adapter};

/// A fresh folder under the system's temporary directory.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch folder");
    dir
}

/// Tint's command line, when installed. Without it the test fails in CI
/// (`CI` / `WGRAD_REQUIRE_ADAPTER`, as for a missing adapter) and is
/// skipped loudly elsewhere.
fn tint(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join("tint"))
                .find(|p| p.is_file())
        })
        .unwrap_or(None);
    if found.is_none() {
        let hint = "tint (Dawn's WGSL compiler) is not on the PATH; build it from Dawn's sources or install a package that ships it";
        assert!(!adapter_required(), "{test}: {hint}, and CI requires it");
        eprintln!("SKIP {test}: {hint}");
    }
    found
}

/// Runs Tint on `module` (WGSL to WGSL, through its IR and validator),
/// for one entry point and override values when given; the error text on
/// failure.
fn tint_compile(
    tint: &Path,
    module: &Path,
    entry: Option<&str>,
    overrides: &[(String, String)],
    out: &Path,
) -> Result<(), String> {
    let mut cmd = Command::new(tint);
    cmd.arg("--format").arg("wgsl").arg("-o").arg(out);
    if let Some(entry) = entry {
        cmd.arg("--entry-point").arg(entry);
    }
    if !overrides.is_empty() {
        let list: Vec<String> = overrides.iter().map(|(k, v)| format!("{k}={v}")).collect();
        cmd.arg("--overrides").arg(list.join(","));
    }
    cmd.arg(module);
    let output = cmd.output().map_err(|e| format!("could not run tint: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// Override values worth compiling an entry point with: the defaults, every
/// boolean override on, the matrix-vector kernels' row counts and lane
/// counts and the embedding sort's lanes as the Rust side picks them.
fn override_variants(naga_src: &str) -> Vec<Vec<(String, String)>> {
    let module = naga::front::wgsl::parse_str(naga_src).expect("naga parses the registry's source");
    let mut all_on = Vec::new();
    let mut numeric = Vec::new();
    for (_, o) in module.overrides.iter() {
        let Some(name) = o.name.clone() else { continue };
        match module.types[o.ty].inner {
            naga::TypeInner::Scalar(naga::Scalar {
                kind: naga::ScalarKind::Bool,
                ..
            }) => all_on.push((name, "1".to_string())),
            _ => numeric.push(name),
        }
    }
    let mut variants = vec![Vec::new()];
    if !all_on.is_empty() {
        variants.push(all_on);
    }
    if numeric.iter().any(|n| n == "MATVEC_ROWS") {
        for (rows, lanes) in [(1, 8), (4, 8), (2, 64), (3, 256)] {
            variants.push(vec![
                ("MATVEC_ROWS".into(), format!("{rows}")),
                ("MATVEC_WG".into(), format!("{lanes}")),
            ]);
        }
    }
    // The embedding sort's lanes on a GPU that allows 1024 (rowwise.rs).
    if numeric.iter().any(|n| n == "SORT_WG") {
        variants.push(vec![("SORT_WG".into(), "1024".into())]);
    }
    variants
}

#[test]
fn tint_accepts_every_module_as_dumped_for_every_entry_and_override_variant() {
    let test = "tint_accepts_every_module_as_dumped_for_every_entry_and_override_variant";
    let Some(tint) = tint(test) else { return };
    let dir = scratch_dir("tint");
    let written = wgrad::kernels::dump::write_modules(&dir).expect("dump the modules");
    let webgpu: Vec<_> = written.iter().collect();
    assert_eq!(webgpu.len(), Family::ALL.len(), "one WebGPU module per family");
    let out = dir.join("tint-out.wgsl");
    let mut failures = Vec::new();
    let mut compiles = 0;
    for m in &webgpu {
        let src = std::fs::read_to_string(&m.path).expect("read the dumped module");
        assert_eq!(
            src,
            m.family.source_for(Dialect::WebGpu),
            "{}: the dump is the registry's module",
            m.path.display()
        );
        if let Err(e) = tint_compile(&tint, &m.path, None, &[], &out) {
            failures.push(format!("{}: {e}", m.path.display()));
            continue;
        }
        compiles += 1;
        for entry in &m.entries {
            for overrides in override_variants(m.family.source()) {
                compiles += 1;
                if let Err(e) = tint_compile(&tint, &m.path, Some(entry), &overrides, &out) {
                    failures.push(format!("{}::{entry} {overrides:?}: {e}", m.path.display()));
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "Tint rejected {} of {compiles} compiles:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("{test}: {compiles} Tint compiles of {} modules", webgpu.len());
}

#[test]
fn the_naga_dialect_differs_only_by_the_subgroups_directive() {
    for family in Family::ALL {
        let naga = family.source_for(Dialect::Naga);
        let web = family.source_for(Dialect::WebGpu);
        assert_eq!(
            naga,
            family.source(),
            "{}: wgpu's native backends compile the registry's source",
            family.name()
        );
        if family.required_features().contains(wgpu::Features::SUBGROUP) {
            assert_eq!(web, format!("enable subgroups;\n{naga}"), "{}", family.name());
        } else {
            assert_eq!(web, naga, "{}", family.name());
        }
    }
}

/// The entry points whose storage buffers exceed WebGPU's default of 8 per
/// stage: the fused loss-with-last-Linear kernels. The plan must never
/// choose them on a device with the default limits (see the strict-mode
/// training test below); any other entry point over a default limit is a
/// kernel a browser cannot run at all.
const OVER_WEBGPU_DEFAULTS: [&str; 2] = ["mse_linear_forward_backward", "cross_entropy_linear_forward_backward"];

#[test]
fn every_entry_point_fits_webgpus_default_limits_except_the_fused_linear_losses() {
    let defaults = wgpu::Limits::default();
    let mut over = Vec::new();
    for kernel in KERNELS {
        let needs = reflect::entry_needs(*kernel).unwrap_or_else(|e| panic!("{}: {e}", kernel.entry));
        assert!(
            needs.slots.iter().any(|s| s.storage),
            "{}: binds no storage buffer",
            kernel.entry
        );
        // The Rust side compiles the matrix-vector kernels with up to 256
        // lanes; the rest have fixed sizes.
        let constants: &[(&'static str, f64)] = &[("MATVEC_WG", 256.0)];
        if let Err(e) = reflect::check_limits(*kernel, constants, &defaults) {
            over.push((kernel.entry, e.to_string()));
        }
    }
    let names: Vec<&str> = over.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names, OVER_WEBGPU_DEFAULTS,
        "entry points over WebGPU's default limits: {over:#?}"
    );
    for (_, message) in &over {
        assert!(message.contains("max_storage_buffers_per_shader_stage"), "{message}");
    }
}

#[test]
fn the_reflected_slots_agree_with_the_wgsl_declarations() {
    // matmul: a, b, act_input, bias and the f16 views of a and b
    // read-only, c and pre writable, the parameter block a uniform.
    let needs = reflect::entry_needs(wgrad::kernels::registry::MATMUL_FORWARD_REGISTER).unwrap();
    let writable: Vec<u32> = needs.slots.iter().filter(|s| s.writable).map(|s| s.slot).collect();
    assert_eq!(writable, [2, 5]);
    assert_eq!(needs.storage_buffers(), 8);
    assert_eq!(
        needs
            .slots
            .iter()
            .filter(|s| !s.storage)
            .map(|s| s.slot)
            .collect::<Vec<_>>(),
        [3]
    );
    // The tiled kernels' staged A (4 KiB) and B (5 KiB, padded), 128
    // invocations; the matrix-vector kernel's override-sized workgroup.
    for entry in [
        wgrad::kernels::registry::MATMUL_FORWARD_SHARED,
        wgrad::kernels::registry::MATMUL_FORWARD_SHARED_VEC4,
    ] {
        let shared = reflect::entry_needs(entry).unwrap();
        assert_eq!(shared.workgroup_bytes, (256 + 320) * 16, "{}", entry.entry);
        assert_eq!(shared.invocations(&[]), 128, "{}", entry.entry);
    }
    let matvec = reflect::entry_needs(wgrad::kernels::registry::MATMUL_FORWARD_MATVEC).unwrap();
    assert_eq!(matvec.invocations(&[("MATVEC_WG", 8.0)]), 8);
    assert_eq!(matvec.invocations(&[]), 64, "MATVEC_WG's default");
}

#[test]
fn a_writable_binding_that_aliases_another_is_refused_where_the_dispatch_is_built() {
    for_each_adapter(
        "a_writable_binding_that_aliases_another_is_refused_where_the_dispatch_is_built",
        |k| {
            let align = (k.device().limits().min_storage_buffer_offset_alignment as usize / 4).max(1);
            let x = k.upload(&vec![1.0f32; 4 * align])?;
            let y = k.upload(&vec![2.0f32; 4 * align])?;
            // In place: the output is the first operand.
            let err = k
                .binary(wgrad::kernels::Binary::Add, x.view(), x.view(), y.view())
                .expect_err("out aliasing x");
            assert!(
                err.to_string().contains("overlaps") && err.to_string().contains("WebGPU"),
                "{err}"
            );
            // A written part overlapping a read part of the same buffer.
            let err = k
                .binary(
                    wgrad::kernels::Binary::Add,
                    x.slice(0, 2 * align)?,
                    x.slice(align, 2 * align)?,
                    y.slice(0, 2 * align)?,
                )
                .expect_err("overlapping parts");
            assert!(err.to_string().contains("overlaps"), "{err}");
            // Separate buffers run as before.
            let out = k.zeros(4 * align)?;
            let d = k.binary(wgrad::kernels::Binary::Add, out.view(), x.view(), y.view())?;
            k.run(&[&d])?;
            assert_eq!(k.read::<f32>(out.view())?, vec![3.0f32; 4 * align]);
            Ok(())
        },
    );
}

/// Invocations a GPU launch should have: about 8K (a few waves on every
/// compute unit of a large GPU), or, for a launch over less data than
/// that, enough that no invocation walks more than this many elements of
/// its largest operand (a bias gradient of 768 values needs no 8K).
const GPU_LAUNCH_INVOCATIONS: u64 = 8192;
const MAX_ELEMENTS_PER_INVOCATION: u64 = 64;

/// Known exceptions, each open work: the embedding gradient's counting
/// sort over the vocabulary runs in one workgroup of as many lanes as the
/// device allows (1024 where it can, WebGPU's default 256 elsewhere),
/// which a multi-workgroup sort would replace.
const SINGLE_WORKGROUP_FOR_NOW: [&str; 1] = ["embedding_backward_sort"];

#[test]
fn no_training_dispatch_at_gpt2_124m_shapes_launches_fewer_than_8k_invocations_on_a_gpu() {
    let test = "no_training_dispatch_at_gpt2_124m_shapes_launches_fewer_than_8k_invocations_on_a_gpu";
    let Some(k) = crate::common::adapters().first().cloned() else {
        crate::common::no_adapter(test);
        return;
    };
    let _gl = k.device().lock_gl();
    // The kernels shaped as on a GPU, whatever this adapter is (with the
    // CPU shaping this test fails: one-pass column sums and the 8-lane
    // subgroup matmul give hundreds of invocations over millions of
    // values). One block: every block of GPT-2 124M has the same shapes,
    // so one covers every kind of dispatch. Two limits of a 128 MiB
    // storage binding (lavapipe's, and WebGPU's default) shape the rest: a
    // sequence of 512 tokens (at 1024 the logits, 206 MB, are over it, and
    // the fused cross-entropy does not split rows over bindings), and a
    // vocabulary of 32,768 (the input gradient's dlogits·wte reads wte,
    // 154 MB at 50,257 tokens, along k, which a matmul does not split over
    // bindings).
    let gpu = crate::common::limited_kernels(
        &k,
        wgrad::kernels::LimitOverrides {
            gpu_shaping: Some(true),
            ..Default::default()
        },
    );
    let config = wgrad::models::GptConfig {
        n_layer: 1,
        block_size: 512,
        vocab_size: 32768,
        ..wgrad::models::GptConfig::gpt2()
    };
    let gpt = wgrad::models::Gpt::new(config).expect("GPT-2's config");
    let optimizer = wgrad::optim::AdamW::new(6e-4).decay_matrices_only().clip_grad_norm(1.0);
    let trainer = wgrad::Trainer::new(gpu.clone(), &gpt, wgrad::nn::CrossEntropyLoss, optimizer, 1)
        .expect("a GPT-2-shaped trainer");
    let mut small = Vec::new();
    let mut launches = 0;
    for dispatch in trainer.executor().step_dispatches() {
        for launch in dispatch.each_launch() {
            launches += 1;
            let entry = launch.kernel().entry;
            let per_workgroup = reflect::entry_needs(launch.kernel())
                .expect("a registered entry")
                .invocations(&launch.recipe().constants);
            let [x, y, z] = launch.workgroups();
            let invocations = u64::from(x) * u64::from(y) * u64::from(z) * per_workgroup;
            let largest = launch.recipe().bindings.iter().map(|b| b.bytes / 4).max().unwrap_or(0);
            let wanted = GPU_LAUNCH_INVOCATIONS.min(largest.div_ceil(MAX_ELEMENTS_PER_INVOCATION));
            if invocations < wanted && !SINGLE_WORKGROUP_FOR_NOW.contains(&entry) {
                small.push(format!("{entry}: {x}x{y}x{z} workgroups of {per_workgroup} = {invocations} invocations over {largest} elements"));
            }
        }
    }
    eprintln!("{test}: {launches} launches per step");
    assert!(
        small.is_empty(),
        "launches too small for a GPU at GPT-2 124M's shapes:\n{}",
        small.join("\n")
    );
}

/// Entry points that may have no browser case in `cli/src/webgpu_cases.rs`,
/// each with why. Empty: every entry point has one today. An entry belongs
/// here only when a browser cannot run it at all, and the reason says so.
const NO_BROWSER_CASE: [(&str, &str); 0] = [];

/// The entry points `cli/src/webgpu_cases.rs`'s builder table claims, read
/// from its source: the `const BUILDERS` table, whitespace
/// removed (rustfmt may break an entry over lines), where each builder
/// starts with `(&["entry", ...]`. `wgrad shaders --dump` checks at run
/// time that each case runs what it claims; that needs an adapter, and only
/// CI's Chromium run dumps.
fn browser_case_entries() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/src/webgpu_cases.rs");
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let Some(start) = source.find("const BUILDERS") else {
        return Vec::new();
    };
    let table: String = source[start..].chars().filter(|c| !c.is_whitespace()).collect();
    // The table ends the const's block: `..]};`.
    let table = table.split_once("]};").map_or(table.as_str(), |(t, _)| t);
    let mut entries = Vec::new();
    for builder in table.split("(&[").skip(1) {
        let Some((list, _)) = builder.split_once(']') else {
            continue;
        };
        // The list is `"a","b"`: every other piece of a split on quotes.
        entries.extend(list.split('"').skip(1).step_by(2).map(str::to_string));
    }
    entries
}

// Runs everywhere (no adapter, no Chromium): a new entry point without a
// browser case fails here, not only in CI's Chromium run.
#[test]
fn every_entry_point_has_a_browser_case() {
    let claimed = browser_case_entries();
    assert!(
        claimed.len() >= KERNELS.len() / 2,
        "read only {} entries from webgpu_cases.rs's builder table: has its layout changed?",
        claimed.len()
    );
    let allowed: Vec<&str> = NO_BROWSER_CASE.iter().map(|(entry, _)| *entry).collect();
    let missing: Vec<&str> = KERNELS
        .iter()
        .map(|k| k.entry)
        .filter(|entry| !claimed.iter().any(|c| c == entry) && !allowed.contains(entry))
        .collect();
    assert!(
        missing.is_empty(),
        "entry points with no case in cli/src/webgpu_cases.rs's builder table (add one; CONTRIBUTING.md): {missing:?}"
    );
    let unknown: Vec<&String> = claimed
        .iter()
        .filter(|c| !KERNELS.iter().any(|k| k.entry == c.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "cli/src/webgpu_cases.rs claims entry points the registry lacks: {unknown:?}"
    );
    let stale: Vec<&str> = allowed
        .iter()
        .copied()
        .filter(|a| claimed.iter().any(|c| c == a))
        .collect();
    assert!(
        stale.is_empty(),
        "NO_BROWSER_CASE lists entries that have a case now: {stale:?}"
    );
}
