//! A pretrained model in a page: a GGUF file's bytes (its matrices kept
//! block-quantized as stored, its tokenizer and chat template from its
//! metadata), loaded as `wgrad generate` and `wgrad chat` load a file, and
//! generation that streams each token to a JavaScript callback.
//!
//! A chat keeps its history in the KV cache, as `wgrad chat` does: each
//! turn renders the whole conversation through the template and feeds
//! only what follows the part the cache holds.

// A call's `RefCell` borrow, held across its awaits, is the object's
// one-call-at-a-time lock: a second call takes it with `try_borrow_mut`
// ([`crate::busy`]) and gets an error saying the object is busy, never a
// panic.
#![allow(clippy::await_holding_refcell_ref)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wasm_bindgen::prelude::*;
use wgrad::device::Instant;
use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling};
use wgrad::infer::pretrained::{load_pretrained_gguf_bytes, PretrainedLm};
use wgrad::io::chat::{ChatMessage, ChatTemplate};

use crate::{busy, invalid, js_error, Gpu};

/// The cache's positions when the page does not say: SmolLM2's whole 8192
/// would be 180 MiB of keys and values.
const DEFAULT_CONTEXT: usize = 2048;

struct Session {
    lm: PretrainedLm,
    generator: Generator,
    template: Option<ChatTemplate>,
    messages: Vec<ChatMessage>,
    /// The chat's draws, seeded once per conversation (as `wgrad chat`).
    rng: Option<(u64, ChaCha8Rng)>,
}

/// A GGUF model ready to generate and chat.
#[wasm_bindgen]
pub struct LmSession {
    state: Rc<RefCell<Session>>,
    summary: String,
}

/// The sampling settings a page passes: temperature 0 is greedy, `top_k`
/// 0 and `top_p` 1 leave them off.
fn sampling(temperature: f32, top_k: u32, top_p: f32, seed: u32) -> Result<Sampling, JsValue> {
    let sampling = Sampling {
        temperature,
        top_k: (top_k > 0).then_some(top_k as usize),
        top_p: (top_p < 1.0).then_some(top_p),
        seed: u64::from(seed),
    };
    sampling.check().map_err(js_error)?;
    Ok(sampling)
}

/// What one answer took, and its tokens.
#[derive(Default)]
struct Answer {
    tokens: Vec<u32>,
    text: String,
    prefill_tokens: usize,
    prefill_seconds: f64,
    decode_steps: usize,
    decode_seconds: f64,
    context_full: bool,
}

impl Answer {
    fn json(&self, prompt_ids: &[u32]) -> String {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        serde_json::json!({
            "prompt_ids": prompt_ids,
            "ids": self.tokens,
            "text": self.text,
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_tokens": self.decode_steps,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_s": rate(self.decode_steps, self.decode_seconds),
            "context_full": self.context_full,
        })
        .to_string()
    }
}

#[wasm_bindgen]
impl LmSession {
    /// Loads a GGUF file from its bytes (`name` labels it in messages)
    /// onto `gpu`, with a KV cache of `context` positions (0: 2048, or
    /// the model's context if shorter). Reads, uploads and builds; nothing
    /// waits for the GPU.
    #[wasm_bindgen(constructor)]
    pub fn new(gpu: &Gpu, bytes: Vec<u8>, name: &str, context: u32) -> Result<LmSession, JsValue> {
        let kernels = gpu.kernels().clone();
        let wanted = if context == 0 {
            DEFAULT_CONTEXT
        } else {
            context as usize
        };
        let started = Instant::now();
        // The context is fitted to the model once its sizes are known.
        let fits = GeneratorOptions {
            context: Some(1),
            ..GeneratorOptions::default()
        };
        let lm = load_pretrained_gguf_bytes(&kernels, name, bytes, None, &fits).map_err(js_error)?;
        let options = GeneratorOptions {
            context: Some(wanted.min(lm.model.context_len())),
            quantized: Arc::new(lm.quantized.clone()),
            suppressed_tokens: lm.suppressed.clone(),
            ..GeneratorOptions::default()
        };
        let generator = Generator::with_options(kernels.clone(), lm.model.as_ref(), &options).map_err(js_error)?;
        let template = lm
            .tokenizer
            .chat_template()
            .map(ChatTemplate::new)
            .transpose()
            .map_err(js_error)?;
        let summary = serde_json::json!({
            "name": name,
            "model": generator.model(),
            "vocabulary": lm.tokenizer.vocab_size(),
            "context": generator.context_len(),
            "weights": generator.dtype().name(),
            "chat_template": template.is_some(),
            "load_seconds": started.elapsed().as_secs_f64(),
            "device": kernels.device().label(),
        })
        .to_string();
        Ok(LmSession {
            state: Rc::new(RefCell::new(Session {
                lm,
                generator,
                template,
                messages: Vec::new(),
                rng: None,
            })),
            summary,
        })
    }

    /// The model as loaded, as JSON: name, model, vocabulary, context,
    /// weights, chat_template (whether the file has one), load_seconds,
    /// device.
    pub fn describe(&self) -> String {
        self.summary.clone()
    }

    /// The ids of `text` as the model's tokenizer reads it (with its BOS
    /// where the model adds one).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, JsValue> {
        let s = self
            .state
            .try_borrow()
            .map_err(|_| invalid("LmSession::encode", "the session is busy".into()))?;
        s.lm.tokenizer.encode(text, true).map_err(js_error)
    }

    /// Continues `prompt` (plain text, no template) by up to `max_new`
    /// tokens, as `wgrad generate --prompt` does: temperature 0 is greedy;
    /// `top_k` 0 and `top_p` 1 are off; `on_token(piece, id)` gets each
    /// token as it comes. Resolves to JSON: prompt_ids, ids, text, prefill
    /// and decode counts and seconds, decode_tokens_per_s.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &self,
        prompt: String,
        max_new: u32,
        temperature: f32,
        top_k: u32,
        top_p: f32,
        seed: u32,
        on_token: Option<js_sys::Function>,
    ) -> js_sys::Promise {
        let state = self.state.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let sampling = sampling(temperature, top_k, top_p, seed)?;
            let mut guard = busy(&state, "the model")?;
            let s = &mut *guard;
            let ids = s.lm.tokenizer.encode(&prompt, true).map_err(js_error)?;
            if ids.is_empty() {
                return Err(invalid(
                    "LmSession::generate",
                    "the prompt is empty: give some text".into(),
                ));
            }
            let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
            let answer = answer(s, &ids, false, max_new as usize, &sampling, &mut rng, on_token.as_ref()).await?;
            Ok(JsValue::from_str(&answer.json(&ids)))
        })
    }

    /// One chat turn: `message` from the user after the conversation so
    /// far, answered through the model's chat template (sampling as
    /// [`LmSession::generate`]; the draws continue one stream per
    /// conversation, seeded by the first turn's `seed`). Resolves to JSON
    /// as `generate`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn chat(
        &self,
        message: String,
        max_new: u32,
        temperature: f32,
        top_k: u32,
        top_p: f32,
        seed: u32,
        on_token: Option<js_sys::Function>,
    ) -> js_sys::Promise {
        let state = self.state.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let sampling = sampling(temperature, top_k, top_p, seed)?;
            let mut guard = busy(&state, "the model")?;
            let s = &mut *guard;
            if message.trim().is_empty() {
                return Err(invalid("LmSession::chat", "the message is empty".into()));
            }
            s.messages.push(ChatMessage::user(message));
            let ids = match render(s) {
                Ok(ids) => ids,
                Err(e) => {
                    s.messages.pop();
                    return Err(e);
                }
            };
            // Keep the cache's tokens the new render starts with (all but
            // one at most, so there is a token to feed).
            let held = s.generator.cached_tokens(0).unwrap_or(&[]);
            let common = held
                .iter()
                .zip(&ids)
                .take_while(|(a, b)| a == b)
                .count()
                .min(ids.len() - 1);
            s.generator.truncate(0, common).map_err(js_error)?;
            let mut rng = match s.rng.take() {
                Some((first_seed, rng)) => (first_seed, rng),
                None => (sampling.seed, ChaCha8Rng::seed_from_u64(sampling.seed)),
            };
            let answer = answer(
                s,
                &ids[common..],
                common > 0,
                max_new as usize,
                &sampling,
                &mut rng.1,
                on_token.as_ref(),
            )
            .await;
            s.rng = Some(rng);
            let answer = answer?;
            let reply = s.lm.tokenizer.decode(&answer.tokens, true).map_err(js_error)?;
            s.messages.push(ChatMessage::assistant(reply));
            Ok(JsValue::from_str(&answer.json(&ids)))
        })
    }

    /// Starts a new conversation, with `system` as its system message
    /// when given (else the template's own, if it has one).
    pub fn reset(&self, system: Option<String>) -> Result<(), JsValue> {
        let mut s = self
            .state
            .try_borrow_mut()
            .map_err(|_| invalid("LmSession::reset", "the session is busy: await the call first".into()))?;
        s.messages = system
            .into_iter()
            .filter(|m| !m.trim().is_empty())
            .map(ChatMessage::system)
            .collect();
        s.rng = None;
        Ok(())
    }
}

/// The conversation ready for the assistant's answer, as ids; the oldest
/// turns (after a system message) are dropped until it leaves room for an
/// answer in the context (as `wgrad chat`).
fn render(s: &mut Session) -> Result<Vec<u32>, JsValue> {
    let template = s.template.as_ref().ok_or_else(|| {
        invalid(
            "LmSession::chat",
            "the model has no chat template (a base model, or a file without one): use generate".into(),
        )
    })?;
    let tokenizer = &s.lm.tokenizer;
    let (bos, eos) = (
        tokenizer.bos_token().unwrap_or_default(),
        tokenizer.eos_token().unwrap_or_default(),
    );
    let context = s.generator.context_len();
    loop {
        let text = template.render(&s.messages, true, &bos, &eos).map_err(js_error)?;
        let ids = tokenizer.encode(&text, false).map_err(js_error)?;
        if ids.len() < context {
            return Ok(ids);
        }
        let first = usize::from(s.messages.first().is_some_and(|m| m.role == "system"));
        if s.messages.len() - first <= 1 {
            return Err(invalid(
                "LmSession::chat",
                format!(
                    "the message needs {} tokens with the template, more than the context of {context}",
                    ids.len()
                ),
            ));
        }
        s.messages.remove(first);
    }
}

/// Continues what the cache holds by `new` (from position 0 unless
/// `continuation`) and samples until a stop token, `max_new` tokens or a
/// full context, passing each token's text to `on_token` as it comes (as
/// `wgrad generate` and `chat` answer).
async fn answer(
    s: &mut Session,
    new: &[u32],
    continuation: bool,
    max_new: usize,
    sampling: &Sampling,
    rng: &mut ChaCha8Rng,
    on_token: Option<&js_sys::Function>,
) -> Result<Answer, JsValue> {
    const OP: &str = "LmSession";
    if max_new == 0 {
        return Err(invalid(OP, "max_new must be at least 1".into()));
    }
    let context = s.generator.context_len();
    let held = if continuation {
        s.generator.cached_tokens(0).map_or(0, <[u32]>::len)
    } else {
        0
    };
    if held + new.len() > context {
        return Err(invalid(
            OP,
            format!(
                "{} tokens after {held} cached do not fit the context of {context}",
                new.len()
            ),
        ));
    }
    wgrad::kernels::check_token_ids(OP, new, s.lm.model.vocab_size()).map_err(js_error)?;
    let mut answer = Answer {
        prefill_tokens: new.len(),
        ..Answer::default()
    };
    let start = Instant::now();
    let mut token = if continuation {
        s.generator.extend_and_sample_async(&[new], sampling, rng).await
    } else {
        s.generator.prefill_and_sample_async(&[new], sampling, rng).await
    }
    .map_err(js_error)?[0];
    answer.prefill_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut text = s.lm.tokenizer.stream(true);
    while !s.lm.stops.contains(&token) {
        let piece = text.push(token).map_err(js_error)?;
        if let Some(f) = on_token {
            f.call2(&JsValue::NULL, &JsValue::from_str(&piece), &JsValue::from(token))?;
        }
        answer.text.push_str(&piece);
        answer.tokens.push(token);
        let held = s.generator.cached_tokens(0).map_or(0, <[u32]>::len);
        answer.context_full = held >= context;
        if answer.tokens.len() == max_new || answer.context_full {
            break;
        }
        token = s
            .generator
            .decode_and_sample_async(&[token], sampling, rng)
            .await
            .map_err(js_error)?[0];
        answer.decode_steps += 1;
    }
    answer.decode_seconds = start.elapsed().as_secs_f64();
    answer.text.push_str(&text.finish());
    Ok(answer)
}
