//! Typed errors of the policy layer.
//!
//! Messages describe the problem and name options by their [`PolicyOptions`] field and
//! settings by their key (in backticks, e.g. `` `device_kv_budget` ``); errors about one
//! carry it as a [`Knob`] and budget errors carry [`Advice`], which a front end renders in
//! its own spelling (the CLI's flags).
//!
//! [`PolicyOptions`]: crate::PolicyOptions
use crate::knob::Knob;

/// One thing the user can change to get past a [`KvError::BudgetExceeded`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Raise this (the device KV budget).
    Raise(Knob),
    /// Lower this (a head group, a recompute split).
    Lower(Knob),
    /// Switch to this policy.
    UsePolicy(&'static str),
    /// Prefill in smaller chunks (`GenerateConfig::prefill_chunk`).
    SmallerPrefillChunk,
    /// Send shorter requests.
    ShorterRequests,
}

impl std::fmt::Display for Advice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Raise(k) => write!(f, "raise {k}"),
            Self::Lower(k) => write!(f, "use a smaller {k}"),
            Self::UsePolicy(p) => write!(f, "use the `{p}` policy"),
            Self::SmallerPrefillChunk => write!(f, "use a smaller `prefill_chunk`"),
            Self::ShorterRequests => write!(f, "shorten the requests"),
        }
    }
}

/// The message of a [`KvError::BudgetExceeded`] with its advice already in words (each
/// item a clause): the library's own (`raise `device_kv_budget``), or a front end's (its
/// flags). One template, whoever renders the advice.
pub fn budget_text(
    what: &str,
    needed: u64,
    budget: u64,
    in_use: u64,
    note: &str,
    advice: &[String],
) -> String {
    let sep = if note.is_empty() || advice.is_empty() {
        ""
    } else {
        "; "
    };
    format!(
        "device KV budget exceeded: {what} needs {} but the budget is {} ({} already in use); {note}{sep}{}",
        crate::size::format_bytes(needed),
        crate::size::format_bytes(budget),
        crate::size::format_bytes(in_use),
        advice.join(", or ")
    )
}

/// Everything that can go wrong inside a policy or the attention math.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A policy name that the registry does not know.
    #[error("unknown KV policy `{name}`; valid policies are: {valid}")]
    UnknownPolicy {
        /// The name that was asked for.
        name: String,
        /// The registered names, comma separated.
        valid: String,
    },
    /// An option or setting value that a policy cannot work with.
    #[error("invalid option for the `{policy}` policy: {option} {message}")]
    InvalidOption {
        /// The policy that rejected the option.
        policy: String,
        /// The option or setting.
        option: Knob,
        /// What is wrong with the value and what to do, continuing after the option's name
        /// ("1.5 is outside [0, 1]: …"); other options named by their field, in backticks.
        message: String,
    },
    /// A policy spec string that does not parse.
    #[error("cannot parse the policy spec `{spec}`: {reason}; write NAME, NAME:VALUE or NAME:KEY=VALUE,KEY=VALUE (e.g. headwise:group=1)")]
    BadSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// A setting key the policy does not declare.
    #[error("the `{policy}` policy has no setting `{key}`; {}", valid_keys(.valid))]
    UnknownSetting {
        /// The policy.
        policy: String,
        /// The key given.
        key: String,
        /// The keys it declares.
        valid: Vec<String>,
    },
    /// A setting value the policy's settings type rejects.
    #[error("the `{policy}` policy's setting `{key}`{}{}: {reason}", if .value.is_empty() { "" } else { " = " }, .value)]
    BadSetting {
        /// The policy.
        policy: String,
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What the parser said, and the type the setting takes (as listings print it).
        reason: String,
    },
    /// The device tier would exceed its byte budget.
    #[error(
        "{}",
        budget_text(.what, *.needed, *.budget, *.in_use, .note, &.advice.iter().map(Advice::to_string).collect::<Vec<_>>())
    )]
    BudgetExceeded {
        /// What was being allocated.
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// The configured budget in bytes.
        budget: u64,
        /// Bytes already held.
        in_use: u64,
        /// Why it cannot be made smaller here (may be empty).
        note: &'static str,
        /// What the user can change, best first.
        advice: Vec<Advice>,
    },
    /// A call that breaks [`KvPolicy`](crate::KvPolicy)'s call protocol (reported by
    /// [`Checked`](crate::protocol::Checked)).
    #[error("call out of order: {0}")]
    Protocol(String),
    /// A step that does not continue the sequence the policy holds.
    #[error("layer {layer} of sequence {seq} holds {held} tokens but the step starts at position {pos}; reset the policy (or release the sequence) before starting it again")]
    OutOfOrder {
        /// The step's sequence slot (0 outside a batch).
        seq: usize,
        /// The step's layer.
        layer: usize,
        /// Tokens the policy holds for it.
        held: usize,
        /// Where the step starts.
        pos: usize,
    },
    /// Tensors of a step (or of a call) whose shapes do not fit together.
    #[error("shapes do not fit: {0}")]
    Shape(String),
    /// Something this policy or device does not do.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A copy between the host and the device tier failed.
    #[error("a transfer between the host and device tiers failed: {0}")]
    Transfer(String),
    /// The model could not regenerate K/V from stored inputs.
    #[error("regenerating K/V failed: {0}")]
    Regen(String),
    /// A policy's own bookkeeping broke: a bug in the policy.
    #[error("internal error in the KV policy ({0}); this is a bug, please report it")]
    Invariant(String),
    /// The disk tier could not create, grow, write or read a file, or found one damaged
    /// (the I/O error is the source: `{:#}` / anyhow's chain prints it).
    #[error("disk tier: {what}")]
    Disk {
        /// What was being done, and to which file.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A cost profile (a `profile` file) that cannot be used.
    #[error("cannot use the profile {origin}: {reason}; write JSON such as {{\"h2d_bytes_per_s\": 2.5e10, \"recompute_tokens_per_s\": 1.0e6}}")]
    BadProfile {
        /// Where it came from (a path).
        origin: String,
        /// What is wrong.
        reason: String,
    },
    /// A size string such as `64MiB` that does not parse.
    #[error(transparent)]
    BadSize(#[from] crate::size::SizeError),
}

/// "its settings are: a, b" or "it takes no settings".
fn valid_keys(valid: &[String]) -> String {
    if valid.is_empty() {
        "it takes no settings".to_string()
    } else {
        format!("its settings are: {}", valid.join(", "))
    }
}

impl KvError {
    /// An [`Invariant`](Self::Invariant) error.
    pub fn invariant(what: impl Into<String>) -> Self {
        Self::Invariant(what.into())
    }
}

/// Result type of the policy layer.
pub type Result<T> = std::result::Result<T, KvError>;
