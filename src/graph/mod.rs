//! The define-then-run graph: build ([`Graph`]), differentiate
//! ([`Graph::backward`]), plan memory ([`Plan`]), run ([`Executor`]) and
//! evaluate on the CPU ([`Graph::evaluate_f64`]). Each op is declared once,
//! in `ops/`: shape rule, kernel binding, gradient rule, CPU reference.

mod autodiff;
mod builder;
mod checkpoint;
mod chunks;
mod executor;
mod ops;
mod plan;
pub mod precision;
mod reference;
mod step_update;

pub use autodiff::Gradients;
pub use builder::{DType, Graph, Node, Tensor};
pub use checkpoint::Block;
pub(crate) use chunks::{chunked_outputs, chunked_predictions};
pub use executor::{ArenaPool, DispatchTime, DispatchTimes, DropoutRun, Executor, ParamSpan};
pub use ops::{
    AttentionOp, ElementwiseOp, EmbeddingOp, GenerationOp, LayoutOp, LoraOp, LossKind, LossOp, MatmulOp, NormOp, Op,
    ParameterInit, ReduceOp, RopeOp, SoftmaxOp, SourceOp, DROPOUT_CONTROL,
};
pub use plan::{stored_words, LinearInLoss, LossFusion, Plan, PlanOptions, Storage};
pub use precision::{Precision, Remap};
pub use step_update::{BuildUpdate, StepUpdate, UpdateArenas, UpdateSpec};
