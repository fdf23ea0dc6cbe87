//! The memory plan: which nodes run, in what order, and where each tensor
//! lives. Parameters, their gradients and the optimizer state share one
//! layout in a few large buffers addressed by offset (so a gradient
//! all-reduce is one copy per device). Intermediates are assigned to slots
//! by liveness: tensors whose lifetimes don't overlap share a slot.
//!
//! Each slot is its own buffer rather than a range of one arena: wgpu
//! rejects a dispatch that binds one buffer both read-only and writable, and
//! a node always reads one intermediate while writing another.

use super::autodiff::Gradients;
use super::builder::{DType, Graph, Node, Tensor};
use super::ops::{ElementwiseOp, EmbeddingOp, LayoutOp, LossOp, MatmulOp, Op, ReduceOp, SourceOp};
use super::precision::Precision;
// FUSED_LOSS_MAX, LINEAR_IN_LOSS_MAX_MACS: PlanOptions' defaults, a CPU
// adapter's sizes (kernels/loss.rs gives the reasons, and a GPU's).
use crate::kernels::{Activation, Binary, MatmulForm, FUSED_LOSS_MAX, LINEAR_IN_LOSS_MAX_MACS};

/// Where a node's output lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// In the parameter arena at this element offset.
    Param { offset: usize },
    /// In the gradient arena, at its parameter's offset.
    Grad { offset: usize },
    /// Its own buffer, written by the host before a run.
    Input { index: usize },
    /// Its own buffer, uploaded once.
    Constant { index: usize },
    /// Its own buffer, kept from run to run ([`SourceOp::Cache`]).
    Cache { index: usize },
    /// An intermediate in a reusable slot.
    Slot { index: usize },
    /// Not needed by any output: never computed.
    Unused,
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// Every node that runs, in a topological order.
    pub order: Vec<usize>,
    pub storage: Vec<Storage>,
    /// Size of each slot in elements.
    pub slot_len: Vec<usize>,
    /// (parameter, element offset) in parameter order; offsets and lengths
    /// count 4-byte words, two values of an f16 parameter to a word.
    pub param_offsets: Vec<(Tensor, usize)>,
    /// Length of the parameter arena in elements.
    pub param_arena_len: usize,
    /// Elements `0..trainable_len` of the parameter arena hold the
    /// parameters that are not frozen (`Graph::freeze`); the gradient arena
    /// and each optimizer-state arena are this long, at the same offsets.
    /// Frozen parameters lie after it. Equal to `param_arena_len` when
    /// nothing is frozen.
    pub trainable_len: usize,
    /// Elements `0..decay_len` of the arena hold the parameters weight decay
    /// applies to; the rest hold those excluded from it
    /// (`Graph::exclude_from_weight_decay`).
    pub decay_len: usize,
    pub input_count: usize,
    pub constant_count: usize,
    pub cache_count: usize,
    /// Tensors that survive a run and may be read after it; every other
    /// intermediate shares its slot with later tensors.
    pub is_output: Vec<bool>,
    /// Nodes that add their result into their output (a matmul or column
    /// sum writing straight into a parameter's gradient).
    pub accumulate: Vec<bool>,
    /// Nodes computed by another node's dispatch (an accumulation done by
    /// its producer, a bias add done by its matmul): no dispatch of their own.
    pub fused_away: Vec<bool>,
    /// For a matmul that also adds a bias: the bias add it computes.
    pub bias_into: Vec<Option<usize>>,
    /// For a matmul that also applies an activation: the activation node
    /// whose output it writes. The pre-activation (the bias add) is stored
    /// too when something still reads it, else it has no storage.
    pub activation_into: Vec<Option<usize>>,
    /// For a matmul whose product is an activation's incoming gradient:
    /// the activation-backward node whose output (product · f'(x)) it writes.
    pub activation_grad_into: Vec<Option<usize>>,
    /// The tensors each node reads: its graph inputs, except that a ReLU's
    /// backward reads the ReLU's output instead of its input (f'(x) is the
    /// same where relu(x) > 0 and where x > 0), so a fused Linear + ReLU
    /// need not keep the pre-activation.
    pub reads: Vec<Vec<Tensor>>,
    /// For a loss computed with its gradient: the backward node it fills.
    pub loss_with_grad: Vec<Option<usize>>,
    /// For such a loss: the last layer's work its training-step dispatch
    /// also does (a training step only; runs dispatch those nodes alone).
    pub loss_fusion: Vec<Option<LossFusion>>,
    /// Nodes a training step does not dispatch because their loss's fused
    /// dispatch computes them (see [`LossFusion`]).
    pub in_loss_dispatch: Vec<bool>,
    /// Bytes of intermediates if every one had its own buffer.
    pub naive_intermediate_bytes: u64,
    /// Bytes of the slots actually allocated.
    pub slot_bytes: u64,
    /// Bytes of the inputs, constants and caches (each its own buffer).
    pub input_bytes: u64,
    /// Bytes of the forward's intermediates a training step's backward
    /// reads: what it holds from forward to backward (its activation
    /// memory; f16 storage halves it). 0 without gradients.
    pub held_activation_bytes: u64,
}

/// The Linear layer `pred = x·weightᵀ (+ bias)` computed inside a loss's
/// training dispatch, with its weight gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearInLoss {
    /// The matmul node (the forward moves into the loss in a training step).
    pub matmul: usize,
    pub x: Tensor,
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// The node accumulating d loss / d weight (dpredᵀ·x).
    pub weight_grad: usize,
}

/// Work a loss's single-workgroup training dispatch does besides the loss
/// and its gradient, each saving a dispatch: a small last Linear layer's
/// forward and weight gradient, and its bias gradient (a column sum of the
/// loss gradient, whatever the layer's size).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LossFusion {
    pub linear: Option<LinearInLoss>,
    /// The column-sum node accumulating the bias gradient.
    pub bias_grad: Option<usize>,
}

/// How a graph is planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Combine nodes into fewer dispatches (bias add and gradient
    /// accumulation inside matmuls, a loss with its gradient and the last
    /// layer's work). Off: one dispatch per node, the reference that fused
    /// results are tested against.
    pub fuse: bool,
    /// With `fuse`: a small last Linear layer may run inside its loss's
    /// dispatch (`*_linear_forward_backward`, 10 storage buffers). The
    /// executor turns it off on a device whose limits cannot take that
    /// kernel (WebGPU's default of 8 storage buffers per stage).
    pub linear_in_loss: bool,
    /// Least byte alignment of each parameter's offset in the parameter,
    /// gradient and optimizer-state arenas (a power of two; 0: the
    /// device's own `min_storage_buffer_offset_alignment`). The executor
    /// uses the larger of this and the device's. Data parallel gives every
    /// replica the same value so their arenas match offset for offset
    /// whatever their adapters.
    pub arena_alignment: u32,
    /// Largest prediction (elements) whose loss and gradient run as one
    /// single-workgroup dispatch. The executor lowers it to its adapter's
    /// `Kernels::fused_loss_max` (a GPU's is smaller).
    pub fused_loss_max: usize,
    /// Largest Linear layer (rows·outputs·inputs multiply-adds, done once
    /// forward and once for the weight gradient) computed inside the
    /// loss's single-workgroup dispatch; lowered by the executor to
    /// `Kernels::linear_in_loss_max_macs`.
    pub linear_in_loss_max_macs: usize,
    /// Where a training step keeps the activations its backward reads
    /// ([`crate::graph::precision`]). The graph's builder applies it
    /// before planning (the engines call [`Graph::with_f16_activations`]),
    /// since it adds nodes.
    pub precision: Precision,
    /// Recompute each block's forward in its backward (graph/checkpoint.rs),
    /// applied, like `precision`, by the graph's builder: a model cut into
    /// blocks (the engines' `with_blocks` constructors).
    pub checkpoint_activations: bool,
}

impl PlanOptions {
    /// Nothing fused: one dispatch per node, the reference fused plans are
    /// tested against.
    pub const UNFUSED: PlanOptions = PlanOptions {
        fuse: false,
        linear_in_loss: false,
        arena_alignment: 0,
        fused_loss_max: FUSED_LOSS_MAX,
        linear_in_loss_max_macs: LINEAR_IN_LOSS_MAX_MACS,
        precision: Precision::F32,
        checkpoint_activations: false,
    };
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            fuse: true,
            linear_in_loss: true,
            arena_alignment: 0,
            fused_loss_max: FUSED_LOSS_MAX,
            linear_in_loss_max_macs: LINEAR_IN_LOSS_MAX_MACS,
            precision: Precision::F32,
            checkpoint_activations: false,
        }
    }
}

const BYTES: u64 = 4;

/// 4-byte words that `len` values of `dtype` take in storage: an f16
/// parameter packs two values per word (the first in the low half), a
/// quantized one takes its format's words per block of 32 values.
pub fn stored_words(dtype: DType, len: usize) -> usize {
    match dtype {
        DType::F16 => len.div_ceil(2),
        DType::Quant(format) => format.stored_words(len),
        DType::F32 | DType::U32 => len,
    }
}

impl Plan {
    /// Plans the nodes needed for `outputs` (and every gradient in `grads`).
    /// `align` is the storage-offset alignment in elements.
    pub fn new(graph: &Graph, outputs: &[Tensor], grads: Option<&Gradients>, align: usize) -> Plan {
        Plan::with_options(graph, outputs, grads, align, PlanOptions::default())
    }

    /// [`Plan::new`] with explicit options (fusion off, for reference runs).
    /// One pass per concern, in order: what is needed, the parameter
    /// layout, the fusions, the training nodes a loss dispatch absorbs,
    /// then slots by liveness.
    pub fn with_options(
        graph: &Graph,
        outputs: &[Tensor],
        grads: Option<&Gradients>,
        align: usize,
        options: PlanOptions,
    ) -> Plan {
        let mut p = Planning::needed(graph, outputs, grads, options);
        p.lay_out_parameters(align.max(1));
        p.order = (0..p.count).filter(|&i| p.needed[i]).collect();
        p.count_consumers();
        p.fuse_gradient_accumulations();
        if options.fuse {
            p.fuse_bias_adds();
            p.fuse_residual_adds();
            p.fuse_activations();
            p.fuse_activation_gradients();
            p.fuse_losses_with_gradients();
        }
        p.mark_training_nodes(grads);
        p.fuse_into_loss_dispatches();
        let slots = p.assign_slots();
        let held_activation_bytes = p.held_activation_bytes(grads);
        let slot_bytes = slots.slot_len.iter().map(|&l| l as u64 * BYTES).sum();
        Plan {
            order: p.order,
            storage: p.storage,
            slot_len: slots.slot_len,
            param_offsets: p.param_offsets,
            param_arena_len: p.arena,
            trainable_len: p.trainable_len,
            decay_len: p.decay_len,
            is_output: p.is_output,
            accumulate: p.accumulate,
            fused_away: p.fused_away,
            bias_into: p.bias_into,
            activation_into: p.activation_into,
            activation_grad_into: p.activation_grad_into,
            reads: p.reads,
            loss_with_grad: p.loss_with_grad,
            loss_fusion: p.loss_fusion,
            in_loss_dispatch: p.in_loss_dispatch,
            input_count: slots.inputs,
            constant_count: slots.constants,
            cache_count: slots.caches,
            naive_intermediate_bytes: slots.naive,
            slot_bytes,
            input_bytes: slots.input_bytes,
            held_activation_bytes,
        }
    }

    /// Bytes of GPU memory the plan uses for parameters, `state_arenas`
    /// optimizer-state copies and gradients (when training) of the
    /// trainable ones, inputs, constants and intermediates. Every buffer is
    /// allocated once, so this is also the peak (readback staging aside).
    pub fn peak_bytes(&self, training: bool, state_arenas: usize) -> u64 {
        let arena = self.param_arena_len as u64 * BYTES;
        let trainable = self.trainable_len as u64 * BYTES;
        let copies = u64::from(training) + state_arenas as u64;
        arena + trainable * copies + self.input_bytes + self.slot_bytes
    }
}

/// The state [`Plan::with_options`]'s passes share, one entry per node.
struct Planning<'g> {
    graph: &'g Graph,
    nodes: &'g [Node],
    count: usize,
    options: PlanOptions,
    /// The outputs, the loss and the gradients asked for, and the tensors
    /// whose storage their reshapes share.
    roots: Vec<usize>,
    /// The node owning each node's storage (a reshape's source's owner).
    owner: Vec<usize>,
    needed: Vec<bool>,
    is_output: Vec<bool>,
    /// The node another node's dispatch also writes (a norm's statistics).
    companion: Vec<Option<usize>>,
    storage: Vec<Storage>,
    param_offsets: Vec<(Tensor, usize)>,
    arena: usize,
    trainable_len: usize,
    decay_len: usize,
    order: Vec<usize>,
    reads: Vec<Vec<Tensor>>,
    consumers: Vec<usize>,
    accumulate: Vec<bool>,
    fused_away: Vec<bool>,
    bias_into: Vec<Option<usize>>,
    activation_into: Vec<Option<usize>>,
    keeps_pre_activation: Vec<bool>,
    activation_grad_into: Vec<Option<usize>>,
    loss_with_grad: Vec<Option<usize>>,
    /// A training step's nodes: what the loss and the gradients need.
    in_training: Vec<bool>,
    loss_fusion: Vec<Option<LossFusion>>,
    in_loss_dispatch: Vec<bool>,
}

/// Slot assignment's allocator and what it counts besides the storage.
struct Slots {
    slot_len: Vec<usize>,
    slot_f16: Vec<bool>,
    free: Vec<usize>,
    /// Slots freed once the node at each index has run.
    release_at: Vec<Vec<usize>>,
    inputs: usize,
    constants: usize,
    caches: usize,
    naive: u64,
    input_bytes: u64,
}

/// The most times its length a free slot may be for a tensor to take it
/// ([`Slots::take`]).
const SLOT_FIT: usize = 4;

impl Slots {
    /// A slot for `len` words: the smallest free one that fits and is at
    /// most [`SLOT_FIT`] times `len`, else the largest free one shorter
    /// than `len` (grown), else a new one. A small tensor never takes a
    /// free slot many times its size: held from forward to backward (a
    /// LoRA adapter's [rows, r] product, read by its weight gradient) it
    /// would pin all of that slot, where a slot of its own costs its size.
    /// Outputs get slots of their
    /// own: they are read after a run, possibly after a different run (a
    /// prediction) has executed other nodes that share freed slots. f16
    /// copies (held from forward to backward) and f32 tensors never share a
    /// slot: a copy in a slot an f32 tensor sized would keep those bytes
    /// alive all through the backward.
    fn take(&mut self, len: usize, f16: bool, is_root: bool) -> usize {
        let (slot_len, slot_f16, free) = (&self.slot_len, &self.slot_f16, &self.free);
        let best = free
            .iter()
            .filter(|_| !is_root)
            .enumerate()
            .filter(|(_, &s)| slot_f16[s] == f16 && slot_len[s] >= len && slot_len[s] <= len.saturating_mul(SLOT_FIT))
            .min_by_key(|(_, &s)| slot_len[s])
            .map(|(k, _)| k)
            .or_else(|| {
                (0..free.len())
                    .filter(|&k| !is_root && slot_f16[free[k]] == f16 && slot_len[free[k]] < len)
                    .max_by_key(|&k| slot_len[free[k]])
            });
        let slot = match best {
            Some(k) => self.free.swap_remove(k),
            None => {
                self.slot_len.push(0);
                self.slot_f16.push(f16);
                self.slot_len.len() - 1
            }
        };
        self.slot_len[slot] = self.slot_len[slot].max(len);
        slot
    }
}

impl<'g> Planning<'g> {
    /// The roots and every node they need; reshapes' owners and companions.
    fn needed(graph: &'g Graph, outputs: &[Tensor], grads: Option<&Gradients>, options: PlanOptions) -> Self {
        let nodes = graph.nodes();
        let count = nodes.len();
        let mut roots: Vec<usize> = outputs.iter().map(|t| t.0).collect();
        if let Some(g) = grads {
            roots.push(g.loss.0);
            roots.extend(g.input_gradients().iter().map(|t| t.0));
            // Every accumulation of this backward pass, not just the last
            // per parameter (and none of an earlier backward call).
            roots.extend(g.accumulations().iter().map(|t| t.0));
        }
        roots.retain(|&r| r < count);
        // A reshape shares its input's storage: the tensor that owns it is
        // what must live as long as any of its reshapes is read.
        let mut owner: Vec<usize> = (0..count).collect();
        for (i, node) in nodes.iter().enumerate() {
            if node.op == LayoutOp::Reshape {
                owner[i] = owner[node.inputs[0].0];
            }
        }
        let aliased_roots: Vec<usize> = roots.iter().map(|&r| owner[r]).filter(|o| !roots.contains(o)).collect();
        roots.extend(aliased_roots);
        let mut needed = vec![false; count];
        let mut is_output = vec![false; count];
        for &r in &roots {
            needed[r] = true;
            is_output[r] = true;
        }
        for i in (0..count).rev() {
            if needed[i] {
                for t in &nodes[i].inputs {
                    needed[t.0] = true;
                }
            }
        }
        // A layernorm's dispatch always writes its statistics, a row-wise
        // cross-entropy its gradient.
        let mut companion: Vec<Option<usize>> = vec![None; count];
        for i in 0..count {
            if let Some(s) = graph.companion(Tensor(i)) {
                companion[i] = Some(s.0);
                needed[s.0] |= needed[i];
            }
        }
        Planning {
            graph,
            nodes,
            count,
            options,
            roots,
            owner,
            needed,
            is_output,
            companion,
            storage: vec![Storage::Unused; count],
            param_offsets: Vec::new(),
            arena: 0,
            trainable_len: 0,
            decay_len: 0,
            order: Vec::new(),
            reads: nodes.iter().map(|n| n.inputs.clone()).collect(),
            consumers: vec![0; count],
            accumulate: vec![false; count],
            fused_away: vec![false; count],
            bias_into: vec![None; count],
            activation_into: vec![None; count],
            keeps_pre_activation: vec![false; count],
            activation_grad_into: vec![None; count],
            loss_with_grad: vec![None; count],
            in_training: vec![false; count],
            loss_fusion: vec![None; count],
            in_loss_dispatch: vec![false; count],
        }
    }

    /// Parameters and their gradients: one layout, offsets aligned to
    /// `align` elements. Weight-decayed trainable parameters come first,
    /// then the other trainable ones, so an optimizer update tells the two
    /// groups apart by one boundary (`decay_len`); frozen parameters last,
    /// past `trainable_len`, where the gradient and state arenas end.
    /// `param_offsets` stays in graph order.
    fn lay_out_parameters(&mut self, align: usize) {
        for (trainable, decayed) in [(true, true), (true, false), (false, true), (false, false)] {
            for (i, node) in self.nodes.iter().enumerate() {
                let t = Tensor(i);
                let is_param = matches!(node.op, Op::Source(SourceOp::Parameter { .. }));
                if is_param && self.graph.is_frozen(t) != trainable && self.graph.weight_decay_applies(t) == decayed {
                    self.param_offsets.push((t, self.arena));
                    self.storage[i] = Storage::Param { offset: self.arena };
                    self.arena += stored_words(node.dtype, node.len()).div_ceil(align) * align;
                }
            }
            match (trainable, decayed) {
                (true, true) => self.decay_len = self.arena,
                (true, false) => self.trainable_len = self.arena,
                _ => {}
            }
        }
        self.param_offsets.sort_by_key(|&(t, _)| t);
    }

    fn count_consumers(&mut self) {
        for &i in &self.order {
            for t in &self.nodes[i].inputs {
                self.consumers[t.0] += 1;
            }
        }
    }

    /// Read by no other node and not a root: a fusion may absorb it.
    fn private(&self, j: usize) -> bool {
        self.consumers[j] == 1 && !self.roots.contains(&j)
    }

    /// The node a reshape read by nothing else stands for: a Linear over
    /// [.., in] reshapes its product back, and the fusions see through
    /// that (the reshape shares its source's storage).
    fn through(&self, t: Tensor) -> usize {
        let mut j = t.0;
        while self.nodes[j].op == LayoutOp::Reshape && self.private(j) {
            j = self.nodes[j].inputs[0].0;
        }
        j
    }

    /// A 2-D matmul whose kernel takes the epilogues (a bias, an
    /// activation or its gradient): every one but a quantized weight's
    /// transposed product (a frozen weight's backward), which only adds.
    fn is_matmul(&self, j: usize) -> bool {
        let transposed_quant = |form: MatmulForm| {
            form == MatmulForm::AB && matches!(self.nodes[self.nodes[j].inputs[1].0].dtype, DType::Quant(_))
        };
        matches!(self.nodes[j].op, Op::Matmul(MatmulOp::MatMul(form)) if !transposed_quant(form))
    }

    /// A gradient contribution made by a matmul or column sum that nothing
    /// else reads is computed straight into the gradient arena in
    /// accumulate mode, saving the add and the intermediate.
    fn fuse_gradient_accumulations(&mut self) {
        for k in 0..self.order.len() {
            let i = self.order[k];
            let Op::Elementwise(ElementwiseOp::AccumulateGrad { param }) = self.nodes[i].op else {
                continue;
            };
            let j = self.nodes[i].inputs[0].0;
            // The embedding backward only adds into its output, so it is
            // always computed in the gradient arena, fused or not.
            let op_fuses = match self.nodes[j].op {
                Op::Matmul(MatmulOp::MatMul(_)) | Op::Reduce(ReduceOp::SumRows) => self.options.fuse,
                Op::Embedding(EmbeddingOp::EmbeddingBackward) => true,
                _ => false,
            };
            if let (true, Storage::Param { offset }) = (op_fuses && self.private(j), self.storage[param.0]) {
                self.accumulate[j] = true;
                self.fused_away[i] = true;
                self.storage[j] = Storage::Grad { offset };
            }
        }
    }

    /// A matmul read only by a bias add writes the biased result itself
    /// (one dispatch for a Linear layer), into the bias add's storage.
    fn fuse_bias_adds(&mut self) {
        for k in 0..self.order.len() {
            let i = self.order[k];
            if self.nodes[i].op == ElementwiseOp::BiasAdd {
                let j = self.through(self.nodes[i].inputs[0]);
                if self.is_matmul(j) && self.private(j) && !self.accumulate[j] {
                    self.bias_into[j] = Some(i);
                    self.fused_away[i] = true;
                }
            }
        }
    }

    /// A one-row product added to a residual of its size (decode's
    /// attention and MLP outputs, x + o_proj(..)) adds it as its bias
    /// (bias[col] is the residual's col-th value when there is one row):
    /// the add's reads are put (product, residual), as a bias add's are.
    ///
    /// The residual must be computed before the product runs: a LoRA
    /// adapter's delta (x·Aᵀ·Bᵀ, built after the base product) added to
    /// its base product cannot be the base product's bias.
    fn fuse_residual_adds(&mut self) {
        // 1 + each node's place in the order; 0 for what is not run
        // (parameters, inputs), which is there before anything runs.
        let mut position = vec![0usize; self.count];
        for (k, &n) in self.order.iter().enumerate() {
            position[n] = k + 1;
        }
        for k in 0..self.order.len() {
            let i = self.order[k];
            if self.nodes[i].op != ElementwiseOp::Binary(Binary::Add) {
                continue;
            }
            let [a, b] = self.nodes[i].inputs[..] else { continue };
            for (product, residual) in [(b, a), (a, b)] {
                let j = self.through(product);
                let nodes = self.nodes;
                let one_row = matches!(nodes[j].shape[..], [1, _]);
                let same_size = nodes[residual.0].len() == nodes[i].len()
                    && nodes[j].len() == nodes[i].len()
                    && nodes[residual.0].dtype == DType::F32;
                let free = self.private(j) && !self.accumulate[j] && self.bias_into[j].is_none();
                let mut computed = residual.0;
                while nodes[computed].op == LayoutOp::Reshape {
                    computed = nodes[computed].inputs[0].0;
                }
                let ready = position[computed] < position[j];
                if self.is_matmul(j) && one_row && same_size && free && ready && self.through(residual) != j {
                    self.bias_into[j] = Some(i);
                    self.fused_away[i] = true;
                    self.reads[i] = vec![product, residual];
                    break;
                }
            }
        }
    }

    /// A matmul (with its bias add) read only by an activation applies it
    /// and writes the activation's output: a Linear layer and its
    /// activation in one dispatch. The pre-activation is kept only if
    /// still read; a ReLU's backward reads the ReLU output instead.
    fn fuse_activations(&mut self) {
        for k in 0..self.order.len() {
            let y = self.order[k];
            let Op::Elementwise(ElementwiseOp::Activation(act)) = self.nodes[y].op else {
                continue;
            };
            let z = self.through(self.nodes[y].inputs[0]);
            let matmul = match self.nodes[z].op {
                Op::Elementwise(ElementwiseOp::BiasAdd)
                    if self.bias_into[self.through(self.nodes[z].inputs[0])] == Some(z) =>
                {
                    self.through(self.nodes[z].inputs[0])
                }
                Op::Matmul(MatmulOp::MatMul(_))
                    if self.is_matmul(z) && !self.accumulate[z] && self.bias_into[z].is_none() =>
                {
                    z
                }
                _ => continue,
            };
            if self.activation_into[matmul].is_some() {
                continue;
            }
            if act == Activation::Relu {
                for &j in &self.order {
                    if self.nodes[j].op == ElementwiseOp::ActivationBackward(Activation::Relu)
                        && self.reads[j][0].0 == z
                    {
                        self.reads[j][0] = Tensor(y);
                    }
                }
            }
            // Read by another node than y and the reshapes between them.
            let between = |j: usize| self.nodes[j].op == LayoutOp::Reshape && self.through(Tensor(j)) == z && j != z;
            let pre_read = self.roots.contains(&z)
                || self
                    .order
                    .iter()
                    .any(|&j| j != y && !between(j) && self.reads[j].iter().any(|t| t.0 == z));
            // Without a bias add the matmul node is the pre-activation and
            // has no storage of its own to keep it in.
            if pre_read && matmul == z {
                continue;
            }
            self.activation_into[matmul] = Some(y);
            self.keeps_pre_activation[matmul] = pre_read;
            self.fused_away[y] = true;
        }
    }

    /// An activation's backward whose incoming gradient is a matmul read
    /// by nothing else is done by that matmul (dY·Wᵀ · f'(x)).
    fn fuse_activation_gradients(&mut self) {
        for k in 0..self.order.len() {
            let i = self.order[k];
            if let Op::Elementwise(ElementwiseOp::ActivationBackward(_)) = self.nodes[i].op {
                let g = self.reads[i][1].0;
                let plain = self.bias_into[g].is_none()
                    && self.activation_into[g].is_none()
                    && self.activation_grad_into[g].is_none();
                if self.is_matmul(g) && self.private(g) && !self.accumulate[g] && plain {
                    self.activation_grad_into[g] = Some(i);
                    self.fused_away[i] = true;
                }
            }
        }
    }

    /// A loss and its backward over the same prediction and target run as
    /// one dispatch at the loss; the gradient's slot is taken there. The
    /// fused kernel is one workgroup, so only for small predictions.
    fn fuse_losses_with_gradients(&mut self) {
        for k in 0..self.order.len() {
            let i = self.order[k];
            if let Op::Loss(LossOp::LossBackward(kind)) = self.nodes[i].op {
                let (pred, target) = (self.nodes[i].inputs[0], self.nodes[i].inputs[1]);
                let small = self.nodes[pred.0].len() <= self.options.fused_loss_max;
                let forward = self
                    .order
                    .iter()
                    .copied()
                    .find(|&j| self.nodes[j].op == LossOp::Loss(kind) && self.nodes[j].inputs == [pred, target]);
                if let (true, Some(j)) = (small, forward) {
                    self.loss_with_grad[j] = Some(i);
                    self.fused_away[i] = true;
                }
            }
        }
    }

    /// The training step's nodes: what the loss and the gradients need
    /// (not predictions), to know who else reads a loss's prediction.
    fn mark_training_nodes(&mut self, grads: Option<&Gradients>) {
        if let Some(g) = grads {
            self.in_training[g.loss.0] = true;
            for t in g.accumulations().iter().chain(&g.input_gradients()) {
                self.in_training[t.0] = true;
            }
        }
        for i in (0..self.count).rev() {
            if self.in_training[i] {
                for t in &self.nodes[i].inputs {
                    self.in_training[t.0] = true;
                }
            }
        }
    }

    /// The work each fused loss's training dispatch also does.
    fn fuse_into_loss_dispatches(&mut self) {
        for k in 0..self.order.len() {
            let i = self.order[k];
            let Some(backward) = self.loss_with_grad[i] else {
                continue;
            };
            let mut fusion = self.loss_fusion(i, backward);
            if !self.options.linear_in_loss {
                fusion.linear = None;
            }
            if let Some(l) = fusion.linear {
                self.in_loss_dispatch[l.matmul] = true;
                self.in_loss_dispatch[l.weight_grad] = true;
            }
            if let Some(b) = fusion.bias_grad {
                self.in_loss_dispatch[b] = true;
            }
            if fusion != LossFusion::default() {
                self.loss_fusion[i] = Some(fusion);
            }
        }
    }

    /// What loss `loss` (computed with its gradient `backward`) can also do
    /// in its training dispatch. The moved work reads only what is already
    /// computed when the loss runs (x, parameters) and writes the loss's
    /// prediction and gradient arena entries nothing else in the step reads
    /// before the loss, so moving it to the loss keeps every value.
    fn loss_fusion(&self, loss: usize, backward: usize) -> LossFusion {
        let (nodes, order, storage) = (self.nodes, &self.order, &self.storage);
        let pred = nodes[loss].inputs[0].0;
        let dpred = Tensor(backward);
        // A gradient contribution of dpred accumulated straight into the
        // gradient arena by a node of `op` reading `inputs`.
        let accumulating = |op: Op, inputs: &[Tensor]| {
            order.iter().copied().find(|&j| {
                nodes[j].op == op
                    && nodes[j].inputs == inputs
                    && self.accumulate[j]
                    && matches!(storage[j], Storage::Grad { .. })
            })
        };
        let pred_shape = &nodes[pred].shape;
        let bias_grad = match pred_shape.len() {
            2 => accumulating(ReduceOp::SumRows.into(), &[dpred]),
            _ => None,
        };
        // The prediction: a matmul, alone or with the bias add it computes.
        let (matmul, bias) = match nodes[pred].op {
            Op::Elementwise(ElementwiseOp::BiasAdd) if self.bias_into[nodes[pred].inputs[0].0] == Some(pred) => {
                (nodes[pred].inputs[0].0, Some(nodes[pred].inputs[1]))
            }
            Op::Matmul(MatmulOp::MatMul(_)) if !self.accumulate[pred] => (pred, None),
            _ => {
                return LossFusion {
                    linear: None,
                    bias_grad,
                }
            }
        };
        let (x, weight) = (nodes[matmul].inputs[0], nodes[matmul].inputs[1]);
        let is_param = |t: Tensor| matches!(storage[t.0], Storage::Param { .. });
        let only_the_loss_reads_pred = order
            .iter()
            .filter(|&&j| self.in_training[j] && ![loss, backward, pred].contains(&j))
            .all(|&j| !nodes[j].inputs.iter().any(|t| t.0 == pred || t.0 == matmul));
        let (rows, cols) = (pred_shape[0], pred_shape.get(1).copied().unwrap_or(1));
        let inner = self.graph.node(weight).shape.get(1).copied().unwrap_or(0);
        let small = rows.saturating_mul(cols).saturating_mul(inner) <= self.options.linear_in_loss_max_macs;
        let weight_grad = accumulating(MatmulOp::MatMul(MatmulForm::AtB).into(), &[dpred, x]);
        // The loss kernel reads x in f32 (not an f16-stored activation).
        let fits = pred_shape.len() == 2
            && small
            && is_param(weight)
            && bias.is_none_or(is_param)
            && only_the_loss_reads_pred
            && self.graph.node(x).dtype == DType::F32;
        let linear = match (&nodes[matmul].op, weight_grad) {
            (Op::Matmul(MatmulOp::MatMul(MatmulForm::ABt)), Some(weight_grad)) if fits => Some(LinearInLoss {
                matmul,
                x,
                weight,
                bias,
                weight_grad,
            }),
            _ => None,
        };
        LossFusion { linear, bias_grad }
    }

    /// Last use of each needed node's storage; outputs and the loss live to
    /// the end (`usize::MAX`).
    fn last_uses(&self) -> Vec<Option<usize>> {
        let mut last_use = vec![None::<usize>; self.count];
        for &i in &self.order {
            for t in &self.reads[i] {
                last_use[self.owner[t.0]] = Some(i);
            }
        }
        for &r in &self.roots {
            last_use[self.owner[r]] = Some(usize::MAX);
        }
        last_use
    }

    /// Storage for every node by liveness: inputs, constants and caches get
    /// buffers of their own; intermediates share slots once their last
    /// reader has run.
    fn assign_slots(&mut self) -> Slots {
        let last_use = self.last_uses();
        let mut slots = Slots {
            slot_len: Vec::new(),
            slot_f16: Vec::new(),
            free: Vec::new(),
            release_at: vec![Vec::new(); self.count],
            inputs: 0,
            constants: 0,
            caches: 0,
            naive: 0,
            input_bytes: 0,
        };
        for k in 0..self.order.len() {
            let i = self.order[k];
            let node = &self.nodes[i];
            match &node.op {
                // Writes into the gradient arena: no slot.
                _ if self.accumulate[i] => {}
                // Its matmul (or its loss) already placed it.
                Op::Elementwise(
                    ElementwiseOp::BiasAdd
                    | ElementwiseOp::Binary(Binary::Add)
                    | ElementwiseOp::Activation(_)
                    | ElementwiseOp::ActivationBackward(_),
                )
                | Op::Loss(LossOp::LossBackward(_))
                    if self.fused_away[i] => {}
                Op::Source(SourceOp::Parameter { .. }) => {}
                // Shares its input's storage (set below), or its writer
                // placed it (a layernorm's statistics).
                Op::Layout(LayoutOp::Reshape) => {}
                _ if node.op.is_companion() => {}
                Op::Source(SourceOp::Input) => {
                    self.storage[i] = Storage::Input { index: slots.inputs };
                    slots.inputs += 1;
                    slots.input_bytes += node.len() as u64 * BYTES;
                }
                Op::Source(SourceOp::Constant { .. }) => {
                    self.storage[i] = Storage::Constant { index: slots.constants };
                    slots.constants += 1;
                    slots.input_bytes += node.len() as u64 * BYTES;
                }
                Op::Source(SourceOp::Cache) => {
                    self.storage[i] = Storage::Cache { index: slots.caches };
                    slots.caches += 1;
                    slots.input_bytes += node.len() as u64 * BYTES;
                }
                Op::Elementwise(ElementwiseOp::AccumulateGrad { param }) => {
                    if let Storage::Param { offset } = self.storage[param.0] {
                        self.storage[i] = Storage::Grad { offset };
                    }
                }
                _ => self.place_in_slots(i, &last_use, &mut slots),
            }
            // Inputs of node i whose last use is i may now be overwritten.
            let released = std::mem::take(&mut slots.release_at[i]);
            slots.free.extend(released);
        }
        for &i in &self.order {
            if self.nodes[i].op == LayoutOp::Reshape {
                self.storage[i] = self.storage[self.owner[i]];
            }
        }
        slots
    }

    /// Slots for what node `i`'s dispatch writes. A fused matmul allocates
    /// for the node whose output it writes (and a pre-activation still
    /// read); a fused loss also for its gradient.
    fn place_in_slots(&mut self, i: usize, last_use: &[Option<usize>], slots: &mut Slots) {
        let written = self.activation_grad_into[i]
            .or(self.activation_into[i])
            .or(self.bias_into[i])
            .unwrap_or(i);
        let mut owners = vec![written];
        if let (true, Some(pre)) = (self.keeps_pre_activation[i], self.bias_into[i]) {
            owners.push(pre);
        }
        owners.extend(self.loss_with_grad[i]);
        owners.extend(self.companion[i]);
        for (k, &o) in owners.iter().enumerate() {
            // Words, not values: an f16 copy takes half.
            let len = stored_words(self.nodes[o].dtype, self.nodes[o].len());
            slots.naive += len as u64 * BYTES;
            let is_root = last_use[o] == Some(usize::MAX);
            let slot = slots.take(len, self.nodes[o].dtype == DType::F16, is_root);
            self.storage[o] = Storage::Slot { index: slot };
            if k == 0 {
                self.storage[i] = Storage::Slot { index: slot };
            }
            match last_use[o] {
                Some(usize::MAX) => {}
                Some(u) => slots.release_at[u].push(slot),
                // Written but never read (statistics of an inference run):
                // free once the writer ran.
                None => slots.release_at[i].push(slot),
            }
        }
    }

    /// Bytes of the forward's intermediates a training step's backward
    /// reads (0 without gradients).
    fn held_activation_bytes(&self, grads: Option<&Gradients>) -> u64 {
        let Some(g) = grads else { return 0 };
        let start = g.backward_start().0;
        let mut held = vec![false; self.count];
        for &i in self.order.iter().filter(|&&i| i >= start) {
            for t in &self.reads[i] {
                let o = self.owner[t.0];
                held[o] |= o < start && matches!(self.storage[o], Storage::Slot { .. });
            }
        }
        (0..self.count)
            .filter(|&o| held[o])
            .map(|o| stored_words(self.nodes[o].dtype, self.nodes[o].len()) as u64 * BYTES)
            .sum()
    }
}
