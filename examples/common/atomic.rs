//! Output files: written whole or not at all, and never replacing what the path points at.
//! Shared by the examples' runner and kvbench.
//!
//! * A new path or a regular file: written to a temporary beside it and renamed into place.
//! * A symbolic link: written through to its final target, atomically there (the link
//!   stays a link).
//! * A device file, FIFO or socket (`/dev/null`, `/dev/full`, a pipe): written directly, with
//!   write errors (`/dev/full`: no space) reported; it is never renamed over.
//!
//! Paths are checked before any work ([`check_output`]); temporaries are registered while
//! they exist, and SIGINT/SIGTERM remove them before the process exits ([`on_signals`]).
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

/// Temporaries being written now.
static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes the temporaries on SIGINT/SIGTERM, then exits with 130. Call once at start-up.
pub fn on_signals() {
    let _ = ctrlc::set_handler(|| {
        if let Ok(temps) = TEMPS.lock() {
            for t in temps.iter() {
                let _ = std::fs::remove_file(t);
            }
        }
        eprintln!("interrupted");
        std::process::exit(130);
    });
}

fn register(tmp: &Path, on: bool) {
    if let Ok(mut temps) = TEMPS.lock() {
        if on {
            temps.push(tmp.to_path_buf());
        } else {
            temps.retain(|t| t != tmp);
        }
    }
}

/// Where an output really goes.
enum Target {
    /// A regular file (or a new one) at this path: temporary + rename.
    File(PathBuf),
    /// Not a regular file: written in place.
    Special(PathBuf),
}

fn target(path: &Path) -> Result<Target> {
    // Follow symbolic links to the file they name (which may not exist yet).
    let mut p = path.to_path_buf();
    for _ in 0..40 {
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

/// Checks, before any work, that `path` can be written as the output of `flag`: not a
/// directory, in a directory that exists, and writable when it exists. Touches nothing.
pub fn check_output(path: &Path, flag: &str) -> Result<()> {
    let p = match target(path).with_context(|| flag.to_string())? {
        // Opening a FIFO would hand its reader an empty stream, and a device needs no
        // check: both are written when the run ends.
        Target::Special(_) => return Ok(()),
        Target::File(p) => p,
    };
    if p.exists() {
        OpenOptions::new()
            .append(true)
            .open(&p)
            .with_context(|| format!("{flag} {}: cannot write", path.display()))?;
        return Ok(());
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "{flag} {}: the directory {} does not exist; create it first",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Runs `write` on a temporary file beside `path`'s target, then renames it into place, so
/// a failure leaves nothing half-written; special files are written directly (see the
/// module docs).
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let r = match target(path)? {
        Target::Special(p) => write(&p),
        Target::File(p) => {
            let name = p.file_name().context("output path has no file name")?;
            let tmp = p.with_file_name(format!(".{}.partial", name.to_string_lossy()));
            register(&tmp, true);
            let r = write(&tmp).and_then(|()| Ok(std::fs::rename(&tmp, &p)?));
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            register(&tmp, false);
            r
        }
    };
    r.with_context(|| format!("cannot write {}", path.display()))
}
