//! Every kernel against its plain-Rust twin in `wgrad::cpu`, on every adapter
//! present, over seeded random data and shapes that include 1, primes and
//! non-multiples of the 64×64 matmul tile and the 256-wide workgroup.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, for_each_shaping, random_vec, rng};
use proptest::prelude::*;
use wgrad::kernels::{Activation, AdamConfig, Binary, MatmulEpilogue, MatmulForm, MatmulVariant, SgdConfig};
use wgrad::kernels::{MatmulKernel, MatmulRequest};
use wgrad::{cpu, Error, Kernels};

// The last three are multiples of 4 in every dimension, so
// `MatmulVariant::RegisterVec4` runs its vec4 kernel on them (edge tiles
// included); on the others it runs the scalar register kernel.
pub(crate) const MATMUL_SHAPES: [(usize, usize, usize); 15] = [
    (1, 1, 1),
    (1, 7, 1),
    (7, 1, 13),
    (2, 3, 5),
    (13, 17, 19),
    (64, 64, 64),
    (65, 63, 67),
    (127, 129, 31),
    (31, 200, 257),
    (257, 1, 3),
    (1, 300, 130),
    (96, 160, 1),
    (4, 4, 4),
    (68, 132, 20),
    (132, 64, 12),
];

fn check_matmul(
    k: &Kernels,
    variant: MatmulVariant,
    form: MatmulForm,
    m: usize,
    n: usize,
    kk: usize,
    seed: u64,
) -> wgrad::Result<()> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
    let b_host = random_vec(&mut r, kk * n, -1.0, 1.0);
    let a = k.upload(&a_host)?;
    let b = k.upload(&b_host)?;
    let c = k.zeros(m * n)?;
    k.run(&[&k.matmul(
        &MatmulRequest::new(form, m, n, kk).with_kernel(MatmulKernel::Tiled(variant)),
        c.view(),
        a.view(),
        b.view(),
    )?])?;
    let got = k.read::<f32>(c.view())?;
    let want = cpu::matmul(form, &a_host, &b_host, m, n, kk);
    // f32 accumulation over k terms of magnitude ≤ 1 vs an f64 reference:
    // the error grows at most linearly in k; 1e-6·k leaves a wide margin.
    let atol = 1e-6 * kk as f32 + 1e-6;
    assert_close(
        &format!("{variant:?} {form:?} m={m} n={n} k={kk}"),
        &got,
        &want,
        atol,
        1e-5,
    );
    Ok(())
}

#[test]
fn matmul_every_form_and_variant_matches_the_cpu() {
    for_each_adapter("matmul", |k| {
        // Subgroup runs only on adapters with 8-lane subgroups; its refusal
        // elsewhere is checked in matmul_variants_an_adapter_cannot_run_are_refused.
        for (variant, form) in common::variant_forms_to_test(k) {
            for (i, &(m, n, kk)) in MATMUL_SHAPES.iter().enumerate() {
                check_matmul(k, variant, form, m, n, kk, i as u64)?;
            }
        }
        Ok(())
    });
}

#[test]
fn a_vec4_product_falling_back_to_the_register_kernel_shares_its_pipelines() {
    for_each_adapter("matmul_vec4_fallback", |k| {
        // Off-4 shapes (as f16 operands) take RegisterVec4 to the register
        // kernel, which reads the form from strides: specialised as under
        // Register, not once more per form (seconds each on llvmpipe). The
        // vec4 entry itself is compiled per form.
        let (a, b, c) = (k.zeros(16)?, k.zeros(32)?, k.zeros(35)?);
        for form in MatmulForm::ALL {
            let (a_off4, b_off4) = (a.slice(0, 15)?, b.slice(0, 21)?);
            let register = k.matmul(
                &MatmulRequest::new(form, 5, 7, 3).with_kernel(MatmulKernel::Tiled(MatmulVariant::Register)),
                c.view(),
                a_off4,
                b_off4,
            )?;
            let fallback = k.matmul(
                &MatmulRequest::new(form, 5, 7, 3).with_kernel(MatmulKernel::Tiled(MatmulVariant::RegisterVec4)),
                c.view(),
                a_off4,
                b_off4,
            )?;
            assert_eq!(fallback.kernel().entry, "matmul_forward_register", "{form:?}");
            assert_eq!(fallback.recipe().constants, register.recipe().constants, "{form:?}");
            let vec4 = k.matmul(
                &MatmulRequest::new(form, 4, 8, 4).with_kernel(MatmulKernel::Tiled(MatmulVariant::RegisterVec4)),
                c.slice(0, 32)?,
                a.view(),
                b.view(),
            )?;
            assert_eq!(vec4.kernel().entry, "matmul_forward_register_vec4", "{form:?}");
            let trans = [
                ("TRANS_A", f64::from(u8::from(form == MatmulForm::AtB))),
                ("TRANS_B", f64::from(u8::from(form == MatmulForm::ABt))),
            ];
            assert!(
                trans.iter().all(|t| vec4.recipe().constants.contains(t)),
                "{form:?}: {:?}",
                vec4.recipe().constants
            );
        }
        Ok(())
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn matmul_random_shapes_match_the_cpu(m in 1usize..=128, n in 1usize..=128, kk in 1usize..=128, form in 0usize..3, seed in 0u64..1000) {
        for_each_adapter("matmul_random", |k| {
            check_matmul(k, k.matmul_variant(), MatmulForm::ALL[form], m, n, kk, seed)
        });
    }
}

/// Whether the workgroup-memory kernel loads vec4s for an m×n×k product in
/// `form` with operands at aligned offsets: A's stored rows (k, or m when
/// it is stored [k, m]) and B's (n, or k when stored [n, k]) multiples of 4.
fn shared_loads_vec4(form: MatmulForm, m: usize, n: usize, kk: usize) -> bool {
    let (trans_a, trans_b) = (form == MatmulForm::AtB, form == MatmulForm::ABt);
    (if trans_a { m } else { kk }) % 4 == 0 && (if trans_b { kk } else { n }) % 4 == 0
}

/// One product on the workgroup-memory kernel: `batch` matrices each of
/// A, B, C, A and B placed `pad` elements into their buffers, C starting
/// from random values when `accumulate`; checked against the twin. Returns
/// each launch's entry point.
#[allow(clippy::too_many_arguments)]
fn check_shared(
    k: &Kernels,
    form: MatmulForm,
    batch: usize,
    (m, n, kk): (usize, usize, usize),
    pad: usize,
    accumulate: bool,
    seed: u64,
) -> wgrad::Result<Vec<&'static str>> {
    let mut r = rng(seed);
    let (a_len, b_len) = (batch * m * kk, batch * kk * n);
    let a_host = random_vec(&mut r, a_len, -1.0, 1.0);
    let b_host = random_vec(&mut r, b_len, -1.0, 1.0);
    let c0 = random_vec(&mut r, batch * m * n, -1.0, 1.0);
    // Whatever precedes the operands in their buffers must not be read.
    let padded = |x: &[f32]| -> Vec<f32> { [vec![f32::NAN; pad], x.to_vec()].concat() };
    let (a, b, c) = (k.upload(&padded(&a_host))?, k.upload(&padded(&b_host))?, k.upload(&c0)?);
    let (a_view, b_view) = (a.slice(pad, a_len)?, b.slice(pad, b_len)?);
    let d = if batch == 1 {
        let epilogue = MatmulEpilogue {
            accumulate,
            ..MatmulEpilogue::default()
        };
        k.matmul(
            &MatmulRequest::new(form, m, n, kk)
                .with_kernel(MatmulKernel::Tiled(MatmulVariant::Shared))
                .with_epilogue(epilogue),
            c.view(),
            a_view,
            b_view,
        )?
    } else {
        k.matmul(
            &MatmulRequest::new(form, m, n, kk)
                .with_kernel(MatmulKernel::Tiled(MatmulVariant::Shared))
                .with_batch(batch)
                .accumulating(accumulate),
            c.view(),
            a_view,
            b_view,
        )?
    };
    k.run(&[&d])?;
    let mut want = cpu::matmul_batched(form, &a_host, &b_host, batch, m, n, kk);
    if accumulate {
        want.iter_mut().zip(&c0).for_each(|(w, c)| *w += c);
    }
    // As check_matmul: f32 sums of k products of values in [-1, 1].
    let atol = 1e-6 * kk as f32 + 1e-6;
    assert_close(
        &format!("Shared {form:?} batch {batch} {m}×{n}×{kk} pad {pad} acc={accumulate}"),
        &k.read::<f32>(c.view())?,
        &want,
        atol,
        1e-5,
    );
    Ok(d.each_launch().map(|l| l.kernel().entry).collect())
}

#[test]
fn the_shared_kernel_takes_each_load_path_in_every_form() {
    for_each_adapter("matmul_shared_paths", |k| {
        // One step and fewer steps than a 16-step slice; one column; one
        // row; stored rows a multiple of 4 in one operand only (scalar
        // loads); several slices with a partial last one; and every
        // dimension a multiple of 4 (vec4 loads), edge tiles included.
        let shapes = [
            (5, 3, 1),
            (7, 9, 15),
            (64, 1, 33),
            (1, 64, 64),
            (67, 68, 40),
            (8, 12, 4),
            (68, 132, 36),
        ];
        // A storage-offset alignment into the buffers: still 16-byte
        // aligned, so the vec4 entry runs where the shape allows.
        let align = k.device().limits().min_storage_buffer_offset_alignment as usize / 4;
        for (f, form) in MatmulForm::ALL.into_iter().enumerate() {
            // Accumulation (an override: a pipeline per entry and form) in AB
            // only, on both entries and a batch: the load paths here and the
            // store are independent, and the epilogue test accumulates in
            // the other forms (AtB, ABᵀ).
            let accumulate = |s: usize| form == MatmulForm::AB && s.is_multiple_of(3);
            for (s, &(m, n, kk)) in shapes.iter().enumerate() {
                let entries = check_shared(
                    k,
                    form,
                    1,
                    (m, n, kk),
                    if s % 2 == 0 { 0 } else { align },
                    accumulate(s),
                    (f * 10 + s) as u64,
                )?;
                let want = if shared_loads_vec4(form, m, n, kk) {
                    "matmul_forward_shared_vec4"
                } else {
                    "matmul_forward_shared"
                };
                assert_eq!(entries, [want], "{form:?} {m}×{n}×{kk}");
            }
            // A batch of 3 (each matrix offset by the one before), on both
            // entries, accumulating (in AB) and not.
            check_shared(k, form, 3, (20, 24, 17), 0, accumulate(0), 50 + f as u64)?;
            check_shared(k, form, 3, (20, 24, 16), align, false, 60 + f as u64)?;
        }
        Ok(())
    });
}

#[test]
fn the_shared_kernel_splits_over_small_bindings_with_either_load() {
    for_each_adapter("matmul_shared_split", |k| {
        // 1 KiB bindings (plus one offset alignment, as f16_weights.rs's
        // split test): B of these head-like ABt products in blocks of its
        // rows, A and C in blocks of rows, each bound from the aligned
        // element before it (a block's matrix starts `base` elements in).
        // With k = 12 every launch loads vec4s, with k = 10 scalars.
        let align = u64::from(k.device().limits().min_storage_buffer_offset_alignment);
        let lim = common::limited_kernels(
            k,
            wgrad::kernels::LimitOverrides {
                max_storage_buffer_binding_size: Some(1024 + align.saturating_sub(4)),
                ..Default::default()
            },
        );
        for (i, kk) in [12usize, 10].into_iter().enumerate() {
            let (m, n) = (6, 150);
            let entries = check_shared(&lim, MatmulForm::ABt, 1, (m, n, kk), 0, i == 0, 70 + i as u64)?;
            assert!(entries.len() > 1, "k={kk}: {entries:?}");
            let want = if kk == 12 {
                "matmul_forward_shared_vec4"
            } else {
                "matmul_forward_shared"
            };
            assert!(entries.iter().all(|e| *e == want), "k={kk}: {entries:?}");
        }
        Ok(())
    });
}

#[test]
fn matmul_rejects_wrong_shapes_naming_the_kernel() {
    for_each_adapter("matmul_shapes", |k| {
        let a = k.zeros(6)?;
        let b = k.zeros(12)?;
        let c = k.zeros(8)?;
        // A is 2×3 and B 3×4, so C must be 2×4 = 8; claim k=4 instead.
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 4),
                c.view(),
                a.view(),
                b.view(),
            )
            .unwrap_err();
        match &err {
            Error::Shape { op, shapes, .. } => {
                // The entry of whichever variant this adapter's table runs.
                assert!(
                    op.starts_with("matmul_forward") || *op == "matmul_subgroup_forward",
                    "{err}"
                );
                assert_eq!(shapes, &vec![vec![2, 4], vec![4, 4], vec![2, 4]]);
            }
            other => panic!("expected a shape error, got {other}"),
        }
        assert!(k
            .matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 3),
                c.view(),
                a.view(),
                b.view()
            )
            .is_ok());
        assert!(matches!(
            k.matmul(
                &MatmulRequest::new(MatmulForm::AB, 0, 4, 3),
                c.view(),
                a.view(),
                b.view()
            ),
            Err(Error::Shape { .. })
        ));
        Ok(())
    });
}

const FLAT_SIZES: [usize; 6] = [1, 2, 255, 256, 257, 10_007];

#[test]
fn copy_vec4_copies_exactly_and_refuses_partial_vectors() {
    for_each_adapter("copy_vec4", |k| {
        // 1 vec4, a prime number of them, and lengths around the
        // 256-vec4 block one workgroup copies.
        for (i, vec4s) in [1usize, 7, 255, 256, 257, 1031].into_iter().enumerate() {
            let n = 4 * vec4s;
            let x_host = random_vec(&mut rng(90 + i as u64), n, -3.0, 3.0);
            let x = k.upload(&x_host)?;
            let out = k.upload(&vec![f32::NAN; n + 4])?;
            k.run(&[&k.copy_vec4(out.slice(0, n)?, x.view())?])?;
            let copied = k.read::<f32>(out.view())?;
            // A copy is exact: its reference is the input itself.
            assert_eq!(&copied[..n], &x_host[..], "copy of {n} floats");
            assert!(copied[n..].iter().all(|v| v.is_nan()), "wrote past the end at n={n}");
        }
        let x = k.zeros(8)?;
        let err = k.copy_vec4(x.slice(0, 6)?, x.slice(0, 6)?).unwrap_err();
        assert!(err.to_string().contains("multiple of 4"), "{err}");
        let err = k.copy_vec4(x.slice(4, 4)?, x.slice(1, 4)?).unwrap_err();
        assert!(err.to_string().contains("aligned"), "{err}");
        Ok(())
    });
}

#[test]
fn binary_scale_and_accumulate_match_the_cpu() {
    for_each_adapter("binary", |k| {
        for (i, &n) in FLAT_SIZES.iter().enumerate() {
            let mut r = rng(100 + i as u64);
            let x_host = random_vec(&mut r, n, -3.0, 3.0);
            let y_host = random_vec(&mut r, n, -3.0, 3.0);
            let x = k.upload(&x_host)?;
            let y = k.upload(&y_host)?;
            let out = k.zeros(n)?;
            for op in Binary::ALL {
                k.run(&[&k.binary(op, out.view(), x.view(), y.view())?])?;
                // One f32 rounding on each side: exact up to 1 ulp.
                assert_close(
                    &format!("{op:?} n={n}"),
                    &k.read::<f32>(out.view())?,
                    &cpu::binary(op, &x_host, &y_host),
                    1e-6,
                    1e-6,
                );
            }
            k.run(&[&k.scale(out.view(), x.view(), -0.37)?])?;
            assert_close(
                &format!("scale n={n}"),
                &k.read::<f32>(out.view())?,
                &cpu::scale(&x_host, -0.37),
                1e-6,
                1e-6,
            );
            // out already holds -0.37·x; adding x twice gives 1.63·x.
            let acc = k.add_assign(out.view(), x.view())?;
            k.run(&[&acc, &acc])?;
            let want: Vec<f32> = x_host.iter().map(|v| -0.37 * v + v + v).collect();
            assert_close(
                &format!("add_assign n={n}"),
                &k.read::<f32>(out.view())?,
                &want,
                1e-5,
                1e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn bias_add_broadcasts_over_rows() {
    for_each_adapter("bias_add", |k| {
        for &(rows, cols) in &[(1, 1), (1, 5), (7, 1), (13, 17), (300, 3), (2, 1000)] {
            let mut r = rng((rows * 1000 + cols) as u64);
            let x_host = random_vec(&mut r, rows * cols, -2.0, 2.0);
            let b_host = random_vec(&mut r, cols, -2.0, 2.0);
            let (x, b, out) = (k.upload(&x_host)?, k.upload(&b_host)?, k.zeros(rows * cols)?);
            k.run(&[&k.bias_add(out.view(), x.view(), b.view(), rows, cols)?])?;
            // Exact up to one rounding.
            assert_close(
                &format!("bias_add {rows}×{cols}"),
                &k.read::<f32>(out.view())?,
                &cpu::bias_add(&x_host, &b_host, cols),
                1e-6,
                1e-6,
            );
        }
        let (x, b, out) = (k.zeros(12)?, k.zeros(5)?, k.zeros(12)?);
        assert!(matches!(
            k.bias_add(out.view(), x.view(), b.view(), 3, 4),
            Err(Error::Shape {
                op: "bias_add_forward",
                ..
            })
        ));
        Ok(())
    });
}

#[test]
fn activations_and_their_backward_forms_match_the_cpu() {
    for_each_adapter("activations", |k| {
        for (i, &n) in FLAT_SIZES.iter().enumerate() {
            let mut r = rng(200 + i as u64);
            // Wide range, with exact zeros and large magnitudes (tanh/sigmoid saturation).
            let mut x_host = random_vec(&mut r, n, -8.0, 8.0);
            x_host[0] = 0.0;
            if n > 3 {
                x_host[1] = 60.0;
                x_host[2] = -60.0;
            }
            // Far past exp's f32 range in either sign (SiLU, sigmoid must not overflow).
            if n > 5 {
                x_host[3] = 100.0;
                x_host[4] = -100.0;
            }
            let dy_host = random_vec(&mut r, n, -1.0, 1.0);
            let (x, dy, out) = (k.upload(&x_host)?, k.upload(&dy_host)?, k.zeros(n)?);
            for act in Activation::ALL {
                k.run(&[&k.activation_forward(act, out.view(), x.view())?])?;
                // Transcendentals (exp, tanh) on GPUs are accurate to a few ulp.
                assert_close(
                    &format!("{act:?} forward n={n}"),
                    &k.read::<f32>(out.view())?,
                    &cpu::activation_forward(act, &x_host),
                    1e-5,
                    1e-4,
                );
                k.run(&[&k.activation_backward(act, out.view(), x.view(), dy.view())?])?;
                assert_close(
                    &format!("{act:?} backward n={n}"),
                    &k.read::<f32>(out.view())?,
                    &cpu::activation_backward(act, &x_host, &dy_host),
                    1e-5,
                    1e-4,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn reductions_match_the_cpu() {
    // Under GPU shaping the column sums of 256 rows and more run in two
    // stages (blocks of ⌈√rows⌉ rows): 255 / 256 rows, primes, one column.
    for_each_shaping("reductions", |k| {
        for &(rows, cols) in &[
            (1, 1),
            (1, 7),
            (7, 1),
            (13, 17),
            (300, 3),
            (2, 1000),
            (257, 255),
            (255, 2),
            (256, 1),
            (1031, 129),
            (4099, 3),
        ] {
            let mut r = rng((rows * 7 + cols) as u64);
            let x_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            let x = k.upload(&x_host)?;
            let what = format!("{rows}×{cols}, GPU shaping {}", k.gpu_shaped());
            let col_out = k.zeros(cols)?;
            k.run(&[&k.sum_rows(col_out.view(), x.view(), rows, cols)?])?;
            // Sums of `rows` terms of magnitude ≤ 1 in f32.
            let atol = 1e-6 * rows as f32 + 1e-6;
            assert_close(
                &format!("sum_rows {what}"),
                &k.read::<f32>(col_out.view())?,
                &cpu::sum_rows(&x_host, rows, cols),
                atol,
                1e-5,
            );
            let scalar = k.zeros(1)?;
            let n = rows * cols;
            k.run(&[&k.sum(scalar.view(), x.view())?])?;
            assert_close(
                &format!("sum {what}"),
                &k.read::<f32>(scalar.view())?,
                &[cpu::sum(&x_host)],
                1e-6 * n as f32 + 1e-6,
                1e-5,
            );
            k.run(&[&k.mean(scalar.view(), x.view())?])?;
            assert_close(
                &format!("mean {what}"),
                &k.read::<f32>(scalar.view())?,
                &[cpu::mean(&x_host)],
                1e-6,
                1e-5,
            );
            let row_out = k.zeros(rows)?;
            k.run(&[&k.max_rows(row_out.view(), x.view(), rows, cols)?])?;
            // max is exact.
            assert_eq!(
                k.read::<f32>(row_out.view())?,
                cpu::max_rows(&x_host, rows, cols),
                "max_rows {what}"
            );
            k.run(&[&k.argmax_rows(row_out.view(), x.view(), rows, cols)?])?;
            assert_eq!(
                k.read::<u32>(row_out.view())?,
                cpu::argmax_rows(&x_host, rows, cols),
                "argmax_rows {what}"
            );
        }
        // Ties resolve to the first index, as torch.argmax.
        let x = k.upload(&[1.0f32, 3.0, 3.0, 2.0, 5.0, 5.0])?;
        let idx = k.zeros(2)?;
        k.run(&[&k.argmax_rows(idx.view(), x.view(), 2, 3)?])?;
        assert_eq!(k.read::<u32>(idx.view())?, vec![1, 1]);
        Ok(())
    });
}

#[test]
fn mse_forward_and_backward_match_the_cpu() {
    // Under GPU shaping the loss of more than 4096 elements runs in two
    // stages (chunks of 64, then one workgroup over their sums).
    for_each_shaping("mse", |k| {
        for (i, &n) in FLAT_SIZES.iter().chain(&[4096, 4097]).enumerate() {
            let mut r = rng(300 + i as u64);
            let p_host = random_vec(&mut r, n, -2.0, 2.0);
            let t_host = random_vec(&mut r, n, -2.0, 2.0);
            let (p, t) = (k.upload(&p_host)?, k.upload(&t_host)?);
            let loss = k.zeros(1)?;
            k.run(&[&k.mse_forward(loss.view(), p.view(), t.view())?])?;
            // A mean of n squares, each ≤ 16: f32 summation error relative 1e-5.
            assert_close(
                &format!("mse n={n}, GPU shaping {}", k.gpu_shaped()),
                &k.read::<f32>(loss.view())?,
                &[cpu::mse_forward(&p_host, &t_host)],
                1e-6,
                1e-5,
            );
            let dloss = k.upload(&[0.5f32])?;
            let dp = k.zeros(n)?;
            k.run(&[&k.mse_backward(dp.view(), p.view(), t.view(), dloss.view())?])?;
            assert_close(
                &format!("mse backward n={n}"),
                &k.read::<f32>(dp.view())?,
                &cpu::mse_backward(&p_host, &t_host, 0.5),
                1e-7,
                1e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn cross_entropy_forward_and_backward_match_the_cpu() {
    // Under GPU shaping the loss of more than 256 rows runs in two stages.
    for_each_shaping("cross_entropy", |k| {
        for &(rows, cols) in &[
            (1, 1),
            (1, 10),
            (7, 3),
            (64, 10),
            (300, 17),
            (3, 1000),
            (256, 5),
            (257, 5),
            (1031, 3),
        ] {
            let mut r = rng((rows * 31 + cols) as u64);
            // Large logits check the log-sum-exp is stable.
            let mut logits_host = random_vec(&mut r, rows * cols, -5.0, 5.0);
            logits_host[0] = 80.0;
            let labels_host: Vec<u32> = (0..rows).map(|i| ((i * 7 + 3) % cols) as u32).collect();
            let logits = k.upload(&logits_host)?;
            let labels = k.upload(&labels_host)?;
            let loss = k.zeros(1)?;
            k.run(&[&k.cross_entropy_forward(loss.view(), logits.view(), labels.view(), rows, cols)?])?;
            let want = cpu::cross_entropy_forward(&logits_host, &labels_host, rows, cols);
            // exp/log accurate to a few ulp; the mean of rows terms in f32.
            assert_close(
                &format!("ce {rows}×{cols}, GPU shaping {}", k.gpu_shaped()),
                &k.read::<f32>(loss.view())?,
                &[want],
                1e-5,
                1e-5,
            );
            let dloss = k.upload(&[2.0f32])?;
            let dlogits = k.zeros(rows * cols)?;
            k.run(&[&k.cross_entropy_backward(
                dlogits.view(),
                logits.view(),
                labels.view(),
                dloss.view(),
                rows,
                cols,
            )?])?;
            let want = cpu::cross_entropy_backward(&logits_host, &labels_host, 2.0, rows, cols);
            assert_close(
                &format!("ce backward {rows}×{cols}"),
                &k.read::<f32>(dlogits.view())?,
                &want,
                1e-6,
                1e-4,
            );
        }
        // A label out of range makes the loss NaN rather than reading out of bounds.
        let logits = k.upload(&[0.0f32, 1.0, 2.0, 3.0])?;
        let labels = k.upload(&[1u32, 9])?;
        let loss = k.zeros(1)?;
        k.run(&[&k.cross_entropy_forward(loss.view(), logits.view(), labels.view(), 2, 2)?])?;
        assert!(k.read::<f32>(loss.view())?[0].is_nan());
        // And in two stages (300 rows), one bad label among them.
        let mut labels_host: Vec<u32> = (0..300).map(|i| i % 2).collect();
        labels_host[150] = 2;
        let (logits, labels) = (k.upload(&vec![0.5f32; 600])?, k.upload(&labels_host)?);
        k.run(&[&k.cross_entropy_forward(loss.view(), logits.view(), labels.view(), 300, 2)?])?;
        assert!(
            k.read::<f32>(loss.view())?[0].is_nan(),
            "GPU shaping {}",
            k.gpu_shaped()
        );
        Ok(())
    });
}

#[test]
fn sgd_matches_pytorch_formulas_over_several_steps() {
    let configs = [
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.8,
            dampening: 0.0,
            weight_decay: 0.001,
            nesterov: true,
            ..SgdConfig::default()
        },
    ];
    for_each_adapter("sgd", |k| {
        for (ci, cfg) in configs.iter().enumerate() {
            for &n in &[1usize, 257, 1000] {
                let mut r = rng(400 + ci as u64 * 10 + n as u64);
                let mut p_host = random_vec(&mut r, n, -1.0, 1.0);
                let mut buf_host = vec![0.0f32; n];
                let (p, g, buf) = (k.upload(&p_host)?, k.zeros(n)?, k.zeros(n)?);
                let update = k.sgd_update(p.view(), g.view(), buf.view(), cfg, 1)?;
                for step in 1..=5u64 {
                    let g_host = random_vec(&mut r, n, -1.0, 1.0);
                    k.write(g.view(), &g_host)?;
                    k.set_optimizer_step(&update, n, &wgrad::kernels::OptimizerConfig::Sgd(*cfg), step)?;
                    k.run(&[&update])?;
                    cpu::sgd_update(&mut p_host, &g_host, &mut buf_host, cfg, step);
                }
                // Same f32 operations in the same order; FMA contraction may differ by an ulp per step.
                assert_close(
                    &format!("sgd {cfg:?} n={n}"),
                    &k.read::<f32>(p.view())?,
                    &p_host,
                    1e-6,
                    1e-5,
                );
                assert_close(
                    &format!("sgd buffer {cfg:?} n={n}"),
                    &k.read::<f32>(buf.view())?,
                    &buf_host,
                    1e-6,
                    1e-5,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn plain_sgd_is_the_textbook_update() {
    for_each_adapter("sgd_textbook", |k| {
        let (p, g, buf) = (
            k.upload(&[1.0f32, -2.0, 0.5])?,
            k.upload(&[0.5f32, 0.25, -1.0])?,
            k.zeros(3)?,
        );
        let cfg = SgdConfig {
            lr: 0.5,
            ..SgdConfig::default()
        };
        k.run(&[&k.sgd_update(p.view(), g.view(), buf.view(), &cfg, 1)?])?;
        // p - lr·g, exactly representable.
        assert_eq!(k.read::<f32>(p.view())?, vec![0.75, -2.125, 1.0]);
        Ok(())
    });
}

#[test]
fn adam_and_adamw_match_pytorch_formulas_over_several_steps() {
    let configs = [
        AdamConfig::adam(),
        AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamConfig::adam()
        },
        AdamConfig::adamw(),
        AdamConfig {
            lr: 0.02,
            betas: (0.8, 0.99),
            eps: 1e-6,
            weight_decay: 0.05,
            decoupled_weight_decay: true,
            ..AdamConfig::adam()
        },
    ];
    for_each_adapter("adam", |k| {
        for (ci, cfg) in configs.iter().enumerate() {
            for &n in &[1usize, 257, 1000] {
                let mut r = rng(500 + ci as u64 * 10 + n as u64);
                let mut p_host = random_vec(&mut r, n, -1.0, 1.0);
                let (mut m_host, mut v_host) = (vec![0.0f32; n], vec![0.0f32; n]);
                let (p, g, m, v) = (k.upload(&p_host)?, k.zeros(n)?, k.zeros(n)?, k.zeros(n)?);
                let update = k.adam_update(p.view(), g.view(), m.view(), v.view(), cfg, 1)?;
                for step in 1..=6u64 {
                    let g_host = random_vec(&mut r, n, -1.0, 1.0);
                    k.write(g.view(), &g_host)?;
                    k.set_optimizer_step(&update, n, &wgrad::kernels::OptimizerConfig::Adam(*cfg), step)?;
                    k.run(&[&update])?;
                    cpu::adam_update(&mut p_host, &g_host, &mut m_host, &mut v_host, cfg, step);
                }
                // Same formula in f32; sqrt and division are correctly rounded,
                // FMA contraction may differ by an ulp per operation.
                assert_close(
                    &format!("adam {cfg:?} n={n}"),
                    &k.read::<f32>(p.view())?,
                    &p_host,
                    1e-6,
                    1e-5,
                );
                assert_close(
                    &format!("adam m {cfg:?} n={n}"),
                    &k.read::<f32>(m.view())?,
                    &m_host,
                    1e-6,
                    1e-5,
                );
                assert_close(
                    &format!("adam v {cfg:?} n={n}"),
                    &k.read::<f32>(v.view())?,
                    &v_host,
                    1e-7,
                    1e-5,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn optimizer_arguments_are_checked_like_pytorch() {
    for_each_adapter("optim_args", |k| {
        let (p, g, s) = (k.zeros(4)?, k.zeros(4)?, k.zeros(4)?);
        let bad_lr = SgdConfig {
            lr: -1.0,
            ..SgdConfig::default()
        };
        assert!(matches!(
            k.sgd_update(p.view(), g.view(), s.view(), &bad_lr, 1),
            Err(Error::InvalidArgument { .. })
        ));
        let bad_nesterov = SgdConfig {
            nesterov: true,
            ..SgdConfig::default()
        };
        assert!(matches!(
            k.sgd_update(p.view(), g.view(), s.view(), &bad_nesterov, 1),
            Err(Error::InvalidArgument { .. })
        ));
        let bad_beta = AdamConfig {
            betas: (1.0, 0.999),
            ..AdamConfig::adam()
        };
        assert!(matches!(
            k.adam_update(p.view(), g.view(), s.view(), s.view(), &bad_beta, 1),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            k.sgd_update(p.view(), g.view(), s.view(), &SgdConfig::default(), 0),
            Err(Error::InvalidArgument { .. })
        ));
        let short = k.zeros(3)?;
        assert!(matches!(
            k.sgd_update(p.view(), short.view(), s.view(), &SgdConfig::default(), 1),
            Err(Error::Shape { op: "sgd_update", .. })
        ));
        Ok(())
    });
}

#[test]
fn tensors_over_the_binding_limit_are_errors_and_the_largest_allowed_works() {
    for_each_adapter("limits", |k| {
        let limit = k.device().limits().max_storage_buffer_binding_size;
        // A view claiming one element past the limit is refused before wgpu sees it.
        let small = k.zeros(4)?;
        let over = wgrad::View {
            buffer: small.buffer(),
            offset: 0,
            len: (limit / 4 + 1) as usize,
        };
        let err = k.scale(over, over, 1.0).unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { op: "scale_forward", limit: l, .. } if l == limit),
            "{err}"
        );
        // The largest binding (capped at 128 MiB to stay quick) runs, and needs
        // more than 65,535 workgroups in x: the 2-D grid.
        let n = (limit.min(128 << 20) / 4) as usize;
        let x = k.upload(&vec![1.5f32; n])?;
        let out = k.zeros(n)?;
        let d = k.scale(out.view(), x.view(), 2.0)?;
        assert!(d.workgroups()[1] > 1 || n <= 65_535 * 256, "{:?}", d.workgroups());
        k.run(&[&d])?;
        let back = k.read::<f32>(out.view())?;
        assert_eq!(back.len(), n);
        assert!(
            back.iter().all(|&v| v == 3.0),
            "every element, including the last workgroups, is written"
        );
        Ok(())
    });
}

#[test]
fn views_into_one_buffer_respect_offsets() {
    for_each_adapter("offsets", |k| {
        let align = k.device().limits().min_storage_buffer_offset_alignment as usize / 4;
        let data: Vec<f32> = (0..align * 3).map(|i| i as f32).collect();
        let arena = k.upload(&data)?;
        let out = k.zeros(align)?;
        k.run(&[&k.binary(
            Binary::Add,
            out.view(),
            arena.slice(align, align)?,
            arena.slice(2 * align, align)?,
        )?])?;
        let want: Vec<f32> = (0..align)
            .map(|i| (align + i) as f32 + (2 * align + i) as f32)
            .collect();
        assert_eq!(k.read::<f32>(out.view())?, want);
        if align > 1 {
            let err = k.scale(out.view(), arena.slice(1, align)?, 1.0).unwrap_err();
            assert!(matches!(err, Error::Shape { .. }), "misaligned offset: {err}");
        }
        assert!(arena.slice(align * 2, align + 1).is_err());
        Ok(())
    });
}

#[test]
fn accumulating_matmul_and_column_sums_add_into_their_output() {
    for_each_adapter("accumulate", |k| {
        for form in MatmulForm::ALL {
            for &(m, n, kk) in &[(1, 1, 1), (13, 17, 19), (65, 63, 67)] {
                let mut r = rng((m * n * kk) as u64);
                let (sa, sb) = form.operand_shapes(m, n, kk);
                let a_host = random_vec(&mut r, sa[0] * sa[1], -1.0, 1.0);
                let b_host = random_vec(&mut r, sb[0] * sb[1], -1.0, 1.0);
                let c_host = random_vec(&mut r, m * n, -1.0, 1.0);
                let (a, b, c) = (k.upload(&a_host)?, k.upload(&b_host)?, k.upload(&c_host)?);
                let d = k.matmul(
                    &MatmulRequest::new(form, m, n, kk).accumulating(true),
                    c.view(),
                    a.view(),
                    b.view(),
                )?;
                k.run(&[&d, &d])?;
                let product = cpu::matmul(form, &a_host, &b_host, m, n, kk);
                let want: Vec<f32> = c_host.iter().zip(&product).map(|(c, p)| c + 2.0 * p).collect();
                // Two accumulations of k-term f32 sums onto a value of magnitude ≤ 1.
                assert_close(
                    &format!("accumulate {form:?} {m}×{n}×{kk}"),
                    &k.read::<f32>(c.view())?,
                    &want,
                    2e-6 * kk as f32 + 1e-5,
                    1e-5,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn accumulating_column_sums_add_into_their_output() {
    // 263 rows: two stages under GPU shaping.
    for_each_shaping("sum_rows accumulate", |k| {
        for (rows, cols) in [(37, 11), (263, 11)] {
            let mut r = rng(77 + rows as u64);
            let x_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            let out_host = random_vec(&mut r, cols, -1.0, 1.0);
            let (x, out) = (k.upload(&x_host)?, k.upload(&out_host)?);
            k.run(&[&k.sum_rows_accumulate(out.view(), x.view(), rows, cols)?])?;
            let want: Vec<f32> = out_host
                .iter()
                .zip(cpu::sum_rows(&x_host, rows, cols))
                .map(|(o, s)| o + s)
                .collect();
            // rows terms of magnitude ≤ 1 onto a value ≤ 1, in f32.
            assert_close(
                &format!("sum_rows accumulate {rows}×{cols}, GPU shaping {}", k.gpu_shaped()),
                &k.read::<f32>(out.view())?,
                &want,
                1e-6 * rows as f32 + 1e-5,
                1e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn two_stage_column_sums_are_the_same_bits_on_every_run() {
    // The blocks depend on the shape alone: reruns and a second dispatch
    // built for the same shape give identical bits.
    for_each_shaping("sum_rows determinism", |k| {
        let (rows, cols) = (2053, 5);
        let x_host = random_vec(&mut rng(78), rows * cols, -1.0, 1.0);
        let (x, a, b) = (k.upload(&x_host)?, k.zeros(cols)?, k.zeros(cols)?);
        let first = k.sum_rows(a.view(), x.view(), rows, cols)?;
        k.run(&[&first])?;
        let want = k.read::<u32>(a.view())?;
        for _ in 0..3 {
            k.run(&[&k.sum_rows(b.view(), x.view(), rows, cols)?, &first])?;
            assert_eq!(k.read::<u32>(b.view())?, want, "GPU shaping {}", k.gpu_shaped());
            assert_eq!(k.read::<u32>(a.view())?, want, "GPU shaping {}", k.gpu_shaped());
        }
        // Two stages (two launches) exactly where the GPU shaping is on.
        assert_eq!(first.launches(), if k.gpu_shaped() { 2 } else { 1 });
        Ok(())
    });
}

#[test]
fn matmul_with_bias_matches_matmul_then_bias_add() {
    for_each_adapter("matmul_bias", |k| {
        for form in MatmulForm::ALL {
            for &(m, n, kk) in &[(1, 1, 1), (7, 13, 5), (65, 130, 67)] {
                let mut r = rng((m + n + kk) as u64);
                let (sa, sb) = form.operand_shapes(m, n, kk);
                let a_host = random_vec(&mut r, sa[0] * sa[1], -1.0, 1.0);
                let b_host = random_vec(&mut r, sb[0] * sb[1], -1.0, 1.0);
                let bias_host = random_vec(&mut r, n, -1.0, 1.0);
                let (a, b, bias, c) = (
                    k.upload(&a_host)?,
                    k.upload(&b_host)?,
                    k.upload(&bias_host)?,
                    k.zeros(m * n)?,
                );
                k.run(&[&k.matmul(
                    &MatmulRequest::new(form, m, n, kk).with_bias(bias.view()),
                    c.view(),
                    a.view(),
                    b.view(),
                )?])?;
                let want = cpu::bias_add(&cpu::matmul(form, &a_host, &b_host, m, n, kk), &bias_host, n);
                // k-term f32 sums plus one rounding for the bias.
                assert_close(
                    &format!("matmul+bias {form:?} {m}×{n}×{kk}"),
                    &k.read::<f32>(c.view())?,
                    &want,
                    1e-6 * kk as f32 + 2e-6,
                    1e-5,
                );
            }
        }
        let (a, b, c, short) = (k.zeros(6)?, k.zeros(12)?, k.zeros(8)?, k.zeros(3)?);
        assert!(matches!(
            k.matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_bias(short.view()),
                c.view(),
                a.view(),
                b.view()
            ),
            Err(Error::Shape { .. })
        ));
        Ok(())
    });
}

/// One fused-epilogue case: which activation, which direction, and which of
/// the optional parts (bias, pre-activation store, accumulation) it uses.
#[derive(Clone, Copy, Debug)]
struct EpilogueCase {
    act: Activation,
    backward: bool,
    bias: bool,
    store_pre: bool,
    accumulate: bool,
}

/// Every activation in both directions. The optional parts vary with the
/// form (each combination is a pipeline to compile, seconds on llvmpipe;
/// the activation itself is a uniform, so it adds none).
fn epilogue_cases(form_index: usize) -> Vec<EpilogueCase> {
    let (bias, store_pre, forward_accumulate, backward_accumulate) = match form_index {
        0 => (true, true, false, false),
        1 => (false, true, false, true),
        _ => (true, false, true, false),
    };
    Activation::ALL
        .into_iter()
        .flat_map(|act| {
            [
                EpilogueCase {
                    act,
                    backward: false,
                    bias,
                    store_pre,
                    accumulate: forward_accumulate,
                },
                EpilogueCase {
                    act,
                    backward: true,
                    bias: false,
                    store_pre: false,
                    accumulate: backward_accumulate,
                },
            ]
        })
        .collect()
}

/// For the register-blocked kernels, whose pipelines take 5–20 s each to
/// compile on a cold software adapter: every activation in both directions
/// with every optional part on at once (two pipelines per kernel, which
/// still run every branch of the shared store, `write_c`). The cheap small
/// and shared kernels get every combination ([`epilogue_cases`]).
fn epilogue_cases_all_parts() -> Vec<EpilogueCase> {
    Activation::ALL
        .into_iter()
        .flat_map(|act| {
            [
                EpilogueCase {
                    act,
                    backward: false,
                    bias: true,
                    store_pre: true,
                    accumulate: true,
                },
                EpilogueCase {
                    act,
                    backward: true,
                    bias: false,
                    store_pre: false,
                    accumulate: true,
                },
            ]
        })
        .collect()
}

fn check_matmul_epilogue(
    k: &Kernels,
    variant: MatmulVariant,
    form: MatmulForm,
    case: EpilogueCase,
    (m, n, kk): (usize, usize, usize),
    seed: u64,
) -> wgrad::Result<()> {
    let mut r = rng(seed);
    let (sa, sb) = form.operand_shapes(m, n, kk);
    let a_host = random_vec(&mut r, sa[0] * sa[1], -1.0, 1.0);
    let b_host = random_vec(&mut r, sb[0] * sb[1], -1.0, 1.0);
    let bias_host = random_vec(&mut r, n, -1.0, 1.0);
    let c_host = random_vec(&mut r, m * n, -1.0, 1.0);
    // The activation's forward input, with exact zeros (ReLU's kink) and
    // saturating magnitudes.
    let mut x_host = random_vec(&mut r, m * n, -4.0, 4.0);
    x_host[0] = 0.0;
    if x_host.len() > 2 {
        x_host[1] = 40.0;
        x_host[2] = -40.0;
    }
    let (a, b, bias, c, x, pre) = (
        k.upload(&a_host)?,
        k.upload(&b_host)?,
        k.upload(&bias_host)?,
        k.upload(&c_host)?,
        k.upload(&x_host)?,
        k.zeros(m * n)?,
    );
    let epilogue = MatmulEpilogue {
        accumulate: case.accumulate,
        bias: case.bias.then(|| bias.view()),
        activation: (!case.backward).then(|| (case.act, case.store_pre.then(|| pre.view()))),
        activation_grad: case.backward.then(|| (case.act, x.view())),
    };
    k.run(&[&k.matmul(
        &MatmulRequest::new(form, m, n, kk)
            .with_kernel(MatmulKernel::Tiled(variant))
            .with_epilogue(epilogue),
        c.view(),
        a.view(),
        b.view(),
    )?])?;
    let twin = cpu::Epilogue {
        accumulate_onto: case.accumulate.then_some(&c_host[..]),
        bias: case.bias.then_some(&bias_host[..]),
        activation: (!case.backward).then_some(case.act),
        activation_grad: case.backward.then_some((case.act, &x_host[..])),
    };
    let (want, want_pre) = cpu::matmul_epilogue(form, twin, &a_host, &b_host, m, n, kk);
    let what = format!("{variant:?} {form:?} {case:?} {m}×{n}×{kk}");
    // The product's f32 error (≤ 1e-6·k, as in check_matmul) passes through
    // an activation or derivative of slope ≤ 1.2, plus a few ulp from the
    // transcendentals (as in the activation test) and one rounding for the
    // bias or the accumulation.
    assert_close(&what, &k.read::<f32>(c.view())?, &want, 2e-6 * kk as f32 + 1e-5, 1e-4);
    if case.store_pre && !case.backward {
        assert_close(
            &format!("{what} pre-activation"),
            &k.read::<f32>(pre.view())?,
            &want_pre,
            1e-6 * kk as f32 + 2e-6,
            1e-5,
        );
    }
    Ok(())
}

#[test]
fn matmul_epilogue_matches_the_cpu_for_every_activation_direction_form_and_variant() {
    for_each_adapter("matmul_epilogue", |k| {
        for (variant, form) in common::variant_forms_to_test(k) {
            // The vec4 kernel is compiled once per form; its per-form load
            // paths are checked by matmul_every_form_and_variant_matches_the_cpu,
            // and its store (the shared epilogue) is the same for every form.
            if variant == MatmulVariant::RegisterVec4 && form != MatmulForm::AB {
                continue;
            }
            let slow_to_compile = !matches!(variant, MatmulVariant::Small | MatmulVariant::Shared);
            // GL's default for AB and ABᵀ, checked there with the GPT's
            // activation only: each pipeline costs 5–9 s of a cold llvmpipe,
            // and the store (write_c) is the one every variant shares, checked
            // with every activation on Vulkan.
            let gl_vec4 = variant == MatmulVariant::RegisterVec4 && k.device().is_gl();
            let f = MatmulForm::ALL.iter().position(|&x| x == form).unwrap_or(0);
            let cases = if slow_to_compile {
                epilogue_cases_all_parts()
            } else {
                epilogue_cases(f)
            };
            // (20, 68, 36) has every stored row a multiple of 4, so the
            // workgroup-memory kernel takes its vec4 entry there, in AB only:
            // the vec4 and scalar entries differ in their loads alone (each
            // form's are the load-path test's) and share the store
            // (mt_store, write_c), which the scalar entry runs with these
            // epilogues in every form. So the vec4 entry's epilogues are one
            // pipeline per direction, not one per direction and form; in the
            // other forms a shape of the same size off 4 takes its place.
            let last = if variant == MatmulVariant::Shared && form != MatmulForm::AB {
                (21, 68, 37)
            } else {
                (20, 68, 36)
            };
            for case in cases.into_iter().filter(|c| !gl_vec4 || c.act == Activation::Gelu) {
                for (s, &shape) in [(1, 7, 1), (13, 17, 19), (65, 130, 67), last].iter().enumerate() {
                    check_matmul_epilogue(k, variant, form, case, shape, (f * 100 + s) as u64)?;
                }
            }
        }
        Ok(())
    });
}

#[test]
fn matmul_variants_an_adapter_cannot_run_are_refused_and_never_chosen() {
    for_each_adapter("matmul_variant_support", |k| {
        let sized_8 = {
            let info = k.device().info();
            info.subgroup_min_size == 8 && info.subgroup_max_size == 8
        };
        let has_subgroup = k.device().features().contains(wgpu::Features::SUBGROUP);
        assert_eq!(
            k.supports_matmul_variant(MatmulVariant::Subgroup),
            has_subgroup && sized_8
        );
        for form in MatmulForm::ALL {
            let chosen = k.matmul_variant_for(form);
            assert!(
                k.supports_matmul_variant(chosen),
                "{form:?} runs {chosen:?}, which this adapter cannot run"
            );
        }
        if k.supports_matmul_variant(MatmulVariant::Subgroup) {
            return Ok(());
        }
        let (a, b, c, x) = (k.zeros(6)?, k.zeros(6)?, k.zeros(4)?, k.zeros(4)?);
        for form in MatmulForm::ALL {
            let epilogue = MatmulEpilogue {
                activation_grad: Some((Activation::Relu, x.view())),
                ..MatmulEpilogue::default()
            };
            match k.matmul(
                &MatmulRequest::new(form, 2, 2, 3)
                    .with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup))
                    .with_epilogue(epilogue),
                c.view(),
                a.view(),
                b.view(),
            ) {
                Err(Error::Unsupported { op, feature, .. }) => {
                    assert_eq!(op, "matmul_subgroup_forward");
                    assert!(
                        feature.contains(if has_subgroup {
                            "subgroups of exactly 8"
                        } else {
                            "SUBGROUP"
                        }),
                        "{feature}"
                    );
                }
                other => panic!(
                    "Subgroup {form:?} on {}: want Error::Unsupported, got {other:?}",
                    k.device().label()
                ),
            }
        }
        // Refusing compiled nothing, so nothing reached wgpu's validation.
        k.device().check("after the refusals")
    });
}

#[test]
fn fused_epilogue_agrees_with_the_unfused_kernels() {
    for_each_adapter("matmul_epilogue_unfused", |k| {
        let (m, n, kk) = (37, 70, 29);
        let mut r = rng(404);
        let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
        let b_host = random_vec(&mut r, kk * n, -1.0, 1.0);
        let x_host = random_vec(&mut r, m * n, -4.0, 4.0);
        let (a, b, x) = (k.upload(&a_host)?, k.upload(&b_host)?, k.upload(&x_host)?);
        let (fused, product, unfused) = (k.zeros(m * n)?, k.zeros(m * n)?, k.zeros(m * n)?);
        k.run(&[&k.matmul(
            &MatmulRequest::new(MatmulForm::AB, m, n, kk),
            product.view(),
            a.view(),
            b.view(),
        )?])?;
        for act in Activation::ALL {
            let forward = MatmulEpilogue {
                activation: Some((act, None)),
                ..MatmulEpilogue::default()
            };
            k.run(&[
                &k.matmul(
                    &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_epilogue(forward),
                    fused.view(),
                    a.view(),
                    b.view(),
                )?,
                &k.activation_forward(act, unfused.view(), product.view())?,
            ])?;
            // Same f32 formulas on the same product: equal up to the
            // compiler's freedom to contract a multiply-add (an ulp or two).
            assert_close(
                &format!("{act:?} forward"),
                &k.read::<f32>(fused.view())?,
                &k.read::<f32>(unfused.view())?,
                1e-7,
                1e-6,
            );
            let backward = MatmulEpilogue {
                activation_grad: Some((act, x.view())),
                ..MatmulEpilogue::default()
            };
            k.run(&[
                &k.matmul(
                    &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_epilogue(backward),
                    fused.view(),
                    a.view(),
                    b.view(),
                )?,
                &k.activation_backward(act, unfused.view(), x.view(), product.view())?,
            ])?;
            assert_close(
                &format!("{act:?} backward"),
                &k.read::<f32>(fused.view())?,
                &k.read::<f32>(unfused.view())?,
                1e-7,
                1e-6,
            );
        }
        Ok(())
    });
}

#[test]
fn matmul_epilogue_rejects_bad_combinations_and_shapes() {
    for_each_adapter("matmul_epilogue_errors", |k| {
        let (a, b, c, bias, x, short) = (
            k.zeros(6)?,
            k.zeros(12)?,
            k.zeros(8)?,
            k.zeros(4)?,
            k.zeros(8)?,
            k.zeros(7)?,
        );
        let run = |e: MatmulEpilogue<'_>| {
            k.matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_epilogue(e),
                c.view(),
                a.view(),
                b.view(),
            )
        };
        let grad = Some((Activation::Relu, x.view()));
        let with_bias = MatmulEpilogue {
            bias: Some(bias.view()),
            activation_grad: grad,
            ..MatmulEpilogue::default()
        };
        assert!(matches!(run(with_bias), Err(Error::InvalidArgument { .. })));
        let with_act = MatmulEpilogue {
            activation: Some((Activation::Tanh, None)),
            activation_grad: grad,
            ..MatmulEpilogue::default()
        };
        assert!(matches!(run(with_act), Err(Error::InvalidArgument { .. })));
        let short_x = MatmulEpilogue {
            activation_grad: Some((Activation::Relu, short.view())),
            ..MatmulEpilogue::default()
        };
        assert!(matches!(run(short_x), Err(Error::Shape { .. })));
        let short_pre = MatmulEpilogue {
            activation: Some((Activation::Gelu, Some(short.view()))),
            ..MatmulEpilogue::default()
        };
        assert!(matches!(run(short_pre), Err(Error::Shape { .. })));
        assert!(run(MatmulEpilogue {
            activation_grad: grad,
            accumulate: true,
            ..MatmulEpilogue::default()
        })
        .is_ok());
        Ok(())
    });
}

#[test]
fn fused_loss_forward_backward_matches_the_separate_kernels_twins() {
    for_each_adapter("fused_loss", |k| {
        for &(rows, cols) in &[(1, 1), (7, 3), (64, 10), (300, 17)] {
            let mut r = rng((rows * 13 + cols) as u64);
            let logits_host = random_vec(&mut r, rows * cols, -5.0, 5.0);
            let labels_host: Vec<u32> = (0..rows).map(|i| ((i * 5 + 1) % cols) as u32).collect();
            let target_host = random_vec(&mut r, rows * cols, -2.0, 2.0);
            let (logits, labels, target) = (
                k.upload(&logits_host)?,
                k.upload(&labels_host)?,
                k.upload(&target_host)?,
            );
            let (loss, grad, dloss) = (k.zeros(1)?, k.zeros(rows * cols)?, k.upload(&[0.5f32])?);
            k.run(&[&k.cross_entropy_forward_backward(
                loss.view(),
                grad.view(),
                logits.view(),
                labels.view(),
                dloss.view(),
                rows,
                cols,
            )?])?;
            // Same tolerances as the separate kernels' tests.
            assert_close(
                "fused ce loss",
                &k.read::<f32>(loss.view())?,
                &[cpu::cross_entropy_forward(&logits_host, &labels_host, rows, cols)],
                1e-5,
                1e-5,
            );
            assert_close(
                "fused ce grad",
                &k.read::<f32>(grad.view())?,
                &cpu::cross_entropy_backward(&logits_host, &labels_host, 0.5, rows, cols),
                1e-6,
                1e-4,
            );
            k.run(&[&k.mse_forward_backward(loss.view(), grad.view(), logits.view(), target.view(), dloss.view())?])?;
            assert_close(
                "fused mse loss",
                &k.read::<f32>(loss.view())?,
                &[cpu::mse_forward(&logits_host, &target_host)],
                1e-6,
                1e-5,
            );
            assert_close(
                "fused mse grad",
                &k.read::<f32>(grad.view())?,
                &cpu::mse_backward(&logits_host, &target_host, 0.5),
                1e-7,
                1e-5,
            );
        }
        Ok(())
    });
}
