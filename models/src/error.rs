//! Typed errors of model loading, tokenization and generation.
use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The KV policy failed.
    #[error(transparent)]
    Policy(#[from] kvpolicy_core::KvError),
    /// A file could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// config.json is missing a field, has a bad value, or asks for something unsupported.
    #[error("config: field `{field}`: {message}")]
    Config {
        /// The offending field (dotted path).
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A weight is missing or its shape disagrees with the config.
    #[error("weights in {path}: {message}")]
    Weights {
        /// The weight file or directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A file that should be GGUF is not, or is damaged.
    #[error("{path} {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// No source could provide the model.
    #[error("could not obtain the model: {0}")]
    Fetch(String),
    /// A request that the model cannot serve (bad ids, too long, empty prompt).
    #[error("invalid input: {0}")]
    Input(String),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

/// The message of a candle error without the backtrace candle attaches when
/// `RUST_BACKTRACE` is set (a user-facing load error should not dump one).
pub fn candle_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", candle_message(inner))
        }
        other => other.to_string(),
    }
}

impl ModelError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// A config error on `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A tokenizer error as a [`ModelError::Tokenizer`].
pub(crate) fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}
