//! The prefix cache's counters ([`PrefixStats`]) and the causes chunk-file writes fail with
//! ([`WriteErrors`], [`WriteErrorKind`]): a write that fails is not an error of the request
//! — the chunk stays in RAM if it fits — so it is counted by cause, and the first of each
//! cause is written to stderr once, naming the directory.
use crate::error::PrefixError;

/// Why a chunk file could not be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteErrorKind {
    /// The directory is gone (removed after the cache opened it).
    DirMissing,
    /// The disk, or the user's quota, is full.
    NoSpace,
    /// Writing is denied (its permissions changed, a read-only file system).
    Denied,
    /// Anything else.
    Other,
}

impl WriteErrorKind {
    /// The kind of `e`, a failed write.
    pub fn of(e: &PrefixError) -> Self {
        let PrefixError::Io { cause, .. } = e else {
            return Self::Other;
        };
        match cause.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => return Self::NoSpace,
            Some(libc::EROFS | libc::EACCES | libc::EPERM) => return Self::Denied,
            _ => {}
        }
        match cause.kind() {
            std::io::ErrorKind::NotFound => Self::DirMissing,
            std::io::ErrorKind::PermissionDenied => Self::Denied,
            _ => Self::Other,
        }
    }

    /// Its name in logs and metrics labels: `dir_missing`, `no_space`, `denied`, `other`.
    pub fn name(self) -> &'static str {
        match self {
            Self::DirMissing => "dir_missing",
            Self::NoSpace => "no_space",
            Self::Denied => "denied",
            Self::Other => "other",
        }
    }
}

/// Chunk files that could not be written, by cause (their sum is
/// [`PrefixStats::write_errors`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteErrors {
    /// The directory was gone.
    pub dir_missing: u64,
    /// The disk or the quota was full.
    pub no_space: u64,
    /// Writing was denied.
    pub denied: u64,
    /// Anything else.
    pub other: u64,
}

impl WriteErrors {
    /// Counts one error of `kind`; returns the count of that kind now.
    pub fn count(&mut self, kind: WriteErrorKind) -> u64 {
        let n = match kind {
            WriteErrorKind::DirMissing => &mut self.dir_missing,
            WriteErrorKind::NoSpace => &mut self.no_space,
            WriteErrorKind::Denied => &mut self.denied,
            WriteErrorKind::Other => &mut self.other,
        };
        *n += 1;
        *n
    }

    /// Each kind's name ([`WriteErrorKind::name`]) and count, for a labelled metric.
    pub fn by_kind(&self) -> [(&'static str, u64); 4] {
        [
            (WriteErrorKind::DirMissing.name(), self.dir_missing),
            (WriteErrorKind::NoSpace.name(), self.no_space),
            (WriteErrorKind::Denied.name(), self.denied),
            (WriteErrorKind::Other.name(), self.other),
        ]
    }
}

/// The prefix cache's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixStats {
    /// Chunks found.
    pub hits: u64,
    /// Chunk lookups that found nothing.
    pub misses: u64,
    /// Tokens restored from host RAM (a chunk found but not restored counts as a hit only).
    pub tokens_from_ram: u64,
    /// Tokens restored from files.
    pub tokens_from_disk: u64,
    /// Chunks stored (kept in RAM or written to a file).
    pub stored: u64,
    /// K/V bytes held in host RAM (never above its budget).
    pub ram_bytes: u64,
    /// Of those, the bytes of chunks live sequences hold by reference (leased: not
    /// evicted while held).
    pub shared_bytes: u64,
    /// Bytes of the chunk files known (never above its budget).
    pub disk_bytes: u64,
    /// Chunks evicted from host RAM.
    pub ram_evictions: u64,
    /// Chunk files removed to stay within the budget.
    pub disk_evictions: u64,
    /// Chunk files that failed their checks — damaged, truncated, another model's or
    /// shape's, writable by others — (removed; misses).
    pub damaged: u64,
    /// Chunk files that could not be written (the chunk stayed in RAM, if it fit): the sum
    /// of [`PrefixStats::write_error_kinds`].
    pub write_errors: u64,
    /// [`PrefixStats::write_errors`] by cause (the directory gone, the disk full, …).
    pub write_error_kinds: WriteErrors,
    /// Seconds spent restoring K/V into policies.
    pub restore_s: f64,
}
