//! Modules and losses with PyTorch's names, built from graph ops so users
//! never touch buffers. A [`Module`] declares its parameters under a
//! hierarchical prefix (`h.0.attn.c_attn.weight`, as a `state_dict` names
//! them) and adds its forward to a [`Graph`]. Initial weights follow
//! PyTorch's defaults and come from a seeded generator ([`manual_seed`]).

mod causal_lm;
mod grouped_attention;
mod layers;
mod lora;
mod multi_lora;
pub(crate) mod parameter_tree;
mod rms_norm;
mod rotary;
pub mod shard;
mod staged;
mod swiglu;
mod training_graph;
mod transformer;

pub(crate) use causal_lm::cache_pass;
pub use causal_lm::{
    CachePass, CausalLm, ForwardContext, LmConfig, LmSizes, QuantizedMatrix, QuantizedWeights, WeightDtype,
};
pub use grouped_attention::{AttentionOptions, GroupedQueryAttention};
pub use layers::{Embedding, LayerNorm};
pub use lora::{linear_sites, BaseStorage, LinearSite, Lora, LoraAdapter, LoraConfig, ALL_LINEAR};
pub use multi_lora::{MultiLora, NamedAdapter};
pub use parameter_tree::ParameterTree;
pub use rms_norm::RmsNorm;
pub use rotary::{RopeLayout, Rotary};
pub use shard::TensorSplit;
pub use staged::{StageCosts, Staged};
pub use swiglu::SwiGluMlp;
pub(crate) use training_graph::{build_model, training_graph_with_passes, Built, TrainingGraph};
pub use transformer::{
    causal_attention, causal_attention_window, AttentionKernel, Block, CausalSelfAttention, Mlp,
    CPU_FUSED_ATTENTION_MIN_SEQ,
};

use std::cell::RefCell;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{Activation, MatmulForm};
use parameter_tree::parameter_tree;

thread_local! {
    static INIT_RNG: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::seed_from_u64(0));
}

/// Seeds the generator that layer constructors draw their initial weights
/// from (per thread), like `torch.manual_seed`.
pub fn manual_seed(seed: u64) {
    INIT_RNG.with(|r| *r.borrow_mut() = ChaCha8Rng::seed_from_u64(seed));
}

fn uniform(n: usize, bound: f32) -> Vec<f32> {
    INIT_RNG.with(|r| {
        let mut rng = r.borrow_mut();
        (0..n).map(|_| rng.random_range(-bound..=bound)).collect()
    })
}

/// N(0, std²) samples (Box–Muller), like torch.nn.init.normal_.
fn normal(n: usize, std: f32) -> Vec<f32> {
    INIT_RNG.with(|r| {
        let mut rng = r.borrow_mut();
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            let radius = (-2.0 * u1.ln()).sqrt();
            let angle = std::f64::consts::TAU * u2;
            out.push((radius * angle.cos()) as f32 * std);
            out.push((radius * angle.sin()) as f32 * std);
        }
        out.truncate(n);
        out
    })
}

/// A building block of a model, as torch.nn.Module: it adds its forward on
/// `x` to a graph and declares its parameters there, named `{prefix}{name}`
/// (a submodule's prefix extends its parent's: `h.0.` + `attn.`). The names
/// are its [`ParameterTree`]'s, declared once; the listings below derive
/// from that walk.
pub trait Module: ParameterTree {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor>;

    /// (name, shape) of every parameter, relative to this module, in the
    /// order `forward` declares them.
    fn named_parameters(&self) -> Vec<(String, Vec<usize>)> {
        let mut all = Vec::new();
        self.visit("", &mut |name, shape, _| all.push((name, shape)));
        all
    }

    /// (name, shape, values) of every parameter, in the same order; shapes
    /// as `forward` declares them (Linear weights [out, in]).
    fn parameter_values(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut all = Vec::new();
        self.visit("", &mut |name, shape, values| all.push((name, shape, values)));
        all
    }

    /// One line naming the module and its sizes; checkpoints store it and
    /// loading compares it.
    fn describe(&self) -> String;

    /// Linears whose output rows this model holds in another order than
    /// Hugging Face's, by module name, with the heads the rows permute over
    /// (a GGUF Llama's q and k, whose rows llama.cpp's converter interleaves
    /// for its rotary pairs). A PEFT adapter's B rows for them move alike
    /// when it is loaded or saved (`io::peft`); none by default.
    fn permuted_rows(&self) -> Vec<(String, usize)> {
        Vec::new()
    }

    /// What Hugging Face's model class puts before this model's module
    /// names (`transformer.` before a GPT-2's blocks), which the names in a
    /// PEFT adapter carry (`io::peft` adds and strips it); none by default.
    fn hf_module_prefix(&self) -> &'static str {
        ""
    }

    /// Declares the input a whole model reads for `batch` examples: f32
    /// features for an MLP, u32 token ids ([`Graph::ids`]) for a language
    /// model. Trainer and Predictor call it; parts of a model need not.
    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        let _ = (g, batch);
        Err(Error::InvalidArgument {
            op: "Module::input",
            reason: format!(
                "`{}` does not declare its input: it is not a whole model",
                self.describe()
            ),
        })
    }

    /// Parameter count.
    fn num_parameters(&self) -> usize {
        self.named_parameters()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// y = x·Wᵀ + b with W [out_features, in_features], as torch.nn.Linear;
/// `bias: None` is `Linear(.., bias=False)` (Llama's projections).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    pub in_features: usize,
    pub out_features: usize,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// PyTorch's default init: kaiming_uniform(a=√5) for the weight and
    /// U(-1/√in, 1/√in) for the bias — both U(-1/√in, 1/√in).
    pub fn new(in_features: usize, out_features: usize) -> Self {
        let bound = 1.0 / (in_features.max(1) as f32).sqrt();
        let weight = uniform(in_features * out_features, bound);
        let bias = Some(uniform(out_features, bound));
        Linear {
            in_features,
            out_features,
            weight,
            bias,
        }
    }

    /// The structure with no values (empty weight and bias), for a model's
    /// `from_parameters` to fill: the tree reports names and shapes without
    /// allocating.
    pub fn empty(in_features: usize, out_features: usize, bias: bool) -> Self {
        Linear {
            in_features,
            out_features,
            weight: Vec::new(),
            bias: bias.then(Vec::new),
        }
    }

    /// GPT-2's init: weight N(0, std²), bias zero.
    pub fn normal(in_features: usize, out_features: usize, std: f32) -> Self {
        Linear {
            in_features,
            out_features,
            weight: normal(in_features * out_features, std),
            bias: Some(vec![0.0; out_features]),
        }
    }

    /// No bias, weight N(0, std²) (Llama's init, `initializer_range`).
    pub fn normal_no_bias(in_features: usize, out_features: usize, std: f32) -> Self {
        Linear {
            in_features,
            out_features,
            weight: normal(in_features * out_features, std),
            bias: None,
        }
    }
}

impl Module for Linear {
    /// Over the last dimension of x [.., in_features]; parameters are named
    /// `{prefix}weight` and (with a bias) `{prefix}bias`.
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let (w, b) = match self.declare_weights(g, prefix)?[..] {
            [w] => (w, None),
            [w, b] => (w, Some(b)),
            ref other => {
                return Err(Error::InvalidArgument {
                    op: "Linear",
                    reason: format!("declared {} parameters, not a weight and an optional bias", other.len()),
                })
            }
        };
        let shape = g.shape_of(x).map(<[usize]>::to_vec).unwrap_or_default();
        if shape.last() != Some(&self.in_features) {
            return Err(Error::shape(
                "Linear",
                format!("`{prefix}weight` reads {} input features", self.in_features),
                &[&shape],
            ));
        }
        if shape.len() <= 2 {
            let xw = g.rows_matmul(MatmulForm::ABt, x, w)?;
            let y = match b {
                Some(b) => g.bias_add(xw, b)?,
                None => xw,
            };
            return lora::adapt(g, x, y, prefix, self.in_features, self.out_features);
        }
        // Rows of a [.., in] tensor as a matrix, so the bias add follows
        // the matmul directly and the plan fuses it into the matmul's
        // epilogue.
        let rows = shape[..shape.len() - 1].iter().product();
        let flat = g.reshape(x, &[rows, self.in_features])?;
        let xw = g.matmul_form(MatmulForm::ABt, flat, w)?;
        let y = match b {
            Some(b) => g.bias_add(xw, b)?,
            None => xw,
        };
        let mut out_shape = shape;
        if let Some(last) = out_shape.last_mut() {
            *last = self.out_features;
        }
        let y = g.reshape(y, &out_shape)?;
        lora::adapt(g, x, y, prefix, self.in_features, self.out_features)
    }

    fn describe(&self) -> String {
        match self.bias {
            Some(_) => format!("Linear({}, {})", self.in_features, self.out_features),
            None => format!("Linear({}, {}, bias=False)", self.in_features, self.out_features),
        }
    }
}

parameter_tree!(Linear, |m| linear(m.in_features, m.out_features) parameters {
    weight: [m.out_features, m.in_features],
    bias: [m.out_features]
});

/// One element of a [`Sequential`].
#[derive(Clone, Debug, PartialEq)]
pub enum Layer {
    Linear(Linear),
    ReLU,
    /// tanh approximation, torch.nn.GELU(approximate="tanh")
    GELU,
    Tanh,
    Sigmoid,
}

impl Module for Layer {
    /// A Linear's parameters are named `{prefix}weight`, `{prefix}bias`.
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        match self {
            Layer::Linear(l) => l.forward(g, x, prefix),
            Layer::ReLU => g.activation(Activation::Relu, x),
            Layer::GELU => g.activation(Activation::Gelu, x),
            Layer::Tanh => g.activation(Activation::Tanh, x),
            Layer::Sigmoid => g.activation(Activation::Sigmoid, x),
        }
    }

    fn describe(&self) -> String {
        match self {
            Layer::Linear(l) => l.describe(),
            Layer::ReLU => "ReLU".into(),
            Layer::GELU => "GELU".into(),
            Layer::Tanh => "Tanh".into(),
            Layer::Sigmoid => "Sigmoid".into(),
        }
    }
}

/// A Linear's parameters under the layer's own prefix; activations have none.
impl ParameterTree for Layer {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        if let Layer::Linear(l) = self {
            l.visit(prefix, f);
        }
    }

    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool)) {
        if let Layer::Linear(l) = self {
            l.visit_linears(prefix, f);
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        match self {
            Layer::Linear(l) => l.visit_mut(prefix, f),
            _ => Ok(()),
        }
    }
}

/// torch.nn.Sequential: parameters are named by position, `0.weight`,
/// `0.bias`, `2.weight`, … as in a PyTorch state_dict.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Sequential {
    pub layers: Vec<Layer>,
}

impl Sequential {
    pub fn new(layers: Vec<Layer>) -> Self {
        Sequential { layers }
    }

    /// Linear layers of the given widths with `activation` between them
    /// (none after the last).
    pub fn mlp(widths: &[usize], activation: Layer) -> Result<Self> {
        if widths.len() < 2 || widths.contains(&0) {
            return Err(Error::InvalidArgument {
                op: "Sequential::mlp",
                reason: format!("needs at least two non-zero widths, got {widths:?}"),
            });
        }
        let mut layers = Vec::new();
        for (i, pair) in widths.windows(2).enumerate() {
            if i > 0 {
                layers.push(activation.clone());
            }
            layers.push(Layer::Linear(Linear::new(pair[0], pair[1])));
        }
        Ok(Sequential { layers })
    }

    /// e.g. `Linear(64, 128) ReLU Linear(128, 10)` ([`Module::describe`]).
    pub fn describe(&self) -> String {
        Module::describe(self)
    }

    /// Input width of the first Linear.
    pub fn in_features(&self) -> Option<usize> {
        self.layers.iter().find_map(|l| match l {
            Layer::Linear(l) => Some(l.in_features),
            _ => None,
        })
    }

    /// Output width of the last Linear.
    pub fn out_features(&self) -> Option<usize> {
        self.layers.iter().rev().find_map(|l| match l {
            Layer::Linear(l) => Some(l.out_features),
            _ => None,
        })
    }

    /// Each layer's tensor-parallel split: the Linears of every
    /// Linear–activation–Linear pair (counted from the first layer)
    /// column- then row-parallel.
    fn tensor_splits(&self) -> Vec<Option<TensorSplit>> {
        let mut splits = vec![None; self.layers.len()];
        let mut i = 0;
        while i + 2 < self.layers.len() {
            let pair = matches!(&self.layers[i..i + 3], [Layer::Linear(_), act, Layer::Linear(_)] if !matches!(act, Layer::Linear(_)));
            if pair {
                splits[i] = Some(TensorSplit::Column { groups: 1, unit: 1 });
                splits[i + 2] = Some(TensorSplit::Row { unit: 1 });
                i += 3;
            } else {
                i += 1;
            }
        }
        splits
    }

    /// Where pipeline blocks start: at each Linear (the activations after
    /// it go with it; any before the first Linear form the prologue).
    fn block_starts(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&i| matches!(self.layers[i], Layer::Linear(_)))
            .collect()
    }

    /// Layers `range` in order, each named by its position.
    fn run_layers(&self, g: &mut Graph, x: Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
        self.layers[range.clone()]
            .iter()
            .zip(range)
            .try_fold(x, |h, (layer, i)| layer.forward(g, h, &format!("{i}.")))
    }

    /// Parses [`Sequential::describe`]'s output (weights are placeholders,
    /// to be loaded from a checkpoint).
    pub fn from_description(text: &str) -> Result<Self> {
        let bad = |what: &str| Error::InvalidArgument {
            op: "Sequential::from_description",
            reason: format!("cannot parse `{what}` in `{text}`"),
        };
        let mut layers = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            if let Some(after) = rest.strip_prefix("Linear(") {
                let close = after.find(')').ok_or_else(|| bad(rest))?;
                let dims: Vec<usize> = after[..close]
                    .split(',')
                    .map(|d| d.trim().parse::<usize>().map_err(|_| bad(&after[..close])))
                    .collect::<Result<_>>()?;
                let [i, o] = dims[..] else {
                    return Err(bad(&after[..close]));
                };
                // Sizes come from a file: refuse absurd ones before allocating.
                if i == 0 || o == 0 || i.checked_mul(o).is_none_or(|n| n > 1 << 31) {
                    return Err(bad(&after[..close]));
                }
                layers.push(Layer::Linear(Linear {
                    in_features: i,
                    out_features: o,
                    weight: vec![0.0; i * o],
                    bias: Some(vec![0.0; o]),
                }));
                rest = after[close + 1..].trim_start();
            } else {
                let word_end = rest.find(' ').unwrap_or(rest.len());
                layers.push(match &rest[..word_end] {
                    "ReLU" => Layer::ReLU,
                    "GELU" => Layer::GELU,
                    "Tanh" => Layer::Tanh,
                    "Sigmoid" => Layer::Sigmoid,
                    other => return Err(bad(other)),
                });
                rest = rest[word_end..].trim_start();
            }
        }
        Ok(Sequential { layers })
    }
}

/// Layers by position, as PyTorch's Sequential (no `layers.` level).
impl ParameterTree for Sequential {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        self.layers.visit(prefix, f);
    }

    /// The last layer, when a Linear, is the output layer (the head).
    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool)) {
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            layer.visit_linears(&parameter_tree::item_prefix(prefix, i), &mut |site, head| {
                f(site, head || i == last)
            });
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        self.layers.visit_mut(prefix, f)
    }
}

impl Module for Sequential {
    /// Layer i's parameters are named `{prefix}{i}.weight`, `{prefix}{i}.bias`.
    /// Under tensor parallelism each Linear–activation–Linear pair splits
    /// as Megatron's MLP: the first Linear column-parallel, the second
    /// row-parallel, then an all-reduce; a Linear in no pair is whole.
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let splits = self.tensor_splits();
        let mut h = x;
        for (i, layer) in self.layers.iter().enumerate() {
            let name = parameter_tree::item_prefix(prefix, i);
            h = match (layer, splits[i]) {
                (Layer::Linear(l), Some(split @ TensorSplit::Row { .. })) => {
                    let partial = l.forward_split(g, h, &name, split)?;
                    shard::all_reduce(g, partial)?
                }
                (Layer::Linear(l), Some(split)) => l.forward_split(g, h, &name, split)?,
                _ => layer.forward(g, h, &name)?,
            };
        }
        Ok(h)
    }

    /// f32 features [batch, in_features of the first Linear].
    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        let width = self.in_features().ok_or_else(|| Error::InvalidArgument {
            op: "Sequential",
            reason: "the model has no Linear layer".into(),
        })?;
        g.input("input", &[batch, width])
    }

    /// e.g. `Linear(64, 128) ReLU Linear(128, 10)`; stored in checkpoints.
    fn describe(&self) -> String {
        self.layers.iter().map(Layer::describe).collect::<Vec<_>>().join(" ")
    }
}

/// Blocks are the Linears, each with the activations that follow it;
/// activations before the first Linear are the prologue, and the
/// epilogue is empty.
impl Staged for Sequential {
    fn prologue(&self, g: &mut Graph, input: Tensor) -> Result<Tensor> {
        let first = self.block_starts().first().copied().unwrap_or(self.layers.len());
        self.run_layers(g, input, 0..first)
    }

    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor> {
        let starts = self.block_starts();
        let start = *starts.get(index).ok_or_else(|| Error::InvalidArgument {
            op: "Sequential::block",
            reason: format!("block {index} of {}", starts.len()),
        })?;
        let end = starts.get(index + 1).copied().unwrap_or(self.layers.len());
        self.run_layers(g, x, start..end)
    }

    fn epilogue(&self, _g: &mut Graph, x: Tensor) -> Result<Tensor> {
        Ok(x)
    }

    /// A Linear's multiply-adds per example.
    fn stage_costs(&self) -> StageCosts {
        let blocks = self
            .layers
            .iter()
            .filter_map(|l| match l {
                Layer::Linear(l) => Some((l.in_features * l.out_features) as f64),
                _ => None,
            })
            .collect();
        StageCosts {
            prologue: 0.0,
            blocks,
            epilogue: 0.0,
        }
    }
}

/// torch.nn.MSELoss (mean reduction).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MSELoss;

/// torch.nn.CrossEntropyLoss over logits and class indices (mean reduction).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CrossEntropyLoss;

/// Either loss, for code that takes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Criterion {
    Mse,
    CrossEntropy,
}

impl Criterion {
    /// Declares the targets input this loss compares `output` with: f32
    /// values of the output's shape, or u32 classes of its leading shape.
    pub fn targets(&self, g: &mut Graph, output: Tensor) -> Result<Tensor> {
        let shape = g.shape_of(output).map(<[usize]>::to_vec).unwrap_or_default();
        match self {
            Criterion::Mse => g.input("target", &shape),
            Criterion::CrossEntropy => g.ids("target", &shape[..shape.len().saturating_sub(1)]),
        }
    }

    /// The scalar loss of `output` against `targets`.
    pub fn loss(&self, g: &mut Graph, output: Tensor, targets: Tensor) -> Result<Tensor> {
        match self {
            Criterion::Mse => g.mse_loss(output, targets),
            Criterion::CrossEntropy => g.cross_entropy_loss(output, targets),
        }
    }
}

impl From<MSELoss> for Criterion {
    fn from(_: MSELoss) -> Self {
        Criterion::Mse
    }
}

impl From<CrossEntropyLoss> for Criterion {
    fn from(_: CrossEntropyLoss) -> Self {
        Criterion::CrossEntropy
    }
}
