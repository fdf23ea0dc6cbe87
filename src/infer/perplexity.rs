//! Perplexity of any causal language model over a text, as llama.cpp's
//! `llama-perplexity` reports it (the figure people compare quantizations
//! by): the tokens are cut into non-overlapping windows of `context`
//! tokens; each window runs from position 0 with its first token replaced
//! by BOS where the tokenizer starts its encodings with one; and only the
//! predictions of its second half are scored, positions `context / 2` to
//! `context - 2` predicting the tokens after them (`context - 1 - context
//! / 2` per window), so every scored token has at least half a window
//! before it instead of the nearly empty context of a window's first
//! tokens. The tokens after the last whole window are left out. The
//! result is the mean next-token loss in nats over every scored token,
//! and its exponential.
//!
//! The window runs as one graph over the model's own forward under a
//! [`ForwardContext`] (the generator's prefill), so a GGUF file's matrices
//! stay block-quantized as stored; the loss is computed on the GPU
//! ([`Graph::cross_entropy_loss`] over the scored rows) and only one value
//! per window comes back, never the [rows, vocab] logits.

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::graph::{Executor, Graph, Tensor};
use crate::infer::generate::WeightDtype;
use crate::kernels::{check_token_ids, Kernels};
use crate::nn::{CachePass, CausalLm, ForwardContext, QuantizedWeights};

const OP: &str = "perplexity";

/// How [`Scorer::new`] builds its graph.
#[derive(Clone, Debug, Default)]
pub struct ScorerOptions {
    /// Tokens per window: at least 3 (so a window scores a prediction), at
    /// most the model's context.
    pub context: usize,
    pub dtype: WeightDtype,
    /// Matrices stored block-quantized, by parameter name (a GGUF file's).
    pub quantized: Arc<QuantizedWeights>,
}

/// What [`Scorer::score`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    pub windows: usize,
    /// Tokens per window.
    pub context: usize,
    /// Predictions scored: `windows · (context - 1 - context / 2)`.
    pub scored: usize,
    /// Tokens at the end that fill no whole window, left out.
    pub left_out: usize,
    /// Mean next-token loss over the scored predictions, in nats.
    pub mean_loss: f64,
    /// Seconds the windows took on the device (the graph's build aside).
    pub seconds: f64,
}

impl Perplexity {
    /// exp(mean loss).
    pub fn perplexity(&self) -> f64 {
        self.mean_loss.exp()
    }

    /// Tokens run through the model per second (every token of every
    /// window, scored or not).
    pub fn tokens_per_second(&self) -> f64 {
        (self.windows * self.context) as f64 / self.seconds.max(1e-9)
    }
}

/// Predictions a window of `context` tokens scores (its second half).
pub fn scored_per_window(context: usize) -> usize {
    context.saturating_sub(1 + context / 2)
}

/// One window's forward and mean loss, planned and allocated once.
pub struct Scorer {
    exec: Executor,
    context: usize,
    vocab_size: usize,
    ids: Tensor,
    targets: Tensor,
    loss: Tensor,
}

/// Whether any op of `g` reads `t` (a model without positions leaves its
/// position input unread, and the executor gives an unread input no
/// buffer to write).
fn is_read(g: &Graph, t: Tensor) -> bool {
    g.nodes().iter().any(|n| n.inputs.contains(&t))
}

impl Scorer {
    /// A scorer of windows of `options.context` tokens for `model`.
    pub fn new(kernels: Arc<Kernels>, model: &dyn CausalLm, options: &ScorerOptions) -> Result<Self> {
        let context = options.context;
        let most = model.context_len();
        if context < 3 || context > most {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "a window of {context} tokens: give 3 (the shortest that scores a prediction) to the model's context of {most}"
                ),
            });
        }
        let first = context / 2;
        let scored = scored_per_window(context);
        let mut g = Graph::new();
        let ids = g.ids("perplexity.idx", &[1, context])?;
        let positions = g.ids("perplexity.positions", &[1, context])?;
        let starts = g.ids("perplexity.starts", &[1])?;
        let rows = g.ids("perplexity.rows", &[scored])?;
        let targets = g.ids("perplexity.targets", &[scored])?;
        let mut cx = ForwardContext::new(options.dtype.on(&kernels), context).with_quantized(options.quantized.clone());
        let loss = cx.run(CachePass { starts, positions }, || {
            let (x, table) = model.body(&mut g, ids, "")?;
            let channels = g.shape_of(x).and_then(|s| s.last().copied()).unwrap_or(0);
            let x = g.reshape(x, &[context, channels])?;
            // Only the scored rows reach the head: a vocabulary of 262,144
            // makes the logits of a whole window the largest tensor.
            let x = g.embedding(x, rows)?;
            let logits = model.logits(&mut g, table, x, "")?;
            g.cross_entropy_loss(logits, targets)
        })?;
        let read = (is_read(&g, positions), is_read(&g, starts));
        let exec = Executor::new(kernels, g, &[loss], None, None)?;
        let mut declared = exec.parameters_shapes();
        let mut expected = model.named_parameters();
        declared.sort();
        expected.sort();
        if declared != expected {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("the scoring graph's parameters {declared:?} are not the model's {expected:?}"),
            });
        }
        // Every window runs from position 0 and scores the same rows.
        if read.0 {
            exec.set_labels(positions, &(0..context as u32).collect::<Vec<_>>())?;
        }
        if read.1 {
            exec.set_labels(starts, &[0])?;
        }
        exec.set_labels(rows, &(first as u32..(first + scored) as u32).collect::<Vec<_>>())?;
        Ok(Scorer {
            exec,
            context,
            vocab_size: model.vocab_size(),
            ids,
            targets,
            loss,
        })
    }

    /// Tokens per window.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The mean loss of one window's scored predictions, in nats: `window`
    /// holds exactly the scorer's context of ids, BOS already in place.
    pub fn window_loss(&mut self, window: &[u32]) -> Result<f64> {
        if window.len() != self.context {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("a window of {} tokens for a scorer of {}", window.len(), self.context),
            });
        }
        check_token_ids(OP, window, self.vocab_size)?;
        let first = self.context / 2;
        self.exec.set_labels(self.ids, window)?;
        self.exec.set_labels(self.targets, &window[first + 1..])?;
        let loss = self.exec.run_and_read(&[self.loss], self.loss)?;
        let value = loss.first().copied().map(f64::from).unwrap_or(f64::NAN);
        if !value.is_finite() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("a window's loss is {value}: the model's logits are not finite"),
            });
        }
        Ok(value)
    }

    /// The perplexity of `tokens` (see the module documentation): `bos`,
    /// where given, replaces each window's first token. `progress` hears
    /// (windows done, windows) after each window. Fewer tokens than one
    /// window is an error.
    pub fn score(
        &mut self,
        tokens: &[u32],
        bos: Option<u32>,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Perplexity> {
        let context = self.context;
        let windows = tokens.len() / context;
        if windows == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "the text has {} tokens, fewer than one window of {context}: give a longer text or a shorter context",
                    tokens.len()
                ),
            });
        }
        let start = Instant::now();
        let mut total = 0.0;
        for (w, chunk) in tokens.chunks_exact(context).enumerate() {
            let mut window = chunk.to_vec();
            if let Some(bos) = bos {
                window[0] = bos;
            }
            // Each window's mean is over the same count: their mean is
            // the mean over every scored token.
            total += self.window_loss(&window)?;
            progress(w + 1, windows);
        }
        Ok(Perplexity {
            windows,
            context,
            scored: windows * scored_per_window(context),
            left_out: tokens.len() - windows * context,
            mean_loss: total / windows as f64,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}
