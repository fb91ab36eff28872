//! The device side of KV-parallel decoding on GPUs (Helix, arXiv 2507.07120 §3; feature
//! `nccl`): an NCCL communicator over candle's CUDA stream, and the two tensor collectives
//! `helix` needs — the all-gather of every rank's (output, log-sum-exp) and a sum — run on
//! device memory, with no copy through the host. The communicator is built from an
//! [`NcclId`] that one rank creates and every rank receives by some other channel (MPI's
//! broadcast in [`crate::nccl_world`]); with one rank it needs no channel at all.
//!
//! The collectives are queued on the stream like any candle op; the host does not wait for
//! them, so `helix`'s `collective_s` counts the host's time to queue them, not the GPU's.
//!
//! NCCL itself is loaded at run time (`libnccl.so.2`: PyPI's `nvidia-nccl-cu13`, which
//! PyTorch's CUDA wheels install); it needs one GPU per rank.
use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaDevice, CudaStorage, CustomOp1, Device, Layout, Shape, Tensor};

use crate::collective::{CollectiveError, CollectiveResult};

/// The communicator's identity (NCCL's unique id), as words a host collective can send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclId {
    bytes: [u8; 128],
}

impl NcclId {
    /// Words in [`Self::to_words`].
    pub const WORDS: usize = 32;

    /// A new identity (on the rank that founds the group).
    pub fn new() -> CollectiveResult<Self> {
        let id = Id::new().map_err(|e| nccl_err("creating the group's id", e))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal()) {
            *b = *c as u8;
        }
        Ok(Self { bytes })
    }

    /// The identity as [`Self::WORDS`] words.
    pub fn to_words(&self) -> [u32; Self::WORDS] {
        let mut words = [0u32; Self::WORDS];
        for (w, b) in words.iter_mut().zip(self.bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        words
    }

    /// The identity [`Self::to_words`] wrote.
    pub fn from_words(words: &[u32; Self::WORDS]) -> Self {
        let mut bytes = [0u8; 128];
        for (b, w) in bytes.chunks_exact_mut(4).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        Self { bytes }
    }

    fn id(&self) -> Id {
        Id::uninit(self.bytes.map(|b| b as std::ffi::c_char))
    }
}

/// Makes `device`'s context current on this thread.
fn bind(device: &CudaDevice) -> CollectiveResult<()> {
    device
        .cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| CollectiveError::Backend(format!("CUDA could not bind the GPU: {e:?}")))
}

fn nccl_err(what: &str, e: candle_core::cuda::cudarc::nccl::result::NcclError) -> CollectiveError {
    CollectiveError::Backend(format!("NCCL failed {what}: {:?}", e.0))
}

/// An NCCL communicator on one GPU: this rank's place in a group of GPUs.
pub struct NcclGroup {
    comm: Mutex<Comm>,
    device: CudaDevice,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread but not from two at once; every
// use goes through the `comm` lock. The CUDA stream it enqueues on is candle's device stream.
unsafe impl Send for NcclGroup {}
// SAFETY: as above.
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    /// Joins the group `id` names as `rank` of `size`, on `device` (every rank calls this
    /// together: it returns once all have — a rank that fails to join leaves the others
    /// waiting, so a caller ends the job then, as the runner does with MPI's abort). Each
    /// rank needs its own GPU.
    pub fn join(
        device: &CudaDevice,
        rank: usize,
        size: usize,
        id: &NcclId,
    ) -> CollectiveResult<Self> {
        // NCCL binds the communicator to the calling thread's current device.
        bind(device)?;
        let comm = Comm::from_rank(device.cuda_stream(), rank, size, id.id()).map_err(|e| {
            nccl_err(
                &format!("joining the group as rank {rank} of {size} on GPU {:?} (each rank needs a GPU of its own)", device.location()),
                e,
            )
        })?;
        Ok(Self {
            comm: Mutex::new(comm),
            device: device.clone(),
            rank,
            size,
        })
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether `t` lives on this group's GPU.
    pub fn holds(&self, t: &Tensor) -> bool {
        matches!(t.device(), Device::Cuda(d) if d.same_device(&self.device))
    }

    /// Every rank's `local` stacked in rank order along a new first dimension, f32, on the
    /// GPU.
    pub fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        self.run(local, Exchange::Gather)
    }

    /// The element-wise sum of every rank's `local`, f32, on the GPU.
    pub fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        self.run(local, Exchange::Sum)
    }

    fn run(&self, local: &Tensor, kind: Exchange) -> CollectiveResult<Tensor> {
        if !self.holds(local) {
            return Err(CollectiveError::Backend(format!(
                "the NCCL group lives on {:?}; a tensor on {:?} was handed to it",
                self.device.location(),
                local.device().location()
            )));
        }
        let local = local.to_dtype(candle_core::DType::F32)?.contiguous()?;
        bind(&self.device)?;
        let comm = self
            .comm
            .lock()
            .map_err(|_| CollectiveError::Backend("a thread panicked inside NCCL".into()))?;
        let op = DeviceExchange {
            comm: &comm,
            kind,
            ranks: self.size,
        };
        Ok(local.apply_op1_no_bwd(&op)?)
    }
}

#[derive(Debug, Clone, Copy)]
enum Exchange {
    Gather,
    Sum,
}

/// One collective as a candle op, so that it reads and writes candle's device memory on
/// candle's stream.
struct DeviceExchange<'a> {
    comm: &'a Comm,
    kind: Exchange,
    ranks: usize,
}

impl CustomOp1 for DeviceExchange<'_> {
    fn name(&self) -> &'static str {
        "nccl-exchange"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "NCCL exchanges GPU memory; a CPU tensor goes through the host collective".into(),
        ))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL exchanges contiguous tensors".into()))?;
        let src = s.as_cuda_slice::<f32>()?.slice(start..end);
        let dev = s.device().clone();
        let n = end - start;
        let failed = |e: candle_core::cuda::cudarc::nccl::result::NcclError| {
            candle_core::Error::Cuda(format!("NCCL {:?} failed: {:?}", self.kind, e.0).into())
        };
        match self.kind {
            Exchange::Gather => {
                // SAFETY: the all-gather writes every element before anything reads it.
                let mut dst = unsafe { dev.alloc::<f32>(n * self.ranks) }?;
                self.comm.all_gather(&src, &mut dst).map_err(failed)?;
                let mut dims = vec![self.ranks];
                dims.extend_from_slice(l.dims());
                Ok((CudaStorage::wrap_cuda_slice(dst, dev), Shape::from(dims)))
            }
            Exchange::Sum => {
                // SAFETY: the sum writes every element before anything reads it.
                let mut dst = unsafe { dev.alloc::<f32>(n) }?;
                self.comm
                    .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                    .map_err(failed)?;
                Ok((CudaStorage::wrap_cuda_slice(dst, dev), l.shape().clone()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_words() {
        let mut bytes = [0u8; 128];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37 + 11) as u8;
        }
        let id = NcclId { bytes };
        assert_eq!(NcclId::from_words(&id.to_words()), id);
    }
}
