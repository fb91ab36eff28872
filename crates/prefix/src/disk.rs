//! The file tier of the prefix cache: one file per chunk, named by its key, in a directory
//! the user names and no one else can write ([`crate::trust`]), up to a byte budget (least
//! recently used evicted first, never the chunks before a new one in its prompt; a file's
//! modification time records its last use, so processes sharing the directory see each
//! other's). Files are written whole to a temporary of a name only this cache gives
//! (`.kvc-tmp-PID-RANDOM.part`) and renamed, so that no reader ever sees half a chunk, with
//! mode 0644 less the process's umask. Reads open names without following symbolic links
//! (`O_NOFOLLOW`), take only regular files that only this user can write, read and check
//! the header page first — every field against what the cache expects, its length against
//! the file's — and only then the payload, in bounded pieces, past the page cache
//! (`O_DIRECT` into page-aligned buffers) unless asked not to; a file that fails a check is
//! removed and counted as damaged: a miss, never wrong K/V.
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use kvpolicy_core::DiskIo;

use crate::chunk::{self, ChunkKv, Damage, Expect, ALIGN};
use crate::error::{PrefixError, Result};
use crate::header::{Header, HEADER_PAGE};
use crate::key::{ChunkKey, Fingerprint};
use crate::lru::Lru;
use crate::trust;

/// The suffix of chunk files.
const SUFFIX: &str = ".kvc";
/// The prefix of the temporaries chunk files are written to; the process id and a dash
/// follow, then [`TEMP_RANDOM`] random letters and digits, then [`TEMP_SUFFIX`].
const TEMP_PREFIX: &str = ".kvc-tmp-";
/// Random characters in a temporary's name.
const TEMP_RANDOM: usize = 8;
/// The suffix of temporaries.
const TEMP_SUFFIX: &str = ".part";
/// A temporary older than this was left by a process that died while writing it.
const STALE: std::time::Duration = std::time::Duration::from_secs(3600);
/// The largest chunk file read (a damaged length must not allocate without bound).
const MAX_FILE: u64 = 16 << 30;

/// Counters of the file tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounts {
    /// Bytes of the chunk files this tier knows of.
    pub bytes: u64,
    /// Chunk files known.
    pub files: u64,
    /// Files removed to stay within the budget.
    pub evictions: u64,
    /// Files that failed their checks, or that others could write (removed).
    pub damaged: u64,
    /// Bytes read from chunk files (headers and payloads).
    pub read_bytes: u64,
}

/// Chunk files under a directory, within a byte budget.
pub struct DiskTier {
    dir: PathBuf,
    io: DiskIo,
    lru: Lru,
    evictions: u64,
    damaged: u64,
    read_bytes: u64,
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

/// Whether `name` is exactly a temporary this cache writes: `.kvc-tmp-PID-RANDOM.part`.
fn is_temporary(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(TEMP_PREFIX)
        .and_then(|r| r.strip_suffix(TEMP_SUFFIX))
    else {
        return false;
    };
    let Some((pid, random)) = rest.split_once('-') else {
        return false;
    };
    (1..=10).contains(&pid.len())
        && pid.bytes().all(|b| b.is_ascii_digit())
        && random.len() == TEMP_RANDOM
        && random.bytes().all(|b| b.is_ascii_alphanumeric())
}

impl DiskTier {
    /// Opens the directory `dir` — created private (0700) if needed; refused when others
    /// can write it ([`PrefixError::Untrusted`]) or this process cannot — indexes the chunk
    /// files already there (other entries are left alone, its own stale temporaries
    /// removed; symbolic links are not followed) and evicts down to `budget`.
    pub fn open(dir: &Path, budget: u64, io: DiskIo) -> Result<Self> {
        trust::create_private_dir(dir)?;
        trust::check_dir(dir)?;
        let mut found = Vec::new();
        let listing = std::fs::read_dir(dir)
            .map_err(|e| PrefixError::io("cannot read the prefix cache directory", dir, e))?;
        for entry in listing.flatten() {
            let name = entry.file_name();
            let name = name.to_str().unwrap_or_default();
            if is_temporary(name) {
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
            io,
            lru: Lru::new(budget),
            evictions: 0,
            damaged: 0,
            read_bytes: 0,
        };
        for (_, key, bytes) in found {
            tier.lru.insert(key, bytes);
        }
        tier.evict(None, 0, &[]);
        // A directory we cannot write fails here, before any prefill.
        tempfile::tempfile_in(dir)
            .map_err(|e| PrefixError::io("cannot write in the prefix cache directory", dir, e))?;
        Ok(tier)
    }

    fn path(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX}", key.hex()))
    }

    /// Removes least recently used files, none of `keep`, until `key` can hold `incoming`
    /// bytes; whether it can.
    fn evict(&mut self, key: Option<&ChunkKey>, incoming: u64, keep: &[ChunkKey]) -> bool {
        let Some(victims) = self.lru.victims(key, incoming, keep) else {
            return false;
        };
        for k in victims {
            // Already gone (another process evicted it) is as good as removed.
            let _ = std::fs::remove_file(self.path(&k));
            self.lru.remove(&k);
            self.evictions += 1;
        }
        true
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
        self.get_after(fp, key, &Expect::default(), &[])
    }

    /// [`DiskTier::get`] of a chunk of the shape `expect` says (another shape is damage),
    /// evicting none of `before` should the index have grown past the budget.
    pub fn get_after(
        &mut self,
        fp: &Fingerprint,
        key: &ChunkKey,
        expect: &Expect,
        before: &[ChunkKey],
    ) -> Result<Option<ChunkKv>> {
        let path = self.path(key);
        let file = match self.open_chunk(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.lru.remove(key);
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
        let _span = tracing::debug_span!("chunk_read", bytes = meta.len()).entered();
        let read = if trust::private(&meta) {
            self.read(&file, meta.len(), fp, key, expect)
        } else {
            // Someone else could have written it: not K/V to believe.
            Ok(Err(Damage("writable by others".into())))
        };
        match read {
            Ok(Ok(chunk)) => {
                // The use is recorded for other processes' eviction order too.
                let _ = file.set_modified(SystemTime::now());
                self.lru.insert(*key, meta.len());
                // A file another process wrote may take this index past the budget.
                self.evict(None, 0, before);
                Ok(Some(chunk))
            }
            Ok(Err(_)) => {
                let _ = std::fs::remove_file(&path);
                self.lru.remove(key);
                self.damaged += 1;
                Ok(None)
            }
            // An I/O error says nothing about the file's bytes: a miss, the file kept.
            Err(e) => {
                tracing::warn!("prefix cache: cannot read {}: {e}", path.display());
                Ok(None)
            }
        }
    }

    /// Reads and checks `file` (`len` bytes): its header page first, then — only when the
    /// header is `key`'s of `fp`, of the expected shape and of the file's length — the
    /// payload in pieces.
    fn read(
        &mut self,
        file: &File,
        len: u64,
        fp: &Fingerprint,
        key: &ChunkKey,
        expect: &Expect,
    ) -> std::io::Result<std::result::Result<ChunkKv, Damage>> {
        if !len.is_multiple_of(ALIGN as u64) || len > MAX_FILE || len < HEADER_PAGE as u64 {
            return Ok(Err(Damage("a length that is no chunk file's".into())));
        }
        let mut page = Pages::new(HEADER_PAGE);
        file.read_exact_at(page.bytes(), 0)?;
        self.read_bytes += HEADER_PAGE as u64;
        let header = match Header::parse(page.bytes()) {
            Ok(h) => h,
            Err(d) => return Ok(Err(d)),
        };
        if let Err(d) = header.check(fp, key, expect, len) {
            return Ok(Err(d));
        }
        let _span = tracing::debug_span!("chunk_decode").entered();
        let padded = (len as usize) - HEADER_PAGE;
        let mut pages = Pages::new(padded);
        let base = HEADER_PAGE as u64;
        let mut read_at = |buf: &mut [u8], at: u64| file.read_exact_at(buf, base + at);
        let checked = header.read_payload(pages.bytes(), &mut read_at)?;
        self.read_bytes += padded as u64;
        Ok(checked
            .and_then(|()| ChunkKv::from_payload(&pages.bytes()[..header.payload], &header.shape)))
    }

    /// Writes `chunk` under `key` (whole, then named), evicting least recently used files
    /// to stay within the budget; a chunk larger than the budget is not written. Returns
    /// whether it was.
    pub fn put(&mut self, fp: &Fingerprint, key: &ChunkKey, chunk: &ChunkKv) -> Result<bool> {
        self.put_after(fp, &[], key, chunk)
    }

    /// [`DiskTier::put`], evicting none of `before` (the chunks before `key` in its prompt):
    /// when `chunk` fits only by evicting one of them it is not written, nothing evicted.
    pub fn put_after(
        &mut self,
        fp: &Fingerprint,
        before: &[ChunkKey],
        key: &ChunkKey,
        chunk: &ChunkKv,
    ) -> Result<bool> {
        let bytes = chunk::encode(fp, key, chunk)?;
        let len = bytes.len() as u64;
        if !self.evict(Some(key), len, before) {
            return Ok(false);
        }
        self.lru.remove(key);
        let path = self.path(key);
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!("{TEMP_PREFIX}{}-", std::process::id()))
            .rand_bytes(TEMP_RANDOM)
            .suffix(TEMP_SUFFIX)
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .tempfile_in(&self.dir)
            .map_err(|e| PrefixError::io("cannot create a chunk file in", &self.dir, e))?;
        tmp.write_all(&bytes)
            .map_err(|e| PrefixError::io("cannot write a chunk file in", &self.dir, e))?;
        // Renamed over any file of the same name (another process's copy of the same
        // chunk: the same bytes).
        tmp.persist(&path)
            .map_err(|e| PrefixError::io("cannot name the chunk file", &path, e.error))?;
        self.lru.insert(*key, len);
        Ok(true)
    }

    /// Marks `key`'s file, if known, as just used (here and, through its modification
    /// time, for other processes).
    pub fn touch(&mut self, key: &ChunkKey) {
        if self.lru.touch(key) {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(self.path(key));
            if let Ok(f) = file {
                let _ = f.set_modified(SystemTime::now());
            }
        }
    }

    /// Whether a file for `key` is known (not read; another process may have removed it).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.lru.contains(key)
    }

    /// The counters.
    pub fn counts(&self) -> DiskCounts {
        DiskCounts {
            bytes: self.lru.bytes(),
            files: self.lru.len() as u64,
            evictions: self.evictions,
            damaged: self.damaged,
            read_bytes: self.read_bytes,
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.lru.budget()
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Removes `entry`, a temporary of ours, when no process can still be writing it: a regular
/// file of this user's, older than [`STALE`].
fn sweep_stale(entry: &std::fs::DirEntry) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let old = entry
        .metadata()
        .ok()
        .filter(|m| m.file_type().is_file() && m.uid() == me)
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

/// Whole pages of zeros, seen as bytes.
struct Pages(Vec<Page>);

impl Pages {
    /// `len` bytes (a multiple of [`ALIGN`]).
    fn new(len: usize) -> Self {
        Self(vec![Page([0; ALIGN]); len / ALIGN])
    }

    fn bytes(&mut self) -> &mut [u8] {
        let len = self.0.len() * ALIGN;
        // SAFETY: the pages hold `len` initialised bytes, page-aligned, borrowed mutably
        // through `self` for as long as the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }
}
