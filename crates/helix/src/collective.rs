//! The communication boundary of KV-parallel decoding (Helix, arXiv 2507.07120 §3): the
//! collectives its ranks need, over tensors, and the single-process backends. The MPI
//! backend (`mpi_world`, feature `mpi`) runs them over Open MPI; the in-process
//! [`ThreadGroup`](crate::threads::ThreadGroup) runs ranks as threads (tests, benches).
use candle_core::Tensor;

/// What a collective can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A tensor operation around the exchange failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The ranks handed in tensors of different sizes.
    #[error("rank {rank} sent {got} values where the others sent {want}")]
    Mismatch {
        /// The rank that differs.
        rank: usize,
        /// Its count.
        got: usize,
        /// The others'.
        want: usize,
    },
    /// A rank left the group (it exited or was killed).
    #[error("rank {rank} left the group: {why}")]
    PeerLost {
        /// The rank that left.
        rank: usize,
        /// What was seen.
        why: String,
    },
    /// The communication library failed.
    #[error("{0}")]
    Backend(String),
}

/// Result of a collective.
pub type CollectiveResult<T> = std::result::Result<T, CollectiveError>;

/// The collectives KV-parallel decoding uses, over the ranks of one group. Every rank calls
/// the same collectives in the same order (as MPI requires); a collective returns on a rank
/// once every rank has called it.
pub trait Collective: Send + Sync {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Every rank's `local` (the same shape and dtype on each), stacked in rank order along
    /// a new first dimension: `(size, ..local's shape)`, f32.
    fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor>;
    /// The element-wise sum of every rank's `local` (the same shape on each), f32.
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor>;
    /// Every rank's `local` words (the same count on each), concatenated in rank order:
    /// counters gathered once at the end of a run (KV bytes per rank), exact.
    fn all_gather_u64(&self, local: &[u64]) -> CollectiveResult<Vec<u64>>;
    /// Rank `root`'s `values` on every rank (`values` must have the same length everywhere).
    fn broadcast_u32(&self, values: &mut [u32], root: usize) -> CollectiveResult<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> CollectiveResult<()>;
    /// The backend's name (`solo`, `threads`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;
}

/// One rank alone: every collective is the identity. What a run outside `mpirun` gets.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        Ok(local.to_dtype(candle_core::DType::F32)?.unsqueeze(0)?)
    }
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        Ok(local.to_dtype(candle_core::DType::F32)?)
    }
    fn all_gather_u64(&self, local: &[u64]) -> CollectiveResult<Vec<u64>> {
        Ok(local.to_vec())
    }
    fn broadcast_u32(&self, _: &mut [u32], _: usize) -> CollectiveResult<()> {
        Ok(())
    }
    fn barrier(&self) -> CollectiveResult<()> {
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "solo"
    }
}

/// `local` as host f32 values, row-major (what host-side backends send).
pub(crate) fn host_values(local: &Tensor) -> CollectiveResult<Vec<f32>> {
    Ok(local
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// `values` gathered from `ranks` ranks of `like`'s shape, as a tensor on `like`'s device.
pub(crate) fn stacked(values: Vec<f32>, ranks: usize, like: &Tensor) -> CollectiveResult<Tensor> {
    let mut dims = vec![ranks];
    dims.extend_from_slice(like.dims());
    Ok(Tensor::from_vec(values, dims, like.device())?)
}
