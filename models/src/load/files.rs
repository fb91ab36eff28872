//! The model files a user names, read through [`kvpolicy_core::userfile`] (regular files
//! only, under a cap that names itself), with its refusals as [`ModelError::Input`].
use std::fs::File;
use std::path::Path;

use kvpolicy_core::userfile;

use crate::error::{ModelError, Result};

/// The most bytes read of a config.json.
pub const CONFIG_CAP: u64 = 16 << 20;
/// The most bytes read of a tokenizer.json or tokenizer_config.json (the largest on the
/// hub are tens of MiB).
pub const TOKENIZER_CAP: u64 = 256 << 20;

/// A refusal as it stands; another I/O error as one line naming `what` and `path` (its
/// cause in the text, not as a source printed a second time).
fn mapped(path: &Path, what: &str, e: std::io::Error) -> ModelError {
    match e.kind() {
        std::io::ErrorKind::InvalidInput => ModelError::Input(e.to_string().into()),
        _ => ModelError::Input(format!("cannot read {what} {}: {e}", path.display()).into()),
    }
}

/// [`userfile::open_regular`].
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    userfile::open_regular(path, what).map_err(|e| mapped(path, what, e))
}

/// [`userfile::read_text_capped`].
pub fn read_text_capped(path: &Path, what: &str, cap: u64) -> Result<String> {
    userfile::read_text_capped(path, what, cap).map_err(|e| mapped(path, what, e))
}
