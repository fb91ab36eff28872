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

#[cfg(test)]
mod tests {
    use super::WorldError;

    /// An example built without `--features mpi` and launched by `mpirun` as several ranks
    /// says how to rebuild, and what the build needs (the examples the tests run are built
    /// with MPI, so this is checked here, on the message itself).
    #[test]
    fn without_mpi_the_message_names_the_rebuild() {
        let m = WorldError::NotBuilt { ranks: 2 }.to_string();
        assert!(m.contains("one of 2 ranks launched by mpirun"), "{m}");
        assert!(m.contains("rebuild with `--features mpi`"), "{m}");
        assert!(
            m.contains("apt-get install libopenmpi-dev openmpi-bin"),
            "{m}"
        );
        assert!(!m.contains('\n'), "{m}");
    }
}
