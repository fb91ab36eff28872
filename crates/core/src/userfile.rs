//! Reading the files a user names (config.json, tokenizer files, a prompts file, a cost
//! profile, safetensors headers): only regular files — a FIFO is refused at once instead of
//! blocking, a device such as `/dev/zero` instead of filling memory — and whole files only
//! up to a cap that names itself in the error. Refusals are `InvalidInput` I/O errors whose
//! message is the whole sentence; crates map them to their own error types.
use std::fs::File;
use std::io::{Error, ErrorKind, Read, Result};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` for reading when it is a regular file (symbolic links followed); `what`
/// names it in the error (e.g. "--tokenizer", "the weight file").
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    // Non-blocking, so that opening a FIFO returns at once (to be refused below) instead of
    // waiting for a writer; for a regular file the flag changes nothing.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = f.metadata()?.file_type();
    if kind.is_file() {
        return Ok(f);
    }
    let is = if kind.is_dir() {
        "is a directory"
    } else {
        "is not a regular file (a FIFO, socket or device)"
    };
    Err(Error::new(
        ErrorKind::InvalidInput,
        format!("{what} {} {is}; give a regular file", path.display()),
    ))
}

/// The whole of the regular file `path`, refused when it holds more than `cap` bytes.
pub fn read_capped(path: &Path, what: &str, cap: u64) -> Result<Vec<u8>> {
    let f = open_regular(path, what)?;
    let mut bytes = Vec::new();
    f.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        let cap_mib = cap >> 20;
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{what} {} is larger than {cap_mib} MiB, the most read of such a file; check it is the right file, or give one under {cap_mib} MiB",
                path.display(),
            ),
        ));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(path: &Path, what: &str, cap: u64) -> Result<String> {
    String::from_utf8(read_capped(path, what, cap)?).map_err(|_| {
        Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{what} {} is not UTF-8 text; give the right file",
                path.display()
            ),
        )
    })
}
