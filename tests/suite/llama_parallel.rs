//! A Llama (4 query heads sharing 2 KV heads, an MLP of 22 hidden units,
//! untied and tied heads) trained under each parallel strategy by what its
//! modules declare, against single-device training on the same batches:
//! data parallel (2 devices, rows 1 + 3), tensor parallel (2 devices: a KV
//! head each with its 2 query heads, 11 hidden units each; 3 devices
//! refused) and pipeline parallel (2 stages, GPipe and 1F1B, the tied
//! table on both). Ten AdamW steps with weight decay, warmup and cosine,
//! every step clipped.

use crate::common;
use crate::parallel::open_groups;

use common::{
    assert_close, assert_same_parameters, clipped_adamw, columns_held, copies_held, rng, rows_held,
    train_on_one_device, Parameters,
};
use rand::Rng;
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, CrossEntropyLoss, RopeLayout, Staged};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{partition, Pipeline, Schedule};
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::DeviceSelection;
use wgrad::{Examples, Targets, Trainer};

const VOCAB: usize = 29;
const T: usize = 8;
const BATCH: usize = 4;
const STEPS: u64 = 10;
/// Below every step's gradient norm here (asserted), so every step clips.
pub(crate) const CLIP: f32 = 0.1;

/// L2, C16, 4 heads of 4 channels over 2 KV heads, MLP 22 (11 per device).
pub(crate) fn config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: VOCAB,
        block_size: T,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: 16,
        intermediate_size: 22,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: wgrad::models::LlamaVariant::Llama,
    }
}

pub(crate) fn model(tied: bool) -> Llama {
    nn::manual_seed(13);
    Llama::new(config(tied)).unwrap()
}

pub(crate) fn optimizer() -> OptimizerConfig {
    clipped_adamw(CLIP, STEPS).into()
}

/// Every step's sequences: random tokens, each followed by a fixed
/// function of it (something to learn).
pub(crate) fn batches() -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..STEPS)
        .map(|s| {
            let mut r = rng(2400 + s);
            let ids: Vec<u32> = (0..BATCH * T).map(|_| r.random_range(0..VOCAB as u32)).collect();
            let targets = ids.iter().map(|&i| (i * 7 + 3) % VOCAB as u32).collect();
            (ids, targets)
        })
        .collect()
}

fn what(tied: bool) -> &'static str {
    if tied {
        "tied Llama"
    } else {
        "untied Llama"
    }
}

/// One device's run: its losses, pre-clip norms (each above the clip) and
/// final parameters.
fn reference(k: &std::sync::Arc<wgrad::Kernels>, tied: bool) -> (Vec<f32>, Vec<f32>, Parameters) {
    let (trainer, losses, norms) = train_on_one_device(k, &model(tied), optimizer(), BATCH, &batches());
    assert!(
        norms.iter().all(|&n| n > CLIP),
        "{}: every step clips: norms {norms:?} against {CLIP}",
        what(tied)
    );
    (losses, norms, trainer.executor().parameters().unwrap())
}

/// Parameters after ten steps: the same math as one device with the
/// batch's (or a layer's) sums split over devices and added in another
/// order, compounded over ten clipped Adam steps: |Δ| ≤ 1e-5 + 1e-4·|p|.
fn assert_trained_alike(what: &str, got: &Parameters, want: &Parameters) -> f32 {
    assert_same_parameters(what, got, want, 1e-5, 1e-4)
}

#[test]
fn llama_data_parallel_matches_single_device_training() {
    let groups = open_groups(
        "llama_data_parallel_matches_single_device_training",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    for tied in [false, true] {
        let (losses, norms, want) = reference(&group.members()[0], tied);
        let mut dp = DataParallel::new(
            group,
            &model(tied),
            CrossEntropyLoss,
            optimizer(),
            BATCH,
            Split::Rows(vec![1, 3]),
        )
        .unwrap();
        let (mut loss_err, mut norm_err) = (0.0f32, 0.0f32);
        for (s, (ids, targets)) in batches().iter().enumerate() {
            let loss = dp.step(ids, Targets::Classes(targets), true).unwrap().unwrap();
            loss_err = loss_err.max((loss - losses[s]).abs() / losses[s]);
            // The loss (about 3.4) as a row-weighted mean of the shards'.
            assert_close(
                &format!("{} step {s} loss on [{labels}]", what(tied)),
                &[loss],
                &[losses[s]],
                0.0,
                1e-5,
            );
            for (r, replica) in dp.replicas().iter().enumerate() {
                let norm = replica
                    .executor()
                    .read_grad_norm()
                    .unwrap()
                    .expect("the optimizer clips");
                norm_err = norm_err.max((norm - norms[s]).abs() / norms[s]);
                // Each replica clips by the all-reduced gradient's norm:
                // one device's, summed per shard (relative 1e-4).
                assert_close(
                    &format!("{} step {s} norm on replica {r} of [{labels}]", what(tied)),
                    &[norm],
                    &[norms[s]],
                    0.0,
                    1e-4,
                );
            }
        }
        let mut param_err = 0.0f32;
        for (r, replica) in dp.replicas().iter().enumerate() {
            let got = replica.executor().parameters().unwrap();
            param_err = param_err.max(assert_trained_alike(
                &format!("{} replica {r} on [{labels}]", what(tied)),
                &got,
                &want,
            ));
        }
        eprintln!("llama data parallel ({}) on [{labels}]: loss rel err {loss_err:.1e}, norm rel err {norm_err:.1e}, max |Δparam| {param_err:.1e}", what(tied));
    }
}

#[test]
fn llama_tensor_parallel_splits_kv_heads_with_their_query_heads() {
    let groups = open_groups(
        "llama_tensor_parallel_splits_kv_heads_with_their_query_heads",
        &[DeviceSelection::Count(2), DeviceSelection::Count(3)],
    );
    let [two, three] = &groups[..] else { return };
    let labels = two.labels().join(", ");
    for tied in [false, true] {
        let (losses, norms, want) = reference(&two.members()[0], tied);
        let mut tp = TensorParallel::new(two, &model(tied), CrossEntropyLoss, optimizer(), BATCH).unwrap();
        for layer in 0..2 {
            let held = |name: &str| rows_held(&tp, &format!("model.layers.{layer}.{name}.weight"));
            // A KV head each (4 of k's and v's 2 · 4 rows) and, in step, the
            // 2 query heads sharing it (8 of q's 4 · 4); o_proj reads those 8.
            assert_eq!(
                (
                    held("self_attn.q_proj"),
                    held("self_attn.k_proj"),
                    held("self_attn.v_proj")
                ),
                (vec![8, 8], vec![4, 4], vec![4, 4])
            );
            assert_eq!(
                columns_held(&tp, &format!("model.layers.{layer}.self_attn.o_proj.weight")),
                [8, 8]
            );
            // 11 of the 22 hidden units each: gate and up's rows, down's columns.
            assert_eq!(
                (held("mlp.gate_proj"), held("mlp.up_proj")),
                (vec![11, 11], vec![11, 11])
            );
            assert_eq!(
                columns_held(&tp, &format!("model.layers.{layer}.mlp.down_proj.weight")),
                [11, 11]
            );
        }
        // Norms and embeddings are replicated: no device holds a slice.
        for name in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.layers.1.input_layernorm.weight",
        ] {
            assert_eq!(tp.slices(name), [None, None], "{name}");
        }

        let (ids, targets) = &batches()[0];
        let mut fresh = Trainer::new(
            two.members()[0].clone(),
            &model(tied),
            CrossEntropyLoss,
            optimizer(),
            BATCH,
        )
        .unwrap();
        let before = fresh
            .evaluate_loss(Examples::Ids(ids), Targets::Classes(targets))
            .unwrap();
        let got = tp.evaluate_loss(ids.as_slice(), Targets::Classes(targets)).unwrap();
        // f32 sums in another order through 2 layers: a few ulps of 3.4.
        assert_close(
            &format!("{} loss before training", what(tied)),
            &[got],
            &[before],
            0.0,
            1e-5,
        );

        let (mut loss_err, mut norm_err) = (0.0f32, 0.0f32);
        for (s, (ids, targets)) in batches().iter().enumerate() {
            let loss = tp
                .step(ids.as_slice(), Targets::Classes(targets), true)
                .unwrap()
                .unwrap();
            let norm = tp.last_grad_norm().unwrap();
            loss_err = loss_err.max((loss - losses[s]).abs() / losses[s]);
            norm_err = norm_err.max((norm - norms[s]).abs() / norms[s]);
            // Partial sums over devices, then in f64: relative 1e-5 on the
            // loss and on the norm (a sum of squares over every gradient).
            assert_close(
                &format!("{} step {s} loss on [{labels}]", what(tied)),
                &[loss],
                &[losses[s]],
                0.0,
                1e-5,
            );
            assert_close(
                &format!("{} step {s} norm on [{labels}]", what(tied)),
                &[norm],
                &[norms[s]],
                0.0,
                1e-5,
            );
        }
        let param_err = assert_trained_alike(
            &format!("{} on [{labels}]", what(tied)),
            &tp.parameters().unwrap(),
            &want,
        );
        // The replicated table's copies (each device's lookup, and the
        // tied head on device 0) take the same summed step: the same bits.
        let copies = copies_held(tp.stages().map(|(_, stage)| stage), "model.embed_tokens.weight");
        assert_eq!(
            copies.len(),
            if tied { 3 } else { 2 },
            "{}: copies of the token table",
            what(tied)
        );
        assert!(
            copies.iter().all(|c| c == &copies[0]),
            "{}: the table's copies differ",
            what(tied)
        );
        eprintln!("llama tensor parallel ({}) on [{labels}]: loss rel err {loss_err:.1e}, norm rel err {norm_err:.1e}, max |Δparam| {param_err:.1e}", what(tied));
    }
    // Each device takes whole KV heads: 3 devices do not divide 2.
    let err = TensorParallel::new(three, &model(false), CrossEntropyLoss, optimizer(), BATCH)
        .err()
        .expect("3 devices, 2 KV heads")
        .to_string();
    assert!(err.contains("3 devices") && err.contains("2 KV heads"), "{err}");
    assert!(
        TensorParallel::check(&model(false), 3, BATCH).is_err(),
        "refused on the host too"
    );
}

#[test]
fn llama_pipeline_matches_single_device_training() {
    let groups = open_groups(
        "llama_pipeline_matches_single_device_training",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    for tied in [false, true] {
        let (losses, norms, want) = reference(&group.members()[0], tied);
        let micro = if tied { 4 } else { 2 };
        let mut trained = Vec::new();
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut p = Pipeline::new(
                group,
                &model(tied),
                CrossEntropyLoss,
                optimizer(),
                BATCH,
                micro,
                schedule,
            )
            .unwrap();
            let what = format!("{} {} on [{labels}]", what(tied), p.describe());
            // A layer per stage: the head (29 × 16) costs less than a layer.
            assert_eq!(p.blocks_per_stage(), [1, 1], "{what}");
            let (mut loss_err, mut norm_err) = (0.0f32, 0.0f32);
            for (s, (ids, targets)) in batches().iter().enumerate() {
                let loss = p
                    .step(ids.as_slice(), Targets::Classes(targets), true)
                    .unwrap()
                    .unwrap();
                let norm = p.stats().last_grad_norm.expect("a clipping optimizer reports the norm");
                loss_err = loss_err.max((loss - losses[s]).abs() / losses[s]);
                norm_err = norm_err.max((norm - norms[s]).abs() / norms[s]);
                // Per-micro-batch means weighted and summed (loss about
                // 3.4), per-stage sums of squares added (the tied table's
                // gradient counted once): relative 1e-5.
                assert_close(&format!("step {s} loss of {what}"), &[loss], &[losses[s]], 0.0, 1e-5);
                assert_close(&format!("step {s} norm of {what}"), &[norm], &[norms[s]], 0.0, 1e-5);
            }
            let got = p.parameters().unwrap();
            let param_err = assert_trained_alike(&what, &got, &want);
            let tables = copies_held(p.stages(), "model.embed_tokens.weight");
            // Tied, the first stage's lookup and the last stage's head hold
            // the table, take the same summed gradient and the same step.
            assert_eq!(
                tables.len(),
                if tied { 2 } else { 1 },
                "{what}: copies of the token table"
            );
            assert!(
                tables.iter().all(|t| t == &tables[0]),
                "{what}: the table's copies differ"
            );
            eprintln!("llama pipeline ({what}): loss rel err {loss_err:.1e}, norm rel err {norm_err:.1e}, max |Δparam| {param_err:.1e}");
            trained.push(
                got.into_iter()
                    .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
            );
        }
        // Both schedules run the same passes in the same micro-batch order.
        assert_eq!(trained[0], trained[1], "{}: GPipe and 1F1B", what(tied));
    }
}

/// The stage costs a partitioner evens out: SmolLM2-135M's 30 layers over
/// 4 stages, its tied head (576 × 49152) worth about two layers of its
/// 8192 positions, so the last stage takes fewer.
#[test]
fn llama_stage_costs_balance_layers_against_the_head() {
    let smol = LlamaConfig::smollm2_135m();
    let costs = smol.stage_costs(smol.n_layer);
    assert_eq!(costs.blocks.len(), 30);
    let split = partition(&costs, 4).unwrap();
    assert_eq!(split.iter().sum::<usize>(), 30, "{split:?}");
    assert!(split[3] < split[0], "{split:?}");
    // A model's costs are its config's over its layers.
    assert_eq!(model(false).stage_costs(), config(false).stage_costs(2));
    // A whole model names its parameters from the root.
    let mut g = wgrad::graph::Graph::new();
    let idx = g.ids("idx", &[1, T]).unwrap();
    let err = wgrad::nn::Module::forward(&model(true), &mut g, idx, "inner.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("inner."), "{err}");
}
