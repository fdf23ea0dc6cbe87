//! A small causal transformer learns a task that needs attention: at every
//! position, output the token seen `LAG` positions earlier. Each output
//! depends on another position's input, so a model that looks at one
//! position at a time cannot do better than chance; attention can look back.
//!
//! The model is `wgrad::models::Gpt`, a Module made of the public layers
//! (Embedding, Block = LayerNorm + CausalSelfAttention + Mlp, Linear),
//! trained with the Trainer. The same model with its attention removed (an
//! MLP per position, with a third more blocks to be of similar size) is
//! trained the same way as the baseline.
//!
//! Run: `cargo run --release --example attention`

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module};
use wgrad::optim::Adam;
use wgrad::{Targets, Trainer};

const VOCAB: usize = 16;
const SEQ: usize = 12;
const LAG: usize = 3;
const EMBD: usize = 48;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const BATCH: usize = 32;
const STEPS: usize = 400;

/// `count` random sequences and their targets: the token LAG positions
/// back (the first LAG positions repeat their own token).
fn lagged_copies(count: usize, rng: &mut ChaCha8Rng) -> (Vec<u32>, Vec<u32>) {
    let inputs: Vec<u32> = (0..count * SEQ).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    let targets = (0..count * SEQ)
        .map(|i| if i % SEQ >= LAG { inputs[i - LAG] } else { inputs[i] })
        .collect();
    (inputs, targets)
}

/// Fraction of positions with a lag (t ≥ LAG) predicted right: the part of
/// the task that needs another position.
fn lagged_accuracy(predictions: &[u32], targets: &[u32]) -> f32 {
    let scored: Vec<bool> = (0..targets.len())
        .filter(|i| i % SEQ >= LAG)
        .map(|i| predictions[i] == targets[i])
        .collect();
    scored.iter().filter(|&&right| right).count() as f32 / scored.len() as f32
}

fn train(kernels: &Arc<wgrad::Kernels>, model: &Gpt, test: &(Vec<u32>, Vec<u32>)) -> wgrad::Result<f32> {
    let mut trainer = Trainer::new(kernels.clone(), model, CrossEntropyLoss, Adam::new(3e-3), BATCH)?;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for step in 1..=STEPS {
        let (x, y) = lagged_copies(BATCH, &mut rng);
        trainer.zero_grad();
        trainer.forward_ids(&x)?;
        trainer.loss(Targets::Classes(&y))?;
        trainer.backward()?;
        if step % 100 == 0 {
            println!("  step {step:4}: loss {:.4}", trainer.step_reading_loss()?);
        } else {
            trainer.step()?;
        }
    }
    Ok(lagged_accuracy(&trainer.predict_ids(&test.0)?, &test.1))
}

fn main() -> wgrad::Result<()> {
    let kernels = Arc::new(wgrad::Kernels::new(wgrad::Device::open_default()?));
    println!("adapter: {}", kernels.device().label());
    println!("task: output the token {LAG} positions back, vocabulary {VOCAB}, sequences of {SEQ}");
    let test = lagged_copies(256, &mut ChaCha8Rng::seed_from_u64(99));

    let config = GptConfig {
        vocab_size: VOCAB,
        block_size: SEQ,
        n_layer: LAYERS,
        n_head: HEADS,
        n_embd: EMBD,
    };
    nn::manual_seed(0);
    let attention = Gpt::new(config)?;
    println!("attention model: {} parameters", attention.num_parameters());
    let attention_accuracy = train(&kernels, &attention, &test)?;
    println!("accuracy {:.1}%", 100.0 * attention_accuracy);

    // Without attention a block has 2/3 of the parameters: 3 blocks for 2
    // keep the two models of similar size.
    nn::manual_seed(0);
    let mlp = Gpt::without_attention(GptConfig {
        n_layer: LAYERS * 3 / 2,
        ..config
    })?;
    println!(
        "MLP baseline (no attention, each position alone): {} parameters",
        mlp.num_parameters()
    );
    let mlp_accuracy = train(&kernels, &mlp, &test)?;
    println!(
        "MLP accuracy {:.1}% (chance is {:.1}%)",
        100.0 * mlp_accuracy,
        100.0 / VOCAB as f32
    );
    Ok(())
}
