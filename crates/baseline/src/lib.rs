//! `kvpolicy-baseline`: the reference and baseline KV policies.
//!
//! * [`FullPolicy`] (`full`) keeps every layer's K/V on the device tier in preallocated
//!   buffers that grow in chunks — the reference every other policy must match.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod full;

pub use full::FullPolicy;

use kvpolicy_core::PolicyRegistry;

/// Registers this crate's policies.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "full",
        "every layer's K/V on the device (the reference)",
        |o| Ok(Box::new(FullPolicy::new(o))),
    );
}
