//! `wgrad::train`: a whole run through the library (what `wgrad train`
//! calls), its progress reports, its checkpoint and resuming from it; the
//! data sharing and the refusals that need no device.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use wgrad::optim::SGD;
use wgrad::parallel::distributed::{ProcessGroup, SingleProcess};
use wgrad::parallel::engine::Strategy;
use wgrad::train::{self, Classifier, Evaluation, Progress, RunInfo, TrainConfig};
use wgrad::{DeviceOptions, Error};

/// Every report, in order, as text.
#[derive(Default)]
struct Recorder {
    events: Vec<String>,
    info: Option<RunInfo>,
}

impl Progress for Recorder {
    fn preparing(&mut self) {
        self.events.push("preparing".into());
    }
    fn started(&mut self, info: &RunInfo) {
        self.events.push("started".into());
        self.info = Some(info.clone());
    }
    fn loss(&mut self, step: u64, loss: f32, samples_per_s: f64) {
        assert!(loss.is_finite() && loss > 0.0, "loss {loss} at step {step}");
        assert!(samples_per_s > 0.0, "{samples_per_s} samples/s at step {step}");
        self.events.push(format!("loss {step}"));
    }
    fn rebalanced(&mut self, step: u64, _engine: &str) {
        self.events.push(format!("rebalanced {step}"));
    }
    fn step(&mut self, step: u64) {
        self.events.push(format!("step {step}"));
    }
    fn trained(&mut self) {
        self.events.push("trained".into());
    }
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-training-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small digits MLP: SGD, batch 32, the loss read every 5 steps.
fn config(steps: u64, checkpoint: PathBuf) -> TrainConfig {
    TrainConfig {
        optimizer: SGD::new(0.05).into(),
        seed: 3,
        loss_every: 5,
        max_steps: Some(steps),
        save: Some(checkpoint),
        ..TrainConfig::default()
    }
}

fn task() -> Classifier {
    Classifier {
        hidden: vec![16],
        ..Classifier::default()
    }
}

/// 12 steps reporting in order (loss at 5, 10 and the last step), a
/// checkpoint that says what it is, and 3 more steps resumed from it that
/// continue its step count.
#[test]
fn a_run_reports_progress_writes_its_checkpoint_and_resumes() {
    let reports = common::reports();
    if reports.is_empty() {
        common::no_adapter("a_run_reports_progress_writes_its_checkpoint_and_resumes");
        return;
    }
    for report in reports {
        let opts = DeviceOptions {
            backends: None,
            adapter: Some(report.index.to_string()),
            ..Default::default()
        };
        let dir = out_dir(&format!("adapter{}", report.index));
        let first = dir.join("first.safetensors");
        let mut rec = Recorder::default();
        let summary = train::train(&opts, config(12, first.clone()), task(), None, &mut rec)
            .unwrap()
            .expect("rank 0 has a summary");

        let mut want = vec!["preparing".to_string(), "started".to_string()];
        for s in 1..=12u64 {
            if s % 5 == 0 || s == 12 {
                want.push(format!("loss {s}"));
            }
            want.push(format!("step {s}"));
        }
        want.push("trained".into());
        assert_eq!(rec.events, want, "{}", report.info.name);
        let info = rec.info.take().unwrap();
        assert_eq!((info.steps, info.batch_size), (12, 32));
        assert!(
            info.data.starts_with("digits, ") && info.data.contains("train /"),
            "{}",
            info.data
        );
        assert!(info.resumed_from.is_none() && info.footprint.intermediates.is_some());
        assert_eq!(summary.steps, 12);
        assert_eq!(
            summary.train_curve.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![5, 10, 12]
        );
        let Evaluation::Accuracy { train, test } = summary.evaluation else {
            panic!("a classifier's run ended with {:?}", summary.evaluation)
        };
        assert!((0.0..=1.0).contains(&test) && (0.0..=1.0).contains(&train));
        assert_eq!(summary.saved.as_deref(), Some(first.as_path()));

        let ckpt = wgrad::io::checkpoint::load(&first).unwrap();
        assert_eq!(ckpt.meta("step"), Some("12"));
        assert_eq!(ckpt.meta("data"), Some("digits"));
        assert_eq!(ckpt.meta("split_seed"), Some("3"));
        assert_eq!(ckpt.meta("test_accuracy"), Some(format!("{test:.6}").as_str()));

        let second = dir.join("second.safetensors");
        let mut resumed = config(3, second.clone());
        resumed.resume = Some(first.clone());
        let mut rec = Recorder::default();
        train::train(&opts, resumed, task(), None, &mut rec).unwrap().unwrap();
        assert_eq!(rec.info.unwrap().resumed_from.as_deref(), Some(first.as_path()));
        assert_eq!(wgrad::io::checkpoint::load(&second).unwrap().meta("step"), Some("15"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Across processes the run is data parallel; anything else is refused
/// before a device opens.
#[test]
fn across_processes_only_data_parallel_is_accepted() {
    let group: Arc<dyn ProcessGroup> = Arc::new(SingleProcess);
    let mut cfg = config(1, out_dir("refused").join("never.safetensors"));
    cfg.strategy = Some(Strategy::Tensor);
    let err = train::train(&DeviceOptions::default(), cfg.clone(), task(), Some(group), &mut ())
        .expect_err("tensor parallel across processes");
    assert!(
        matches!(
            &err,
            Error::InvalidArgument {
                op: "train --distributed",
                ..
            }
        ),
        "{err}"
    );
    assert!(!cfg.save.unwrap().exists());
}

/// With one process, sharing the data hands back what rank 0 loaded.
#[test]
fn shared_data_is_rank_zeros() {
    let loaded = train::load_data(None, 0.25, 7).unwrap();
    let shared = train::share_data(&SingleProcess, Some(loaded.clone())).unwrap();
    assert_eq!(shared.name, "digits");
    for (a, b) in [(&loaded.train, &shared.train), (&loaded.test, &shared.test)] {
        assert_eq!((a.features(), a.classes()), (b.features(), b.classes()));
        assert_eq!(a.x(), b.x());
        assert_eq!(a.labels(), b.labels());
    }
    // round(1797 · 0.25) test rows.
    assert_eq!((loaded.test.len(), loaded.train.len()), (449, 1348));
}
