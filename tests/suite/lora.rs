//! LoRA by declaration (`wgrad::nn::Lora`): adapters on a tiny Llama's
//! Linears, their gradients against f64 central differences, the frozen
//! base (no gradient, no optimizer state, unchanged by steps, a smaller
//! memory plan), and the declarations refused.

use crate::common;

use common::{assert_close, for_each_adapter, random_vec, rng};
use rand::Rng;
use wgrad::graph::{Executor, Graph};
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{Llama, LlamaConfig, LlamaVariant};
use wgrad::nn::{self, Criterion, CrossEntropyLoss, Lora, LoraConfig, Module, ParameterTree, RopeLayout};
use wgrad::optim::AdamW;
use wgrad::{Targets, Trainer};

const VOCAB: usize = 11;
const T: usize = 4;
const BATCH: usize = 2;

/// One layer, C 8, 2 query heads of 4 channels over 1 KV head, MLP 6,
/// untied head: every Linear a different shape.
fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: VOCAB,
        block_size: T,
        n_layer: 1,
        n_head: 2,
        n_kv_head: 1,
        n_embd: 8,
        intermediate_size: 6,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: LlamaVariant::Llama,
    }
}

fn tiny_llama() -> Llama {
    nn::manual_seed(5);
    Llama::new(tiny_config()).unwrap()
}

/// `model` with every adapter's B set to small random values (PEFT's init
/// leaves B zero, so A's gradient would be zero and the path invisible).
fn with_random_b(mut model: Lora<Llama>, seed: u64) -> Lora<Llama> {
    let mut r = rng(seed);
    model
        .visit_mut("", &mut |name, _, values| {
            if name.ends_with("lora_B.weight") {
                *values = random_vec(&mut r, values.len(), -0.5, 0.5);
            }
            Ok(())
        })
        .unwrap();
    model
}

fn batch(seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut r = rng(seed);
    let ids: Vec<u32> = (0..BATCH * T).map(|_| r.random_range(0..VOCAB as u32)).collect();
    let targets = ids.iter().map(|&i| (i * 3 + 1) % VOCAB as u32).collect();
    (ids, targets)
}

#[test]
fn all_linear_targets_every_linear_but_the_head() {
    let lora = Lora::new(tiny_llama(), LoraConfig::new(2, 4.0, &["all-linear"])).unwrap();
    let modules: Vec<&str> = lora.adapters().iter().map(|a| a.module.as_str()).collect();
    let layer = |p: &str| format!("model.layers.0.{p}");
    let want: Vec<String> = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    .iter()
    .map(|p| layer(p))
    .collect();
    assert_eq!(modules, want);
    // A [r, in], B [out, r]; k and v project to the one KV head (4).
    let k = &lora.adapters()[1];
    assert_eq!((k.in_features, k.out_features, k.a.len(), k.b.len()), (8, 4, 16, 8));
    // PEFT's init: A within kaiming-uniform(a=√5)'s bound 1/√in, not all
    // zero; B zero.
    for a in lora.adapters() {
        let bound = 1.0 / (a.in_features as f32).sqrt();
        assert!(
            a.a.iter().all(|v| v.abs() <= bound) && a.a.iter().any(|&v| v != 0.0),
            "{}",
            a.module
        );
        assert!(a.b.iter().all(|&v| v == 0.0), "{}", a.module);
    }
    let names: Vec<String> = lora.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.lora_A.weight".to_string()));
    assert!(names.contains(&"model.layers.0.mlp.down_proj.lora_B.weight".to_string()));
    // 2·(8+8) + 2·(8+4)·2 + 2·(8+8) + 2·(8+6)·2 + 2·(6+8) = 32+48+32+56+28.
    assert_eq!(lora.trainable_parameters(), 196);
    assert_eq!(lora.num_parameters(), tiny_llama().num_parameters() + 196);
}

#[test]
fn target_names_match_module_suffixes() {
    let lora = Lora::new(
        tiny_llama(),
        LoraConfig::parse("r=1,alpha=2,targets=q_proj,mlp.up_proj").unwrap(),
    )
    .unwrap();
    let modules: Vec<&str> = lora.adapters().iter().map(|a| a.module.as_str()).collect();
    assert_eq!(
        modules,
        ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]
    );
    assert_eq!(lora.config.scale(), 2.0);
    // GPT-2's names: c_attn, c_proj (attention's and the MLP's), c_fc.
    nn::manual_seed(1);
    let gpt = wgrad::models::Gpt::new(wgrad::models::GptConfig {
        vocab_size: 13,
        block_size: 4,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
    })
    .unwrap();
    let lora = Lora::new(gpt, LoraConfig::new(2, 2.0, &["c_attn", "c_proj", "c_fc"])).unwrap();
    let modules: Vec<&str> = lora.adapters().iter().map(|a| a.module.as_str()).collect();
    assert_eq!(
        modules,
        ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"]
    );
}

#[test]
fn bad_declarations_are_clear_errors() {
    let err = |config: LoraConfig| Lora::new(tiny_llama(), config).unwrap_err().to_string();
    let e = err(LoraConfig::new(2, 4.0, &["q_proj", "c_attn"]));
    assert!(e.contains("`c_attn` matches no Linear"), "{e}");
    let e = err(LoraConfig::new(0, 4.0, &["q_proj"]));
    assert!(e.contains("at least 1"), "{e}");
    // down_proj is [8, 6]: rank 7 is too large for it.
    let e = err(LoraConfig::new(7, 4.0, &["down_proj"]));
    assert!(
        e.contains("rank 7 exceeds `model.layers.0.mlp.down_proj` [8, 6]: at most 6"),
        "{e}"
    );
    let e = err(LoraConfig {
        dropout: 1.0,
        ..LoraConfig::new(2, 4.0, &["all-linear"])
    });
    assert!(e.contains("dropout 1 is not in [0, 1)"), "{e}");
    for (spec, says) in [
        ("alpha=4", "no rank"),
        ("r=2,beta=3", "unknown key `beta`"),
        ("r=two", "not a whole number"),
        ("r=2,dropout=1.5", "not in [0, 1)"),
        ("r=2,q_proj", "not key=value"),
    ] {
        let e = LoraConfig::parse(spec).unwrap_err().to_string();
        assert!(e.contains(says), "{spec}: {e}");
    }
    let parsed = LoraConfig::parse("r=16,alpha=32,dropout=0.05,targets=all-linear").unwrap();
    assert_eq!(
        parsed,
        LoraConfig {
            dropout: 0.05,
            ..LoraConfig::new(16, 32.0, &["all-linear"])
        }
    );
}

/// d loss / d (every adapter value) on the GPU against f64 central
/// differences of the graph's reference, with B random (so both A's and
/// B's gradients are non-zero); the base parameters are frozen and get
/// no gradient node at all.
#[test]
fn lora_gradients_match_central_differences() {
    for_each_adapter("lora_gradients_match_central_differences", |k| {
        let model = with_random_b(Lora::new(tiny_llama(), LoraConfig::new(2, 3.0, &["all-linear"]))?, 40);
        let mut g = Graph::new();
        let ids = model.input(&mut g, BATCH)?;
        let logits = model.forward(&mut g, ids, "")?;
        let criterion = Criterion::from(CrossEntropyLoss);
        let labels = criterion.targets(&mut g, logits)?;
        let loss = criterion.loss(&mut g, logits, labels)?;
        let grads = g.backward(loss)?;
        let (frozen, trainable): (Vec<_>, Vec<_>) = g.parameters().into_iter().partition(|&p| g.is_frozen(p));
        assert_eq!(trainable.len(), 14, "an A and a B per adapted Linear");
        assert!(trainable.iter().all(|&p| g.get(p).unwrap().name.contains(".lora_")));
        assert!(
            frozen.iter().all(|&p| grads.get(p).is_none()),
            "a frozen parameter has a gradient"
        );
        let reference = g.clone();
        let mut exec = Executor::new(k.clone(), g, &[loss], Some(grads), None)?;
        let (ids_v, targets) = batch(3);
        exec.set_labels(ids, &ids_v)?;
        exec.set_labels(labels, &targets)?;
        exec.train_step(true, false, false)?;
        let feeds: Vec<_> = [(ids, &ids_v), (labels, &targets)]
            .iter()
            .map(|(t, v)| (*t, v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>()))
            .collect();
        for p in trainable {
            let got = exec.read_grad(p)?;
            let name = reference.get(p).unwrap().name.clone();
            let mut want = Vec::with_capacity(got.len());
            for i in 0..got.len() {
                let mut plus = reference.clone();
                let mut minus = reference.clone();
                let a = plus.parameter_init_mut(p).unwrap();
                a[i] += 1e-3;
                let up = a[i];
                let b = minus.parameter_init_mut(p).unwrap();
                b[i] -= 1e-3;
                let step = f64::from(up) - f64::from(b[i]);
                let lp = plus.evaluate_f64(&[loss], &feeds)?[0][0];
                let lm = minus.evaluate_f64(&[loss], &feeds)?[0][0];
                want.push(((lp - lm) / step) as f32);
            }
            assert!(got.iter().any(|&v| v.abs() > 1e-4), "{name}: gradient all but zero");
            // f32 GPU gradients against f64 differences of an f32-perturbed
            // value (step 2e-3): a few 1e-4 relative.
            assert_close(&format!("d loss / d {name}"), &got, &want, 2e-4, 1e-2);
        }
        Ok(())
    });
}

/// Five AdamW steps (weight decay on): the base stays bit for bit what it
/// was, the adapters move; the arenas hold gradients and two moments for
/// the adapters only, as the plan and the optimizer's state say.
#[test]
fn the_frozen_base_has_no_gradient_or_state_and_does_not_change() {
    for_each_adapter("the_frozen_base_has_no_gradient_or_state_and_does_not_change", |k| {
        let base = tiny_llama();
        let model = Lora::new(base.clone(), LoraConfig::new(2, 4.0, &["all-linear"]))?;
        let optimizer: OptimizerConfig = AdamW::new(1e-2).weight_decay(0.1).into();
        let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, optimizer, BATCH)?;
        let full = Trainer::new(k.clone(), &base, CrossEntropyLoss, optimizer, BATCH)?;
        let before = t.executor().parameters()?;
        for s in 0..5 {
            let (ids, targets) = batch(100 + s);
            t.zero_grad();
            t.forward_ids(&ids)?;
            t.loss(Targets::Classes(&targets))?;
            t.backward()?;
            t.step()?;
        }
        let after = t.executor().parameters()?;
        let mut moved = 0;
        for ((name, _, b), (_, _, a)) in before.iter().zip(&after) {
            if name.contains(".lora_") {
                moved += usize::from(a != b);
            } else {
                assert_eq!(a, b, "frozen `{name}` changed");
                assert!(t.executor().read_grad_named(name).is_err(), "`{name}` has a gradient");
            }
        }
        assert_eq!(moved, 14, "every adapter matrix trains");
        let plan = t.executor().plan();
        let adapter_words: usize = model.adapters().iter().map(|a| a.a.len() + a.b.len()).sum();
        assert!(plan.trainable_len >= adapter_words && plan.trainable_len < plan.param_arena_len);
        let state = t.executor().optimizer_state()?;
        assert_eq!(state.len(), 2 * 14, "exp_avg and exp_avg_sq of the adapters only");
        assert!(state.iter().all(|(name, _, _)| name.contains(".lora_")));
        // Parameters once, gradients and two moments of the adapters only:
        // well below full fine-tuning's four copies of everything.
        let (lora_bytes, full_bytes) = (t.executor().peak_bytes(), full.executor().peak_bytes());
        let arena = 4 * plan.param_arena_len as u64;
        let slots = plan.input_bytes + plan.slot_bytes;
        assert_eq!(lora_bytes, arena + 3 * 4 * plan.trainable_len as u64 + slots);
        // Padded to 256-byte alignment (SwiftShader under WebGPU's limits)
        // this toy model's adapters take as many words as its base: the
        // comparison holds only where the laid-out adapters are smaller.
        if 2 * plan.trainable_len >= plan.param_arena_len {
            return Ok(());
        }
        assert!(
            lora_bytes < full_bytes,
            "{lora_bytes} B with LoRA, {full_bytes} B without"
        );
        Ok(())
    });
}

mod peft_folders {
    use super::*;
    use crate::gpt_folder::{fixture, TempDir};
    use std::path::Path;
    use wgrad::infer::Predictor;
    use wgrad::io::checkpoint;
    use wgrad::io::llama_folder::load_llama_folder;
    use wgrad::io::peft;
    use wgrad::optim::SGD;

    const FOLDER: &str = "peft-tiny-llama-lora";

    fn base() -> Llama {
        load_llama_folder(fixture("hf-tiny-llama")).unwrap().model
    }

    fn files() -> (Vec<u8>, Vec<u8>) {
        let dir = fixture(FOLDER);
        (
            std::fs::read(dir.join(peft::CONFIG_FILE)).unwrap(),
            std::fs::read(dir.join(peft::WEIGHTS_FILE)).unwrap(),
        )
    }

    /// The adapter PEFT saved (scripts/make_peft_fixture.py): logits, loss
    /// and every adapter gradient equal PEFT's.
    #[test]
    fn an_adapter_peft_saved_gives_pefts_logits_and_gradients() {
        let reference = checkpoint::load(fixture("peft-tiny-llama-lora-reference.safetensors")).unwrap();
        let as_u32 = |name: &str| -> Vec<u32> { reference.get(name).unwrap().data.iter().map(|&v| v as u32).collect() };
        let (ids, targets) = (as_u32("ids"), as_u32("targets"));
        let adapter = peft::read(fixture(FOLDER)).unwrap();
        assert_eq!(adapter.config.r, 4);
        assert_eq!(adapter.config.alpha, 8.0);
        assert_eq!(adapter.config.dropout, 0.05);
        assert_eq!(adapter.base_model.as_deref(), Some("tests/fixtures/hf-tiny-llama"));
        let mut model = adapter.apply(base()).unwrap();
        // PEFT took its gradients in eval(), without its lora_dropout 0.05.
        model.config.dropout = 0.0;
        // 2 layers × q, v, o, up, down; k and gate carry none.
        assert_eq!(model.adapters().len(), 10);
        assert!(model
            .adapters()
            .iter()
            .all(|a| !a.module.ends_with("k_proj") && !a.module.ends_with("gate_proj")));
        for_each_adapter("an adapter peft saved", |k| {
            let logits = Predictor::new(k.clone(), &model, 2)?.outputs_ids(&ids)?;
            // Logits within ±4: float32 sums in another order, a few ulps.
            assert_close("logits", &logits, &reference.get("logits").unwrap().data, 3e-5, 1e-5);
            let mut t = Trainer::new(k.clone(), &model, CrossEntropyLoss, SGD::new(0.0), 2)?;
            t.zero_grad();
            t.forward_ids(&ids)?;
            t.loss(Targets::Classes(&targets))?;
            let loss = t.forward_backward(true)?.unwrap_or(f32::NAN);
            assert_close("loss", &[loss], &reference.get("loss").unwrap().data, 1e-5, 1e-5);
            let mut checked = 0;
            for (name, _, _) in t.executor().parameters()? {
                let Some(want) = reference.get(&format!("grad.base_model.model.{name}")) else {
                    assert!(!name.contains(".lora_"), "no reference gradient for {name}");
                    continue;
                };
                let got = t.executor().read_grad_named(&name)?;
                // Gradients up to ~0.3: f32 sums of 32 rows in another order.
                assert_close(&format!("d loss / d {name}"), &got, &want.data, 2e-6, 1e-4);
                checked += 1;
            }
            assert_eq!(checked, 20);
            Ok(())
        });
    }

    #[test]
    fn a_saved_adapter_reads_back_with_pefts_names() {
        let tmp = TempDir::new("peft");
        let model = with_random_b(
            Lora::new(tiny_llama(), LoraConfig::new(2, 5.0, &["q_proj", "down_proj"])).unwrap(),
            9,
        );
        let dir = tmp.path("adapter");
        peft::save_lora(&dir, &model, "tiny-llama").unwrap();
        let saved = checkpoint::load(dir.join(peft::WEIGHTS_FILE)).unwrap();
        let names: Vec<&str> = saved.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
                "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            ]
        );
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(peft::CONFIG_FILE)).unwrap()).unwrap();
        for (key, value) in [
            ("peft_type", serde_json::json!("LORA")),
            ("r", serde_json::json!(2)),
            ("lora_alpha", serde_json::json!(5.0)),
            ("lora_dropout", serde_json::json!(0.0)),
            ("target_modules", serde_json::json!(["q_proj", "down_proj"])),
            ("bias", serde_json::json!("none")),
            ("task_type", serde_json::json!("CAUSAL_LM")),
            ("base_model_name_or_path", serde_json::json!("tiny-llama")),
        ] {
            assert_eq!(config[key], value, "{key}");
        }
        let back = peft::load(tiny_llama(), &dir).unwrap();
        assert_eq!(back.adapters(), model.adapters());
        assert_eq!(back.config, model.config);
    }

    /// Each broken adapter is refused by [`peft::parse`] or when applied,
    /// with a reason naming what is wrong.
    #[test]
    fn bad_adapters_are_clear_errors() {
        let (config, weights) = files();
        let json: serde_json::Value = serde_json::from_slice(&config).unwrap();
        let edited = |key: &str, value: serde_json::Value| {
            let mut j = json.clone();
            j[key] = value;
            serde_json::to_vec(&j).unwrap()
        };
        let dir = Path::new("adapter");
        let refused = |config: &[u8], weights: &[u8]| -> String {
            match peft::parse(config, weights, dir) {
                Err(e) => e.to_string(),
                Ok(adapter) => adapter.apply(base()).map(|_| ()).unwrap_err().to_string(),
            }
        };
        let cases: Vec<(Vec<u8>, Vec<u8>, &str)> = vec![
            (
                edited("use_dora", true.into()),
                weights.clone(),
                "DoRA (use_dora) is not implemented",
            ),
            (
                edited("use_rslora", true.into()),
                weights.clone(),
                "use_rslora) is not implemented",
            ),
            (edited("bias", "all".into()), weights.clone(), "bias `all`"),
            (edited("peft_type", "IA3".into()), weights.clone(), "peft_type `IA3`"),
            (edited("r", 3.into()), weights.clone(), "are not [3, in] and [out, 3]"),
            (edited("r", 0.into()), weights.clone(), "at least 1"),
            (
                edited("target_modules", ".*proj".into()),
                weights.clone(),
                "regular expression",
            ),
            (
                edited(
                    "target_modules",
                    serde_json::json!(["q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "c_fc"]),
                ),
                weights.clone(),
                "`c_fc` matches no Linear",
            ),
            (
                edited(
                    "target_modules",
                    serde_json::json!(["q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "k_proj"]),
                ),
                weights.clone(),
                "no adapter for `model.layers.0.self_attn.k_proj`",
            ),
            (
                edited("target_modules", serde_json::json!(["q_proj", "v_proj"])),
                weights.clone(),
                "not a targeted Linear",
            ),
            (
                config.clone(),
                weights[..weights.len() - 7].to_vec(),
                "adapter_model.safetensors",
            ),
            (b"{".to_vec(), weights.clone(), "not JSON"),
        ];
        for (config, weights, says) in cases {
            let e = refused(&config, &weights);
            assert!(e.contains(says), "want `{says}` in: {e}");
        }
        // An adapter for another base: the fixture's layers are 32 wide,
        // the tiny Llama here 8.
        let e = peft::parse(&config, &weights, dir)
            .unwrap()
            .apply(tiny_llama())
            .unwrap_err()
            .to_string();
        assert!(e.contains("the base Linear is"), "{e}");
    }
}

/// Ten clipped AdamW steps of a LoRA Llama (llama_parallel.rs's model and
/// batches, adapters on every Linear) under data parallel, ZeRO-2 and the
/// pipeline equal one device's: only adapter gradients are all-reduced
/// (the gradient arena holds nothing else), relative 1e-5 on the losses;
/// tensor parallel likewise, each adapter split with its Linear.
mod engines {
    use super::*;
    use crate::llama_parallel::{batches, model, optimizer};
    use crate::parallel::open_groups;
    use wgrad::parallel::data::{DataParallel, Split};
    use wgrad::parallel::engine::{Holding, TrainEngine};
    use wgrad::parallel::pipeline::{Pipeline, Schedule};
    use wgrad::parallel::tensor::TensorParallel;
    use wgrad::parallel::zero::{Zero, ZeroStage};
    use wgrad::parallel::DeviceSelection;

    const BATCH: usize = 4;

    fn lora_model() -> Lora<Llama> {
        nn::manual_seed(21);
        with_random_b(
            Lora::new(model(false), LoraConfig::new(2, 4.0, &["all-linear"])).unwrap(),
            77,
        )
    }

    fn assert_losses(what: &str, got: &[f32], want: &[f32]) {
        for (s, (g, w)) in got.iter().zip(want).enumerate() {
            // Sums split over devices and added in another order, through
            // ten steps: relative 1e-5 on a loss of about 3.4.
            assert_close(&format!("{what} step {s}"), &[*g], &[*w], 0.0, 1e-5);
        }
        assert_eq!(got.len(), want.len(), "{what}: steps");
    }

    #[test]
    fn lora_trains_alike_under_data_zero_and_pipeline_parallel() {
        let groups = open_groups(
            "lora_trains_alike_under_data_zero_and_pipeline_parallel",
            &[DeviceSelection::Count(2)],
        );
        let Some(group) = groups.first() else { return };
        let m = lora_model();
        let (_, want, _) = common::train_on_one_device(&group.members()[0], &m, optimizer(), BATCH, &batches());
        let mut dp =
            DataParallel::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, Split::Rows(vec![1, 3])).unwrap();
        let trainable = dp.replicas()[0].executor().plan().trainable_len;
        // Each adapter matrix aligned to 256 B in the group's arenas: still
        // less than the whole arena.
        assert!(trainable < dp.replicas()[0].executor().plan().param_arena_len);
        let got: Vec<f32> = batches()
            .iter()
            .map(|(ids, t)| dp.step(ids, Targets::Classes(t), true).unwrap().unwrap())
            .collect();
        assert_losses("data parallel", &got, &want);
        let mut zero = Zero::new(
            group,
            &m,
            CrossEntropyLoss,
            optimizer(),
            BATCH,
            ZeroStage::Gradients,
            None,
        )
        .unwrap();
        let got: Vec<f32> = batches()
            .iter()
            .map(|(ids, t)| zero.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
            .collect();
        assert_losses("ZeRO-2", &got, &want);
        // What a run saves: the adapters from the shards and the frozen base.
        let names: Vec<String> = TrainEngine::parameters(&zero)
            .unwrap()
            .into_iter()
            .map(|(n, _, _)| n)
            .collect();
        assert!(m.named_parameters().iter().all(|(n, _)| names.contains(n)), "{names:?}");
        let mut p = Pipeline::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, 2, Schedule::OneFOneB).unwrap();
        let got: Vec<f32> = batches()
            .iter()
            .map(|(ids, t)| p.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
            .collect();
        assert_losses("pipeline", &got, &want);
    }

    /// Tensor parallel over 2 devices: each adapter splits with its base
    /// Linear (B by rows beside a column-parallel q, k, v, gate and up; A
    /// by columns beside a row-parallel o and down; the other matrix
    /// replicated, its gradient summed over the devices), and ten steps
    /// equal one device's, the adapters gathered whole at the end.
    #[test]
    fn lora_trains_alike_under_tensor_parallel() {
        let groups = open_groups("lora_trains_alike_under_tensor_parallel", &[DeviceSelection::Count(2)]);
        let Some(group) = groups.first() else { return };
        let m = lora_model();
        let (single, want, _) = common::train_on_one_device(&group.members()[0], &m, optimizer(), BATCH, &batches());
        let mut tp = TensorParallel::new(group, &m, CrossEntropyLoss, optimizer(), BATCH).unwrap();
        // 4 query heads of 4 channels over 2 devices: 8 rows of q_proj's B
        // each; o_proj's A by its 8 input columns each.
        let layer = "model.layers.0";
        assert_eq!(
            common::rows_held(&tp, &format!("{layer}.self_attn.q_proj.lora_B.weight")),
            [8, 8]
        );
        assert_eq!(
            common::columns_held(&tp, &format!("{layer}.self_attn.o_proj.lora_A.weight")),
            [8, 8]
        );
        assert_eq!(
            common::rows_held(&tp, &format!("{layer}.mlp.up_proj.lora_B.weight")),
            [11, 11]
        );
        assert_eq!(
            common::columns_held(&tp, &format!("{layer}.mlp.down_proj.lora_A.weight")),
            [11, 11]
        );
        let Holding::Stages(spread, _) = tp.holding() else {
            panic!("tensor parallel holds the model across stages")
        };
        let replicated: Vec<&str> = spread.shared().iter().map(|s| s.name.as_str()).collect();
        assert!(
            replicated.iter().all(|n| n.contains(".lora_")),
            "only adapter gradients are summed over the devices: {replicated:?}"
        );
        assert_eq!(
            replicated.len(),
            14,
            "the unsplit A or B of every adapter: {replicated:?}"
        );
        let got: Vec<f32> = batches()
            .iter()
            .map(|(ids, t)| tp.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
            .collect();
        assert_losses("tensor parallel", &got, &want);
        let adapters = |p: Vec<(String, Vec<usize>, Vec<f32>)>| -> Vec<_> {
            p.into_iter().filter(|(n, _, _)| n.contains(".lora_")).collect()
        };
        let (got, want) = (
            adapters(TrainEngine::parameters(&tp).unwrap()),
            adapters(single.executor().parameters().unwrap()),
        );
        // Ten AdamW steps of lr 1e-2-scale updates, sums split over two
        // devices: 1e-5 absolute on adapters of |p| < 1.
        common::assert_same_parameters("tensor parallel adapters", &got, &want, 1e-5, 1e-4);
    }
}

/// Adapters under ZeRO-2 and ZeRO-3 stage by stage, and with dropout
/// under every engine.
mod sharded_and_dropout {
    use super::*;
    use crate::llama_parallel::{batches, model, optimizer};
    use crate::parallel::open_groups;
    use wgrad::graph::Precision;
    use wgrad::parallel::data::{DataParallel, Split};
    use wgrad::parallel::engine::{Strategy, TrainEngine};
    use wgrad::parallel::memory::{strategy_memory, Planning};
    use wgrad::parallel::pipeline::{Pipeline, Schedule};
    use wgrad::parallel::tensor::TensorParallel;
    use wgrad::parallel::zero::{Zero, ZeroStage};
    use wgrad::parallel::zero_stages::ZeroStages;
    use wgrad::parallel::DeviceSelection;
    use wgrad::Examples;

    const BATCH: usize = 4;

    fn lora_model(dropout: f32) -> Lora<Llama> {
        nn::manual_seed(21);
        let mut m = with_random_b(
            Lora::new(model(false), LoraConfig::new(2, 4.0, &["all-linear"])).unwrap(),
            77,
        );
        m.config.dropout = dropout;
        m
    }

    /// Relative 1e-5 on losses of about 3.4: sums split over devices and
    /// added in another order, through ten steps.
    fn assert_losses(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: steps");
        for (s, (g, w)) in got.iter().zip(want).enumerate() {
            assert_close(&format!("{what} step {s}"), &[*g], &[*w], 0.0, 1e-5);
        }
    }

    fn adapters(params: Vec<(String, Vec<usize>, Vec<f32>)>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        params.into_iter().filter(|(n, _, _)| n.contains(".lora_")).collect()
    }

    /// Ten clipped AdamW steps under ZeRO-2 and ZeRO-3 stage by stage equal
    /// one device's: the shards (the gradients reduce-scattered, the state
    /// and at stage 3 the parameters) cover the adapters only, the frozen
    /// base stays whole on each device and unchanged, and what `--dry-run`
    /// plans equals what the engine allocates.
    #[test]
    fn lora_trains_alike_under_zero_stage_by_stage() {
        let groups = open_groups(
            "lora_trains_alike_under_zero_stage_by_stage",
            &[DeviceSelection::Count(2)],
        );
        let Some(group) = groups.first() else { return };
        let m = lora_model(0.0);
        let (single, want, _) = common::train_on_one_device(&group.members()[0], &m, optimizer(), BATCH, &batches());
        let adapter_values: usize = m.adapters().iter().map(|a| a.a.len() + a.b.len()).sum();
        let planning = Planning {
            criterion: CrossEntropyLoss.into(),
            optimizer: optimizer(),
            batch: BATCH,
            micro_batches: 1,
            device_alignment: 256,
            precision: Precision::F32,
            checkpoint_activations: false,
        };
        for stage in [ZeroStage::Gradients, ZeroStage::Parameters] {
            let what = format!("ZeRO-{} stage by stage", stage.number());
            let mut z = ZeroStages::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, stage, None).unwrap();
            let sharded: usize = z.shards().iter().map(|r| r.len()).sum();
            assert_eq!(sharded, adapter_values, "{what}: only the adapters are sharded");
            let planned = strategy_memory(&m, Strategy::Zero(stage), 2, &planning).unwrap();
            assert_eq!(planned, TrainEngine::memory(&z), "{what}: planned against allocated");
            let got: Vec<f32> = batches()
                .iter()
                .map(|(ids, t)| z.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
                .collect();
            assert_losses(&what, &got, &want);
            let (got, want) = (
                TrainEngine::parameters(&z).unwrap(),
                single.executor().parameters().unwrap(),
            );
            // The base: what it was, bit for bit.
            for (name, _, values) in m.parameter_values() {
                if !name.contains(".lora_") {
                    let (_, _, now) = got.iter().find(|(n, _, _)| *n == name).unwrap();
                    assert_eq!(now.as_slice(), values, "{what}: frozen `{name}` changed");
                }
            }
            // Adapters of |p| < 1 after ten steps: 1e-5 absolute.
            common::assert_same_parameters(&what, &adapters(got), &adapters(want), 1e-5, 1e-4);
        }
    }

    /// Dropout 0.1 on every adapter's input: each engine draws one
    /// device's masks (its rows' under data parallel and ZeRO (whole-arena
    /// and stage by stage), its
    /// micro-batches' in the pipeline, its columns' beside a row-parallel
    /// Linear), so ten steps give one device's losses; evaluation draws
    /// none, as the dropout-free model's loss shows.
    #[test]
    fn lora_dropout_draws_one_devices_masks_under_every_engine() {
        let groups = open_groups(
            "lora_dropout_draws_one_devices_masks_under_every_engine",
            &[DeviceSelection::Count(2)],
        );
        let Some(group) = groups.first() else { return };
        let (plain, m) = (lora_model(0.0), lora_model(0.1));
        let k = &group.members()[0];
        let (ids, targets) = &batches()[0];
        let evaluate = |model: &Lora<Llama>| {
            let mut t = Trainer::new(k.clone(), model, CrossEntropyLoss, optimizer(), BATCH).unwrap();
            t.evaluate_loss(Examples::Ids(ids), Targets::Classes(targets)).unwrap()
        };
        // One graph copies x where the other has no node: one rounding apart at most.
        assert_close("evaluation", &[evaluate(&m)], &[evaluate(&plain)], 0.0, 1e-6);
        let (_, without, _) = common::train_on_one_device(k, &plain, optimizer(), BATCH, &batches());
        let (mut single, want, _) = common::train_on_one_device(k, &m, optimizer(), BATCH, &batches());
        assert!(
            (want[0] - without[0]).abs() > 1e-5,
            "dropout changes the training loss: {} and {}",
            want[0],
            without[0]
        );
        let mut engines: Vec<(&str, Box<dyn TrainEngine>)> = vec![
            (
                "tensor parallel",
                Box::new(TensorParallel::new(group, &m, CrossEntropyLoss, optimizer(), BATCH).unwrap()),
            ),
            (
                "data parallel",
                Box::new(
                    DataParallel::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, Split::Rows(vec![1, 3]))
                        .unwrap(),
                ),
            ),
            (
                "ZeRO-2 stage by stage",
                Box::new(
                    ZeroStages::new(
                        group,
                        &m,
                        CrossEntropyLoss,
                        optimizer(),
                        BATCH,
                        ZeroStage::Gradients,
                        Some(vec![3, 1]),
                    )
                    .unwrap(),
                ),
            ),
            (
                "pipeline",
                Box::new(Pipeline::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, 2, Schedule::GPipe).unwrap()),
            ),
            (
                "ZeRO-1",
                Box::new(
                    Zero::new(
                        group,
                        &m,
                        CrossEntropyLoss,
                        optimizer(),
                        BATCH,
                        ZeroStage::OptimizerState,
                        Some(vec![1, 3]),
                    )
                    .unwrap(),
                ),
            ),
        ];
        let after = single
            .evaluate_loss(Examples::Ids(ids), Targets::Classes(targets))
            .unwrap();
        for (what, engine) in &mut engines {
            let got: Vec<f32> = batches()
                .iter()
                .map(|(ids, t)| {
                    engine
                        .step(Examples::Ids(ids), Targets::Classes(t), true)
                        .unwrap()
                        .unwrap()
                })
                .collect();
            assert_losses(what, &got, &want);
            let evaluated = engine
                .evaluate_loss(Examples::Ids(ids), Targets::Classes(targets))
                .unwrap();
            assert_close(&format!("{what}: evaluation"), &[evaluated], &[after], 0.0, 1e-5);
        }
    }
}

/// What `wgrad train --dry-run` prints, planned without a device, equals
/// what a LoRA trainer allocates, and holds gradients and AdamW's two
/// moments for the adapters only: the frozen base counts once.
#[test]
fn the_memory_plan_counts_the_frozen_base_once() {
    use wgrad::graph::Precision;
    use wgrad::parallel::engine::{Strategy, TrainEngine};
    use wgrad::parallel::memory::{strategy_memory, Planning};
    for_each_adapter("the_memory_plan_counts_the_frozen_base_once", |k| {
        let base = tiny_llama();
        let lora = Lora::new(base.clone(), LoraConfig::new(2, 4.0, &["all-linear"]))?;
        let optimizer: OptimizerConfig = AdamW::new(1e-3).into();
        let planning = Planning {
            criterion: CrossEntropyLoss.into(),
            optimizer,
            batch: BATCH,
            micro_batches: 1,
            device_alignment: k.device().limits().min_storage_buffer_offset_alignment,
            precision: Precision::F32,
            checkpoint_activations: false,
        };
        let planned = strategy_memory(&lora, Strategy::Single, 1, &planning)?;
        let trainer = Trainer::new(k.clone(), &lora, CrossEntropyLoss, optimizer, BATCH)?;
        assert_eq!(planned, TrainEngine::memory(&trainer), "planned against allocated");
        let full = strategy_memory(&base, Strategy::Single, 1, &planning)?;
        let plan = trainer.executor().plan();
        assert_eq!(planned.gradients, 4 * plan.trainable_len as u64);
        assert_eq!(planned.optimizer_state, 2 * planned.gradients);
        assert_eq!(planned.parameters, 4 * plan.param_arena_len as u64);
        // On an adapter that aligns every parameter to 256 bytes
        // (SwiftShader under WebGPU's limits) this toy model's 14 adapter
        // matrices pad to as many words as its whole base: LoRA saves
        // memory only where the laid-out adapters are smaller than the base.
        if 2 * plan.trainable_len >= plan.param_arena_len {
            return Ok(());
        }
        assert!(planned.gradients < full.gradients && planned.parameters >= full.parameters);
        assert!(
            planned.total() < full.total(),
            "{planned:?} against full fine-tuning's {full:?}"
        );
        Ok(())
    });
}
