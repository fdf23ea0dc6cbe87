//! Many LoRA adapters over one frozen base, for serving (S-LoRA, Punica):
//! each sequence of a generation pass names its adapter (or none), and
//! every adapted Linear adds, on each row, that row's adapter's low-rank
//! path in one gathered product (`Graph::lora_shrink` and
//! `Graph::lora_expand`), so requests with different adapters decode in
//! the same step rather than in a batch per adapter.
//!
//! [`MultiLora`] wraps a model as [`super::Lora`] does, and its forward runs
//! the model's own forward in a scope in which each Linear that some
//! adapter adapts adds the gathered products. Per Linear it holds every
//! adapter's A [r_a, in] stacked row-wise (`{module}.lora_set.A`, [R, in]),
//! their Bᵀ [r_a, out] stacked alike (`{module}.lora_set.Bt`, [R, out]) and
//! each adapter's (first row, rank, scale) (`{module}.lora_set.meta`, [N,
//! 3]; rank 0 where the adapter leaves the Linear alone). Which adapter
//! each sequence applies is an input of the pass, declared through the
//! [`ForwardContext`](super::ForwardContext): the generator writes it
//! before each run (`Generator::set_slot_adapter`).

use std::cell::RefCell;
use std::sync::Arc;

use super::causal_lm::{declare_parameter, row_adapters, CausalLm, LmSizes};
use super::lora::{linear_sites, Lora, LoraAdapter, LoraConfig};
use super::{Module, ParameterTree};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};
use crate::ops::LORA_META;

/// One adapter of a [`MultiLora`]: the name a server knows it by, its
/// settings and its matrices, one per Linear (as `io::peft` reads them).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedAdapter {
    pub name: String,
    pub config: LoraConfig,
    pub adapters: Vec<LoraAdapter>,
    /// Multiplies the adapter's α / r (1: as trained; 0: the base).
    pub scale: f32,
}

impl NamedAdapter {
    /// `name`'s adapter as trained (scale 1).
    pub fn new(name: impl Into<String>, config: LoraConfig, adapters: Vec<LoraAdapter>) -> Self {
        NamedAdapter {
            name: name.into(),
            config,
            adapters,
            scale: 1.0,
        }
    }
}

/// One Linear's adapters, stacked for the gathered products.
#[derive(Clone, Debug, PartialEq)]
struct StackedLinear {
    module: String,
    in_features: usize,
    out_features: usize,
    /// R: every adapter's rank here.
    ranks: usize,
    /// The largest rank here: h's width.
    width: usize,
    /// [R, in]: each adapter's A rows, in adapter order.
    a: Vec<f32>,
    /// [R, out]: each adapter's Bᵀ rows, as `a`'s.
    bt: Vec<f32>,
    /// [N, 3]: each adapter's (first row, rank, scale), (0, 0, 0) for one
    /// without an adapter here.
    meta: Vec<f32>,
}

/// The most stacked rows a Linear takes: `meta` holds row numbers as f32,
/// exact below 2^24.
const MAX_STACKED_ROWS: usize = 1 << 24;

/// A model whose Linears carry many adapters at once, each sequence of a
/// generation pass applying its own (see the module documentation).
#[derive(Clone, Debug)]
pub struct MultiLora<M> {
    pub base: M,
    names: Vec<String>,
    linears: Arc<Vec<StackedLinear>>,
}

/// The scope a [`MultiLora`]'s forward runs its model in.
struct Gather {
    root: String,
    adapters: usize,
    linears: Arc<Vec<StackedLinear>>,
}

thread_local! {
    static GATHER: RefCell<Option<Gather>> = const { RefCell::new(None) };
}

/// Runs `f` with `scope` active on this thread, restoring what was active
/// before however it ends (an error or a panic).
fn with_gather<R>(scope: Gather, f: impl FnOnce() -> Result<R>) -> Result<R> {
    struct Restore(Option<Gather>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            GATHER.with(|s| *s.borrow_mut() = previous);
        }
    }
    let _restore = Restore(GATHER.with(|s| s.borrow_mut().replace(scope)));
    f()
}

/// Whether a forward runs under a [`MultiLora`]'s scope (generation's joined
/// products then stay apart, so each Linear adds its adapters).
pub(crate) fn active() -> bool {
    GATHER.with(|s| s.borrow().is_some())
}

/// Under a [`MultiLora`]'s scope, for a Linear some adapter adapts: `y`
/// (the Linear at `prefix`'s output of x [.., in]) with each row's
/// adapter's path added. None outside the scope or for a Linear no adapter
/// names.
pub(crate) fn adapt(
    g: &mut Graph,
    x: Tensor,
    y: Tensor,
    prefix: &str,
    in_features: usize,
    out_features: usize,
) -> Result<Option<Tensor>> {
    let found = GATHER.with(|s| {
        let scope = s.borrow();
        let gather = scope.as_ref()?;
        let local = prefix.strip_prefix(gather.root.as_str()).unwrap_or(prefix);
        let module = local.strip_suffix('.').unwrap_or(local);
        let at = gather.linears.iter().position(|l| l.module == module)?;
        Some((gather.adapters, Arc::clone(&gather.linears), at))
    });
    let Some((adapters, linears, at)) = found else {
        return Ok(None);
    };
    let linear = &linears[at];
    if (linear.in_features, linear.out_features) != (in_features, out_features) {
        return Err(Error::shape(
            "MultiLora",
            format!(
                "the adapters of `{}` are for [{}, {}] but the Linear runs [{out_features}, {in_features}]",
                linear.module, linear.out_features, linear.in_features
            ),
            &[&[linear.out_features, linear.in_features], &[out_features, in_features]],
        ));
    }
    let ranks = linear.ranks;
    let a = declare_parameter(
        g,
        format!("{prefix}lora_set.A"),
        &[ranks, in_features],
        &linear.a,
        false,
    )?;
    let bt = declare_parameter(
        g,
        format!("{prefix}lora_set.Bt"),
        &[ranks, out_features],
        &linear.bt,
        false,
    )?;
    let meta = declare_parameter(
        g,
        format!("{prefix}lora_set.meta"),
        &[adapters, LORA_META],
        &linear.meta,
        false,
    )?;
    let index = row_adapters(g, adapters)?;
    let shape = g.shape_of(y).map(<[usize]>::to_vec).unwrap_or_default();
    let rows = shape.iter().product::<usize>() / out_features.max(1);
    let flat_x = g.reshape(x, &[rows, in_features])?;
    let flat_y = g.reshape(y, &[rows, out_features])?;
    let h = g.lora_shrink(flat_x, a, meta, index, linear.width)?;
    let out = g.lora_expand(flat_y, h, bt, meta, index)?;
    g.reshape(out, &shape).map(Some)
}

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "MultiLora",
        reason,
    }
}

impl<M: Module> MultiLora<M> {
    /// `base` carrying `adapters` at once, adapter i answering to index i
    /// ([`MultiLora::index_of`]). Each is checked against `base` as
    /// [`Lora::with_adapters`] checks one (its Linears, sizes and rank,
    /// every targeted Linear covered); the error names the adapter. Names
    /// must be unique and not empty, scales finite.
    pub fn new(base: M, adapters: Vec<NamedAdapter>) -> Result<Self> {
        if adapters.is_empty() {
            return Err(invalid("no adapters: give at least one".into()));
        }
        let mut names: Vec<String> = Vec::new();
        for a in &adapters {
            if a.name.trim().is_empty() {
                return Err(invalid("an adapter's name is empty".into()));
            }
            if names.contains(&a.name) {
                return Err(invalid(format!("two adapters are named `{}`", a.name)));
            }
            if !a.scale.is_finite() {
                return Err(invalid(format!(
                    "adapter `{}`: scale {} is not finite",
                    a.name, a.scale
                )));
            }
            names.push(a.name.clone());
        }
        let mut base = base;
        let mut checked: Vec<(f32, Vec<LoraAdapter>)> = Vec::with_capacity(adapters.len());
        for a in adapters {
            let scale = a.scale * a.config.scale();
            let lora = Lora::with_adapters(base, a.config, a.adapters)
                .map_err(|e| invalid(format!("adapter `{}`: {e}", a.name)))?;
            checked.push((scale, lora.adapters().to_vec()));
            base = lora.base;
        }
        let linears = stack(&base, &checked)?;
        Ok(MultiLora {
            base,
            names,
            linears: Arc::new(linears),
        })
    }
}

/// Each Linear of `base` some adapter adapts, in the order the model runs
/// them, with every adapter's matrices stacked.
fn stack(base: &dyn Module, adapters: &[(f32, Vec<LoraAdapter>)]) -> Result<Vec<StackedLinear>> {
    let (sites, _) = linear_sites(base)?;
    let mut linears: Vec<StackedLinear> = Vec::new();
    for site in sites {
        if linears.iter().any(|l| l.module == site.module) {
            continue;
        }
        let (i, o) = (site.in_features, site.out_features);
        let mut linear = StackedLinear {
            module: site.module,
            in_features: i,
            out_features: o,
            ranks: 0,
            width: 0,
            a: Vec::new(),
            bt: Vec::new(),
            meta: Vec::with_capacity(adapters.len() * LORA_META),
        };
        for (scale, list) in adapters {
            let Some(found) = list.iter().find(|a| a.module == linear.module) else {
                linear.meta.extend([0.0; LORA_META]);
                continue;
            };
            let r = found.a.len() / i.max(1);
            linear.meta.extend([linear.ranks as f32, r as f32, *scale]);
            linear.a.extend_from_slice(&found.a);
            // B [out, r] as Bᵀ [r, out].
            linear
                .bt
                .extend((0..r).flat_map(|j| (0..o).map(move |c| found.b[c * r + j])));
            linear.ranks += r;
            linear.width = linear.width.max(r);
        }
        if linear.ranks >= MAX_STACKED_ROWS {
            return Err(invalid(format!(
                "`{}` stacks {} adapter rows; at most {MAX_STACKED_ROWS}",
                linear.module, linear.ranks
            )));
        }
        if linear.ranks > 0 {
            linears.push(linear);
        }
    }
    Ok(linears)
}

impl<M> MultiLora<M> {
    /// The adapters' names, index order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The index of the adapter named `name` (what a generator's slot is
    /// set to).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    /// Values the stacked adapters hold.
    fn stacked_values(&self) -> usize {
        self.linears.iter().map(|l| l.a.len() + l.bt.len() + l.meta.len()).sum()
    }

    fn run<R>(&self, root: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let scope = Gather {
            root: root.to_string(),
            adapters: self.names.len(),
            linears: Arc::clone(&self.linears),
        };
        with_gather(scope, f)
    }
}

impl<M: ParameterTree> ParameterTree for MultiLora<M> {
    /// The base's Linears (an adapter set is not one).
    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(super::LinearSite, bool)) {
        self.base.visit_linears(prefix, f);
    }

    /// The base's parameters, then each adapted Linear's stacked A, Bᵀ and
    /// meta.
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        self.base.visit(prefix, f);
        let n = self.names.len();
        for l in self.linears.iter() {
            f(
                format!("{prefix}{}.lora_set.A", l.module),
                vec![l.ranks, l.in_features],
                &l.a,
            );
            f(
                format!("{prefix}{}.lora_set.Bt", l.module),
                vec![l.ranks, l.out_features],
                &l.bt,
            );
            f(
                format!("{prefix}{}.lora_set.meta", l.module),
                vec![n, LORA_META],
                &l.meta,
            );
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        self.base.visit_mut(prefix, f)?;
        let n = self.names.len();
        for l in Arc::make_mut(&mut self.linears).iter_mut() {
            f(
                format!("{prefix}{}.lora_set.A", l.module),
                vec![l.ranks, l.in_features],
                &mut l.a,
            )?;
            f(
                format!("{prefix}{}.lora_set.Bt", l.module),
                vec![l.ranks, l.out_features],
                &mut l.bt,
            )?;
            f(
                format!("{prefix}{}.lora_set.meta", l.module),
                vec![n, LORA_META],
                &mut l.meta,
            )?;
        }
        Ok(())
    }
}

impl<M: Module> Module for MultiLora<M> {
    fn forward(&self, g: &mut Graph, x: Tensor, prefix: &str) -> Result<Tensor> {
        self.run(prefix, || self.base.forward(g, x, prefix))
    }

    /// The base's line, then the adapters': `LoRA adapters [a, b]`.
    fn describe(&self) -> String {
        format!("{} LoRA adapters [{}]", self.base.describe(), self.names.join(", "))
    }

    fn input(&self, g: &mut Graph, batch: usize) -> Result<Tensor> {
        self.base.input(g, batch)
    }
}

impl<M: CausalLm> CausalLm for MultiLora<M> {
    fn lm_sizes(&self) -> LmSizes {
        let sizes = self.base.lm_sizes();
        LmSizes {
            parameters: sizes.parameters + self.stacked_values() as u64,
            ..sizes
        }
    }

    fn body(&self, g: &mut Graph, idx: Tensor, prefix: &str) -> Result<(Tensor, Tensor)> {
        self.run(prefix, || self.base.body(g, idx, prefix))
    }

    fn logits(&self, g: &mut Graph, table: Tensor, x: Tensor, prefix: &str) -> Result<Tensor> {
        self.run(prefix, || self.base.logits(g, table, x, prefix))
    }
}
