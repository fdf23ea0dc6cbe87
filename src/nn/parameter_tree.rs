//! Parameter names declared once, by the module tree (candle's
//! `VarBuilder::pp`, PyTorch's `state_dict` keys): a parameter's name is
//! the path of struct fields that reaches it, `h.0.attn.c_attn.weight`.

use super::lora::LinearSite;
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};

/// A module whose parameters are reached by hierarchical name.
///
/// Why this shape: names have one source, the module's own fields. A
/// module states its tree once, with [`parameter_tree!`]: a leaf lists its
/// parameter fields with their shapes, a composite lists its child fields
/// (a `Vec` child names its items `0.`, `1.`, …; an `Option` child is
/// skipped when `None`). The macro writes `visit` and `visit_mut` from that
/// one list, so the read and write walks cannot disagree, and every name is
/// `stringify!` of a field: a typo is a compile error, not a silent
/// mismatch. `forward` takes the same names by the same rule: a leaf
/// declares its graph parameters through `visit` ([`ParameterTree::declare`]),
/// and a composite hands each child the prefix [`child_prefix!`] derives
/// from the field it calls. Everything else — `Module::named_parameters`,
/// `Module::parameter_values`, a model's `from_parameters`
/// ([`ParameterTree::fill`]), the checkpoint and folder name maps — is
/// derived from the walk and lists no names. A foreign format whose names
/// differ (GPT-2's `transformer.` prefix) states its rule over these names.
pub trait ParameterTree {
    /// Calls `f(name, shape, values)` for every parameter, in the order
    /// `Module::forward` declares them, names under `prefix`. Shapes come
    /// from the module's sizes, not from the values, so a model built
    /// without values (a model's `empty`) still reports them.
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32]));

    /// The same walk with the values writable (loading weights).
    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()>;

    /// Calls `f(site, head)` for every [`Linear`](super::Linear) in the
    /// tree, in `visit`'s order (the order `forward` runs them), its
    /// module name without the trailing `.` (`model.layers.0.mlp.up_proj`);
    /// `head` marks a model's output layer (an `lm_head`, a Sequential's
    /// last layer). What [`Lora`](super::Lora) adapts, found without
    /// building a graph. No default: a wrapper that forwards `visit` must
    /// forward this too, or adapters would find none of its Linears.
    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool));

    /// Declares this module's parameters in `g` as `visit` names them, in
    /// visiting order: how a leaf's forward gets its tensors. Under a
    /// [`ForwardContext`](super::ForwardContext) a name an earlier forward
    /// declared is handed back.
    fn declare(&self, g: &mut Graph, prefix: &str) -> Result<Vec<Tensor>> {
        declare_tree(self, g, prefix, false)
    }

    /// [`ParameterTree::declare`] for a module whose matrices are weights
    /// a decode step reads whole (a Linear's, a tied head's table): an f16
    /// forward context stores them in f16.
    fn declare_weights(&self, g: &mut Graph, prefix: &str) -> Result<Vec<Tensor>> {
        declare_tree(self, g, prefix, true)
    }

    /// Replaces every parameter's values with `take(name, shape)`, called
    /// once per parameter in visiting order; `take` returns exactly
    /// `shape`'s element count of values, or the error to report.
    fn fill(&mut self, op: &'static str, take: &mut dyn FnMut(&str, &[usize]) -> Result<Vec<f32>>) -> Result<()> {
        self.visit_mut("", &mut |name, shape, values| {
            let taken = take(&name, &shape)?;
            if taken.len() != shape.iter().product::<usize>() {
                return Err(Error::shape(
                    op,
                    format!("`{name}` needs {shape:?}, got {} values", taken.len()),
                    &[&shape],
                ));
            }
            *values = taken;
            Ok(())
        })
    }
}

/// The parameter `name`, declared with `values` unless the graph already
/// has it: a name declared twice is one parameter (a head tied to the token
/// embedding reads the table the embedding declared; a pipeline stage
/// holding both finds one tensor).
pub(super) fn declare_one(g: &mut Graph, name: &str, shape: &[usize], values: &[f32]) -> Result<Tensor> {
    let declared = g
        .parameters()
        .into_iter()
        .find(|&p| g.get(p).is_some_and(|n| n.name == name));
    match declared {
        Some(t) => {
            let have = g.shape_of(t).map(<[usize]>::to_vec).unwrap_or_default();
            if have != shape {
                return Err(Error::shape(
                    "parameter",
                    format!("`{name}` is declared twice with different shapes"),
                    &[&have, shape],
                ));
            }
            Ok(t)
        }
        // A model sized without values (to plan its memory): a parameter
        // with no contents, which no executor runs.
        None if values.is_empty() => g.parameter_planned(name, shape, crate::graph::DType::F32),
        None => g.parameter(name, shape, values.to_vec()),
    }
}

fn declare_tree<T: ParameterTree + ?Sized>(
    tree: &T,
    g: &mut Graph,
    prefix: &str,
    weights: bool,
) -> Result<Vec<Tensor>> {
    let mut declared = Vec::new();
    let mut failed = None;
    tree.visit(prefix, &mut |name, shape, values| {
        if failed.is_none() {
            match super::causal_lm::declare_parameter(g, name, &shape, values, weights && shape.len() == 2) {
                Ok(t) => declared.push(t),
                Err(e) => failed = Some(e),
            }
        }
    });
    failed.map_or(Ok(declared), Err)
}

/// The prefix of a child field: `{prefix}{group}{field}.`; `group` is a
/// level a format nests the field under that the struct does not have
/// (Hugging Face's `model.` in a Llama). [`parameter_tree!`] and
/// [`child_prefix!`] both name children through it.
pub(crate) fn child_path(prefix: &str, group: &str, field: &str) -> String {
    format!("{prefix}{group}{field}.")
}

/// The optional `[GROUP]` of a [`parameter_tree!`] child, or none.
pub(crate) fn group<'a>(groups: &[&'a str]) -> &'a str {
    groups.first().copied().unwrap_or("")
}

/// The prefix of item `i` of a list of modules: `{prefix}{i}.`.
pub(crate) fn item_prefix(prefix: &str, i: usize) -> String {
    format!("{prefix}{i}.")
}

/// The prefix `forward` hands a child: `child_prefix!(prefix, self.c_attn)`
/// is `{prefix}c_attn.`, `child_prefix!(prefix, GROUP, self.norm)` is
/// `{prefix}{GROUP}norm.` — the names [`parameter_tree!`] gives the same
/// fields. Naming the field (not a string) makes a typo a compile error.
macro_rules! child_prefix {
    ($prefix:expr, $this:ident . $field:ident) => {{
        let _ = &$this.$field;
        $crate::nn::parameter_tree::child_path(&$prefix, "", stringify!($field))
    }};
    ($prefix:expr, $group:expr, $this:ident . $field:ident) => {{
        let _ = &$this.$field;
        $crate::nn::parameter_tree::child_path(&$prefix, $group, stringify!($field))
    }};
}
pub(crate) use child_prefix;

/// Writes a module's [`ParameterTree`] from one list of its fields.
///
/// A leaf: `parameter_tree!(Linear, |m| parameters { weight: [m.out_features,
/// m.in_features], bias: [m.out_features] })` — each field a `Vec<f32>` (or
/// an `Option<Vec<f32>>`, absent when `None`), its shape read from the
/// module bound to `m`.
///
/// A composite: `parameter_tree!(Block { ln_1 if attn, attn, ln_2, mlp })`
/// — each field a child module, in forward's order; `if other` keeps the
/// child only while the `Option` field `other` is `Some`; `[GROUP] field`
/// nests it under the format's level `GROUP` (a `&str` const).
macro_rules! parameter_tree {
    ($ty:ty, |$m:ident| $(linear($in:expr, $out:expr))? parameters { $($name:ident: [$($dim:expr),* $(,)?]),* $(,)? }) => {
        impl $crate::nn::ParameterTree for $ty {
            /// A Linear's site (a leaf declared `linear(in, out)`); other
            /// leaves have none.
            fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut($crate::nn::LinearSite, bool)) {
                let _ = (prefix, &f);
                $(
                    let $m = self;
                    let module = prefix.strip_suffix('.').unwrap_or(prefix).to_string();
                    let head = module.rsplit('.').next() == Some("lm_head");
                    let site = $crate::nn::LinearSite {
                        module,
                        in_features: $in,
                        out_features: $out,
                    };
                    f(site, head);
                )?
            }

            fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
                let $m = self;
                $(
                    if let Some(values) = $crate::nn::parameter_tree::LeafValues::values(&$m.$name) {
                        f(format!("{prefix}{}", stringify!($name)), vec![$($dim),*], values);
                    }
                )*
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<()> {
                $(
                    let shape = {
                        let $m = &*self;
                        vec![$($dim),*]
                    };
                    if let Some(values) = $crate::nn::parameter_tree::LeafValues::values_mut(&mut self.$name) {
                        f(format!("{prefix}{}", stringify!($name)), shape, values)?;
                    }
                )*
                Ok(())
            }
        }
    };
    ($ty:ty { $($([$group:expr])? $child:ident $(if $guard:ident)?),* $(,)? }) => {
        impl $crate::nn::ParameterTree for $ty {
            fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut($crate::nn::LinearSite, bool)) {
                $(
                    if true $(&& self.$guard.is_some())? {
                        let group = $crate::nn::parameter_tree::group(&[$($group)?]);
                        let path = $crate::nn::parameter_tree::child_path(prefix, group, stringify!($child));
                        $crate::nn::ParameterTree::visit_linears(&self.$child, &path, f);
                    }
                )*
            }

            fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
                $(
                    if true $(&& self.$guard.is_some())? {
                        let group = $crate::nn::parameter_tree::group(&[$($group)?]);
                        let path = $crate::nn::parameter_tree::child_path(prefix, group, stringify!($child));
                        $crate::nn::ParameterTree::visit(&self.$child, &path, f);
                    }
                )*
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<()> {
                $(
                    if true $(&& self.$guard.is_some())? {
                        let group = $crate::nn::parameter_tree::group(&[$($group)?]);
                        let path = $crate::nn::parameter_tree::child_path(prefix, group, stringify!($child));
                        $crate::nn::ParameterTree::visit_mut(&mut self.$child, &path, f)?;
                    }
                )*
                Ok(())
            }
        }
    };
}
pub(crate) use parameter_tree;

/// A leaf's parameter field: a `Vec<f32>`, or an optional one (a bias
/// that `bias=False` removes).
pub(crate) trait LeafValues {
    fn values(&self) -> Option<&Vec<f32>>;
    fn values_mut(&mut self) -> Option<&mut Vec<f32>>;
}

impl LeafValues for Vec<f32> {
    fn values(&self) -> Option<&Vec<f32>> {
        Some(self)
    }

    fn values_mut(&mut self) -> Option<&mut Vec<f32>> {
        Some(self)
    }
}

impl LeafValues for Option<Vec<f32>> {
    fn values(&self) -> Option<&Vec<f32>> {
        self.as_ref()
    }

    fn values_mut(&mut self) -> Option<&mut Vec<f32>> {
        self.as_mut()
    }
}

/// Items named by position, `{prefix}0.`, `{prefix}1.`, … (a GPT's `h`, a
/// Sequential's layers).
impl<T: ParameterTree> ParameterTree for Vec<T> {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        for (i, item) in self.iter().enumerate() {
            item.visit(&item_prefix(prefix, i), f);
        }
    }

    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool)) {
        for (i, item) in self.iter().enumerate() {
            item.visit_linears(&item_prefix(prefix, i), f);
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        for (i, item) in self.iter_mut().enumerate() {
            item.visit_mut(&item_prefix(prefix, i), f)?;
        }
        Ok(())
    }
}

/// A child that may be absent (an untied head, a block's attention).
impl<T: ParameterTree> ParameterTree for Option<T> {
    fn visit<'a>(&'a self, prefix: &str, f: &mut dyn FnMut(String, Vec<usize>, &'a [f32])) {
        if let Some(inner) = self {
            inner.visit(prefix, f);
        }
    }

    fn visit_linears(&self, prefix: &str, f: &mut dyn FnMut(LinearSite, bool)) {
        if let Some(inner) = self {
            inner.visit_linears(prefix, f);
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, Vec<usize>, &mut Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        match self {
            Some(inner) => inner.visit_mut(prefix, f),
            None => Ok(()),
        }
    }
}
