//! The converter's errors: each names the input at fault and what to do.
use std::path::PathBuf;

/// What can go wrong converting a model.
#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    /// A setting that cannot apply to this model (`--kv-heads` not a divisor, …).
    #[error("{0}")]
    Setting(String),
    /// An architecture the converter does not handle.
    #[error("{0}")]
    Unsupported(String),
    /// The output path cannot be written as asked.
    #[error("{path}: {why}")]
    Output {
        /// The path.
        path: PathBuf,
        /// Why not.
        why: String,
    },
    /// The input checkpoint lacks what its config promises.
    #[error("{0}")]
    Checkpoint(String),
    /// A file could not be read or written (the OS error is part of the message and not
    /// a `source`, so that a chain-printing caller says it once).
    #[error("{path}: {cause}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        cause: std::io::Error,
    },
    /// Loading or running the model.
    #[error(transparent)]
    Model(#[from] kvpolicy_models::ModelError),
    /// A tensor operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The KV policy during calibration.
    #[error(transparent)]
    Policy(#[from] kvpolicy_core::KvError),
}

impl CompressError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            cause: source,
        }
    }
}

/// The converter's result type.
pub type Result<T> = std::result::Result<T, CompressError>;
