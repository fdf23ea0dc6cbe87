//! The kernel sources and the table of entry points. A new WGSL entry is
//! one line in the `entry_points!` block of the Rust file that dispatches
//! it (src/kernels/<family>.rs); [`KERNELS`] gathers every file's, and
//! tests/suite/shaders.rs checks the table against the WGSL files. A new
//! family is a [`Family`] variant with its arms below, and its Rust file in
//! `kernel_files!`.
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
    /// reduction, for matmul.wgsl's f32, f16_weights.wgsl's f16 and
    /// quant_weights.wgsl's block-quantized weights.
    Matvec,
    /// The tiled forward kernels' row multiply-adds and masked row stores
    /// (through each family's `write_c`), for matmul.wgsl, f16_weights.wgsl,
    /// matmul_f16.wgsl and quant_weights.wgsl.
    MatmulRows,
    /// The workgroup-memory tiled kernels' staging, multiply-adds and
    /// stores (the GPU layout), for matmul.wgsl and f16_weights.wgsl.
    MatmulTiles,
    /// The register-blocked kernel's 32×16 block (through each family's
    /// `load_a`, `load_b` and matmul_rows.wgsl's stores), for matmul.wgsl
    /// and matmul_f16.wgsl.
    MatmulRegister,
}

impl Shared {
    pub const ALL: [Shared; 6] = [
        Shared::Common,
        Shared::Activations,
        Shared::Matvec,
        Shared::MatmulRows,
        Shared::MatmulTiles,
        Shared::MatmulRegister,
    ];

    pub fn file_name(self) -> &'static str {
        match self {
            Shared::Common => "common.wgsl",
            Shared::Activations => "activations.wgsl",
            Shared::Matvec => "matvec.wgsl",
            Shared::MatmulRows => "matmul_rows.wgsl",
            Shared::MatmulTiles => "matmul_tiles.wgsl",
            Shared::MatmulRegister => "matmul_register.wgsl",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Shared::Common => wgsl!("common.wgsl"),
            Shared::Activations => wgsl!("activations.wgsl"),
            Shared::Matvec => wgsl!("matvec.wgsl"),
            Shared::MatmulRows => wgsl!("matmul_rows.wgsl"),
            Shared::MatmulTiles => wgsl!("matmul_tiles.wgsl"),
            Shared::MatmulRegister => wgsl!("matmul_register.wgsl"),
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
    /// Generation with block-quantized weights (Q8_0, Q4_0, Q4_1) decoded
    /// in the kernels, f32 activations: matrix-vector, matmul and
    /// embedding lookup. Core WGSL only.
    QuantWeights,
    /// Fused causal self-attention (FlashAttention-2), forward and
    /// backward: tiles of rows in workgroup memory, one row per invocation.
    FlashAttention,
    /// Needs SUBGROUP with 8-lane subgroups: the quantized rows kernel
    /// sharing A by broadcasts. Its source is the quant_weights family's
    /// followed by quant_weights_subgroup.wgsl (see [`Family::base`]).
    QuantWeightsSubgroup,
    /// Many LoRA adapters over one base, each row of a batch applying its
    /// sequence's (generation): the gathered shrink and expand.
    Lora,
}

impl Family {
    pub const ALL: [Family; 17] = [
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
        Family::QuantWeights,
        Family::FlashAttention,
        Family::QuantWeightsSubgroup,
        Family::Lora,
    ];

    /// Device features the file needs to compile at all; its typed entries
    /// check them first and return `Error::Unsupported` without them.
    pub fn required_features(self) -> wgpu::Features {
        match self {
            Family::MatmulF16 | Family::F16Weights => wgpu::Features::SHADER_F16,
            Family::MatmulSubgroup | Family::QuantWeightsSubgroup => wgpu::Features::SUBGROUP,
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
            Family::QuantWeightsSubgroup => Some(Family::QuantWeights),
            _ => None,
        }
    }

    /// The shared files this family's source adds after its own file
    /// (module-scope WGSL may be declared in any order, and a file's
    /// `enable` directive must stay first). A family with a base has them
    /// through the base.
    pub fn shared(self) -> &'static [Shared] {
        match self {
            Family::Matmul => &[
                Shared::Activations,
                Shared::Matvec,
                Shared::MatmulRows,
                Shared::MatmulTiles,
                Shared::MatmulRegister,
            ],
            Family::Elementwise => &[Shared::Common, Shared::Activations],
            Family::Reduce | Family::Loss | Family::Optim | Family::Rowwise | Family::Tensor | Family::Attention => {
                &[Shared::Common]
            }
            Family::Sampling | Family::Rope | Family::FlashAttention => &[Shared::Common],
            Family::MatmulF16 => &[Shared::Common, Shared::MatmulRows, Shared::MatmulRegister],
            Family::MatmulSubgroup | Family::QuantWeightsSubgroup | Family::Lora => &[],
            Family::F16Weights => &[
                Shared::Common,
                Shared::Activations,
                Shared::Matvec,
                Shared::MatmulRows,
                Shared::MatmulTiles,
            ],
            Family::QuantWeights => &[Shared::Common, Shared::Activations, Shared::Matvec, Shared::MatmulRows],
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
            Family::QuantWeights => "quant_weights.wgsl",
            Family::FlashAttention => "flash_attention.wgsl",
            Family::QuantWeightsSubgroup => "quant_weights_subgroup.wgsl",
            Family::Lora => "lora.wgsl",
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
            Family::QuantWeights => wgsl!("quant_weights.wgsl"),
            Family::FlashAttention => wgsl!("flash_attention.wgsl"),
            Family::QuantWeightsSubgroup => wgsl!("quant_weights_subgroup.wgsl"),
            Family::Lora => wgsl!("lora.wgsl"),
        }
    }

    /// The module compiled for this family: the base family's source (if
    /// any), then its own file, then its [`Family::shared`] files. Keep in
    /// step with `base` and `shared`; tests/suite/shaders.rs checks it.
    pub fn source(self) -> &'static str {
        match self {
            Family::Matmul => wgsl!(
                "matmul.wgsl",
                "activations.wgsl",
                "matvec.wgsl",
                "matmul_rows.wgsl",
                "matmul_tiles.wgsl",
                "matmul_register.wgsl"
            ),
            Family::Elementwise => wgsl!("elementwise.wgsl", "common.wgsl", "activations.wgsl"),
            Family::Reduce => wgsl!("reduce.wgsl", "common.wgsl"),
            Family::Loss => wgsl!("loss.wgsl", "common.wgsl"),
            Family::Optim => wgsl!("optim.wgsl", "common.wgsl"),
            Family::MatmulF16 => wgsl!(
                "matmul_f16.wgsl",
                "common.wgsl",
                "matmul_rows.wgsl",
                "matmul_register.wgsl"
            ),
            Family::MatmulSubgroup => wgsl!(
                "matmul.wgsl",
                "activations.wgsl",
                "matvec.wgsl",
                "matmul_rows.wgsl",
                "matmul_tiles.wgsl",
                "matmul_register.wgsl",
                "matmul_subgroup.wgsl"
            ),
            Family::Rowwise => wgsl!("rowwise.wgsl", "common.wgsl"),
            Family::Tensor => wgsl!("tensor.wgsl", "common.wgsl"),
            Family::Attention => wgsl!("attention.wgsl", "common.wgsl"),
            Family::Sampling => wgsl!("sampling.wgsl", "common.wgsl"),
            Family::F16Weights => wgsl!(
                "f16_weights.wgsl",
                "common.wgsl",
                "activations.wgsl",
                "matvec.wgsl",
                "matmul_rows.wgsl",
                "matmul_tiles.wgsl"
            ),
            Family::Rope => wgsl!("rope.wgsl", "common.wgsl"),
            Family::QuantWeights => wgsl!(
                "quant_weights.wgsl",
                "common.wgsl",
                "activations.wgsl",
                "matvec.wgsl",
                "matmul_rows.wgsl"
            ),
            Family::FlashAttention => wgsl!("flash_attention.wgsl", "common.wgsl"),
            Family::QuantWeightsSubgroup => wgsl!(
                "quant_weights.wgsl",
                "common.wgsl",
                "activations.wgsl",
                "matvec.wgsl",
                "matmul_rows.wgsl",
                "quant_weights_subgroup.wgsl"
            ),
            Family::Lora => wgsl!("lora.wgsl"),
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

/// Declares a kernel file's WGSL entry points, grouped by family: a public
/// `Kernel` const per entry (in the file's `entries` module, re-exported
/// here as `registry::NAME` and used by the file's typed entries), and
/// the file's list, `ENTRY_POINTS`, which [`KERNELS`] concatenates. So a
/// new entry point is one line, in the file that dispatches it.
macro_rules! entry_points {
    ($($family:ident { $($name:ident = $entry:literal,)+ })+) => {
        /// This file's WGSL entry points.
        pub mod entries {
            use $crate::kernels::registry::{Family, Kernel};
            $($(pub const $name: Kernel = Kernel { family: Family::$family, entry: $entry };)+)+
        }
        use entries::*;
        /// This file's entry points, listed in `registry::KERNELS`.
        pub(super) const ENTRY_POINTS: &[$crate::kernels::registry::Kernel] = &[$($(entries::$name,)+)+];
    };
}
pub(super) use entry_points;

/// The kernel files (under src/kernels/) whose `entry_points!` declare
/// every entry wgrad dispatches: their constants re-exported here, and
/// their lists concatenated, in this order, into [`KERNELS`].
macro_rules! kernel_files {
    ($($file:ident),+ $(,)?) => {
        $(pub use super::$file::entries::*;)+
        const PER_FILE: &[&[Kernel]] = &[$(super::$file::ENTRY_POINTS),+];
    };
}

kernel_files!(
    matmul,
    elementwise,
    reduce,
    loss,
    optim,
    matmul_ext,
    rowwise,
    tensor,
    attention,
    sampling,
    f16_weights,
    rope,
    quant_weights,
    flash_attention,
    lora
);

const fn total_len(lists: &[&[Kernel]]) -> usize {
    let (mut total, mut i) = (0, 0);
    while i < lists.len() {
        total += lists[i].len();
        i += 1;
    }
    total
}

/// The lists one after another (const: `KERNELS` stays a `&'static` slice).
const fn concat<const N: usize>(lists: &[&[Kernel]]) -> [Kernel; N] {
    let mut all = [Kernel {
        family: Family::Matmul,
        entry: "",
    }; N];
    let (mut n, mut i) = (0, 0);
    while i < lists.len() {
        let mut j = 0;
        while j < lists[i].len() {
            all[n] = lists[i][j];
            n += 1;
            j += 1;
        }
        i += 1;
    }
    all
}

const ALL: [Kernel; total_len(PER_FILE)] = concat(PER_FILE);

/// Every entry point wgrad dispatches.
pub const KERNELS: &[Kernel] = &ALL;
