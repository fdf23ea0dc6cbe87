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

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::distributed::ProcessGroup;
use crate::error::{Error, Result};

/// MPI_COMM_WORLD of an initialised MPI job. Dropping it does not finalise
/// MPI (that would hang on an error path while other ranks wait): end a
/// run with [`MpiGroup::finalize`] or [`ProcessGroup::abort`].
pub struct MpiGroup {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    universe: ManuallyDrop<Universe>,
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
        Ok(MpiGroup { world, rank, size, universe: ManuallyDrop::new(universe) })
    }

    /// A clean end of the job: waits for every rank, then `MPI_Finalize`.
    pub fn finalize(mut self) {
        self.world.barrier();
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
            self.world.all_reduce_into(&send[..], chunk, SystemOperation::sum());
        }
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        if root >= self.size {
            return Err(Error::Distributed { op: "broadcast", rank: self.rank, size: self.size, message: format!("no rank {root}") });
        }
        let root_process = self.world.process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        root_process.broadcast_into(&mut len);
        let len = usize::try_from(len).map_err(|_| Error::Distributed {
            op: "broadcast",
            rank: self.rank,
            size: self.size,
            message: format!("{len} bytes do not fit in memory here"),
        })?;
        bytes.resize(len, 0);
        for chunk in bytes.chunks_mut(MAX_COUNT) {
            root_process.broadcast_into(chunk);
        }
        Ok(())
    }

    fn all_gather(&self, values: &[f64]) -> Result<Vec<f64>> {
        let mut out = vec![0.0f64; values.len() * self.size];
        self.world.all_gather_into(values, &mut out[..]);
        Ok(out)
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn describe(&self) -> String {
        let (major, minor) = mpi::environment::version();
        format!("MPI {major}.{minor} ({}), rank {} of {} on {}", mpi::environment::library_version().unwrap_or_default().lines().next().unwrap_or("").trim(), self.rank, self.size, self.host())
    }
}
