//! `kvpolicy-core`: the boundary between model definitions and KV-cache policies.
//!
//! A model's attention layer hands every forward step of every layer to a [`KvPolicy`]
//! as an [`AttnStep`]: the step's queries, its new keys and values, the layer's attention
//! input (for policies that store activations instead of K/V, KVPR §3 and HybridServe §4),
//! and a [`KvRegen`] handle that rebuilds K/V from such inputs. The policy decides where
//! the cache lives and returns the attention output.
//!
//! The attention math ([`attention`]) is written once here — causal masks for a chunk at
//! an offset, sliding windows, logit soft-capping, grouped-query attention without
//! repeating K/V, and partial attentions that carry their log-sum-exp so that a policy may
//! attend over pieces of the cache (head groups, token ranges) and merge them exactly.
//!
//! This crate is the contract every policy author reads: the trait and its call protocol
//! ([`KvPolicy`], [`protocol`]), the steps ([`step`]), the optional capabilities
//! ([`capabilities`]), attention, stats and metrics, errors, the shared options and each
//! policy's settings ([`options`], [`settings`]), and the registry. The toolkit offloading
//! policies build on — host and disk tiers, the host-device link, transfer engines — is
//! the crate `kvpolicy-tiered`.
//!
//! Errors are [`KvError`] variants with data; messages name options by their
//! [`PolicyOptions`] field and budget errors carry [`Advice`], which front ends map to
//! their own flags.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod attention;
pub mod batch;
pub mod buffer;
pub mod capabilities;
pub mod error;
pub mod knob;
pub mod lease;
pub mod options;
pub mod policy;
pub mod pool;
pub mod profile;
pub mod protocol;
pub mod ranges;
pub mod regen;
pub mod registry;
pub mod restore;
pub mod settings;
pub mod shared;
pub mod size;
pub mod stats;
pub mod step;
pub mod storage;
pub mod userfile;
pub mod window;

pub use attention::{
    attend, attend_partial, attend_partial_runs, merge_partials, AttnInputs, AttnSpec, KvRun,
    Partial,
};
pub use batch::{PerSequence, PolicyFactory};
pub use buffer::{grown, move_to_front, round_up, KvBuffer};
pub use capabilities::{
    check_store, Batched, KvRestore, LayerKv, Profiled, SeqHeld, SeqLoad, ShardLocal,
};
pub use error::{Advice, KvError, Result};
pub use knob::{Knob, PolicyOption};
pub use lease::{KeptRun, KvLease, SharedRun};
pub use options::PolicyOptions;
pub use policy::KvPolicy;
pub use pool::{KvPool, PoolTier, TierPool};
pub use profile::Profile;
pub use protocol::Checked;
pub use ranges::{HeadRange, TokenRange};
pub use regen::{KvRegen, NoRegen};
pub use registry::{PolicyBuilder, PolicyInfo, PolicyRegistry, BUDGET_KEY};
pub use restore::{adopt_kv, append_kv, attach_kv, export_kv};
pub use settings::{NoSettings, PolicySettings, PolicySpec, SettingDoc};
pub use shared::{not_shareable, ReaderStash, StashedUnit};
pub use size::{format_bytes, parse_bytes};
pub use stats::{DeviceMeter, KvStats, MetricKind, Need, PolicyMetric};
pub use step::{AttnStep, KvShape};
pub use storage::{DiskIo, KvCodec};
pub use window::{front_to_drop, window_capacity, WindowKv};
