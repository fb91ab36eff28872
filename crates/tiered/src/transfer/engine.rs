//! The transfer engine's contract: [`CopyJob`]s submitted in batches, a [`Ticket`] to
//! wait on, host-tier buffers allocated and released through the engine.
use candle_core::{DType, Device, Shape, Tensor};
use kvpolicy_core::Result;

/// Copy `src` into `dst` at `offset` along `dim` (`dst.slice_set(src, dim, offset)`), moving
/// `src` to `dst`'s device first. `src` may be a strided view (it is gathered on the copying
/// thread); `dst` is a contiguous buffer (or a contiguous narrow of one).
#[derive(Debug, Clone)]
pub struct CopyJob {
    /// Source range.
    pub src: Tensor,
    /// Destination buffer.
    pub dst: Tensor,
    /// Dimension along which `offset` counts.
    pub dim: usize,
    /// Offset in `dst` along `dim`.
    pub offset: usize,
}

impl CopyJob {
    /// Bytes this job moves.
    pub fn bytes(&self) -> u64 {
        (self.src.elem_count() * self.src.dtype().size_in_bytes()) as u64
    }

    /// Performs the copy.
    pub fn run(&self) -> Result<()> {
        // candle's `to_device` copies a view's whole storage; compact the view first so only
        // its own bytes cross devices.
        // A strided view (e.g. a token range across all heads) is gathered first.
        let src = if self.src.is_contiguous() {
            self.src.clone()
        } else {
            self.src.force_contiguous()?
        };
        let src = if src.device().same_device(self.dst.device()) {
            src
        } else {
            src.to_device(self.dst.device())?
        };
        self.dst.slice_set(&src, self.dim, self.offset)?;
        Ok(())
    }
}

/// Runs `jobs` in order, stopping at the first failure.
pub fn run_jobs(jobs: &[CopyJob]) -> Result<()> {
    jobs.iter().try_for_each(CopyJob::run)
}

/// Pages of a host-tier buffer to gather into a device buffer by the device itself
/// (zero-copy, CLO §4): each `page_bytes` long, from byte `src_offsets[i]` of `src` (a whole
/// buffer from [`TransferEngine::host_zeros`]) to byte `dst_offsets[i]` of `dst` (a whole
/// contiguous device tensor).
#[derive(Debug)]
pub struct MappedGather<'a> {
    /// The host-tier buffer.
    pub src: &'a Tensor,
    /// The device buffer.
    pub dst: &'a Tensor,
    /// Per page, its byte offset in `src`.
    pub src_offsets: Vec<u64>,
    /// Per page, its byte offset in `dst`.
    pub dst_offsets: Vec<u64>,
    /// Bytes of one page.
    pub page_bytes: usize,
}

impl MappedGather<'_> {
    /// Bytes the gather moves.
    pub fn bytes(&self) -> u64 {
        self.src_offsets.len() as u64 * self.page_bytes as u64
    }
}

/// A handle on a submitted batch of copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// Moves ranges between tiers, possibly asynchronously.
pub trait TransferEngine: Send {
    /// Queues `jobs`; they run in order after every earlier submission.
    fn submit(&mut self, jobs: Vec<CopyJob>) -> Result<Ticket>;
    /// Blocks until `ticket` (and everything before it) is done; returns the seconds waited.
    fn wait(&mut self, ticket: Ticket) -> Result<f64>;
    /// Blocks until everything submitted is done.
    fn wait_all(&mut self) -> Result<f64>;

    /// A zeroed host-tier buffer (CPU memory; page-locked where the engine can do so, kept
    /// so until [`Self::host_release`]).
    fn host_zeros(&mut self, shape: Shape, dtype: DType) -> Result<Tensor> {
        Ok(Tensor::zeros(shape, dtype, &Device::Cpu)?)
    }

    /// Hands back a buffer from [`Self::host_zeros`] that its owner is about to drop (after
    /// every copy touching it is done).
    fn host_release(&mut self, buffer: &Tensor) -> Result<()> {
        let _ = buffer;
        Ok(())
    }

    /// Bytes of host-tier buffers page-locked now (0 for engines that do not pin).
    fn pinned_bytes(&self) -> u64 {
        0
    }

    /// Seconds this engine has spent copying since it was created, over the batches known to
    /// be complete: its worker (CPU) or copy stream (CUDA) busy, whether or not compute ran
    /// beside it. Compared with a step's time it shows the overlap.
    fn copy_seconds(&self) -> f64 {
        0.0
    }

    /// Gathers `g`'s pages with a kernel on the device reading the host buffer in place
    /// (zero-copy, CLO §4), ordered on the compute stream after every copy into host memory
    /// submitted before; `Ok(false)` (the default) when this engine cannot — the buffer is
    /// not mapped into the device, or there is no device — and the caller copies instead.
    fn gather_mapped(&mut self, g: &MappedGather<'_>) -> Result<bool> {
        let _ = g;
        Ok(false)
    }

    /// Seconds the link has been busy since the engine was created: the copies' time, or on
    /// a simulated wire each batch's wire time with its copy inside (the default: the copy
    /// time). Its share of the decode time says how far a run is from the link's bound.
    fn busy_seconds(&self) -> f64 {
        self.copy_seconds()
    }
}

/// A host-tier buffer of `dims` from `engine` whose leading part along `dim` holds a copy of
/// `old`, which is handed back to the engine: how host buffers grow (see [`grown`] for the
/// device tier). Waits for every queued copy first, since they may target `old`.
///
/// [`grown`]: kvpolicy_core::buffer::grown
pub fn grown_host(
    engine: &mut dyn TransferEngine,
    old: Option<&Tensor>,
    dims: impl Into<Shape>,
    dim: usize,
    dtype: DType,
) -> Result<Tensor> {
    let t = engine.host_zeros(dims.into(), dtype)?;
    if let Some(o) = old {
        engine.wait_all()?;
        t.slice_set(o, dim, 0)?;
        engine.host_release(o)?;
    }
    Ok(t)
}
