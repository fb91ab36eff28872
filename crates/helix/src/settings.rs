//! `helix`'s settings: the policy each rank keeps its share under.
use schemars::JsonSchema;

/// `helix`'s settings.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HelixSettings {
    /// The lossless policy each rank keeps its share of the sequence under (`full`,
    /// `layer`, `headwise`, `headwise:1`, `auto`, `auto:64MiB`; a spec without commas). The shared options
    /// (device and host budgets, disk directory, KV dtype) apply to every rank's share.
    pub local: String,
}

impl Default for HelixSettings {
    fn default() -> Self {
        Self {
            local: "full".into(),
        }
    }
}
