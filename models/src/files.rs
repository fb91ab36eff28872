//! Reading the files a user names (config.json, tokenizer.json, tokenizer_config.json, a
//! prompts file, safetensors headers): only regular files — a FIFO is refused at once
//! instead of blocking, a device such as `/dev/zero` instead of filling memory — and whole
//! files only up to a cap that names itself in the error.
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{ModelError, Result};

/// The most bytes read of a config.json.
pub const CONFIG_CAP: u64 = 16 << 20;
/// The most bytes read of a tokenizer.json or tokenizer_config.json (the largest on the
/// hub are tens of MiB).
pub const TOKENIZER_CAP: u64 = 256 << 20;

/// Opens `path` for reading when it is a regular file (symbolic links followed); `what`
/// names it in the error (e.g. "--tokenizer", "the weight file").
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    // Non-blocking, so that opening a FIFO returns at once (to be refused below) instead of
    // waiting for a writer; for a regular file the flag changes nothing.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| ModelError::io(path, e))?;
    let kind = f
        .metadata()
        .map_err(|e| ModelError::io(path, e))?
        .file_type();
    if kind.is_file() {
        return Ok(f);
    }
    let is = if kind.is_dir() {
        "is a directory"
    } else {
        "is not a regular file (a FIFO, socket or device)"
    };
    Err(ModelError::Input(format!(
        "{what} {} {is}; give a regular file",
        path.display()
    )))
}

/// The whole of the regular file `path`, refused when it holds more than `cap` bytes.
pub fn read_capped(path: &Path, what: &str, cap: u64) -> Result<Vec<u8>> {
    let f = open_regular(path, what)?;
    let mut bytes = Vec::new();
    f.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ModelError::io(path, e))?;
    if bytes.len() as u64 > cap {
        return Err(ModelError::Input(format!(
            "{what} {} is larger than {} MiB, the most read of such a file; give the right file",
            path.display(),
            cap >> 20
        )));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(path: &Path, what: &str, cap: u64) -> Result<String> {
    String::from_utf8(read_capped(path, what, cap)?).map_err(|_| {
        ModelError::Input(format!(
            "{what} {} is not UTF-8 text; give the right file",
            path.display()
        ))
    })
}
