//! Continuous batching (`wgrad::infer::batch`) and the generator's slot
//! operations it runs on (`Generator::prefill_slot`, `decode_slots`): each
//! request gives the tokens it gives alone, whatever joins and leaves
//! around it; cancellation, stop tokens, the context's end and refusals.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::common::{for_each_adapter, rng};
use crate::generate::{llama_configs, sharp_llama};
use rand::{Rng, SeedableRng};
use wgrad::infer::batch::{BatchRequest, Event, FinishReason, Finished, Scheduler, Sink};
use wgrad::infer::generate::{Generator, GeneratorOptions, PrefillMode, Sampling, SlotStep};
use wgrad::models::{Llama, LlamaConfig};

/// Positions the serving generators' caches hold: fewer than the model's
/// 40, so the context override is in every test.
const CONTEXT: usize = 29;

/// Its first layer attends through a sliding window of 6 (the second to
/// everything, as Gemma 3 mixes them), so every slot operation runs the
/// window's cached attention at positions past it.
fn model() -> (Llama, LlamaConfig) {
    let config = LlamaConfig {
        block_size: 40,
        ..llama_configs()[0]
    };
    let mut model = sharp_llama(config, 31);
    model.layers[0].self_attn.sliding_window = Some(6);
    (model, config)
}

fn serving(k: &Arc<wgrad::Kernels>, model: &Llama, slots: usize) -> wgrad::Result<Generator> {
    let options = GeneratorOptions {
        sequences: slots,
        context: Some(CONTEXT),
        prefill: PrefillMode::OneSlot,
        ..GeneratorOptions::default()
    };
    Generator::with_options(k.clone(), model, &options)
}

/// A sink recording every event, answering `listen(tokens so far)`.
fn recorder(listen: impl Fn(usize) -> bool + Send + 'static) -> (Sink, Arc<Mutex<Vec<Event>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = events.clone();
    let sink: Sink = Box::new(move |event| {
        let mut seen = seen.lock().unwrap();
        seen.push(event);
        listen(seen.iter().filter(|e| matches!(e, Event::Token(_))).count())
    });
    (sink, events)
}

fn tokens_of(events: &[Event]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None })
        .collect()
}

fn finished(events: &[Event]) -> Finished {
    match events.last() {
        Some(Event::Done(f)) => f.clone(),
        other => panic!("the last event is {other:?}, not Done"),
    }
}

fn run_until_idle(scheduler: &mut Scheduler) -> wgrad::Result<()> {
    for _ in 0..1000 {
        if scheduler.is_idle() {
            return Ok(());
        }
        scheduler.step()?;
    }
    panic!("the scheduler is still busy after 1000 steps");
}

#[test]
fn each_request_gives_what_it_gives_alone() {
    for_each_adapter("batch: requests as alone", |k| {
        let (model, config) = model();
        let mut r = rng(5);
        // Six requests over three slots: three wait, then join as others
        // leave (different lengths), mixing greedy, top-k and top-p.
        let specs: [(usize, usize, Sampling); 6] = [
            (1, 9, Sampling::greedy()),
            (
                5,
                4,
                Sampling {
                    temperature: 0.9,
                    top_k: Some(5),
                    top_p: None,
                    seed: 11,
                },
            ),
            (
                9,
                12,
                Sampling {
                    temperature: 1.3,
                    top_k: None,
                    top_p: Some(0.8),
                    seed: 12,
                },
            ),
            (
                2,
                6,
                Sampling {
                    temperature: 0.7,
                    top_k: None,
                    top_p: None,
                    seed: 13,
                },
            ),
            (7, 15, Sampling::greedy()),
            (
                3,
                5,
                Sampling {
                    temperature: 1.0,
                    top_k: Some(3),
                    top_p: Some(0.9),
                    seed: 14,
                },
            ),
        ];
        let requests: Vec<BatchRequest> = specs
            .iter()
            .map(|&(n, max, s)| {
                BatchRequest::new(
                    (0..n).map(|_| r.random_range(0..config.vocab_size as u32)).collect(),
                    max,
                    s,
                )
            })
            .collect();
        let mut scheduler = Scheduler::new(serving(k, &model, 3)?)?;
        let mut logs = Vec::new();
        for request in &requests {
            let (sink, events) = recorder(|_| true);
            scheduler.submit(request.clone(), sink)?;
            logs.push(events);
        }
        assert_eq!((scheduler.queued(), scheduler.free_slots()), (6, 3));
        run_until_idle(&mut scheduler)?;
        assert_eq!(scheduler.free_slots(), 3);
        let stats = scheduler.stats();
        assert_eq!(stats.prefills, 6);
        assert!(
            stats.mean_batch() > 1.5,
            "the steps ran {} requests on average",
            stats.mean_batch()
        );
        // Alone: a one-sequence generator of the same context, its
        // all-sequence prefill and decode.
        let options = GeneratorOptions {
            context: Some(CONTEXT),
            ..GeneratorOptions::default()
        };
        let mut alone = Generator::with_options(k.clone(), &model, &options)?;
        for (i, (request, events)) in requests.iter().zip(&logs).enumerate() {
            let events = events.lock().unwrap();
            let want = alone.generate(&request.prompt, request.max_new_tokens, &request.sampling, |_| Ok(()))?;
            assert_eq!(
                tokens_of(&events),
                want,
                "request {i}'s tokens against the same request alone"
            );
            assert_eq!(
                finished(&events),
                Finished {
                    reason: FinishReason::Length,
                    prompt_tokens: request.prompt.len(),
                    completion_tokens: want.len()
                },
                "request {i}"
            );
        }
        Ok(())
    });
}

#[test]
fn cancelled_stopped_and_full_requests_free_their_slots() {
    for_each_adapter("batch: leaving", |k| {
        let (model, _) = model();
        let prompt = vec![3u32, 1, 4, 1, 5];
        let options = GeneratorOptions {
            context: Some(CONTEXT),
            ..GeneratorOptions::default()
        };
        let greedy =
            Generator::with_options(k.clone(), &model, &options)?
                .generate(&prompt, 20, &Sampling::greedy(), |_| Ok(()))?;
        let mut scheduler = Scheduler::new(serving(k, &model, 2)?)?;
        // A: cancelled by its flag after the first step; B: its sink stops
        // listening after 3 tokens; C waits for a slot, then stops at the
        // first token of the greedy run not seen before it; D: a prompt
        // that leaves the context room for 2 tokens.
        let a = BatchRequest::new(prompt.clone(), 20, Sampling::greedy());
        let (sink_a, events_a) = recorder(|_| true);
        let (sink_b, events_b) = recorder(|n| n < 3);
        let stop_at = (1..greedy.len())
            .find(|&i| !greedy[..i].contains(&greedy[i]))
            .expect("a new token in the greedy run");
        let c = BatchRequest {
            stop_tokens: vec![greedy[stop_at]],
            ..BatchRequest::new(prompt.clone(), 20, Sampling::greedy())
        };
        let (sink_c, events_c) = recorder(|_| true);
        let d = BatchRequest::new(vec![2; CONTEXT - 2], 20, Sampling::greedy());
        let (sink_d, events_d) = recorder(|_| true);
        let cancel_a = a.cancel.clone();
        scheduler.submit(a, sink_a)?;
        scheduler.submit(BatchRequest::new(prompt.clone(), 20, Sampling::greedy()), sink_b)?;
        scheduler.submit(c, sink_c)?;
        scheduler.submit(d, sink_d)?;
        scheduler.step()?;
        assert_eq!((scheduler.free_slots(), scheduler.queued()), (0, 2));
        cancel_a.store(true, Ordering::Relaxed);
        run_until_idle(&mut scheduler)?;
        let (a, b, c, d) = (
            events_a.lock().unwrap(),
            events_b.lock().unwrap(),
            events_c.lock().unwrap(),
            events_d.lock().unwrap(),
        );
        assert_eq!(
            finished(&a),
            Finished {
                reason: FinishReason::Cancelled,
                prompt_tokens: 5,
                completion_tokens: 2
            }
        );
        assert_eq!(tokens_of(&a), greedy[..2]);
        assert_eq!(
            finished(&b),
            Finished {
                reason: FinishReason::Cancelled,
                prompt_tokens: 5,
                completion_tokens: 3
            }
        );
        assert_eq!(
            finished(&c),
            Finished {
                reason: FinishReason::Stop,
                prompt_tokens: 5,
                completion_tokens: stop_at
            }
        );
        assert_eq!(tokens_of(&c), greedy[..stop_at], "C's tokens before its stop token");
        assert_eq!(finished(&d).reason, FinishReason::Length);
        assert_eq!(finished(&d).completion_tokens, 2, "the context's end");
        assert_eq!(scheduler.free_slots(), 2);

        // Refused before queueing: no event.
        for (request, why) in [
            (BatchRequest::new(vec![], 4, Sampling::greedy()), "empty"),
            (
                BatchRequest::new(vec![1; CONTEXT], 4, Sampling::greedy()),
                "context holds",
            ),
            (BatchRequest::new(vec![1, 37], 4, Sampling::greedy()), "37"),
            (BatchRequest::new(vec![1], 0, Sampling::greedy()), "max_new_tokens"),
        ] {
            let (sink, events) = recorder(|_| true);
            let err = scheduler.submit(request, sink).expect_err(why).to_string();
            assert!(err.contains(why), "{err}");
            assert!(events.lock().unwrap().is_empty());
        }
        // end_all ends running and waiting requests alike.
        let mut logs = Vec::new();
        for _ in 0..3 {
            let (sink, events) = recorder(|_| true);
            scheduler.submit(BatchRequest::new(prompt.clone(), 20, Sampling::greedy()), sink)?;
            logs.push(events);
        }
        scheduler.step()?;
        scheduler.end_all(FinishReason::Failed("shutting down".into()));
        assert!(scheduler.is_idle());
        for events in &logs {
            assert_eq!(
                finished(&events.lock().unwrap()).reason,
                FinishReason::Failed("shutting down".into())
            );
        }
        Ok(())
    });
}

#[test]
fn slot_operations_refuse_what_they_cannot_do() {
    for_each_adapter("batch: slot refusals", |k| {
        let (model, _) = model();
        for context in [0, 41] {
            let options = GeneratorOptions {
                context: Some(context),
                ..GeneratorOptions::default()
            };
            let err = Generator::with_options(k.clone(), &model, &options)
                .expect_err("a context outside 1..=40")
                .to_string();
            assert!(err.contains(&format!("{context} positions")), "{err}");
        }
        let mut all = Generator::with_options(
            k.clone(),
            &model,
            &GeneratorOptions {
                sequences: 2,
                context: Some(CONTEXT),
                ..GeneratorOptions::default()
            },
        )?;
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let err = all
            .prefill_slot(0, &[1, 2], &Sampling::greedy(), &mut r)
            .expect_err("all-sequence generator")
            .to_string();
        assert!(err.contains("OneSlot"), "{err}");
        assert!(Scheduler::new(all).is_err());

        let mut slots = serving(k, &model, 2)?;
        let err = slots.prefill(&[&[1]]).expect_err("one-slot generator").to_string();
        assert!(err.contains("prefill_slot"), "{err}");
        let err = slots
            .prefill_slot(2, &[1], &Sampling::greedy(), &mut r)
            .expect_err("slot 2 of 2")
            .to_string();
        assert!(err.contains("2 of a generator of 2"), "{err}");
        // Slot 0 fills its context, then cannot sit a step out.
        let first = slots.prefill_slot(0, &[1; CONTEXT], &Sampling::greedy(), &mut r)?;
        assert!(first < 37);
        let greedy = Sampling::greedy();
        let mut steps = vec![
            None,
            Some(SlotStep {
                token: 1,
                sampling: &greedy,
                rng: &mut r,
            }),
        ];
        let err = slots
            .decode_slots(&mut steps)
            .expect_err("a full slot sitting out")
            .to_string();
        assert!(err.contains("slot 0") && err.contains("full"), "{err}");
        slots.truncate(0, 0)?;
        let tokens = slots.decode_slots(&mut steps)?;
        assert!(tokens[0].is_none() && matches!(tokens[1], Some(Ok(t)) if t < 37));
        assert_eq!(slots.cached_tokens(1), Some(&[1][..]));
        // A step computes the slots up to the highest stepping one: slot 3
        // of 4, full, is not among slot 0's step's rows; slot 0 then moves.
        let mut four = serving(k, &model, 4)?;
        four.prefill_slot(3, &[2; CONTEXT], &Sampling::greedy(), &mut r)?;
        let token = four.prefill_slot(0, &[1, 2, 3], &Sampling::greedy(), &mut r)?;
        let mut steps = vec![
            Some(SlotStep {
                token,
                sampling: &greedy,
                rng: &mut r,
            }),
            None,
            None,
            None,
        ];
        let next = four.decode_slots(&mut steps)?;
        assert!(matches!(next[0], Some(Ok(_))) && next[1..].iter().all(Option::is_none));
        four.move_slot(0, 2)?;
        assert_eq!(
            (four.cached_tokens(0), four.cached_tokens(2)),
            (Some(&[][..]), Some(&[1, 2, 3, token][..]))
        );
        // Keys and values: 2 layers × 2 caches × [slots, 2 KV heads, 29, 6].
        let (caches, staging) = slots.cache_bytes();
        assert_eq!(
            (caches, staging),
            (
                2 * 2 * 2 * 2 * CONTEXT as u64 * 6 * 4,
                2 * 2 * 2 * CONTEXT as u64 * 6 * 4
            )
        );
        Ok(())
    });
}
