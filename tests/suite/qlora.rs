//! QLoRA (`nn::BaseStorage`): LoRA adapters over a frozen base kept on the
//! GPU as a GGUF file stores it (tests/fixtures/gguf-llama.gguf: a 2-layer
//! Llama whose matrices are Q4_0, Q4_1 and Q8_0 blocks, with F32, F16 and
//! BF16 ones beside them) or in f16. The forward runs the quantized
//! products, the backward the transposed one (dX = dY·W through the
//! blocks); the adapters' gradients against f64 central differences, a
//! run equal to LoRA over the same base de-quantized to f32, activation
//! checkpointing and f16 activations over it, the memory planned against
//! the memory allocated, the base's matrices found from the module tree,
//! and the 1B presets' parameter counts against transformers' configs.

use crate::common;
use crate::gpt_folder::fixture;

use std::collections::HashMap;
use std::sync::Arc;

use common::{assert_close, for_each_adapter, random_vec, rng};
use rand::Rng;
use wgrad::graph::{DType, Executor, Graph, PlanOptions, Precision};
use wgrad::io::gguf_model::GgufModel;
use wgrad::kernels::OptimizerConfig;
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{
    self, BaseStorage, CausalLm, Criterion, CrossEntropyLoss, Lora, LoraConfig, Module, ParameterTree, QuantizedWeights,
};
use wgrad::optim::{AdamW, LossScaling};
use wgrad::parallel::engine::{Strategy, TrainEngine};
use wgrad::parallel::memory::{strategy_memory, Planning};
use wgrad::{Kernels, Targets, Trainer};

/// Windows of 9 tokens, 3 a batch: 27 rows (not a multiple of the
/// kernels' 8-row groups).
const T: usize = 9;
const BATCH: usize = 3;

/// The fixture's Llama de-quantized to f32, and its block-quantized
/// matrices by parameter name.
fn fixture_model() -> (Llama, Arc<QuantizedWeights>) {
    let file = GgufModel::open(fixture("gguf-llama.gguf")).unwrap();
    let model = file.to_llama().unwrap();
    let values: HashMap<String, Vec<f32>> = model
        .parameter_values()
        .into_iter()
        .map(|(name, _, v)| (name, v.to_vec()))
        .collect();
    // Windows of T of its 32 positions (as `train --init` crops them).
    let config = LlamaConfig {
        block_size: T,
        ..model.config
    };
    let cropped = Llama::from_parameters(config, |name, _| Ok(values[name].clone())).unwrap();
    (cropped, Arc::new(file.quantized_weights().unwrap()))
}

/// Rank-4 adapters on every Linear but the head, over `base` stored as
/// `storage`, with B random (PEFT's zero B would hide A's gradient).
fn adapted(base: Llama, storage: BaseStorage) -> Lora<Llama> {
    nn::manual_seed(7);
    let mut model = Lora::new(base, LoraConfig::new(4, 8.0, &["all-linear"]))
        .unwrap()
        .with_base_storage(storage);
    let mut r = rng(70);
    model
        .visit_mut("", &mut |name, _, values| {
            if name.ends_with("lora_B.weight") {
                *values = random_vec(&mut r, values.len(), -0.3, 0.3);
            }
            Ok(())
        })
        .unwrap();
    model
}

fn batch(seed: u64, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut r = rng(seed);
    let ids: Vec<u32> = (0..BATCH * T).map(|_| r.random_range(0..vocab as u32)).collect();
    let targets = ids.iter().map(|&i| (i * 7 + 3) % vocab as u32).collect();
    (ids, targets)
}

fn optimizer() -> OptimizerConfig {
    AdamW::new(1e-2).weight_decay(0.1).clip_grad_norm(1.0).into()
}

/// `model` trained `steps` steps (clipped AdamW) on one batch, planned
/// with `options`: the trainer and each step's loss.
fn train(
    k: &Arc<Kernels>,
    model: &Lora<Llama>,
    options: PlanOptions,
    steps: u64,
) -> wgrad::Result<(Trainer, Vec<f32>)> {
    let mut optimizer = optimizer();
    if options.precision == Precision::F16 {
        optimizer = AdamW::new(1e-2)
            .weight_decay(0.1)
            .clip_grad_norm(1.0)
            .loss_scaling(LossScaling::default())
            .into();
    }
    let mut t = Trainer::with_blocks(k.clone(), model, CrossEntropyLoss, optimizer, BATCH, options)?;
    let mut losses = Vec::new();
    // One batch every step: the adapters fit it.
    let (ids, targets) = batch(200, model.vocab_size());
    for _ in 0..steps {
        t.zero_grad();
        t.forward_ids(&ids)?;
        t.loss(Targets::Classes(&targets))?;
        t.backward()?;
        losses.push(t.step_reading_loss()?);
    }
    Ok((t, losses))
}

/// Every matrix the file stores in a format the kernels read is declared
/// so (its words, not f32 values), frozen; the F16, BF16 and F32 ones and
/// the norms are f32 from the de-quantized model; the adapters are the
/// only trainable parameters; the arena holds the blocks.
#[test]
fn a_quantized_base_is_declared_as_its_blocks_and_frozen() {
    let (base, quantized) = fixture_model();
    let names: Vec<String> = quantized.keys().cloned().collect();
    // The token table (Q4_0), the untied head (Q4_1) and 8 of the 14
    // Linears (Q4_0, Q4_1, Q8_0); the rest are F32, F16 or BF16.
    assert_eq!(names.len(), 10, "{names:?}");
    let f32_base = adapted(base.clone(), BaseStorage::F32);
    let model = adapted(base, BaseStorage::Quantized(quantized.clone()));
    let mut g = Graph::new();
    let ids = model.input(&mut g, BATCH).unwrap();
    model.forward(&mut g, ids, "").unwrap();
    for p in g.parameters() {
        let node = g.get(p).unwrap();
        match quantized.get(&node.name) {
            Some(m) => assert_eq!(node.dtype, DType::Quant(m.format), "{}", node.name),
            None => assert_eq!(node.dtype, DType::F32, "{}", node.name),
        }
        assert_eq!(g.is_frozen(p), !node.name.contains(".lora_"), "{}", node.name);
    }
    for_each_adapter("qlora: declared as blocks", |k| {
        let planned = |m: &Lora<Llama>| -> wgrad::Result<_> {
            let t = Trainer::new(k.clone(), m, CrossEntropyLoss, optimizer(), BATCH)?;
            let plan = t.executor().plan();
            Ok((plan.param_arena_len, plan.trainable_len))
        };
        let ((q_arena, q_trainable), (f_arena, f_trainable)) = (planned(&model)?, planned(&f32_base)?);
        // Same adapters; the 10 quantized matrices take 0.56 (Q4_0) to
        // 1.06 (Q8_0) words per value rather than 1.
        assert_eq!(q_trainable, f_trainable);
        assert!(q_arena < f_arena, "{q_arena} words quantized, {f_arena} in f32");
        Ok(())
    });
}

/// d loss / d every adapter value on the GPU, through the quantized
/// products and their transposed backward: against the backward graph's
/// own f64 reference (which decodes the blocks) for every value, and
/// against f64 central differences for a few values of each matrix.
#[test]
fn qlora_gradients_match_central_differences() {
    let (base, quantized) = fixture_model();
    let model = adapted(base, BaseStorage::Quantized(quantized));
    for_each_adapter("qlora_gradients_match_central_differences", |k| {
        let mut g = Graph::new();
        let ids = model.input(&mut g, BATCH)?;
        let logits = model.forward(&mut g, ids, "")?;
        let criterion = Criterion::from(CrossEntropyLoss);
        let labels = criterion.targets(&mut g, logits)?;
        let loss = criterion.loss(&mut g, logits, labels)?;
        let grads = g.backward(loss)?;
        let trainable = g.trainable_parameters();
        assert_eq!(trainable.len(), 28, "an A and a B per adapted Linear");
        let transposed = g
            .nodes()
            .iter()
            .filter(|n| {
                matches!(
                    n.op,
                    wgrad::graph::Op::Matmul(wgrad::graph::MatmulOp::MatMul(wgrad::kernels::MatmulForm::AB))
                ) && matches!(g.get(n.inputs[1]).map(|w| w.dtype), Some(DType::Quant(_)))
            })
            .count();
        // dX through the head and each of the 8 quantized Linears (the
        // table's lookup has none).
        assert_eq!(transposed, 9, "transposed quantized products in the backward");
        let reference = g.clone();
        let mut exec = Executor::new(k.clone(), g, &[loss], Some(grads.clone()), None)?;
        let (ids_v, targets) = batch(3, model.vocab_size());
        exec.set_labels(ids, &ids_v)?;
        exec.set_labels(labels, &targets)?;
        exec.train_step(true, false, false)?;
        let feeds: Vec<_> = [(ids, &ids_v), (labels, &targets)]
            .iter()
            .map(|(t, v)| (*t, v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>()))
            .collect();
        let mut picks = rng(90);
        for p in trainable {
            let got = exec.read_grad(p)?;
            let name = reference.get(p).unwrap().name.clone();
            let node = grads.get(p).unwrap();
            let backward: Vec<f32> = reference.evaluate_f64(&[node], &feeds)?[0]
                .iter()
                .map(|&v| v as f32)
                .collect();
            // The kernels' f32 sums against the same graph in f64.
            assert_close(
                &format!("d loss / d {name}, backward reference"),
                &got,
                &backward,
                1e-5,
                1e-3,
            );
            assert!(got.iter().any(|&v| v.abs() > 1e-5), "{name}: gradient all but zero");
            for _ in 0..4 {
                let i = picks.random_range(0..got.len());
                let (mut plus, mut minus) = (reference.clone(), reference.clone());
                let a = plus.parameter_init_mut(p).unwrap();
                a[i] += 1e-3;
                let up = a[i];
                let b = minus.parameter_init_mut(p).unwrap();
                b[i] -= 1e-3;
                let step = f64::from(up) - f64::from(b[i]);
                let lp = reference_loss(&plus, loss, &feeds)?;
                let lm = reference_loss(&minus, loss, &feeds)?;
                // f32 GPU gradient against f64 differences of an
                // f32-perturbed value (step 2e-3): a few 1e-4 relative.
                assert_close(
                    &format!("d loss / d {name}[{i}]"),
                    &[got[i]],
                    &[((lp - lm) / step) as f32],
                    2e-5,
                    1e-2,
                );
            }
        }
        Ok(())
    });
}

fn reference_loss(
    g: &Graph,
    loss: wgrad::graph::Tensor,
    feeds: &[(wgrad::graph::Tensor, Vec<f64>)],
) -> wgrad::Result<f64> {
    Ok(g.evaluate_f64(&[loss], feeds)?[0][0])
}

/// Six clipped AdamW steps over the quantized base against the same
/// adapters over the base de-quantized to f32: the weights are the same
/// values, so the runs differ by the f32 rounding of sums in another
/// order (the quantized kernels scale each block's sum of integer
/// products): losses within 2e-5 relative, the adapters within 1e-4 of
/// values of order 0.1 after the steps.
#[test]
fn qlora_trains_as_lora_over_the_dequantized_base() {
    let (base, quantized) = fixture_model();
    let (f32_model, q_model) = (
        adapted(base.clone(), BaseStorage::F32),
        adapted(base, BaseStorage::Quantized(quantized)),
    );
    for_each_adapter("qlora_trains_as_lora_over_the_dequantized_base", |k| {
        let (f32_run, want) = train(k, &f32_model, PlanOptions::default(), 6)?;
        let (q_run, got) = train(k, &q_model, PlanOptions::default(), 6)?;
        assert_close("losses", &got, &want, 0.0, 2e-5);
        assert!(want[5] < want[0], "the adapters learn: {want:?}");
        // Parameters with f32 values: the adapters (and the f32 matrices
        // and norms of the base, unchanged).
        let (q_params, f_params) = (q_run.executor().parameters()?, f32_run.executor().parameters()?);
        for (name, _, values) in &q_params {
            let (_, _, want) = f_params.iter().find(|p| &p.0 == name).unwrap();
            assert_close(name, values, want, 1e-4, 1e-3);
        }
        assert!(
            q_params.len() < f_params.len(),
            "the quantized matrices have no f32 copy"
        );
        Ok(())
    });
}

/// Each block recomputed before its backward (activation checkpointing)
/// over the quantized base: the same losses as the plain plan, and less
/// held from forward to backward.
#[test]
fn qlora_with_activation_checkpointing_trains_as_without() {
    let (base, quantized) = fixture_model();
    let model = adapted(base, BaseStorage::Quantized(quantized));
    for_each_adapter("qlora_with_activation_checkpointing", |k| {
        let (plain, want) = train(k, &model, PlanOptions::default(), 4)?;
        let options = PlanOptions {
            checkpoint_activations: true,
            ..PlanOptions::default()
        };
        let (checkpointed, got) = train(k, &model, options, 4)?;
        // The same kernels on the same inputs; the plan may fuse the
        // copies differently: a few f32 ulps.
        assert_close("checkpointed losses", &got, &want, 1e-6, 1e-5);
        let held = |t: &Trainer| t.executor().plan().held_activation_bytes;
        assert!(
            held(&checkpointed) < held(&plain),
            "{} vs {}",
            held(&checkpointed),
            held(&plain)
        );
        Ok(())
    });
}

/// Saved activations in f16 (with dynamic loss scaling) over the
/// quantized base: the quantized products read their inputs in f32 (the
/// kernels take f32 activations), the adapters' weight gradients read the
/// f16 copies; the losses follow the f32 run within f16's rounding.
#[test]
fn qlora_with_f16_activations_follows_the_f32_run() {
    let (base, quantized) = fixture_model();
    let model = adapted(base, BaseStorage::Quantized(quantized));
    for_each_adapter("qlora_with_f16_activations", |k| {
        if !k.supports_f16() {
            eprintln!(
                "qlora f16 activations: {} has no SHADER_F16, skipped there",
                k.device().label()
            );
            return Ok(());
        }
        let (_, want) = train(k, &model, PlanOptions::default(), 4)?;
        let options = PlanOptions {
            precision: Precision::F16,
            ..PlanOptions::default()
        };
        let (f16_run, got) = train(k, &model, options, 4)?;
        let stored = f16_run
            .executor()
            .graph()
            .nodes()
            .iter()
            .filter(|n| n.op == wgrad::graph::ElementwiseOp::StoreF16)
            .count();
        assert!(stored > 0, "no activation was stored in f16");
        // Activations rounded to f16 (11 bits) through 2 layers: losses
        // of about 5.6 within 1e-2 relative.
        assert_close("f16 activations: losses", &got, &want, 0.0, 1e-2);
        Ok(())
    });
}

/// The base's matrices in f16 (`BaseStorage::F16`): the same run as an
/// f32 base holding those matrices rounded to f16.
#[test]
fn an_f16_base_trains_as_the_f32_base_of_its_values() {
    let (mut base, _) = fixture_model();
    base.visit_mut("", &mut |_, shape, values| {
        if shape.len() == 2 {
            values.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32());
        }
        Ok(())
    })
    .unwrap();
    let (f32_model, f16_model) = (adapted(base.clone(), BaseStorage::F32), adapted(base, BaseStorage::F16));
    let mut g = Graph::new();
    let ids = f16_model.input(&mut g, BATCH).unwrap();
    f16_model.forward(&mut g, ids, "").unwrap();
    let f16_params = g
        .parameters()
        .into_iter()
        .filter(|&p| g.get(p).unwrap().dtype == DType::F16)
        .count();
    // 7 Linears of 2 layers, the head and the token table.
    assert_eq!(f16_params, 16);
    for_each_adapter("an_f16_base_trains_as_the_f32_base_of_its_values", |k| {
        // The f16 table's lookup needs SHADER_F16 (the products do not:
        // without it the f32 kernels read f16 weights).
        if !k.supports_f16() {
            eprintln!("f16 base: {} has no SHADER_F16, skipped there", k.device().label());
            return Ok(());
        }
        let (_, want) = train(k, &f32_model, PlanOptions::default(), 4)?;
        let (_, got) = train(k, &f16_model, PlanOptions::default(), 4)?;
        // The same values; SHADER_F16's kernels (or the f32 ones reading
        // f16) sum in another order.
        assert_close("f16 base: losses", &got, &want, 0.0, 2e-5);
        Ok(())
    });
}

/// What `wgrad train --dry-run` plans for the QLoRA run without a device
/// equals what its trainer allocates; the frozen quantized base has no
/// gradient and no state, and takes fewer bytes than in f32.
#[test]
fn the_planned_qlora_memory_is_the_allocated_memory() {
    let (base, quantized) = fixture_model();
    let q_model = adapted(base.clone(), BaseStorage::Quantized(quantized));
    for_each_adapter("the_planned_qlora_memory_is_the_allocated_memory", |k| {
        for checkpoint_activations in [false, true] {
            let planning = Planning {
                criterion: CrossEntropyLoss.into(),
                optimizer: optimizer(),
                batch: BATCH,
                micro_batches: 1,
                device_alignment: k.device().limits().min_storage_buffer_offset_alignment,
                precision: Precision::F32,
                checkpoint_activations,
            };
            let planned = strategy_memory(&q_model, Strategy::Single, 1, &planning)?;
            let options = PlanOptions {
                checkpoint_activations,
                ..PlanOptions::default()
            };
            let trainer = Trainer::with_blocks(k.clone(), &q_model, CrossEntropyLoss, optimizer(), BATCH, options)?;
            assert_eq!(
                planned,
                TrainEngine::memory(&trainer),
                "checkpointing {checkpoint_activations}"
            );
            let full = strategy_memory(&base, Strategy::Single, 1, &planning)?;
            assert!(planned.parameters < full.parameters, "{planned:?} vs {full:?}");
            assert!(planned.gradients < full.gradients && planned.optimizer_state < full.optimizer_state);
        }
        Ok(())
    });
}

/// A quantized parameter trains only frozen: backward refuses one that is
/// not, naming it; a base planned as quantized (`QuantizedAs`) may not
/// hold values, and a graph planned without values runs on no executor.
#[test]
fn quantized_weights_train_only_frozen() {
    let (base, quantized) = fixture_model();
    let (name, matrix) = quantized.iter().next().unwrap();
    let rows = base.named_parameters().into_iter().find(|p| &p.0 == name).unwrap().1;
    let mut g = Graph::new();
    let w = g.parameter_quantized(name, &rows, matrix.format, &matrix.raw).unwrap();
    let x = g.parameter("x", &[3, rows[1]], vec![0.5; 3 * rows[1]]).unwrap();
    let y = g.matmul_form(wgrad::kernels::MatmulForm::ABt, x, w).unwrap();
    let loss = g.mean(y).unwrap();
    let err = g.clone().backward(loss).unwrap_err().to_string();
    assert!(err.contains(name.as_str()) && err.contains("freeze"), "{err}");
    g.freeze(w).unwrap();
    let grads = g.backward(loss).unwrap();
    assert!(grads.get(w).is_none() && grads.get(x).is_some());

    let model = adapted(
        base.clone(),
        BaseStorage::QuantizedAs(wgrad::kernels::QuantFormat::Q4_0),
    );
    let mut g = Graph::new();
    let ids = model.input(&mut g, 1).unwrap();
    let err = model.forward(&mut g, ids, "").unwrap_err().to_string();
    assert!(err.contains("does not quantize"), "{err}");
    // The same sizes without values: planned, and refused by an executor.
    let empty = Lora::new(
        Llama::empty(base.config).unwrap(),
        LoraConfig::new(4, 8.0, &["all-linear"]),
    )
    .unwrap()
    .with_base_storage(BaseStorage::QuantizedAs(wgrad::kernels::QuantFormat::Q4_0));
    assert_eq!(empty.adapters().len(), 14, "adapters found on a base without values");
    for_each_adapter("quantized weights train only frozen", |k| {
        let err = Trainer::new(k.clone(), &empty, CrossEntropyLoss, optimizer(), 1)
            .err()
            .expect("a planned graph ran")
            .to_string();
        assert!(err.contains("planning only"), "{err}");
        Ok(())
    });
}

/// SmolLM2-135M-Instruct's Q4_1 file (the real one) under QLoRA, r = 16 on
/// every Linear, batches of 4 × 128 tokens, against full fine-tuning of
/// the same model planned alike: one device's bytes, planned without a
/// device. With activation checkpointing (`wgrad train`'s default over a
/// quantized base, as QLoRA's recipe trains: peft's
/// prepare_model_for_kbit_training turns it on) QLoRA takes at
/// most 0.35 of full fine-tuning's bytes (measured 0.234), and what
/// a trainer allocates is what was planned. Without it both runs hold the
/// same 0.95 GB of activations for the backward, which then dominate
/// QLoRA's bytes: measured 0.365, bounded here at 0.37.
#[test]
fn qlora_on_smollm2_takes_at_most_0_35_of_full_fine_tuning() {
    let path = wgrad_benches::smollm2_path().expect("no WGRAD_SMOLLM2 and no cache directory (HOME unset)");
    if !path.is_file() {
        eprintln!(
            "skipped: SmolLM2-135M-Instruct's GGUF file is missing at {} (make test fetches it; \
             scripts/fetch-smollm2.sh)",
            path.display()
        );
        return;
    }
    let file = GgufModel::open(&path).unwrap();
    let wgrad::io::gguf_model::GgufArchitecture::Llama(config) = *file.architecture() else {
        panic!("SmolLM2's file is a Llama");
    };
    let config = LlamaConfig {
        block_size: 128,
        ..config
    };
    let quantized = Arc::new(file.lora_base_weights().unwrap());
    // The quantized matrices hold no f32 copy on the host either: only
    // the norms are read as values.
    let mut base = Llama::empty(config).unwrap();
    base.visit_mut("", &mut |name, _, values| {
        if !quantized.contains_key(&name) {
            *values = file.parameter_f32(&name)?;
        }
        Ok(())
    })
    .unwrap();
    nn::manual_seed(1);
    let model = Lora::new(base, LoraConfig::parse("r=16,alpha=32,targets=all-linear").unwrap())
        .unwrap()
        .with_base_storage(BaseStorage::Quantized(quantized));
    assert_eq!(model.trainable_parameters(), 4_884_480);
    let planning = |alignment: u32, checkpoint_activations: bool| Planning {
        criterion: CrossEntropyLoss.into(),
        optimizer: AdamW::new(1e-4).into(),
        batch: 4,
        micro_batches: 1,
        device_alignment: alignment,
        precision: Precision::F32,
        checkpoint_activations,
    };
    let full_model = Llama::empty(config).unwrap();
    let mut shares = Vec::new();
    for checkpoint in [true, false] {
        let qlora = strategy_memory(&model, Strategy::Single, 1, &planning(256, checkpoint)).unwrap();
        let full = strategy_memory(&full_model, Strategy::Single, 1, &planning(256, checkpoint)).unwrap();
        // The quantized base: Q4_1 matrices (0.625 bytes a value) and the
        // Q8_0 token table (1.0625), 112 MiB of the 513 MiB in f32.
        assert!(qlora.parameters < full.parameters / 4, "{qlora:?}");
        let share = qlora.total() as f64 / full.total() as f64;
        eprintln!("SmolLM2 QLoRA (checkpointing {checkpoint}): {qlora:?}, {share:.3} of full fine-tuning's {full:?}");
        shares.push(share);
    }
    assert!(
        shares[0] <= 0.35,
        "checkpointed: QLoRA takes {:.3} of full fine-tuning",
        shares[0]
    );
    assert!(
        shares[1] <= 0.37,
        "plain: QLoRA takes {:.3} of full fine-tuning",
        shares[1]
    );
    // Allocated on one adapter (building the step compiles its kernels).
    let Some(k) = common::adapters().first() else { return };
    let options = PlanOptions {
        checkpoint_activations: true,
        ..PlanOptions::default()
    };
    let trainer = Trainer::with_blocks(k.clone(), &model, CrossEntropyLoss, AdamW::new(1e-4), 4, options).unwrap();
    let alignment = k.device().limits().min_storage_buffer_offset_alignment;
    let planned = strategy_memory(&model, Strategy::Single, 1, &planning(alignment, true)).unwrap();
    assert_eq!(planned, TrainEngine::memory(&trainer), "planned against allocated");
}

/// A Hugging Face config's sizes (config.json's fields).
struct HfConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    /// Qwen2's q, k and v projections carry biases.
    qkv_bias: bool,
    tie_word_embeddings: bool,
}

impl HfConfig {
    /// Parameters as transformers' LlamaForCausalLM / Qwen2ForCausalLM
    /// count them: the token table, per layer q, k, v, o (and Qwen2's
    /// biases on q, k, v), gate, up, down and two RMSNorms, the final
    /// norm, and an untied head.
    fn parameters(&self) -> usize {
        let (h, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let c = self.hidden_size;
        let attention = c * h + 2 * c * kv + h * c + usize::from(self.qkv_bias) * (h + 2 * kv);
        let layer = attention + 3 * c * self.intermediate_size + 2 * c;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * c
        };
        self.vocab_size * c + self.num_hidden_layers * layer + c + head
    }
}

/// The 1B presets are their Hugging Face models' shapes: parameter counts
/// computed here from meta-llama/Llama-3.2-1B's and Qwen/Qwen2.5-1.5B's
/// config.json equal the presets' (by their sizes and by their module
/// trees), and transformers' own counts (AutoModelForCausalLM.from_config
/// on the meta device gave 1,235,814,400 and 1,543,714,304).
#[test]
fn the_1b_presets_have_their_hugging_face_parameter_counts() {
    let llama = HfConfig {
        vocab_size: 128256,
        hidden_size: 2048,
        intermediate_size: 8192,
        num_hidden_layers: 16,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 64,
        qkv_bias: false,
        tie_word_embeddings: true,
    };
    let qwen = HfConfig {
        vocab_size: 151936,
        hidden_size: 1536,
        intermediate_size: 8960,
        num_hidden_layers: 28,
        num_attention_heads: 12,
        num_key_value_heads: 2,
        head_dim: 128,
        qkv_bias: true,
        tie_word_embeddings: true,
    };
    assert_eq!(llama.parameters(), 1_235_814_400);
    assert_eq!(qwen.parameters(), 1_543_714_304);
    let presets = [
        (LlamaConfig::preset("llama3.2-1b", 0).unwrap(), &llama),
        (
            wgrad::models::qwen::preset(wgrad::models::LlamaVariant::Qwen2, "qwen2.5-1.5b", 0).unwrap(),
            &qwen,
        ),
    ];
    for (preset, hf) in presets {
        assert_eq!(preset.num_parameters(), Some(hf.parameters()), "{preset:?}");
        // Built without values: the module tree's shapes.
        assert_eq!(Llama::empty(preset).unwrap().num_parameters(), hf.parameters());
        assert_eq!(
            (
                preset.n_embd,
                preset.n_layer,
                preset.n_head,
                preset.n_kv_head,
                preset.head_dim()
            ),
            (
                hf.hidden_size,
                hf.num_hidden_layers,
                hf.num_attention_heads,
                hf.num_key_value_heads,
                hf.head_dim
            )
        );
        assert!(preset.tie_word_embeddings && preset.block_size == 2048);
    }
}

/// Ten clipped AdamW steps of QLoRA over the fixture's quantized base
/// under data parallel, ZeRO-2 and the pipeline equal one device's
/// (relative 1e-5 on the losses: sums split over devices and added in
/// another order): each device holds the quantized base whole and frozen,
/// only adapter gradients are reduced.
#[test]
fn qlora_trains_alike_under_data_zero_and_pipeline_parallel() {
    use crate::parallel::open_groups;
    use wgrad::parallel::data::{DataParallel, Split};
    use wgrad::parallel::pipeline::{Pipeline, Schedule};
    use wgrad::parallel::zero::{Zero, ZeroStage};
    use wgrad::parallel::DeviceSelection;
    const BATCH: usize = 4;
    let groups = open_groups(
        "qlora_trains_alike_under_data_zero_and_pipeline_parallel",
        &[DeviceSelection::Count(2)],
    );
    let Some(group) = groups.first() else { return };
    let (base, quantized) = fixture_model();
    let m = adapted(base, BaseStorage::Quantized(quantized));
    let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..10)
        .map(|s| {
            let mut r = rng(500 + s);
            let ids: Vec<u32> = (0..BATCH * T)
                .map(|_| r.random_range(0..m.vocab_size() as u32))
                .collect();
            let targets = ids.iter().map(|&i| (i * 7 + 3) % m.vocab_size() as u32).collect();
            (ids, targets)
        })
        .collect();
    let (_, want, _) = common::train_on_one_device(&group.members()[0], &m, optimizer(), BATCH, &batches);
    let check = |what: &str, got: Vec<f32>| {
        assert_eq!(got.len(), want.len(), "{what}: steps");
        assert_close(what, &got, &want, 0.0, 1e-5);
    };
    let mut dp = DataParallel::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, Split::Rows(vec![1, 3])).unwrap();
    check(
        "data parallel",
        batches
            .iter()
            .map(|(ids, t)| dp.step(ids, Targets::Classes(t), true).unwrap().unwrap())
            .collect(),
    );
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
    check(
        "ZeRO-2",
        batches
            .iter()
            .map(|(ids, t)| zero.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
            .collect(),
    );
    let mut p = Pipeline::new(group, &m, CrossEntropyLoss, optimizer(), BATCH, 2, Schedule::OneFOneB).unwrap();
    check(
        "pipeline",
        batches
            .iter()
            .map(|(ids, t)| p.step(ids.as_slice(), Targets::Classes(t), true).unwrap().unwrap())
            .collect(),
    );
}
