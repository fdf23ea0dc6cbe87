//! The define-then-run graph: build ([`Graph`]), differentiate
//! ([`Graph::backward`]), plan memory ([`Plan`]) and run ([`Executor`]).

mod autodiff;
mod builder;
mod executor;
mod plan;

pub use autodiff::Gradients;
pub use builder::{DType, Graph, LossKind, Node, Op, Tensor};
pub use executor::{DispatchTimes, Executor};
pub use plan::{LinearInLoss, LossFusion, Plan, PlanOptions, Storage};
