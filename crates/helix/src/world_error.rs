//! Why the process's group could not be set up ([`crate::world()`]); its own file so that the
//! MPI backend names it without importing the module that starts the backend.

/// Why the process's group could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum WorldError {
    /// Launched by `mpirun` with several ranks, but built without MPI.
    #[error("this process is one of {ranks} ranks launched by mpirun, but was built without MPI; rebuild with `--features mpi` (it needs Open MPI: `apt-get install libopenmpi-dev openmpi-bin libclang-dev`)")]
    NotBuilt {
        /// Ranks `mpirun` launched.
        ranks: usize,
    },
    /// MPI could not be initialized.
    #[error("MPI could not be initialized: {0}")]
    Init(String),
}
