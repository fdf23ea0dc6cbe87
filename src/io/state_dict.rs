//! A training checkpoint assembled from whatever holds the state (one
//! executor, or shards gathered to the host): parameters under their
//! state_dict names, optimizer state as `optim.<param>.<state>`, and the
//! metadata that says what trained them; and the checks a checkpoint passes
//! before it is loaded into a model.

use crate::error::{Error, Result};
use crate::io::checkpoint::{Checkpoint, NamedTensor};
use crate::kernels::OptimizerConfig;
use crate::nn::Criterion;
use crate::optim;

/// What a checkpoint's metadata says besides its tensors.
pub(crate) struct CheckpointAbout<'a> {
    pub model: &'a str,
    pub criterion: Criterion,
    pub optimizer: &'a OptimizerConfig,
    pub step: u64,
    /// Dynamic loss scaling's state, written beside the rest (f16 runs).
    pub loss_scale: Option<optim::LossScaleState>,
}

/// A checkpoint of parameters (state_dict names), optimizer state
/// (`optim.<param>.<state>`, shaped as its parameter) and metadata, from
/// whatever holds them (one executor, or shards gathered to the host).
pub(crate) fn assemble_checkpoint(
    params: Vec<(String, Vec<usize>, Vec<f32>)>,
    state: Vec<(String, &'static str, Vec<f32>)>,
    about: &CheckpointAbout<'_>,
) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint::new();
    let shapes: Vec<(String, Vec<usize>)> = params.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
    for (name, shape, data) in params {
        ckpt.push(NamedTensor::new(name, shape, data)?);
    }
    for (param, state, data) in state {
        let shape = shapes
            .iter()
            .find(|(n, _)| *n == param)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| vec![data.len()]);
        ckpt.push(NamedTensor::new(format!("optim.{param}.{state}"), shape, data)?);
    }
    ckpt.set_meta("format", "wgrad");
    ckpt.set_meta("model", about.model.to_string());
    ckpt.set_meta("criterion", format!("{:?}", about.criterion));
    ckpt.set_meta("optimizer", optim::describe(about.optimizer));
    ckpt.set_meta("step", about.step.to_string());
    for (key, value) in about.loss_scale.iter().flat_map(optim::LossScaleState::metadata) {
        ckpt.set_meta(key, value);
    }
    Ok(ckpt)
}

/// An error when the checkpoint holds another model than `description`.
pub(crate) fn check_model(ckpt: &Checkpoint, description: &str) -> Result<()> {
    match ckpt.meta("model") {
        Some(m) if m != description => Err(Error::InvalidArgument {
            op: "load checkpoint",
            reason: format!("the checkpoint holds `{m}`, the model is `{description}`"),
        }),
        _ => Ok(()),
    }
}

/// The checkpoint's values for every parameter of `shapes` (name, shape),
/// each checked to be there with that shape.
pub(crate) fn checked_parameters(
    ckpt: &Checkpoint,
    shapes: Vec<(String, Vec<usize>)>,
) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let t = ckpt.get_checked(&name, &shape)?;
            Ok((name, shape, t.data.clone()))
        })
        .collect()
}
