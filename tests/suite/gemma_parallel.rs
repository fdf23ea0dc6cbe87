//! Gemma 3 (norms before and after each branch, q/k norms, a GELU gate,
//! a local and a global layer, heads of 6 channels over 16 / 4, a tied
//! head) trained under each parallel strategy by what its modules
//! declare, against single-device training on the same batches, as
//! qwen_parallel.rs checks Qwen (the Llama's sizes, batches and clipped
//! AdamW): data parallel (rows 1 + 3), tensor parallel (a KV head each
//! with its 2 query heads; every norm replicated, the post-norms reading
//! the whole branch all-reduced beside the stream), pipeline parallel (2
//! stages, 1F1B) and ZeRO stages 1–3 on 2 and 3 devices.

use crate::common;
use crate::llama_parallel::{batches, config, optimizer, CLIP};
use crate::parallel::open_groups;
use crate::zero::{stages_match_one_device, two_and_three, Case};

use common::{assert_close, assert_same_parameters, rows_held, train_on_one_device, Parameters};
use wgrad::models::{Gemma, GemmaConfig};
use wgrad::nn::{self, CrossEntropyLoss};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{Pipeline, Schedule};
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::DeviceSelection;
use wgrad::Targets;

const BATCH: usize = 4;
const HEAD_DIM: usize = 6;

fn gemma() -> Gemma {
    gemma_with(config(true).n_kv_head, config(true).block_size)
}

/// The test's Gemma 3 with `n_kv_head` KV heads and local layers attending
/// over `window` positions.
fn gemma_with(n_kv_head: usize, window: usize) -> Gemma {
    let llama = config(true);
    nn::manual_seed(19);
    let mut model = Gemma::new(GemmaConfig {
        vocab_size: llama.vocab_size,
        block_size: llama.block_size,
        n_layer: 2,
        n_head: llama.n_head,
        n_kv_head,
        n_embd: llama.n_embd,
        head_dim: HEAD_DIM,
        intermediate_size: llama.intermediate_size,
        rope_theta: 1_000_000.0,
        rope_local_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        query_pre_attn_scalar: 5.0,
        sliding_window: window,
        sliding_window_pattern: 2,
    })
    .unwrap();
    // Norms off their zero init, so a norm read on the wrong rows shows.
    for layer in &mut model.layers {
        for (i, w) in layer.post_attention_layernorm.weight.iter_mut().enumerate() {
            *w = 0.1 * ((i % 5) as f32 - 2.0);
        }
    }
    model
}

/// Ten steps of `engine` against one device's losses (relative 1e-5) and
/// parameters (1e-5 + 1e-4·|p|), as for Qwen.
fn matches_one_device(what: &str, engine: &mut dyn TrainEngine, losses: &[f32], want: &Parameters) {
    let mut loss_err = 0.0f32;
    for (s, (ids, targets)) in batches().iter().enumerate() {
        let loss = engine
            .step(ids.as_slice().into(), Targets::Classes(targets), true)
            .unwrap()
            .unwrap();
        loss_err = loss_err.max((loss - losses[s]).abs() / losses[s]);
        assert_close(&format!("{what} step {s} loss"), &[loss], &[losses[s]], 0.0, 1e-5);
    }
    let param_err = assert_same_parameters(what, &engine.parameters().unwrap(), want, 1e-5, 1e-4);
    eprintln!("{what}: loss rel err {loss_err:.1e}, max |Δparam| {param_err:.1e}");
}

#[test]
fn gemma_data_tensor_and_pipeline_parallel_match_single_device_training() {
    let groups = open_groups(
        "gemma_data_tensor_and_pipeline_parallel_match_single_device_training",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    let model = gemma();
    let (trainer, losses, norms) = train_on_one_device(&group.members()[0], &model, optimizer(), BATCH, &batches());
    assert!(
        norms.iter().all(|&n| n > CLIP),
        "every step clips: norms {norms:?} against {CLIP}"
    );
    let want = trainer.executor().parameters().unwrap();

    let mut dp = DataParallel::new(
        group,
        &model,
        CrossEntropyLoss,
        optimizer(),
        BATCH,
        Split::Rows(vec![1, 3]),
    )
    .unwrap();
    matches_one_device(&format!("Gemma 3 data parallel on [{labels}]"), &mut dp, &losses, &want);

    let mut tp = TensorParallel::new(group, &model, CrossEntropyLoss, optimizer(), BATCH).unwrap();
    for layer in 0..2 {
        let name = |module: &str| format!("model.layers.{layer}.{module}.weight");
        assert_eq!(
            (
                rows_held(&tp, &name("self_attn.q_proj")),
                rows_held(&tp, &name("self_attn.k_proj"))
            ),
            (vec![2 * HEAD_DIM, 2 * HEAD_DIM], vec![HEAD_DIM, HEAD_DIM])
        );
        for norm in [
            "self_attn.q_norm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ] {
            assert_eq!(tp.slices(&name(norm)), [None, None], "{norm} replicated");
        }
    }
    matches_one_device(
        &format!("Gemma 3 tensor parallel on [{labels}]"),
        &mut tp,
        &losses,
        &want,
    );

    let mut p = Pipeline::new(
        group,
        &model,
        CrossEntropyLoss,
        optimizer(),
        BATCH,
        2,
        Schedule::OneFOneB,
    )
    .unwrap();
    assert_eq!(p.blocks_per_stage(), [1, 1]);
    matches_one_device(&format!("Gemma 3 pipeline on [{labels}]"), &mut p, &losses, &want);
}

#[test]
fn zero_stages_train_gemma_as_one_device() {
    let groups = two_and_three("zero_stages_train_gemma_as_one_device");
    let model = gemma();
    let case = Case {
        what: "Gemma 3",
        model: &model,
        optimizer: optimizer(),
        clip: CLIP,
        batches: batches(),
    };
    stages_match_one_device(&groups, &case);
}

/// Gemma 3 270M's attention: one KV head for all four query heads
/// (multi-query), the local layer attending over 3 of the 8 positions.
/// Tensor parallel holds k and v whole on each device (their gradients
/// summed over the devices, as a norm's) and splits the query heads; it
/// refused 2 devices before ("must divide the 1 KV heads").
#[test]
fn gemma_with_one_kv_head_and_a_window_trains_as_one_device_under_tensor_parallel() {
    let groups = open_groups(
        "gemma_with_one_kv_head_and_a_window_trains_as_one_device_under_tensor_parallel",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    let model = gemma_with(1, 3);
    let (trainer, losses, _) = train_on_one_device(&group.members()[0], &model, optimizer(), BATCH, &batches());
    let want = trainer.executor().parameters().unwrap();
    let mut tp = TensorParallel::new(group, &model, CrossEntropyLoss, optimizer(), BATCH).unwrap();
    for layer in 0..2 {
        let name = |module: &str| format!("model.layers.{layer}.{module}.weight");
        assert_eq!(
            rows_held(&tp, &name("self_attn.q_proj")),
            vec![2 * HEAD_DIM, 2 * HEAD_DIM]
        );
        for replicated in ["self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm"] {
            assert_eq!(tp.slices(&name(replicated)), [None, None], "{replicated} replicated");
        }
    }
    matches_one_device(
        &format!("Gemma 3, one KV head, window 3: tensor parallel on [{labels}]"),
        &mut tp,
        &losses,
        &want,
    );
}
