//! Qwen2 (q/k/v biases), Qwen3 (q/k norms, heads of 6 channels over
//! 16 / 4) and Mistral (attention over a sliding window of 3 positions)
//! trained under each parallel strategy by what their modules
//! declare, against single-device training on the same batches, as
//! llama_parallel.rs checks the Llama (its sizes, batches and clipped
//! AdamW): data parallel (rows 1 + 3), tensor parallel (a KV head each
//! with its 2 query heads: the biases split with their rows, the q/k norm
//! weights replicated, their gradients summed over the devices), pipeline
//! parallel (2 stages, 1F1B) and ZeRO stages 1–3 on 2 and 3 devices.

use crate::common;
use crate::llama_parallel::{batches, config, optimizer, CLIP};
use crate::parallel::open_groups;
use crate::zero::{stages_match_one_device, two_and_three, Case};

use common::{assert_close, assert_same_parameters, rows_held, train_on_one_device, Parameters};
use wgrad::models::{Llama, LlamaConfig, LlamaVariant};
use wgrad::nn::{self, CrossEntropyLoss};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{Pipeline, Schedule};
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::Targets;

const BATCH: usize = 4;

fn qwen(variant: LlamaVariant) -> Llama {
    let head_dim = (variant == LlamaVariant::Qwen3).then_some(6);
    // Mistral attends over 3 positions of the batches' 8.
    let sliding_window = (variant == LlamaVariant::Mistral).then_some(3);
    nn::manual_seed(17);
    Llama::new(LlamaConfig {
        variant,
        head_dim,
        sliding_window,
        ..config(false)
    })
    .unwrap()
}

const VARIANTS: [LlamaVariant; 3] = [LlamaVariant::Qwen2, LlamaVariant::Qwen3, LlamaVariant::Mistral];

/// Ten steps of `engine` against one device's losses (relative 1e-5: the
/// batch's or a layer's sums split over devices, as for the Llama) and
/// parameters (1e-5 + 1e-4·|p| after ten clipped Adam steps).
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

fn reference(group: &DeviceGroup, model: &Llama) -> (Vec<f32>, Parameters) {
    let (trainer, losses, norms) = train_on_one_device(&group.members()[0], model, optimizer(), BATCH, &batches());
    assert!(
        norms.iter().all(|&n| n > CLIP),
        "every step clips: norms {norms:?} against {CLIP}"
    );
    (losses, trainer.executor().parameters().unwrap())
}

#[test]
fn qwen_data_tensor_and_pipeline_parallel_match_single_device_training() {
    let groups = open_groups(
        "qwen_data_tensor_and_pipeline_parallel_match_single_device_training",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let labels = group.labels().join(", ");
    for variant in VARIANTS {
        let model = qwen(variant);
        let (losses, want) = reference(group, &model);

        let mut dp = DataParallel::new(
            group,
            &model,
            CrossEntropyLoss,
            optimizer(),
            BATCH,
            Split::Rows(vec![1, 3]),
        )
        .unwrap();
        matches_one_device(
            &format!("{variant:?} data parallel on [{labels}]"),
            &mut dp,
            &losses,
            &want,
        );

        let mut tp = TensorParallel::new(group, &model, CrossEntropyLoss, optimizer(), BATCH).unwrap();
        let d = model.config.head_dim();
        for layer in 0..2 {
            let name = |module: &str, suffix: &str| format!("model.layers.{layer}.self_attn.{module}.{suffix}");
            // A KV head each and its 2 query heads: the weights' rows and,
            // in Qwen2, the biases' with them.
            assert_eq!(
                (
                    rows_held(&tp, &name("q_proj", "weight")),
                    rows_held(&tp, &name("k_proj", "weight"))
                ),
                (vec![2 * d, 2 * d], vec![d, d])
            );
            if variant == LlamaVariant::Qwen2 {
                assert_eq!(
                    (
                        rows_held(&tp, &name("q_proj", "bias")),
                        rows_held(&tp, &name("v_proj", "bias"))
                    ),
                    (vec![2 * d, 2 * d], vec![d, d])
                );
            } else if variant == LlamaVariant::Qwen3 {
                // One norm weight serves every head: replicated.
                assert_eq!(tp.slices(&name("q_norm", "weight")), [None, None]);
                assert_eq!(tp.slices(&name("k_norm", "weight")), [None, None]);
            }
        }
        matches_one_device(
            &format!("{variant:?} tensor parallel on [{labels}]"),
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
        matches_one_device(&format!("{variant:?} pipeline on [{labels}]"), &mut p, &losses, &want);
    }
}

#[test]
fn zero_stages_train_qwen_as_one_device() {
    let groups = two_and_three("zero_stages_train_qwen_as_one_device");
    for variant in VARIANTS {
        let model = qwen(variant);
        let what = format!("{variant:?}");
        let case = Case {
            what: &what,
            model: &model,
            optimizer: optimizer(),
            clip: CLIP,
            batches: batches(),
        };
        stages_match_one_device(&groups, &case);
    }
}
