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
        "device KV budget exceeded: {what} needs {needed} but the budget is {budget} ({in_use} already in use); {hint}"
    )]
    BudgetExceeded {
        /// What was being allocated.
        what: String,
        /// Bytes it needs, human readable.
        needed: String,
        /// The configured budget, human readable.
        budget: String,
        /// Bytes already held, human readable.
        in_use: String,
        /// What the user can do about it.
        hint: String,
    },
    /// The step handed to a policy does not fit what the policy holds.
    #[error("inconsistent attention step: {0}")]
    Step(String),
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
