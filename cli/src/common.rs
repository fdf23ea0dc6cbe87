//! What several commands share: a spinner for waits of unknown length,
//! and opening the chosen adapter's kernels.

use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use wgrad::{Device, DeviceOptions, Kernels};

/// A ticking spinner with a message, for waits of unknown length.
pub fn spinner(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

pub fn open_kernels(opts: &DeviceOptions) -> wgrad::Result<Arc<Kernels>> {
    Ok(Arc::new(Kernels::new(Device::open(opts)?)))
}
