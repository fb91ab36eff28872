//! `kvpolicy-tiered`: the toolkit every offloading policy is built from — the host and
//! disk tiers, the link between host and device, and the transfer engines that move K/V
//! over it. `kvpolicy-core` is the contract (the trait, attention, stats, errors,
//! registry); this crate is what `layer`, `headwise`, `auto`, `recompute` and `hybrid` build
//! on, and what a new offloading policy would.
//!
//! * [`Link`]: the wire between the host and the device tier — a [`TransferEngine`] with
//!   its copy accounting (bytes each way, time spent waiting, copy time since the last
//!   reset).
//! * [`HostLayers`]: each layer's K/V on the host tier in `(b, kv_heads, cap, head_dim)`
//!   buffers that grow in large chunks through the engine (so the CUDA one page-locks
//!   them) — or, past a host budget, in a file of the disk tier ([`DiskKv`]) — with the
//!   tokens each layer holds, the attention spec it last ran with and the run's
//!   [`KvShape`](kvpolicy_core::KvShape).
//! * [`PingPong`]: two device buffers and at most one keyed prefetch — while a unit is
//!   attended in one buffer the next fills the other (HeadInfer §3.2's ping-pong, KVPR
//!   §3.3's transfer ∥ regeneration, FlexGen's layer-wise overlap).
//!
//! `layer`, `headwise` and `auto` (crate `kvpolicy-offload`), `recompute` and `hybrid` keep
//! only what is theirs next to these.
//!
//! * [`transfer`]: the engines — a worker thread on the CPU ([`CpuTransferEngine`]), a copy
//!   stream with a page-locked host tier and events on CUDA (`CudaTransferEngine`, feature
//!   `cuda`), picked by [`engine_for`]. Host-tier buffers are allocated through the engine
//!   ([`TransferEngine::host_zeros`]) so the CUDA one can page-lock them.
//! * [`probe`]: a cost [`Profile`](kvpolicy_core::Profile) measured on the device.
//!
//! Files: `link` the engine and its accounting, `host` the host tier (RAM, then disk past
//! a host budget: `host/mod.rs` [`HostLayers`], which routes to each layer's store through
//! one store trait, `host/store.rs`; `host/ram.rs` the RAM store, `host/disk_layer.rs` the
//! disk tier's file as a store, `host/disk_traffic.rs` the disk reads ahead and the disk
//! counts), `disk_tier` where it spills and how that is checked, `disk` the disk tier's
//! file layout, `disk_format` what its writer and reader share, `disk_fs` its files as
//! file-system objects (unnamed, 0600) and the directory checks, `disk_read` their reads,
//! `pingpong` the device buffers. The stored
//! forms (`KvCodec`, lossy opt-ins) and the disk I/O mode are options every policy reads,
//! in `kvpolicy-core`'s `storage`.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod disk;
mod disk_format;
mod disk_fs;
mod disk_read;
mod disk_tier;
mod host;
mod link;
mod pingpong;
pub mod probe;
pub mod transfer;

pub use disk::{raw_bytes, DiskKv};
pub use disk_fs::{free_disk_bytes, probe_disk_dir, sync_disk_files};
pub use disk_tier::DiskTier;
pub use host::{tensor_bytes, HistoryPiece, HostKv, HostLayers, WriteAt, READ_AHEAD};
pub use link::{report_device, Direction, Link};
pub use pingpong::{other_buffer, Loaded, PingPong};
pub use probe::Probe;
pub use transfer::runs::{copy_runs, Run};
#[cfg(feature = "cuda")]
pub use transfer::CudaTransferEngine;
pub use transfer::{
    engine_for, grown_host, run_jobs, CopyJob, CpuTransferEngine, MappedGather, SyncTransferEngine,
    Ticket, TransferEngine,
};
