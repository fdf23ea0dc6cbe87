//! The perplexity scorer (`wgrad::infer::perplexity`): each window's mean
//! loss against the loss of the generator's logits after every prefix of
//! the window (another graph: the prefill's last row through the head,
//! the cross-entropy taken on the host in f64), for a GPT and the small
//! Llamas; llama-perplexity's windows (second halves scored, BOS first,
//! the tail left out); and each refusal.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::infer::generate::Generator;
use wgrad::infer::perplexity::{scored_per_window, Scorer, ScorerOptions};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self, CausalLm};
use wgrad::Kernels;

use crate::common::for_each_adapter;
use crate::generate::{llama_configs, sharp_llama};

/// |scorer - reference| on a mean loss of order 1-4 nats: float32 sums of
/// two layers in another order (the scorer's rows in one pass, the
/// reference's prefills one prefix at a time); measured below 2e-6.
const ATOL: f64 = 1e-4;

/// 37 tokens (prime), a context of 13 (prime) positions.
const GPT: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 13,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};

/// A GPT with attention far from uniform and logits of order 1 (GPT-2's
/// init gives near-uniform ones, where a wrong row would hardly show).
fn sharp_gpt(seed: u64) -> Gpt {
    nn::manual_seed(seed);
    let mut model = Gpt::new(GPT).expect("valid config");
    for w in model.wte.weight.iter_mut().chain(model.wpe.weight.iter_mut()) {
        *w *= 25.0;
    }
    model
}

/// The mean loss of `window`'s second half from the logits after each of
/// its prefixes, in f64.
fn reference_loss(generator: &mut Generator, window: &[u32]) -> wgrad::Result<f64> {
    let first = window.len() / 2;
    let mut total = 0.0;
    for p in first..window.len() - 1 {
        let logits = generator.prefill(&[&window[..=p]])?;
        let max = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
        let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
        total += max + sum.ln() - logits[window[p + 1] as usize] as f64;
    }
    Ok(total / (window.len() - 1 - first) as f64)
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.random_range(0..vocab as u32)).collect()
}

/// Scores `model` over three windows of `context` and `context - 1`
/// tokens more (too few for a fourth), and
/// checks each window's loss, the mean, the counts and BOS's placement.
fn check_model(k: &Arc<Kernels>, model: &dyn CausalLm, context: usize, seed: u64) -> wgrad::Result<()> {
    let options = ScorerOptions {
        context,
        ..ScorerOptions::default()
    };
    let mut scorer = Scorer::new(k.clone(), model, &options)?;
    let mut generator = Generator::new(k.clone(), model, 1)?;
    let text = tokens(seed, 4 * context - 1, model.vocab_size());
    let bos = 1;
    let mut expected = 0.0;
    for chunk in text.chunks_exact(context) {
        let mut window = chunk.to_vec();
        window[0] = bos;
        let reference = reference_loss(&mut generator, &window)?;
        let loss = scorer.window_loss(&window)?;
        assert!((loss - reference).abs() <= ATOL, "window: {loss} against {reference}");
        expected += reference / 3.0;
    }
    let mut heard = Vec::new();
    let result = scorer.score(&text, Some(bos), |done, of| heard.push((done, of)))?;
    assert_eq!(heard, vec![(1, 3), (2, 3), (3, 3)]);
    assert_eq!(
        (result.windows, result.context, result.left_out),
        (3, context, context - 1)
    );
    assert_eq!(result.scored, 3 * scored_per_window(context));
    assert!(
        (result.mean_loss - expected).abs() <= ATOL,
        "{} against {expected}",
        result.mean_loss
    );
    assert!((result.perplexity() - result.mean_loss.exp()).abs() <= 1e-9 * result.perplexity());
    // Without BOS each window keeps the text's own first token.
    let plain = scorer.score(&text, None, |_, _| {})?;
    let mut expected_plain = 0.0;
    for chunk in text.chunks_exact(context) {
        expected_plain += reference_loss(&mut generator, chunk)? / 3.0;
    }
    assert!(
        (plain.mean_loss - expected_plain).abs() <= ATOL,
        "{} against {expected_plain}",
        plain.mean_loss
    );
    Ok(())
}

#[test]
fn windows_score_what_the_generator_predicts() {
    for_each_adapter("windows_score_what_the_generator_predicts", |k| {
        let gpt = sharp_gpt(3);
        // Contexts: the shortest (3: one prediction), odd and even, and
        // the model's whole context.
        for context in [3, 8, 13] {
            check_model(k, &gpt, context, context as u64)?;
        }
        for (i, config) in llama_configs().into_iter().enumerate() {
            let llama = sharp_llama(config, 40 + i as u64);
            check_model(k, &llama, 11, i as u64)?;
        }
        Ok(())
    });
}

#[test]
fn the_scorer_refuses_what_it_cannot_score() {
    for_each_adapter("the_scorer_refuses_what_it_cannot_score", |k| {
        let gpt = sharp_gpt(5);
        let with = |context| ScorerOptions {
            context,
            ..ScorerOptions::default()
        };
        for context in [0, 2, GPT.block_size + 1] {
            let err = Scorer::new(k.clone(), &gpt, &with(context)).err().expect("refused");
            assert!(err.to_string().contains("give 3"), "{err}");
        }
        let mut scorer = Scorer::new(k.clone(), &gpt, &with(8))?;
        let err = scorer.score(&[1; 7], None, |_, _| {}).unwrap_err();
        assert!(err.to_string().contains("fewer than one window of 8"), "{err}");
        let err = scorer.window_loss(&[1; 7]).unwrap_err();
        assert!(err.to_string().contains("a window of 7 tokens"), "{err}");
        let err = scorer.window_loss(&[1, 2, 3, 37, 4, 5, 6, 7]).unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary of 37"), "{err}");
        Ok(())
    });
}
