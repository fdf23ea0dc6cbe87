//! wgrad in a browser tab: the library, compiled to wasm32 over the page's
//! WebGPU, with what a page calls from JavaScript (web/www is that page).
//!
//! - [`Gpu`] opens the page's WebGPU adapter and says what it lacks.
//! - [`GptTrainer`] trains `make train`'s Shakespeare GPT: the same
//!   config, seed, data windows and validation windows as `wgrad train`.
//! - [`LmSession`] generates with a GGUF model from its bytes, and chats
//!   through its chat template.
//!
//! Every wait is awaited (each call that reads the GPU returns a
//! `Promise`): a page cannot block. Calls on one object run one at a
//! time; a second before the first settles is an error that says so.

// The RefCell borrow held across an await is that rule: `busy` takes it
// with `try_borrow_mut`, so an overlapping call gets the error, never a
// panic, and the page has one thread.
#![allow(clippy::await_holding_refcell_ref)]

mod chat;
mod train;

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::sync::Arc;

use wasm_bindgen::prelude::*;
use wgrad::{Device, DeviceOptions, Kernels, LimitsMode};

pub use chat::LmSession;
pub use train::GptTrainer;

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = console, js_name = error)]
    fn console_error(message: &str);
}

/// Panics go to the console with their message (wasm32 otherwise shows
/// only "unreachable"). The page calls it once, before anything else.
#[wasm_bindgen(js_name = installPanicHook)]
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| console_error(&format!("wgrad panicked: {info}"))));
}

/// A wgrad error as JavaScript sees it: an `Error` with wgrad's message
/// (the op and the shapes in it).
pub(crate) fn js_error(error: wgrad::Error) -> JsValue {
    js_sys::Error::new(&error.to_string()).into()
}

pub(crate) fn invalid(op: &'static str, reason: String) -> JsValue {
    js_error(wgrad::Error::InvalidArgument { op, reason })
}

/// The object's state for one call at a time: a second call while an
/// awaited one holds it is an error, not a panic.
pub(crate) fn busy<'a, T>(cell: &'a Rc<RefCell<T>>, what: &str) -> Result<RefMut<'a, T>, JsValue> {
    cell.try_borrow_mut()
        .map_err(|_| js_sys::Error::new(&format!("{what} is busy: await the call before making another")).into())
}

/// The page's WebGPU device, as wgrad opens it (`Device::open_async`):
/// the features wgrad uses where the adapter has them, its limits or
/// WebGPU's defaults.
#[wasm_bindgen]
pub struct Gpu {
    kernels: Arc<Kernels>,
}

#[wasm_bindgen]
impl Gpu {
    /// Opens the adapter the browser hands out. `webgpu_limits` asks for
    /// WebGPU's default limits (what every browser guarantees) instead of
    /// the adapter's own. Without WebGPU the error says so.
    pub async fn open(webgpu_limits: bool) -> Result<Gpu, JsValue> {
        let options = DeviceOptions {
            limits: Some(if webgpu_limits {
                LimitsMode::WebGpu
            } else {
                LimitsMode::Adapter
            }),
            ..DeviceOptions::default()
        };
        let device = Device::open_async(&options).await.map_err(js_error)?;
        Ok(Gpu {
            kernels: Arc::new(Kernels::new(device)),
        })
    }

    /// The adapter's name as the browser gives it (some hide it).
    #[wasm_bindgen(getter)]
    pub fn adapter(&self) -> String {
        let name = &self.kernels.device().info().name;
        if name.trim().is_empty() {
            "WebGPU adapter (the browser does not name it)".into()
        } else {
            name.clone()
        }
    }

    /// What the device has and what wgrad does without it, as JSON:
    /// `{adapter, shader_f16, subgroups, subgroup_sizes, storage_buffers,
    /// binding_mib, notes: [..]}`.
    pub fn report(&self) -> String {
        let device = self.kernels.device();
        let (features, limits, info) = (device.features(), device.limits(), device.info());
        let f16 = features.contains(wgpu::Features::SHADER_F16);
        let subgroups = features.contains(wgpu::Features::SUBGROUP);
        let mut notes = Vec::new();
        if !f16 {
            notes.push(
                "no shader-f16: models keep f32 weights and train in f32 (as natively on an adapter without \
                 SHADER_F16)",
            );
        }
        if !subgroups {
            notes.push("no subgroups: the matrix products run their forms without subgroup operations");
        }
        serde_json::json!({
            "adapter": self.adapter(),
            "fallback_adapter": device.is_cpu(),
            "shader_f16": f16,
            "subgroups": subgroups,
            "subgroup_sizes": [info.subgroup_min_size, info.subgroup_max_size],
            "storage_buffers": limits.max_storage_buffers_per_shader_stage,
            "binding_mib": limits.max_storage_buffer_binding_size / (1 << 20),
            "notes": notes,
        })
        .to_string()
    }
}

impl Gpu {
    pub(crate) fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }
}
