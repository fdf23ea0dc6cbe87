//! Pipeline (model) parallel training of the digits MLP on two devices,
//! 1F1B schedule.
//!
//! **What is split:** the model, by layers. The layers are cut into
//! contiguous *stages*, one per device, with about equal multiply-adds:
//! here device 0 holds `Linear(64, 128) ReLU` and device 1 holds
//! `Linear(128, 10)` and the loss. Each parameter lives on exactly one
//! device, and so does its optimizer state.
//!
//! **What moves between devices each step:** activations forward and their
//! gradients backward, at the cuts. Stage 0's output (the 128 hidden
//! values per row) is copied through the host to stage 1; in the backward
//! pass the gradient of that output is copied back from stage 1 to stage 0.
//! No parameters or parameter gradients travel.
//!
//! **Keeping both devices busy:** run naively, stage 1 would wait while
//! stage 0 works and the other way round. So the batch of 32 rows is cut
//! into *micro-batches* (4 of 8 rows): while stage 1 works on micro-batch
//! 0, stage 0 already works on micro-batch 1. Gradients are summed over the
//! micro-batches and each stage takes one optimizer step per batch, so the
//! result is the same as one step on the whole batch. The stages still
//! idle while the pipeline fills and drains: the *bubble*, ideally
//! (S-1)/(M+S-1) of the time for S stages and M micro-batches (20% here).
//! Backward recomputes each stage's forward from its saved input instead
//! of keeping every intermediate (re-materialisation, as GPipe does).
//!
//! **What stays identical:** nothing needs to, since no parameter is held
//! twice; the model the stages hold together is the single-device model,
//! with the same parameter names (`0.weight`, `2.bias`, …).
//!
//! Run: `cargo run --release --example pipeline_parallel`
//! (`WGRAD_DEVICES=0,0` puts both stages on adapter 0.)

use wgrad::io::data::{digits, Sampler};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::Adam;
use wgrad::parallel::engine::TrainEngine;
use wgrad::parallel::pipeline::{Pipeline, Schedule};
use wgrad::parallel::{DeviceGroup, DeviceSelection};
use wgrad::train::accuracy;
use wgrad::Targets;

const BATCH: usize = 32;
const MICRO_BATCHES: usize = 4;
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

    // The pipeline places the Linears (each with its activation) over the
    // stages, evening out their multiply-adds.
    let mut pipe = Pipeline::new(
        &group,
        &model,
        CrossEntropyLoss,
        Adam::new(2e-3),
        BATCH,
        MICRO_BATCHES,
        Schedule::OneFOneB,
    )?;
    println!("{}", pipe.describe());
    println!(
        "Linears per stage {:?}; ideal bubble (S-1)/(M+S-1) = {:.1}%",
        pipe.blocks_per_stage(),
        100.0 * pipe.ideal_bubble_fraction()
    );

    let mut loader = Sampler::new(train.len(), BATCH, 0, true)?;
    let (mut x, mut y) = (vec![0.0f32; BATCH * train.features()], vec![0u32; BATCH]);
    for epoch in 1..=EPOCHS {
        let batches = loader.num_batches();
        for (b, indices) in loader.iter().enumerate() {
            train.fill_batch(indices, &mut x, &mut y)?;
            let read_loss = epoch % 5 == 0 && b + 1 == batches;
            if let Some(loss) = pipe.step(&x, Targets::Classes(&y), read_loss)? {
                let acc = accuracy(&pipe.predict(test.x())?, test.labels());
                println!(
                    "epoch {epoch:2}: loss {loss:.4}, test accuracy {:.2}%, measured bubble so far {:.1}%",
                    100.0 * acc,
                    100.0 * pipe.measured_bubble_fraction()
                );
            }
        }
        loader.next_epoch();
    }

    let stats = pipe.stats();
    let wall = stats.wall.as_secs_f64();
    let busy: Vec<String> = stats.busy.iter().map(|d| format!("{:.2} s", d.as_secs_f64())).collect();
    println!("{} steps in {wall:.2} s; busy time per stage {busy:?}", stats.steps);
    println!(
        "bubble: ideal {:.1}%, measured {:.1}%; communication {:.2} s = {:.1}% of step time",
        100.0 * pipe.ideal_bubble_fraction(),
        100.0 * pipe.measured_bubble_fraction(),
        stats.communication.as_secs_f64(),
        100.0 * stats.communication.as_secs_f64() / wall.max(1e-9)
    );
    let names: Vec<String> = pipe
        .parameters()?
        .into_iter()
        .map(|(n, shape, _)| format!("{n} {shape:?}"))
        .collect();
    println!("parameters held by the stages together: {}", names.join(", "));

    let acc = accuracy(&pipe.predict(test.x())?, test.labels());
    println!("final test accuracy: {:.2}%", 100.0 * acc);
    if acc < 0.95 {
        eprintln!("FAILED: accuracy below 95%");
        std::process::exit(1);
    }
    Ok(())
}
