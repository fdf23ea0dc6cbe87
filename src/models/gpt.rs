//! A GPT as nanoGPT writes it, with GPT-2's parameter names: token and
//! position embeddings (`wte`, `wpe`), pre-norm blocks (`h.0.…`), a final
//! norm (`ln_f`), and a head tied to the token embedding (logits = x·wteᵀ,
//! no bias), so `wte.weight` gets the gradients of both uses.

use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::kernels::MatmulForm;
use crate::nn::cache_pass;
use crate::nn::parameter_tree::{child_prefix, item_prefix, parameter_tree};
use crate::nn::{
    AttentionKernel, Block, CausalLm, CausalSelfAttention, Embedding, LayerNorm, Linear, LmConfig, LmSizes, Mlp,
    Module, ParameterTree, StageCosts, Staged,
};

/// The sizes of a [`Gpt`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The longest sequence (the position table's rows).
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
}

impl GptConfig {
    /// GPT-2 (124M): the released `gpt2` checkpoint's sizes.
    pub const fn gpt2() -> Self {
        GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
        }
    }

    /// GPT-2 medium (350M).
    pub const fn gpt2_medium() -> Self {
        GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
        }
    }

    /// GPT-2 large (774M).
    pub const fn gpt2_large() -> Self {
        GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 36,
            n_head: 20,
            n_embd: 1280,
        }
    }

    /// GPT-2 XL (1558M).
    pub const fn gpt2_xl() -> Self {
        GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 48,
            n_head: 25,
            n_embd: 1600,
        }
    }

    /// A preset by its Hugging Face name: `gpt2`, `gpt2-medium`,
    /// `gpt2-large`, `gpt2-xl`.
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "gpt2" => Ok(Self::gpt2()),
            "gpt2-medium" => Ok(Self::gpt2_medium()),
            "gpt2-large" => Ok(Self::gpt2_large()),
            "gpt2-xl" => Ok(Self::gpt2_xl()),
            other => Err(Error::InvalidArgument {
                op: "GptConfig::preset",
                reason: format!("unknown preset `{other}`; known: gpt2, gpt2-medium, gpt2-large, gpt2-xl"),
            }),
        }
    }

    /// Parameters of a [`Gpt`] of this size (head tied to the token
    /// embedding), without building it: 124,439,808 for [`GptConfig::gpt2`].
    pub fn num_parameters(&self) -> usize {
        let c = self.n_embd;
        let block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
        self.vocab_size * c + self.block_size * c + self.n_layer * block + 2 * c
    }

    /// Forward multiply-adds per token of the embedding, each of `blocks`
    /// blocks, and the head with its loss ([`Staged::stage_costs`]).
    pub fn stage_costs(&self, blocks: usize) -> StageCosts {
        let (c, t, v) = (self.n_embd as f64, self.block_size as f64, self.vocab_size as f64);
        // q, k, v and the output projection, the MLP's two matmuls, and the
        // attention scores and their weighted sum.
        let block = 12.0 * c * c + 2.0 * t * c;
        StageCosts {
            prologue: 2.0 * c,
            blocks: vec![block; blocks],
            epilogue: v * c + 3.0 * v + 4.0 * c,
        }
    }

    fn check(&self) -> Result<()> {
        let sizes = [self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd];
        if sizes.contains(&0) || self.n_embd % self.n_head != 0 {
            return Err(Error::InvalidArgument {
                op: "GptConfig",
                reason: format!("every size must be positive and n_embd a multiple of n_head: {self:?}"),
            });
        }
        Ok(())
    }
}

/// A decoder-only transformer over u32 token ids [batch, block_size],
/// returning logits [batch, block_size, vocab_size].
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt {
    pub config: GptConfig,
    pub wte: Embedding,
    pub wpe: Embedding,
    pub h: Vec<Block>,
    pub ln_f: LayerNorm,
}

impl Gpt {
    /// GPT-2's initialisation (nanoGPT's `_init_weights`): weights and
    /// embeddings N(0, 0.02²), biases zero, the residual projections
    /// N(0, (0.02/√(2·n_layer))²), norms one and zero.
    pub fn new(config: GptConfig) -> Result<Self> {
        config.check()?;
        let h = (0..config.n_layer)
            .map(|_| Block::gpt2(config.n_embd, config.n_head, config.n_layer))
            .collect::<Result<_>>()?;
        Ok(Self::assemble(config, h))
    }

    /// The same model with every block's attention removed: each position
    /// is transformed on its own, a baseline that cannot look at others.
    pub fn without_attention(config: GptConfig) -> Result<Self> {
        config.check()?;
        let h = (0..config.n_layer)
            .map(|_| Block::mlp_only_gpt2(config.n_embd, config.n_layer))
            .collect();
        Ok(Self::assemble(config, h))
    }

    /// A model of `config` whose parameters come from `take(name, shape)`,
    /// called once per parameter in [`Module::named_parameters`] order; it
    /// returns exactly `shape`'s element count of values, or the error to
    /// report. Draws nothing from the init generator.
    pub fn from_parameters(
        config: GptConfig,
        mut take: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let mut model = Self::empty(config)?;
        model.fill("Gpt::from_parameters", &mut take)?;
        Ok(model)
    }

    /// Every block's attention computed as `kernel` says (fused by
    /// default; unfused is the reference).
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        for attn in self.h.iter_mut().filter_map(|block| block.attn.as_mut()) {
            attn.attention = kernel;
        }
    }

    /// The model's structure with no values (every matrix empty, norms
    /// ones and zeros): its tree names and shapes every parameter without
    /// allocating, and [`Gpt::from_parameters`] fills it.
    pub fn empty(config: GptConfig) -> Result<Self> {
        config.check()?;
        let c = config.n_embd;
        let h = (0..config.n_layer)
            .map(|_| Block {
                ln_1: LayerNorm::new(c),
                attn: Some(CausalSelfAttention {
                    n_embd: c,
                    n_head: config.n_head,
                    c_attn: Linear::empty(c, 3 * c, true),
                    c_proj: Linear::empty(c, c, true),
                    attention: AttentionKernel::default(),
                }),
                ln_2: LayerNorm::new(c),
                mlp: Mlp {
                    c_fc: Linear::empty(c, 4 * c, true),
                    c_proj: Linear::empty(4 * c, c, true),
                },
            })
            .collect();
        Ok(Gpt {
            config,
            wte: Embedding::empty(config.vocab_size, c),
            wpe: Embedding::empty(config.block_size, c),
            h,
            ln_f: LayerNorm::new(c),
        })
    }

    /// The input of the first block, x [batch, T, C]: the token
    /// embeddings of `idx` (u32 [batch, T ≤ block_size]) plus the first T
    /// position embeddings, or under a [`super::ForwardContext`] those of
    /// the cache's positions.
    fn embed(&self, g: &mut Graph, idx: Tensor) -> Result<Tensor> {
        let shape = g.shape_of(idx).map(<[usize]>::to_vec).unwrap_or_default();
        let (block, channels) = (self.config.block_size, self.config.n_embd);
        let t = match shape[..] {
            [_, t] if t <= block => t,
            _ => {
                return Err(Error::shape(
                    "Gpt",
                    format!("expects ids [batch, T ≤ {block}]"),
                    &[&shape],
                ))
            }
        };
        let wte = self.wte.tied_table(g, &child_prefix!("", self.wte))?;
        let tokens = g.embedding(wte, idx)?;
        let table = self.wpe.table(g, &child_prefix!("", self.wpe))?;
        // The first T rows of the position table, broadcast over the batch.
        let positions = if let Some(pass) = cache_pass() {
            g.embedding(table, pass.positions)?
        } else if t == block {
            table
        } else {
            let flat = g.reshape(table, &[1, block * channels])?;
            let first = g.slice_last(flat, 0, t * channels)?;
            g.reshape(first, &[t, channels])?
        };
        g.add(tokens, positions)
    }

    /// The final norm and the head tied to the token table `wte`: logits
    /// [.., vocab_size] of x [.., C].
    fn head(&self, g: &mut Graph, wte: Tensor, x: Tensor) -> Result<Tensor> {
        let x = self.ln_f.forward(g, x, &child_prefix!("", self.ln_f))?;
        g.rows_matmul(MatmulForm::ABt, x, wte)
    }

    /// A whole model names its parameters from the root.
    fn check_root(prefix: &str) -> Result<()> {
        if !prefix.is_empty() {
            return Err(Error::InvalidArgument {
                op: "Gpt",
                reason: format!("a whole model names its parameters from the root, not under `{prefix}`"),
            });
        }
        Ok(())
    }

    fn assemble(config: GptConfig, h: Vec<Block>) -> Self {
        Gpt {
            config,
            wte: Embedding::normal(config.vocab_size, config.n_embd, 0.02),
            wpe: Embedding::normal(config.block_size, config.n_embd, 0.02),
            h,
            ln_f: LayerNorm::new(config.n_embd),
        }
    }
}

parameter_tree!(Gpt { wte, wpe, h, ln_f });

/// The embeddings, the blocks `h.{i}`, and the final norm with the head
/// (which declares `wte.weight` again: the pipeline finds the tied copy).
impl Staged for Gpt {
    fn prologue(&self, g: &mut Graph, idx: Tensor) -> Result<Tensor> {
        self.embed(g, idx)
    }

    fn block(&self, g: &mut Graph, index: usize, x: Tensor) -> Result<Tensor> {
        let block = self.h.get(index).ok_or_else(|| Error::InvalidArgument {
            op: "Gpt::block",
            reason: format!("block {index} of {}", self.h.len()),
        })?;
        block.forward(g, x, &item_prefix(&child_prefix!("", self.h), index))
    }

    /// Logits [.., vocab_size] of x [.., C] through `ln_f` and the head
    /// tied to the token table.
    fn epilogue(&self, g: &mut Graph, x: Tensor) -> Result<Tensor> {
        let wte = self.wte.tied_table(g, &child_prefix!("", self.wte))?;
        self.head(g, wte, x)
    }

    fn stage_costs(&self) -> StageCosts {
        self.config.stage_costs(self.h.len())
    }
}

impl Module for Gpt {
    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        g.ids("idx", &[batch, self.config.block_size])
    }

    /// `idx`: u32 [batch, T] with T ≤ block_size. A whole model: its
    /// parameters are named from the root, so `prefix` must be empty.
    fn forward(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_root(prefix)?;
        self.forward_units(g, idx, 0..self.h.len(), true, true)
    }

    fn describe(&self) -> String {
        let c = &self.config;
        let attention = if self.h.iter().all(|b| b.attn.is_some()) {
            ""
        } else {
            ", no attention"
        };
        format!(
            "Gpt(vocab_size={}, block_size={}, n_layer={}, n_head={}, n_embd={}{attention})",
            c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd
        )
    }

    /// GPT2LMHeadModel's body is `transformer.` (`transformer.h.0.attn.c_attn`).
    fn hf_module_prefix(&self) -> &'static str {
        "transformer."
    }
}

impl CausalLm for Gpt {
    fn lm_sizes(&self) -> LmSizes {
        self.config.lm_sizes()
    }

    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<(Tensor, Tensor)> {
        Self::check_root(prefix)?;
        let x = self.forward_units(g, idx, 0..self.h.len(), true, false)?;
        // The table the embedding declared, found again by its name.
        let wte = self.wte.tied_table(g, &child_prefix!("", self.wte))?;
        Ok((x, wte))
    }

    fn logits(&self, g: &mut Graph, wte: Tensor, x: Tensor, prefix: &str) -> Result<Tensor> {
        Self::check_root(prefix)?;
        self.head(g, wte, x)
    }
}

impl LmConfig for GptConfig {
    /// In f16: the token table (the tied head) and every block's four
    /// projection weights, 3C·C + C·C + 4C·C + 4C·C.
    fn lm_sizes(&self) -> LmSizes {
        let c = self.n_embd as u64;
        LmSizes {
            parameters: self.num_parameters() as u64,
            f16_weight_values: self.vocab_size as u64 * c + self.n_layer as u64 * 12 * c * c,
            cached_layers: self.n_layer as u64,
            cache_width: c,
            context: self.block_size,
            vocab_size: self.vocab_size,
            head_dim: self.n_embd / self.n_head.max(1),
        }
    }
}
