//! CLO §4's zero-copy transfer on the CUDA engine: the page-locked host tier is also mapped
//! into the device's address space, and [`CudaTransferEngine::gather`] has a kernel
//! (`kvpolicy_kernels::gather`) read the selected pages straight out of it on the compute
//! stream, instead of the copy engine copying them. GPU-side synchronization: the compute
//! stream waits (on the device) for the copies into host memory submitted before, so the
//! host never blocks.
use candle_core::backend::BackendDevice;
use candle_core::Storage;
use kvpolicy_core::{KvError, Result};
use kvpolicy_kernels::gather::{gather_pages, PageGather};

use super::{cuda_base, cuda_err, CudaTransferEngine};
use crate::transfer::engine::MappedGather;

impl CudaTransferEngine {
    /// The zero-copy gather (module docs); `Ok(false)` when `g.src` is not a mapped
    /// host-tier buffer of this engine or `g.dst` is not on its device.
    pub(super) fn gather(&mut self, g: &MappedGather<'_>) -> Result<bool> {
        let Some(src) = self
            .pinned
            .iter()
            .find(|p| p.id == g.src.id())
            .and_then(|p| p.mapped.map(|m| (m, p.bytes)))
        else {
            return Ok(false);
        };
        let compute = self.device.cuda_stream();
        let (store, layout) = g.dst.storage_and_layout();
        let dst = match &*store {
            Storage::Cuda(c) if c.device.same_device(&self.device) && layout.is_contiguous() => {
                cuda_base(&c.slice, &compute)
                    + (layout.start_offset() * g.dst.dtype().size_in_bytes()) as u64
            }
            _ => return Ok(false),
        };
        let dst_bytes = (g.dst.elem_count() * g.dst.dtype().size_in_bytes()) as u64;
        let fits =
            |offs: &[u64], limit: u64| offs.iter().all(|&o| o + g.page_bytes as u64 <= limit);
        if !fits(&g.src_offsets, src.1) || !fits(&g.dst_offsets, dst_bytes) {
            return Err(KvError::invariant(
                "a zero-copy page lies outside its buffer",
            ));
        }
        // The host buffer's latest rows were written by the copy stream: the compute
        // stream waits for those copies on the device.
        for p in self.pending.iter().filter(|p| p.to_host) {
            compute
                .wait(&p.done)
                .map_err(|e| cuda_err("ordering a gather after a write-back", e))?;
        }
        let gather = PageGather {
            src: src.0,
            dst,
            src_offsets: &g.src_offsets,
            dst_offsets: &g.dst_offsets,
            page_bytes: g.page_bytes,
        };
        gather_pages(&self.device, &gather).map_err(|e| cuda_err("a zero-copy gather", e))?;
        Ok(true)
    }
}
