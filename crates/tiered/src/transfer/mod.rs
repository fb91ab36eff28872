//! Moving K/V ranges between the host tier and the device tier.
//!
//! A [`TransferEngine`] takes batches of [`CopyJob`]s and returns a [`Ticket`] to wait on.
//! [`CpuTransferEngine`] runs the copies on a worker thread, so a prefetch overlaps compute
//! even on a CPU-only machine (HeadInfer §3.2's ping-pong schedule); jobs run in submission
//! order, so a write-back always lands before a later prefetch of the same range.
//! [`SyncTransferEngine`] copies at submission (the fallback for devices without a copy
//! engine of their own). On CUDA, `CudaTransferEngine` (feature `cuda`) issues the copies on
//! a dedicated copy stream from page-locked host buffers and orders them with events.
//!
//! The host tier's buffers are allocated through the engine ([`TransferEngine::host_zeros`])
//! so that an engine able to page-lock them does, and handed back with
//! [`TransferEngine::host_release`] before they are dropped.
//!
//! Files: `engine` the trait and the jobs, this one [`engine_for`]; `cpu` the worker-thread and
//! synchronous engines; `wire` the simulated link's timing rule; `cuda` the copy-stream
//! engine; `runs` the byte runs a strided copy is made of.

use candle_core::Device;

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod runs;
pub mod wire;

pub use cpu::{CpuTransferEngine, SyncTransferEngine, INLINE_BYTES};
#[cfg(feature = "cuda")]
pub use cuda::CudaTransferEngine;
pub use engine::{grown_host, run_jobs, CopyJob, MappedGather, Ticket, TransferEngine};

use kvpolicy_core::{KvError, Result};

/// The engine suited to a device: a worker thread on the CPU (simulating a link of
/// `link_bytes_per_s` when given), a copy stream with pinned host buffers on CUDA (feature
/// `cuda`), synchronous copies elsewhere.
pub fn engine_for(
    device: &Device,
    link_bytes_per_s: Option<f64>,
) -> Result<Box<dyn TransferEngine>> {
    if !device.is_cpu() && link_bytes_per_s.is_some() {
        return Err(KvError::Unsupported(
            "a simulated host-device link is for CPU runs only; leave it unset on a GPU".into(),
        ));
    }
    match (device, link_bytes_per_s) {
        (Device::Cpu, None) => Ok(Box::new(CpuTransferEngine::new()?)),
        (Device::Cpu, Some(bw)) => Ok(Box::new(CpuTransferEngine::with_link(bw)?)),
        #[cfg(feature = "cuda")]
        (Device::Cuda(d), _) => Ok(Box::new(CudaTransferEngine::new(d)?)),
        _ => Ok(Box::new(SyncTransferEngine::default())),
    }
}
