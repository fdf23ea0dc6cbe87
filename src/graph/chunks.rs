//! Running a planned graph over any number of examples in batch-sized
//! chunks (the last one zero-padded), as the trainer and the predictor do
//! for outputs and predictions.

use super::builder::{DType, Tensor};
use super::executor::Executor;
use crate::error::{Error, Result};

/// Runs `run_chunk` over batch-sized chunks of `examples` (the last one
/// zero-padded) and concatenates what it returns for the real rows.
pub(crate) fn in_chunks<T: bytemuck::Pod + Default, R>(
    exec: &mut Executor,
    input: Tensor,
    batch_size: usize,
    in_features: usize,
    examples: &[T],
    mut run_chunk: impl FnMut(&mut Executor, usize) -> Result<Vec<R>>,
) -> Result<Vec<R>> {
    if examples.is_empty() || examples.len() % in_features != 0 {
        return Err(Error::shape(
            "predict",
            format!("inputs must be rows × {in_features}"),
            &[&[examples.len()]],
        ));
    }
    let rows = examples.len() / in_features;
    let mut out = Vec::with_capacity(rows);
    let mut chunk = vec![T::default(); batch_size * in_features];
    let is_ids = exec.graph().get(input).is_some_and(|n| n.dtype == DType::U32);
    for start in (0..rows).step_by(batch_size) {
        let n = (rows - start).min(batch_size);
        chunk.fill(T::default());
        chunk[..n * in_features].copy_from_slice(&examples[start * in_features..(start + n) * in_features]);
        if is_ids {
            exec.set_labels(input, bytemuck::cast_slice(&chunk))?;
        } else {
            exec.set_input(input, bytemuck::cast_slice(&chunk))?;
        }
        out.extend(run_chunk(exec, n)?);
    }
    Ok(out)
}

/// Outputs of `output` for every example, batch by batch.
pub(crate) fn chunked_outputs<T: bytemuck::Pod + Default>(
    exec: &mut Executor,
    (input, output): (Tensor, Tensor),
    (batch, in_features, width): (usize, usize, usize),
    features: &[T],
) -> Result<Vec<f32>> {
    in_chunks(exec, input, batch, in_features, features, |exec, n| {
        exec.run(&[output])?;
        Ok(exec.read(output)?[..n * width].to_vec())
    })
}

/// The argmax node's values for every example, batch by batch.
pub(crate) fn chunked_predictions<T: bytemuck::Pod + Default>(
    exec: &mut Executor,
    (input, prediction): (Tensor, Tensor),
    (batch, in_features): (usize, usize),
    examples: &[T],
) -> Result<Vec<u32>> {
    let per_example = exec.graph().get(prediction).map_or(0, |n| n.len()) / batch.max(1);
    in_chunks(exec, input, batch, in_features, examples, |exec, n| {
        exec.run(&[prediction])?;
        Ok(exec.read_u32(prediction)?[..n * per_example].to_vec())
    })
}
