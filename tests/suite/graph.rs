//! The graph, autodiff, memory plan and executor: gradients against f64
//! central differences, one submit per step, no allocation per step,
//! determinism, memory reuse, and a golden MLP run against a hand-written
//! CPU implementation.

use crate::common;

use std::sync::Arc;

use common::{assert_close, for_each_adapter, gradcheck, mse_to_random, param, param_in, random_vec, rng};
use wgrad::graph::{Executor, Graph, LossOp};
use wgrad::kernels::{Activation, Binary, MatmulForm, OptimizerConfig, SgdConfig};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::{Adam, SGD};
use wgrad::{cpu, Error, Kernels};
use wgrad::{Targets, Trainer};

#[test]
fn every_op_backward_matches_central_differences() {
    for_each_adapter("gradcheck", |k| {
        // matmul in each form, into an MSE loss.
        for form in MatmulForm::ALL {
            let (m, n, kk) = (3, 5, 4);
            let (sa, sb) = form.operand_shapes(m, n, kk);
            let mut g = Graph::new();
            let a = param(&mut g, "a", &sa, 1);
            let b = param(&mut g, "b", &sb, 2);
            let c = g.matmul_form(form, a, b)?;
            let t = g.input("t", &[m, n])?;
            let loss = g.mse_loss(c, t)?;
            gradcheck(
                k,
                &format!("matmul {form:?}"),
                g,
                loss,
                vec![(t, random_vec(&mut rng(3), m * n, -1.0, 1.0))],
                vec![],
            )?;
        }
        // Binary ops, scale and bias add, each with both operands trainable.
        for op in Binary::ALL {
            // Division is checked below, with divisors kept away from 0.
            if op == Binary::Div {
                continue;
            }
            let mut g = Graph::new();
            let a = param(&mut g, "a", &[4, 3], 4);
            let b = param(&mut g, "b", &[4, 3], 5);
            let c = match op {
                Binary::Add => g.add(a, b)?,
                Binary::Sub => g.sub(a, b)?,
                Binary::Mul => g.mul(a, b)?,
                Binary::Div => g.div(a, b)?,
            };
            let s = g.scale(c, 0.7)?;
            let bias = param(&mut g, "bias", &[3], 6);
            let y = g.bias_add(s, bias)?;
            let t = g.input("t", &[4, 3])?;
            let loss = g.mse_loss(y, t)?;
            gradcheck(
                k,
                &format!("{op:?}/scale/bias_add"),
                g,
                loss,
                vec![(t, random_vec(&mut rng(7), 12, -1.0, 1.0))],
                vec![],
            )?;
        }
        // Activations, and a parameter used twice (gradients accumulate).
        for act in Activation::ALL {
            let mut g = Graph::new();
            let a = param(&mut g, "a", &[5, 2], 8);
            let h = g.activation(act, a)?;
            let y = g.mul(h, a)?;
            let t = g.input("t", &[5, 2])?;
            let loss = g.mse_loss(y, t)?;
            gradcheck(
                k,
                &format!("{act:?}"),
                g,
                loss,
                vec![(t, random_vec(&mut rng(9), 10, -1.0, 1.0))],
                vec![],
            )?;
        }
        // Cross-entropy over a linear layer.
        let mut g = Graph::new();
        let x = g.input("x", &[6, 4])?;
        let w = param(&mut g, "w", &[3, 4], 10);
        let logits = g.matmul_form(MatmulForm::ABt, x, w)?;
        let labels = g.labels("y", 6)?;
        let loss = g.cross_entropy_loss(logits, labels)?;
        gradcheck(
            k,
            "cross_entropy",
            g,
            loss,
            vec![(x, random_vec(&mut rng(11), 24, -2.0, 2.0))],
            vec![(labels, vec![0, 2, 1, 1, 0, 2])],
        )?;
        Ok(())
    });
}

#[test]
fn tensor_ops_backward_match_central_differences() {
    for_each_adapter("gradcheck tensors", |k| {
        // Broadcasting binary ops along trailing dimensions, ranks 3 and 1–2.
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 3, 5], 20);
        let bias = param(&mut g, "bias", &[5], 21);
        let col = param(&mut g, "col", &[3, 1], 22);
        let den = param_in(&mut g, "den", &[1, 5], 23, 1.0, 2.0);
        let lead = param(&mut g, "lead", &[2, 1, 5], 24);
        let y = g.add(x, bias)?;
        let y = g.mul(y, col)?;
        let y = g.div(y, den)?;
        let y = g.sub(y, lead)?;
        let (loss, feeds) = mse_to_random(&mut g, y, 25)?;
        gradcheck(k, "broadcast add/mul/div/sub", g, loss, feeds, vec![])?;

        // exp and rsqrt (rsqrt on positive values).
        let mut g = Graph::new();
        let a = param_in(&mut g, "a", &[3, 7], 26, 0.5, 2.0);
        let e = g.exp(a)?;
        let r = g.rsqrt(a)?;
        let y = g.add(e, r)?;
        let (loss, feeds) = mse_to_random(&mut g, y, 27)?;
        gradcheck(k, "exp/rsqrt", g, loss, feeds, vec![])?;

        // Reshape, permute (rank 4), split and concat along the last axis.
        let mut g = Graph::new();
        let p = param(&mut g, "p", &[2, 3, 2, 5], 28);
        let q = g.permute(p, &[0, 2, 1, 3])?;
        let q = g.reshape(q, &[4, 15])?;
        let parts = g.split_last(q, &[2, 13])?;
        let y = g.concat_last(&[parts[1], parts[0]])?;
        let y = g.transpose(y, 0, 1)?;
        let (loss, feeds) = mse_to_random(&mut g, y, 29)?;
        gradcheck(k, "reshape/permute/split/concat", g, loss, feeds, vec![])?;

        // Batched matmul, ranks 3 and 4, every form.
        for (lead, form) in [
            (vec![3], MatmulForm::AB),
            (vec![2, 2], MatmulForm::ABt),
            (vec![1, 3], MatmulForm::AtB),
        ] {
            let (m, n, kk) = (3, 5, 4);
            let (sa, sb) = form.operand_shapes(m, n, kk);
            let mut g = Graph::new();
            let a = param(&mut g, "a", &[lead.clone(), sa.to_vec()].concat(), 30);
            let b = param(&mut g, "b", &[lead.clone(), sb.to_vec()].concat(), 31);
            let c = g.matmul_form(form, a, b)?;
            let (loss, feeds) = mse_to_random(&mut g, c, 32)?;
            gradcheck(
                k,
                &format!("batched matmul {form:?} over {lead:?}"),
                g,
                loss,
                feeds,
                vec![],
            )?;
        }

        // Softmax, causal over [.., T, T] and plain over odd rows.
        for (shape, causal) in [(vec![2, 2, 5, 5], true), (vec![3, 7], false)] {
            let mut g = Graph::new();
            let s = param_in(&mut g, "s", &shape, 33, -2.0, 2.0);
            let y = g.softmax(s, causal)?;
            let (loss, feeds) = mse_to_random(&mut g, y, 34)?;
            gradcheck(k, &format!("softmax causal={causal}"), g, loss, feeds, vec![])?;
        }

        // Embedding with repeated ids, then cross-entropy over rank-3 logits.
        let mut g = Graph::new();
        let table = param(&mut g, "wte", &[11, 4], 39);
        let ids = g.ids("ids", &[2, 5])?;
        let h = g.embedding(table, ids)?;
        let w = param(&mut g, "head", &[4, 6], 40);
        let logits = g.matmul(h, w)?;
        let targets = g.ids("targets", &[2, 5])?;
        let loss = g.cross_entropy_loss(logits, targets)?;
        let feeds_ids = vec![
            (ids, vec![3, 3, 0, 10, 3, 7, 7, 1, 3, 0]),
            (targets, vec![0, 5, 2, 2, 1, 3, 4, 0, 5, 1]),
        ];
        gradcheck(k, "embedding + rank-3 cross-entropy", g, loss, vec![], feeds_ids)?;

        // Cross-entropy over logits too large for one workgroup: one
        // workgroup per row, then the mean (257 rows of 256 classes).
        let (rows, vocab) = (257, 256);
        let mut g = Graph::new();
        let x = g.input("x", &[rows, 3])?;
        let w = param(&mut g, "w", &[3, vocab], 44);
        let logits = g.matmul(x, w)?;
        let targets = g.labels("targets", rows)?;
        let loss = g.cross_entropy_loss(logits, targets)?;
        assert!(
            g.nodes().iter().any(|n| n.op == LossOp::CrossEntropyRows),
            "the row-wise loss serves large logits"
        );
        let labels: Vec<u32> = (0..rows as u32).map(|r| (r * 37) % vocab as u32).collect();
        gradcheck(
            k,
            "row-wise cross-entropy",
            g,
            loss,
            vec![(x, random_vec(&mut rng(45), rows * 3, -1.0, 1.0))],
            vec![(targets, labels)],
        )?;

        // A whole one-block GPT on sequences shorter than its block (the
        // position table is sliced), into a rank-3 cross-entropy.
        nn::manual_seed(46);
        let gpt = wgrad::models::Gpt::new(wgrad::models::GptConfig {
            vocab_size: 5,
            block_size: 4,
            n_layer: 1,
            n_head: 2,
            n_embd: 4,
        })?;
        let mut g = Graph::new();
        let idx = g.ids("idx", &[2, 3])?;
        let logits = nn::Module::forward(&gpt, &mut g, idx, "")?;
        let targets = g.ids("targets", &[2, 3])?;
        let loss = g.cross_entropy_loss(logits, targets)?;
        gradcheck(
            k,
            "Gpt",
            g,
            loss,
            vec![],
            vec![(idx, vec![1, 4, 1, 0, 2, 2]), (targets, vec![4, 1, 0, 2, 2, 3])],
        )?;

        // The attention module end to end: two heads over [2, 5, 8].
        nn::manual_seed(41);
        let attn = nn::CausalSelfAttention::new(8, 2)?;
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 5, 8], 42);
        let y = nn::Module::forward(&attn, &mut g, x, "attn.")?;
        let (loss, feeds) = mse_to_random(&mut g, y, 43)?;
        gradcheck(k, "CausalSelfAttention", g, loss, feeds, vec![])?;
        Ok(())
    });
}

#[test]
fn bad_shapes_are_errors_at_build_time_naming_the_op_and_shapes() {
    let mut g = Graph::new();
    let x = g.input("x", &[4, 3]).unwrap();
    let w = g.input("w", &[5, 2]).unwrap();
    match g.matmul(x, w).unwrap_err() {
        Error::Shape { op, shapes, .. } => {
            assert_eq!(op, "matmul");
            assert_eq!(shapes, vec![vec![4, 3], vec![5, 2]]);
        }
        other => panic!("{other}"),
    }
    let b = g.input("b", &[4]).unwrap();
    assert!(matches!(g.bias_add(x, b), Err(Error::Shape { op: "bias_add", .. })));
    assert!(matches!(g.add(x, w), Err(Error::Shape { op: "add", .. })));
    let labels = g.labels("y", 3).unwrap();
    assert!(matches!(
        g.cross_entropy_loss(x, labels),
        Err(Error::Shape {
            op: "cross_entropy_loss",
            ..
        })
    ));
    assert!(g.input("empty", &[0, 3]).is_err());
}

#[test]
fn a_gradient_without_a_rule_is_an_error() {
    let mut g = Graph::new();
    let p = g.parameter("p", &[2, 2], vec![1.0; 4]).unwrap();
    // Column sums have no gradient rule (only autodiff emits them).
    let columns = g.sum_rows(p).unwrap();
    let m = g.mean(columns).unwrap();
    match g.backward(m) {
        Err(Error::NoGradient { op, .. }) => assert_eq!(op, "sum_rows"),
        other => panic!("expected NoGradient, got {other:?}"),
    }
    let x = g.input("x", &[2, 2]).unwrap();
    assert!(
        matches!(g.backward(x), Err(Error::Shape { .. })),
        "a non-scalar loss is refused"
    );
}

fn digits_like(rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut r = rng(seed);
    let x = random_vec(&mut r, rows * 16, 0.0, 1.0);
    // A learnable rule: the class is the argmax of four feature sums.
    let y = (0..rows)
        .map(|i| {
            let s: Vec<f32> = (0..4)
                .map(|c| x[i * 16 + c * 4..i * 16 + c * 4 + 4].iter().sum())
                .collect();
            cpu::argmax_rows(&s, 1, 4)[0]
        })
        .collect();
    (x, y)
}

fn mlp_trainer(k: &Arc<Kernels>, seed: u64, batch: usize) -> wgrad::Result<Trainer> {
    nn::manual_seed(seed);
    let model = Sequential::mlp(&[16, 32, 4], Layer::ReLU)?;
    Trainer::new(k.clone(), &model, CrossEntropyLoss, Adam::new(1e-2), batch)
}

#[test]
fn a_training_step_is_one_submit_and_allocates_nothing() {
    for_each_adapter("one_submit", |shared| {
        let k = &common::private_kernels(shared);
        let (x, y) = digits_like(32, 1);
        let mut t = mlp_trainer(k, 1, 32)?;
        let buffers_before = k.buffers_created();
        for step in 0..200 {
            let submits = k.submit_count();
            t.zero_grad();
            t.forward(&x)?;
            t.loss(Targets::Classes(&y))?;
            t.backward()?;
            t.step()?;
            assert_eq!(k.submit_count() - submits, 1, "step {step}");
        }
        assert_eq!(k.buffers_created(), buffers_before, "buffers created during 200 steps");
        let submits = k.submit_count();
        t.zero_grad();
        t.forward(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        let loss = t.step_reading_loss()?;
        assert_eq!(
            k.submit_count() - submits,
            1,
            "a step that reads its loss is still one submit"
        );
        assert!(loss < 1.0, "the rule is learnable: loss {loss}");
        Ok(())
    });
}

#[test]
fn a_gpu_shaped_training_step_is_one_submit_and_allocates_nothing() {
    // 512 rows: the bias gradients are two-stage column sums (GPU shaping
    // from 256 rows), whose partials live in the device's reduction
    // scratch, sized when the dispatches are built.
    for_each_adapter("one_submit_gpu_shaped", |shared| {
        let k = &common::limited_kernels(
            shared,
            wgrad::kernels::LimitOverrides {
                gpu_shaping: Some(true),
                ..Default::default()
            },
        );
        let (x, y) = digits_like(512, 2);
        let mut t = mlp_trainer(k, 1, 512)?;
        let buffers_before = k.buffers_created();
        let mut loss = f32::NAN;
        for step in 0..20 {
            let submits = k.submit_count();
            t.zero_grad();
            t.forward(&x)?;
            t.loss(Targets::Classes(&y))?;
            t.backward()?;
            loss = t.step_reading_loss()?;
            assert_eq!(k.submit_count() - submits, 1, "step {step}");
        }
        assert_eq!(k.buffers_created(), buffers_before, "buffers created during 20 steps");
        assert!(loss < 1.3, "the rule is learnable: loss {loss}");
        Ok(())
    });
}

#[test]
fn the_memory_plan_reuses_intermediate_slots() {
    nn::manual_seed(0);
    let model = Sequential::mlp(&[64, 128, 128, 128, 10], Layer::ReLU).unwrap();
    let mut g = Graph::new();
    let x = g.input("x", &[256, 64]).unwrap();
    let out = nn::Module::forward(&model, &mut g, x, "").unwrap();
    let y = g.labels("y", 256).unwrap();
    let loss = g.cross_entropy_loss(out, y).unwrap();
    let grads = g.backward(loss).unwrap();
    let plan = wgrad::graph::Plan::new(&g, &[loss], Some(&grads), 64);
    assert!(
        plan.slot_bytes * 4 < plan.naive_intermediate_bytes * 3,
        "slots {} vs naive {}",
        plan.slot_bytes,
        plan.naive_intermediate_bytes
    );
    let in_slots = plan
        .storage
        .iter()
        .filter(|s| matches!(s, wgrad::graph::Storage::Slot { .. }))
        .count();
    assert!(
        plan.slot_len.len() * 2 <= in_slots,
        "{} slots hold {in_slots} tensors",
        plan.slot_len.len()
    );
    // Every parameter offset is aligned and they do not overlap (the arena
    // holds the decayed group first, so sort by offset).
    let mut end = 0;
    let mut by_offset = plan.param_offsets.clone();
    by_offset.sort_by_key(|&(_, offset)| offset);
    for &(p, offset) in &by_offset {
        assert_eq!(offset % 64, 0);
        assert!(offset >= end);
        end = offset + g.get(p).expect("parameter").len();
    }
    eprintln!(
        "plan: {} slots, {} B vs naive {} B",
        plan.slot_len.len(),
        plan.slot_bytes,
        plan.naive_intermediate_bytes
    );
}

#[test]
fn same_seed_same_adapter_gives_bit_identical_weights() {
    for_each_adapter("determinism", |k| {
        let (x, y) = digits_like(32, 2);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut t = mlp_trainer(k, 7, 32)?;
            for _ in 0..10 {
                t.zero_grad();
                t.forward(&x)?;
                t.loss(Targets::Classes(&y))?;
                t.backward()?;
                t.step()?;
            }
            let params: Vec<Vec<u32>> = t
                .executor()
                .parameters()?
                .into_iter()
                .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
                .collect();
            runs.push(params);
        }
        assert_eq!(runs[0], runs[1]);
        Ok(())
    });
}

#[test]
fn without_zero_grad_gradients_accumulate() {
    for_each_adapter("accumulate", |k| {
        let (x, y) = digits_like(8, 3);
        nn::manual_seed(3);
        let model = Sequential::mlp(&[16, 4], Layer::ReLU)?;
        // lr = 0 keeps the weights fixed so both backward passes see the same function.
        let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, SGD::new(0.0), 8)?;
        let p = t.executor().graph().parameters()[0];
        t.zero_grad();
        t.forward(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        t.step()?;
        let once = t.executor().read_grad(p)?;
        t.forward(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        t.step()?;
        let twice = t.executor().read_grad(p)?;
        let doubled: Vec<f32> = once.iter().map(|v| 2.0 * v).collect();
        assert_close("accumulated gradient", &twice, &doubled, 1e-6, 1e-5);
        Ok(())
    });
}

/// A 2-layer MLP with forward, backward and SGD written out by hand with the
/// CPU twins: the golden reference for the GPU engine.
struct CpuMlp {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl CpuMlp {
    fn step(&mut self, x: &[f32], y: &[u32], dims: (usize, usize, usize, usize), lr: f32) -> f32 {
        let (batch, input, hidden, classes) = dims;
        let h_pre = cpu::bias_add(
            &cpu::matmul(MatmulForm::ABt, x, &self.w1, batch, hidden, input),
            &self.b1,
            hidden,
        );
        let h = cpu::activation_forward(Activation::Relu, &h_pre);
        let logits = cpu::bias_add(
            &cpu::matmul(MatmulForm::ABt, &h, &self.w2, batch, classes, hidden),
            &self.b2,
            classes,
        );
        let loss = cpu::cross_entropy_forward(&logits, y, batch, classes);
        let dlogits = cpu::cross_entropy_backward(&logits, y, 1.0, batch, classes);
        let dw2 = cpu::matmul(MatmulForm::AtB, &dlogits, &h, classes, hidden, batch);
        let db2 = cpu::sum_rows(&dlogits, batch, classes);
        let dh = cpu::matmul(MatmulForm::AB, &dlogits, &self.w2, batch, hidden, classes);
        let dh_pre = cpu::activation_backward(Activation::Relu, &h_pre, &dh);
        let dw1 = cpu::matmul(MatmulForm::AtB, &dh_pre, x, hidden, input, batch);
        let db1 = cpu::sum_rows(&dh_pre, batch, hidden);
        let cfg = SgdConfig {
            lr,
            ..SgdConfig::default()
        };
        for (p, g) in [
            (&mut self.w1, &dw1),
            (&mut self.b1, &db1),
            (&mut self.w2, &dw2),
            (&mut self.b2, &db2),
        ] {
            let mut unused = vec![0.0; p.len()];
            cpu::sgd_update(p, g, &mut unused, &cfg, 1);
        }
        loss
    }
}

#[test]
fn golden_mlp_losses_match_a_hand_written_cpu_mlp_for_20_steps() {
    for_each_adapter("golden", |k| {
        let dims = (24, 16, 20, 4);
        let (x, y) = digits_like(dims.0, 4);
        nn::manual_seed(11);
        let model = Sequential::mlp(&[16, 20, 4], Layer::ReLU)?;
        let weights = |i: usize| match &model.layers[i] {
            Layer::Linear(l) => l.clone(),
            _ => unreachable!(),
        };
        let (l0, l2) = (weights(0), weights(2));
        let mut reference = CpuMlp {
            w1: l0.weight,
            b1: l0.bias.unwrap_or_default(),
            w2: l2.weight,
            b2: l2.bias.unwrap_or_default(),
        };
        let lr = 0.5;
        let mut t = Trainer::new(
            k.clone(),
            &model,
            CrossEntropyLoss,
            OptimizerConfig::Sgd(SgdConfig {
                lr,
                ..SgdConfig::default()
            }),
            dims.0,
        )?;
        for step in 0..20 {
            t.zero_grad();
            t.forward(&x)?;
            t.loss(Targets::Classes(&y))?;
            t.backward()?;
            let gpu = t.step_reading_loss()?;
            let want = reference.step(&x, &y, dims, lr);
            // f32 GPU vs f64-accumulating CPU twins; differences compound over
            // steps but stay far below 1e-3 for this small, well-scaled net.
            assert!(
                (gpu - want).abs() <= 1e-4 + 1e-3 * want.abs(),
                "step {step}: gpu {gpu} cpu {want}"
            );
        }
        let params = t.executor().parameters()?;
        assert_close("final 0.weight", &params[0].2, &reference.w1, 1e-3, 1e-2);
        Ok(())
    });
}

#[test]
fn a_parameter_feeding_two_matmuls_gets_both_gradients() {
    for_each_adapter("shared_weight", |k| {
        // y = (x·W)·W with W square: two fused accumulations into one gradient.
        let mut g = Graph::new();
        let x = g.input("x", &[3, 4])?;
        let w = param(&mut g, "w", &[4, 4], 12);
        let h = g.matmul(x, w)?;
        let y = g.matmul(h, w)?;
        let t = g.input("t", &[3, 4])?;
        let loss = g.mse_loss(y, t)?;
        gradcheck(
            k,
            "shared weight",
            g,
            loss,
            vec![
                (x, random_vec(&mut rng(13), 12, -1.0, 1.0)),
                (t, random_vec(&mut rng(14), 12, -1.0, 1.0)),
            ],
            vec![],
        )
    });
}

#[test]
fn input_gradients_from_backward_from_match_central_differences() {
    for_each_adapter("input_gradient", |k| {
        let mut g = Graph::new();
        let x = g.input("x", &[2, 3])?;
        let w = param(&mut g, "w", &[4, 3], 15);
        let h = g.matmul_form(MatmulForm::ABt, x, w)?;
        let y = g.tanh(h)?;
        let seed = g.input("dy", &[2, 4])?;
        let reference = g.clone();
        let grads = g.backward_from(y, seed, &[x])?;
        let dx = grads.input(x).expect("input gradient");
        let mut exec = Executor::new(k.clone(), g, &[y], Some(grads), None)?;
        let x_host = random_vec(&mut rng(16), 6, -1.0, 1.0);
        let dy_host = random_vec(&mut rng(17), 8, -1.0, 1.0);
        exec.set_input(x, &x_host)?;
        exec.set_input(seed, &dy_host)?;
        exec.train_step(true, false, false)?;
        let got = exec.read(dx)?;
        // d/dx of Σ dy ⊙ y(x), by central differences in f64.
        let objective = |xv: &[f32]| -> f64 {
            let feeds = vec![(x, xv.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>())];
            let values = reference.evaluate_f64(&[y], &feeds).expect("the reference evaluates");
            values[0].iter().zip(&dy_host).map(|(a, b)| a * f64::from(*b)).sum()
        };
        let want: Vec<f32> = (0..6)
            .map(|i| {
                let (mut p, mut m) = (x_host.clone(), x_host.clone());
                p[i] += 1e-3;
                m[i] -= 1e-3;
                ((objective(&p) - objective(&m)) / (f64::from(p[i]) - f64::from(m[i]))) as f32
            })
            .collect();
        assert_close("d/dx", &got, &want, 2e-3, 1e-2);
        Ok(())
    });
}

#[test]
fn only_outputs_can_be_read_back() {
    for_each_adapter("outputs_only", |k| {
        let mut g = Graph::new();
        let x = g.input("x", &[2, 3])?;
        let w = param(&mut g, "w", &[3, 3], 18);
        let h = g.matmul(x, w)?; // shares its slot once the ReLU has read it
        let r = g.relu(h)?;
        let y = g.sigmoid(r)?;
        let mut exec = Executor::new(k.clone(), g, &[y], None, None)?;
        exec.set_input(x, &[1.0; 6])?;
        exec.run(&[y])?;
        assert_eq!(exec.read(y)?.len(), 6);
        assert!(matches!(exec.read(h), Err(Error::InvalidArgument { .. })));
        assert!(matches!(exec.run(&[r]), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
}
