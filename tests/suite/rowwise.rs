//! The row-wise kernels (rowwise.wgsl: softmax, layernorm, RMSNorm,
//! cross-entropy, embedding) against their plain-Rust twins in `wgrad::cpu`,
//! on every adapter present, and the norms' graph gradients against f64
//! central differences (`common::gradcheck`). Shapes include 1, primes, lengths that are not
//! multiples of the 256-wide workgroup, rows as long as GPT-2's 50,257-token
//! vocabulary, and more rows than one grid dimension holds.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{
    assert_close, central_differences, for_each_adapter, for_each_shaping, gradcheck, mse_to_random, param, param_in,
    random_vec, read, rng, wide,
};
use rand::Rng;
use wgrad::graph::Graph;
use wgrad::kernels::{SHORT_ROW_MAX, SHORT_ROW_MAX_GPU};
use wgrad::{cpu, Error, Kernels};

/// (rows, cols): 1, primes, around the workgroup size, a long row; the
/// attention example's scores (1536×12) and token rows (384×48); both sides
/// of SHORT_ROW_MAX (128: one invocation per row; 131, a prime: one
/// workgroup per row) and of SHORT_ROW_MAX_GPU (32 and 33), the boundary
/// under GPU shaping.
const ROW_SHAPES: [(usize, usize); 15] = [
    (1, 1),
    (1, 7),
    (3, 1),
    (5, 13),
    (11, 32),
    (6, 33),
    (1536, 12),
    (384, 48),
    (9, 128),
    (5, 131),
    (4, 255),
    (3, 256),
    (7, 257),
    (2, 1031),
    (2, 50_257),
];

#[test]
fn the_shapes_exercise_both_row_paths() {
    assert_eq!(
        SHORT_ROW_MAX, 128,
        "update the shapes at the SHORT_ROW_MAX boundary (128 and the prime 131)"
    );
    assert!(
        ROW_SHAPES.iter().any(|&(_, c)| c == SHORT_ROW_MAX) && ROW_SHAPES.iter().any(|&(_, c)| c == SHORT_ROW_MAX + 3)
    );
    assert_eq!(
        SHORT_ROW_MAX_GPU, 32,
        "update the shapes at the SHORT_ROW_MAX_GPU boundary (32 and 33)"
    );
    assert!(
        ROW_SHAPES.iter().any(|&(_, c)| c == SHORT_ROW_MAX_GPU)
            && ROW_SHAPES.iter().any(|&(_, c)| c == SHORT_ROW_MAX_GPU + 1)
    );
}

#[test]
fn softmax_forward_matches_the_cpu() {
    for_each_shaping("softmax_forward", |k| {
        for (i, &(rows, cols)) in ROW_SHAPES.iter().enumerate() {
            let x_host = random_vec(&mut rng(i as u64), rows * cols, -5.0, 5.0);
            let x = k.upload(&x_host)?;
            let y = k.zeros(rows * cols)?;
            k.run(&[&k.softmax_forward(y.view(), x.view(), rows, cols, None)?])?;
            // exp to a few ulp over |x - max| ≤ 10 (Vulkan allows 3 + 2|x|
            // ulp) and a sum of ≤ 197 terms per invocation in f32: ≲ 1e-5
            // relative; atol for probabilities that are nearly 0.
            assert_close(
                &format!("softmax {rows}×{cols}, GPU shaping {}", k.gpu_shaped()),
                &read(k, &y)?,
                &cpu::softmax_forward(&x_host, rows, cols, None),
                1e-8,
                2e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn causal_softmax_masks_the_future_of_each_query() {
    for_each_shaping("softmax_causal", |k| {
        // [batch·heads·T, T] with batch·heads = 2·3 and T prime (and 1).
        // 12: the attention example; 128 / 131: each side of SHORT_ROW_MAX;
        // 32 / 33: each side of SHORT_ROW_MAX_GPU.
        for (i, t) in [1usize, 2, 7, 12, 13, 32, 33, 128, 131, 257].into_iter().enumerate() {
            let rows = 6 * t;
            let x_host = random_vec(&mut rng(50 + i as u64), rows * t, -5.0, 5.0);
            let x = k.upload(&x_host)?;
            let y = k.zeros(rows * t)?;
            k.run(&[&k.softmax_forward(y.view(), x.view(), rows, t, Some(t))?])?;
            let got = read(k, &y)?;
            let want = cpu::softmax_forward(&x_host, rows, t, Some(t));
            // As softmax_forward_matches_the_cpu.
            assert_close(
                &format!("causal softmax T={t}, GPU shaping {}", k.gpu_shaped()),
                &got,
                &want,
                1e-8,
                2e-5,
            );
            for r in 0..rows {
                let query = r % t;
                assert!(
                    got[r * t + query + 1..(r + 1) * t].iter().all(|&p| p == 0.0),
                    "T={t} row {r}: a masked column is not 0"
                );
                let total: f32 = got[r * t..(r + 1) * t].iter().sum();
                // ≤ 257 probabilities summed in f32.
                assert!(
                    (total - 1.0).abs() < 1e-5,
                    "T={t} row {r}: probabilities sum to {total}"
                );
            }
        }
        Ok(())
    });
}

#[test]
fn softmax_over_more_rows_than_one_grid_dimension_holds() {
    for_each_adapter("softmax_2d_grid", |k| {
        // Rows longer than SHORT_ROW_MAX take one workgroup each: 65,631
        // rows fold the grid into 2-D. Causal (T = 131) so the mask's
        // query position r % T is checked in the grid's second row too.
        let t = SHORT_ROW_MAX + 3;
        let rows = t * 501;
        let x_host = random_vec(&mut rng(7), rows * t, -5.0, 5.0);
        let x = k.upload(&x_host)?;
        let y = k.zeros(rows * t)?;
        let d = k.softmax_forward(y.view(), x.view(), rows, t, Some(t))?;
        assert!(d.workgroups()[1] > 1, "expected a 2-D grid, got {:?}", d.workgroups());
        k.run(&[&d])?;
        // As softmax_forward_matches_the_cpu.
        assert_close(
            &format!("causal softmax {rows}×{t}"),
            &read(k, &y)?,
            &cpu::softmax_forward(&x_host, rows, t, Some(t)),
            1e-8,
            2e-5,
        );

        // Short rows, one invocation each: more than 65,535 rows, causal
        // (T = 12, as in the attention example) and plain.
        for (i, (rows, cols, causal)) in [(12 * 5462, 12, Some(12)), (65_537, 3, None)].into_iter().enumerate() {
            let x_host = random_vec(&mut rng(8 + i as u64), rows * cols, -5.0, 5.0);
            let x = k.upload(&x_host)?;
            let y = k.zeros(rows * cols)?;
            k.run(&[&k.softmax_forward(y.view(), x.view(), rows, cols, causal)?])?;
            // As softmax_forward_matches_the_cpu.
            assert_close(
                &format!("softmax {rows}×{cols}"),
                &read(k, &y)?,
                &cpu::softmax_forward(&x_host, rows, cols, causal),
                1e-8,
                2e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn short_rows_fold_the_grid_past_65535_workgroups() {
    for_each_adapter("softmax_short_2d_grid", |k| {
        // 256 rows per workgroup: 65,535·256 + 1 rows of one column need a
        // second grid row. softmax of one value is exactly 1; a row the
        // grid missed would stay 0.
        let rows = 65_535 * 256 + 1;
        let x = k.zeros(rows)?;
        let y = k.zeros(rows)?;
        let d = k.softmax_forward(y.view(), x.view(), rows, 1, None)?;
        assert!(d.workgroups()[1] > 1, "expected a 2-D grid, got {:?}", d.workgroups());
        k.run(&[&d])?;
        let got = read(k, &y)?;
        if let Some(r) = got.iter().position(|&v| v != 1.0) {
            panic!("row {r} of {rows}: {} instead of 1", got[r]);
        }
        Ok(())
    });
}

#[test]
fn softmax_backward_matches_the_cpu() {
    for_each_shaping("softmax_backward", |k| {
        for (i, &(rows, cols)) in ROW_SHAPES.iter().enumerate() {
            let mut r = rng(100 + i as u64);
            let y_host = cpu::softmax_forward(&random_vec(&mut r, rows * cols, -5.0, 5.0), rows, cols, None);
            let dy_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            let (y, dy, dx) = (k.upload(&y_host)?, k.upload(&dy_host)?, k.zeros(rows * cols)?);
            k.run(&[&k.softmax_backward(dx.view(), y.view(), dy.view(), rows, cols)?])?;
            // dx = y·(dy − dot) with y ≤ 1, |dy| ≤ 1 and dot a ≤ 1 sum in
            // f32: |err| ≲ y·1e-6, so 1e-7 absolute plus 1e-5 relative.
            assert_close(
                &format!("softmax_backward {rows}×{cols}, GPU shaping {}", k.gpu_shaped()),
                &read(k, &dx)?,
                &cpu::softmax_backward(&y_host, &dy_host, rows, cols),
                1e-7,
                1e-5,
            );
        }
        Ok(())
    });
}

/// Layernorm (and RMSNorm) shapes: the row shapes plus many rows (the parameter
/// gradients sum over rows; from 256 rows on, in two stages under GPU
/// shaping: 255 / 256 rows, primes, a block count above the columns).
/// Includes the attention example's 384×48, both sides of SHORT_ROW_MAX, and
/// more rows than one grid dimension holds on the short path.
const LAYERNORM_SHAPES: [(usize, usize); 18] = [
    (255, 33),
    (256, 32),
    (1031, 7),
    (1, 1),
    (1, 7),
    (3, 1),
    (5, 13),
    (384, 48),
    (9, 128),
    (5, 131),
    (4, 255),
    (3, 256),
    (7, 257),
    (2, 1031),
    (1, 50_257),
    (301, 37),
    (70_001, 5),
    (300, 12),
];

#[test]
fn layernorm_forward_matches_the_cpu() {
    for_each_shaping("layernorm_forward", |k| {
        for (i, &(rows, cols)) in LAYERNORM_SHAPES.iter().enumerate() {
            let mut r = rng(200 + i as u64);
            // Offset by 3 so the mean is far from 0 (the variance must not cancel).
            let x_host: Vec<f32> = random_vec(&mut r, rows * cols, -2.0, 2.0)
                .iter()
                .map(|v| v + 3.0)
                .collect();
            let w_host = random_vec(&mut r, cols, 0.5, 1.5);
            let b_host = random_vec(&mut r, cols, -1.0, 1.0);
            let (x, w, b) = (k.upload(&x_host)?, k.upload(&w_host)?, k.upload(&b_host)?);
            let (y, mean, rstd) = (k.zeros(rows * cols)?, k.zeros(rows)?, k.zeros(rows)?);
            k.run(&[&k.layernorm_forward(
                y.view(),
                mean.view(),
                rstd.view(),
                x.view(),
                w.view(),
                b.view(),
                rows,
                cols,
                1e-5,
            )?])?;
            let want = cpu::layernorm_forward(&x_host, &w_host, &b_host, rows, cols, 1e-5);
            let what = format!("layernorm {rows}×{cols}, GPU shaping {}", k.gpu_shaped());
            // Sums of ≤ 197 terms per invocation of |x| ≤ 5 in f32:
            // mean and variance to ~1e-6 relative; y = O(5).
            assert_close(&format!("{what} mean"), &read(k, &mean)?, &want.mean, 1e-6, 1e-5);
            assert_close(&format!("{what} rstd"), &read(k, &rstd)?, &want.rstd, 0.0, 1e-5);
            assert_close(&format!("{what} y"), &read(k, &y)?, &want.y, 1e-5, 1e-5);
        }
        Ok(())
    });
}

#[test]
fn layernorm_backward_and_parameter_gradients_match_the_cpu() {
    for_each_shaping("layernorm_backward", |k| {
        for (i, &(rows, cols)) in LAYERNORM_SHAPES.iter().enumerate() {
            let mut r = rng(300 + i as u64);
            let x_host: Vec<f32> = random_vec(&mut r, rows * cols, -2.0, 2.0)
                .iter()
                .map(|v| v + 3.0)
                .collect();
            let w_host = random_vec(&mut r, cols, 0.5, 1.5);
            let dy_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            // The kernels take the forward's statistics; the twin's are used
            // for both sides, so only the backward is compared.
            let fwd = cpu::layernorm_forward(&x_host, &w_host, &vec![0.0; cols], rows, cols, 1e-5);
            let dw0 = random_vec(&mut r, cols, -1.0, 1.0);
            let db0 = random_vec(&mut r, cols, -1.0, 1.0);
            let (x, w, dy) = (k.upload(&x_host)?, k.upload(&w_host)?, k.upload(&dy_host)?);
            let (mean, rstd) = (k.upload(&fwd.mean)?, k.upload(&fwd.rstd)?);
            let (dx, dw, db) = (k.zeros(rows * cols)?, k.upload(&dw0)?, k.upload(&db0)?);
            k.run(&[
                &k.layernorm_backward(
                    dx.view(),
                    dy.view(),
                    x.view(),
                    w.view(),
                    mean.view(),
                    rstd.view(),
                    rows,
                    cols,
                )?,
                &k.layernorm_backward_params(
                    true,
                    dw.view(),
                    db.view(),
                    dy.view(),
                    x.view(),
                    mean.view(),
                    rstd.view(),
                    rows,
                    cols,
                )?,
            ])?;
            let want = cpu::layernorm_backward(&dy_host, &x_host, &w_host, &fwd.mean, &fwd.rstd, rows, cols);
            let what = format!("layernorm_backward {rows}×{cols}, GPU shaping {}", k.gpu_shaped());
            // dx = (g − mean(g) − x̂·mean(g·x̂))·rstd with |g| ≤ 1.5, |x̂| ≲ 2
            // and rstd ≲ 1.5 (cols = 1 gives exactly 0): f32 sums of ≤ 197
            // terms per invocation, a few roundings of O(1) values.
            assert_close(&format!("{what} dx"), &read(k, &dx)?, &want.dx, 2e-6, 2e-5);
            // Added into the initial values; sums over ≤ 70,001 rows in order,
            // or in blocks of ⌈√rows⌉ then the blocks (atol grows with the rows).
            let add = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f32>>();
            let atol = 1e-6 * rows as f32 + 1e-6;
            assert_close(
                &format!("{what} dweight"),
                &read(k, &dw)?,
                &add(&dw0, &want.dweight),
                atol,
                1e-5,
            );
            assert_close(
                &format!("{what} dbias"),
                &read(k, &db)?,
                &add(&db0, &want.dbias),
                atol,
                1e-5,
            );
        }
        Ok(())
    });
}

/// (rows, vocab) for cross-entropy: 1, primes, a digits-sized and a
/// GPT-2-sized vocabulary.
/// Also the attention example's 384×16 and both sides of SHORT_ROW_MAX and
/// of SHORT_ROW_MAX_GPU.
const CE_SHAPES: [(usize, usize); 12] = [
    (1, 1),
    (1, 2),
    (3, 7),
    (384, 16),
    (5, 32),
    (7, 33),
    (3, 128),
    (3, 131),
    (5, 257),
    (64, 65),
    (2, 1031),
    (4, 50_257),
];

#[test]
fn cross_entropy_rows_matches_the_cpu() {
    for_each_shaping("cross_entropy_rows", |k| {
        for (i, &(rows, vocab)) in CE_SHAPES.iter().enumerate() {
            let mut r = rng(400 + i as u64);
            let logits_host = random_vec(&mut r, rows * vocab, -4.0, 4.0);
            let targets_host: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
            let scale = 1.0 / rows as f32;
            let (logits, targets) = (k.upload(&logits_host)?, k.upload(&targets_host)?);
            let (losses, dlogits, mean) = (k.zeros(rows)?, k.zeros(rows * vocab)?, k.zeros(1)?);
            k.run(&[
                &k.cross_entropy_rows_forward_backward(
                    losses.view(),
                    dlogits.view(),
                    logits.view(),
                    targets.view(),
                    rows,
                    vocab,
                    scale,
                )?,
                &k.mean(mean.view(), losses.view())?,
            ])?;
            let (want_losses, want_dlogits) =
                cpu::cross_entropy_rows_forward_backward(&logits_host, &targets_host, rows, vocab, scale);
            let what = format!("cross_entropy_rows {rows}×{vocab}, GPU shaping {}", k.gpu_shaped());
            // max + log Σ exp: the f32 sum of ≤ 50,257 terms (≤ 197 per
            // invocation) is good to ~1e-5 relative, so the log to ~1e-5
            // absolute; losses are ≲ 19.
            assert_close(&format!("{what} losses"), &read(k, &losses)?, &want_losses, 3e-5, 1e-5);
            assert_close(
                &format!("{what} mean"),
                &read(k, &mean)?,
                &[cpu::mean(&want_losses)],
                3e-5,
                1e-5,
            );
            // (p − onehot)·scale: p to ~2e-5 relative (the sum, exp's ulp).
            assert_close(
                &format!("{what} dlogits"),
                &read(k, &dlogits)?,
                &want_dlogits,
                1e-9,
                3e-5,
            );
        }
        Ok(())
    });
}

#[test]
fn cross_entropy_rows_gradient_matches_central_differences() {
    for_each_adapter("cross_entropy_rows_gradient", |k| {
        let (rows, vocab) = (3, 7);
        let mut r = rng(450);
        let logits_host = random_vec(&mut r, rows * vocab, -2.0, 2.0);
        let targets_host = vec![0u32, 6, 3];
        let scale = 1.0 / rows as f32;
        let (logits, targets) = (k.upload(&logits_host)?, k.upload(&targets_host)?);
        let (losses, dlogits) = (k.zeros(rows)?, k.zeros(rows * vocab)?);
        k.run(&[&k.cross_entropy_rows_forward_backward(
            losses.view(),
            dlogits.view(),
            logits.view(),
            targets.view(),
            rows,
            vocab,
            scale,
        )?])?;
        // The mean loss in f64, differentiated with step h.
        let mean_loss = |l: &[f64]| {
            cpu::cross_entropy_rows_loss(l, &targets_host, rows, vocab)
                .iter()
                .sum::<f64>()
                / rows as f64
        };
        let wide: Vec<f64> = logits_host.iter().map(|&v| f64::from(v)).collect();
        let h = 1e-4;
        let numeric: Vec<f32> = (0..rows * vocab)
            .map(|i| {
                let (mut up, mut down) = (wide.clone(), wide.clone());
                up[i] += h;
                down[i] -= h;
                ((mean_loss(&up) - mean_loss(&down)) / (2.0 * h)) as f32
            })
            .collect();
        // Truncation error ~h²/6·|f'''| ≈ 2e-9, plus f32 rounding of
        // gradients ≤ 1/3 (ulp 3e-8) and of the logits the GPU read.
        assert_close(
            "dlogits vs central differences",
            &read(k, &dlogits)?,
            &numeric,
            1e-7,
            1e-5,
        );
        Ok(())
    });
}

#[test]
fn a_target_outside_the_vocabulary_gives_a_nan_row_and_no_out_of_bounds_read() {
    for_each_adapter("cross_entropy_rows_bad_target", |k| {
        let (rows, vocab) = (3, 5);
        let logits_host = random_vec(&mut rng(460), rows * vocab, -2.0, 2.0);
        let targets_host = vec![1u32, 5, u32::MAX];
        let (logits, targets) = (k.upload(&logits_host)?, k.upload(&targets_host)?);
        let (losses, dlogits) = (k.zeros(rows)?, k.zeros(rows * vocab)?);
        k.run(&[&k.cross_entropy_rows_forward_backward(
            losses.view(),
            dlogits.view(),
            logits.view(),
            targets.view(),
            rows,
            vocab,
            1.0,
        )?])?;
        let (want_losses, want_dlogits) =
            cpu::cross_entropy_rows_forward_backward(&logits_host, &targets_host, rows, vocab, 1.0);
        assert!(want_losses[1].is_nan() && want_losses[2].is_nan() && want_dlogits[5..].iter().all(|v| v.is_nan()));
        // NaN exactly where the twin has NaN; row 0 as in cross_entropy_rows_matches_the_cpu.
        assert_close("losses", &read(k, &losses)?, &want_losses, 3e-5, 1e-5);
        assert_close("dlogits", &read(k, &dlogits)?, &want_dlogits, 1e-9, 3e-5);
        Ok(())
    });
}

/// (n, vocab, channels) for the embedding: 1, primes, more positions than a
/// workgroup, more channels than a workgroup, a GPT-2-sized vocabulary.
/// Under GPU shaping the sort's workgroup has 1024 lanes: 2053 positions
/// fill two tiles and part of a third.
const EMBEDDING_SHAPES: [(usize, usize, usize); 8] = [
    (1, 1, 1),
    (13, 7, 5),
    (257, 3, 300),
    (300, 50, 257),
    (1000, 11, 37),
    (64, 50_257, 3),
    (2, 2, 1),
    (2053, 13, 2),
];

/// Ids for the embedding tests: the first half from a handful of tokens (so
/// tokens repeat many times), the rest from the whole vocabulary.
fn embedding_ids(r: &mut impl Rng, n: usize, vocab: usize) -> Vec<u32> {
    let few = vocab.min(5) as u32;
    (0..n)
        .map(|i| {
            if i < n / 2 {
                r.random_range(0..few)
            } else {
                r.random_range(0..vocab as u32)
            }
        })
        .collect()
}

#[test]
fn embedding_forward_matches_the_cpu() {
    for_each_adapter("embedding_forward", |k| {
        for (i, &(n, vocab, channels)) in EMBEDDING_SHAPES.iter().enumerate() {
            let mut r = rng(500 + i as u64);
            let table_host = random_vec(&mut r, vocab * channels, -1.0, 1.0);
            let ids_host = embedding_ids(&mut r, n, vocab);
            let (table, ids, out) = (k.upload(&table_host)?, k.upload(&ids_host)?, k.zeros(n * channels)?);
            k.run(&[&k.embedding_forward(out.view(), table.view(), ids.view(), n, vocab, channels)?])?;
            // A copy: exact.
            assert_close(
                &format!("embedding {n}×{vocab}×{channels}"),
                &read(k, &out)?,
                &cpu::embedding_forward(&table_host, &ids_host, vocab, channels),
                0.0,
                0.0,
            );
        }
        Ok(())
    });
}

/// Runs the two backward kernels (sort, gather) in one pass onto a dtable
/// that starts at `dtable0`; returns dtable and the sorted positions.
fn embedding_backward_gpu(
    k: &Kernels,
    dtable0: &[f32],
    dout: &[f32],
    ids_host: &[u32],
    vocab: usize,
    channels: usize,
) -> wgrad::Result<(Vec<f32>, Vec<u32>)> {
    let n = ids_host.len();
    let (dtable, dout, ids) = (k.upload(dtable0)?, k.upload(dout)?, k.upload(ids_host)?);
    // Scratch that starts dirty: the sort must not depend on its contents.
    let order = k.upload(&vec![u32::MAX; n])?;
    let cursor = k.upload(&vec![7u32; vocab + 1])?;
    k.run(&[
        &k.embedding_backward_sort(order.view(), cursor.view(), ids.view(), n, vocab)?,
        &k.embedding_backward(dtable.view(), dout.view(), ids.view(), order.view(), n, vocab, channels)?,
    ])?;
    Ok((k.read::<f32>(dtable.view())?, k.read::<u32>(order.view())?))
}

/// The positions 0..n stably sorted by id, ids ≥ vocab last.
fn stable_order(ids: &[u32], vocab: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&n| (ids[n as usize] as usize).min(vocab));
    order
}

#[test]
fn embedding_backward_is_deterministic_and_matches_the_cpu() {
    for_each_shaping("embedding_backward", |k| {
        for (i, &(n, vocab, channels)) in EMBEDDING_SHAPES.iter().enumerate() {
            let mut r = rng(600 + i as u64);
            let ids_host = embedding_ids(&mut r, n, vocab);
            let dout = random_vec(&mut r, n * channels, -1.0, 1.0);
            let dtable0 = random_vec(&mut r, vocab * channels, -1.0, 1.0);
            let what = format!(
                "embedding_backward {n}×{vocab}×{channels}, GPU shaping {}",
                k.gpu_shaped()
            );
            let (first, order) = embedding_backward_gpu(k, &dtable0, &dout, &ids_host, vocab, channels)?;
            assert_eq!(order, stable_order(&ids_host, vocab), "{what}: sorted positions");
            let (second, _) = embedding_backward_gpu(k, &dtable0, &dout, &ids_host, vocab, channels)?;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&first), bits(&second), "{what}: two runs differ");
            let grad = cpu::embedding_backward(&dout, &ids_host, vocab, channels);
            let want: Vec<f32> = dtable0.iter().zip(&grad).map(|(a, b)| a + b).collect();
            // f32 sums of up to n terms of |v| ≤ 1 in position order vs f64.
            assert_close(&what, &first, &want, 1e-6 * n as f32 + 1e-6, 1e-5);
        }
        Ok(())
    });
}

#[test]
fn ids_outside_the_vocabulary_are_nan_forward_dropped_backward_and_an_error_on_the_host() {
    for_each_adapter("embedding_bad_ids", |k| {
        let (vocab, channels) = (4, 3);
        let ids_host = vec![2u32, 4, 0, u32::MAX, 2];
        let n = ids_host.len();
        let mut r = rng(700);
        let table_host = random_vec(&mut r, vocab * channels, -1.0, 1.0);
        let (table, ids, out) = (k.upload(&table_host)?, k.upload(&ids_host)?, k.zeros(n * channels)?);
        k.run(&[&k.embedding_forward(out.view(), table.view(), ids.view(), n, vocab, channels)?])?;
        let got = read(k, &out)?;
        assert!(got[3..6].iter().chain(&got[9..12]).all(|v| v.is_nan()), "{got:?}");
        // Exact copies elsewhere, NaN where the twin has NaN.
        assert_close(
            "forward",
            &got,
            &cpu::embedding_forward(&table_host, &ids_host, vocab, channels),
            0.0,
            0.0,
        );

        let dout = random_vec(&mut r, n * channels, -1.0, 1.0);
        let dtable0 = vec![0.0; vocab * channels];
        let (dtable, order) = embedding_backward_gpu(k, &dtable0, &dout, &ids_host, vocab, channels)?;
        assert_eq!(order, stable_order(&ids_host, vocab));
        // Two terms at most: exact up to one rounding.
        assert_close(
            "backward",
            &dtable,
            &cpu::embedding_backward(&dout, &ids_host, vocab, channels),
            1e-7,
            1e-6,
        );

        let err = wgrad::kernels::check_token_ids("embedding", &ids_host, vocab).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { op: "embedding", reason } if reason.contains("position 1")),
            "{err}"
        );
        assert!(wgrad::kernels::check_token_ids("embedding", &[0, 3, 1], vocab).is_ok());
        Ok(())
    });
}

fn shape_op(result: wgrad::Result<wgrad::kernels::Dispatch>) -> &'static str {
    match result {
        Err(Error::Shape { op, .. }) => op,
        Err(other) => panic!("expected a shape error, got {other}"),
        Ok(_) => panic!("expected a shape error, got a dispatch"),
    }
}

#[test]
fn wrong_shapes_are_errors_naming_the_kernel() {
    for_each_adapter("rowwise_shapes", |k| {
        let t6 = k.zeros(6)?;
        let t5 = k.zeros(5)?;
        let t2 = k.zeros(2)?;
        let t3 = k.zeros(3)?;
        // Second tensors for the calls that must succeed: a writable
        // binding may not alias another (WebGPU's rule, checked everywhere).
        let (t6b, t2b) = (k.zeros(6)?, k.zeros(2)?);
        let (a, b, s, p) = (t6.view(), t5.view(), t2.view(), t3.view());
        let (a2, s2) = (t6b.view(), t2b.view());
        assert_eq!(shape_op(k.softmax_forward(a, b, 2, 3, None)), "softmax_forward");
        assert_eq!(shape_op(k.softmax_forward(a, a, 0, 3, None)), "softmax_forward");
        // A causal mask needs cols = T and rows a multiple of T.
        assert_eq!(shape_op(k.softmax_forward(a, a, 2, 3, Some(3))), "softmax_forward");
        assert_eq!(shape_op(k.softmax_forward(a, a, 3, 2, Some(3))), "softmax_forward");
        assert_eq!(shape_op(k.softmax_forward(a, a, 3, 2, Some(2))), "softmax_forward");
        assert!(k.softmax_forward(a2, a, 2, 3, None).is_ok() && k.softmax_forward(a2, a, 6, 1, Some(1)).is_ok());
        assert_eq!(shape_op(k.softmax_backward(a, a, b, 2, 3)), "softmax_backward");
        assert_eq!(
            shape_op(k.layernorm_forward(a, s, s, a, p, s, 2, 3, 1e-5)),
            "layernorm_forward"
        );
        assert!(k.layernorm_forward(a2, s, s2, a, p, p, 2, 3, 1e-5).is_ok());
        assert!(matches!(
            k.layernorm_forward(a2, s, s2, a, p, p, 2, 3, f32::NAN),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(
            shape_op(k.layernorm_backward(a, a, a, p, p, s, 2, 3)),
            "layernorm_backward"
        );
        assert_eq!(
            shape_op(k.layernorm_backward_params(false, s, p, a, a, s, s, 2, 3)),
            "layernorm_backward_params"
        );
        assert_eq!(
            shape_op(k.cross_entropy_rows_forward_backward(s, a, a, p, 2, 3, 0.5)),
            "cross_entropy_rows_forward_backward"
        );
        assert!(matches!(
            k.cross_entropy_rows_forward_backward(s, a, a, s, 2, 3, f32::INFINITY),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(shape_op(k.embedding_forward(a, a, s, 2, 3, 3)), "embedding_forward");
        assert!(k.embedding_forward(a2, a, s, 2, 2, 3).is_ok());
        assert_eq!(
            shape_op(k.embedding_backward_sort(s, s, s, 2, 2)),
            "embedding_backward_sort"
        );
        assert!(k.embedding_backward_sort(s, p, s2, 2, 2).is_ok());
        assert_eq!(
            shape_op(k.embedding_backward(a, a, s, p, 2, 2, 3)),
            "embedding_backward"
        );
        Ok(())
    });
}

/// The RMSNorm kernels' eps: Llama's.
const RMS_EPS: f32 = 1e-6;

#[test]
fn rmsnorm_forward_matches_the_cpu() {
    for_each_shaping("rmsnorm_forward", |k| {
        for (i, &(rows, cols)) in LAYERNORM_SHAPES.iter().enumerate() {
            let mut r = rng(800 + i as u64);
            let mut x_host = random_vec(&mut r, rows * cols, -2.0, 2.0);
            // A row of zeros: eps > 0 makes it 0, not NaN.
            x_host[..cols].fill(0.0);
            let w_host = random_vec(&mut r, cols, 0.5, 1.5);
            let (x, w) = (k.upload(&x_host)?, k.upload(&w_host)?);
            let (y, rstd) = (k.zeros(rows * cols)?, k.zeros(rows)?);
            k.run(&[&k.rmsnorm_forward(y.view(), rstd.view(), x.view(), w.view(), rows, cols, RMS_EPS)?])?;
            let want = cpu::rmsnorm_forward(&x_host, &w_host, rows, cols, RMS_EPS);
            let what = format!("rmsnorm {rows}×{cols}, GPU shaping {}", k.gpu_shaped());
            // Σ x² of ≤ 197 terms per invocation in f32, then sqrt and a
            // division: rstd to ~1e-6 relative (1000 for the zero row:
            // 1/√eps, exact in both).
            assert_close(&format!("{what} rstd"), &read(k, &rstd)?, &want.rstd, 0.0, 1e-5);
            // y = x·rstd·w = O(3): two more roundings.
            assert_close(&format!("{what} y"), &read(k, &y)?, &want.y, 1e-6, 1e-5);
            assert!(read(k, &y)?[..cols].iter().all(|&v| v == 0.0), "{what}: the zero row");
        }
        Ok(())
    });
}

#[test]
fn rmsnorm_backward_and_weight_gradient_match_the_cpu() {
    for_each_shaping("rmsnorm_backward", |k| {
        for (i, &(rows, cols)) in LAYERNORM_SHAPES.iter().enumerate() {
            let mut r = rng(900 + i as u64);
            let x_host = random_vec(&mut r, rows * cols, -2.0, 2.0);
            let w_host = random_vec(&mut r, cols, 0.5, 1.5);
            let dy_host = random_vec(&mut r, rows * cols, -1.0, 1.0);
            // Both sides take the twin's rstd: only the backward is compared.
            let fwd = cpu::rmsnorm_forward(&x_host, &w_host, rows, cols, RMS_EPS);
            let dw0 = random_vec(&mut r, cols, -1.0, 1.0);
            let (x, w, dy, rstd) = (
                k.upload(&x_host)?,
                k.upload(&w_host)?,
                k.upload(&dy_host)?,
                k.upload(&fwd.rstd)?,
            );
            let want = cpu::rmsnorm_backward(&dy_host, &x_host, &w_host, &fwd.rstd, rows, cols);
            let what = format!("rmsnorm_backward {rows}×{cols}, GPU shaping {}", k.gpu_shaped());
            // Sums over ≤ 70,001 rows in order, or in blocks then the
            // blocks: atol grows with the rows.
            let atol = 1e-6 * rows as f32 + 1e-6;
            // Accumulating onto dw0, then overwriting stale values (NaN).
            for accumulate in [true, false] {
                let (dx, dw) = (
                    k.zeros(rows * cols)?,
                    k.upload(&if accumulate { dw0.clone() } else { vec![f32::NAN; cols] })?,
                );
                k.run(&[
                    &k.rmsnorm_backward(dx.view(), dy.view(), x.view(), w.view(), rstd.view(), rows, cols)?,
                    &k.rmsnorm_backward_params(accumulate, dw.view(), dy.view(), x.view(), rstd.view(), rows, cols)?,
                ])?;
                // dx = (g − x̂·mean(g·x̂))·rstd with |g| ≤ 1.5, |x̂| ≲ 2√3 and
                // rstd ≲ 1/√eps only for tiny rows: f32 sums of ≤ 197 terms
                // per invocation, a few roundings of O(1) values.
                assert_close(&format!("{what} dx"), &read(k, &dx)?, &want.dx, 2e-6, 2e-5);
                let base = if accumulate { dw0.clone() } else { vec![0.0; cols] };
                let dweight: Vec<f32> = base.iter().zip(&want.dweight).map(|(a, b)| a + b).collect();
                assert_close(
                    &format!("{what} dweight, accumulate {accumulate}"),
                    &read(k, &dw)?,
                    &dweight,
                    atol,
                    1e-5,
                );
            }
        }
        Ok(())
    });
}

#[test]
fn rmsnorm_twin_gradients_match_central_differences() {
    for (i, &(rows, cols)) in [(3usize, 7usize), (2, 1), (1, 13)].iter().enumerate() {
        let mut r = rng(950 + i as u64);
        let x = random_vec(&mut r, rows * cols, -2.0, 2.0);
        let w = random_vec(&mut r, cols, 0.5, 1.5);
        let dy = random_vec(&mut r, rows * cols, -1.0, 1.0);
        let fwd = cpu::rmsnorm_forward(&x, &w, rows, cols, RMS_EPS);
        let got = cpu::rmsnorm_backward(&dy, &x, &w, &fwd.rstd, rows, cols);
        let dx = central_differences(&wide(&x), &wide(&dy), 1e-5, |v| {
            cpu::rmsnorm_forward(v, &wide(&w), rows, cols, RMS_EPS).y
        });
        let dw = central_differences(&wide(&w), &wide(&dy), 1e-5, |v| {
            cpu::rmsnorm_forward(&wide(&x), v, rows, cols, RMS_EPS).y
        });
        // Truncation ~h²·|f'''| ≲ 1e-9; the twin's rstd is rounded to f32
        // (6e-8 relative), which bounds the gradients' error.
        assert_close(&format!("rmsnorm dx {rows}×{cols}"), &got.dx, &dx, 1e-6, 1e-6);
        assert_close(&format!("rmsnorm dweight {rows}×{cols}"), &got.dweight, &dw, 1e-6, 1e-6);
    }
}

#[test]
fn rmsnorm_refuses_bad_arguments() {
    for_each_adapter("rmsnorm_errors", |k| {
        let (x, w, rstd, y2) = (k.zeros(6)?, k.zeros(3)?, k.zeros(2)?, k.zeros(6)?);
        assert!(k
            .rmsnorm_forward(y2.view(), rstd.view(), x.view(), w.view(), 2, 3, RMS_EPS)
            .is_ok());
        for eps in [0.0, -1e-6, f32::NAN, f32::INFINITY] {
            assert!(
                matches!(
                    k.rmsnorm_forward(y2.view(), rstd.view(), x.view(), w.view(), 2, 3, eps),
                    Err(Error::InvalidArgument {
                        op: "rmsnorm_forward",
                        ..
                    })
                ),
                "eps {eps}"
            );
        }
        assert!(matches!(
            k.rmsnorm_forward(y2.view(), rstd.view(), x.view(), w.view(), 3, 2, RMS_EPS),
            Err(Error::Shape {
                op: "rmsnorm_forward",
                ..
            })
        ));
        assert!(matches!(
            k.rmsnorm_backward(y2.view(), x.view(), x.view(), rstd.view(), rstd.view(), 2, 3),
            Err(Error::Shape {
                op: "rmsnorm_backward",
                ..
            })
        ));
        assert!(matches!(
            k.rmsnorm_backward_params(false, rstd.view(), x.view(), x.view(), rstd.view(), 2, 3),
            Err(Error::Shape {
                op: "rmsnorm_backward_params",
                ..
            })
        ));
        Ok(())
    });
}

#[test]
fn norms_backward_match_central_differences() {
    for_each_adapter("gradcheck norms", |k| {
        // LayerNorm over the last dimension of a rank-3 tensor.
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 3, 7], 35);
        let w = param_in(&mut g, "w", &[7], 36, 0.5, 1.5);
        let b = param(&mut g, "b", &[7], 37);
        let y = g.layer_norm(x, w, b, 1e-5)?;
        let (loss, feeds) = mse_to_random(&mut g, y, 38)?;
        gradcheck(k, "layer_norm", g, loss, feeds, vec![])?;

        // RMSNorm over the last dimension of a rank-3 tensor (a prime width).
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 3, 7], 135);
        let w = param_in(&mut g, "w", &[7], 136, 0.5, 1.5);
        let y = g.rms_norm(x, w, 1e-5)?;
        let (loss, feeds) = mse_to_random(&mut g, y, 138)?;
        gradcheck(k, "rms_norm", g, loss, feeds, vec![])?;
        Ok(())
    });
}
