//! The tiered-cache toolkit every offloading policy is built from.
//!
//! * [`Link`]: the wire between the host and the device tier — a [`TransferEngine`](crate::TransferEngine) with
//!   its copy accounting (bytes each way, time spent waiting, copy time since the last
//!   reset).
//! * [`HostLayers`]: each layer's K/V on the host tier in `(b, kv_heads, cap, head_dim)`
//!   buffers that grow in large chunks through the engine (so the CUDA one page-locks
//!   them) — or, past a host budget, in a file of the disk tier ([`DiskKv`]) — with the
//!   tokens each layer holds, the attention spec it last ran with and the run's
//!   [`KvShape`](crate::KvShape).
//! * [`PingPong`]: two device buffers and at most one keyed prefetch — while a unit is
//!   attended in one buffer the next fills the other (HeadInfer §3.2's ping-pong, KVPR
//!   §3.3's transfer ∥ regeneration, FlexGen's layer-wise overlap).
//!
//! `layer`, `headwise` and `auto` (crate `kvpolicy-offload`), `recompute` and `hybrid` keep
//! only what is theirs next to these.
//!
//! Files: `link` the engine and its accounting, `host` the host tier (RAM, then disk past
//! a host budget), `disk` the disk tier's file layout, `disk_fs` its files as file-system
//! objects (unnamed, 0600) and the directory checks, `disk_read` their reads, `codec` the
//! stored forms (lossy opt-ins), `pingpong` the device buffers.
mod codec;
mod disk;
mod disk_format;
mod disk_fs;
mod disk_read;
mod host;
mod link;
mod pingpong;

pub use codec::KvCodec;
pub use disk::{raw_bytes, DiskKv};
pub use disk_fs::{free_disk_bytes, probe_disk_dir, sync_disk_files};
pub use disk_read::DiskIo;
pub use host::{tensor_bytes, DiskTier, HostKv, HostLayers, HostStore, READ_AHEAD};
pub use link::{report_device, Direction, Link};
pub use pingpong::{Loaded, PingPong};
