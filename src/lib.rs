//! # kvpolicy
//!
//! Long-context LLM inference in small accelerator memory, by plugging KV-cache *policies*
//! into real model definitions on [Candle](https://github.com/huggingface/candle).
//!
//! Every model's attention layer calls one [`KvPolicy`]; a policy decides where keys,
//! values and layer activations live and how attention over them is evaluated, and every
//! policy returns the same logits as [`full`](kvpolicy_baseline::FullPolicy).
//!
//! ```no_run
//! use kvpolicy::{build_policy, PolicyOptions};
//! let policy = build_policy("full", &PolicyOptions::default())?;
//! assert_eq!(policy.name(), "full");
//! # Ok::<(), kvpolicy::KvError>(())
//! ```
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub use kvpolicy_baseline as baseline;
pub use kvpolicy_core as core;
pub use kvpolicy_helix as helix;
pub use kvpolicy_hybrid as hybrid;
pub use kvpolicy_models as models;
pub use kvpolicy_offload as offload;
pub use kvpolicy_prefix as prefix;
pub use kvpolicy_recompute as recompute;
pub use kvpolicy_sparse as sparse;
pub use kvpolicy_tiered as tiered;

pub use kvpolicy_core::{
    attend, attend_partial, merge_partials, parse_bytes, AttnInputs, AttnSpec, AttnStep, Knob,
    KvError, KvPolicy, KvPool, KvRegen, KvShape, KvStats, NoRegen, NoSettings, PolicyMetric,
    PolicyOption, PolicyOptions, PolicyRegistry, PolicySpec, Profile,
};
pub use kvpolicy_hybrid::HybridSettings;
pub use kvpolicy_models::{
    CausalLm, GenerateConfig, Generation, LogitsMode, ModelError, ModelInfo, ModelSpec,
};
pub use kvpolicy_offload::{HeadGroup, HeadwiseSettings};
pub use kvpolicy_recompute::RecomputeSettings;
pub use kvpolicy_sparse::{CloSettings, FlexiCacheSettings, QuestSettings};

/// A registry holding every policy of this workspace.
pub fn registry() -> PolicyRegistry {
    let mut reg = PolicyRegistry::new();
    kvpolicy_baseline::register(&mut reg);
    kvpolicy_offload::register(&mut reg);
    kvpolicy_recompute::register(&mut reg);
    kvpolicy_hybrid::register(&mut reg);
    kvpolicy_sparse::register(&mut reg);
    // Last: its local policies are those registered before it.
    kvpolicy_helix::register(&mut reg);
    reg
}

/// Builds the policy `spec` names (e.g. `"full"`, `"headwise:group=1"`); an unknown name is
/// an error listing the valid ones, an unknown setting one listing the policy's keys.
pub fn build_policy(spec: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>, KvError> {
    registry().build(spec, opts)
}

/// Builds the policy `spec` names for ragged batches of requests
/// ([`models::generate_batch`]): `hybrid` as it is, every other policy as one instance per
/// request ([`core::PerSequence`]).
pub fn build_policy_batched(
    spec: &str,
    opts: &PolicyOptions,
) -> Result<Box<dyn KvPolicy>, KvError> {
    registry().build_batched(spec, opts)
}

/// Names of every policy of this workspace.
pub fn policy_names() -> Vec<&'static str> {
    registry().names()
}

/// The README's Rust snippets, compiled and run as doctests (`cargo test --doc`).
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The book's Rust snippets (`docs/`), compiled and run as doctests like the README's.
#[cfg(doctest)]
pub mod book_doctests {
    /// `docs/policies.md`.
    #[doc = include_str!("../docs/policies.md")]
    pub struct Policies;
    /// `docs/writing-a-policy.md`.
    #[doc = include_str!("../docs/writing-a-policy.md")]
    pub struct WritingAPolicy;
    /// `docs/writing-a-model.md`.
    #[doc = include_str!("../docs/writing-a-model.md")]
    pub struct WritingAModel;
}
