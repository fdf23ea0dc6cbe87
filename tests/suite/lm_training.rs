//! `wgrad::train`: the GPT run `wgrad train --model gpt` makes — the
//! validation windows, a short run that learns, and the refusals.

use crate::common;

use wgrad::models::{Gpt, GptConfig};
use wgrad::train::{validation_windows, AdamWSchedule, LanguageModel, TextSource};
use wgrad::train::{Evaluation, Progress, RunInfo, TrainConfig, TrainingRun};
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
    assert!(matches!(
        validation_windows(&tokens, 45, 5),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        validation_windows(&tokens[..5], 1, 5),
        Err(Error::InvalidArgument { .. })
    ));
}

#[derive(Default)]
struct Recorder {
    losses: Vec<f32>,
    validations: Vec<(u64, f32)>,
    info: Option<RunInfo>,
}

impl Progress for Recorder {
    fn started(&mut self, info: &RunInfo) {
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

fn tiny_config() -> TrainConfig {
    let schedule = AdamWSchedule {
        lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 4,
        ..AdamWSchedule::default()
    };
    TrainConfig {
        batch_size: 4,
        max_steps: Some(40),
        optimizer: schedule.optimizer(40),
        eval_every: 20,
        loss_every: 5,
        ..TrainConfig::default()
    }
}

fn tiny_task(sizes: GptConfig) -> LanguageModel<Gpt> {
    LanguageModel {
        text: TextSource::Text(patterned_text()),
        eval_batches: 2,
        ..LanguageModel::new(sizes)
    }
}

const TINY: GptConfig = GptConfig {
    vocab_size: 0,
    n_layer: 1,
    n_head: 2,
    n_embd: 16,
    block_size: 16,
};

fn final_validation(evaluation: Evaluation) -> f32 {
    match evaluation {
        Evaluation::ValidationLoss(v) => v,
        other => panic!("a language model's run ended with {other:?}"),
    }
}

#[test]
fn a_short_run_learns_and_reports_validation_losses() {
    common::for_each_adapter("lm_training::a_short_run_learns", |k| {
        let mut progress = Recorder::default();
        let mut run = TrainingRun::with_kernels(k.clone(), tiny_config(), tiny_task(TINY), &mut progress)?;
        let before = run.validation_loss()?.expect("a language model has a validation loss");
        let summary = run.fit(&mut progress)?.expect("one process is rank 0");
        let info = progress.info.as_ref().expect("started was reported");
        // "the cat sat on the mat. " has 11 distinct characters.
        assert!(info.data.contains("vocabulary 11"), "{}", info.data);
        let final_validation_loss = final_validation(summary.evaluation);
        assert_eq!(
            progress.validations.iter().map(|v| v.0).collect::<Vec<_>>(),
            vec![20, 40]
        );
        assert_eq!(summary.validation_curve, progress.validations);
        assert_eq!(summary.train_curve.len(), 8);
        // Uniform guessing is ln 11 = 2.40; the text is nearly periodic.
        assert!(before > 2.0, "untrained validation loss {before}");
        assert!(
            final_validation_loss < 1.0,
            "validation loss {} after 40 steps",
            final_validation_loss
        );
        assert_eq!(
            run.validation_loss()?,
            Some(final_validation_loss),
            "the validation loss is deterministic"
        );
        Ok(())
    });
}

#[test]
fn bad_settings_are_refused_before_any_work() {
    common::for_each_adapter("lm_training::bad_settings", |k| {
        let refused = |config: TrainConfig, task: LanguageModel<Gpt>| {
            matches!(
                TrainingRun::with_kernels(k.clone(), config, task, &mut ()),
                Err(Error::InvalidArgument { .. })
            )
        };
        assert!(refused(
            TrainConfig {
                max_steps: Some(0),
                ..tiny_config()
            },
            tiny_task(TINY)
        ));
        assert!(refused(
            tiny_config(),
            LanguageModel {
                eval_batches: 0,
                ..tiny_task(TINY)
            }
        ));
        assert!(
            refused(tiny_config(), tiny_task(GptConfig { n_head: 3, ..TINY })),
            "16 channels do not split into 3 heads"
        );
        assert!(refused(
            tiny_config(),
            LanguageModel {
                text: TextSource::Text("too short".into()),
                ..tiny_task(TINY)
            }
        ));
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
        let config = TrainConfig {
            max_steps: Some(10),
            eval_every: 10,
            optimizer: AdamWSchedule {
                lr: 1e-2,
                min_lr: 1e-3,
                warmup_steps: 4,
                ..AdamWSchedule::default()
            }
            .optimizer(10),
            ..tiny_config()
        };
        let mut whole = TrainingRun::with_kernels(k.clone(), config.clone(), tiny_task(TINY), &mut ())?;
        whole.fit(&mut ())?;

        let mut first = TrainingRun::with_kernels(
            k.clone(),
            TrainConfig {
                max_steps: Some(4),
                ..config.clone()
            },
            tiny_task(TINY),
            &mut (),
        )?;
        first.fit(&mut ())?;
        first.save(&dir)?;
        let mut second = TrainingRun::with_kernels(
            k.clone(),
            TrainConfig {
                resume: Some(dir.clone()),
                ..config.clone()
            },
            tiny_task(TINY),
            &mut (),
        )?;
        assert_eq!(second.info().first_step, 5);
        let summary = second.fit(&mut ())?.expect("one process is rank 0");
        assert_eq!(summary.steps, 6);
        let trained = |run: &TrainingRun<LanguageModel<Gpt>>| run.task().trained_model(run.engine(), run.model());
        let (a, b) = (trained(&whole)?, trained(&second)?);
        assert!(
            a == b,
            "the resumed run's parameters differ from the uninterrupted run's"
        );

        // A folder of another size is refused, naming both.
        let other = tiny_task(GptConfig {
            n_embd: 24,
            n_head: 2,
            ..TINY
        });
        match TrainingRun::with_kernels(
            k.clone(),
            TrainConfig {
                resume: Some(dir.clone()),
                ..config
            },
            other,
            &mut (),
        ) {
            Err(Error::InvalidArgument { reason, .. }) => assert!(
                reason.contains("n_embd: 16") && reason.contains("n_embd: 24"),
                "{reason}"
            ),
            Err(e) => panic!("expected a refusal naming the sizes, got {e}"),
            Ok(_) => panic!("a folder of another size was accepted"),
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    });
}

/// A run stepped one awaited step at a time (as the browser page steps
/// it) gives what `fit` gives: every loss, the validation loss and the
/// trained parameters.
#[test]
fn stepping_a_run_through_its_async_forms_equals_fit() {
    common::for_each_adapter("lm_training::stepping_a_run_through_its_async_forms", |k| {
        let config = TrainConfig {
            max_steps: Some(6),
            eval_every: 6,
            loss_every: 1,
            ..tiny_config()
        };
        let mut fitted = TrainingRun::with_kernels(k.clone(), config.clone(), tiny_task(TINY), &mut ())?;
        let summary = fitted.fit(&mut ())?.expect("one process is rank 0");
        let mut stepped = TrainingRun::with_kernels(k.clone(), config, tiny_task(TINY), &mut ())?;
        let mut curve = Vec::new();
        for step in 1..=6 {
            let loss = wgrad::device::wait("step_async", stepped.step_async(true))?;
            curve.push((step, loss.expect("the loss was asked for")));
        }
        assert_eq!(curve, summary.train_curve);
        let validation = wgrad::device::wait("validation_loss_async", stepped.validation_loss_async())?;
        assert_eq!(validation, summary.validation_curve.last().map(|v| v.1));
        let trained = |run: &TrainingRun<LanguageModel<Gpt>>| run.task().trained_model(run.engine(), run.model());
        assert!(
            trained(&fitted)? == trained(&stepped)?,
            "the stepped run's parameters differ from fit's"
        );
        // The page samples from the parameters read back without blocking.
        let params = wgrad::device::wait("parameters_async", stepped.parameters_async())?;
        assert!(params == stepped.engine().parameters()?);
        assert!(stepped.task().model_with(stepped.model(), &params)? == trained(&stepped)?);
        Ok(())
    });
}
