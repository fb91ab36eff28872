//! `hybrid`'s own settings (a `hybrid:KEY=VALUE` spec), next to the options every
//! policy shares.

/// `hybrid`'s settings.
#[derive(
    Clone, Copy, Debug, PartialEq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct HybridSettings {
    /// Tokens per cache block.
    pub block_size: usize,
    /// Share of blocks stored as K/V rather than activations, forced, in [0, 1]: 1 = all
    /// KV, 0.5 = 1:1, 0 = all activations; unset: balanced from the profile.
    pub kv_act_ratio: Option<f64>,
}

impl Default for HybridSettings {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_act_ratio: None,
        }
    }
}
