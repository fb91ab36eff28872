//! [`Collective`] for ranks on GPUs (feature `nccl`): a host collective carries what lives
//! on the host (the NCCL id, token ids, counters, the barrier) — MPI's world when `mpirun`
//! launched the ranks (with feature `mpi`), [`Solo`](crate::Solo) for one rank — and NCCL
//! the tensors on the GPU ([`crate::nccl::NcclGroup`]). The first tensor collective settles
//! where they run — every rank makes the same collectives in the same order, so every rank
//! settles at the same call: the ranks agree that all of them are on GPUs (the NCCL group
//! is founded then, on the GPU the tensor lives on) or all on the CPU (`--cpu` runs: the
//! host collective); a mix fails on every rank instead of pairing mismatched collectives.
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use crate::collective::{Collective, CollectiveError, CollectiveResult};
use crate::nccl::{NcclGroup, NcclId};

/// A host collective for the host, NCCL for GPU tensors (module docs).
pub struct NcclWorld<H> {
    host: H,
    tensors: Mutex<Tensors>,
}

/// Where the group's tensor collectives run, settled by the first one.
#[derive(Clone)]
enum Tensors {
    /// Not settled yet.
    Unsettled,
    /// Every rank's tensors are on the CPU: the host collective.
    Host,
    /// Every rank's tensors are on a GPU: this NCCL group.
    Gpu(Arc<NcclGroup>),
}

impl<H: Collective> NcclWorld<H> {
    /// Over `host` (MPI's world, or [`Solo`](crate::Solo)); the NCCL group is founded on
    /// first use.
    pub fn new(host: H) -> Self {
        Self {
            host,
            tensors: Mutex::new(Tensors::Unsettled),
        }
    }

    /// The NCCL group founded, once there is one.
    pub fn group(&self) -> Option<Arc<NcclGroup>> {
        match &*self.tensors.lock().ok()? {
            Tensors::Gpu(g) => Some(g.clone()),
            _ => None,
        }
    }

    /// Where tensor collectives run, settled at the first one (module docs): the ranks
    /// agree over the host collective that every rank's tensor is on a GPU, or that none
    /// is; a mix is an error on every rank naming the ranks on the CPU.
    fn settle(&self, t: &Tensor) -> CollectiveResult<Tensors> {
        let mut slot = self
            .tensors
            .lock()
            .map_err(|_| CollectiveError::Backend("a thread panicked inside NCCL".into()))?;
        if !matches!(*slot, Tensors::Unsettled) {
            return Ok(slot.clone());
        }
        let on_gpu = self
            .host
            .all_gather_u64(&[u64::from(t.device().is_cuda())])?;
        let cpu: Vec<usize> = (0..on_gpu.len()).filter(|&r| on_gpu[r] == 0).collect();
        let settled = if cpu.len() == on_gpu.len() {
            Tensors::Host
        } else if !cpu.is_empty() {
            return Err(CollectiveError::Backend(format!(
                "ranks {cpu:?} run on the CPU and the others on GPUs; give every rank a GPU, or pass --cpu to every rank"
            )));
        } else {
            let Device::Cuda(dev) = t.device() else {
                return Err(CollectiveError::Backend("a GPU tensor left its GPU".into()));
            };
            Tensors::Gpu(Arc::new(self.found(dev)?))
        };
        *slot = settled.clone();
        Ok(settled)
    }

    /// Founds the NCCL group on `dev`: rank 0 makes the id and broadcasts it over the host
    /// collective with a word saying whether it could (so that a failure there fails every
    /// rank instead of leaving them waiting).
    fn found(&self, dev: &candle_core::CudaDevice) -> CollectiveResult<NcclGroup> {
        let mut words = [0u32; NcclId::WORDS + 1];
        let mut made = None;
        if self.host.rank() == 0 {
            match NcclId::new() {
                Ok(id) => {
                    words[0] = 1;
                    words[1..].copy_from_slice(&id.to_words());
                }
                Err(e) => made = Some(e),
            }
        }
        self.host.broadcast_u32(&mut words, 0)?;
        if let Some(e) = made {
            return Err(e);
        }
        if words[0] != 1 {
            return Err(CollectiveError::PeerLost {
                rank: 0,
                why: "it could not create the NCCL group's id".into(),
            });
        }
        let mut id = [0u32; NcclId::WORDS];
        id.copy_from_slice(&words[1..]);
        NcclGroup::join(
            dev,
            self.host.rank(),
            self.host.size(),
            &NcclId::from_words(&id),
        )
    }
}

impl<H: Collective> Collective for NcclWorld<H> {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        match self.settle(local)? {
            Tensors::Gpu(g) => g.all_gather(local),
            _ => self.host.all_gather(local),
        }
    }
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        match self.settle(local)? {
            Tensors::Gpu(g) => g.all_reduce_sum(local),
            _ => self.host.all_reduce_sum(local),
        }
    }
    fn all_gather_u64(&self, local: &[u64]) -> CollectiveResult<Vec<u64>> {
        self.host.all_gather_u64(local)
    }
    fn broadcast_u32(&self, values: &mut [u32], root: usize) -> CollectiveResult<()> {
        self.host.broadcast_u32(values, root)
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.host.barrier()
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
}
