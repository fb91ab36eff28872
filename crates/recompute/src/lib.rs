//! `kvpolicy-recompute`: partial KV recompute, after KVPR (Jiang et al., ACL Findings 2025).
//!
//! ## What the paper does
//!
//! KVPR keeps the KV cache in CPU memory. For each decode step and layer it transfers the
//! layer's *inputs* X of the first `l` tokens, regenerates their K/V on the GPU
//! (`K = X·Wk`, `V = X·Wv`, §3.1) while the K/V of tokens `[l, s)` are still crossing the
//! PCIe link, and attends over both. A profiler measures the link bandwidth and the GPU's
//! throughput at start-up, and a scheduler picks `l` by linear programming so that
//! recompute and transfer end together (§3.3); the row-by-row schedule optimises latency,
//! the column-by-column one throughput. It reports up to 35.8% lower decode latency than
//! offloading the whole cache, on OPT models (multi-head attention).
//!
//! ## What this implementation does
//!
//! * **Storage.** Per layer the host tier keeps K/V for every token and X for the prefix
//!   the scheduler can ever recompute: tokens below the largest split it would choose at
//!   the run's length (known from [`KvPolicy::prepare`](kvpolicy_core::KvPolicy)), or
//!   below the `split` setting. Each token's K/V is still needed in the steps before the
//!   split (≈ a fixed fraction of the context) overtakes it, and the host tier is not the
//!   scarce one; like the paper, the prefix has both. For grouped-query models no X is
//!   kept at all (see below). With a sliding window X is kept for every token of the
//!   window: the host tier drops K/V and X before the window as it would grow.
//! * **Regeneration** goes through the layer's [`KvRegen`](kvpolicy_core::KvRegen)
//!   handle: the model's own K/V projections (float or quantized, biases included) and RoPE
//!   at the tokens' original positions.
//! * **Profiler** ([`Profile`](kvpolicy_core::Profile)): measured at the first step on the
//!   actual device — a copy of one layer's K/V size (1–64 MiB) through the transfer engine
//!   and a regeneration of 64 tokens — and cached per device and layer shape; or read from
//!   the `profile` option.
//! * **Scheduler** ([`scheduler`]): the exact minimiser of
//!   `t(l) = l·x/B + max(l·r, (s−l)·kv/B)` (closed form, checked against a scan). It
//!   derives that `l = 0` whenever one token's X is at least its K+V — every GQA model
//!   with two or more query heads per KV head — so `recompute` then moves exactly what
//!   `layer` moves; [`KvStats::split`](kvpolicy_core::KvStats) and `recompute_tokens` say
//!   so.
//! * **Runtime** ([`policy`]): per layer and step, the X[0:l) copy is queued first, then
//!   K/V[l:s), on the transfer engine; the device regenerates the first range into the
//!   K/V buffer as soon as X is in, while K/V[l:s) is still in flight, then attends once
//!   over the assembled range (attending the two ranges apart and merging them by their
//!   log-sum-exp is exact too, but its rounding flipped a near-tied greedy token of the
//!   quantized default model). The next layer's ranges are prefetched into a second
//!   buffer set while this one computes (ping-pong, as in `layer`). The step's new K/V
//!   (and X, inside the prefix) go back to the host behind the compute.
//! * Device memory: two buffer sets, each one layer's K/V at the current capacity plus X
//!   for the split; the regenerated K/V are written into the K/V buffer.
//! * Only the latency (row-by-row) schedule is implemented; HybridServe (`hybrid`) covers
//!   the throughput side with batched requests.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod policy;
pub mod scheduler;
mod settings;

pub use policy::RecomputePolicy;
pub use scheduler::SplitCosts;
pub use settings::RecomputeSettings;

use kvpolicy_core::{PolicyOption, PolicyRegistry};

/// Registers `recompute`.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "recompute",
        "partial recompute (KVPR): KV on the host; the first l tokens' K/V regenerated from stored inputs while the rest transfers",
        &[
            PolicyOption::DeviceKvBudget,
            PolicyOption::Profile,
            PolicyOption::LinkBandwidth,
        ],
        |o, s: RecomputeSettings| Ok(Box::new(RecomputePolicy::new(o, s)?)),
    );
}
