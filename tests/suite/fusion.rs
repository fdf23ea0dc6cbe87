//! Fused kernels and plan-level fusion: each fused kernel against its CPU
//! twin, fused training steps against the one-dispatch-per-node reference
//! (`PlanOptions { fuse: false }`), the dispatch counts fusion buys, and the
//! planned memory of the MLP step against its liveness bound.

use crate::common;

use std::sync::Arc;

use common::{assert_close, for_each_adapter, param, random_vec, rng};
use wgrad::graph::{Executor, Graph, Plan, PlanOptions, Storage};
use wgrad::kernels::{Activation, LossLinear, LossTargets, MatmulForm, OptimizerConfig, SgdConfig};
use wgrad::nn::{self, Criterion, CrossEntropyLoss, Layer, Linear, MSELoss, Sequential};
use wgrad::optim::{Adam, SGD};
use wgrad::{cpu, Kernels};
use wgrad::{Targets, Trainer};

const UNFUSED: PlanOptions = PlanOptions::UNFUSED;

/// One fused-loss case: rows × cols prediction, optional Linear layer of
/// `inner` inputs (with or without bias), optional bias gradient.
#[derive(Clone, Copy, Debug)]
struct LossCase {
    rows: usize,
    cols: usize,
    linear: Option<(usize, bool)>,
    bias_grad: bool,
    classes: bool,
}

fn check_fused_loss(k: &Kernels, case: LossCase, seed: u64) -> wgrad::Result<()> {
    let LossCase {
        rows,
        cols,
        linear,
        bias_grad,
        classes,
    } = case;
    let mut r = rng(seed);
    let n = rows * cols;
    let pred_host = random_vec(&mut r, n, -2.0, 2.0);
    let values = random_vec(&mut r, n, -1.0, 1.0);
    let labels: Vec<u32> = (0..rows).map(|i| ((i * 7 + seed as usize) % cols) as u32).collect();
    let inner = linear.map_or(1, |(inner, _)| inner);
    let x_host = random_vec(&mut r, rows * inner, -1.0, 1.0);
    let w_host = random_vec(&mut r, cols * inner, -1.0, 1.0);
    let b_host = random_vec(&mut r, cols, -1.0, 1.0);
    // Gradients already hold values: the kernel must add to them.
    let wg_before = random_vec(&mut r, cols * inner, -1.0, 1.0);
    let bg_before = random_vec(&mut r, cols, -1.0, 1.0);
    let dloss_value = 0.75f32;

    let pred = k.upload(&pred_host)?;
    let targets_buf = if classes {
        k.upload(&labels)?
    } else {
        k.upload(&values)?
    };
    let (loss, dpred, dloss) = (k.zeros(1)?, k.zeros(n)?, k.upload(&[dloss_value])?);
    let (x, w, b) = (k.upload(&x_host)?, k.upload(&w_host)?, k.upload(&b_host)?);
    let (wg, bg) = (k.upload(&wg_before)?, k.upload(&bg_before)?);
    let targets = if classes {
        LossTargets::Labels(targets_buf.view())
    } else {
        LossTargets::Values(targets_buf.view())
    };
    let layer = linear.map(|(inner, has_bias)| LossLinear {
        x: x.view(),
        weight: w.view(),
        bias: has_bias.then(|| b.view()),
        inner,
        weight_grad: wg.view(),
    });
    let dispatch = k.loss_forward_backward_fused(
        targets,
        loss.view(),
        dpred.view(),
        pred.view(),
        dloss.view(),
        rows,
        cols,
        layer,
        bias_grad.then(|| bg.view()),
    )?;
    k.run(&[&dispatch])?;

    let cpu_targets = if classes {
        cpu::LossTargets::Labels(&labels)
    } else {
        cpu::LossTargets::Values(&values)
    };
    let cpu_linear = linear.map(|(inner, has_bias)| {
        (
            x_host.as_slice(),
            w_host.as_slice(),
            has_bias.then_some(b_host.as_slice()),
            inner,
        )
    });
    let want = cpu::loss_forward_backward_fused(cpu_targets, &pred_host, cpu_linear, dloss_value, rows, cols);
    let what = format!("{case:?}");
    // f32 kernel sums vs the f64-accumulating twin: inner ≤ 64 and rows ≤ 97
    // terms of magnitude ≤ 2 keep the error near 1e-5 relative.
    assert_close(
        &format!("{what} loss"),
        &k.read::<f32>(loss.view())?,
        &[want.loss],
        1e-5,
        1e-4,
    );
    assert_close(
        &format!("{what} dpred"),
        &k.read::<f32>(dpred.view())?,
        &want.dpred,
        1e-6,
        1e-4,
    );
    if linear.is_some() {
        assert_close(
            &format!("{what} pred"),
            &k.read::<f32>(pred.view())?,
            &want.pred,
            1e-5,
            1e-4,
        );
        let wg_want: Vec<f32> = wg_before.iter().zip(&want.weight_grad).map(|(a, b)| a + b).collect();
        assert_close(
            &format!("{what} weight_grad"),
            &k.read::<f32>(wg.view())?,
            &wg_want,
            1e-5,
            1e-4,
        );
    } else {
        assert_eq!(k.read::<f32>(pred.view())?, pred_host, "{what}: pred is only read");
    }
    let bg_want: Vec<f32> = if bias_grad {
        bg_before.iter().zip(&want.bias_grad).map(|(a, b)| a + b).collect()
    } else {
        bg_before.clone()
    };
    assert_close(
        &format!("{what} bias_grad"),
        &k.read::<f32>(bg.view())?,
        &bg_want,
        1e-5,
        1e-4,
    );
    Ok(())
}

#[test]
fn fused_loss_kernels_match_their_cpu_twin() {
    for_each_adapter("fused_loss", |k| {
        let mut seed = 0;
        // Shapes: 1, primes, and more rows than a workgroup has invocations.
        for (rows, cols) in [(1, 1), (7, 3), (13, 5), (97, 2), (300, 1)] {
            for classes in [false, true] {
                for linear in [None, Some((1, true)), Some((11, false)), Some((37, true))] {
                    for bias_grad in [false, true] {
                        seed += 1;
                        let case = LossCase {
                            rows,
                            cols,
                            linear,
                            bias_grad,
                            classes,
                        };
                        // With 8 storage buffers per stage (WebGPU's
                        // default) the 10-buffer fused Linear losses are
                        // refused before their pipeline is made.
                        let over_limits =
                            linear.is_some() && !k.fits_limits(wgrad::kernels::registry::MSE_LINEAR_FORWARD_BACKWARD);
                        match (over_limits, check_fused_loss(k, case, seed)) {
                            (true, Err(e)) => {
                                assert!(e.to_string().contains("max_storage_buffers_per_shader_stage"), "{e}")
                            }
                            (true, Ok(())) => panic!("a fused Linear loss over the storage-buffer limit ran"),
                            (false, result) => result?,
                        }
                    }
                }
            }
        }
        Ok(())
    });
}

#[test]
fn fused_loss_shape_errors_name_the_kernel() {
    for_each_adapter("fused_loss_shapes", |k| {
        let (pred, t, one) = (k.zeros(12)?, k.zeros(12)?, k.zeros(1)?);
        let (loss, dloss, dpred) = (k.zeros(1)?, k.zeros(1)?, k.zeros(12)?);
        let bad_rows = k.loss_forward_backward_fused(
            LossTargets::Values(t.view()),
            loss.view(),
            dpred.view(),
            pred.view(),
            dloss.view(),
            5,
            3,
            None,
            None,
        );
        assert!(
            matches!(
                bad_rows,
                Err(wgrad::Error::Shape {
                    op: "mse_forward_backward",
                    ..
                })
            ),
            "{bad_rows:?}"
        );
        let x = k.zeros(4 * 2)?;
        let w = k.zeros(3 * 5)?;
        let layer = LossLinear {
            x: x.view(),
            weight: w.view(),
            bias: None,
            inner: 2,
            weight_grad: w.view(),
        };
        let bad_linear = k.loss_forward_backward_fused(
            LossTargets::Values(t.view()),
            loss.view(),
            dpred.view(),
            pred.view(),
            dloss.view(),
            4,
            3,
            Some(layer),
            None,
        );
        assert!(
            matches!(
                bad_linear,
                Err(wgrad::Error::Shape {
                    op: "mse_linear_forward_backward",
                    ..
                })
            ),
            "{bad_linear:?}"
        );
        let bad_bias = k.loss_forward_backward_fused(
            LossTargets::Values(t.view()),
            loss.view(),
            dpred.view(),
            pred.view(),
            dloss.view(),
            4,
            3,
            None,
            Some(one.view()),
        );
        assert!(matches!(bad_bias, Err(wgrad::Error::Shape { .. })), "{bad_bias:?}");
        Ok(())
    });
}

/// Seeded features and targets for a model with `inputs` features and
/// `outputs` outputs.
fn data(
    batch: usize,
    inputs: usize,
    outputs: usize,
    criterion: Criterion,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let mut r = rng(seed);
    let x = random_vec(&mut r, batch * inputs, -1.0, 1.0);
    let values = random_vec(&mut r, batch * outputs, -1.0, 1.0);
    let classes = match criterion {
        Criterion::CrossEntropy => (0..batch)
            .map(|i| ((x[i * inputs] > 0.0) as usize + 2 * (i % 2)) as u32 % outputs as u32)
            .collect(),
        Criterion::Mse => Vec::new(),
    };
    (x, values, classes)
}

struct Case {
    name: &'static str,
    widths: Vec<usize>,
    activation: Layer,
    criterion: Criterion,
    optimizer: OptimizerConfig,
    batch: usize,
}

fn cases() -> Vec<Case> {
    let sgd_momentum = OptimizerConfig::Sgd(SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..SgdConfig::default()
    });
    vec![
        Case {
            name: "linear 10-1 mse sgd",
            widths: vec![10, 1],
            activation: Layer::ReLU,
            criterion: Criterion::Mse,
            optimizer: SGD::new(0.01).into(),
            batch: 64,
        },
        Case {
            name: "tanh 12-24-4 ce adam",
            widths: vec![12, 24, 4],
            activation: Layer::Tanh,
            criterion: Criterion::CrossEntropy,
            optimizer: Adam::new(1e-2).into(),
            batch: 16,
        },
        Case {
            name: "gelu 7-13-5-3 mse momentum",
            widths: vec![7, 13, 5, 3],
            activation: Layer::GELU,
            criterion: Criterion::Mse,
            optimizer: sgd_momentum,
            batch: 11,
        },
        Case {
            name: "relu 9-17-1 mse sgd, batch 1",
            widths: vec![9, 17, 1],
            activation: Layer::ReLU,
            criterion: Criterion::Mse,
            optimizer: SGD::new(0.1).into(),
            batch: 1,
        },
        // Last layer 96·10·64 multiply-adds: too big for the loss's one
        // workgroup, so only its bias gradient moves into the loss.
        Case {
            name: "sigmoid 20-64-10 ce adam, big last layer",
            widths: vec![20, 64, 10],
            activation: Layer::Sigmoid,
            criterion: Criterion::CrossEntropy,
            optimizer: Adam::new(1e-2).into(),
            batch: 96,
        },
    ]
}

fn trainer(k: &Arc<Kernels>, case: &Case, options: PlanOptions) -> wgrad::Result<Trainer> {
    nn::manual_seed(21);
    let model = Sequential::mlp(&case.widths, case.activation.clone())?;
    Trainer::with_options(k.clone(), &model, case.criterion, case.optimizer, case.batch, options)
}

/// Losses of `steps` steps and the final parameters.
fn train(t: &mut Trainer, case: &Case, steps: u64) -> wgrad::Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let (inputs, outputs) = (case.widths[0], *case.widths.last().unwrap_or(&1));
    let mut losses = Vec::new();
    for s in 0..steps {
        let (x, values, classes) = data(case.batch, inputs, outputs, case.criterion, 100 + s);
        t.zero_grad();
        t.forward(&x)?;
        match case.criterion {
            Criterion::Mse => t.loss(Targets::Values(&values))?,
            Criterion::CrossEntropy => t.loss(Targets::Classes(&classes))?,
        }
        t.backward()?;
        losses.push(t.step_reading_loss()?);
    }
    let params = t.executor().parameters()?.into_iter().map(|(_, _, v)| v).collect();
    Ok((losses, params))
}

#[test]
fn fused_training_steps_match_the_unfused_reference() {
    for_each_adapter("fused_vs_unfused", |k| {
        for case in cases() {
            let mut fused = trainer(k, &case, PlanOptions::default())?;
            let mut unfused = trainer(k, &case, UNFUSED)?;
            let fused_dispatches = fused.executor().dispatches_per_step();
            let unfused_dispatches = unfused.executor().dispatches_per_step();
            assert!(
                fused_dispatches < unfused_dispatches,
                "{}: {fused_dispatches} fused vs {unfused_dispatches}",
                case.name
            );
            let (fused_losses, fused_params) = train(&mut fused, &case, 8)?;
            let (unfused_losses, unfused_params) = train(&mut unfused, &case, 8)?;
            // Same arithmetic in a different summation order (a loop in the
            // loss kernel vs the tiled matmul): f32 rounding only, a few
            // ulps per step, compounded over 8 steps.
            assert_close(
                &format!("{} losses", case.name),
                &fused_losses,
                &unfused_losses,
                1e-5,
                1e-4,
            );
            for (i, (f, u)) in fused_params.iter().zip(&unfused_params).enumerate() {
                assert_close(&format!("{} parameter {i}", case.name), f, u, 1e-5, 1e-4);
            }
        }
        Ok(())
    });
}

#[test]
fn gpu_shaped_training_steps_match_the_adapters_own_shaping() {
    // Predictions over GPU shaping's single-workgroup loss limit (4096
    // elements), with 256 rows and more: under GPU shaping the loss is
    // planned unfused, its value in two stages, the bias gradients as
    // two-stage column sums; on a GPU adapter the CPU shaping is the other.
    let big = |name, widths: Vec<usize>, criterion, batch| Case {
        name,
        widths,
        activation: Layer::ReLU,
        criterion,
        optimizer: Adam::new(1e-2).into(),
        batch,
    };
    let cases = [
        big(
            "relu 30-40-10 ce adam, batch 512",
            vec![30, 40, 10],
            Criterion::CrossEntropy,
            512,
        ),
        big("relu 8-16-12 mse adam, batch 400", vec![8, 16, 12], Criterion::Mse, 400),
    ];
    let all = common::adapters();
    if all.is_empty() {
        common::no_adapter("gpu_shaped_training");
        return;
    }
    for (own, other) in all.iter().zip(common::other_shaping_adapters()) {
        let _gl = own.device().lock_gl();
        let (gpu, cpu) = if other.gpu_shaped() { (other, own) } else { (own, other) };
        let run = || -> wgrad::Result<()> {
            for case in &cases {
                let mut on_gpu = trainer(gpu, case, PlanOptions::default())?;
                let mut on_cpu = trainer(cpu, case, PlanOptions::default())?;
                let fused = |t: &Trainer| t.executor().plan().loss_with_grad.iter().any(Option::is_some);
                assert!(
                    fused(&on_cpu) && !fused(&on_gpu),
                    "{}: the loss is fused on the CPU shaping only",
                    case.name
                );
                let (gpu_losses, gpu_params) = train(&mut on_gpu, case, 4)?;
                let (cpu_losses, cpu_params) = train(&mut on_cpu, case, 4)?;
                // The same sums in other orders (blocks, trees): f32
                // rounding, compounded over 4 Adam steps.
                assert_close(&format!("{} losses", case.name), &gpu_losses, &cpu_losses, 1e-5, 1e-4);
                for (i, (g, c)) in gpu_params.iter().zip(&cpu_params).enumerate() {
                    assert_close(&format!("{} parameter {i}", case.name), g, c, 1e-5, 1e-4);
                }
            }
            Ok(())
        };
        if let Err(e) = run() {
            panic!("gpu_shaped_training on {}: {e}", own.device().label());
        }
    }
}

#[test]
fn fused_gradients_accumulate_without_zero_grad_like_unfused_ones() {
    for_each_adapter("fused_accumulate", |k| {
        let case = &cases()[1];
        let lr_zero = OptimizerConfig::Sgd(SgdConfig {
            lr: 0.0,
            ..SgdConfig::default()
        });
        let mut grads = Vec::new();
        for options in [PlanOptions::default(), UNFUSED] {
            nn::manual_seed(3);
            let model = Sequential::mlp(&case.widths, case.activation.clone())?;
            let mut t = Trainer::with_options(k.clone(), &model, case.criterion, lr_zero, case.batch, options)?;
            let (x, _, classes) = data(case.batch, 12, 4, case.criterion, 5);
            for zero in [true, false] {
                if zero {
                    t.zero_grad();
                }
                t.forward(&x)?;
                t.loss(Targets::Classes(&classes))?;
                t.backward()?;
                t.step()?;
            }
            let exec = t.executor();
            let all: Vec<Vec<f32>> = exec
                .graph()
                .parameters()
                .into_iter()
                .map(|p| exec.read_grad(p))
                .collect::<wgrad::Result<_>>()?;
            grads.push(all);
        }
        for (i, (f, u)) in grads[0].iter().zip(&grads[1]).enumerate() {
            assert_close(&format!("twice-accumulated gradient {i}"), f, u, 1e-6, 1e-4);
        }
        Ok(())
    });
}

#[test]
fn fusion_cuts_the_dispatches_of_a_step() {
    for_each_adapter("dispatch_counts", |k| {
        nn::manual_seed(0);
        let linear = Sequential::new(vec![Layer::Linear(Linear::new(10, 1))]);
        let fused = Trainer::new(k.clone(), &linear, MSELoss, SGD::new(0.01), 64)?;
        let unfused = Trainer::with_options(k.clone(), &linear, MSELoss, SGD::new(0.01), 64, UNFUSED)?;
        // The whole Linear layer, loss and gradients in one dispatch, the
        // update in another; unfused: matmul, bias add, loss, loss backward,
        // weight-gradient matmul and its add, column sum and its add, update.
        // Where that kernel's 10 storage buffers are over the device's
        // limit (WebGPU's default is 8), the layer stays out of the loss:
        // matmul with its bias, loss with the bias gradient, weight
        // gradient, update.
        let linear_fits = k.fits_limits(wgrad::kernels::registry::MSE_LINEAR_FORWARD_BACKWARD);
        assert_eq!(fused.executor().dispatches_per_step(), if linear_fits { 2 } else { 4 });
        assert_eq!(unfused.executor().dispatches_per_step(), 9);
        let plan = fused.executor().plan();
        assert!(plan
            .loss_fusion
            .iter()
            .flatten()
            .any(|f| f.linear.is_some() == linear_fits && f.bias_grad.is_some()));

        // A prediction still runs the layer on its own (not the loss).
        let mut fused = fused;
        let out = fused.outputs(&[0.5; 3 * 10])?;
        let w = fused.executor().parameters()?;
        let want = cpu::bias_add(
            &cpu::matmul(wgrad::kernels::MatmulForm::ABt, &[0.5; 3 * 10], &w[0].2, 3, 1, 10),
            &w[1].2,
            1,
        );
        assert_close("prediction", &out, &want, 1e-6, 1e-5);

        let mlp = Sequential::mlp(&[784, 512, 512, 10], Layer::ReLU)?;
        let fused = Trainer::new(k.clone(), &mlp, CrossEntropyLoss, Adam::new(1e-3), 256)?;
        let unfused = Trainer::with_options(k.clone(), &mlp, CrossEntropyLoss, Adam::new(1e-3), 256, UNFUSED)?;
        let (f, u) = (
            fused.executor().dispatches_per_step(),
            unfused.executor().dispatches_per_step(),
        );
        eprintln!("MLP 784-512-512-10 dispatches per step: {f} fused, {u} unfused");
        // Per hidden layer: matmul + bias + ReLU forward; input-gradient
        // matmul + ReLU backward; weight gradient; bias gradient. The last
        // layer's bias gradient is in the loss; Adam is one dispatch.
        assert!(f <= 12 && f < u, "{f} fused vs {u}");
        Ok(())
    });
}

/// Largest total size of slot-held tensors alive at once: a tensor lives
/// from the node making it to its last reader (`plan.reads`: what each node
/// actually reads); outputs live to the end. No allocator can use less.
fn max_live_slot_bytes(g: &Graph, plan: &Plan) -> u64 {
    let nodes = g.nodes();
    let mut last = vec![0usize; nodes.len()];
    for &i in &plan.order {
        for t in &plan.reads[i] {
            last[t.index()] = i;
        }
    }
    for (i, &out) in plan.is_output.iter().enumerate() {
        if out {
            last[i] = usize::MAX;
        }
    }
    let mut live: Vec<usize> = Vec::new();
    let mut worst = 0u64;
    for &i in &plan.order {
        if matches!(plan.storage[i], Storage::Slot { .. }) {
            live.push(i);
        }
        worst = worst.max(live.iter().map(|&j| nodes[j].len() as u64 * 4).sum());
        live.retain(|&j| last[j] > i);
    }
    worst
}

#[test]
fn the_mlp_step_peak_memory_is_parameters_state_and_the_live_activations() {
    nn::manual_seed(0);
    let model = Sequential::mlp(&[784, 512, 512, 10], Layer::ReLU).unwrap();
    let mut g = Graph::new();
    let x = g.input("x", &[256, 784]).unwrap();
    let out = nn::Module::forward(&model, &mut g, x, "").unwrap();
    let y = g.labels("y", 256).unwrap();
    let loss = g.cross_entropy_loss(out, y).unwrap();
    let prediction = g.argmax(out).unwrap();
    let grads = g.backward(loss).unwrap();
    let plan = Plan::new(&g, &[out, prediction, loss], Some(&grads), 64);
    let params: u64 = g.parameters().iter().map(|&p| g.get(p).unwrap().len() as u64 * 4).sum();
    let arena = plan.param_arena_len as u64 * 4;
    assert!(
        arena < params + 64 * 4 * g.parameters().len() as u64,
        "alignment padding only"
    );
    let inputs = (256 * 784 + 256 + 1) * 4;
    assert_eq!(plan.input_bytes, inputs);
    // Parameters, gradients and Adam's two moments, inputs, slots.
    let peak = plan.peak_bytes(true, 2);
    assert_eq!(peak, 4 * arena + inputs + plan.slot_bytes);
    let live = max_live_slot_bytes(&g, &plan);
    eprintln!(
        "MLP plan: peak {peak} B = 4 × {arena} (params, grads, Adam) + {inputs} inputs + {} slots; live bound {live}, naive {}",
        plan.slot_bytes, plan.naive_intermediate_bytes
    );
    assert!(
        plan.slot_bytes < plan.naive_intermediate_bytes,
        "{} vs naive {}",
        plan.slot_bytes,
        plan.naive_intermediate_bytes
    );
    // Within 10% of the liveness bound: slots are reused, not summed.
    assert!(
        plan.slot_bytes * 10 <= live * 11,
        "slots {} vs live bound {live}",
        plan.slot_bytes
    );
    assert!(peak <= 4 * arena + inputs + live * 11 / 10);
}

/// Runs one forward + backward of `graph` fused and unfused and compares
/// the loss and every parameter gradient; returns the fused plan.
fn fused_matches_unfused(
    k: &Arc<Kernels>,
    what: &str,
    graph: &Graph,
    loss: wgrad::graph::Tensor,
    outputs: &[wgrad::graph::Tensor],
    feeds: &[(wgrad::graph::Tensor, Vec<f32>)],
) -> wgrad::Result<Plan> {
    let mut results = Vec::new();
    let mut fused_plan = None;
    for options in [PlanOptions::default(), UNFUSED] {
        let mut g = graph.clone();
        let grads = g.backward(loss)?;
        let params = g.parameters();
        let mut exec = Executor::with_options(k.clone(), g, outputs, Some(grads), None, options)?;
        for (t, data) in feeds {
            exec.set_input(*t, data)?;
        }
        let value = exec.train_step(true, false, true)?.unwrap_or(f32::NAN);
        let mut all = vec![vec![value]];
        for p in params {
            all.push(exec.read_grad(p)?);
        }
        for &o in outputs {
            all.push(exec.read(o)?);
        }
        results.push(all);
        fused_plan.get_or_insert_with(|| exec.plan().clone());
    }
    for (i, (f, u)) in results[0].iter().zip(&results[1]).enumerate() {
        // Same arithmetic, summed in another order by the fused kernels.
        assert_close(&format!("{what}: result {i}"), f, u, 1e-6, 1e-4);
    }
    Ok(fused_plan.expect("planned"))
}

#[test]
fn activation_fusion_keeps_what_each_backward_needs() {
    for_each_adapter("activation_fusion", |k| {
        let (rows, inputs, hidden) = (5, 7, 6);
        let x_data = random_vec(&mut rng(40), rows * inputs, -1.0, 1.0);
        let t_data = random_vec(&mut rng(41), rows * 3, -1.0, 1.0);
        for act in Activation::ALL {
            // Linear + activation + Linear, MSE; sometimes the
            // pre-activation is also an output.
            for pre_is_output in [false, true] {
                let mut g = Graph::new();
                let x = g.input("x", &[rows, inputs])?;
                let w1 = param(&mut g, "w1", &[hidden, inputs], 42);
                let b1 = param(&mut g, "b1", &[hidden], 43);
                let w2 = param(&mut g, "w2", &[3, hidden], 44);
                let product = g.matmul_form(MatmulForm::ABt, x, w1)?;
                let z = g.bias_add(product, b1)?;
                let y = g.activation(act, z)?;
                let out = g.matmul_form(MatmulForm::ABt, y, w2)?;
                let t = g.input("t", &[rows, 3])?;
                let loss = g.mse_loss(out, t)?;
                let outputs: Vec<_> = if pre_is_output { vec![z, loss] } else { vec![loss] };
                let what = format!("{act:?}, pre-activation output: {pre_is_output}");
                let plan = fused_matches_unfused(
                    k,
                    &what,
                    &g,
                    loss,
                    &outputs,
                    &[(x, x_data.clone()), (t, t_data.clone())],
                )?;
                assert_eq!(plan.activation_into[product.index()], Some(y.index()), "{what}");
                // ReLU's backward reads the ReLU output: the pre-activation
                // is kept only when something else reads it.
                let kept = plan.storage[z.index()] != Storage::Unused;
                assert_eq!(
                    kept,
                    act != Activation::Relu || pre_is_output,
                    "{what}: pre-activation kept"
                );
                // The hidden activation's backward rides on dOut·W2.
                let backward = plan.activation_grad_into.iter().flatten().count();
                assert_eq!(backward, 1, "{what}");
            }
        }
        // Without a bias add there is nowhere to keep a pre-activation: a
        // tanh (whose backward needs it) stays separate, a ReLU fuses.
        for act in [Activation::Tanh, Activation::Relu] {
            let mut g = Graph::new();
            let x = g.input("x", &[rows, inputs])?;
            let w1 = param(&mut g, "w1", &[inputs, hidden], 45);
            let product = g.matmul(x, w1)?;
            let y = g.activation(act, product)?;
            // y feeds two ops: its incoming gradient is a sum, not a matmul.
            let doubled = g.add(y, y)?;
            let w2 = param(&mut g, "w2", &[hidden, 3], 46);
            let out = g.matmul(doubled, w2)?;
            let t = g.input("t", &[rows, 3])?;
            let loss = g.mse_loss(out, t)?;
            let what = format!("{act:?} without bias");
            let plan = fused_matches_unfused(k, &what, &g, loss, &[loss], &[(x, x_data.clone()), (t, t_data.clone())])?;
            let fused = plan.activation_into[product.index()] == Some(y.index());
            assert_eq!(fused, act == Activation::Relu, "{what}");
            assert!(
                plan.activation_grad_into.iter().all(Option::is_none),
                "{what}: dy is a sum"
            );
        }
        Ok(())
    });
}
