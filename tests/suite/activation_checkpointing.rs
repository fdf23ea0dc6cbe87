//! Activation checkpointing (`PlanOptions::checkpoint_activations` with
//! `Trainer::with_blocks`): each block's forward recomputed before its
//! backward trains as the plain graph does, and the plan holds less.

use crate::common;

use std::sync::Arc;

use common::assert_close;
use wgrad::graph::{PlanOptions, Precision};
use wgrad::io::text::{random_windows, CharTokenizer};
use wgrad::models::{Gpt, GptConfig, Llama, LlamaConfig};
use wgrad::nn::{self, CrossEntropyLoss, Staged};
use wgrad::optim::{AdamW, LossScaling};
use wgrad::Kernels;
use wgrad::{Targets, Trainer};

const PANGRAM: &str = "the quick brown fox, jumps over the lazy dog. ";

/// `model` trained 4 steps (clipped AdamW) on the pangram, planned with
/// `options`: the trainer and each step's loss.
fn train(k: &Arc<Kernels>, model: &dyn Staged, options: PlanOptions) -> wgrad::Result<(Trainer, Vec<f32>)> {
    let tokenizer = CharTokenizer::from_text(PANGRAM)?;
    let tokens = tokenizer.encode(&PANGRAM.repeat(20))?;
    let mut rng = common::rng(5);
    let mut optimizer = AdamW::new(1e-2)
        .betas(0.9, 0.95)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(1.0);
    if options.precision == Precision::F16 {
        optimizer = optimizer.loss_scaling(LossScaling::default());
    }
    let mut t = Trainer::with_blocks(k.clone(), model, CrossEntropyLoss, optimizer, 3, options)?;
    let mut losses = Vec::new();
    for _ in 0..4 {
        let (x, y) = random_windows(&tokens, 3, 11, &mut rng)?;
        t.zero_grad();
        t.forward_ids(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        losses.push(t.step_reading_loss()?);
    }
    Ok((t, losses))
}

/// Checkpointed against plain: the recomputed values are the forward's
/// (same kernels on the same inputs), but the plan may fuse the copies
/// differently, so parameters agree to a few f32 ulps of accumulated
/// difference after 4 steps; losses too.
fn same_training(k: &Arc<Kernels>, what: &str, model: &dyn Staged) -> wgrad::Result<()> {
    let (plain, want) = train(k, model, PlanOptions::default())?;
    let (checkpointed, got) = train(
        k,
        model,
        PlanOptions {
            checkpoint_activations: true,
            ..PlanOptions::default()
        },
    )?;
    assert_close(&format!("{what}: losses"), &got, &want, 1e-6, 1e-5);
    for ((name, _, g), (_, _, w)) in checkpointed
        .executor()
        .parameters()?
        .iter()
        .zip(&plain.executor().parameters()?)
    {
        assert_close(&format!("{what}: {name}"), g, w, 1e-6, 1e-4);
    }
    let (held, held_plain) = (
        checkpointed.executor().plan().held_activation_bytes,
        plain.executor().plan().held_activation_bytes,
    );
    assert!(
        held < held_plain / 2,
        "{what}: checkpointing holds {held} B of activations, the plain step {held_plain} B"
    );
    assert!(
        checkpointed.executor().plan().slot_bytes < plain.executor().plan().slot_bytes,
        "{what}: planned intermediates"
    );
    Ok(())
}

#[test]
fn a_checkpointed_gpt_trains_as_the_plain_one() {
    common::for_each_adapter("activation_checkpointing::gpt", |k| {
        nn::manual_seed(3);
        let gpt = Gpt::new(GptConfig {
            vocab_size: 29,
            block_size: 11,
            n_layer: 3,
            n_head: 2,
            n_embd: 16,
        })?;
        same_training(k, "gpt", &gpt)
    });
}

#[test]
fn a_checkpointed_llama_trains_as_the_plain_one() {
    common::for_each_adapter("activation_checkpointing::llama", |k| {
        nn::manual_seed(4);
        let config = LlamaConfig {
            vocab_size: 29,
            block_size: 11,
            n_layer: 2,
            n_head: 3,
            n_kv_head: 1,
            n_embd: 24,
            intermediate_size: 40,
            ..LlamaConfig::small(29)
        };
        let llama = Llama::new(config)?;
        same_training(k, "llama", &llama)
    });
}

/// Both passes at once: the blocks' boundaries, all the backward then
/// holds, are stored in f16.
#[test]
fn checkpointing_and_f16_together_follow_f32() {
    common::for_each_adapter("activation_checkpointing::with_f16", |k| {
        if !k.supports_f16() {
            eprintln!(
                "activation_checkpointing::with_f16: {} has no SHADER_F16, skipped there",
                k.device().label()
            );
            return Ok(());
        }
        nn::manual_seed(3);
        let gpt = Gpt::new(GptConfig {
            vocab_size: 29,
            block_size: 11,
            n_layer: 3,
            n_head: 2,
            n_embd: 16,
        })?;
        let (_, want) = train(k, &gpt, PlanOptions::default())?;
        let (both, got) = train(
            k,
            &gpt,
            PlanOptions {
                checkpoint_activations: true,
                precision: Precision::F16,
                ..PlanOptions::default()
            },
        )?;
        // f16 boundaries: the recomputed blocks start from f16-rounded
        // inputs, so the losses drift by f16's rounding (measured: 8e-6).
        let drift = got
            .iter()
            .zip(&want)
            .map(|(g, w)| ((g - w) / w).abs())
            .fold(0.0f32, f32::max);
        eprintln!("checkpointed f16 against f32: largest relative loss difference {drift:.2e}");
        assert_close("checkpointed f16 losses", &got, &want, 0.0, 5e-3);
        assert_eq!(both.precision(), Precision::F16);
        Ok(())
    });
}
