//! Tensor parallel training of the digits MLP on two devices, Megatron
//! style.
//!
//! **What is split:** the weight matrices themselves, inside the block
//! `Linear(64, 128) → ReLU → Linear(128, 10)`. The 128 hidden units are
//! dealt out among the devices (64 + 64 here):
//!
//! - the first Linear is split by its outputs: device p holds the rows of
//!   `0.weight` [128, 64] and `0.bias` [128] for its hidden units, and
//!   computes only those hidden values;
//! - ReLU acts on each value alone, so each device applies it to its slice
//!   without needing the others;
//! - the second Linear is split by its inputs: device p holds the columns
//!   of `2.weight` [10, 128] that read its hidden units, and computes a
//!   *partial* output [batch, 10] from them. The true output is the sum of
//!   the partial outputs; the bias `2.bias` is added once, after the sum,
//!   on device 0, where the loss is computed too.
//!
//! **What moves between devices each step:** activations, not weights.
//! Forward: every device gets the block's input (the batch), and the
//! partial outputs are summed (an all-reduce, here through the host).
//! Backward: the gradient of the summed output goes back to every device,
//! which then has everything it needs for the gradients of its own weight
//! slices. (A layer before the block would also need the partial input
//! gradients summed: a second all-reduce; this model has none.) No
//! parameter or parameter gradient ever travels, and each device keeps the
//! optimizer state of its own slices only.
//!
//! **What stays identical:** the mathematics. Every weight exists once,
//! and gathered back together the slices form exactly the single-device
//! model, with its parameter names and shapes: the program shows this by
//! loading them into a plain one-device model and scoring it.
//!
//! Run: `cargo run --release --example tensor_parallel`
//! (`WGRAD_DEVICES=3` splits the hidden layer three ways.)

use std::sync::Arc;

use wgrad::infer::Predictor;
use wgrad::io::data::{digits, Sampler};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::Adam;
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::tensor::TensorParallel;
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::train::accuracy;
use wgrad::Targets;

const BATCH: usize = 32;
const EPOCHS: usize = 25;

fn main() -> wgrad::Result<()> {
    let group = DeviceGroup::from_env(DeviceSelection::Count(2))?;
    println!("devices:");
    for label in group.labels() {
        println!("  {label}");
    }

    let (train, test) = digits()?.split(0.2, 0)?;
    nn::manual_seed(0);
    let model = Sequential::mlp(&[64, 128, 10], Layer::ReLU)?;
    println!("model: {}", model.describe());

    // The Sequential declares its split: 0.weight column-parallel (hidden
    // units per device), 2.weight row-parallel, then an all-reduce.
    let mut tp = TensorParallel::new(&group, &model, CrossEntropyLoss, Adam::new(2e-3), BATCH)?;
    println!("{}", tp.describe());
    for (d, slice) in tp.slices("0.weight").iter().enumerate() {
        println!("  device #{d}: rows {slice:?} of 0.weight and 0.bias, the same columns of 2.weight");
    }

    let mut loader = Sampler::new(train.len(), BATCH, 0, true)?;
    let (mut x, mut y) = (vec![0.0f32; BATCH * train.features()], vec![0u32; BATCH]);
    for epoch in 1..=EPOCHS {
        let batches = loader.num_batches();
        for (b, indices) in loader.iter().enumerate() {
            train.fill_batch(indices, &mut x, &mut y)?;
            let read_loss = epoch % 5 == 0 && b + 1 == batches;
            if let Some(loss) = tp.step(&x, Targets::Classes(&y), read_loss)? {
                let acc = accuracy(&tp.predict(test.x())?, test.labels());
                println!("epoch {epoch:2}: loss {loss:.4}, test accuracy {:.2}%", 100.0 * acc);
            }
        }
        loader.next_epoch();
    }

    let stats = tp.stats();
    let wall = stats.wall.as_secs_f64();
    println!(
        "{} steps in {wall:.2} s; communication {:.2} s = {:.1}% of step time",
        stats.steps,
        stats.communication.as_secs_f64(),
        100.0 * stats.communication.as_secs_f64() / wall.max(1e-9)
    );
    let acc = accuracy(&tp.predict(test.x())?, test.labels());
    println!("final test accuracy: {:.2}%", 100.0 * acc);

    // Gather the slices back: single-device names and shapes.
    let gathered = tp.parameters()?;
    println!("gathered parameters (name, shape) vs the single-device model:");
    let expected = single_device_shapes(&model);
    let mut same_layout = gathered.len() == expected.len();
    for ((name, shape, _), (want_name, want_shape)) in gathered.iter().zip(&expected) {
        let ok = name == want_name && shape == want_shape;
        same_layout &= ok;
        let shape = format!("{shape:?}");
        println!(
            "  {name:9} {shape:10} {}",
            if ok {
                "= single device"
            } else {
                "DIFFERS from the single-device model"
            }
        );
    }

    // Load them into a plain model on one device: it predicts as well.
    let mut single = model.clone();
    for (i, layer) in single.layers.iter_mut().enumerate() {
        if let Layer::Linear(l) = layer {
            let find = |suffix: &str| {
                gathered
                    .iter()
                    .find(|(n, _, _)| *n == format!("{i}.{suffix}"))
                    .map(|(_, _, v)| v.clone())
            };
            l.weight = find("weight").unwrap_or_default();
            l.bias = find("bias");
        }
    }
    let mut predictor = Predictor::new(Arc::clone(&group.members()[0]), &single, BATCH)?;
    let single_acc = accuracy(&predictor.predict(test.x())?, test.labels());
    println!(
        "the gathered weights in a one-device model: test accuracy {:.2}%",
        100.0 * single_acc
    );

    if acc < 0.95 || !same_layout {
        eprintln!("FAILED: accuracy must reach 95% and the gathered parameters must match the single-device layout");
        std::process::exit(1);
    }
    Ok(())
}

/// `0.weight [128, 64]`, `0.bias [128]`, … as a one-device model names them.
fn single_device_shapes(model: &Sequential) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for (i, layer) in model.layers.iter().enumerate() {
        if let Layer::Linear(l) = layer {
            out.push((format!("{i}.weight"), vec![l.out_features, l.in_features]));
            out.push((format!("{i}.bias"), vec![l.out_features]));
        }
    }
    out
}
