//! The opt-in kernels of `matmul_ext`: f16-storage matmul (f32
//! accumulation), the f32 <-> f16 conversions and the subgroup matmul,
//! against their CPU twins on every adapter that has the feature, and the
//! `Error::Unsupported` path on every adapter that lacks it (on a CPU-only
//! machine: llvmpipe through GL has neither SHADER_F16 nor SUBGROUP).
//! Tolerances are stated beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, rng};
use half::f16;
use wgrad::kernels::{Activation, F16View, MatmulEpilogue, MatmulForm, MatmulOperand, MatmulVariant};
use wgrad::kernels::{MatmulKernel, MatmulRequest};
use wgrad::{cpu, Error, Kernels};

/// 1, primes, and non-multiples of the 64×64 tile: the f32 matmul test's
/// shapes before its vec4-friendly ones.
const SHAPES: &[(usize, usize, usize)] = super::kernels::MATMUL_SHAPES.split_at(11).0;

/// f32 accumulation over k terms of magnitude ≤ 1 against an f64
/// reference: the error grows at most linearly in k; 1e-6·k leaves a wide
/// margin (as tests/suite/kernels.rs for the f32 matmul).
fn f32_atol(k: usize) -> f32 {
    1e-6 * k as f32 + 1e-6
}

fn check_f16_matmul(k: &Kernels, form: MatmulForm, m: usize, n: usize, kk: usize, seed: u64) -> wgrad::Result<()> {
    let mut r = rng(seed);
    let a_host = cpu::to_f16(&random_vec(&mut r, m * kk, -1.0, 1.0));
    let b_host = cpu::to_f16(&random_vec(&mut r, kk * n, -1.0, 1.0));
    let a = k.upload_f16(&a_host)?;
    let b = k.upload_f16(&b_host)?;
    let c = k.zeros(m * n)?;
    k.run(&[&k.matmul(
        &MatmulRequest::new(form, m, n, kk).with_kernel(MatmulKernel::NativeF16),
        c.view(),
        a.view(),
        b.view(),
    )?])?;
    let got = k.read::<f32>(c.view())?;
    // Same f16 inputs on both sides, products exact in f32: what is left is
    // f32 accumulation, so the f32 matmul's tolerance applies.
    let want = cpu::matmul_f16(form, &a_host, &b_host, m, n, kk);
    assert_close(
        &format!("f16 {form:?} m={m} n={n} k={kk}"),
        &got,
        &want,
        f32_atol(kk),
        1e-5,
    );
    Ok(())
}

#[test]
fn f16_matmul_matches_its_twin_in_every_form_and_shape() {
    for_each_adapter("matmul_f16", |k| {
        if !k.supports_f16() {
            return Ok(());
        }
        for form in MatmulForm::ALL {
            for (i, &(m, n, kk)) in SHAPES.iter().enumerate() {
                check_f16_matmul(k, form, m, n, kk, 100 + i as u64)?;
            }
        }
        Ok(())
    });
}

/// Which operands of a product are stored in f16.
#[derive(Clone, Copy, Debug)]
enum Halves {
    A,
    B,
    Both,
}

fn operand<'a>(half: bool, f16: &'a wgrad::kernels::F16Tensor, f32: &'a wgrad::GpuTensor) -> MatmulOperand<'a> {
    if half {
        f16.view().into()
    } else {
        f32.view().into()
    }
}

fn twin_operand<'a>(half: bool, f16: &'a [f16], f32: &'a [f32]) -> cpu::Operand<'a> {
    if half {
        cpu::Operand::F16(f16)
    } else {
        cpu::Operand::F32(f32)
    }
}

/// One product of `matmul.wgsl` on `variant` with the operands `halves`
/// names stored in f16 (the others f32), with `epilogue`'s parts, against
/// the twin on the same (f16-rounded) values.
#[allow(clippy::too_many_arguments)]
fn check_f16_operands(
    k: &Kernels,
    variant: MatmulVariant,
    form: MatmulForm,
    halves: Halves,
    epilogue: (bool, Option<Activation>, bool),
    (m, n, kk): (usize, usize, usize),
    seed: u64,
) -> wgrad::Result<()> {
    let (accumulate, act, backward) = epilogue;
    let mut r = rng(seed);
    let mut a32 = random_vec(&mut r, m * kk, -1.0, 1.0);
    let mut b32 = random_vec(&mut r, kk * n, -1.0, 1.0);
    // Zeros of both signs and f16 subnormals (below 2^-14), which the
    // kernel widens by a path of their own.
    for (i, v) in [-3e-6f32, 1e-7, 0.0, -0.0].into_iter().enumerate() {
        if let (Some(x), Some(y)) = (a32.get_mut(i), b32.get_mut(i + 1)) {
            (*x, *y) = (v, -v);
        }
    }
    let c_host = random_vec(&mut r, m * n, -1.0, 1.0);
    let bias_host = random_vec(&mut r, n, -1.0, 1.0);
    let x_host = random_vec(&mut r, m * n, -4.0, 4.0);
    let (a16, b16) = (cpu::to_f16(&a32), cpu::to_f16(&b32));
    let (a_half, b_half) = (
        matches!(halves, Halves::A | Halves::Both),
        matches!(halves, Halves::B | Halves::Both),
    );
    let (a_f32, b_f32, a_f16, b_f16) = (
        k.upload(&a32)?,
        k.upload(&b32)?,
        k.upload_f16(&a16)?,
        k.upload_f16(&b16)?,
    );
    let (c, bias, x, pre) = (
        k.upload(&c_host)?,
        k.upload(&bias_host)?,
        k.upload(&x_host)?,
        k.zeros(m * n)?,
    );
    let forward = act.filter(|_| !backward);
    let e = MatmulEpilogue {
        accumulate,
        bias: forward.map(|_| bias.view()),
        activation: forward.map(|a| (a, Some(pre.view()))),
        activation_grad: act.filter(|_| backward).map(|a| (a, x.view())),
    };
    k.run(&[&k.matmul(
        &MatmulRequest::new(form, m, n, kk)
            .with_kernel(MatmulKernel::Tiled(variant))
            .with_epilogue(e),
        c.view(),
        operand(a_half, &a_f16, &a_f32),
        operand(b_half, &b_f16, &b_f32),
    )?])?;
    let twin = cpu::Epilogue {
        accumulate_onto: accumulate.then_some(&c_host[..]),
        bias: forward.map(|_| &bias_host[..]),
        activation: forward,
        activation_grad: act.filter(|_| backward).map(|a| (a, &x_host[..])),
    };
    let (want, want_pre) = cpu::matmul_operands(
        form,
        twin,
        twin_operand(a_half, &a16, &a32),
        twin_operand(b_half, &b16, &b32),
        m,
        n,
        kk,
    );
    let what =
        format!("{variant:?} {form:?} f16 {halves:?} accumulate={accumulate} {act:?} backward={backward} {m}×{n}×{kk}");
    // The twin widens the same f16 values exactly (the products are exact
    // in f32), so what is left is f32 accumulation (f32_atol) and, with an
    // epilogue, tests/suite/kernels.rs's allowance for it: a slope ≤ 1.2,
    // a few ulp of the transcendentals, one rounding for bias or sum.
    assert_close(&what, &k.read::<f32>(c.view())?, &want, 2e-6 * kk as f32 + 1e-5, 1e-4);
    if forward.is_some() {
        assert_close(
            &format!("{what} pre-activation"),
            &k.read::<f32>(pre.view())?,
            &want_pre,
            f32_atol(kk) + 1e-6,
            1e-5,
        );
    }
    Ok(())
}

/// The f32 kernels reading f16 operands (a training step's f16
/// activations): every form, each operand f16 alone and both, on the small,
/// register and shared kernels, plain and with each epilogue a training
/// step fuses (accumulation into a gradient, bias + activation forward,
/// activation backward). No feature is needed, so on every adapter.
#[test]
fn f16_operands_match_the_twin_on_every_kernel_form_and_epilogue() {
    for_each_adapter("matmul_f16_operands", |k| {
        // 1, primes and non-multiples of the 64×64 tile; the small kernel
        // takes m·n·k ≤ 2^20, the others any.
        let shapes: &[(usize, usize, usize)] = &[(1, 1, 1), (7, 1, 13), (65, 63, 67)];
        let epilogue_shapes: &[(usize, usize, usize)] = &[(1, 1, 1), (13, 17, 19), (65, 63, 67)];
        let plain = (false, None, false);
        // Why this grid: each pipeline (the overrides A_F16, B_F16, the
        // epilogue's and, on the shared kernel, the form's) costs seconds
        // of a cold software adapter, shapes cost nothing once it is built.
        // load_a and load_b widen each operand on its own, and the store
        // (write_c) follows whatever was loaded, so the switches compose
        // independently and are covered pairwise, not as a cross product:
        // both operands f16 in every form (each f16 load on each of the
        // shared kernel's staging paths, rows and columns of A and of B),
        // and each epilogue with a different operand f16, which is also
        // where each operand alone meets an f32 one (B alone accumulating,
        // A alone with bias + GELU forward, both with GELU backward; the
        // epilogues with f32 operands are tests/suite/kernels.rs's).
        let epilogues = [
            ((true, None, false), Halves::B),
            ((false, Some(Activation::Gelu), false), Halves::A),
            ((true, Some(Activation::Gelu), true), Halves::Both),
        ];
        let mut seed = 300;
        // RegisterVec4 runs the register kernel's pipelines (f16 has no
        // vec4 loads), so it is checked on one shape.
        for variant in [
            MatmulVariant::Small,
            MatmulVariant::Register,
            MatmulVariant::Shared,
            MatmulVariant::RegisterVec4,
        ] {
            let shapes = if variant == MatmulVariant::RegisterVec4 {
                &shapes[2..]
            } else {
                shapes
            };
            for form in MatmulForm::ALL {
                for &shape in shapes {
                    seed += 1;
                    check_f16_operands(k, variant, form, Halves::Both, plain, shape, seed)?;
                }
                // The small and register kernels read the form from strides
                // (one pipeline for all three), so their epilogues run in
                // every form; the shared kernel compiles one per form, and
                // its store is every form's, so they run in AtB there.
                if variant == MatmulVariant::Shared && form != MatmulForm::AtB {
                    continue;
                }
                for &(e, halves) in &epilogues {
                    for &shape in epilogue_shapes {
                        seed += 1;
                        check_f16_operands(k, variant, form, halves, e, shape, seed)?;
                    }
                }
            }
        }
        Ok(())
    });
}

/// Batched products with f16 operands (the unfused attention's, reading
/// f16 q, k, v and probabilities): each matrix of the batch starts where
/// the previous ends, mid-word when m·k or k·n is odd.
#[test]
fn f16_operands_in_a_batch_match_the_twin() {
    for_each_adapter("matmul_f16_operands_batched", |k| {
        let mut seed = 400;
        for form in MatmulForm::ALL {
            for &(batch, m, n, kk) in &[(1, 1, 1, 1), (3, 5, 7, 3), (2, 65, 13, 67)] {
                seed += 1;
                let mut r = rng(seed);
                let a16 = cpu::to_f16(&random_vec(&mut r, batch * m * kk, -1.0, 1.0));
                let b32 = random_vec(&mut r, batch * kk * n, -1.0, 1.0);
                let b16 = cpu::to_f16(&b32);
                let (a_f16, b_f16, b_f32, c) = (
                    k.upload_f16(&a16)?,
                    k.upload_f16(&b16)?,
                    k.upload(&b32)?,
                    k.zeros(batch * m * n)?,
                );
                for b_half in [false, true] {
                    let b = operand(b_half, &b_f16, &b_f32);
                    k.run(&[&k.matmul(
                        &MatmulRequest::new(form, m, n, kk).with_batch(batch),
                        c.view(),
                        a_f16.view(),
                        b,
                    )?])?;
                    let b_values = if b_half { cpu::from_f16(&b16) } else { b32.clone() };
                    let want = cpu::matmul_batched(form, &cpu::from_f16(&a16), &b_values, batch, m, n, kk);
                    // Exact products of the same values; f32 accumulation.
                    assert_close(
                        &format!("batched {form:?} f16 A, f16 B {b_half}, {batch}×{m}×{n}×{kk}"),
                        &k.read::<f32>(c.view())?,
                        &want,
                        f32_atol(kk),
                        1e-5,
                    );
                }
            }
        }
        Ok(())
    });
}

/// f16 operands are checked like f32 ones: lengths in values, and a
/// product whose f16 operand would need splitting is refused, not split.
#[test]
fn f16_operands_of_the_wrong_length_are_refused() {
    for_each_adapter("matmul_f16_operands_refused", |k| {
        let a = k.upload_f16(&cpu::to_f16(&[1.0; 6]))?;
        let b = k.upload(&[1.0f32; 6])?;
        let c = k.zeros(4)?;
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 2, 4),
                c.view(),
                a.view(),
                b.view(),
            )
            .unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        Ok(())
    });
}

/// Per element of C = A·B (row-major [m,k]·[k,n]), in f64: the exact
/// product of the f32 inputs and S = Σ|a||b|.
fn reference_and_scale(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut exact = vec![0.0; m * n];
    let mut scale = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let (x, y) = (f64::from(a[i * k + p]), f64::from(b[p * n + j]));
                exact[i * n + j] += x * y;
                scale[i * n + j] += (x * y).abs();
            }
        }
    }
    (exact, scale)
}

/// The stated error bound of the f16 matmul against the exact product of
/// the f32 inputs, per element, for inputs with |x| ≤ 1 rounded to nearest
/// f16 on the host:
/// - each input off by ≤ u = 2⁻¹¹ relative, so each product by ≤ 2u + u²
///   relative: (2u + u²)·S, independent of K;
/// - f32 accumulation (products are exact in f32): ≤ γ·S with
///   γ = K·2⁻²⁴ / (1 − K·2⁻²⁴), 2.4e-4 at K = 4096, below the first term;
/// - inputs below f16's smallest normal 2⁻¹⁴ are subnormal (absolute
///   error η ≤ 2⁻²⁵ each), adding at most 2η(1 + u) + η² per product with
///   |x| ≤ 1: under K·2⁻²³.
///
/// An f16 accumulator would add ≈ K·2⁻¹¹·S in the worst case instead of γ·S.
fn f16_matmul_bound(k: usize, scale: f64) -> f64 {
    let u = 2f64.powi(-11);
    let eps32 = 2f64.powi(-24);
    let gamma = k as f64 * eps32 / (1.0 - k as f64 * eps32);
    (2.0 * u + u * u) * scale + gamma * scale + k as f64 * 2.0 * eps32
}

/// CPU model of what the kernel avoids: the same f16 inputs summed in an
/// f16 accumulator (each step rounded to f16).
fn f16_accumulated(a: &[f16], b: &[f16], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = f16::from_f32(0.0);
            for p in 0..k {
                acc = f16::from_f32(acc.to_f32() + a[i * k + p].to_f32() * b[p * n + j].to_f32());
            }
            c[i * n + j] = f64::from(acc.to_f32());
        }
    }
    c
}

#[test]
fn f16_matmul_error_is_input_rounding_and_does_not_grow_like_f16_accumulation() {
    for_each_adapter("matmul_f16_error", |k| {
        if !k.supports_f16() {
            return Ok(());
        }
        let (m, n) = (3, 67);
        // Non-negative inputs: no cancellation, so C ≈ S and an f16
        // accumulator stalls once the sum's spacing exceeds the terms.
        // Signed inputs: the usual case, C ≪ S.
        for (lo, signs) in [(0.0f32, "non-negative"), (-1.0, "signed")] {
            for (i, kk) in [1usize, 7, 257, 1031, 4096].into_iter().enumerate() {
                let mut r = rng(200 + i as u64);
                let a_host = random_vec(&mut r, m * kk, lo, 1.0);
                let b_host = random_vec(&mut r, kk * n, lo, 1.0);
                let (a16, b16) = (cpu::to_f16(&a_host), cpu::to_f16(&b_host));
                let a = k.upload_f16(&a16)?;
                let b = k.upload_f16(&b16)?;
                let c = k.zeros(m * n)?;
                k.run(&[&k.matmul(
                    &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_kernel(MatmulKernel::NativeF16),
                    c.view(),
                    a.view(),
                    b.view(),
                )?])?;
                let got = k.read::<f32>(c.view())?;
                let (exact, scale) = reference_and_scale(&a_host, &b_host, m, n, kk);
                let mut worst_relative = 0.0f64;
                for e in 0..m * n {
                    let err = (f64::from(got[e]) - exact[e]).abs();
                    let bound = f16_matmul_bound(kk, scale[e]);
                    assert!(
                        err <= bound,
                        "{signs} k={kk} C[{e}]: got {}, exact {}, |err| {err:e} > bound {bound:e}",
                        got[e],
                        exact[e]
                    );
                    worst_relative = worst_relative.max(err / scale[e]);
                }
                eprintln!(
                    "{}: f16 matmul {signs} k={kk}: max |err|/S = {worst_relative:.2e} (bound ≈ {:.2e})",
                    k.device().label(),
                    f16_matmul_bound(kk, 1.0)
                );
                // The bound separates f32 from f16 accumulation: the model
                // of an f16 accumulator breaks it where there is no
                // cancellation and K is large.
                if lo == 0.0 && kk == 4096 {
                    let f16_acc = f16_accumulated(&a16, &b16, m, n, kk);
                    let breaks = (0..m * n).any(|e| (f16_acc[e] - exact[e]).abs() > f16_matmul_bound(kk, scale[e]));
                    assert!(breaks, "the bound does not tell f16 accumulation apart at k={kk}");
                }
            }
        }
        Ok(())
    });
}

/// Inputs for the conversions: random values plus the edges of f16 —
/// signed zero, the largest finite, the smallest normal, subnormals, a
/// value that underflows to 0 and an exact tie (1 + 2⁻¹¹ rounds to even: 1).
fn conversion_inputs(len: usize, seed: u64) -> Vec<f32> {
    let specials = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        -65504.0,
        6.103_515_6e-5,
        3.0e-7,
        -5.960_464_5e-8,
        1.0e-9,
        1.0 + 2f32.powi(-11),
        0.1,
    ];
    let mut values = random_vec(&mut rng(seed), len, -4.0, 4.0);
    for (v, s) in values.iter_mut().zip(specials) {
        *v = s;
    }
    values
}

/// f16 values one unit in the last place apart or less (same sign).
fn within_one_ulp(x: f16, y: f16) -> bool {
    let (a, b) = (x.to_bits() as i32, y.to_bits() as i32);
    (a - b).abs() <= 1 && (a ^ b) & 0x8000 == 0 || x.to_f32() == y.to_f32()
}

#[test]
fn conversions_round_to_f16_and_widen_exactly() {
    for_each_adapter("f16_conversions", |k| {
        if !k.supports_f16() {
            return Ok(());
        }
        for (i, len) in [1usize, 2, 7, 12, 257, 4099].into_iter().enumerate() {
            let host = conversion_inputs(len, 300 + i as u64);
            let src = k.upload(&host)?;
            let half = k.zeros_f16(len)?;
            let back = k.zeros(len)?;
            k.run(&[
                &k.to_f16(half.view(), src.view())?,
                &k.from_f16(back.view(), half.view())?,
            ])?;
            let got = k.read_f16(half.view())?;
            let want = cpu::to_f16(&host);
            // WGSL lets an inexact f32 -> f16 conversion take either
            // neighbour: at most one ulp from round-to-nearest-even.
            let exact = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() == w.to_bits())
                .count();
            for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    within_one_ulp(*g, *w),
                    "to_f16 len={len} [{e}] of {}: got {g}, want {w}",
                    host[e]
                );
            }
            if exact != len {
                eprintln!(
                    "{}: to_f16 len={len}: {exact}/{len} bit-exact (the rest one ulp off)",
                    k.device().label()
                );
            }
            // Widening is exact, subnormals included.
            let widened = k.read::<f32>(back.view())?;
            assert_eq!(widened, cpu::from_f16(&got), "from_f16 len={len}");
            // An odd length leaves the last word's high half 0.
            if len % 2 == 1 {
                let words = k.read::<u32>(half.view().words())?;
                assert_eq!(words[len / 2] >> 16, 0, "spare half of len={len}");
            }
        }
        Ok(())
    });
}

#[test]
fn f16_views_and_conversions_check_lengths() {
    for_each_adapter("f16_lengths", |k| {
        let words = k.zeros(3)?;
        // 3 words hold 5 or 6 values, not 4 or 7.
        assert!(F16View::new(words.view(), 6).is_ok());
        assert!(F16View::new(words.view(), 5).is_ok());
        for bad in [4, 7] {
            assert!(
                matches!(F16View::new(words.view(), bad), Err(Error::Shape { .. })),
                "len {bad}"
            );
        }
        if !k.supports_f16() {
            return Ok(());
        }
        let half = k.zeros_f16(5)?;
        let f = k.zeros(6)?;
        match k.to_f16(half.view(), f.view()) {
            Err(Error::Shape { op, .. }) => assert_eq!(op, "f32_to_f16"),
            other => panic!("to_f16 with 6 -> 5 values: {other:?}"),
        }
        match k.from_f16(f.view(), half.view()) {
            Err(Error::Shape { op, .. }) => assert_eq!(op, "f16_to_f32"),
            other => panic!("from_f16 with 5 -> 6 values: {other:?}"),
        }
        // A is 2×3 and B 3×4 (12 values), C 2×4; claim k = 4.
        let (a, b, c) = (k.zeros_f16(6)?, k.zeros_f16(12)?, k.zeros(8)?);
        match k.matmul(
            &MatmulRequest::new(MatmulForm::AB, 2, 4, 4).with_kernel(MatmulKernel::NativeF16),
            c.view(),
            a.view(),
            b.view(),
        ) {
            Err(Error::Shape { op, shapes, .. }) => {
                assert_eq!(op, "matmul_f16_forward");
                assert_eq!(shapes, vec![vec![2, 4], vec![4, 4], vec![2, 4]]);
            }
            other => panic!("matmul_f16 with k=4: {other:?}"),
        }
        assert!(k
            .matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_kernel(MatmulKernel::NativeF16),
                c.view(),
                a.view(),
                b.view()
            )
            .is_ok());
        Ok(())
    });
}

#[test]
fn subgroup_matmul_matches_the_cpu_in_every_form_and_shape() {
    for_each_adapter("matmul_subgroup", |k| {
        if !k.supports_subgroup_matmul() {
            return Ok(());
        }
        for form in MatmulForm::ALL {
            for (i, &(m, n, kk)) in SHAPES.iter().enumerate() {
                let mut r = rng(400 + i as u64);
                let a_host = random_vec(&mut r, m * kk, -1.0, 1.0);
                let b_host = random_vec(&mut r, kk * n, -1.0, 1.0);
                let a = k.upload(&a_host)?;
                let b = k.upload(&b_host)?;
                let c = k.zeros(m * n)?;
                k.run(&[&k.matmul(
                    &MatmulRequest::new(form, m, n, kk).with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup)),
                    c.view(),
                    a.view(),
                    b.view(),
                )?])?;
                let got = k.read::<f32>(c.view())?;
                let want = cpu::matmul(form, &a_host, &b_host, m, n, kk);
                assert_close(
                    &format!("subgroup {form:?} m={m} n={n} k={kk}"),
                    &got,
                    &want,
                    f32_atol(kk),
                    1e-5,
                );
            }
        }
        let (a, b, c) = (k.zeros(6)?, k.zeros(12)?, k.zeros(8)?);
        match k.matmul(
            &MatmulRequest::new(MatmulForm::AB, 2, 4, 4).with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup)),
            c.view(),
            a.view(),
            b.view(),
        ) {
            Err(Error::Shape { op, .. }) => assert_eq!(op, "matmul_subgroup_forward"),
            other => panic!("matmul_subgroup with k=4: {other:?}"),
        }
        Ok(())
    });
}

fn assert_unsupported(result: wgrad::Result<wgrad::kernels::Dispatch>, k: &Kernels, op: &str, feature: &str) {
    match result {
        Err(Error::Unsupported {
            op: got_op,
            feature: got_feature,
            adapter,
        }) => {
            assert_eq!(got_op, op);
            assert!(
                got_feature.contains(feature),
                "{op}: feature `{got_feature}` should name {feature}"
            );
            assert_eq!(adapter, k.device().label());
        }
        other => panic!("{op} on {}: want Error::Unsupported, got {other:?}", k.device().label()),
    }
}

#[test]
fn opt_in_kernels_refuse_an_adapter_without_the_feature_with_a_clear_error() {
    for_each_adapter("opt_in_unsupported", |k| {
        let f = k.zeros(6)?;
        let half = k.zeros_f16(6)?;
        if !k.supports_f16() {
            assert!(!k.device().features().contains(wgpu::Features::SHADER_F16));
            assert_unsupported(k.to_f16(half.view(), f.view()), k, "f32_to_f16", "SHADER_F16");
            assert_unsupported(k.from_f16(f.view(), half.view()), k, "f16_to_f32", "SHADER_F16");
            let c = k.zeros(4)?;
            let err = k.matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 2, 3).with_kernel(MatmulKernel::NativeF16),
                c.view(),
                half.view(),
                half.view(),
            );
            assert_unsupported(err, k, "matmul_f16_forward", "SHADER_F16");
            // Packing and readback need no feature.
            let values = cpu::to_f16(&[1.5, -2.0, 0.25]);
            assert_eq!(k.read_f16(k.upload_f16(&values)?.view())?, values);
        }
        if !k.supports_subgroup_matmul() {
            let feature = if k.device().features().contains(wgpu::Features::SUBGROUP) {
                "subgroups of exactly 8"
            } else {
                "SUBGROUP"
            };
            let c = k.zeros(4)?;
            assert_unsupported(
                k.matmul(
                    &MatmulRequest::new(MatmulForm::AB, 2, 2, 3)
                        .with_kernel(MatmulKernel::Tiled(MatmulVariant::Subgroup)),
                    c.view(),
                    f.view(),
                    f.view(),
                ),
                k,
                "matmul_subgroup_forward",
                feature,
            );
        }
        // Refusing compiled nothing, so nothing reached wgpu's validation.
        k.device().check("after the refusals")
    });
}

#[test]
fn timestamp_queries_time_a_kernel_per_launch() {
    common::for_each_adapter("timestamp_queries_time_a_kernel_per_launch", |k| {
        let (m, n, kk) = (96, 80, 64);
        let (a, b, c) = (
            k.upload(&vec![0.5f32; m * kk])?,
            k.upload(&vec![0.25f32; kk * n])?,
            k.zeros(m * n)?,
        );
        let d = k.matmul(
            &MatmulRequest::new(MatmulForm::AB, m, n, kk),
            c.view(),
            a.view(),
            b.view(),
        )?;
        // Software drivers compile a pipeline at its first launch: warm up.
        k.run(&[&d])?;
        k.device().wait_idle("warm-up")?;
        let once = k.time_on_gpu(&d, 1)?;
        let many = k.time_on_gpu(&d, 8)?;
        let has = k.device().features().contains(wgpu::Features::TIMESTAMP_QUERY);
        match (once, many) {
            (Some(t1), Some(t8)) => {
                assert!(has);
                // Timed spans, not speeds (a loaded machine makes any ratio
                // flaky; benches compare times): both came back non-zero.
                assert!(
                    t1 > std::time::Duration::ZERO && t8 > std::time::Duration::ZERO,
                    "{t1:?} once, {t8:?} per launch of 8"
                );
                eprintln!("{}: {t1:?} once, {t8:?} per launch of 8", k.device().label());
            }
            (None, None) => eprintln!(
                "{}: no timestamps (TIMESTAMP_QUERY {has}); callers use wall time",
                k.device().label()
            ),
            other => panic!("timestamps came and went: {other:?}"),
        }
        // The timed pass ran the kernel: C holds the product.
        let got: Vec<f32> = k.read(c.view())?;
        assert!(
            got.iter().all(|&v| (v - 0.125 * kk as f32).abs() < 1e-4),
            "{:?}",
            &got[..4]
        );
        Ok(())
    });
}
