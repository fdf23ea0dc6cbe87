//! `wgrad shaders --dump DIR`'s cases: one or more per entry point of
//! `wgrad::kernels::KERNELS`, each built through the typed entry wgrad
//! dispatches it from (so bindings, uniform block and override constants are
//! exactly wgrad's), with its inputs read back from the native device before
//! anything runs and the expected outputs from the CPU twins (`wgrad::cpu`).
//! `scripts/webgpu/` replays them in a browser's WebGPU and compares.
//!
//! Lives in the CLI because the library must not call the twins.
//!
//! Files: `DIR/cases.json` (the list, described in `write_cases`) and
//! `DIR/cases/NAME.bin` per case (its buffers' initial bytes, each launch's
//! uniform block, the expected values), referenced by byte ranges.

use std::path::Path;

use half::f16;
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use wgrad::kernels::{
    reflect, Activation, AdamConfig, Binary, CachedAttentionShape, Dispatch, F16WeightsKernel, Family,
    FlashAttentionShape, LossLinear, LossTargets, MatmulEpilogue, MatmulForm, MatmulVariant, OptimizerConfig,
    QkvLayout, QuantFormat, QuantView, QuantWeightsKernel, RopeLayout, RopeShape, SgdConfig, Unary, KERNELS,
    SUBGROUP_MATMUL_LANES,
};
use wgrad::kernels::{DropoutMask, MatmulKernel, MatmulOperand, MatmulRequest};
use wgrad::{cpu, Error, GpuTensor, Kernels, Result};

/// Expected values of one output as the browser compares them.
enum Values {
    F32(Vec<f32>),
    U32(Vec<u32>),
    /// f16 values packed two per word on the GPU; the expected values
    /// widened to f32 here.
    F16(Vec<f32>),
}

impl Values {
    fn dtype(&self) -> &'static str {
        match self {
            Values::F32(_) => "f32",
            Values::U32(_) => "u32",
            Values::F16(_) => "f16",
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Values::F32(v) | Values::F16(v) => bytemuck::cast_slice(v).to_vec(),
            Values::U32(v) => bytemuck::cast_slice(v).to_vec(),
        }
    }
}

/// One output of a case: a range of a bound buffer and what it must hold,
/// within `atol + rtol·|want|` per element (or, with `sum`, the range's sum
/// against the one value).
struct Expect {
    name: &'static str,
    buffer: wgpu::Buffer,
    offset: u64,
    /// Elements of the GPU range: the values' count, or what is summed.
    elements: usize,
    values: Values,
    atol: f64,
    rtol: f64,
    sum: bool,
    /// Where the values come from when it is not plainly the twin.
    source: &'static str,
}

fn expect(name: &'static str, t: &GpuTensor, values: Vec<f32>, atol: f64, rtol: f64) -> Expect {
    Expect {
        name,
        buffer: t.buffer().clone(),
        offset: 0,
        elements: values.len(),
        values: Values::F32(values),
        atol,
        rtol,
        sum: false,
        source: "",
    }
}

fn expect_u32(name: &'static str, t: &GpuTensor, values: Vec<u32>) -> Expect {
    Expect {
        name,
        buffer: t.buffer().clone(),
        offset: 0,
        elements: values.len(),
        values: Values::U32(values),
        atol: 0.0,
        rtol: 0.0,
        sum: false,
        source: "",
    }
}

/// A case as built: its launches (in order), outputs and the writable
/// bindings it leaves unchecked (scratch between launches) with why.
struct Case {
    name: String,
    /// The entry points this case is the representative of.
    entries: Vec<&'static str>,
    note: String,
    dispatches: Vec<Dispatch>,
    expected: Vec<Expect>,
    scratch: Vec<(&'static str, &'static str)>,
    /// The kernels that built it.
    on: On,
}

/// Which kernels a case is built with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum On {
    /// WebGPU's default limits: what a browser gives a page that asks for
    /// nothing more.
    Web,
    /// The adapter's limits, for the entries over WebGPU's defaults.
    Full,
    /// WebGPU's defaults with storage bindings lowered to [`SPLIT_BINDING`]
    /// bytes, so an op splits its operands over several launches, each
    /// binding an aligned part of a buffer, as one over 128 MiB does.
    Split,
    /// WebGPU's defaults with the kernels shaped for a GPU
    /// (`LimitOverrides::gpu_shaping`): the two-stage column sums and
    /// losses, the workgroup attention, the tiled f16-weight matmul.
    Gpu,
}

/// The storage binding size of [`On::Split`].
pub const SPLIT_BINDING: u64 = 4096;

impl Case {
    fn new(
        entries: &[&'static str],
        name: impl Into<String>,
        dispatches: Vec<Dispatch>,
        expected: Vec<Expect>,
    ) -> Case {
        Case {
            name: name.into(),
            entries: entries.to_vec(),
            note: String::new(),
            dispatches,
            expected,
            scratch: Vec::new(),
            on: On::Web,
        }
    }

    fn note(mut self, note: &str) -> Case {
        self.note = note.to_string();
        self
    }
}

/// What a case is built from: the kernels (WebGPU's default limits, or the
/// adapter's for the entries over them) and a seeded generator.
struct Ctx<'k> {
    k: &'k Kernels,
    rng: ChaCha8Rng,
}

impl Ctx<'_> {
    fn vals(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    /// Values with no two equal, for the kernels whose result picks one of
    /// them (max, argmax, sampling): equal values would make the pick depend
    /// on tie-breaking the twin and the kernel need not share.
    fn distinct(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        // A shuffled grid: n different values by construction.
        let mut grid: Vec<f32> = (0..n).map(|i| lo + (hi - lo) * (i as f32 + 0.5) / n as f32).collect();
        for i in (1..n).rev() {
            grid.swap(i, self.rng.random_range(0..=i));
        }
        grid
    }

    fn ids(&mut self, n: usize, below: u32) -> Vec<u32> {
        (0..n).map(|_| self.rng.random_range(0..below)).collect()
    }

    fn up(&self, v: &[f32]) -> Result<GpuTensor> {
        self.k.upload(v)
    }

    fn up_u32(&self, v: &[u32]) -> Result<GpuTensor> {
        self.k.upload(v)
    }
}

// Tolerances, |gpu − twin| ≤ atol + rtol·|twin|, against twins that
// accumulate in f64. The browser's WGSL may be less exact than lavapipe's:
// exp, tanh and division have ULP bounds (exp: 3 + 2|x| ULP), not exactness.
/// Exact operations (copies, sums of two values, picks).
const EXACT: (f64, f64) = (0.0, 0.0);
/// One f32 rounding or a division (2.5 ULP).
const ROUNDING: (f64, f64) = (1e-7, 1e-6);
/// Transcendentals of |x| ≤ 4 (exp, tanh): up to ~11 ULP, and absolute
/// error where tanh(x) comes from exp and cancels near 0.
const TRANSCENDENTAL: (f64, f64) = (1e-6, 2e-5);
/// f32 sums of up to a few hundred terms of magnitude ≤ ~4.
const SUMS: (f64, f64) = (2e-5, 2e-5);

fn f16s(v: &[f32]) -> Vec<f16> {
    cpu::to_f16(v)
}

/// A built case, or, where the adapter cannot build it (no SHADER_F16, no
/// 8-lane subgroups), the entries it covers and why.
type Planned = std::result::Result<Case, (Vec<&'static str>, String)>;

type Builder = fn(&mut Ctx<'_>) -> Result<Case>;

/// Every case: (entries covered, the kernels to build with, builder).
/// `tests/suite/webgpu.rs` reads this table's entries from the source.
const BUILDERS: &[(&[&str], On, Builder)] = {
    use On::{Full, Gpu, Split, Web};
    &[
        (&["matmul_forward_register"], Web, matmul_register),
        (&["matmul_forward_shared"], Web, matmul_shared),
        (&["matmul_forward_shared_vec4"], Web, matmul_shared_vec4),
        (&["matmul_forward_register_vec4"], Web, matmul_vec4),
        (&["matmul_forward_matvec"], Web, |c| matmul_matvec(c, None)),
        (&["matmul_forward_matvec"], Web, |c| matmul_matvec(c, Some(64))),
        (&["matmul_forward_small"], Web, matmul_small_epilogue),
        (&["matmul_forward_small"], Web, matmul_small_batched),
        (&["matmul_forward_small"], Split, matmul_split),
        (&["add_forward"], Web, |c| binary(c, Binary::Add)),
        (&["add_forward"], Web, arena_add),
        (&["sub_forward"], Web, |c| binary(c, Binary::Sub)),
        (&["mul_forward"], Web, |c| binary(c, Binary::Mul)),
        (&["div_forward"], Web, |c| binary(c, Binary::Div)),
        (&["scale_forward"], Web, scale),
        (&["add_assign"], Web, add_assign),
        (&["dropout_forward"], Web, dropout),
        (&["copy_vec4"], Web, copy_vec4),
        (&["bias_add_forward"], Web, bias_add),
        (&["relu_forward"], Web, |c| activation(c, Activation::Relu, false)),
        (&["relu_backward"], Web, |c| activation(c, Activation::Relu, true)),
        (&["gelu_forward"], Web, |c| activation(c, Activation::Gelu, false)),
        (&["gelu_backward"], Web, |c| activation(c, Activation::Gelu, true)),
        (&["sigmoid_forward"], Web, |c| activation(c, Activation::Sigmoid, false)),
        (&["sigmoid_backward"], Web, |c| activation(c, Activation::Sigmoid, true)),
        (&["tanh_forward"], Web, |c| activation(c, Activation::Tanh, false)),
        (&["tanh_backward"], Web, |c| activation(c, Activation::Tanh, true)),
        (&["silu_forward"], Web, |c| activation(c, Activation::Silu, false)),
        (&["silu_backward"], Web, |c| activation(c, Activation::Silu, true)),
        // 70 columns: two 64-wide column workgroups; 301 rows: two stages
        // on a GPU.
        (&["sum_rows_forward"], Web, |c| sum_rows(c, 37, 70)),
        (&["sum_rows_partial", "sum_rows_forward"], Gpu, |c| sum_rows(c, 301, 70)),
        (&["sum_forward"], Web, |c| whole_sum(c, false)),
        (&["mean_forward"], Web, |c| whole_sum(c, true)),
        (&["max_rows_forward"], Web, max_rows),
        (&["argmax_rows_forward"], Web, argmax_rows),
        (&["mse_forward"], Web, |c| mse_forward(c, 307)),
        (&["mse_partial", "loss_finish"], Gpu, |c| mse_forward(c, 5003)),
        (&["cross_entropy_partial", "loss_finish"], Gpu, |c| {
            ce_forward(c, 301, 11)
        }),
        (&["mse_backward"], Web, mse_backward),
        (&["cross_entropy_forward"], Web, |c| ce_forward(c, 13, 11)),
        (&["cross_entropy_backward"], Web, ce_backward),
        (&["mse_forward_backward"], Web, |c| fused_loss(c, false, false)),
        (&["cross_entropy_forward_backward"], Web, |c| fused_loss(c, true, false)),
        (&["mse_linear_forward_backward"], Full, |c| fused_loss(c, false, true)),
        (&["cross_entropy_linear_forward_backward"], Full, |c| {
            fused_loss(c, true, true)
        }),
        (&["sgd_update"], Web, sgd),
        (&["adam_update"], Web, adam),
        (
            &["grad_norm_partials", "grad_norm_finish", "adamw_update"],
            Web,
            clipped_adamw,
        ),
        (
            &["loss_scale_partials", "loss_scale_finish", "adamw_update"],
            Web,
            loss_scaled_adamw,
        ),
        (&["matmul_f16_forward"], Web, matmul_f16),
        (&["f32_to_f16"], Web, to_f16),
        (&["f16_to_f32"], Web, from_f16),
        (&["matmul_subgroup_forward"], Web, matmul_subgroup),
        (&["softmax_forward"], Web, |c| softmax(c, false)),
        (&["softmax_backward"], Web, |c| softmax_backward(c, false)),
        (&["layernorm_forward"], Web, |c| layernorm(c, false)),
        (&["layernorm_backward"], Web, |c| layernorm_backward(c, false)),
        (&["layernorm_backward_params"], Web, |c| layernorm_params(c, 37, 70)),
        (
            &["layernorm_backward_params_partial", "layernorm_backward_params_finish"],
            Gpu,
            |c| layernorm_params(c, 301, 70),
        ),
        (&["cross_entropy_rows_forward_backward"], Web, |c| ce_rows(c, false)),
        (&["rmsnorm_forward"], Web, |c| rmsnorm(c, false)),
        (&["rmsnorm_backward"], Web, |c| rmsnorm_backward(c, false)),
        (&["rmsnorm_forward_short"], Web, |c| rmsnorm(c, true)),
        (&["rmsnorm_backward_short"], Web, |c| rmsnorm_backward(c, true)),
        (&["layernorm_backward_params"], Web, |c| rmsnorm_params(c, 37, 70)),
        (
            &["layernorm_backward_params_partial", "layernorm_backward_params_finish"],
            Gpu,
            |c| rmsnorm_params(c, 301, 70),
        ),
        (&["softmax_forward_short"], Web, |c| softmax(c, true)),
        (&["softmax_backward_short"], Web, |c| softmax_backward(c, true)),
        (&["layernorm_forward_short"], Web, |c| layernorm(c, true)),
        (&["layernorm_backward_short"], Web, |c| layernorm_backward(c, true)),
        (&["cross_entropy_rows_forward_backward_short"], Web, |c| {
            ce_rows(c, true)
        }),
        (&["embedding_forward"], Web, embedding),
        (&["embedding_forward"], Split, embedding_split),
        (
            &["embedding_backward_sort", "embedding_backward"],
            Web,
            embedding_backward,
        ),
        (&["binary_broadcast_forward"], Web, binary_broadcast),
        (&["unary_forward"], Web, unary),
        (&["reduce_to_shape_forward"], Web, |c| {
            reduce_to_shape(c, &[2, 3, 5, 7], &[3, 1, 7])
        }),
        (&["reduce_to_shape_partial"], Gpu, |c| {
            reduce_to_shape(c, &[2, 151, 7], &[7])
        }),
        (&["permute_forward"], Web, permute),
        (&["slice_last_forward"], Web, slice_last),
        (&["pad_last_forward"], Web, pad_last),
        (&["concat_last_forward"], Web, concat_last),
        (&["cached_attention_forward"], Web, attention),
        (&["cached_attention_forward_workgroup"], Gpu, attention),
        (&["cached_attention_forward_grouped"], Web, grouped_attention),
        (&["cached_attention_forward_channels"], Web, channel_attention),
        (&["sample_rows_forward"], Web, sample_rows),
        (&["matvec_f16w_forward"], Web, |c| f16_weights(c, None)),
        (&["matvec_f16w_forward"], Web, |c| {
            f16_weights(c, Some(F16WeightsKernel::Matvec { lanes: 64 }))
        }),
        (&["matmul_f16w_forward_small"], Web, |c| {
            f16_weights(c, Some(F16WeightsKernel::Small))
        }),
        (&["matmul_f16w_forward_register"], Web, |c| {
            f16_weights(c, Some(F16WeightsKernel::Register))
        }),
        (&["matmul_f16w_forward_shared"], Gpu, |c| {
            f16_weights(c, Some(F16WeightsKernel::Shared))
        }),
        (&["matmul_f16w_forward_shared_vec"], Gpu, f16_weights_shared_vec),
        (&["embedding_f16w_forward"], Web, embedding_f16),
        (&["matvec_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q4_1, Some(QuantWeightsKernel::Matvec { lanes: 8 }))
        }),
        (&["matvec_quant_forward_columns"], Web, |c| {
            quant_weights(c, QuantFormat::Q4_1, Some(QuantWeightsKernel::MatvecColumns))
        }),
        (&["matvec_quant_forward_rows"], Web, |c| {
            quant_weights(c, QuantFormat::Q4_0, Some(QuantWeightsKernel::MatvecRows))
        }),
        (&["matvec_quant_forward_rows_subgroup"], Web, |c| {
            quant_weights(c, QuantFormat::Q8_0, Some(QuantWeightsKernel::MatvecRowsSubgroup))
        }),
        (&["matvec_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q8_0, Some(QuantWeightsKernel::Matvec { lanes: 64 }))
        }),
        (&["matmul_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q4_0, Some(QuantWeightsKernel::Tiled))
        }),
        (&["embedding_quant_forward"], Web, |c| {
            embedding_quant(c, QuantFormat::Q4_1)
        }),
        // The formats after Q4_1, each on some kernel (they share every
        // kernel's code but the block decoding).
        (&["matvec_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q4_K, Some(QuantWeightsKernel::Matvec { lanes: 8 }))
        }),
        (&["matvec_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q5_1, Some(QuantWeightsKernel::Matvec { lanes: 64 }))
        }),
        (&["matvec_quant_forward_columns"], Web, |c| {
            quant_weights(c, QuantFormat::Q6_K, Some(QuantWeightsKernel::MatvecColumns))
        }),
        (&["matvec_quant_forward_columns"], Web, |c| {
            quant_weights(c, QuantFormat::IQ4_NL, Some(QuantWeightsKernel::MatvecColumns))
        }),
        (&["matvec_quant_forward_rows"], Web, |c| {
            quant_weights(c, QuantFormat::Q5_K, Some(QuantWeightsKernel::MatvecRows))
        }),
        (&["matvec_quant_forward_rows_subgroup"], Web, |c| {
            quant_weights(c, QuantFormat::Q3_K, Some(QuantWeightsKernel::MatvecRowsSubgroup))
        }),
        (&["matmul_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q2_K, Some(QuantWeightsKernel::Tiled))
        }),
        (&["matmul_quant_forward"], Web, |c| {
            quant_weights(c, QuantFormat::Q5_0, Some(QuantWeightsKernel::Tiled))
        }),
        (&["embedding_quant_forward"], Web, |c| {
            embedding_quant(c, QuantFormat::Q4_K)
        }),
        (&["matmul_quant_transposed"], Web, |c| {
            quant_transposed(c, QuantFormat::Q4_1)
        }),
        (&["matmul_quant_transposed"], Web, |c| {
            quant_transposed(c, QuantFormat::Q6_K)
        }),
        (&["embedding_quant_forward"], Web, |c| {
            embedding_quant(c, QuantFormat::Q6_K)
        }),
        (&["rope_forward"], Web, |c| rope(c, RopeLayout::Interleaved, false)),
        (&["rope_backward"], Web, |c| rope(c, RopeLayout::HalfSplit, true)),
        (&["lora_shrink", "lora_expand"], Web, lora),
        (&["lora_shrink", "lora_expand"], Gpu, lora),
        (
            &[
                "flash_attention_forward_rows",
                "flash_attention_backward_prepare",
                "flash_attention_backward_query_rows",
                "flash_attention_backward_key_value_rows",
            ],
            Web,
            flash_attention,
        ),
        (
            &[
                "flash_attention_forward",
                "flash_attention_backward_prepare",
                "flash_attention_backward_query",
                "flash_attention_backward_key_value",
            ],
            Gpu,
            flash_attention,
        ),
    ]
};

fn plan(kernels: &CaseKernels<'_>) -> Result<Vec<Planned>> {
    let mut planned = Vec::new();
    for (i, &(entries, on, build)) in BUILDERS.iter().enumerate() {
        let mut ctx = Ctx {
            k: kernels.get(on),
            rng: ChaCha8Rng::seed_from_u64(1000 + i as u64),
        };
        match build(&mut ctx) {
            Ok(mut case) => {
                case.on = on;
                let ran: Vec<&str> = case
                    .dispatches
                    .iter()
                    .flat_map(|d| d.each_launch())
                    .map(|l| l.kernel().entry)
                    .collect();
                if let Some(missing) = entries.iter().find(|e| !ran.contains(e)) {
                    return Err(Error::InvalidArgument {
                        op: "shaders --dump",
                        reason: format!("case `{}` was meant for `{missing}` but runs {ran:?}", case.name),
                    });
                }
                planned.push(Ok(case));
            }
            // The adapter lacks what the kernel needs: the case is listed,
            // unbuilt, with the reason.
            Err(e @ Error::Unsupported { .. }) => planned.push(Err((entries.to_vec(), e.to_string()))),
            Err(e) => return Err(e),
        }
    }
    let covered: Vec<&str> = planned
        .iter()
        .flat_map(|p| match p {
            Ok(c) => c.entries.clone(),
            Err((entries, _)) => entries.clone(),
        })
        .collect();
    let missing: Vec<&str> = KERNELS
        .iter()
        .map(|k| k.entry)
        .filter(|e| !covered.contains(e))
        .collect();
    if !missing.is_empty() {
        return Err(Error::InvalidArgument {
            op: "shaders --dump",
            reason: format!("no case for the entry points {missing:?}"),
        });
    }
    Ok(planned)
}

// ---- matmul.wgsl -------------------------------------------------------

fn matmul_variant(
    c: &mut Ctx<'_>,
    entry: &'static str,
    variant: MatmulVariant,
    form: MatmulForm,
    (m, n, kk): (usize, usize, usize),
) -> Result<Case> {
    let (a_h, b_h) = (c.vals(m * kk, -1.0, 1.0), c.vals(kk * n, -1.0, 1.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(form, m, n, kk).with_kernel(MatmulKernel::Tiled(variant)),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let want = cpu::matmul(form, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &[entry],
        format!("{entry} {form:?} {m}x{n}x{kk}"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

fn matmul_register(c: &mut Ctx<'_>) -> Result<Case> {
    matmul_variant(
        c,
        "matmul_forward_register",
        MatmulVariant::Register,
        MatmulForm::AB,
        (67, 70, 19),
    )
}

fn matmul_shared(c: &mut Ctx<'_>) -> Result<Case> {
    matmul_variant(
        c,
        "matmul_forward_shared",
        MatmulVariant::Shared,
        MatmulForm::AtB,
        (65, 41, 23),
    )
}

fn matmul_shared_vec4(c: &mut Ctx<'_>) -> Result<Case> {
    // Both operands' stored rows multiples of 4: the vec4 loads.
    matmul_variant(
        c,
        "matmul_forward_shared_vec4",
        MatmulVariant::Shared,
        MatmulForm::AB,
        (67, 72, 20),
    )
}

fn matmul_vec4(c: &mut Ctx<'_>) -> Result<Case> {
    // Multiples of 4 in every dimension, or the scalar register kernel runs.
    matmul_variant(
        c,
        "matmul_forward_register_vec4",
        MatmulVariant::RegisterVec4,
        MatmulForm::ABt,
        (68, 20, 28),
    )
}

fn matmul_subgroup(c: &mut Ctx<'_>) -> Result<Case> {
    let (m, n, kk) = (37, 29, 19);
    let (a_h, b_h) = (c.vals(m * kk, -1.0, 1.0), c.vals(kk * n, -1.0, 1.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup)),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let want = cpu::matmul(MatmulForm::AB, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &["matmul_subgroup_forward"],
        format!("matmul_subgroup_forward AB {m}x{n}x{kk}"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

/// The decode shape (3 rows of A·Bᵀ, k a multiple of 4), which the
/// shape-selected entry gives the matrix-vector kernel, with the forward
/// epilogue: bias, GELU, the pre-activation kept. The entry picks the lanes
/// by adapter (8 on a CPU one, which builds these cases); `Some(lanes)`
/// asks for a GPU's 64.
fn matmul_matvec(c: &mut Ctx<'_>, lanes: Option<u32>) -> Result<Case> {
    let (m, n, kk) = (3, 37, 20);
    let (a_h, b_h, bias_h) = (
        c.vals(m * kk, -1.0, 1.0),
        c.vals(n * kk, -1.0, 1.0),
        c.vals(n, -1.0, 1.0),
    );
    let (a, b, bias, out, pre) = (
        c.up(&a_h)?,
        c.up(&b_h)?,
        c.up(&bias_h)?,
        c.k.zeros(m * n)?,
        c.k.zeros(m * n)?,
    );
    let epilogue = MatmulEpilogue {
        bias: Some(bias.view()),
        activation: Some((Activation::Gelu, Some(pre.view()))),
        ..MatmulEpilogue::default()
    };
    let d = match lanes {
        None => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
            out.view(),
            a.view(),
            b.view(),
        )?,
        Some(lanes) => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk)
                .with_kernel(MatmulKernel::Matvec { lanes })
                .with_epilogue(epilogue),
            out.view(),
            a.view(),
            b.view(),
        )?,
    };
    let lanes = d
        .recipe()
        .constants
        .iter()
        .find(|(name, _)| *name == "MATVEC_WG")
        .map_or(0.0, |(_, v)| *v);
    let e = cpu::Epilogue {
        bias: Some(&bias_h),
        activation: Some(Activation::Gelu),
        ..cpu::Epilogue::default()
    };
    let (want, want_pre) = cpu::matmul_epilogue(MatmulForm::ABt, e, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &["matmul_forward_matvec"],
        format!("matmul_forward_matvec ABt {m}x{n}x{kk} +bias gelu, {lanes} lanes"),
        vec![d],
        vec![
            expect("c", &out, want, 1e-5, TRANSCENDENTAL.1),
            expect("pre", &pre, want_pre, SUMS.0, SUMS.1),
        ],
    ))
}

/// A small product accumulated onto C through tanh's backward: the
/// gradient epilogue (ACCUMULATE, ACTIVATION_BACKWARD).
fn matmul_small_epilogue(c: &mut Ctx<'_>) -> Result<Case> {
    let (m, n, kk) = (13, 17, 11);
    let (a_h, b_h, c0, x_h) = (
        c.vals(m * kk, -1.0, 1.0),
        c.vals(kk * n, -1.0, 1.0),
        c.vals(m * n, -1.0, 1.0),
        c.vals(m * n, -2.0, 2.0),
    );
    let (a, b, out, x) = (c.up(&a_h)?, c.up(&b_h)?, c.up(&c0)?, c.up(&x_h)?);
    let epilogue = MatmulEpilogue {
        accumulate: true,
        activation_grad: Some((Activation::Tanh, x.view())),
        ..MatmulEpilogue::default()
    };
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_epilogue(epilogue),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let e = cpu::Epilogue {
        accumulate_onto: Some(&c0),
        activation_grad: Some((Activation::Tanh, &x_h)),
        ..cpu::Epilogue::default()
    };
    let (want, _) = cpu::matmul_epilogue(MatmulForm::AB, e, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &["matmul_forward_small"],
        format!("matmul_forward_small AB {m}x{n}x{kk} accumulate tanh'"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

/// Three products over the grid's z.
fn matmul_small_batched(c: &mut Ctx<'_>) -> Result<Case> {
    let (batch, m, n, kk) = (3, 7, 5, 9);
    let (a_h, b_h) = (c.vals(batch * m * kk, -1.0, 1.0), c.vals(batch * kk * n, -1.0, 1.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(batch * m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::AtB, m, n, kk).with_batch(batch),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let want = cpu::matmul_batched(MatmulForm::AtB, &a_h, &b_h, batch, m, n, kk);
    Ok(Case::new(
        &["matmul_forward_small"],
        format!("matmul_forward_small AtB batch {batch} of {m}x{n}x{kk}"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

/// An A·Bᵀ product whose B and C are over [`On::Split`]'s binding size:
/// the entry splits it into launches over blocks of columns, each binding
/// an aligned part of B and C.
fn matmul_split(c: &mut Ctx<'_>) -> Result<Case> {
    let (m, n, kk) = (5, 300, 16);
    let (a_h, b_h) = (c.vals(m * kk, -1.0, 1.0), c.vals(n * kk, -1.0, 1.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::ABt, m, n, kk),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let launches = d.launches();
    let want = cpu::matmul(MatmulForm::ABt, &a_h, &b_h, m, n, kk);
    let name =
        format!("matmul_forward_small ABt {m}x{n}x{kk} split into {launches} launches ({SPLIT_BINDING}-byte bindings)");
    Ok(Case::new(
        &["matmul_forward_small"],
        name,
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

// ---- elementwise.wgsl --------------------------------------------------

/// Past four 256-wide workgroups, not a multiple of one.
const FLAT_N: usize = 1031;

fn binary(c: &mut Ctx<'_>, op: Binary) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -2.0, 2.0);
    // Divisors away from 0, where WGSL's division is specified to 2.5 ULP.
    let y_h: Vec<f32> = c
        .vals(FLAT_N, 0.5, 2.0)
        .iter()
        .enumerate()
        .map(|(i, v)| if i % 2 == 0 { *v } else { -v })
        .collect();
    let (x, y, out) = (c.up(&x_h)?, c.up(&y_h)?, c.k.zeros(FLAT_N)?);
    let d = c.k.binary(op, out.view(), x.view(), y.view())?;
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} {FLAT_N}"),
        vec![d],
        vec![expect("out", &out, cpu::binary(op, &x_h, &y_h), ROUNDING.0, ROUNDING.1)],
    ))
}

/// x and y as two parts of one buffer (an arena), out in another: read-only
/// bindings of one buffer side by side. (A writable binding may not share
/// its buffer with a read-only one in a dispatch: WebGPU's usage scopes,
/// which wgpu-core enforces too.)
fn arena_add(c: &mut Ctx<'_>) -> Result<Case> {
    // Parts start on WebGPU's 256-byte storage offset alignment.
    let stride = FLAT_N.next_multiple_of(64);
    let arena_h = c.vals(2 * stride, -2.0, 2.0);
    let (arena, out) = (c.up(&arena_h)?, c.k.zeros(FLAT_N)?);
    let d = c.k.binary(
        Binary::Add,
        out.view(),
        arena.slice(0, FLAT_N)?,
        arena.slice(stride, FLAT_N)?,
    )?;
    let want = cpu::binary(Binary::Add, &arena_h[..FLAT_N], &arena_h[stride..stride + FLAT_N]);
    Ok(Case::new(
        &["add_forward"],
        format!("add_forward {FLAT_N}, x and y in one buffer"),
        vec![d],
        vec![expect("out", &out, want, ROUNDING.0, ROUNDING.1)],
    ))
}

fn scale(c: &mut Ctx<'_>) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -2.0, 2.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(FLAT_N)?);
    let d = c.k.scale(out.view(), x.view(), -1.75)?;
    Ok(Case::new(
        &["scale_forward"],
        format!("scale_forward {FLAT_N} by -1.75"),
        vec![d],
        vec![expect("out", &out, cpu::scale(&x_h, -1.75), ROUNDING.0, ROUNDING.1)],
    ))
}

/// Dropout of FLAT_N values (a prime count: one row), as a share of a
/// 2000-wide row from column 300 in the second example, at p = 0.3: the
/// mask's integer hash is exact, each kept value one rounding.
fn dropout(c: &mut Ctx<'_>) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -2.0, 2.0);
    let mask = DropoutMask {
        p: 0.3,
        salt: 77,
        row_width: 2000,
        col_offset: 300,
    };
    let control = [5u32, 1, 1, 0];
    let (x, ctl, out) = (c.up(&x_h)?, c.up_u32(&control)?, c.k.zeros(FLAT_N)?);
    let d = c.k.dropout(mask, out.view(), x.view(), ctl.view(), FLAT_N, 1)?;
    Ok(Case::new(
        &["dropout_forward"],
        format!("dropout_forward {FLAT_N} at p 0.3"),
        vec![d],
        vec![expect(
            "out",
            &out,
            cpu::dropout(&mask, &x_h, &control, FLAT_N, 1),
            ROUNDING.0,
            ROUNDING.1,
        )],
    ))
}

fn add_assign(c: &mut Ctx<'_>) -> Result<Case> {
    let (x_h, out0) = (c.vals(FLAT_N, -2.0, 2.0), c.vals(FLAT_N, -2.0, 2.0));
    let (x, out) = (c.up(&x_h)?, c.up(&out0)?);
    let d = c.k.add_assign(out.view(), x.view())?;
    Ok(Case::new(
        &["add_assign"],
        format!("add_assign {FLAT_N}"),
        vec![d],
        vec![expect(
            "out",
            &out,
            cpu::binary(Binary::Add, &out0, &x_h),
            ROUNDING.0,
            ROUNDING.1,
        )],
    ))
}

fn copy_vec4(c: &mut Ctx<'_>) -> Result<Case> {
    let n = FLAT_N + 1; // whole vec4s
    let x_h = c.vals(n, -2.0, 2.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(n)?);
    let d = c.k.copy_vec4(out.view(), x.view())?;
    Ok(Case::new(
        &["copy_vec4"],
        format!("copy_vec4 {n}"),
        vec![d],
        vec![expect("out", &out, x_h, EXACT.0, EXACT.1)],
    ))
}

fn bias_add(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols) = (37, 29);
    let (x_h, b_h) = (c.vals(rows * cols, -2.0, 2.0), c.vals(cols, -1.0, 1.0));
    let (x, b, out) = (c.up(&x_h)?, c.up(&b_h)?, c.k.zeros(rows * cols)?);
    let d = c.k.bias_add(out.view(), x.view(), b.view(), rows, cols)?;
    Ok(Case::new(
        &["bias_add_forward"],
        format!("bias_add_forward {rows}x{cols}"),
        vec![d],
        vec![expect(
            "out",
            &out,
            cpu::bias_add(&x_h, &b_h, cols),
            ROUNDING.0,
            ROUNDING.1,
        )],
    ))
}

fn activation(c: &mut Ctx<'_>, act: Activation, backward: bool) -> Result<Case> {
    let (x_h, dy_h) = (c.vals(FLAT_N, -4.0, 4.0), c.vals(FLAT_N, -1.0, 1.0));
    let (x, dy, out) = (c.up(&x_h)?, c.up(&dy_h)?, c.k.zeros(FLAT_N)?);
    let (d, want) = if backward {
        (
            c.k.activation_backward(act, out.view(), x.view(), dy.view())?,
            cpu::activation_backward(act, &x_h, &dy_h),
        )
    } else {
        (
            c.k.activation_forward(act, out.view(), x.view())?,
            cpu::activation_forward(act, &x_h),
        )
    };
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} {FLAT_N}"),
        vec![d],
        vec![expect("out", &out, want, TRANSCENDENTAL.0, TRANSCENDENTAL.1)],
    ))
}

// ---- reduce.wgsl -------------------------------------------------------

/// The entry points a dispatch launches, in order, each once.
fn launched(d: &Dispatch) -> Vec<&'static str> {
    let mut entries: Vec<&'static str> = Vec::new();
    for launch in d.each_launch() {
        if !entries.contains(&launch.kernel().entry) {
            entries.push(launch.kernel().entry);
        }
    }
    entries
}

/// A reduction's case. Where the kernels take two stages (a GPU's shaping,
/// enough rows), the first launch's sums pass to the second through the
/// device's reduction scratch, `partial`: checked through the result.
fn reduction_case(d: Dispatch, what: String, expected: Vec<Expect>, partial: &'static str) -> Case {
    let entries = launched(&d);
    let two_stage = d.launches() > 1;
    let mut case = Case::new(&entries, format!("{} {what}", entries.join(" + ")), vec![d], expected);
    if two_stage {
        case.scratch
            .push((partial, "the first stage's partial sums, summed by the second stage"));
    }
    case
}

fn sum_rows(c: &mut Ctx<'_>, rows: usize, cols: usize) -> Result<Case> {
    let (x_h, out0) = (c.vals(rows * cols, -1.0, 1.0), c.vals(cols, -1.0, 1.0));
    let (x, out) = (c.up(&x_h)?, c.up(&out0)?);
    let d = c.k.sum_rows_accumulate(out.view(), x.view(), rows, cols)?;
    let want: Vec<f32> = cpu::sum_rows(&x_h, rows, cols)
        .iter()
        .zip(&out0)
        .map(|(s, o)| s + o)
        .collect();
    Ok(reduction_case(
        d,
        format!("{rows}x{cols} accumulate"),
        vec![expect("out", &out, want, SUMS.0, SUMS.1)],
        "partial",
    ))
}

fn whole_sum(c: &mut Ctx<'_>, mean: bool) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -1.0, 1.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(1)?);
    let (d, want) = if mean {
        (c.k.mean(out.view(), x.view())?, cpu::mean(&x_h))
    } else {
        (c.k.sum(out.view(), x.view())?, cpu::sum(&x_h))
    };
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} {FLAT_N}"),
        vec![d],
        vec![expect("out", &out, vec![want], SUMS.0 * 10.0, SUMS.1)],
    ))
}

fn max_rows(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols) = (261, 70);
    let x_h = c.distinct(rows * cols, -4.0, 4.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(rows)?);
    let d = c.k.max_rows(out.view(), x.view(), rows, cols)?;
    Ok(Case::new(
        &["max_rows_forward"],
        format!("max_rows_forward {rows}x{cols}"),
        vec![d],
        vec![expect("out", &out, cpu::max_rows(&x_h, rows, cols), EXACT.0, EXACT.1)],
    ))
}

fn argmax_rows(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols) = (261, 70);
    let x_h = c.distinct(rows * cols, -4.0, 4.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(rows)?);
    let d = c.k.argmax_rows(out.view(), x.view(), rows, cols)?;
    Ok(Case::new(
        &["argmax_rows_forward"],
        format!("argmax_rows_forward {rows}x{cols}"),
        vec![d],
        vec![expect_u32("indices", &out, cpu::argmax_rows(&x_h, rows, cols))],
    ))
}

// ---- loss.wgsl ---------------------------------------------------------

const LOSS: (f64, f64) = (2e-6, 1e-4);

/// Over 4096 values a GPU sums in two stages.
fn mse_forward(c: &mut Ctx<'_>, n: usize) -> Result<Case> {
    let (p_h, t_h) = (c.vals(n, -2.0, 2.0), c.vals(n, -2.0, 2.0));
    let (p, t, loss) = (c.up(&p_h)?, c.up(&t_h)?, c.k.zeros(1)?);
    let d = c.k.mse_forward(loss.view(), p.view(), t.view())?;
    Ok(reduction_case(
        d,
        format!("{n}"),
        vec![expect(
            "loss",
            &loss,
            vec![cpu::mse_forward(&p_h, &t_h)],
            LOSS.0,
            LOSS.1,
        )],
        "partials",
    ))
}

fn mse_backward(c: &mut Ctx<'_>) -> Result<Case> {
    let n = 307;
    let (p_h, t_h) = (c.vals(n, -2.0, 2.0), c.vals(n, -2.0, 2.0));
    let (p, t, dl, dp) = (c.up(&p_h)?, c.up(&t_h)?, c.up(&[0.7f32])?, c.k.zeros(n)?);
    let d = c.k.mse_backward(dp.view(), p.view(), t.view(), dl.view())?;
    Ok(Case::new(
        &["mse_backward"],
        format!("mse_backward {n}"),
        vec![d],
        vec![expect("dpred", &dp, cpu::mse_backward(&p_h, &t_h, 0.7), LOSS.0, LOSS.1)],
    ))
}

/// Over 256 rows a GPU sums in two stages.
fn ce_forward(c: &mut Ctx<'_>, rows: usize, cols: usize) -> Result<Case> {
    let (l_h, y_h) = (c.vals(rows * cols, -3.0, 3.0), c.ids(rows, cols as u32));
    let (l, y, loss) = (c.up(&l_h)?, c.up_u32(&y_h)?, c.k.zeros(1)?);
    let d = c.k.cross_entropy_forward(loss.view(), l.view(), y.view(), rows, cols)?;
    let want = cpu::cross_entropy_forward(&l_h, &y_h, rows, cols);
    Ok(reduction_case(
        d,
        format!("{rows}x{cols}"),
        vec![expect("loss", &loss, vec![want], LOSS.0, LOSS.1)],
        "partials",
    ))
}

fn ce_backward(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols) = (13, 11);
    let (l_h, y_h) = (c.vals(rows * cols, -3.0, 3.0), c.ids(rows, cols as u32));
    let (l, y, dl, dlogits) = (c.up(&l_h)?, c.up_u32(&y_h)?, c.up(&[1.3f32])?, c.k.zeros(rows * cols)?);
    let d =
        c.k.cross_entropy_backward(dlogits.view(), l.view(), y.view(), dl.view(), rows, cols)?;
    let want = cpu::cross_entropy_backward(&l_h, &y_h, 1.3, rows, cols);
    Ok(Case::new(
        &["cross_entropy_backward"],
        format!("cross_entropy_backward {rows}x{cols}"),
        vec![d],
        vec![expect("dlogits", &dlogits, want, LOSS.0, LOSS.1)],
    ))
}

/// A loss and its gradient in one dispatch, adding the bias gradient; with
/// `linear` the last Linear layer's forward and weight gradient too (ten
/// storage buffers: over WebGPU's default of eight, so built with the
/// adapter's limits and run in the browser only where its adapter allows).
fn fused_loss(c: &mut Ctx<'_>, labels: bool, linear: bool) -> Result<Case> {
    let (rows, cols, inner) = (7, 5, 6);
    let pred_h = c.vals(rows * cols, -2.0, 2.0);
    let (target_h, label_h) = (c.vals(rows * cols, -2.0, 2.0), c.ids(rows, cols as u32));
    let (x_h, w_h, b_h) = (
        c.vals(rows * inner, -1.0, 1.0),
        c.vals(cols * inner, -1.0, 1.0),
        c.vals(cols, -1.0, 1.0),
    );
    let (wg0, bg0) = (c.vals(cols * inner, -1.0, 1.0), c.vals(cols, -1.0, 1.0));
    let pred = if linear {
        c.k.zeros(rows * cols)?
    } else {
        c.up(&pred_h)?
    };
    let (target, label) = (c.up(&target_h)?, c.up_u32(&label_h)?);
    let (loss, dpred, dloss) = (c.k.zeros(1)?, c.k.zeros(rows * cols)?, c.up(&[0.9f32])?);
    let (x, w, b, wg, bg) = (c.up(&x_h)?, c.up(&w_h)?, c.up(&b_h)?, c.up(&wg0)?, c.up(&bg0)?);
    let targets = if labels {
        LossTargets::Labels(label.view())
    } else {
        LossTargets::Values(target.view())
    };
    let lin = linear.then(|| LossLinear {
        x: x.view(),
        weight: w.view(),
        bias: Some(b.view()),
        inner,
        weight_grad: wg.view(),
    });
    let d = c.k.loss_forward_backward_fused(
        targets,
        loss.view(),
        dpred.view(),
        pred.view(),
        dloss.view(),
        rows,
        cols,
        lin,
        Some(bg.view()),
    )?;
    let cpu_targets = if labels {
        cpu::LossTargets::Labels(&label_h)
    } else {
        cpu::LossTargets::Values(&target_h)
    };
    let want = cpu::loss_forward_backward_fused(
        cpu_targets,
        &pred_h,
        linear.then_some((&x_h[..], &w_h[..], Some(&b_h[..]), inner)),
        0.9,
        rows,
        cols,
    );
    let add = |a: &[f32], b: &[f32]| -> Vec<f32> { a.iter().zip(b).map(|(x, y)| x + y).collect() };
    let mut expected = vec![
        expect("loss", &loss, vec![want.loss], LOSS.0, LOSS.1),
        expect("dpred", &dpred, want.dpred.clone(), LOSS.0, LOSS.1),
    ];
    expected.push(expect("bias_grad", &bg, add(&bg0, &want.bias_grad), LOSS.0, LOSS.1));
    if linear {
        expected.push(expect("pred", &pred, want.pred.clone(), SUMS.0, SUMS.1));
        expected.push(expect("weight_grad", &wg, add(&wg0, &want.weight_grad), LOSS.0, LOSS.1));
    }
    let d_entry = d.kernel().entry;
    Ok(Case::new(
        &[d_entry],
        format!(
            "{d_entry} {rows}x{cols}{}",
            if linear {
                format!(" inner {inner}")
            } else {
                String::new()
            }
        ),
        vec![d],
        expected,
    ))
}

// ---- optim.wgsl --------------------------------------------------------

const OPTIM: (f64, f64) = (1e-6, 1e-5);

fn sgd(c: &mut Ctx<'_>) -> Result<Case> {
    let n = FLAT_N;
    let (p0, g_h, m0) = (c.vals(n, -1.0, 1.0), c.vals(n, -1.0, 1.0), c.vals(n, -1.0, 1.0));
    let (p, g, m) = (c.up(&p0)?, c.up(&g_h)?, c.up(&m0)?);
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: true,
        ..SgdConfig::default()
    };
    let d = c.k.sgd_update(p.view(), g.view(), m.view(), &cfg, 3)?;
    let (mut p_want, mut m_want) = (p0, m0);
    cpu::sgd_update(&mut p_want, &g_h, &mut m_want, &cfg, 3);
    Ok(Case::new(
        &["sgd_update"],
        format!("sgd_update {n} step 3 nesterov"),
        vec![d],
        vec![
            expect("param", &p, p_want, OPTIM.0, OPTIM.1),
            expect("momentum_buf", &m, m_want, OPTIM.0, OPTIM.1),
        ],
    ))
}

fn adam(c: &mut Ctx<'_>) -> Result<Case> {
    let n = FLAT_N;
    let (p0, g_h, m0, v0) = (
        c.vals(n, -1.0, 1.0),
        c.vals(n, -1.0, 1.0),
        c.vals(n, -0.1, 0.1),
        c.vals(n, 0.0, 0.01),
    );
    let (p, g, m, v) = (c.up(&p0)?, c.up(&g_h)?, c.up(&m0)?, c.up(&v0)?);
    let cfg = AdamConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamConfig::adam()
    };
    let d = c.k.adam_update(p.view(), g.view(), m.view(), v.view(), &cfg, 3)?;
    let (mut p_want, mut m_want, mut v_want) = (p0, m0, v0);
    cpu::adam_update(&mut p_want, &g_h, &mut m_want, &mut v_want, &cfg, 3);
    let expected = vec![
        expect("param", &p, p_want, OPTIM.0, OPTIM.1),
        expect("exp_avg", &m, m_want, OPTIM.0, OPTIM.1),
        expect("exp_avg_sq", &v, v_want, OPTIM.0, OPTIM.1),
    ];
    Ok(Case::new(
        &["adam_update"],
        format!("adam_update {n} step 3"),
        vec![d],
        expected,
    ))
}

/// An AdamW step with gradient clipping over an arena whose first part is
/// weight-decayed, as the executor records it: the norm's two passes
/// (per-chunk sums of squares, then their sum and the clip factor), then
/// the update reading the factor. `grad_norm_partials` has no twin of its
/// own: its partials are checked through their sum (the squared norm).
fn clipped_adamw(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, decay_len, max_norm) = (3001, 1800, 1.0f32);
    let (p0, g_h, m0, v0) = (
        c.vals(n, -1.0, 1.0),
        c.vals(n, -1.0, 1.0),
        c.vals(n, -0.1, 0.1),
        c.vals(n, 0.0, 0.01),
    );
    let groups = wgrad::kernels::grad_norm_groups(n);
    let (p, g, m, v, norm, partials) = (
        c.up(&p0)?,
        c.up(&g_h)?,
        c.up(&m0)?,
        c.up(&v0)?,
        c.k.zeros(2)?,
        c.k.zeros(groups)?,
    );
    let cfg = OptimizerConfig::Adam(AdamConfig {
        lr: 1e-2,
        clip_grad_norm: Some(max_norm),
        ..AdamConfig::adamw()
    });
    let [sums, finish] = c.k.grad_norm(norm.view(), partials.view(), g.view(), max_norm)?;
    let arena = wgrad::kernels::ArenaGroups {
        decay_len,
        grad_norm: Some(norm.view()),
    };
    let update =
        c.k.optimizer_update(&cfg, p.view(), g.view(), &[m.view(), v.view()], arena, 3)?;
    // The twin takes the arena as two tensors: decayed, then not.
    let split = |v: &[f32]| vec![v[..decay_len].to_vec(), v[decay_len..].to_vec()];
    let (mut params, grads) = (split(&p0), split(&g_h));
    let mut state = vec![
        vec![m0[..decay_len].to_vec(), v0[..decay_len].to_vec()],
        vec![m0[decay_len..].to_vec(), v0[decay_len..].to_vec()],
    ];
    cpu::optimizer_step(&mut params, &grads, &mut state, &[true, false], &cfg, 3);
    let (total, factor) = cpu::clip_grad_norm(&[&g_h], max_norm);
    let joined = |a: &[Vec<f32>]| a.concat();
    let mut squares = expect("partials", &partials, vec![total * total], SUMS.0, 1e-5);
    squares.sum = true;
    squares.elements = groups;
    squares.source = "their sum against the twin's squared norm (the chunking has no twin)";
    let expected = vec![
        expect("norm_out", &norm, vec![total, factor], SUMS.0, 1e-5),
        squares,
        expect("param", &p, joined(&params), OPTIM.0, OPTIM.1),
        expect(
            "exp_avg",
            &m,
            joined(&[state[0][0].clone(), state[1][0].clone()]),
            OPTIM.0,
            OPTIM.1,
        ),
        expect(
            "exp_avg_sq",
            &v,
            joined(&[state[0][1].clone(), state[1][1].clone()]),
            OPTIM.0,
            OPTIM.1,
        ),
    ];
    Ok(Case::new(
        &["grad_norm_partials", "grad_norm_finish", "adamw_update"],
        format!("grad_norm + adamw_update {n} ({groups} partials) clip {max_norm} decay {decay_len}"),
        vec![sums, finish, update],
        expected,
    )
    .note("the executor's clipped step: norm, then the update reading its clip factor"))
}

/// A loss-scaled, clipped AdamW step as the executor records it under
/// `--precision f16`: the unscale, inf/NaN check and scale update over
/// gradients scaled by 1024, then the update reading the block's factor and
/// its step count. The twin is `cpu::LossScaleTwin` (the norm of the
/// unscaled gradients and the factor), then AdamW's step 1 over the
/// gradients times that factor. The partials have no twin of their own.
fn loss_scaled_adamw(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, decay_len, max_norm) = (2999, 1700, 1.0f32);
    let scaling = wgrad::optim::LossScaling {
        init_scale: 1024.0,
        ..Default::default()
    };
    let (p0, g0, m0, v0) = (
        c.vals(n, -1.0, 1.0),
        c.vals(n, -1.0, 1.0),
        c.vals(n, -0.1, 0.1),
        c.vals(n, 0.0, 0.01),
    );
    let scaled: Vec<f32> = g0.iter().map(|g| g * scaling.init_scale).collect();
    let cfg = OptimizerConfig::Adam(AdamConfig {
        lr: 1e-2,
        clip_grad_norm: Some(max_norm),
        ..AdamConfig::adamw()
    })
    .with_loss_scaling(Some(scaling));
    let groups = wgrad::kernels::grad_norm_groups(n);
    let (p, g, m, v) = (c.up(&p0)?, c.up(&scaled)?, c.up(&m0)?, c.up(&v0)?);
    let (block, partials) = (
        c.up(&wgrad::kernels::loss_scale_block(&scaling))?,
        c.k.zeros(2 * groups)?,
    );
    let [sums, finish] = c.k.loss_scale(block.view(), partials.view(), g.view(), &cfg)?;
    let arena = wgrad::kernels::ArenaGroups {
        decay_len,
        grad_norm: Some(block.view()),
    };
    let update =
        c.k.optimizer_update(&cfg, p.view(), g.view(), &[m.view(), v.view()], arena, 1)?;
    let mut twin = cpu::LossScaleTwin::new(&scaling);
    let (norm, factor) = twin.step(&scaled, &scaling, Some(max_norm));
    let factor = factor.ok_or_else(|| Error::Validation {
        op: "loss_scaled_adamw".into(),
        message: "finite gradients were skipped by the twin".into(),
    })?;
    let plain = OptimizerConfig::Adam(AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    });
    let split = |v: &[f32]| vec![v[..decay_len].to_vec(), v[decay_len..].to_vec()];
    let unscaled: Vec<f32> = scaled.iter().map(|g| g * factor).collect();
    let (mut params, grads) = (split(&p0), split(&unscaled));
    let mut state = vec![
        vec![m0[..decay_len].to_vec(), v0[..decay_len].to_vec()],
        vec![m0[decay_len..].to_vec(), v0[decay_len..].to_vec()],
    ];
    cpu::optimizer_step(&mut params, &grads, &mut state, &[true, false], &plain, 1);
    let joined = |a: &[Vec<f32>]| a.concat();
    // Words of the block against the twin: the unscaled norm, no skip, the
    // scale unchanged after one clean step, one step taken.
    use wgrad::kernels::loss_scale_word as word;
    let at = |name: &'static str, w: usize, value: f32| Expect {
        offset: (w * 4) as u64,
        source: "a word of the loss-scale block",
        ..expect(name, &block, vec![value], SUMS.0, 1e-5)
    };
    let words = [
        at("block_norm", word::NORM, norm),
        at("block_skip", word::SKIP, 0.0),
        at("block_scale", word::SCALE, twin.scale),
        at("block_step", word::STEP, twin.steps_taken as f32),
    ];
    let mut expected = Vec::from(words);
    expected.extend([
        expect("param", &p, joined(&params), OPTIM.0, OPTIM.1),
        expect(
            "exp_avg",
            &m,
            joined(&[state[0][0].clone(), state[1][0].clone()]),
            OPTIM.0,
            OPTIM.1,
        ),
        expect(
            "exp_avg_sq",
            &v,
            joined(&[state[0][1].clone(), state[1][1].clone()]),
            OPTIM.0,
            OPTIM.1,
        ),
    ]);
    let mut case = Case::new(
        &["loss_scale_partials", "loss_scale_finish", "adamw_update"],
        format!(
            "loss_scale + adamw_update {n} ({groups} partials) scale {} clip {max_norm} decay {decay_len}",
            scaling.init_scale
        ),
        vec![sums, finish, update],
        expected,
    )
    .note("--precision f16's step: unscale, check and clip, then the update reading the factor and step count");
    case.scratch.push((
        "partials",
        "per-chunk sums of squares and non-finite counts, read by loss_scale_finish",
    ));
    Ok(case)
}

// ---- matmul_f16.wgsl, matmul_subgroup.wgsl -----------------------------

fn matmul_f16(c: &mut Ctx<'_>) -> Result<Case> {
    let (m, n, kk) = (21, 19, 17);
    let (a_h, b_h) = (f16s(&c.vals(m * kk, -1.0, 1.0)), f16s(&c.vals(n * kk, -1.0, 1.0)));
    let (a, b, out) = (c.k.upload_f16(&a_h)?, c.k.upload_f16(&b_h)?, c.k.zeros(m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_kernel(MatmulKernel::NativeF16),
        out.view(),
        a.view(),
        b.view(),
    )?;
    let want = cpu::matmul_f16(MatmulForm::ABt, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &["matmul_f16_forward"],
        format!("matmul_f16_forward ABt {m}x{n}x{kk}"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

fn to_f16(c: &mut Ctx<'_>) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -4.0, 4.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros_f16(FLAT_N)?);
    let d = c.k.to_f16(out.view(), x.view())?;
    let want = cpu::from_f16(&cpu::to_f16(&x_h));
    // WGSL lets the conversion round to either neighbour: one f16 ULP
    // (2^-10 relative) plus f16's smallest subnormal.
    let e = Expect {
        name: "dst",
        buffer: out.buffer().clone(),
        offset: 0,
        elements: want.len(),
        values: Values::F16(want),
        atol: 6e-8,
        rtol: 1.0 / 1024.0,
        sum: false,
        source: "",
    };
    Ok(Case::new(
        &["f32_to_f16"],
        format!("f32_to_f16 {FLAT_N}"),
        vec![d],
        vec![e],
    ))
}

fn from_f16(c: &mut Ctx<'_>) -> Result<Case> {
    let x_h = f16s(&c.vals(FLAT_N, -4.0, 4.0));
    let (x, out) = (c.k.upload_f16(&x_h)?, c.k.zeros(FLAT_N)?);
    let d = c.k.from_f16(out.view(), x.view())?;
    Ok(Case::new(
        &["f16_to_f32"],
        format!("f16_to_f32 {FLAT_N}"),
        vec![d],
        vec![expect("dst", &out, cpu::from_f16(&x_h), EXACT.0, EXACT.1)],
    ))
}

// ---- rowwise.wgsl ------------------------------------------------------

const ROW: (f64, f64) = (2e-6, 1e-4);

/// Long rows (one workgroup per row): causal scores over T = 131 positions
/// (a prime past SHORT_ROW_MAX), two sequences; short rows: 37×29.
fn softmax(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols, causal) = if short { (37, 29, None) } else { (262, 131, Some(131)) };
    let x_h = c.vals(rows * cols, -4.0, 4.0);
    let (x, y) = (c.up(&x_h)?, c.k.zeros(rows * cols)?);
    let d = c.k.softmax_forward(y.view(), x.view(), rows, cols, causal)?;
    let entry = d.kernel().entry;
    let want = cpu::softmax_forward(&x_h, rows, cols, causal);
    let mask = if causal.is_some() { " causal" } else { "" };
    Ok(Case::new(
        &[entry],
        format!("{entry} {rows}x{cols}{mask}"),
        vec![d],
        vec![expect("y", &y, want, ROW.0, ROW.1)],
    ))
}

fn softmax_backward(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols) = if short { (37, 29) } else { (6, 300) };
    let y_h = cpu::softmax_forward(&c.vals(rows * cols, -4.0, 4.0), rows, cols, None);
    let dy_h = c.vals(rows * cols, -1.0, 1.0);
    let (y, dy, dx) = (c.up(&y_h)?, c.up(&dy_h)?, c.k.zeros(rows * cols)?);
    let d = c.k.softmax_backward(dx.view(), y.view(), dy.view(), rows, cols)?;
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} {rows}x{cols}"),
        vec![d],
        vec![expect(
            "dx",
            &dx,
            cpu::softmax_backward(&y_h, &dy_h, rows, cols),
            ROW.0,
            ROW.1,
        )],
    ))
}

fn layernorm(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols) = if short { (37, 29) } else { (5, 300) };
    let (x_h, w_h, b_h) = (
        c.vals(rows * cols, -2.0, 3.0),
        c.vals(cols, 0.5, 1.5),
        c.vals(cols, -0.5, 0.5),
    );
    let (x, w, b) = (c.up(&x_h)?, c.up(&w_h)?, c.up(&b_h)?);
    let (y, mean, rstd) = (c.k.zeros(rows * cols)?, c.k.zeros(rows)?, c.k.zeros(rows)?);
    let d = c.k.layernorm_forward(
        y.view(),
        mean.view(),
        rstd.view(),
        x.view(),
        w.view(),
        b.view(),
        rows,
        cols,
        1e-5,
    )?;
    let entry = d.kernel().entry;
    let want = cpu::layernorm_forward(&x_h, &w_h, &b_h, rows, cols, 1e-5);
    let expected = vec![
        expect("y", &y, want.y, ROW.0 * 5.0, ROW.1),
        expect("mean", &mean, want.mean, ROW.0, ROW.1),
        expect("rstd", &rstd, want.rstd, ROW.0, ROW.1),
    ];
    Ok(Case::new(&[entry], format!("{entry} {rows}x{cols}"), vec![d], expected))
}

/// Layernorm's backward inputs: dy, x, weight and the forward's statistics
/// (from the twin).
fn layernorm_inputs(
    c: &mut Ctx<'_>,
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, cpu::LayerNormForward) {
    let (x_h, w_h, dy_h) = (
        c.vals(rows * cols, -2.0, 3.0),
        c.vals(cols, 0.5, 1.5),
        c.vals(rows * cols, -1.0, 1.0),
    );
    let fwd = cpu::layernorm_forward(&x_h, &w_h, &vec![0.0; cols], rows, cols, 1e-5);
    (x_h, w_h, dy_h, fwd)
}

fn layernorm_backward(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols) = if short { (37, 29) } else { (5, 300) };
    let (x_h, w_h, dy_h, fwd) = layernorm_inputs(c, rows, cols);
    let (x, w, dy, mean, rstd, dx) = (
        c.up(&x_h)?,
        c.up(&w_h)?,
        c.up(&dy_h)?,
        c.up(&fwd.mean)?,
        c.up(&fwd.rstd)?,
        c.k.zeros(rows * cols)?,
    );
    let d = c.k.layernorm_backward(
        dx.view(),
        dy.view(),
        x.view(),
        w.view(),
        mean.view(),
        rstd.view(),
        rows,
        cols,
    )?;
    let entry = d.kernel().entry;
    let want = cpu::layernorm_backward(&dy_h, &x_h, &w_h, &fwd.mean, &fwd.rstd, rows, cols);
    Ok(Case::new(
        &[entry],
        format!("{entry} {rows}x{cols}"),
        vec![d],
        vec![expect("dx", &dx, want.dx, ROW.0 * 5.0, ROW.1)],
    ))
}

fn layernorm_params(c: &mut Ctx<'_>, rows: usize, cols: usize) -> Result<Case> {
    let (x_h, w_h, dy_h, fwd) = layernorm_inputs(c, rows, cols);
    let (dw0, db0) = (c.vals(cols, -1.0, 1.0), c.vals(cols, -1.0, 1.0));
    let (x, dy, mean, rstd, dw, db) = (
        c.up(&x_h)?,
        c.up(&dy_h)?,
        c.up(&fwd.mean)?,
        c.up(&fwd.rstd)?,
        c.up(&dw0)?,
        c.up(&db0)?,
    );
    let d = c.k.layernorm_backward_params(
        true,
        dw.view(),
        db.view(),
        dy.view(),
        x.view(),
        mean.view(),
        rstd.view(),
        rows,
        cols,
    )?;
    let want = cpu::layernorm_backward(&dy_h, &x_h, &w_h, &fwd.mean, &fwd.rstd, rows, cols);
    let add = |a: &[f32], b: &[f32]| -> Vec<f32> { a.iter().zip(b).map(|(x, y)| x + y).collect() };
    let expected = vec![
        expect("dweight", &dw, add(&dw0, &want.dweight), SUMS.0, SUMS.1),
        expect("dbias", &db, add(&db0, &want.dbias), SUMS.0, SUMS.1),
    ];
    Ok(reduction_case(
        d,
        format!("{rows}x{cols} accumulate"),
        expected,
        "partial",
    ))
}

fn rmsnorm(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols) = if short { (37, 29) } else { (5, 300) };
    let (x_h, w_h) = (c.vals(rows * cols, -2.0, 2.0), c.vals(cols, 0.5, 1.5));
    let (x, w, y, rstd) = (c.up(&x_h)?, c.up(&w_h)?, c.k.zeros(rows * cols)?, c.k.zeros(rows)?);
    let d =
        c.k.rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), rows, cols, 1e-6)?;
    let entry = d.kernel().entry;
    let want = cpu::rmsnorm_forward(&x_h, &w_h, rows, cols, 1e-6);
    let expected = vec![
        expect("y", &y, want.y, ROW.0 * 5.0, ROW.1),
        expect("rstd", &rstd, want.rstd, ROW.0, ROW.1),
    ];
    Ok(Case::new(&[entry], format!("{entry} {rows}x{cols}"), vec![d], expected))
}

/// RMSNorm's backward inputs: dy, x, weight and the forward's rstd (from
/// the twin).
fn rmsnorm_inputs(c: &mut Ctx<'_>, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x_h, w_h, dy_h) = (
        c.vals(rows * cols, -2.0, 2.0),
        c.vals(cols, 0.5, 1.5),
        c.vals(rows * cols, -1.0, 1.0),
    );
    let rstd = cpu::rmsnorm_forward(&x_h, &w_h, rows, cols, 1e-6).rstd;
    (x_h, w_h, dy_h, rstd)
}

fn rmsnorm_backward(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, cols) = if short { (37, 29) } else { (5, 300) };
    let (x_h, w_h, dy_h, rstd_h) = rmsnorm_inputs(c, rows, cols);
    let (x, w, dy, rstd, dx) = (
        c.up(&x_h)?,
        c.up(&w_h)?,
        c.up(&dy_h)?,
        c.up(&rstd_h)?,
        c.k.zeros(rows * cols)?,
    );
    let d =
        c.k.rmsnorm_backward(dx.view(), dy.view(), x.view(), w.view(), rstd.view(), rows, cols)?;
    let entry = d.kernel().entry;
    let want = cpu::rmsnorm_backward(&dy_h, &x_h, &w_h, &rstd_h, rows, cols);
    Ok(Case::new(
        &[entry],
        format!("{entry} {rows}x{cols}"),
        vec![d],
        vec![expect("dx", &dx, want.dx, ROW.0 * 5.0, ROW.1)],
    ))
}

/// RMSNorm's weight gradient: layernorm's column-sum entries, not centered.
fn rmsnorm_params(c: &mut Ctx<'_>, rows: usize, cols: usize) -> Result<Case> {
    let (x_h, w_h, dy_h, rstd_h) = rmsnorm_inputs(c, rows, cols);
    let dw0 = c.vals(cols, -1.0, 1.0);
    let (x, dy, rstd, dw) = (c.up(&x_h)?, c.up(&dy_h)?, c.up(&rstd_h)?, c.up(&dw0)?);
    let d =
        c.k.rmsnorm_backward_params(true, dw.view(), dy.view(), x.view(), rstd.view(), rows, cols)?;
    let want = cpu::rmsnorm_backward(&dy_h, &x_h, &w_h, &rstd_h, rows, cols);
    let dweight: Vec<f32> = dw0.iter().zip(&want.dweight).map(|(a, b)| a + b).collect();
    Ok(reduction_case(
        d,
        format!("{rows}x{cols} RMSNorm accumulate"),
        vec![expect("dweight", &dw, dweight, SUMS.0, SUMS.1)],
        "partial",
    ))
}

fn ce_rows(c: &mut Ctx<'_>, short: bool) -> Result<Case> {
    let (rows, vocab) = if short { (37, 29) } else { (5, 301) };
    let (l_h, t_h) = (c.vals(rows * vocab, -4.0, 4.0), c.ids(rows, vocab as u32));
    let scale = 1.0 / rows as f32;
    let (l, t, losses, dl) = (c.up(&l_h)?, c.up_u32(&t_h)?, c.k.zeros(rows)?, c.k.zeros(rows * vocab)?);
    let d =
        c.k.cross_entropy_rows_forward_backward(losses.view(), dl.view(), l.view(), t.view(), rows, vocab, scale)?;
    let entry = d.kernel().entry;
    let (want_l, want_d) = cpu::cross_entropy_rows_forward_backward(&l_h, &t_h, rows, vocab, scale);
    Ok(Case::new(
        &[entry],
        format!("{entry} {rows}x{vocab}"),
        vec![d],
        vec![
            expect("losses", &losses, want_l, ROW.0 * 5.0, ROW.1),
            expect("dlogits", &dl, want_d, ROW.0, ROW.1),
        ],
    ))
}

fn embedding(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, vocab, channels) = (37, 23, 29);
    let (table_h, ids_h) = (c.vals(vocab * channels, -1.0, 1.0), c.ids(n, vocab as u32));
    let (table, ids, out) = (c.up(&table_h)?, c.up_u32(&ids_h)?, c.k.zeros(n * channels)?);
    let d =
        c.k.embedding_forward(out.view(), table.view(), ids.view(), n, vocab, channels)?;
    let want = cpu::embedding_forward(&table_h, &ids_h, vocab, channels);
    Ok(Case::new(
        &["embedding_forward"],
        format!("embedding_forward {n} ids, {vocab}x{channels}"),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

/// A table over [`On::Split`]'s binding size: one launch per range of
/// table rows, each binding an aligned part of the table.
fn embedding_split(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, vocab, channels) = (31, 97, 29);
    let (table_h, ids_h) = (c.vals(vocab * channels, -1.0, 1.0), c.ids(n, vocab as u32));
    let (table, ids, out) = (c.up(&table_h)?, c.up_u32(&ids_h)?, c.k.zeros(n * channels)?);
    let d =
        c.k.embedding_forward(out.view(), table.view(), ids.view(), n, vocab, channels)?;
    let launches = d.launches();
    let want = cpu::embedding_forward(&table_h, &ids_h, vocab, channels);
    let name = format!(
        "embedding_forward {n} ids, {vocab}x{channels} split into {launches} launches ({SPLIT_BINDING}-byte bindings)"
    );
    Ok(Case::new(
        &["embedding_forward"],
        name,
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

/// The embedding's backward as the executor records it: the sort, then the
/// gather into the table's gradient (compared with the twin). The sort's
/// `order` has no twin; it is compared with its definition, the positions
/// stably sorted by id (several 256-position tiles, many repeats).
fn embedding_backward(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, vocab, channels) = (600, 23, 7);
    let (dout_h, ids_h, dt0) = (
        c.vals(n * channels, -1.0, 1.0),
        c.ids(n, vocab as u32),
        c.vals(vocab * channels, -1.0, 1.0),
    );
    let (dout, ids, dtable) = (c.up(&dout_h)?, c.up_u32(&ids_h)?, c.up(&dt0)?);
    let (order, cursor) = (c.k.zeros(n)?, c.k.zeros(vocab + 1)?);
    let sort =
        c.k.embedding_backward_sort(order.view(), cursor.view(), ids.view(), n, vocab)?;
    let gather =
        c.k.embedding_backward(dtable.view(), dout.view(), ids.view(), order.view(), n, vocab, channels)?;
    let want: Vec<f32> = cpu::embedding_backward(&dout_h, &ids_h, vocab, channels)
        .iter()
        .zip(&dt0)
        .map(|(g, t)| g + t)
        .collect();
    let mut by_id: Vec<u32> = (0..n as u32).collect();
    by_id.sort_by_key(|&p| ids_h[p as usize]); // stable
    let mut sorted = expect_u32("order", &order, by_id);
    sorted.source = "the definition: positions stably sorted by id (the twin has no order)";
    let mut case = Case::new(
        &["embedding_backward_sort", "embedding_backward"],
        format!("embedding_backward_sort + embedding_backward {n} ids, {vocab}x{channels}"),
        vec![sort, gather],
        vec![expect("dtable", &dtable, want, SUMS.0, SUMS.1), sorted],
    );
    case.scratch.push(("cursor", "the sort's bucket cursors, scratch"));
    Ok(case)
}

// ---- tensor.wgsl -------------------------------------------------------

fn binary_broadcast(c: &mut Ctx<'_>) -> Result<Case> {
    let (a_shape, b_shape) = ([2, 3, 5, 7], [3, 1, 7]);
    let (a_h, b_h) = (c.vals(210, -2.0, 2.0), c.vals(21, -2.0, 2.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(210)?);
    let d =
        c.k.binary_broadcast(Binary::Mul, out.view(), a.view(), b.view(), &a_shape, &b_shape)?;
    let want = cpu::binary_broadcast(Binary::Mul, &a_h, &b_h, &a_shape, &b_shape)?;
    Ok(Case::new(
        &["binary_broadcast_forward"],
        "binary_broadcast_forward mul [2,3,5,7] by [3,1,7]",
        vec![d],
        vec![expect("out", &out, want, ROUNDING.0, ROUNDING.1)],
    ))
}

fn unary(c: &mut Ctx<'_>) -> Result<Case> {
    let x_h = c.vals(FLAT_N, -4.0, 4.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(FLAT_N)?);
    let d = c.k.unary(Unary::Exp, out.view(), x.view())?;
    Ok(Case::new(
        &["unary_forward"],
        format!("unary_forward exp {FLAT_N}"),
        vec![d],
        vec![expect(
            "out",
            &out,
            cpu::unary(Unary::Exp, &x_h),
            TRANSCENDENTAL.0,
            TRANSCENDENTAL.1,
        )],
    ))
}

fn reduce_to_shape(c: &mut Ctx<'_>, x_shape: &[usize], out_shape: &[usize]) -> Result<Case> {
    let (x_len, out_len) = (x_shape.iter().product(), out_shape.iter().product());
    let (x_h, out0) = (c.vals(x_len, -1.0, 1.0), c.vals(out_len, -1.0, 1.0));
    let (x, out) = (c.up(&x_h)?, c.up(&out0)?);
    let d = c.k.reduce_to_shape(true, out.view(), x.view(), x_shape, out_shape)?;
    let want: Vec<f32> = cpu::reduce_to_shape(&x_h, x_shape, out_shape)?
        .iter()
        .zip(&out0)
        .map(|(s, o)| s + o)
        .collect();
    Ok(reduction_case(
        d,
        format!("{x_shape:?} to {out_shape:?} accumulate"),
        vec![expect("out", &out, want, SUMS.0, SUMS.1)],
        "partial",
    ))
}

fn permute(c: &mut Ctx<'_>) -> Result<Case> {
    let (shape, perm) = ([2, 3, 5, 7], [2, 0, 3, 1]);
    let x_h = c.vals(210, -2.0, 2.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(210)?);
    let d = c.k.permute(out.view(), x.view(), &shape, &perm)?;
    Ok(Case::new(
        &["permute_forward"],
        "permute_forward [2,3,5,7] by [2,0,3,1]",
        vec![d],
        vec![expect(
            "out",
            &out,
            cpu::permute(&x_h, &shape, &perm)?,
            EXACT.0,
            EXACT.1,
        )],
    ))
}

fn slice_last(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols, start, width) = (13, 29, 5, 11);
    let x_h = c.vals(rows * cols, -2.0, 2.0);
    let (x, out) = (c.up(&x_h)?, c.k.zeros(rows * width)?);
    let d = c.k.slice_last(out.view(), x.view(), rows, cols, start, width)?;
    let want = cpu::slice_last(&x_h, rows, cols, start, width);
    Ok(Case::new(
        &["slice_last_forward"],
        format!("slice_last_forward {rows}x{cols}[:, {start}..{}]", start + width),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

fn pad_last(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, cols, start, width) = (13, 29, 5, 11);
    let (x_h, out0) = (c.vals(rows * width, -2.0, 2.0), c.vals(rows * cols, -2.0, 2.0));
    // Not accumulating: every column is written, the padding with zeros
    // over the random values already there.
    let (x, out) = (c.up(&x_h)?, c.up(&out0)?);
    let d = c.k.pad_last(false, out.view(), x.view(), rows, cols, start, width)?;
    let want = cpu::pad_last(&x_h, rows, cols, start, width);
    Ok(Case::new(
        &["pad_last_forward"],
        format!("pad_last_forward {rows}x{width} into {rows}x{cols} at {start}"),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

fn concat_last(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, a_cols, b_cols) = (13, 7, 11);
    let (a_h, b_h) = (c.vals(rows * a_cols, -2.0, 2.0), c.vals(rows * b_cols, -2.0, 2.0));
    let (a, b, out) = (c.up(&a_h)?, c.up(&b_h)?, c.k.zeros(rows * (a_cols + b_cols))?);
    let d = c.k.concat_last(out.view(), a.view(), b.view(), rows, a_cols, b_cols)?;
    let want = cpu::concat_last(&a_h, &b_h, rows, a_cols, b_cols);
    Ok(Case::new(
        &["concat_last_forward"],
        format!("concat_last_forward {rows}x{a_cols} | {rows}x{b_cols}"),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

// ---- attention.wgsl, sampling.wgsl -------------------------------------

/// A rotation from a table rounded once to f32: two products and a sum of
/// |x| ≤ 1, a few 1e-8 from the twin's f64.
const ROTATION: (f64, f64) = (3e-7, 1e-6);

/// Two sequences, one continuing at position 40 (a decode step's start),
/// 3 heads of 10 channels of which 8 rotate, Llama 3's base.
fn rope(c: &mut Ctx<'_>, layout: RopeLayout, backward: bool) -> Result<Case> {
    let shape = RopeShape {
        seqs: 2,
        rows: 5,
        heads: 3,
        head_dim: 10,
        rotary_dim: 8,
        positions: 48,
    };
    let base = 500_000.0;
    let n = shape.seqs * shape.rows * shape.heads * shape.head_dim;
    let starts_h = vec![40u32, 0];
    let table_h = wgrad::ops::rope_table(base, shape.rotary_dim, shape.positions)?;
    let x_h = c.vals(n, -1.0, 1.0);
    let (x, starts, table, out) = (c.up(&x_h)?, c.up_u32(&starts_h)?, c.up(&table_h)?, c.k.zeros(n)?);
    let (d, want) = if backward {
        (
            c.k.rope_backward(out.view(), x.view(), starts.view(), table.view(), shape, layout)?,
            cpu::rope_backward(&x_h, &starts_h, shape, layout, base),
        )
    } else {
        (
            c.k.rope_forward(out.view(), x.view(), starts.view(), table.view(), shape, layout)?,
            cpu::rope_forward(&x_h, &starts_h, shape, layout, base),
        )
    };
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} {layout:?} 2 seqs x 5 rows, 3 heads of 10 (8 rotary)"),
        vec![d],
        vec![expect("out", &out, want, ROTATION.0, ROTATION.1)],
    ))
}

fn attention(c: &mut Ctx<'_>) -> Result<Case> {
    attention_case(c, None, 5)
}

// ---- lora.wgsl ---------------------------------------------------------

/// Three sequences of 2 rows over adapters of ranks 1, 9 and 0 (absent
/// from this Linear), one sequence with none: the shrink into h, then the
/// expand from it.
fn lora(c: &mut Ctx<'_>) -> Result<Case> {
    let (seqs, per, cols_in, cols_out) = (3, 2, 67, 13);
    let ranks = [1usize, 9, 0];
    let shape = wgrad::kernels::LoraShape {
        seqs,
        rows: seqs * per,
        cols: cols_in,
        width: 9,
        adapters: ranks.len(),
        ranks: 10,
    };
    let out_shape = wgrad::kernels::LoraShape {
        cols: cols_out,
        ..shape
    };
    let meta_h = vec![0.0, 1.0, 2.0, 1.0, 9.0, -0.5, 0.0, 0.0, 0.0];
    let index_h = [1u32, wgrad::kernels::NO_ADAPTER, 0];
    let (x_h, a_h) = (c.vals(shape.rows * cols_in, -1.0, 1.0), c.vals(10 * cols_in, -1.0, 1.0));
    let (y_h, bt_h) = (
        c.vals(shape.rows * cols_out, -1.0, 1.0),
        c.vals(10 * cols_out, -1.0, 1.0),
    );
    let (x, a, y, bt) = (c.up(&x_h)?, c.up(&a_h)?, c.up(&y_h)?, c.up(&bt_h)?);
    let (meta, index) = (c.up(&meta_h)?, c.up_u32(&index_h)?);
    let (h, out) = (c.k.zeros(shape.rows * shape.width)?, c.k.zeros(shape.rows * cols_out)?);
    let shrink =
        c.k.lora_shrink(h.view(), x.view(), a.view(), meta.view(), index.view(), shape)?;
    let expand = c.k.lora_expand(
        out.view(),
        y.view(),
        h.view(),
        bt.view(),
        meta.view(),
        index.view(),
        out_shape,
    )?;
    let want_h = cpu::lora_shrink(&x_h, &a_h, &meta_h, &index_h, shape);
    let want = cpu::lora_expand(&y_h, &want_h, &bt_h, &meta_h, &index_h, out_shape);
    Ok(Case::new(
        &["lora_shrink", "lora_expand"],
        "lora_shrink + lora_expand: 3 seqs x 2 rows, 67 -> 13, ranks 1, 9 and 0",
        vec![shrink, expand],
        vec![
            expect("h", &h, want_h, SUMS.0, SUMS.1),
            expect("out", &out, want, SUMS.0, SUMS.1),
        ],
    ))
}

/// The CPU adapters' kernel for grouped-query attention (vec4 reads: a
/// head_dim of 8), whichever the adapter would pick.
fn grouped_attention(c: &mut Ctx<'_>) -> Result<Case> {
    attention_case(c, Some(wgrad::kernels::CachedAttentionKernel::Grouped), 8)
}

/// The CPU adapters' kernel for wide heads: a head_dim of 40 (10 vec4s
/// over 8 lanes, so the second vec4 of most lanes is past the head).
fn channel_attention(c: &mut Ctx<'_>) -> Result<Case> {
    attention_case(c, Some(wgrad::kernels::CachedAttentionKernel::Channels), 40)
}

/// Grouped-query attention over separate q, k, v (Llama's): 4 query heads
/// sharing 2 KV heads of `head_dim`, by `kernel` (None: the adapter's pick).
fn attention_case(
    c: &mut Ctx<'_>,
    kernel: Option<wgrad::kernels::CachedAttentionKernel>,
    head_dim: usize,
) -> Result<Case> {
    let shape = CachedAttentionShape {
        seqs: 2,
        rows: 3,
        heads: 4,
        kv_heads: 2,
        head_dim,
        context: 11,
        layout: QkvLayout::Separate,
        // Shorter than the later rows' positions: the sliding window's
        // first position moves past 0.
        window: Some(3),
    };
    let lengths = shape.lengths().ok_or_else(|| Error::InvalidArgument {
        op: "shaders --dump",
        reason: "attention shape overflows".into(),
    })?;
    // Sequence 0 continues after 4 cached positions, sequence 1 starts.
    let starts_h = vec![4u32, 0];
    let (q_h, k_h, v_h) = (
        c.vals(lengths.q, -1.0, 1.0),
        c.vals(lengths.k, -1.0, 1.0),
        c.vals(lengths.v, -1.0, 1.0),
    );
    let (k0, v0) = (c.vals(lengths.cache, -1.0, 1.0), c.vals(lengths.cache, -1.0, 1.0));
    let (q, k, v, starts) = (c.up(&q_h)?, c.up(&k_h)?, c.up(&v_h)?, c.up_u32(&starts_h)?);
    let (kc, vc, out) = (c.up(&k0)?, c.up(&v0)?, c.k.zeros(lengths.out)?);
    let views = (
        out.view(),
        kc.view(),
        vc.view(),
        q.view(),
        k.view(),
        v.view(),
        starts.view(),
    );
    let d = match kernel {
        Some(kernel) => c.k.cached_attention_forward_with(
            kernel, views.0, views.1, views.2, views.3, views.4, views.5, views.6, shape,
        )?,
        None => {
            c.k.cached_attention_forward(views.0, views.1, views.2, views.3, views.4, views.5, views.6, shape)?
        }
    };
    let (want, keys, values) = cpu::cached_attention(&q_h, &k_h, &v_h, &starts_h, &k0, &v0, shape);
    let expected = vec![
        expect("out", &out, want, ROW.0 * 5.0, ROW.1),
        expect("k_cache", &kc, keys, EXACT.0, EXACT.1),
        expect("v_cache", &vc, values, EXACT.0, EXACT.1),
    ];
    // Without a kernel named: the per-invocation kernel on CPU adapters,
    // the workgroup one on GPUs.
    let entry = d.kernel().entry;
    Ok(Case::new(
        &[entry],
        format!("{entry} 2 seqs x 3 rows, 4 heads over 2 KV heads of {head_dim}, context 11, window 3"),
        vec![d],
        expected,
    ))
}

/// Fused causal attention forward and backward, chained as a training step
/// runs them: 4 query heads over 2 KV heads of 5 channels, 67 rows (past
/// one 64-row block), a sliding window of 29 (the second block's keys
/// start past 0), with the entries the kernels' shaping picks (the
/// register-blocked ones on a CPU adapter, the tiled ones on a GPU).
fn flash_attention(c: &mut Ctx<'_>) -> Result<Case> {
    let shape = FlashAttentionShape {
        batch: 2,
        seq: 67,
        heads: 4,
        kv_heads: 2,
        head_dim: 5,
        window: Some(29),
    };
    let (q_len, kv_len, rows) = shape.lengths().ok_or_else(|| Error::InvalidArgument {
        op: "shaders --dump",
        reason: "attention shape overflows".into(),
    })?;
    let (q_h, k_h, v_h, dout_h) = (
        c.vals(q_len, -1.0, 1.0),
        c.vals(kv_len, -1.0, 1.0),
        c.vals(kv_len, -1.0, 1.0),
        c.vals(q_len, -1.0, 1.0),
    );
    let (q, k, v, dout) = (c.up(&q_h)?, c.up(&k_h)?, c.up(&v_h)?, c.up(&dout_h)?);
    let (out, lse, delta) = (c.k.zeros(q_len)?, c.k.zeros(rows)?, c.k.zeros(rows)?);
    let (dq, dk, dv) = (c.k.zeros(q_len)?, c.k.zeros(kv_len)?, c.k.zeros(kv_len)?);
    let dispatches = vec![
        c.k.flash_attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), shape)?,
        c.k.flash_attention_backward_prepare(delta.view(), dout.view(), out.view(), shape)?,
        c.k.flash_attention_backward_query(
            dq.view(),
            dout.view(),
            q.view(),
            k.view(),
            v.view(),
            lse.view(),
            delta.view(),
            shape,
        )?,
        c.k.flash_attention_backward_key_value(
            dk.view(),
            dv.view(),
            dout.view(),
            q.view(),
            k.view(),
            v.view(),
            lse.view(),
            delta.view(),
            shape,
        )?,
    ];
    let (want_out, want_lse) = cpu::flash_attention_forward(&q_h, &k_h, &v_h, shape);
    let want_delta = cpu::flash_attention_backward_prepare(&dout_h, &want_out, shape);
    let grads = cpu::flash_attention_backward(&dout_h, &q_h, &k_h, &v_h, &want_lse, &want_delta, shape);
    // Rows of weighted means; gradients sum up to 2 heads × 67 rows.
    let expected = vec![
        expect("out", &out, want_out, ROW.0 * 5.0, ROW.1),
        expect("lse", &lse, want_lse, ROW.0 * 5.0, ROW.1),
        expect("delta", &delta, want_delta, ROW.0 * 5.0, ROW.1),
        expect("dq", &dq, grads.dq, 1e-4, 1e-3),
        expect("dk", &dk, grads.dk, 1e-4, 1e-3),
        expect("dv", &dv, grads.dv, 1e-4, 1e-3),
    ];
    let entries: Vec<&'static str> = dispatches.iter().map(|d| d.kernel().entry).collect();
    let name = format!(
        "{} and backward, 2 seqs x 67 rows, 4 heads over 2 KV heads of 5, window 29",
        entries[0]
    );
    Ok(Case::new(&entries, name, dispatches, expected))
}

/// Rows over several settings: greedy, top-k, the whole vocabulary and
/// top-p, top-k and top-p, a row with an infinite logit. Logits are distinct (ties would make the pick
/// depend on tie-breaking) and each u is kept away from the running sums'
/// boundaries, where f32 and the twin's f64 could pick neighbours.
fn sample_rows(c: &mut Ctx<'_>) -> Result<Case> {
    let (rows, vocab) = (5, 300);
    let mut logits_h = c.distinct(rows * vocab, -4.0, 4.0);
    logits_h[4 * vocab + 17] = f32::INFINITY;
    let settings = [
        (0.0f32, 5u32, 1.0f32),
        (0.8, 5, 1.0),
        (1.3, vocab as u32, 0.9),
        (0.7, 40, 0.5),
        (1.0, 10, 1.0),
    ];
    let mut draws_h = Vec::new();
    for (r, &(temperature, top_k, top_p)) in settings.iter().enumerate() {
        let row = &logits_h[r * vocab..(r + 1) * vocab];
        if row.iter().any(|v| !v.is_finite()) {
            draws_h.extend([0.5, temperature, top_p]);
            continue;
        }
        let candidates = cpu::sampling_candidates(row, temperature, top_k, top_p);
        let total: f64 = candidates.iter().map(|(_, w)| w).sum();
        let bounds: Vec<f64> = candidates
            .iter()
            .scan(0.0, |s, (_, w)| {
                *s += w;
                Some(*s / total)
            })
            .collect();
        let u = (1..100)
            .map(|i| i as f64 * 0.0097 + 0.013)
            .find(|u| bounds.iter().all(|b| (b - u).abs() > 1e-3))
            .unwrap_or(0.5);
        draws_h.extend([u as f32, temperature, top_p]);
    }
    let top_k_h: Vec<u32> = settings.iter().map(|s| s.1).collect();
    let (logits, draws, top_k, out) = (
        c.up(&logits_h)?,
        c.up(&draws_h)?,
        c.up_u32(&top_k_h)?,
        c.k.zeros(rows * 2)?,
    );
    let d =
        c.k.sample_rows(out.view(), logits.view(), draws.view(), top_k.view(), rows, vocab)?;
    let want = cpu::sample_rows(&logits_h, &draws_h, &top_k_h, rows, vocab);
    Ok(Case::new(
        &["sample_rows_forward"],
        format!("sample_rows_forward {rows}x{vocab}"),
        vec![d],
        vec![expect_u32("out", &out, want)],
    ))
}

// ---- f16_weights.wgsl --------------------------------------------------

/// A·Bᵀ with f16 weights and the forward epilogue (bias, ReLU, the
/// pre-activation kept): `None` lets the shape pick (2 rows, k a multiple
/// of 8: the matrix-vector kernel with the adapter's lanes), else the
/// kernel named.
fn f16_weights(c: &mut Ctx<'_>, kernel: Option<F16WeightsKernel>) -> Result<Case> {
    let (m, n, kk): (usize, usize, usize) = match kernel {
        None | Some(F16WeightsKernel::Matvec { .. }) => (2, 37, 24),
        Some(_) => (37, 29, 19),
    };
    let (a_h, b_h, bias_h) = (
        c.vals(m * kk, -1.0, 1.0),
        f16s(&c.vals(n * kk, -1.0, 1.0)),
        c.vals(n, -1.0, 1.0),
    );
    let (a, b, bias, out, pre) = (
        c.up(&a_h)?,
        c.k.upload_f16(&b_h)?,
        c.up(&bias_h)?,
        c.k.zeros(m * n)?,
        c.k.zeros(m * n)?,
    );
    let epilogue = MatmulEpilogue {
        bias: Some(bias.view()),
        activation: Some((Activation::Relu, Some(pre.view()))),
        ..MatmulEpilogue::default()
    };
    let d = match kernel {
        None => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
            out.view(),
            a.view(),
            MatmulOperand::F16Weight(b.view()),
        )?,
        Some(kernel) => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk)
                .with_kernel(MatmulKernel::F16Weights(kernel))
                .with_epilogue(epilogue),
            out.view(),
            a.view(),
            MatmulOperand::F16Weight(b.view()),
        )?,
    };
    let entry = d.kernel().entry;
    let lanes = match d.recipe().constants.iter().find(|(name, _)| *name == "MATVEC_WG") {
        Some((_, v)) => format!(", {v} lanes"),
        None => String::new(),
    };
    let e = cpu::Epilogue {
        bias: Some(&bias_h),
        activation: Some(Activation::Relu),
        ..cpu::Epilogue::default()
    };
    let (want, want_pre) = cpu::matmul_f16_weights(e, &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &[entry],
        format!("{entry} {m}x{n}x{kk} +bias relu{lanes}"),
        vec![d],
        vec![
            expect("c", &out, want, SUMS.0, SUMS.1),
            expect("pre", &pre, want_pre, SUMS.0, SUMS.1),
        ],
    ))
}

/// The tiled f16-weight matmul with 8-weight loads (k a multiple of 8).
fn f16_weights_shared_vec(c: &mut Ctx<'_>) -> Result<Case> {
    let (m, n, kk) = (37, 29, 24);
    let (a_h, b_h) = (c.vals(m * kk, -1.0, 1.0), f16s(&c.vals(n * kk, -1.0, 1.0)));
    let (a, b, out) = (c.up(&a_h)?, c.k.upload_f16(&b_h)?, c.k.zeros(m * n)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_kernel(MatmulKernel::F16Weights(F16WeightsKernel::Shared)),
        out.view(),
        a.view(),
        MatmulOperand::F16Weight(b.view()),
    )?;
    let entry = d.kernel().entry;
    let (want, _) = cpu::matmul_f16_weights(cpu::Epilogue::default(), &a_h, &b_h, m, n, kk);
    Ok(Case::new(
        &[entry],
        format!("{entry} {m}x{n}x{kk}"),
        vec![d],
        vec![expect("c", &out, want, SUMS.0, SUMS.1)],
    ))
}

fn embedding_f16(c: &mut Ctx<'_>) -> Result<Case> {
    let (n, vocab, channels) = (37, 23, 29);
    let (table_h, ids_h) = (f16s(&c.vals(vocab * channels, -1.0, 1.0)), c.ids(n, vocab as u32));
    let (table, ids, out) = (c.k.upload_f16(&table_h)?, c.up_u32(&ids_h)?, c.k.zeros(n * channels)?);
    let d =
        c.k.embedding_f16_weights(out.view(), table.view(), ids.view(), n, vocab, channels)?;
    let want = cpu::embedding_f16_weights(&table_h, &ids_h, vocab, channels);
    Ok(Case::new(
        &["embedding_f16w_forward"],
        format!("embedding_f16w_forward {n} ids, {vocab}x{channels}"),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

// ---- quant_weights.wgsl ------------------------------------------------

/// f32 sums of up to a few hundred terms whose integers' products are
/// summed before scaling (up to 15 times the weights' magnitude).
const QUANT_SUMS: (f64, f64) = (2e-4, 2e-5);

/// The formats after Q4_1: random bytes, each f16 scale (d, then m or dmin)
/// drawn from a range that keeps the weights within about ±1 whatever the
/// integers and sub-scales.
fn new_format_blocks(c: &mut Ctx<'_>, format: QuantFormat, rows: usize, cols: usize) -> Vec<u8> {
    let ranges: [(f32, f32); 2] = match format {
        QuantFormat::Q5_0 => [(0.02, 0.06), (0.0, 0.0)],
        QuantFormat::Q5_1 => [(0.01, 0.03), (-0.5, 0.0)],
        QuantFormat::IQ4_NL => [(0.002, 0.008), (0.0, 0.0)],
        QuantFormat::Q2_K => [(0.005, 0.02), (0.005, 0.02)],
        QuantFormat::Q3_K => [(0.002, 0.008), (0.0, 0.0)],
        QuantFormat::Q4_K => [(0.0005, 0.001), (0.002, 0.008)],
        QuantFormat::Q5_K => [(0.0003, 0.0005), (0.002, 0.008)],
        _ => [(0.0001, 0.0002), (0.0, 0.0)],
    };
    let blocks = rows * cols / format.super_block();
    let mut raw: Vec<u8> = (0..blocks * format.block_bytes())
        .map(|_| c.rng.random::<u8>())
        .collect();
    for block in raw.chunks_exact_mut(format.block_bytes()) {
        for (&at, &(lo, hi)) in format.scale_offsets().iter().zip(&ranges) {
            block[at..at + 2].copy_from_slice(&f16::from_f32(c.rng.random_range(lo..=hi)).to_le_bytes());
        }
    }
    raw
}

/// A [rows, cols] `format` matrix as a GGUF file stores it: random
/// integers, and scales (and Q4_1's minimum, in [-0.5, 0)) that keep the
/// weights within about ±1.
fn quant_blocks(c: &mut Ctx<'_>, format: QuantFormat, rows: usize, cols: usize) -> Vec<u8> {
    if !matches!(format, QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q4_1) {
        return new_format_blocks(c, format, rows, cols);
    }
    let mut raw = Vec::new();
    let scale = if format == QuantFormat::Q8_0 { 0.008 } else { 0.06 };
    for _ in 0..rows * cols / QuantFormat::BLOCK {
        raw.extend_from_slice(&f16::from_f32(c.rng.random_range(scale / 4.0..scale)).to_le_bytes());
        if format == QuantFormat::Q4_1 {
            raw.extend_from_slice(&f16::from_f32(c.rng.random_range(-0.5..0.0)).to_le_bytes());
        }
        raw.extend((0..format.quant_words() * 4).map(|_| c.rng.random::<u8>()));
    }
    raw
}

/// A·Bᵀ with quantized weights and the forward epilogue (bias, ReLU, the
/// pre-activation kept): `None` lets the shape pick (2 rows: the
/// matrix-vector kernel with the adapter's lanes), else the kernel named.
fn quant_weights(c: &mut Ctx<'_>, format: QuantFormat, kernel: Option<QuantWeightsKernel>) -> Result<Case> {
    let (m, n, kk): (usize, usize, usize) = match kernel {
        None | Some(QuantWeightsKernel::Matvec { .. } | QuantWeightsKernel::MatvecColumns) => (2, 37, 96),
        Some(QuantWeightsKernel::Tiled) => (37, 29, 64),
        // Two groups of rows, the second partial; two workgroups of columns.
        Some(QuantWeightsKernel::MatvecRows | QuantWeightsKernel::MatvecRowsSubgroup) => (5, 67, 96),
    };
    // A k-quant's rows are whole 256-value super-blocks.
    let kk = kk.next_multiple_of(format.super_block());
    let (a_h, bias_h) = (c.vals(m * kk, -1.0, 1.0), c.vals(n, -1.0, 1.0));
    let raw = quant_blocks(c, format, n, kk);
    let words = c.up_u32(&wgrad::kernels::pack_quantized(format, &raw, n, kk)?)?;
    let (a, bias, out, pre) = (c.up(&a_h)?, c.up(&bias_h)?, c.k.zeros(m * n)?, c.k.zeros(m * n)?);
    let b = QuantView::new(words.view(), format, n, kk)?;
    let epilogue = MatmulEpilogue {
        bias: Some(bias.view()),
        activation: Some((Activation::Relu, Some(pre.view()))),
        ..MatmulEpilogue::default()
    };
    let d = match kernel {
        None => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
            out.view(),
            a.view(),
            b,
        )?,
        Some(kernel) => c.k.matmul(
            &MatmulRequest::new(MatmulForm::ABt, m, n, kk)
                .with_kernel(MatmulKernel::Quant(kernel))
                .with_epilogue(epilogue),
            out.view(),
            a.view(),
            b,
        )?,
    };
    let entry = d.kernel().entry;
    let e = cpu::Epilogue {
        bias: Some(&bias_h),
        activation: Some(Activation::Relu),
        ..cpu::Epilogue::default()
    };
    let (want, want_pre) = cpu::matmul_quant_weights(e, &a_h, format, &raw, m, n, kk)?;
    let name = format!("{entry} {format:?} {m}x{n}x{kk} +bias relu");
    Ok(Case::new(
        &[entry],
        name,
        vec![d],
        vec![
            expect("c", &out, want, QUANT_SUMS.0, QUANT_SUMS.1),
            expect("pre", &pre, want_pre, QUANT_SUMS.0, QUANT_SUMS.1),
        ],
    ))
}

fn embedding_quant(c: &mut Ctx<'_>, format: QuantFormat) -> Result<Case> {
    let (n, vocab, channels) = (37, 23, 64usize.next_multiple_of(format.super_block()));
    let (raw, ids_h) = (quant_blocks(c, format, vocab, channels), c.ids(n, vocab as u32));
    let (words, ids, out) = (
        c.up_u32(&wgrad::kernels::pack_quantized(format, &raw, vocab, channels)?)?,
        c.up_u32(&ids_h)?,
        c.k.zeros(n * channels)?,
    );
    let d = c.k.embedding_quant_weights(
        out.view(),
        QuantView::new(words.view(), format, vocab, channels)?,
        ids.view(),
        n,
    )?;
    let want = cpu::embedding_quant_weights(format, &raw, &ids_h, vocab, channels)?;
    // q·d + m: one rounding (q·d is exact, and a k-quant's d·s, q·(d·s)
    // and dmin·m), as the kernel's fma.
    Ok(Case::new(
        &["embedding_quant_forward"],
        format!("embedding_quant_forward {format:?} {n} ids, {vocab}x{channels}"),
        vec![d],
        vec![expect("out", &out, want, EXACT.0, EXACT.1)],
    ))
}

/// A frozen weight's backward dX = dY·W through its quantized rows
/// (`matmul_quant_transposed`): W [37, n] as a GGUF file stores it, 29
/// rows of dY (a partial 8-row group), C accumulated into.
fn quant_transposed(c: &mut Ctx<'_>, format: QuantFormat) -> Result<Case> {
    let (m, n, kk) = (29, 96usize.next_multiple_of(format.super_block()), 37);
    let (a_h, start) = (c.vals(m * kk, -1.0, 1.0), c.vals(m * n, -1.0, 1.0));
    let raw = quant_blocks(c, format, kk, n);
    let words = c.up_u32(&wgrad::kernels::pack_quantized(format, &raw, kk, n)?)?;
    let (a, out) = (c.up(&a_h)?, c.up(&start)?);
    let d = c.k.matmul(
        &MatmulRequest::new(MatmulForm::AB, m, n, kk).accumulating(true),
        out.view(),
        a.view(),
        QuantView::new(words.view(), format, kk, n)?,
    )?;
    let mut want = cpu::matmul_quant_transposed(&a_h, format, &raw, m, n, kk)?;
    want.iter_mut().zip(&start).for_each(|(w, s)| *w += s);
    Ok(Case::new(
        &["matmul_quant_transposed"],
        format!("matmul_quant_transposed {format:?} {m}x{n}x{kk} +=C"),
        vec![d],
        vec![expect("c", &out, want, QUANT_SUMS.0, QUANT_SUMS.1)],
    ))
}

// ---- writing -----------------------------------------------------------

/// WebGPU's names of the features a family needs.
fn webgpu_features(family: Family) -> Vec<&'static str> {
    let needs = family.required_features();
    let mut names = Vec::new();
    if needs.contains(wgpu::Features::SHADER_F16) {
        names.push("shader-f16");
    }
    if needs.contains(wgpu::Features::SUBGROUP) {
        names.push("subgroups");
    }
    names
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::DataIo {
        op: "shaders --dump",
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `got` matches an expectation, as the page compares: the largest
/// error and the first element out of tolerance.
fn compare(e: &Expect, got: &[u8]) -> (f64, Option<usize>) {
    let got_values: Vec<f64> = match &e.values {
        Values::F32(_) => bytemuck::pod_collect_to_vec::<u8, f32>(got)
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
        Values::U32(_) => bytemuck::pod_collect_to_vec::<u8, u32>(got)
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
        Values::F16(_) => bytemuck::pod_collect_to_vec::<u8, u16>(got)
            .iter()
            .map(|&v| f64::from(f16::from_bits(v).to_f32()))
            .collect(),
    };
    let want: Vec<f64> = match &e.values {
        Values::F32(v) | Values::F16(v) => v.iter().map(|&x| f64::from(x)).collect(),
        Values::U32(v) => v.iter().map(|&x| f64::from(x)).collect(),
    };
    let got_values = if e.sum {
        vec![got_values.iter().sum()]
    } else {
        got_values
    };
    let mut worst = (0.0f64, None);
    for (i, (g, w)) in got_values.iter().zip(&want).enumerate() {
        let err = if g == w { 0.0 } else { (g - w).abs() };
        let err = if err.is_nan() { f64::INFINITY } else { err };
        worst.0 = worst.0.max(err);
        if err > e.atol + e.rtol * w.abs() && worst.1.is_none() {
            worst.1 = Some(i);
        }
    }
    (worst.0, worst.1)
}

/// What writing the cases found: how many, and those whose native run
/// (on the adapter that built them) disagreed with the twin.
pub struct Written {
    pub built: usize,
    pub unbuilt: Vec<String>,
    pub native_failures: Vec<String>,
}

/// The kernels cases are built with (see [`On`]).
pub struct CaseKernels<'k> {
    pub web: &'k Kernels,
    pub full: &'k Kernels,
    pub split: &'k Kernels,
    pub gpu: &'k Kernels,
}

impl CaseKernels<'_> {
    fn get(&self, on: On) -> &Kernels {
        match on {
            On::Web => self.web,
            On::Full => self.full,
            On::Split => self.split,
            On::Gpu => self.gpu,
        }
    }
}

/// Builds every case (see [`On`] for the kernels each is built with) and
/// writes `dir/cases.json`
/// and `dir/cases/*.bin`. Each case in the JSON:
/// - `name`, `entries` (the entry points it represents), `note`;
/// - `features` (WebGPU feature names), `subgroup_size` (exact lanes
///   needed, or null), `limits` (WebGPU limits above the defaults it needs);
/// - `data`: its .bin file; `buffers`: `{size, data: [offset, bytes]}`,
///   each buffer's initial contents;
/// - `launches`, in order, one compute pass: `{entry, module, constants,
///   workgroups: [x, y, z], bindings: [{slot, name, writable, buffer,
///   offset, size}], params: {slot, data: [offset, bytes]}}`;
/// - `expected`: `{name, buffer, offset (bytes), count, dtype (f32, u32,
///   or f16: packed on the GPU, f32 in the file), compare (elementwise or
///   sum), atol, rtol, source, data: [offset, bytes]}`;
/// - `scratch`: writable bindings left unchecked, with why;
/// - `native`: with `check_native`, the same comparison on the adapter that
///   built the case (which compiles every pipeline: on a cold Mesa cache,
///   ~30 s more for the register-blocked matmuls);
/// - `unbuilt`: the reason, for a case the adapter could not build.
pub fn write_cases(dir: &Path, kernels: &CaseKernels<'_>, check_native: bool) -> Result<Written> {
    let planned = plan(kernels)?;
    let cases_dir = dir.join("cases");
    std::fs::create_dir_all(&cases_dir).map_err(|e| io(&cases_dir, e))?;
    let mut json_cases = Vec::new();
    let mut written = Written {
        built: 0,
        unbuilt: Vec::new(),
        native_failures: Vec::new(),
    };
    for (index, p) in planned.into_iter().enumerate() {
        let case = match p {
            Ok(case) => case,
            Err((entries, reason)) => {
                written.unbuilt.push(format!("{}: {reason}", entries.join(", ")));
                json_cases.push(json!({ "name": entries.join(" + "), "entries": entries, "unbuilt": reason }));
                continue;
            }
        };
        let k = kernels.get(case.on);
        let file = format!("cases/{index:02}_{}.bin", case.entries[0]);
        let (value, failure) = write_case(k, dir, &file, &case, check_native)?;
        if let Some(f) = failure {
            written.native_failures.push(f);
        }
        written.built += 1;
        json_cases.push(value);
    }
    let info = kernels.web.device().info();
    let doc = json!({
        "built_on": format!("{} ({:?}, {})", info.name, info.backend, info.driver_info),
        "cases": json_cases,
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::InvalidArgument {
        op: "shaders --dump",
        reason: e.to_string(),
    })?;
    let path = dir.join("cases.json");
    std::fs::write(&path, text).map_err(|e| io(&path, e))?;
    Ok(written)
}

/// One case: reads its buffers before anything runs, with `check_native`
/// runs it natively to check the expectations there too, writes its data
/// file and returns its JSON and, when the native run disagrees with the
/// twin, why.
fn write_case(k: &Kernels, dir: &Path, file: &str, case: &Case, check_native: bool) -> Result<(Value, Option<String>)> {
    let launches: Vec<&Dispatch> = case.dispatches.iter().flat_map(|d| d.each_launch()).collect();
    let mut buffers: Vec<wgpu::Buffer> = Vec::new();
    let mut index_of = |b: &wgpu::Buffer| match buffers.iter().position(|x| x == b) {
        Some(i) => i,
        None => {
            buffers.push(b.clone());
            buffers.len() - 1
        }
    };
    let mut blob: Vec<u8> = Vec::new();
    let mut put = |bytes: &[u8]| -> [usize; 2] {
        let at = blob.len();
        blob.extend_from_slice(bytes);
        // Each piece 4-byte aligned, so the page can view it as u32/f32.
        blob.resize(blob.len().next_multiple_of(4), 0);
        [at, bytes.len()]
    };
    let mut json_launches = Vec::new();
    let mut max_storage = 0u32;
    let mut features: Vec<&str> = Vec::new();
    let mut subgroup_size = None;
    let mut written_ranges: Vec<(usize, u64, u64, &'static str)> = Vec::new();
    for launch in &launches {
        let kernel = launch.kernel();
        let needs = reflect::entry_needs(kernel)?;
        max_storage = max_storage.max(needs.storage_buffers());
        for f in webgpu_features(kernel.family) {
            if !features.contains(&f) {
                features.push(f);
            }
        }
        if matches!(kernel.family, Family::MatmulSubgroup | Family::QuantWeightsSubgroup) {
            subgroup_size = Some(SUBGROUP_MATMUL_LANES);
        }
        let recipe = launch.recipe();
        let mut bindings = Vec::new();
        for b in &recipe.bindings {
            let buffer = index_of(&b.buffer);
            let writable = needs.is_writable(b.slot);
            if writable {
                written_ranges.push((buffer, b.offset, b.bytes, b.name));
            }
            bindings.push(json!({ "slot": b.slot, "name": b.name, "writable": writable, "buffer": buffer, "offset": b.offset, "size": b.bytes }));
        }
        let constants: serde_json::Map<String, Value> = recipe
            .constants
            .iter()
            .map(|(name, v)| (name.to_string(), json!(v)))
            .collect();
        json_launches.push(json!({
            "entry": kernel.entry,
            "module": format!("modules/{}.wgsl", kernel.family.name()),
            "constants": constants,
            "workgroups": launch.workgroups(),
            "bindings": bindings,
            "params": { "slot": recipe.params_slot, "data": put(&recipe.params) },
        }));
    }
    // Every expectation is a range of a bound buffer, and every writable
    // binding of a real tensor is checked or declared scratch.
    let mut json_expected = Vec::new();
    let mut expected_at = Vec::new();
    for e in &case.expected {
        let buffer = buffers
            .iter()
            .position(|b| *b == e.buffer)
            .ok_or_else(|| Error::InvalidArgument {
                op: "shaders --dump",
                reason: format!("case `{}`: the expected `{}` is in no bound buffer", case.name, e.name),
            })?;
        expected_at.push(buffer);
        json_expected.push(json!({
            "name": e.name, "buffer": buffer, "offset": e.offset, "count": e.elements, "dtype": e.values.dtype(),
            "compare": if e.sum { "sum" } else { "elementwise" }, "atol": e.atol, "rtol": e.rtol, "source": e.source,
            "data": put(&e.values.bytes()),
        }));
    }
    for (buffer, _, _, name) in &written_ranges {
        let internal = !buffers[*buffer].usage().contains(wgpu::BufferUsages::COPY_SRC);
        if !internal && !expected_at.contains(buffer) && !case.scratch.iter().any(|(s, _)| s == name) {
            return Err(Error::InvalidArgument {
                op: "shaders --dump",
                reason: format!(
                    "case `{}`: the writable `{name}` is neither checked nor scratch",
                    case.name
                ),
            });
        }
    }
    // Initial contents, before anything runs. wgrad's own placeholders
    // (bound where a layout has a slot the dispatch does not use) cannot be
    // copied from; wgpu zero-fills them and no kernel writes them.
    let mut json_buffers = Vec::new();
    for b in &buffers {
        let bytes: Vec<u8> = if b.usage().contains(wgpu::BufferUsages::COPY_SRC) {
            let words: Vec<u32> = k.read(wgrad::View {
                buffer: b,
                offset: 0,
                len: (b.size() / 4) as usize,
            })?;
            bytemuck::cast_slice(&words).to_vec()
        } else {
            vec![0; b.size() as usize]
        };
        json_buffers.push(json!({ "size": b.size(), "data": put(&bytes) }));
    }
    // The native run: the same comparison as the page's, on the adapter
    // that built the case, so a wrong expectation shows here first.
    let mut failure = None;
    let mut native = Vec::new();
    if check_native {
        k.run(&case.dispatches.iter().collect::<Vec<_>>())?;
    }
    for e in case.expected.iter().filter(|_| check_native) {
        let (words, bytes) = match e.values {
            Values::F16(_) => (e.elements.div_ceil(2), e.elements * 2),
            _ => (e.elements, e.elements * 4),
        };
        let words: Vec<u32> = k.read(wgrad::View {
            buffer: &e.buffer,
            offset: e.offset,
            len: words,
        })?;
        let bytes = &bytemuck::cast_slice::<u32, u8>(&words)[..bytes];
        let (err, bad) = compare(e, bytes);
        native.push(json!({ "name": e.name, "max_error": err, "pass": bad.is_none() }));
        if let Some(i) = bad {
            failure.get_or_insert_with(|| {
                format!(
                    "{}: `{}` element {i} off by {err:e} (atol {}, rtol {})",
                    case.name, e.name, e.atol, e.rtol
                )
            });
        }
    }
    let path = dir.join(file);
    std::fs::write(&path, &blob).map_err(|e| io(&path, e))?;
    let default_storage = wgpu::Limits::default().max_storage_buffers_per_shader_stage;
    let limits = if max_storage > default_storage {
        json!({ "maxStorageBuffersPerShaderStage": max_storage })
    } else {
        json!({})
    };
    let scratch: Vec<Value> = case
        .scratch
        .iter()
        .map(|(name, why)| json!({ "name": name, "why": why }))
        .collect();
    let value = json!({
        "name": case.name, "entries": case.entries, "note": case.note,
        "features": features, "subgroup_size": subgroup_size, "limits": limits,
        "data": file, "buffers": json_buffers, "launches": json_launches, "expected": json_expected,
        "scratch": scratch, "native": if check_native { json!(native) } else { Value::Null },
    });
    Ok((value, failure))
}
