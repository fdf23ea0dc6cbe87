//! [`ProcessGroup`] over MPI (the `mpi` cargo feature, through rsmpi), for
//! jobs launched by `mpirun`, `srun` or any MPI launcher.
//!
//! MPI's one trap for Rust: dropping the `Universe` calls `MPI_Finalize`,
//! which waits for every other rank — so a rank that panics or returns
//! early while the others sit in a collective hangs the job forever.
//! [`MpiGroup::init`] therefore installs a panic hook that aborts the whole
//! job, and callers end every error path with [`ProcessGroup::abort`]
//! (see `wgrad train --distributed mpi`).

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::distributed::{check_counts, ProcessGroup};
use crate::device::wait_timeout;
use crate::error::{Error, Result};

/// MPI_COMM_WORLD of an initialised MPI job. Dropping it does not finalise
/// MPI (that would hang on an error path while other ranks wait): end a
/// run with [`MpiGroup::finalize`] or [`ProcessGroup::abort`].
pub struct MpiGroup {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    universe: ManuallyDrop<Universe>,
    watch: Arc<Watch>,
}

/// The collective in flight, for the watchdog: MPI over TCP waits forever
/// for a peer whose network link went down (no error, no reset), so a
/// thread ends this rank once a collective has made no progress for
/// [`wait_timeout`] (`WGRAD_TIMEOUT_S`), naming the rank, its host and
/// the collective; `mpirun` then ends the job.
struct Watch {
    epoch: Instant,
    /// Milliseconds after `epoch` the collective began, plus one (0: none).
    since_ms: AtomicU64,
    op: Mutex<&'static str>,
}

impl Watch {
    fn start(rank: usize, size: usize, host: String) -> Arc<Watch> {
        let watch = Arc::new(Watch {
            epoch: Instant::now(),
            since_ms: AtomicU64::new(0),
            op: Mutex::new(""),
        });
        let seen = watch.clone();
        let limit = wait_timeout();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(250));
            let since = seen.since_ms.load(Ordering::Acquire);
            if since == 0 {
                continue;
            }
            let waited = seen.epoch.elapsed().saturating_sub(Duration::from_millis(since - 1));
            if waited > limit {
                let op = *seen.op.lock().unwrap_or_else(|p| p.into_inner());
                eprintln!(
                    "error: rank {rank} of {size} on {host}: MPI {op} got no answer for {:.0} s (WGRAD_TIMEOUT_S): a rank or its network link is gone; ending this rank so mpirun ends the job",
                    waited.as_secs_f64()
                );
                // Not MPI_Abort: MPI is not ours to call from this thread
                // (Threading::Funneled), and the main thread is inside it.
                std::process::exit(3);
            }
        });
        watch
    }
}

/// Largest element count passed to one MPI call (counts are C ints).
const MAX_COUNT: usize = 1 << 30;

impl MpiGroup {
    /// Initialises MPI (once per process) and makes any later panic abort
    /// the whole job with a message naming this rank.
    pub fn init() -> Result<Self> {
        // Only the calling thread talks to MPI; wgpu's and the drivers'
        // own threads never do.
        let (universe, _) = mpi::initialize_with_threading(Threading::Funneled).ok_or_else(|| Error::Distributed {
            op: "MPI init",
            rank: 0,
            size: 0,
            message: "MPI was already initialised in this process".into(),
        })?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("rank {rank} of {size} panicked: aborting the MPI job");
            // SAFETY: MPI is initialised (this hook is installed after
            // init) and MPI_Abort may be called from any state.
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
            }
        }));
        let host = mpi::environment::processor_name().unwrap_or_else(|_| "?".into());
        Ok(MpiGroup {
            world,
            rank,
            size,
            universe: ManuallyDrop::new(universe),
            watch: Watch::start(rank, size, host),
        })
    }

    /// Runs the collective `f` under the watchdog ([`Watch`]).
    fn watched<T>(&self, op: &'static str, f: impl FnOnce() -> T) -> T {
        *self.watch.op.lock().unwrap_or_else(|p| p.into_inner()) = op;
        let now = self.watch.epoch.elapsed().as_millis() as u64 + 1;
        self.watch.since_ms.store(now, Ordering::Release);
        let out = f();
        self.watch.since_ms.store(0, Ordering::Release);
        out
    }

    /// A clean end of the job: waits for every rank, then `MPI_Finalize`.
    pub fn finalize(mut self) {
        self.watched("barrier", || self.world.barrier());
        // SAFETY: `universe` is never used again; `self` is consumed.
        unsafe { ManuallyDrop::drop(&mut self.universe) };
    }

    /// The processor (host) name MPI reports.
    pub fn host(&self) -> String {
        mpi::environment::processor_name().unwrap_or_else(|_| "?".into())
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()> {
        for chunk in values.chunks_mut(MAX_COUNT) {
            let send = chunk.to_vec();
            self.watched("all_reduce", || {
                self.world.all_reduce_into(&send[..], chunk, SystemOperation::sum())
            });
        }
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        if root >= self.size {
            return Err(Error::Distributed {
                op: "broadcast",
                rank: self.rank,
                size: self.size,
                message: format!("no rank {root}"),
            });
        }
        let root_process = self.world.process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        self.watched("broadcast", || root_process.broadcast_into(&mut len));
        let len = usize::try_from(len).map_err(|_| Error::Distributed {
            op: "broadcast",
            rank: self.rank,
            size: self.size,
            message: format!("{len} bytes do not fit in memory here"),
        })?;
        bytes.resize(len, 0);
        for chunk in bytes.chunks_mut(MAX_COUNT) {
            self.watched("broadcast", || root_process.broadcast_into(chunk));
        }
        Ok(())
    }

    fn all_gather(&self, values: &[f64]) -> Result<Vec<f64>> {
        let mut out = vec![0.0f64; values.len() * self.size];
        self.watched("all_gather", || self.world.all_gather_into(values, &mut out[..]));
        Ok(out)
    }

    fn reduce_scatter_sum(&self, values: &[f64], counts: &[usize]) -> Result<Vec<f64>> {
        check_counts("reduce_scatter", self, values.len(), counts)?;
        // MPI_Reduce_scatter_block takes equal blocks: each segment padded
        // to the largest, so the sum of a segment is MPI's, untouched.
        let block = counts.iter().copied().max().unwrap_or(0).max(1);
        if block * self.size > MAX_COUNT {
            return Err(Error::Distributed {
                op: "reduce_scatter",
                rank: self.rank,
                size: self.size,
                message: format!("{} padded values are over MPI's count limit", block * self.size),
            });
        }
        let mut send = vec![0.0f64; block * self.size];
        let mut start = 0;
        for (r, &n) in counts.iter().enumerate() {
            send[r * block..r * block + n].copy_from_slice(&values[start..start + n]);
            start += n;
        }
        let mut own = vec![0.0f64; block];
        self.watched("reduce_scatter", || {
            self.world
                .reduce_scatter_block_into(&send[..], &mut own[..], SystemOperation::sum())
        });
        own.truncate(counts[self.rank]);
        Ok(own)
    }

    fn all_gather_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        let total: usize = counts.iter().sum();
        if counts.len() != self.size || counts.get(self.rank) != Some(&values.len()) || total > MAX_COUNT {
            return Err(Error::Distributed {
                op: "all_gather",
                rank: self.rank,
                size: self.size,
                message: format!("segments {counts:?} must name each rank, {} values here", values.len()),
            });
        }
        let as_count = |n: usize| n as mpi::Count;
        let displs: Vec<mpi::Count> = counts
            .iter()
            .scan(0, |at, &n| {
                let d = *at;
                *at += n;
                Some(as_count(d))
            })
            .collect();
        let counts: Vec<mpi::Count> = counts.iter().map(|&n| as_count(n)).collect();
        let mut out = vec![0.0f32; total];
        {
            let mut partition = mpi::datatype::PartitionMut::new(&mut out[..], counts, displs);
            self.watched("all_gather", || {
                self.world.all_gather_varcount_into(values, &mut partition)
            });
        }
        Ok(out)
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn describe(&self) -> String {
        let (major, minor) = mpi::environment::version();
        format!(
            "MPI {major}.{minor} ({}), rank {} of {} on {}",
            mpi::environment::library_version()
                .unwrap_or_default()
                .lines()
                .next()
                .unwrap_or("")
                .trim(),
            self.rank,
            self.size,
            self.host()
        )
    }
}
