//! Fused causal attention (FlashAttention-2, shaders/flash_attention.wgsl):
//! each kernel against its CPU twin on every adapter, at T = 1, primes and
//! non-multiples of the 64-row block and of the key tile, with grouped
//! query heads; the same bits on a second run; the twin's backward against
//! central differences of its forward; the graph op's gradients against
//! f64 central differences; and the fused op against the unfused graph
//! (q·kᵀ, scale, causal softmax, ·v), values and gradients.
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{central_differences, gradcheck, mse_to_random, param, wide};
use std::sync::Arc;

use common::{
    assert_close, clipped_adamw, for_each_adapter, for_each_shaping, limited_kernels, random_vec, read, rng,
    train_on_one_device,
};
use rand::Rng;
use wgrad::graph::{Executor, Graph};
use wgrad::kernels::{FlashAttentionShape, LimitOverrides, FLASH_MAX_HEAD_DIM};
use wgrad::models::{Gpt, GptConfig, Llama, LlamaConfig};
use wgrad::nn::{self, AttentionKernel, Module, CPU_FUSED_ATTENTION_MIN_SEQ};
use wgrad::{cpu, Error, Kernels};

/// (batch, T, heads, kv_heads, d, sliding window): T = 1, primes, the
/// block (64) and past it; H = KV, H = 2·KV, H = 3·KV = 3, 8·KV; d = 1,
/// not a multiple of 4, of 16, Gemma 3's 256 and widths between; windows
/// of 1, primes shorter than a block and than T (whole key tiles outside
/// them), and one as long as T. The CPU-shaped kernels hold heads up to
/// d = 64; with CPU shaping, wider heads take the tiled ones.
const CASES: &[(usize, usize, usize, usize, usize, Option<usize>)] = &[
    (2, 1, 4, 2, 8, None),
    (1, 2, 3, 1, 1, None),
    (2, 7, 4, 2, 16, None),
    (1, 37, 3, 1, 64, None),
    (1, 64, 2, 2, 5, None),
    (1, 129, 4, 2, 16, None),
    (2, 67, 1, 1, 128, None),
    (1, 150, 8, 1, 72, None),
    (1, 37, 3, 1, 64, Some(1)),
    (1, 150, 2, 1, 16, Some(13)),
    (2, 67, 2, 2, 8, Some(67)),
    (1, 131, 2, 1, 72, Some(37)),
    (1, 70, 2, 1, 256, None),
    (1, 41, 1, 1, 256, Some(17)),
    (1, 33, 2, 1, 80, None),
    (1, 45, 2, 2, 96, Some(20)),
];

/// Loop iterations per launch low enough that every kernel of the
/// [`CASES`] past T = 30 splits its loop over several launches, as long
/// sequences do on a CPU adapter (llvmpipe's limit).
const SMALL_LOOP_BUDGET: usize = 300;

/// Every fused-attention kernel's outputs: (out, lse, delta, dq, dk, dv).
type Outputs = [Vec<f32>; 6];

/// The forward, the preprocessing and both backward kernels on `shape`,
/// the backward fed dout.
fn run_kernels(
    k: &Kernels,
    shape: FlashAttentionShape,
    q: &[f32],
    kk: &[f32],
    v: &[f32],
    dout: &[f32],
) -> wgrad::Result<Outputs> {
    let (q_len, kv_len, rows) = shape.lengths().expect("small shape");
    let (q_gpu, k_gpu, v_gpu, dout_gpu) = (k.upload(q)?, k.upload(kk)?, k.upload(v)?, k.upload(dout)?);
    let (out, lse, delta) = (k.zeros(q_len)?, k.zeros(rows)?, k.zeros(rows)?);
    let (dq, dk, dv) = (k.zeros(q_len)?, k.zeros(kv_len)?, k.zeros(kv_len)?);
    let forward = k.flash_attention_forward(out.view(), lse.view(), q_gpu.view(), k_gpu.view(), v_gpu.view(), shape)?;
    let prepare = k.flash_attention_backward_prepare(delta.view(), dout_gpu.view(), out.view(), shape)?;
    let query = k.flash_attention_backward_query(
        dq.view(),
        dout_gpu.view(),
        q_gpu.view(),
        k_gpu.view(),
        v_gpu.view(),
        lse.view(),
        delta.view(),
        shape,
    )?;
    let key_value = k.flash_attention_backward_key_value(
        dk.view(),
        dv.view(),
        dout_gpu.view(),
        q_gpu.view(),
        k_gpu.view(),
        v_gpu.view(),
        lse.view(),
        delta.view(),
        shape,
    )?;
    k.run(&[&forward, &prepare, &query, &key_value])?;
    Ok([
        read(k, &out)?,
        read(k, &lse)?,
        read(k, &delta)?,
        read(k, &dq)?,
        read(k, &dk)?,
        read(k, &dv)?,
    ])
}

/// Both shapes of the kernels run on every adapter: the GPU-shaped
/// (workgroup tiles) and the CPU-shaped (register blocks) entries.
#[test]
fn kernels_match_the_cpu_and_repeat_bit_for_bit() {
    for_each_shaping("flash_attention kernels", check_kernels);
}

#[test]
fn kernels_split_over_launches_match_the_cpu() {
    for_each_shaping("flash_attention kernels over several launches", |k| {
        let overrides = LimitOverrides {
            loop_iterations: Some(SMALL_LOOP_BUDGET),
            gpu_shaping: Some(k.gpu_shaped()),
            ..LimitOverrides::default()
        };
        check_kernels(&limited_kernels(k, overrides))
    });
}

/// Every kernel against its twin on [`CASES`], and a second run's bits.
fn check_kernels(k: &Arc<Kernels>) -> wgrad::Result<()> {
    for (i, &(batch, seq, heads, kv_heads, head_dim, window)) in CASES.iter().enumerate() {
        let shape = FlashAttentionShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
            window,
        };
        let (q_len, kv_len, _) = shape.lengths().expect("small shape");
        let mut r = rng(2700 + i as u64);
        let q = random_vec(&mut r, q_len, -1.0, 1.0);
        let kk = random_vec(&mut r, kv_len, -1.0, 1.0);
        let v = random_vec(&mut r, kv_len, -1.0, 1.0);
        let dout = random_vec(&mut r, q_len, -1.0, 1.0);
        let got = run_kernels(k, shape, &q, &kk, &v, &dout)?;
        let (out, lse) = cpu::flash_attention_forward(&q, &kk, &v, shape);
        let delta = cpu::flash_attention_backward_prepare(&dout, &out, shape);
        let grads = cpu::flash_attention_backward(&dout, &q, &kk, &v, &lse, &delta, shape);
        let shaping = if k.gpu_shaped() { "GPU-shaped" } else { "CPU-shaped" };
        let what = format!("{shape:?} on {} ({shaping})", k.device().label());
        // f32 sums of ≤ 256 products per score and ≤ 150 weighted
        // values per row against f64; outputs are means of values in
        // [-1, 1], log-sum-exps at most log T + √d.
        assert_close(&format!("out {what}"), &got[0], &out, 1e-5, 1e-4);
        assert_close(&format!("lse {what}"), &got[1], &lse, 1e-5, 1e-5);
        assert_close(&format!("delta {what}"), &got[2], &delta, 1e-5, 1e-4);
        // Gradients sum up to 8 heads × 150 rows of terms of either
        // sign: an absolute floor for the cancellations.
        assert_close(&format!("dq {what}"), &got[3], &grads.dq, 1e-4, 1e-3);
        assert_close(&format!("dk {what}"), &got[4], &grads.dk, 1e-4, 1e-3);
        assert_close(&format!("dv {what}"), &got[5], &grads.dv, 1e-4, 1e-3);
        // No atomics, fixed orders: a second run gives the same bits, and
        // a window as long as T is none.
        let again = if window.is_some_and(|w| w >= seq) {
            run_kernels(k, FlashAttentionShape { window: None, ..shape }, &q, &kk, &v, &dout)?
        } else {
            run_kernels(k, shape, &q, &kk, &v, &dout)?
        };
        for (name, (a, b)) in ["out", "lse", "delta", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(&again))
        {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} {what}: a second run differs"
            );
        }
    }
    Ok(())
}

#[test]
fn kernels_check_their_operands() {
    for_each_adapter("flash_attention errors", |k| {
        let shape = FlashAttentionShape {
            batch: 2,
            seq: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            window: None,
        };
        let (q_len, kv_len, rows) = shape.lengths().expect("small shape");
        let (q, kv, stats, out) = (k.zeros(q_len)?, k.zeros(kv_len)?, k.zeros(rows)?, k.zeros(q_len)?);
        let kv2 = k.zeros(kv_len)?;
        let err = k
            .flash_attention_forward(out.view(), stats.view(), q.view(), q.view(), kv2.view(), shape)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. })
                && err
                    .to_string()
                    .contains(&format!("`k` has {q_len} elements, want {kv_len}")),
            "{err}"
        );
        // 3 KV heads do not divide 4 query heads.
        let uneven = FlashAttentionShape { kv_heads: 3, ..shape };
        let err = k
            .flash_attention_forward(out.view(), stats.view(), q.view(), kv.view(), kv2.view(), uneven)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("divide"),
            "{err}"
        );
        let wide_heads = FlashAttentionShape {
            head_dim: FLASH_MAX_HEAD_DIM + 1,
            ..shape
        };
        let err = k
            .flash_attention_forward(out.view(), stats.view(), q.view(), kv.view(), kv2.view(), wide_heads)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("head_dim"),
            "{err}"
        );
        let no_window = FlashAttentionShape {
            window: Some(0),
            ..shape
        };
        let err = k
            .flash_attention_forward(out.view(), stats.view(), q.view(), kv.view(), kv2.view(), no_window)
            .unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("window"),
            "{err}"
        );
        let empty = FlashAttentionShape { seq: 0, ..shape };
        let err = k
            .flash_attention_backward_prepare(stats.view(), q.view(), out.view(), empty)
            .unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        Ok(())
    });
}

/// The twin's backward against central differences of its forward: the
/// loss Σ w·out for random weights w (= dout), causal and with a window.
#[test]
fn twin_backward_matches_central_differences() {
    for window in [None, Some(2)] {
        check_twin_backward(FlashAttentionShape {
            batch: 2,
            seq: 5,
            heads: 4,
            kv_heads: 2,
            head_dim: 3,
            window,
        });
    }
}

fn check_twin_backward(shape: FlashAttentionShape) {
    let (q_len, kv_len, _) = shape.lengths().expect("small shape");
    let mut r = rng(2750);
    let [q, kk, v] = [q_len, kv_len, kv_len].map(|n| wide(&random_vec(&mut r, n, -1.0, 1.0)));
    let dout = wide(&random_vec(&mut r, q_len, -1.0, 1.0));
    let (out, lse) = cpu::flash_attention_forward(&q, &kk, &v, shape);
    let delta = cpu::flash_attention_backward_prepare(&dout, &out, shape);
    let grads = cpu::flash_attention_backward(&dout, &q, &kk, &v, &lse, &delta, shape);
    let narrow = |x: &[f64]| -> Vec<f32> { x.iter().map(|&e| e as f32).collect() };
    // f64 differences with h = 1e-5 carry ~1e-10 truncation error.
    let dq = central_differences(&q, &dout, 1e-5, |x| cpu::flash_attention_forward(x, &kk, &v, shape).0);
    assert_close("twin dq", &narrow(&grads.dq), &dq, 1e-6, 1e-5);
    let dk = central_differences(&kk, &dout, 1e-5, |x| cpu::flash_attention_forward(&q, x, &v, shape).0);
    assert_close("twin dk", &narrow(&grads.dk), &dk, 1e-6, 1e-5);
    let dv = central_differences(&v, &dout, 1e-5, |x| cpu::flash_attention_forward(&q, &kk, x, shape).0);
    assert_close("twin dv", &narrow(&grads.dv), &dv, 1e-6, 1e-5);
}

/// The graph op's gradients on the GPU against f64 central differences of
/// `Graph::evaluate_f64`, and each backward node against its reference.
#[test]
fn op_gradients_match_central_differences() {
    for_each_shaping("fused_causal_attention gradcheck", |k| {
        // (batch, T, heads, kv_heads, d): grouped and multi-head.
        // (batch, T, heads, kv_heads, d, window): grouped and multi-head,
        // causal and windowed.
        let cases = [(1, 5, 2, 1, 3, None), (2, 3, 2, 2, 4, None), (1, 7, 2, 1, 3, Some(3))];
        for (i, &(batch, seq, heads, kv_heads, d, window)) in cases.iter().enumerate() {
            let mut g = Graph::new();
            let seed = 2760 + 10 * i as u64;
            let q = param(&mut g, "q", &[batch, seq, heads * d], seed);
            let kk = param(&mut g, "k", &[batch, seq, kv_heads * d], seed + 1);
            let v = param(&mut g, "v", &[batch, seq, kv_heads * d], seed + 2);
            let y = g.fused_causal_attention_window(q, kk, v, heads, window)?;
            let (loss, feeds) = mse_to_random(&mut g, y, seed + 3)?;
            gradcheck(
                k,
                &format!("fused_causal_attention {heads} heads over {kv_heads}, window {window:?}"),
                g,
                loss,
                feeds,
                vec![],
            )?;
        }
        Ok(())
    });
}

#[test]
fn fused_op_matches_the_unfused_graph() {
    for_each_shaping("fused_causal_attention vs unfused", |k| {
        // T = 1, a prime, and past one block of 64 rows; sliding windows
        // of 1, a prime, and one past T (no window).
        let cases = [
            (2, 1, 2, 4, None),
            (2, 13, 3, 8, None),
            (1, 70, 2, 16, None),
            (2, 13, 3, 8, Some(1)),
            (1, 70, 2, 16, Some(23)),
            (1, 9, 2, 4, Some(40)),
        ];
        for &(batch, seq, heads, d, window) in &cases {
            let mut results = Vec::new();
            for fused in [true, false] {
                let mut g = Graph::new();
                let q = param(&mut g, "q", &[batch, seq, heads * d], 2790);
                let kk = param(&mut g, "k", &[batch, seq, heads * d], 2791);
                let v = param(&mut g, "v", &[batch, seq, heads * d], 2792);
                // The unfused reference: q·kᵀ, scale, causal softmax, ·v over
                // [B, H, T, d] as separate graph ops.
                let kernel = if fused {
                    AttentionKernel::Fused
                } else {
                    AttentionKernel::Unfused
                };
                let y = nn::causal_attention_window(&mut g, [q, kk, v], (heads, heads, d), kernel, window)?;
                if fused {
                    assert_eq!(g.get(y).map(|n| n.op.name()), Some("fused_causal_attention"));
                }
                let (loss, feeds) = mse_to_random(&mut g, y, 2793)?;
                let grads = g.backward(loss)?;
                let mut exec = Executor::new(k.clone(), g, &[y, loss], Some(grads), None)?;
                for (t, data) in &feeds {
                    exec.set_input(*t, data)?;
                }
                exec.train_step(true, false, false)?;
                results.push([
                    exec.read(y)?,
                    exec.read_grad(q)?,
                    exec.read_grad(kk)?,
                    exec.read_grad(v)?,
                ]);
            }
            let what = format!("B {batch} T {seq} H {heads} d {d} window {window:?}");
            // Both are f32 on the GPU, summing in different orders.
            for (name, (fused, unfused)) in ["y", "dq", "dk", "dv"].iter().zip(results[0].iter().zip(&results[1])) {
                assert_close(&format!("{name} {what}"), fused, unfused, 1e-5, 1e-4);
            }
        }
        Ok(())
    });
}

/// Random token ids and targets for `steps` batches of `batch` × `t`.
fn token_batches(steps: u64, batch: usize, t: usize, vocab: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..steps)
        .map(|s| {
            let mut r = rng(2800 + s);
            let ids: Vec<u32> = (0..batch * t).map(|_| r.random_range(0..vocab)).collect();
            let targets = ids.iter().map(|&i| (i * 7 + 3) % vocab).collect();
            (ids, targets)
        })
        .collect()
}

/// A clipping threshold no gradient norm here reaches: the norms are
/// computed (and compared) but never clip.
const CLIP_ABOVE_EVERY_NORM: f32 = 1e6;

/// The GPT and the Llama (4 heads over 2 KV heads) train by default through
/// the fused op, and their losses and gradient norms over five AdamW steps
/// equal the unfused reference's.
#[test]
fn models_train_fused_by_default_as_the_unfused_reference() {
    for_each_adapter("models fused vs unfused attention", |k| {
        let (vocab, t, batch) = (23usize, 11usize, 3usize);
        let batches = token_batches(5, batch, t, vocab as u32);
        nn::manual_seed(27);
        let gpt = Gpt::new(GptConfig {
            vocab_size: vocab,
            block_size: t,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
        })?;
        nn::manual_seed(27);
        let llama = Llama::new(LlamaConfig {
            vocab_size: vocab,
            block_size: t,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            n_embd: 16,
            intermediate_size: 24,
            ..LlamaConfig::small(vocab)
        })?;
        let (mut gpt_unfused, mut llama_unfused) = (gpt.clone(), llama.clone());
        gpt_unfused.set_attention_kernel(AttentionKernel::Unfused);
        llama_unfused.set_attention_kernel(AttentionKernel::Unfused);
        let cases: [(&str, &dyn Module, &dyn Module); 2] =
            [("GPT", &gpt, &gpt_unfused), ("Llama", &llama, &llama_unfused)];
        for (name, fused, unfused) in cases {
            let (trainer, fused_losses, fused_norms) =
                train_on_one_device(k, fused, clipped_adamw(CLIP_ABOVE_EVERY_NORM, 5), batch, &batches);
            let ops: Vec<&str> = trainer.executor().graph().nodes().iter().map(|n| n.op.name()).collect();
            assert!(
                ops.contains(&"fused_causal_attention") && !ops.contains(&"softmax"),
                "{name} trains through the fused op by default: {ops:?}"
            );
            let (_, unfused_losses, unfused_norms) =
                train_on_one_device(k, unfused, clipped_adamw(CLIP_ABOVE_EVERY_NORM, 5), batch, &batches);
            // f32 on both paths, summing in different orders, over five
            // steps of an optimizer that normalizes its updates.
            assert_close(&format!("{name} losses"), &fused_losses, &unfused_losses, 1e-5, 1e-4);
            assert_close(
                &format!("{name} gradient norms"),
                &fused_norms,
                &unfused_norms,
                1e-5,
                1e-3,
            );
        }
        Ok(())
    });
}

/// Training picks the fused kernels on GPU-shaped kernels at every
/// length and head width, and on CPU adapters from
/// CPU_FUSED_ATTENTION_MIN_SEQ positions for heads the CPU-shaped kernels
/// hold (64 channels: GPT-2's and SmolLM2's), where they measured faster
/// than the unfused graph; wider heads stay unfused there.
#[test]
fn attention_kernel_follows_the_adapter_and_the_context() {
    for_each_shaping("AttentionKernel::for_devices", |k| {
        let devices = [k.clone()];
        let short = CPU_FUSED_ATTENTION_MIN_SEQ - 1;
        assert_eq!(
            AttentionKernel::for_devices(&devices, CPU_FUSED_ATTENTION_MIN_SEQ, 64),
            AttentionKernel::Fused
        );
        let want = if k.gpu_shaped() {
            AttentionKernel::Fused
        } else {
            AttentionKernel::Unfused
        };
        assert_eq!(
            AttentionKernel::for_devices(&devices, short, 64),
            want,
            "T = {short}, GPU-shaped {}",
            k.gpu_shaped()
        );
        assert_eq!(
            AttentionKernel::for_devices(&devices, 1024, 128),
            want,
            "d = 128, GPU-shaped {}",
            k.gpu_shaped()
        );
        assert!(k.flash_rows_hold(64) && !k.flash_rows_hold(65));
        Ok(())
    });
    assert_eq!(AttentionKernel::for_devices(&[], 1024, 64), AttentionKernel::Unfused);
}
