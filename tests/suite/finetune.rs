//! Fine-tuning a pretrained model (`wgrad train --init`): a GGUF Llama
//! with its own tokenizer learns, its saved Hugging Face folder loads back
//! with equal logits, and training with the tied token table, the logits
//! and the arenas each over one storage binding (limits lowered by
//! `Kernels::with_limits`) equals training without, to rounding.

use std::sync::Arc;

use crate::common::{assert_close, for_each_adapter, limited_kernels};
use crate::gpt_folder::{fixture, TempDir};

use wgrad::infer::Predictor;
use wgrad::kernels::LimitOverrides;
use wgrad::models::{Gpt, Llama};
use wgrad::nn::{CausalLm, Module};
use wgrad::train::{AdamWSchedule, LanguageModel, Pretrained, TextSource, TrainConfig, TrainableLm, TrainingRun};
use wgrad::{Error, Kernels};

/// The tied Llama of scripts/gguf_reference.py: 271 tokens of byte-level
/// BPE, 64 channels, context 32.
const TIED: &str = "gguf-llama-tied.gguf";

fn text() -> String {
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. ".repeat(40)
}

fn config(steps: u64, batch_size: usize) -> TrainConfig {
    let schedule = AdamWSchedule {
        lr: 3e-3,
        min_lr: 3e-3,
        warmup_steps: 0,
        ..AdamWSchedule::default()
    };
    TrainConfig {
        batch_size,
        max_steps: Some(steps),
        optimizer: schedule.optimizer(steps),
        eval_every: steps,
        loss_every: 1,
        ..TrainConfig::default()
    }
}

fn fine_tune(pretrained: &Pretrained<Llama>, window: usize) -> LanguageModel<Llama> {
    LanguageModel {
        text: TextSource::Text(text()),
        eval_batches: 2,
        init: Some(pretrained.clone()),
        ..LanguageModel::new(Llama::with_context(pretrained.model.config(), window))
    }
}

/// `model`'s logits on `ids` (one sequence of the model's context).
fn logits(k: &Arc<Kernels>, model: &dyn Module, ids: &[u32]) -> wgrad::Result<Vec<f32>> {
    Predictor::new(k.clone(), model, 1)?.outputs_ids(ids)
}

#[test]
fn a_fine_tuned_gguf_llama_learns_and_its_folder_loads_back_with_equal_logits() {
    for_each_adapter("fine-tune a GGUF Llama", |k| {
        let pretrained = Pretrained::<Llama>::load(&fixture(TIED))?;
        let mut run = TrainingRun::with_kernels(k.clone(), config(12, 4), fine_tune(&pretrained, 16), &mut ())?;
        let before = run.validation_loss()?.expect("a validation loss");
        let summary = run.fit(&mut ())?.expect("rank 0");
        let after = summary.validation_curve.last().expect("validated at the end").1;
        assert!(after < before - 0.5, "held-out loss {before} -> {after}");

        let tmp = TempDir::new("finetune");
        let out = tmp.path("tuned");
        run.save(&out)?;
        let mut files: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json",
                "wgrad_tokenizer.json"
            ]
        );

        // The folder with its tokenizer.json: the same ids as the GGUF
        // file's tokenizer, the full context, and the trained logits.
        let trained = run.task().trained_model(run.engine(), run.model())?;
        assert_eq!(trained.context_len(), pretrained.model.context_len());
        let loaded = Pretrained::<Llama>::load(&out)?;
        assert_eq!(loaded.model.context_len(), pretrained.model.context_len());
        let sample = &text()[..200];
        let ids = pretrained.tokenizer.encode(sample)?;
        assert_eq!(loaded.tokenizer.encode(sample)?, ids);
        let window = &ids[..16];
        let want = logits(
            k,
            &Pretrained {
                model: trained,
                ..pretrained.clone()
            }
            .cropped(16)?,
            window,
        )?;
        let got = logits(k, &loaded.cropped(16)?, window)?;
        // The folder holds q and k in Hugging Face's half-split rows, so the
        // scores sum the same products in another order: f32 rounding only.
        assert_close("reloaded logits", &got, &want, 1e-4, 1e-4);
        Ok(())
    });
}

/// Bytes per binding in the split test: the token table (271 × 64 floats,
/// 69 KB), the logits of 4 × 16 rows (69 KB) and every arena are over it;
/// the blocks' weights and activations (24 KB at most) fit.
const TABLE_OVER_BINDING: u64 = 32 * 1024;

#[test]
fn fine_tuning_with_the_token_table_over_a_binding_matches_fine_tuning_without() {
    for_each_adapter("fine-tune over a lowered binding limit", |k| {
        let pretrained = Pretrained::<Llama>::load(&fixture(TIED))?;
        let table_bytes = (pretrained.model.vocab_size() * 64 * 4) as u64;
        assert!(table_bytes > TABLE_OVER_BINDING);
        let lim = limited_kernels(
            k,
            LimitOverrides {
                max_storage_buffer_binding_size: Some(TABLE_OVER_BINDING),
                ..LimitOverrides::default()
            },
        );
        let train = |k: &Arc<Kernels>| -> wgrad::Result<(Vec<(u64, f32)>, Vec<(String, Vec<usize>, Vec<f32>)>)> {
            let mut run = TrainingRun::with_kernels(k.clone(), config(3, 4), fine_tune(&pretrained, 16), &mut ())?;
            let summary = run.fit(&mut ())?.expect("rank 0");
            Ok((summary.train_curve, run.engine().parameters()?))
        };
        let (split_losses, split) = train(&lim)?;
        let (whole_losses, whole) = train(k)?;
        // The first step's loss is the same sums in the same order: equal.
        assert_eq!(split_losses[0], whole_losses[0], "first loss");
        let (s, w): (Vec<f32>, Vec<f32>) = split_losses.iter().zip(&whole_losses).map(|(s, w)| (s.1, w.1)).unzip();
        assert_close("losses", &s, &w, 1e-5, 1e-5);
        for ((name, _, s), (_, _, w)) in split.iter().zip(&whole) {
            // The head's gradients (dlogits·wte, dlogitsᵀ·x) sum the
            // vocabulary in parts when it is over the binding, each part
            // rounded once more; three AdamW steps of 3e-3 keep that within
            // rounding of the parameters.
            assert_close(name, s, w, 2e-5, 1e-4);
        }
        Ok(())
    });
}

#[test]
fn fine_tuning_refuses_what_it_cannot_train() {
    // Another family's file, a missing file, a file without a tokenizer.
    let err = Pretrained::<Gpt>::load(&fixture(TIED)).expect_err("a Llama as a GPT");
    assert!(err.to_string().contains("llama"), "{err}");
    let err = Pretrained::<Llama>::load(&fixture("missing.gguf")).expect_err("a missing file");
    assert!(err.to_string().contains("does not exist"), "{err}");
    let err = Pretrained::<Llama>::load(&fixture("hf-tiny-llama")).expect_err("a folder without a tokenizer");
    assert!(err.to_string().contains("no tokenizer"), "{err}");
    // Windows longer than the context; too little text for a batch.
    for_each_adapter("fine-tune refusals", |k| {
        let pretrained = Pretrained::<Llama>::load(&fixture(TIED))?;
        let context = pretrained.model.context_len();
        let long = TrainingRun::with_kernels(k.clone(), config(2, 2), fine_tune(&pretrained, context + 1), &mut ())
            .err()
            .expect("windows over the context");
        assert!(long.to_string().contains("context"), "{long}");
        let short = LanguageModel {
            text: TextSource::Text("Shall I compare thee".into()),
            ..fine_tune(&pretrained, 16)
        };
        let err = TrainingRun::with_kernels(k.clone(), config(2, 2), short, &mut ())
            .err()
            .expect("too little text");
        assert!(
            matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("tokens"),
            "{err}"
        );
        Ok(())
    });
}
