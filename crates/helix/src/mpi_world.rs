//! [`Collective`] over MPI (the `mpi` crate over Open MPI): the ranks `mpirun` launched.
//! MPI is initialized for serialized use and every call holds one lock, so the group may be
//! shared between threads. A rank that dies ends the job: Open MPI's `mpirun` then stops
//! the others and names the rank.
use std::sync::Mutex;

use candle_core::Tensor;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Root};
use mpi::Threading;

use crate::collective::{host_values, stacked, Collective, CollectiveError, CollectiveResult};
use crate::world_error::WorldError;

/// The universe, held until [`finalize`] (dropping it finalizes MPI).
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

/// MPI's world communicator as a [`Collective`].
pub struct MpiWorld {
    comm: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
}

// SAFETY: MPI is initialized at `Threading::Serialized` or above (checked in `init`), which
// allows calls from any thread as long as no two run at once; every call goes through the
// `comm` lock.
unsafe impl Send for MpiWorld {}
// SAFETY: as above: shared access is serialized by the lock.
unsafe impl Sync for MpiWorld {}

impl MpiWorld {
    /// Initializes MPI and takes its world communicator.
    pub fn init() -> Result<Self, WorldError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| WorldError::Init("MPI was already initialized".into()))?;
        if threading < Threading::Serialized {
            return Err(WorldError::Init(format!(
                "the MPI library offers {threading:?} threading; serialized is needed"
            )));
        }
        let comm = universe.world();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        *UNIVERSE
            .lock()
            .map_err(|_| WorldError::Init("poisoned".into()))? = Some(universe);
        Ok(Self {
            comm: Mutex::new(comm),
            rank,
            size,
        })
    }

    fn comm(&self) -> CollectiveResult<std::sync::MutexGuard<'_, SimpleCommunicator>> {
        self.comm
            .lock()
            .map_err(|_| CollectiveError::Backend("a thread panicked inside MPI".into()))
    }
}

/// Finalizes MPI (once; later collectives are errors of the MPI library).
pub fn finalize() {
    if let Ok(mut u) = UNIVERSE.lock() {
        u.take();
    }
}

/// Aborts every rank of the job with `code`.
pub fn abort(code: i32) {
    if let Ok(u) = UNIVERSE.lock() {
        if let Some(u) = u.as_ref() {
            u.world().abort(code);
        }
    }
}

impl Collective for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        let send = host_values(local)?;
        let mut recv = vec![0f32; send.len() * self.size];
        self.comm()?.all_gather_into(&send[..], &mut recv[..]);
        stacked(recv, self.size, local)
    }
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        let send = host_values(local)?;
        let mut recv = vec![0f32; send.len()];
        self.comm()?
            .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        Ok(Tensor::from_vec(recv, local.dims(), local.device())?)
    }
    fn all_gather_u64(&self, local: &[u64]) -> CollectiveResult<Vec<u64>> {
        let mut recv = vec![0u64; local.len() * self.size];
        self.comm()?.all_gather_into(local, &mut recv[..]);
        Ok(recv)
    }
    fn broadcast_u32(&self, values: &mut [u32], root: usize) -> CollectiveResult<()> {
        let comm = self.comm()?;
        comm.process_at_rank(root as i32).broadcast_into(values);
        Ok(())
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.comm()?.barrier();
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
}
