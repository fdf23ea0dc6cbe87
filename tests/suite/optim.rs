//! Optimizer features inside the executor's training step — weight-decay
//! groups, global gradient-norm clipping, the learning-rate schedule —
//! against `cpu::optimizer_step`, which takes the parameters as separate
//! tensors the way PyTorch does, on every adapter present.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, rng};
use wgrad::graph::{Executor, Graph, Tensor};
use wgrad::kernels::{AdamConfig, LrSchedule, MatmulForm, OptimizerConfig, SgdConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::{AdamW, SGD};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::DeviceSelection;
use wgrad::{cpu, Error};
use wgrad::{Targets, Trainer};

// Primes, none a multiple of a workgroup.
const ROWS: usize = 7;
const IN: usize = 5;
const OUT: usize = 3;

/// pred = x·W + b, mse against t: a 2-D weight that weight decay applies
/// to and a bias excluded from it.
struct Net {
    exec: Executor,
    x: Tensor,
    t: Tensor,
    w: Tensor,
    b: Tensor,
}

fn initial() -> (Vec<f32>, Vec<f32>) {
    let mut r = rng(7);
    (
        random_vec(&mut r, IN * OUT, -0.5, 0.5),
        random_vec(&mut r, OUT, -0.5, 0.5),
    )
}

fn net(k: &std::sync::Arc<wgrad::Kernels>, cfg: OptimizerConfig) -> wgrad::Result<Net> {
    let (w0, b0) = initial();
    let mut g = Graph::new();
    let x = g.input("x", &[ROWS, IN])?;
    let t = g.input("t", &[ROWS, OUT])?;
    let w = g.parameter("weight", &[IN, OUT], w0)?;
    let b = g.parameter("bias", &[OUT], b0)?;
    let xw = g.matmul(x, w)?;
    let pred = g.bias_add(xw, b)?;
    let loss = g.mse_loss(pred, t)?;
    g.exclude_from_weight_decay(b)?;
    let grads = g.backward(loss)?;
    let exec = Executor::new(k.clone(), g, &[loss], Some(grads), Some(cfg))?;
    Ok(Net { exec, x, t, w, b })
}

/// One step's batch: targets scaled by `scale` to move the gradient norm.
fn batch(step: u64, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let mut r = rng(100 + step);
    (
        random_vec(&mut r, ROWS * IN, -1.0, 1.0),
        random_vec(&mut r, ROWS * OUT, -scale, scale),
    )
}

/// The CPU forward and backward of [`net`]: (dW, db).
fn cpu_grads(w: &[f32], b: &[f32], x: &[f32], t: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let pred = cpu::bias_add(&cpu::matmul(MatmulForm::AB, x, w, ROWS, OUT, IN), b, OUT);
    let dpred = cpu::mse_backward(&pred, t, 1.0);
    (
        cpu::matmul(MatmulForm::AtB, x, &dpred, IN, OUT, ROWS),
        cpu::sum_rows(&dpred, ROWS, OUT),
    )
}

fn param(exec: &Executor, name: &str) -> Vec<f32> {
    let all = exec.parameters().unwrap();
    all.into_iter().find(|(n, _, _)| n == name).map(|(_, _, v)| v).unwrap()
}

const SCHEDULE: LrSchedule = LrSchedule::WarmupCosine {
    warmup_steps: 3,
    total_steps: 8,
    min_lr: 0.004,
};
const MAX_NORM: f32 = 1.0;

fn configs() -> Vec<(&'static str, OptimizerConfig)> {
    let shared = |c: OptimizerConfig| c.with_schedule(SCHEDULE).with_clip_grad_norm(Some(MAX_NORM));
    vec![
        (
            "adamw",
            shared(OptimizerConfig::Adam(AdamConfig {
                lr: 0.05,
                weight_decay: 0.1,
                ..AdamConfig::adamw()
            })),
        ),
        (
            "adam l2",
            shared(OptimizerConfig::Adam(AdamConfig {
                lr: 0.05,
                weight_decay: 0.1,
                ..AdamConfig::adam()
            })),
        ),
        (
            "sgd",
            shared(OptimizerConfig::Sgd(SgdConfig {
                lr: 0.2,
                momentum: 0.9,
                weight_decay: 0.1,
                ..SgdConfig::default()
            })),
        ),
    ]
}

#[test]
fn grouped_clipped_scheduled_steps_match_the_reference() {
    for_each_adapter("optim_reference", |k| {
        for (name, cfg) in configs() {
            let mut n = net(k, cfg)?;
            assert!(n.exec.graph().weight_decay_applies(n.w) && !n.exec.graph().weight_decay_applies(n.b));
            let (w0, b0) = initial();
            let mut params = vec![w0, b0];
            let mut state = vec![vec![vec![0.0; IN * OUT]; 2], vec![vec![0.0; OUT]; 2]];
            let mut clipped = 0;
            for step in 1..=10u64 {
                // Large targets on odd steps, so some steps clip and some don't.
                let (x, t) = batch(step, if step % 2 == 1 { 4.0 } else { 0.2 });
                n.exec.set_input(n.x, &x)?;
                n.exec.set_input(n.t, &t)?;
                n.exec.train_step(true, true, false)?;
                let (dw, db) = cpu_grads(&params[0], &params[1], &x, &t);
                let norm = cpu::optimizer_step(&mut params, &[dw, db], &mut state, &[true, false], &cfg, step).unwrap();
                clipped += usize::from(norm > MAX_NORM);
                let what = format!("{name} step {step}");
                // The norm of f32 gradients summed in another order: a few ulps.
                assert_close(
                    &format!("{what} norm"),
                    &[n.exec.read_grad_norm()?.unwrap()],
                    &[norm],
                    1e-6,
                    1e-5,
                );
                assert_eq!(n.exec.learning_rate(), Some(cfg.lr_at(step)), "{what} lr");
                // Gradients differ from the f64-accumulated reference's in the
                // last bits; each step moves a parameter by about lr, so those
                // differences carry into it scaled by lr, over 10 steps.
                assert_close(
                    &format!("{what} weight"),
                    &param(&n.exec, "weight"),
                    &params[0],
                    2e-5,
                    1e-4,
                );
                assert_close(&format!("{what} bias"), &param(&n.exec, "bias"), &params[1], 2e-5, 1e-4);
            }
            assert!(
                (1..10).contains(&clipped),
                "{name}: {clipped} of 10 steps clipped; the data should clip some, not all"
            );
        }
        Ok(())
    });
}

/// One plain-SGD step (lr 1) with clipping at `max_norm`, checked against
/// p - factor·g; returns the executor's norm and the reference factor.
fn one_clipped_step(k: &std::sync::Arc<wgrad::Kernels>, max_norm: f32) -> wgrad::Result<(f32, f32)> {
    let cfg = OptimizerConfig::from(SGD::new(1.0).clip_grad_norm(max_norm));
    let mut n = net(k, cfg)?;
    let (x, t) = batch(1, 3.0);
    n.exec.set_input(n.x, &x)?;
    n.exec.set_input(n.t, &t)?;
    n.exec.train_step(true, true, false)?;
    let (w0, b0) = initial();
    // The gradient arena keeps the unclipped gradients (the update scales them).
    let (dw, db) = (n.exec.read_grad(n.w)?, n.exec.read_grad(n.b)?);
    let (norm, factor) = cpu::clip_grad_norm(&[&dw, &db], max_norm);
    let gpu_norm = n.exec.read_grad_norm()?.unwrap();
    // f32 gradients, norm summed in another order: a few ulps.
    assert_close("grad norm", &[gpu_norm], &[norm], 1e-6, 1e-5);
    let step = |p0: &[f32], g: &[f32]| -> Vec<f32> { p0.iter().zip(g).map(|(p, g)| p - factor * g).collect() };
    // One multiply-add per element (FMA or not): an ulp of |p| ≤ 2.
    assert_close(
        &format!("weight, max_norm {max_norm}"),
        &param(&n.exec, "weight"),
        &step(&w0, &dw),
        1e-6,
        1e-5,
    );
    assert_close(
        &format!("bias, max_norm {max_norm}"),
        &param(&n.exec, "bias"),
        &step(&b0, &db),
        1e-6,
        1e-5,
    );
    Ok((gpu_norm, factor))
}

#[test]
fn clipping_scales_gradients_only_above_max_norm() {
    for_each_adapter("optim_clip", |k| {
        let (norm, factor) = one_clipped_step(k, 0.05)?;
        assert!(
            norm > 0.05 && factor < 0.5,
            "norm {norm} should be clipped to 0.05 (factor {factor})"
        );
        let (norm, factor) = one_clipped_step(k, 1e4)?;
        assert!(
            norm < 1e4 && factor == 1.0,
            "norm {norm} is below max_norm; factor {factor}"
        );
        Ok(())
    });
}

#[test]
fn warmup_cosine_is_nanogpts_get_lr() {
    let s = LrSchedule::WarmupCosine {
        warmup_steps: 10,
        total_steps: 100,
        min_lr: 0.1,
    };
    // step counts from 1; nanoGPT's it = step - 1.
    let cases = [
        (1, 0.1),
        (5, 0.5),
        (10, 1.0),
        (11, 1.0),
        (56, 0.55),
        (100, 0.1 + 0.45 * (1.0 + (std::f64::consts::PI * 89.0 / 90.0).cos())),
        (101, 0.1),
        (5000, 0.1),
    ];
    for (step, want) in cases {
        // lr_at rounds an f64 to f32 once.
        assert!(
            (f64::from(s.lr_at(1.0, step)) - want).abs() < 1e-6,
            "step {step}: {} want {want}",
            s.lr_at(1.0, step)
        );
    }
    assert_eq!(LrSchedule::Constant.lr_at(0.3, 7), 0.3);
    // No warmup: the first step runs at the full rate.
    assert_eq!(
        LrSchedule::WarmupCosine {
            warmup_steps: 0,
            total_steps: 4,
            min_lr: 0.0
        }
        .lr_at(2.0, 1),
        2.0
    );
}

#[test]
fn bad_schedules_and_clips_are_errors() {
    let bad_schedules = [
        LrSchedule::WarmupCosine {
            warmup_steps: 11,
            total_steps: 10,
            min_lr: 0.0,
        },
        LrSchedule::WarmupCosine {
            warmup_steps: 1,
            total_steps: 10,
            min_lr: f32::NAN,
        },
        LrSchedule::WarmupCosine {
            warmup_steps: 1,
            total_steps: 10,
            min_lr: -1e-3,
        },
    ];
    for s in bad_schedules {
        let cfg = OptimizerConfig::from(AdamW::new(1e-3).schedule(s));
        assert!(matches!(cfg.validate(), Err(Error::InvalidArgument { .. })), "{s:?}");
    }
    for max_norm in [f32::NAN, -1.0] {
        assert!(matches!(
            OptimizerConfig::from(SGD::new(0.1).clip_grad_norm(max_norm)).validate(),
            Err(Error::InvalidArgument { .. })
        ));
    }
    for_each_adapter("optim_bad_args", |k| {
        let bad = OptimizerConfig::from(AdamW::new(1e-3).schedule(bad_schedules[0]));
        assert!(matches!(net(k, bad), Err(Error::InvalidArgument { .. })));
        // A per-tensor update cannot clip: it has no global norm.
        let (p, g, s) = (k.zeros(4)?, k.zeros(4)?, k.zeros(4)?);
        let clip = SgdConfig {
            clip_grad_norm: Some(1.0),
            ..SgdConfig::default()
        };
        assert!(matches!(
            k.sgd_update(p.view(), g.view(), s.view(), &clip, 1),
            Err(Error::InvalidArgument { .. })
        ));
        Ok(())
    });
    let mut g = Graph::new();
    let x = g.input("x", &[2, 2]).unwrap();
    assert!(matches!(
        g.exclude_from_weight_decay(x),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn decay_matrices_only_excludes_biases_through_the_trainer() {
    for_each_adapter("optim_trainer_groups", |k| {
        nn::manual_seed(5);
        let model = Sequential::mlp(&[IN, 4, OUT], Layer::ReLU)?;
        // The same step with and without groups: only the biases' decay differs.
        let opt = |groups: bool| {
            let o = AdamW::new(0.01).weight_decay(0.5);
            if groups {
                o.decay_matrices_only()
            } else {
                o
            }
        };
        let mut params = Vec::new();
        for groups in [false, true] {
            let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, opt(groups), ROWS)?;
            let graph = t.executor().graph();
            let biases = graph
                .parameters()
                .into_iter()
                .filter(|&p| !graph.weight_decay_applies(p))
                .count();
            assert_eq!(biases, if groups { 2 } else { 0 });
            let (x, _) = batch(1, 1.0);
            let y: Vec<u32> = (0..ROWS as u32).map(|i| i % OUT as u32).collect();
            t.zero_grad();
            t.forward(&x)?;
            t.loss(Targets::Classes(&y))?;
            t.backward()?;
            t.step()?;
            params.push(t.executor().parameters()?);
        }
        // Same step except decay: weights identical, biases differ by the
        // decay term lr·wd·p (≥ 1e-5 for |p| ≥ 2e-3).
        for ((name, _, off), (_, _, on)) in params[0].iter().zip(&params[1]) {
            if name.ends_with("weight") {
                // Same kernels, same inputs: bit-identical.
                assert_eq!(off, on, "{name}");
            } else {
                assert_ne!(off, on, "{name}: decay should differ");
            }
        }
        Ok(())
    });
}

#[test]
fn data_parallel_clips_the_all_reduced_gradients() {
    const GLOBAL: usize = 12;
    let groups = crate::parallel::open_groups("optim_data_parallel", &[DeviceSelection::Count(2)]);
    let Some(group) = groups.first() else { return };
    nn::manual_seed(9);
    let model = Sequential::mlp(&[IN, 8, OUT], Layer::ReLU).unwrap();
    let opt = AdamW::new(0.02)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(0.5)
        .schedule(SCHEDULE);
    let data = |s: u64| {
        let (x, _) = batch(s, 1.0);
        let x: Vec<f32> = x.iter().cycle().take(GLOBAL * IN).copied().collect();
        let y: Vec<u32> = (0..GLOBAL).map(|i| ((i as u64 + s) % OUT as u64) as u32).collect();
        (x, y)
    };
    let mut single = Trainer::new(group.members()[0].clone(), &model, CrossEntropyLoss, opt, GLOBAL).unwrap();
    let mut dp = DataParallel::new(
        group,
        &model,
        CrossEntropyLoss,
        opt,
        GLOBAL,
        Split::Rows(vec![5, GLOBAL - 5]),
    )
    .unwrap();
    for s in 0..6 {
        let (x, y) = data(s);
        single.zero_grad();
        single.forward(&x).unwrap();
        single.loss(Targets::Classes(&y)).unwrap();
        single.backward().unwrap();
        single.step().unwrap();
        dp.step(&x, Targets::Classes(&y), false).unwrap();
        let want = single.executor().read_grad_norm().unwrap().unwrap();
        for (r, replica) in dp.replicas().iter().enumerate() {
            // The all-reduced gradient is the full batch's, summed in another order.
            let got = replica.executor().read_grad_norm().unwrap().unwrap();
            assert_close(&format!("norm on replica {r} step {s}"), &[got], &[want], 1e-6, 1e-4);
        }
    }
    let want = single.executor().parameters().unwrap();
    for (r, replica) in dp.replicas().iter().enumerate() {
        for ((name, _, g), (_, _, w)) in replica.executor().parameters().unwrap().iter().zip(&want) {
            // Shards summed separately then weighted: f32 rounding over 6 steps.
            assert_close(&format!("{name} on replica {r}"), g, w, 1e-5, 1e-4);
        }
    }
}
