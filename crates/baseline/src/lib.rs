//! `kvpolicy-baseline`: the reference and baseline KV policies.
//!
//! * [`FullPolicy`] (`full`) keeps every layer's K/V on the device tier in preallocated
//!   buffers that grow in chunks — the reference every other policy must match.
//! * [`layer_policy`] (`layer`) keeps the cache on the host and two layers' worth on the
//!   device — layer-wise offload, the baseline of FlexGen and HF's offloaded cache.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod full;
pub mod layer;

pub use full::FullPolicy;
pub use layer::layer_policy;

use kvpolicy_core::{PolicyOption, PolicyRegistry};

/// Registers this crate's policies.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "full",
        "every layer's K/V on the device (the reference)",
        &[PolicyOption::DeviceKvBudget],
        |o| Ok(Box::new(FullPolicy::new(o))),
    );
    reg.register(
        "layer",
        "layer-wise offload: KV on the host, two layers' buffers on the device",
        &[PolicyOption::DeviceKvBudget, PolicyOption::LinkBandwidth],
        |o| Ok(Box::new(layer_policy(o)?)),
    );
}
