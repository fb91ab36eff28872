//! Building a policy from its name at run time: `Box<dyn KvPolicy>` for CLIs and for users
//! who pick a policy in configuration. Each policy crate registers its builders; the facade
//! crate `kvpolicy` returns a registry that holds all of them.
use candle_core::Device;

use crate::batch::PerSequence;
use crate::error::{KvError, Result};
use crate::policy::KvPolicy;
use crate::profile::Profile;

/// How many KV heads a head-wise unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadGroup {
    /// Chosen from the device budget and the context length (HeadInfer §3.3).
    Auto,
    /// A fixed number of KV heads (must divide the model's KV heads).
    Fixed(usize),
}

impl std::str::FromStr for HeadGroup {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Fixed(n)),
            _ => Err(format!(
                "`{s}` is neither `auto` nor a positive number of KV heads"
            )),
        }
    }
}

/// Options every policy may read; each ignores what does not concern it.
#[derive(Clone, Debug)]
pub struct PolicyOptions {
    /// The compute device (the device tier).
    pub device: Device,
    /// Byte budget of the device tier for KV buffers; `None` = unlimited.
    pub device_kv_budget: Option<u64>,
    /// Tokens by which preallocated buffers grow.
    pub grow_tokens: usize,
    /// KV heads per head-wise unit (`headwise`).
    pub head_group: HeadGroup,
    /// Transfer and recompute rates for the schedulers (`recompute`); `None` = measure at
    /// the first step.
    pub profile: Option<Profile>,
    /// Tokens recomputed per layer and step, forced (`recompute`); `None` = the scheduler's.
    pub recompute_split: Option<usize>,
    /// Simulated host↔device link in bytes/s for CPU experiments; `None` = plain copies.
    pub link_bandwidth: Option<f64>,
    /// Tokens per cache block (`hybrid`).
    pub block_size: usize,
    /// Share of blocks stored as K/V rather than activations, forced (`hybrid`): 1 = all
    /// KV, 0 = all activations; `None` = balanced from the profile.
    pub kv_act_ratio: Option<f64>,
    /// Host bytes of K/V kept in RAM before layers go to the disk tier (`disk_dir`);
    /// `None` with a `disk_dir`: every layer on disk.
    pub host_kv_budget: Option<u64>,
    /// Directory of the disk tier's files; `None` = no disk tier.
    pub disk_dir: Option<std::path::PathBuf>,
    /// How the disk tier reads its files: past the page cache (the default) or through it.
    pub disk_io: crate::tiered::DiskIo,
    /// LOSSY unless `Model`, opt-in: how K/V are stored on the host tier (and disk, and in
    /// the streaming buffers), decoded to the model's dtype before attention — f16, bf16
    /// or q8_0; `Model` (the default) = the model's own dtype, lossless.
    pub host_kv_dtype: crate::tiered::KvCodec,
}

impl Default for PolicyOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            device_kv_budget: None,
            grow_tokens: 256,
            head_group: HeadGroup::Auto,
            profile: None,
            recompute_split: None,
            link_bandwidth: None,
            block_size: 16,
            kv_act_ratio: None,
            host_kv_budget: None,
            disk_dir: None,
            disk_io: crate::tiered::DiskIo::Direct,
            host_kv_dtype: crate::tiered::KvCodec::Model,
        }
    }
}

impl PolicyOptions {
    /// The disk tier the options ask for: `disk_dir` (an existing directory where a file
    /// can be created: probed now, so a read-only one fails before any work) with
    /// `host_kv_budget` bytes of RAM first (0 without one); `None` without `disk_dir`. A
    /// host budget without a directory is an error naming `policy`.
    pub fn disk_tier(&self, policy: &str) -> Result<Option<crate::tiered::DiskTier>> {
        let bad = |option, message: String| KvError::InvalidOption {
            policy: policy.to_string(),
            option,
            message,
        };
        match (&self.disk_dir, self.host_kv_budget) {
            (None, None) => Ok(None),
            (None, Some(b)) => Err(bad(
                PolicyOption::HostKvBudget,
                format!("`host_kv_budget` {b} needs a `disk_dir` for the layers past it"),
            )),
            (Some(dir), _) if !dir.is_dir() => Err(bad(
                PolicyOption::DiskDir,
                format!("`disk_dir` {} is not an existing directory", dir.display()),
            )),
            (Some(dir), budget) => {
                crate::tiered::probe_disk_dir(dir).map_err(|e| {
                    bad(
                        PolicyOption::DiskDir,
                        format!(
                            "`disk_dir` {} cannot hold the disk tier's files ({e}); give a writable directory",
                            dir.display()
                        ),
                    )
                })?;
                Ok(Some(crate::tiered::DiskTier {
                    dir: dir.clone(),
                    host_budget: budget.unwrap_or(0),
                    io: self.disk_io,
                }))
            }
        }
    }
}

/// A [`PolicyOptions`] field that only some policies read, named by the flag the examples
/// give it; [`PolicyRegistry::reads`] says which a policy reads, so that a CLI can say when
/// a flag does not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyOption {
    /// `device_kv_budget`.
    DeviceKvBudget,
    /// `head_group`.
    HeadGroup,
    /// `profile`.
    Profile,
    /// `recompute_split`.
    RecomputeSplit,
    /// `link_bandwidth`.
    LinkBandwidth,
    /// `block_size`.
    BlockSize,
    /// `kv_act_ratio`.
    KvActRatio,
    /// `host_kv_budget`.
    HostKvBudget,
    /// `disk_dir`.
    DiskDir,
    /// `host_kv_dtype`.
    HostKvDtype,
}

impl PolicyOption {
    /// Every option.
    pub const ALL: [Self; 10] = [
        Self::DeviceKvBudget,
        Self::HeadGroup,
        Self::Profile,
        Self::RecomputeSplit,
        Self::LinkBandwidth,
        Self::BlockSize,
        Self::KvActRatio,
        Self::HostKvBudget,
        Self::DiskDir,
        Self::HostKvDtype,
    ];

    /// Its field in [`PolicyOptions`], e.g. `head_group` (how library messages name it).
    pub fn field(self) -> &'static str {
        match self {
            Self::DeviceKvBudget => "device_kv_budget",
            Self::HeadGroup => "head_group",
            Self::Profile => "profile",
            Self::RecomputeSplit => "recompute_split",
            Self::LinkBandwidth => "link_bandwidth",
            Self::BlockSize => "block_size",
            Self::KvActRatio => "kv_act_ratio",
            Self::HostKvBudget => "host_kv_budget",
            Self::DiskDir => "disk_dir",
            Self::HostKvDtype => "host_kv_dtype",
        }
    }

    /// The examples' flag for it, e.g. `--head-group`.
    pub fn flag(self) -> &'static str {
        match self {
            Self::DeviceKvBudget => "--device-kv-budget",
            Self::HeadGroup => "--head-group",
            Self::Profile => "--profile",
            Self::RecomputeSplit => "--recompute-split",
            Self::LinkBandwidth => "--link-bandwidth",
            Self::BlockSize => "--block-size",
            Self::KvActRatio => "--kv-act-ratio",
            Self::HostKvBudget => "--host-kv-budget",
            Self::DiskDir => "--disk-dir",
            Self::HostKvDtype => "--host-kv-dtype",
        }
    }
}

/// Builds a policy from options.
pub type PolicyBuilder = fn(&PolicyOptions) -> Result<Box<dyn KvPolicy>>;

#[derive(Clone)]
struct Entry {
    name: &'static str,
    description: &'static str,
    reads: &'static [PolicyOption],
    builder: PolicyBuilder,
}

/// Named policy builders.
#[derive(Clone, Default)]
pub struct PolicyRegistry {
    entries: Vec<Entry>,
}

impl PolicyRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a policy under `name`, with a one-line description and the
    /// options its builder reads.
    pub fn register(
        &mut self,
        name: &'static str,
        description: &'static str,
        reads: &'static [PolicyOption],
        builder: PolicyBuilder,
    ) {
        self.entries.retain(|e| e.name != name);
        self.entries.push(Entry {
            name,
            description,
            reads,
            builder,
        });
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| KvError::UnknownPolicy {
                name: name.to_string(),
                valid: self.names().join(", "),
            })
    }

    /// Registered names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|e| e.name).collect()
    }

    /// Names with their descriptions.
    pub fn describe(&self) -> Vec<(&'static str, &'static str)> {
        self.entries
            .iter()
            .map(|e| (e.name, e.description))
            .collect()
    }

    /// The options policy `name` reads (the rest of [`PolicyOptions`] it ignores).
    pub fn reads(&self, name: &str) -> Result<&'static [PolicyOption]> {
        Ok(self.entry(name)?.reads)
    }

    /// The policies that read `option`, in registration order.
    pub fn readers(&self, option: PolicyOption) -> Vec<&'static str> {
        self.entries
            .iter()
            .filter(|e| e.reads.contains(&option))
            .map(|e| e.name)
            .collect()
    }

    /// Builds the policy called `name`, or fails listing the valid names.
    pub fn build(&self, name: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        (self.entry(name)?.builder)(opts)
    }

    /// Builds `name` for ragged batches of requests: the policy itself when it keeps one
    /// cache per sequence ([`KvPolicy::batched`]), otherwise one instance per request
    /// through [`PerSequence`].
    pub fn build_batched(&self, name: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        let first = self.build(name, opts)?;
        if first.batched() {
            return Ok(first);
        }
        let builder = self.entry(name)?.builder;
        let opts = opts.clone();
        Ok(Box::new(PerSequence::new(
            first.name(),
            Box::new(move || builder(&opts)),
        )))
    }
}
