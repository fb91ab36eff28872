//! The output directory, written whole or not at all: checked before any work (a new path,
//! or an empty directory, in a parent directory this process can write; never a symbolic
//! link — dangling, or named with a trailing slash —, a file, or a directory with
//! contents), filled inside a temporary directory beside it, and renamed into place at the
//! end. An interrupted run (an error, SIGINT, SIGTERM) removes the temporary.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::error::{CompressError, Result};

/// The temporary being filled now, for the signal handler.
static TEMP: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Removes the temporary on SIGINT/SIGTERM and exits with 130. Call once at start-up.
pub fn on_signals() {
    let _ = ctrlc::set_handler(|| {
        if let Ok(t) = TEMP.lock() {
            if let Some(p) = t.as_ref() {
                // The main thread may still be adding a file: try again if one appeared.
                for _ in 0..3 {
                    if std::fs::remove_dir_all(p).is_ok() || !p.exists() {
                        break;
                    }
                }
            }
        }
        std::process::exit(130);
    });
}

fn refuse(path: &Path, why: &str) -> CompressError {
    CompressError::Output {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

/// `out` without trailing slashes (with one, the OS would follow a symbolic link named
/// `out` and look at its target).
fn bare(out: &Path) -> PathBuf {
    match (out.parent(), out.file_name()) {
        (Some(p), Some(name)) => p.join(name),
        _ => out.to_path_buf(),
    }
}

/// Checks, before any work, that `out` can be created (or is an empty directory to fill):
/// not a symbolic link (dangling or not, with or without a trailing slash), not a file,
/// not a directory with contents, in an existing parent directory this process can write.
pub fn check_output(out: &Path) -> Result<()> {
    let path = bare(out);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(refuse(
                out,
                "is a symbolic link; give --out a new directory (the converted model is written there, never through a link)",
            ))
        }
        Ok(m) if !m.is_dir() => {
            return Err(refuse(
                out,
                "exists and is not a directory; give --out a new directory",
            ))
        }
        Ok(_) => {
            let mut entries = std::fs::read_dir(&path).map_err(|e| CompressError::io(out, e))?;
            if entries.next().is_some() {
                return Err(refuse(
                    out,
                    "exists and is not empty; give --out a new or empty directory (nothing is overwritten)",
                ));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            // A component of the path is a file.
            return Err(refuse(
                out,
                "cannot be created: its parent is not a directory; give --out a path in a directory",
            ));
        }
        Err(e) => {
            return Err(refuse(
                out,
                &format!("cannot be checked ({e}); give --out a new directory you can write"),
            ))
        }
    }
    check_parent(out, &parent_of(&path))
}

/// Refuses `out` when its `parent` is not an existing directory this process can write
/// (tried: a temporary created and removed at once).
fn check_parent(out: &Path, parent: &Path) -> Result<()> {
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(refuse(
            out,
            "cannot be created: its parent is not a directory; give --out a path in a directory",
        )),
        Err(_) => {
            return Err(refuse(
                out,
                "its parent directory does not exist; create it first",
            ))
        }
    }
    tempfile::Builder::new()
        .prefix(".kvpolicy-compress-")
        .tempdir_in(parent)
        .map(drop)
        .map_err(|e| {
            refuse(
                out,
                &format!(
                    "cannot be written: its parent directory {} refuses a new entry ({}); give --out a path in a directory you can write",
                    parent.display(),
                    e.kind()
                ),
            )
        })
}

fn parent_of(out: &Path) -> PathBuf {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `ck` as an HF directory at `out` (`model.safetensors`, `config.json`, its files).
pub fn write(ck: &Checkpoint, out: &Path) -> Result<()> {
    check_output(out)?;
    let out = &bare(out);
    let parent = parent_of(out);
    let tmp = tempfile::Builder::new()
        .prefix(".kvpolicy-compress-")
        .tempdir_in(&parent)
        .map_err(|e| CompressError::io(&parent, e))?;
    if let Ok(mut t) = TEMP.lock() {
        *t = Some(tmp.path().to_path_buf());
    }
    let result = fill(ck, tmp.path()).and_then(|()| {
        if out.is_dir() {
            // Checked empty above; `rename` replaces an empty directory.
            std::fs::remove_dir(out).map_err(|e| CompressError::io(out, e))?;
        }
        std::fs::rename(tmp.path(), out).map_err(|e| CompressError::io(out, e))
    });
    if let Ok(mut t) = TEMP.lock() {
        *t = None;
    }
    match result {
        Ok(()) => {
            // Renamed: nothing left at the temporary's path to remove.
            let _ = tmp.keep();
            Ok(())
        }
        Err(e) => Err(e), // `tmp` drops here and removes what was written.
    }
}

fn fill(ck: &Checkpoint, dir: &Path) -> Result<()> {
    let weights = dir.join("model.safetensors");
    let tensors: HashMap<String, candle_core::Tensor> = ck.tensors.clone().into_iter().collect();
    // HF's loaders read the metadata's `format` (PyTorch's `save_pretrained` writes "pt").
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(&tensors, Some(metadata), &weights)
        .map_err(|e| CompressError::io(&weights, std::io::Error::other(e.to_string())))?;
    let config = dir.join("config.json");
    let text = serde_json::to_string_pretty(&Value::Object(ck.config.clone()))
        .map_err(|e| CompressError::Checkpoint(e.to_string()))?;
    std::fs::write(&config, text + "\n").map_err(|e| CompressError::io(&config, e))?;
    for f in &ck.files {
        let p = dir.join(&f.name);
        std::fs::write(&p, &f.bytes).map_err(|e| CompressError::io(&p, e))?;
    }
    // The temporary was created private (0700); the output is an ordinary directory.
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir).map_err(|e| CompressError::io(dir, e))? {
        let p = entry.map_err(|e| CompressError::io(dir, e))?.path();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| CompressError::io(&p, e))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| CompressError::io(dir, e))
}
