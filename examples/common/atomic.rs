//! Output files: written whole or not at all, and never replacing what the path points at.
//! Shared by the examples' runner and kvbench.
//!
//! * A new path or a regular file: written to a temporary beside it and renamed into place.
//! * A symbolic link: written through to its final target, atomically there (the link
//!   stays a link).
//! * A device file, FIFO or socket (`/dev/null`, `/dev/full`, a pipe): written directly, with
//!   write errors (`/dev/full`: no space) reported; it is never renamed over.
//!
//! Paths are checked before any work ([`check_output`]); a run's outputs are staged and put
//! in place together ([`Staged`]), so one failing output leaves none of the others;
//! temporaries are registered while they exist, and SIGINT/SIGTERM remove them before the
//! process exits ([`on_signals`]).
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

/// Numbers the temporaries of this process.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Temporaries being written now.
static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes the temporaries and the disk tier's files on SIGINT/SIGTERM, then exits with 130. Call
/// once at start-up.
pub fn on_signals() {
    let _ = ctrlc::set_handler(|| {
        kvpolicy::core::tiered::remove_disk_files();
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

/// A run's outputs, staged: each is written to a temporary first, and only when every one
/// has been written are they put in place, so that a failing output (a full disk, a closed
/// FIFO) leaves none of the others behind. Dropped uncommitted, it removes its temporaries.
#[derive(Default)]
pub struct Staged {
    items: Vec<Staging>,
}

struct Staging {
    /// The path as the user gave it (for messages).
    shown: PathBuf,
    tmp: PathBuf,
    target: Target,
}

impl Staged {
    /// Nothing staged yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes `path`'s content with `write` into a temporary: beside its target for a
    /// regular file (renamed into place by [`commit`](Self::commit)), in the system's
    /// temporary directory for a device or FIFO (copied into it by `commit`).
    pub fn add(&mut self, path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
        let target = target(path).with_context(|| format!("cannot write {}", path.display()))?;
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = match &target {
            Target::File(p) => {
                let name = p.file_name().context("output path has no file name")?;
                // Short enough for any file-name limit, unique within the process.
                let name: String = name.to_string_lossy().chars().take(64).collect();
                p.with_file_name(format!(".{name}.{}-{n}.partial", std::process::id()))
            }
            Target::Special(_) => {
                std::env::temp_dir().join(format!("kvpolicy-{}-{n}.partial", std::process::id()))
            }
        };
        register(&tmp, true);
        self.items.push(Staging {
            shown: path.to_path_buf(),
            tmp: tmp.clone(),
            target,
        });
        write(&tmp).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Puts every staged output in place: devices and FIFOs first (the outputs that can
    /// still fail), then the renames.
    pub fn commit(mut self) -> Result<()> {
        for item in &self.items {
            if let Target::Special(p) = &item.target {
                let bytes = std::fs::read(&item.tmp)?;
                OpenOptions::new()
                    .write(true)
                    .open(p)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
                    .with_context(|| format!("cannot write {}", item.shown.display()))?;
            }
        }
        for item in std::mem::take(&mut self.items) {
            let r = match &item.target {
                Target::File(p) => std::fs::rename(&item.tmp, p),
                Target::Special(_) => Ok(()),
            };
            let _ = std::fs::remove_file(&item.tmp);
            register(&item.tmp, false);
            r.with_context(|| format!("cannot write {}", item.shown.display()))?;
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for item in &self.items {
            let _ = std::fs::remove_file(&item.tmp);
            register(&item.tmp, false);
        }
    }
}

/// Writes one output with `write`, whole or not at all (a [`Staged`] of one; kvbench's).
#[allow(dead_code)] // the examples' runner stages several outputs instead
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut staged = Staged::new();
    staged.add(path, write)?;
    staged.commit()
}
