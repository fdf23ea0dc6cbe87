//! wgrad's Llama against transformers' LlamaForCausalLM, as llm.c's
//! test_gpt2 checks its model and gpt_reference.rs checks the GPT: from the
//! same weights and batch, the logits, the loss, every gradient by Hugging
//! Face's name, ten clipped AdamW steps (weight-decay groups, the
//! warmup-cosine schedule) and the parameters they end at; a tied head's
//! logits and gradients; and Meta's interleaved rotary layout giving the
//! same logits from permuted q/k rows. The numbers come from
//! scripts/llama_reference.py (PyTorch float32), committed as
//! tests/fixtures/llama_reference.safetensors.

use crate::common;
use crate::gpt_reference::{check_gradients, check_steps, initial_values, worst, Fixture};

use common::{assert_close, for_each_adapter, for_each_shaping};
use wgrad::infer::Predictor;
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module, RopeLayout};
use wgrad::{Targets, Trainer};

const FIXTURE: &[u8] = include_bytes!("../fixtures/llama_reference.safetensors");

fn config(fx: &Fixture, tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: fx.setting("vocab_size"),
        block_size: fx.setting("block_size"),
        n_layer: fx.setting("n_layer"),
        n_head: fx.setting("n_head"),
        n_kv_head: fx.setting("n_kv_head"),
        n_embd: fx.setting("n_embd"),
        intermediate_size: fx.setting("intermediate_size"),
        rope_theta: fx.setting("rope_theta"),
        rms_norm_eps: fx.setting("rms_norm_eps"),
        tie_word_embeddings: tied,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: wgrad::models::LlamaVariant::Llama,
    }
}

/// The fixture's initial weights (`{prefix}init.<name>`) in a Llama.
fn model(fx: &Fixture, tied: bool) -> Llama {
    let prefix = if tied { "tied.init." } else { "init." };
    Llama::from_parameters(config(fx, tied), |name, _| {
        Ok(fx.get(&format!("{prefix}{name}")).to_vec())
    })
    .expect("the fixture's weights fit its config")
}

/// Names and shapes of the fixture's `{prefix}…` tensors, sorted.
fn fixture_parameters(fx: &Fixture, prefix: &str) -> Vec<(String, Vec<usize>)> {
    let names: Vec<(String, Vec<usize>)> = fx.parameters();
    if prefix == "init." {
        return names;
    }
    let mut tied: Vec<(String, Vec<usize>)> = ["model.embed_tokens.weight", "model.norm.weight"]
        .iter()
        .map(|n| (n.to_string(), fx.shape(&format!("{prefix}{n}")).to_vec()))
        .chain(
            names
                .into_iter()
                .filter(|(n, _)| n.starts_with("model.layers."))
                .map(|(n, _)| {
                    let shape = fx.shape(&format!("{prefix}{n}")).to_vec();
                    (n, shape)
                }),
        )
        .collect();
    tied.sort();
    tied
}

#[test]
fn the_model_has_hugging_faces_parameter_names_and_shapes() {
    let fx = Fixture::from_bytes(FIXTURE);
    for (tied, prefix) in [(false, "init."), (true, "tied.init.")] {
        let llama = model(&fx, tied);
        let mut ours = llama.named_parameters();
        ours.sort();
        assert_eq!(
            ours,
            fixture_parameters(&fx, prefix),
            "tied {tied}: wgrad's names and shapes against LlamaForCausalLM's state_dict"
        );
        // The graph declares exactly the fixture's weights under those names.
        let declared = initial_values(&llama);
        assert_eq!(
            declared.len(),
            ours.len(),
            "tied {tied}: one graph parameter per named parameter"
        );
        for (name, values) in declared {
            assert_eq!(
                values,
                fx.get(&format!("{prefix}{name}")),
                "{name} as the graph declares it"
            );
        }
    }
}

#[test]
fn llama_init_has_transformers_scale_per_parameter() {
    // The RNGs differ, so only each parameter's spread can match. The
    // smallest random tensor has 2,048 values: a sample std within ~2% of
    // the other's (one sigma); 10% is five sigmas.
    let fx = Fixture::from_bytes(FIXTURE);
    nn::manual_seed(0);
    let llama = Llama::new(config(&fx, false)).expect("valid config");
    let ours = initial_values(&llama);
    for (name, _) in fx.parameters() {
        let (mine, theirs) = (&ours[&name], fx.get(&format!("init.{name}")));
        if theirs.iter().all(|&x| x == 1.0) {
            assert!(
                mine.iter().all(|&x| x == 1.0),
                "{name}: transformers initialises it to ones"
            );
            continue;
        }
        let std = |v: &[f32]| (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        let ratio = std(mine) / std(theirs);
        assert!(
            (0.9..1.1).contains(&ratio),
            "{name}: std {} against transformers' {} (ratio {ratio:.3})",
            std(mine),
            std(theirs)
        );
    }
}

#[test]
fn logits_loss_gradients_and_ten_adamw_steps_match_transformers() {
    let fx = Fixture::from_bytes(FIXTURE);
    let (idx, targets) = (fx.ids("idx"), fx.ids("targets"));
    let batch = fx.shape("logits")[0];
    let names = fx.parameters();
    for_each_shaping("llama reference", |k| {
        let llama = model(&fx, false);
        let who = format!(
            "{}, {} shaping",
            k.device().label(),
            if k.gpu_shaped() { "GPU" } else { "CPU" }
        );

        // Logits (within ±1): PyTorch's float32 and float64 differ by 2.0e-7,
        // wgrad and PyTorch by 2.2e-7.
        let logits = Predictor::new(k.clone(), &llama, batch)?.outputs_ids(idx)?;
        println!("{who}: logits |err| {:.1e}", worst(&logits, fx.get("logits")));
        assert_close("logits", &logits, fx.get("logits"), 2e-6, 0.0);

        let mut trainer = Trainer::new(k.clone(), &llama, CrossEntropyLoss, fx.optimizer(), batch)?;
        trainer.forward_ids(idx)?;
        trainer.loss(Targets::Classes(targets))?;
        let loss = trainer.forward_backward(true)?.expect("the loss was asked for");
        println!("{who}: loss |err| {:.1e}", (loss - fx.get("loss")[0]).abs());
        // The loss (4.23): equal here; a few ulps allowed.
        assert_close("loss", &[loss], fx.get("loss"), 2e-6, 0.0);

        // Every gradient by name: PyTorch's float32 and float64 differ by
        // 4.9e-8, wgrad and PyTorch by 6.0e-8.
        let grad_err = check_gradients(&trainer, &fx, names.iter().map(|(n, _)| n.as_str()), "", 1e-6)?;
        println!("{who}: gradients |err| {grad_err:.1e}");

        // Ten steps: warmup (1-3), cosine (4-8), floor (9-10); PyTorch
        // clipped steps 1, 2, 3, 5 and 7. Losses (2.3 to 4.2): PyTorch's
        // float32 and float64 differ by 3e-6 over the ten steps, wgrad and
        // PyTorch by 9.5e-7. Gradient norms (0.9 to 5.5): 3.5e-5 and 9.4e-6.
        check_steps(&mut trainer, &fx, idx, targets, &who, 5e-6, 5e-5)?;

        // The parameters after ten steps: PyTorch's float32 and float64
        // differ by 5.6e-5 (Adam's first steps divide by tiny second
        // moments, so rounding noise grows), wgrad and PyTorch by 3.0e-5.
        let mut param_err = 0.0f32;
        for (name, _, got) in trainer.executor().parameters()? {
            let want = fx.get(&format!("final.{name}"));
            param_err = param_err.max(worst(&got, want));
            assert_close(&format!("final {name}"), &got, want, 1e-4, 0.0);
        }
        println!("{who}: final parameters |err| {param_err:.1e}");
        Ok(())
    });
}

#[test]
fn a_tied_head_matches_transformers() {
    // The head is the token table: its gradient sums both uses.
    let fx = Fixture::from_bytes(FIXTURE);
    let (idx, targets) = (fx.ids("idx"), fx.ids("targets"));
    let batch = fx.shape("tied.logits")[0];
    for_each_adapter("llama reference, tied head", |k| {
        let llama = model(&fx, true);
        let mut trainer = Trainer::new(k.clone(), &llama, CrossEntropyLoss, fx.optimizer(), batch)?;
        trainer.forward_ids(idx)?;
        trainer.loss(Targets::Classes(targets))?;
        let loss = trainer.forward_backward(true)?.expect("the loss was asked for");
        // The same tolerances as the untied checks.
        assert_close("tied loss", &[loss], fx.get("tied.loss"), 2e-6, 0.0);
        let names = llama.named_parameters();
        let grad_err = check_gradients(&trainer, &fx, names.iter().map(|(n, _)| n.as_str()), "tied.", 1e-6)?;
        let logits = Predictor::new(k.clone(), &llama, batch)?.outputs_ids(idx)?;
        println!(
            "tied: logits |err| {:.1e}, gradients |err| {grad_err:.1e}",
            worst(&logits, fx.get("tied.logits"))
        );
        assert_close("tied logits", &logits, fx.get("tied.logits"), 2e-6, 0.0);
        Ok(())
    });
}

#[test]
fn interleaved_rotary_with_permuted_rows_gives_the_same_logits() {
    // Meta's (and GGUF's) layout rotates pairs (2i, 2i+1); Hugging Face's
    // converter permutes each head's q/k rows so rotate_half computes the
    // same thing. Undoing the permutation and rotating interleaved pairs
    // must give transformers' logits again.
    let fx = Fixture::from_bytes(FIXTURE);
    let idx = fx.ids("idx");
    let batch = fx.shape("logits")[0];
    let mut llama = model(&fx, false);
    llama.config.rope_layout = RopeLayout::Interleaved;
    let (n_head, n_kv_head) = (llama.config.n_head, llama.config.n_kv_head);
    for layer in &mut llama.layers {
        let attn = &mut layer.self_attn;
        attn.rotary.layout = RopeLayout::Interleaved;
        attn.q_proj.weight =
            wgrad::io::gguf::llama::permute_rows(&attn.q_proj.weight, attn.q_proj.out_features, n_head)
                .expect("whole heads");
        attn.k_proj.weight =
            wgrad::io::gguf::llama::permute_rows(&attn.k_proj.weight, attn.k_proj.out_features, n_kv_head)
                .expect("whole heads");
    }
    for_each_adapter("llama reference, interleaved rotary", |k| {
        let logits = Predictor::new(k.clone(), &llama, batch)?.outputs_ids(idx)?;
        println!("interleaved: logits |err| {:.1e}", worst(&logits, fx.get("logits")));
        // The same tolerance as the half-split check.
        assert_close("interleaved logits", &logits, fx.get("logits"), 2e-6, 0.0);
        Ok(())
    });
}
