//! The rotary embedding (rope.wgsl) against its plain-Rust twin in
//! `wgrad::cpu`, on every adapter present; the twin's and the graph op's
//! gradients against f64 central differences; the table, the kernels and
//! RMSNorm (whose own tests are in rowwise.rs) against transformers' Llama
//! (tests/fixtures/llama-kernels.safetensors, scripts/make_llama_kernels_fixture.py).
//! SiLU is an `Activation`, checked with the others in kernels.rs (and in
//! the matmul epilogue, and by the graph's gradient checks).
//! Tolerances: `|gpu - ref| <= atol + rtol·|ref|`, stated beside each check.

use crate::common;

use common::{
    assert_close, central_differences, for_each_adapter, for_each_shaping, gradcheck, mse_to_random, param, random_vec,
    read, rng, wide,
};
use safetensors::SafeTensors;
use wgrad::graph::Graph;
use wgrad::kernels::{RopeLayout, RopeShape};
use wgrad::ops::rope_table;
use wgrad::{cpu, Error, Kernels};

/// A rope case: the shape, the layout, the base and each sequence's start.
struct RopeCase {
    shape: RopeShape,
    layout: RopeLayout,
    base: f32,
    starts: Vec<u32>,
}

#[allow(clippy::too_many_arguments)]
fn rope_case(
    seqs: usize,
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    positions: usize,
    layout: RopeLayout,
    base: f32,
    starts: &[u32],
) -> RopeCase {
    assert_eq!(starts.len(), seqs);
    RopeCase {
        shape: RopeShape {
            seqs,
            rows,
            heads,
            head_dim,
            rotary_dim,
            positions,
        },
        layout,
        base,
        starts: starts.to_vec(),
    }
}

/// Shapes of 1, primes, more elements than a workgroup; the whole and a
/// part of the head rotated (odd head dimensions too); nonzero starts;
/// Llama 2's base and head dimension, SmolLM2's and Llama 3's bases at
/// positions up to 8,191 (GQA: the same table for 32 query and 8 key
/// heads); rows past the table, and a start at u32::MAX, which must give
/// NaN rather than wrap around.
fn rope_cases() -> Vec<RopeCase> {
    use RopeLayout::{HalfSplit, Interleaved};
    let mut cases = Vec::new();
    for layout in [Interleaved, HalfSplit] {
        cases.push(rope_case(1, 1, 1, 2, 2, 1, layout, 10_000.0, &[0]));
        cases.push(rope_case(2, 5, 3, 8, 8, 9, layout, 10_000.0, &[0, 3]));
        cases.push(rope_case(3, 7, 2, 13, 8, 40, layout, 10_000.0, &[11, 0, 29]));
        cases.push(rope_case(1, 257, 1, 6, 4, 300, layout, 10_000.0, &[17]));
        cases.push(rope_case(2, 3, 4, 64, 64, 4099, layout, 10_000.0, &[4000, 4096]));
        cases.push(rope_case(1, 2, 5, 64, 32, 4002, layout, 100_000.0, &[4000]));
        for heads in [32, 8] {
            cases.push(rope_case(2, 2, heads, 128, 128, 8192, layout, 500_000.0, &[8190, 3]));
        }
        cases.push(rope_case(3, 3, 2, 6, 6, 10, layout, 10_000.0, &[8, u32::MAX, 7]));
    }
    cases
}

fn run_rope(k: &Kernels, case: &RopeCase, x_host: &[f32], backward: bool) -> wgrad::Result<Vec<f32>> {
    let s = case.shape;
    let table_host = rope_table(case.base, s.rotary_dim, s.positions)?;
    let (x, starts, table, y) = (
        k.upload(x_host)?,
        k.upload(&case.starts)?,
        k.upload(&table_host)?,
        k.zeros(x_host.len())?,
    );
    let d = if backward {
        k.rope_backward(y.view(), x.view(), starts.view(), table.view(), s, case.layout)?
    } else {
        k.rope_forward(y.view(), x.view(), starts.view(), table.view(), s, case.layout)?
    };
    k.run(&[&d])?;
    read(k, &y)
}

#[test]
fn rope_forward_and_backward_match_the_cpu() {
    for_each_adapter("rope", |k| {
        for (i, case) in rope_cases().iter().enumerate() {
            let s = case.shape;
            let n = s.lengths().expect("small").0;
            let x_host = random_vec(&mut rng(1000 + i as u64), n, -1.0, 1.0);
            let what = format!("{:?} {:?} base {} starts {:?}", case.layout, s, case.base, case.starts);
            // The same f32 angles on both sides; the table's cos and sin
            // are rounded once (≤ 6e-8), then two products and a sum of
            // |x| ≤ 1 in f32: a few 1e-8.
            let want = cpu::rope_forward(&x_host, &case.starts, s, case.layout, case.base);
            assert_close(
                &format!("rope_forward {what}"),
                &run_rope(k, case, &x_host, false)?,
                &want,
                3e-7,
                1e-6,
            );
            let want = cpu::rope_backward(&x_host, &case.starts, s, case.layout, case.base);
            assert_close(
                &format!("rope_backward {what}"),
                &run_rope(k, case, &x_host, true)?,
                &want,
                3e-7,
                1e-6,
            );
        }
        Ok(())
    });
}

#[test]
fn rope_of_one_pair_is_the_rotation_by_the_position() {
    // rotary_dim 2: inv_freq_0 = 1, so row t turns by t radians; the third
    // channel passes through. Written from the definition, for both
    // layouts (one pair is the same pair in each) and for twin and kernel.
    let positions = 6;
    let x: Vec<f32> = (0..positions * 3).map(|i| (i as f32 * 0.37).sin()).collect();
    let want: Vec<f32> = (0..positions)
        .flat_map(|t| {
            let (a, b, c) = (f64::from(x[3 * t]), f64::from(x[3 * t + 1]), x[3 * t + 2]);
            let (cos, sin) = ((t as f64).cos(), (t as f64).sin());
            [(a * cos - b * sin) as f32, (b * cos + a * sin) as f32, c]
        })
        .collect();
    let shape = RopeShape {
        seqs: 1,
        rows: positions,
        heads: 1,
        head_dim: 3,
        rotary_dim: 2,
        positions,
    };
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        // f64 but for the f32 angles, here exact integers.
        assert_close(
            &format!("twin {layout:?}"),
            &cpu::rope_forward(&x, &[0], shape, layout, 10_000.0),
            &want,
            1e-7,
            1e-7,
        );
        // Undone by the backward.
        assert_close(
            &format!("twin round trip {layout:?}"),
            &cpu::rope_backward(&want, &[0], shape, layout, 10_000.0),
            &x,
            1e-6,
            1e-6,
        );
    }
    for_each_adapter("rope_one_pair", |k| {
        let case = RopeCase {
            shape,
            layout: RopeLayout::HalfSplit,
            base: 10_000.0,
            starts: vec![0],
        };
        // As rope_forward_and_backward_match_the_cpu.
        assert_close("kernel", &run_rope(k, &case, &x, false)?, &want, 3e-7, 1e-6);
        Ok(())
    });
}

#[test]
fn rope_layouts_agree_under_the_channel_permutation() {
    // Hugging Face's checkpoints store q and k rows permuted from Meta's so
    // that rotate_half pairs (i, i + R/2) what Meta paired as (2i, 2i + 1):
    // permuting the rotary channels maps one layout's result onto the
    // other's, with the same products in f32.
    for_each_adapter("rope_layouts", |k| {
        let (heads, head_dim, rotary_dim) = (3, 10, 8);
        let case = |layout| rope_case(2, 5, heads, head_dim, rotary_dim, 16, layout, 10_000.0, &[0, 9]);
        let half_split = case(RopeLayout::HalfSplit);
        let n = half_split.shape.lengths().expect("small").0;
        let x = random_vec(&mut rng(1100), n, -1.0, 1.0);
        // Channel c of the half-split head is channel interleaved(c).
        let interleaved = |c: usize| {
            if c >= rotary_dim {
                c
            } else if c < rotary_dim / 2 {
                2 * c
            } else {
                2 * (c - rotary_dim / 2) + 1
            }
        };
        let to_interleaved = |v: &[f32]| {
            let mut out = vec![0.0; v.len()];
            for (i, &e) in v.iter().enumerate() {
                out[i - i % head_dim + interleaved(i % head_dim)] = e;
            }
            out
        };
        let got_half = run_rope(k, &half_split, &x, false)?;
        let got_inter = run_rope(k, &case(RopeLayout::Interleaved), &to_interleaved(&x), false)?;
        // The same two products and sum per element: equal up to the
        // compiler's contraction into fma (1 ulp of |x| ≤ 1).
        assert_close(
            "half-split vs interleaved",
            &to_interleaved(&got_half),
            &got_inter,
            2e-7,
            0.0,
        );
        Ok(())
    });
}

#[test]
fn rope_twin_backward_matches_central_differences() {
    // The small cases with every row inside the table (past it the
    // forward is NaN, and so is every difference).
    let inside = |c: &RopeCase| c.starts.iter().all(|&s| s as usize + c.shape.rows <= c.shape.positions);
    for (i, case) in rope_cases()
        .iter()
        .enumerate()
        .filter(|(_, c)| inside(c) && c.shape.lengths().is_some_and(|l| l.0 <= 1200))
    {
        let s = case.shape;
        let n = s.lengths().expect("small").0;
        let mut r = rng(1200 + i as u64);
        let x = random_vec(&mut r, n, -1.0, 1.0);
        let dy = random_vec(&mut r, n, -1.0, 1.0);
        let numeric = central_differences(&wide(&x), &wide(&dy), 1e-3, |v| {
            cpu::rope_f64(v, &case.starts, s, case.layout, case.base, 1.0)
        });
        let got = cpu::rope_backward(&dy, &case.starts, s, case.layout, case.base);
        // A rotation is linear: central differences are exact up to
        // rounding (~1e-13 here); both sides are then rounded to f32.
        assert_close(
            &format!("rope dx {:?} {:?}", case.layout, s),
            &got,
            &numeric,
            1e-9,
            2e-7,
        );
    }
}

#[test]
fn rope_refuses_bad_arguments() {
    for_each_adapter("rope_errors", |k| {
        let shape = RopeShape {
            seqs: 2,
            rows: 3,
            heads: 1,
            head_dim: 4,
            rotary_dim: 4,
            positions: 5,
        };
        let (x, y, starts, table) = (k.zeros(24)?, k.zeros(24)?, k.upload(&[0u32, 1])?, k.zeros(20)?);
        let rope = |shape: RopeShape, table: &wgrad::GpuTensor| {
            k.rope_forward(
                y.view(),
                x.view(),
                starts.view(),
                table.view(),
                shape,
                RopeLayout::Interleaved,
            )
        };
        assert!(rope(shape, &table).is_ok());
        let shape_error = |r: wgrad::Result<_>, what: &str| {
            assert!(matches!(r, Err(Error::Shape { op: "rope_forward", .. })), "{what}")
        };
        shape_error(
            rope(RopeShape { rotary_dim: 3, ..shape }, &k.zeros(15)?),
            "odd rotary_dim",
        );
        shape_error(
            rope(
                RopeShape {
                    rotary_dim: 6,
                    head_dim: 4,
                    ..shape
                },
                &k.zeros(30)?,
            ),
            "rotary_dim > head_dim",
        );
        shape_error(rope(RopeShape { rotary_dim: 0, ..shape }, &k.zeros(1)?), "rotary_dim 0");
        shape_error(
            rope(RopeShape { positions: 4, ..shape }, &table),
            "table of the wrong length",
        );
        shape_error(rope(RopeShape { heads: 2, ..shape }, &table), "x of the wrong length");
        let one_start = k.upload(&[0u32])?;
        assert!(matches!(
            k.rope_backward(
                y.view(),
                x.view(),
                one_start.view(),
                table.view(),
                shape,
                RopeLayout::HalfSplit
            ),
            Err(Error::Shape {
                op: "rope_backward",
                ..
            })
        ));
        for (base, rotary_dim, positions) in [
            (0.0, 4, 5),
            (f32::NAN, 4, 5),
            (10_000.0, 3, 5),
            (10_000.0, 4, 0),
            (10_000.0, 4, (1 << 24) + 1),
        ] {
            assert!(
                matches!(
                    rope_table(base, rotary_dim, positions),
                    Err(Error::InvalidArgument { op: "rope_table", .. })
                ),
                "{base} {rotary_dim} {positions}"
            );
        }
        Ok(())
    });
}

const FIXTURE: &[u8] = include_bytes!("../fixtures/llama-kernels.safetensors");

/// The fixture's tensor `name` (all f32).
fn fixture(name: &str) -> Vec<f32> {
    let file = SafeTensors::deserialize(FIXTURE).expect("the fixture is safetensors");
    let view = file
        .tensor(name)
        .unwrap_or_else(|e| panic!("the fixture has no `{name}`: {e}"));
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn rope_table_matches_transformers_llama_rotary_embedding() {
    for (base, dim) in [(10_000.0f32, 64usize), (100_000.0, 64), (500_000.0, 128)] {
        let key = format!("rope/{base}/{dim}");
        let positions = fixture(&format!("{key}/positions"));
        let (cos, sin) = (fixture(&format!("{key}/cos")), fixture(&format!("{key}/sin")));
        let table = rope_table(base, dim, 8192).expect("a valid table");
        let half = dim / 2;
        // Hugging Face's [P, dim] repeats the half's frequencies (cat(freqs,
        // freqs)); the table holds (cos, sin) per pair.
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for (j, &p) in positions.iter().enumerate() {
            for c in 0..dim {
                let at = (p as usize * half + c % half) * 2;
                got.extend([table[at], table[at + 1]]);
                want.extend([cos[j * dim + c], sin[j * dim + c]]);
            }
        }
        // The same f32 angles (inv_freq bit for bit, one f32 product); the
        // cos and sin of f32 are within an ulp (≤ 6e-8 near 1) of each other
        // at any angle (8,191 radians here).
        assert_close(&format!("rope_table base {base} dim {dim}"), &got, &want, 1.2e-7, 0.0);
    }
}

#[test]
fn rope_kernel_matches_transformers_apply_rotary_pos_emb() {
    // q with 4 heads and k with 2 (grouped-query), each its own call;
    // sequence 0 starts at position 5, as a decode after 5 cached tokens.
    let starts: Vec<u32> = fixture("apply/starts").iter().map(|&s| s as u32).collect();
    for_each_adapter("rope_transformers", |k| {
        for (name, heads) in [("q", 4), ("k", 2)] {
            let shape = RopeShape {
                seqs: 2,
                rows: 7,
                heads,
                head_dim: 16,
                rotary_dim: 16,
                positions: 12,
            };
            let case = RopeCase {
                shape,
                layout: RopeLayout::HalfSplit,
                base: 10_000.0,
                starts: starts.clone(),
            };
            let got = run_rope(k, &case, &fixture(&format!("apply/{name}")), false)?;
            // x·cos + rotate_half(x)·sin in f32 on both sides, from the
            // same f32 angles: an ulp or two of |x| ≲ 4.
            assert_close(
                &format!("{name} rotated"),
                &got,
                &fixture(&format!("apply/{name}_out")),
                1e-6,
                1e-6,
            );
        }
        Ok(())
    });
}

#[test]
fn rmsnorm_matches_transformers_llama_rms_norm() {
    let (x, w, want) = (fixture("rmsnorm/x"), fixture("rmsnorm/weight"), fixture("rmsnorm/y"));
    let (rows, cols) = (5, 24);
    for_each_shaping("rmsnorm_transformers", |k| {
        let (xg, wg, y, rstd) = (k.upload(&x)?, k.upload(&w)?, k.zeros(rows * cols)?, k.zeros(rows)?);
        k.run(&[&k.rmsnorm_forward(y.view(), rstd.view(), xg.view(), wg.view(), rows, cols, 1e-5)?])?;
        // The same f32 steps; the sum of 24 squares in another order:
        // a few ulp of |y| ≲ 10.
        assert_close("rmsnorm", &read(k, &y)?, &want, 1e-6, 2e-6);
        Ok(())
    });
}

#[test]
fn rope_backward_matches_central_differences() {
    for_each_adapter("gradcheck rope", |k| {
        // Rotary embedding, both layouts, a partial rotary_dim, fed starts
        // and the default zero starts.
        for (layout, rotary_dim, fed) in [(RopeLayout::HalfSplit, 6, false), (RopeLayout::Interleaved, 4, true)] {
            let mut g = Graph::new();
            let x = param(&mut g, "x", &[2, 3, 2, 6], 139);
            let starts = if fed { Some(g.ids("starts", &[2])?) } else { None };
            let y = g.rope(x, starts, layout, 10000.0, rotary_dim, 16)?;
            let (loss, feeds) = mse_to_random(&mut g, y, 140)?;
            let labels = starts.map(|s| vec![(s, vec![5, 11])]).unwrap_or_default();
            gradcheck(
                k,
                &format!("rope {layout:?} rotary_dim {rotary_dim}"),
                g,
                loss,
                feeds,
                labels,
            )?;
        }
        Ok(())
    });
}
