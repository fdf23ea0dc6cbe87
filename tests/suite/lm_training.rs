//! `wgrad::lm_training`: the GPT run `wgrad train --model gpt` makes — the
//! validation windows, a short run that learns, and the refusals.

use crate::common;

use wgrad::lm_training::{validation_windows, LmProgress, LmRunInfo, LmTrainConfig, LmTrainingRun, TextSource};
use wgrad::Error;

#[test]
fn validation_windows_are_evenly_spaced_and_shifted_by_one() {
    let tokens: Vec<u32> = (0..50).collect();
    let (x, y) = validation_windows(&tokens, 4, 5).expect("room for 4 windows");
    // stride = (50 - 5 - 1) / 4 = 11
    assert_eq!(&x[..5], &[0, 1, 2, 3, 4]);
    assert_eq!(&x[5..10], &[11, 12, 13, 14, 15]);
    assert_eq!(&x[15..], &[33, 34, 35, 36, 37]);
    assert_eq!(&y[15..], &[34, 35, 36, 37, 38]);
    assert!(matches!(validation_windows(&tokens, 45, 5), Err(Error::InvalidArgument { .. })));
    assert!(matches!(validation_windows(&tokens[..5], 1, 5), Err(Error::InvalidArgument { .. })));
}

#[derive(Default)]
struct Recorder {
    losses: Vec<f32>,
    validations: Vec<(u64, f32)>,
    info: Option<LmRunInfo>,
}

impl LmProgress for Recorder {
    fn started(&mut self, info: &LmRunInfo) {
        self.info = Some(info.clone());
    }
    fn loss(&mut self, _step: u64, loss: f32, tokens_per_s: f64) {
        assert!(tokens_per_s > 0.0);
        self.losses.push(loss);
    }
    fn validation(&mut self, step: u64, loss: f32) {
        self.validations.push((step, loss));
    }
}

/// A text with structure a tiny model learns in a few dozen steps.
fn patterned_text() -> String {
    "the cat sat on the mat. ".repeat(400)
}

fn tiny_config() -> LmTrainConfig {
    LmTrainConfig {
        text: TextSource::Text(patterned_text()),
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        block_size: 16,
        batch_size: 4,
        max_steps: 40,
        lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 4,
        eval_every: 20,
        eval_batches: 2,
        loss_every: 5,
        ..LmTrainConfig::default()
    }
}

#[test]
fn a_short_run_learns_and_reports_validation_losses() {
    common::for_each_adapter("lm_training::a_short_run_learns", |k| {
        let mut progress = Recorder::default();
        let mut run = LmTrainingRun::with_kernels(k.clone(), tiny_config(), &mut progress)?;
        let before = run.validation_loss()?;
        let summary = run.fit(&mut progress)?;
        let info = progress.info.as_ref().expect("started was reported");
        // "the cat sat on the mat. " has 11 distinct characters.
        assert_eq!(info.vocab_size, 11);
        assert_eq!(progress.validations.iter().map(|v| v.0).collect::<Vec<_>>(), vec![20, 40]);
        assert_eq!(summary.validation_curve, progress.validations);
        assert_eq!(summary.train_curve.len(), 8);
        // Uniform guessing is ln 11 = 2.40; the text is nearly periodic.
        assert!(before > 2.0, "untrained validation loss {before}");
        assert!(summary.final_validation_loss < 1.0, "validation loss {} after 40 steps", summary.final_validation_loss);
        assert_eq!(run.validation_loss()?, summary.final_validation_loss, "the validation loss is deterministic");
        Ok(())
    });
}

#[test]
fn bad_settings_are_refused_before_any_work() {
    common::for_each_adapter("lm_training::bad_settings", |k| {
        let refused = |config: LmTrainConfig| matches!(LmTrainingRun::with_kernels(k.clone(), config, &mut ()), Err(Error::InvalidArgument { .. }));
        assert!(refused(LmTrainConfig { max_steps: 0, ..tiny_config() }));
        assert!(refused(LmTrainConfig { eval_batches: 0, ..tiny_config() }));
        assert!(refused(LmTrainConfig { n_head: 3, ..tiny_config() }), "16 channels do not split into 3 heads");
        assert!(refused(LmTrainConfig { text: TextSource::Text("too short".into()), ..tiny_config() }));
        Ok(())
    });
}

/// A run saved half way and resumed from its folder ends where an
/// uninterrupted run ends: parameters, optimizer state, schedule and
/// training windows all continue.
#[test]
fn a_resumed_run_equals_an_uninterrupted_one() {
    common::for_each_adapter("lm_training::a_resumed_run", |k| {
        let dir = std::env::temp_dir().join(format!("wgrad-lm-resume-{}-{}", std::process::id(), k.device().is_gl()));
        let config = LmTrainConfig { max_steps: 10, eval_every: 10, ..tiny_config() };
        let mut whole = LmTrainingRun::with_kernels(k.clone(), config.clone(), &mut ())?;
        whole.fit(&mut ())?;

        let mut first = LmTrainingRun::with_kernels(k.clone(), LmTrainConfig { max_steps: 4, ..config.clone() }, &mut ())?;
        first.fit(&mut ())?;
        first.save(&dir)?;
        let mut second = LmTrainingRun::with_kernels(k.clone(), LmTrainConfig { resume: Some(dir.clone()), ..config.clone() }, &mut ())?;
        assert_eq!(second.info().first_step, 5);
        let summary = second.fit(&mut ())?;
        assert_eq!(summary.steps, 6);
        let (a, b) = (whole.trained_model()?, second.trained_model()?);
        assert!(a == b, "the resumed run's parameters differ from the uninterrupted run's");

        // A folder of another size is refused, naming both.
        let other = LmTrainConfig { n_embd: 24, n_head: 2, resume: Some(dir.clone()), ..config };
        match LmTrainingRun::with_kernels(k.clone(), other, &mut ()) {
            Err(Error::InvalidArgument { reason, .. }) => assert!(reason.contains("n_embd: 16") && reason.contains("n_embd: 24"), "{reason}"),
            Err(e) => panic!("expected a refusal naming the sizes, got {e}"),
            Ok(_) => panic!("a folder of another size was accepted"),
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    });
}
