//! Host→device bandwidth, the denominator of the PCIe bound (HeadInfer §5, KVPR §4).
//!
//! Two paths are timed on the same bytes: a pageable CPU tensor through candle's
//! `to_device` (what a policy without an engine would do) and a host-tier buffer from the
//! policies' own transfer engine through that engine (page-locked and asynchronous on a
//! copy stream under CUDA; a worker thread on the CPU).
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::tiered::{engine_for, CopyJob};

use crate::sweep::median;

/// Measured host→device bandwidths in bytes/s.
#[derive(Debug, Clone, Copy)]
pub struct Bandwidth {
    /// Pageable memory through candle's `to_device` (`None` on the CPU, where it copies
    /// nothing).
    pub pageable: Option<f64>,
    /// A host-tier buffer through the transfer engine.
    pub engine: f64,
    /// Whether the engine page-locked that buffer.
    pub pinned: bool,
}

/// Times `copy` five times over `bytes` and returns the median bytes/s.
fn timed(bytes: usize, dev: &Device, mut copy: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        copy()?;
        dev.synchronize()?;
        v.push(bytes as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

/// Measures both paths for a `mib` MiB copy (through the simulated link of
/// `link_bytes_per_s` on the CPU, when given, as the policies copy).
pub fn measure(dev: &Device, mib: usize, link_bytes_per_s: Option<f64>) -> Result<Bandwidth> {
    anyhow::ensure!(mib > 0, "--bandwidth-mib must be at least 1");
    let n = mib * 1024 * 1024 / 4;
    let pageable_src = Tensor::zeros(n, DType::F32, &Device::Cpu)?;
    let pageable = if dev.is_cpu() {
        None
    } else {
        Some(timed(n * 4, dev, || {
            drop(pageable_src.to_device(dev)?);
            Ok(())
        })?)
    };
    let mut engine = engine_for(dev, link_bytes_per_s)?;
    let src = engine.host_zeros(n.into(), DType::F32)?;
    let pinned = engine.pinned_bytes() > 0;
    let dst = Tensor::zeros(n, DType::F32, dev)?;
    let through_engine = timed(n * 4, dev, || {
        let job = CopyJob {
            src: src.clone(),
            dst: dst.clone(),
            dim: 0,
            offset: 0,
        };
        engine.submit(vec![job])?;
        engine.wait_all()?;
        Ok(())
    })?;
    engine.host_release(&src)?;
    Ok(Bandwidth {
        pageable,
        engine: through_engine,
        pinned,
    })
}
