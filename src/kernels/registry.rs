//! The kernel sources and the table of entry points. A new WGSL entry gets one
//! line in `KERNELS`; a test checks the table against the WGSL files.
//!
//! WGSL has no includes, so WGSL that several families need (index helpers,
//! activation formulas) lives once in a [`Shared`] file and is concatenated
//! into each family that uses it by [`Family::source`]; tests/suite/shaders.rs
//! checks that every family composing a shared name lists its file in
//! [`Family::shared`] and that no family file defines one of its own.

/// `include_str!` of files under shaders/, each followed by a newline.
macro_rules! wgsl {
    ($($file:literal),+) => {
        concat!($(include_str!(concat!("../../shaders/", $file)), "\n"),+)
    };
}

/// A WGSL file with no entry points, composed into the families that use
/// it (see [`Family::shared`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shared {
    /// `WG` and `flat_index`, for one-invocation-per-element kernels.
    Common,
    /// Each activation's forward and backward formula by code, for the
    /// elementwise kernels and the matmul epilogue.
    Activations,
    /// The matrix-vector kernels' overrides, workgroup memory and lane
    /// reduction, for matmul.wgsl's f32 and f16_weights.wgsl's f16 weights.
    Matvec,
    /// The tiled forward kernels' row multiply-adds and masked row stores
    /// (through each family's `write_c`), for matmul.wgsl, f16_weights.wgsl
    /// and matmul_f16.wgsl.
    MatmulRows,
    /// The workgroup-memory tiled kernels' staging, multiply-adds and
    /// stores (the GPU layout), for matmul.wgsl and f16_weights.wgsl.
    MatmulTiles,
}

impl Shared {
    pub const ALL: [Shared; 5] = [Shared::Common, Shared::Activations, Shared::Matvec, Shared::MatmulRows, Shared::MatmulTiles];

    pub fn file_name(self) -> &'static str {
        match self {
            Shared::Common => "common.wgsl",
            Shared::Activations => "activations.wgsl",
            Shared::Matvec => "matvec.wgsl",
            Shared::MatmulRows => "matmul_rows.wgsl",
            Shared::MatmulTiles => "matmul_tiles.wgsl",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Shared::Common => wgsl!("common.wgsl"),
            Shared::Activations => wgsl!("activations.wgsl"),
            Shared::Matvec => wgsl!("matvec.wgsl"),
            Shared::MatmulRows => wgsl!("matmul_rows.wgsl"),
            Shared::MatmulTiles => wgsl!("matmul_tiles.wgsl"),
        }
    }
}

/// One WGSL file, embedded at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Matmul,
    Elementwise,
    Reduce,
    Loss,
    Optim,
    /// Opt-in: needs SHADER_F16 (see [`Family::required_features`]).
    MatmulF16,
    /// Needs SUBGROUP with 8-lane subgroups; `MatmulVariant::Subgroup` of
    /// the training matmul. Its source is the matmul family's followed by
    /// matmul_subgroup.wgsl (see [`Family::base`]).
    MatmulSubgroup,
    /// One workgroup per row: softmax, layernorm, cross-entropy over long
    /// rows, embedding lookup.
    Rowwise,
    /// Rank-1..4 layout ops, one invocation per output element:
    /// broadcasting binary ops, unary ops, reduction to a broadcast
    /// operand's shape, permute, and slice / pad / concat of the last axis.
    Tensor,
    /// Attention over a KV cache (generation): one invocation per
    /// (sequence, row, head) on a CPU adapter, one workgroup on a GPU.
    Attention,
    /// The next token of each row of logits (generation): one workgroup
    /// per row.
    Sampling,
    /// Opt-in: needs SHADER_F16. Generation with f16 weights and f32
    /// activations: matrix-vector, matmul and embedding lookup.
    F16Weights,
    /// Rotary position embedding, forward and backward: one invocation
    /// per element.
    Rope,
}

impl Family {
    pub const ALL: [Family; 13] = [
        Family::Matmul,
        Family::Elementwise,
        Family::Reduce,
        Family::Loss,
        Family::Optim,
        Family::MatmulF16,
        Family::MatmulSubgroup,
        Family::Rowwise,
        Family::Tensor,
        Family::Attention,
        Family::Sampling,
        Family::F16Weights,
        Family::Rope,
    ];

    /// Device features the file needs to compile at all; its typed entries
    /// check them first and return `Error::Unsupported` without them.
    pub fn required_features(self) -> wgpu::Features {
        match self {
            Family::MatmulF16 | Family::F16Weights => wgpu::Features::SHADER_F16,
            Family::MatmulSubgroup => wgpu::Features::SUBGROUP,
            _ => wgpu::Features::empty(),
        }
    }

    /// The family whose file this one's source starts with. WGSL has no
    /// includes; the subgroup matmul shares matmul.wgsl's overrides,
    /// bindings and epilogue (`write_c`) by being appended to it, so the
    /// two cannot drift apart, while matmul.wgsl alone stays free of
    /// subgroup builtins (a module using them does not validate on an
    /// adapter without SUBGROUP). The composed module also holds the base
    /// file's entry points; they are registered under the base family only.
    pub fn base(self) -> Option<Family> {
        match self {
            Family::MatmulSubgroup => Some(Family::Matmul),
            _ => None,
        }
    }

    /// The shared files this family's source adds after its own file
    /// (module-scope WGSL may be declared in any order, and a file's
    /// `enable` directive must stay first). A family with a base has them
    /// through the base.
    pub fn shared(self) -> &'static [Shared] {
        match self {
            Family::Matmul => &[Shared::Activations, Shared::Matvec, Shared::MatmulRows, Shared::MatmulTiles],
            Family::Elementwise => &[Shared::Common, Shared::Activations],
            Family::Reduce | Family::Loss | Family::Optim | Family::Rowwise | Family::Tensor | Family::Attention => &[Shared::Common],
            Family::Sampling | Family::Rope => &[Shared::Common],
            Family::MatmulF16 => &[Shared::Common, Shared::MatmulRows],
            Family::MatmulSubgroup => &[],
            Family::F16Weights => &[Shared::Common, Shared::Activations, Shared::Matvec, Shared::MatmulRows, Shared::MatmulTiles],
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            Family::Matmul => "matmul.wgsl",
            Family::Elementwise => "elementwise.wgsl",
            Family::Reduce => "reduce.wgsl",
            Family::Loss => "loss.wgsl",
            Family::Optim => "optim.wgsl",
            Family::MatmulF16 => "matmul_f16.wgsl",
            Family::MatmulSubgroup => "matmul_subgroup.wgsl",
            Family::Rowwise => "rowwise.wgsl",
            Family::Tensor => "tensor.wgsl",
            Family::Attention => "attention.wgsl",
            Family::Sampling => "sampling.wgsl",
            Family::F16Weights => "f16_weights.wgsl",
            Family::Rope => "rope.wgsl",
        }
    }

    /// The family's own file alone (not a valid module where it uses
    /// shared or base WGSL).
    pub fn own_source(self) -> &'static str {
        match self {
            Family::Matmul => wgsl!("matmul.wgsl"),
            Family::Elementwise => wgsl!("elementwise.wgsl"),
            Family::Reduce => wgsl!("reduce.wgsl"),
            Family::Loss => wgsl!("loss.wgsl"),
            Family::Optim => wgsl!("optim.wgsl"),
            Family::MatmulF16 => wgsl!("matmul_f16.wgsl"),
            Family::MatmulSubgroup => wgsl!("matmul_subgroup.wgsl"),
            Family::Rowwise => wgsl!("rowwise.wgsl"),
            Family::Tensor => wgsl!("tensor.wgsl"),
            Family::Attention => wgsl!("attention.wgsl"),
            Family::Sampling => wgsl!("sampling.wgsl"),
            Family::F16Weights => wgsl!("f16_weights.wgsl"),
            Family::Rope => wgsl!("rope.wgsl"),
        }
    }

    /// The module compiled for this family: the base family's source (if
    /// any), then its own file, then its [`Family::shared`] files. Keep in
    /// step with `base` and `shared`; tests/suite/shaders.rs checks it.
    pub fn source(self) -> &'static str {
        match self {
            Family::Matmul => wgsl!("matmul.wgsl", "activations.wgsl", "matvec.wgsl", "matmul_rows.wgsl", "matmul_tiles.wgsl"),
            Family::Elementwise => wgsl!("elementwise.wgsl", "common.wgsl", "activations.wgsl"),
            Family::Reduce => wgsl!("reduce.wgsl", "common.wgsl"),
            Family::Loss => wgsl!("loss.wgsl", "common.wgsl"),
            Family::Optim => wgsl!("optim.wgsl", "common.wgsl"),
            Family::MatmulF16 => wgsl!("matmul_f16.wgsl", "common.wgsl", "matmul_rows.wgsl"),
            Family::MatmulSubgroup => wgsl!("matmul.wgsl", "activations.wgsl", "matvec.wgsl", "matmul_rows.wgsl", "matmul_tiles.wgsl", "matmul_subgroup.wgsl"),
            Family::Rowwise => wgsl!("rowwise.wgsl", "common.wgsl"),
            Family::Tensor => wgsl!("tensor.wgsl", "common.wgsl"),
            Family::Attention => wgsl!("attention.wgsl", "common.wgsl"),
            Family::Sampling => wgsl!("sampling.wgsl", "common.wgsl"),
            Family::F16Weights => wgsl!("f16_weights.wgsl", "common.wgsl", "activations.wgsl", "matvec.wgsl", "matmul_rows.wgsl", "matmul_tiles.wgsl"),
            Family::Rope => wgsl!("rope.wgsl", "common.wgsl"),
        }
    }
}

/// Which compiler a module is written for. WGSL's `enable subgroups;`
/// directive is required by Tint (Chrome, Dawn) for subgroup builtins and
/// refused by naga 30, which wgpu's native backends compile with; the
/// modules are otherwise the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// naga, as wgpu's Vulkan, Metal, DX12 and GL backends parse it.
    Naga,
    /// WebGPU as browsers and Dawn take it (Tint): extensions enabled.
    WebGpu,
}

impl Dialect {
    /// The dialect a device's backend compiles: WebGPU in a browser (wgpu
    /// hands it the WGSL as it is), naga everywhere else.
    pub fn for_backend(backend: wgpu::Backend) -> Dialect {
        if backend == wgpu::Backend::BrowserWebGpu {
            Dialect::WebGpu
        } else {
            Dialect::Naga
        }
    }
}

impl Family {
    /// [`Family::source`] as `dialect` wants it: for WebGPU, a family that
    /// needs SUBGROUP starts with `enable subgroups;` (its files carry no
    /// directive, since naga refuses it).
    pub fn source_for(self, dialect: Dialect) -> std::borrow::Cow<'static, str> {
        let needs_subgroups = self.required_features().contains(wgpu::Features::SUBGROUP);
        match dialect {
            Dialect::WebGpu if needs_subgroups => format!("enable subgroups;\n{}", self.source()).into(),
            _ => self.source().into(),
        }
    }

    /// A lower-case name for files and reports (`matmul_subgroup`).
    pub fn name(self) -> &'static str {
        self.file_name().trim_end_matches(".wgsl")
    }
}

/// A WGSL entry point and the file it lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub family: Family,
    pub entry: &'static str,
}

const fn kernel(family: Family, entry: &'static str) -> Kernel {
    Kernel { family, entry }
}

pub const MATMUL_FORWARD_REGISTER: Kernel = kernel(Family::Matmul, "matmul_forward_register");
pub const MATMUL_FORWARD_SHARED: Kernel = kernel(Family::Matmul, "matmul_forward_shared");
pub const MATMUL_FORWARD_SHARED_VEC4: Kernel = kernel(Family::Matmul, "matmul_forward_shared_vec4");
pub const MATMUL_FORWARD_REGISTER_VEC4: Kernel = kernel(Family::Matmul, "matmul_forward_register_vec4");
pub const MATMUL_FORWARD_MATVEC: Kernel = kernel(Family::Matmul, "matmul_forward_matvec");
pub const MATMUL_FORWARD_SMALL: Kernel = kernel(Family::Matmul, "matmul_forward_small");

pub const ADD_FORWARD: Kernel = kernel(Family::Elementwise, "add_forward");
pub const SUB_FORWARD: Kernel = kernel(Family::Elementwise, "sub_forward");
pub const MUL_FORWARD: Kernel = kernel(Family::Elementwise, "mul_forward");
pub const DIV_FORWARD: Kernel = kernel(Family::Elementwise, "div_forward");
pub const SCALE_FORWARD: Kernel = kernel(Family::Elementwise, "scale_forward");
pub const ADD_ASSIGN: Kernel = kernel(Family::Elementwise, "add_assign");
pub const COPY_VEC4: Kernel = kernel(Family::Elementwise, "copy_vec4");
pub const BIAS_ADD_FORWARD: Kernel = kernel(Family::Elementwise, "bias_add_forward");
pub const RELU_FORWARD: Kernel = kernel(Family::Elementwise, "relu_forward");
pub const RELU_BACKWARD: Kernel = kernel(Family::Elementwise, "relu_backward");
pub const GELU_FORWARD: Kernel = kernel(Family::Elementwise, "gelu_forward");
pub const GELU_BACKWARD: Kernel = kernel(Family::Elementwise, "gelu_backward");
pub const SIGMOID_FORWARD: Kernel = kernel(Family::Elementwise, "sigmoid_forward");
pub const SIGMOID_BACKWARD: Kernel = kernel(Family::Elementwise, "sigmoid_backward");
pub const TANH_FORWARD: Kernel = kernel(Family::Elementwise, "tanh_forward");
pub const TANH_BACKWARD: Kernel = kernel(Family::Elementwise, "tanh_backward");
pub const SILU_FORWARD: Kernel = kernel(Family::Elementwise, "silu_forward");
pub const SILU_BACKWARD: Kernel = kernel(Family::Elementwise, "silu_backward");

pub const SUM_ROWS_FORWARD: Kernel = kernel(Family::Reduce, "sum_rows_forward");
pub const SUM_ROWS_PARTIAL: Kernel = kernel(Family::Reduce, "sum_rows_partial");
pub const SUM_FORWARD: Kernel = kernel(Family::Reduce, "sum_forward");
pub const MEAN_FORWARD: Kernel = kernel(Family::Reduce, "mean_forward");
pub const MAX_ROWS_FORWARD: Kernel = kernel(Family::Reduce, "max_rows_forward");
pub const ARGMAX_ROWS_FORWARD: Kernel = kernel(Family::Reduce, "argmax_rows_forward");

pub const MSE_FORWARD: Kernel = kernel(Family::Loss, "mse_forward");
pub const MSE_BACKWARD: Kernel = kernel(Family::Loss, "mse_backward");
pub const CROSS_ENTROPY_FORWARD: Kernel = kernel(Family::Loss, "cross_entropy_forward");
pub const CROSS_ENTROPY_BACKWARD: Kernel = kernel(Family::Loss, "cross_entropy_backward");
pub const MSE_FORWARD_BACKWARD: Kernel = kernel(Family::Loss, "mse_forward_backward");
pub const CROSS_ENTROPY_FORWARD_BACKWARD: Kernel = kernel(Family::Loss, "cross_entropy_forward_backward");
pub const MSE_LINEAR_FORWARD_BACKWARD: Kernel = kernel(Family::Loss, "mse_linear_forward_backward");
pub const CROSS_ENTROPY_LINEAR_FORWARD_BACKWARD: Kernel = kernel(Family::Loss, "cross_entropy_linear_forward_backward");
pub const MSE_PARTIAL: Kernel = kernel(Family::Loss, "mse_partial");
pub const CROSS_ENTROPY_PARTIAL: Kernel = kernel(Family::Loss, "cross_entropy_partial");
pub const LOSS_FINISH: Kernel = kernel(Family::Loss, "loss_finish");

pub const SGD_UPDATE: Kernel = kernel(Family::Optim, "sgd_update");
pub const ADAM_UPDATE: Kernel = kernel(Family::Optim, "adam_update");
pub const ADAMW_UPDATE: Kernel = kernel(Family::Optim, "adamw_update");
pub const GRAD_NORM_PARTIALS: Kernel = kernel(Family::Optim, "grad_norm_partials");
pub const GRAD_NORM_FINISH: Kernel = kernel(Family::Optim, "grad_norm_finish");

pub const MATMUL_F16_FORWARD: Kernel = kernel(Family::MatmulF16, "matmul_f16_forward");
pub const F32_TO_F16: Kernel = kernel(Family::MatmulF16, "f32_to_f16");
pub const F16_TO_F32: Kernel = kernel(Family::MatmulF16, "f16_to_f32");
pub const MATMUL_SUBGROUP_FORWARD: Kernel = kernel(Family::MatmulSubgroup, "matmul_subgroup_forward");

pub const SOFTMAX_FORWARD: Kernel = kernel(Family::Rowwise, "softmax_forward");
pub const SOFTMAX_BACKWARD: Kernel = kernel(Family::Rowwise, "softmax_backward");
pub const LAYERNORM_FORWARD: Kernel = kernel(Family::Rowwise, "layernorm_forward");
pub const LAYERNORM_BACKWARD: Kernel = kernel(Family::Rowwise, "layernorm_backward");
pub const SOFTMAX_FORWARD_SHORT: Kernel = kernel(Family::Rowwise, "softmax_forward_short");
pub const SOFTMAX_BACKWARD_SHORT: Kernel = kernel(Family::Rowwise, "softmax_backward_short");
pub const LAYERNORM_FORWARD_SHORT: Kernel = kernel(Family::Rowwise, "layernorm_forward_short");
pub const LAYERNORM_BACKWARD_SHORT: Kernel = kernel(Family::Rowwise, "layernorm_backward_short");
pub const CROSS_ENTROPY_ROWS_FORWARD_BACKWARD_SHORT: Kernel = kernel(Family::Rowwise, "cross_entropy_rows_forward_backward_short");
pub const RMSNORM_FORWARD: Kernel = kernel(Family::Rowwise, "rmsnorm_forward");
pub const RMSNORM_BACKWARD: Kernel = kernel(Family::Rowwise, "rmsnorm_backward");
pub const RMSNORM_FORWARD_SHORT: Kernel = kernel(Family::Rowwise, "rmsnorm_forward_short");
pub const RMSNORM_BACKWARD_SHORT: Kernel = kernel(Family::Rowwise, "rmsnorm_backward_short");
pub const LAYERNORM_BACKWARD_PARAMS: Kernel = kernel(Family::Rowwise, "layernorm_backward_params");
pub const LAYERNORM_BACKWARD_PARAMS_PARTIAL: Kernel = kernel(Family::Rowwise, "layernorm_backward_params_partial");
pub const LAYERNORM_BACKWARD_PARAMS_FINISH: Kernel = kernel(Family::Rowwise, "layernorm_backward_params_finish");
pub const CROSS_ENTROPY_ROWS_FORWARD_BACKWARD: Kernel = kernel(Family::Rowwise, "cross_entropy_rows_forward_backward");
pub const EMBEDDING_FORWARD: Kernel = kernel(Family::Rowwise, "embedding_forward");
pub const EMBEDDING_BACKWARD_SORT: Kernel = kernel(Family::Rowwise, "embedding_backward_sort");
pub const EMBEDDING_BACKWARD: Kernel = kernel(Family::Rowwise, "embedding_backward");

pub const BINARY_BROADCAST_FORWARD: Kernel = kernel(Family::Tensor, "binary_broadcast_forward");
pub const UNARY_FORWARD: Kernel = kernel(Family::Tensor, "unary_forward");
pub const REDUCE_TO_SHAPE_FORWARD: Kernel = kernel(Family::Tensor, "reduce_to_shape_forward");
pub const REDUCE_TO_SHAPE_PARTIAL: Kernel = kernel(Family::Tensor, "reduce_to_shape_partial");
pub const PERMUTE_FORWARD: Kernel = kernel(Family::Tensor, "permute_forward");
pub const SLICE_LAST_FORWARD: Kernel = kernel(Family::Tensor, "slice_last_forward");
pub const PAD_LAST_FORWARD: Kernel = kernel(Family::Tensor, "pad_last_forward");
pub const CONCAT_LAST_FORWARD: Kernel = kernel(Family::Tensor, "concat_last_forward");

pub const CACHED_ATTENTION_FORWARD: Kernel = kernel(Family::Attention, "cached_attention_forward");
pub const CACHED_ATTENTION_FORWARD_WORKGROUP: Kernel = kernel(Family::Attention, "cached_attention_forward_workgroup");

pub const SAMPLE_ROWS_FORWARD: Kernel = kernel(Family::Sampling, "sample_rows_forward");
pub const MATVEC_F16W_FORWARD: Kernel = kernel(Family::F16Weights, "matvec_f16w_forward");
pub const MATMUL_F16W_FORWARD_SMALL: Kernel = kernel(Family::F16Weights, "matmul_f16w_forward_small");
pub const MATMUL_F16W_FORWARD_REGISTER: Kernel = kernel(Family::F16Weights, "matmul_f16w_forward_register");
pub const MATMUL_F16W_FORWARD_SHARED: Kernel = kernel(Family::F16Weights, "matmul_f16w_forward_shared");
pub const MATMUL_F16W_FORWARD_SHARED_VEC: Kernel = kernel(Family::F16Weights, "matmul_f16w_forward_shared_vec");
pub const EMBEDDING_F16W_FORWARD: Kernel = kernel(Family::F16Weights, "embedding_f16w_forward");
pub const ROPE_FORWARD: Kernel = kernel(Family::Rope, "rope_forward");
pub const ROPE_BACKWARD: Kernel = kernel(Family::Rope, "rope_backward");

/// Every entry point wgrad dispatches.
pub const KERNELS: &[Kernel] = &[
    MATMUL_FORWARD_REGISTER,
    MATMUL_FORWARD_SHARED,
    MATMUL_FORWARD_SHARED_VEC4,
    MATMUL_FORWARD_REGISTER_VEC4,
    MATMUL_FORWARD_MATVEC,
    MATMUL_FORWARD_SMALL,
    ADD_FORWARD,
    SUB_FORWARD,
    MUL_FORWARD,
    DIV_FORWARD,
    SCALE_FORWARD,
    ADD_ASSIGN,
    COPY_VEC4,
    BIAS_ADD_FORWARD,
    RELU_FORWARD,
    RELU_BACKWARD,
    GELU_FORWARD,
    GELU_BACKWARD,
    SIGMOID_FORWARD,
    SIGMOID_BACKWARD,
    TANH_FORWARD,
    TANH_BACKWARD,
    SILU_FORWARD,
    SILU_BACKWARD,
    SUM_ROWS_FORWARD,
    SUM_ROWS_PARTIAL,
    SUM_FORWARD,
    MEAN_FORWARD,
    MAX_ROWS_FORWARD,
    ARGMAX_ROWS_FORWARD,
    MSE_FORWARD,
    MSE_BACKWARD,
    CROSS_ENTROPY_FORWARD,
    CROSS_ENTROPY_BACKWARD,
    MSE_FORWARD_BACKWARD,
    CROSS_ENTROPY_FORWARD_BACKWARD,
    MSE_LINEAR_FORWARD_BACKWARD,
    CROSS_ENTROPY_LINEAR_FORWARD_BACKWARD,
    MSE_PARTIAL,
    CROSS_ENTROPY_PARTIAL,
    LOSS_FINISH,
    SGD_UPDATE,
    ADAM_UPDATE,
    ADAMW_UPDATE,
    GRAD_NORM_PARTIALS,
    GRAD_NORM_FINISH,
    MATMUL_F16_FORWARD,
    F32_TO_F16,
    F16_TO_F32,
    MATMUL_SUBGROUP_FORWARD,
    SOFTMAX_FORWARD,
    SOFTMAX_BACKWARD,
    LAYERNORM_FORWARD,
    LAYERNORM_BACKWARD,
    LAYERNORM_BACKWARD_PARAMS,
    LAYERNORM_BACKWARD_PARAMS_PARTIAL,
    LAYERNORM_BACKWARD_PARAMS_FINISH,
    CROSS_ENTROPY_ROWS_FORWARD_BACKWARD,
    SOFTMAX_FORWARD_SHORT,
    SOFTMAX_BACKWARD_SHORT,
    LAYERNORM_FORWARD_SHORT,
    LAYERNORM_BACKWARD_SHORT,
    CROSS_ENTROPY_ROWS_FORWARD_BACKWARD_SHORT,
    RMSNORM_FORWARD,
    RMSNORM_BACKWARD,
    RMSNORM_FORWARD_SHORT,
    RMSNORM_BACKWARD_SHORT,
    EMBEDDING_FORWARD,
    EMBEDDING_BACKWARD_SORT,
    EMBEDDING_BACKWARD,
    BINARY_BROADCAST_FORWARD,
    UNARY_FORWARD,
    REDUCE_TO_SHAPE_FORWARD,
    REDUCE_TO_SHAPE_PARTIAL,
    PERMUTE_FORWARD,
    SLICE_LAST_FORWARD,
    PAD_LAST_FORWARD,
    CONCAT_LAST_FORWARD,
    CACHED_ATTENTION_FORWARD,
    CACHED_ATTENTION_FORWARD_WORKGROUP,
    SAMPLE_ROWS_FORWARD,
    MATVEC_F16W_FORWARD,
    MATMUL_F16W_FORWARD_SMALL,
    MATMUL_F16W_FORWARD_REGISTER,
    MATMUL_F16W_FORWARD_SHARED,
    MATMUL_F16W_FORWARD_SHARED_VEC,
    EMBEDDING_F16W_FORWARD,
    ROPE_FORWARD,
    ROPE_BACKWARD,
];
