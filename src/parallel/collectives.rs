//! Collectives between devices, through the host: all-reduce (sum or
//! weighted), reduce-scatter, broadcast, all-gather, send. Every copy to the host is started
//! on all devices before any is waited on, and devices are polled in turn,
//! so a slow device never holds up the copies of the others. Staging buffers
//! are each device's reused readback buffer.

use std::time::{Duration, Instant};

use super::on_device;
use crate::error::{Error, Result};
use crate::kernels::{Kernels, PendingRead, View};

/// A range on one device.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    pub kernels: &'a Kernels,
    pub view: View<'a>,
}

impl<'a> Part<'a> {
    pub fn new(kernels: &'a Kernels, view: View<'a>) -> Self {
        Part { kernels, view }
    }

    /// Elements `start..start + len` of this part (unchecked: the caller
    /// keeps them inside it).
    pub fn sub(&self, start: usize, len: usize) -> View<'a> {
        View {
            buffer: self.view.buffer,
            offset: self.view.offset + start as u64 * 4,
            len,
        }
    }
}

fn same_lengths(op: &'static str, parts: &[Part<'_>]) -> Result<usize> {
    let n = parts.first().map(|p| p.view.len).unwrap_or(0);
    if parts.iter().any(|p| p.view.len != n) {
        let shapes: Vec<Vec<usize>> = parts.iter().map(|p| vec![p.view.len]).collect();
        return Err(Error::Shape {
            op,
            reason: "every device's part must have the same length".into(),
            shapes,
        });
    }
    Ok(n)
}

/// Copies `views[i]` from each device to the host. Returns the values and
/// how long after `since` each device's data arrived (its compute plus copy
/// time when the copy was queued behind a step).
pub fn to_host(parts: &[(&Kernels, View<'_>)], since: Instant) -> Result<(Vec<Vec<f32>>, Vec<Duration>)> {
    // Each pending read holds its device's staging buffer: two parts on one
    // device would wait on each other.
    for (i, (a, _)) in parts.iter().enumerate() {
        if parts[..i].iter().any(|(b, _)| std::ptr::eq(*a, *b)) {
            return Err(Error::InvalidArgument {
                op: "collective",
                reason: format!("part {i} is on the same device as an earlier part"),
            });
        }
    }
    let mut pending = Vec::with_capacity(parts.len());
    for (i, (k, view)) in parts.iter().enumerate() {
        pending.push(k.begin_read(*view).map_err(|e| on_device(i, k, e))?);
    }
    let arrived = arrivals(parts, &mut pending, since)?;
    let mut values = Vec::with_capacity(parts.len());
    for (i, p) in pending.into_iter().enumerate() {
        values.push(p.finish::<f32>().map_err(|e| on_device(i, parts[i].0, e))?);
    }
    Ok((values, arrived))
}

/// When each pending read arrived, after `since`. Several devices are
/// polled in turn so none idles while another is waited on; native only (it
/// sleeps between polls). A browser gives a page one adapter, so the
/// multi-device collectives do not run there.
#[cfg(not(target_arch = "wasm32"))]
fn arrivals(parts: &[(&Kernels, View<'_>)], pending: &mut [PendingRead<'_>], since: Instant) -> Result<Vec<Duration>> {
    let mut arrived: Vec<Option<Duration>> = vec![None; parts.len()];
    let deadline = Instant::now() + crate::device::wait_timeout();
    while arrived.iter().any(Option::is_none) {
        let mut progressed = false;
        for (i, p) in pending.iter_mut().enumerate() {
            if arrived[i].is_none() && p.is_ready().map_err(|e| on_device(i, parts[i].0, e))? {
                arrived[i] = Some(since.elapsed());
                progressed = true;
            }
        }
        if !progressed {
            if Instant::now() > deadline {
                let i = arrived.iter().position(Option::is_none).unwrap_or(0);
                return Err(on_device(
                    i,
                    parts[i].0,
                    Error::Readback {
                        op: "collective",
                        message: format!("no data after {:?} (WGRAD_TIMEOUT_S)", crate::device::wait_timeout()),
                    },
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(arrived.into_iter().map(|d| d.unwrap_or_default()).collect())
}

#[cfg(target_arch = "wasm32")]
fn arrivals(_: &[(&Kernels, View<'_>)], _: &mut [PendingRead<'_>], _: Instant) -> Result<Vec<Duration>> {
    Err(Error::InvalidArgument {
        op: "collective",
        reason: "collectives across devices need a native build: a browser gives a page one adapter".into(),
    })
}

fn write_all(parts: &[Part<'_>], views: &[View<'_>], values: &[f32]) -> Result<()> {
    for (i, (p, v)) in parts.iter().zip(views).enumerate() {
        p.kernels.write(*v, values).map_err(|e| on_device(i, p.kernels, e))?;
    }
    Ok(())
}

/// Every part becomes Σ_i weights[i]·part_i (plain sum without weights),
/// accumulated in f64 in device order, so every device gets the same bits.
/// Works through the parts `bucket` elements at a time (0: all at once),
/// keeping host buffers small. Returns when each device's first bucket
/// arrived, measured from `since`.
pub fn all_reduce(parts: &[Part<'_>], weights: Option<&[f64]>, bucket: usize, since: Instant) -> Result<Vec<Duration>> {
    all_reduce_then(parts, weights, bucket, since, &mut |_| Ok(()))
}

/// [`all_reduce`] with a second stage: each bucket's weighted local sum
/// (f64, on the host) goes through `across` before it is written back —
/// where a multi-process run sums it over processes, making the reduction
/// hierarchical (devices, then hosts) with one host round trip per bucket.
pub fn all_reduce_then(
    parts: &[Part<'_>],
    weights: Option<&[f64]>,
    bucket: usize,
    since: Instant,
    across: &mut dyn FnMut(&mut [f64]) -> Result<()>,
) -> Result<Vec<Duration>> {
    let n = same_lengths("all_reduce", parts)?;
    if let Some(w) = weights {
        if w.len() != parts.len() {
            return Err(Error::InvalidArgument {
                op: "all_reduce",
                reason: format!("{} weights for {} devices", w.len(), parts.len()),
            });
        }
    }
    let bucket = if bucket == 0 { n.max(1) } else { bucket };
    let mut first_arrival = Vec::new();
    let mut sum = vec![0.0f64; bucket.min(n)];
    let mut out = vec![0.0f32; bucket.min(n)];
    let mut start = 0;
    while start < n {
        let len = bucket.min(n - start);
        let views: Vec<View<'_>> = parts.iter().map(|p| p.sub(start, len)).collect();
        let arrived = weighted_sum(parts, &views, weights, since, &mut sum[..len])?;
        if first_arrival.is_empty() {
            first_arrival = arrived;
        }
        across(&mut sum[..len])?;
        narrow(&sum[..len], &mut out[..len]);
        write_all(parts, &views, &out[..len])?;
        start += len;
    }
    Ok(first_arrival)
}

/// `sum` = Σ_i weights[i]·views[i] (each on `parts[i]`'s device), in f64
/// in device order; returns when each device's values arrived.
fn weighted_sum(
    parts: &[Part<'_>],
    views: &[View<'_>],
    weights: Option<&[f64]>,
    since: Instant,
    sum: &mut [f64],
) -> Result<Vec<Duration>> {
    let pairs: Vec<(&Kernels, View<'_>)> = parts.iter().zip(views).map(|(p, v)| (p.kernels, *v)).collect();
    let (values, arrived) = to_host(&pairs, since)?;
    sum.fill(0.0);
    for (i, v) in values.iter().enumerate() {
        let w = weights.map_or(1.0, |w| w[i]);
        for (s, x) in sum.iter_mut().zip(v) {
            *s += w * f64::from(*x);
        }
    }
    Ok(arrived)
}

/// Σ_i weights[i]·parts[i] (plain sum without weights) on the host, in
/// f64 in device order, as [`all_reduce`] sums: the local stage of a
/// reduction that continues across processes.
pub fn sum_to_host(parts: &[Part<'_>], weights: Option<&[f64]>, since: Instant) -> Result<Vec<f64>> {
    let n = same_lengths("sum_to_host", parts)?;
    let views: Vec<View<'_>> = parts.iter().map(|p| p.view).collect();
    let mut sum = vec![0.0f64; n];
    weighted_sum(parts, &views, weights, since, &mut sum)?;
    Ok(sum)
}

fn narrow(sum: &[f64], out: &mut [f32]) {
    for (o, s) in out.iter_mut().zip(sum) {
        *o = *s as f32;
    }
}

/// Reduce-scatter: the sources (one per device, equal lengths) are summed
/// element-wise (weighted by `weights` when given) and destination `i`
/// receives segment `i` of the sum, the segments being consecutive and of
/// the destinations' lengths (which may differ: uneven shards). Sums are
/// f64 in device order, as [`all_reduce`]'s, so a segment gets the bits
/// an all-reduce would have written there. Works `bucket` elements at a
/// time (0: a segment at once). Returns when each source's first bucket
/// arrived, measured from `since`.
pub fn reduce_scatter(
    srcs: &[Part<'_>],
    weights: Option<&[f64]>,
    dsts: &[Part<'_>],
    bucket: usize,
    since: Instant,
) -> Result<Vec<Duration>> {
    reduce_scatter_then(srcs, weights, dsts, bucket, since, &mut |_, _| Ok(()))
}

/// [`reduce_scatter`] where each bucket's f64 sum goes through
/// `across(segment, values)` before it is written to its destination: a
/// sum over processes, or a statistic of the reduced values (ZeRO's
/// gradient norm, shard by shard).
pub fn reduce_scatter_then(
    srcs: &[Part<'_>],
    weights: Option<&[f64]>,
    dsts: &[Part<'_>],
    bucket: usize,
    since: Instant,
    across: &mut dyn FnMut(usize, &mut [f64]) -> Result<()>,
) -> Result<Vec<Duration>> {
    let n = same_lengths("reduce_scatter", srcs)?;
    let total: usize = dsts.iter().map(|d| d.view.len).sum();
    if total != n || srcs.is_empty() {
        let mut shapes = vec![vec![n]];
        shapes.extend(dsts.iter().map(|d| vec![d.view.len]));
        return Err(Error::Shape {
            op: "reduce_scatter",
            reason: "the destinations' lengths must add up to a source's".into(),
            shapes,
        });
    }
    if let Some(w) = weights {
        if w.len() != srcs.len() {
            return Err(Error::InvalidArgument {
                op: "reduce_scatter",
                reason: format!("{} weights for {} devices", w.len(), srcs.len()),
            });
        }
    }
    let largest = dsts.iter().map(|d| d.view.len).max().unwrap_or(0).max(1);
    let bucket = if bucket == 0 { largest } else { bucket.min(largest) };
    let mut first_arrival = Vec::new();
    let mut sum = vec![0.0f64; bucket];
    let mut out = vec![0.0f32; bucket];
    let mut segment_start = 0;
    for (segment, dst) in dsts.iter().enumerate() {
        let mut start = 0;
        while start < dst.view.len {
            let len = bucket.min(dst.view.len - start);
            let views: Vec<View<'_>> = srcs.iter().map(|p| p.sub(segment_start + start, len)).collect();
            let arrived = weighted_sum(srcs, &views, weights, since, &mut sum[..len])?;
            if first_arrival.is_empty() {
                first_arrival = arrived;
            }
            across(segment, &mut sum[..len])?;
            narrow(&sum[..len], &mut out[..len]);
            dst.kernels
                .write(dst.sub(start, len), &out[..len])
                .map_err(|e| on_device(segment, dst.kernels, e))?;
            start += len;
        }
        segment_start += dst.view.len;
    }
    Ok(first_arrival)
}

/// Copies `src` to every part of `dsts`.
pub fn broadcast(src: Part<'_>, dsts: &[Part<'_>]) -> Result<()> {
    let n = src.view.len;
    if let Some(bad) = dsts.iter().find(|d| d.view.len != n) {
        return Err(Error::shape(
            "broadcast",
            "destination and source lengths differ",
            &[&[n], &[bad.view.len]],
        ));
    }
    let (values, _) = to_host(&[(src.kernels, src.view)], Instant::now())?;
    let views: Vec<View<'_>> = dsts.iter().map(|d| d.view).collect();
    write_all(dsts, &views, &values[0])
}

/// Every destination receives the concatenation of all sources, in order.
pub fn all_gather(srcs: &[Part<'_>], dsts: &[Part<'_>]) -> Result<()> {
    let total: usize = srcs.iter().map(|s| s.view.len).sum();
    if let Some(bad) = dsts.iter().find(|d| d.view.len != total) {
        return Err(Error::shape(
            "all_gather",
            "each destination must hold every source",
            &[&[total], &[bad.view.len]],
        ));
    }
    let pairs: Vec<(&Kernels, View<'_>)> = srcs.iter().map(|s| (s.kernels, s.view)).collect();
    let (values, _) = to_host(&pairs, Instant::now())?;
    let joined: Vec<f32> = values.concat();
    let views: Vec<View<'_>> = dsts.iter().map(|d| d.view).collect();
    write_all(dsts, &views, &joined)
}

/// Copies `src` (one device) to `dst` (another, or the same).
pub fn send(src: Part<'_>, dst: Part<'_>) -> Result<()> {
    broadcast(src, &[dst])
}
