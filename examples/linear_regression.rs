//! The PyTorch tutorial's first model, line for line:
//!
//! ```python
//! model = nn.Linear(10, 1)
//! criterion = nn.MSELoss()
//! optimizer = optim.SGD(model.parameters(), lr=0.01)
//! for x, y in loader:
//!     optimizer.zero_grad()
//!     output = model(x)
//!     loss = criterion(output, y)
//!     loss.backward()
//!     optimizer.step()
//! ```
//!
//! wgrad records the five calls of each iteration and runs them as one GPU
//! submission. The data are synthetic, y = x·Wᵀ + b + noise, so the learned
//! weights can be compared with the true ones.
//!
//! Run: `cargo run --release --example linear_regression`

use std::sync::Arc;

use wgrad::io::data::{synthetic_regression, Sampler};
use wgrad::nn::{self, Layer, Linear, MSELoss, Sequential};
use wgrad::optim::SGD;
use wgrad::{Targets, Trainer};

fn main() -> wgrad::Result<()> {
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    println!("adapter: {}", kernels.device().label());
    let data = synthetic_regression(4096, 10, 1, 0.01, 42)?;

    nn::manual_seed(0);
    let model = Sequential::new(vec![Layer::Linear(Linear::new(10, 1))]); // model = nn.Linear(10, 1)
    let criterion = MSELoss; // criterion = nn.MSELoss()
    let optimizer = SGD::new(0.01); // optimizer = optim.SGD(lr=0.01)
    let batch = 64;
    let mut trainer = Trainer::new(kernels, &model, criterion, optimizer, batch)?;

    let mut loader = Sampler::new(data.len(), batch, 0, true)?;
    let (mut x, mut y) = (vec![0.0f32; batch * 10], vec![0.0f32; batch]);
    for epoch in 0..20 {
        for indices in loader.iter() {
            data.fill_batch(indices, &mut x, &mut y)?;
            trainer.zero_grad(); // optimizer.zero_grad()
            trainer.forward(&x)?; // output = model(x)
            trainer.loss(Targets::Values(&y))?; // loss = criterion(output, y)
            trainer.backward()?; // loss.backward()
            trainer.step()?; // optimizer.step()
        }
        loader.next_epoch();
        if epoch % 5 == 4 {
            println!("epoch {:2}: loss {:.6}", epoch + 1, trainer.loss_item()?);
        }
    }

    let params = trainer.executor().parameters()?;
    let (weight, bias) = (&params[0].2, &params[1].2);
    let worst = weight
        .iter()
        .zip(&data.weight)
        .map(|(w, t)| (w - t).abs())
        .fold((bias[0] - data.bias[0]).abs(), f32::max);
    println!("learned weight {weight:.3?}\n   true weight {:.3?}", data.weight);
    println!(
        "learned bias {:.4}, true bias {:.4}; largest error {worst:.2e}",
        bias[0], data.bias[0]
    );
    if worst > 1e-2 {
        eprintln!("did not recover the true weights within 1e-2");
        std::process::exit(1);
    }
    Ok(())
}
