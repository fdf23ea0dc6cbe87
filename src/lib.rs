//! wgrad: train and run neural networks on any GPU vendor. Every numeric
//! kernel is a WGSL compute shader dispatched through wgpu (Vulkan, Metal,
//! DX12, GL), including software adapters such as Mesa's lavapipe.
//!
//! Layers, each depending only on those above it:
//! `shaders/*.wgsl` → [`device`] → [`kernels`]; [`cpu`] holds the plain-Rust
//! twin of every kernel that the tests compare against. Both take their op
//! vocabulary (matmul forms, activations, optimizer settings) from [`ops`],
//! so neither imports the other. [`train`] runs a whole training run
//! (data, devices, strategy, resume, loop, checkpoint) over [`parallel`].
//!
//! The `wgrad` command line is a separate package (`cli/`), so depending
//! on this library compiles none of its argument parsing, progress bars or
//! plotting.

pub mod atomic_write;
pub mod cpu;
pub mod device;
pub mod error;
pub mod graph;
pub mod infer;
pub mod io;
pub mod kernels;
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod pipeline_cache;
pub mod train;
pub mod user_cache;

pub use device::{Device, DeviceOptions, LimitsMode};
pub use error::{Error, Result};
pub use kernels::{GpuTensor, Kernels, View};
pub use parallel::{Examples, Targets, Trainer};
