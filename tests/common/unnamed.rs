//! The disk tier's files have no name (created unlinked): tests find them through the
//! descriptors a process holds, `/proc/PID/fd/N` links that read `DIR/… (deleted)`.
use std::path::{Path, PathBuf};

use anyhow::Result;

/// The `/proc/PID/fd/N` links of process `pid` (`"self"` for this one) open on unnamed
/// files in `dir`, one per file: the disk tier's live files. Each can be opened (e.g. to
/// damage it).
pub fn unnamed_files(pid: &str, dir: &Path) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let dir = dir.canonicalize()?;
    let mut v = Vec::new();
    // A direct read holds a second descriptor of the same file for its length: one link
    // per file (inode).
    let mut seen = std::collections::HashSet::new();
    let fds = Path::new("/proc").join(pid).join("fd");
    for e in std::fs::read_dir(&fds)? {
        let link = e?.path();
        // A descriptor may close between the listing and the read.
        let Ok(to) = std::fs::read_link(&link) else {
            continue;
        };
        let to = to.to_string_lossy().into_owned();
        if let Some(file) = to.strip_suffix(" (deleted)") {
            let inode = std::fs::metadata(&link).map(|m| m.ino());
            if Path::new(file).parent() == Some(dir.as_path())
                && inode.is_ok_and(|i| seen.insert(i))
            {
                v.push(link);
            }
        }
    }
    Ok(v)
}
