//! Token sampling on the GPU (`Kernels::sample_rows`, `Graph::sample_tokens`,
//! `Generator::decode_and_sample`) against its CPU twin (`cpu::sample_rows`)
//! and the host sampler (`Sampling::sample`). Greedy picks and errors must
//! agree exactly; a sampled pick must agree wherever the draw is not within
//! rounding of a boundary between two candidates: the GPU sums the weights
//! in f32, the twin in f64.

use std::sync::Arc;

use crate::common;

use common::{for_each_adapter, rng};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use wgrad::graph::{Executor, Graph};
use wgrad::infer::generate::{Generator, Sampling};
use wgrad::kernels::NO_TOKEN;
use wgrad::models::{Gpt, GptConfig};
use wgrad::nn::{self};
use wgrad::{cpu, Error, Kernels};

/// How close (relative to Σw) a draw's target u·Σw may come to a boundary
/// between two candidates' cumulative weights before the f32 and f64 sums
/// may disagree on the side it falls: f32 exp and sums over ≤ 50257 terms
/// in chunks of ≤ 197 err by ~1e-6 relative.
const BOUNDARY_MARGIN: f64 = 1e-5;

/// Whether u·Σw lies within [`BOUNDARY_MARGIN`]·Σw of a boundary between
/// two candidates of `logits` (cumulative weights in id order, in f64), or
/// the nucleus's edge is within rounding of top_p ([`near_the_nucleus_edge`]).
fn near_a_boundary(logits: &[f32], u: f32, temperature: f32, top_k: u32, top_p: f32) -> bool {
    if near_the_nucleus_edge(logits, temperature, top_k, top_p) {
        return true;
    }
    let candidates = cpu::sampling_candidates(logits, temperature, top_k, top_p);
    let total: f64 = candidates.iter().map(|&(_, w)| w).sum();
    let target = f64::from(u) * total;
    let mut running = 0.0;
    candidates[..candidates.len() - 1].iter().any(|&(_, w)| {
        running += w;
        (running - target).abs() <= BOUNDARY_MARGIN * total
    })
}

/// Whether some most-likely-first prefix of the top-k candidates holds a
/// share of their Σw within [`NUCLEUS_MARGIN`] of `top_p` (below 1): the
/// GPU's f32 sums and the twin's f64 may then cut the nucleus at
/// neighbouring candidates.
fn near_the_nucleus_edge(logits: &[f32], temperature: f32, top_k: u32, top_p: f32) -> bool {
    if !(top_p < 1.0 && temperature > 0.0) {
        return false;
    }
    let mut weights: Vec<f64> = cpu::sampling_candidates(logits, temperature, top_k, 1.0)
        .into_iter()
        .map(|(_, w)| w)
        .collect();
    weights.sort_by(|a, b| b.total_cmp(a));
    let total: f64 = weights.iter().sum();
    let mut running = 0.0;
    weights.iter().any(|&w| {
        running += w;
        (running / total - f64::from(top_p)).abs() <= NUCLEUS_MARGIN
    })
}

/// The kernel on `logits` [rows, vocab] with (u, temperature, top_p) per row and
/// top_k per row: out [rows, 2].
fn sample_on_gpu(
    k: &Kernels,
    logits: &[f32],
    draws: &[f32],
    top_k: &[u32],
    rows: usize,
    vocab: usize,
) -> wgrad::Result<Vec<u32>> {
    let (logits_gpu, draws_gpu, top_k_gpu) = (k.upload(logits)?, k.upload(draws)?, k.upload(top_k)?);
    let out = k.upload(&vec![7u32; 2 * rows])?;
    k.run(&[&k.sample_rows(
        out.view(),
        logits_gpu.view(),
        draws_gpu.view(),
        top_k_gpu.view(),
        rows,
        vocab,
    )?])?;
    k.read::<u32>(out.view())
}

/// Logits from `levels` distinct values (many ties) when given, else
/// continuous in [-4, 4).
fn random_logits(r: &mut ChaCha8Rng, n: usize, levels: Option<u32>) -> Vec<f32> {
    match levels {
        Some(levels) => (0..n).map(|_| r.random_range(0..levels) as f32 * 0.75 - 2.0).collect(),
        None => (0..n).map(|_| r.random_range(-4.0..4.0)).collect(),
    }
}

#[test]
fn greedy_picks_equal_the_twin_exactly_ties_included() {
    for_each_adapter("sample_rows greedy", |k| {
        for (case, &vocab) in [1usize, 2, 7, 97, 1000, 50257].iter().enumerate() {
            for rows in [1usize, 3] {
                let mut r = rng(100 + case as u64 * 2 + rows as u64);
                // Few levels: the maximum is shared by several ids, in
                // different lanes' chunks for the long rows.
                let mut logits = random_logits(&mut r, rows * vocab, Some(4));
                if rows == 3 && vocab > 1 {
                    // A row of zeros of both signs: −0 and +0 are equal, so
                    // its first id is the first maximum.
                    logits[vocab..2 * vocab]
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 });
                }
                // Temperature 0, or any temperature with k = 1 (greedy too).
                let draws: Vec<f32> = (0..rows)
                    .flat_map(|row| [r.random::<f32>(), if row == 1 { 1.5 } else { 0.0 }, 1.0])
                    .collect();
                let top_k: Vec<u32> = (0..rows)
                    .map(|row| {
                        if row == 1 {
                            1
                        } else {
                            r.random_range(0..vocab as u32 + 2)
                        }
                    })
                    .collect();
                let got = sample_on_gpu(k, &logits, &draws, &top_k, rows, vocab)?;
                let want = cpu::sample_rows(&logits, &draws, &top_k, rows, vocab);
                // Exact: the first maximum is an integer.
                assert_eq!(got, want, "vocab {vocab}, rows {rows}");
                assert_eq!(want[1], NO_TOKEN);
            }
        }
        Ok(())
    });
}

/// (vocab, rows, logit levels or continuous, top_k values): k of 1, 2, 5
/// and the whole vocabulary, and with few levels k past the number of
/// distinct values, which cuts a group of equal logits at the boundary.
const SAMPLED_CASES: [(usize, usize, Option<u32>, &[u32]); 6] = [
    (2, 64, None, &[1, 2]),
    (7, 64, Some(3), &[1, 2, 5, 7]),
    (97, 48, None, &[2, 5, 97]),
    (97, 48, Some(5), &[2, 7, 40, 97]),
    (1000, 32, Some(6), &[5, 300, 1000]),
    (50257, 4, None, &[5, 40, 50257]),
];

#[test]
fn sampled_picks_equal_the_twin_away_from_boundaries() {
    for_each_adapter("sample_rows sampled", |k| {
        let (mut draws_checked, mut skipped, mut expected_skips) = (0usize, 0usize, 0.0f64);
        for (case, &(vocab, rows, levels, ks)) in SAMPLED_CASES.iter().enumerate() {
            for &top_k in ks {
                let mut r = rng(200 + case as u64 * 10 + u64::from(top_k));
                let logits = random_logits(&mut r, rows * vocab, levels);
                let draws: Vec<f32> = (0..rows)
                    .flat_map(|_| [r.random::<f32>(), r.random_range(0.3..3.0), 1.0])
                    .collect();
                let ks = vec![top_k; rows];
                let got = sample_on_gpu(k, &logits, &draws, &ks, rows, vocab)?;
                let want = cpu::sample_rows(&logits, &draws, &ks, rows, vocab);
                for row in 0..rows {
                    let what = format!(
                        "vocab {vocab}, k {top_k}, row {row}, draw {:?}",
                        &draws[3 * row..3 * row + 3]
                    );
                    assert_eq!(got[2 * row + 1], NO_TOKEN, "{what}: no logit is bad");
                    let logits_row = &logits[row * vocab..(row + 1) * vocab];
                    // u·Σw is uniform over [0, Σw): each interior boundary
                    // catches 2·BOUNDARY_MARGIN of the draws.
                    expected_skips += 2.0 * BOUNDARY_MARGIN * (top_k.min(vocab as u32) - 1) as f64;
                    if near_a_boundary(logits_row, draws[3 * row], draws[3 * row + 1], top_k, 1.0) {
                        skipped += 1;
                        continue;
                    }
                    draws_checked += 1;
                    // Exact away from a boundary (BOUNDARY_MARGIN).
                    assert_eq!(got[2 * row], want[2 * row], "{what}");
                }
            }
        }
        assert!(
            (skipped as f64) <= 3.0 * expected_skips + 2.0 && draws_checked > 700,
            "{skipped} draws near a boundary skipped (about {expected_skips:.1} expected), {draws_checked} checked"
        );
        Ok(())
    });
}

/// How close (relative to Σw) a most-likely-first prefix's mass may come
/// to top_p·Σw before the f32 and f64 sums may cut the nucleus at
/// neighbouring candidates: the GPU's masses are sums like Σw's.
const NUCLEUS_MARGIN: f64 = 3e-6;

/// (vocab, rows, logit levels or continuous, top_k, top_p values, the
/// temperatures' range): the nucleus alone and inside a top-k, with ties
/// cut at its edge (few levels), p from a sliver to nearly all. The large
/// vocabulary is sampled cold: at temperature 1 its 49152 candidates'
/// masses lie ~2e-5 apart, within rounding of any p.
const NUCLEUS_CASES: [(usize, usize, Option<u32>, u32, &[f32], (f32, f32)); 6] = [
    (1, 8, None, 1, &[0.3, 1.0], (0.3, 2.0)),
    (7, 48, Some(3), 7, &[0.05, 0.5, 0.9], (0.3, 2.0)),
    (97, 32, None, 97, &[0.2, 0.75, 0.999], (0.3, 2.0)),
    (97, 32, Some(5), 40, &[0.3, 0.8], (0.3, 2.0)),
    (1000, 16, None, 300, &[0.1, 0.95], (0.3, 2.0)),
    (49152, 3, None, 49152, &[0.5, 0.9], (0.2, 0.3)),
];

#[test]
fn nucleus_picks_equal_the_twin_away_from_boundaries() {
    for_each_adapter("sample_rows top-p", |k| {
        let (mut checked, mut skipped) = (0usize, Vec::new());
        for (case, &(vocab, rows, levels, top_k, ps, (cold, hot))) in NUCLEUS_CASES.iter().enumerate() {
            for (i, &top_p) in ps.iter().enumerate() {
                let mut r = rng(700 + case as u64 * 10 + i as u64);
                let logits = random_logits(&mut r, rows * vocab, levels);
                let draws: Vec<f32> = (0..rows)
                    .flat_map(|_| [r.random::<f32>(), r.random_range(cold..hot), top_p])
                    .collect();
                let ks = vec![top_k; rows];
                let got = sample_on_gpu(k, &logits, &draws, &ks, rows, vocab)?;
                let want = cpu::sample_rows(&logits, &draws, &ks, rows, vocab);
                for row in 0..rows {
                    let setting = &draws[3 * row..3 * row + 3];
                    if near_a_boundary(
                        &logits[row * vocab..(row + 1) * vocab],
                        setting[0],
                        setting[1],
                        top_k,
                        top_p,
                    ) {
                        skipped.push((
                            vocab,
                            setting.to_vec(),
                            near_the_nucleus_edge(&logits[row * vocab..(row + 1) * vocab], setting[1], top_k, top_p),
                        ));
                        continue;
                    }
                    checked += 1;
                    // Exact away from a boundary and the nucleus's edge.
                    assert_eq!(
                        got[2 * row..2 * row + 2],
                        want[2 * row..2 * row + 2],
                        "vocab {vocab}, k {top_k}, row {row}, settings {setting:?}"
                    );
                }
            }
        }
        assert!(
            skipped.len() <= 3 && checked > 300,
            "{skipped:?} draws near a boundary skipped, {checked} checked"
        );
        Ok(())
    });
}

#[test]
fn a_top_p_of_one_is_no_top_p_and_a_tiny_one_is_greedy() {
    for_each_adapter("generate with top-p", |k| {
        let mut generator = Generator::new(Arc::clone(k), &model(37), 1)?;
        let prompt = [2, 7, 1, 8];
        let max_new = 2 * CONFIG.block_size;
        let all = Sampling {
            temperature: 1.0,
            top_k: Some(9),
            top_p: None,
            seed: 38,
        };
        let unsampled = generator.generate(&prompt, max_new, &all, |_| Ok(()))?;
        assert_eq!(
            generator.generate(
                &prompt,
                max_new,
                &Sampling {
                    top_p: Some(1.0),
                    ..all
                },
                |_| Ok(())
            )?,
            unsampled,
            "top_p 1"
        );
        let distinct: std::collections::BTreeSet<u32> = unsampled.iter().copied().collect();
        assert!(distinct.len() > 2, "{all:?} sampled only {distinct:?}");
        // Below the most likely token's probability, the nucleus is that
        // token: greedy, whatever the temperature and the draws.
        let greedy = generator.generate(&prompt, max_new, &Sampling::greedy(), |_| Ok(()))?;
        for (temperature, seed) in [(1.0, 39), (3.0, 40)] {
            let tiny = Sampling {
                temperature,
                top_k: None,
                top_p: Some(1e-6),
                seed,
            };
            assert_eq!(
                generator.generate(&prompt, max_new, &tiny, |_| Ok(()))?,
                greedy,
                "{tiny:?}"
            );
        }
        Ok(())
    });
}

#[test]
fn draws_hit_every_top_k_candidate_and_nothing_else() {
    // Ids 1 and 3 share the maximum, 4 and 6 the next value: k = 3 takes
    // id 4 but not 6. At temperature 1 the weights are 1, 1, e^-0.5 twice,
    // then 0.08, 0.05, 0.02 (Σ 3.36): top-p 0.5 keeps ids 1 and 3 (2.0 ≥
    // 1.68), top-p 0.7 id 4 too but not 6 (2.61 ≥ 2.35).
    let logits = [0.5, 3.0, -1.0, 3.0, 2.5, 0.0, 2.5];
    // 800 rows: a workgroup each, which SwiftShader runs slowly (its
    // barriers are emulated); the draws are seeded, so the shares below
    // are the same every run.
    let (vocab, rows) = (logits.len(), 800);
    for_each_adapter("sample_rows distribution", |k| {
        let cases = [
            (3u32, 2.0f32, 1.0f32, vec![1u32, 3, 4]),
            (5, 0.7, 1.0, vec![0, 1, 3, 4, 6]),
            (7, 4.0, 1.0, (0..7).collect()),
            (7, 1.0, 0.5, vec![1, 3]),
            (7, 1.0, 0.7, vec![1, 3, 4]),
        ];
        for (top_k, temperature, top_p, candidates) in cases {
            let mut r = rng(300 + u64::from(top_k));
            let all: Vec<f32> = logits.iter().copied().cycle().take(rows * vocab).collect();
            let draws: Vec<f32> = (0..rows)
                .flat_map(|_| [r.random::<f32>(), temperature, top_p])
                .collect();
            let got = sample_on_gpu(k, &all, &draws, &vec![top_k; rows], rows, vocab)?;
            let weights: Vec<f64> = candidates
                .iter()
                .map(|&i| ((f64::from(logits[i as usize]) - 3.0) / f64::from(temperature)).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            for (&id, &w) in candidates.iter().zip(&weights) {
                let share = got.chunks(2).filter(|pick| pick[0] == id).count() as f64 / rows as f64;
                // 800 draws: the share's standard deviation is ≤ 0.018,
                // so 0.05 is 2.8 of them.
                assert!(
                    (share - w / total).abs() < 0.05,
                    "k {top_k}, p {top_p}: id {id} drawn {share}, probability {}",
                    w / total
                );
            }
            let strays: Vec<u32> = got
                .chunks(2)
                .map(|pick| pick[0])
                .filter(|id| !candidates.contains(id))
                .collect();
            assert!(
                strays.is_empty(),
                "k {top_k}, p {top_p}: non-candidates drawn: {strays:?}"
            );
        }
        Ok(())
    });
}

#[test]
fn a_logit_that_is_not_finite_is_reported_by_its_first_column() {
    for_each_adapter("sample_rows non-finite", |k| {
        let vocab = 1000;
        // (columns made bad, in that order; the first by id is reported).
        let rows_bad: [&[(usize, f32)]; 5] = [
            &[(2, f32::NAN)],
            &[(700, f32::INFINITY), (300, f32::NEG_INFINITY)],
            &[(999, f32::NAN)],
            &[],
            &[(0, f32::INFINITY)],
        ];
        let rows = rows_bad.len();
        let mut logits = random_logits(&mut rng(400), rows * vocab, None);
        for (row, bad) in rows_bad.iter().enumerate() {
            for &(column, value) in *bad {
                logits[row * vocab + column] = value;
            }
        }
        let draws: Vec<f32> = (0..rows)
            .flat_map(|row| [0.5, if row % 2 == 0 { 1.0 } else { 0.0 }, 0.9])
            .collect();
        let got = sample_on_gpu(k, &logits, &draws, &[10, 1000, 1, 10, 3], rows, vocab)?;
        let want: Vec<[u32; 2]> = vec![
            [NO_TOKEN, 2],
            [NO_TOKEN, 300],
            [NO_TOKEN, 999],
            [
                cpu::sample_row(&logits[3 * vocab..4 * vocab], 0.5, 0.0, 10, 0.9).0,
                NO_TOKEN,
            ],
            [NO_TOKEN, 0],
        ];
        assert_eq!(got, want.concat());
        assert_eq!(
            got,
            cpu::sample_rows(&logits, &draws, &[10, 1000, 1, 10, 3], rows, vocab)
        );
        Ok(())
    });
}

#[test]
fn the_kernel_checks_its_operands() {
    for_each_adapter("sample_rows errors", |k| {
        let (logits, draws, top_k, out) = (k.zeros(3 * 5)?, k.zeros(9)?, k.zeros(3)?, k.zeros(6)?);
        let short = k.zeros(6)?;
        let err = k
            .sample_rows(out.view(), logits.view(), short.view(), top_k.view(), 3, 5)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Shape {
                    op: "sample_rows_forward",
                    ..
                }
            ) && err.to_string().contains("`draws` has 6 elements, want 9"),
            "{err}"
        );
        let err = k
            .sample_rows(out.view(), logits.view(), draws.view(), top_k.view(), 3, 4)
            .unwrap_err();
        assert!(err.to_string().contains("`logits` has 15 elements, want 12"), "{err}");
        assert!(k
            .sample_rows(out.view(), logits.view(), draws.view(), top_k.view(), 0, 5)
            .is_err());
        Ok(())
    });
}

#[test]
fn the_host_sampler_is_the_twin() {
    // Sampling::sample draws one f32 per call and computes in f64 as the
    // twin does: the same pick, exactly, on every draw.
    let mut r = rng(500);
    for case in 0..300 {
        let vocab = r.random_range(1..60);
        let logits = random_logits(&mut r, vocab, (case % 2 == 0).then_some(4));
        let temperature = if case % 5 == 0 { 0.0 } else { r.random_range(0.2..3.0) };
        let top_k = if case % 3 == 0 {
            None
        } else {
            Some(r.random_range(1..vocab + 3))
        };
        let top_p = if case % 4 == 0 {
            None
        } else {
            Some(r.random_range(0.01f32..=1.0))
        };
        let sampling = Sampling {
            temperature,
            top_k,
            top_p,
            seed: case,
        };
        let mut draws = rng(case);
        let u: f32 = draws.clone().random();
        let picked = sampling.sample(&logits, &mut draws).expect("finite logits");
        let k = top_k.unwrap_or(vocab).min(vocab) as u32;
        assert_eq!(
            picked,
            cpu::sample_row(&logits, u, temperature, k, top_p.unwrap_or(1.0)).0,
            "case {case}: {sampling:?} on {logits:?}"
        );
    }
}

#[test]
fn the_graph_op_samples_through_an_executor_without_rebuilding() {
    for_each_adapter("sample_tokens in a graph", |k| {
        let (rows, vocab) = (3, 37);
        let mut g = Graph::new();
        let logits = g.input("logits", &[rows, 1, vocab])?;
        let draws = g.input("draws", &[rows, 3])?;
        let top_k = g.ids("top_k", &[rows])?;
        let tokens = g.sample_tokens(logits, draws, top_k)?;
        assert_eq!(g.shape_of(tokens), Some(&[rows, 2][..]));
        let mut exec = Executor::new(Arc::clone(k), g, &[tokens], None, None)?;
        let mut r = rng(600);
        let values = random_logits(&mut r, rows * vocab, Some(8));
        exec.set_input(logits, &values)?;
        // Different settings each run, from inputs: the graph is built once.
        for (run, (temperature, ks)) in [(0.0, [37, 37, 37]), (1.0, [1, 5, 37]), (0.5, [3, 2, 36])]
            .into_iter()
            .enumerate()
        {
            let host_draws: Vec<f32> = (0..rows).flat_map(|_| [r.random::<f32>(), temperature, 1.0]).collect();
            exec.set_input(draws, &host_draws)?;
            exec.set_labels(top_k, &ks)?;
            exec.run(&[tokens])?;
            let got = exec.read_u32(tokens)?;
            let want = cpu::sample_rows(&values, &host_draws, &ks, rows, vocab);
            for row in 0..rows {
                let row_logits = &values[row * vocab..(row + 1) * vocab];
                if !near_a_boundary(row_logits, host_draws[3 * row], temperature, ks[row], 1.0) {
                    assert_eq!(
                        got[2 * row..2 * row + 2],
                        want[2 * row..2 * row + 2],
                        "run {run}, row {row}"
                    );
                }
            }
        }
        Ok(())
    });
}

#[test]
fn the_graph_op_checks_shapes_and_has_no_gradient() {
    let mut g = Graph::new();
    let logits = g.input("logits", &[4, 10]).unwrap();
    let draws = g.input("draws", &[4, 3]).unwrap();
    let top_k = g.ids("top_k", &[4]).unwrap();
    let shape_error = |result: wgrad::Result<_>, shapes: &[&[usize]]| match result {
        Err(Error::Shape { op, shapes: got, .. }) => {
            assert_eq!(op, "sample_tokens");
            assert_eq!(got, shapes.iter().map(|s| s.to_vec()).collect::<Vec<_>>());
        }
        other => panic!("expected a shape error, got {other:?}"),
    };
    let narrow = g.input("narrow draws", &[4, 2]).unwrap();
    shape_error(g.sample_tokens(logits, narrow, top_k), &[&[4, 10], &[4, 2], &[4]]);
    let few = g.ids("few", &[3]).unwrap();
    shape_error(g.sample_tokens(logits, draws, few), &[&[4, 10], &[4, 3], &[3]]);
    let float_k = g.input("float k", &[4]).unwrap();
    shape_error(g.sample_tokens(logits, draws, float_k), &[&[4, 10], &[4, 3], &[4]]);
    let flat = g.input("flat", &[10]).unwrap();
    shape_error(g.sample_tokens(flat, draws, top_k), &[&[10], &[4, 3], &[4]]);
    assert!(g.sample_tokens(logits, top_k, top_k).is_err(), "u32 draws");

    let weights = g.parameter("w", &[4, 10], vec![0.0; 40]).unwrap();
    let tokens = g.sample_tokens(weights, draws, top_k).unwrap();
    let seed = g.constant("seed", &[4, 2], vec![1.0; 8]).unwrap();
    match g.backward_from(tokens, seed, &[]) {
        Err(Error::NoGradient { op, .. }) => assert_eq!(op, "sample_tokens"),
        other => panic!("expected NoGradient, got {other:?}"),
    }
}

const CONFIG: GptConfig = GptConfig {
    vocab_size: 37,
    block_size: 13,
    n_layer: 2,
    n_head: 3,
    n_embd: 24,
};

/// A GPT whose logits are spread over several units, so that a top-k
/// draw at temperature 1 has more than one likely candidate.
fn model(seed: u64) -> Gpt {
    nn::manual_seed(seed);
    let mut model = Gpt::new(CONFIG).expect("valid config");
    model.wte.weight.iter_mut().for_each(|w| *w *= 4.0);
    model
}

/// What `Generator::generate` does, step by step, with the logits read
/// back and each token picked by `Sampling::sample` from the same seed.
/// Where the pick differs from `generated` (whose tokens it feeds on, so
/// both see the same logits), the draw must have been within rounding of
/// a boundary; returns how many were.
fn replay_on_the_host(
    generator: &mut Generator,
    prompt: &[u32],
    generated: &[u32],
    sampling: &Sampling,
) -> wgrad::Result<usize> {
    let (context, keep) = (CONFIG.block_size, CONFIG.block_size / 2);
    let mut draws = rng(sampling.seed);
    let mut logits = generator.prefill(&[prompt])?;
    let mut near_boundaries = 0;
    for (i, &token) in generated.iter().enumerate() {
        let u: f32 = draws.clone().random();
        let picked = sampling.sample(&logits, &mut draws)?;
        if picked != token {
            let k = sampling.top_k.unwrap_or(CONFIG.vocab_size) as u32;
            assert!(
                near_a_boundary(&logits, u, sampling.temperature, k, sampling.top_p.unwrap_or(1.0)),
                "token {i}: the GPU picked {token}, the host {picked}; logits {logits:?}"
            );
            near_boundaries += 1;
        }
        let cached = generator.cached_tokens(0).map_or(0, <[u32]>::len);
        logits = if cached < context {
            generator.decode(&[token])?
        } else {
            let held = generator.cached_tokens(0).unwrap_or(&[]);
            let mut window = held[held.len() + 1 - keep..].to_vec();
            window.push(token);
            generator.prefill(&[&window])?
        };
    }
    Ok(near_boundaries)
}

#[test]
fn generate_picks_on_the_gpu_what_the_host_sampler_picks() {
    for_each_adapter("generate with GPU sampling", |k| {
        let mut generator = Generator::new(Arc::clone(k), &model(30), 1)?;
        let prompt = [3, 1, 4, 1, 5];
        // Past the context (13): decode steps and the shifts' prefills.
        let max_new = 2 * CONFIG.block_size;
        let samplings = [
            Sampling::greedy(),
            Sampling {
                temperature: 1.0,
                top_k: Some(5),
                top_p: None,
                seed: 31,
            },
            Sampling {
                temperature: 0.7,
                top_k: None,
                top_p: None,
                seed: 32,
            },
            Sampling {
                temperature: 1.0,
                top_k: None,
                top_p: Some(0.8),
                seed: 35,
            },
            Sampling {
                temperature: 1.3,
                top_k: Some(9),
                top_p: Some(0.6),
                seed: 36,
            },
        ];
        for sampling in samplings {
            let generated = generator.generate(&prompt, max_new, &sampling, |_| Ok(()))?;
            assert_eq!(generated.len(), max_new);
            let near = replay_on_the_host(&mut generator, &prompt, &generated, &sampling)?;
            // ~2e-5 of draws per boundary come that close.
            assert!(near <= 1, "{sampling:?}: {near} draws within rounding of a boundary");
            if sampling.temperature > 0.0 {
                let distinct: std::collections::BTreeSet<u32> = generated.iter().copied().collect();
                assert!(distinct.len() > 2, "{sampling:?} sampled only {distinct:?}");
            }
        }
        Ok(())
    });
}

#[test]
fn several_sequences_draw_in_sequence_order_and_bad_logits_are_errors() {
    for_each_adapter("decode_and_sample", |k| {
        let vocab = CONFIG.vocab_size;
        // Two generators of one model, fed the same tokens: one reads the
        // logits back, one picks on the GPU (the logits are the same bits).
        let mut reads_logits = Generator::new(Arc::clone(k), &model(33), 3)?;
        let mut picks = Generator::new(Arc::clone(k), &model(33), 3)?;
        let sampling = Sampling {
            temperature: 1.2,
            top_k: Some(6),
            top_p: Some(0.9),
            seed: 34,
        };
        let prompts: [&[u32]; 3] = [&[1, 2], &[7], &[9, 9, 9, 9]];
        let (mut gpu_draws, mut host_draws) = (rng(34), rng(34));
        let mut logits = reads_logits.prefill(&prompts)?;
        let mut tokens = picks.prefill_and_sample(&prompts, &sampling, &mut gpu_draws)?;
        for step in 0..6 {
            // One draw per sequence, in sequence order, on both sides.
            for (s, &token) in tokens.iter().enumerate() {
                let row = &logits[s * vocab..(s + 1) * vocab];
                let u: f32 = host_draws.clone().random();
                let picked = sampling.sample(row, &mut host_draws)?;
                assert!(
                    picked == token || near_a_boundary(row, u, 1.2, 6, 0.9),
                    "step {step}, sequence {s}: GPU {token}, host {picked}"
                );
            }
            logits = reads_logits.decode(&tokens)?;
            tokens = picks.decode_and_sample(&tokens, &sampling, &mut gpu_draws)?;
        }

        let mut broken = model(33);
        // Token 5's logit is NaN (5 is never an input here).
        let channels = CONFIG.n_embd;
        broken.wte.weight[5 * channels..6 * channels]
            .iter_mut()
            .for_each(|w| *w = f32::NAN);
        let mut bad = Generator::new(Arc::clone(k), &broken, 3)?;
        let host_error = Sampling::greedy()
            .sample(&bad.prefill(&prompts)?[..vocab], &mut rng(0))
            .unwrap_err()
            .to_string();
        assert!(
            host_error.contains("logit NaN of token 5 is not finite"),
            "{host_error}"
        );
        let err = bad
            .prefill_and_sample(&prompts, &Sampling::greedy(), &mut rng(0))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("logit NaN of token 5 in sequence 0 is not finite"),
            "{err}"
        );
        let err = bad
            .decode_and_sample(&[1, 2, 3], &sampling, &mut rng(0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("token 5 in sequence 0"), "{err}");
        let mut one = Generator::new(Arc::clone(k), &broken, 1)?;
        let err = one.generate(&[1, 2], 3, &sampling, |_| Ok(())).unwrap_err().to_string();
        assert!(err.contains("logit NaN of token 5 is not finite"), "{err}");
        Ok(())
    });
}
