//! The policies the examples and kvbench build by name: kvpolicy's own and those of
//! downstream crates of the workspace — examples/custom-policy's `sinks` (approximate),
//! registered through the same public API a crate of one's own uses.
use kvpolicy::PolicyRegistry;

/// Every policy the command-line tools know.
pub fn registry() -> PolicyRegistry {
    kvpolicy_custom_policy::registry()
}
