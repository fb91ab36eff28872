//! Who may write what the cache reads. K/V with a valid checksum are believed, so whoever
//! can write the cache directory, a chunk file or a session file can change a model's
//! outputs: like ssh with `~/.ssh`, a directory or session file that is writable by group or
//! others, or owned by another user (root aside), is refused with an error saying how to
//! make it private ([`check_dir`], [`check_file`]); a chunk file that is not private is a
//! miss ([`private`]). A directory the cache creates is created private (0700).
use std::fs::Metadata;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

use crate::error::{PrefixError, Result};

/// Whether only this user (or root) owns `meta`'s file and no one else can write it.
pub fn private(meta: &Metadata) -> bool {
    let owner = meta.uid();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    (owner == me || owner == 0) && meta.mode() & 0o022 == 0
}

/// Why `meta` is not private, and what to do, for a message about `path`.
fn why_not(meta: &Metadata, path: &Path) -> Option<String> {
    // SAFETY: as in `private`.
    let me = unsafe { libc::geteuid() };
    let owner = meta.uid();
    if owner != me && owner != 0 {
        return Some(format!(
            "is owned by user {owner}, not this user ({me}): another user could change the K/V it holds, and with them this model's outputs; use a path of your own, or `chown {me} {}`",
            path.display()
        ));
    }
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then(|| {
        format!(
            "is writable by group or others (mode {mode:o}): whoever can write it can plant K/V and change this model's outputs; make it private: `chmod go-w {}`",
            path.display()
        )
    })
}

/// Creates `dir` (and missing parents) private to this user (0700), if it does not exist.
pub fn create_private_dir(dir: &Path) -> Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| PrefixError::io("cannot create the prefix cache directory", dir, e))
}

/// Refuses a cache directory `dir` that is not a directory, or not private to this user.
pub fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir)
        .map_err(|e| PrefixError::io("cannot stat the prefix cache directory", dir, e))?;
    if !meta.is_dir() {
        return Err(PrefixError::Invalid(format!(
            "the prefix cache directory {} is not a directory; give a directory of your own",
            dir.display()
        )));
    }
    match why_not(&meta, dir) {
        Some(why) => Err(PrefixError::Untrusted {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Refuses a file (a session) at `path`, of `meta`, that is not private to this user.
pub fn check_file(meta: &Metadata, path: &Path) -> Result<()> {
    match why_not(meta, path) {
        Some(why) => Err(PrefixError::Untrusted {
            path: path.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}
