//! `layer`: layer-wise offload — all KV on the host tier; the device holds two buffers of one
//! layer's KV each, and layer l+1's history is prefetched while layer l attends (FlexGen
//! §4; HF transformers' offloaded cache). The baseline every paper in this project beats.
//!
//! It is head-wise offload with one unit per layer, so it shares
//! [`OffloadPolicy`](kvpolicy_core::OffloadPolicy) with `headwise`.
use kvpolicy_core::{Grouping, OffloadPolicy, PolicyOptions, Result};

/// Builds the `layer` policy.
pub fn layer_policy(opts: &PolicyOptions) -> Result<OffloadPolicy> {
    OffloadPolicy::new("layer", Grouping::Layer, opts)
}
