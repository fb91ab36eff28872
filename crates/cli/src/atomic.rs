//! Output files: written whole or not at all, and never replacing what the path points at.
//! Shared by the examples' runner and kvbench; where a path leads is `outpath`'s.
//!
//! * A new path or a regular file: written to a temporary beside it and renamed into place.
//!   The temporary is created exclusively, never through a link, under an unpredictable name
//!   (the `tempfile` crate), so nothing planted at a guessable name is followed.
//! * A symbolic link: written through to its final target, atomically there (the link
//!   stays a link).
//! * A device file, FIFO or socket (`/dev/null`, `/dev/full`, a named pipe): written in
//!   place (appending), with write errors (`/dev/full`: no space) reported; never renamed
//!   over.
//! * A descriptor of this process (`/dev/stdout`, `/dev/fd/63`, `/proc/self/fd/N`): written
//!   through a duplicate of it, after what the run printed there — a redirected file keeps
//!   its contents, a pipe gets the output.
//!
//! Paths are checked before any work ([`check_output`]); a run's outputs are staged and put
//! in place together ([`Staged`]), so one failing output leaves none of the others. Outputs
//! for devices and descriptors are staged in memory (no temporary directory is used);
//! temporaries are registered while they exist, and SIGINT/SIGTERM remove them before the
//! process exits ([`on_signals`]).
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use tempfile::NamedTempFile;

use crate::outpath::{target, writable_descriptor, Target};

/// Temporaries being written now.
static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes the temporaries on SIGINT/SIGTERM, then exits with 130 (the disk tier's files
/// are unlinked from the start and need nothing). Call once at start-up.
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

/// Checks, before any work, that `path` can be written as the output of `flag`: not a
/// directory, in a directory that exists, writable when it exists; a descriptor path names
/// a descriptor open for writing. Touches nothing.
pub fn check_output(path: &Path, flag: &str) -> Result<()> {
    let p = match target(path).with_context(|| flag.to_string())? {
        Target::Special(p) => return check_special(&p, path, flag),
        Target::Descriptor(fd) => {
            writable_descriptor(fd, path).with_context(|| flag.to_string())?;
            return Ok(());
        }
        Target::File(p) => p,
    };
    if p.exists() {
        if let Err(e) = OpenOptions::new().append(true).open(&p) {
            bail!(
                "{flag} {}: cannot write it ({e}); give a path you can write, or make the file writable",
                path.display()
            );
        }
        return Ok(());
    }
    let dir = parent_dir(&p);
    if !dir.is_dir() {
        bail!(
            "{flag} {}: the directory {} does not exist; create it first (`mkdir -p {}`), or give a path in a directory that exists",
            path.display(),
            dir.display(),
            dir.display()
        );
    }
    // Where the temporary and the file will be made: asked of the kernel, which also
    // answers for a read-only file system (EROFS), without making anything.
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: `c` is a NUL-terminated path; access only reads it.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        bail!(
            "{flag} {}: cannot create files in {} ({}); give a path in a directory you can write",
            path.display(),
            dir.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// A device, FIFO or socket named as an output: a socket cannot be written through its
/// path, a device must open for writing now; a FIFO is left alone (opening it would hand
/// its reader an empty stream; it is written when the run ends).
fn check_special(p: &Path, shown: &Path, flag: &str) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let kind = std::fs::metadata(p)
        .with_context(|| format!("{flag} {}", shown.display()))?
        .file_type();
    if kind.is_socket() {
        bail!("{flag} {} is a socket; give a file path", shown.display());
    }
    if kind.is_char_device() || kind.is_block_device() {
        OpenOptions::new()
            .append(true)
            .open(p)
            .with_context(|| format!("{flag} {}: cannot write", shown.display()))?;
    }
    Ok(())
}

fn parent_dir(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// A run's outputs, staged: each is written to a temporary first, and only when every one
/// has been written are they put in place, so that a failing output (a full disk, a closed
/// FIFO) leaves none of the others behind. Dropped uncommitted, it removes its temporaries.
#[derive(Default)]
pub struct Staged {
    items: Vec<Staging>,
}

/// One staged output.
struct Staging {
    /// The path as the user gave it (for messages).
    shown: PathBuf,
    content: Content,
}

/// What an output was staged into, by where it goes.
enum Content {
    /// A temporary beside the regular file `to`, renamed over it at commit.
    File { tmp: NamedTempFile, to: PathBuf },
    /// Bytes for a device or FIFO at this path, written in place at commit.
    Special { bytes: Vec<u8>, to: PathBuf },
    /// Bytes for this process's open descriptor, written through it at commit.
    Descriptor { bytes: Vec<u8>, fd: i32 },
}

impl Staged {
    /// Nothing staged yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stages `path`'s content, produced by `write`: into an exclusive temporary beside its
    /// target for a regular file (renamed into place by [`commit`](Self::commit)), in
    /// memory for a device, FIFO or descriptor (written there by `commit`).
    pub fn add(
        &mut self,
        path: &Path,
        write: impl FnOnce(&mut dyn Write) -> Result<()>,
    ) -> Result<()> {
        let shown = path.to_path_buf();
        let fail = || format!("cannot write {}", path.display());
        let content = match target(path).with_context(fail)? {
            Target::File(to) => {
                let mut tmp = temporary_beside(&to).with_context(fail)?;
                // Registered before it is written, so a signal mid-write removes it.
                register(tmp.path(), true);
                let written = {
                    let mut out = std::io::BufWriter::new(tmp.as_file_mut());
                    write(&mut out).and_then(|()| Ok(out.flush()?))
                };
                if let Err(e) = written {
                    register(tmp.path(), false);
                    return Err(e.context(fail())); // `tmp` removes itself
                }
                Content::File { tmp, to }
            }
            Target::Special(to) => {
                let mut bytes = Vec::new();
                write(&mut bytes).with_context(fail)?;
                Content::Special { bytes, to }
            }
            Target::Descriptor(fd) => {
                let mut bytes = Vec::new();
                write(&mut bytes).with_context(fail)?;
                Content::Descriptor { bytes, fd }
            }
        };
        self.items.push(Staging { shown, content });
        Ok(())
    }

    /// Puts every staged output in place: devices, FIFOs and descriptors first (the outputs
    /// that can still fail), then the renames.
    pub fn commit(mut self) -> Result<()> {
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        for item in &self.items {
            let shown = &item.shown;
            let written = match &item.content {
                Content::File { .. } => continue,
                Content::Special { bytes, to } => OpenOptions::new()
                    .append(true)
                    .open(to)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(anyhow::Error::from),
                Content::Descriptor { bytes, fd } => {
                    writable_descriptor(*fd, shown).and_then(|mut f| Ok(f.write_all(bytes)?))
                }
            };
            written.with_context(|| format!("cannot write {}", shown.display()))?;
        }
        for item in std::mem::take(&mut self.items) {
            if let Content::File { tmp, to } = item.content {
                let at = tmp.path().to_path_buf();
                let r = tmp.persist(&to);
                register(&at, false);
                r.map_err(|e| e.error)
                    .with_context(|| format!("cannot write {}", item.shown.display()))?;
            }
        }
        Ok(())
    }
}

/// An exclusive temporary in `to`'s directory, named `.NAME.XXXXXX.partial`, with the
/// permissions `to` has (a new file: 0666 less the umask, as `File::create` would give).
fn temporary_beside(to: &Path) -> Result<NamedTempFile> {
    let name = to.file_name().context("output path has no file name")?;
    // Short enough for any file-name limit.
    let name: String = name.to_string_lossy().chars().take(64).collect();
    let mode = std::fs::metadata(to)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0o666);
    Ok(tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".partial")
        .permissions(std::fs::Permissions::from_mode(mode))
        .tempfile_in(parent_dir(to))?)
}

impl Drop for Staged {
    fn drop(&mut self) {
        for item in self.items.drain(..) {
            if let Content::File { tmp, .. } = item.content {
                register(tmp.path(), false);
                // NamedTempFile's own Drop removes the file.
            }
        }
    }
}

/// Writes one output with `write`, whole or not at all (a [`Staged`] of one; kvbench's).
#[allow(dead_code)] // the examples' runner stages several outputs instead
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let mut staged = Staged::new();
    staged.add(path, write)?;
    staged.commit()
}
