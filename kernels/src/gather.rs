//! Zero-copy page gather (CLO, arXiv 2511.14510, §4; feature `cuda`): a kernel on the
//! device reads pages straight out of page-locked host memory mapped into the device's
//! address space (`cuMemHostRegister` with `DEVICEMAP`) and writes them into a device
//! buffer, on candle's compute stream — no copy engine, no host thread, and the attention
//! that follows on the same stream needs no event to wait for.
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use crate::ptx;

/// Pages to gather: each `page_bytes` long, from byte `src_offsets[i]` of the mapped host
/// buffer at device address `src` to byte `dst_offsets[i]` of the device buffer at `dst`.
#[derive(Clone, Debug)]
pub struct PageGather<'a> {
    /// Device address of the mapped host buffer.
    pub src: u64,
    /// Device address of the destination buffer.
    pub dst: u64,
    /// Per page, its byte offset in the source.
    pub src_offsets: &'a [u64],
    /// Per page, its byte offset in the destination.
    pub dst_offsets: &'a [u64],
    /// Bytes of one page (a multiple of 4).
    pub page_bytes: usize,
}

/// Launches the gather on `dev`'s stream (module docs). The caller guarantees that both
/// ranges of every page lie inside their buffers and that the buffers outlive the kernel.
pub fn gather_pages(dev: &CudaDevice, g: &PageGather<'_>) -> Result<()> {
    let n = g.src_offsets.len();
    if n != g.dst_offsets.len() {
        candle_core::bail!(
            "gather_pages: {n} source offsets for {} destinations",
            g.dst_offsets.len()
        );
    }
    if n == 0 {
        return Ok(());
    }
    if !g.page_bytes.is_multiple_of(4) {
        candle_core::bail!(
            "gather_pages: a page of {} bytes is not whole 4-byte words",
            g.page_bytes
        );
    }
    let aligned = |x: u64| x.is_multiple_of(16);
    let wide = g.page_bytes.is_multiple_of(16)
        && aligned(g.src)
        && aligned(g.dst)
        && g.src_offsets
            .iter()
            .chain(g.dst_offsets)
            .all(|&o| aligned(o));
    let word: u64 = if wide { 16 } else { 4 };
    let so: Vec<u64> = g.src_offsets.iter().map(|o| o / word).collect();
    let dof: Vec<u64> = g.dst_offsets.iter().map(|o| o / word).collect();
    let so = dev.clone_htod(&so)?;
    let dof = dev.clone_htod(&dof)?;
    let name = if wide {
        "kvpolicy_gather_pages_16"
    } else {
        "kvpolicy_gather_pages_4"
    };
    let func = dev.get_or_load_custom_func(name, "kvpolicy_gather_pages", ptx::GATHER_PAGES)?;
    let pages = u32::try_from(n).map_err(|_| candle_core::Error::Msg("too many pages".into()))?;
    let words = u32::try_from(g.page_bytes as u64 / word)
        .map_err(|_| candle_core::Error::Msg("a page too large".into()))?;
    let total = (u64::from(pages) * u64::from(words)).min(u64::from(u32::MAX)) as u32;
    let cfg = LaunchConfig::for_num_elems(total);
    let mut b = func.builder();
    b.arg(&g.src);
    b.arg(&g.dst);
    b.arg(&so);
    b.arg(&dof);
    b.arg(&pages);
    b.arg(&words);
    // SAFETY: the kernel reads `pages × words` words at the given source offsets and
    // writes them at the destination offsets, all inside their buffers (the caller's
    // guarantee); the arguments match its signature.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
