//! The narrow interface through which a training step runs work its
//! executor does not know: an optimizer's update (the optimizer layer
//! attaches one). The executor offers its parameter and gradient arenas, records the
//! update's dispatches after the backward in the step's one submission,
//! copies one value into the loss gradient's seed and reads a few words
//! back beside the loss. Which buffers the update holds (an optimizer's
//! state), what they are called and how they are saved stay with it.

use std::any::Any;

use crate::error::Result;
use crate::kernels::{Dispatch, Kernels, View};

/// Work a training step runs after its backward, over the executor's arenas.
pub trait StepUpdate: std::fmt::Debug + Send + Sync + Any {
    /// The dispatches of one step, in order.
    fn dispatches(&self) -> Box<dyn Iterator<Item = &Dispatch> + '_>;

    /// Host writes a submission that runs [`StepUpdate::dispatches`] needs
    /// first (the next step's scalars).
    fn prepare(&self, kernels: &Kernels) -> Result<()>;

    /// Called once a submission that ran the dispatches is made.
    fn finish(&mut self);

    /// Steps taken so far (reported with a non-finite loss).
    fn steps_taken(&self) -> u64;

    /// One f32 the step copies into the loss gradient's seed before its
    /// backward (a loss scale), if any.
    fn loss_seed(&self) -> Option<View<'_>> {
        None
    }

    /// Words a step that reads its loss copies back beside it, if any.
    fn readback(&self) -> Option<View<'_>> {
        None
    }

    /// What came back of [`StepUpdate::readback`] with the last loss read.
    fn read_back(&mut self, _words: &[f32]) {}

    /// For the owner of this kind of update, to reach its own type.
    fn as_any(&self) -> &dyn Any;

    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The arenas an update is built over: parameters and gradients of `len`
/// elements, whose first `decay_len` are the weight-decayed group.
#[derive(Clone, Copy, Debug)]
pub struct UpdateArenas<'a> {
    pub params: View<'a>,
    pub grads: View<'a>,
    pub len: usize,
    pub decay_len: usize,
}

/// Builds the update a training executor attaches once its arenas exist.
pub type BuildUpdate<'a> = Box<dyn FnOnce(&Kernels, UpdateArenas<'_>) -> Result<Box<dyn StepUpdate>> + 'a>;

/// What an executor is told of the update it will attach before planning:
/// the arenas in the parameters' layout it will allocate (counted in the
/// memory check and in `Executor::peak_bytes`), whether its steps seed the
/// loss gradient ([`StepUpdate::loss_seed`]), and how to build it.
pub struct UpdateSpec<'a> {
    pub state_arenas: usize,
    pub seeds_loss: bool,
    pub build: BuildUpdate<'a>,
}

impl std::fmt::Debug for UpdateSpec<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateSpec")
            .field("state_arenas", &self.state_arenas)
            .field("seeds_loss", &self.seeds_loss)
            .finish()
    }
}
