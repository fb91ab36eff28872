//! `kvpolicy-hybrid`: the activation-hybrid KV cache, after HybridServe (Lee et al., 2025).
//!
//! ## What the paper does
//!
//! HybridServe serves many requests from host memory (FlexGen-style offloading) and
//! stores the cache in fixed-size token blocks, each either a *KV block* (K and V of every
//! layer) or an *ACT block* (the layer inputs X, from which the device regenerates K and V
//! with one GEMM, §4.1). For multi-head models X is half the size of K+V, so ACT blocks
//! halve the bytes moved, at the price of recompute. Profiled linear cost models of
//! transfer and recompute pick the KV:ACT ratio at which the two take equally long
//! (§4.2; the host is filled in two steps: first enough ACT to remove idle time, then the
//! rest at the balanced ratio). Requests are packed into mini-batches that fit the device
//! buffers, balancing each mini-batch's transfer against its recompute (a bin packing,
//! §4.3), and run layer by layer across mini-batches. It reports 2.19× FlexGen's
//! throughput on OPT models.
//!
//! ## What this implementation does
//!
//! * **Blocks** ([`blocks`]): `block_size` tokens (a setting, default 16) of every layer; per
//!   request a [`BlockTable`](blocks::BlockTable) of (kind, tier, slot); pools per tier and
//!   kind, allocated in slots for every layer and grown by doubling; freeing a request
//!   returns its slots. ACT blocks live on the device while its pool has room, then on the
//!   host; KV blocks on the host.
//! * **Ratio** ([`ratio`]): lines `t₀ + t₁·tokens` fitted (least squares) to the
//!   profiler's measurements at 16, 64 and 256 tokens (or through the origin from
//!   the `profile` option); the share of KV blocks that balances transfer against recompute, rounded
//!   to whole blocks (checked against a brute-force search). All-KV whenever one token's X
//!   is at least its K+V — every GQA model with two or more query heads per KV head.
//!   The `kv_act_ratio` setting forces the share of KV blocks (1 = all KV, 0 = all ACT). A request
//!   keeps its share as it grows: KV blocks are spread evenly through its table.
//!   Deviation: one ratio per request, computed for ACT blocks on the device; ACT blocks
//!   that overflow to the host keep it (they move X, still smaller than K+V).
//! * **Batches** ([`pack`], [`policy`]): the models run a ragged batch packed
//!   ([`Batched`](kvpolicy_core::Batched)): projections and MLPs over all
//!   requests' tokens at once, each request attending only over its own cache — no
//!   padding, no attention across requests. [`Batched::plan`](kvpolicy_core::Batched::plan)
//!   packs the requests into mini-batches whose staged bytes fit one staging unit
//!   (greedy on the imbalance); the model runs them layer by layer across mini-batches,
//!   and the policy prefetches the next unit while the current one regenerates and
//!   attends.
//! * **Device budget** (`device_kv_budget`): half of it (at least two units of the
//!   longest request) stages transfers, the rest holds ACT blocks; the number of resident
//!   blocks never passes what fits (stats: `device_blocks`).
//! * Exact: the assembled K/V equal what `full` caches, and the attention is the same call.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod blocks;
pub mod manager;
pub mod pack;
pub mod policy;
pub mod probe;
pub mod ratio;
mod settings;
pub mod stager;

pub use policy::HybridPolicy;
pub use ratio::{Costs, LinearCost};
pub use settings::HybridSettings;

use kvpolicy_core::{PolicyOption, PolicyRegistry};

/// Registers `hybrid`.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "hybrid",
        "activation-hybrid (HybridServe): token blocks stored as KV or as layer inputs at a profiled ratio; batches of requests packed into mini-batches",
        &[
            PolicyOption::DeviceKvBudget,
            PolicyOption::Profile,
            PolicyOption::LinkBandwidth,
        ],
        |o, s: HybridSettings| Ok(Box::new(HybridPolicy::new(o, s)?)),
    );
}
