//! Gemma 3 (text) as transformers' `Gemma3ForCausalLM` writes it, with its
//! parameter names: a token embedding scaled by √hidden
//! (`model.embed_tokens`), decoder layers (`model.layers.N.…`) that norm
//! both before and after attention and MLP (`input_layernorm`,
//! `post_attention_layernorm`, `pre_feedforward_layernorm`,
//! `post_feedforward_layernorm`), grouped-query attention with q/k
//! RMSNorm, scores scaled by `query_pre_attn_scalar`^-½ and a rotary base
//! per layer (local layers `rope_local_base_freq`, global ones
//! `rope_theta`), a GELU-tanh gated MLP, a final norm (`model.norm`) and a
//! head tied to the token table.
//!
//! Every RMSNorm scales by 1 + weight ([`RmsNorm::unit_offset`]), with the
//! weight as Hugging Face stores it (zeros at init); llama.cpp's converter
//! stores 1 + weight in a GGUF file, which its reader undoes.
//!
//! Layer i attends over a sliding window of `sliding_window` positions
//! unless (i + 1) is a multiple of `sliding_window_pattern` (a global
//! layer): five of every six in the published models.
//!
//! Under tensor parallelism the post-norms need the whole branch, so each
//! branch is all-reduced beside the stream ([`shard::reduce_beside`]);
//! the attention splits over KV heads as Llama's does (the ranks must
//! divide them: Gemma 3 270M's single KV head runs on one device).

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::{Activation, MatmulForm};
use crate::nn::parameter_tree::{child_prefix, item_prefix, parameter_tree};
use crate::nn::{
    shard, AttentionKernel, AttentionOptions, CausalLm, Embedding, GroupedQueryAttention, LmConfig, LmSizes, Module,
    ParameterTree, RmsNorm, RopeLayout, Rotary, StageCosts, Staged, SwiGluMlp,
};

/// transformers' Gemma3TextConfig `initializer_range`.
pub const INITIALIZER_RANGE: f32 = 0.02;

/// The level transformers keeps the body under (`Gemma3TextModel`).
const MODEL: &str = "model.";

/// The sizes and constants of a [`Gemma`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmaConfig {
    pub vocab_size: usize,
    /// The longest sequence (`max_position_embeddings`).
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// Channels per head (`head_dim`, 256 in the published models).
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// The global layers' rotary base (`rope_theta`).
    pub rope_theta: f32,
    /// The sliding-window layers' rotary base (`rope_local_base_freq`).
    pub rope_local_theta: f32,
    pub rms_norm_eps: f32,
    /// The scores are scaled by its inverse square root.
    pub query_pre_attn_scalar: f32,
    /// Positions a local layer attends over.
    pub sliding_window: usize,
    /// Layer i is global when (i + 1) is a multiple of this.
    pub sliding_window_pattern: usize,
}

impl GemmaConfig {
    /// google/gemma-3-270m: 18 layers of 640 channels, 4 heads of 256
    /// over 1 KV head, MLP 2048, vocabulary 262,144, window 512, context
    /// 32,768.
    pub const fn gemma3_270m() -> Self {
        GemmaConfig {
            vocab_size: 262_144,
            block_size: 32_768,
            n_layer: 18,
            n_head: 4,
            n_kv_head: 1,
            n_embd: 640,
            head_dim: 256,
            intermediate_size: 2048,
            rope_theta: 1_000_000.0,
            rope_local_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            query_pre_attn_scalar: 256.0,
            sliding_window: 512,
            sliding_window_pattern: 6,
        }
    }

    /// A small Gemma for a character-level corpus of `vocab_size` symbols:
    /// 4 layers × 128 channels (the second and fourth global), 4 heads of
    /// 48 over 2 KV heads (so two devices split them), MLP 384, 64
    /// positions, a window of all 64.
    pub const fn small(vocab_size: usize) -> Self {
        GemmaConfig {
            vocab_size,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            n_kv_head: 2,
            n_embd: 128,
            head_dim: 48,
            intermediate_size: 384,
            rope_theta: 1_000_000.0,
            rope_local_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            query_pre_attn_scalar: 48.0,
            sliding_window: 64,
            sliding_window_pattern: 2,
        }
    }

    /// Context of the `gemma3-270m` training preset.
    pub const TRAINING_CONTEXT: usize = 2048;

    /// A preset by name: `small` (whose vocabulary `vocab_size` gives: the
    /// data's) or `gemma3-270m` (trained on [`Self::TRAINING_CONTEXT`]
    /// tokens).
    pub fn preset(name: &str, vocab_size: usize) -> Result<Self> {
        match name {
            "small" => Ok(Self::small(vocab_size)),
            "gemma3-270m" => Ok(GemmaConfig {
                block_size: Self::TRAINING_CONTEXT,
                ..Self::gemma3_270m()
            }),
            other => Err(Error::InvalidArgument {
                op: "GemmaConfig::preset",
                reason: format!("unknown Gemma 3 preset `{other}`; known: small, gemma3-270m"),
            }),
        }
    }

    /// Whether layer `index` attends over every position (else over the
    /// sliding window).
    pub fn is_global(&self, index: usize) -> bool {
        (index + 1) % self.sliding_window_pattern.max(1) == 0
    }

    /// Layer `index`'s attention options.
    pub fn attention_options(&self, index: usize) -> AttentionOptions {
        AttentionOptions {
            head_dim: self.head_dim,
            qkv_bias: false,
            qk_norm_eps: Some(self.rms_norm_eps),
            sliding_window: (!self.is_global(index)).then_some(self.sliding_window),
            scale: Some(1.0 / self.query_pre_attn_scalar.sqrt()),
        }
    }

    /// Layer `index`'s rotation (half-split pairs, as transformers and
    /// llama.cpp's NEOX mode rotate them).
    pub fn rotary(&self, index: usize) -> Rotary {
        Rotary {
            base: if self.is_global(index) {
                self.rope_theta
            } else {
                self.rope_local_theta
            },
            rotary_dim: self.head_dim,
            layout: RopeLayout::HalfSplit,
            positions: self.block_size,
        }
    }

    /// Parameters of a model of this size; `None` when the count overflows.
    pub fn num_parameters(&self) -> Option<usize> {
        let (c, f, d) = (self.n_embd, self.intermediate_size, self.head_dim);
        let q = self.n_head.checked_mul(d)?;
        let kv = self.n_kv_head.checked_mul(d)?;
        let layer = c
            .checked_mul(q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?)?
            .checked_add(c.checked_mul(f)?.checked_mul(3)?)?
            .checked_add(c.checked_mul(4)?)?
            .checked_add(d.checked_mul(2)?)?;
        layer
            .checked_mul(self.n_layer)?
            .checked_add(self.vocab_size.checked_mul(c)?)?
            .checked_add(c)
    }

    /// Every size positive, KV heads dividing heads, an even head width,
    /// bases above 1, positive eps and scalar.
    pub fn check(&self) -> Result<()> {
        let sizes = [
            self.vocab_size,
            self.block_size,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.n_embd,
            self.head_dim,
            self.intermediate_size,
            self.sliding_window,
            self.sliding_window_pattern,
        ];
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "GemmaConfig",
                reason: format!("{reason}: {self:?}"),
            })
        };
        if sizes.contains(&0) {
            return bad("every size must be positive".into());
        }
        if self.n_head % self.n_kv_head != 0 {
            return bad(format!(
                "n_head {} must be a multiple of n_kv_head {}",
                self.n_head, self.n_kv_head
            ));
        }
        if self.head_dim % 2 != 0 {
            return bad(format!("the head width {} must be even", self.head_dim));
        }
        let finite_above = |v: f32, floor: f32| v.is_finite() && v > floor;
        if !finite_above(self.rope_theta, 1.0) || !finite_above(self.rope_local_theta, 1.0) {
            return bad("the rotary bases must be finite and above 1".into());
        }
        if !finite_above(self.rms_norm_eps, 0.0) || !finite_above(self.query_pre_attn_scalar, 0.0) {
            return bad("rms_norm_eps and query_pre_attn_scalar must be positive and finite".into());
        }
        Ok(())
    }
}

/// One decoder layer: x + post_norm(attn(norm(x))), then
/// + post_norm(mlp(pre_norm(x))).
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaDecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: GroupedQueryAttention,
    pub post_attention_layernorm: RmsNorm,
    pub pre_feedforward_layernorm: RmsNorm,
    pub mlp: SwiGluMlp,
    pub post_feedforward_layernorm: RmsNorm,
}

impl GemmaDecoderLayer {
    /// Layer `index` with no values (matrices empty, norms zeros).
    fn empty(config: &GemmaConfig, index: usize) -> Result<Self> {
        let (c, eps) = (config.n_embd, config.rms_norm_eps);
        let norm = || RmsNorm::unit_offset(c, eps);
        let mut self_attn = GroupedQueryAttention::empty(
            c,
            config.n_head,
            config.n_kv_head,
            config.attention_options(index),
            config.rotary(index),
        )?;
        self_attn.q_norm = Some(RmsNorm::unit_offset(config.head_dim, eps));
        self_attn.k_norm = Some(RmsNorm::unit_offset(config.head_dim, eps));
        Ok(GemmaDecoderLayer {
            input_layernorm: norm(),
            self_attn,
            post_attention_layernorm: norm(),
            pre_feedforward_layernorm: norm(),
            mlp: SwiGluMlp::empty(c, config.intermediate_size, Activation::Gelu),
            post_feedforward_layernorm: norm(),
        })
    }

    /// transformers' init: projections N(0, std²), norms zeros.
    fn new(config: &GemmaConfig, index: usize, std: f32) -> Result<Self> {
        let mut layer = Self::empty(config, index)?;
        let fresh = GroupedQueryAttention::with_options(
            config.n_embd,
            config.n_head,
            config.n_kv_head,
            config.attention_options(index),
            config.rotary(index),
            std,
        )?;
        let attn = &mut layer.self_attn;
        (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) = (fresh.q_proj, fresh.k_proj, fresh.v_proj, fresh.o_proj);
        layer.mlp = SwiGluMlp {
            activation: Activation::Gelu,
            ..SwiGluMlp::normal(config.n_embd, config.intermediate_size, std)
        };
        Ok(layer)
    }
}

impl Module for GemmaDecoderLayer {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        let normed = self
            .input_layernorm
            .forward(g, x, &child_prefix!(prefix, self.input_layernorm))?;
        let attended = self
            .self_attn
            .forward(g, normed, &child_prefix!(prefix, self.self_attn))?;
        // Both branches end in a row-parallel Linear under tensor
        // parallelism, and their post-norm needs the whole sum.
        let (x, attended) = shard::reduce_beside(g, x, attended)?;
        let attended = self.post_attention_layernorm.forward(
            g,
            attended,
            &child_prefix!(prefix, self.post_attention_layernorm),
        )?;
        let x = g.add(x, attended)?;
        let normed =
            self.pre_feedforward_layernorm
                .forward(g, x, &child_prefix!(prefix, self.pre_feedforward_layernorm))?;
        let transformed = self.mlp.forward(g, normed, &child_prefix!(prefix, self.mlp))?;
        let (x, transformed) = shard::reduce_beside(g, x, transformed)?;
        let transformed = self.post_feedforward_layernorm.forward(
            g,
            transformed,
            &child_prefix!(prefix, self.post_feedforward_layernorm),
        )?;
        g.add(x, transformed)
    }

    fn describe(&self) -> String {
        format!(
            "GemmaDecoderLayer({}, {})",
            self.self_attn.describe(),
            self.mlp.describe()
        )
    }
}

// In the order the forward declares them.
parameter_tree!(GemmaDecoderLayer {
    input_layernorm,
    self_attn,
    post_attention_layernorm,
    pre_feedforward_layernorm,
    mlp,
    post_feedforward_layernorm
});

/// A Gemma 3 over u32 token ids [batch, T ≤ block_size], returning logits
/// [batch, T, vocab_size]; its head is the token table.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma {
    pub config: GemmaConfig,
    pub embed_tokens: Embedding,
    pub layers: Vec<GemmaDecoderLayer>,
    pub norm: RmsNorm,
}

impl Gemma {
    /// transformers' init: embeddings and projections N(0, 0.02²), norms
    /// zeros; draws from [`crate::nn::manual_seed`]'s generator.
    pub fn new(config: GemmaConfig) -> Result<Self> {
        config.check()?;
        let embed_tokens = Embedding::normal(config.vocab_size, config.n_embd, INITIALIZER_RANGE);
        let layers = (0..config.n_layer)
            .map(|i| GemmaDecoderLayer::new(&config, i, INITIALIZER_RANGE))
            .collect::<Result<_>>()?;
        Ok(Gemma {
            config,
            embed_tokens,
            layers,
            norm: RmsNorm::unit_offset(config.n_embd, config.rms_norm_eps),
        })
    }

    /// The structure with no values, for [`Gemma::from_parameters`].
    pub fn empty(config: GemmaConfig) -> Result<Self> {
        config.check()?;
        let layers = (0..config.n_layer)
            .map(|i| GemmaDecoderLayer::empty(&config, i))
            .collect::<Result<_>>()?;
        Ok(Gemma {
            config,
            embed_tokens: Embedding::empty(config.vocab_size, config.n_embd),
            layers,
            norm: RmsNorm::unit_offset(config.n_embd, config.rms_norm_eps),
        })
    }

    /// A model whose parameters come from `take(name, shape)`, called once
    /// per parameter in [`Module::named_parameters`] order (Hugging
    /// Face's names, norm weights as Hugging Face stores them).
    pub fn from_parameters(
        config: GemmaConfig,
        mut take: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let mut model = Self::empty(config)?;
        model.fill("Gemma::from_parameters", &mut take)?;
        Ok(model)
    }

    /// Every layer's attention computed as `kernel` says.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        for layer in &mut self.layers {
            layer.self_attn.attention = kernel;
        }
    }

    /// The token table, which the head reads too.
    fn token_table(&self, g: &mut Graph) -> Result<Tensor> {
        self.embed_tokens
            .tied_table(g, &child_prefix!("", MODEL, self.embed_tokens))
    }

    /// The final norm, then the token table transposed.
    fn head(&self, g: &mut Graph, table: Tensor, x: Tensor) -> Result<Tensor> {
        let x = self.norm.forward(g, x, &child_prefix!("", MODEL, self.norm))?;
        g.rows_matmul(MatmulForm::ABt, x, table)
    }

    fn check_root(prefix: &str) -> Result<()> {
        if !prefix.is_empty() {
            return Err(Error::InvalidArgument {
                op: "Gemma",
                reason: format!("a whole model names its parameters from the root, not under `{prefix}`"),
            });
        }
        Ok(())
    }
}

impl Module for Gemma {
    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        g.ids("idx", &[batch, self.config.block_size])
    }

    fn forward(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_root(prefix)?;
        self.forward_units(g, idx, 0..self.layers.len(), true, true)
    }

    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "Gemma3(vocab_size={}, block_size={}, n_layer={}, n_head={}, n_kv_head={}, n_embd={}, head_dim={}, intermediate_size={}, rope_theta={}, rope_local_theta={}, rms_norm_eps={}, query_pre_attn_scalar={}, sliding_window={}, sliding_window_pattern={})",
            c.vocab_size,
            c.block_size,
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.n_embd,
            c.head_dim,
            c.intermediate_size,
            c.rope_theta,
            c.rope_local_theta,
            c.rms_norm_eps,
            c.query_pre_attn_scalar,
            c.sliding_window,
            c.sliding_window_pattern
        )
    }
}

parameter_tree!(Gemma { [MODEL] embed_tokens, [MODEL] layers, [MODEL] norm });

impl Staged for Gemma {
    /// The token rows times √n_embd (in f32, as transformers scales an f32
    /// model's).
    fn prologue(&self, g: &mut Graph, idx: Tensor) -> Result<Tensor> {
        let shape = g.shape_of(idx).map(<[usize]>::to_vec).unwrap_or_default();
        if !matches!(shape[..], [_, t] if t <= self.config.block_size) {
            return Err(Error::shape(
                "Gemma",
                format!("expects ids [batch, T ≤ {}]", self.config.block_size),
                &[&shape],
            ));
        }
        let table = self.token_table(g)?;
        let rows = g.embedding(table, idx)?;
        g.scale(rows, (self.config.n_embd as f32).sqrt())
    }

    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor> {
        let layer = self.layers.get(index).ok_or_else(|| Error::InvalidArgument {
            op: "Gemma::block",
            reason: format!("layer {index} of {}", self.layers.len()),
        })?;
        layer.forward(g, x, &item_prefix(&child_prefix!("", MODEL, self.layers), index))
    }

    fn epilogue(&self, g: &mut Graph, x: Tensor) -> Result<Tensor> {
        let table = self.token_table(g)?;
        self.head(g, table, x)
    }

    fn stage_costs(&self) -> StageCosts {
        let c = &self.config;
        let (e, t, v, f) = (
            c.n_embd as f64,
            c.block_size as f64,
            c.vocab_size as f64,
            c.intermediate_size as f64,
        );
        let (q, kv) = ((c.n_head * c.head_dim) as f64, (c.n_kv_head * c.head_dim) as f64);
        let block = 2.0 * e * q + 2.0 * e * kv + 3.0 * e * f + 2.0 * t * q;
        StageCosts {
            prologue: e,
            blocks: vec![block; self.layers.len()],
            epilogue: v * e + 3.0 * v + 2.0 * e,
        }
    }
}

impl CausalLm for Gemma {
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
        self.head(g, table, x)
    }
}

impl LmConfig for GemmaConfig {
    /// In f16: every projection and the tied token table.
    fn lm_sizes(&self) -> LmSizes {
        let (c, f, v) = (
            self.n_embd as u64,
            self.intermediate_size as u64,
            self.vocab_size as u64,
        );
        let (q, kv) = (
            self.n_head as u64 * self.head_dim as u64,
            self.n_kv_head as u64 * self.head_dim as u64,
        );
        let layer = (2 * c * q + 2 * c * kv + 3 * c * f).saturating_mul(self.n_layer as u64);
        LmSizes {
            parameters: self.num_parameters().map_or(u64::MAX, |n| n as u64),
            f16_weight_values: layer.saturating_add(v * c),
            cached_layers: self.n_layer as u64,
            cache_width: kv,
            context: self.block_size,
            vocab_size: self.vocab_size,
            head_dim: self.head_dim,
        }
    }
}
