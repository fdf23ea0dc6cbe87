//! Tensor parallelism as the modules declare it (Megatron-LM, Shoeybi et
//! al. 2019). A module says how each Linear splits
//! ([`Linear::forward_split`]: column-parallel, its outputs divided among
//! the ranks; row-parallel, its inputs) and where the partial sums meet
//! ([`all_reduce`], [`reduce_residual`]). Outside a tensor-parallel build
//! these are the plain forward and an add.
//!
//! A tensor-parallel engine builds each rank's graph by running the
//! model's own forward inside [`build_rank`], which sets the rank for the
//! declarations to read (as Megatron's `parallel_state`): a split Linear
//! declares only its slice, under the whole model's name, and records where
//! that slice lies; each all-reduce ends the rank's current graph (a
//! segment, whose output the engine sums over the ranks) and starts the
//! next one reading the sum.

use std::cell::RefCell;
use std::ops::Range;

use super::{Linear, Module};
use crate::error::{Error, Result};
use crate::graph::{Graph, Tensor};

/// How a Linear's weight W [out, in] (and bias [out]) is divided among
/// tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorSplit {
    /// Column-parallel: each rank holds some outputs (rows of W and their
    /// bias) and yields those outputs. W's rows form `groups` equal blocks
    /// (a fused q, k, v projection: 3), each a run of units of `unit` rows
    /// (a head's channels); a rank holds the same units of every block.
    Column { groups: usize, unit: usize },
    /// Row-parallel: each rank holds the inputs (columns of W, in units of
    /// `unit`) its column-parallel partner yielded, and outputs a partial
    /// sum; rank 0 alone adds the bias, so the ranks' outputs sum to the
    /// whole Linear's. An all-reduce must follow.
    Row { unit: usize },
    /// Not split: every rank holds the whole Linear and yields all its
    /// outputs (multi-query attention's one KV head). As a norm's, its
    /// gradient is summed over the ranks, each rank's holding what its
    /// own share of the consumers (its query heads) asked of it.
    Replicated,
}

/// Where a rank's share of a split parameter lies in the whole one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slice {
    /// These rows (first-axis indexes) of the parameter, in order.
    Rows(Vec<Range<usize>>),
    /// These columns of a [rows, cols] parameter.
    Columns(Range<usize>),
}

impl Slice {
    /// The share of `full` (of `shape`).
    pub fn take(&self, full: &[f32], shape: &[usize]) -> Vec<f32> {
        // No values (a model sized to plan its memory): no share of them.
        if full.is_empty() {
            return Vec::new();
        }
        let (rows, cols) = matrix(shape);
        match self {
            Slice::Rows(ranges) => ranges
                .iter()
                .flat_map(|r| full[r.start * cols..r.end * cols].iter().copied())
                .collect(),
            Slice::Columns(range) => (0..rows)
                .flat_map(|r| full[r * cols + range.start..r * cols + range.end].iter().copied())
                .collect(),
        }
    }

    /// Writes `share` where it lies in `full` (of `shape`); `None` when its
    /// size is not the slice's.
    pub fn put(&self, full: &mut [f32], shape: &[usize], share: &[f32]) -> Option<()> {
        let (rows, cols) = matrix(shape);
        let mut at = 0;
        let mut copy = |dst: Range<usize>| -> Option<()> {
            let src = share.get(at..at + dst.len())?;
            full.get_mut(dst.clone())?.copy_from_slice(src);
            at += dst.len();
            Some(())
        };
        match self {
            Slice::Rows(ranges) => ranges.iter().try_for_each(|r| copy(r.start * cols..r.end * cols))?,
            Slice::Columns(range) => (0..rows).try_for_each(|r| copy(r * cols + range.start..r * cols + range.end))?,
        }
        (at == share.len()).then_some(())
    }
}

/// A parameter as rows × columns (a vector is one column per row).
fn matrix(shape: &[usize]) -> (usize, usize) {
    let rows = shape.first().copied().unwrap_or(1);
    (rows, shape[1..].iter().product())
}

/// `units` over `ranks` as evenly as possible, the first ranks taking one
/// more (4 heads over 3 ranks: 2, 1, 1): rank `rank`'s range.
pub fn share_of(units: usize, ranks: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (units / ranks.max(1), units % ranks.max(1));
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The splits of grouped-query attention's projections over heads of
/// `head_dim` channels (Llama's q_proj, k_proj, v_proj and o_proj): a rank
/// takes whole KV heads and, in step, the query heads that share them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSplit {
    pub query: TensorSplit,
    /// Both k and v.
    pub key_value: TensorSplit,
    pub output: TensorSplit,
}

impl AttentionSplit {
    /// `n_head` query heads sharing `n_kv_head` KV heads in groups. With
    /// fewer KV heads than query heads (grouped-query), the ranks must
    /// divide the KV heads, so each takes the same share; with one KV head
    /// per query head the heads split as evenly as they go. With one KV
    /// head for all (multi-query: Gemma 3 270M) over several ranks, every
    /// rank holds k and v whole (replicated: a KV head is 1/n_head of the
    /// attention's weights) and the query heads split as evenly as they go.
    pub fn grouped_query(n_head: usize, n_kv_head: usize, head_dim: usize) -> Result<Self> {
        if n_head == 0 || n_kv_head == 0 || head_dim == 0 || n_head % n_kv_head != 0 {
            return Err(Error::InvalidArgument {
                op: "AttentionSplit",
                reason: format!("{n_head} query heads cannot share {n_kv_head} KV heads in equal groups"),
            });
        }
        let ranks = ranks();
        if n_kv_head == 1 && n_head > 1 && ranks > 1 {
            return Ok(AttentionSplit {
                query: TensorSplit::Column {
                    groups: 1,
                    unit: head_dim,
                },
                key_value: TensorSplit::Replicated,
                output: TensorSplit::Row { unit: head_dim },
            });
        }
        if ranks > n_kv_head || (n_kv_head < n_head && n_kv_head % ranks != 0) {
            return Err(Error::InvalidArgument {
                op: "tensor parallel",
                reason: format!("{ranks} devices must divide the {n_kv_head} KV heads: each device takes whole KV heads and the query heads sharing them"),
            });
        }
        let group = n_head / n_kv_head;
        Ok(AttentionSplit {
            query: TensorSplit::Column {
                groups: 1,
                unit: group * head_dim,
            },
            key_value: TensorSplit::Column {
                groups: 1,
                unit: head_dim,
            },
            output: TensorSplit::Row { unit: group * head_dim },
        })
    }
}

/// One rank's graph up to an all-reduce (or, last, to the model output).
pub struct Segment {
    pub graph: Graph,
    /// The model input (first segment) or the previous all-reduce's sum.
    pub input: Tensor,
    pub output: Tensor,
}

/// What [`build_rank`] yields: the rank's segments in order, and where its
/// share of each split parameter lies (name, whole shape, slice).
pub struct RankBuild {
    pub segments: Vec<Segment>,
    pub slices: Vec<(String, Vec<usize>, Slice)>,
}

struct ShardState {
    rank: usize,
    ranks: usize,
    input: Tensor,
    done: Vec<Segment>,
    slices: Vec<(String, Vec<usize>, Slice)>,
    /// The split Linear whose share is being built (an adapter on it
    /// splits with it): its prefix, whole [out, in] and weight slice.
    linear: Option<(String, [usize; 2], Slice)>,
}

thread_local! {
    static SHARD: RefCell<Option<ShardState>> = const { RefCell::new(None) };
}

/// Clears the shard state however the build ends.
struct Reset;

impl Drop for Reset {
    fn drop(&mut self) {
        SHARD.with(|s| s.borrow_mut().take());
    }
}

/// Rank `rank` of `ranks`: runs `forward` (a model's forward from `input`,
/// declared in `g`) with the split declarations active and returns its
/// segments, the last ending at `forward`'s output.
pub fn build_rank(
    rank: usize,
    ranks: usize,
    mut g: Graph,
    input: Tensor,
    forward: impl FnOnce(&mut Graph, Tensor) -> Result<Tensor>,
) -> Result<RankBuild> {
    if ranks == 0 || rank >= ranks {
        return Err(Error::InvalidArgument {
            op: "tensor parallel",
            reason: format!("rank {rank} of {ranks}"),
        });
    }
    let nested = SHARD.with(|s| s.borrow().is_some());
    if nested {
        return Err(Error::InvalidArgument {
            op: "tensor parallel",
            reason: "a rank's build cannot nest another".into(),
        });
    }
    SHARD.with(|s| {
        *s.borrow_mut() = Some(ShardState {
            rank,
            ranks,
            input,
            done: Vec::new(),
            slices: Vec::new(),
            linear: None,
        })
    });
    let _reset = Reset;
    let output = forward(&mut g, input)?;
    let state = SHARD.with(|s| s.borrow_mut().take()).ok_or_else(|| Error::Internal {
        op: "tensor parallel",
        reason: "the build lost its rank".into(),
    })?;
    let mut segments = state.done;
    segments.push(Segment {
        graph: g,
        input: state.input,
        output,
    });
    Ok(RankBuild {
        segments,
        slices: state.slices,
    })
}

/// (rank, ranks) inside [`build_rank`].
/// Whether a tensor-parallel rank is being built on this thread.
pub(crate) fn sharded() -> bool {
    current().is_some()
}

fn current() -> Option<(usize, usize)> {
    SHARD.with(|s| s.borrow().as_ref().map(|s| (s.rank, s.ranks)))
}

/// The ranks a module's forward is being split over (1 outside a
/// tensor-parallel build), for a module to check its own sizes against
/// (attention: a head per rank at least).
pub fn ranks() -> usize {
    current().map_or(1, |(_, ranks)| ranks)
}

/// Sums `partial` over the ranks: in a tensor-parallel build it ends this
/// segment and returns the next one's input; otherwise it is `partial`.
pub fn all_reduce(g: &mut Graph, partial: Tensor) -> Result<Tensor> {
    if current().is_none() {
        return Ok(partial);
    }
    let shape = g.shape_of(partial).map(<[usize]>::to_vec).unwrap_or_default();
    let graph = std::mem::replace(g, Graph::new());
    let next = g.input("segment_input", &shape)?;
    SHARD.with(|s| {
        if let Some(state) = s.borrow_mut().as_mut() {
            let input = std::mem::replace(&mut state.input, next);
            state.done.push(Segment {
                graph,
                input,
                output: partial,
            });
        }
    });
    Ok(next)
}

/// A residual branch `x + f(x)` whose last Linear is row-parallel: rank 0
/// adds x to its partial f(x), the others pass theirs on, and the
/// all-reduce sums them (Megatron's g).
pub fn reduce_residual(g: &mut Graph, x: Tensor, branch: Tensor) -> Result<Tensor> {
    match current() {
        None => g.add(x, branch),
        Some((0, _)) => {
            let sum = g.add(x, branch)?;
            all_reduce(g, sum)
        }
        Some(_) => all_reduce(g, branch),
    }
}

/// A residual branch that is normed before it joins the stream (Gemma's
/// post-attention and post-MLP norms), whose last Linear is row-parallel:
/// the whole branch and the stream x, in the segment after the all-reduce
/// (outside tensor parallelism, both as given). Under tensor parallelism
/// the ranks all-reduce x | branch side by side, rank 0 contributing x and
/// the others zeros, so that the next segment holds both.
pub fn reduce_beside(g: &mut Graph, x: Tensor, branch: Tensor) -> Result<(Tensor, Tensor)> {
    let Some((rank, _)) = current() else {
        return Ok((x, branch));
    };
    let stream = if rank == 0 { x } else { g.scale(x, 0.0)? };
    let width = g.shape_of(x).and_then(|s| s.last().copied()).unwrap_or(0);
    let joined = g.concat_last(&[stream, branch])?;
    let summed = all_reduce(g, joined)?;
    let parts = g.split_last(summed, &[width, width])?;
    Ok((parts[0], parts[1]))
}

impl Linear {
    /// [`Module::forward`] with the split this Linear takes under tensor
    /// parallelism: inside [`build_rank`] it declares only the rank's share
    /// of `{prefix}weight` and `{prefix}bias` (and records where it lies);
    /// outside, the whole Linear.
    pub fn forward_split(&self, g: &mut Graph, x: Tensor, prefix: &str, split: TensorSplit) -> Result<Tensor> {
        let Some((rank, ranks)) = current() else {
            return self.forward(g, x, prefix);
        };
        let (out, input) = (self.out_features, self.in_features);
        let bias_len = self.bias.as_ref().map_or(out, Vec::len);
        // Built without values (a model sized to plan its memory): shares
        // without values too.
        let planned = self.weight.is_empty() && self.bias.as_ref().is_none_or(Vec::is_empty);
        if !planned && (self.weight.len() != out * input || bias_len != out) {
            return Err(Error::shape(
                "Linear",
                format!("`{prefix}weight` must hold [{out}, {input}] values and its bias {out}"),
                &[&[out, input], &[self.weight.len()], &[bias_len]],
            ));
        }
        let bad = |what: String| Error::InvalidArgument {
            op: "tensor parallel",
            reason: format!("`{prefix}weight` [{out}, {input}] does not split into {what}"),
        };
        let weight_shape = vec![out, input];
        let (share, weight_slice, bias) = match split {
            // The whole Linear, declared as any replicated parameter.
            TensorSplit::Replicated => return self.forward(g, x, prefix),
            TensorSplit::Column { groups, unit } => {
                let per_group = out / groups.max(1);
                if groups == 0 || unit == 0 || out % groups != 0 || per_group % unit != 0 {
                    return Err(bad(format!("{groups} blocks of {unit}-row units")));
                }
                let units = share_range(prefix, per_group / unit, ranks, rank)?;
                let rows: Vec<Range<usize>> = (0..groups)
                    .map(|k| k * per_group + units.start * unit..k * per_group + units.end * unit)
                    .collect();
                let slice = Slice::Rows(rows);
                let bias = self.bias.as_ref().map(|b| {
                    let part = slice.take(b, &[out]);
                    (part, Some(slice.clone()))
                });
                let local = groups * units.len() * unit;
                let linear = Linear {
                    in_features: input,
                    out_features: local,
                    weight: slice.take(&self.weight, &weight_shape),
                    bias: None,
                };
                (linear, slice, bias)
            }
            TensorSplit::Row { unit } => {
                if unit == 0 || input % unit != 0 {
                    return Err(bad(format!("{unit}-column units")));
                }
                let units = share_range(prefix, input / unit, ranks, rank)?;
                let slice = Slice::Columns(units.start * unit..units.end * unit);
                // The bias once, on rank 0: the ranks' outputs are summed.
                let bias = self.bias.as_ref().filter(|_| rank == 0).map(|b| (b.clone(), None));
                let linear = Linear {
                    in_features: units.len() * unit,
                    out_features: out,
                    weight: slice.take(&self.weight, &weight_shape),
                    bias: None,
                };
                (linear, slice, bias)
            }
        };
        let bias_slice = bias.as_ref().and_then(|(_, s)| s.clone());
        let share = Linear {
            bias: bias.map(|(b, _)| b),
            ..share
        };
        SHARD.with(|s| {
            if let Some(state) = s.borrow_mut().as_mut() {
                state
                    .slices
                    .push((format!("{prefix}weight"), weight_shape, weight_slice.clone()));
                if let Some(slice) = bias_slice {
                    state.slices.push((format!("{prefix}bias"), vec![out], slice));
                }
                state.linear = Some((prefix.to_string(), [out, input], weight_slice));
            }
        });
        let y = share.forward(g, x, prefix);
        SHARD.with(|s| s.borrow_mut().as_mut().map(|state| state.linear.take()));
        y
    }
}

/// Inside [`Linear::forward_split`] of the Linear at `prefix`: its whole
/// [out, in] and where this rank's share of its weight lies (rows:
/// column-parallel, columns: row-parallel), for an adapter on it to split
/// alike.
pub(crate) fn linear_share(prefix: &str) -> Option<([usize; 2], Slice)> {
    SHARD.with(|s| {
        s.borrow()
            .as_ref()
            .and_then(|state| state.linear.as_ref())
            .filter(|(p, _, _)| p == prefix)
            .map(|(_, whole, slice)| (*whole, slice.clone()))
    })
}

/// Notes where this rank's share of the parameter `name` (whole `shape`)
/// lies, as [`Linear::forward_split`] notes its weight's (an adapter's
/// split matrix).
pub(crate) fn record_slice(name: String, shape: Vec<usize>, slice: Slice) {
    SHARD.with(|s| {
        if let Some(state) = s.borrow_mut().as_mut() {
            state.slices.push((name, shape, slice));
        }
    });
}

/// This rank's range of `units`, or an error when some rank would get none.
fn share_range(prefix: &str, units: usize, ranks: usize, rank: usize) -> Result<Range<usize>> {
    if units < ranks {
        return Err(Error::InvalidArgument {
            op: "tensor parallel",
            reason: format!("{ranks} devices need a share each, but `{prefix}weight` has {units} units to split (heads or hidden units): use at most {units} devices"),
        });
    }
    Ok(share_of(units, ranks, rank))
}
