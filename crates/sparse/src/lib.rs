//! `kvpolicy-sparse`: **APPROXIMATE** head-wise policies that move, per decoded token, only
//! the pages of the cache a query needs — past the floor of exact offload, which moves the
//! whole cache every token. All three are opt-in and labeled lossy everywhere (registry
//! description, the runner's summary, `--stats-out`'s `"lossy": true`, kvbench).
//!
//! * `quest` (Quest, ICML 2024): per decode step and KV head, the top-K pages by their
//!   min/max upper bound, fetched from the host tier every step.
//! * `flexicache` (FlexiCache, arXiv 2511.00868): stable heads keep their top-K pages on
//!   the device and re-rank periodically; unstable heads keep every page there.
//! * `clo` (CLO, arXiv 2511.14510): a head reuses its selection while its query stays
//!   similar; pages that keep coming back persist on the device.
//!
//! Shared by all three ([`SparsePolicy`]): each global layer's K/V on the host tier (RAM,
//! or the disk tier past a host budget); on the device the sink pages and the recent
//! window (always attended), the page summaries (per layer, KV head and page: the min and
//! max of each key channel), and each head's resident pages. A prefill chunk attends the
//! whole middle densely (it crosses the link once per chunk and layer); a decode step
//! attends each head's selected pages. Sliding-window layers keep their window resident
//! and select nothing. With a budget that covers the context every one of them equals
//! `full` (≤ 1e-5).
//!
//! Files: `settings` the settings; `pages` the summaries and scores; `select` top-K and
//! overlaps; `cache` a head's device pages; `layers` a layer's device tier; `middle` the
//! dense and selected attention over the middle and the page fetches; `selector` the rule
//! a policy supplies; `policy` the runtime; `restore` K/V computed elsewhere (a restored
//! or shared prefix); `quest`, `flexicache`, `clo` the rules.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod cache;
pub mod clo;
pub mod flexicache;
mod layers;
mod middle;
pub mod pages;
pub mod policy;
pub mod quest;
mod restore;
pub mod select;
pub mod selector;
pub mod settings;

pub use clo::Clo;
pub use flexicache::FlexiCache;
pub use policy::SparsePolicy;
pub use quest::Quest;
pub use settings::{CloSettings, FlexiCacheSettings, Pages, QuestSettings};

use kvpolicy_core::{PolicyOption, PolicyOptions, PolicyRegistry, Result};

/// The shared options the three read.
const READS: &[PolicyOption] = &[
    PolicyOption::LinkBandwidth,
    PolicyOption::HostKvBudget,
    PolicyOption::DiskDir,
];

/// Builds `quest`.
pub fn quest_policy(opts: &PolicyOptions, s: QuestSettings) -> Result<SparsePolicy<Quest>> {
    SparsePolicy::new("quest", s.pages(), Quest, opts)
}

/// Builds `flexicache`.
pub fn flexicache_policy(
    opts: &PolicyOptions,
    s: FlexiCacheSettings,
) -> Result<SparsePolicy<FlexiCache>> {
    let threshold = settings::unit_interval("flexicache", "threshold", s.threshold)?;
    SparsePolicy::new(
        "flexicache",
        s.pages(),
        FlexiCache::new(s.rerank, threshold),
        opts,
    )
}

/// Builds `clo`.
pub fn clo_policy(opts: &PolicyOptions, s: CloSettings) -> Result<SparsePolicy<Clo>> {
    let eta = settings::unit_interval("clo", "similarity", s.similarity)?;
    let persist = s.persist / s.page.max(1);
    Ok(
        SparsePolicy::new("clo", s.pages(), Clo::new(eta, persist), opts)?
            .with_zero_copy(s.zero_copy),
    )
}

/// Registers `quest`, `flexicache` and `clo`.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "quest",
        "APPROXIMATE: Quest page selection — each KV head attends its top pages (min/max key bounds) + sinks + window, fetched from the host every step; logits differ from full once the context passes sinks + window + budget",
        READS,
        |o, s: QuestSettings| Ok(Box::new(quest_policy(o, s)?)),
    );
    reg.register(
        "flexicache",
        "APPROXIMATE: FlexiCache — stable heads keep their top pages on the device (re-ranked periodically), unstable heads all pages; logits differ from full once the context passes sinks + window + budget",
        READS,
        |o, s: FlexiCacheSettings| Ok(Box::new(flexicache_policy(o, s)?)),
    );
    reg.register(
        "clo",
        "APPROXIMATE: CLO — heads reuse their page selection while the query stays similar, often-selected pages persist on the device; logits differ from full once the context passes sinks + window + budget",
        READS,
        |o, s: CloSettings| Ok(Box::new(clo_policy(o, s)?)),
    );
}
