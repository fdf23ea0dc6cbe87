//! Many LoRA adapters over one base (`nn::MultiLora`): the gathered
//! `lora_shrink` / `lora_expand` kernels against their CPU twins at awkward
//! shapes (one row, primes, ranks 1, 8 and 16 side by side, adapters absent
//! from a layer, rows with no adapter), the graph ops' refusals and
//! reference, and generators whose sequences each apply their own adapter
//! in one batch against one generator per adapter.

use std::sync::{Arc, Mutex};

use crate::common::{assert_close, for_each_adapter, for_each_shaping, random_vec, rng};
use crate::generate::{llama_configs, sharp_llama};
use wgrad::graph::{Executor, Graph};
use wgrad::infer::batch::{BatchRequest, Event, Scheduler};
use wgrad::infer::generate::{Generator, GeneratorOptions, PrefillMode, Sampling};
use wgrad::kernels::{LoraShape, LORA_META, NO_ADAPTER};
use wgrad::models::Llama;
use wgrad::nn::{Lora, LoraAdapter, LoraConfig, Module, MultiLora, NamedAdapter, ParameterTree};
use wgrad::Error;

/// Stacked operands of `ranks.len()` adapters over one Linear [cols_out,
/// cols_in]: (a [R, in], bt [R, out], meta [N, 3]); a rank 0 is an adapter
/// absent from this Linear.
fn stacked(seed: u64, ranks: &[usize], cols_in: usize, cols_out: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = rng(seed);
    let total: usize = ranks.iter().sum();
    let a = random_vec(&mut r, total * cols_in, -1.0, 1.0);
    let bt = random_vec(&mut r, total * cols_out, -1.0, 1.0);
    let mut meta = Vec::new();
    let mut first = 0;
    for (i, &rank) in ranks.iter().enumerate() {
        let scale = [2.0, -0.5, 0.75, 1.5][i % 4];
        if rank == 0 {
            meta.extend([0.0, 0.0, 0.0]);
        } else {
            meta.extend([first as f32, rank as f32, scale]);
        }
        first += rank;
    }
    (a, bt, meta)
}

/// (sequences, rows per sequence, in, out, each adapter's rank here, each
/// sequence's adapter).
type Case = (usize, usize, usize, usize, &'static [usize], &'static [u32]);

const CASES: [Case; 6] = [
    // One row, one column, rank 1.
    (1, 1, 1, 1, &[1], &[0]),
    // Decode: ranks 1, 8 and 16 side by side, a row with none.
    (3, 1, 37, 29, &[1, 8, 16], &[2, NO_ADAPTER, 0]),
    // Prefill-like rows (5 per sequence), more columns than a GPU
    // workgroup's 64 lanes, an adapter absent from this Linear.
    (2, 5, 67, 13, &[16, 0, 8], &[1, 2]),
    // More outputs than one expand workgroup (256), a repeated adapter.
    (5, 1, 130, 259, &[8, 1, 16, 3], &[3, 0, 0, 1, NO_ADAPTER]),
    // A width of 17: three blocks of 8 columns of h, the last partial.
    (2, 3, 19, 7, &[17, 5], &[0, 1]),
    // No row applies an adapter: y unchanged.
    (2, 2, 11, 5, &[4, 2], &[NO_ADAPTER, NO_ADAPTER]),
];

fn shape_of(&(seqs, per, cols, _, ranks, _): &Case) -> LoraShape {
    LoraShape {
        seqs,
        rows: seqs * per,
        cols,
        width: ranks.iter().copied().max().unwrap_or(1),
        adapters: ranks.len(),
        ranks: ranks.iter().sum(),
    }
}

#[test]
fn the_gathered_products_match_the_cpu() {
    for_each_shaping("lora shrink and expand", |k| {
        for (c, case) in CASES.iter().enumerate() {
            let &(_, _, cols_in, cols_out, ranks, index) = case;
            let shape = shape_of(case);
            let (a_h, bt_h, meta_h) = stacked(10 + c as u64, ranks, cols_in, cols_out);
            let mut r = rng(20 + c as u64);
            let x_h = random_vec(&mut r, shape.rows * cols_in, -1.0, 1.0);
            let y_h = random_vec(&mut r, shape.rows * cols_out, -1.0, 1.0);
            let (x, a, bt, meta, idx, y) = (
                k.upload(&x_h)?,
                k.upload(&a_h)?,
                k.upload(&bt_h)?,
                k.upload(&meta_h)?,
                k.upload(index)?,
                k.upload(&y_h)?,
            );
            // h starts as NaN: every element must be written.
            let h = k.upload(&vec![f32::NAN; shape.rows * shape.width])?;
            let out = k.zeros(shape.rows * cols_out)?;
            let shrink = k.lora_shrink(h.view(), x.view(), a.view(), meta.view(), idx.view(), shape)?;
            let out_shape = LoraShape {
                cols: cols_out,
                ..shape
            };
            let expand = k.lora_expand(
                out.view(),
                y.view(),
                h.view(),
                bt.view(),
                meta.view(),
                idx.view(),
                out_shape,
            )?;
            k.run(&[&shrink, &expand])?;
            let what = format!("case {c} {case:?}");
            let h_got = k.read::<f32>(h.view())?;
            // Sums of up to 130 products of values in [-1, 1] in f32.
            let h_want = wgrad::cpu::lora_shrink(&x_h, &a_h, &meta_h, index, shape);
            assert_close(&format!("{what}: h"), &h_got, &h_want, 2e-5, 2e-5);
            // The expand from the kernel's h, so each kernel answers for itself.
            let want = wgrad::cpu::lora_expand(&y_h, &h_got, &bt_h, &meta_h, index, out_shape);
            assert_close(&format!("{what}: out"), &k.read::<f32>(out.view())?, &want, 1e-5, 1e-5);
            // A row with no adapter here is y's, exactly.
            let got = k.read::<f32>(out.view())?;
            for row in 0..shape.rows {
                let adapter = index[row / (shape.rows / shape.seqs)];
                if adapter == NO_ADAPTER || meta_h[adapter as usize * LORA_META + 1] == 0.0 {
                    let span = row * cols_out..(row + 1) * cols_out;
                    assert_eq!(got[span.clone()], y_h[span], "{what}: row {row} has no adapter");
                }
            }
        }
        Ok(())
    });
}

#[test]
fn the_gathered_products_refuse_operands_that_do_not_fit() {
    for_each_adapter("lora refusals", |k| {
        let shape = LoraShape {
            seqs: 2,
            rows: 4,
            cols: 5,
            width: 3,
            adapters: 2,
            ranks: 4,
        };
        let buf = |n: usize| k.zeros(n);
        let (x, a, meta, idx, h) = (buf(20)?, buf(20)?, buf(6)?, buf(2)?, buf(12)?);
        k.lora_shrink(h.view(), x.view(), a.view(), meta.view(), idx.view(), shape)?;
        let short = buf(19)?;
        let said = |e: Error, what: &str| assert!(e.to_string().contains(what), "{e}");
        said(
            k.lora_shrink(h.view(), short.view(), a.view(), meta.view(), idx.view(), shape)
                .unwrap_err(),
            "`x` has 19 elements, want 20",
        );
        said(
            k.lora_shrink(h.view(), x.view(), a.view(), short.view(), idx.view(), shape)
                .unwrap_err(),
            "`meta` has 19 elements, want 6",
        );
        let odd = LoraShape { seqs: 3, ..shape };
        let idx3 = buf(3)?;
        said(
            k.lora_shrink(h.view(), x.view(), a.view(), meta.view(), idx3.view(), odd)
                .unwrap_err(),
            "not whole sequences of 3",
        );
        let none = LoraShape { width: 0, ..shape };
        said(
            k.lora_expand(x.view(), x.view(), h.view(), a.view(), meta.view(), idx.view(), none)
                .unwrap_err(),
            "width must not be 0",
        );
        Ok(())
    });
}

/// The ops in a graph: x [S, T, in] and y [S, T, out] of rank 3, against
/// `Graph::evaluate_f64`; then the refusals and the index check.
#[test]
fn the_graph_ops_run_their_reference_and_check_their_operands() {
    for_each_adapter("lora graph ops", |k| {
        let (seqs, per, cols_in, cols_out, ranks) = (3, 2, 7, 5, [2usize, 1]);
        let (a_h, bt_h, meta_h) = stacked(3, &ranks, cols_in, cols_out);
        let mut g = Graph::new();
        let x = g.input("x", &[seqs, per, cols_in])?;
        let y = g.input("y", &[seqs, per, cols_out])?;
        let a = g.parameter("a", &[3, cols_in], a_h)?;
        let bt = g.parameter("bt", &[3, cols_out], bt_h)?;
        let meta = g.parameter("meta", &[2, LORA_META], meta_h)?;
        let index = g.ids("index", &[seqs])?;
        let h = g.lora_shrink(x, a, meta, index, 2)?;
        assert_eq!(g.shape_of(h), Some(&[seqs, per, 2][..]));
        let out = g.lora_expand(y, h, bt, meta, index)?;
        let mut r = rng(4);
        let (x_h, y_h) = (
            random_vec(&mut r, seqs * per * cols_in, -1.0, 1.0),
            random_vec(&mut r, seqs * per * cols_out, -1.0, 1.0),
        );
        let index_h = [1u32, NO_ADAPTER, 0];
        let mut exec = Executor::new(k.clone(), g.clone(), &[out], None, None)?;
        exec.set_input(x, &x_h)?;
        exec.set_input(y, &y_h)?;
        exec.set_labels(index, &index_h)?;
        let got = exec.run_and_read(&[out], out)?;
        let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let feeds = [
            (x, wide(&x_h)),
            (y, wide(&y_h)),
            (index, index_h.iter().map(|&i| f64::from(i)).collect()),
        ];
        let want: Vec<f32> = g.evaluate_f64(&[out], &feeds)?[0].iter().map(|&v| v as f32).collect();
        assert_close("lora ops against evaluate_f64", &got, &want, 1e-5, 1e-5);

        // An index past the adapters that is not NO_ADAPTER, refused before
        // it reaches the GPU.
        let bad = exec.set_labels(index, &[0, 2, NO_ADAPTER]).unwrap_err();
        assert!(bad.to_string().contains("adapter 2 of 2"), "{bad}");
        // No gradient.
        let seed = g.constant("seed", &[seqs, per, cols_out], vec![1.0; seqs * per * cols_out])?;
        match g.backward_from(out, seed, &[]) {
            Err(Error::NoGradient { op, .. }) => assert_eq!(op, "lora_expand"),
            other => panic!("expected NoGradient, got {other:?}"),
        }
        // Operands that do not fit.
        let flat = g.input("flat", &[cols_in])?;
        let wide_meta = g.parameter("meta4", &[2, 4], vec![0.0; 8])?;
        let float_index = g.input("float index", &[seqs])?;
        let four = g.ids("four", &[4])?;
        let narrow_a = g.parameter("a6", &[3, cols_in - 1], vec![0.0; 3 * (cols_in - 1)])?;
        for (what, result) in [
            ("rank 1 x", g.lora_shrink(flat, a, meta, index, 2)),
            ("meta [2, 4]", g.lora_shrink(x, a, wide_meta, index, 2)),
            ("f32 index", g.lora_shrink(x, a, meta, float_index, 2)),
            ("6 rows over 4 sequences", g.lora_shrink(x, a, meta, four, 2)),
            ("A of other columns", g.lora_shrink(x, narrow_a, meta, index, 2)),
            ("width 0", g.lora_shrink(x, a, meta, index, 0)),
            ("h of other rows", g.lora_expand(y, flat, bt, meta, index)),
        ] {
            assert!(
                matches!(result, Err(Error::Shape { .. } | Error::InvalidArgument { .. })),
                "{what}: {result:?}"
            );
        }
        Ok(())
    });
}

/// Three adapters over `base`: ranks 1 (q and v), 8 (every Linear) and 16
/// (the MLP), with random A and B of order 1.
fn adapters(base: &Llama) -> Vec<NamedAdapter> {
    let specs: [(&str, usize, &[&str]); 3] = [
        ("qv", 1, &["q_proj", "v_proj"]),
        ("all", 8, &["all-linear"]),
        ("mlp", 16, &["gate_proj", "up_proj", "down_proj"]),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, &(name, r, targets))| {
            let config = LoraConfig::new(r, 2.0 * r as f32, targets);
            let mut lora = Lora::new(base.clone(), config.clone()).expect("adapters fit");
            let mut values = rng(60 + i as u64);
            lora.visit_mut("", &mut |name, _, v| {
                if name.contains(".lora_") {
                    *v = random_vec(&mut values, v.len(), -0.3, 0.3);
                }
                Ok(())
            })
            .expect("values");
            let list: Vec<LoraAdapter> = lora.adapters().to_vec();
            NamedAdapter::new(name, config, list)
        })
        .collect()
}

/// The model a request naming `adapter` runs alone: the base, or the base
/// with that one adapter.
fn alone(base: &Llama, all: &[NamedAdapter], adapter: Option<usize>) -> Box<dyn wgrad::nn::CausalLm> {
    match adapter {
        None => Box::new(base.clone()),
        Some(a) => {
            Box::new(Lora::with_adapters(base.clone(), all[a].config.clone(), all[a].adapters.clone()).expect("fits"))
        }
    }
}

#[test]
fn sequences_with_different_adapters_in_one_batch_give_each_adapters_logits() {
    for_each_adapter("MultiLora batch logits", |k| {
        let base = sharp_llama(llama_configs()[0], 71);
        let named = adapters(&base);
        let multi = MultiLora::new(base.clone(), named.clone())?;
        assert_eq!(multi.index_of("mlp"), Some(2));
        let vocab = llama_configs()[0].vocab_size;
        // Sequence s applies picks[s]: two share one, one applies none.
        let picks = [Some(1), None, Some(0), Some(2), Some(1)];
        let mut batch = Generator::new(k.clone(), &multi, picks.len())?;
        assert_eq!(batch.adapters(), 3);
        for (s, &a) in picks.iter().enumerate() {
            batch.set_slot_adapter(s, a)?;
        }
        let mut r = rng(72);
        let prompts: Vec<Vec<u32>> = (0..picks.len())
            .map(|s| {
                (0..2 + s)
                    .map(|_| rand::Rng::random_range(&mut r, 0..vocab as u32))
                    .collect()
            })
            .collect();
        let prompt_refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let mut logits = vec![batch.prefill(&prompt_refs)?];
        let steps: Vec<Vec<u32>> = (0..3)
            .map(|t| (0..picks.len() as u32).map(|s| (s * 7 + t) % 31).collect())
            .collect();
        for tokens in &steps {
            logits.push(batch.decode(tokens)?);
        }
        let mut differs = 0;
        for (s, &a) in picks.iter().enumerate() {
            let model = alone(&base, &named, a);
            let mut one = Generator::new(k.clone(), model.as_ref(), 1)?;
            let mut want = vec![one.prefill(&[&prompts[s]])?];
            for tokens in &steps {
                want.push(one.decode(&[tokens[s]])?);
            }
            for (step, (got, want)) in logits.iter().zip(&want).enumerate() {
                let row = &got[s * vocab..(s + 1) * vocab];
                // The adapter's path in another order of sums than the
                // single adapter's matmuls: f32 rounding through two layers.
                assert_close(
                    &format!("sequence {s} (adapter {a:?}), step {step}"),
                    row,
                    want,
                    1e-4,
                    1e-4,
                );
            }
            // The adapter changes the logits (else the check shows nothing).
            if a.is_some() {
                let mut plain = Generator::new(k.clone(), &base, 1)?;
                let base_logits = plain.prefill(&[&prompts[s]])?;
                let gap = base_logits
                    .iter()
                    .zip(&want[0])
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                differs += usize::from(gap > 1e-2);
            }
        }
        assert_eq!(differs, 4, "every adapted sequence's logits differ from the base's");
        // Slot adapters are checked.
        let e = batch.set_slot_adapter(0, Some(3)).unwrap_err();
        assert!(e.to_string().contains("adapter 3 of a model carrying 3"), "{e}");
        assert!(batch.set_slot_adapter(5, None).is_err());
        Ok(())
    });
}

#[test]
fn a_scheduler_decodes_requests_with_different_adapters_together() {
    for_each_adapter("MultiLora scheduler", |k| {
        // A longer context than the test configs' 13 positions.
        let config = wgrad::models::LlamaConfig {
            block_size: 40,
            ..llama_configs()[0]
        };
        let base = sharp_llama(config, 81);
        let named = adapters(&base);
        let multi = MultiLora::new(base.clone(), named.clone())?;
        let options = GeneratorOptions {
            sequences: 4,
            context: Some(24),
            prefill: PrefillMode::OneSlot,
            ..GeneratorOptions::default()
        };
        let mut scheduler = Scheduler::new(Generator::with_options(k.clone(), &multi, &options)?)?;
        let picks = [Some(2), Some(0), None, Some(1)];
        let prompts: [Vec<u32>; 4] = [vec![3, 1, 4], vec![1, 5], vec![9, 2, 6, 5], vec![3, 5, 8, 9, 7]];
        let new_tokens = 8;
        let mut events = Vec::new();
        for (prompt, &adapter) in prompts.iter().zip(&picks) {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let sink_seen = seen.clone();
            let request = BatchRequest {
                adapter,
                ..BatchRequest::new(prompt.clone(), new_tokens, Sampling::greedy())
            };
            scheduler.submit(
                request,
                Box::new(move |e| sink_seen.lock().map(|mut s| s.push(e)).is_ok()),
            )?;
            events.push(seen);
        }
        // An adapter the model does not carry is refused at submission.
        let refused = BatchRequest {
            adapter: Some(3),
            ..BatchRequest::new(vec![1], 1, Sampling::greedy())
        };
        assert!(scheduler.submit(refused, Box::new(|_| true)).is_err());
        while !scheduler.is_idle() {
            scheduler.step()?;
        }
        // Every step after the joins ran all four rows.
        let stats = scheduler.stats();
        assert_eq!(stats.decoded_rows, 4 * stats.decode_steps, "{stats:?}");
        for (s, &adapter) in picks.iter().enumerate() {
            let model = alone(&base, &named, adapter);
            let mut one = Generator::with_options(
                k.clone(),
                model.as_ref(),
                &GeneratorOptions {
                    context: Some(24),
                    ..GeneratorOptions::default()
                },
            )?;
            let want = one.generate(&prompts[s], new_tokens, &Sampling::greedy(), |_| Ok(()))?;
            let got: Vec<u32> = events[s]
                .lock()
                .map_err(|_| Error::Internal {
                    op: "test",
                    reason: "a poisoned sink".into(),
                })?
                .iter()
                .filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None })
                .collect();
            assert_eq!(got, want, "request {s} with adapter {adapter:?}");
        }
        Ok(())
    });
}

#[test]
fn a_multi_lora_refuses_adapters_that_do_not_fit() {
    let base = sharp_llama(llama_configs()[0], 91);
    let named = adapters(&base);
    let err = |adapters: Vec<NamedAdapter>| MultiLora::new(base.clone(), adapters).unwrap_err().to_string();
    assert!(err(Vec::new()).contains("no adapters"));
    let mut twice = named.clone();
    twice[1].name = "qv".into();
    assert!(err(twice).contains("two adapters are named `qv`"));
    let mut unnamed = named.clone();
    unnamed[0].name = " ".into();
    assert!(err(unnamed).contains("name is empty"));
    // An adapter for a Linear of other sizes, named in the error.
    let mut other = named.clone();
    other[2].adapters[0].in_features += 1;
    let e = err(other);
    assert!(e.contains("adapter `mlp`"), "{e}");
    // A model carrying many adapters runs only under a generator, which
    // names each sequence's.
    let multi = MultiLora::new(base.clone(), named).expect("fits");
    let mut g = Graph::new();
    let idx = multi.input(&mut g, 1).expect("input");
    let e = multi.forward(&mut g, idx, "").unwrap_err().to_string();
    assert!(e.contains("under a generator"), "{e}");
    // Its parameters: the base's, then each adapted Linear's stacks.
    let names: Vec<String> = multi.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.lora_set.A".to_string()));
}
