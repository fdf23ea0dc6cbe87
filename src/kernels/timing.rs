//! Kernel time measured on the GPU itself, from timestamp queries written
//! at the start and end of a compute pass: on a fast GPU a submit and a
//! wait cost more than the kernel, so wall-clock timing of one dispatch
//! would measure the driver, not the kernel.

use std::time::Duration;

use super::{Dispatch, Kernels, View};
use crate::error::Result;

impl Kernels {
    /// Time per launch of `dispatch`, recorded `reps` times in one pass and
    /// timed by timestamp queries. `None` when the device has no
    /// TIMESTAMP_QUERY or its timestamps do not advance (some drivers
    /// report zeros); the caller then falls back to wall-clock time.
    pub fn time_on_gpu(&self, dispatch: &Dispatch, reps: u32) -> Result<Option<Duration>> {
        let device = self.device();
        if !device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Ok(None);
        }
        let reps = reps.max(1);
        let wgpu_device = device.wgpu_device();
        let (queries, resolved, encoder) = device.scoped("time_on_gpu", || {
            let queries = wgpu_device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kernel timing"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            });
            let resolved = wgpu_device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kernel timing resolve"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let mut encoder = wgpu_device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("kernel timing"),
            });
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("kernel timing"),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &queries,
                        beginning_of_pass_write_index: Some(0),
                        end_of_pass_write_index: Some(1),
                    }),
                });
                for _ in 0..reps {
                    dispatch.record(&mut pass);
                }
            }
            encoder.resolve_query_set(&queries, 0..2, &resolved, 0);
            (queries, resolved, encoder)
        })?;
        self.submit("time_on_gpu", encoder)?;
        let ticks: Vec<u64> = self.read(View {
            buffer: &resolved,
            offset: 0,
            len: 4,
        })?;
        drop(queries);
        let period_ns = f64::from(device.queue().get_timestamp_period());
        let elapsed_ns = match ticks.as_slice() {
            [start, end] if end > start => (end - start) as f64 * period_ns,
            _ => return Ok(None),
        };
        if !elapsed_ns.is_finite() || elapsed_ns <= 0.0 {
            return Ok(None);
        }
        Ok(Some(Duration::from_secs_f64(elapsed_ns / 1e9 / f64::from(reps))))
    }
}
