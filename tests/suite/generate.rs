//! Generation with a KV cache (`wgrad::infer::generate`): the cached attention
//! kernel against its CPU twin, the cached logits against a full-sequence
//! forward (`Predictor`), greedy and sampled generation against a full
//! recompute at every step (past the context too), and each error.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use std::sync::Arc;

use crate::common;

use common::{assert_close, for_each_adapter, for_each_shaping, random_vec, read, rng};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgrad::infer::generate::{Generator, Sampling};
use wgrad::infer::Predictor;
use wgrad::kernels::{CachedAttentionKernel, CachedAttentionShape, QkvLayout, GROUPED_MAX_HEAD_DIM, MAX_HEAD_DIM};
use wgrad::models::{Gpt, GptConfig};
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, AttentionKernel, Module, RopeLayout};
use wgrad::{cpu, Error};

/// (sequences, rows, heads, head_dim, context, starts): head dim 1, prime
/// head counts and dims, position 0 (one position) and context − 1,
/// several sequences at different positions, a prompt's rows after cached
/// ones (rows > 1, start > 0), a whole prompt, GPT-2's 12 heads of 64,
/// more invocations than a 256-wide workgroup, the largest head
/// dimension; for the GPU shape (one workgroup of DECODE_LANES = 64 lanes
/// per head) 1, 63, 64, 65 and 131 positions, a prompt whose rows straddle
/// the lanes, head dims around its 32-channel merge chunks (31, 33, 67);
/// contexts near llvmpipe's 65,535 loop iterations for one invocation
/// (1,024 positions of 64 channels, within them unrolled; 700 of 256, past
/// them, which CPU adapters run with the workgroup kernel of 32 lanes); and
/// positions past the context (their rows NaN, the caches untouched).
/// Each runs as multi-head attention over one fused qkv operand (a GPT's).
type AttentionCase = (usize, usize, usize, usize, usize, &'static [u32]);

/// Grouped-query cases, (sequences, rows, heads, kv_heads, head_dim,
/// context, starts, layout): three separate operands (Llama's) and fused
/// ones, groups of 2, 3 and 7 query heads per KV head, multi-query
/// (kv_heads 1), a prompt after cached rows, a prime head dim, one on
/// GPT-2's 1,024 positions (the workgroup kernel on CPU adapters too),
/// heads of 64 channels (the grouped kernel's longest) and of 68 (past it:
/// a CPU adapter's other kernels), and a position past the context.
type GroupedCase = (usize, usize, usize, usize, usize, usize, &'static [u32], QkvLayout);

const GROUPED_CASES: [GroupedCase; 9] = [
    (1, 1, 2, 1, 1, 1, &[0], QkvLayout::Separate),
    (2, 3, 6, 2, 5, 11, &[0, 4], QkvLayout::Separate),
    (3, 1, 9, 3, 8, 17, &[16, 0, 7], QkvLayout::Separate),
    (2, 4, 7, 1, 13, 13, &[2, 9], QkvLayout::Separate),
    (2, 5, 4, 2, 6, 9, &[0, 3], QkvLayout::Fused),
    (1, 2, 14, 2, 64, 97, &[60], QkvLayout::Fused),
    (1, 1, 4, 1, 64, 1024, &[1000], QkvLayout::Separate),
    (2, 2, 6, 3, 3, 7, &[6, 1], QkvLayout::Separate),
    (1, 3, 6, 2, 68, 23, &[20], QkvLayout::Separate),
];

const ATTENTION_CASES: [AttentionCase; 18] = [
    (1, 1, 1, 1, 1, &[0]),
    (1, 1, 3, 1, 5, &[4]),
    (2, 1, 5, 7, 11, &[0, 10]),
    (3, 1, 2, 13, 17, &[3, 16, 8]),
    (2, 4, 3, 5, 13, &[0, 6]),
    (1, 13, 3, 8, 13, &[0]),
    (4, 1, 12, 64, 40, &[39, 0, 17, 5]),
    (3, 30, 7, 3, 37, &[0, 7, 2]),
    (2, 3, 1, 2, 3, &[0, 0]),
    (1, 2, 2, MAX_HEAD_DIM, 6, &[3]),
    (3, 1, 2, 31, 131, &[62, 63, 64]),
    (1, 1, 3, 33, 131, &[130]),
    (2, 1, 1, 67, 97, &[96, 0]),
    (1, 70, 2, 16, 97, &[5]),
    (1, 1, 12, 64, 1024, &[1000]),
    (1, 2, 1, MAX_HEAD_DIM, 700, &[690]),
    (2, 1, 3, 5, 7, &[7, 2]),
    (1, 4, 2, 3, 9, &[7]),
];

/// Sliding windows over grouped cases: a window of 1, windows shorter
/// than the cached positions (a decode step and a prompt after cached
/// rows, whose window reaches back into the cache or not), on the grouped
/// kernel's 64 channels, past them, at Gemma 3's 256, a 70-row prompt, a
/// window as long as the context (no window), and a position past it.
const WINDOW_CASES: [(GroupedCase, usize); 10] = [
    ((1, 1, 2, 1, 1, 1, &[0], QkvLayout::Separate), 1),
    ((2, 3, 6, 2, 5, 11, &[0, 4], QkvLayout::Separate), 3),
    ((3, 1, 9, 3, 8, 17, &[16, 0, 7], QkvLayout::Separate), 5),
    ((1, 2, 14, 2, 64, 97, &[60], QkvLayout::Fused), 7),
    ((1, 1, 4, 1, 64, 1024, &[1000], QkvLayout::Separate), 13),
    ((1, 3, 6, 2, 68, 23, &[20], QkvLayout::Separate), 2),
    ((1, 70, 4, 2, 16, 97, &[5], QkvLayout::Fused), 11),
    ((1, 2, 2, 1, 256, 40, &[30], QkvLayout::Separate), 17),
    ((2, 4, 7, 1, 13, 13, &[2, 9], QkvLayout::Separate), 13),
    ((2, 1, 3, 3, 5, 7, &[7, 2], QkvLayout::Fused), 3),
];

/// Every case of [`ATTENTION_CASES`] (multi-head over one fused qkv),
/// [`GROUPED_CASES`] and [`WINDOW_CASES`], with the seed each draws its
/// values from.
fn attention_cases() -> impl Iterator<Item = (u64, CachedAttentionShape, &'static [u32])> {
    let fused = ATTENTION_CASES
        .iter()
        .map(|&(seqs, rows, heads, head_dim, context, starts)| {
            (
                CachedAttentionShape::fused(seqs, rows, heads, head_dim, context),
                starts,
            )
        });
    let grouped = GROUPED_CASES
        .iter()
        .map(|&(seqs, rows, heads, kv_heads, head_dim, context, starts, layout)| {
            (
                CachedAttentionShape {
                    seqs,
                    rows,
                    heads,
                    kv_heads,
                    head_dim,
                    context,
                    layout,
                    window: None,
                },
                starts,
            )
        });
    let windowed = WINDOW_CASES.iter().map(
        |&((seqs, rows, heads, kv_heads, head_dim, context, starts, layout), window)| {
            (
                CachedAttentionShape {
                    seqs,
                    rows,
                    heads,
                    kv_heads,
                    head_dim,
                    context,
                    layout,
                    window: Some(window),
                },
                starts,
            )
        },
    );
    fused
        .chain(grouped)
        .chain(windowed)
        .enumerate()
        .map(|(i, (shape, starts))| (900 + i as u64, shape, starts))
}

/// One cached attention on `kernel` (None: the one the adapter picks)
/// against its CPU twin: the output and both caches.
fn check_cached_attention(
    k: &wgrad::kernels::Kernels,
    seed: u64,
    shape: CachedAttentionShape,
    starts: &[u32],
    kernel: Option<CachedAttentionKernel>,
) -> wgrad::Result<()> {
    let lengths = shape.lengths().expect("small shape");
    let mut r = rng(seed);
    let q_host = random_vec(&mut r, lengths.q, -2.0, 2.0);
    // A fused qkv is one operand given as q, k and v.
    let (k_host, v_host) = match shape.layout {
        QkvLayout::Fused => (q_host.clone(), q_host.clone()),
        QkvLayout::Separate => (
            random_vec(&mut r, lengths.k, -2.0, 2.0),
            random_vec(&mut r, lengths.v, -2.0, 2.0),
        ),
    };
    // Earlier positions' keys and values, as a previous step left them.
    let k_cache_host = random_vec(&mut r, lengths.cache, -2.0, 2.0);
    let v_cache_host = random_vec(&mut r, lengths.cache, -2.0, 2.0);
    let (q, k_rows, v_rows, starts_gpu) = (
        k.upload(&q_host)?,
        k.upload(&k_host)?,
        k.upload(&v_host)?,
        k.upload(starts)?,
    );
    let (k_rows, v_rows) = match shape.layout {
        QkvLayout::Fused => (&q, &q),
        QkvLayout::Separate => (&k_rows, &v_rows),
    };
    // Zeros, not NaN: a row past the context must be written NaN.
    let (k_cache, v_cache, out) = (
        k.upload(&k_cache_host)?,
        k.upload(&v_cache_host)?,
        k.zeros(lengths.out)?,
    );
    let views = (
        out.view(),
        k_cache.view(),
        v_cache.view(),
        q.view(),
        k_rows.view(),
        v_rows.view(),
        starts_gpu.view(),
    );
    let dispatch = match kernel {
        Some(kernel) => k.cached_attention_forward_with(
            kernel, views.0, views.1, views.2, views.3, views.4, views.5, views.6, shape,
        )?,
        None => k.cached_attention_forward(views.0, views.1, views.2, views.3, views.4, views.5, views.6, shape)?,
    };
    k.run(&[&dispatch])?;
    let (want_out, want_k, want_v) =
        cpu::cached_attention(&q_host, &k_host, &v_host, starts, &k_cache_host, &v_cache_host, shape);
    let what = format!(
        "{shape:?} starts {starts:?}, kernel {kernel:?}, GPU shaping {}",
        k.gpu_shaped()
    );
    // f32 sums of ≤ 256 products over ≤ 1,024 positions against
    // f64; outputs are weighted means of values in [-2, 2].
    assert_close(&format!("out {what}"), &read(k, &out)?, &want_out, 1e-5, 1e-4);
    // Copies: exact, and rows not written keep their values.
    assert_close(&format!("k_cache {what}"), &read(k, &k_cache)?, &want_k, 0.0, 0.0);
    assert_close(&format!("v_cache {what}"), &read(k, &v_cache)?, &want_v, 0.0, 0.0);
    Ok(())
}

#[test]
fn cached_attention_matches_the_cpu() {
    for_each_shaping("cached_attention_forward", |k| {
        for (seed, shape, starts) in attention_cases() {
            check_cached_attention(k, seed, shape, starts, None)?;
        }
        Ok(())
    });
}

/// Each kernel on every case it takes, whichever the adapter would pick:
/// the workgroup kernel with 32 and 64 lanes, the grouped one (vec4
/// reads: head dims that are multiples of 4 up to GROUPED_MAX_HEAD_DIM;
/// groups of 1, 2, 3, 4 and 7 query heads per KV head, 7 past its 4 heads
/// per workgroup) and the channel one (any multiple of 4 up to
/// MAX_HEAD_DIM: lanes owning 1 to 8 vec4s of a head, some none), each
/// refusing a head dim it cannot take.
#[test]
fn every_cached_attention_kernel_matches_the_cpu() {
    for_each_adapter("cached_attention_forward_with", |k| {
        for (seed, shape, starts) in attention_cases() {
            for lanes in [32, 64] {
                check_cached_attention(k, seed, shape, starts, Some(CachedAttentionKernel::Workgroup { lanes }))?;
            }
            if shape.head_dim % 4 == 0 && shape.head_dim <= GROUPED_MAX_HEAD_DIM {
                check_cached_attention(k, seed, shape, starts, Some(CachedAttentionKernel::Grouped))?;
            } else {
                let err =
                    check_cached_attention(k, seed, shape, starts, Some(CachedAttentionKernel::Grouped)).unwrap_err();
                assert!(
                    err.to_string()
                        .contains(&format!("multiple of 4 up to {GROUPED_MAX_HEAD_DIM}")),
                    "{err}"
                );
            }
            if shape.head_dim % 4 == 0 {
                check_cached_attention(k, seed, shape, starts, Some(CachedAttentionKernel::Channels))?;
            } else {
                let err =
                    check_cached_attention(k, seed, shape, starts, Some(CachedAttentionKernel::Channels)).unwrap_err();
                assert!(
                    err.to_string().contains(&format!("multiple of 4 up to {MAX_HEAD_DIM}")),
                    "{err}"
                );
            }
        }
        Ok(())
    });
}

#[test]
fn cached_attention_checks_its_operands() {
    for_each_adapter("cached_attention_forward errors", |k| {
        let shape = CachedAttentionShape::fused(2, 1, 3, 4, 5);
        let lengths = shape.lengths().expect("small shape");
        let (qkv, starts, cache, out) = (
            k.zeros(lengths.q)?,
            k.zeros(2)?,
            k.zeros(lengths.cache)?,
            k.zeros(lengths.out)?,
        );
        let cache2 = k.zeros(lengths.cache)?;
        let short = k.zeros(lengths.cache - 1)?;
        let err = k
            .cached_attention_forward(
                out.view(),
                short.view(),
                cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                shape,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains(&format!("want {}", lengths.cache)),
            "{err}"
        );
        let zero_heads = CachedAttentionShape { heads: 0, ..shape };
        let err = k
            .cached_attention_forward(
                out.view(),
                cache.view(),
                cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                zero_heads,
            )
            .unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        // 2 KV heads do not divide 3 query heads.
        let uneven = CachedAttentionShape {
            kv_heads: 2,
            layout: QkvLayout::Separate,
            ..shape
        };
        let err = k
            .cached_attention_forward(
                out.view(),
                cache.view(),
                cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                uneven,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("divide"),
            "{err}"
        );
        // One KV head: caches a third of the size, separate operands of
        // their own widths; the fused buffers fit neither.
        let grouped = CachedAttentionShape {
            kv_heads: 1,
            layout: QkvLayout::Separate,
            ..shape
        };
        let err = k
            .cached_attention_forward(
                out.view(),
                cache.view(),
                cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                grouped,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("`k_cache`"),
            "{err}"
        );
        let small = grouped.lengths().expect("small shape");
        let (small_cache, small_cache2) = (k.zeros(small.cache)?, k.zeros(small.cache)?);
        let err = k
            .cached_attention_forward(
                out.view(),
                small_cache.view(),
                small_cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                grouped,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. })
                && err
                    .to_string()
                    .contains(&format!("`q` has {} elements, want {}", lengths.q, small.q)),
            "{err}"
        );
        let wide = CachedAttentionShape::fused(1, 1, 1, MAX_HEAD_DIM + 1, 1);
        let lengths = wide.lengths().expect("small shape");
        let (qkv, starts, out) = (k.zeros(lengths.q)?, k.zeros(1)?, k.zeros(lengths.out)?);
        let (cache, cache2) = (k.zeros(lengths.cache)?, k.zeros(lengths.cache)?);
        let err = k
            .cached_attention_forward(
                out.view(),
                cache.view(),
                cache2.view(),
                qkv.view(),
                qkv.view(),
                qkv.view(),
                starts.view(),
                wide,
            )
            .unwrap_err();
        assert!(err.to_string().contains(&format!("{}", MAX_HEAD_DIM + 1)), "{err}");
        Ok(())
    });
}

const CONFIG: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 13,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};

/// A random GPT whose attention is far from uniform and whose logits are
/// of order 1: GPT-2's init (std 0.02) gives near-equal attention weights
/// and logits near 0, against which a wrong mask or position would show
/// only in the fifth decimal.
fn sharp_model(seed: u64) -> Gpt {
    nn::manual_seed(seed);
    let mut model = Gpt::new(CONFIG).expect("valid config");
    for w in model.wte.weight.iter_mut().chain(model.wpe.weight.iter_mut()) {
        *w *= 25.0;
    }
    for block in &mut model.h {
        if let Some(attn) = &mut block.attn {
            attn.c_attn.weight.iter_mut().for_each(|w| *w *= 10.0);
        }
    }
    model
}

fn random_tokens(r: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| r.random_range(0..CONFIG.vocab_size as u32)).collect()
}

/// The logits at every position of `tokens` (≤ block_size) from a
/// full-sequence forward: the ids padded to block_size, which a causal
/// model's earlier positions never see. [len][vocab].
fn full_logits(predictor: &mut Predictor, tokens: &[u32]) -> wgrad::Result<Vec<Vec<f32>>> {
    let (block, vocab) = (CONFIG.block_size, CONFIG.vocab_size);
    let mut padded = tokens.to_vec();
    padded.resize(block, 0);
    let all = predictor.outputs_ids(&padded)?;
    Ok((0..tokens.len())
        .map(|p| all[p * vocab..(p + 1) * vocab].to_vec())
        .collect())
}

// The cached path (cached_attention, one row per step) and the full one
// (batched matmuls, causal softmax) sum in different orders in f32, on
// logits of order 1.
const LOGITS_ATOL: f32 = 1e-4;
const LOGITS_RTOL: f32 = 1e-4;

#[test]
fn kv_cache_logits_equal_the_full_sequence_logits() {
    for_each_shaping("generate: cached logits", |k| {
        let model = sharp_model(11);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let sequence = random_tokens(&mut rng(12), CONFIG.block_size);
        let full = full_logits(&mut predictor, &sequence)?;
        // A prompt of one token, of several, and of the whole context.
        for prompt_len in [1, 5, CONFIG.block_size] {
            let logits = generator.prefill(&[&sequence[..prompt_len]])?;
            assert_close(
                &format!("prefill of {prompt_len}"),
                &logits,
                &full[prompt_len - 1],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
            for p in prompt_len..CONFIG.block_size {
                let logits = generator.decode(&[sequence[p]])?;
                assert_close(
                    &format!("prompt {prompt_len}, decode at {p}"),
                    &logits,
                    &full[p],
                    LOGITS_ATOL,
                    LOGITS_RTOL,
                );
            }
            assert_eq!(generator.cached_tokens(0), Some(&sequence[..]));
        }
        // From an empty cache, decoding alone is the same forward.
        generator.reset()?;
        for (p, &token) in sequence.iter().enumerate() {
            let logits = generator.decode(&[token])?;
            assert_close(
                &format!("decode from empty at {p}"),
                &logits,
                &full[p],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
        }
        Ok(())
    });
}

#[test]
fn several_sequences_keep_their_own_caches() {
    for_each_shaping("generate: several sequences", |k| {
        let model = sharp_model(13);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 3)?;
        let vocab = CONFIG.vocab_size;
        let mut r = rng(14);
        let sequences: Vec<Vec<u32>> = (0..3).map(|_| random_tokens(&mut r, CONFIG.block_size)).collect();
        let full: Vec<Vec<Vec<f32>>> = sequences
            .iter()
            .map(|s| full_logits(&mut predictor, s))
            .collect::<wgrad::Result<_>>()?;
        // Prompts of different lengths, then steps in lockstep, each
        // sequence at its own position.
        let lens = [1, 6, 4];
        let prompts: Vec<&[u32]> = sequences.iter().zip(lens).map(|(s, n)| &s[..n]).collect();
        let logits = generator.prefill(&prompts)?;
        for s in 0..3 {
            assert_close(
                &format!("prefill, sequence {s}"),
                &logits[s * vocab..(s + 1) * vocab],
                &full[s][lens[s] - 1],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
        }
        for step in 0..CONFIG.block_size - 6 {
            let tokens: Vec<u32> = (0..3).map(|s| sequences[s][lens[s] + step]).collect();
            let logits = generator.decode(&tokens)?;
            for s in 0..3 {
                let p = lens[s] + step;
                assert_close(
                    &format!("step {step}, sequence {s} at {p}"),
                    &logits[s * vocab..(s + 1) * vocab],
                    &full[s][p],
                    LOGITS_ATOL,
                    LOGITS_RTOL,
                );
            }
        }
        Ok(())
    });
}

/// Small Llamas (the GPT's CONFIG sizes): grouped-query with 4 heads over
/// 2 KV heads and an untied head, multi-query (3 heads over 1, head width
/// 8) with a tied head, and Meta's interleaved rotary pairs with
/// multi-head attention.
pub(crate) fn llama_configs() -> [LlamaConfig; 3] {
    let base = LlamaConfig {
        vocab_size: CONFIG.vocab_size,
        block_size: CONFIG.block_size,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        n_embd: CONFIG.n_embd,
        intermediate_size: 40,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        rope_layout: RopeLayout::HalfSplit,
        head_dim: None,
        sliding_window: None,
        variant: wgrad::models::LlamaVariant::Llama,
    };
    [
        base,
        LlamaConfig {
            n_head: 3,
            n_kv_head: 1,
            tie_word_embeddings: true,
            ..base
        },
        LlamaConfig {
            n_kv_head: 4,
            rope_layout: RopeLayout::Interleaved,
            ..base
        },
    ]
}

/// A random Llama with sharp attention and logits of order 1 (as
/// `sharp_model`): Llama's init (std 0.02) scaled up.
pub(crate) fn sharp_llama(config: LlamaConfig, seed: u64) -> Llama {
    nn::manual_seed(seed);
    let mut model = Llama::new(config).expect("valid config");
    model.embed_tokens.weight.iter_mut().for_each(|w| *w *= 50.0);
    for layer in &mut model.layers {
        let attn = &mut layer.self_attn;
        for w in attn
            .q_proj
            .weight
            .iter_mut()
            .chain(attn.k_proj.weight.iter_mut())
            .chain(attn.v_proj.weight.iter_mut())
        {
            *w *= 15.0;
        }
        attn.o_proj
            .weight
            .iter_mut()
            .chain(layer.mlp.down_proj.weight.iter_mut())
            .for_each(|w| *w *= 10.0);
    }
    if let Some(head) = &mut model.lm_head {
        head.weight.iter_mut().for_each(|w| *w *= 50.0);
    }
    model
}

#[test]
fn llama_kv_cache_logits_equal_the_full_sequence_logits() {
    for_each_shaping("generate: Llama cached logits", |k| {
        let vocab = CONFIG.vocab_size;
        for (c, config) in llama_configs().into_iter().enumerate() {
            let model = sharp_llama(config, 40 + c as u64);
            let mut predictor = Predictor::new(k.clone(), &model, 1)?;
            let mut generator = Generator::new(k.clone(), &model, 3)?;
            let mut r = rng(41 + c as u64);
            let sequences: Vec<Vec<u32>> = (0..3).map(|_| random_tokens(&mut r, CONFIG.block_size)).collect();
            let full: Vec<Vec<Vec<f32>>> = sequences
                .iter()
                .map(|s| full_logits(&mut predictor, s))
                .collect::<wgrad::Result<_>>()?;
            let what = format!("{} on {}", model.describe(), k.device().label());
            let spread = full.iter().flatten().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(
                spread > 1.0,
                "{what}: logits of order 1 and above, got at most {spread}"
            );
            let mut worst = 0.0f32;
            let mut check = |label: String, got: &[f32], want: &[f32]| {
                worst = worst.max(got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max));
                assert_close(&format!("{what}: {label}"), got, want, LOGITS_ATOL, LOGITS_RTOL);
            };
            // Prompts of different lengths (one token, several, the whole
            // context), then steps in lockstep, each sequence at its own
            // position until it fills the context.
            let lens = [1, 6, CONFIG.block_size];
            let prompts: Vec<&[u32]> = sequences.iter().zip(lens).map(|(s, n)| &s[..n]).collect();
            let logits = generator.prefill(&prompts)?;
            for s in 0..3 {
                check(
                    format!("prefill, sequence {s}"),
                    &logits[s * vocab..(s + 1) * vocab],
                    &full[s][lens[s] - 1],
                );
            }
            generator.prefill(
                &prompts[..2]
                    .iter()
                    .copied()
                    .chain([&sequences[2][..4]])
                    .collect::<Vec<_>>(),
            )?;
            let lens = [1, 6, 4];
            for step in 0..CONFIG.block_size - 6 {
                let tokens: Vec<u32> = (0..3).map(|s| sequences[s][lens[s] + step]).collect();
                let logits = generator.decode(&tokens)?;
                for s in 0..3 {
                    let p = lens[s] + step;
                    check(
                        format!("step {step}, sequence {s} at {p}"),
                        &logits[s * vocab..(s + 1) * vocab],
                        &full[s][p],
                    );
                }
            }
            // From empty caches, decoding alone is the same forward at
            // every position.
            generator.reset()?;
            for p in 0..CONFIG.block_size {
                let tokens: Vec<u32> = (0..3).map(|s| sequences[s][p]).collect();
                let logits = generator.decode(&tokens)?;
                for s in 0..3 {
                    check(
                        format!("decode from empty, sequence {s} at {p}"),
                        &logits[s * vocab..(s + 1) * vocab],
                        &full[s][p],
                    );
                }
            }
            eprintln!("{what}: cached against full logits, max |diff| {worst:e} (logits up to {spread})");
        }
        Ok(())
    });
}

/// A Llama whose first layer attends through a sliding window of 3 (the
/// second to everything, as Gemma 3 mixes local and global layers): its
/// fused and unfused full-sequence logits agree and differ from the
/// windowless model's, and the KV-cache path (prompts of different
/// lengths, then decode steps with each sequence at its own position, and
/// decoding alone from empty caches) gives them at every position.
#[test]
fn sliding_window_cached_logits_equal_the_full_sequence_logits() {
    for_each_shaping("generate: sliding-window cached logits", |k| {
        let vocab = CONFIG.vocab_size;
        let plain = sharp_llama(llama_configs()[0], 48);
        let mut model = plain.clone();
        model.layers[0].self_attn.sliding_window = Some(3);
        let mut unfused = model.clone();
        unfused.set_attention_kernel(AttentionKernel::Unfused);
        let sequences: Vec<Vec<u32>> = (0..2)
            .map(|s| random_tokens(&mut rng(49 + s), CONFIG.block_size))
            .collect();
        let full_of = |m: &Llama| -> wgrad::Result<Vec<Vec<Vec<f32>>>> {
            let mut predictor = Predictor::new(k.clone(), m, 1)?;
            sequences.iter().map(|s| full_logits(&mut predictor, s)).collect()
        };
        let (full, reference, windowless) = (full_of(&model)?, full_of(&unfused)?, full_of(&plain)?);
        let what = model.describe();
        let layer = model.layers[0].self_attn.describe();
        assert!(layer.contains("sliding_window=3"), "{layer}");
        for s in 0..2 {
            for p in 0..CONFIG.block_size {
                let label = format!("{what}: fused vs unfused, sequence {s} at {p}");
                assert_close(&label, &full[s][p], &reference[s][p], LOGITS_ATOL, LOGITS_RTOL);
            }
        }
        // Positions 0 ..= 2 see the same keys with or without the window;
        // later ones must not.
        let moved = |p: usize| {
            full[0][p]
                .iter()
                .zip(&windowless[0][p])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max)
        };
        assert!(
            moved(2) < 1e-3 && moved(CONFIG.block_size - 1) > 1e-2,
            "{what}: the window changes late logits only"
        );
        let mut generator = Generator::new(k.clone(), &model, 2)?;
        let lens = [2, 7];
        let prompts: Vec<&[u32]> = sequences.iter().zip(lens).map(|(s, n)| &s[..n]).collect();
        let logits = generator.prefill(&prompts)?;
        for s in 0..2 {
            let label = format!("{what}: prefill of {}, sequence {s}", lens[s]);
            assert_close(
                &label,
                &logits[s * vocab..(s + 1) * vocab],
                &full[s][lens[s] - 1],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
        }
        for step in 0..CONFIG.block_size - 7 {
            let tokens: Vec<u32> = (0..2).map(|s| sequences[s][lens[s] + step]).collect();
            let logits = generator.decode(&tokens)?;
            for s in 0..2 {
                let p = lens[s] + step;
                let label = format!("{what}: step {step}, sequence {s} at {p}");
                assert_close(
                    &label,
                    &logits[s * vocab..(s + 1) * vocab],
                    &full[s][p],
                    LOGITS_ATOL,
                    LOGITS_RTOL,
                );
            }
        }
        generator.reset()?;
        for p in 0..CONFIG.block_size {
            let tokens: Vec<u32> = (0..2).map(|s| sequences[s][p]).collect();
            let logits = generator.decode(&tokens)?;
            for s in 0..2 {
                let label = format!("{what}: decode from empty, sequence {s} at {p}");
                assert_close(
                    &label,
                    &logits[s * vocab..(s + 1) * vocab],
                    &full[s][p],
                    LOGITS_ATOL,
                    LOGITS_RTOL,
                );
            }
        }
        Ok(())
    });
}

/// `Generator::extend`: a prefill after what the caches hold (each
/// sequence at its own position), its fallback to a whole prefill near the
/// context's end, and `truncate`, against the full-sequence logits; the
/// decode steps after them see the right caches. A GPT (position table)
/// and a Llama (rotary positions).
#[test]
fn a_continuation_prefill_equals_the_full_sequence_logits() {
    for_each_adapter("generate: extend", |k| {
        let vocab = CONFIG.vocab_size;
        let models: [Box<dyn nn::CausalLm>; 2] =
            [Box::new(sharp_model(15)), Box::new(sharp_llama(llama_configs()[0], 16))];
        for model in &models {
            let what = model.describe();
            let mut predictor = Predictor::new(k.clone(), model.as_ref(), 1)?;
            let mut generator = Generator::new(k.clone(), model.as_ref(), 2)?;
            let mut r = rng(17);
            let sequences: Vec<Vec<u32>> = (0..2).map(|_| random_tokens(&mut r, CONFIG.block_size)).collect();
            let full: Vec<Vec<Vec<f32>>> = sequences
                .iter()
                .map(|s| full_logits(&mut predictor, s))
                .collect::<wgrad::Result<_>>()?;
            let check = |label: &str, logits: &[f32], ends: [usize; 2]| {
                for s in 0..2 {
                    assert_close(
                        &format!("{what}: {label}, sequence {s} at {}", ends[s] - 1),
                        &logits[s * vocab..(s + 1) * vocab],
                        &full[s][ends[s] - 1],
                        LOGITS_ATOL,
                        LOGITS_RTOL,
                    );
                }
            };
            generator.prefill(&[&sequences[0][..3], &sequences[1][..1]])?;
            // From positions 3 and 1, in the 8-row pass.
            check(
                "extend",
                &generator.extend(&[&sequences[0][3..7], &sequences[1][1..7]])?,
                [7, 7],
            );
            assert_eq!(generator.cached_tokens(1), Some(&sequences[1][..7]));
            check(
                "decode after extend",
                &generator.decode(&[sequences[0][7], sequences[1][7]])?,
                [8, 8],
            );
            // 8 + 8 padded rows pass the context of 13: the pass starts at
            // position 5, running the cached tokens 5..8 again.
            check(
                "extend near the end",
                &generator.extend(&[&sequences[0][8..12], &sequences[1][8..10]])?,
                [12, 10],
            );
            assert_eq!(generator.cached_tokens(0), Some(&sequences[0][..12]));
            check(
                "decode after the whole prefill",
                &generator.decode(&[sequences[0][12], sequences[1][10]])?,
                [13, 11],
            );
            // Back to 2 and 5 tokens, then on from there.
            generator.truncate(0, 2)?;
            generator.truncate(1, 5)?;
            check(
                "extend after truncate",
                &generator.extend(&[&sequences[0][2..6], &sequences[1][5..6]])?,
                [6, 6],
            );
            expect_error(
                "extend past the context",
                generator.extend(&[&sequences[0][..8], &sequences[1][6..7]]),
                &["8 tokens after the 6", "context of 13"],
            );
            expect_error(
                "an empty continuation",
                generator.extend(&[&[], &sequences[1][6..7]]),
                &["empty"],
            );
            expect_error("truncate a third sequence", generator.truncate(2, 0), &["sequence 2"]);
            assert_eq!(
                generator.cached_tokens(0),
                Some(&sequences[0][..6]),
                "{what}: the errors kept the cache"
            );
        }
        Ok(())
    });
}

/// Chunked prefill (`GeneratorOptions::prefill_chunk`): prompts longer
/// than the chunk run in passes of at most its rows over the same caches,
/// and the logits after them, after a continuation that is itself longer
/// than the chunk and after a decode step equal those of one pass (and so
/// the full-sequence forward's), for chunks of 1, a prime (5) and one as
/// long as the context, on a GPT and a Llama: two prompts of 11 and 3
/// tokens in one batch (the short one done chunks before the long one), a
/// continuation that ends at the context's last position (its last chunk
/// starts earlier, re-running cached tokens) and one-slot prefills
/// (continuous batching's) of a prompt over several chunks.
#[test]
fn chunked_prefill_equals_one_pass() {
    use wgrad::infer::generate::{GeneratorOptions, PrefillMode};
    for_each_adapter("generate: chunked prefill", |k| {
        let vocab = CONFIG.vocab_size;
        let models: [Box<dyn nn::CausalLm>; 2] =
            [Box::new(sharp_model(61)), Box::new(sharp_llama(llama_configs()[0], 62))];
        for model in &models {
            let what = model.describe();
            let mut predictor = Predictor::new(k.clone(), model.as_ref(), 1)?;
            let mut r = rng(63);
            let sequences: Vec<Vec<u32>> = (0..2).map(|_| random_tokens(&mut r, CONFIG.block_size)).collect();
            let full: Vec<Vec<Vec<f32>>> = sequences
                .iter()
                .map(|s| full_logits(&mut predictor, s))
                .collect::<wgrad::Result<_>>()?;
            let options = |chunk: Option<usize>, prefill: PrefillMode| GeneratorOptions {
                sequences: 2,
                prefill_chunk: chunk,
                prefill,
                ..GeneratorOptions::default()
            };
            let mut one_pass =
                Generator::with_options(k.clone(), model.as_ref(), &options(None, PrefillMode::AllSequences))?;
            let steps = |generator: &mut Generator| -> wgrad::Result<[Vec<f32>; 3]> {
                Ok([
                    generator.prefill(&[&sequences[0][..11], &sequences[1][..3]])?,
                    generator.extend(&[&sequences[0][11..12], &sequences[1][3..12]])?,
                    generator.decode(&[sequences[0][12], sequences[1][12]])?,
                ])
            };
            let want = steps(&mut one_pass)?;
            let ends = [[11, 3], [12, 12], [13, 13]];
            for (step, ends) in ends.iter().enumerate() {
                for s in 0..2 {
                    // The one pass against the full forward: as the other
                    // cached-logits tests.
                    assert_close(
                        &format!("{what}: one pass, step {step}, sequence {s}"),
                        &want[step][s * vocab..(s + 1) * vocab],
                        &full[s][ends[s] - 1],
                        LOGITS_ATOL,
                        LOGITS_RTOL,
                    );
                }
            }
            for chunk in [1, 5, CONFIG.block_size] {
                let mut chunked = Generator::with_options(
                    k.clone(),
                    model.as_ref(),
                    &options(Some(chunk), PrefillMode::AllSequences),
                )?;
                let got = steps(&mut chunked)?;
                for (step, (got, want)) in got.iter().zip(&want).enumerate() {
                    // Other passes (1 to 16 rows) over the same positions:
                    // f32 sums in other orders.
                    assert_close(
                        &format!("{what}: chunk {chunk}, step {step}"),
                        got,
                        want,
                        LOGITS_ATOL,
                        LOGITS_RTOL,
                    );
                }
                for (s, sequence) in sequences.iter().enumerate() {
                    assert_eq!(chunked.cached_tokens(s), Some(&sequence[..13]), "{what}: chunk {chunk}");
                }
                // One slot at a time: the slot's greedy token after a
                // prompt of 12 tokens in chunks of `chunk` (over a history
                // of 2 in slot 1) is the one pass's argmax.
                let mut slots =
                    Generator::with_options(k.clone(), model.as_ref(), &options(Some(chunk), PrefillMode::OneSlot))?;
                let mut draws = ChaCha8Rng::seed_from_u64(1);
                let first = slots.prefill_slot(1, &sequences[1][..2], &Sampling::greedy(), &mut draws)?;
                assert!(
                    is_argmax(&full[1][1], first, 1e-4),
                    "{what}: chunk {chunk}, slot prefill"
                );
                let token = slots.extend_slot(1, &sequences[1][2..12], &Sampling::greedy(), &mut draws)?;
                assert!(
                    is_argmax(&full[1][11], token, 1e-4),
                    "{what}: chunk {chunk}, slot extend"
                );
                assert_eq!(slots.cached_tokens(1), Some(&sequences[1][..12]));
                let token = slots.prefill_slot(0, &sequences[0][..9], &Sampling::greedy(), &mut draws)?;
                assert!(is_argmax(&full[0][8], token, 1e-4), "{what}: chunk {chunk}, slot 0");
            }
            expect_error(
                "a chunk of no rows",
                Generator::with_options(k.clone(), model.as_ref(), &options(Some(0), PrefillMode::AllSequences)),
                &["at least 1 row"],
            );
        }
        Ok(())
    });
}

/// Without a chunk given, a prefill pass whose activations would not fit
/// one storage binding is shortened: a Llama of 8 channels and an MLP of
/// 96, on kernels whose bindings hold only its largest parameter, prefills
/// the whole context in passes shorter than it (the MLP's activations of
/// 13 rows would pass the binding), with the logits of a generator
/// without that limit.
#[test]
fn a_prefill_too_wide_for_a_binding_runs_in_shorter_passes() {
    for_each_adapter("generate: prefill within a binding", |k| {
        let config = LlamaConfig {
            n_embd: 8,
            n_head: 2,
            n_kv_head: 1,
            intermediate_size: 96,
            ..llama_configs()[0]
        };
        let model = sharp_llama(config, 64);
        let largest = model
            .named_parameters()
            .iter()
            .map(|(_, shape)| 4 * shape.iter().product::<usize>() as u64)
            .max()
            .unwrap_or(16);
        let limited = common::limited_kernels(
            k,
            wgrad::kernels::LimitOverrides {
                max_storage_buffer_binding_size: Some(largest.next_multiple_of(256)),
                ..Default::default()
            },
        );
        let prompt = random_tokens(&mut rng(65), CONFIG.block_size);
        let mut wide = Generator::new(k.clone(), &model, 1)?;
        let mut narrow = Generator::new(limited, &model, 1)?;
        assert_eq!(wide.prefill_chunk(), CONFIG.block_size);
        assert!(
            narrow.prefill_chunk() < CONFIG.block_size,
            "a binding of {largest} bytes: passes of {} rows",
            narrow.prefill_chunk()
        );
        let want = wide.prefill(&[&prompt])?;
        let got = narrow.prefill(&[&prompt])?;
        // Other passes over the same positions: f32 sums in other orders.
        assert_close("logits", &got, &want, LOGITS_ATOL, LOGITS_RTOL);
        Ok(())
    });
}

/// `context_that_fits`: the model's context where its caches fit the
/// adapter's memory beside its parameters; on kernels given less memory
/// the most positions that fit (one more would not), and an error naming
/// the memory where not even one position fits.
#[test]
fn the_context_shrinks_to_what_fits_the_memory() {
    use wgrad::infer::generate::{check_fits_with_options, context_that_fits, GeneratorOptions};
    use wgrad::nn::LmConfig;
    for_each_adapter("generate: the context that fits", |k| {
        let options = GeneratorOptions::default();
        let with = |context: usize| GeneratorOptions {
            context: Some(context),
            ..GeneratorOptions::default()
        };
        assert_eq!(context_that_fits(k, &CONFIG, &options, 1)?, CONFIG.block_size);
        let sizes = CONFIG.lm_sizes();
        // The parameters and the keys and values of 6 positions in all layers.
        let per_position = 4 * 2 * sizes.cached_layers * sizes.cache_width;
        let memory = 4 * sizes.parameters + 6 * per_position + per_position / 2;
        let small = common::limited_kernels(
            k,
            wgrad::kernels::LimitOverrides {
                memory_bytes: Some(memory),
                ..Default::default()
            },
        );
        let fitted = context_that_fits(&small, &CONFIG, &options, 1)?;
        assert_eq!(fitted, 6, "{memory} bytes of memory");
        check_fits_with_options(&small, &CONFIG, &with(fitted))?;
        assert!(check_fits_with_options(&small, &CONFIG, &with(fitted + 1)).is_err());
        let err = context_that_fits(&small, &CONFIG, &options, 7).unwrap_err();
        assert!(matches!(err, Error::MemoryTooSmall { .. }), "{err}");
        Ok(())
    });
}

#[test]
fn llama_greedy_generation_equals_a_full_recompute() {
    for_each_adapter("generate: Llama greedy", |k| {
        let model = sharp_llama(llama_configs()[1], 45);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let prompt = [5, 9, 2];
        // Past the context: the window shifts twice.
        let greedy = generator.generate(&prompt, 2 * CONFIG.block_size, &Sampling::greedy(), |_| Ok(()))?;
        check_against_recompute(&mut predictor, &prompt, &greedy, |logits, t| {
            is_argmax(logits, t, 2.0 * LOGITS_ATOL)
        })
    });
}

#[test]
fn a_decode_step_is_one_submit_and_allocates_nothing() {
    for_each_adapter("generate: one submit per token", |shared| {
        let k = &common::private_kernels(shared);
        let model = sharp_model(15);
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let submits = k.submit_count();
        generator.prefill(&[&[1, 2, 3]])?;
        assert_eq!(k.submit_count() - submits, 1, "prefill");
        generator.decode(&[4])?;
        let buffers = k.buffers_created();
        for token in 5..12 {
            let submits = k.submit_count();
            generator.decode(&[token])?;
            assert_eq!(k.submit_count() - submits, 1, "decode of {token}");
        }
        // Picking the token on the GPU too: still one submit, whose only
        // readback is the [S, 2] u32 picks.
        let (sampling, mut draws) = (
            Sampling {
                temperature: 0.8,
                top_k: Some(5),
                top_p: None,
                seed: 3,
            },
            ChaCha8Rng::seed_from_u64(3),
        );
        for token in 12..14 {
            let submits = k.submit_count();
            generator.decode_and_sample(&[token], &sampling, &mut draws)?;
            assert_eq!(k.submit_count() - submits, 1, "decode_and_sample of {token}");
        }
        assert_eq!(k.buffers_created(), buffers, "buffers created by decode steps");
        Ok(())
    });
}

/// The argmax of `logits` up to `tolerance`: whether `token`'s logit is
/// within it of the largest (two logits closer than the cached and full
/// paths agree may pick either).
fn is_argmax(logits: &[f32], token: u32, tolerance: f32) -> bool {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits[token as usize] >= max - tolerance
}

/// Whether `token` is among the `k` largest `logits`, up to `tolerance`.
fn in_top_k(logits: &[f32], token: u32, k: usize, tolerance: f32) -> bool {
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    logits[token as usize] >= sorted[k - 1] - tolerance
}

/// Checks each generated token against a full recompute of the window the
/// generator's cache holds, which follows the documented rule: grow to
/// block_size tokens, then keep the last block_size / 2 and continue.
fn check_against_recompute(
    predictor: &mut Predictor,
    prompt: &[u32],
    generated: &[u32],
    picked_right: impl Fn(&[f32], u32) -> bool,
) -> wgrad::Result<()> {
    let (block, keep) = (CONFIG.block_size, CONFIG.block_size / 2);
    let mut window = prompt.to_vec();
    for (i, &token) in generated.iter().enumerate() {
        let full = full_logits(predictor, &window)?;
        let logits = full.last().expect("non-empty window");
        assert!(
            picked_right(logits, token),
            "token {i} = {token} with a window of {} tokens; logits {logits:?}",
            window.len()
        );
        window.push(token);
        if window.len() > block {
            window.drain(..window.len() - keep);
        }
    }
    Ok(())
}

#[test]
fn greedy_generation_is_deterministic_and_equals_a_full_recompute() {
    for_each_adapter("generate: greedy", |k| {
        let model = sharp_model(16);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let prompt = [3, 1, 4];
        // Fills the context exactly: no shift.
        let max_new = CONFIG.block_size - prompt.len();
        let mut streamed = Vec::new();
        let first = generator.generate(&prompt, max_new, &Sampling::greedy(), |t| {
            streamed.push(t);
            Ok(())
        })?;
        assert_eq!(first.len(), max_new);
        assert_eq!(streamed, first, "each token streams as it is produced");
        let second = generator.generate(&prompt, max_new, &Sampling::greedy(), |_| Ok(()))?;
        assert_eq!(first, second, "greedy generation twice");
        check_against_recompute(&mut predictor, &prompt, &first, |logits, t| {
            is_argmax(logits, t, 2.0 * LOGITS_ATOL)
        })
    });
}

#[test]
fn generation_past_the_context_shifts_and_goes_on() {
    for_each_adapter("generate: past block_size", |k| {
        let model = sharp_model(17);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let prompt = [5, 9, 2, 7, 30];
        // Three shifts' worth with a context of 13.
        let max_new = 3 * CONFIG.block_size;
        let mut count = 0;
        let greedy = generator.generate(&prompt, max_new, &Sampling::greedy(), |_| {
            count += 1;
            Ok(())
        })?;
        assert_eq!((greedy.len(), count), (max_new, max_new));
        assert!(generator.cached_tokens(0).is_some_and(|c| c.len() <= CONFIG.block_size));
        check_against_recompute(&mut predictor, &prompt, &greedy, |logits, t| {
            is_argmax(logits, t, 2.0 * LOGITS_ATOL)
        })?;

        let sampling = Sampling {
            temperature: 0.9,
            top_k: Some(4),
            top_p: None,
            seed: 99,
        };
        let sampled = generator.generate(&prompt, max_new, &sampling, |_| Ok(()))?;
        assert_eq!(
            sampled,
            generator.generate(&prompt, max_new, &sampling, |_| Ok(()))?,
            "the same seed twice"
        );
        check_against_recompute(&mut predictor, &prompt, &sampled, |logits, t| {
            in_top_k(logits, t, 4, 2.0 * LOGITS_ATOL)
        })
    });
}

#[test]
fn a_batch_of_prompts_generates_what_each_prompt_generates_alone() {
    for_each_adapter("generate: batch", |k| {
        let model = sharp_model(19);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        // Prompts of different lengths: each sequence decodes at its own position.
        let prompts: [&[u32]; 3] = [&[3, 1, 4, 1, 5], &[9], &[2, 6, 5]];
        let mut batch = Generator::new(k.clone(), &model, prompts.len())?;
        // The longest prompt fills the context exactly: no shift yet.
        let max_new = CONFIG.block_size - prompts[0].len();
        let mut steps = Vec::new();
        let greedy = batch.generate_batch(&prompts, max_new, &Sampling::greedy(), |tokens| {
            steps.push(tokens.to_vec());
            Ok(())
        })?;
        assert_eq!(steps.len(), max_new, "one callback per step");
        let mut alone = Generator::new(k.clone(), &model, 1)?;
        for (s, prompt) in prompts.iter().enumerate() {
            assert_eq!(greedy[s].len(), max_new);
            assert!(
                steps.iter().zip(&greedy[s]).all(|(step, &t)| step[s] == t),
                "sequence {s} streams its tokens in step order"
            );
            // Each row's sums run in the same order in a batch as alone.
            assert_eq!(
                greedy[s],
                alone.generate(prompt, max_new, &Sampling::greedy(), |_| Ok(()))?,
                "sequence {s} against the prompt alone"
            );
            check_against_recompute(&mut predictor, prompt, &greedy[s], |logits, t| {
                is_argmax(logits, t, 2.0 * LOGITS_ATOL)
            })?;
        }

        // Past the context with prompts of one length: every sequence shifts
        // when the generator's one does, so each follows the documented rule.
        let same_length: [&[u32]; 3] = [&[5, 9, 2], &[7, 30, 1], &[0, 0, 36]];
        let sampling = Sampling {
            temperature: 0.9,
            top_k: Some(4),
            top_p: None,
            seed: 7,
        };
        let max_new = 2 * CONFIG.block_size;
        let sampled = batch.generate_batch(&same_length, max_new, &sampling, |_| Ok(()))?;
        assert_eq!(
            sampled,
            batch.generate_batch(&same_length, max_new, &sampling, |_| Ok(()))?,
            "the same seed twice"
        );
        for (prompt, tokens) in same_length.iter().zip(&sampled) {
            check_against_recompute(&mut predictor, prompt, tokens, |logits, t| {
                in_top_k(logits, t, 4, 2.0 * LOGITS_ATOL)
            })?;
        }
        let greedy = batch.generate_batch(&same_length, max_new, &Sampling::greedy(), |_| Ok(()))?;
        for (prompt, tokens) in same_length.iter().zip(&greedy) {
            check_against_recompute(&mut predictor, prompt, tokens, |logits, t| {
                is_argmax(logits, t, 2.0 * LOGITS_ATOL)
            })?;
        }

        // A prompt past the context stops the batch before any step runs.
        let long = vec![1u32; CONFIG.block_size + 1];
        let mut called = false;
        expect_error(
            "a prompt past the context",
            batch.generate_batch(&[&[1], &long, &[2]], 3, &Sampling::greedy(), |_| {
                called = true;
                Ok(())
            }),
            &["prompt 1", "context"],
        );
        assert!(!called, "no tokens before the error");
        expect_error(
            "two prompts for three sequences",
            batch.generate_batch(&[&[1], &[2]], 3, &Sampling::greedy(), |_| Ok(())),
            &["2 prompts", "3 sequences"],
        );
        expect_error(
            "an empty prompt",
            batch.generate_batch(&[&[1], &[], &[2]], 3, &Sampling::greedy(), |_| Ok(())),
            &["prompt 1", "empty"],
        );
        expect_error(
            "no new tokens",
            batch.generate_batch(&prompts, 0, &Sampling::greedy(), |_| Ok(())),
            &["at least 1"],
        );
        Ok(())
    });
}

#[test]
fn a_callback_error_stops_generation() {
    for_each_adapter("generate: callback error", |k| {
        let mut generator = Generator::new(k.clone(), &sharp_model(18), 1)?;
        let mut seen = 0;
        let err = generator
            .generate(&[1], 10, &Sampling::greedy(), |_| {
                seen += 1;
                if seen == 3 {
                    return Err(Error::InvalidArgument {
                        op: "caller",
                        reason: "stop".into(),
                    });
                }
                Ok(())
            })
            .unwrap_err();
        assert!(err.to_string().contains("stop") && seen == 3, "{err} after {seen}");
        Ok(())
    });
}

/// Expects an `InvalidArgument` whose message holds every one of `parts`.
fn expect_error<T: std::fmt::Debug>(what: &str, result: wgrad::Result<T>, parts: &[&str]) {
    let err = result.expect_err(what);
    let message = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{what}: {message}");
    for part in parts {
        assert!(message.contains(part), "{what}: `{message}` does not mention {part}");
    }
}

#[test]
fn bad_requests_are_errors_that_lose_nothing() {
    for_each_adapter("generate: errors", |k| {
        let model = sharp_model(19);
        expect_error("no sequences", Generator::new(k.clone(), &model, 0), &["sequences"]);
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(k.clone(), &model, 1)?;
        let sequence = random_tokens(&mut rng(20), CONFIG.block_size);
        let full = full_logits(&mut predictor, &sequence)?;
        generator.prefill(&[&sequence[..4]])?;

        let too_long = vec![1u32; CONFIG.block_size + 1];
        let greedy = Sampling::greedy();
        expect_error("empty prompt", generator.prefill(&[&[]]), &["empty"]);
        expect_error("long prompt", generator.prefill(&[&too_long]), &["14", "13"]);
        expect_error(
            "token past the vocabulary",
            generator.prefill(&[&[1, 37]]),
            &["37", "vocabulary"],
        );
        expect_error(
            "two prompts for one sequence",
            generator.prefill(&[&[1], &[2]]),
            &["2 prompts", "1 sequences"],
        );
        expect_error("no decode token", generator.decode(&[]), &["0 tokens", "1 sequences"]);
        expect_error("two decode tokens", generator.decode(&[1, 2]), &["2 tokens"]);
        expect_error(
            "decode token past the vocabulary",
            generator.decode(&[40]),
            &["40", "37"],
        );
        expect_error(
            "max_new_tokens 0",
            generator.generate(&[1], 0, &greedy, |_| Ok(())),
            &["max_new_tokens"],
        );
        expect_error(
            "generate, empty prompt",
            generator.generate(&[], 3, &greedy, |_| Ok(())),
            &["empty"],
        );
        expect_error(
            "generate, long prompt",
            generator.generate(&too_long, 3, &greedy, |_| Ok(())),
            &["14", "13"],
        );
        expect_error(
            "generate, bad id",
            generator.generate(&[99], 3, &greedy, |_| Ok(())),
            &["99"],
        );
        let negative = Sampling {
            temperature: -1.0,
            ..greedy
        };
        expect_error(
            "negative temperature",
            generator.generate(&[1], 3, &negative, |_| Ok(())),
            &["-1"],
        );
        let nan = Sampling {
            temperature: f32::NAN,
            ..greedy
        };
        expect_error(
            "NaN temperature",
            generator.generate(&[1], 3, &nan, |_| Ok(())),
            &["NaN"],
        );
        let top_0 = Sampling {
            top_k: Some(0),
            ..greedy
        };
        expect_error("top_k 0", generator.generate(&[1], 3, &top_0, |_| Ok(())), &["top_k"]);
        for p in [0.0, -0.5, 1.5, f32::NAN] {
            let bad_p = Sampling {
                temperature: 1.0,
                top_p: Some(p),
                ..greedy
            };
            expect_error(
                &format!("top_p {p}"),
                generator.generate(&[1], 3, &bad_p, |_| Ok(())),
                &["top_p", &p.to_string()],
            );
            let host = bad_p
                .sample(&[0.0, 1.0], &mut ChaCha8Rng::seed_from_u64(0))
                .unwrap_err()
                .to_string();
            assert!(host.contains("top_p must be in (0, 1]"), "{host}");
        }

        // Nothing above touched the cache: decoding goes on from position 4.
        assert_eq!(generator.cached_tokens(0), Some(&sequence[..4]));
        for p in 4..CONFIG.block_size {
            let logits = generator.decode(&[sequence[p]])?;
            assert_close(
                &format!("decode at {p} after the errors"),
                &logits,
                &full[p],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
        }
        expect_error("decode past the context", generator.decode(&[1]), &["13 positions"]);

        let mut two = Generator::new(k.clone(), &model, 2)?;
        expect_error(
            "generate with two sequences",
            two.generate(&[1], 3, &greedy, |_| Ok(())),
            &["one sequence", "2"],
        );
        Ok(())
    });
}

#[test]
fn sampling_picks_from_the_top_k_and_repeats_with_its_seed() {
    let logits = [0.5, 3.0, -1.0, 3.0, 2.5, 0.0];
    let greedy = Sampling::greedy();
    let mut r = ChaCha8Rng::seed_from_u64(0);
    assert_eq!(greedy.sample(&logits, &mut r).unwrap(), 1, "the first of two maxima");
    let top_3 = Sampling {
        temperature: 2.0,
        top_k: Some(3),
        top_p: None,
        seed: 5,
    };
    let draw = |s: &Sampling| {
        let mut r = ChaCha8Rng::seed_from_u64(s.seed);
        (0..400)
            .map(|_| s.sample(&logits, &mut r).unwrap())
            .collect::<Vec<u32>>()
    };
    let draws = draw(&top_3);
    assert!(draws.iter().all(|t| [1, 3, 4].contains(t)), "{draws:?}");
    // Each of the three has probability ≥ 0.25 at temperature 2: all appear.
    assert!([1, 3, 4].iter().all(|t| draws.contains(t)), "{draws:?}");
    assert_eq!(draws, draw(&top_3), "the same seed");
    let top_1 = Sampling {
        temperature: 5.0,
        top_k: Some(1),
        top_p: None,
        seed: 1,
    };
    assert!(draw(&top_1).iter().all(|&t| t == 1));
    let mut bad = logits;
    bad[2] = f32::NAN;
    let err = top_3.sample(&bad, &mut r).unwrap_err();
    assert!(err.to_string().contains("token 2"), "{err}");
}

#[test]
fn a_model_without_attention_generates_too() {
    for_each_adapter("generate: no attention", |k| {
        nn::manual_seed(21);
        let model = Gpt::without_attention(CONFIG)?;
        let mut predictor = Predictor::new(k.clone(), &model, 1)?;
        let mut generator = Generator::new(Arc::clone(k), &model, 1)?;
        let sequence = random_tokens(&mut rng(22), 6);
        let full = full_logits(&mut predictor, &sequence)?;
        let logits = generator.prefill(&[&sequence[..2]])?;
        assert_close("prefill", &logits, &full[1], LOGITS_ATOL, LOGITS_RTOL);
        for p in 2..6 {
            assert_close(
                &format!("decode at {p}"),
                &generator.decode(&[sequence[p]])?,
                &full[p],
                LOGITS_ATOL,
                LOGITS_RTOL,
            );
        }
        Ok(())
    });
}

/// A Hugging Face GPT-2 folder (random weights, vocabulary 96, 32
/// positions, L2 H2 C16) and transformers' greedy continuation of a fixed
/// prompt, made by
/// `scripts/make_gpt2_folder.py tests/fixtures/hf-greedy-gpt2 --vocab-size 96 --n-positions 32 --n-embd 16 --n-layer 2 --n-head 2 --init-std 1.0 --seed 2`
/// and `scripts/check_greedy.py tests/fixtures/hf-greedy-gpt2 --prompt-ids 5,17,42,3,88,60 --max-new-tokens 20 --write tests/fixtures/hf-greedy-gpt2-ids.json`.
/// Along transformers' path the best logit leads the second by at least
/// `min_gap` (0.061), far above f32 rounding, so the ids must agree exactly.
#[test]
fn greedy_ids_equal_transformers_greedy_generate() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("hf-greedy-gpt2-ids.json")).unwrap()).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        expected[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, greedy) = (ids("prompt"), ids("greedy"));
    assert_eq!(greedy.len(), 20);
    assert!(
        expected["min_gap"].as_f64().unwrap() > 1e-2,
        "the fixture's path has near-ties"
    );
    let loaded = wgrad::io::gpt_folder::load_gpt_folder(fixtures.join("hf-greedy-gpt2")).unwrap();
    for_each_adapter("generate: greedy ids against transformers", |k| {
        let mut generator = Generator::new(k.clone(), &loaded.model, 1)?;
        let ours = generator.generate(&prompt, greedy.len(), &Sampling::greedy(), |_| Ok(()))?;
        assert_eq!(ours, greedy, "wgrad's greedy ids against transformers' generate");
        Ok(())
    });
}

#[test]
fn the_generation_bench_times_a_prompt_and_its_decode_steps() {
    // A context of 7: the prompt takes 3 tokens and the decode is capped at
    // the 4 positions left, however many tokens are asked for.
    let config = GptConfig {
        vocab_size: 13,
        block_size: 7,
        n_layer: 1,
        n_head: 1,
        n_embd: 8,
    };
    for_each_adapter("generation bench", |k| {
        let line = wgrad_benches::gpt_generate(k, config, 100)?;
        let value = |key: &str| -> f64 {
            let found = line.values.iter().find(|(name, _)| *name == key);
            found.and_then(|(_, v)| v.parse().ok()).unwrap_or(f64::NAN)
        };
        assert_eq!(line.case, "gpt_generate");
        assert_eq!(value("prefill_tokens"), 3.0);
        assert!(
            value("tokens_per_s") > 0.0 && value("prefill_tokens_per_s") > 0.0,
            "{line}"
        );
        let per_token_ms = value("ms_per_token");
        assert!(
            (per_token_ms - 1e3 / value("tokens_per_s")).abs() < 0.02 * per_token_ms.max(0.5),
            "{line}"
        );
        Ok(())
    });
}

/// `GeneratorOptions::suppressed_tokens`: the suppressed ids' logits come
/// back as the unsuppressed ones plus SUPPRESSED_LOGIT, the others exactly
/// as without suppression, and neither greedy decoding nor sampling at a
/// high temperature ever picks one, though unsuppressed the greedy picks
/// would (the suppressed ids are each step's argmax, then every id but
/// the prime-numbered ones). An id outside the vocabulary, or all of them,
/// is an error.
#[test]
fn suppressed_tokens_are_never_sampled() {
    use wgrad::infer::generate::{GeneratorOptions, SUPPRESSED_LOGIT};
    for_each_adapter("generate: suppressed tokens", |k| {
        let model = sharp_model(23);
        let prompt = random_tokens(&mut rng(24), 4);
        let mut plain = Generator::new(k.clone(), &model, 1)?;
        let free = plain.prefill(&[&prompt])?;
        let best = free
            .iter()
            .enumerate()
            .fold(0, |b, (i, &v)| if v > free[b] { i } else { b }) as u32;
        let with = |ids: Vec<u32>| GeneratorOptions {
            suppressed_tokens: ids,
            ..GeneratorOptions::default()
        };
        let mut masked = Generator::with_options(k.clone(), &model, &with(vec![best]))?;
        let logits = masked.prefill(&[&prompt])?;
        let mut want = free.clone();
        want[best as usize] += SUPPRESSED_LOGIT;
        // The same forward, one op more: only the added bias differs.
        assert_close("suppressed logits", &logits, &want, LOGITS_ATOL, LOGITS_RTOL);
        let greedy = masked.generate(&prompt, 6, &Sampling::greedy(), |_| Ok(()))?;
        assert!(
            greedy.iter().all(|&t| t != best),
            "{best} suppressed, generated {greedy:?}"
        );

        let primes = [2u32, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31];
        let rest: Vec<u32> = (0..CONFIG.vocab_size as u32).filter(|t| !primes.contains(t)).collect();
        let mut few = Generator::with_options(k.clone(), &model, &with(rest))?;
        let hot = Sampling {
            temperature: 2.0,
            top_k: None,
            top_p: None,
            seed: 3,
        };
        let sampled = few.generate(&prompt, CONFIG.block_size - prompt.len(), &hot, |_| Ok(()))?;
        assert!(
            sampled.iter().all(|t| primes.contains(t)),
            "only primes are left, sampled {sampled:?}"
        );

        let past = Generator::with_options(k.clone(), &model, &with(vec![37]));
        expect_error("an id past the vocabulary", past, &["37", "vocabulary"]);
        let every = (0..CONFIG.vocab_size as u32).collect();
        expect_error(
            "every id",
            Generator::with_options(k.clone(), &model, &with(every)),
            &["all 37"],
        );
        Ok(())
    });
}
