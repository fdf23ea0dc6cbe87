//! Operands larger than one storage binding (a GPT-2 `wte` is 154 MB, over
//! lavapipe's 128 MiB): the matmul, the embedding lookup and its backward
//! split their work into launches over parts that fit, and a model larger
//! than the adapter's memory or buffer limit is refused before anything is
//! allocated. Run on small tensors through `Kernels::with_limits`, which
//! lowers the limits: each split result is checked against the same op on
//! the adapter's own limits (unsplit), and against the CPU twin.

use std::sync::Arc;

use crate::common;

use common::{assert_close, for_each_adapter, limited_kernels, random_vec, read, rng};
use rand::Rng;
use wgrad::graph::{Executor, Graph};
use wgrad::infer::generate::{check_fits, Generator, Sampling};
use wgrad::kernels::MatmulRequest;
use wgrad::kernels::{Activation, LimitOverrides, MatmulEpilogue, MatmulForm};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::Module;
use wgrad::nn::{self};
use wgrad::{cpu, Error, Kernels};

/// Bytes per storage binding in the split tests: 256 floats, so a handful
/// of launches cover each operand below.
const SMALL_BINDING: u64 = 1024;

fn binding_limited(k: &Kernels, bytes: u64) -> Arc<Kernels> {
    limited_kernels(
        k,
        LimitOverrides {
            max_storage_buffer_binding_size: Some(bytes),
            ..LimitOverrides::default()
        },
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What a matmul case fuses into its store.
#[derive(Clone, Copy, Debug)]
enum Store {
    Plain,
    Accumulate,
    /// Bias, GELU, and the pre-activation kept.
    BiasGeluPre,
    /// The product times GELU'(x).
    GeluGrad,
}

/// (form, m, n, k, store): the LM head at decode (one row, B's rows in
/// blocks), many rows and columns (blocks of both), A's rows in blocks
/// (AB), and each epilogue on a split product.
const MATMUL_CASES: [(MatmulForm, usize, usize, usize, Store); 7] = [
    (MatmulForm::ABt, 1, 300, 5, Store::Plain),
    (MatmulForm::ABt, 3, 50, 8, Store::Plain),
    (MatmulForm::ABt, 40, 37, 12, Store::Accumulate),
    (MatmulForm::AB, 45, 7, 11, Store::Plain),
    (MatmulForm::AB, 30, 9, 10, Store::BiasGeluPre),
    (MatmulForm::ABt, 29, 41, 7, Store::BiasGeluPre),
    (MatmulForm::ABt, 33, 23, 9, Store::GeluGrad),
];

/// The case's outputs (C, and pre when kept) on `k`, and its launches.
#[allow(clippy::too_many_arguments)]
fn run_matmul(
    k: &Kernels,
    form: MatmulForm,
    store: Store,
    (m, n, kk): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    c0: &[f32],
    extra: &[f32],
) -> wgrad::Result<(Vec<f32>, Vec<f32>, usize)> {
    let (a, b, c) = (k.upload(a)?, k.upload(b)?, k.upload(c0)?);
    let bias = k.upload(&extra[..n])?;
    let x = k.upload(extra)?;
    let pre = k.zeros(m * n)?;
    let epilogue = match store {
        Store::Plain => MatmulEpilogue::default(),
        Store::Accumulate => MatmulEpilogue {
            accumulate: true,
            ..MatmulEpilogue::default()
        },
        Store::BiasGeluPre => MatmulEpilogue {
            bias: Some(bias.view()),
            activation: Some((Activation::Gelu, Some(pre.view()))),
            ..MatmulEpilogue::default()
        },
        Store::GeluGrad => MatmulEpilogue {
            activation_grad: Some((Activation::Gelu, x.view())),
            ..MatmulEpilogue::default()
        },
    };
    let d = k.matmul(
        &MatmulRequest::new(form, m, n, kk).with_epilogue(epilogue),
        c.view(),
        a.view(),
        b.view(),
    )?;
    k.run(&[&d])?;
    Ok((read(k, &c)?, read(k, &pre)?, d.launches()))
}

#[test]
fn matmuls_over_small_bindings_equal_the_unsplit_ones() {
    for_each_adapter("matmul split over bindings", |k| {
        let lim = binding_limited(k, SMALL_BINDING);
        for (i, &(form, m, n, kk, store)) in MATMUL_CASES.iter().enumerate() {
            let mut r = rng(300 + i as u64);
            let (a, b) = (
                random_vec(&mut r, m * kk, -1.0, 1.0),
                random_vec(&mut r, kk * n, -1.0, 1.0),
            );
            let c0 = random_vec(&mut r, m * n, -1.0, 1.0);
            // The bias (first n values) or the activation's input x [m, n].
            let extra = random_vec(&mut r, m * n, -2.0, 2.0);
            let what = format!("{form:?} m={m} n={n} k={kk} {store:?}");
            let (split, split_pre, launches) = run_matmul(&lim, form, store, (m, n, kk), &a, &b, &c0, &extra)?;
            let (whole, whole_pre, one) = run_matmul(k, form, store, (m, n, kk), &a, &b, &c0, &extra)?;
            assert!(
                launches > 1 && one == 1,
                "{what}: {launches} launches split, {one} whole"
            );
            // Each element is computed by the same kernel over the same k
            // order whichever launch holds it: equal bit for bit.
            assert_eq!(bits(&split), bits(&whole), "{what}: C");
            if matches!(store, Store::BiasGeluPre) {
                assert_eq!(bits(&split_pre), bits(&whole_pre), "{what}: pre");
            }
            let e = cpu::Epilogue {
                accumulate_onto: matches!(store, Store::Accumulate).then_some(&c0[..]),
                bias: matches!(store, Store::BiasGeluPre).then_some(&extra[..n]),
                activation: matches!(store, Store::BiasGeluPre).then_some(Activation::Gelu),
                activation_grad: matches!(store, Store::GeluGrad).then_some((Activation::Gelu, &extra[..])),
            };
            let (want, _) = cpu::matmul_epilogue(form, e, &a, &b, m, n, kk);
            // f32 sums of ≤ 12 products of values in [-1, 1] against f64.
            assert_close(&what, &split, &want, 1e-5, 1e-5);
        }
        Ok(())
    });
}

/// (form, m, n, k, accumulate): products whose operands fit a binding only
/// in parts along k: the tied head's gradients dlogits·wte (AB, k the
/// vocabulary) and dlogitsᵀ·x (AtB, A stored [k, m]), one row of A over
/// the limit (ABt), and C added into.
const ALONG_K_CASES: [(MatmulForm, usize, usize, usize, bool); 4] = [
    (MatmulForm::AB, 7, 5, 301, false),
    (MatmulForm::AtB, 300, 5, 13, true),
    (MatmulForm::ABt, 3, 4, 517, false),
    (MatmulForm::AtB, 37, 3, 200, false),
];

#[test]
fn matmuls_split_along_k_equal_the_unsplit_ones() {
    for_each_adapter("matmul split along k", |k| {
        let lim = binding_limited(k, SMALL_BINDING);
        let mut r = rng(305);
        for (form, m, n, kk, accumulate) in ALONG_K_CASES {
            let a = random_vec(&mut r, m * kk, -1.0, 1.0);
            let b = random_vec(&mut r, kk * n, -1.0, 1.0);
            let c0 = random_vec(&mut r, m * n, -1.0, 1.0);
            let run = |k: &Kernels| -> wgrad::Result<(Vec<f32>, usize)> {
                let (av, bv, cv) = (k.upload(&a)?, k.upload(&b)?, k.upload(&c0)?);
                let d = k.matmul(
                    &MatmulRequest::new(form, m, n, kk).with_epilogue(MatmulEpilogue {
                        accumulate,
                        ..MatmulEpilogue::default()
                    }),
                    cv.view(),
                    av.view(),
                    bv.view(),
                )?;
                k.run(&[&d])?;
                Ok((read(k, &cv)?, d.launches()))
            };
            let (split, launches) = run(&lim)?;
            let (whole, _) = run(k)?;
            let what = format!("{form:?} m={m} n={n} k={kk} accumulate={accumulate}");
            assert!(launches > 1, "{what}: {launches} launches");
            // f32 sums of ≤ 517 products of values in [-1, 1], each part's
            // rounded once more in C.
            assert_close(&what, &split, &whole, 1e-4, 1e-5);
            let (want, _) = cpu::matmul_epilogue(
                form,
                cpu::Epilogue {
                    accumulate_onto: accumulate.then_some(&c0[..]),
                    bias: None,
                    activation: None,
                    activation_grad: None,
                },
                &a,
                &b,
                m,
                n,
                kk,
            );
            assert_close(&format!("{what} against the CPU"), &split, &want, 1e-4, 1e-5);
        }
        Ok(())
    });
}

#[test]
fn a_matmul_that_cannot_split_names_the_operand_and_the_limit() {
    for_each_adapter("matmul split errors", |k| {
        let lim = binding_limited(k, SMALL_BINDING);
        let expect_too_large = |what: &str, result: wgrad::Result<wgrad::kernels::Dispatch>, operand: &str| {
            let err = result.expect_err(what);
            let message = err.to_string();
            assert!(matches!(err, Error::TooLarge { .. }), "{what}: {message}");
            assert!(
                message.contains(operand)
                    && message.contains("lowered by Kernels::with_limits")
                    && message.contains("1024"),
                "{what}: {message}"
            );
        };
        // AB: B [k, n] splits only along k, which a bias cannot follow.
        let (m, n, kk) = (2, 30, 20);
        let (a, b, c, bias) = (lim.zeros(m * kk)?, lim.zeros(kk * n)?, lim.zeros(m * n)?, lim.zeros(n)?);
        let epilogue = MatmulEpilogue {
            bias: Some(bias.view()),
            ..MatmulEpilogue::default()
        };
        expect_too_large(
            "AB with a bias, B over the limit",
            lim.matmul(
                &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_epilogue(epilogue),
                c.view(),
                a.view(),
                b.view(),
            ),
            "`b (stored [k, n]",
        );
        // A batch of products is not split.
        let (batch, m, n, kk) = (4, 10, 10, 10);
        let (a, b, c) = (
            lim.zeros(batch * m * kk)?,
            lim.zeros(batch * kk * n)?,
            lim.zeros(batch * m * n)?,
        );
        expect_too_large(
            "batched",
            lim.matmul(
                &MatmulRequest::new(MatmulForm::AB, m, n, kk).with_batch(batch),
                c.view(),
                a.view(),
                b.view(),
            ),
            "`a`",
        );
        // One row of A over the limit, with a bias (no split along k).
        let (m, n, kk) = (2, 2, 300);
        let (a, b, c, bias) = (lim.zeros(m * kk)?, lim.zeros(kk * n)?, lim.zeros(m * n)?, lim.zeros(n)?);
        let epilogue = MatmulEpilogue {
            bias: Some(bias.view()),
            ..MatmulEpilogue::default()
        };
        expect_too_large(
            "a row over the limit",
            lim.matmul(
                &MatmulRequest::new(MatmulForm::ABt, m, n, kk).with_epilogue(epilogue),
                c.view(),
                a.view(),
                b.view(),
            ),
            "one row",
        );
        Ok(())
    });
}

/// The embedding's vocabulary and channels in the split tests: a table of
/// 444 floats, over the 256 of [`SMALL_BINDING`].
const VOCAB: usize = 37;
const CHANNELS: usize = 12;

/// Ids from every part of the table, repeats, and one past the vocabulary.
fn embedding_ids() -> Vec<u32> {
    let mut ids: Vec<u32> = (0..VOCAB as u32).rev().step_by(3).collect();
    ids.extend([0, 36, 36, 17, 0, VOCAB as u32, 5]);
    ids
}

#[test]
fn embedding_lookups_over_small_bindings_equal_the_unsplit_ones() {
    for_each_adapter("embedding split over bindings", |k| {
        let lim = binding_limited(k, SMALL_BINDING);
        let table_host = random_vec(&mut rng(310), VOCAB * CHANNELS, -1.0, 1.0);
        let ids_host = embedding_ids();
        let n = ids_host.len();
        let lookup = |k: &Kernels| -> wgrad::Result<(Vec<f32>, usize)> {
            let (table, ids, out) = (k.upload(&table_host)?, k.upload(&ids_host)?, k.zeros(n * CHANNELS)?);
            let d = k.embedding_forward(out.view(), table.view(), ids.view(), n, VOCAB, CHANNELS)?;
            k.run(&[&d])?;
            Ok((read(k, &out)?, d.launches()))
        };
        let (split, launches) = lookup(&lim)?;
        let (whole, _) = lookup(k)?;
        assert!(launches > 1, "{launches} launches");
        // Copies: exact, NaN for the id past the vocabulary.
        assert_close("split lookup", &split, &whole, 0.0, 0.0);
        assert_close(
            "split lookup against the CPU",
            &split,
            &cpu::embedding_forward(&table_host, &ids_host, VOCAB, CHANNELS),
            0.0,
            0.0,
        );

        // The backward adds into dtable, row range by row range.
        let dout_host = random_vec(&mut rng(311), n * CHANNELS, -1.0, 1.0);
        let dtable0 = random_vec(&mut rng(312), VOCAB * CHANNELS, -1.0, 1.0);
        let backward = |k: &Kernels| -> wgrad::Result<(Vec<f32>, usize)> {
            let (dtable, dout, ids) = (k.upload(&dtable0)?, k.upload(&dout_host)?, k.upload(&ids_host)?);
            let (order, cursor) = (k.zeros(n)?, k.zeros(VOCAB + 1)?);
            let sort = k.embedding_backward_sort(order.view(), cursor.view(), ids.view(), n, VOCAB)?;
            let gather =
                k.embedding_backward(dtable.view(), dout.view(), ids.view(), order.view(), n, VOCAB, CHANNELS)?;
            k.run(&[&sort, &gather])?;
            Ok((read(k, &dtable)?, gather.launches()))
        };
        let (split, launches) = backward(&lim)?;
        let (whole, _) = backward(k)?;
        assert!(launches > 1, "{launches} backward launches");
        // The same sums in the same position order: equal bit for bit.
        assert_eq!(bits(&split), bits(&whole), "split backward");
        let want: Vec<f32> = cpu::embedding_backward(&dout_host, &ids_host, VOCAB, CHANNELS)
            .iter()
            .zip(&dtable0)
            .map(|(g, d)| g + d)
            .collect();
        // Sums of ≤ 3 values in [-1, 1] plus the start, f32 against f64.
        assert_close("split backward against the CPU", &split, &want, 1e-6, 1e-6);
        Ok(())
    });
}

/// A GPT whose token table (300 × 16 floats, 19.2 KB) and full-sequence
/// logits (16 × 300) are over [`GPT_BINDING`] while every other tensor
/// fits it, with logits of order 1 so greedy picks are clear.
const GPT: GptConfig = GptConfig {
    vocab_size: 300,
    block_size: 16,
    n_layer: 2,
    n_head: 2,
    n_embd: 16,
};
const GPT_BINDING: u64 = 8192;

fn gpt_model() -> Gpt {
    nn::manual_seed(320);
    let mut model = Gpt::new(GPT).expect("valid config");
    model
        .wte
        .weight
        .iter_mut()
        .chain(model.wpe.weight.iter_mut())
        .for_each(|w| *w *= 25.0);
    model
}

#[test]
fn generation_with_the_token_table_over_a_binding_equals_generation_without() {
    for_each_adapter("generate with a split head and lookup", |k| {
        assert!((GPT.vocab_size * GPT.n_embd * 4) as u64 > GPT_BINDING);
        let lim = binding_limited(k, GPT_BINDING);
        let model = gpt_model();
        let mut split = Generator::new(lim.clone(), &model, 1)?;
        let mut whole = Generator::new(k.clone(), &model, 1)?;
        let mut r = rng(321);
        let sequence: Vec<u32> = (0..GPT.block_size)
            .map(|_| r.random_range(0..GPT.vocab_size as u32))
            .collect();
        // Prefill then decode to the end of the context: every launch of
        // the split lookup and head against the one dispatch each.
        let prompt = &sequence[..5];
        assert_eq!(
            bits(&split.prefill(&[prompt])?),
            bits(&whole.prefill(&[prompt])?),
            "prefill logits"
        );
        for (p, &token) in sequence.iter().enumerate().skip(5) {
            assert_eq!(
                bits(&split.decode(&[token])?),
                bits(&whole.decode(&[token])?),
                "decode logits at {p}"
            );
        }
        let greedy = Sampling::greedy();
        let ids = split.generate(&[7, 3, 250], 30, &greedy, |_| Ok(()))?;
        assert_eq!(
            ids,
            whole.generate(&[7, 3, 250], 30, &greedy, |_| Ok(()))?,
            "greedy ids"
        );

        // The full-sequence forward (Gpt::forward): logits [16, 300] in
        // blocks of rows.
        let forward = |k: &Arc<Kernels>| -> wgrad::Result<Vec<f32>> {
            let mut g = Graph::new();
            let idx = model.input(&mut g, 1)?;
            let logits = model.forward(&mut g, idx, "")?;
            let mut exec = Executor::new(k.clone(), g, &[logits], None, None)?;
            exec.set_labels(idx, &sequence)?;
            exec.run_and_read(&[logits], logits)
        };
        assert_eq!(bits(&forward(&lim)?), bits(&forward(k)?), "full-sequence logits");
        Ok(())
    });
}

#[test]
fn a_model_over_the_memory_or_the_buffer_limit_is_refused_before_allocating() {
    for_each_adapter("model over the memory", |k| {
        let model = gpt_model();
        let parameters = GPT.num_parameters() as u64 * 4;

        let small_memory = limited_kernels(
            k,
            LimitOverrides {
                memory_bytes: Some(parameters),
                ..LimitOverrides::default()
            },
        );
        let buffers = small_memory.buffers_created();
        let err = Generator::new(small_memory.clone(), &model, 1).expect_err("over the memory");
        let message = err.to_string();
        let Error::MemoryTooSmall { needed, available, .. } = err else {
            panic!("{message}")
        };
        assert!(needed > available && available == parameters, "{message}");
        assert!(
            message.contains(&needed.to_string())
                && message.contains(&parameters.to_string())
                && message.contains("parameters"),
            "{message}"
        );
        assert_eq!(
            small_memory.buffers_created(),
            buffers,
            "buffers allocated before the refusal"
        );
        // From the sizes alone: parameters plus caches over the memory.
        let err = check_fits(&small_memory, &GPT, 1).expect_err("over the memory, from the config");
        assert!(
            matches!(err, Error::MemoryTooSmall { .. }) && err.to_string().contains("KV caches"),
            "{err}"
        );
        // Room for both: the check passes.
        let roomy = limited_kernels(
            k,
            LimitOverrides {
                memory_bytes: Some(2 * parameters),
                ..LimitOverrides::default()
            },
        );
        check_fits(&roomy, &GPT, 1)?;

        // One buffer over the buffer limit: the parameter arena.
        let small_buffers = limited_kernels(
            k,
            LimitOverrides {
                max_buffer_size: Some(parameters / 2),
                ..LimitOverrides::default()
            },
        );
        let buffers = small_buffers.buffers_created();
        let err = Generator::new(small_buffers.clone(), &model, 1).expect_err("over the buffer limit");
        let message = err.to_string();
        assert!(
            matches!(err, Error::TooLarge { .. })
                && message.contains("`parameters`")
                && message.contains("max_buffer_size"),
            "{message}"
        );
        assert_eq!(
            small_buffers.buffers_created(),
            buffers,
            "buffers allocated before the refusal"
        );

        // A limit above the adapter's is refused.
        let adapter = k.device().limits().max_storage_buffer_binding_size;
        let backend = wgpu::Backends::from(k.device().info().backend);
        let device = wgrad::Device::open(&wgrad::DeviceOptions {
            backends: Some(backend),
            adapter: None,
            ..Default::default()
        })?;
        let err = Kernels::with_limits(
            device,
            LimitOverrides {
                max_storage_buffer_binding_size: Some(adapter + 4),
                ..LimitOverrides::default()
            },
        )
        .expect_err("above the adapter");
        assert!(err.to_string().contains(&adapter.to_string()), "{err}");
        Ok(())
    });
}
