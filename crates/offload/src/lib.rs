//! `kvpolicy-offload`: the offload runtime and its three policies — `layer` (layer-wise
//! offload: FlexGen, HF's offloaded cache; the baseline), `headwise` (head-wise offload,
//! after HeadInfer, Luo et al., ICML 2025) and `auto` (resident units under a device
//! budget, the rest streamed head-wise).
//!
//! Files, one type and its `impl` each: `runtime` the policy ([`OffloadPolicy`]), which
//! composes the others and owns what they share (link, host tier, device meter, stats);
//! `plan` its fixed layout choices ([`Grouping`], the head group, the resident bytes);
//! `stream` the unit order, prefetch and disk read-ahead on `kvpolicy-tiered`'s toolkit;
//! `staging` the two device buffers as places for the units staged ahead; `resident`
//! `auto`'s resident units, attended in place;
//! `settings` `headwise`'s settings.
//!
//! ## What the paper does
//!
//! HeadInfer keeps the whole KV cache in CPU memory and, for each layer, moves to the GPU
//! only the KV of one *head group* at a time (§3.2). Two preallocated GPU buffers alternate
//! ("ping-pong"): while attention runs on group g, group g+1 is prefetched and group g−1's
//! new entries are written back. Attention is exact because heads are independent. Head
//! groups adapt to the context (§3.3: all heads of a layer for short contexts, fewer as the
//! context grows), the prompt is prefilled in chunks so activations stay small (§3.4), and
//! layer-wise offload is the special case of one group per layer. For Llama-3-8B at 1M
//! tokens this cuts device KV from 128 GB to 1 GB.
//!
//! ## What this implementation does
//!
//! * The host tier holds, per layer, `(b, kv_heads, capacity, head_dim)` K and V buffers
//!   that grow in chunks of 8 × the device growth step, so one KV head's tokens are one
//!   contiguous range and a group moves in `2 × b × group` copies.
//! * The device tier holds exactly two buffers of `group` heads at the current capacity:
//!   peak device KV = `2 × group × capacity × row bytes × 2 (K, V) × batch` (a row:
//!   `head_dim` values as stored — f32, f16/bf16, or q8_0's 34 bytes per 32),
//!   asserted exactly by the tests through [`KvStats`](kvpolicy_core::KvStats).
//! * Units run in order across layers. Beyond the paper's one-ahead ping-pong, the units
//!   after the current one are staged as far ahead as the two buffers have room (small
//!   units — one head, a sliding-window layer — share a buffer, packed along the token
//!   axis), each copy queued before the current unit's is waited for and the freed place
//!   refilled as soon as a unit is attended — also with the next step's first units, once
//!   this step has written their layers. So the link carries one copy after another and a
//!   decode step costs what moving its cache costs (HeadInfer §3.2's claim, measured by
//!   `scripts/link_bound.py`: 0.96–0.99 of a simulated link's bound). Same device bytes as
//!   the ping-pong: only what fills the buffers runs further ahead. New entries go back
//!   behind each unit.
//! * The `group` setting (`headwise:group=N`) fixes the group; `auto` picks the largest group (a divisor of the KV
//!   heads) whose two buffers and a step's scratch (the unit's attention tiles, the chunk's
//!   activations) fit `device_kv_budget`, re-chosen as the context grows, and
//!   without a budget follows the paper's thresholds: all heads below 500K tokens, half as
//!   many for each doubling beyond.
//! * Chunked prefill is the generation loop's `prefill_chunk` (every policy gets it; 2,048
//!   tokens by default); with a sliding window only the window's range is moved.
//! * Each unit's attention runs the tiled kernel of `kvpolicy-core` (§3.3's requirement that
//!   attention memory not grow with the context: scratch bounded by tiles, no `t × s`
//!   scores or mask).
//!
//! * `auto` (after llama.cpp#12663's ask for a partial split): the same machinery, but as
//!   many units as the budget holds — after the two streaming buffers and a step's scratch,
//!   at the capacity the run will reach — stay resident on the device in growing buffers
//!   and are attended in place; only the others move. Sliding-window layers' units come
//!   first: their resident buffers hold the window and one step, not the context (Gemma
//!   2/3 keep most layers resident for the price of a few global ones); the others are
//!   decided in the order they first run, while the budget's bytes last. A resident unit
//!   whose growth no longer fits is demoted to the host once, the last-decided first
//!   (counted in `demotions`), so the device never holds more than the budget. Without a
//!   budget every unit is resident and nothing moves (`full`'s placement, with windowed
//!   layers in window-sized buffers).
//! * Disk tier (beyond HeadInfer, whose contexts are bounded by host RAM; FlexGen's
//!   `--offload-dir`): with `disk_dir`, host-tier layers past `host_kv_budget` live in
//!   files (read with `O_DIRECT` by default); the three streamed units after the next are
//!   read from disk, each on a reader thread, while the next one crosses to the device and
//!   the current one attends (disk → host → device); after the last layer the read-ahead
//!   goes on into the next step's first units.
//! * Left for later: KVPR's partial recompute for the streamed units of MHA layers (the
//!   `recompute` policy does it for whole layers).
//!
//! ## Differences, and why
//!
//! * Group outputs are concatenated once per layer rather than written in place by a fused
//!   kernel: candle has no strided-output attention, and one concat per layer is small next
//!   to moving the KV.
//! * On CUDA the attention is the tiled candle-op path until a fused kernel is written and
//!   measured on a GPU.
//! * The paper offloads only KV; the weights stay on the device here too.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod placement;
mod plan;
mod resident;
mod restore;
mod runtime;
mod settings;
mod shard;
mod staging;
mod stream;

pub use plan::{Grouping, AUTO_ALL_HEADS_BELOW};
pub use runtime::OffloadPolicy;
pub use settings::{HeadGroup, HeadwiseSettings};

use kvpolicy_core::settings::NoSettings;
use kvpolicy_core::{PolicyOption, PolicyOptions, PolicyRegistry, Result};

/// The shared options the offload policies read.
const READS: &[PolicyOption] = &[
    PolicyOption::DeviceKvBudget,
    PolicyOption::LinkBandwidth,
    PolicyOption::HostKvBudget,
    PolicyOption::DiskDir,
    PolicyOption::HostKvDtype,
    PolicyOption::KvDtype,
];

/// Builds the `layer` policy: all KV on the host, two buffers of one layer each on the
/// device, layer l+1 prefetched while layer l attends.
pub fn layer_policy(opts: &PolicyOptions) -> Result<OffloadPolicy> {
    OffloadPolicy::new("layer", Grouping::Layer, opts)
}

/// Builds the `headwise` policy with its settings' head group and the options' budget.
pub fn headwise_policy(opts: &PolicyOptions, settings: HeadwiseSettings) -> Result<OffloadPolicy> {
    OffloadPolicy::new("headwise", Grouping::Heads(settings.group), opts)
}

/// Builds the `auto` policy: as many (layer, head group) units as `device_kv_budget`
/// holds stay resident on the device, the rest stream as `headwise` does.
pub fn auto_policy(opts: &PolicyOptions) -> Result<OffloadPolicy> {
    OffloadPolicy::new("auto", Grouping::Resident, opts)
}

/// Registers `layer`, `headwise` and `auto`.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "layer",
        "layer-wise offload: KV on the host, two layers' buffers on the device",
        READS,
        |o, _: NoSettings| Ok(Box::new(layer_policy(o)?)),
    );
    reg.register(
        "auto",
        "the fastest exact placement under the device KV budget: resident (layer, head group) units on the device, the rest streamed head-wise",
        READS,
        |o, _: NoSettings| Ok(Box::new(auto_policy(o)?)),
    );
    reg.register(
        "headwise",
        "head-wise offload (HeadInfer): KV on the host, two head groups' buffers on the device",
        READS,
        |o, s: HeadwiseSettings| Ok(Box::new(headwise_policy(o, s)?)),
    );
}
