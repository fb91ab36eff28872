//! The file tier of the prefix cache: one file per chunk, named by its key, in a directory
//! the user names, up to a byte budget (least recently used evicted first; a file's
//! modification time records its last use, so processes sharing the directory see each
//! other's). Files are written whole before they get their name — an unnamed file
//! (`O_TMPFILE`) linked in, or a temporary renamed — so that no reader ever sees half a
//! chunk, and created with mode 0666 less the process's umask. Reads open names without
//! following symbolic links (`O_NOFOLLOW`), take only regular files, and go past the page
//! cache (`O_DIRECT` into page-aligned buffers) unless asked not to; a file that fails its
//! checks is removed and counted as damaged: a miss, never wrong K/V.
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use kvpolicy_core::DiskIo;

use crate::chunk::{self, ChunkKv, ALIGN};
use crate::error::{PrefixError, Result};
use crate::key::{ChunkKey, Fingerprint};

/// The suffix of chunk files.
const SUFFIX: &str = ".kvc";
/// The prefix of chunk files being written.
const TEMP_PREFIX: &str = ".kvc-";
/// A temporary older than this was left by a process that died while writing it.
const STALE: std::time::Duration = std::time::Duration::from_secs(3600);
/// The largest chunk file read (a damaged length must not allocate without bound).
const MAX_FILE: u64 = 16 << 30;

struct Entry {
    bytes: u64,
    used: u64,
}

/// Counters of the file tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounts {
    /// Bytes of the chunk files this tier knows of.
    pub bytes: u64,
    /// Chunk files known.
    pub files: u64,
    /// Files removed to stay within the budget.
    pub evictions: u64,
    /// Files that failed their checks (removed).
    pub damaged: u64,
}

/// Chunk files under a directory, within a byte budget.
pub struct DiskTier {
    dir: PathBuf,
    budget: u64,
    io: DiskIo,
    tick: u64,
    counts: DiskCounts,
    entries: HashMap<ChunkKey, Entry>,
}

/// The key a chunk file's name spells, if it is one.
fn key_of(name: &str) -> Option<ChunkKey> {
    let hex = name.strip_suffix(SUFFIX)?;
    if hex.len() != 64 {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(ChunkKey(key))
}

impl DiskTier {
    /// Opens (creating it if needed) the directory `dir`, indexes the chunk files already
    /// there (other entries are left alone; symbolic links are not followed) and evicts
    /// down to `budget`.
    pub fn open(dir: &Path, budget: u64, io: DiskIo) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| PrefixError::io("cannot create the prefix cache directory", dir, e))?;
        let mut found = Vec::new();
        let listing = std::fs::read_dir(dir)
            .map_err(|e| PrefixError::io("cannot read the prefix cache directory", dir, e))?;
        for entry in listing.flatten() {
            let name = entry.file_name();
            let name = name.to_str().unwrap_or_default();
            if name.starts_with(TEMP_PREFIX) {
                sweep_stale(&entry);
            }
            let Some(key) = key_of(name) else {
                continue;
            };
            // `DirEntry::metadata` does not follow symbolic links.
            let Ok(meta) = entry.metadata() else { continue };
            if meta.file_type().is_file() {
                let at = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                found.push((at, key, meta.len()));
            }
        }
        found.sort();
        let mut tier = Self {
            dir: dir.to_path_buf(),
            budget,
            io,
            tick: 0,
            counts: DiskCounts::default(),
            entries: HashMap::new(),
        };
        for (_, key, bytes) in found {
            tier.index(key, bytes);
        }
        tier.evict_for(0);
        // A directory we cannot write fails here, before any prefill.
        tempfile::tempfile_in(dir)
            .map_err(|e| PrefixError::io("cannot write in the prefix cache directory", dir, e))?;
        Ok(tier)
    }

    fn path(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX}", key.hex()))
    }

    fn index(&mut self, key: ChunkKey, bytes: u64) {
        self.tick += 1;
        if let Some(old) = self.entries.insert(
            key,
            Entry {
                bytes,
                used: self.tick,
            },
        ) {
            self.counts.bytes -= old.bytes;
            self.counts.files -= 1;
        }
        self.counts.bytes += bytes;
        self.counts.files += 1;
    }

    fn forget(&mut self, key: &ChunkKey) {
        if let Some(e) = self.entries.remove(key) {
            self.counts.bytes -= e.bytes;
            self.counts.files -= 1;
        }
    }

    /// Removes least recently used files until `incoming` more bytes fit the budget.
    fn evict_for(&mut self, incoming: u64) {
        while self.counts.bytes + incoming > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| *k)
            else {
                break;
            };
            // Already gone (another process evicted it) is as good as removed.
            let _ = std::fs::remove_file(self.path(&oldest));
            self.forget(&oldest);
            self.counts.evictions += 1;
        }
    }

    /// Opens `path` for reading without following a symbolic link, past the page cache
    /// when asked and the file system allows.
    fn open_chunk(&self, path: &Path) -> std::io::Result<File> {
        let open = |direct: bool| {
            let mut flags = libc::O_NOFOLLOW | libc::O_NONBLOCK;
            if direct {
                flags |= libc::O_DIRECT;
            }
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(path)
        };
        match self.io {
            // tmpfs refuses O_DIRECT (EINVAL): read through the page cache there.
            DiskIo::Direct => match open(true) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(false),
                other => other,
            },
            DiskIo::Buffered => open(false),
        }
    }

    /// The chunk under `key` of model `fp`, or `None`: absent, not a regular file,
    /// unreadable (left alone), or damaged — then removed. A hit marks the file as just used.
    pub fn get(&mut self, fp: &Fingerprint, key: &ChunkKey) -> Result<Option<ChunkKv>> {
        let path = self.path(key);
        let file = match self.open_chunk(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(key);
                return Ok(None);
            }
            // A symbolic link (ELOOP) or anything unreadable is not ours to read.
            Err(_) => return Ok(None),
        };
        let meta = file
            .metadata()
            .map_err(|e| PrefixError::io("cannot stat", &path, e))?;
        if !meta.file_type().is_file() {
            return Ok(None);
        }
        let len = meta.len();
        let _span = tracing::debug_span!("chunk_read", bytes = len).entered();
        let decoded = if len % ALIGN as u64 != 0 || len > MAX_FILE {
            Err(chunk::Damage("a length that is no chunk file's".into()))
        } else {
            let decode = |b: &[u8]| {
                let _span = tracing::debug_span!("chunk_decode").entered();
                chunk::decode(b, fp, key)
            };
            match with_bytes(&file, len as usize, decode) {
                Ok(d) => d,
                // An I/O error says nothing about the file's bytes: a miss, the file kept.
                Err(e) => {
                    tracing::warn!("prefix cache: cannot read {}: {e}", path.display());
                    return Ok(None);
                }
            }
        };
        match decoded {
            Ok(chunk) => {
                // The use is recorded for other processes' eviction order too.
                let _ = file.set_modified(SystemTime::now());
                self.index(*key, len);
                // A file another process wrote may take this index past the budget.
                self.evict_for(0);
                Ok(Some(chunk))
            }
            Err(_) => {
                let _ = std::fs::remove_file(&path);
                self.forget(key);
                self.counts.damaged += 1;
                Ok(None)
            }
        }
    }

    /// Writes `chunk` under `key` (whole, then named), evicting least recently used files
    /// to stay within the budget; a chunk larger than the budget is not written. Returns
    /// whether it was.
    pub fn put(&mut self, fp: &Fingerprint, key: &ChunkKey, chunk: &ChunkKv) -> Result<bool> {
        let bytes = chunk::encode(fp, key, chunk)?;
        let len = bytes.len() as u64;
        if len > self.budget {
            return Ok(false);
        }
        self.forget(key);
        self.evict_for(len);
        let path = self.path(key);
        let mut tmp = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .suffix(".part")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .tempfile_in(&self.dir)
            .map_err(|e| PrefixError::io("cannot create a chunk file in", &self.dir, e))?;
        tmp.write_all(&bytes)
            .map_err(|e| PrefixError::io("cannot write a chunk file in", &self.dir, e))?;
        // Renamed over any file of the same name (another process's copy of the same
        // chunk: the same bytes).
        tmp.persist(&path)
            .map_err(|e| PrefixError::io("cannot name the chunk file", &path, e.error))?;
        self.index(*key, len);
        Ok(true)
    }

    /// Whether a file for `key` is known (not read; another process may have removed it).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The counters.
    pub fn counts(&self) -> DiskCounts {
        self.counts
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Removes `entry`, a temporary chunk file, when no process can still be writing it.
fn sweep_stale(entry: &std::fs::DirEntry) {
    let old = entry
        .metadata()
        .ok()
        .filter(|m| m.file_type().is_file())
        .and_then(|m| m.modified().ok())
        .and_then(|at| at.elapsed().ok())
        .is_some_and(|age| age > STALE);
    if old {
        let _ = std::fs::remove_file(entry.path());
    }
}

/// A page-aligned byte buffer (direct reads need aligned memory).
#[repr(C, align(4096))]
#[derive(Clone, Copy)]
struct Page([u8; ALIGN]);

/// `f` of the first `len` bytes of `file` (a multiple of [`ALIGN`]), read into a
/// page-aligned buffer.
fn with_bytes<R>(file: &File, len: usize, f: impl FnOnce(&[u8]) -> R) -> std::io::Result<R> {
    let mut pages = vec![Page([0; ALIGN]); len / ALIGN];
    // SAFETY: `pages` holds `len` initialised bytes, page-aligned, borrowed by `buf` alone
    // until `f` returns.
    let buf = unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), len) };
    file.read_exact_at(buf, 0)?;
    Ok(f(buf))
}
