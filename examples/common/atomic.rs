//! Output files written whole or not at all: shared by the examples' runner and kvbench.
use std::path::Path;

use anyhow::{Context, Result};

/// Runs `write` on a temporary file beside `path`, then renames it into place, so a failure
/// leaves nothing half-written.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.file_name().context("output path has no file name")?;
    let tmp = path.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    let r = write(&tmp)
        .and_then(|()| Ok(std::fs::rename(&tmp, path)?))
        .with_context(|| format!("cannot write {}", path.display()));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}
