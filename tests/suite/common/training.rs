//! What the parallel strategies' tests share: their reference (the same
//! model trained on one device on the same batches), the comparison of
//! parameters by name, and what a tensor-parallel split holds.

use std::sync::Arc;

use wgrad::kernels::{LrSchedule, OptimizerConfig};
use wgrad::nn::shard::Slice;
use wgrad::nn::{CrossEntropyLoss, Module};
use wgrad::optim::AdamW;
use wgrad::parallel::stage::Stage;
use wgrad::parallel::tensor::TensorParallel;
use wgrad::Kernels;
use wgrad::{Targets, Trainer};

use super::assert_close;

/// Named parameters as executors and the parallel engines return them.
pub type Parameters = Vec<(String, Vec<usize>, Vec<f32>)>;

/// AdamW as the strategies' tests train: betas (0.9, 0.95), weight decay
/// 0.1 on matrices, 3 warmup steps then cosine over `steps` to lr/10, the
/// gradient clipped at `clip`.
pub fn clipped_adamw(clip: f32, steps: u64) -> AdamW {
    AdamW::new(1e-2)
        .betas(0.9, 0.95)
        .weight_decay(0.1)
        .decay_matrices_only()
        .clip_grad_norm(clip)
        .schedule(LrSchedule::WarmupCosine {
            warmup_steps: 3,
            total_steps: steps,
            min_lr: 1e-3,
        })
}

/// `model` trained on one device, a step per batch of (token ids, next
/// tokens) of `batch` sequences: the trainer, and each step's loss and
/// gradient norm before clipping (NaN when the optimizer does not clip).
pub fn train_on_one_device(
    k: &Arc<Kernels>,
    model: &dyn Module,
    optimizer: impl Into<OptimizerConfig>,
    batch: usize,
    batches: &[(Vec<u32>, Vec<u32>)],
) -> (Trainer, Vec<f32>, Vec<f32>) {
    let mut t = Trainer::new(k.clone(), model, CrossEntropyLoss, optimizer, batch).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for (ids, targets) in batches {
        t.zero_grad();
        t.forward_ids(ids).unwrap();
        t.loss(Targets::Classes(targets)).unwrap();
        t.backward().unwrap();
        losses.push(t.step_reading_loss().unwrap());
        norms.push(t.executor().read_grad_norm().unwrap().unwrap_or(f32::NAN));
    }
    (t, losses, norms)
}

/// Every parameter of `want` found by name in `got` with its shape (and
/// `got` holding no others), its values within `atol + rtol·|want|`;
/// returns the largest |got − want|, for the report.
pub fn assert_same_parameters(what: &str, got: &Parameters, want: &Parameters, atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    let mut worst = 0.0f32;
    for (name, shape, w) in want {
        let (_, got_shape, g) = got
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("{what}: no {name}"));
        assert_eq!(got_shape, shape, "{what}: {name} shape");
        assert_close(&format!("{what}: {name}"), g, w, atol, rtol);
        worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
    }
    worst
}

/// Rows of `name` each device of `tp` holds (a column-parallel Linear's
/// outputs).
pub fn rows_held(tp: &TensorParallel, name: &str) -> Vec<usize> {
    tp.slices(name)
        .into_iter()
        .map(|s| match s {
            Some(Slice::Rows(ranges)) => ranges.iter().map(|r| r.len()).sum(),
            other => panic!("`{name}` is not split by rows: {other:?}"),
        })
        .collect()
}

/// Columns of `name` each device of `tp` holds (a row-parallel Linear's
/// inputs).
pub fn columns_held(tp: &TensorParallel, name: &str) -> Vec<usize> {
    tp.slices(name)
        .into_iter()
        .map(|s| match s {
            Some(Slice::Columns(r)) => r.len(),
            other => panic!("`{name}` is not split by columns: {other:?}"),
        })
        .collect()
}

/// The bits of every copy of parameter `name` the stages hold (a
/// replicated or tied parameter has one per stage using it).
pub fn copies_held<'a>(stages: impl IntoIterator<Item = &'a Stage>, name: &str) -> Vec<Vec<u32>> {
    stages
        .into_iter()
        .flat_map(|stage| stage.executor().parameters().unwrap())
        .filter(|(n, _, _)| n == name)
        .map(|(_, _, v)| v.iter().map(|f| f.to_bits()).collect())
        .collect()
}
