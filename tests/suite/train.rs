//! Training sessions end to end: checkpoints resume bit-identically, a
//! forward-only predictor reproduces the trainer's predictions, bad
//! checkpoints are clear errors that change nothing, NaN losses are errors.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{for_each_adapter, random_vec, rng};
use wgrad::infer::Predictor;
use wgrad::nn::{self, CrossEntropyLoss, Layer, Linear, MSELoss, Sequential};
use wgrad::optim::{Adam, SGD};
use wgrad::{Error, Kernels};
use wgrad::{Targets, Trainer};

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgrad-train-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn batch(seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut r = rng(seed);
    let x = random_vec(&mut r, 16 * 12, -1.0, 1.0);
    let y = (0..16)
        .map(|i| (x[i * 12] > 0.0) as u32 + 2 * (x[i * 12 + 1] > 0.0) as u32)
        .collect();
    (x, y)
}

fn trainer(k: &Arc<Kernels>, hidden: usize) -> wgrad::Result<Trainer> {
    nn::manual_seed(5);
    let model = Sequential::mlp(&[12, hidden, 4], Layer::Tanh)?;
    Trainer::new(k.clone(), &model, CrossEntropyLoss, Adam::new(1e-2), 16)
}

fn train(t: &mut Trainer, steps: u64, seed: u64) -> wgrad::Result<()> {
    for s in 0..steps {
        let (x, y) = batch(seed + s);
        t.zero_grad();
        t.forward(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        t.step()?;
    }
    Ok(())
}

fn bits(t: &Trainer) -> wgrad::Result<Vec<Vec<u32>>> {
    Ok(t.executor()
        .parameters()?
        .into_iter()
        .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
        .collect())
}

#[test]
fn resuming_from_a_checkpoint_continues_bit_identically() {
    for_each_adapter("resume", |k| {
        let path = temp_path(&format!("resume-{:?}.safetensors", k.device().info().backend));
        let mut a = trainer(k, 24)?;
        train(&mut a, 10, 0)?;
        a.save(&path)?;
        train(&mut a, 10, 100)?;
        let mut b = trainer(k, 24)?;
        b.load(&path)?;
        assert_eq!(b.executor().step_count(), 10);
        train(&mut b, 10, 100)?;
        assert_eq!(bits(&a)?, bits(&b)?, "parameters after resume");
        Ok(())
    });
}

#[test]
fn a_predictor_from_a_checkpoint_matches_the_trainer() {
    for_each_adapter("predictor", |k| {
        let path = temp_path(&format!("predict-{:?}.safetensors", k.device().info().backend));
        let mut t = trainer(k, 24)?;
        train(&mut t, 20, 7)?;
        t.save(&path)?;
        let (x, _) = batch(999);
        let want = t.predict(&x)?;
        // A different batch size, so chunking and padding are exercised.
        let (mut p, ckpt) = Predictor::from_checkpoint(k.clone(), &path, 5)?;
        assert_eq!(ckpt.meta("model"), Some(t.model_description()));
        assert_eq!(p.predict(&x)?, want);
        assert!(p.executor().plan().param_arena_len > 0);
        Ok(())
    });
}

#[test]
fn outputs_survive_a_prediction_run() {
    for_each_adapter("outputs_survive", |k| {
        let mut t = trainer(k, 8)?;
        let (x, y) = batch(1);
        t.zero_grad();
        t.forward(&x)?;
        t.loss(Targets::Classes(&y))?;
        t.backward()?;
        let loss = t.step_reading_loss()?;
        t.predict(&batch(2).0)?;
        assert_eq!(t.loss_item()?, loss);
        Ok(())
    });
}

#[test]
fn a_mismatched_or_corrupt_checkpoint_is_an_error_and_changes_nothing() {
    for_each_adapter("bad_checkpoint", |k| {
        let wide = temp_path(&format!("wide-{:?}.safetensors", k.device().info().backend));
        trainer(k, 32)?.save(&wide)?;
        let mut narrow = trainer(k, 16)?;
        let before = bits(&narrow)?;
        let err = narrow.load(&wide).unwrap_err();
        assert!(
            err.to_string().contains("Linear(12, 32)") || matches!(err, Error::CheckpointMismatch { .. }),
            "{err}"
        );
        assert_eq!(bits(&narrow)?, before);

        let bytes = std::fs::read(&wide).unwrap();
        let truncated = temp_path(&format!("truncated-{:?}.safetensors", k.device().info().backend));
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
        let mut t = trainer(k, 32)?;
        let before = bits(&t)?;
        assert!(matches!(t.load(&truncated), Err(Error::CheckpointFormat { .. })));
        assert_eq!(bits(&t)?, before);
        assert!(Predictor::from_checkpoint(k.clone(), &truncated, 4).is_err());
        assert_eq!(std::fs::read(&wide).unwrap(), bytes, "the good file is untouched");
        Ok(())
    });
}

#[test]
fn a_nan_loss_is_an_error() {
    for_each_adapter("nan_loss", |k| {
        nn::manual_seed(1);
        let model = Sequential::new(vec![Layer::Linear(Linear::new(3, 1))]);
        let mut t = Trainer::new(k.clone(), &model, MSELoss, SGD::new(0.01), 2)?;
        t.zero_grad();
        t.forward(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
        t.loss(Targets::Values(&[f32::NAN, 1.0]))?;
        t.backward()?;
        assert!(matches!(t.step_reading_loss(), Err(Error::NonFiniteLoss { .. })));
        // Out-of-range class labels are refused before they reach the GPU.
        nn::manual_seed(1);
        let mut c = trainer(k, 4)?;
        c.forward(&batch(0).0)?;
        assert!(matches!(
            c.loss(Targets::Classes(&[9; 16])),
            Err(Error::InvalidArgument { .. })
        ));
        Ok(())
    });
}

#[test]
fn the_digits_mlp_reaches_95_percent_test_accuracy() {
    for_each_adapter("digits", |k| {
        let (train_set, test_set) = wgrad::io::data::digits()?.split(0.2, 0)?;
        nn::manual_seed(0);
        let model = Sequential::mlp(&[64, 128, 10], Layer::ReLU)?;
        let batch = 32;
        let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, Adam::new(2e-3), batch)?;
        let mut loader = wgrad::io::data::Sampler::new(train_set.len(), batch, 0, true)?;
        let (mut x, mut y) = (vec![0.0f32; batch * 64], vec![0u32; batch]);
        for _ in 0..25 {
            for indices in loader.iter() {
                train_set.fill_batch(indices, &mut x, &mut y)?;
                t.zero_grad();
                t.forward(&x)?;
                t.loss(Targets::Classes(&y))?;
                t.backward()?;
                t.step()?;
            }
            loader.next_epoch();
        }
        let acc = wgrad::train::accuracy(&t.predict(test_set.x())?, test_set.labels());
        eprintln!("digits test accuracy on {}: {:.2}%", k.device().label(), 100.0 * acc);
        assert!(acc >= 0.95, "test accuracy {acc}");
        Ok(())
    });
}
