//! A small causal transformer learns a task that needs attention: at every
//! position, output the token seen `LAG` positions earlier. Each output
//! depends on another position's input, so a model that looks at one
//! position at a time cannot do better than chance; attention can look back.
//!
//! Built only from the public Module API (Embedding, Block, LayerNorm,
//! Linear) and trained with the Trainer. The same model with its attention
//! removed (an MLP per position, of similar size) is trained the same way
//! as the baseline.
//!
//! Run: `cargo run --release --example attention`

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::graph::{Graph, Tensor};
use wgrad::nn::{self, Block, CrossEntropyLoss, Embedding, LayerNorm, Linear, Module};
use wgrad::optim::Adam;
use wgrad::trainer::{Targets, Trainer};

const VOCAB: usize = 16;
const SEQ: usize = 12;
const LAG: usize = 3;
const EMBD: usize = 48;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const BATCH: usize = 32;
const STEPS: usize = 400;

/// Token and position embeddings, blocks, a final norm and the head, named
/// as GPT-2 names them (`wte`, `wpe`, `h.0.attn.c_attn.weight`, …).
struct TinyTransformer {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
}

impl TinyTransformer {
    fn new(attention: bool) -> wgrad::Result<Self> {
        // Without attention a block has 2/3 of the parameters: 3 blocks for
        // 2 keep the two models of similar size.
        let layers = if attention { LAYERS } else { LAYERS * 3 / 2 };
        let h = (0..layers)
            .map(|_| if attention { Block::new(EMBD, HEADS) } else { Ok(Block::mlp_only(EMBD)) })
            .collect::<wgrad::Result<_>>()?;
        Ok(TinyTransformer {
            wte: Embedding::normal(VOCAB, EMBD, 0.1),
            wpe: Embedding::normal(SEQ, EMBD, 0.1),
            h,
            ln_f: LayerNorm::new(EMBD),
            lm_head: Linear::new(EMBD, VOCAB),
        })
    }
}

impl Module for TinyTransformer {
    fn input(&self, g: &mut Graph, batch: usize) -> wgrad::Result<Tensor> {
        g.ids("idx", &[batch, SEQ])
    }

    fn forward(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> wgrad::Result<Tensor> {
        let tokens = self.wte.forward(g, idx, &format!("{prefix}wte."))?;
        // [SEQ, EMBD] broadcast over the batch.
        let positions = self.wpe.table(g, &format!("{prefix}wpe."))?;
        let mut x = g.add(tokens, positions)?;
        for (i, block) in self.h.iter().enumerate() {
            x = block.forward(g, x, &format!("{prefix}h.{i}."))?;
        }
        let x = self.ln_f.forward(g, x, &format!("{prefix}ln_f."))?;
        self.lm_head.forward(g, x, &format!("{prefix}lm_head."))
    }

    fn named_parameters(&self) -> Vec<(String, Vec<usize>)> {
        let mut all: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |prefix: String, m: &dyn Module| all.extend(m.named_parameters().into_iter().map(|(n, s)| (format!("{prefix}{n}"), s)));
        add("wte.".into(), &self.wte);
        add("wpe.".into(), &self.wpe);
        for (i, block) in self.h.iter().enumerate() {
            add(format!("h.{i}."), block);
        }
        add("ln_f.".into(), &self.ln_f);
        add("lm_head.".into(), &self.lm_head);
        all
    }

    fn describe(&self) -> String {
        let blocks: Vec<String> = self.h.iter().map(Module::describe).collect();
        format!("TinyTransformer(vocab={VOCAB}, seq={SEQ}, {})", blocks.join(" "))
    }
}

/// `count` random sequences and their targets: the token LAG positions
/// back (the first LAG positions repeat their own token).
fn lagged_copies(count: usize, rng: &mut ChaCha8Rng) -> (Vec<u32>, Vec<u32>) {
    let inputs: Vec<u32> = (0..count * SEQ).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    let targets = (0..count * SEQ).map(|i| if i % SEQ >= LAG { inputs[i - LAG] } else { inputs[i] }).collect();
    (inputs, targets)
}

/// Fraction of positions with a lag (t ≥ LAG) predicted right: the part of
/// the task that needs another position.
fn lagged_accuracy(predictions: &[u32], targets: &[u32]) -> f32 {
    let scored: Vec<bool> = (0..targets.len()).filter(|i| i % SEQ >= LAG).map(|i| predictions[i] == targets[i]).collect();
    scored.iter().filter(|&&right| right).count() as f32 / scored.len() as f32
}

fn train(kernels: &Arc<wgrad::Kernels>, model: &TinyTransformer, test: &(Vec<u32>, Vec<u32>)) -> wgrad::Result<f32> {
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

    nn::manual_seed(0);
    let attention = TinyTransformer::new(true)?;
    println!("attention model: {} parameters", attention.num_parameters());
    let attention_accuracy = train(&kernels, &attention, &test)?;
    println!("accuracy {:.1}%", 100.0 * attention_accuracy);

    nn::manual_seed(0);
    let mlp = TinyTransformer::new(false)?;
    println!("MLP baseline (no attention, each position alone): {} parameters", mlp.num_parameters());
    let mlp_accuracy = train(&kernels, &mlp, &test)?;
    println!("MLP accuracy {:.1}% (chance is {:.1}%)", 100.0 * mlp_accuracy, 100.0 / VOCAB as f32);
    Ok(())
}
