//! `recompute`'s own settings (a `recompute:KEY=VALUE` spec), next to the options every
//! policy shares.

/// `recompute`'s settings.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct RecomputeSettings {
    /// Tokens regenerated per layer and step, forced: the first `split` cached tokens of
    /// every layer (clamped to the tokens cached so far); unset: the scheduler's split.
    pub split: Option<usize>,
}
