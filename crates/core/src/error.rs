//! Typed errors of the policy layer.

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
    /// An option value that a policy cannot work with.
    #[error("invalid option for the `{policy}` policy: {message}")]
    InvalidOption {
        /// The policy that rejected the option.
        policy: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// The device tier would exceed its byte budget.
    #[error(
        "device KV budget exceeded: {what} needs {} but the budget is {} ({} already in use); {hint}",
        crate::size::format_bytes(*.needed),
        crate::size::format_bytes(*.budget),
        crate::size::format_bytes(*.in_use)
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
        /// What the user can do about it.
        hint: &'static str,
    },
    /// The step handed to a policy does not fit what the policy holds.
    #[error("inconsistent attention step: {0}")]
    Step(String),
    /// A cost profile (`--profile FILE`) that cannot be used.
    #[error("cannot use the profile {origin}: {reason}; write JSON such as {{\"h2d_bytes_per_s\": 2.5e10, \"recompute_tokens_per_s\": 1.0e6}}")]
    BadProfile {
        /// Where it came from (a path).
        origin: String,
        /// What is wrong.
        reason: String,
    },
    /// A size string such as `64MiB` that does not parse.
    #[error("cannot parse the size `{input}`: {reason}; write a number with an optional unit, e.g. 512MiB, 2GB or 1048576")]
    BadSize {
        /// The text given.
        input: String,
        /// Why it is rejected.
        reason: String,
    },
}

/// Result type of the policy layer.
pub type Result<T> = std::result::Result<T, KvError>;
