//! `wgrad infer`: a classifier's checkpoint on the test split of its
//! data, with a few predictions and the accuracy.

use std::path::PathBuf;

use wgrad::infer::Predictor;
use wgrad::train::{self, accuracy};
use wgrad::DeviceOptions;

use crate::common::{open_kernels, spinner};

pub fn infer(opts: &DeviceOptions, path: &PathBuf, mnist: Option<&PathBuf>, show: usize) -> wgrad::Result<()> {
    let kernels = open_kernels(opts)?;
    let (mut predictor, ckpt) = Predictor::from_checkpoint(kernels.clone(), path, 256)?;
    let seed = ckpt.meta("split_seed").and_then(|s| s.parse().ok()).unwrap_or(0);
    let fraction = ckpt.meta("test_fraction").and_then(|s| s.parse().ok()).unwrap_or(0.2);
    let train::DataSplit {
        test: test_set,
        name: data_name,
        ..
    } = train::load_data(mnist.map(PathBuf::as_path), fraction, seed)?;
    if test_set.features() != predictor.in_features() {
        return Err(wgrad::Error::shape(
            "infer",
            format!(
                "the model takes {} features, {data_name} has {}",
                predictor.in_features(),
                test_set.features()
            ),
            &[&[predictor.in_features()], &[test_set.features()]],
        ));
    }
    println!("adapter: {}", kernels.device().label());
    println!(
        "model: {} (step {})",
        predictor.model_description(),
        ckpt.meta("step").unwrap_or("?")
    );
    let predicting = spinner("predicting (a first run on this adapter compiles kernels)");
    let predictions = predictor.predict(test_set.x())?;
    predicting.finish_and_clear();
    for (i, (p, l)) in predictions.iter().zip(test_set.labels()).take(show).enumerate() {
        println!(
            "  sample {i:4}: predicted {p}, label {l}{}",
            if p == l { "" } else { "  (wrong)" }
        );
    }
    let acc = accuracy(&predictions, test_set.labels());
    println!(
        "test accuracy {:.2}% on {} rows of {data_name}",
        100.0 * acc,
        test_set.len()
    );
    Ok(())
}
