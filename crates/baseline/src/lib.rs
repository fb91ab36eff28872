//! `kvpolicy-baseline`: the reference KV policy.
//!
//! * [`FullPolicy`] (`full`) keeps every layer's K/V on the device tier in preallocated
//!   buffers that grow in chunks — the reference every other policy must match.
//!
//! The baseline of the offloading papers, layer-wise offload (`layer`), is the offload
//! runtime with one unit per layer and lives with it in `kvpolicy-offload`.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod full;
pub mod held;

pub use full::FullPolicy;

use kvpolicy_core::settings::NoSettings;
use kvpolicy_core::{PolicyOption, PolicyRegistry};

/// Registers this crate's policies.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "full",
        "every layer's K/V on the device (the reference)",
        &[PolicyOption::DeviceKvBudget, PolicyOption::KvDtype],
        |o, _: NoSettings| Ok(Box::new(FullPolicy::new(o)?)),
    );
}
