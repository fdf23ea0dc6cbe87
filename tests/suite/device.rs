//! The adapter layer: discovery, selection, and wgpu errors as `Error`s.

use crate::common;

use wgrad::device::{list_adapters, parse_backend, select_adapter, DeviceOptions};
use wgrad::Error;

#[test]
fn backend_names_parse_and_unknown_ones_are_errors() {
    assert_eq!(parse_backend("Vulkan").unwrap(), wgpu::Backends::VULKAN);
    assert_eq!(parse_backend("gl").unwrap(), wgpu::Backends::GL);
    assert_eq!(parse_backend("dx12").unwrap(), wgpu::Backends::DX12);
    assert_eq!(parse_backend("metal").unwrap(), wgpu::Backends::METAL);
    let err = parse_backend("cuda").unwrap_err();
    assert!(matches!(err, Error::UnknownBackend(ref b) if b == "cuda"), "{err}");
}

#[test]
fn listing_numbers_adapters_and_reports_limits() {
    if !common::any_adapter("listing") {
        return;
    }
    let list = list_adapters();
    for (i, r) in list.iter().enumerate() {
        assert_eq!(r.index, i);
        let text = r.to_string();
        assert!(text.contains(&r.info.name), "{text}");
        assert!(text.contains("storage binding"), "{text}");
        assert!(text.contains("SUBGROUP="), "{text}");
        assert!(r.limits.max_storage_buffer_binding_size > 0);
    }
}

#[test]
fn a_name_that_matches_nothing_is_an_error_listing_what_exists() {
    let opts = DeviceOptions {
        backends: None,
        adapter: Some("no-such-gpu-xyz".into()),
        ..Default::default()
    };
    match select_adapter(&opts) {
        Err(Error::AdapterNotFound { selector, .. }) => assert!(selector.contains("no-such-gpu-xyz")),
        Err(Error::NoAdapter { .. }) => common::no_adapter("selection_miss"),
        other => panic!("expected AdapterNotFound, got {:?}", other.map(|a| a.get_info().name)),
    }
    let opts = DeviceOptions {
        backends: None,
        adapter: Some("999".into()),
        ..Default::default()
    };
    assert!(select_adapter(&opts).is_err());
}

#[test]
fn selection_by_index_name_and_backend() {
    if !common::any_adapter("selection") {
        return;
    }
    let list = list_adapters();
    let Some(first) = list.first() else { return };
    let by_index = select_adapter(&DeviceOptions {
        backends: None,
        adapter: Some("0".into()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(by_index.get_info().name, first.info.name);
    assert_eq!(by_index.get_info().backend, first.info.backend);
    let needle = first.info.name.to_uppercase();
    let by_name = select_adapter(&DeviceOptions {
        backends: None,
        adapter: Some(needle),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(by_name.get_info().name, first.info.name);
    for r in &list {
        let backends = wgpu::Backends::from(r.info.backend);
        let chosen = select_adapter(&DeviceOptions {
            backends: Some(backends),
            adapter: None,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(chosen.get_info().backend, r.info.backend);
    }
}

#[test]
fn the_policy_prefers_native_apis_over_gl_for_the_same_kind() {
    if !common::any_adapter("policy") {
        return;
    }
    let list = list_adapters();
    let best = select_adapter(&DeviceOptions::default()).unwrap();
    let info = best.get_info();
    let rank = |t: wgpu::DeviceType| match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    for r in &list {
        assert!(
            rank(info.device_type) <= rank(r.info.device_type),
            "{} beat {}",
            r.info.name,
            info.name
        );
        if r.info.device_type == info.device_type && r.info.backend != wgpu::Backend::Gl {
            assert_ne!(info.backend, wgpu::Backend::Gl, "GL chosen over {}", r.info.name);
        }
    }
}

#[test]
fn a_gpu_validation_error_is_an_error_not_a_panic() {
    common::for_each_adapter("validation_error", |k| {
        let a = k.upload(&[1.0f32; 8])?;
        let out = k.zeros(8)?;
        let dispatch = k.scale(out.view(), a.view(), 2.0)?;
        // Destroying a bound buffer makes the next submit invalid in wgpu.
        a.buffer().destroy();
        let err = k.run(&[&dispatch]).expect_err("submit with a destroyed buffer");
        assert!(matches!(err, Error::Validation { .. }), "{err}");
        // The device stays usable afterwards.
        let b = k.upload(&[3.0f32; 4])?;
        let out = k.zeros(4)?;
        k.run(&[&k.scale(out.view(), b.view(), 2.0)?])?;
        assert_eq!(k.read::<f32>(out.view())?, vec![6.0; 4]);
        Ok(())
    });
}

#[test]
fn a_lost_device_is_reported_as_device_lost() {
    common::for_each_adapter("device_lost", |shared| {
        // A device of its own: destroying the shared one would break the
        // other tests.
        let k = common::private_kernels(shared);
        k.device().wgpu_device().destroy();
        let err = k.upload(&[1.0f32]).and_then(|t| k.read::<f32>(t.view()));
        match err {
            Err(Error::DeviceLost { adapter, .. }) => assert!(adapter.contains(&shared.device().info().name)),
            other => panic!("{}: expected DeviceLost, got {other:?}", shared.device().label()),
        }
        Ok(())
    });
}
