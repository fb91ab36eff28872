//! The CUDA transfer engine: a copy stream, page-locked host buffers and events (feature
//! `cuda`).
//!
//! HeadInfer §3.2 (ping-pong head buffers) and KVPR §3.3 (transfer ∥ regeneration) both
//! rest on copies that run beside the compute instead of in front of it. Pageable copies
//! on candle's stream serialise everything; this engine instead
//!
//! - allocates the host tier page-locked ([`TransferEngine::host_zeros`] registers the CPU
//!   tensor's memory with `cuMemHostRegister`, so candle keeps using it as an ordinary CPU
//!   tensor and the DMA engine reads it directly);
//! - issues every copy as `cuMemcpy{HtoD,DtoH,DtoD}Async` on one dedicated copy stream, one
//!   call per contiguous byte run of the job ([`super::runs::copy_runs`]), straight into the
//!   destination tensor's memory — the device buffers are ordinary candle tensors;
//! - orders the two streams with events: a batch starts after the compute enqueued before
//!   it (so a ping-pong buffer is not overwritten while attention still reads it, and a
//!   write-back reads finished rows), and [`TransferEngine::wait`] makes the compute stream
//!   wait for that batch's event only — the host does not block unless the batch wrote host
//!   memory, which the host may read next.
//!
//! The host tier is also mapped into the device's address space where the driver allows
//! (`DEVICEMAP`), so that a page-selecting policy can gather pages with a kernel reading
//! host memory directly instead of copies (CLO §4's zero-copy engine; `zero_copy`).
//!
//! Jobs (and so their buffers) are kept until their batch's event has completed, so no
//! buffer is freed or reused under a copy in flight. All calls are made from the thread that
//! runs the model: candle's stream is that thread's per-thread default stream.
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::{sys, CudaEvent, CudaStream, DevicePtr};
use candle_core::cuda::CudaStorageSlice;
use candle_core::{CpuStorage, CudaDevice, DType, Device, Shape, Storage, Tensor, TensorId};

use super::engine::{CopyJob, Ticket, TransferEngine};
use super::runs::{copy_runs, Run};
use kvpolicy_core::{KvError, Result};

/// Host buffers below this size stay pageable: registration works on whole pages, and small
/// allocations may share a page with other data.
pub const PIN_MIN_BYTES: u64 = 1 << 20;

fn cuda_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Transfer(format!("CUDA {what} failed: {e}"))
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_err(what, format!("{r:?}")))
    }
}

/// The address of a CPU tensor's storage.
fn cpu_base(s: &CpuStorage) -> *const u8 {
    match s {
        CpuStorage::U8(v)
        | CpuStorage::F6E2M3(v)
        | CpuStorage::F6E3M2(v)
        | CpuStorage::F4(v)
        | CpuStorage::F8E8M0(v) => v.as_ptr(),
        CpuStorage::U32(v) => v.as_ptr().cast(),
        CpuStorage::I16(v) => v.as_ptr().cast(),
        CpuStorage::I32(v) => v.as_ptr().cast(),
        CpuStorage::I64(v) => v.as_ptr().cast(),
        CpuStorage::BF16(v) => v.as_ptr().cast(),
        CpuStorage::F16(v) => v.as_ptr().cast(),
        CpuStorage::F32(v) => v.as_ptr().cast(),
        CpuStorage::F64(v) => v.as_ptr().cast(),
        CpuStorage::F8E4M3(v) => v.as_ptr().cast(),
    }
}

/// The device address of a CUDA tensor's storage, its use recorded on `stream` (so a later
/// free waits for it).
fn cuda_base(s: &CudaStorageSlice, stream: &CudaStream) -> sys::CUdeviceptr {
    macro_rules! ptr {
        ($($v:ident),*) => {
            match s {
                $(CudaStorageSlice::$v(x) => x.device_ptr(stream).0,)*
            }
        };
    }
    ptr!(U8, U32, I16, I32, I64, BF16, F16, F32, F64, F8E4M3, F6E2M3, F6E3M2, F4, F8E8M0)
}

/// Where one side of a copy lives.
#[derive(Clone, Copy)]
enum Mem {
    Host(*const u8),
    Dev(sys::CUdeviceptr),
}

/// A batch in flight: its completion event and the jobs (buffers) it must outlive.
struct Pending {
    id: u64,
    start: CudaEvent,
    done: CudaEvent,
    to_host: bool,
    _jobs: Vec<CopyJob>,
}

/// A page-locked host buffer.
struct Pinned {
    id: TensorId,
    ptr: *mut c_void,
    bytes: u64,
    /// Its address in the device's address space, when mapped (zero-copy reads).
    mapped: Option<sys::CUdeviceptr>,
    _tensor: Tensor,
}

mod zero_copy;

/// Registers `bytes` at `ptr` page-locked and, where the driver allows, mapped into the
/// device's address space (then also its device address); falls back to page-locked only.
fn register_mapped(ptr: *mut c_void, bytes: u64) -> (sys::CUresult, Option<sys::CUdeviceptr>) {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: `ptr..ptr+bytes` is a live CPU allocation its caller keeps until it
    // unregisters it.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr, bytes as usize, flags) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: as above.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr, bytes as usize, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        return (r, None);
    }
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` was just registered with DEVICEMAP; `dptr` is a valid out-pointer.
    let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr, 0) };
    (r, (got == sys::CUresult::CUDA_SUCCESS).then_some(dptr))
}

/// Copies on a dedicated CUDA stream from page-locked host memory (see the module docs).
pub struct CudaTransferEngine {
    device: CudaDevice,
    copy: Arc<CudaStream>,
    submitted: u64,
    pending: VecDeque<Pending>,
    pinned: Vec<Pinned>,
    /// Copy-stream seconds of retired batches.
    busy_s: f64,
}

// SAFETY: the raw pointers in `pinned` are addresses of CPU tensors this engine keeps alive
// (`_tensor`); they are only passed to the CUDA driver, never dereferenced here.
unsafe impl Send for CudaTransferEngine {}

impl std::fmt::Debug for CudaTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTransferEngine")
            .field("submitted", &self.submitted)
            .field("pending", &self.pending.len())
            .field("pinned_bytes", &self.pinned_bytes())
            .finish()
    }
}

impl CudaTransferEngine {
    /// An engine for `device`, with its own copy stream.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let copy = device
            .cuda_stream()
            .context()
            .new_stream()
            .map_err(|e| cuda_err("creating the copy stream", e))?;
        Ok(Self {
            device: device.clone(),
            copy,
            submitted: 0,
            pending: VecDeque::new(),
            pinned: Vec::new(),
            busy_s: 0.0,
        })
    }

    /// Seconds between a batch's two timing events (it is complete).
    fn seconds(p: &Pending) -> f64 {
        p.start
            .elapsed_ms(&p.done)
            .map_or(0.0, |ms| f64::from(ms) / 1e3)
    }

    /// Drops finished batches (their jobs' buffers may be freed now), adding up their time.
    fn retire(&mut self) -> Result<()> {
        while let Some(p) = self.pending.front() {
            match p.done.try_is_complete() {
                Ok(true) => {
                    self.busy_s += Self::seconds(p);
                    self.pending.pop_front();
                }
                Ok(false) => break,
                Err(e) => return Err(cuda_err("a copy", e)),
            }
        }
        Ok(())
    }

    /// Issues one job on the copy stream; `false` when it cannot be expressed as runs
    /// between host and this device (the caller copies it synchronously instead).
    fn issue(&self, job: &CopyJob) -> Result<bool> {
        if job.src.dtype() != job.dst.dtype() {
            return Err(KvError::Unsupported(format!(
                "a copy from {:?} into {:?} would convert; the tiers must share a dtype",
                job.src.dtype(),
                job.dst.dtype()
            )));
        }
        let region = job.dst.narrow(job.dim, job.offset, job.src.dim(job.dim)?)?;
        if region.dims() != job.src.dims() {
            return Err(KvError::Shape(format!(
                "a copy of {:?} does not fit {:?} at {} along dim {}",
                job.src.dims(),
                job.dst.dims(),
                job.offset,
                job.dim
            )));
        }
        let Some(runs) = copy_runs(
            job.src.layout(),
            region.layout(),
            job.src.dtype().size_in_bytes(),
        ) else {
            return Ok(false);
        };
        let (src_store, _) = job.src.storage_and_layout();
        let (dst_store, _) = region.storage_and_layout();
        let side = |s: &Storage| -> Option<Mem> {
            match s {
                Storage::Cpu(c) => Some(Mem::Host(cpu_base(c))),
                Storage::Cuda(c) if c.device.same_device(&self.device) => {
                    Some(Mem::Dev(cuda_base(&c.slice, &self.copy)))
                }
                _ => None,
            }
        };
        let (Some(src), Some(dst)) = (side(&src_store), side(&dst_store)) else {
            return Ok(false);
        };
        if let (Mem::Host(_), Mem::Host(_)) = (src, dst) {
            return Ok(false);
        }
        let stream = self.copy.cu_stream();
        for Run {
            src: so,
            dst: d_o,
            len,
        } in runs
        {
            // SAFETY: the runs lie inside both storages (they come from the views' layouts),
            // the storages outlive the copy (the job is kept until the batch's event has
            // completed), and the copy stream is ordered after the compute that wrote them.
            let r = unsafe {
                match (src, dst) {
                    (Mem::Host(s), Mem::Dev(d)) => {
                        sys::cuMemcpyHtoDAsync_v2(d + d_o as u64, s.add(so).cast(), len, stream)
                    }
                    (Mem::Dev(s), Mem::Host(d)) => sys::cuMemcpyDtoHAsync_v2(
                        d.add(d_o).cast_mut().cast(),
                        s + so as u64,
                        len,
                        stream,
                    ),
                    (Mem::Dev(s), Mem::Dev(d)) => {
                        sys::cuMemcpyDtoDAsync_v2(d + d_o as u64, s + so as u64, len, stream)
                    }
                    (Mem::Host(_), Mem::Host(_)) => sys::CUresult::CUDA_SUCCESS,
                }
            };
            check("an asynchronous copy", r)?;
        }
        Ok(true)
    }

    /// Issues every job of a batch in order; a job that is not expressible as runs is
    /// copied the ordinary way after everything queued before it.
    fn issue_all(&self, jobs: &[CopyJob], compute: &CudaStream) -> Result<()> {
        for job in jobs {
            if !self.issue(job)? {
                self.copy
                    .synchronize()
                    .map_err(|e| cuda_err("waiting for the copy stream", e))?;
                job.run()?;
                self.copy
                    .join(compute)
                    .map_err(|e| cuda_err("ordering a copy after compute", e))?;
            }
        }
        Ok(())
    }

    fn wait_event(&mut self, ticket: Ticket) -> Result<f64> {
        let start = Instant::now();
        let Some(idx) = self.pending.iter().rposition(|p| p.id <= ticket.0) else {
            return Ok(0.0); // already retired
        };
        let to_host = self.pending.iter().take(idx + 1).any(|p| p.to_host);
        let p = &self.pending[idx];
        if to_host {
            p.done
                .synchronize()
                .map_err(|e| cuda_err("waiting for a copy", e))?;
        } else {
            self.device
                .cuda_stream()
                .wait(&p.done)
                .map_err(|e| cuda_err("ordering compute after a copy", e))?;
        }
        self.retire()?;
        Ok(start.elapsed().as_secs_f64())
    }
}

impl TransferEngine for CudaTransferEngine {
    fn submit(&mut self, jobs: Vec<CopyJob>) -> Result<Ticket> {
        self.retire()?;
        self.copy
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let compute = self.device.cuda_stream();
        self.copy
            .join(&compute)
            .map_err(|e| cuda_err("ordering a copy after compute", e))?;
        // Timing events (the default flags keep timing on).
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .copy
            .record_event(timed)
            .map_err(|e| cuda_err("recording a copy event", e))?;
        let to_host = jobs.iter().any(|j| j.dst.device().is_cpu());
        if let Err(e) = self.issue_all(&jobs, &compute) {
            // Copies of this batch may be in flight: let them end before its buffers go.
            let _ = self.copy.synchronize();
            return Err(e);
        }
        let done = self
            .copy
            .record_event(timed)
            .map_err(|e| cuda_err("recording a copy event", e))?;
        self.submitted += 1;
        self.pending.push_back(Pending {
            id: self.submitted,
            start,
            done,
            to_host,
            _jobs: jobs,
        });
        Ok(Ticket(self.submitted))
    }

    fn wait(&mut self, ticket: Ticket) -> Result<f64> {
        self.wait_event(ticket)
    }

    fn wait_all(&mut self) -> Result<f64> {
        let start = Instant::now();
        self.copy
            .synchronize()
            .map_err(|e| cuda_err("waiting for the copy stream", e))?;
        self.busy_s += self
            .pending
            .drain(..)
            .map(|p| Self::seconds(&p))
            .sum::<f64>();
        Ok(start.elapsed().as_secs_f64())
    }

    fn host_zeros(&mut self, shape: Shape, dtype: DType) -> Result<Tensor> {
        let t = Tensor::zeros(shape, dtype, &Device::Cpu)?;
        let bytes = (t.elem_count() * dtype.size_in_bytes()) as u64;
        if bytes < PIN_MIN_BYTES {
            return Ok(t);
        }
        let ptr = match &*t.storage_and_layout().0 {
            Storage::Cpu(c) => Some(cpu_base(c).cast_mut().cast::<c_void>()),
            _ => None,
        };
        let Some(ptr) = ptr else { return Ok(t) };
        self.copy
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: `ptr..ptr+bytes` is the tensor's allocation, kept alive (and registered)
        // until `host_release` or the engine's drop unregisters it.
        let (r, mapped) = register_mapped(ptr, bytes);
        if r == sys::CUresult::CUDA_SUCCESS {
            self.pinned.push(Pinned {
                id: t.id(),
                ptr,
                bytes,
                mapped,
                _tensor: t.clone(),
            });
        }
        // A refused registration (e.g. a page-locked memory limit) leaves the buffer
        // pageable: copies stay correct, only slower; `pinned_bytes` shows it.
        Ok(t)
    }

    fn host_release(&mut self, buffer: &Tensor) -> Result<()> {
        let Some(i) = self.pinned.iter().position(|p| p.id == buffer.id()) else {
            return Ok(());
        };
        self.wait_all()?;
        self.copy
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let p = self.pinned.swap_remove(i);
        // SAFETY: `p.ptr` was registered by `host_zeros` and no copy is in flight.
        check("unregistering host memory", unsafe {
            sys::cuMemHostUnregister(p.ptr)
        })
    }

    fn pinned_bytes(&self) -> u64 {
        self.pinned.iter().map(|p| p.bytes).sum()
    }

    fn gather_mapped(&mut self, g: &super::engine::MappedGather<'_>) -> Result<bool> {
        self.gather(g)
    }

    fn copy_seconds(&self) -> f64 {
        let done: f64 = self
            .pending
            .iter()
            .filter(|p| p.done.is_complete())
            .map(Self::seconds)
            .sum();
        self.busy_s + done
    }
}

impl Drop for CudaTransferEngine {
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
        self.pending.clear();
        let _ = self.copy.context().bind_to_thread();
        for p in self.pinned.drain(..) {
            // SAFETY: registered by `host_zeros`; the copy stream is idle.
            let _ = unsafe { sys::cuMemHostUnregister(p.ptr) };
        }
    }
}
