//! `TensorParallel` over a GPT against single-device training of the same GPT on
//! the same batches: 2 devices (lavapipe + llvmpipe-GL, heads 2 + 2) and 3
//! (lavapipe, llvmpipe-GL, lavapipe again: heads 2 + 1 + 1, an uneven
//! split), with AdamW, weight decay groups, the warmup-cosine schedule and
//! a gradient clip that triggers; the global-norm clip; resuming from the
//! gathered optimizer state on another split; and the refusals.

use crate::common;
use crate::parallel::open_groups;

use common::{columns_held, rng, rows_held, train_on_one_device, Parameters};
use rand::Rng;
use wgrad::io::gpt_folder::OptimizerState;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss};
use wgrad::optim::{AdamW, SGD};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::DeviceSelection;
use wgrad::Error;
use wgrad::{Examples, Targets, Trainer};

/// 4 heads, so 3 devices split them unevenly; C 16 (head size 4), MLP 64.
const CONFIG: GptConfig = GptConfig {
    vocab_size: 29,
    block_size: 8,
    n_layer: 2,
    n_head: 4,
    n_embd: 16,
};
const BATCH: usize = 4;
const STEPS: u64 = 10;
/// Below the gradient norms of every step here (asserted), so every step clips.
pub(crate) const CLIP: f32 = 0.3;

pub(crate) fn model() -> Gpt {
    nn::manual_seed(5);
    Gpt::new(CONFIG).unwrap()
}

pub(crate) fn adamw() -> AdamW {
    common::clipped_adamw(CLIP, STEPS)
}

/// Step `s`'s sequences and their next tokens.
pub(crate) fn batch(s: u64) -> (Vec<u32>, Vec<u32>) {
    let tokens = BATCH * CONFIG.block_size;
    let mut r = rng(1000 + s);
    let stream: Vec<u32> = (0..tokens + 1)
        .map(|_| r.random_range(0..CONFIG.vocab_size as u32))
        .collect();
    (stream[..tokens].to_vec(), stream[1..].to_vec())
}

/// Single-device training: the trainer, and each step's loss and
/// gradient norm (before clipping).
fn single_device(
    k: &std::sync::Arc<wgrad::Kernels>,
    model: &Gpt,
    optimizer: impl Into<wgrad::kernels::OptimizerConfig>,
    steps: std::ops::Range<u64>,
) -> (Trainer, Vec<f32>, Vec<f32>) {
    train_on_one_device(k, model, optimizer, BATCH, &steps.map(batch).collect::<Vec<_>>())
}

/// The largest |got − want| over every parameter, for the report; each
/// parameter checked against atol 1e-5 + rtol 1e-4: the same math as one
/// device, summed in another order (partial sums over devices, then in
/// f64), compounded over the steps.
fn assert_same_parameters(what: &str, got: &Parameters, want: &Parameters) -> f32 {
    common::assert_same_parameters(what, got, want, 1e-5, 1e-4)
}

/// Every replicated parameter (embeddings, norms) has the same bits in
/// every stage holding a copy.
fn assert_copies_identical(what: &str, tp: &TensorParallel) {
    let mut copies: std::collections::HashMap<String, Vec<Vec<u32>>> = Default::default();
    for (_, stage) in tp.stages() {
        for (name, _, values) in stage.executor().parameters().unwrap() {
            if name.starts_with("wte.") || name.starts_with("wpe.") || name.contains(".ln_") {
                copies
                    .entry(name)
                    .or_default()
                    .push(values.iter().map(|v| v.to_bits()).collect());
            }
        }
    }
    let devices = tp.slices("h.0.mlp.c_fc.weight").len();
    // wte: each device's embeddings and the head; the others once per device.
    assert_eq!(copies["wte.weight"].len(), devices + 1, "{what}: copies of wte");
    for (name, list) in &copies {
        assert_eq!(
            list.len(),
            if name == "wte.weight" { devices + 1 } else { devices },
            "{what}: copies of {name}"
        );
        assert!(
            list.iter().all(|c| c == &list[0]),
            "{what}: the copies of {name} differ"
        );
    }
}

/// Attention heads per device: c_attn's rows are q, k and v of 4-wide heads.
fn head_split(tp: &TensorParallel) -> Vec<usize> {
    rows_held(tp, "h.0.attn.c_attn.weight")
        .into_iter()
        .map(|rows| rows / (3 * CONFIG.n_embd / CONFIG.n_head))
        .collect()
}

/// MLP hidden units per device; c_proj holds the matching columns.
fn hidden_split(tp: &TensorParallel) -> Vec<usize> {
    let hidden = rows_held(tp, "h.0.mlp.c_fc.weight");
    let columns = columns_held(tp, "h.0.mlp.c_proj.weight");
    assert_eq!(hidden, columns, "c_fc's rows and c_proj's columns go together");
    hidden
}

#[test]
fn gpt_tensor_parallel_matches_single_device_training() {
    let groups = open_groups(
        "gpt_tensor_parallel_matches_single_device_training",
        &[DeviceSelection::Count(2), DeviceSelection::Count(3)],
    );
    for group in groups.iter() {
        let labels = group.labels().join(", ");
        let k0 = &group.members()[0];
        let (mut single, losses, norms) = single_device(k0, &model(), adamw(), 0..STEPS);
        assert!(
            norms.iter().all(|&n| n > CLIP),
            "every step clips: norms {norms:?} against {CLIP}"
        );
        let want = single.executor().parameters().unwrap();

        let mut tp = TensorParallel::new(group, &model(), CrossEntropyLoss, adamw(), BATCH).unwrap();
        let (heads, hidden): (&[usize], &[usize]) = if group.len() == 2 {
            (&[2, 2], &[32, 32])
        } else {
            (&[2, 1, 1], &[22, 21, 21])
        };
        assert_eq!(
            (head_split(&tp), hidden_split(&tp)),
            (heads.to_vec(), hidden.to_vec()),
            "{labels}"
        );
        // The forward pass alone, before any update: the same loss.
        let (x, y) = batch(0);
        let mut fresh = Trainer::new(k0.clone(), &model(), CrossEntropyLoss, adamw(), BATCH).unwrap();
        let before = fresh.evaluate_loss(Examples::Ids(&x), Targets::Classes(&y)).unwrap();
        let got = tp.evaluate_loss(&x, Targets::Classes(&y)).unwrap();
        // f32 sums in another order through 2 blocks: a few ulps of 3.4.
        assert!(
            (got - before).abs() <= 1e-5 * before,
            "[{labels}] loss before training {got} vs {before}"
        );

        let (mut worst_loss, mut worst_norm) = (0.0f32, 0.0f32);
        for s in 0..STEPS {
            let (x, y) = batch(s);
            let loss = tp.step(&x, Targets::Classes(&y), true).unwrap().unwrap();
            let norm = tp.last_grad_norm().unwrap();
            let (i, want_loss, want_norm) = (s as usize, losses[s as usize], norms[s as usize]);
            worst_loss = worst_loss.max((loss - want_loss).abs() / want_loss);
            worst_norm = worst_norm.max((norm - want_norm).abs() / want_norm);
            // Relative 1e-5 on the loss (≈ 3.4) and on the norm (a sum of
            // squares over 7.2k gradients, each summed in another order);
            // measured at most 1.5e-7 and 2e-7.
            assert!(
                (loss - want_loss).abs() <= 1e-5 * want_loss,
                "[{labels}] step {i}: loss {loss} vs {want_loss}"
            );
            assert!(
                (norm - want_norm).abs() <= 1e-5 * want_norm,
                "[{labels}] step {i}: gradient norm {norm} vs {want_norm}"
            );
        }
        let worst = assert_same_parameters(&format!("[{labels}] heads {heads:?}"), &tp.parameters().unwrap(), &want);
        eprintln!("gpt_tensor [{labels}]: max |Δparameter| {worst:.2e}, max relative Δloss {worst_loss:.2e}, Δnorm {worst_norm:.2e}");
        assert_copies_identical(&labels, &tp);
        assert_eq!(tp.step_count(), STEPS);
        assert_eq!(tp.stats().steps, STEPS);
        assert!(tp.report().contains(&format!("{STEPS} steps")), "{}", tp.report());
        // Evaluation after training agrees too, and changes nothing.
        let (x, y) = batch(STEPS);
        let want_eval = single.evaluate_loss(Examples::Ids(&x), Targets::Classes(&y)).unwrap();
        let got_eval = tp.evaluate_loss(&x, Targets::Classes(&y)).unwrap();
        assert!(
            (got_eval - want_eval).abs() <= 1e-5 * want_eval,
            "[{labels}] loss after training {got_eval} vs {want_eval}"
        );
        assert_eq!(tp.step_count(), STEPS);

        // Wrong sizes and tokens outside the vocabulary are errors naming
        // the call or the device.
        let err = tp.step(&x[1..], Targets::Classes(&y), false).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Shape {
                    op: "TensorParallel::step",
                    ..
                }
            ),
            "{err}"
        );
        let err = tp.evaluate_loss(&x, Targets::Classes(&y[..3])).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Shape {
                    op: "TensorParallel::evaluate_loss",
                    ..
                }
            ),
            "{err}"
        );
        let mut bad = x.clone();
        bad[5] = CONFIG.vocab_size as u32;
        let err = tp.step(&bad, Targets::Classes(&y), false).unwrap_err();
        assert!(
            matches!(&err, Error::OnDevice { device, .. } if device.starts_with("#0 "))
                && err.to_string().contains("29"),
            "{err}"
        );
    }
}

/// Clipping uses the whole model's gradient norm: with SGD the clip factor
/// scales every update directly, so shards clipped by their own (smaller)
/// norms would step further than one device does. On 3 devices, and on 1
/// (segments and head on one device: only `wte` is shared, by the
/// embeddings and the head).
#[test]
fn the_clip_uses_the_whole_models_gradient_norm() {
    let groups = open_groups(
        "the_clip_uses_the_whole_models_gradient_norm",
        &[DeviceSelection::Count(1), DeviceSelection::Count(3)],
    );
    for group in groups.iter() {
        let labels = group.labels().join(", ");
        let sgd = || SGD::new(0.5).momentum(0.9).clip_grad_norm(CLIP);
        let (single, _, norms) = single_device(&group.members()[0], &model(), sgd(), 0..3);
        let mut tp = TensorParallel::new(group, &model(), CrossEntropyLoss, sgd(), BATCH).unwrap();
        for s in 0..3 {
            let (x, y) = batch(s);
            tp.step(&x, Targets::Classes(&y), false).unwrap();
            let norm = tp.last_grad_norm().unwrap();
            // Relative 1e-5, as in the training test.
            assert!(
                (norm - norms[s as usize]).abs() <= 1e-5 * norms[s as usize],
                "[{labels}] step {s}: norm {norm} vs {}",
                norms[s as usize]
            );
            assert!(norm > CLIP, "[{labels}] step {s} clips");
        }
        assert_same_parameters(
            &format!("SGD with clipping on [{labels}]"),
            &tp.parameters().unwrap(),
            &single.executor().parameters().unwrap(),
        );
    }
}

/// The gathered optimizer state resumes the run exactly: on another split
/// (2 devices → 3), and on a single device, which reads it by the same
/// names as its own checkpoint.
#[test]
fn resuming_from_the_gathered_state_continues_the_run() {
    const PAUSE: u64 = 4;
    let groups = open_groups(
        "resuming_from_the_gathered_state_continues_the_run",
        &[DeviceSelection::Count(2), DeviceSelection::Count(3)],
    );
    let [two, three] = &groups[..] else { return };
    let k0 = &two.members()[0];
    let (single, _, _) = single_device(k0, &model(), adamw(), 0..STEPS);
    let want = single.executor().parameters().unwrap();

    let mut tp = TensorParallel::new(two, &model(), CrossEntropyLoss, adamw(), BATCH).unwrap();
    for s in 0..PAUSE {
        let (x, y) = batch(s);
        tp.step(&x, Targets::Classes(&y), false).unwrap();
    }
    let state = OptimizerState::from_checkpoint(&tp.checkpoint().unwrap()).unwrap();
    let mut values = tp.parameters().unwrap();
    let paused = Gpt::from_parameters(CONFIG, |name, _| {
        Ok(values.remove(values.iter().position(|(n, _, _)| n == name).unwrap()).2)
    })
    .unwrap();
    assert_eq!(state.step, PAUSE);
    assert_eq!(state.state_names(), ["exp_avg", "exp_avg_sq"]);
    // The same names and sizes as a single device's checkpoint.
    let (paused_single, _, _) = single_device(k0, &model(), adamw(), 0..PAUSE);
    let reference = OptimizerState::from_checkpoint(&paused_single.checkpoint().unwrap()).unwrap();
    let key = |s: &OptimizerState| {
        let mut v: Vec<(String, String, usize)> = s
            .state
            .iter()
            .map(|(p, n, v)| (p.clone(), n.clone(), v.len()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&state), key(&reference));
    assert_eq!(state.optimizer, reference.optimizer);

    // 3 devices, heads split 2 + 1 + 1 instead of 2 + 2.
    let mut resumed = TensorParallel::new(three, &paused, CrossEntropyLoss, adamw(), BATCH).unwrap();
    resumed.load_state(&[], &state.state, Some(state.step)).unwrap();
    assert_eq!(resumed.step_count(), PAUSE);
    // One device.
    let mut alone = Trainer::new(k0.clone(), &paused, CrossEntropyLoss, adamw(), BATCH).unwrap();
    alone
        .executor_mut()
        .load_state(&[], &state.state, Some(state.step))
        .unwrap();
    for s in PAUSE..STEPS {
        let (x, y) = batch(s);
        resumed.step(&x, Targets::Classes(&y), false).unwrap();
        alone.zero_grad();
        alone.forward_ids(&x).unwrap();
        alone.loss(Targets::Classes(&y)).unwrap();
        alone.backward().unwrap();
        alone.step().unwrap();
    }
    let worst = assert_same_parameters("resumed on 3 devices", &resumed.parameters().unwrap(), &want);
    assert_same_parameters("resumed on one device", &alone.executor().parameters().unwrap(), &want);
    eprintln!("gpt_tensor resumed: max |Δparameter| {worst:.2e}");

    // A state that lacks an entry, or holds one of the wrong size, is
    // refused before anything changes.
    let mut missing = state.clone();
    missing
        .state
        .retain(|(p, n, _)| !(p == "h.1.mlp.c_fc.weight" && n == "exp_avg_sq"));
    let err = resumed
        .load_state(&[], &missing.state, Some(missing.step))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("h.1.mlp.c_fc.weight") && err.contains("exp_avg_sq"),
        "{err}"
    );
    let mut short = state.clone();
    if let Some(entry) = short.state.iter_mut().find(|(p, _, _)| p == "h.0.attn.c_attn.weight") {
        entry.2.pop();
    }
    let err = resumed.load_state(&[], &short.state, Some(short.step)).unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("h.0.attn.c_attn.weight"),
        "{err}"
    );
    assert_eq!(resumed.step_count(), STEPS, "a refused state changes nothing");
}

/// A model without attention (MLP-only blocks) splits its hidden units.
#[test]
fn an_mlp_only_gpt_splits_its_hidden_units() {
    let groups = open_groups("an_mlp_only_gpt_splits_its_hidden_units", &[DeviceSelection::Count(3)]);
    let Some(group) = groups.first() else { return };
    let mlp_only = || {
        nn::manual_seed(6);
        Gpt::without_attention(CONFIG).unwrap()
    };
    let (single, _, _) = single_device(&group.members()[0], &mlp_only(), adamw(), 0..3);
    let mut tp = TensorParallel::new(group, &mlp_only(), CrossEntropyLoss, adamw(), BATCH).unwrap();
    assert_eq!(hidden_split(&tp), [22, 21, 21]);
    for s in 0..3 {
        let (x, y) = batch(s);
        tp.step(&x, Targets::Classes(&y), false).unwrap();
    }
    assert_same_parameters(
        "MLP-only GPT",
        &tp.parameters().unwrap(),
        &single.executor().parameters().unwrap(),
    );
}

#[test]
fn impossible_splits_and_bad_shapes_are_refused() {
    let groups = open_groups(
        "impossible_splits_and_bad_shapes_are_refused",
        &[DeviceSelection::Count(3)],
    );
    let Some(group) = groups.first() else { return };
    // More devices than heads: the numbers in the message.
    nn::manual_seed(0);
    let two_heads = Gpt::new(GptConfig { n_head: 2, ..CONFIG }).unwrap();
    let err = TensorParallel::new(group, &two_heads, CrossEntropyLoss, adamw(), BATCH)
        .err()
        .expect("3 devices, 2 heads")
        .to_string();
    assert!(err.contains("3 devices") && err.contains("2 heads"), "{err}");
    // A weight of the wrong size, a Linear of the wrong shape.
    let mut short = model();
    short.h[1].attn.as_mut().unwrap().c_attn.weight.pop();
    let err = TensorParallel::new(group, &short, CrossEntropyLoss, adamw(), BATCH)
        .err()
        .expect("a short weight");
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("h.1.attn.c_attn.weight"),
        "{err}"
    );
    let mut narrow = model();
    let fc = &mut narrow.h[0].mlp.c_fc;
    fc.out_features = 32;
    fc.weight.truncate(32 * CONFIG.n_embd);
    if let Some(bias) = fc.bias.as_mut() {
        bias.truncate(32);
    }
    // c_fc yields 32 hidden units; c_proj, the Linear that reads them,
    // expects 64 and names itself.
    let err = TensorParallel::new(group, &narrow, CrossEntropyLoss, adamw(), BATCH)
        .err()
        .expect("a narrow MLP");
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("h.0.mlp.c_proj.weight"),
        "{err}"
    );
    let err = TensorParallel::new(group, &model(), CrossEntropyLoss, adamw(), 0)
        .err()
        .expect("batch 0")
        .to_string();
    assert!(err.contains("batch"), "{err}");
}
