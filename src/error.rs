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

    /// An argument (or a combination of them, or a call out of order) that
    /// the operation refuses: something the caller can change.
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },

    /// One of wgrad's own invariants failed (a plan inconsistent with its
    /// graph, a slot the planner made gone missing): a bug in wgrad, not in
    /// the caller's input. Kept apart from `InvalidArgument` so a caller
    /// never searches its own code for the fault.
    #[error("{op}: internal error, a bug in wgrad (please report it): {reason}")]
    Internal { op: &'static str, reason: String },

    /// An error on one device of a group, naming it.
    #[error("device {device}: {source}")]
    OnDevice { device: String, source: Box<Error> },

    /// A failure between the processes of a distributed run (MPI), naming
    /// the rank that saw it.
    #[error("rank {rank} of {size}: {op}: {message}")]
    Distributed {
        op: &'static str,
        rank: usize,
        size: usize,
        message: String,
    },

    /// An error on one process of a distributed run, naming its rank.
    #[error("rank {rank}: {source}")]
    OnRank { rank: usize, source: Box<Error> },

    /// `backward` reached an op that has no gradient rule for that input.
    #[error("backward: `{op}` has no gradient with respect to its input `{input}`")]
    NoGradient { op: &'static str, input: String },

    /// A loss read back from the GPU was NaN or infinite.
    #[error("the loss became {value} at step {step}; lower the learning rate or check the data")]
    NonFiniteLoss { value: f32, step: u64 },

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

    /// A model (or other set of buffers) larger than the memory the
    /// adapter has, found before anything was allocated.
    #[error(
        "{op}: needs {needed} bytes of GPU memory ({parts}), more than the {available} bytes of {memory}; \
         use a smaller model, fewer sequences or an adapter with more memory"
    )]
    MemoryTooSmall {
        op: &'static str,
        needed: u64,
        available: u64,
        memory: String,
        parts: String,
    },

    /// An opt-in kernel needs a device feature (or a subgroup size) this
    /// adapter does not offer.
    #[error("{op}: needs {feature}, which adapter `{adapter}` does not offer; use the f32 kernels there")]
    Unsupported {
        op: &'static str,
        feature: String,
        adapter: String,
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

    /// A data file could not be opened, read or decompressed.
    #[error("{op}: cannot read `{}`: {source}", path.display())]
    DataIo {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file in wgrad's cache directory could not be written.
    #[error("{op}: `{}`: {source}", path.display())]
    CacheIo {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A text data file (CSV) has a bad line; `line` counts from 1.
    #[error("{op}: `{file}` line {line}: {reason}")]
    DataParse {
        op: &'static str,
        file: String,
        line: usize,
        reason: String,
    },

    /// A binary data file (IDX) whose header or size is wrong, or two files
    /// that do not belong together.
    #[error("{op}: `{file}`: {reason}")]
    DataFormat {
        op: &'static str,
        file: String,
        reason: String,
    },

    /// None of the accepted names for a data file exists.
    #[error("{op}: file not found; tried {tried}")]
    DataNotFound { op: &'static str, tried: String },

    /// Reading or writing a checkpoint file failed at the OS level.
    #[error("checkpoint `{}`: could not {action}: {source}", .path.display())]
    CheckpointIo {
        path: std::path::PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// A file that is not a readable checkpoint (truncated, corrupt header,
    /// a dtype other than F32).
    #[error("checkpoint `{}`: {reason}", .path.display())]
    CheckpointFormat { path: std::path::PathBuf, reason: String },

    /// The model expects a tensor the checkpoint does not have.
    #[error("checkpoint has no tensor `{name}` (the model expects shape {expected:?})")]
    CheckpointMissing { name: String, expected: Vec<usize> },

    /// A checkpoint tensor whose shape differs from the model's.
    #[error("checkpoint tensor `{name}` has shape {found:?}, but the model expects {expected:?}")]
    CheckpointMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// A GGUF file whose header, metadata or layout is wrong (truncated, a
    /// count larger than the file could hold, an unknown version), or that
    /// holds something wgrad does not run (an architecture, a value of the
    /// wrong type for its key).
    #[error("GGUF `{}`: {reason}", .path.display())]
    Gguf { path: std::path::PathBuf, reason: String },

    /// One tensor of a GGUF file: its data runs past the end of the file,
    /// overlaps another's or is misaligned, its dims overflow, its type id is
    /// unknown, or its type is one wgrad does not decode. `dtype` is its type
    /// and dims (`Q4_1 [576, 1536]`), or what is known of them.
    #[error("GGUF `{}`: tensor `{tensor}` ({dtype}): {reason}", .path.display())]
    GgufTensor {
        path: std::path::PathBuf,
        tensor: String,
        dtype: String,
        reason: String,
    },

    /// A model folder's weights lack a tensor its config.json implies.
    #[error("`{}` has no tensor `{name}` (config.json implies shape {expected:?})", .path.display())]
    FolderTensorMissing {
        path: std::path::PathBuf,
        name: String,
        expected: Vec<usize>,
    },

    /// A tensor in a model folder that the model has no parameter for.
    #[error("`{}` holds tensor `{name}` {shape:?}, which this model has no parameter for", .path.display())]
    FolderTensorUnexpected {
        path: std::path::PathBuf,
        name: String,
        shape: Vec<usize>,
    },

    /// A tensor in a model folder whose shape disagrees with config.json.
    #[error("`{}`: tensor `{name}` has shape {found:?}, but config.json implies {expected:?}", .path.display())]
    FolderTensorShape {
        path: std::path::PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
}

impl Error {
    /// A broken invariant of wgrad's own in `op` ([`Error::Internal`]).
    pub fn internal(op: &'static str, reason: impl Into<String>) -> Self {
        Error::Internal {
            op,
            reason: reason.into(),
        }
    }

    /// A shape error in `op` with the operands' shapes.
    pub fn shape(op: &'static str, reason: impl Into<String>, shapes: &[&[usize]]) -> Self {
        Error::Shape {
            op,
            reason: reason.into(),
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn internal_errors_say_they_are_wgrad_bugs_and_name_the_op() {
        let e = Error::internal("Executor", "`h` (matmul) has no kernel");
        let text = e.to_string();
        assert!(text.starts_with("Executor: "), "{text}");
        assert!(text.contains("a bug in wgrad"), "{text}");
        assert!(text.ends_with("`h` (matmul) has no kernel"), "{text}");
        // A user's bad argument reads as theirs to fix, not as a bug.
        let user = Error::InvalidArgument {
            op: "Sampling",
            reason: "top_k must be at least 1".into(),
        };
        assert!(!user.to_string().contains("bug"), "{user}");
    }
}
