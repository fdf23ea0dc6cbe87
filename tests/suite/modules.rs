//! Modules end to end: determinism with embeddings, causality of the
//! attention block, ragged last batches, fused vs unfused masking, and
//! tensors over an adapter's limits.

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, rng};
use wgrad::graph::{Executor, Graph};
use wgrad::infer::Predictor;
use wgrad::models::{Gpt, GptConfig};
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, CrossEntropyLoss, Module};
use wgrad::optim::{AdamW, SGD};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::DeviceSelection;
use wgrad::Error;
use wgrad::{Targets, Trainer};

const VOCAB: usize = 13;
const SEQ: usize = 7;

/// A one-block GPT (token and position embeddings, attention, MLP, head).
fn tiny(seed: u64) -> Gpt {
    nn::manual_seed(seed);
    Gpt::new(GptConfig {
        vocab_size: VOCAB,
        block_size: SEQ,
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
    })
    .expect("a valid config")
}

/// Batches where most positions hold the same few tokens, so the
/// embedding gradient adds many rows into the same table row.
fn repetitive_batch(batch: usize, step: u64) -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = (0..batch * SEQ)
        .map(|i| {
            if (i as u64 + step).is_multiple_of(5) {
                (i % VOCAB) as u32
            } else {
                (step % 3) as u32
            }
        })
        .collect();
    let targets = ids.iter().map(|&t| (t + 1) % VOCAB as u32).collect();
    (ids, targets)
}

#[test]
fn the_same_seed_gives_bit_identical_weights_with_repeated_tokens() {
    for_each_adapter("determinism", |k| {
        let run = || -> wgrad::Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
            let model = tiny(7);
            let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, AdamW::new(1e-2), 6)?;
            for step in 0..20 {
                let (x, y) = repetitive_batch(6, step);
                t.zero_grad();
                t.forward_ids(&x)?;
                t.loss(Targets::Classes(&y))?;
                t.backward()?;
                t.step()?;
            }
            t.executor().parameters()
        };
        let (first, second) = (run()?, run()?);
        let start = tiny(7);
        assert_ne!(
            first.iter().find(|(n, _, _)| n == "wte.weight").map(|p| &p.2),
            Some(&start.wte.weight),
            "the embedding trained"
        );
        for ((name, _, a), (_, _, b)) in first.iter().zip(&second) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{name} differs between two runs with the same seed");
        }
        Ok(())
    });
}

#[test]
fn an_output_depends_on_no_later_token_and_a_ragged_last_batch_needs_no_rebuild() {
    for_each_adapter("causality", |k| {
        let model = tiny(3);
        // A graph built for batch 4 serves 5 sequences: the last chunk is
        // padded, nothing is rebuilt.
        let mut p = Predictor::new(k.clone(), &model, 4)?;
        let ids: Vec<u32> = random_vec(&mut rng(5), 5 * SEQ, 0.0, VOCAB as f32)
            .iter()
            .map(|&v| (v as u32).min(VOCAB as u32 - 1))
            .collect();
        let all = p.predict_ids(&ids)?;
        assert_eq!(all.len(), 5 * SEQ);
        let alone = p.predict_ids(&ids[4 * SEQ..])?;
        assert_eq!(
            &all[4 * SEQ..],
            &alone[..],
            "a sequence's predictions do not depend on its batch"
        );
        // Changing the tokens after position t changes nothing up to t:
        // a generator can run a full-length graph on a prefix.
        let outputs = p.outputs_ids(&ids[..SEQ])?;
        for t in 0..SEQ {
            let mut changed = ids[..SEQ].to_vec();
            for v in &mut changed[t + 1..] {
                *v = (*v + 1) % VOCAB as u32;
            }
            let other = p.outputs_ids(&changed)?;
            let upto = (t + 1) * VOCAB;
            assert_eq!(
                &outputs[..upto],
                &other[..upto],
                "logits up to position {t} saw a later token"
            );
        }
        Ok(())
    });
}

#[test]
fn the_fused_causal_softmax_matches_a_mask_added_before_a_plain_softmax() {
    for_each_adapter("causal softmax vs mask", |k| {
        let (b, h, t) = (2, 3, 11);
        let values = random_vec(&mut rng(8), b * h * t * t, -3.0, 3.0);
        let mut g = Graph::new();
        let scores = g.constant("scores", &[b, h, t, t], values)?;
        let fused = g.softmax(scores, true)?;
        // The unfused reference: −1e9 above the diagonal, broadcast over
        // batch and heads.
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = g.constant("mask", &[t, t], mask)?;
        let masked = g.add(scores, mask)?;
        let reference = g.softmax(masked, false)?;
        let mut exec = Executor::new(k.clone(), g, &[fused, reference], None, None)?;
        exec.run(&[fused, reference])?;
        // exp(−1e9 − max) is exactly 0 in f32; the visible terms are the
        // same sums, up to the reduction order.
        assert_close("causal softmax", &exec.read(fused)?, &exec.read(reference)?, 1e-6, 1e-5);
        Ok(())
    });
}

#[test]
fn a_tensor_over_the_adapters_binding_limit_is_an_error() {
    for_each_adapter("over the limit", |k| {
        let limit = k.device().limits().max_storage_buffer_binding_size as usize / 4;
        let mut g = Graph::new();
        let x = g.input("x", &[2, limit / 2 + 7])?;
        let y = g.relu(x)?;
        match Executor::new(k.clone(), g, &[y], None, None) {
            Err(Error::TooLarge { .. }) => Ok(()),
            Err(other) => panic!("expected a limit error, got {other}"),
            Ok(_) => panic!("a tensor over max_storage_buffer_binding_size was accepted"),
        }
    });
}

#[test]
fn data_parallel_trains_an_attention_model_as_one_device_does() {
    let groups = crate::parallel::open_groups("data parallel attention", &[DeviceSelection::Count(2)]);
    let Some(group) = groups.first() else { return };
    let model = tiny(11);
    let global = 6;
    // SGD, whose step is linear in the gradient: Adam would turn the
    // rounding noise of gradients that are zero in exact arithmetic (the
    // key bias: softmax ignores a shift of every score) into full steps.
    let mut single = Trainer::new(
        group.members()[0].clone(),
        &model,
        CrossEntropyLoss,
        SGD::new(0.1),
        global,
    )
    .expect("trainer");
    let mut dp = DataParallel::new(
        group,
        &model,
        CrossEntropyLoss,
        SGD::new(0.1),
        global,
        Split::Rows(vec![2, 4]),
    )
    .expect("data parallel");
    for step in 0..4 {
        let (x, y) = repetitive_batch(global, step);
        single.zero_grad();
        single.forward_ids(&x).expect("forward");
        single.loss(Targets::Classes(&y)).expect("loss");
        single.backward().expect("backward");
        single.step().expect("step");
        dp.step(&x, Targets::Classes(&y), false).expect("data parallel step");
    }
    let want = single.executor().parameters().expect("parameters");
    for (r, replica) in dp.replicas().iter().enumerate() {
        for ((name, _, got), (_, _, w)) in replica.executor().parameters().expect("parameters").iter().zip(&want) {
            // The same math with the batch summed in two shards, then
            // weighted: f32 rounding through 4 SGD steps.
            assert_close(&format!("{name} on replica {r}"), got, w, 1e-5, 1e-4);
        }
    }
}

#[test]
fn gpt_presets_have_gpt2s_sizes_and_the_count_matches_the_module() {
    // The released GPT-2 small has 124,439,808 parameters (tied head).
    assert_eq!(GptConfig::gpt2().num_parameters(), 124_439_808);
    assert_eq!(GptConfig::preset("gpt2-xl").expect("known preset").n_embd, 1600);
    assert!(GptConfig::preset("gpt5").is_err());
    let small = GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 2,
        n_head: 3,
        n_embd: 6,
    };
    assert_eq!(Gpt::new(small).expect("valid").num_parameters(), small.num_parameters());
    assert!(
        Gpt::new(GptConfig { n_head: 4, ..small }).is_err(),
        "n_embd must be a multiple of n_head"
    );
}

/// (name, shape) of every parameter `model`'s forward declares, in order.
fn declared_by_forward(model: &dyn Module, batch: usize) -> Vec<(String, Vec<usize>)> {
    let mut g = Graph::new();
    let x = model.input(&mut g, batch).expect("a whole model declares its input");
    model.forward(&mut g, x, "").expect("forward");
    g.parameters()
        .into_iter()
        .map(|t| {
            g.get(t)
                .map(|n| (n.name.clone(), n.shape.clone()))
                .expect("a parameter node")
        })
        .collect()
}

#[test]
fn forward_declares_exactly_the_parameters_the_module_tree_names() {
    // Sizes 1 and primes; no adapter needed: this compares names only.
    let gpt = GptConfig {
        vocab_size: 7,
        block_size: 5,
        n_layer: 2,
        n_head: 1,
        n_embd: 3,
    };
    let mut llama = LlamaConfig {
        n_layer: 2,
        n_head: 3,
        n_kv_head: 1,
        n_embd: 6,
        intermediate_size: 5,
        block_size: 5,
        ..LlamaConfig::small(11)
    };
    let mut models: Vec<Box<dyn Module>> = vec![
        Box::new(Gpt::new(gpt).expect("valid")),
        Box::new(Gpt::without_attention(gpt).expect("valid")),
        Box::new(Llama::new(llama).expect("valid")),
        Box::new(nn::Sequential::mlp(&[3, 1, 2], nn::Layer::ReLU).expect("valid")),
    ];
    llama.tie_word_embeddings = true;
    models.push(Box::new(Llama::new(llama).expect("valid")));
    for model in &models {
        let tree = model.named_parameters();
        assert_eq!(declared_by_forward(model.as_ref(), 2), tree, "{}", model.describe());
        let values: Vec<usize> = model.parameter_values().iter().map(|(_, _, v)| v.len()).collect();
        let sizes: Vec<usize> = tree.iter().map(|(_, s)| s.iter().product()).collect();
        assert_eq!(values, sizes, "{}", model.describe());
    }
    let without = Gpt::without_attention(gpt).expect("valid").named_parameters();
    assert!(
        without.iter().all(|(n, _)| !n.contains("ln_1") && !n.contains("attn")),
        "a block without attention has no ln_1: {without:?}"
    );
}

#[test]
fn from_parameters_fills_the_tree_in_its_order_and_refuses_a_wrong_count() {
    let gpt = GptConfig {
        vocab_size: 7,
        block_size: 5,
        n_layer: 2,
        n_head: 1,
        n_embd: 3,
    };
    let model = Gpt::new(gpt).expect("valid");
    let values = model.parameter_values();
    let mut next = values.iter();
    let rebuilt = Gpt::from_parameters(gpt, |name, shape| {
        let (want, want_shape, v) = next.next().expect("no more parameters than the tree");
        assert_eq!((name, shape), (want.as_str(), want_shape.as_slice()));
        Ok(v.to_vec())
    })
    .expect("rebuilt");
    assert!(next.next().is_none(), "every parameter taken");
    assert_eq!(rebuilt, model);
    let short = Gpt::from_parameters(gpt, |_, shape| Ok(vec![0.0; shape.iter().product::<usize>() - 1]));
    assert!(matches!(short, Err(Error::Shape { .. })), "{short:?}");
    let llama = LlamaConfig {
        n_layer: 1,
        n_head: 2,
        n_kv_head: 1,
        n_embd: 4,
        intermediate_size: 3,
        block_size: 5,
        ..LlamaConfig::small(7)
    };
    let empty = Llama::empty(llama).expect("valid");
    assert_eq!(
        empty.named_parameters(),
        Llama::new(llama).expect("valid").named_parameters()
    );
    // Norms start at one; every matrix is left unallocated.
    assert!(
        empty
            .parameter_values()
            .iter()
            .filter(|(_, s, _)| s.len() == 2)
            .all(|(_, _, v)| v.is_empty()),
        "empty allocates no matrices"
    );
}
