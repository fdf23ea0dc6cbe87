//! Runs a planned graph. Every buffer, pipeline and bind group is created in
//! `Executor::new`; a run writes the inputs, records every dispatch into one
//! compute pass and submits once. Values come back only when asked for.
//!
//! A training executor runs an update after the backward (an optimizer,
//! which the optimizer layer attaches through [`StepUpdate`] and whose state and
//! methods on `Executor` it defines): the executor knows nothing of it.

use std::collections::HashMap;
use std::sync::Arc;

use super::autodiff::Gradients;
use super::builder::{DType, Graph, Tensor};
use super::ops::{DispatchContext, LayoutOp, LossKind, LossOp, Op, ParameterInit, SourceOp, DROPOUT_CONTROL};
use super::plan::{stored_words, LossFusion, Plan, PlanOptions, Storage};
use super::step_update::{StepUpdate, UpdateArenas, UpdateSpec};
use crate::error::{Error, Result};
use crate::kernels::{Dispatch, GpuTensor, Kernels, LossLinear, LossTargets, View, DROPOUT_CONTROL_WORDS};

/// One dispatch of a profiling run, run alone.
#[derive(Clone, Debug)]
pub struct DispatchTime {
    /// The graph node it computes.
    pub node: String,
    /// Its kernel's entry point.
    pub entry: &'static str,
    /// Kernel time from GPU timestamps where the adapter has them, else
    /// the wall time of its submit and wait (which adds the driver's fixed
    /// cost, ~0.1 ms on lavapipe).
    pub time: std::time::Duration,
    /// Whether `time` came from timestamps.
    pub on_gpu: bool,
    /// Bytes of the storage ranges its launches bind: what it reads and
    /// writes at most (a KV cache is bound whole, though attention reads
    /// only the positions so far).
    pub bound_bytes: u64,
}

/// Per-dispatch times from the profiling runs, in dispatch order.
pub type DispatchTimes = Vec<DispatchTime>;

/// Where a parameter lives in the arenas, as the executor's plan laid
/// them out.
#[derive(Clone, Debug)]
pub struct ParamSpan {
    pub name: String,
    pub shape: Vec<usize>,
    /// Element offset in every arena.
    pub offset: usize,
}

impl ParamSpan {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Buffers executors that run in turn share ([`Executor::with_arenas`]):
/// the parameter and gradient arenas and the intermediate slots, each as
/// long as the longest any of them plans.
pub struct ArenaPool {
    pub params: GpuTensor,
    pub grads: GpuTensor,
    pub slots: Vec<GpuTensor>,
}

pub struct Executor {
    kernels: Arc<Kernels>,
    graph: Graph,
    plan: Plan,
    params: GpuTensor,
    grads: Option<GpuTensor>,
    inputs: Vec<GpuTensor>,
    constants: Vec<GpuTensor>,
    /// Tensors kept from run to run (KV caches), zero at first.
    caches: Vec<GpuTensor>,
    slots: Vec<GpuTensor>,
    dispatches: Vec<Option<Dispatch>>,
    /// A training step's dispatch for a loss that also does its last
    /// layer's work (the plan's `loss_fusion`); runs use `dispatches`.
    train_loss_dispatches: Vec<Option<Dispatch>>,
    /// The update a training step runs after its backward (an optimizer,
    /// which owns its state), and the arenas of the parameters' layout it
    /// was announced to hold.
    update: Option<Box<dyn StepUpdate>>,
    state_arenas: usize,
    /// Node lists for each set of requested outputs, computed once.
    run_orders: HashMap<Vec<Tensor>, Vec<usize>>,
    train_order: Vec<usize>,
    gradients: Option<Gradients>,
    /// Where a scalar read back at the end of a training run lands (and
    /// the update's readback words after it).
    scalar_staging: wgpu::Buffer,
    /// The graph's dropout control inputs ([`Graph::dropout_control`]) and
    /// what the executor writes into them before each run.
    dropout_controls: Vec<Tensor>,
    dropout: DropoutRun,
}

/// How an executor fills its graph's dropout control
/// ([`Graph::dropout_control`]) before each run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropoutRun {
    /// The masks' key: `None` follows the optimizer's step count, so every
    /// step draws new masks, a run and the step that recomputes it draw
    /// the same ones, and a resumed run draws what it would have.
    pub step: Option<u64>,
    /// The number of the first example this executor's batch holds in the
    /// whole batch (a device's rows of a split batch, a micro-batch).
    pub first_example: usize,
    /// Dropout in runs too, not only in training steps: an engine whose
    /// training forward is a run that the step then recomputes.
    pub training: bool,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("nodes", &self.graph.len())
            .field("update", &self.update)
            .finish()
    }
}

impl Executor {
    /// Plans `graph` for `outputs` (and, when training, the gradients and
    /// the `update` a step runs after them), then allocates every buffer and
    /// builds every dispatch. The optimizer layer builds its
    /// executors through this (`Executor::new`, `Executor::with_options`).
    pub fn with_update(
        kernels: Arc<Kernels>,
        graph: Graph,
        outputs: &[Tensor],
        gradients: Option<Gradients>,
        options: PlanOptions,
        update: Option<UpdateSpec<'_>>,
    ) -> Result<Self> {
        Self::build(kernels, graph, outputs, gradients, update, options, None)
    }

    /// A training executor without an optimizer whose parameter arena,
    /// gradient arena and intermediate slots are the first elements of
    /// `pool`'s buffers, which other executors share: ZeRO-3 runs a
    /// model's stages in turn on one device, writing each stage's
    /// parameters before it runs and reading what it needs of a run
    /// before the next stage's. Its initial parameters are written there
    /// now; an error when a pooled buffer is shorter than planned.
    pub fn with_arenas(
        kernels: Arc<Kernels>,
        graph: Graph,
        outputs: &[Tensor],
        gradients: Gradients,
        options: PlanOptions,
        pool: &ArenaPool,
    ) -> Result<Self> {
        Self::build(kernels, graph, outputs, Some(gradients), None, options, Some(pool))
    }

    fn build(
        kernels: Arc<Kernels>,
        graph: Graph,
        outputs: &[Tensor],
        gradients: Option<Gradients>,
        update: Option<UpdateSpec<'_>>,
        options: PlanOptions,
        pooled: Option<&ArenaPool>,
    ) -> Result<Self> {
        check_build(&graph, outputs, gradients.as_ref(), update.as_ref(), &options)?;
        let state_arenas = update.as_ref().map_or(0, |u| u.state_arenas);
        let (options, align) = device_plan_options(&kernels, options);
        let plan = Plan::with_options(&graph, outputs, gradients.as_ref(), align, options);
        check_memory(&kernels, &graph, &plan, gradients.is_some(), state_arenas)?;

        let arena_len = plan.param_arena_len.max(1);
        // Gradients and optimizer state cover the trainable parameters
        // only, which the plan lays out first.
        let trainable_len = plan.trainable_len.max(1);
        let initial = initial_arena(&graph, &plan, arena_len)?;
        let training = gradients.is_some();
        let (params, grads) = match pooled {
            Some(pool) => {
                let (params, grads) = (
                    pool.params.share_prefix(arena_len)?,
                    pool.grads.share_prefix(trainable_len)?,
                );
                kernels.write(params.view(), &initial)?;
                (params, Some(grads))
            }
            None => (
                kernels.upload(&initial)?,
                if training {
                    Some(kernels.zeros(trainable_len)?)
                } else {
                    None
                },
            ),
        };
        let (inputs, constants, caches) = source_buffers(&kernels, &graph, &plan)?;
        let slots = slot_buffers(&kernels, &plan, pooled)?;
        // The loss seeds the backward with the loss scale, so it must be
        // the plan's own constant, which the step overwrites, or an input
        // its caller fills (a stage of a model spread over devices, whose
        // engine seeds the scale).
        if let (true, Some(g)) = (update.as_ref().is_some_and(|u| u.seeds_loss), &gradients) {
            if !matches!(
                plan.storage[g.seed().0],
                Storage::Constant { .. } | Storage::Input { .. }
            ) {
                return Err(Error::InvalidArgument {
                    op: "Executor::new",
                    reason: "loss scaling needs a backward seeded from a loss (Graph::backward)".into(),
                });
            }
        }
        let staging = scalar_staging(&kernels, 0);

        let train_order = train_order(&graph, &plan, gradients.as_ref())?;
        let mut exec = Executor {
            kernels,
            graph,
            plan,
            params,
            grads,
            inputs,
            constants,
            caches,
            slots,
            dispatches: Vec::new(),
            train_loss_dispatches: Vec::new(),
            update: None,
            state_arenas,
            run_orders: HashMap::new(),
            train_order,
            gradients,
            scalar_staging: staging,
            dropout_controls: Vec::new(),
            dropout: DropoutRun::default(),
        };
        exec.dropout_controls = (0..exec.graph.len())
            .filter(|&i| {
                let node = exec.graph.node(Tensor(i));
                node.op == SourceOp::Input && node.name == DROPOUT_CONTROL
            })
            .filter(|&i| matches!(exec.plan.storage[i], Storage::Input { .. }))
            .map(Tensor)
            .collect();
        let needs_kernel = |i: usize| {
            !matches!(exec.plan.storage[i], Storage::Unused)
                && !exec.plan.fused_away[i]
                && exec.graph.node(Tensor(i)).op.has_kernel()
        };
        let nodes: Vec<usize> = (0..exec.graph.len()).filter(|&i| needs_kernel(i)).collect();
        let mut dispatches: Vec<Option<Dispatch>> = (0..exec.graph.len()).map(|_| None).collect();
        for (i, d) in nodes.iter().zip(exec.build_dispatches(&nodes)?) {
            dispatches[*i] = Some(d);
        }
        exec.dispatches = dispatches;
        let mut train_loss_dispatches = Vec::with_capacity(exec.graph.len());
        for i in 0..exec.graph.len() {
            train_loss_dispatches.push(match exec.plan.loss_fusion[i] {
                Some(fusion) if exec.train_order.contains(&i) => Some(exec.build_loss_fusion(i, &fusion)?),
                _ => None,
            });
        }
        exec.train_loss_dispatches = train_loss_dispatches;
        if let (Some(spec), Some(grads)) = (update, &exec.grads) {
            let (params, decay_len) = (exec.params.slice(0, trainable_len)?, exec.plan.decay_len);
            let arenas = UpdateArenas {
                params,
                grads: grads.view(),
                len: trainable_len,
                decay_len,
            };
            let update = (spec.build)(&exec.kernels, arenas)?;
            // The loss comes back with the words the update reads beside it.
            if let Some(words) = update.readback().map(|v| v.len) {
                exec.scalar_staging = scalar_staging(&exec.kernels, words);
            }
            exec.update = Some(update);
        }
        // Every pipeline a run of this graph needs exists now: keep them
        // for the next process even if this one ends without dropping
        // its device.
        exec.kernels.device().persist_pipeline_cache();
        Ok(exec)
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// The update a training step runs after its backward, if any.
    pub fn update(&self) -> Option<&dyn StepUpdate> {
        self.update.as_deref()
    }

    /// [`Executor::update`], to change it (its owner reaches its own type
    /// through [`StepUpdate::as_any_mut`]).
    pub fn update_mut(&mut self) -> Option<&mut dyn StepUpdate> {
        match &mut self.update {
            Some(u) => Some(u.as_mut()),
            None => None,
        }
    }

    /// Steps the update took so far (0 without one).
    fn steps_taken(&self) -> u64 {
        self.update.as_ref().map_or(0, |u| u.steps_taken())
    }

    /// GPU bytes held: parameters, gradients, optimizer state, inputs,
    /// constants and intermediates.
    pub fn peak_bytes(&self) -> u64 {
        self.plan.peak_bytes(self.grads.is_some(), self.state_arenas)
    }

    /// Dispatches recorded by one training step (forward, backward, the
    /// gradient norm when clipping, optimizer).
    pub fn dispatches_per_step(&self) -> usize {
        self.train_dispatches().count() + self.update_dispatches().count()
    }

    /// Every dispatch one training step records, in order: forward,
    /// backward, the gradient norm when clipping, the update. Their grids
    /// and constants are known once the executor is built, without running
    /// them (a test reads them to check a step's shape on an adapter).
    pub fn step_dispatches(&self) -> impl Iterator<Item = &Dispatch> {
        self.train_dispatches().chain(self.update_dispatches())
    }

    /// The update's dispatches in order (an optimizer's: the gradient norm
    /// when clipping, then the update). Empty without an update.
    fn update_dispatches(&self) -> impl Iterator<Item = &Dispatch> {
        self.update.iter().flat_map(|u| u.dispatches())
    }

    /// Where the parameter `name`'s gradient lives in the gradient arena.
    fn grad_slice(&self, op: &'static str, name: &str) -> Result<View<'_>> {
        let grads = self.grads.as_ref().ok_or_else(|| Error::InvalidArgument {
            op,
            reason: "this executor has no gradients".into(),
        })?;
        let (p, offset) = self
            .plan
            .param_offsets
            .iter()
            .find(|(p, _)| self.graph.node(*p).name == name)
            .copied()
            .ok_or_else(|| Error::InvalidArgument {
                op,
                reason: format!("no parameter named `{name}`"),
            })?;
        if self.graph.is_frozen(p) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("parameter `{name}` is frozen: it has no gradient"),
            });
        }
        grads.slice(offset, self.graph.node(p).len())
    }

    /// The gradient of the parameter `name` as accumulated so far (waits).
    pub fn read_grad_named(&self, name: &str) -> Result<Vec<f32>> {
        self.kernels.read(self.grad_slice("read_grad_named", name)?)
    }

    /// Replaces the gradient of the parameter `name`: a parameter held by
    /// several executors (a tied embedding on two pipeline stages, a norm
    /// replicated over tensor-parallel shards) gets the sum of every
    /// copy's contribution before the optimizer step.
    pub fn write_grad_named(&self, name: &str, values: &[f32]) -> Result<()> {
        self.kernels.write(self.grad_slice("write_grad_named", name)?, values)
    }

    /// A training step's forward and backward dispatches, in order.
    fn train_dispatches(&self) -> impl Iterator<Item = &Dispatch> {
        self.train_order
            .iter()
            .filter_map(|&i| self.train_loss_dispatches[i].as_ref().or(self.dispatches[i].as_ref()))
    }

    pub(super) fn view(&self, t: Tensor) -> Result<View<'_>> {
        if t.0 >= self.graph.len() {
            return Err(Error::InvalidArgument {
                op: "Executor",
                reason: format!("tensor #{} is not in this executor's graph", t.0),
            });
        }
        let node = self.graph.node(t);
        let len = stored_words(node.dtype, node.len());
        match self.plan.storage[t.0] {
            Storage::Param { offset } => self.params.slice(offset, len),
            Storage::Grad { offset } => match &self.grads {
                Some(g) => g.slice(offset, len),
                None => Err(self.not_stored(t)),
            },
            Storage::Input { index } => Ok(self.inputs[index].view()),
            Storage::Constant { index } => Ok(self.constants[index].view()),
            Storage::Cache { index } => Ok(self.caches[index].view()),
            Storage::Slot { index } => self.slots[index].slice(0, len),
            Storage::Unused => Err(self.not_stored(t)),
        }
    }

    fn not_stored(&self, t: Tensor) -> Error {
        Error::InvalidArgument {
            op: "Executor",
            reason: format!(
                "`{}` is not computed by this executor (not needed by its outputs)",
                self.graph.node(t).name
            ),
        }
    }

    /// The dispatches of `nodes`, in order. Compiling pipelines is what
    /// costs here (a software adapter's LLVM spends seconds on each large
    /// matmul variant), so off GL several threads build at once: each
    /// compiles a different pipeline, and one needing a pipeline another is
    /// compiling waits for it (`Kernels::pipeline`). GL compiles at a
    /// pipeline's first use, on one context, so it builds on this thread.
    fn build_dispatches(&self, nodes: &[usize]) -> Result<Vec<Dispatch>> {
        let threads = match self.kernels.device().info().backend {
            wgpu::Backend::Gl => 1,
            _ => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8)
                .min(nodes.len()),
        };
        if threads <= 1 {
            return nodes.iter().map(|&i| self.build_dispatch(i)).collect();
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut built: Vec<(usize, Result<Dispatch>)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        while let Some(&i) = nodes.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                            mine.push((i, self.build_dispatch(i)));
                        }
                        mine
                    })
                })
                .collect();
            // A worker can only panic on a bug; its panic goes on as it was.
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_else(|payload| std::panic::resume_unwind(payload)))
                .collect()
        });
        built.sort_by_key(|(i, _)| *i);
        built.into_iter().map(|(_, d)| d).collect()
    }

    /// Node `i`'s dispatch, as its op's family binds it.
    fn build_dispatch(&self, i: usize) -> Result<Dispatch> {
        let op = &self.graph.node(Tensor(i)).op;
        op.family().dispatch(&DispatchContext { exec: self, node: i })
    }

    /// The training dispatch of loss node `i`: the loss, its gradient and
    /// the last layer's work `fusion` names.
    fn build_loss_fusion(&self, i: usize, fusion: &LossFusion) -> Result<Dispatch> {
        let node = self.graph.node(Tensor(i));
        let backward = self.plan.loss_with_grad[i].map(Tensor).ok_or_else(|| Error::Internal {
            op: "Executor",
            reason: format!("`{}` is not computed with its gradient", node.name),
        })?;
        let (pred, target) = (node.inputs[0], node.inputs[1]);
        let targets = match node.op {
            Op::Loss(LossOp::Loss(LossKind::Mse)) => LossTargets::Values(self.view(target)?),
            _ => LossTargets::Labels(self.view(target)?),
        };
        let (rows, cols) = match self.graph.shape(pred) {
            [rows, cols] => (*rows, *cols),
            other => (1, other.iter().product()),
        };
        let linear = match fusion.linear {
            Some(l) => Some(LossLinear {
                x: self.view(l.x)?,
                weight: self.view(l.weight)?,
                bias: l.bias.map(|b| self.view(b)).transpose()?,
                inner: self.graph.shape(l.weight).get(1).copied().unwrap_or(0),
                weight_grad: self.view(Tensor(l.weight_grad))?,
            }),
            None => None,
        };
        let bias_grad = fusion.bias_grad.map(|j| self.view(Tensor(j))).transpose()?;
        let dloss = self.view(self.graph.node(backward).inputs[2])?;
        self.kernels.loss_forward_backward_fused(
            targets,
            self.view(Tensor(i))?,
            self.view(backward)?,
            self.view(pred)?,
            dloss,
            rows,
            cols,
            linear,
            bias_grad,
        )
    }

    fn input_storage(&self, t: Tensor, dtype: DType, len: usize) -> Result<&GpuTensor> {
        if t.0 >= self.graph.len() {
            return Err(Error::InvalidArgument {
                op: "set_input",
                reason: format!("tensor #{} is not in the graph", t.0),
            });
        }
        let node = self.graph.node(t);
        let Storage::Input { index } = self.plan.storage[t.0] else {
            return Err(Error::InvalidArgument {
                op: "set_input",
                reason: format!("`{}` is not an input of this executor", node.name),
            });
        };
        if node.dtype != dtype || node.len() != len {
            return Err(Error::shape(
                "set_input",
                format!(
                    "`{}` takes {} {:?} values, got {len} {dtype:?}",
                    node.name,
                    node.len(),
                    node.dtype
                ),
                &[&node.shape, &[len]],
            ));
        }
        Ok(&self.inputs[index])
    }

    /// Queues f32 data for an input; it takes effect at the next run.
    pub fn set_input(&self, t: Tensor, data: &[f32]) -> Result<()> {
        let buf = self.input_storage(t, DType::F32, data.len())?;
        self.kernels.write(buf.view(), data)
    }

    /// Queues u32 class labels for a labels input. A label outside the
    /// classes of the cross-entropy reading it is an error here, before it
    /// can reach the GPU.
    pub fn set_labels(&self, t: Tensor, labels: &[u32]) -> Result<()> {
        let buf = self.input_storage(t, DType::U32, labels.len())?;
        // Each op reading the input itself, or a reshape of it, checks the
        // values (a class label, a token id).
        let reads_t = |u: Tensor| {
            let mut u = u;
            while self.graph.node(u).op == LayoutOp::Reshape {
                u = self.graph.node(u).inputs[0];
            }
            u == t
        };
        for (i, node) in self.graph.nodes().iter().enumerate() {
            for (slot, &input) in node.inputs.iter().enumerate() {
                if reads_t(input) {
                    node.op.family().check_u32_input(&self.graph, Tensor(i), slot, labels)?;
                }
            }
        }
        self.kernels.write(buf.view(), labels)
    }

    /// One training step in one submission: optionally zero the gradients,
    /// run forward and backward, apply the update (the optimizer, when
    /// `apply_update`), and copy the loss for reading when `read_loss`.
    /// Returns the loss when read.
    pub fn train_step(&mut self, zero_grad: bool, apply_update: bool, read_loss: bool) -> Result<Option<f32>> {
        crate::device::wait("train_step", self.train_step_async(zero_grad, apply_update, read_loss))
    }

    /// [`Executor::train_step`], awaited. The step is recorded and
    /// submitted when the future is first polled; only the loss's read-back
    /// waits (so with `read_loss` false it is ready at once).
    pub async fn train_step_async(
        &mut self,
        zero_grad: bool,
        apply_update: bool,
        read_loss: bool,
    ) -> Result<Option<f32>> {
        let Some(grads) = &self.grads else {
            return Err(Error::InvalidArgument {
                op: "train_step",
                reason: "this executor was built without backward()".into(),
            });
        };
        let loss = self
            .gradients
            .as_ref()
            .map(|g| g.loss)
            .ok_or_else(|| Error::InvalidArgument {
                op: "train_step",
                reason: "no loss".into(),
            })?;
        if apply_update {
            let Some(u) = &self.update else {
                return Err(Error::InvalidArgument {
                    op: "train_step",
                    reason: "no optimizer was given".into(),
                });
            };
            u.prepare(&self.kernels)?;
        }
        self.feed_dropout(true)?;
        let loss_view = self.view(loss)?;
        // The update may seed this step's loss gradient (loss scaling: the
        // scale) and read words back with the loss (its state).
        let scale = self.update.as_ref().and_then(|u| u.loss_seed());
        let seed = match (scale, &self.gradients) {
            (Some(_), Some(g)) if matches!(self.plan.storage[g.seed().0], Storage::Constant { .. }) => {
                Some(self.view(g.seed())?)
            }
            _ => None,
        };
        let scale_state = self.update.as_ref().and_then(|u| u.readback());
        let steps = self.train_dispatches();
        let update = self.update_dispatches().filter(|_| apply_update);
        let staging = &self.scalar_staging;
        self.kernels.submit_pass(
            "train_step",
            steps.chain(update),
            |encoder| {
                if zero_grad {
                    encoder.clear_buffer(grads.buffer(), 0, None);
                }
                if let (Some(scale), Some(seed)) = (scale, seed) {
                    encoder.copy_buffer_to_buffer(scale.buffer, scale.offset, seed.buffer, seed.offset, 4);
                }
            },
            |encoder| {
                if read_loss {
                    encoder.copy_buffer_to_buffer(loss_view.buffer, loss_view.offset, staging, 0, 4);
                    if let Some(state) = scale_state {
                        encoder.copy_buffer_to_buffer(state.buffer, state.offset, staging, 4, 4 * state.len as u64);
                    }
                }
            },
        )?;
        let scale_words = scale_state.map(|v| v.len);
        if let (true, Some(u)) = (apply_update, &mut self.update) {
            u.finish();
        }
        if !read_loss {
            return Ok(None);
        }
        let value = match (scale_words, &mut self.update) {
            (Some(words), Some(u)) => {
                let read: Vec<f32> = self
                    .kernels
                    .map_read_async(&self.scalar_staging, 4 * (1 + words) as u64)
                    .await?;
                u.read_back(read.get(1..).unwrap_or(&[]));
                read.first().copied().unwrap_or(f32::NAN)
            }
            _ => self.kernels.map_read_scalar_async(&self.scalar_staging).await?,
        };
        if !value.is_finite() {
            return Err(Error::NonFiniteLoss {
                value,
                step: self.steps_taken(),
            });
        }
        Ok(Some(value))
    }

    /// A training step's dispatches (forward, backward and the update), each
    /// submitted alone and waited for, in order ([`DispatchTime`]). Gradients accumulate and the parameters are
    /// updated as by [`Executor::train_step`] without zeroing, so profile
    /// on a copy of the state you care about.
    pub fn profile_train_step(&mut self) -> Result<DispatchTimes> {
        let mut times = Vec::new();
        if let Some(u) = &self.update {
            u.prepare(&self.kernels)?;
        }
        self.feed_dropout(true)?;
        for &i in &self.train_order {
            if let Some(d) = self.train_loss_dispatches[i].as_ref().or(self.dispatches[i].as_ref()) {
                times.push(self.time_dispatch(&self.graph.node(Tensor(i)).name, d)?);
            }
        }
        for d in self.update_dispatches() {
            times.push(self.time_dispatch("update", d)?);
        }
        Ok(times)
    }

    /// What [`Executor::run`] of `outputs` dispatches, each submitted alone
    /// and waited for, in order ([`DispatchTime`]).
    pub fn profile_run(&mut self, outputs: &[Tensor]) -> Result<DispatchTimes> {
        let order = order_for(&self.graph, &self.plan, outputs)?;
        self.feed_dropout(self.dropout.training)?;
        let mut times = Vec::new();
        for i in order {
            if let Some(d) = &self.dispatches[i] {
                times.push(self.time_dispatch(&self.graph.node(Tensor(i)).name, d)?);
            }
        }
        Ok(times)
    }

    /// One profile entry: `d` run alone and waited for.
    fn time_dispatch(&self, name: &str, d: &Dispatch) -> Result<DispatchTime> {
        let (time, on_gpu) = match self.kernels.time_on_gpu(d, 1)? {
            Some(time) => (time, true),
            None => (self.kernels.time_dispatch(d)?, false),
        };
        let bound_bytes = d
            .each_launch()
            .flat_map(|l| &l.recipe().bindings)
            .map(|b| b.bytes)
            .sum();
        Ok(DispatchTime {
            node: name.to_string(),
            entry: d.kernel().entry,
            time,
            on_gpu,
            bound_bytes,
        })
    }

    /// Where the gradient with respect to `input` lands (after a backward
    /// run), for sending to the previous pipeline stage.
    pub fn input_gradient(&self, input: Tensor) -> Result<View<'_>> {
        let g = self
            .gradients
            .as_ref()
            .and_then(|g| g.input(input))
            .ok_or_else(|| Error::InvalidArgument {
                op: "input_gradient",
                reason: "this input's gradient was not requested in backward_from".into(),
            })?;
        self.view(g)
    }

    /// Where an output lives, for collectives. Only outputs: other
    /// intermediates share slots and would read another tensor's values.
    pub fn tensor_view(&self, t: Tensor) -> Result<View<'_>> {
        let readable = t.0 < self.graph.len()
            && (self.plan.is_output[t.0]
                || matches!(
                    self.plan.storage[t.0],
                    Storage::Input { .. } | Storage::Param { .. } | Storage::Constant { .. } | Storage::Cache { .. }
                ));
        if !readable {
            return Err(Error::InvalidArgument {
                op: "Executor",
                reason: format!(
                    "tensor #{} was not planned as an output of this executor: its memory is shared",
                    t.0
                ),
            });
        }
        self.view(t)
    }

    /// The whole gradient arena (every parameter's gradient, contiguous).
    pub fn gradient_arena(&self) -> Option<View<'_>> {
        self.grads.as_ref().map(|g| g.view())
    }

    /// The loss gradient a training step's backward starts from (one f32,
    /// 1 unless overwritten), for an owner whose optimizer lives outside
    /// this executor and scales the loss (ZeRO's shards): `None` without
    /// a backward seeded from a loss.
    pub fn loss_seed_view(&self) -> Option<View<'_>> {
        let seed = self.gradients.as_ref()?.seed();
        matches!(self.plan.storage[seed.0], Storage::Constant { .. })
            .then(|| self.view(seed).ok())
            .flatten()
    }

    /// The whole parameter arena.
    pub fn parameter_arena(&self) -> View<'_> {
        self.params.view()
    }

    /// The parameter arena's trainable part, which the gradient and
    /// optimizer-state arenas mirror: all of it unless some parameter is
    /// frozen (those lie after it).
    pub fn trainable_arena(&self) -> View<'_> {
        let all = self.params.view();
        View {
            len: self.plan.trainable_len.max(1).min(all.len),
            ..all
        }
    }

    /// Runs only what `outputs` need (no backward, no optimizer) in one
    /// submission. Read the results with [`Executor::read`].
    pub fn run(&mut self, outputs: &[Tensor]) -> Result<()> {
        if !self.run_orders.contains_key(outputs) {
            let order = order_for(&self.graph, &self.plan, outputs)?;
            self.run_orders.insert(outputs.to_vec(), order);
        }
        self.feed_dropout(self.dropout.training)?;
        let order = &self.run_orders[outputs];
        let dispatches = order.iter().filter_map(|&i| self.dispatches[i].as_ref());
        self.kernels.submit_pass("run", dispatches, |_| {}, |_| {})
    }

    /// What the executor writes into the graph's dropout control before
    /// each run ([`DropoutRun`]).
    pub fn dropout_run(&self) -> DropoutRun {
        self.dropout
    }

    /// Dropout in runs as in training steps (`true`, as PyTorch's
    /// `model.train()`), or in training steps only (`false`, the default:
    /// a run is an evaluation).
    pub fn set_training(&mut self, training: bool) {
        self.dropout.training = training;
    }

    /// Fixes the key of the dropout masks (`None`: the optimizer's step
    /// count), for an engine that steps the optimizer outside this
    /// executor or runs several micro-batches a step.
    pub fn set_dropout_step(&mut self, step: Option<u64>) {
        self.dropout.step = step;
    }

    /// Where this executor's batch starts in the whole batch, in examples,
    /// so a device's rows draw the masks one device would.
    pub fn set_dropout_first_example(&mut self, first_example: usize) {
        self.dropout.first_example = first_example;
    }

    /// Writes the dropout control words for the next run: the key, whether
    /// dropout applies (`on`), the first example.
    fn feed_dropout(&self, on: bool) -> Result<()> {
        if self.dropout_controls.is_empty() {
            return Ok(());
        }
        let step = self.dropout.step.unwrap_or_else(|| self.steps_taken());
        // The key folds the step's high bits in (a wrapped count still differs).
        let key = (step ^ (step >> 32)) as u32;
        let first = u32::try_from(self.dropout.first_example).map_err(|_| Error::InvalidArgument {
            op: "dropout",
            reason: format!("example {} is past 2^32", self.dropout.first_example),
        })?;
        let words = [key, u32::from(on), first, 0];
        for &t in &self.dropout_controls {
            let buf = self.input_storage(t, DType::U32, DROPOUT_CONTROL_WORDS)?;
            self.kernels.write(buf.view(), &words)?;
        }
        Ok(())
    }

    /// [`Executor::run`] that also reads `read` (one of `outputs`) back, in
    /// the same submission; waits for the GPU.
    pub fn run_and_read(&mut self, outputs: &[Tensor], read: Tensor) -> Result<Vec<f32>> {
        self.run_and_read_as(outputs, read, DType::F32)
    }

    /// [`Executor::run_and_read`] of a u32 output (sampled tokens).
    pub fn run_and_read_u32(&mut self, outputs: &[Tensor], read: Tensor) -> Result<Vec<u32>> {
        self.run_and_read_as(outputs, read, DType::U32)
    }

    /// [`Executor::run_and_read`], awaited.
    pub async fn run_and_read_async(&mut self, outputs: &[Tensor], read: Tensor) -> Result<Vec<f32>> {
        self.run_and_read_as_async(outputs, read, DType::F32).await
    }

    /// [`Executor::run_and_read_u32`], awaited.
    pub async fn run_and_read_u32_async(&mut self, outputs: &[Tensor], read: Tensor) -> Result<Vec<u32>> {
        self.run_and_read_as_async(outputs, read, DType::U32).await
    }

    fn run_and_read_as<T: bytemuck::Pod>(&mut self, outputs: &[Tensor], read: Tensor, dtype: DType) -> Result<Vec<T>> {
        crate::device::wait("run_and_read", self.run_and_read_as_async(outputs, read, dtype))
    }

    /// `T` is the Rust type of `dtype`, which `read` must have.
    async fn run_and_read_as_async<T: bytemuck::Pod>(
        &mut self,
        outputs: &[Tensor],
        read: Tensor,
        dtype: DType,
    ) -> Result<Vec<T>> {
        if !outputs.contains(&read) {
            return Err(Error::InvalidArgument {
                op: "run_and_read",
                reason: format!("tensor #{} is not among the outputs run", read.0),
            });
        }
        if let Some(node) = self.graph.get(read) {
            if node.dtype != dtype {
                let call = if dtype == DType::U32 {
                    "run_and_read_u32"
                } else {
                    "run_and_read"
                };
                return Err(Error::InvalidArgument {
                    op: "run_and_read",
                    reason: format!("`{}` holds {:?} values; {call} reads {dtype:?}", node.name, node.dtype),
                });
            }
        }
        if !self.run_orders.contains_key(outputs) {
            let order = order_for(&self.graph, &self.plan, outputs)?;
            self.run_orders.insert(outputs.to_vec(), order);
        }
        self.feed_dropout(self.dropout.training)?;
        let view = self.tensor_view(read)?;
        let order = &self.run_orders[outputs];
        let dispatches = order.iter().filter_map(|&i| self.dispatches[i].as_ref());
        self.kernels
            .submit_pass_and_read_async("run", dispatches, |_| {}, view)
            .await
    }

    /// Clears every cache tensor ([`Graph::cache`]) to zero, in one
    /// submission.
    pub fn clear_caches(&mut self) -> Result<()> {
        let caches = &self.caches;
        self.kernels.submit_pass(
            "clear_caches",
            std::iter::empty(),
            |encoder| {
                for cache in caches {
                    encoder.clear_buffer(cache.buffer(), 0, None);
                }
            },
            |_| {},
        )
    }

    /// Reads an output (waits for the GPU).
    pub fn read(&self, t: Tensor) -> Result<Vec<f32>> {
        crate::device::wait("read", self.read_async(t))
    }

    /// [`Executor::read`], awaited.
    pub async fn read_async(&self, t: Tensor) -> Result<Vec<f32>> {
        self.not_stored_weight("read", t)?;
        self.kernels.read_async(self.tensor_view(t)?).await
    }

    /// An f16 or quantized parameter's words are not f32 values: read an
    /// f16 one through [`Executor::parameters`], which widens them.
    fn not_stored_weight(&self, op: &'static str, t: Tensor) -> Result<()> {
        match self.graph.get(t) {
            Some(node) if node.dtype == DType::F16 => Err(Error::InvalidArgument {
                op,
                reason: format!("`{}` is stored in f16; read it with Executor::parameters", node.name),
            }),
            Some(node) if node.dtype.is_stored_weight() => Err(Error::InvalidArgument {
                op,
                reason: format!("`{}` holds {}, not f32 values", node.name, node.dtype.describe()),
            }),
            _ => Ok(()),
        }
    }

    /// Reads a u32 output (argmax).
    pub fn read_u32(&self, t: Tensor) -> Result<Vec<u32>> {
        crate::device::wait("read_u32", self.read_u32_async(t))
    }

    /// [`Executor::read_u32`], awaited.
    pub async fn read_u32_async(&self, t: Tensor) -> Result<Vec<u32>> {
        self.not_stored_weight("read_u32", t)?;
        self.kernels.read_async(self.tensor_view(t)?).await
    }

    /// The gradient of `param` accumulated so far.
    pub fn read_grad(&self, param: Tensor) -> Result<Vec<f32>> {
        let g = self
            .gradients
            .as_ref()
            .and_then(|g| g.get(param))
            .ok_or_else(|| Error::InvalidArgument {
                op: "read_grad",
                reason: "no gradient for this tensor (not a parameter the loss depends on, or no backward)".into(),
            })?;
        self.read(g)
    }

    /// Host copies of every parameter with f32 values: (name, shape,
    /// values); an f16 parameter's values widened to f32 (exact). A
    /// quantized parameter (a frozen base's, whose values are its file's
    /// blocks, which a GGUF reader decodes) is left out.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
        crate::device::wait("Executor::parameters", self.parameters_async())
    }

    /// [`Executor::parameters`], awaited.
    pub async fn parameters_async(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
        let all: Vec<f32> = self.kernels.read_async(self.params.view()).await?;
        Ok(self
            .plan
            .param_offsets
            .iter()
            .filter(|&&(p, _)| !matches!(self.graph.node(p).dtype, DType::Quant(_)))
            .map(|&(p, offset)| {
                let node = self.graph.node(p);
                (
                    node.name.clone(),
                    node.shape.clone(),
                    take_parameter(&all[offset..], node.dtype, node.len()),
                )
            })
            .collect())
    }

    /// (name, shape) of every parameter, in arena order.
    pub fn parameters_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.plan
            .param_offsets
            .iter()
            .map(|&(p, _)| (self.graph.node(p).name.clone(), self.graph.node(p).shape.clone()))
            .collect()
    }

    /// Every trainable parameter's place in the arenas (the gradient and
    /// state arenas hold no frozen one), in graph order.
    pub fn parameter_spans(&self) -> Vec<ParamSpan> {
        self.plan
            .param_offsets
            .iter()
            .filter(|&&(p, _)| !self.graph.is_frozen(p))
            .map(|&(p, offset)| ParamSpan {
                name: self.graph.node(p).name.clone(),
                shape: self.graph.node(p).shape.clone(),
                offset,
            })
            .collect()
    }

    /// The parameter arena's host copy with `params` (name, shape, values)
    /// written in, every name and shape checked; nothing on the GPU changes
    /// (write it with [`Executor::write_parameter_arena`]).
    pub fn arena_with_parameters(&self, params: &[(String, Vec<usize>, Vec<f32>)]) -> Result<Vec<f32>> {
        // A quantized parameter's words come back as they are (bits in the
        // f32 host copy); values for one are refused (put_parameter).
        let mut host: Vec<f32> = self.kernels.read(self.params.view())?;
        let find = |name: &str| {
            self.plan
                .param_offsets
                .iter()
                .find(|(p, _)| self.graph.node(*p).name == name)
                .copied()
        };
        for (name, shape, values) in params {
            let (p, offset) = find(name).ok_or_else(|| Error::InvalidArgument {
                op: "load_state",
                reason: format!("the model has no parameter `{name}`"),
            })?;
            let node = self.graph.node(p);
            if &node.shape != shape || values.len() != node.len() {
                return Err(Error::shape(
                    "load_state",
                    format!("parameter `{name}`: model has {:?}, checkpoint {shape:?}", node.shape),
                    &[&node.shape, shape],
                ));
            }
            put_parameter(&mut host[offset..], node.dtype, values)?;
        }
        Ok(host)
    }

    /// Writes a host copy of the whole parameter arena (one
    /// [`Executor::arena_with_parameters`] made).
    pub fn write_parameter_arena(&self, host: &[f32]) -> Result<()> {
        self.kernels.write(self.params.view(), host)
    }
}

/// Writes a parameter's `values` at the start of `arena` as `dtype` stores
/// them: f32 as is, f16 rounded to nearest and packed two per word (the
/// words' bits carried in the f32 arena's host copy). Values cannot be
/// quantized here: a quantized parameter comes as its file's blocks.
fn put_parameter(arena: &mut [f32], dtype: DType, values: &[f32]) -> Result<()> {
    match dtype {
        DType::F16 => {
            let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            for (slot, word) in arena.iter_mut().zip(crate::kernels::pack_f16(&halves)) {
                *slot = f32::from_bits(word);
            }
        }
        DType::Quant(format) => {
            return Err(Error::InvalidArgument {
                op: "put_parameter",
                reason: format!(
                    "f32 values cannot be stored as {}: a quantized parameter is given as its blocks",
                    format.name()
                ),
            })
        }
        DType::F32 | DType::U32 => arena[..values.len()].copy_from_slice(values),
    }
    Ok(())
}

/// The `len` values of a `dtype` parameter at the start of `arena`, as f32.
fn take_parameter(arena: &[f32], dtype: DType, len: usize) -> Vec<f32> {
    match dtype {
        DType::F16 => {
            let words: Vec<u32> = arena[..stored_words(dtype, len)].iter().map(|v| v.to_bits()).collect();
            crate::kernels::unpack_f16(&words, len)
                .iter()
                .map(|h| h.to_f32())
                .collect()
        }
        DType::F32 | DType::U32 => arena[..len].to_vec(),
        // Left out before reading (Executor::parameters).
        DType::Quant(_) => Vec::new(),
    }
}

/// The mappable buffer a training step copies its loss into, and `words`
/// more f32 after it (what the update reads back with the loss).
fn scalar_staging(kernels: &Kernels, words: usize) -> wgpu::Buffer {
    kernels.device().wgpu_device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("scalar readback"),
        size: 4 * (1 + words) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// A model too large for the adapter is one clear error, with the numbers,
/// before any buffer is allocated or the arena's host copy is built.
fn check_memory(kernels: &Kernels, graph: &Graph, plan: &Plan, training: bool, state_arenas: usize) -> Result<()> {
    const BYTES: u64 = 4;
    let arena = plan.param_arena_len.max(1) as u64 * BYTES;
    let trainable = plan.trainable_len.max(1) as u64 * BYTES;
    let own_buffers = |i: &usize| {
        matches!(
            plan.storage[*i],
            Storage::Input { .. } | Storage::Constant { .. } | Storage::Cache { .. }
        )
    };
    let largest_input = plan
        .order
        .iter()
        .filter(|i| own_buffers(i))
        .map(|&i| graph.node(Tensor(i)).len() as u64 * BYTES)
        .max()
        .unwrap_or(0);
    let largest_slot = plan.slot_len.iter().max().map_or(0, |&len| len as u64 * BYTES);
    kernels.check_allocation(
        "Executor::new",
        &[
            ("parameters", arena, arena),
            (
                "gradients",
                if training { trainable } else { 0 },
                if training { trainable } else { 0 },
            ),
            (
                "optimizer state",
                trainable * state_arenas as u64,
                if state_arenas > 0 { trainable } else { 0 },
            ),
            ("inputs, constants and caches", plan.input_bytes, largest_input),
            ("intermediates", plan.slot_bytes, largest_slot),
        ],
    )
}

/// The planned nodes `outputs` need, in plan order. Only planned outputs
/// (and inputs, parameters) can be asked for.
fn order_for(graph: &Graph, plan: &Plan, outputs: &[Tensor]) -> Result<Vec<usize>> {
    let mut needed = vec![false; graph.len()];
    for t in outputs {
        let known = t.0 < graph.len() && plan.storage[t.0] != Storage::Unused;
        if !known
            || !(plan.is_output[t.0] || matches!(plan.storage[t.0], Storage::Input { .. } | Storage::Param { .. }))
        {
            return Err(Error::InvalidArgument {
                op: "run",
                reason: format!("tensor #{} was not planned as an output of this executor", t.0),
            });
        }
        needed[t.0] = true;
    }
    for i in (0..graph.len()).rev() {
        if needed[i] {
            for t in &plan.reads[i] {
                needed[t.0] = true;
            }
        }
    }
    Ok(plan.order.iter().copied().filter(|&i| needed[i]).collect())
}

/// The arguments [`Executor`]'s constructors refuse before planning.
fn check_build(
    graph: &Graph,
    outputs: &[Tensor],
    gradients: Option<&Gradients>,
    update: Option<&UpdateSpec<'_>>,
    options: &PlanOptions,
) -> Result<()> {
    if update.is_some() && gradients.is_none() {
        return Err(Error::InvalidArgument {
            op: "Executor::new",
            reason: "an optimizer needs the gradients from backward()".into(),
        });
    }
    let foreign = |t: &Tensor| t.0 >= graph.len();
    let grads_foreign = gradients.is_some_and(|g| {
        foreign(&g.loss) || g.accumulations().iter().any(foreign) || g.input_gradients().iter().any(foreign)
    });
    if outputs.iter().any(foreign) || grads_foreign {
        return Err(Error::InvalidArgument {
            op: "Executor::new",
            reason: "an output or gradient is not in this graph".into(),
        });
    }
    // The gradient and state arenas share the parameters' layout, and
    // nothing computes a gradient or an update in f16 or quantized: such a
    // parameter is frozen (a LoRA adapter's base) or inference's.
    if gradients.is_some() {
        if let Some(p) = graph
            .parameters()
            .into_iter()
            .find(|&p| graph.node(p).dtype.is_stored_weight() && !graph.is_frozen(p))
        {
            return Err(Error::InvalidArgument {
                op: "Executor::new",
                reason: format!(
                    "parameter `{}` holds {}, which a training executor takes only frozen (Graph::freeze)",
                    graph.node(p).name,
                    graph.node(p).dtype.describe()
                ),
            });
        }
    }
    if options.arena_alignment != 0 && (!options.arena_alignment.is_power_of_two() || options.arena_alignment < 4) {
        return Err(Error::InvalidArgument {
            op: "Executor::new",
            reason: format!(
                "arena alignment {} B must be 0 or a power of two of at least 4 B",
                options.arena_alignment
            ),
        });
    }
    Ok(())
}

/// `options` as this device plans them, and the arenas' alignment in
/// elements.
fn device_plan_options(kernels: &Kernels, options: PlanOptions) -> (PlanOptions, usize) {
    // Both are powers of two, so the larger is a multiple of the device's.
    let align_bytes = kernels
        .device()
        .limits()
        .min_storage_buffer_offset_alignment
        .max(options.arena_alignment);
    let align = (align_bytes as usize / 4).max(1);
    // A fused kernel the device's limits cannot take is planned unfused.
    let mut options = options;
    options.linear_in_loss &= kernels.fits_limits(crate::kernels::registry::MSE_LINEAR_FORWARD_BACKWARD)
        && kernels.fits_limits(crate::kernels::registry::CROSS_ENTROPY_LINEAR_FORWARD_BACKWARD);
    // The single-workgroup loss fusions only as large as this adapter
    // runs them well (a GPU's limits are lower).
    options.fused_loss_max = options.fused_loss_max.min(kernels.fused_loss_max());
    options.linear_in_loss_max_macs = options.linear_in_loss_max_macs.min(kernels.linear_in_loss_max_macs());
    (options, align)
}

/// The parameter arena's initial contents: each parameter's values (or
/// packed words) at its planned offset.
fn initial_arena(graph: &Graph, plan: &Plan, arena_len: usize) -> Result<Vec<f32>> {
    let mut initial = vec![0.0f32; arena_len];
    for &(p, offset) in &plan.param_offsets {
        match &graph.node(p).op {
            Op::Source(SourceOp::Parameter {
                init: ParameterInit::Values(init),
            }) => put_parameter(&mut initial[offset..], graph.node(p).dtype, init)?,
            // Already in the kernels' layout: the words' bits as they are.
            Op::Source(SourceOp::Parameter {
                init: ParameterInit::Packed(words),
            }) => {
                initial[offset..offset + words.len()]
                    .iter_mut()
                    .zip(words)
                    .for_each(|(slot, &w)| *slot = f32::from_bits(w));
            }
            Op::Source(SourceOp::Parameter {
                init: ParameterInit::Planned,
            }) => {
                return Err(Error::InvalidArgument {
                    op: "Executor::new",
                    reason: format!(
                        "parameter `{}` has no contents: its graph was built from a model sized for planning only \
                         (a dry run), which no executor runs",
                        graph.node(p).name
                    ),
                })
            }
            _ => {}
        }
    }
    Ok(initial)
}

/// Buffers of the plan's inputs, constants (uploaded) and caches.
fn source_buffers(
    kernels: &Kernels,
    graph: &Graph,
    plan: &Plan,
) -> Result<(Vec<GpuTensor>, Vec<GpuTensor>, Vec<GpuTensor>)> {
    let mut inputs = Vec::with_capacity(plan.input_count);
    let mut constants = Vec::with_capacity(plan.constant_count);
    let mut caches = Vec::with_capacity(plan.cache_count);
    for &i in &plan.order {
        let node = graph.node(Tensor(i));
        match (&node.op, plan.storage[i]) {
            (Op::Source(SourceOp::Input), Storage::Input { .. }) => inputs.push(kernels.zeros(node.len())?),
            (Op::Source(SourceOp::Constant { values }), Storage::Constant { .. }) => {
                constants.push(kernels.upload(values)?)
            }
            (Op::Source(SourceOp::Cache), Storage::Cache { .. }) => caches.push(kernels.zeros(node.len())?),
            _ => {}
        }
    }
    Ok((inputs, constants, caches))
}

/// The plan's slots: new buffers, or prefixes of a pool's.
fn slot_buffers(kernels: &Kernels, plan: &Plan, pooled: Option<&ArenaPool>) -> Result<Vec<GpuTensor>> {
    let slots = match pooled {
        Some(pool) => plan
            .slot_len
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                pool.slots
                    .get(i)
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "Executor::with_arenas",
                        reason: format!("{} pooled slots for {} planned", pool.slots.len(), plan.slot_len.len()),
                    })?
                    .share_prefix(len)
            })
            .collect::<Result<Vec<_>>>()?,
        None => plan
            .slot_len
            .iter()
            .map(|&len| kernels.zeros(len))
            .collect::<Result<Vec<_>>>()?,
    };
    Ok(slots)
}

/// A training step runs what the loss and the gradients need, not other
/// outputs (predictions) the caller runs separately.
fn train_order(graph: &Graph, plan: &Plan, gradients: Option<&Gradients>) -> Result<Vec<usize>> {
    Ok(match gradients {
        Some(g) => {
            let mut targets = vec![g.loss];
            targets.extend(g.accumulations());
            targets.extend(g.input_gradients());
            let mut order = order_for(graph, plan, &targets)?;
            order.retain(|&i| !plan.in_loss_dispatch[i]);
            order
        }
        None => Vec::new(),
    })
}
