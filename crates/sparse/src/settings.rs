//! The three policies' settings (`quest:budget=512`, `flexicache:rerank=8`,
//! `clo:similarity=0.9`): what pages are and how many a head attends ([`Pages`]), and what
//! each policy adds. Every one of them is LOSSY once a context is longer than the sinks,
//! the window and the budget together.
use kvpolicy_core::{Knob, KvError, Result};

/// Tokens per page when the settings do not say (Quest's 16).
pub const DEFAULT_PAGE: usize = 16;
/// Middle tokens a head attends per step when the settings do not say.
pub const DEFAULT_BUDGET: usize = 512;
/// First tokens always attended (rounded up to whole pages).
pub const DEFAULT_SINKS: usize = 16;
/// Recent tokens always attended (at least; the window moves a page at a time).
pub const DEFAULT_WINDOW: usize = 128;

/// What every page-selecting policy reads: the page size, the selection budget, the sinks
/// and the recent window, resolved against a policy's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pages {
    /// Tokens per page.
    pub page: usize,
    /// Middle tokens a KV head attends per step (whole pages: `budget / page` of them).
    pub budget: usize,
    /// Fraction of the middle pages attended instead of `budget`, in (0, 1].
    pub fraction: Option<f64>,
    /// First tokens always attended (rounded up to whole pages).
    pub sinks: usize,
    /// Recent tokens always attended.
    pub window: usize,
}

impl Pages {
    /// Checks the values for `policy`.
    pub fn checked(self, policy: &str) -> Result<Self> {
        let bad = |key: &'static str, message: String| KvError::InvalidOption {
            policy: policy.into(),
            option: Knob::Setting(key),
            message,
        };
        if self.page == 0 {
            return Err(bad("page", "0: a page holds at least one token".into()));
        }
        if self.budget < self.page && self.fraction.is_none() {
            return Err(bad(
                "budget",
                format!(
                    "{} tokens is less than one page of {}; give at least the page size",
                    self.budget, self.page
                ),
            ));
        }
        if let Some(f) = self.fraction {
            if !(f > 0.0 && f <= 1.0) {
                return Err(bad("fraction", format!("{f}: give a value in (0, 1]")));
            }
        }
        if self.window == 0 {
            return Err(bad(
                "window",
                "0: every query attends at least to itself; give 1 or more".into(),
            ));
        }
        Ok(self)
    }

    /// Pages a head attends out of `candidates` middle pages.
    pub fn pages_for(&self, candidates: usize) -> usize {
        match self.fraction {
            Some(f) => ((candidates as f64 * f).ceil() as usize).min(candidates),
            None => (self.budget / self.page).min(candidates),
        }
    }

    /// The first token after the sink pages.
    pub fn sink_end(&self) -> usize {
        self.sinks.div_ceil(self.page) * self.page
    }
}

macro_rules! page_settings {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $field:ident : $ty:ty = $default:expr),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            /// Tokens per page: the unit of summaries, selection and transfer.
            pub page: usize,
            /// Middle tokens (outside the sinks and the window) each KV head attends per
            /// decode step, in whole pages.
            pub budget: usize,
            /// Share of the middle pages each KV head attends instead of `budget`, in (0, 1].
            pub fraction: Option<f64>,
            /// First tokens always attended (rounded up to whole pages).
            pub sinks: usize,
            /// Recent tokens always attended (the window moves a page at a time).
            pub window: usize,
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    page: DEFAULT_PAGE,
                    budget: DEFAULT_BUDGET,
                    fraction: None,
                    sinks: DEFAULT_SINKS,
                    window: DEFAULT_WINDOW,
                    $($field: $default,)*
                }
            }
        }

        impl $name {
            /// The page settings.
            pub fn pages(&self) -> Pages {
                Pages {
                    page: self.page,
                    budget: self.budget,
                    fraction: self.fraction,
                    sinks: self.sinks,
                    window: self.window,
                }
            }
        }
    };
}

page_settings! {
    /// `quest`'s settings: pages and budget only.
    QuestSettings {}
}

page_settings! {
    /// `flexicache`'s settings.
    FlexiCacheSettings {
        /// Decode steps between re-rankings of a stable head's resident pages (and
        /// re-evaluations of every head's class).
        rerank: usize = 16,
        /// A head is stable when its top pages overlap by at least this share from one
        /// ranking to the next (query rows of the prefill's last chunk, then re-ranks).
        threshold: f64 = 0.2,
    }
}

page_settings! {
    /// `clo`'s settings.
    CloSettings {
        /// Cosine similarity of a head's queries to those of its last selection above which
        /// the head reuses that selection, for the least important head; more important
        /// heads need more (the threshold rises towards 1 with the head's importance).
        similarity: f64 = 0.9,
        /// Middle tokens per KV head kept on the device across steps besides those
        /// attended (whole pages): the most often selected pages persist.
        persist: usize = 512,
        /// CUDA: pages are gathered by a kernel reading the page-locked host tier mapped
        /// into the device (CLO's zero-copy engine) instead of copied; no effect on the CPU.
        zero_copy: bool = true,
    }
}

/// Checks a share-like setting in `[0, 1]`.
pub(crate) fn unit_interval(policy: &str, key: &'static str, value: f64) -> Result<f64> {
    if (0.0..=1.0).contains(&value) {
        return Ok(value);
    }
    Err(KvError::InvalidOption {
        policy: policy.into(),
        option: Knob::Setting(key),
        message: format!("{value}: give a value in [0, 1]"),
    })
}
