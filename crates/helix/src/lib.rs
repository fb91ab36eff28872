//! `kvpolicy-helix`: decoding one sequence across ranks (Helix, arXiv 2507.07120): each
//! rank keeps a share of the sequence's KV under a local policy and the attention partials
//! are merged exactly ([`HelixPolicy`], `helix`), over a [`Collective`]: MPI between
//! processes (feature `mpi`, launched by `mpirun`), GPU tensors over NCCL (feature
//! `nccl`; across processes with `mpi`), threads within one process ([`ThreadGroup`]).
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod collective;
#[cfg(feature = "mpi")]
pub mod mpi_world;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
pub mod nccl_world;
pub mod policy;
pub mod settings;
pub mod shares;
pub mod threads;
pub mod world;
pub mod world_error;

pub use collective::{Collective, CollectiveError, CollectiveResult, Solo};
pub use policy::{decode_bytes_per_layer, CollectiveCounters, HelixPolicy};
pub use settings::HelixSettings;
pub use shares::Shares;
pub use threads::ThreadGroup;
pub use world::{finish, world, WorldError};

use kvpolicy_core::{PolicyOption, PolicyRegistry};

/// The shared options `helix` passes on to its local policy.
const READS: &[PolicyOption] = &[
    PolicyOption::DeviceKvBudget,
    PolicyOption::HostKvBudget,
    PolicyOption::DiskDir,
    PolicyOption::HostKvDtype,
    PolicyOption::KvDtype,
];

/// Registers `helix`, whose local policies are those `reg` holds now (register it last).
pub fn register(reg: &mut PolicyRegistry) {
    let locals = reg.clone();
    reg.register(
        "helix",
        "KV-parallel decoding across the ranks of `mpirun` (exact): each rank holds a share of the sequence under `local`",
        READS,
        move |opts, s: HelixSettings| {
            if s.local.split(':').next() == Some("helix") {
                return Err(kvpolicy_core::KvError::Unsupported(
                    "`helix` cannot be its own local policy".into(),
                ));
            }
            let local = locals.build(&s.local, opts)?;
            let comm = world().map_err(|e| kvpolicy_core::KvError::Unsupported(e.to_string()))?;
            Ok(Box::new(HelixPolicy::new(local, comm)?))
        },
    );
}
