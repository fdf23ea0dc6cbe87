//! Data parallel training of the digits MLP on two devices.
//!
//! **What is split:** the batch. Every device holds a complete copy (a
//! *replica*) of the model and of the optimizer state. Each step, the 32
//! rows of the global batch are dealt out among the devices (say 16 + 16),
//! and each device runs forward and backward on its own rows only.
//!
//! **What moves between devices each step:** the gradients, and nothing
//! else. wgpu has no device-to-device copies, so the gradients of every
//! replica are copied to the host, averaged there (weighted by how many
//! rows each device took, so the result is the gradient of the whole
//! batch), and the same average is written back to every device. This is
//! the *all-reduce*. Then every replica takes the same optimizer step.
//!
//! **What stays identical:** the parameters and the optimizer state. All
//! replicas start from the same weights and apply the same averaged
//! gradient with the same update, so they never drift apart; the program
//! checks this bit for bit at the end.
//!
//! Devices need not be equally fast. With `Split::Measured` the group
//! starts with an even split and then watches how long each device takes
//! for its rows; when the measured speeds call for a different division
//! (moving more than 5% of the batch), the shares are re-estimated, so the
//! faster device gets more rows and neither waits long for the other.
//!
//! Run: `cargo run --release --example data_parallel`
//! (`WGRAD_DEVICES=0,0` puts both replicas on adapter 0, `WGRAD_DEVICES=3`
//! uses three devices.)

use wgrad::io::data::{digits, Sampler};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::Adam;
use wgrad::parallel::data::{DataParallel, Split};
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

    // One replica per device; the split of each batch follows the measured
    // speed of the devices, re-estimated every 20 steps.
    let split = Split::Measured { every: 20 };
    let mut dp = DataParallel::new(&group, &model, CrossEntropyLoss, Adam::new(2e-3), BATCH, split)?;
    println!(
        "starting split of the {BATCH}-row batch: {:?} rows per device",
        dp.shares()
    );

    let mut loader = Sampler::new(train.len(), BATCH, 0, true)?;
    let (mut x, mut y) = (vec![0.0f32; BATCH * train.features()], vec![0u32; BATCH]);
    let mut shares = dp.shares().to_vec();
    let mut step = 0u64;
    let mut printed_changes = 0;
    for epoch in 1..=EPOCHS {
        let batches = loader.num_batches();
        for (b, indices) in loader.iter().enumerate() {
            train.fill_batch(indices, &mut x, &mut y)?;
            // Read the loss back only on the epoch's last batch: reading
            // waits for the devices.
            let read_loss = epoch % 5 == 0 && b + 1 == batches;
            let loss = dp.step(&x, Targets::Classes(&y), read_loss)?;
            step += 1;
            if dp.shares() != shares.as_slice() {
                if printed_changes < 10 {
                    println!("  step {step:4}: split re-estimated {shares:?} -> {:?}", dp.shares());
                } else if printed_changes == 10 {
                    println!("  (further re-splits counted, not printed)");
                }
                printed_changes += 1;
                shares = dp.shares().to_vec();
            }
            if let Some(loss) = loss {
                let acc = accuracy(&dp.predict(test.x())?, test.labels());
                println!(
                    "epoch {epoch:2}: loss {loss:.4}, test accuracy {:.2}%, split {:?}",
                    100.0 * acc,
                    dp.shares()
                );
            }
        }
        loader.next_epoch();
    }

    if printed_changes == 0 {
        println!("the split never changed: the measured speeds never called for moving more than 5% of the batch");
    }
    let stats = dp.stats();
    let comm = stats.communication.as_secs_f64();
    let compute = stats.compute.as_secs_f64();
    println!(
        "{} steps: final split {:?}, {} re-splits; compute {:.2} s, communication {:.2} s = {:.1}% of step time",
        stats.steps,
        dp.shares(),
        stats.resplits,
        compute,
        comm,
        100.0 * comm / (compute + comm).max(1e-9)
    );

    // The replicas must hold the very same weights, bit for bit.
    let reference = dp.replicas()[0].executor().parameters()?;
    let values: usize = reference.iter().map(|(_, _, v)| v.len()).sum();
    let mut identical = true;
    for (i, replica) in dp.replicas().iter().enumerate().skip(1) {
        let params = replica.executor().parameters()?;
        let differing: usize = reference
            .iter()
            .zip(&params)
            .map(|((_, _, a), (_, _, b))| a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count())
            .sum();
        println!("replica #{i} vs replica #0: {differing} of {values} parameter values differ (bitwise)");
        identical &= differing == 0 && params.len() == reference.len();
    }
    println!("replicas identical: {}", if identical { "yes" } else { "NO" });

    let acc = accuracy(&dp.predict(test.x())?, test.labels());
    println!("final test accuracy: {:.2}%", 100.0 * acc);
    if acc < 0.95 || !identical {
        eprintln!("FAILED: accuracy must reach 95% and replicas must stay identical");
        std::process::exit(1);
    }
    Ok(())
}
