//! The matrix-vector kernel (`matmul_forward_matvec`) that decoding's
//! one-row products run on: against the CPU twin for each lane count,
//! row count and epilogue, with k and n not multiples of the workgroup's
//! lanes and columns; and which products the shape-selected entries give
//! it. Tolerance: `|gpu - cpu| <= atol + rtol·|cpu|`, beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, read, rng};
use wgrad::cpu;
use wgrad::kernels::{Activation, MatmulEpilogue, MatmulForm, MATVEC_MAX_ROWS};
use wgrad::kernels::{MatmulKernel, MatmulRequest};

/// (n, k): one column, fewer columns than a workgroup's 8, a prime n over
/// several workgroups, k of one vec4, k not a multiple of the lanes'
/// stride, and GPT-2's k = 768 on a few columns.
const SHAPES: [(usize, usize); 6] = [(1, 4), (7, 12), (8, 100), (71, 260), (9, 4), (13, 768)];

#[derive(Clone, Copy, Debug)]
enum Store {
    Plain,
    Accumulate,
    BiasGeluPre,
    GeluGrad,
}

#[test]
fn matvec_matches_the_cpu_for_every_lane_count_row_count_and_epilogue() {
    for_each_adapter("matmul_forward_matvec", |k| {
        for (case, &(n, kk)) in SHAPES.iter().enumerate() {
            for m in 1..=MATVEC_MAX_ROWS {
                for (lanes, store) in [
                    (8, Store::Plain),
                    (64, Store::Accumulate),
                    (16, Store::BiasGeluPre),
                    (8, Store::GeluGrad),
                    (32, Store::Plain),
                ] {
                    let mut r = rng(700 + case as u64 * 10 + m as u64);
                    let (a_host, b_host) = (
                        random_vec(&mut r, m * kk, -1.0, 1.0),
                        random_vec(&mut r, n * kk, -1.0, 1.0),
                    );
                    let (c0, extra) = (
                        random_vec(&mut r, m * n, -1.0, 1.0),
                        random_vec(&mut r, m * n, -2.0, 2.0),
                    );
                    let (a, b, c, pre) = (k.upload(&a_host)?, k.upload(&b_host)?, k.upload(&c0)?, k.zeros(m * n)?);
                    let (bias, x) = (k.upload(&extra[..n])?, k.upload(&extra)?);
                    let epilogue = match store {
                        Store::Plain => MatmulEpilogue::default(),
                        Store::Accumulate => MatmulEpilogue {
                            accumulate: true,
                            ..MatmulEpilogue::default()
                        },
                        Store::BiasGeluPre => MatmulEpilogue {
                            bias: Some(bias.view()),
                            activation: Some((Activation::Gelu, Some(pre.view()))),
                            ..MatmulEpilogue::default()
                        },
                        Store::GeluGrad => MatmulEpilogue {
                            activation_grad: Some((Activation::Gelu, x.view())),
                            ..MatmulEpilogue::default()
                        },
                    };
                    let d = k.matmul(
                        &MatmulRequest::new(MatmulForm::ABt, m, n, kk)
                            .with_kernel(MatmulKernel::Matvec { lanes })
                            .with_epilogue(epilogue),
                        c.view(),
                        a.view(),
                        b.view(),
                    )?;
                    assert_eq!(d.kernel().entry, "matmul_forward_matvec");
                    k.run(&[&d])?;
                    let e = cpu::Epilogue {
                        accumulate_onto: matches!(store, Store::Accumulate).then_some(&c0[..]),
                        bias: matches!(store, Store::BiasGeluPre).then_some(&extra[..n]),
                        activation: matches!(store, Store::BiasGeluPre).then_some(Activation::Gelu),
                        activation_grad: matches!(store, Store::GeluGrad).then_some((Activation::Gelu, &extra[..])),
                    };
                    let (want, want_pre) = cpu::matmul_epilogue(MatmulForm::ABt, e, &a_host, &b_host, m, n, kk);
                    let what = format!("m={m} n={n} k={kk} lanes={lanes} {store:?}");
                    // f32 sums of ≤ 768 products of values in [-1, 1]
                    // (sums of order 10) against f64.
                    assert_close(&what, &read(k, &c)?, &want, 1e-4, 1e-5);
                    if matches!(store, Store::BiasGeluPre) {
                        assert_close(&format!("{what} pre"), &read(k, &pre)?, &want_pre, 1e-4, 1e-5);
                    }
                }
            }
        }
        Ok(())
    });
}

#[test]
fn the_shape_selected_entries_run_matvec_for_few_rows_of_abt() {
    for_each_adapter("matvec selection", |k| {
        let entry = |form: MatmulForm, m: usize, n: usize, kk: usize| -> wgrad::Result<&'static str> {
            let (a, b, c) = (k.zeros(m * kk)?, k.zeros(kk * n)?, k.zeros(m * n)?);
            Ok(
                k.matmul(&MatmulRequest::new(form, m, n, kk), c.view(), a.view(), b.view())?
                    .kernel()
                    .entry,
            )
        };
        assert_eq!(entry(MatmulForm::ABt, 1, 50, 16)?, "matmul_forward_matvec");
        assert_eq!(
            entry(MatmulForm::ABt, MATVEC_MAX_ROWS, 50, 16)?,
            "matmul_forward_matvec"
        );
        assert_ne!(
            entry(MatmulForm::ABt, MATVEC_MAX_ROWS + 1, 50, 16)?,
            "matmul_forward_matvec",
            "too many rows"
        );
        assert_ne!(
            entry(MatmulForm::ABt, 1, 50, 18)?,
            "matmul_forward_matvec",
            "k not a multiple of 4"
        );
        assert_ne!(entry(MatmulForm::AB, 1, 50, 16)?, "matmul_forward_matvec", "AB");
        assert_ne!(entry(MatmulForm::AtB, 1, 50, 16)?, "matmul_forward_matvec", "AtB");
        // The explicit entry refuses what it cannot run.
        let (a, b, c) = (k.zeros(6)?, k.zeros(6 * 3)?, k.zeros(3)?);
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 3, 6).with_kernel(MatmulKernel::Matvec { lanes: 8 }),
                c.view(),
                a.view(),
                b.view(),
            )
            .unwrap_err();
        assert!(err.to_string().contains("k=6"), "{err}");
        let (a, b, c) = (k.zeros(4)?, k.zeros(4)?, k.zeros(1)?);
        let err = k
            .matmul(
                &MatmulRequest::new(MatmulForm::ABt, 1, 1, 4).with_kernel(MatmulKernel::Matvec { lanes: 3 }),
                c.view(),
                a.view(),
                b.view(),
            )
            .unwrap_err();
        assert!(err.to_string().contains("3 lanes"), "{err}");
        Ok(())
    });
}
