//! The rank-1..4 tensor kernels (batched matmul in matmul.wgsl; broadcast,
//! unary, reduce_to_shape, permute, slice/pad/concat of the last axis in
//! tensor.wgsl) against their plain-Rust twins in `wgrad::cpu`, on every
//! adapter present. Shapes include 1, primes, sizes that are not multiples
//! of the 64-wide matmul tile, ranks 3 and 4, and every matmul form.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, for_each_shaping, random_vec, read, rng};
use wgrad::kernels::{Binary, Family, MatmulForm, MatmulVariant, Unary};
use wgrad::kernels::{MatmulKernel, MatmulRequest};
use wgrad::{cpu, Error, Kernels};

fn is_shape_error<T>(r: wgrad::Result<T>) -> bool {
    matches!(r, Err(Error::Shape { .. }))
}

/// Runs one batched product with `accumulate` onto a random C and checks
/// it against the twin (plus the starting C).
#[allow(clippy::too_many_arguments)]
fn check_batched(
    k: &Kernels,
    variant: Option<MatmulVariant>,
    form: MatmulForm,
    accumulate: bool,
    batch: usize,
    m: usize,
    n: usize,
    k_: usize,
    seed: u64,
) -> wgrad::Result<()> {
    let mut r = rng(seed);
    let a_host = random_vec(&mut r, batch * m * k_, -1.0, 1.0);
    let b_host = random_vec(&mut r, batch * k_ * n, -1.0, 1.0);
    let c0 = random_vec(&mut r, batch * m * n, -1.0, 1.0);
    let (a, b, c) = (k.upload(&a_host)?, k.upload(&b_host)?, k.upload(&c0)?);
    let d = match variant {
        None => k.matmul(
            &MatmulRequest::new(form, m, n, k_)
                .with_batch(batch)
                .accumulating(accumulate),
            c.view(),
            a.view(),
            b.view(),
        )?,
        Some(v) => k.matmul(
            &MatmulRequest::new(form, m, n, k_)
                .with_kernel(MatmulKernel::Tiled(v))
                .with_batch(batch)
                .accumulating(accumulate),
            c.view(),
            a.view(),
            b.view(),
        )?,
    };
    assert_eq!(d.workgroups()[2] as usize, batch, "the batch is the grid's z");
    k.run(&[&d])?;
    let mut want = cpu::matmul_batched(form, &a_host, &b_host, batch, m, n, k_);
    if accumulate {
        want.iter_mut().zip(&c0).for_each(|(w, c)| *w += c);
    }
    // k products of |a|,|b| ≤ 1 summed in f32 (fma): |err| ≲ k·2^-24·k
    // in the worst case, far less for random signs; 1e-6·k absolute
    // covers k ≤ 129 with margin, 1e-5 relative for the rest.
    let atol = 1e-6 * k_ as f32 + 1e-6;
    assert_close(
        &format!("{variant:?} {form:?} acc={accumulate} batch {batch} {m}×{n}×{k_}"),
        &read(k, &c)?,
        &want,
        atol,
        1e-5,
    );
    Ok(())
}

#[test]
fn matmul_batched_matches_the_cpu_for_every_form() {
    for_each_adapter("matmul_batched", |k| {
        // Small shapes (the Small kernel): 1, primes, past one 64-wide tile.
        let shapes = [(1, 1, 1), (7, 13, 37), (65, 3, 13), (13, 70, 1)];
        let mut seed = 0;
        for form in MatmulForm::ALL {
            for batch in [1, 3, 7] {
                for &(m, n, k_) in &shapes {
                    seed += 1;
                    check_batched(k, None, form, seed % 2 == 0, batch, m, n, k_, seed)?;
                }
            }
        }
        Ok(())
    });
}

#[test]
fn matmul_batched_picks_the_tuned_kernel_for_a_large_product() {
    for_each_adapter("matmul_batched_large", |k| {
        // 65·129·129 > 2^20 multiply-adds per product: the shape chooser
        // leaves Small; batch 3 and edges off the 64-wide tile. One shape,
        // one form: a register pipeline costs seconds to compile.
        let (m, n, k_) = (65, 129, 129);
        assert_ne!(
            k.matmul_variant_for_shape(MatmulForm::AB, m, n, k_),
            MatmulVariant::Small
        );
        check_batched(k, None, MatmulForm::AB, false, 3, m, n, k_, 100)
    });
}

#[test]
fn every_matmul_variant_offsets_each_batch() {
    for_each_adapter("matmul_batched_variants", |k| {
        // m, n, k multiples of 4 so RegisterVec4 runs its vec4 kernel; m and
        // n past one tile. AtB and ABt between them take every load path
        // (transposed and not) of the kernels compiled per form.
        let (m, n, k_) = (68, 72, 20);
        for (variant, form) in common::variant_forms_to_test(k) {
            if let Some(i) = [MatmulForm::AtB, MatmulForm::ABt].iter().position(|&f| f == form) {
                check_batched(k, Some(variant), form, false, 3, m, n, k_, 200 + i as u64)?;
            }
        }
        Ok(())
    });
}

#[test]
fn matmul_batched_refuses_wrong_lengths_and_a_batch_over_the_grid_limit() {
    for_each_adapter("matmul_batched_errors", |k| {
        // Fits batch 2 of m=2 n=4 k=3: A 2·6, B 2·12, C 2·8 elements.
        let (a, b, c) = (k.zeros(2 * 6)?, k.zeros(2 * 12)?, k.zeros(2 * 8)?);
        assert!(k
            .matmul(
                &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_batch(2),
                c.view(),
                a.view(),
                b.view()
            )
            .is_ok());
        assert!(
            is_shape_error(k.matmul(
                &MatmulRequest::new(MatmulForm::AB, 4, 2, 3).with_batch(2),
                c.view(),
                a.view(),
                b.view()
            )),
            "C fits, A and B do not"
        );
        assert!(is_shape_error(k.matmul(
            &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_batch(3),
            c.view(),
            a.view(),
            b.view()
        )));
        assert!(is_shape_error(k.matmul(
            &MatmulRequest::new(MatmulForm::AB, 2, 4, 3).with_batch(0),
            c.view(),
            a.view(),
            b.view()
        )));
        let max = k.device().limits().max_compute_workgroups_per_dimension as usize;
        let big = k.zeros(max + 1)?;
        let r = k.matmul(
            &MatmulRequest::new(MatmulForm::AB, 1, 1, 1).with_batch(max + 1),
            big.view(),
            big.view(),
            big.view(),
        );
        assert!(is_shape_error(r), "a batch over the z limit must be an Error");
        Ok(())
    });
}

/// (a_shape, b_shape): trailing-aligned broadcasts of ranks 1..4.
const BROADCASTS: [(&[usize], &[usize]); 8] = [
    (&[2, 7, 13], &[13]),
    (&[3, 2, 7, 7], &[7, 7]),
    (&[5, 7, 1], &[5, 7, 13]),
    (&[1], &[37]),
    (&[13], &[1]),
    (&[2, 1, 7, 1], &[3, 1, 5]),
    (&[65], &[65]),
    (&[3, 1, 129], &[1, 5, 1]),
];

#[test]
fn binary_broadcast_matches_the_cpu() {
    for_each_adapter("binary_broadcast", |k| {
        for (i, &(sa, sb)) in BROADCASTS.iter().enumerate() {
            let mut r = rng(300 + i as u64);
            let a_host = random_vec(&mut r, sa.iter().product(), -3.0, 3.0);
            // Divisors away from 0.
            let b_host = random_vec(&mut r, sb.iter().product(), 0.5, 3.0);
            let out_shape = wgrad::ops::broadcast_shape(sa, sb).expect("the table broadcasts");
            let (a, b, out) = (
                k.upload(&a_host)?,
                k.upload(&b_host)?,
                k.zeros(out_shape.iter().product())?,
            );
            for op in Binary::ALL {
                k.run(&[&k.binary_broadcast(op, out.view(), a.view(), b.view(), sa, sb)?])?;
                // One f32 operation each side (division ≤ 2.5 ulp on the GPU).
                assert_close(
                    &format!("{op:?} {sa:?}∘{sb:?}"),
                    &read(k, &out)?,
                    &cpu::binary_broadcast(op, &a_host, &b_host, sa, sb)?,
                    1e-6,
                    1e-6,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn binary_broadcast_refuses_shapes_that_do_not_broadcast() {
    for_each_adapter("binary_broadcast_errors", |k| {
        let (a, b, out) = (k.zeros(6)?, k.zeros(4)?, k.zeros(24)?);
        // b [4, 1] against a [6] broadcasts to [4, 6].
        let add = |sa: &[usize], sb: &[usize], o: &wgrad::GpuTensor| {
            k.binary_broadcast(Binary::Add, o.view(), a.view(), b.view(), sa, sb)
        };
        assert!(is_shape_error(add(&[2, 3], &[4], &out)), "3 against 4");
        assert!(is_shape_error(add(&[1, 1, 1, 2, 3], &[4], &out)), "rank 5");
        assert!(
            is_shape_error(add(&[2, 2], &[4, 1], &out)),
            "a holds 6 elements, not [2, 2]"
        );
        assert!(
            is_shape_error(add(&[6], &[2, 1], &out)),
            "the broadcast [2, 6] is 12 elements, out 24"
        );
        // The same views with shapes that fit: accepted.
        assert!(add(&[6], &[4, 1], &out).is_ok());
        Ok(())
    });
}

#[test]
fn unary_matches_the_cpu() {
    for_each_adapter("unary", |k| {
        for (i, n) in [1usize, 7, 257, 4099].into_iter().enumerate() {
            let mut r = rng(400 + i as u64);
            let x_host = random_vec(&mut r, n, -10.0, 10.0);
            let pos_host = random_vec(&mut r, n, 1e-3, 100.0);
            let (x, pos, out) = (k.upload(&x_host)?, k.upload(&pos_host)?, k.zeros(n)?);
            k.run(&[&k.unary(Unary::Exp, out.view(), x.view())?])?;
            // Vulkan's exp is within 3 + 2|x| ulp: ≤ 23 ulp ≈ 1.4e-6 at |x| ≤ 10.
            assert_close(
                &format!("exp n={n}"),
                &read(k, &out)?,
                &cpu::unary(Unary::Exp, &x_host),
                0.0,
                4e-6,
            );
            // Rsqrt is specified for x > 0 only (see Unary::Rsqrt): 2 ulp.
            k.run(&[&k.unary(Unary::Rsqrt, out.view(), pos.view())?])?;
            assert_close(
                &format!("rsqrt n={n}"),
                &read(k, &out)?,
                &cpu::unary(Unary::Rsqrt, &pos_host),
                0.0,
                1e-6,
            );
        }
        let (x, out) = (k.zeros(3)?, k.zeros(4)?);
        assert!(is_shape_error(k.unary(Unary::Exp, out.view(), x.view())));
        Ok(())
    });
}

/// (x_shape, out_shape): x is out broadcast (leading axes and/or size-1
/// axes expanded). From 256 summed elements per output on, GPU shaping
/// sums in two stages over blocks of ⌈√summed⌉ (the last four, and 7×65×3):
/// blocks that cross summed axes, exactly 256, a prime count on the last axis.
const REDUCTIONS: [(&[usize], &[usize]); 12] = [
    (&[8, 37, 5], &[5]),
    (&[17, 3, 16, 2], &[1, 3, 1, 2]),
    (&[256], &[1]),
    (&[3, 1031], &[3, 1]),
    (&[2, 7, 13], &[13]),
    (&[3, 2, 7, 7], &[7, 7]),
    (&[5, 7, 13], &[5, 7, 1]),
    (&[37], &[1]),
    (&[2, 3, 7, 5], &[2, 1, 7, 1]),
    (&[13], &[13]),
    (&[4, 65, 3], &[1, 65, 1]),
    (&[7, 65, 3], &[3]),
];

#[test]
fn reduce_to_shape_matches_the_cpu() {
    for_each_shaping("reduce_to_shape", |k| {
        for (i, &(sx, so)) in REDUCTIONS.iter().enumerate() {
            let mut r = rng(500 + i as u64);
            let x_host = random_vec(&mut r, sx.iter().product(), -1.0, 1.0);
            let n_out: usize = so.iter().product();
            let start = random_vec(&mut r, n_out, -1.0, 1.0);
            let (x, out) = (k.upload(&x_host)?, k.upload(&start)?);
            let want = cpu::reduce_to_shape(&x_host, sx, so)?;
            // At most 1031 terms of |x| ≤ 1 summed in f32 one after another
            // (or in blocks, then the blocks: less error): ~3e-5 for random
            // signs, 1e-4 leaves room; the twin sums in f64.
            k.run(&[&k.reduce_to_shape(false, out.view(), x.view(), sx, so)?])?;
            assert_close(
                &format!("reduce {sx:?}->{so:?}, GPU shaping {}", k.gpu_shaped()),
                &read(k, &out)?,
                &want,
                1e-4,
                1e-5,
            );
            // Accumulating adds the same sums once more.
            k.run(&[&k.reduce_to_shape(true, out.view(), x.view(), sx, so)?])?;
            let twice: Vec<f32> = want.iter().map(|w| 2.0 * w).collect();
            assert_close(&format!("reduce+= {sx:?}->{so:?}"), &read(k, &out)?, &twice, 2e-4, 1e-5);
        }
        let (x, out) = (k.zeros(6)?, k.zeros(3)?);
        assert!(
            is_shape_error(k.reduce_to_shape(false, out.view(), x.view(), &[3, 2], &[3])),
            "[3, 2] is not a broadcast of [3]"
        );
        assert!(
            is_shape_error(k.reduce_to_shape(false, out.view(), x.view(), &[3], &[2, 3])),
            "out of higher rank than x"
        );
        assert!(
            is_shape_error(k.reduce_to_shape(false, out.view(), x.view(), &[2, 3], &[3, 1])),
            "[2, 3] against [3, 1]"
        );
        Ok(())
    });
}

#[test]
fn permute_matches_the_cpu() {
    for_each_adapter("permute", |k| {
        let cases: [(&[usize], &[usize]); 7] = [
            (&[2, 3, 5, 7], &[0, 2, 1, 3]),
            (&[2, 3, 5, 7], &[3, 2, 1, 0]),
            (&[1, 7, 1, 13], &[2, 3, 0, 1]),
            (&[5, 7, 13], &[1, 2, 0]),
            (&[7, 13], &[1, 0]),
            (&[37], &[0]),
            (&[65, 3, 2], &[2, 0, 1]),
        ];
        for (i, &(shape, perm)) in cases.iter().enumerate() {
            let x_host = random_vec(&mut rng(600 + i as u64), shape.iter().product(), -1.0, 1.0);
            let (x, out) = (k.upload(&x_host)?, k.zeros(x_host.len())?);
            k.run(&[&k.permute(out.view(), x.view(), shape, perm)?])?;
            // A copy: bit-exact.
            assert_close(
                &format!("permute {shape:?} by {perm:?}"),
                &read(k, &out)?,
                &cpu::permute(&x_host, shape, perm)?,
                0.0,
                0.0,
            );
        }
        let (x, out) = (k.zeros(6)?, k.zeros(6)?);
        assert!(
            is_shape_error(k.permute(out.view(), x.view(), &[2, 3], &[0, 0])),
            "a repeated axis"
        );
        assert!(
            is_shape_error(k.permute(out.view(), x.view(), &[2, 3], &[1, 0, 2])),
            "too many axes"
        );
        assert!(
            is_shape_error(k.permute(out.view(), x.view(), &[2, 3], &[2, 0])),
            "an axis out of range"
        );
        assert!(
            is_shape_error(k.permute(out.view(), x.view(), &[1, 1, 1, 2, 3], &[0, 1, 2, 3, 4])),
            "rank 5"
        );
        Ok(())
    });
}

/// (rows, cols, start, width).
const SLICES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 0, 1),
    (7, 13, 0, 13),
    (7, 13, 5, 7),
    (13, 37, 36, 1),
    (3, 129, 64, 65),
    (257, 3, 1, 2),
];

#[test]
fn slice_and_pad_of_the_last_axis_match_the_cpu() {
    for_each_adapter("slice_pad_last", |k| {
        for (i, &(rows, cols, start, width)) in SLICES.iter().enumerate() {
            let mut r = rng(700 + i as u64);
            let x_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            let (x, sliced) = (k.upload(&x_host)?, k.zeros(rows * width)?);
            k.run(&[&k.slice_last(sliced.view(), x.view(), rows, cols, start, width)?])?;
            let want_slice = cpu::slice_last(&x_host, rows, cols, start, width);
            // Copies: bit-exact.
            assert_close(
                &format!("slice {rows}×{cols}[{start}..+{width}]"),
                &read(k, &sliced)?,
                &want_slice,
                0.0,
                0.0,
            );

            // pad overwrites every column (out starts random); accumulating
            // adds into the window and leaves the rest.
            let start_out = random_vec(&mut r, rows * cols, -1.0, 1.0);
            let padded = k.upload(&start_out)?;
            k.run(&[&k.pad_last(false, padded.view(), sliced.view(), rows, cols, start, width)?])?;
            let want_pad = cpu::pad_last(&want_slice, rows, cols, start, width);
            assert_close(&format!("pad {rows}×{cols}"), &read(k, &padded)?, &want_pad, 0.0, 0.0);
            let acc = k.upload(&start_out)?;
            k.run(&[&k.pad_last(true, acc.view(), sliced.view(), rows, cols, start, width)?])?;
            let want_acc: Vec<f32> = start_out.iter().zip(&want_pad).map(|(s, p)| s + p).collect();
            // One f32 addition (the twin's too): exact to the same rounding.
            assert_close(&format!("pad+= {rows}×{cols}"), &read(k, &acc)?, &want_acc, 0.0, 0.0);
        }
        let (x, out) = (k.zeros(13)?, k.zeros(13)?);
        assert!(
            is_shape_error(k.slice_last(out.view(), x.view(), 1, 13, 1, 13)),
            "start + width past cols"
        );
        assert!(
            is_shape_error(k.pad_last(false, out.view(), x.view(), 1, 13, 13, 1)),
            "start at cols"
        );
        assert!(
            is_shape_error(k.slice_last(out.view(), x.view(), 1, 13, 0, 12)),
            "out of the wrong length"
        );
        Ok(())
    });
}

#[test]
fn concat_of_the_last_axis_matches_the_cpu() {
    for_each_adapter("concat_last", |k| {
        for (i, &(rows, a_cols, b_cols)) in [(1usize, 1usize, 1usize), (7, 13, 37), (3, 65, 64), (257, 1, 2)]
            .iter()
            .enumerate()
        {
            let mut r = rng(800 + i as u64);
            let a_host = random_vec(&mut r, rows * a_cols, -1.0, 1.0);
            let b_host = random_vec(&mut r, rows * b_cols, -1.0, 1.0);
            let (a, b, out) = (
                k.upload(&a_host)?,
                k.upload(&b_host)?,
                k.zeros(rows * (a_cols + b_cols))?,
            );
            k.run(&[&k.concat_last(out.view(), a.view(), b.view(), rows, a_cols, b_cols)?])?;
            // A copy: bit-exact.
            assert_close(
                &format!("concat {rows}×({a_cols}+{b_cols})"),
                &read(k, &out)?,
                &cpu::concat_last(&a_host, &b_host, rows, a_cols, b_cols),
                0.0,
                0.0,
            );
        }
        let (a, b, out) = (k.zeros(2)?, k.zeros(3)?, k.zeros(6)?);
        assert!(
            is_shape_error(k.concat_last(out.view(), a.view(), b.view(), 1, 2, 3)),
            "out of 6 for 5 columns"
        );
        assert!(
            is_shape_error(k.concat_last(out.view(), a.view(), b.view(), 1, 0, 6)),
            "an empty side"
        );
        Ok(())
    });
}

#[test]
fn op_codes_agree_between_rust_and_tensor_wgsl() {
    let src = Family::Tensor.source();
    let module = naga::front::wgsl::parse_str(src).expect("tensor.wgsl parses");
    let constant = |name: &str| -> u32 {
        let c = module
            .constants
            .iter()
            .find(|(_, c)| c.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("tensor.wgsl has no {name}"))
            .1;
        match module.global_expressions[c.init] {
            naga::Expression::Literal(naga::Literal::U32(v)) => v,
            ref e => panic!("{name} is {e:?}"),
        }
    };
    for op in Binary::ALL {
        assert_eq!(constant(&format!("BIN_{op:?}").to_uppercase()), op.code(), "{op:?}");
    }
    for op in Unary::ALL {
        assert_eq!(constant(&format!("UN_{op:?}").to_uppercase()), op.code(), "{op:?}");
    }
}
