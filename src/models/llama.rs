//! Llama as transformers' `LlamaForCausalLM` writes it, with its parameter
//! names, so a Hugging Face folder needs no name map: token embedding
//! (`model.embed_tokens`), pre-norm decoder layers (`model.layers.N.…`:
//! RMSNorm, grouped-query attention with rotary positions, RMSNorm, SwiGLU
//! MLP), a final RMSNorm (`model.norm`), and a head that is either the
//! token embedding (tied) or its own `lm_head`. SmolLM2, TinyLlama, Llama
//! 2/3 are sizes of it; Qwen2/Qwen2.5 and Qwen3 are variants
//! ([`LlamaVariant`], [`crate::models::qwen`]) whose attention adds
//! biases or q/k norms, and Mistral ([`crate::models::mistral`]) one whose
//! attention may slide over a window, with the same parameter names.

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{Activation, MatmulForm};
use crate::nn::parameter_tree::{child_prefix, item_prefix, parameter_tree};
use crate::nn::{
    shard, AttentionKernel, AttentionOptions, CausalLm, Embedding, GroupedQueryAttention, Linear, LmConfig, LmSizes,
    Module, ParameterTree, RmsNorm, RopeLayout, Rotary, StageCosts, Staged, SwiGluMlp,
};

/// transformers' LlamaConfig `initializer_range`: every matrix starts N(0, 0.02²).
pub const INITIALIZER_RANGE: f32 = 0.02;

/// The level transformers' LlamaForCausalLM keeps its body under
/// (`LlamaModel`), which this flatter struct names for its body's fields.
const MODEL: &str = "model.";

/// Which decoder of the Llama family a [`LlamaConfig`] describes: one
/// layer structure and one set of parameter names, the attention differing
/// ([`AttentionOptions`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlamaVariant {
    /// transformers' LlamaForCausalLM (SmolLM2, TinyLlama, Llama 2/3).
    #[default]
    Llama,
    /// Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on q, k and v.
    Qwen2,
    /// Qwen3ForCausalLM: an RMSNorm over each q and k head before the
    /// rotation, no biases.
    Qwen3,
    /// MistralForCausalLM: Llama's layers, attending over
    /// [`LlamaConfig::sliding_window`] positions when it is set.
    Mistral,
}

impl LlamaVariant {
    /// transformers' class and `model_type` (`LlamaForCausalLM`, `llama`),
    /// and the name `describe` and the CLI use.
    pub fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            LlamaVariant::Llama => ("LlamaForCausalLM", "llama", "Llama"),
            LlamaVariant::Qwen2 => ("Qwen2ForCausalLM", "qwen2", "Qwen2"),
            LlamaVariant::Qwen3 => ("Qwen3ForCausalLM", "qwen3", "Qwen3"),
            LlamaVariant::Mistral => ("MistralForCausalLM", "mistral", "Mistral"),
        }
    }
}

/// The sizes and constants of a [`Llama`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    /// The longest sequence (`max_position_embeddings`).
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads (`num_key_value_heads`), a divisor of n_head.
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub intermediate_size: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// How q/k channels pair up for the rotation: Hugging Face checkpoints
    /// are [`RopeLayout::HalfSplit`], Meta's and GGUF's interleaved.
    pub rope_layout: RopeLayout,
    /// Channels per head when not n_embd / n_head (transformers'
    /// `head_dim`, Qwen3's 128 over 1024 channels of 16 heads).
    pub head_dim: Option<usize>,
    /// Every layer attends to the last this-many positions only (key j of
    /// query i when i - j < window; Mistral 7B v0.1's 4096); None: all.
    pub sliding_window: Option<usize>,
    pub variant: LlamaVariant,
}

impl LlamaConfig {
    /// HuggingFaceTB/SmolLM2-135M: 30 layers of 576 channels, 9 heads
    /// sharing 3 KV heads, MLP 1536, vocabulary 49152, tied head.
    pub const fn smollm2_135m() -> Self {
        LlamaConfig {
            vocab_size: 49152,
            block_size: 8192,
            n_layer: 30,
            n_head: 9,
            n_kv_head: 3,
            n_embd: 576,
            intermediate_size: 1536,
            rope_theta: 100000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            rope_layout: RopeLayout::HalfSplit,
            head_dim: None,
            sliding_window: None,
            variant: LlamaVariant::Llama,
        }
    }

    /// A small Llama for a character-level corpus of `vocab_size` symbols
    /// (the shipped Shakespeare trains it on a software adapter in
    /// seconds): 4 layers × 128 channels, 4 heads over 2 KV heads, MLP 384,
    /// 64 positions, untied head.
    pub const fn small(vocab_size: usize) -> Self {
        LlamaConfig {
            vocab_size,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            n_kv_head: 2,
            n_embd: 128,
            intermediate_size: 384,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            rope_layout: RopeLayout::HalfSplit,
            head_dim: None,
            sliding_window: None,
            variant: LlamaVariant::Llama,
        }
    }

    /// Context of the `smollm2-135m` training preset: SmolLM2 was
    /// pretrained on 2048-token sequences (its 8192 came from a later
    /// long-context stage), and a step's activations grow with it.
    pub const SMOLLM2_TRAINING_CONTEXT: usize = 2048;

    /// meta-llama/Llama-3.2-1B's shapes: 16 layers of 2048 channels, 32
    /// heads of 64 over 8 KV heads, MLP 8192, vocabulary 128,256, tied
    /// head, RoPE base 500,000, context 131,072 — 1,235,814,400
    /// parameters, as transformers counts them. Its `rope_scaling` (llama3's
    /// rule stretching the low frequencies past 8,192 positions) is not
    /// modelled: at the 2,048 positions of the preset it changes the
    /// frequencies a pretrained file would rotate with, so this sizes and
    /// plans runs (and trains from scratch); it does not load the file.
    pub const fn llama3_2_1b() -> Self {
        LlamaConfig {
            vocab_size: 128256,
            block_size: 131072,
            n_layer: 16,
            n_head: 32,
            n_kv_head: 8,
            n_embd: 2048,
            intermediate_size: 8192,
            rope_theta: 500000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            rope_layout: RopeLayout::HalfSplit,
            head_dim: None,
            sliding_window: None,
            variant: LlamaVariant::Llama,
        }
    }

    /// Context of the 1B and larger training presets: a step's activations
    /// grow with it, and 2048 positions is where pretraining starts.
    pub const LARGE_TRAINING_CONTEXT: usize = 2048;

    /// A preset by name: `smollm2-135m` (SmolLM2-135M's architecture,
    /// trained on [`LlamaConfig::SMOLLM2_TRAINING_CONTEXT`] tokens),
    /// `llama3.2-1b` ([`LlamaConfig::llama3_2_1b`]'s shapes on
    /// [`LlamaConfig::LARGE_TRAINING_CONTEXT`] tokens), or `small` (whose
    /// vocabulary `vocab_size` gives: the data's).
    pub fn preset(name: &str, vocab_size: usize) -> Result<Self> {
        match name {
            "smollm2-135m" => Ok(LlamaConfig {
                block_size: Self::SMOLLM2_TRAINING_CONTEXT,
                ..Self::smollm2_135m()
            }),
            "llama3.2-1b" => Ok(LlamaConfig {
                block_size: Self::LARGE_TRAINING_CONTEXT,
                ..Self::llama3_2_1b()
            }),
            "small" => Ok(Self::small(vocab_size)),
            other => Err(Error::InvalidArgument {
                op: "LlamaConfig::preset",
                reason: format!("unknown preset `{other}`; known: smollm2-135m, llama3.2-1b, small"),
            }),
        }
    }

    /// Channels per head: `head_dim`, else n_embd / n_head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.n_embd / self.n_head.max(1))
    }

    /// What the variant adds to Llama's attention.
    pub fn attention_options(&self) -> AttentionOptions {
        AttentionOptions {
            head_dim: self.head_dim(),
            qkv_bias: self.variant == LlamaVariant::Qwen2,
            qk_norm_eps: (self.variant == LlamaVariant::Qwen3).then_some(self.rms_norm_eps),
            sliding_window: self.sliding_window,
            scale: None,
        }
    }

    /// The rotation every attention layer applies.
    pub fn rotary(&self) -> Rotary {
        Rotary {
            base: self.rope_theta,
            rotary_dim: self.head_dim(),
            layout: self.rope_layout,
            positions: self.block_size,
        }
    }

    /// Parameters of a model of this size; `None` when the count overflows
    /// (sizes read from a file may be absurd). 134,515,008 for SmolLM2-135M.
    pub fn num_parameters(&self) -> Option<usize> {
        let (c, f, options) = (self.n_embd, self.intermediate_size, self.attention_options());
        let kv = self.n_kv_head.checked_mul(options.head_dim)?;
        let q = self.n_head.checked_mul(options.head_dim)?;
        let mut attention = c
            .checked_mul(q)?
            .checked_mul(2)?
            .checked_add(c.checked_mul(kv)?.checked_mul(2)?)?;
        if options.qkv_bias {
            attention = attention.checked_add(q)?.checked_add(kv.checked_mul(2)?)?;
        }
        if options.qk_norm_eps.is_some() {
            attention = attention.checked_add(options.head_dim.checked_mul(2)?)?;
        }
        let layer = attention
            .checked_add(c.checked_mul(f)?.checked_mul(3)?)?
            .checked_add(2 * c)?;
        let table = self.vocab_size.checked_mul(c)?;
        let head = if self.tie_word_embeddings { 0 } else { table };
        layer
            .checked_mul(self.n_layer)?
            .checked_add(table)?
            .checked_add(head)?
            .checked_add(c)
    }

    /// Multiply-adds per position of the embedding lookup, each of `blocks`
    /// decoder layers, and the final norm with the head and its loss
    /// ([`Staged::stage_costs`]).
    pub fn stage_costs(&self, blocks: usize) -> StageCosts {
        let (c, t, v, f) = (
            self.n_embd as f64,
            self.block_size as f64,
            self.vocab_size as f64,
            self.intermediate_size as f64,
        );
        let (q, kv) = (
            (self.n_head * self.head_dim()) as f64,
            (self.n_kv_head * self.head_dim()) as f64,
        );
        // q and o, k and v, the MLP's three matmuls, and the attention
        // scores and their weighted sum.
        let block = 2.0 * c * q + 2.0 * c * kv + 3.0 * c * f + 2.0 * t * q;
        StageCosts {
            prologue: c,
            blocks: vec![block; blocks],
            epilogue: v * c + 3.0 * v + 2.0 * c,
        }
    }

    /// Every size positive, heads dividing channels (unless `head_dim`
    /// is given), KV heads dividing heads, an even head width (pairs
    /// rotate), a base above 1 and a positive eps.
    pub fn check(&self) -> Result<()> {
        let sizes = [
            self.vocab_size,
            self.block_size,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.n_embd,
            self.intermediate_size,
            self.head_dim(),
            self.sliding_window.unwrap_or(1),
        ];
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "LlamaConfig",
                reason: format!("{reason}: {self:?}"),
            })
        };
        if sizes.contains(&0) {
            return bad("every size (and a sliding window) must be positive".into());
        }
        if (self.head_dim.is_none() && self.n_embd % self.n_head != 0) || self.n_head % self.n_kv_head != 0 {
            return bad(format!(
                "n_embd {} must be a multiple of n_head {}, and n_head of n_kv_head {}",
                self.n_embd, self.n_head, self.n_kv_head
            ));
        }
        if self.head_dim() % 2 != 0 {
            return bad(format!(
                "the head width {} must be even (rotary positions turn channel pairs)",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!(
                "rope_theta {} must be a finite number above 1",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps {} must be positive and finite",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }
}

/// One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x)).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaDecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: GroupedQueryAttention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: SwiGluMlp,
}

impl LlamaDecoderLayer {
    fn new(config: &LlamaConfig, std: f32) -> Result<Self> {
        let c = config.n_embd;
        Ok(LlamaDecoderLayer {
            input_layernorm: RmsNorm::new(c, config.rms_norm_eps),
            self_attn: GroupedQueryAttention::with_options(
                c,
                config.n_head,
                config.n_kv_head,
                config.attention_options(),
                config.rotary(),
                std,
            )?,
            post_attention_layernorm: RmsNorm::new(c, config.rms_norm_eps),
            mlp: SwiGluMlp::normal(c, config.intermediate_size, std),
        })
    }
}

impl Module for LlamaDecoderLayer {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let normed = self
            .input_layernorm
            .forward(g, x, &child_prefix!(prefix, self.input_layernorm))?;
        let attended = self
            .self_attn
            .forward(g, normed, &child_prefix!(prefix, self.self_attn))?;
        // Both branches end in a row-parallel Linear under tensor parallelism.
        let x = shard::reduce_residual(g, x, attended)?;
        let normed =
            self.post_attention_layernorm
                .forward(g, x, &child_prefix!(prefix, self.post_attention_layernorm))?;
        let transformed = self.mlp.forward(g, normed, &child_prefix!(prefix, self.mlp))?;
        shard::reduce_residual(g, x, transformed)
    }

    fn describe(&self) -> String {
        format!(
            "LlamaDecoderLayer({}, {})",
            self.self_attn.describe(),
            self.mlp.describe()
        )
    }
}

parameter_tree!(LlamaDecoderLayer {
    input_layernorm,
    self_attn,
    post_attention_layernorm,
    mlp
});

/// A Llama over u32 token ids [batch, T ≤ block_size], returning logits
/// [batch, T, vocab_size].
#[derive(Clone, Debug, PartialEq)]
pub struct Llama {
    pub config: LlamaConfig,
    pub embed_tokens: Embedding,
    pub layers: Vec<LlamaDecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when the head is the token embedding (tie_word_embeddings).
    pub lm_head: Option<Linear>,
}

impl Llama {
    /// transformers' LlamaPreTrainedModel init: embeddings and every
    /// projection N(0, 0.02²), norms one; draws from [`crate::nn::manual_seed`]'s generator.
    pub fn new(config: LlamaConfig) -> Result<Self> {
        config.check()?;
        let embed_tokens = Embedding::normal(config.vocab_size, config.n_embd, INITIALIZER_RANGE);
        let layers = (0..config.n_layer)
            .map(|_| LlamaDecoderLayer::new(&config, INITIALIZER_RANGE))
            .collect::<Result<_>>()?;
        let lm_head = (!config.tie_word_embeddings)
            .then(|| Linear::normal_no_bias(config.n_embd, config.vocab_size, INITIALIZER_RANGE));
        Ok(Llama {
            config,
            embed_tokens,
            layers,
            norm: RmsNorm::new(config.n_embd, config.rms_norm_eps),
            lm_head,
        })
    }

    /// A model of `config` whose parameters come from `take(name, shape)`,
    /// called once per parameter in [`Module::named_parameters`] order
    /// (Hugging Face's names); it returns exactly `shape`'s element count
    /// of values, or the error to report. Draws nothing from the init
    /// generator.
    pub fn from_parameters(
        config: LlamaConfig,
        mut take: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let mut model = Self::empty(config)?;
        model.fill("Llama::from_parameters", &mut take)?;
        Ok(model)
    }

    /// Every layer's attention computed as `kernel` says (fused by
    /// default; unfused is the reference).
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        for layer in &mut self.layers {
            layer.self_attn.attention = kernel;
        }
    }

    /// The model's structure with no values (every matrix empty, norms
    /// ones): its tree names and shapes every parameter without
    /// allocating, and [`Llama::from_parameters`] fills it.
    pub fn empty(config: LlamaConfig) -> Result<Self> {
        config.check()?;
        let (c, f) = (config.n_embd, config.intermediate_size);
        let norm = || RmsNorm::new(c, config.rms_norm_eps);
        let layers = (0..config.n_layer)
            .map(|_| {
                Ok(LlamaDecoderLayer {
                    input_layernorm: norm(),
                    self_attn: GroupedQueryAttention::empty(
                        c,
                        config.n_head,
                        config.n_kv_head,
                        config.attention_options(),
                        config.rotary(),
                    )?,
                    post_attention_layernorm: norm(),
                    mlp: SwiGluMlp::empty(c, f, Activation::Silu),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Llama {
            config,
            embed_tokens: Embedding::empty(config.vocab_size, c),
            layers,
            norm: norm(),
            lm_head: (!config.tie_word_embeddings).then(|| Linear::empty(c, config.vocab_size, false)),
        })
    }
}

impl Module for Llama {
    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        g.ids("idx", &[batch, self.config.block_size])
    }

    /// `idx`: u32 [batch, T] with T ≤ block_size. A whole model: its
    /// parameters are named from the root, so `prefix` must be empty.
    fn forward(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_root(prefix)?;
        self.forward_units(g, idx, 0..self.layers.len(), true, true)
    }

    fn describe(&self) -> String {
        let c = &self.config;
        // Llama's line as before (checkpoints store it); a variant's names
        // itself and its head width.
        let head_dim = match (c.variant, c.head_dim) {
            (LlamaVariant::Llama, None) => String::new(),
            _ => format!(", head_dim={}", c.head_dim()),
        };
        format!(
            "{}(vocab_size={}, block_size={}, n_layer={}, n_head={}, n_kv_head={}, n_embd={}, intermediate_size={}, rope_theta={}, rms_norm_eps={}, tied={}, rope={:?}{head_dim})",
            c.variant.names().2,
            c.vocab_size,
            c.block_size,
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.n_embd,
            c.intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
            c.tie_word_embeddings,
            c.rope_layout
        )
    }

    /// q_proj and k_proj of every layer when q and k rotate interleaved
    /// pairs (a GGUF file's row order; Hugging Face's is half-split).
    fn permuted_rows(&self) -> Vec<(String, usize)> {
        if self.config.rope_layout != RopeLayout::Interleaved {
            return Vec::new();
        }
        let c = &self.config;
        (0..self.layers.len())
            .flat_map(|i| {
                [
                    (format!("model.layers.{i}.self_attn.q_proj"), c.n_head),
                    (format!("model.layers.{i}.self_attn.k_proj"), c.n_kv_head),
                ]
            })
            .collect()
    }
}

parameter_tree!(Llama { [MODEL] embed_tokens, [MODEL] layers, [MODEL] norm, lm_head });

/// The token embedding, the decoder layers `model.layers.{i}`, and the
/// final norm with the head (which, tied, declares
/// `model.embed_tokens.weight` again: the pipeline finds the copy).
impl Staged for Llama {
    /// `idx`: u32 [batch, T ≤ block_size] to x [batch, T, C].
    fn prologue(&self, g: &mut Graph, idx: Tensor) -> Result<Tensor> {
        let shape = g.shape_of(idx).map(<[usize]>::to_vec).unwrap_or_default();
        if !matches!(shape[..], [_, t] if t <= self.config.block_size) {
            return Err(Error::shape(
                "Llama",
                format!("expects ids [batch, T ≤ {}]", self.config.block_size),
                &[&shape],
            ));
        }
        let table = self.token_table(g)?;
        g.embedding(table, idx)
    }

    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor> {
        let layer = self.layers.get(index).ok_or_else(|| Error::InvalidArgument {
            op: "Llama::block",
            reason: format!("layer {index} of {}", self.layers.len()),
        })?;
        layer.forward(g, x, &item_prefix(&child_prefix!("", MODEL, self.layers), index))
    }

    /// Logits [.., vocab_size] of x [.., C]: the final norm, then
    /// `lm_head` or, tied, the token table.
    fn epilogue(&self, g: &mut Graph, x: Tensor) -> Result<Tensor> {
        self.head(g, None, x)
    }

    fn stage_costs(&self) -> StageCosts {
        self.config.stage_costs(self.layers.len())
    }
}

impl Llama {
    /// The token table `model.embed_tokens.weight`; tied, it is the head's
    /// weight too (in f16 under an f16 forward context). Declared by the
    /// prologue and, tied, again by the epilogue: one tensor in one graph.
    fn token_table(&self, g: &mut Graph) -> Result<Tensor> {
        let name = child_prefix!("", MODEL, self.embed_tokens);
        if self.lm_head.is_some() {
            self.embed_tokens.table(g, &name)
        } else {
            self.embed_tokens.tied_table(g, &name)
        }
    }

    /// The final norm, then `lm_head` or, tied, the token table
    /// transposed (`table` when the caller holds it, else declared again).
    fn head(&self, g: &mut Graph, table: Option<Tensor>, x: Tensor) -> Result<Tensor> {
        let x = self.norm.forward(g, x, &child_prefix!("", MODEL, self.norm))?;
        match (&self.lm_head, table) {
            (Some(head), _) => head.forward(g, x, &child_prefix!("", self.lm_head)),
            (None, Some(table)) => g.rows_matmul(MatmulForm::ABt, x, table),
            (None, None) => {
                let table = self.token_table(g)?;
                g.rows_matmul(MatmulForm::ABt, x, table)
            }
        }
    }

    /// A whole model names its parameters from the root.
    fn check_root(prefix: &str) -> Result<()> {
        if !prefix.is_empty() {
            return Err(Error::InvalidArgument {
                op: "Llama",
                reason: format!("a whole model names its parameters from the root, not under `{prefix}`"),
            });
        }
        Ok(())
    }
}

impl CausalLm for Llama {
    fn lm_sizes(&self) -> LmSizes {
        self.config.lm_sizes()
    }

    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<(Tensor, Tensor)> {
        Self::check_root(prefix)?;
        let x = self.forward_units(g, idx, 0..self.layers.len(), true, false)?;
        Ok((x, self.token_table(g)?))
    }

    fn logits(&self, g: &mut Graph, table: Tensor, x: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_root(prefix)?;
        self.head(g, Some(table), x)
    }
}

impl LmConfig for LlamaConfig {
    /// In f16: every projection (q, k, v, o, gate, up, down) and the head
    /// (lm_head, or the token table when tied). Saturates where the sizes
    /// (read from a file) overflow, which no adapter holds.
    fn lm_sizes(&self) -> LmSizes {
        let (c, f, v) = (
            self.n_embd as u64,
            self.intermediate_size as u64,
            self.vocab_size as u64,
        );
        let (q, kv) = (
            self.n_head as u64 * self.head_dim() as u64,
            self.n_kv_head as u64 * self.head_dim() as u64,
        );
        let layer = (2 * c * q + 2 * c * kv + 3 * c * f).saturating_mul(self.n_layer as u64);
        LmSizes {
            parameters: self.num_parameters().map_or(u64::MAX, |n| n as u64),
            f16_weight_values: layer.saturating_add(v * c),
            cached_layers: self.n_layer as u64,
            cache_width: kv,
            context: self.block_size,
            vocab_size: self.vocab_size,
            head_dim: self.head_dim(),
        }
    }
}
