//! The benchmark crate: `wgrad bench`'s measurements (the CLI depends on
//! this library) and the criterion benches under `benches/` (criterion is a
//! dev-dependency, so neither the CLI nor `cargo test` builds it). Each
//! measurement matters for training speed on one adapter and sits beside a
//! reference measured in the same run.
//! Output lines read `bench <case> key=value ...` so scripts can parse them.
//! The matmul case, timed beside a CPU sgemm, is the CLI's (`cli/src/bench.rs`),
//! so this library does not depend on the sgemm crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use wgrad::error::Result;
use wgrad::graph::{Executor, Graph, PlanOptions};
use wgrad::kernels::{Dispatch, GpuTensor, Kernels, MatmulForm, OptimizerConfig};
use wgrad::kernels::{MatmulKernel, MatmulRequest};
use wgrad::nn::{self, Criterion, CrossEntropyLoss, Layer, Linear, MSELoss, Sequential};
use wgrad::optim::{Adam, SGD};
use wgrad::parallel::data::{DataParallel, Split};
use wgrad::parallel::DeviceGroup;
use wgrad::{Targets, Trainer};

/// One measured case: its name and (key, value) pairs.
#[derive(Clone, Debug)]
pub struct BenchLine {
    pub case: String,
    pub values: Vec<(&'static str, String)>,
}

impl std::fmt::Display for BenchLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bench {}", self.case)?;
        for (k, v) in &self.values {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Median of `reps` timings of `run`, after one warm-up call.
pub fn median_time(reps: usize, mut run: impl FnMut() -> Result<()>) -> Result<Duration> {
    run()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        run()?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// The regression or classification targets a [`StepCase`] owns.
#[derive(Clone, Debug)]
pub enum CaseTargets {
    Values(Vec<f32>),
    Classes(Vec<u32>),
}

/// A training-step benchmark case without its device: model, loss,
/// optimizer, batch and seeded data. `wgrad bench` and the criterion benches
/// (`bench-suite/benches/steps.rs`) build from the same definition, so their figures
/// describe the same step.
#[derive(Clone, Debug)]
pub struct StepCase {
    /// The case name `wgrad bench` prints.
    pub name: &'static str,
    pub model: Sequential,
    pub criterion: Criterion,
    pub optimizer: OptimizerConfig,
    pub batch: usize,
    /// [batch, in_features], row-major.
    pub x: Vec<f32>,
    pub targets: CaseTargets,
}

impl StepCase {
    /// 784-512-512-10 ReLU MLP, cross-entropy, Adam(1e-3), batch 256.
    pub fn mlp() -> Result<Self> {
        let batch = 256;
        nn::manual_seed(0);
        let model = Sequential::mlp(&[784, 512, 512, 10], Layer::ReLU)?;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x = random(batch * 784, &mut rng);
        let y: Vec<u32> = (0..batch).map(|_| rng.random_range(0..10)).collect();
        Ok(StepCase {
            name: "mlp_784_512_512_10_b256_adam",
            model,
            criterion: CrossEntropyLoss.into(),
            optimizer: Adam::new(1e-3).into(),
            batch,
            x,
            targets: CaseTargets::Classes(y),
        })
    }

    /// `make train`'s digits MLP shape: 64-128-10 ReLU, cross-entropy,
    /// Adam(2e-3), batch 32, random data.
    pub fn digits_mlp() -> Result<Self> {
        let batch = 32;
        nn::manual_seed(0);
        let model = Sequential::mlp(&[64, 128, 10], Layer::ReLU)?;
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let x = random(batch * 64, &mut rng);
        let y: Vec<u32> = (0..batch).map(|_| rng.random_range(0..10)).collect();
        Ok(StepCase {
            name: "digits_mlp_64_128_10_b32_adam",
            model,
            criterion: CrossEntropyLoss.into(),
            optimizer: Adam::new(2e-3).into(),
            batch,
            x,
            targets: CaseTargets::Classes(y),
        })
    }

    /// The tutorial's Linear(10, 1), MSE, SGD(lr=0.01), batch 64.
    pub fn linear() -> Self {
        let batch = 64;
        nn::manual_seed(0);
        let model = Sequential::new(vec![Layer::Linear(Linear::new(10, 1))]);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let (x, y) = (random(batch * 10, &mut rng), random(batch, &mut rng));
        StepCase {
            name: "linear_10_1_b64_sgd",
            model,
            criterion: MSELoss.into(),
            optimizer: SGD::new(0.01).into(),
            batch,
            x,
            targets: CaseTargets::Values(y),
        }
    }

    pub fn targets(&self) -> Targets<'_> {
        match &self.targets {
            CaseTargets::Values(v) => Targets::Values(v),
            CaseTargets::Classes(c) => Targets::Classes(c),
        }
    }

    /// A single-device trainer for this case.
    pub fn trainer(&self, kernels: &Arc<Kernels>) -> Result<Trainer> {
        Trainer::new(kernels.clone(), &self.model, self.criterion, self.optimizer, self.batch)
    }

    /// A data-parallel trainer for this case over `group`, the global batch
    /// split as given.
    pub fn data_parallel(&self, group: &DeviceGroup, split: Split) -> Result<DataParallel> {
        DataParallel::new(group, &self.model, self.criterion, self.optimizer, self.batch, split)
    }
}

/// One full training step as `wgrad bench` times it: zero_grad, forward,
/// loss, backward, optimizer step (queued; does not wait for the GPU).
pub fn train_step(trainer: &mut Trainer, x: &[f32], targets: Targets<'_>) -> Result<()> {
    trainer.zero_grad();
    trainer.forward(x)?;
    trainer.loss(targets)?;
    trainer.backward()?;
    trainer.step()
}

/// Milliseconds per training step of `trainer` on fixed data, measured
/// over `steps` steps after a warm-up, waiting once at the end.
fn time_steps(kernels: &Kernels, trainer: &mut Trainer, x: &[f32], targets: Targets<'_>, steps: usize) -> Result<f64> {
    time_queued(kernels, steps, || train_step(trainer, x, targets))
}

/// Milliseconds per call of `one` (which queues GPU work without waiting),
/// over `calls` calls after 3 warm-up calls, waiting once at the end.
fn time_queued(kernels: &Kernels, calls: usize, mut one: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        one()?;
    }
    kernels.device().wait_idle("bench")?;
    let start = Instant::now();
    for _ in 0..calls.max(1) {
        one()?;
    }
    kernels.device().wait_idle("bench")?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / calls.max(1) as f64)
}

/// One training step of a 784-512-512-10 ReLU MLP, cross-entropy, Adam,
/// batch 256, seeded random data.
pub fn mlp_step(kernels: &Arc<Kernels>, steps: usize) -> Result<BenchLine> {
    let case = StepCase::mlp()?;
    let batch = case.batch;
    let mut trainer = case.trainer(kernels)?;
    let ms = time_steps(kernels, &mut trainer, &case.x, case.targets(), steps)?;
    let exec = trainer.executor();
    let plan = exec.plan();
    // Parameters, gradients and optimizer state share one arena layout.
    let arena_copies = 2 + exec.state_arenas().len() as u64;
    Ok(BenchLine {
        case: case.name.into(),
        values: vec![
            ("ms_per_step", format!("{ms:.2}")),
            ("samples_per_s", format!("{:.0}", batch as f64 * 1e3 / ms)),
            ("dispatches", exec.dispatches_per_step().to_string()),
            ("dispatches_unfused", unfused_dispatches(kernels, &case)?.to_string()),
            ("peak_gpu_bytes", exec.peak_bytes().to_string()),
            (
                "parameter_and_state_bytes",
                (plan.param_arena_len as u64 * 4 * arena_copies).to_string(),
            ),
            ("input_bytes", plan.input_bytes.to_string()),
            ("naive_intermediate_bytes", plan.naive_intermediate_bytes.to_string()),
            ("planned_intermediate_bytes", plan.slot_bytes.to_string()),
        ],
    })
}

/// Dispatches per step of `case` planned without fusion (one per node):
/// what fusion saves. Built, never run.
fn unfused_dispatches(kernels: &Arc<Kernels>, case: &StepCase) -> Result<usize> {
    let options = PlanOptions::UNFUSED;
    let trainer = Trainer::with_options(
        kernels.clone(),
        &case.model,
        case.criterion,
        case.optimizer,
        case.batch,
        options,
    )?;
    Ok(trainer.executor().dispatches_per_step())
}

/// One step of the tutorial's Linear(10, 1), MSE, SGD(lr=0.01), batch 64.
pub fn linear_step(kernels: &Arc<Kernels>, steps: usize) -> Result<BenchLine> {
    let case = StepCase::linear();
    let mut trainer = case.trainer(kernels)?;
    let ms = time_steps(kernels, &mut trainer, &case.x, case.targets(), steps)?;
    Ok(BenchLine {
        case: case.name.into(),
        values: vec![
            ("ms_per_step", format!("{ms:.3}")),
            ("dispatches", trainer.executor().dispatches_per_step().to_string()),
            ("dispatches_unfused", unfused_dispatches(kernels, &case)?.to_string()),
        ],
    })
}

/// Milliseconds since `start`.
fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Where start-up goes: for each matmul variant and form this adapter runs
/// (64×64×64), and for a few of the small kernels, the time to create the
/// pipeline (`create_ms`), the first run with its wait (`first_ms`), and a
/// later run (`steady_ms`). `compile_ms` = create + first − steady: lavapipe
/// compiles at creation, llvmpipe-GL at the first dispatch, so only the sum
/// compares across backends. Run once with an empty Mesa shader cache
/// (`MESA_SHADER_CACHE_DIR=$(mktemp -d)`) and once warm. Then the digits
/// MLP (64-128-10, batch 32, Adam): building its trainer, its first and a
/// later training step.
pub fn compile_times(kernels: &Arc<Kernels>) -> Result<Vec<BenchLine>> {
    use wgrad::kernels::{Activation, MatmulEpilogue, MatmulVariant};
    let n = 64;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (a, b, c) = (
        kernels.upload(&random(n * n, &mut rng))?,
        kernels.upload(&random(n * n, &mut rng))?,
        kernels.zeros(n * n)?,
    );
    let mut lines = Vec::new();
    let mut time_first_runs = |name: String, build: &dyn Fn() -> Result<wgrad::kernels::Dispatch>| -> Result<()> {
        let start = Instant::now();
        let dispatch = build()?;
        let create = ms_since(start);
        let start = Instant::now();
        kernels.run(&[&dispatch])?;
        kernels.device().wait_idle("bench")?;
        let first = ms_since(start);
        let start = Instant::now();
        kernels.run(&[&dispatch])?;
        kernels.device().wait_idle("bench")?;
        let steady = ms_since(start);
        lines.push(BenchLine {
            case: format!("compile_{name}"),
            values: vec![
                ("create_ms", format!("{create:.1}")),
                ("first_ms", format!("{first:.1}")),
                ("steady_ms", format!("{steady:.2}")),
                ("compile_ms", format!("{:.1}", create + first - steady)),
            ],
        });
        Ok(())
    };
    for variant in MatmulVariant::ALL
        .into_iter()
        .filter(|&v| kernels.supports_matmul_variant(v))
    {
        for form in MatmulForm::ALL {
            let epilogue = MatmulEpilogue::default();
            time_first_runs(format!("matmul_{variant:?}_{form:?}").to_lowercase(), &|| {
                kernels.matmul(
                    &MatmulRequest::new(form, n, n, n)
                        .with_kernel(MatmulKernel::Tiled(variant))
                        .with_epilogue(epilogue),
                    c.view(),
                    a.view(),
                    b.view(),
                )
            })?;
        }
    }
    time_first_runs("relu_forward".into(), &|| {
        kernels.activation_forward(Activation::Relu, c.view(), a.view())
    })?;
    time_first_runs("sum_rows_forward".into(), &|| {
        kernels.sum_rows(c.slice(0, n)?, a.view(), n, n)
    })?;

    let case = StepCase::digits_mlp()?;
    let start = Instant::now();
    let mut trainer = case.trainer(kernels)?;
    let build = ms_since(start);
    let mut step_ms = || -> Result<f64> {
        let start = Instant::now();
        train_step(&mut trainer, &case.x, case.targets())?;
        kernels.device().wait_idle("bench")?;
        Ok(ms_since(start))
    };
    let first = step_ms()?;
    let steady = step_ms()?;
    lines.push(BenchLine {
        case: case.name.into(),
        values: vec![
            ("build_ms", format!("{build:.1}")),
            ("first_step_ms", format!("{first:.1}")),
            ("steady_step_ms", format!("{steady:.2}")),
        ],
    });
    Ok(lines)
}

/// The GPT `wgrad bench` times: the Burn/PyTorch reference shape of issue
/// 13 (L4, H4, C128, T128, vocabulary 84 as the char-level Shakespeare),
/// which is also `make train`'s default model, at batch 16.
pub fn gpt_bench_config() -> wgrad::models::GptConfig {
    wgrad::models::GptConfig {
        vocab_size: 84,
        block_size: 128,
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
    }
}

/// Model FLOPs of one training step (forward and backward) on `tokens`
/// tokens of context `config.block_size`: 6 per parameter per token (the
/// position table excluded, as it does no multiply) plus attention's
/// 12·L·C·T per token (PaLM's appendix B, nanoGPT's `estimate_mfu`).
pub fn gpt_train_flops(config: &wgrad::models::GptConfig, tokens: usize) -> f64 {
    let params = (config.num_parameters() - config.block_size * config.n_embd) as f64;
    let attention = 12.0 * (config.n_layer * config.n_embd * config.block_size) as f64;
    (6.0 * params + attention) * tokens as f64
}

/// Training steps of a GPT (AdamW, warmup-cosine, clipping at 1.0, as
/// `wgrad train --model gpt`) on seeded random tokens: step time, tokens/s
/// and model-FLOPs utilisation against `matmul_gflops`, the adapter's best
/// matmul rate measured in the same run.
pub fn gpt_train_step(
    kernels: &Arc<Kernels>,
    config: wgrad::models::GptConfig,
    batch: usize,
    steps: usize,
    matmul_gflops: f64,
) -> Result<BenchLine> {
    gpt_train_step_with(
        kernels,
        config,
        batch,
        steps,
        matmul_gflops,
        wgrad::graph::PlanOptions::default(),
    )
}

/// [`gpt_train_step`] planned with `options`: with
/// `Precision::F16`, activations stored in f16 and the loss scaled
/// dynamically (line `gpt_train` with `precision f16`).
pub fn gpt_train_step_with(
    kernels: &Arc<Kernels>,
    config: wgrad::models::GptConfig,
    batch: usize,
    steps: usize,
    matmul_gflops: f64,
    options: wgrad::graph::PlanOptions,
) -> Result<BenchLine> {
    wgrad::nn::manual_seed(0);
    let model = wgrad::models::Gpt::new(config)?;
    let mut optimizer = wgrad::train::AdamWSchedule::default().optimizer((steps + 3) as u64);
    if options.precision == wgrad::graph::Precision::F16 {
        optimizer = optimizer.with_loss_scaling(Some(wgrad::optim::LossScaling::default()));
    }
    let mut trainer = Trainer::with_options(kernels.clone(), &model, CrossEntropyLoss, optimizer, batch, options)?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let tokens = batch * config.block_size;
    let ids: Vec<u32> = (0..tokens + 1)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let (x, y) = (&ids[..tokens], &ids[1..]);
    let ms = time_queued(kernels, steps, || {
        trainer.zero_grad();
        trainer.forward_ids(x)?;
        trainer.loss(Targets::Classes(y))?;
        trainer.backward()?;
        trainer.step()
    })?;
    let seconds = ms / 1e3;
    let flops = gpt_train_flops(&config, tokens);
    let exec = trainer.executor();
    let plan = exec.plan();
    Ok(BenchLine {
        case: "gpt_train".into(),
        values: vec![
            (
                "config",
                format!(
                    "L{}-H{}-C{}-T{}-V{}-B{batch}",
                    config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size
                ),
            ),
            ("tokens_per_s", format!("{:.0}", tokens as f64 / seconds)),
            ("ms_per_step", format!("{:.1}", seconds * 1e3)),
            ("model_gflops_per_s", format!("{:.2}", flops / seconds / 1e9)),
            ("matmul_gflops", format!("{matmul_gflops:.2}")),
            ("mfu", format!("{:.3}", flops / seconds / 1e9 / matmul_gflops.max(1e-9))),
            ("dispatches", exec.dispatches_per_step().to_string()),
            ("peak_gpu_bytes", exec.peak_bytes().to_string()),
            ("naive_intermediate_bytes", plan.naive_intermediate_bytes.to_string()),
            ("planned_intermediate_bytes", plan.slot_bytes.to_string()),
            ("precision", trainer.precision().name().to_string()),
            ("held_activation_bytes", plan.held_activation_bytes.to_string()),
        ],
    })
}

/// Causal self-attention alone trained a step at a time (forward and
/// backward, no optimizer): q, k, v [B, T, heads·head_dim] as parameters,
/// B = tokens / T, an MSE loss against random targets; fused
/// (FlashAttention-2) and unfused (q·kᵀ, scale, causal softmax, ·v), in the
/// same run. Per path: ms per step and the intermediate bytes its memory
/// plan holds (`Plan::slot_bytes`: activations and gradients, the
/// parameters and their gradients not counted).
pub fn attention_train(
    kernels: &Arc<Kernels>,
    seq: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    steps: usize,
) -> Result<BenchLine> {
    let batch = (tokens / seq.max(1)).max(1);
    let shape = [batch, seq, heads * head_dim];
    let n = shape.iter().product();
    let measure = |kernel: nn::AttentionKernel| -> Result<(f64, u64)> {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut g = Graph::new();
        let [q, k, v] = ["q", "k", "v"].map(|name| g.parameter(name, &shape, random(n, &mut rng)));
        let y = nn::causal_attention(&mut g, [q?, k?, v?], heads, heads, head_dim, kernel)?;
        let target = g.input("target", &shape)?;
        let loss = g.mse_loss(y, target)?;
        let grads = g.backward(loss)?;
        let mut exec = Executor::new(kernels.clone(), g, &[loss], Some(grads), None)?;
        exec.set_input(target, &random(n, &mut rng))?;
        let ms = time_queued(kernels, steps, || exec.train_step(true, false, false).map(|_| ()))?;
        Ok((ms, exec.plan().slot_bytes))
    };
    let (fused_ms, fused_bytes) = measure(nn::AttentionKernel::Fused)?;
    let (unfused_ms, unfused_bytes) = measure(nn::AttentionKernel::Unfused)?;
    Ok(BenchLine {
        case: "attention_train".into(),
        values: vec![
            ("T", seq.to_string()),
            ("fused_ms", format!("{fused_ms:.2}")),
            ("unfused_ms", format!("{unfused_ms:.2}")),
            ("fused_bytes", fused_bytes.to_string()),
            ("unfused_bytes", unfused_bytes.to_string()),
            ("B", batch.to_string()),
            ("H", heads.to_string()),
            ("d", head_dim.to_string()),
        ],
    })
}

/// Seconds for one prefill of `prompt` and for `new_tokens` greedy decode
/// steps after it (the median step, as seconds per token), once every
/// pipeline of both passes has compiled and run. Each step picks its token
/// on the GPU and reads back only that, as `Generator::generate` does.
/// `between_steps` runs after each timed step, outside the timing: the
/// 124M bench times its copy kernel there, so the decode and the bandwidth
/// it is divided by are measured in the same moments of a noisy machine.
fn time_generation(
    generator: &mut wgrad::infer::generate::Generator,
    prompt: &[u32],
    new_tokens: usize,
    rng: &mut ChaCha8Rng,
    mut between_steps: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let greedy = wgrad::infer::generate::Sampling::greedy();
    // A few steps first: on a CPU adapter the first passes over the weights
    // run slower (memory first touched), which is not a token's cost.
    generator.prefill_and_sample(&[prompt], &greedy, rng)?;
    for _ in 0..3.min(generator.context_len().saturating_sub(prompt.len())) {
        generator.decode_and_sample(&[0], &greedy, rng)?;
    }
    let start = Instant::now();
    let mut tokens = generator.prefill_and_sample(&[prompt], &greedy, rng)?;
    let prefill = start.elapsed().as_secs_f64();
    let mut steps = Vec::with_capacity(new_tokens);
    for _ in 0..new_tokens {
        let start = Instant::now();
        tokens = generator.decode_and_sample(&tokens, &greedy, rng)?;
        steps.push(start.elapsed().as_secs_f64());
        between_steps()?;
    }
    Ok((prefill, median(&mut steps)))
}

/// The middle value (the mean of the two middle ones for an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Generation with the KV cache on the GPU: a `config` GPT with random
/// weights, a prompt of half the context, then `new_tokens` decode steps
/// (one token each, greedy). Prefill and decode tokens/s.
pub fn gpt_generate(kernels: &Arc<Kernels>, config: wgrad::models::GptConfig, new_tokens: usize) -> Result<BenchLine> {
    wgrad::nn::manual_seed(0);
    let model = wgrad::models::Gpt::new(config)?;
    let mut generator = wgrad::infer::generate::Generator::new(kernels.clone(), &model, 1)?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let prompt: Vec<u32> = (0..config.block_size / 2)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let new_tokens = new_tokens.clamp(1, config.block_size - prompt.len());
    let (prefill, seconds_per_token) = time_generation(&mut generator, &prompt, new_tokens, &mut rng, || Ok(()))?;
    let decode = seconds_per_token * new_tokens as f64;
    Ok(BenchLine {
        case: "gpt_generate".into(),
        values: vec![
            (
                "config",
                format!(
                    "L{}-H{}-C{}-T{}-V{}",
                    config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size
                ),
            ),
            ("tokens_per_s", format!("{:.1}", new_tokens as f64 / decode)),
            ("ms_per_token", format!("{:.2}", 1e3 * decode / new_tokens as f64)),
            ("prefill_tokens", prompt.len().to_string()),
            ("prefill_tokens_per_s", format!("{:.0}", prompt.len() as f64 / prefill)),
        ],
    })
}

/// Bytes of the copy that measures the adapter's memory bandwidth.
const COPY_BYTES: usize = 64 << 20;

/// The adapter's copy bandwidth in GB/s (bytes read plus bytes written per
/// second) over [`COPY_BYTES`], two ways: a copy kernel, and
/// `copy_buffer_to_buffer`. The kernel is `copy_vec4`, 16-byte loads and
/// stores, four per invocation: on lavapipe about 4× the rate of the
/// one-f32-per-invocation kernels, so the bound a kernel reading memory is
/// measured against is the best a shader moves, not a slow one's. The
/// buffer copy is the driver's own (a memcpy on a CPU adapter), which no
/// shader on lavapipe comes near. Each [`CopyBandwidth::sample`] times one
/// of each, waited; the rates are the medians.
pub struct CopyBandwidth<'a> {
    kernels: &'a Kernels,
    src: GpuTensor,
    dst: GpuTensor,
    shader: Dispatch,
    shader_times: Vec<f64>,
    memcpy_times: Vec<f64>,
}

impl<'a> CopyBandwidth<'a> {
    pub fn new(kernels: &'a Kernels) -> Result<Self> {
        let n = COPY_BYTES / 4;
        let (src, dst) = (kernels.upload(&vec![1.0f32; n])?, kernels.zeros(n)?);
        let shader = kernels.copy_vec4(dst.view(), src.view())?;
        Ok(CopyBandwidth {
            kernels,
            src,
            dst,
            shader,
            shader_times: Vec::new(),
            memcpy_times: Vec::new(),
        })
    }

    /// Times one copy by the kernel and one by the driver.
    pub fn sample(&mut self) -> Result<()> {
        let start = Instant::now();
        self.kernels.run(&[&self.shader])?;
        self.kernels.device().wait_idle("bench copy")?;
        self.shader_times.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let (src, dst) = (self.src.buffer(), self.dst.buffer());
        self.kernels.submit_pass(
            "bench copy",
            std::iter::empty(),
            |_| {},
            |encoder| encoder.copy_buffer_to_buffer(src, 0, dst, 0, COPY_BYTES as u64),
        )?;
        self.kernels.device().wait_idle("bench copy")?;
        self.memcpy_times.push(start.elapsed().as_secs_f64());
        Ok(())
    }

    /// (by the kernel, by the driver) in GB/s: medians of the samples.
    pub fn gbps(&mut self) -> (f64, f64) {
        let rate = |seconds: f64| {
            if seconds > 0.0 {
                2.0 * COPY_BYTES as f64 / seconds / 1e9
            } else {
                0.0
            }
        };
        (
            rate(median(&mut self.shader_times)),
            rate(median(&mut self.memcpy_times)),
        )
    }
}

/// Bytes a decode step of a `config` GPT reads at position `position`:
/// every parameter once (the head reads all of wte), except that the
/// position table gives one row, plus the keys and values of positions
/// 0..=position in every layer's cache.
pub fn decode_bytes_per_token(config: &wgrad::models::GptConfig, position: usize) -> u64 {
    decode_bytes_per_token_with(config, position, wgrad::infer::generate::WeightDtype::F32)
}

/// [`decode_bytes_per_token`] for a generator storing its weights as
/// `dtype`: with f16, 2 bytes for each value of the token table and the
/// blocks' projection weights (what `WeightDtype::F16` stores in f16).
pub fn decode_bytes_per_token_with(
    config: &wgrad::models::GptConfig,
    position: usize,
    dtype: wgrad::infer::generate::WeightDtype,
) -> u64 {
    let c = config.n_embd;
    let parameters = config.num_parameters() - config.block_size * c + c;
    let cache = 2 * config.n_layer * (position + 1) * c;
    let halved = match dtype {
        wgrad::infer::generate::WeightDtype::F32 => 0,
        wgrad::infer::generate::WeightDtype::F16 => wgrad::nn::LmConfig::lm_sizes(config).f16_weight_values,
    };
    ((parameters + cache) * 4) as u64 - halved * 2
}

/// Generation with GPT-2 124M's shape and random weights the bench draws
/// itself: `prompt_tokens` prefilled (tokens/s), then `new_tokens` greedy
/// decode steps, one token each, with the bytes each reads
/// ([`decode_bytes_per_token`], averaged over the steps), the adapter's
/// copy bandwidth sampled after every timed step ([`CopyBandwidth`]: by a
/// copy kernel, and by the driver's buffer copy as `memcpy_gbps`), and the
/// share of each the decode reaches: bytes_per_token · tokens_per_s / rate.
/// Where the adapter has SHADER_F16, the same decode again with the
/// weights in f16 (`WeightDtype::F16`), its own line with `dtype=f16` and
/// the bytes counted at 2 per f16 weight. With `profile`, each generator's
/// decode step dispatch by dispatch after its timing ([`profile_lines`]).
pub fn gpt2_124m_generate(
    kernels: &Arc<Kernels>,
    prompt_tokens: usize,
    new_tokens: usize,
    profile: bool,
) -> Result<Vec<BenchLine>> {
    use wgrad::infer::generate::WeightDtype;
    let config = wgrad::models::GptConfig::gpt2();
    wgrad::nn::manual_seed(0);
    let model = wgrad::models::Gpt::new(config)?;
    let prompt_tokens = prompt_tokens.clamp(1, config.block_size - 1);
    let new_tokens = new_tokens.clamp(1, config.block_size - prompt_tokens);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let prompt: Vec<u32> = (0..prompt_tokens)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let dtypes: &[WeightDtype] = if kernels.supports_f16() {
        &[WeightDtype::F32, WeightDtype::F16]
    } else {
        &[WeightDtype::F32]
    };
    let mut generators = Vec::new();
    for &dtype in dtypes {
        wgrad::infer::generate::check_fits_with_dtype(kernels, &config, 1, dtype)?;
        generators.push(wgrad::infer::generate::Generator::new_with_dtype(
            kernels.clone(),
            &model,
            1,
            dtype,
        )?);
    }
    // The host copy of the weights (500 MB) goes before anything is timed.
    drop(model);
    // A copy after each decode step: the bandwidth the decode is divided
    // by is measured in the same moments (see time_generation).
    let mut bandwidth = CopyBandwidth::new(kernels)?;
    bandwidth.sample()?;
    // (dtype, prefill seconds, seconds per decoded token), one generator at a time.
    let mut timings = Vec::new();
    let mut profiles = Vec::new();
    for mut generator in generators {
        let (prefill, per_token) =
            time_generation(&mut generator, &prompt, new_tokens, &mut rng, || bandwidth.sample())?;
        timings.push((generator.dtype(), prefill, per_token));
        if profile {
            profiles.push((generator.dtype(), median_profile(&mut generator)?));
        }
    }
    let (copy, memcpy) = bandwidth.gbps();
    let mut lines = Vec::new();
    for (dtype, prefill, per_token) in timings {
        if dtype == WeightDtype::F32 {
            lines.push(BenchLine {
                case: "gpt2_124m_prefill".into(),
                values: vec![
                    ("tokens_per_s", format!("{:.1}", prompt_tokens as f64 / prefill)),
                    ("prompt_tokens", prompt_tokens.to_string()),
                ],
            });
        }
        let bytes: u64 = (prompt_tokens..prompt_tokens + new_tokens)
            .map(|p| decode_bytes_per_token_with(&config, p, dtype))
            .sum::<u64>()
            / new_tokens as u64;
        lines.push(decode_line(
            "gpt2_124m_decode",
            dtype.name(),
            per_token,
            bytes,
            (copy, memcpy),
            new_tokens,
        ));
    }
    for (dtype, times) in profiles {
        lines.extend(profile_lines("gpt2_124m_decode_profile", dtype.name(), &times, copy));
    }
    Ok(lines)
}

/// A decode line: tokens/s from the median seconds per token, the bytes a
/// step reads, and the share of the copy kernel's and the driver's copy
/// bandwidth (`copy`, measured in the same moments) that those bytes at
/// that rate are: bytes_per_token · tokens_per_s / rate.
fn decode_line(
    case: &str,
    dtype: &str,
    seconds_per_token: f64,
    bytes_per_token: u64,
    (copy, memcpy): (f64, f64),
    new_tokens: usize,
) -> BenchLine {
    let tokens_per_s = 1.0 / seconds_per_token;
    let read_gbps = bytes_per_token as f64 * tokens_per_s / 1e9;
    BenchLine {
        case: case.into(),
        values: vec![
            ("dtype", dtype.into()),
            ("tokens_per_s", format!("{tokens_per_s:.2}")),
            ("bytes_per_token", bytes_per_token.to_string()),
            ("copy_gbps", format!("{copy:.2}")),
            ("bandwidth_share", format!("{:.4}", read_gbps / copy)),
            ("memcpy_gbps", format!("{memcpy:.2}")),
            ("memcpy_share", format!("{:.4}", read_gbps / memcpy)),
            ("new_tokens", new_tokens.to_string()),
        ],
    }
}

/// Where a decode step's time goes, from `Generator::profile_decode`
/// (each dispatch alone, its kernel time from GPU timestamps where the
/// adapter has them): one line per kernel entry, slowest first, with its
/// dispatches, milliseconds, the bytes its launches bind (reads and
/// writes, at most) and the rate and share of the copy kernel's `copy_gbps`
/// that makes (a kernel reading a few rows of a table it binds whole, as
/// the embeddings, rotary and attention kernels do, shows a rate far above
/// the copy's); then the three slowest dispatches by node; then `all`, the
/// sum of the times and bound bytes.
pub fn profile_lines(case: &str, dtype: &str, times: &wgrad::graph::DispatchTimes, copy_gbps: f64) -> Vec<BenchLine> {
    let line = |what: (&'static str, String), count: usize, seconds: f64, bytes: u64| {
        let gbps = if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        };
        BenchLine {
            case: case.into(),
            values: vec![
                ("dtype", dtype.into()),
                what,
                ("dispatches", count.to_string()),
                ("ms", format!("{:.3}", seconds * 1e3)),
                ("bound_bytes", bytes.to_string()),
                ("gbps", format!("{gbps:.2}")),
                ("copy_share", format!("{:.3}", gbps / copy_gbps.max(1e-9))),
            ],
        }
    };
    let mut by_entry: Vec<(&'static str, usize, f64, u64)> = Vec::new();
    for t in times {
        match by_entry.iter_mut().find(|e| e.0 == t.entry) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.time.as_secs_f64();
                e.3 += t.bound_bytes;
            }
            None => by_entry.push((t.entry, 1, t.time.as_secs_f64(), t.bound_bytes)),
        }
    }
    by_entry.sort_by(|a, b| b.2.total_cmp(&a.2));
    let mut lines: Vec<BenchLine> = by_entry
        .iter()
        .map(|&(entry, count, seconds, bytes)| line(("entry", entry.into()), count, seconds, bytes))
        .collect();
    let mut slowest: Vec<&wgrad::graph::DispatchTime> = times.iter().collect();
    slowest.sort_by_key(|t| std::cmp::Reverse(t.time));
    lines.extend(slowest.iter().take(3).map(|t| {
        line(
            ("node", format!("{}:{}", t.node, t.entry)),
            1,
            t.time.as_secs_f64(),
            t.bound_bytes,
        )
    }));
    let timer = if times.iter().all(|t| t.on_gpu) {
        "gpu_timestamps"
    } else {
        "wall"
    };
    let mut all = line(
        ("entry", "all".into()),
        times.len(),
        times.iter().map(|t| t.time.as_secs_f64()).sum(),
        times.iter().map(|t| t.bound_bytes).sum(),
    );
    // A rate over every dispatch would count the tables a few rows of are
    // read from (embeddings, rotary, KV caches) as read whole.
    all.values.retain(|(k, _)| !matches!(*k, "gbps" | "copy_share"));
    all.values.push(("timer", timer.into()));
    lines.push(all);
    lines
}

/// Profiles of a decode step taken this many times: each dispatch's time
/// is its median over them, as one sample of a 0.1 ms dispatch on a
/// shared machine may be ten times that.
const PROFILE_RUNS: usize = 5;

/// `generator`'s decode step profiled [`PROFILE_RUNS`] times (at the same
/// position: `profile_decode` does not advance it), each dispatch's time
/// the median of its runs.
fn median_profile(generator: &mut wgrad::infer::generate::Generator) -> Result<wgrad::graph::DispatchTimes> {
    let tokens = vec![0; generator.sequences()];
    let runs = (0..PROFILE_RUNS)
        .map(|_| generator.profile_decode(&tokens))
        .collect::<Result<Vec<_>>>()?;
    let mut profile = runs[0].clone();
    for (i, entry) in profile.iter_mut().enumerate() {
        let mut times: Vec<Duration> = runs.iter().filter_map(|r| r.get(i)).map(|t| t.time).collect();
        times.sort();
        entry.time = times[times.len() / 2];
        entry.on_gpu = runs.iter().all(|r| r.get(i).is_some_and(|t| t.on_gpu));
    }
    Ok(profile)
}

/// Where SmolLM2-135M-Instruct's GGUF file is: `$WGRAD_SMOLLM2`, else
/// where `scripts/fetch-smollm2.sh` caches it (wgrad's cache directory).
pub fn smollm2_path() -> Option<std::path::PathBuf> {
    std::env::var_os("WGRAD_SMOLLM2")
        .map(std::path::PathBuf::from)
        .or_else(|| wgrad::user_cache::models_dir().map(|d| d.join("SmolLM2-135M-Instruct.Q4_1.gguf")))
}

/// Where Gemma 3 270M's Q4_K_M GGUF file is: `$WGRAD_GEMMA3`, else where
/// `scripts/fetch-gemma3.sh` caches it.
pub fn gemma3_path() -> Option<std::path::PathBuf> {
    std::env::var_os("WGRAD_GEMMA3")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| wgrad::user_cache::models_dir().map(|d| d.join("gemma-3-270m-q4_k_m.gguf")))
}

/// A GGUF model file's generation bench: which cases it names, where the
/// file is fetched from, the cache it runs with and whether the f32
/// de-quantized model runs beside the file's own weights.
pub struct GgufBench<'a> {
    /// Case names are `{family}_prefill`, `{family}_decode`.
    pub family: &'a str,
    /// How to fetch the file, for the error a missing one gives.
    pub fetch: &'a str,
    /// Positions the cache holds (None: the file's whole context).
    pub context: Option<usize>,
    pub with_f32: bool,
}

/// SmolLM2-135M-Instruct from its GGUF file at `path`, as `wgrad generate`
/// runs it: once with the weights as the file stores them (Q4_1
/// projections, the Q8_0 token table that is also the head, decoded in the
/// kernels; `dtype=q4_1`) and once de-quantized to f32. See [`gguf_generate`].
pub fn smollm2_generate(
    kernels: &Arc<Kernels>,
    path: &std::path::Path,
    prompt_tokens: usize,
    new_tokens: usize,
    profile: bool,
) -> Result<Vec<BenchLine>> {
    // The file's whole context (8192 positions), as `wgrad generate` ran
    // it: the attention kernel on a CPU adapter is picked by the context.
    let bench = GgufBench {
        family: "smollm2",
        fetch: "fetch it with scripts/fetch-smollm2.sh, or set WGRAD_SMOLLM2 to a copy",
        context: None,
        with_f32: true,
    };
    gguf_generate(kernels, path, &bench, prompt_tokens, new_tokens, profile)
}

/// Any family's GGUF file at `path` as `wgrad generate` runs it: with the
/// weights as the file stores them (named by the format most of the
/// quantized bytes are in) and, with `with_f32`, de-quantized to f32. For
/// each, a `prompt_tokens`-token prompt (seeded random ids) prefilled
/// (tokens/s), then `new_tokens` greedy decode steps with the bytes each
/// reads (the parameter arena, every weight once, plus the KV cache's
/// positions so far) and the share of the copy bandwidth sampled after
/// every step, as [`gpt2_124m_generate`] does. A missing file is an error
/// naming where it was looked for and how to fetch it. With `profile`,
/// each generator's decode step dispatch by dispatch ([`profile_lines`]).
pub fn gguf_generate(
    kernels: &Arc<Kernels>,
    path: &std::path::Path,
    bench: &GgufBench<'_>,
    prompt_tokens: usize,
    new_tokens: usize,
    profile: bool,
) -> Result<Vec<BenchLine>> {
    use wgrad::infer::generate::{Generator, GeneratorOptions, WeightDtype};
    if !path.is_file() {
        return Err(wgrad::Error::InvalidArgument {
            op: "bench",
            reason: format!(
                "{}: the GGUF file is missing at {}: {}",
                bench.family,
                path.display(),
                bench.fetch
            ),
        });
    }
    let file = wgrad::io::gguf_model::GgufModel::open(path)?;
    let (model, quantized) = file.to_quantized_causal_lm()?;
    let full = model.context_len();
    let context = bench.context.unwrap_or(full).min(full);
    let prompt_tokens = prompt_tokens.clamp(1, context / 2);
    let new_tokens = new_tokens.clamp(1, context - prompt_tokens - 4);
    // Named by the format most of the quantized bytes are in (SmolLM2's
    // file: Q4_1, its token table Q8_0; Gemma 3's Q4_K_M: Q8_0's table).
    let mut formats: Vec<(wgrad::ops::QuantFormat, usize)> = Vec::new();
    for m in quantized.values() {
        match formats.iter_mut().find(|f| f.0 == m.format) {
            Some(f) => f.1 += m.raw.len(),
            None => formats.push((m.format, m.raw.len())),
        }
    }
    let quantized_name = formats
        .iter()
        .max_by_key(|f| f.1)
        .map_or("f32".to_string(), |f| f.0.name().to_lowercase());
    let options = |quantized: Arc<wgrad::nn::QuantizedWeights>| GeneratorOptions {
        context: Some(context),
        quantized,
        ..GeneratorOptions::default()
    };
    let mut generators = vec![(
        quantized_name,
        Generator::with_options(kernels.clone(), model.as_ref(), &options(Arc::new(quantized)))?,
    )];
    if bench.with_f32 {
        let dense = file.to_causal_lm()?;
        generators.push((
            WeightDtype::F32.name().to_string(),
            Generator::with_options(kernels.clone(), dense.as_ref(), &options(Arc::default()))?,
        ));
    }
    drop(file);
    let sizes = model.lm_sizes();
    // The host copy of the weights goes before anything is timed.
    drop(model);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let prompt: Vec<u32> = (0..prompt_tokens)
        .map(|_| rng.random_range(0..sizes.vocab_size as u32))
        .collect();
    let mut bandwidth = CopyBandwidth::new(kernels)?;
    bandwidth.sample()?;
    let mut timings = Vec::new();
    let mut profiles = Vec::new();
    for (dtype, mut generator) in generators {
        let (prefill, per_token) =
            time_generation(&mut generator, &prompt, new_tokens, &mut rng, || bandwidth.sample())?;
        let parameter_bytes = generator.executor().plan().param_arena_len as u64 * 4;
        if profile {
            profiles.push((dtype.clone(), median_profile(&mut generator)?));
        }
        timings.push((dtype, prefill, per_token, parameter_bytes));
    }
    let (copy, memcpy) = bandwidth.gbps();
    // Keys and values of every layer at positions 0..=p.
    let cache_bytes = |p: usize| 2 * sizes.cached_layers * (p as u64 + 1) * sizes.cache_width * 4;
    let mut lines = Vec::new();
    for (dtype, prefill, per_token, parameter_bytes) in timings {
        lines.push(BenchLine {
            case: format!("{}_prefill", bench.family),
            values: vec![
                ("dtype", dtype.clone()),
                ("tokens_per_s", format!("{:.1}", prompt_tokens as f64 / prefill)),
                ("prompt_tokens", prompt_tokens.to_string()),
            ],
        });
        let bytes = parameter_bytes
            + (prompt_tokens..prompt_tokens + new_tokens)
                .map(cache_bytes)
                .sum::<u64>()
                / new_tokens as u64;
        lines.push(decode_line(
            &format!("{}_decode", bench.family),
            &dtype,
            per_token,
            bytes,
            (copy, memcpy),
            new_tokens,
        ));
    }
    for (dtype, times) in profiles {
        lines.extend(profile_lines(
            &format!("{}_decode_profile", bench.family),
            &dtype,
            &times,
            copy,
        ));
    }
    Ok(lines)
}

/// Batched decode on SmolLM2 from its GGUF file (quantized weights, as
/// `wgrad serve` runs it, caches of 512 positions): for each count in
/// `rows`, a generator of that many sequences prefills a 16-token prompt
/// (seeded random ids) in each, then `steps` greedy decode steps of every
/// row; the median step's time and the tokens/s it makes (rows per step).
/// What continuous batching's throughput rests on, without the server.
/// With `profile`, each count's step dispatch by dispatch
/// (`smollm2_decode_rows_profile`, dtype `rows=R`).
pub fn smollm2_decode_rows(
    kernels: &Arc<Kernels>,
    path: &std::path::Path,
    rows: &[usize],
    steps: usize,
    profile: bool,
) -> Result<Vec<BenchLine>> {
    use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling};
    use wgrad::nn::CausalLm;
    if !path.is_file() {
        return Err(wgrad::Error::InvalidArgument {
            op: "bench smollm2_decode_rows",
            reason: format!("SmolLM2-135M-Instruct's GGUF file is missing at {}: fetch it with scripts/fetch-smollm2.sh, or set WGRAD_SMOLLM2 to a copy", path.display()),
        });
    }
    let file = wgrad::io::gguf_model::GgufModel::open(path)?;
    let model = file.to_llama()?;
    let quantized = Arc::new(file.quantized_weights()?);
    drop(file);
    let vocab = model.vocab_size() as u32;
    let greedy = Sampling::greedy();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let copy = if profile {
        CopyBandwidth::new(kernels).and_then(|mut b| b.sample().map(|_| b.gbps().0))?
    } else {
        0.0
    };
    let mut lines = Vec::new();
    for &r in rows {
        let options = GeneratorOptions {
            sequences: r,
            context: Some(512),
            quantized: quantized.clone(),
            ..GeneratorOptions::default()
        };
        let mut generator = Generator::with_options(kernels.clone(), &model, &options)?;
        let prompts: Vec<Vec<u32>> = (0..r)
            .map(|_| (0..16).map(|_| rng.random_range(0..vocab)).collect())
            .collect();
        let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let mut tokens = generator.prefill_and_sample(&prompts, &greedy, &mut rng)?;
        // Untimed steps first: pipelines compile and memory is first touched.
        for _ in 0..2 {
            tokens = generator.decode_and_sample(&tokens, &greedy, &mut rng)?;
        }
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let start = Instant::now();
            tokens = generator.decode_and_sample(&tokens, &greedy, &mut rng)?;
            times.push(start.elapsed().as_secs_f64());
        }
        let step = median(&mut times);
        lines.push(BenchLine {
            case: "smollm2_decode_rows".into(),
            values: vec![
                ("rows", r.to_string()),
                ("step_ms", format!("{:.1}", step * 1e3)),
                ("tokens_per_s", format!("{:.2}", r as f64 / step)),
                ("steps", steps.to_string()),
            ],
        });
        if profile {
            lines.extend(profile_lines(
                "smollm2_decode_rows_profile",
                &format!("rows={r}"),
                &median_profile(&mut generator)?,
                copy,
            ));
        }
    }
    Ok(lines)
}
