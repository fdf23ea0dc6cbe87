//! Time per dispatch of every kernel family except matmul (which has
//! `benches/matmul.rs`), on the default adapter:
//!
//! - `overhead`: an empty submit + wait, one tiny dispatch, and 16 tiny
//!   dispatches in one pass: the fixed costs every small kernel pays;
//! - `elementwise`: add/sub/mul, each activation forward and backward,
//!   bias_add;
//! - `reduce`: sum_rows, sum, max_rows, argmax_rows;
//! - `loss`: MSE and cross-entropy forward, backward and the fused
//!   single-workgroup forward_backward;
//! - `optim`: SGD, SGD with momentum and Adam over a flat parameter arena;
//! - `transformer`: every kernel at the shapes of `examples/attention.rs`
//!   (batch 32, seq 12, 48 channels, 4 heads: 384 token rows, 1536 score
//!   rows of 12), each as 1 and as 8 dispatches in one pass (the difference
//!   over 7 is the kernel's own time without the submit), and a whole
//!   training step of that model (`transformer/step`); and softmax /
//!   layernorm at 2048 rows of SHORT_ROW_MAX and SHORT_ROW_MAX + 3 columns
//!   (`threshold_*`: the two row-wise paths side by side);
//! - `quant_matvec`: decode's product (one row) with block-quantized
//!   weights on the adapter's chosen kernel, each GGUF format at the
//!   down projections of SmolLM2 (576 × 1536) and Gemma 3 270M (640 ×
//!   2048), whose rows are whole k-quant super-blocks; throughput is the
//!   packed weights' bytes.
//! - `flash_attention`: the fused attention's forward, and its forward
//!   with the three backward kernels, on the kernels the adapter's shaping
//!   picks: 4 heads of 64 channels (GPT-2's, SmolLM2's) and Gemma 3's 4
//!   query heads of 256 over 1 KV head, each causal and with a sliding
//!   window a quarter of the sequence (the tiles it skips are the gain).
//!
//! Each family runs at a tiny size (the time is the dispatch + submit + wait
//! overhead) and at large sizes (the time is the kernel's own work;
//! criterion reports Throughput::Bytes, the bytes each kernel must read and
//! write at least, so GB/s compares kernels with memory bandwidth). Every iteration submits once and waits for the GPU, so the time
//! is the real completion time, not the queueing time.
//!
//! No adapter: prints why and exits successfully.
//!
//! Environment: `WGRAD_ADAPTER` / `WGRAD_BACKEND` (adapter choice, see
//! `Device::open_default`), `LP_NUM_THREADS` (llvmpipe/lavapipe threads).
//!
//! Run: `LP_NUM_THREADS=2 cargo bench -p wgrad-benches --bench kernels` (about 2 minutes on
//! 2 cores); one family: `cargo bench -p wgrad-benches --bench kernels -- optim`.

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

use wgrad::kernels::MatmulRequest;
use wgrad::kernels::{
    pack_quantized, Activation, AdamConfig, Binary, Dispatch, FlashAttentionShape, MatmulForm, QuantFormat, QuantView,
    SgdConfig,
};
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::CrossEntropyLoss;
use wgrad::optim::Adam;
use wgrad::{Device, GpuTensor, Kernels};
use wgrad::{Targets, Trainer};

const F32: u64 = 4;

/// Elementwise and reduction sizes as (rows, cols): tiny is all overhead,
/// large (16 MiB per operand) is all the kernel's own work.
const TINY: (usize, usize) = (10, 100);
const LARGE: (usize, usize) = (4096, 1024);
/// A loss sees [batch, classes]: the MLP's 256×10, and an ImageNet-sized
/// 1024×1000 that shows how the one-workgroup fused kernels scale.
const LOSS_SHAPES: [(usize, usize); 2] = [(256, 10), (1024, 1000)];
/// Parameter arenas: tiny, ~1M (the 784-512-512-10 MLP has 0.67M) and ~10M.
const ARENAS: [usize; 3] = [1_000, 1 << 20, 10 << 20];

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "n/a".into())
}

fn random(rng: &mut ChaCha8Rng, len: usize, bound: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-bound..bound)).collect()
}

/// Buffers with seeded random contents, and one way to time a dispatch list.
struct Bench {
    kernels: Arc<Kernels>,
    rng: ChaCha8Rng,
}

impl Bench {
    fn tensor(&mut self, len: usize) -> GpuTensor {
        let data = random(&mut self.rng, len, 3.0);
        self.kernels.upload(&data).expect("upload")
    }

    fn labels(&mut self, rows: usize, cols: usize) -> GpuTensor {
        let data: Vec<u32> = (0..rows).map(|_| self.rng.random_range(0..cols as u32)).collect();
        self.kernels.upload(&data).expect("upload labels")
    }

    /// One pass holding `dispatches`, one submit, then wait until the GPU is
    /// done; `bytes`: the least memory traffic of one run, for throughput.
    /// The first run, outside the timing, lets GL compile (it builds shaders
    /// lazily at the first dispatch); it runs even when a criterion filter
    /// skips the case.
    fn time(
        &self,
        group: &mut BenchmarkGroup<'_, WallTime>,
        name: impl Into<String>,
        size: &str,
        bytes: Option<u64>,
        dispatches: &[&Dispatch],
    ) {
        let run = || {
            self.kernels.run(dispatches).expect("run");
            self.kernels.device().wait_idle("bench kernels").expect("wait");
        };
        run();
        if let Some(b) = bytes {
            group.throughput(Throughput::Bytes(b));
        }
        group.bench_function(BenchmarkId::new(name, size), |bench| bench.iter(run));
    }
}

/// Flat sampling: the large cases take milliseconds per iteration, and
/// criterion's default linear sampling would multiply the run time.
fn family<'c>(c: &'c mut Criterion, name: &str) -> BenchmarkGroup<'c, WallTime> {
    let mut group = c.benchmark_group(name);
    group.sampling_mode(SamplingMode::Flat);
    group
}

fn size_label((rows, cols): (usize, usize)) -> String {
    format!("{rows}x{cols}")
}

fn overhead(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "overhead");
    let n = TINY.0 * TINY.1;
    let (x, out) = (b.tensor(n), b.kernels.zeros(n).expect("zeros"));
    let relu = b
        .kernels
        .activation_forward(Activation::Relu, out.view(), x.view())
        .expect("relu");
    b.time(&mut group, "empty_submit_wait", "0", None, &[]);
    b.time(&mut group, "relu_tiny_dispatches", "1", None, &[&relu]);
    // The difference to one dispatch, over 15, is the cost of a dispatch
    // inside a pass (llvmpipe wakes its thread pool for each).
    let sixteen = [&relu; 16];
    b.time(&mut group, "relu_tiny_dispatches", "16", None, &sixteen);
    group.finish();
}

fn elementwise(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "elementwise");
    for shape in [TINY, LARGE] {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let (x, y, out) = (b.tensor(n), b.tensor(n), b.kernels.zeros(n).expect("zeros"));
        for op in Binary::ALL {
            let d = b.kernels.binary(op, out.view(), x.view(), y.view()).expect("binary");
            b.time(&mut group, format!("{op:?}"), &label, Some(3 * n as u64 * F32), &[&d]);
        }
        for act in Activation::ALL {
            let fwd = b
                .kernels
                .activation_forward(act, out.view(), x.view())
                .expect("activation forward");
            b.time(
                &mut group,
                format!("{act:?}_forward"),
                &label,
                Some(2 * n as u64 * F32),
                &[&fwd],
            );
            let bwd = b
                .kernels
                .activation_backward(act, out.view(), x.view(), y.view())
                .expect("activation backward");
            b.time(
                &mut group,
                format!("{act:?}_backward"),
                &label,
                Some(3 * n as u64 * F32),
                &[&bwd],
            );
        }
        let bias = b.tensor(cols);
        let d = b
            .kernels
            .bias_add(out.view(), x.view(), bias.view(), rows, cols)
            .expect("bias_add");
        b.time(&mut group, "bias_add", &label, Some((2 * n + cols) as u64 * F32), &[&d]);
    }
    group.finish();
}

fn reduce(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "reduce");
    for shape in [TINY, LARGE] {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let x = b.tensor(n);
        let (col_out, row_out, scalar) = (
            b.kernels.zeros(cols).expect("zeros"),
            b.kernels.zeros(rows).expect("zeros"),
            b.kernels.zeros(1).expect("zeros"),
        );
        let d = b
            .kernels
            .sum_rows(col_out.view(), x.view(), rows, cols)
            .expect("sum_rows");
        b.time(&mut group, "sum_rows", &label, Some((n + cols) as u64 * F32), &[&d]);
        // One workgroup by design (deterministic order): shows its ceiling.
        let d = b.kernels.sum(scalar.view(), x.view()).expect("sum");
        b.time(&mut group, "sum", &label, Some((n + 1) as u64 * F32), &[&d]);
        let d = b
            .kernels
            .max_rows(row_out.view(), x.view(), rows, cols)
            .expect("max_rows");
        b.time(&mut group, "max_rows", &label, Some((n + rows) as u64 * F32), &[&d]);
        let d = b
            .kernels
            .argmax_rows(row_out.view(), x.view(), rows, cols)
            .expect("argmax_rows");
        b.time(&mut group, "argmax_rows", &label, Some((n + rows) as u64 * F32), &[&d]);
    }
    group.finish();
}

fn loss(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "loss");
    for shape in LOSS_SHAPES {
        let (rows, cols) = shape;
        let n = rows * cols;
        let label = size_label(shape);
        let (pred, target, grad) = (b.tensor(n), b.tensor(n), b.kernels.zeros(n).expect("zeros"));
        let labels = b.labels(rows, cols);
        let (loss, dloss) = (
            b.kernels.zeros(1).expect("zeros"),
            b.kernels.upload(&[1.0f32]).expect("upload"),
        );
        let k = &b.kernels;

        let d = k
            .mse_forward(loss.view(), pred.view(), target.view())
            .expect("mse_forward");
        b.time(&mut group, "mse_forward", &label, Some(2 * n as u64 * F32), &[&d]);
        let d = k
            .mse_backward(grad.view(), pred.view(), target.view(), dloss.view())
            .expect("mse_backward");
        b.time(&mut group, "mse_backward", &label, Some(3 * n as u64 * F32), &[&d]);
        let d = k
            .mse_forward_backward(loss.view(), grad.view(), pred.view(), target.view(), dloss.view())
            .expect("mse_forward_backward");
        b.time(
            &mut group,
            "mse_forward_backward",
            &label,
            Some(3 * n as u64 * F32),
            &[&d],
        );

        let (logits_labels, logits_grad) = ((n + rows) as u64 * F32, (2 * n + rows) as u64 * F32);
        let d = k
            .cross_entropy_forward(loss.view(), pred.view(), labels.view(), rows, cols)
            .expect("cross_entropy_forward");
        b.time(&mut group, "cross_entropy_forward", &label, Some(logits_labels), &[&d]);
        let d = k
            .cross_entropy_backward(grad.view(), pred.view(), labels.view(), dloss.view(), rows, cols)
            .expect("cross_entropy_backward");
        b.time(&mut group, "cross_entropy_backward", &label, Some(logits_grad), &[&d]);
        let d = k
            .cross_entropy_forward_backward(
                loss.view(),
                grad.view(),
                pred.view(),
                labels.view(),
                dloss.view(),
                rows,
                cols,
            )
            .expect("cross_entropy_forward_backward");
        b.time(
            &mut group,
            "cross_entropy_forward_backward",
            &label,
            Some(logits_grad),
            &[&d],
        );
    }
    group.finish();
}

fn optim(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "optim");
    let sgd = SgdConfig::default();
    let momentum = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let adam = AdamConfig::adam();
    for n in ARENAS {
        let label = n.to_string();
        // Gradients in [-3, 3] and lr ≤ 0.01: thousands of repeated updates
        // keep every value finite, so the timing never hits denormal or NaN paths.
        let (param, grad) = (b.tensor(n), b.tensor(n));
        let (state_a, state_b) = (b.kernels.zeros(n).expect("zeros"), b.kernels.zeros(n).expect("zeros"));
        let k = &b.kernels;
        // Step 2: the steady-state path (step 1 initialises the momentum buffer).
        let d = k
            .sgd_update(param.view(), grad.view(), state_a.view(), &sgd, 2)
            .expect("sgd_update");
        b.time(&mut group, "sgd", &label, Some(3 * n as u64 * F32), &[&d]);
        let d = k
            .sgd_update(param.view(), grad.view(), state_a.view(), &momentum, 2)
            .expect("sgd_update momentum");
        b.time(&mut group, "sgd_momentum", &label, Some(5 * n as u64 * F32), &[&d]);
        let d = k
            .adam_update(param.view(), grad.view(), state_a.view(), state_b.view(), &adam, 2)
            .expect("adam_update");
        b.time(&mut group, "adam", &label, Some(7 * n as u64 * F32), &[&d]);
    }
    group.finish();
}

/// The model of `examples/attention.rs` (attention variant): a
/// `wgrad::models::Gpt` of these sizes.
const T_VOCAB: usize = 16;
const T_SEQ: usize = 12;
const T_EMBD: usize = 48;
const T_HEADS: usize = 4;
const T_LAYERS: usize = 2;
const T_BATCH: usize = 32;

/// One dispatch, and 8 of it in one pass.
fn time_kernel(group: &mut BenchmarkGroup<'_, WallTime>, b: &Bench, name: &str, size: &str, d: &Dispatch) {
    b.time(group, format!("{name}_x1"), size, None, &[d]);
    b.time(group, format!("{name}_x8"), size, None, &[d; 8]);
}

fn transformer(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "transformer");
    let (bt, ch, t, h) = (T_BATCH * T_SEQ, T_EMBD, T_SEQ, T_HEADS);
    let score_rows = T_BATCH * h * t;
    let scores = b.tensor(score_rows * t);
    let dscores = b.tensor(score_rows * t);
    let probs = b.kernels.zeros(score_rows * t).expect("zeros");
    let k = &b.kernels;
    let size = format!("{score_rows}x{t}");
    let d = k
        .softmax_forward(probs.view(), scores.view(), score_rows, t, Some(t))
        .expect("softmax");
    time_kernel(&mut group, b, "softmax_forward_causal", &size, &d);
    let d = k
        .softmax_backward(dscores.view(), probs.view(), scores.view(), score_rows, t)
        .expect("softmax_backward");
    time_kernel(&mut group, b, "softmax_backward", &size, &d);

    let x = b.tensor(bt * ch);
    let w = b.tensor(ch);
    let bias = b.tensor(ch);
    let dy = b.tensor(bt * ch);
    let k = &b.kernels;
    let (y, mean, rstd) = (
        k.zeros(bt * ch).expect("zeros"),
        k.zeros(bt).expect("zeros"),
        k.zeros(bt).expect("zeros"),
    );
    let (dw, db, dx) = (
        k.zeros(ch).expect("zeros"),
        k.zeros(ch).expect("zeros"),
        k.zeros(bt * ch).expect("zeros"),
    );
    let size = format!("{bt}x{ch}");
    let d = k
        .layernorm_forward(
            y.view(),
            mean.view(),
            rstd.view(),
            x.view(),
            w.view(),
            bias.view(),
            bt,
            ch,
            1e-5,
        )
        .expect("ln");
    time_kernel(&mut group, b, "layernorm_forward", &size, &d);
    let d = k
        .layernorm_backward(
            dx.view(),
            dy.view(),
            x.view(),
            w.view(),
            mean.view(),
            rstd.view(),
            bt,
            ch,
        )
        .expect("ln bw");
    time_kernel(&mut group, b, "layernorm_backward", &size, &d);
    let d = k
        .layernorm_backward_params(
            true,
            dw.view(),
            db.view(),
            dy.view(),
            x.view(),
            mean.view(),
            rstd.view(),
            bt,
            ch,
        )
        .expect("ln params");
    time_kernel(&mut group, b, "layernorm_backward_params", &size, &d);

    // Each side of SHORT_ROW_MAX (128: one invocation per row, 131: one
    // workgroup per row), at 2048 rows: where the threshold sits.
    for cols in [wgrad::kernels::SHORT_ROW_MAX, wgrad::kernels::SHORT_ROW_MAX + 3] {
        let rows = 2048;
        let (x, w, bias) = (b.tensor(rows * cols), b.tensor(cols), b.tensor(cols));
        let k = &b.kernels;
        let (y, mean, rstd) = (
            k.zeros(rows * cols).expect("zeros"),
            k.zeros(rows).expect("zeros"),
            k.zeros(rows).expect("zeros"),
        );
        let size = format!("{rows}x{cols}");
        let d = k
            .softmax_forward(y.view(), x.view(), rows, cols, None)
            .expect("softmax");
        b.time(&mut group, "threshold_softmax_forward", &size, None, &[&d]);
        let d = k
            .layernorm_forward(
                y.view(),
                mean.view(),
                rstd.view(),
                x.view(),
                w.view(),
                bias.view(),
                rows,
                cols,
                1e-5,
            )
            .expect("ln");
        b.time(&mut group, "threshold_layernorm_forward", &size, None, &[&d]);
    }

    // Heads: [B, T, H, D] -> [B, H, T, D], and the attention products.
    let d_head = ch / h;
    let qkv = b.kernels.zeros(bt * ch).expect("zeros");
    let d = b
        .kernels
        .permute(qkv.view(), x.view(), &[T_BATCH, t, h, d_head], &[0, 2, 1, 3])
        .expect("permute");
    time_kernel(
        &mut group,
        b,
        "permute_heads",
        &format!("{T_BATCH}x{t}x{h}x{d_head}"),
        &d,
    );
    let batch = T_BATCH * h;
    let k = &b.kernels;
    let d = k
        .matmul(
            &MatmulRequest::new(MatmulForm::ABt, t, t, d_head).with_batch(batch),
            scores.view(),
            x.view(),
            dy.view(),
        )
        .expect("qk");
    time_kernel(
        &mut group,
        b,
        "matmul_batched_qkT",
        &format!("{batch}x{t}x{t}x{d_head}"),
        &d,
    );
    let d = k
        .matmul(
            &MatmulRequest::new(MatmulForm::AB, t, d_head, t).with_batch(batch),
            qkv.view(),
            probs.view(),
            x.view(),
        )
        .expect("av");
    time_kernel(
        &mut group,
        b,
        "matmul_batched_av",
        &format!("{batch}x{t}x{d_head}x{t}"),
        &d,
    );

    // Token-row matmuls: c_attn (48 -> 144) and the MLP (48 -> 192).
    let wide = b.tensor(bt * 4 * ch);
    let w_attn = b.tensor(ch * 3 * ch);
    let w_fc = b.tensor(ch * 4 * ch);
    let k = &b.kernels;
    let out3 = k.zeros(bt * 3 * ch).expect("zeros");
    let d = k
        .matmul(
            &MatmulRequest::new(MatmulForm::AB, bt, 3 * ch, ch),
            out3.view(),
            x.view(),
            w_attn.view(),
        )
        .expect("c_attn");
    time_kernel(&mut group, b, "matmul_c_attn", &format!("{bt}x{}x{ch}", 3 * ch), &d);
    let d = k
        .matmul(
            &MatmulRequest::new(MatmulForm::AB, bt, 4 * ch, ch),
            wide.view(),
            x.view(),
            w_fc.view(),
        )
        .expect("fc");
    time_kernel(&mut group, b, "matmul_fc", &format!("{bt}x{}x{ch}", 4 * ch), &d);
    let d = k.slice_last(y.view(), out3.view(), bt, 3 * ch, ch, ch).expect("slice");
    time_kernel(&mut group, b, "slice_last", &format!("{bt}x{}", 3 * ch), &d);
    let pos_grad = k.zeros(t * ch).expect("zeros");
    let d = k
        .binary_broadcast(
            Binary::Add,
            y.view(),
            x.view(),
            pos_grad.view(),
            &[T_BATCH, t, ch],
            &[t, ch],
        )
        .expect("broadcast");
    time_kernel(
        &mut group,
        b,
        "binary_broadcast_add",
        &format!("{T_BATCH}x{t}x{ch}"),
        &d,
    );
    let d = k
        .reduce_to_shape(true, pos_grad.view(), dy.view(), &[T_BATCH, t, ch], &[t, ch])
        .expect("reduce_to_shape");
    time_kernel(&mut group, b, "reduce_to_shape", &format!("{T_BATCH}x{t}x{ch}"), &d);

    // Embedding and loss.
    let ids = b.labels(bt, T_VOCAB);
    let table = b.tensor(T_VOCAB * ch);
    let k = &b.kernels;
    let (order, cursor, dtable) = (
        k.zeros(bt).expect("zeros"),
        k.zeros(T_VOCAB + 1).expect("zeros"),
        k.zeros(T_VOCAB * ch).expect("zeros"),
    );
    let d = k
        .embedding_forward(y.view(), table.view(), ids.view(), bt, T_VOCAB, ch)
        .expect("emb");
    time_kernel(&mut group, b, "embedding_forward", &format!("{bt}x{ch}"), &d);
    let d = k
        .embedding_backward_sort(order.view(), cursor.view(), ids.view(), bt, T_VOCAB)
        .expect("sort");
    time_kernel(&mut group, b, "embedding_backward_sort", &format!("{bt}"), &d);
    let d = k
        .embedding_backward(dtable.view(), dy.view(), ids.view(), order.view(), bt, T_VOCAB, ch)
        .expect("emb bw");
    time_kernel(&mut group, b, "embedding_backward", &format!("{bt}x{ch}"), &d);
    let logits = b.tensor(bt * T_VOCAB);
    let k = &b.kernels;
    let (losses, dlogits) = (k.zeros(bt).expect("zeros"), k.zeros(bt * T_VOCAB).expect("zeros"));
    let d = k
        .cross_entropy_rows_forward_backward(
            losses.view(),
            dlogits.view(),
            logits.view(),
            ids.view(),
            bt,
            T_VOCAB,
            1.0 / bt as f32,
        )
        .expect("ce rows");
    time_kernel(&mut group, b, "cross_entropy_rows", &format!("{bt}x{T_VOCAB}"), &d);

    // The whole step, as the example runs it.
    let kernels = b.kernels.clone();
    wgrad::nn::manual_seed(0);
    let config = GptConfig {
        vocab_size: T_VOCAB,
        block_size: T_SEQ,
        n_layer: T_LAYERS,
        n_head: T_HEADS,
        n_embd: T_EMBD,
    };
    let model = Gpt::new(config).expect("model");
    let mut trainer =
        Trainer::new(kernels.clone(), &model, CrossEntropyLoss, Adam::new(3e-3), T_BATCH).expect("trainer");
    let inputs: Vec<u32> = (0..bt).map(|_| b.rng.random_range(0..T_VOCAB as u32)).collect();
    let targets: Vec<u32> = (0..bt)
        .map(|i| if i % T_SEQ >= 3 { inputs[i - 3] } else { inputs[i] })
        .collect();
    let mut step = || {
        trainer.zero_grad();
        trainer.forward_ids(&inputs).expect("forward");
        trainer.loss(Targets::Classes(&targets)).expect("loss");
        trainer.backward().expect("backward");
        trainer.step().expect("step");
        kernels.device().wait_idle("bench transformer").expect("wait");
    };
    for _ in 0..3 {
        step();
    }
    group.bench_function(BenchmarkId::new("step", T_BATCH), |bench| bench.iter(&mut step));
    group.finish();
    println!(
        "transformer step: {} dispatches per step",
        trainer.executor().dispatches_per_step()
    );
}

/// Decode's quantized product, C[1, n] = A[1, k]·Bᵀ, per format: the
/// blocks random bytes with each f16 scale set to 2^-10 (any finite value
/// times the same work).
fn quant_matvec(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "quant_matvec");
    for (n, k) in [(576, 1536), (640, 2048)] {
        let a = b.tensor(k);
        let out = b.kernels.zeros(n).expect("zeros");
        for format in QuantFormat::ALL {
            let blocks = n * k / format.super_block();
            let mut raw: Vec<u8> = (0..blocks * format.block_bytes()).map(|_| b.rng.random()).collect();
            for block in raw.chunks_exact_mut(format.block_bytes()) {
                for &at in format.scale_offsets() {
                    block[at..at + 2].copy_from_slice(&0x1400u16.to_le_bytes());
                }
            }
            let words = b
                .kernels
                .upload(&pack_quantized(format, &raw, n, k).expect("pack"))
                .expect("upload");
            let view = QuantView::new(words.view(), format, n, k).expect("view");
            let d = b
                .kernels
                .matmul(
                    &MatmulRequest::new(MatmulForm::ABt, 1, n, k),
                    out.view(),
                    a.view(),
                    view,
                )
                .expect("quant matvec");
            let bytes = format.stored_words(n * k) as u64 * 4;
            b.time(
                &mut group,
                format!("{}_{}", format.name(), d.kernel().entry),
                &format!("{n}x{k}"),
                Some(bytes),
                &[&d],
            );
        }
    }
    group.finish();
}

/// (T, heads, KV heads, head_dim) of the fused-attention cases, each run
/// causal and with a window of T / 4.
const FLASH_CASES: [(usize, usize, usize, usize); 2] = [(512, 4, 4, 64), (256, 4, 1, 256)];

fn flash_attention(c: &mut Criterion, b: &mut Bench) {
    let mut group = family(c, "flash_attention");
    for (seq, heads, kv_heads, head_dim) in FLASH_CASES {
        for window in [None, Some(seq / 4)] {
            let shape = FlashAttentionShape {
                batch: 1,
                seq,
                heads,
                kv_heads,
                head_dim,
                window,
            };
            let (q_len, kv_len, rows) = shape.lengths().expect("small shape");
            let (q, k, v, dout) = (b.tensor(q_len), b.tensor(kv_len), b.tensor(kv_len), b.tensor(q_len));
            let kn = &b.kernels;
            let zeros = |n: usize| kn.zeros(n).expect("zeros");
            let (out, lse, delta) = (zeros(q_len), zeros(rows), zeros(rows));
            let (dq, dk, dv) = (zeros(q_len), zeros(kv_len), zeros(kv_len));
            let forward = kn
                .flash_attention_forward(out.view(), lse.view(), q.view(), k.view(), v.view(), shape)
                .expect("forward");
            let prepare = kn
                .flash_attention_backward_prepare(delta.view(), dout.view(), out.view(), shape)
                .expect("prepare");
            let (qv, kv, vv, lv, dlv, dov) = (q.view(), k.view(), v.view(), lse.view(), delta.view(), dout.view());
            let query = kn
                .flash_attention_backward_query(dq.view(), dov, qv, kv, vv, lv, dlv, shape)
                .expect("dq");
            let key_value = kn
                .flash_attention_backward_key_value(dk.view(), dv.view(), dov, qv, kv, vv, lv, dlv, shape)
                .expect("dk/dv");
            let size = format!("T{seq}_H{heads}over{kv_heads}_d{head_dim}_w{}", window.unwrap_or(seq));
            b.time(&mut group, "forward", &size, None, &[&forward]);
            b.time(
                &mut group,
                "forward_backward",
                &size,
                None,
                &[&forward, &prepare, &query, &key_value],
            );
        }
    }
    group.finish();
}

fn main() {
    let device = match Device::open_default() {
        Ok(d) => d,
        Err(e) => {
            println!("kernels bench skipped: no usable adapter ({e})");
            return;
        }
    };
    println!(
        "kernels bench on {}, LP_NUM_THREADS={}, load average {}",
        device.label(),
        std::env::var("LP_NUM_THREADS").unwrap_or_else(|_| "<unset>".into()),
        load_average(),
    );
    let mut bench = Bench {
        kernels: Arc::new(Kernels::new(device)),
        rng: ChaCha8Rng::seed_from_u64(0x5eed),
    };
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500))
        .without_plots()
        .configure_from_args();
    overhead(&mut criterion, &mut bench);
    elementwise(&mut criterion, &mut bench);
    reduce(&mut criterion, &mut bench);
    loss(&mut criterion, &mut bench);
    optim(&mut criterion, &mut bench);
    transformer(&mut criterion, &mut bench);
    quant_matvec(&mut criterion, &mut bench);
    flash_attention(&mut criterion, &mut bench);
    criterion.final_summary();
    println!("kernels bench done, load average now {}", load_average());
}
