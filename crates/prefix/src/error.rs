//! The prefix cache's typed errors. A damaged or foreign chunk file is not an error — it
//! is a miss ([`crate::chunk::Damage`]); errors are what the caller must act on: a cache
//! directory that cannot be used or that others can write, a write that failed, a session
//! for another model.
use std::path::PathBuf;

/// Everything the prefix cache and sessions can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PrefixError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The policy refused restored K/V (it takes none without attention), or failed.
    #[error(transparent)]
    Policy(#[from] kvpolicy_core::KvError),
    /// A file or directory operation failed (the OS error is part of the message, so that
    /// one line says it all).
    #[error("{what} {}: {cause}", path.display())]
    Io {
        /// What was being done ("cannot create the prefix cache directory", …).
        what: String,
        /// The path.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Input the cache cannot work with (a chunk of mismatched layers, a zero chunk size).
    #[error("{0}")]
    Invalid(String),
    /// A cache directory or session file that someone other than this user can write:
    /// planted K/V with a valid checksum would change outputs, so it is not used.
    #[error("{} {why}", path.display())]
    Untrusted {
        /// The directory or file.
        path: PathBuf,
        /// Who can write it and what to do (`chmod go-w PATH`).
        why: String,
    },
    /// A session file that is not one, or is for another model.
    #[error("session {}: {why}", path.display())]
    Session {
        /// The session file.
        path: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
}

impl PrefixError {
    /// An [`PrefixError::Io`] for `path`.
    pub fn io(what: impl Into<String>, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            path: path.into(),
            cause: source,
        }
    }
}

/// The prefix cache's result.
pub type Result<T> = std::result::Result<T, PrefixError>;
