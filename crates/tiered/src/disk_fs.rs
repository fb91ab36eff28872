//! The disk tier's files as file-system objects (issue "Hardening II"): made without a name
//! (`O_TMPFILE`, mode 0600, so no kill leaves one behind), registered while a store holds
//! one (for a benchmark's sync), and the checks made of a directory before any work — that a
//! file can be made there, and how many bytes it has free. The files' layout is
//! [`DiskKv`](crate::DiskKv)'s.
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

/// The files of every live store of the process (synced by [`sync_disk_files`]).
static LIVE: Mutex<Vec<Weak<File>>> = Mutex::new(Vec::new());

/// Writes the dirty pages of every live store's file out to the disk (a benchmark's fill,
/// before decode is timed).
pub fn sync_disk_files() -> std::io::Result<()> {
    let files: Vec<Arc<File>> = LIVE
        .lock()
        .map(|live| live.iter().filter_map(Weak::upgrade).collect())
        .unwrap_or_default();
    for f in files {
        f.sync_data()?;
    }
    Ok(())
}

/// Checks that `dir` can hold the disk tier's files: an unnamed file is created there and
/// dropped (a read-only file system or a directory without write permission fails here,
/// before any work, not at the first spill).
pub fn probe_disk_dir(dir: &Path) -> std::io::Result<()> {
    unnamed_file(dir).map(drop)
}

/// A new file in `dir` without a name, mode 0600: `O_TMPFILE`, or, where the file system
/// lacks it, an exclusive temporary (the `tempfile` crate) unlinked at once.
pub(super) fn unnamed_file(dir: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmpfile = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    match tmpfile {
        Ok(f) => Ok(f),
        // Unsupported here (EOPNOTSUPP, EISDIR on kernels before 3.11): name it and unlink.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR)
            ) =>
        {
            let named = tempfile::Builder::new()
                .prefix(".kvpolicy-")
                .permissions(std::fs::Permissions::from_mode(0o600))
                .tempfile_in(dir)?;
            let (file, path) = named.into_parts();
            path.close()?;
            Ok(file)
        }
        Err(e) => Err(e),
    }
}

/// Bytes free for an unprivileged user on the file system holding `dir`.
pub fn free_disk_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs succeeded and filled `st`.
    let st = unsafe { st.assume_init() };
    // `c_ulong` is 32 bits wide on 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Registers a live store's file (dropped entries are pruned here).
pub(super) fn register(file: &Arc<File>) {
    if let Ok(mut live) = LIVE.lock() {
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(file));
    }
}
