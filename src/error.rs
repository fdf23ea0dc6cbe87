//! The one error type of the crate. Variants name the operation and carry the
//! shapes or sizes involved, so a message is enough to find the bad call.

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no GPU adapter found{filter}. wgrad needs a Vulkan, Metal, DX12 or GL driver. \
         On a machine without a GPU install a software driver: Debian/Ubuntu \
         `apt-get install mesa-vulkan-drivers libvulkan1` (Vulkan lavapipe) or \
         `libegl1 libegl-mesa0 libgl1-mesa-dri` (GL llvmpipe); Fedora `mesa-vulkan-drivers`; \
         Windows has WARP through DX12"
    )]
    NoAdapter { filter: String },

    #[error("adapter `{selector}` matches none of the adapters present: {available}")]
    AdapterNotFound { selector: String, available: String },

    #[error("unknown backend `{0}`: expected one of vulkan, metal, dx12, gl")]
    UnknownBackend(String),

    #[error("could not open a device on adapter `{adapter}`: {source}")]
    RequestDevice {
        adapter: String,
        #[source]
        source: wgpu::RequestDeviceError,
    },

    /// A shape that does not fit the operation. `shapes` lists every operand's
    /// shape in argument order.
    #[error("{op}: {reason} (shapes {shapes:?})")]
    Shape {
        op: &'static str,
        reason: String,
        shapes: Vec<Vec<usize>>,
    },

    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },

    /// A tensor bigger than the adapter can bind in one storage binding.
    #[error(
        "{op}: `{operand}` needs {bytes} bytes, over this adapter's limit of {limit} bytes \
         ({limit_name}); split the tensor or use an adapter with larger limits"
    )]
    TooLarge {
        op: &'static str,
        operand: &'static str,
        bytes: u64,
        limit: u64,
        limit_name: &'static str,
    },

    /// wgpu reported a validation error for this operation. This is a bug in
    /// wgrad if it happens on a path that passed the shape checks.
    #[error("{op}: GPU validation error: {message}")]
    Validation { op: String, message: String },

    #[error("{op}: the GPU ran out of memory: {message}")]
    OutOfMemory { op: String, message: String },

    #[error("the device `{adapter}` was lost ({reason}); recreate it to continue")]
    DeviceLost { adapter: String, reason: String },

    #[error("{op}: reading a buffer back from the GPU failed: {message}")]
    Readback { op: &'static str, message: String },
}

impl Error {
    /// A shape error in `op` with the operands' shapes.
    pub fn shape(op: &'static str, reason: impl Into<String>, shapes: &[&[usize]]) -> Self {
        Error::Shape {
            op,
            reason: reason.into(),
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
        }
    }
}
