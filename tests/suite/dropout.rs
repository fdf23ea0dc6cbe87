//! Dropout (`Graph::dropout`, the `dropout_forward` kernel): the kernel
//! against its CPU twin bit for bit, the masks' statistics, the placements
//! that let a split batch or a split row draw the whole tensor's mask, its
//! refusals; the gradient against central differences (the backward draws
//! the forward's mask again); and the executor's control words: a new mask
//! each optimizer step, the same one for a run and the step that
//! recomputes it, none in evaluation.

use crate::common;

use common::{assert_close, for_each_adapter, gradcheck, mse_to_random, param, random_vec, rng};
use wgrad::graph::{Executor, Graph};
use wgrad::kernels::{DropoutMask, DROPOUT_CONTROL_WORDS};
use wgrad::optim::SGD;
use wgrad::{cpu, Kernels};

/// `dropout_forward` of `x` on the device.
fn run(
    k: &Kernels,
    mask: DropoutMask,
    x: &[f32],
    control: [u32; DROPOUT_CONTROL_WORDS],
    cols: usize,
    rows_per_example: usize,
) -> wgrad::Result<Vec<f32>> {
    let (xb, cb, out) = (k.upload(x)?, k.upload(&control)?, k.zeros(x.len())?);
    k.run(&[&k.dropout(mask, out.view(), xb.view(), cb.view(), cols, rows_per_example)?])?;
    k.read::<f32>(out.view())
}

#[test]
fn dropout_matches_its_twin_bit_for_bit() {
    for_each_adapter("dropout_twin", |k| {
        let shapes = [(1, 1), (1, 5), (7, 1), (13, 17), (300, 3), (2, 1000), (1, 257)];
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let x = random_vec(&mut rng(300 + i as u64), rows * cols, -2.0, 2.0);
            for (p, key, first) in [(0.05, 0, 0), (0.5, 7, 3), (0.9, u32::MAX, 1 << 20)] {
                let mask = DropoutMask::whole(p, 12_345 + i as u32, cols);
                let control = [key, 1, first, 0];
                // One f32 product on each side, correctly rounded: equal bits.
                let got = run(k, mask, &x, control, cols, 2)?;
                assert_eq!(got, cpu::dropout(&mask, &x, &control, cols, 2), "{rows}×{cols} p={p}");
                // Off (evaluation): x itself.
                assert_eq!(run(k, mask, &x, [key, 0, first, 0], cols, 2)?, x, "{rows}×{cols} off");
            }
        }
        Ok(())
    });
}

/// Over 10,007 ones at p = 0.3: the kept share is 1 − p and each kept
/// value 1/(1 − p); masks of other keys, salts or places agree as
/// independent draws do (p² + (1 − p)²), and a key's mask is the same
/// each time.
#[test]
fn dropout_masks_are_fair_and_independent() {
    for_each_adapter("dropout_statistics", |k| {
        let n = 10_007;
        let ones = vec![1.0f32; n];
        let mask = DropoutMask::whole(0.3, 99, n);
        let kept = |mask: DropoutMask, control| -> wgrad::Result<Vec<bool>> {
            let out = run(k, mask, &ones, control, n, 1)?;
            let scale = 1.0 / (1.0 - 0.3f32);
            assert!(out.iter().all(|&v| v == 0.0 || v == scale), "kept values are 1/(1 - p)");
            Ok(out.iter().map(|&v| v != 0.0).collect())
        };
        let share = |m: &[bool]| m.iter().filter(|&&b| b).count() as f64 / n as f64;
        let agree = |a: &[bool], b: &[bool]| a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / n as f64;
        let base = kept(mask, [1, 1, 0, 0])?;
        // Binomial: σ = sqrt(0.21 / n) = 0.0046; within 5σ.
        assert!((share(&base) - 0.7).abs() < 0.023, "kept {}", share(&base));
        assert_eq!(kept(mask, [1, 1, 0, 0])?, base, "the same key draws the same mask");
        let others = [
            ("the next key", kept(mask, [2, 1, 0, 0])?),
            ("another salt", kept(DropoutMask { salt: 100, ..mask }, [1, 1, 0, 0])?),
            ("the next example", kept(mask, [1, 1, 1, 0])?),
        ];
        for (what, other) in others {
            assert!((share(&other) - 0.7).abs() < 0.023, "{what}: kept {}", share(&other));
            // Independent masks agree on 0.58 of the elements, σ = 0.0049.
            let a = agree(&base, &other);
            assert!((a - 0.58).abs() < 0.025, "{what}: agrees with the first on {a}");
        }
        // Neighbouring elements are not correlated: kept pairs 0.49 of them.
        let pairs = base.windows(2).filter(|w| w[0] && w[1]).count() as f64 / (n - 1) as f64;
        assert!((pairs - 0.49).abs() < 0.025, "neighbours both kept {pairs}");
        Ok(())
    });
}

/// 6 examples of 4 rows of 10 columns: its halves (first examples 0 and 3)
/// and its column shares (6 and 4 of each row's 10) draw the whole
/// tensor's mask.
#[test]
fn split_batches_and_rows_draw_the_whole_mask() {
    for_each_adapter("dropout_placements", |k| {
        let (examples, rows_per_example, cols) = (6, 4, 10);
        let x = random_vec(&mut rng(9), examples * rows_per_example * cols, -1.0, 1.0);
        let mask = DropoutMask::whole(0.4, 5, cols);
        let control = [11, 1, 0, 0];
        let whole = run(k, mask, &x, control, cols, rows_per_example)?;
        assert!(whole.iter().filter(|&&v| v == 0.0).count() > 20, "some dropped");
        let half = examples / 2 * rows_per_example * cols;
        let first = run(k, mask, &x[..half], control, cols, rows_per_example)?;
        let second = run(k, mask, &x[half..], [11, 1, 3, 0], cols, rows_per_example)?;
        assert_eq!([first, second].concat(), whole, "a batch split by examples");
        let columns = |start: usize, width: usize| -> Vec<f32> {
            x.chunks(cols)
                .flat_map(|row| row[start..start + width].to_vec())
                .collect()
        };
        let share = |col_offset| DropoutMask { col_offset, ..mask };
        let left = run(k, share(0), &columns(0, 6), control, 6, rows_per_example)?;
        let right = run(k, share(6), &columns(6, 4), control, 4, rows_per_example)?;
        let joined: Vec<f32> = left
            .chunks(6)
            .zip(right.chunks(4))
            .flat_map(|(l, r)| [l, r].concat())
            .collect();
        assert_eq!(joined, whole, "rows split by columns");
        Ok(())
    });
}

#[test]
fn dropout_refuses_what_it_cannot_draw() {
    for_each_adapter("dropout_refusals", |k| {
        let (x, control, out) = (k.zeros(12)?, k.upload(&[0u32; 4])?, k.zeros(12)?);
        let half = DropoutMask::whole(0.5, 0, 4);
        let cases = [
            (DropoutMask::whole(1.0, 0, 4), 4, 1, "must be in [0, 1)"),
            (DropoutMask::whole(f32::NAN, 0, 4), 4, 1, "must be in [0, 1)"),
            (
                DropoutMask { col_offset: 2, ..half },
                4,
                1,
                "do not lie within rows of 4",
            ),
            (DropoutMask::whole(0.5, 0, 5), 5, 1, "x must be rows × 5"),
            (half, 4, 0, "0 rows per example"),
        ];
        for (mask, cols, rows_per_example, says) in cases {
            let e = k
                .dropout(mask, out.view(), x.view(), control.view(), cols, rows_per_example)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "want `{says}` in: {e}");
        }
        let short = k.upload(&[0u32; 3])?;
        let e = k
            .dropout(half, out.view(), x.view(), short.view(), 4, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("control 3"), "{e}");
        let mut g = Graph::new();
        let a = g.input("a", &[3, 4])?;
        let e = g.dropout(a, DropoutMask::whole(1.5, 0, 4)).unwrap_err().to_string();
        assert!(e.contains("must be in [0, 1)"), "{e}");
        let e = g.dropout(a, DropoutMask::whole(0.5, 0, 3)).unwrap_err().to_string();
        assert!(e.contains("do not lie within rows of 3"), "{e}");
        // p = 0 is no op at all.
        assert_eq!(g.dropout(a, DropoutMask::whole(0.0, 0, 4))?, a);
        Ok(())
    });
}

/// d loss / d a through dropout (rank 3, its first dimension examples)
/// against f64 central differences of the graph's reference, with the
/// control words the executor writes for a step (key 0: no optimizer step
/// taken; on; first example 0): the backward draws the forward's mask.
#[test]
fn dropout_gradient_matches_central_differences() {
    for_each_adapter("dropout_gradcheck", |k| {
        let mut g = Graph::new();
        let a = param(&mut g, "a", &[3, 5, 7], 1);
        let d = g.dropout(a, DropoutMask::whole(0.3, 17, 7))?;
        let (loss, feeds) = mse_to_random(&mut g, d, 2)?;
        let control = g.dropout_control()?;
        gradcheck(k, "dropout", g, loss, feeds, vec![(control, vec![0, 1, 0, 0])])
    });
}

/// What the executor writes into the control: a run is an evaluation (x
/// itself) unless in training mode; a training step draws the mask of the
/// optimizer's step count, so a run in training mode before it draws the
/// same, and the next step a new one; a fixed step and a first example
/// are drawn as told.
#[test]
fn the_executor_draws_a_mask_per_optimizer_step() {
    for_each_adapter("dropout_executor", |k| {
        let (examples, cols) = (4, 9);
        let mut g = Graph::new();
        let a = param(&mut g, "a", &[examples, cols], 3);
        let mask = DropoutMask::whole(0.5, 3, cols);
        let d = g.dropout(a, mask)?;
        let (loss, feeds) = mse_to_random(&mut g, d, 4)?;
        let grads = g.backward(loss)?;
        let values = g.parameter_init_mut(a).map(|v| v.to_vec()).unwrap_or_default();
        let mut exec = Executor::new(k.clone(), g, &[d, loss], Some(grads), Some(SGD::new(0.0).into()))?;
        for (t, v) in &feeds {
            exec.set_input(*t, v)?;
        }
        let twin = |key: u32, first: u32| cpu::dropout(&mask, &values, &[key, 1, first, 0], cols, 1);
        exec.run(&[d])?;
        assert_eq!(exec.read(d)?, values, "a run is an evaluation");
        exec.set_training(true);
        exec.run(&[d])?;
        assert_eq!(exec.read(d)?, twin(0, 0), "training mode: step 0's mask");
        // lr 0: the step changes nothing but the step count.
        exec.train_step(true, true, false)?;
        assert_eq!(exec.read(d)?, twin(0, 0), "the step recomputes the run's mask");
        exec.run(&[d])?;
        let next = exec.read(d)?;
        assert_eq!(next, twin(1, 0), "the next step draws another");
        assert_ne!(next, twin(0, 0));
        exec.set_dropout_step(Some(40));
        exec.set_dropout_first_example(2);
        exec.run(&[d])?;
        assert_close("fixed step, later rows", &exec.read(d)?, &twin(40, 2), 0.0, 0.0);
        exec.set_training(false);
        exec.run(&[d])?;
        assert_eq!(exec.read(d)?, values, "evaluation again");
        Ok(())
    });
}
