//! wgrad's Gemma 3 against transformers' Gemma3ForCausalLM, as
//! qwen_reference.rs checks Qwen: from the same weights and batch, the
//! logits, the loss, every gradient by Hugging Face's name, ten clipped
//! AdamW steps and the parameters they end at; and generation's cached
//! path (constant 1 + weight norms, the KV cache) against the fixture's
//! logits. The fixture (scripts/gemma_tiny_reference.py, PyTorch float32,
//! tests/fixtures/gemma3_reference.safetensors) has a local, a global and
//! a local layer with different rotary bases, heads of 24 channels over
//! 64 / 4, query_pre_attn_scalar 20 (not the head width) and noise on
//! every norm weight, so none sits at its init of zero.

use crate::common;
use crate::gpt_reference::{check_gradients, check_steps, initial_values, worst, Fixture};

use common::{assert_close, for_each_adapter, for_each_shaping};
use wgrad::infer::generate::Generator;
use wgrad::infer::Predictor;
use wgrad::models::{Gemma, GemmaConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module};
use wgrad::{Targets, Trainer};

const FIXTURE: &[u8] = include_bytes!("../fixtures/gemma3_reference.safetensors");

fn config(fx: &Fixture) -> GemmaConfig {
    GemmaConfig {
        vocab_size: fx.setting("vocab_size"),
        block_size: fx.setting("block_size"),
        n_layer: fx.setting("n_layer"),
        n_head: fx.setting("n_head"),
        n_kv_head: fx.setting("n_kv_head"),
        n_embd: fx.setting("n_embd"),
        head_dim: fx.setting("head_dim"),
        intermediate_size: fx.setting("intermediate_size"),
        rope_theta: fx.setting("rope_theta"),
        rope_local_theta: fx.setting("rope_local_theta"),
        rms_norm_eps: fx.setting("rms_norm_eps"),
        query_pre_attn_scalar: fx.setting("query_pre_attn_scalar"),
        sliding_window: fx.setting("sliding_window"),
        sliding_window_pattern: fx.setting("sliding_window_pattern"),
    }
}

fn model(fx: &Fixture) -> Gemma {
    Gemma::from_parameters(config(fx), |name, _| Ok(fx.get(&format!("init.{name}")).to_vec()))
        .expect("the fixture's weights fit its config")
}

#[test]
fn the_model_has_hugging_faces_parameter_names_and_shapes() {
    let fx = Fixture::from_bytes(FIXTURE);
    let gemma = model(&fx);
    let mut ours = gemma.named_parameters();
    ours.sort();
    assert_eq!(
        ours,
        fx.parameters(),
        "wgrad's names and shapes against transformers' state_dict"
    );
    let declared = initial_values(&gemma);
    assert_eq!(declared.len(), ours.len(), "one graph parameter per named parameter");
    // Six norms a layer (four around the branches, q and k) and the final one.
    let layers: usize = fx.setting("n_layer");
    let norms = ours.iter().filter(|(n, _)| n.ends_with("norm.weight")).count();
    assert_eq!(norms, 6 * layers + 1);
    // Layers 0 and 2 local, 1 global (pattern 2), with their own bases.
    let c = config(&fx);
    let bases: Vec<f32> = gemma.layers.iter().map(|l| l.self_attn.rotary.base).collect();
    assert_eq!(bases, [c.rope_local_theta, c.rope_theta, c.rope_local_theta]);
    let windows: Vec<_> = gemma.layers.iter().map(|l| l.self_attn.sliding_window).collect();
    assert_eq!(windows, [Some(c.sliding_window), None, Some(c.sliding_window)]);
}

#[test]
fn gemma_init_is_transformers() {
    // Matrices N(0, 0.02²) (the spread within 10%), norms zeros (they
    // scale by 1 + weight).
    let fx = Fixture::from_bytes(FIXTURE);
    nn::manual_seed(0);
    let gemma = Gemma::new(config(&fx)).expect("valid config");
    for (name, shape, values) in gemma.parameter_values() {
        let std = (values.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / values.len() as f64).sqrt();
        match shape.len() {
            2 => assert!((0.018..0.022).contains(&std), "{name}: std {std}"),
            _ => assert!(values.iter().all(|&x| x == 0.0), "{name}: zeros"),
        }
    }
}

#[test]
fn gemma_logits_loss_gradients_and_ten_adamw_steps_match_transformers() {
    let fx = Fixture::from_bytes(FIXTURE);
    let (idx, targets) = (fx.ids("idx"), fx.ids("targets"));
    let batch = fx.shape("logits")[0];
    let names = fx.parameters();
    for_each_shaping("gemma reference", |k| {
        let gemma = model(&fx);
        let who = format!(
            "Gemma 3 on {}, {} shaping",
            k.device().label(),
            if k.gpu_shaped() { "GPU" } else { "CPU" }
        );
        // Logits (within ±3): PyTorch's float32 and float64 differ by
        // 6.0e-7; 2e-6 as for the Llama and Qwen.
        let logits = Predictor::new(k.clone(), &gemma, batch)?.outputs_ids(idx)?;
        println!("{who}: logits |err| {:.1e}", worst(&logits, fx.get("logits")));
        assert_close("logits", &logits, fx.get("logits"), 2e-6, 0.0);

        let mut trainer = Trainer::new(k.clone(), &gemma, CrossEntropyLoss, fx.optimizer(), batch)?;
        trainer.forward_ids(idx)?;
        trainer.loss(Targets::Classes(targets))?;
        let loss = trainer.forward_backward(true)?.expect("the loss was asked for");
        println!("{who}: loss |err| {:.1e}", (loss - fx.get("loss")[0]).abs());
        // The loss (4.37): float32 against float64 2.8e-7.
        assert_close("loss", &[loss], fx.get("loss"), 2e-6, 0.0);

        // Every gradient by name: float32 against float64 3.5e-7.
        let grad_err = check_gradients(&trainer, &fx, names.iter().map(|(n, _)| n.as_str()), "", 2e-6)?;
        println!("{who}: gradients |err| {grad_err:.1e}");

        // The steps: PyTorch's float32 and float64 differ by 9.3e-4 in the
        // losses (4.4 to 2.3), 1.1e-3 in the gradient norms and 2.9e-3 in
        // the final parameters (the sandwich norms' rsqrt steers the first
        // clipped Adam steps hard); twice that and more.
        check_steps(&mut trainer, &fx, idx, targets, &who, 3e-3, 4e-3)?;
        let mut param_err = 0.0f32;
        for (name, _, got) in trainer.executor().parameters()? {
            let want = fx.get(&format!("final.{name}"));
            param_err = param_err.max(worst(&got, want));
            assert_close(&format!("final {name}"), &got, want, 1e-2, 0.0);
        }
        println!("{who}: final parameters |err| {param_err:.1e}");
        Ok(())
    });
}

#[test]
fn gemma_cached_generation_equals_transformers_logits() {
    // Prefill of 9 tokens of the first sequence, then one token at a time:
    // each step's logits against transformers' at that position.
    let fx = Fixture::from_bytes(FIXTURE);
    let idx = fx.ids("idx");
    let (t, vocab) = (fx.shape("logits")[1], fx.shape("logits")[2]);
    let want = fx.get("logits");
    for_each_adapter("gemma cached generation", |k| {
        let gemma = model(&fx);
        let mut generator = Generator::new(k.clone(), &gemma, 1)?;
        let prompt = 9;
        let logits = generator.prefill(&[&idx[..prompt]])?;
        // The KV cache and the decode kernel sum in another order than the
        // training forward: 1e-5 over logits within ±3.
        assert_close(
            "prefill",
            &logits,
            &want[(prompt - 1) * vocab..prompt * vocab],
            1e-5,
            1e-5,
        );
        for p in prompt..t {
            let logits = generator.decode(&[idx[p]])?;
            assert_close(
                &format!("decode at {p}"),
                &logits,
                &want[p * vocab..(p + 1) * vocab],
                1e-5,
                1e-5,
            );
        }
        Ok(())
    });
}
