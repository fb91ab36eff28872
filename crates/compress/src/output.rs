//! The output directory, written whole or not at all: checked before any work (a new path,
//! or an empty directory; never a link, a file, or a directory with contents), filled
//! inside a temporary directory beside it, and renamed into place at the end. An
//! interrupted run (an error, SIGINT, SIGTERM) removes the temporary.
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

/// Checks that `out` can be created (or is an empty directory to fill).
pub fn check_output(out: &Path) -> Result<()> {
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.file_type().is_symlink() => Err(refuse(
            out,
            "is a symbolic link; give --out a new directory",
        )),
        Ok(m) if !m.is_dir() => Err(refuse(
            out,
            "exists and is not a directory; give --out a new directory",
        )),
        Ok(_) => {
            let mut entries = std::fs::read_dir(out).map_err(|e| CompressError::io(out, e))?;
            if entries.next().is_some() {
                return Err(refuse(
                    out,
                    "exists and is not empty; give --out a new or empty directory (nothing is overwritten)",
                ));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = parent_of(out);
            if !parent.is_dir() {
                return Err(refuse(
                    out,
                    "its parent directory does not exist; create it first",
                ));
            }
            Ok(())
        }
        Err(e) => Err(CompressError::io(out, e)),
    }
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
