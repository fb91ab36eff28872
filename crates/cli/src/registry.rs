//! The policies the command-line tools build by name: kvpolicy's own, plus whatever the
//! binary installs at start-up — the workspace's examples and kvbench add the downstream
//! crate examples/custom-policy's `sinks` (approximate), registered through the same
//! public API a crate of one's own uses.
use std::sync::OnceLock;

use kvpolicy::PolicyRegistry;

static INSTALLED: OnceLock<PolicyRegistry> = OnceLock::new();

/// Makes `reg` the registry every tool of this crate builds from. Call once at start-up,
/// before anything else of this crate; a second call changes nothing.
pub fn install(reg: PolicyRegistry) {
    let _ = INSTALLED.set(reg);
}

/// Every policy the command-line tools know: the installed registry, or kvpolicy's own.
pub fn registry() -> PolicyRegistry {
    INSTALLED.get().cloned().unwrap_or_else(kvpolicy::registry)
}
