//! Embedding lookup and its backward: a stable sort of the positions by
//! id (u32 scratch), then each table row summed in position order straight
//! into the parameter's gradient (deterministic, no float atomics).

use super::{two_parts, DispatchContext, OpFamily, ReferenceContext};
use crate::cpu;
use crate::error::{Error, Result};
use crate::graph::builder::{DType, Graph, Tensor};
use crate::kernels::{Dispatch, F16View, QuantView};

/// Embedding lookup and its backward.
#[derive(Clone, Debug, PartialEq)]
pub enum EmbeddingOp {
    /// inputs (table [V, C], u32 ids [..]) -> [.., C].
    Embedding,
    /// inputs (u32 ids): order[n] then cursor[vocab + 1] at
    /// [`stats_offset`]`(n)`: the positions sorted by id (u32 scratch).
    EmbeddingSort { vocab: usize },
    /// inputs (dy, ids, sort) -> the table's gradient, added into the
    /// parameter's gradient (always computed there).
    EmbeddingBackward,
}

impl OpFamily for EmbeddingOp {
    fn name(&self) -> &'static str {
        match self {
            EmbeddingOp::Embedding => "embedding",
            EmbeddingOp::EmbeddingSort { .. } => "embedding_sort",
            EmbeddingOp::EmbeddingBackward => "embedding_backward",
        }
    }

    fn dispatch(&self, cx: &DispatchContext<'_>) -> Result<Dispatch> {
        let k = cx.kernels();
        match self {
            EmbeddingOp::Embedding => {
                let (vocab, channels) = (cx.input_shape(0)[0], cx.input_shape(0)[1]);
                let n = cx.input_node(1).len();
                match cx.input_node(0).dtype {
                    DType::F16 => {
                        return k.embedding_f16_weights(
                            cx.out()?,
                            F16View::new(cx.input(0)?, vocab * channels)?,
                            cx.input(1)?,
                            n,
                            vocab,
                            channels,
                        )
                    }
                    DType::Quant(format) => {
                        return k.embedding_quant_weights(
                            cx.out()?,
                            QuantView::new(cx.input(0)?, format, vocab, channels)?,
                            cx.input(1)?,
                            n,
                        )
                    }
                    DType::F32 | DType::U32 => {}
                }
                k.embedding_forward(cx.out()?, cx.input(0)?, cx.input(1)?, n, vocab, channels)
            }
            EmbeddingOp::EmbeddingSort { vocab } => {
                let n = cx.input_node(0).len();
                let (order, cursor) = cx.halves(Tensor(cx.node), n)?;
                k.embedding_backward_sort(order, cursor, cx.input(0)?, n, *vocab)
            }
            EmbeddingOp::EmbeddingBackward if cx.accumulate() => {
                let (vocab, channels) = (cx.shape()[0], cx.shape()[1]);
                let n = cx.input_node(1).len();
                let (order, _) = cx.halves(cx.read(2), n)?;
                k.embedding_backward(cx.out()?, cx.input(0)?, cx.input(1)?, order, n, vocab, channels)
            }
            EmbeddingOp::EmbeddingBackward => Err(Error::NoGradient {
                op: "embedding",
                input: "a table that is not a parameter".into(),
            }),
        }
    }

    fn gradient(&self, g: &mut Graph, node: Tensor, slot: usize, dy: Tensor) -> Result<Tensor> {
        let (EmbeddingOp::Embedding, 0) = (self, slot) else {
            return Err(super::no_gradient(g, node, slot));
        };
        let (table, ids) = (g.node(node).inputs[0], g.node(node).inputs[1]);
        let table_shape = g.shape(table).to_vec();
        let (vocab, n_ids) = (table_shape[0], g.node(ids).len());
        let existing = g
            .nodes()
            .iter()
            .position(|m| m.op == EmbeddingOp::EmbeddingSort { vocab } && m.inputs == [ids]);
        let sort = match existing {
            Some(i) => Tensor(i),
            None => {
                let shape = vec![super::stats_offset(n_ids) + vocab + 1];
                let name = format!("{}.sorted", g.node(ids).name);
                g.push(EmbeddingOp::EmbeddingSort { vocab }, vec![ids], shape, DType::U32, name)
            }
        };
        let name = format!("d{}", g.node(table).name);
        Ok(g.push(
            EmbeddingOp::EmbeddingBackward,
            vec![dy, ids, sort],
            table_shape,
            DType::F32,
            name,
        ))
    }

    fn reference(&self, cx: &ReferenceContext<'_>) -> Result<Vec<f64>> {
        match self {
            EmbeddingOp::Embedding => {
                let (vocab, channels) = (cx.input_shape(0)[0], cx.input_shape(0)[1]);
                Ok(cpu::embedding_forward(cx.input(0)?, &cx.input_u32(1)?, vocab, channels))
            }
            // The positions sorted stably by id, then each id's first
            // position in that order (the kernel's cursor is scratch; these
            // are the starts it counts).
            EmbeddingOp::EmbeddingSort { vocab } => {
                let ids = cx.input_u32(0)?;
                let mut order: Vec<usize> = (0..ids.len()).collect();
                order.sort_by_key(|&n| ids[n]);
                let starts = (0..=*vocab)
                    .map(|v| ids.iter().filter(|&&id| (id as usize) < v).count() as f64)
                    .collect();
                Ok(two_parts(
                    order.into_iter().map(|n| n as f64).collect(),
                    starts,
                    ids.len(),
                ))
            }
            EmbeddingOp::EmbeddingBackward => {
                let (vocab, channels) = (cx.shape()[0], cx.shape()[1]);
                Ok(cpu::embedding_backward(
                    cx.input(0)?,
                    &cx.input_u32(1)?,
                    vocab,
                    channels,
                ))
            }
        }
    }

    /// A token id outside the table.
    fn check_u32_input(&self, g: &Graph, node: Tensor, slot: usize, ids: &[u32]) -> Result<()> {
        match (self, slot) {
            (EmbeddingOp::Embedding, 1) => {
                crate::kernels::check_token_ids("Embedding", ids, g.shape(g.node(node).inputs[0])[0])
            }
            _ => Ok(()),
        }
    }
}

impl Graph {
    /// Rows of `table` [V, C] picked by u32 `ids` [..] -> [.., C]
    /// (torch.nn.functional.embedding).
    pub fn embedding(&mut self, table: Tensor, ids: Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        // An f16 or quantized table (generation's tied token embedding) is
        // read in f32.
        if self.get(table).is_none_or(|n| !n.dtype.is_stored_weight()) {
            self.f32_inputs(OP, &[table])?;
        }
        self.check_handle(OP, ids)?;
        let (st, si) = (self.shape(table).to_vec(), self.shape(ids).to_vec());
        let [_, channels] = st[..] else {
            return Err(Error::shape(OP, "the table must be [vocab, channels]", &[&st, &si]));
        };
        if self.node(ids).dtype != DType::U32 {
            return Err(Error::shape(OP, "ids must be u32", &[&st, &si]));
        }
        let mut shape = si.clone();
        shape.push(channels);
        Self::non_empty(OP, &shape)?;
        Ok(self.push(
            EmbeddingOp::Embedding,
            vec![table, ids],
            shape,
            DType::F32,
            format!("{OP}{}", self.nodes.len()),
        ))
    }
}
