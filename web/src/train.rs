//! `make train`'s Shakespeare GPT in a page: the run `wgrad train` makes by
//! default (its config, seed, data windows and validation windows), built
//! by the library's one training run and stepped one awaited step at a
//! time, so the page draws between steps.

// A call's `RefCell` borrow, held across its awaits, is the object's
// one-call-at-a-time lock: a second call takes it with `try_borrow_mut`
// ([`crate::busy`]) and gets an error saying the object is busy, never a
// panic.
#![allow(clippy::await_holding_refcell_ref)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use wasm_bindgen::prelude::*;
use wgrad::infer::generate::{Generator, GeneratorOptions, Sampling};
use wgrad::io::text::{gunzip_text, Utf8Stream};
use wgrad::models::Gpt;
use wgrad::train::{language_model_run, LanguageModel, TextSource, TrainConfig, TrainingRun, MAKE_TRAIN_GPT};
use wgrad::Kernels;

use crate::{busy, invalid, js_error, Gpu};

/// What a step needs: the run, and the steps taken so far.
struct Training {
    run: TrainingRun<LanguageModel<Gpt>>,
    taken: u64,
}

/// The GPT of `make train` (4 layers, 4 heads, 128 channels, 64-token
/// windows, the text's characters as its vocabulary), AdamW with
/// nanoGPT's warmup, cosine decay and clipping over 750 steps of 8
/// windows, the validation loss on 16 batches of held-out windows.
#[wasm_bindgen]
pub struct GptTrainer {
    state: Rc<RefCell<Training>>,
    kernels: Arc<Kernels>,
    last_step: u64,
    seed: u64,
    summary: String,
}

/// `wgrad train`'s default run with `seed` (`--seed`).
pub fn shakespeare_run(seed: u64) -> TrainConfig {
    TrainConfig {
        seed,
        ..language_model_run()
    }
}

#[wasm_bindgen]
impl GptTrainer {
    /// Prepares the run on `gpu`: `text` is `data/shakespeare.txt.gz` as
    /// the page fetched it (any gzip-compressed or plain UTF-8 text
    /// trains the same way), `seed` is `wgrad train --seed`'s. Builds the
    /// model and its training step; nothing waits for the GPU yet.
    #[wasm_bindgen(constructor)]
    pub fn new(gpu: &Gpu, text: &[u8], seed: u32) -> Result<GptTrainer, JsValue> {
        // gzip's magic bytes; anything else is read as plain text.
        let text = if text.starts_with(&[0x1f, 0x8b]) {
            gunzip_text("GptTrainer", text).map_err(js_error)?
        } else {
            String::from_utf8(text.to_vec())
                .map_err(|e| invalid("GptTrainer", format!("the text is neither gzip nor UTF-8: {e}")))?
        };
        let config = shakespeare_run(u64::from(seed));
        let task = LanguageModel::<Gpt> {
            text: TextSource::Text(text),
            ..LanguageModel::new(MAKE_TRAIN_GPT)
        };
        let kernels = gpu.kernels().clone();
        let run = TrainingRun::with_kernels(kernels.clone(), config, task, &mut ()).map_err(js_error)?;
        let info = run.info();
        let summary = serde_json::json!({
            "model": info.model,
            "parameters": info.parameters,
            "optimizer": info.optimizer,
            "data": info.data,
            "batch_size": info.batch_size,
            "tokens_per_step": info.per_step,
            "steps": info.steps,
            "engine": info.engine,
            "device": info.devices,
        })
        .to_string();
        Ok(GptTrainer {
            last_step: info.steps,
            state: Rc::new(RefCell::new(Training { run, taken: 0 })),
            kernels,
            seed: u64::from(seed),
            summary,
        })
    }

    /// The run as `wgrad train` prints it before its first step, as JSON:
    /// model, parameters, optimizer, data, batch size, tokens per step,
    /// steps, engine, device.
    pub fn describe(&self) -> String {
        self.summary.clone()
    }

    /// The run's last step (750).
    #[wasm_bindgen(getter, js_name = lastStep)]
    pub fn last_step(&self) -> f64 {
        self.last_step as f64
    }

    /// Steps taken so far.
    #[wasm_bindgen(getter)]
    pub fn steps(&self) -> f64 {
        self.state.try_borrow().map_or(f64::NAN, |s| s.taken as f64)
    }

    /// One training step: the next 8 random windows, forward, backward and
    /// the AdamW update in one submission; resolves to its loss once read
    /// back. Past the run's last step it is an error.
    pub fn step(&self) -> js_sys::Promise {
        let (state, last) = (self.state.clone(), self.last_step);
        wasm_bindgen_futures::future_to_promise(async move {
            let mut s = busy(&state, "the trainer")?;
            if s.taken >= last {
                return Err(invalid("GptTrainer::step", format!("the run's {last} steps are done")));
            }
            let loss = s.run.step_async(true).await.map_err(js_error)?;
            s.taken += 1;
            let loss = loss.ok_or_else(|| invalid("GptTrainer::step", "no loss came back".into()))?;
            Ok(JsValue::from_f64(f64::from(loss)))
        })
    }

    /// The validation loss now: the mean over the run's fixed held-out
    /// windows (what `wgrad train` prints every 125 steps).
    pub fn evaluate(&self) -> js_sys::Promise {
        let state = self.state.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let mut s = busy(&state, "the trainer")?;
            let loss = s.run.validation_loss_async().await.map_err(js_error)?;
            let loss = loss.ok_or_else(|| invalid("GptTrainer::evaluate", "the run has no validation".into()))?;
            Ok(JsValue::from_f64(f64::from(loss)))
        })
    }

    /// `tokens` characters of the model as trained so far after a newline,
    /// as `wgrad train` samples at its end (temperature 0.8, top-k 40, the
    /// run's seed); `on_piece(text)` gets the text as it comes. Resolves
    /// to the whole sample.
    pub fn sample(&self, tokens: u32, on_piece: Option<js_sys::Function>) -> js_sys::Promise {
        let (state, kernels, seed) = (self.state.clone(), self.kernels.clone(), self.seed);
        wasm_bindgen_futures::future_to_promise(async move {
            let s = busy(&state, "the trainer")?;
            let text = sample(&s.run, kernels, tokens as usize, seed, on_piece.as_ref()).await?;
            Ok(JsValue::from_str(&text))
        })
    }
}

/// The trained model's sample (see [`GptTrainer::sample`]): the prompt
/// and what follows it.
async fn sample(
    run: &TrainingRun<LanguageModel<Gpt>>,
    kernels: Arc<Kernels>,
    tokens: usize,
    seed: u64,
    on_piece: Option<&js_sys::Function>,
) -> Result<String, JsValue> {
    if tokens == 0 {
        return Err(invalid("GptTrainer::sample", "ask for at least 1 token".into()));
    }
    let task = run.task();
    let params = run.parameters_async().await.map_err(js_error)?;
    let model = task.model_with(run.model(), &params).map_err(js_error)?;
    let tokenizer = task
        .text_tokenizer()
        .ok_or_else(|| invalid("GptTrainer::sample", "the run has no tokenizer".into()))?;
    let prompt = task.sample_prompt().map_err(js_error)?;
    let ids = tokenizer.encode(&prompt).map_err(js_error)?;
    let mut generator = Generator::with_options(kernels, &model, &GeneratorOptions::default()).map_err(js_error)?;
    let sampling = Sampling {
        temperature: 0.8,
        top_k: Some(40),
        top_p: None,
        seed,
    };
    let mut text = prompt.clone();
    let mut stream = Utf8Stream::default();
    generator
        .generate_async(&ids, tokens, &sampling, |token| {
            let piece = stream.push(&tokenizer.decode_bytes(&[token])?);
            if let Some(f) = on_piece {
                f.call1(&JsValue::NULL, &JsValue::from_str(&piece))
                    .map_err(|e| wgrad::Error::InvalidArgument {
                        op: "GptTrainer::sample",
                        reason: format!("the page's on_piece threw: {e:?}"),
                    })?;
            }
            text.push_str(&piece);
            Ok(())
        })
        .await
        .map_err(js_error)?;
    text.push_str(&stream.finish());
    Ok(text)
}
