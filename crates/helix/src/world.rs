//! The process's group: MPI's world when the process was launched by `mpirun` (feature
//! `mpi`; with `nccl` too, GPU tensors go over NCCL), a rank alone otherwise. Initialized on first use, finalized by [`finish`].
use std::sync::{Arc, Mutex, OnceLock};

use crate::collective::{Collective, Solo};
pub use crate::world_error::WorldError;

static WORLD: OnceLock<Arc<dyn Collective>> = OnceLock::new();
/// Held while the world is set up: MPI is initialized once, whichever thread asks first.
static SETTING_UP: Mutex<()> = Mutex::new(());

/// Ranks the launcher started, when launched by `mpirun` (Open MPI's or MPICH's).
pub fn launched_ranks() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// This process's rank as the launcher numbered it (0 outside `mpirun`); known before MPI
/// starts, so a tool can keep every rank but 0 quiet from its first line.
pub fn launched_rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// This process's rank among those the launcher started on this machine (0 outside
/// `mpirun`): the GPU a rank uses, one GPU per rank.
pub fn launched_local_rank() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "PMI_LOCAL_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(0)
}

/// GPUs this process sees (0 without feature `cuda`, or without a driver).
pub fn visible_gpus() -> usize {
    #[cfg(feature = "cuda")]
    if let Ok(n) = candle_core::cuda::cudarc::driver::CudaContext::device_count() {
        return usize::try_from(n).unwrap_or(0);
    }
    0
}

/// The process's group (module docs); the same one on every call.
pub fn world() -> Result<Arc<dyn Collective>, WorldError> {
    if let Some(w) = WORLD.get() {
        return Ok(w.clone());
    }
    let _one = SETTING_UP.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = WORLD.get() {
        return Ok(w.clone());
    }
    let w: Arc<dyn Collective> = match launched_ranks() {
        #[cfg(all(feature = "mpi", feature = "nccl"))]
        Some(_) => Arc::new(crate::nccl_world::NcclWorld::new(
            crate::mpi_world::MpiWorld::init()?,
        )),
        #[cfg(all(feature = "mpi", not(feature = "nccl")))]
        Some(_) => Arc::new(crate::mpi_world::MpiWorld::init()?),
        #[cfg(not(feature = "mpi"))]
        Some(ranks) if ranks > 1 => return Err(WorldError::NotBuilt { ranks }),
        _ => Arc::new(Solo),
    };
    Ok(WORLD.get_or_init(|| w).clone())
}

/// The group, when [`world`] has set it up (`None` before: no rank but 0 exists).
pub fn current() -> Option<Arc<dyn Collective>> {
    WORLD.get().cloned()
}

/// Ends the group's communication (MPI's finalize) before the process exits; nothing when
/// MPI was not used. No collective may follow it (the MPI library aborts the process).
pub fn finish() {
    #[cfg(feature = "mpi")]
    crate::mpi_world::finalize();
}

/// Ends every rank of the group with `code` after an error on this one (MPI's abort, so
/// that no rank waits forever on a collective this one will not join); returns on a rank
/// alone.
pub fn abort(code: i32) {
    let _ = code;
    #[cfg(feature = "mpi")]
    if current().is_some_and(|w| w.size() > 1) {
        crate::mpi_world::abort(code);
    }
}
