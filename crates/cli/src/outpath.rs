//! Where an output path really leads, decided before any work: a regular file (or a new
//! one), a device or FIFO written in place, or an open descriptor of this process
//! (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`, `/proc/PID/fd/N` with our
//! own PID) written through that descriptor — never renamed over, never reopened by a path
//! that may lead elsewhere (a pipe has no path; a redirected file would be truncated).
//! Shared by the examples' runner and kvbench through `atomic`.
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Where an output goes.
pub enum Target {
    /// A regular file (or a new one) at this path, reached through the user's symbolic
    /// links: staged beside it and renamed into place.
    File(PathBuf),
    /// A device, FIFO or socket at this path: written in place.
    Special(PathBuf),
    /// An open descriptor of this process: written through a duplicate of it.
    Descriptor(RawFd),
}

/// The descriptor a path names lexically, if it is one of this process's:
/// `/dev/stdin|stdout|stderr`, `/dev/fd/N`, `/proc/self/fd/N`, `/proc/thread-self/fd/N`,
/// `/proc/PID/fd/N` with this process's PID, or `/proc/{self,PID}/task/TID/fd/N`. Repeated and `.` separators are ignored.
pub fn descriptor_of(path: &Path) -> Option<RawFd> {
    let parts: Vec<String> = path
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let number = |s: &str| s.parse::<RawFd>().ok().filter(|n| *n >= 0);
    let ours = |who: &str| {
        who == "self" || who == "thread-self" || who.parse::<u32>().ok() == Some(std::process::id())
    };
    match parts.as_slice() {
        ["/", "dev", "stdin"] => Some(0),
        ["/", "dev", "stdout"] => Some(1),
        ["/", "dev", "stderr"] => Some(2),
        ["/", "dev", "fd", n] => number(n),
        ["/", "proc", who, "fd", n] if ours(who) => number(n),
        // A thread's view of the same descriptor table.
        ["/", "proc", who, "task", _, "fd", n] if ours(who) => number(n),
        _ => None,
    }
}

/// Whether `path` is `/proc/PID/fd/N` (or `/proc/PID/task/TID/fd/N`) of another process.
fn another_process_descriptor(path: &Path) -> bool {
    let parts: Vec<Component> = path.components().collect();
    let is = |c: &Component, s: &str| c.as_os_str() == s;
    let fd_path = match parts.as_slice() {
        [Component::RootDir, proc, _, fd, _] => is(proc, "proc") && is(fd, "fd"),
        [Component::RootDir, proc, _, task, _, fd, _] => {
            is(proc, "proc") && is(task, "task") && is(fd, "fd")
        }
        _ => false,
    };
    fd_path && descriptor_of(path).is_none()
}

/// Resolves `path`: the user's symbolic links are followed to the file they name (which may
/// not exist yet); a descriptor path is recognised at every hop.
pub fn target(path: &Path) -> Result<Target> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        if let Some(fd) = descriptor_of(&p) {
            return Ok(Target::Descriptor(fd));
        }
        if another_process_descriptor(&p) {
            // Another process's descriptor: its magic link may name a pipe or a file
            // another process is writing; opened and written in place, never renamed over.
            return Ok(Target::Special(p));
        }
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(m) if m.is_dir() => bail!("{} is a directory; give a file path", path.display()),
            Ok(m) if m.is_file() => return Ok(Target::File(p)),
            Ok(_) => return Ok(Target::Special(p)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Target::File(p)),
            Err(e) => return Err(e).with_context(|| format!("cannot use {}", path.display())),
        }
    }
    bail!("{}: too many levels of symbolic links", path.display())
}

/// A duplicate of descriptor `fd` (close-on-exec) when it is open for writing; `shown` names
/// the path in the error.
pub fn writable_descriptor(fd: RawFd, shown: &Path) -> Result<File> {
    // SAFETY: fcntl on a descriptor number only queries or duplicates it; an unopened
    // number fails with EBADF and touches nothing.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        bail!(
            "{} names descriptor {fd}, which is not open; redirect it (e.g. `{fd}>FILE`) or give a file path",
            shown.display()
        );
    }
    if flags & libc::O_ACCMODE == libc::O_RDONLY {
        bail!(
            "{} names descriptor {fd}, which is open for reading only; give a file path",
            shown.display()
        );
    }
    // SAFETY: as above; on success the new descriptor is ours alone, owned by the `File`.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot write {}", shown.display()));
    }
    // SAFETY: `dup` is a fresh descriptor nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(dup) }))
}
