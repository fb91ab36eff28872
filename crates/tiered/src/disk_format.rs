//! The disk tier's file format, shared by its writer ([`crate::disk`]) and its reader
//! ([`crate::disk_read`]): page-aligned blocks, each a header (magic, the tokens written)
//! and the block's rows; and how I/O errors name the file.
use std::path::Path;

use kvpolicy_core::KvError;

/// Bytes of a block header: magic, first and end of the tokens written (u32 each).
pub(super) const HEADER: usize = 12;
/// Alignment of blocks, of each block's data and of direct reads (offset, length, buffer):
/// the page size, a multiple of every common logical block size.
pub(super) const ALIGN: u64 = 4096;

/// "KVD1", little-endian.
pub(super) const MAGIC: u32 = 0x3144_564b;

pub(super) fn disk_err(what: &str, path: &Path, e: std::io::Error) -> KvError {
    KvError::Disk {
        what: format!("{what} {}", path.display()),
        source: e,
    }
}

/// `n` rounded up to whole pages.
pub(super) fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}
