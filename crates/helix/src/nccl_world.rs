//! [`Collective`] for ranks on GPUs (feature `nccl`): a host collective carries what lives
//! on the host (the NCCL id, token ids, counters, the barrier) — MPI's world when `mpirun`
//! launched the ranks (with feature `mpi`), [`Solo`](crate::Solo) for one rank — and NCCL
//! the tensors on the GPU ([`crate::nccl::NcclGroup`]). The NCCL group is
//! founded on the first tensor collective over GPU memory — every rank makes the same
//! collectives in the same order, so every rank founds it at the same call, on the GPU the
//! tensor lives on. CPU tensors (`--cpu` runs) go through the host collective.
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use crate::collective::{Collective, CollectiveError, CollectiveResult};
use crate::nccl::{NcclGroup, NcclId};

/// A host collective for the host, NCCL for GPU tensors (module docs).
pub struct NcclWorld<H> {
    host: H,
    group: Mutex<Option<Arc<NcclGroup>>>,
}

impl<H: Collective> NcclWorld<H> {
    /// Over `host` (MPI's world, or [`Solo`](crate::Solo)); the NCCL group is founded on
    /// first use.
    pub fn new(host: H) -> Self {
        Self {
            host,
            group: Mutex::new(None),
        }
    }

    /// The group founded, once there is one.
    pub fn group(&self) -> Option<Arc<NcclGroup>> {
        self.group.lock().ok()?.clone()
    }

    /// The NCCL group on `t`'s GPU, founding it on first use: rank 0 makes the id and
    /// broadcasts it over the host collective with a word saying whether it could (so that
    /// a failure there fails every rank instead of leaving them waiting).
    fn group_for(&self, t: &Tensor) -> CollectiveResult<Arc<NcclGroup>> {
        let Device::Cuda(dev) = t.device() else {
            return Err(CollectiveError::Backend(
                "an NCCL group is founded on a GPU tensor".into(),
            ));
        };
        let mut slot = self
            .group
            .lock()
            .map_err(|_| CollectiveError::Backend("a thread panicked inside NCCL".into()))?;
        if let Some(g) = slot.as_ref() {
            return Ok(g.clone());
        }
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
        let group = Arc::new(NcclGroup::join(
            dev,
            self.host.rank(),
            self.host.size(),
            &NcclId::from_words(&id),
        )?);
        *slot = Some(group.clone());
        Ok(group)
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
        if local.device().is_cuda() {
            self.group_for(local)?.all_gather(local)
        } else {
            self.host.all_gather(local)
        }
    }
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        if local.device().is_cuda() {
            self.group_for(local)?.all_reduce_sum(local)
        } else {
            self.host.all_reduce_sum(local)
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
