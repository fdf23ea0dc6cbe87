//! Continuous batching: a [`Scheduler`] runs many requests over one
//! [`Generator`] built with [`PrefillMode::OneSlot`], as vLLM and
//! llama.cpp's server do. Each request gets a slot (a KV cache of the
//! generator's) when one is free, else waits in a queue; between decode
//! steps, waiting requests join (their prompt prefilled into their slot
//! alone) and finished ones leave, and each decode step feeds every
//! running request's last token in one submission.
//!
//! The scheduler knows nothing of HTTP or text: a request is token ids and
//! its settings, and what it produces goes to its [`Sink`] as [`Event`]s.
//! A sink that answers `false` (its receiver is gone), or a request whose
//! [`BatchRequest::cancel`] flag is set, leaves at the next step and frees
//! its slot.
//!
//! # Reproducibility
//!
//! Each request samples from its own ChaCha8 stream seeded with its
//! `sampling.seed`, one draw per token it picks, with its own temperature,
//! top_k and top_p. Its prompt is prefilled alone, and no reduction of a
//! decode step crosses rows, so a fixed seed gives the same tokens for a
//! fixed batch composition (the same generator, adapter and requests
//! running beside it). Running requests are kept in the lowest slots and a
//! step computes the rows up to the highest one (rounded up to a power of
//! two); a different number of rows may pick another product kernel (on a
//! CPU adapter with quantized weights the columns one for 1 row, the rows
//! one for 2 to 16), whose rounding may differ, so a draw within rounding of a
//! boundary between two candidates may then pick the other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::generate::{Generator, Sampling, SlotStep};
use crate::error::{Error, Result};
use crate::kernels::check_token_ids;

/// One request: a prompt to continue and how.
#[derive(Clone, Debug)]
pub struct BatchRequest {
    pub prompt: Vec<u32>,
    /// The most tokens to generate (fewer when the context ends first).
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the request (EOS, end of turn), not passed on.
    pub stop_tokens: Vec<u32>,
    /// Set from anywhere (a client gone, a stop string seen) to end the
    /// request at the scheduler's next step.
    pub cancel: Arc<AtomicBool>,
    /// The adapter of the generator's model ([`crate::nn::MultiLora`])
    /// its rows apply, prefill and decode alike; None: the base.
    pub adapter: Option<usize>,
}

impl BatchRequest {
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize, sampling: Sampling) -> Self {
        BatchRequest {
            prompt,
            max_new_tokens,
            sampling,
            stop_tokens: Vec::new(),
            cancel: Arc::default(),
            adapter: None,
        }
    }
}

/// Why a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_new_tokens`, or the context is full.
    Length,
    /// Cancelled, or its sink stopped listening.
    Cancelled,
    /// Its own error (a logit that is not finite, an id outside the
    /// vocabulary), or the generator's, which ends every request.
    Failed(String),
}

/// A request's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a request's sink gets: each token as it is picked, then its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Token(u32),
    Done(Finished),
}

/// Where a request's events go; `false` means nobody listens any more
/// (the request is cancelled).
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

/// Counts over a scheduler's life.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchStats {
    pub decode_steps: u64,
    /// Rows of those steps that belonged to a request.
    pub decoded_rows: u64,
    pub prefills: u64,
    pub prefill_tokens: u64,
}

impl BatchStats {
    /// Running requests per decode step, on average.
    pub fn mean_batch(&self) -> f64 {
        self.decoded_rows as f64 / self.decode_steps.max(1) as f64
    }
}

/// A request holding a slot.
struct Running {
    request: BatchRequest,
    sink: Sink,
    rng: ChaCha8Rng,
    /// The token the next decode step feeds.
    next: u32,
    generated: usize,
    /// `max_new_tokens`, or fewer where the context ends first.
    limit: usize,
}

/// Requests over one generator's slots (see the module documentation).
pub struct Scheduler {
    generator: Generator,
    slots: Vec<Option<Running>>,
    queue: VecDeque<(BatchRequest, Sink)>,
    stats: BatchStats,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("generator", &self.generator)
            .field("active", &self.active())
            .field("queued", &self.queue.len())
            .finish()
    }
}

impl Scheduler {
    /// A scheduler over `generator`'s slots, which must prefill one slot
    /// at a time ([`super::generate::PrefillMode::OneSlot`]).
    pub fn new(generator: Generator) -> Result<Self> {
        if !generator.prefills_one_slot() {
            return Err(Error::InvalidArgument {
                op: "Scheduler::new",
                reason: "the generator prefills all sequences together: build it with PrefillMode::OneSlot".into(),
            });
        }
        let slots = (0..generator.sequences()).map(|_| None).collect();
        Ok(Scheduler {
            generator,
            slots,
            queue: VecDeque::new(),
            stats: BatchStats::default(),
        })
    }

    pub fn generator(&self) -> &Generator {
        &self.generator
    }

    /// Refuses a request no slot can run: an empty prompt, one that leaves
    /// no position to generate in the context, ids outside the
    /// vocabulary, max_new_tokens 0, sampling settings no sampler takes,
    /// an adapter the model does not carry.
    pub fn check(&self, request: &BatchRequest) -> Result<()> {
        const OP: &str = "Scheduler::submit";
        let context = self.generator.context_len();
        if request.prompt.is_empty() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "the prompt is empty".into(),
            });
        }
        if request.prompt.len() >= context {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "the prompt has {} tokens; the context holds {context}, the prompt and at least one new token",
                    request.prompt.len()
                ),
            });
        }
        if request.max_new_tokens == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "max_new_tokens must be at least 1".into(),
            });
        }
        request.sampling.check()?;
        if let Some(a) = request.adapter.filter(|&a| a >= self.generator.adapters()) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("adapter {a} of a model carrying {}", self.generator.adapters()),
            });
        }
        check_token_ids(OP, &request.prompt, self.generator.vocab_size())
    }

    /// Queues `request` ([`Scheduler::check`]ed); it joins at a step with
    /// a free slot, in arrival order. A refused request's sink is not
    /// called.
    pub fn submit(&mut self, request: BatchRequest, sink: Sink) -> Result<()> {
        self.check(&request)?;
        self.queue.push_back((request, sink));
        Ok(())
    }

    /// Whether no request runs or waits.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.slots.iter().all(Option::is_none)
    }

    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.is_none()).count()
    }

    /// Requests holding a slot.
    pub fn active(&self) -> usize {
        self.slots.len() - self.free_slots()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn stats(&self) -> BatchStats {
        self.stats
    }

    /// One round: cancelled requests leave; waiting requests take the free
    /// slots (each prompt prefilled alone, its first token sent); then one
    /// decode step for every running request. An error of one request ends
    /// that request; an error of the generator is returned (the requests
    /// stay: [`Scheduler::end_all`] ends them).
    pub fn step(&mut self) -> Result<()> {
        for slot in 0..self.slots.len() {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|r| r.request.cancel.load(Ordering::Relaxed))
            {
                self.finish(slot, FinishReason::Cancelled);
            }
        }
        let (waiting, cancelled): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(|(r, _)| !r.cancel.load(Ordering::Relaxed));
        self.queue = waiting;
        for (request, mut sink) in cancelled {
            sink(Event::Done(Finished {
                reason: FinishReason::Cancelled,
                prompt_tokens: request.prompt.len(),
                completion_tokens: 0,
            }));
        }
        while let Some(slot) = self.slots.iter().position(Option::is_none) {
            let Some((request, sink)) = self.queue.pop_front() else {
                break;
            };
            self.join(slot, request, sink)?;
        }
        self.compact()?;
        self.decode()
    }

    /// Moves the highest running requests into free slots below them, so
    /// a step computes the rows up to the highest running slot only
    /// ([`Generator::decode_slots`]).
    fn compact(&mut self) -> Result<()> {
        while let (Some(free), Some(last)) = (
            self.slots.iter().position(Option::is_none),
            self.slots.iter().rposition(Option::is_some),
        ) {
            if free > last {
                break;
            }
            self.generator.move_slot(last, free)?;
            self.slots.swap(free, last);
        }
        Ok(())
    }

    /// Prefills `request` into `slot` and sends its first token.
    fn join(&mut self, slot: usize, request: BatchRequest, mut sink: Sink) -> Result<()> {
        let mut rng = ChaCha8Rng::seed_from_u64(request.sampling.seed);
        let limit = request
            .max_new_tokens
            .min(self.generator.context_len() - request.prompt.len());
        // The slot's rows apply the request's adapter from its prefill on.
        let prefilled = self.generator.set_slot_adapter(slot, request.adapter).and_then(|()| {
            self.generator
                .prefill_slot(slot, &request.prompt, &request.sampling, &mut rng)
        });
        match prefilled {
            Ok(token) => {
                self.stats.prefills += 1;
                self.stats.prefill_tokens += request.prompt.len() as u64;
                self.slots[slot] = Some(Running {
                    request,
                    sink,
                    rng,
                    next: token,
                    generated: 0,
                    limit,
                });
                self.accept(slot, token);
                Ok(())
            }
            Err(e) if is_request_error(&e) => {
                self.generator.truncate(slot, 0)?;
                sink(Event::Done(Finished {
                    reason: FinishReason::Failed(e.to_string()),
                    prompt_tokens: request.prompt.len(),
                    completion_tokens: 0,
                }));
                Ok(())
            }
            Err(e) => {
                // Back in front: end_all tells it the generator's error.
                self.queue.push_front((request, sink));
                Err(e)
            }
        }
    }

    /// One decode step over the running requests, if any.
    fn decode(&mut self) -> Result<()> {
        let mut steps: Vec<Option<SlotStep<'_>>> = self
            .slots
            .iter_mut()
            .map(|s| {
                s.as_mut().map(|r| SlotStep {
                    token: r.next,
                    sampling: &r.request.sampling,
                    rng: &mut r.rng,
                })
            })
            .collect();
        let rows = steps.iter().flatten().count();
        if rows == 0 {
            return Ok(());
        }
        let tokens = self.generator.decode_slots(&mut steps)?;
        self.stats.decode_steps += 1;
        self.stats.decoded_rows += rows as u64;
        for (slot, token) in tokens.into_iter().enumerate() {
            match token {
                Some(Ok(token)) => self.accept(slot, token),
                Some(Err(e)) => self.finish(slot, FinishReason::Failed(e.to_string())),
                None => {}
            }
        }
        Ok(())
    }

    /// `slot`'s request picked `token`: ends it at a stop token, else
    /// sends the token and ends it at its limit or when nobody listens.
    fn accept(&mut self, slot: usize, token: u32) {
        let Some(running) = self.slots[slot].as_mut() else {
            return;
        };
        if running.request.stop_tokens.contains(&token) {
            return self.finish(slot, FinishReason::Stop);
        }
        running.generated += 1;
        running.next = token;
        if !(running.sink)(Event::Token(token)) {
            self.finish(slot, FinishReason::Cancelled);
        } else if running.generated >= running.limit {
            self.finish(slot, FinishReason::Length);
        }
    }

    /// Ends `slot`'s request with `reason` and frees the slot.
    fn finish(&mut self, slot: usize, reason: FinishReason) {
        let Some(mut running) = self.slots[slot].take() else {
            return;
        };
        // Only an index past the slots fails, and `slot` is one.
        let _ = self.generator.truncate(slot, 0);
        (running.sink)(Event::Done(Finished {
            reason,
            prompt_tokens: running.request.prompt.len(),
            completion_tokens: running.generated,
        }));
    }

    /// Ends every running and waiting request with `reason` (shutting
    /// down, or the generator's error), freeing every slot.
    pub fn end_all(&mut self, reason: FinishReason) {
        for slot in 0..self.slots.len() {
            self.finish(slot, reason.clone());
        }
        for (request, mut sink) in std::mem::take(&mut self.queue) {
            sink(Event::Done(Finished {
                reason: reason.clone(),
                prompt_tokens: request.prompt.len(),
                completion_tokens: 0,
            }));
        }
    }
}

/// Whether `e` is one request's fault (its prompt, its logits) rather
/// than the generator's or the device's.
fn is_request_error(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}
