//! `sampling.wgsl`: the next token of each row of logits, picked on the
//! GPU, so that a generation step reads back two u32 per sequence instead
//! of a vocabulary of logits.

use super::registry::entry_points;
use super::rowwise::check_lengths;
use super::{bind, dim, Dispatch, Kernels, View};
use crate::error::Result;

entry_points! {
    Sampling {
        SAMPLE_ROWS_FORWARD = "sample_rows_forward",
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SampleParams {
    rows: u32,
    vocab: u32,
    _pad0: u32,
    _pad1: u32,
}

impl Kernels {
    /// A token per row of `logits[rows, vocab]` (f32), one workgroup per
    /// row: `out[rows, 2]` (u32) = (token, first column whose logit is not
    /// finite). A row whose logits are all finite has
    /// [`NO_TOKEN`](crate::ops::NO_TOKEN) as its second value, a row with
    /// one has it as its token. Row r's settings are `draws[r]` = (u in
    /// `[0, 1)`, temperature, top_p) (f32 [rows, 3]) and `top_k[r]` (u32
    /// `[rows]`, clamped to 1..=vocab), inputs rather than pipeline
    /// constants so that changing them rebuilds nothing. Temperature 0 (or
    /// k = 1): the first maximum. Above 0: the k largest logits are the
    /// candidates (ties at the boundary to the lower id), w_i = exp((l_i −
    /// max) / temperature); a top_p below 1 keeps the smallest set of them,
    /// most likely first (equal logits by id), whose Σw reaches top_p times
    /// theirs (at least one; 1 or NaN keeps all); the token is the first
    /// candidate in id order whose running sum of w exceeds u·Σw (the last
    /// candidate if rounding leaves none). `cpu::sample_rows` is the twin.
    pub fn sample_rows(
        &self,
        out: View<'_>,
        logits: View<'_>,
        draws: View<'_>,
        top_k: View<'_>,
        rows: usize,
        vocab: usize,
    ) -> Result<Dispatch> {
        let op = SAMPLE_ROWS_FORWARD.entry;
        check_lengths(
            op,
            &[("rows", rows), ("vocab", vocab)],
            &[
                ("out", out.len, rows.checked_mul(2)),
                ("logits", logits.len, rows.checked_mul(vocab)),
                ("draws", draws.len, rows.checked_mul(3)),
                ("top_k", top_k.len, Some(rows)),
            ],
        )?;
        let params = SampleParams {
            rows: dim(op, rows)?,
            vocab: dim(op, vocab)?,
            _pad0: 0,
            _pad1: 0,
        };
        let bindings = [
            bind(0, "logits", logits),
            bind(1, "draws", draws),
            bind(2, "top_k", top_k),
            bind(4, "out", out),
        ];
        // One workgroup per row over a 2-D grid: rows up to the
        // per-dimension workgroup limit squared (else Error::TooLarge).
        self.prepare(SAMPLE_ROWS_FORWARD, &[], &bindings, 3, &params, rows as u64)
    }
}
