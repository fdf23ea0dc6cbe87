//! Trains a 64-128-10 MLP on the UCI handwritten digits shipped with wgrad,
//! reports test accuracy, and saves a checkpoint `wgrad infer` can load.
//! (`wgrad train` is the same loop with options, a progress bar and a plot.)
//!
//! Run: `cargo run --release --example train_digits`

use std::sync::Arc;

use wgrad::io::data::{digits, Sampler};
use wgrad::nn::{self, CrossEntropyLoss, Layer, Sequential};
use wgrad::optim::Adam;
use wgrad::train::accuracy;
use wgrad::{Targets, Trainer};

fn main() -> wgrad::Result<()> {
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    println!("adapter: {}", kernels.device().label());
    let (train, test) = digits()?.split(0.2, 0)?;

    nn::manual_seed(0);
    let model = Sequential::mlp(&[64, 128, 10], Layer::ReLU)?;
    let batch = 32;
    let mut trainer = Trainer::new(kernels, &model, CrossEntropyLoss, Adam::new(2e-3), batch)?;
    println!(
        "{} dispatches per training step, one submit",
        trainer.executor().dispatches_per_step()
    );

    let mut loader = Sampler::new(train.len(), batch, 0, true)?;
    let (mut x, mut y) = (vec![0.0f32; batch * 64], vec![0u32; batch]);
    for epoch in 1..=40 {
        for indices in loader.iter() {
            train.fill_batch(indices, &mut x, &mut y)?;
            trainer.zero_grad();
            trainer.forward(&x)?;
            trainer.loss(Targets::Classes(&y))?;
            trainer.backward()?;
            trainer.step()?;
        }
        loader.next_epoch();
        if epoch % 10 == 0 {
            let acc = accuracy(&trainer.predict(test.x())?, test.labels());
            println!(
                "epoch {epoch:2}: last batch loss {:.4}, test accuracy {:.2}%",
                trainer.loss_item()?,
                100.0 * acc
            );
        }
    }
    std::fs::create_dir_all("out").ok();
    trainer.save("out/example_digits.safetensors")?;
    println!("saved out/example_digits.safetensors");
    Ok(())
}
