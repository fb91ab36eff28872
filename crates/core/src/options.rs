//! The options every policy may read ([`PolicyOptions`]): the device, its KV budget, the
//! host and disk tiers, the simulated link and the cost profile. A policy's own knobs are
//! its settings ([`crate::settings`]), not fields here.
use candle_core::Device;

use crate::profile::Profile;

/// Options every policy may read; each ignores what does not concern it. What only one
/// policy reads is in its own settings ([`crate::settings`]).
#[derive(Clone, Debug)]
pub struct PolicyOptions {
    /// The compute device (the device tier).
    pub device: Device,
    /// Byte budget of the device tier for KV buffers; `None` = unlimited.
    pub device_kv_budget: Option<u64>,
    /// Tokens by which preallocated buffers grow.
    pub grow_tokens: usize,
    /// Transfer and recompute rates for the schedulers (`recompute`); `None` = measure at
    /// the first step.
    pub profile: Option<Profile>,
    /// Simulated host↔device link in bytes/s for CPU experiments; `None` = plain copies.
    pub link_bandwidth: Option<f64>,
    /// Host bytes of K/V kept in RAM before layers go to the disk tier (`disk_dir`);
    /// `None` with a `disk_dir`: every layer on disk.
    pub host_kv_budget: Option<u64>,
    /// Directory of the disk tier's files; `None` = no disk tier.
    pub disk_dir: Option<std::path::PathBuf>,
    /// How the disk tier reads its files: past the page cache (the default) or through it.
    pub disk_io: crate::storage::DiskIo,
    /// LOSSY unless `Model`, opt-in: how K/V are stored on the host tier (and disk, and in
    /// the streaming buffers) — f16, bf16 or q8_0 — decoded before attention unless the
    /// device stores the same form (`kv_dtype`); `Model` (the default) = `kv_dtype`'s form
    /// (the model's own dtype unless given), lossless.
    pub host_kv_dtype: crate::storage::KvCodec,
    /// LOSSY unless `Model` (or wider than the model's dtype), opt-in: the form K/V are
    /// stored in on every tier — the device's buffers (read in place by the attention
    /// kernel, f32 accumulation) and the host and disk tiers unless `host_kv_dtype` says
    /// otherwise. A step's K/V are computed exactly and converted when stored; attention
    /// reads what is stored. `Model` (the default) = the model's own dtype.
    pub kv_dtype: crate::storage::KvCodec,
    /// The pools every instance built from these options shares ([`crate::pool::KvPool`]):
    /// budgets over all of them together, as a server's are. `None` (the default): each
    /// instance's budgets are its own.
    pub pool: Option<std::sync::Arc<crate::pool::KvPool>>,
}

impl PolicyOptions {
    /// How device buffers store K/V: `kv_dtype` (f16/bf16 and q8_0 blocks are read in place
    /// by the CPU attention kernel).
    pub fn device_codec(&self) -> crate::storage::KvCodec {
        self.kv_dtype
    }

    /// How the host and disk tiers store K/V: `host_kv_dtype` when set, else `kv_dtype`.
    pub fn host_codec(&self) -> crate::storage::KvCodec {
        match self.host_kv_dtype {
            crate::storage::KvCodec::Model => self.kv_dtype,
            c => c,
        }
    }
}

impl Default for PolicyOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            device_kv_budget: None,
            grow_tokens: 256,
            profile: None,
            link_bandwidth: None,
            host_kv_budget: None,
            disk_dir: None,
            disk_io: crate::storage::DiskIo::Direct,
            host_kv_dtype: crate::storage::KvCodec::Model,
            kv_dtype: crate::storage::KvCodec::Model,
            pool: None,
        }
    }
}
