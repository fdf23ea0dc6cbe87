//! Tensor parallel training of the GPT, Megatron style (Shoeybi et al.,
//! 2019): every device holds a share of every block.
//!
//! - Attention: device d holds some heads — the rows of `c_attn` that make
//!   their q, k and v (and those bias entries) and the columns of
//!   `attn.c_proj.weight` that read their channels (row-parallel).
//! - MLP: device d holds some hidden units — rows of `c_fc` and its bias,
//!   and the matching columns of `mlp.c_proj.weight`.
//! - The embeddings (`wte`, `wpe`) and the block norms are replicated; the
//!   final norm and the head (tied to `wte`) run on device 0.
//!
//! Each device runs a chain of segments ([`Stage`]s), [B, T, C] in and
//! [B, T, C] out: segment 0 is the embeddings and block 0's attention, then
//! come block 0's MLP, block 1's attention, and so on. Device d's segment
//! outputs its partial sum `[d = 0]·(x + c_proj.bias) + part_d(ln(x))`; the
//! sum over devices (an all-reduce through the host, in f64 and device
//! order: Megatron's g) is the next segment's input on every device.
//! Backward runs the chain in reverse: the head's input gradient is the
//! output gradient of every device's last segment, and the sum of the
//! devices' input gradients (Megatron's f) is the output gradient of the
//! segment before. Sharded parameters then hold exact gradients; each copy
//! of a replicated one holds its device's part, which [`reduce_and_step`]
//! sums before every stage steps, clipping by the whole model's norm.
//!
//! Heads and hidden units are split as evenly as possible (4 heads on 3
//! devices: 2, 1, 1).
//!
//! Why the vocabulary is not split as well: the char-level tables here
//! have 65–84 rows (84 × 128 floats, less than one block's `c_attn`), so a
//! vocabulary-parallel embedding and head would save almost no memory, yet
//! cost an all-reduce of [B, T, C] after the lookup and, for the
//! cross-entropy over split logits, all-reduces of each row's max and sum
//! of exponentials in the forward pass — each a host round trip, which
//! wgpu (no peer copies) pays as a full synchronisation. At GPT-2's 50257
//! rows the table is 31% of the 124M parameters (replicated on every
//! device) and the head about a quarter of the forward's multiply-adds at
//! T = 1024, all on device 0; a vocabulary-parallel embedding and head
//! would then pay for their extra all-reduces.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::stage::{reduce_and_step, SharedParameter, Stage, StageEnd};
use super::tensor::{sum_on_host, TensorParallelStats};
use super::{on_device, DeviceGroup};
use crate::error::{Error, Result};
use crate::gpt_folder::OptimizerState;
use crate::graph::{Graph, Tensor};
use crate::kernels::{Activation, Kernels, MatmulForm, OptimizerConfig, View};
use crate::nn::{parameter, Block, Criterion, Gpt, GptConfig, LayerNorm, Linear, Module};
use crate::optim;
use crate::trainer::Targets;

const OP: &str = "GptTensorParallel";

/// (name, shape, values) of each parameter, as `Executor::parameters`.
type NamedValues = Vec<(String, Vec<usize>, Vec<f32>)>;

fn invalid(reason: String) -> Error {
    Error::InvalidArgument { op: OP, reason }
}

/// Which half of a block a segment computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    Attention,
    Mlp,
}

/// How a parameter of the single-device model is spread over the devices.
#[derive(Clone, Debug, PartialEq)]
enum Layout {
    /// A full copy on every device holding its segment.
    Replicated,
    /// On device 0 only: a bias added once to the partial sums.
    FirstDevice,
    /// `parts` blocks of rows (q, k and v: 3) of `cols` values each; device
    /// d holds `widths[d]` consecutive rows of every block.
    Rows { parts: usize, cols: usize, widths: Vec<usize> },
    /// `rows` rows; device d holds `widths[d]` consecutive columns.
    Columns { rows: usize, widths: Vec<usize> },
}

/// Where one parameter of the single-device model lives.
#[derive(Clone, Debug)]
struct Placement {
    name: String,
    /// Its single-device shape.
    shape: Vec<usize>,
    /// The segment holding it on each device; `None`: only the head.
    segment: Option<usize>,
    /// Also held by the head (the tied token embedding).
    in_head: bool,
    layout: Layout,
}

/// `(start, width)` of each device's share.
fn ranges(widths: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    widths.iter().scan(0, |start, &w| {
        let range = (*start, w);
        *start += w;
        Some(range)
    })
}

impl Placement {
    /// Each device's share of `full` (`None` where a device holds none).
    fn scatter(&self, full: &[f32], devices: usize) -> Result<Vec<Option<Vec<f32>>>> {
        let len: usize = self.shape.iter().product();
        if full.len() != len {
            return Err(Error::shape(OP, format!("`{}` needs {:?}, got {} values", self.name, self.shape, full.len()), &[&self.shape, &[full.len()]]));
        }
        Ok(match &self.layout {
            Layout::Replicated => vec![Some(full.to_vec()); devices],
            Layout::FirstDevice => (0..devices).map(|d| (d == 0).then(|| full.to_vec())).collect(),
            Layout::Rows { parts, cols, widths } => {
                let n: usize = widths.iter().sum();
                ranges(widths)
                    .map(|(start, w)| Some((0..*parts).flat_map(|p| full[(p * n + start) * cols..(p * n + start + w) * cols].iter().copied()).collect()))
                    .collect()
            }
            Layout::Columns { rows, widths } => {
                let n: usize = widths.iter().sum();
                ranges(widths).map(|(start, w)| Some((0..*rows).flat_map(|r| full[r * n + start..r * n + start + w].iter().copied()).collect())).collect()
            }
        })
    }

    /// The full values from the devices' shares (a replicated parameter's
    /// first copy); `None` when a share is missing or of the wrong size.
    fn gather(&self, shards: &[Option<&Vec<f32>>]) -> Option<Vec<f32>> {
        let full = match &self.layout {
            Layout::Replicated | Layout::FirstDevice => shards.iter().flatten().next().map(|v| v.to_vec())?,
            Layout::Rows { parts, cols, widths } => {
                let mut full = Vec::new();
                for p in 0..*parts {
                    for (d, &w) in widths.iter().enumerate() {
                        full.extend_from_slice(shards.get(d).copied().flatten()?.get(p * w * cols..(p + 1) * w * cols)?);
                    }
                }
                full
            }
            Layout::Columns { rows, widths } => {
                let mut full = Vec::new();
                for r in 0..*rows {
                    for (d, &w) in widths.iter().enumerate() {
                        full.extend_from_slice(shards.get(d).copied().flatten()?.get(r * w..(r + 1) * w)?);
                    }
                }
                full
            }
        };
        (full.len() == self.shape.iter().product::<usize>()).then_some(full)
    }
}

/// `total` units over `devices`, as evenly as possible, the first devices
/// taking one more (4 over 3: 2, 1, 1).
fn even_split(total: usize, devices: usize) -> Vec<usize> {
    (0..devices).map(|d| total / devices + usize::from(d < total % devices)).collect()
}

/// Every device's share of every parameter, by name, while the stages are
/// built.
struct Shares(HashMap<String, Vec<Option<Vec<f32>>>>);

/// One device's view of [`Shares`].
#[derive(Clone, Copy)]
struct DeviceShares<'a> {
    all: &'a Shares,
    device: usize,
}

impl DeviceShares<'_> {
    fn take(&self, name: &str) -> Result<Vec<f32>> {
        let device = self.device;
        self.all.0.get(name).and_then(|s| s.get(device).cloned().flatten()).ok_or_else(|| invalid(format!("device #{device} holds no share of `{name}`")))
    }

    /// A norm with the model's eps and this device's copy of its values.
    fn norm(&self, model: &LayerNorm, prefix: &str) -> Result<LayerNorm> {
        Ok(LayerNorm { weight: self.take(&format!("{prefix}weight"))?, bias: self.take(&format!("{prefix}bias"))?, ..model.clone() })
    }
}

/// Sizes every segment graph shares.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    time: usize,
    channels: usize,
}

/// The row-parallel projection ending a segment: `y` [B·T, width] times
/// this device's columns of `{prefix}weight` [C, width], then, on device 0
/// only, the bias and the residual `x` — so the devices' outputs sum to
/// x + y·Wᵀ + b.
fn row_parallel(g: &mut Graph, y: Tensor, x: Tensor, prefix: &str, width: usize, dims: Dims, own: DeviceShares<'_>) -> Result<Tensor> {
    let Dims { batch, time, channels } = dims;
    let first = own.device == 0;
    let weight = parameter(g, prefix, "weight", &[channels, width], &own.take(&format!("{prefix}weight"))?, true)?;
    let mut partial = g.matmul_form(MatmulForm::ABt, y, weight)?;
    if first {
        let bias = parameter(g, prefix, "bias", &[channels], &own.take(&format!("{prefix}bias"))?, false)?;
        partial = g.bias_add(partial, bias)?;
    }
    let partial = g.reshape(partial, &[batch, time, channels])?;
    if first {
        g.add(x, partial)
    } else {
        Ok(partial)
    }
}

/// Device `device`'s share of block `i`'s attention on x [B, T, C]:
/// `heads` heads of `head_dim` channels.
fn attention_share(g: &mut Graph, x: Tensor, (i, block): (usize, &Block), heads: usize, head_dim: usize, dims: Dims, own: DeviceShares<'_>) -> Result<Tensor> {
    let Dims { batch, time, channels } = dims;
    let prefix = format!("h.{i}.");
    let normed = own.norm(&block.ln_1, &format!("{prefix}ln_1."))?.forward(g, x, &format!("{prefix}ln_1."))?;
    let width = heads * head_dim;
    let c_attn = format!("{prefix}attn.c_attn.");
    let c_attn = Linear {
        in_features: channels,
        out_features: 3 * width,
        weight: own.take(&format!("{c_attn}weight"))?,
        bias: Some(own.take(&format!("{c_attn}bias"))?),
    }
    .forward(g, normed, &c_attn)?;
    // As CausalSelfAttention, over this device's heads only.
    let parts = g.split_last(c_attn, &[width, width, width])?;
    let mut qkv = Vec::with_capacity(3);
    for part in parts {
        let split = g.reshape(part, &[batch, time, heads, head_dim])?;
        qkv.push(g.permute(split, &[0, 2, 1, 3])?);
    }
    let scores = g.matmul_form(MatmulForm::ABt, qkv[0], qkv[1])?;
    let scores = g.scale(scores, 1.0 / (head_dim as f32).sqrt())?;
    let att = g.softmax(scores, true)?;
    let y = g.matmul_form(MatmulForm::AB, att, qkv[2])?;
    let y = g.permute(y, &[0, 2, 1, 3])?;
    let y = g.reshape(y, &[batch * time, width])?;
    row_parallel(g, y, x, &format!("{prefix}attn.c_proj."), width, dims, own)
}

/// Device `device`'s share of block `i`'s MLP on x [B, T, C]: `hidden`
/// hidden units.
fn mlp_share(g: &mut Graph, x: Tensor, (i, block): (usize, &Block), hidden: usize, dims: Dims, own: DeviceShares<'_>) -> Result<Tensor> {
    let Dims { batch, time, channels } = dims;
    let prefix = format!("h.{i}.");
    let normed = own.norm(&block.ln_2, &format!("{prefix}ln_2."))?.forward(g, x, &format!("{prefix}ln_2."))?;
    // Rows as a matrix, as Mlp does, so bias and GELU fuse into c_fc's matmul.
    let flat = g.reshape(normed, &[batch * time, channels])?;
    let c_fc = format!("{prefix}mlp.c_fc.");
    let h = Linear { in_features: channels, out_features: hidden, weight: own.take(&format!("{c_fc}weight"))?, bias: Some(own.take(&format!("{c_fc}bias"))?) }
        .forward(g, flat, &c_fc)?;
    let h = g.activation(Activation::Gelu, h)?;
    row_parallel(g, h, x, &format!("{prefix}mlp.c_proj."), hidden, dims, own)
}

/// The single-device model's parameters, (name, shape), in
/// [`Module::named_parameters`] order, as its config says they must be.
fn expected_shapes(model: &Gpt) -> Vec<(String, Vec<usize>)> {
    let GptConfig { vocab_size: v, block_size: p, n_embd: c, .. } = model.config;
    // (name, weight shape, bias shape): Linear weights [out, in], norms [C].
    let mut all = vec![("wte.weight".to_string(), vec![v, c]), ("wpe.weight".to_string(), vec![p, c])];
    let mut pair = |name: String, weight: Vec<usize>, bias: usize| {
        all.push((format!("{name}.weight"), weight));
        all.push((format!("{name}.bias"), vec![bias]));
    };
    for (i, block) in model.h.iter().enumerate() {
        if block.attn.is_some() {
            pair(format!("h.{i}.ln_1"), vec![c], c);
            pair(format!("h.{i}.attn.c_attn"), vec![3 * c, c], 3 * c);
            pair(format!("h.{i}.attn.c_proj"), vec![c, c], c);
        }
        pair(format!("h.{i}.ln_2"), vec![c], c);
        pair(format!("h.{i}.mlp.c_fc"), vec![4 * c, c], 4 * c);
        pair(format!("h.{i}.mlp.c_proj"), vec![c, 4 * c], c);
    }
    pair("ln_f".into(), vec![c], c);
    all
}

/// Refuses a model whose parts do not have the sizes its config gives.
fn check_model(model: &Gpt) -> Result<()> {
    let config = model.config;
    let sizes = [config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_embd];
    if sizes.contains(&0) || config.n_embd % config.n_head != 0 || model.h.len() != config.n_layer {
        return Err(invalid(format!(
            "every size must be positive, n_embd a multiple of n_head and n_layer the number of blocks ({}): {config:?}",
            model.h.len()
        )));
    }
    for (i, block) in model.h.iter().enumerate() {
        if let Some(attn) = &block.attn {
            if attn.n_head != config.n_head || attn.n_embd != config.n_embd {
                return Err(invalid(format!("block {i}'s attention has {} heads over {} channels; the config says {config:?}", attn.n_head, attn.n_embd)));
            }
        }
    }
    let want = expected_shapes(model);
    let have = model.parameter_values();
    if want.len() != have.len() {
        return Err(invalid(format!("{} parameters where the config needs {}", have.len(), want.len())));
    }
    for ((name, shape), (have_name, have_shape, values)) in want.iter().zip(&have) {
        let len: usize = shape.iter().product();
        if name != have_name || shape != have_shape || values.len() != len {
            return Err(Error::shape(
                OP,
                format!("`{have_name}` is {have_shape:?} with {} values; the config needs `{name}` {shape:?}", values.len()),
                &[shape, have_shape, &[values.len()]],
            ));
        }
    }
    Ok(())
}

/// The GPT trained Megatron-style over every device of a group (see the
/// module docs).
pub struct GptTensorParallel {
    config: GptConfig,
    batch: usize,
    optimizer: OptimizerConfig,
    /// `segments[d][k]`: device d's k-th segment.
    segments: Vec<Vec<Stage>>,
    /// Device 0: the final norm, the tied head and the loss.
    head: Stage,
    head_split: Vec<usize>,
    hidden_split: Vec<usize>,
    /// Every parameter of the single-device model, in its order.
    placements: Vec<Placement>,
    /// The parameters several stages hold, by index in [`Self::stages`].
    shared: Vec<SharedParameter>,
    /// The device of each stage, in [`Self::stages`] order.
    stage_devices: Vec<usize>,
    labels: Vec<String>,
    last_grad_norm: Option<f32>,
    stats: TensorParallelStats,
}

impl GptTensorParallel {
    /// Splits `model` over every device of `group`, each step taking
    /// `batch` sequences of `block_size` tokens.
    pub fn new(group: &DeviceGroup, model: &Gpt, optimizer: impl Into<OptimizerConfig>, batch: usize) -> Result<Self> {
        let optimizer = optimizer.into();
        check_model(model)?;
        let config = model.config;
        let devices = group.len();
        if batch == 0 {
            return Err(invalid("the batch needs at least one sequence".into()));
        }
        let (c, n_head) = (config.n_embd, config.n_head);
        let head_dim = c / n_head;
        let hidden = 4 * c;
        let attention = model.h.iter().any(|b| b.attn.is_some());
        if attention && devices > n_head {
            return Err(invalid(format!(
                "{devices} devices need at least one attention head each, but the model has {n_head} heads: use at most {n_head} devices"
            )));
        }
        if devices > hidden {
            return Err(invalid(format!("{devices} devices need at least one MLP hidden unit each, but the model has {hidden}")));
        }
        let head_split = even_split(n_head, devices);
        let hidden_split = even_split(hidden, devices);
        let channel_split: Vec<usize> = head_split.iter().map(|h| h * head_dim).collect();

        // Segment k computes half parts[k] (the first also the embeddings).
        let mut parts = Vec::new();
        for (i, block) in model.h.iter().enumerate() {
            if block.attn.is_some() {
                parts.push((i, Half::Attention));
            }
            parts.push((i, Half::Mlp));
        }
        let segment_of = |i: usize, half: Half| parts.iter().position(|&p| p == (i, half));
        let placements: Vec<Placement> = model
            .parameter_values()
            .into_iter()
            .map(|(name, shape, _)| {
                let place = |segment: Option<usize>, layout: Layout| Placement { name: name.clone(), shape: shape.clone(), segment, in_head: name == "wte.weight", layout };
                let block = name.strip_prefix("h.").and_then(|rest| rest.split_once('.')).and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)));
                match block {
                    None if name.starts_with("ln_f.") => place(None, Layout::Replicated),
                    None => place(Some(0), Layout::Replicated),
                    Some((i, rest)) => {
                        let half = if rest.starts_with("ln_1.") || rest.starts_with("attn.") { Half::Attention } else { Half::Mlp };
                        let layout = match rest {
                            "attn.c_attn.weight" => Layout::Rows { parts: 3, cols: c, widths: channel_split.clone() },
                            "attn.c_attn.bias" => Layout::Rows { parts: 3, cols: 1, widths: channel_split.clone() },
                            "attn.c_proj.weight" => Layout::Columns { rows: c, widths: channel_split.clone() },
                            "mlp.c_fc.weight" => Layout::Rows { parts: 1, cols: c, widths: hidden_split.clone() },
                            "mlp.c_fc.bias" => Layout::Rows { parts: 1, cols: 1, widths: hidden_split.clone() },
                            "mlp.c_proj.weight" => Layout::Columns { rows: c, widths: hidden_split.clone() },
                            "attn.c_proj.bias" | "mlp.c_proj.bias" => Layout::FirstDevice,
                            _ => Layout::Replicated,
                        };
                        place(segment_of(i, half), layout)
                    }
                }
            })
            .collect();
        let mut shares = HashMap::new();
        for ((name, _, values), placement) in model.parameter_values().into_iter().zip(&placements) {
            shares.insert(name, placement.scatter(values, devices)?);
        }
        let shares = Shares(shares);

        let dims = Dims { batch, time: config.block_size, channels: c };
        let mut segments = Vec::with_capacity(devices);
        for (d, kernels) in group.members().iter().enumerate() {
            let mut chain = Vec::with_capacity(parts.len());
            for (k, &(i, half)) in parts.iter().enumerate() {
                let own = DeviceShares { all: &shares, device: d };
                let stage = Self::segment(kernels, model, k, (i, half), (head_split[d], head_dim, hidden_split[d]), dims, own, optimizer)
                    .map_err(|e| on_device(d, kernels, e))?;
                chain.push(stage);
            }
            segments.push(chain);
        }
        let k0 = &group.members()[0];
        let head = Self::head(k0, model, dims, DeviceShares { all: &shares, device: 0 }, optimizer).map_err(|e| on_device(0, k0, e))?;

        let n_seg = parts.len();
        let head_index = devices * n_seg;
        let mut shared = Vec::new();
        for p in &placements {
            let mut holders: Vec<usize> = match (p.segment, &p.layout) {
                (Some(k), Layout::Replicated) => (0..devices).map(|d| d * n_seg + k).collect(),
                _ => Vec::new(),
            };
            if p.in_head {
                holders.push(head_index);
            }
            if holders.len() > 1 {
                shared.push(SharedParameter { name: p.name.clone(), holders });
            }
        }
        let mut stage_devices: Vec<usize> = (0..devices).flat_map(|d| std::iter::repeat_n(d, n_seg)).collect();
        stage_devices.push(0);
        Ok(GptTensorParallel {
            config,
            batch,
            optimizer,
            segments,
            head,
            head_split,
            hidden_split,
            placements,
            shared,
            stage_devices,
            labels: group.labels(),
            last_grad_norm: None,
            stats: TensorParallelStats::default(),
        })
    }

    /// Device `device`'s segment `k`, computing `part` (block, half) with
    /// `units` = (heads, head size, hidden units) of its own.
    #[allow(clippy::too_many_arguments)]
    fn segment(
        kernels: &std::sync::Arc<Kernels>,
        model: &Gpt,
        k: usize,
        part: (usize, Half),
        units: (usize, usize, usize),
        dims: Dims,
        own: DeviceShares<'_>,
        optimizer: OptimizerConfig,
    ) -> Result<Stage> {
        let Dims { batch, time, channels } = dims;
        let config = model.config;
        let mut g = Graph::new();
        let (input, x) = if k == 0 {
            // Token and position embeddings, as Gpt::forward (T = block_size).
            let ids = g.ids("idx", &[batch, time])?;
            let wte = parameter(&mut g, "wte.", "weight", &[config.vocab_size, channels], &own.take("wte.weight")?, false)?;
            let tokens = g.embedding(wte, ids)?;
            let wpe = parameter(&mut g, "wpe.", "weight", &[config.block_size, channels], &own.take("wpe.weight")?, false)?;
            (ids, g.add(tokens, wpe)?)
        } else {
            let x = g.input("segment_input", &[batch, time, channels])?;
            (x, x)
        };
        let (i, half) = part;
        let block = model.h.get(i).ok_or_else(|| invalid(format!("no block {i}")))?;
        let (heads, head_dim, hidden) = units;
        let output = match half {
            Half::Attention => attention_share(&mut g, x, (i, block), heads, head_dim, dims, own)?,
            Half::Mlp => mlp_share(&mut g, x, (i, block), hidden, dims, own)?,
        };
        let in_features = if k == 0 { time } else { channels };
        Stage::from_graph(kernels.clone(), g, input, output, k > 0, StageEnd::Middle, optimizer, batch * time, in_features, channels)
    }

    /// The final norm, the head tied to its own copy of `wte`, and the loss.
    fn head(kernels: &std::sync::Arc<Kernels>, model: &Gpt, dims: Dims, own: DeviceShares<'_>, optimizer: OptimizerConfig) -> Result<Stage> {
        let Dims { batch, time, channels } = dims;
        let vocab = model.config.vocab_size;
        let mut g = Graph::new();
        let x = g.input("segment_input", &[batch, time, channels])?;
        let normed = own.norm(&model.ln_f, "ln_f.")?.forward(&mut g, x, "ln_f.")?;
        let wte = parameter(&mut g, "wte.", "weight", &[vocab, channels], &own.take("wte.weight")?, false)?;
        let logits = g.rows_matmul(MatmulForm::ABt, normed, wte)?;
        Stage::from_graph(kernels.clone(), g, x, logits, true, StageEnd::Last(Criterion::CrossEntropy), optimizer, batch * time, channels, vocab)
    }

    /// Heads of each block's attention held by each device.
    pub fn head_split(&self) -> &[usize] {
        &self.head_split
    }

    /// MLP hidden units of each block held by each device.
    pub fn hidden_split(&self) -> &[usize] {
        &self.hidden_split
    }

    pub fn config(&self) -> GptConfig {
        self.config
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn stats(&self) -> &TensorParallelStats {
        &self.stats
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.head.executor().step_count()
    }

    /// The whole model's gradient norm before the last step's clipping
    /// (torch.nn.utils.clip_grad_norm_'s return value); `None` when the
    /// optimizer does not clip or before the first step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_grad_norm
    }

    /// Every stage with its device index: each device's segments in order,
    /// device by device, then the head on device 0.
    pub fn stages(&self) -> impl Iterator<Item = (usize, &Stage)> {
        self.segments.iter().enumerate().flat_map(|(d, chain)| chain.iter().map(move |s| (d, s))).chain(std::iter::once((0, &self.head)))
    }

    fn check_batch(&self, op: &'static str, ids: &[u32], targets: &[u32]) -> Result<()> {
        let tokens = self.batch * self.config.block_size;
        if ids.len() != tokens || targets.len() != tokens {
            return Err(Error::shape(
                op,
                format!("ids and targets must each be {} sequences × {} tokens", self.batch, self.config.block_size),
                &[&[self.batch, self.config.block_size], &[ids.len()], &[targets.len()]],
            ));
        }
        Ok(())
    }

    /// The devices' outputs of segment `k`, summed (the forward all-reduce's
    /// host half), and the time spent after the slowest device's arrived.
    fn sum_outputs(&self, k: usize) -> Result<(Vec<f32>, Duration)> {
        let views: Vec<(&Kernels, View<'_>)> = self
            .segments
            .iter()
            .enumerate()
            .map(|(d, chain)| Ok((&*chain[k].kernels, chain[k].output_view().map_err(|e| on_device(d, &chain[k].kernels, e))?)))
            .collect::<Result<_>>()?;
        sum_on_host(&views)
    }

    /// Runs every segment's forward and sets the head's input; returns the
    /// time spent moving activations.
    fn forward(&mut self, ids: &[u32]) -> Result<Duration> {
        for (d, chain) in self.segments.iter_mut().enumerate() {
            let k = chain[0].kernels.clone();
            chain[0].set_input_ids(ids).map_err(|e| on_device(d, &k, e))?;
            chain[0].forward().map_err(|e| on_device(d, &k, e))?;
        }
        let (mut x, mut communication) = self.sum_outputs(0)?;
        for k in 1..self.segments[0].len() {
            let writes = Instant::now();
            for (d, chain) in self.segments.iter().enumerate() {
                chain[k].set_input(&x).map_err(|e| on_device(d, &chain[k].kernels, e))?;
            }
            communication += writes.elapsed();
            for (d, chain) in self.segments.iter_mut().enumerate() {
                let kernels = chain[k].kernels.clone();
                chain[k].forward().map_err(|e| on_device(d, &kernels, e))?;
            }
            let (sum, transfer) = self.sum_outputs(k)?;
            x = sum;
            communication += transfer;
        }
        let writes = Instant::now();
        self.head.set_input(&x).map_err(|e| on_device(0, &self.head.kernels, e))?;
        Ok(communication + writes.elapsed())
    }

    /// One optimizer step on `batch` sequences of token `ids` and their
    /// next tokens `targets` (each [batch, block_size], row-major); the
    /// mean loss when `read_loss`.
    pub fn step(&mut self, ids: &[u32], targets: &[u32], read_loss: bool) -> Result<Option<f32>> {
        self.check_batch("GptTensorParallel::step", ids, targets)?;
        let wall = Instant::now();
        let mut communication = self.forward(ids)?;
        let k0 = self.head.kernels.clone();
        self.head.set_targets(Targets::Classes(targets), 1.0).map_err(|e| on_device(0, &k0, e))?;
        self.head.backward(true).map_err(|e| on_device(0, &k0, e))?;
        let view = self.head.input_gradient_view().ok_or_else(|| invalid("the head yields no input gradient".into()))?.map_err(|e| on_device(0, &k0, e))?;
        let (mut grad, transfer) = sum_on_host(&[(&*k0, view)])?;
        communication += transfer;
        for k in (0..self.segments[0].len()).rev() {
            let writes = Instant::now();
            for (d, chain) in self.segments.iter().enumerate() {
                chain[k].set_output_gradient(&grad).map_err(|e| on_device(d, &chain[k].kernels, e))?;
            }
            communication += writes.elapsed();
            for (d, chain) in self.segments.iter_mut().enumerate() {
                let kernels = chain[k].kernels.clone();
                chain[k].backward(true).map_err(|e| on_device(d, &kernels, e))?;
            }
            if k > 0 {
                // The backward all-reduce: the devices' input gradients summed.
                let views: Vec<(&Kernels, View<'_>)> = self
                    .segments
                    .iter()
                    .enumerate()
                    .map(|(d, chain)| match chain[k].input_gradient_view() {
                        Some(v) => Ok((&*chain[k].kernels, v.map_err(|e| on_device(d, &chain[k].kernels, e))?)),
                        None => Err(invalid(format!("segment {k} yields no input gradient"))),
                    })
                    .collect::<Result<_>>()?;
                let (sum, transfer) = sum_on_host(&views)?;
                grad = sum;
                communication += transfer;
            }
        }
        // Compute ends when every device is idle; what follows (reading,
        // summing and writing back the replicated parameters' gradients,
        // the norms) is counted as communication.
        for (d, chain) in self.segments.iter().enumerate() {
            chain[0].kernels.device().wait_idle("GptTensorParallel::step").map_err(|e| on_device(d, &chain[0].kernels, e))?;
        }
        let reduce = Instant::now();
        let mut stages: Vec<&mut Stage> = self.segments.iter_mut().flatten().collect();
        stages.push(&mut self.head);
        self.last_grad_norm = reduce_and_step(&mut stages, &self.stage_devices, &self.shared)?;
        communication += reduce.elapsed();
        let loss = if read_loss {
            let l = self.head.loss_value().map_err(|e| on_device(0, &k0, e))?;
            if !l.is_finite() {
                return Err(Error::NonFiniteLoss { value: l, step: self.stats.steps + 1 });
            }
            Some(l)
        } else {
            None
        };
        self.stats.steps += 1;
        self.stats.communication += communication;
        self.stats.wall += wall.elapsed();
        Ok(loss)
    }

    /// The mean loss of one batch without training on it (forward only).
    pub fn evaluate_loss(&mut self, ids: &[u32], targets: &[u32]) -> Result<f32> {
        self.check_batch("GptTensorParallel::evaluate_loss", ids, targets)?;
        self.forward(ids)?;
        let k0 = self.head.kernels.clone();
        self.head.evaluate_loss(Targets::Classes(targets)).map_err(|e| on_device(0, &k0, e))
    }

    /// The flat stage index holding device `d`'s share of `p`, if any.
    fn stage_of(&self, p: &Placement, d: usize) -> Option<usize> {
        let n_seg = self.segments.first().map_or(0, Vec::len);
        match p.segment {
            Some(k) => Some(d * n_seg + k),
            None => (d == 0).then_some(self.segments.len() * n_seg),
        }
    }

    /// Every parameter of the single-device model, in its order, from the
    /// devices' shares that `lookup(stage, name)` finds.
    fn gather<'a>(&self, lookup: impl Fn(usize, &str) -> Option<&'a Vec<f32>>) -> Result<NamedValues> {
        self.placements
            .iter()
            .map(|p| {
                let shares: Vec<Option<&Vec<f32>>> = (0..self.segments.len()).map(|d| self.stage_of(p, d).and_then(|s| lookup(s, &p.name))).collect();
                let full = p.gather(&shares).ok_or_else(|| invalid(format!("the devices' shares of `{}` are missing or of the wrong size", p.name)))?;
                Ok((p.name.clone(), p.shape.clone(), full))
            })
            .collect()
    }

    /// The whole model's parameters with the single-device [`Gpt`]'s names,
    /// shapes and order (shares gathered, `wte` once).
    pub fn parameters(&self) -> Result<NamedValues> {
        let per_stage: Vec<HashMap<String, Vec<f32>>> = self
            .stages()
            .map(|(d, s)| s.executor().parameters().map(|all| all.into_iter().map(|(n, _, v)| (n, v)).collect()).map_err(|e| on_device(d, &s.kernels, e)))
            .collect::<Result<_>>()?;
        self.gather(|s, name| per_stage.get(s).and_then(|m| m.get(name)))
    }

    /// The trained model as a single-device [`Gpt`] (every block with
    /// attention, as [`Gpt::from_parameters`] builds it).
    pub fn trained_model(&self) -> Result<Gpt> {
        let mut values: HashMap<String, Vec<f32>> = self.parameters()?.into_iter().map(|(n, _, v)| (n, v)).collect();
        Gpt::from_parameters(self.config, |name, shape| values.remove(name).ok_or_else(|| invalid(format!("no parameter `{name}` {shape:?}"))))
    }

    /// The optimizer's state under the single-device model's names and
    /// shapes, with the step count: what `Trainer::checkpoint` gives
    /// through [`OptimizerState::from_checkpoint`], so a run resumes on any
    /// number of devices.
    pub fn optimizer_state(&self) -> Result<OptimizerState> {
        let names = self.head.executor().optimizer_state_names();
        let per_stage: Vec<HashMap<(String, &'static str), Vec<f32>>> = self
            .stages()
            .map(|(d, s)| {
                s.executor().optimizer_state().map(|all| all.into_iter().map(|(p, n, v)| ((p, n), v)).collect()).map_err(|e| on_device(d, &s.kernels, e))
            })
            .collect::<Result<_>>()?;
        let mut state = Vec::new();
        for &state_name in names {
            for (name, _, values) in self.gather(|s, name| per_stage.get(s).and_then(|m| m.get(&(name.to_string(), state_name))))? {
                state.push((name, state_name.to_string(), values));
            }
        }
        Ok(OptimizerState { optimizer: optim::describe(&self.optimizer), step: self.step_count(), state, metadata: Default::default() })
    }

    /// Resumes from [`GptTensorParallel::optimizer_state`] (or a single
    /// device's): every parameter's moments split as its weights are, and
    /// the step count. Build `self` from the model saved with the state.
    /// Checks every name and size before anything on a device changes.
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let names = self.head.executor().optimizer_state_names();
        for (param, state_name, _) in &state.state {
            if !names.contains(&state_name.as_str()) {
                return Err(invalid(format!("this optimizer ({}) has no state `{state_name}`; the state is from `{}`", optim::describe(&self.optimizer), state.optimizer)));
            }
            if !self.placements.iter().any(|p| &p.name == param) {
                return Err(invalid(format!("optimizer state for unknown parameter `{param}`")));
            }
        }
        let by_key: HashMap<(&str, &str), &Vec<f32>> = state.state.iter().map(|(p, s, v)| ((p.as_str(), s.as_str()), v)).collect();
        let devices = self.segments.len();
        let head_index = self.stage_devices.len() - 1;
        let mut per_stage: Vec<Vec<(String, String, Vec<f32>)>> = vec![Vec::new(); self.stage_devices.len()];
        for p in &self.placements {
            for &state_name in names {
                let full = by_key.get(&(p.name.as_str(), state_name)).ok_or_else(|| invalid(format!("the optimizer state has no `{state_name}` for `{}`", p.name)))?;
                let shares = p.scatter(full, devices)?;
                for (d, share) in shares.iter().enumerate() {
                    if let (Some(s), Some(share)) = (self.stage_of(p, d), share) {
                        per_stage[s].push((p.name.clone(), state_name.to_string(), share.clone()));
                    }
                }
                if p.in_head {
                    if let Some(Some(share)) = shares.first() {
                        per_stage[head_index].push((p.name.clone(), state_name.to_string(), share.clone()));
                    }
                }
            }
        }
        let mut stages: Vec<&mut Stage> = self.segments.iter_mut().flatten().collect();
        stages.push(&mut self.head);
        for ((stage, list), &d) in stages.into_iter().zip(&per_stage).zip(&self.stage_devices) {
            let kernels = stage.kernels.clone();
            stage.executor_mut().load_state(&[], list, Some(state.step)).map_err(|e| on_device(d, &kernels, e))?;
        }
        Ok(())
    }

    /// Values moved between the host and the devices in one step: per
    /// segment boundary an all-reduce of B·T·C each way (4 per block: 2
    /// forward, 2 backward), plus the replicated parameters' gradients
    /// read from and written back to every copy.
    pub fn floats_moved_per_step(&self) -> usize {
        let devices = self.segments.len();
        let n_seg = self.segments.first().map_or(0, Vec::len);
        let activation = self.batch * self.config.block_size * self.config.n_embd;
        // Forward: every segment's outputs read, the sum written to the next
        // segments (or the head). Backward: the head's gradient read and
        // written to every last segment; each other boundary read and written.
        let forward = n_seg * devices * activation + n_seg.saturating_sub(1) * devices * activation + activation;
        let backward = activation + n_seg * devices * activation + n_seg.saturating_sub(1) * devices * activation;
        let replicated: usize = self
            .shared
            .iter()
            .map(|s| 2 * s.holders.len() * self.placements.iter().find(|p| p.name == s.name).map_or(0, |p| p.shape.iter().product::<usize>()))
            .sum();
        forward + backward + replicated
    }

    /// One line: how the model is split.
    pub fn describe(&self) -> String {
        let devices: Vec<String> =
            self.labels.iter().enumerate().map(|(d, label)| format!("{label}: {} heads, {} hidden units", self.head_split[d], self.hidden_split[d])).collect();
        format!(
            "tensor parallel GPT over {} devices ({} heads and {} MLP hidden units per block split; embeddings and norms replicated, head on #0): {}",
            self.segments.len(),
            self.config.n_head,
            4 * self.config.n_embd,
            devices.join(", ")
        )
    }

    /// [`GptTensorParallel::describe`] with what the steps so far cost.
    pub fn report(&self) -> String {
        let s = &self.stats;
        let ms = 1e3 * s.wall.as_secs_f64() / s.steps.max(1) as f64;
        let share = 100.0 * s.communication.as_secs_f64() / s.wall.as_secs_f64().max(1e-9);
        let mb = self.floats_moved_per_step() as f64 * 4.0 / 1e6;
        format!("{}; {} steps, {ms:.1} ms/step, communication {share:.0}% of step time ({mb:.1} MB through the host per step)", self.describe(), s.steps)
    }
}
