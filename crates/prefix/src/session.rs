//! Saved sessions (issue "KV reuse across requests", item 3; llama.cpp's `--prompt-cache`
//! and slot save): a run's token ids and the K/V of every token it computed, in one
//! versioned file, so the next run continues the conversation without prefilling its
//! history again. The file is a header — magic `KVPS`, version, the model [`Fingerprint`],
//! the ids, a SHA-256 of all that (checked before anything in it is believed) — then the
//! K/V as a chunk file ([`crate::chunk`]: its own header, checksum and
//! payload) whose key is a digest of the ids, so ids and K/V cannot be paired wrongly.
//! Written whole to a temporary beside the target and renamed ([`Session::save`]); read
//! only from a regular file that no one else can write, headers first — a length the file
//! does not hold is refused before anything is allocated for it — and refused with a clear
//! error when it is another model's, another version's, or damaged ([`Session::load`]).
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::chunk::{self, ChunkKv, Damage, Expect};
use crate::error::{PrefixError, Result};
use crate::header::{Header, HEADER_PAGE};
use crate::key::{ChunkKey, Fingerprint};
use crate::trust;

/// "KVPS".
const MAGIC: [u8; 4] = *b"KVPS";
/// The session format's version.
pub const SESSION_VERSION: u32 = 1;
/// The largest session file read (a damaged header must not allocate without bound).
const MAX_SESSION: u64 = 64 << 30;

/// A run's tokens and the K/V of the first [`Session::kv_tokens`] of them.
#[derive(Clone, Debug)]
pub struct Session {
    /// The model that computed the K/V.
    pub fingerprint: Fingerprint,
    /// Every token of the run: prompt, then generated.
    pub ids: Vec<u32>,
    /// K/V of `ids[..kv.tokens]` (the last generated token has none: no step ran on it).
    pub kv: ChunkKv,
}

/// The key binding a session's K/V to its ids.
fn ids_key(fp: &Fingerprint, ids: &[u32]) -> ChunkKey {
    let mut h = Sha256::new();
    h.update(b"kvpolicy session");
    h.update(fp.0);
    h.update((ids.len() as u64).to_le_bytes());
    for id in ids {
        h.update(id.to_le_bytes());
    }
    ChunkKey(h.finalize().into())
}

fn bad(path: &Path, why: impl Into<String>) -> PrefixError {
    PrefixError::Session {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

impl Session {
    /// Tokens whose K/V the session holds.
    pub fn kv_tokens(&self) -> Result<usize> {
        Ok(self.kv.shape()?.tokens)
    }

    /// The file's bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let kv = self.kv_tokens()?;
        if kv > self.ids.len() {
            return Err(PrefixError::Invalid(format!(
                "a session of {} ids cannot hold K/V of {kv} tokens",
                self.ids.len()
            )));
        }
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&SESSION_VERSION.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.0);
        out.extend_from_slice(&(self.ids.len() as u64).to_le_bytes());
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        let key = ids_key(&self.fingerprint, &self.ids);
        out.extend_from_slice(&chunk::encode(&self.fingerprint, &key, &self.kv)?);
        Ok(out)
    }

    /// The session in `bytes` (read from `path`, named in errors), for the model `fp`.
    pub fn decode(bytes: &[u8], fp: &Fingerprint, path: &Path) -> Result<Self> {
        let n = prelude(bytes, path, bytes.len() as u64)?;
        let ids_end = IDS + 4 * n;
        let ids = ids_of(&bytes[..ids_end + 32], fp, path)?;
        let key = ids_key(fp, &ids);
        let kv = chunk::decode(&bytes[ids_end + 32..], fp, &key, &Expect::default())
            .map_err(|d| damaged(path, &d))?;
        Self::checked(fp, ids, kv, path)
    }

    fn checked(fp: &Fingerprint, ids: Vec<u32>, kv: ChunkKv, path: &Path) -> Result<Self> {
        let session = Self {
            fingerprint: *fp,
            ids,
            kv,
        };
        if session.kv_tokens()? > session.ids.len() {
            return Err(bad(path, "damaged (more K/V than token ids)"));
        }
        Ok(session)
    }

    /// Writes the session to `path`: whole to a temporary in the same directory (mode 0644
    /// less the umask: never writable by others, or [`Session::load`] would refuse it), then
    /// renamed over it — a reader never sees half a session.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.encode()?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut tmp = tempfile::Builder::new()
            .prefix(".kvps-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .tempfile_in(dir)
            .map_err(|e| PrefixError::io("cannot create a session file in", dir, e))?;
        tmp.write_all(&bytes)
            .map_err(|e| PrefixError::io("cannot write the session", path, e))?;
        tmp.persist(path)
            .map_err(|e| PrefixError::io("cannot name the session", path, e.error))?;
        Ok(())
    }

    /// Reads the session at `path` for the model `fp` (a regular file only this user can
    /// write — else [`PrefixError::Untrusted`]; a symbolic link is followed only as the user
    /// named it). Its headers are read and checked first — the ids' count and the K/V's
    /// length against the file's — and the K/V only then, in bounded pieces.
    pub fn load(path: &Path, fp: &Fingerprint) -> Result<Self> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| PrefixError::io("cannot open the session", path, e))?;
        let meta = f
            .metadata()
            .map_err(|e| PrefixError::io("cannot stat the session", path, e))?;
        if !meta.file_type().is_file() {
            return Err(bad(
                path,
                "not a regular file; give a file a run saved its session to",
            ));
        }
        trust::check_file(&meta, path)?;
        let len = meta.len();
        if len > MAX_SESSION {
            return Err(bad(path, format!("larger than {MAX_SESSION} bytes")));
        }
        let read = |buf: &mut [u8], at: u64| {
            f.read_exact_at(buf, at)
                .map_err(|e| PrefixError::io("cannot read the session", path, e))
        };
        let mut head = [0u8; IDS];
        read(&mut head[..(len as usize).min(IDS)], 0)?;
        let n = prelude(&head[..(len as usize).min(IDS)], path, len)?;
        let ids_end = IDS + 4 * n;
        let mut ids = vec![0u8; ids_end + 32];
        read(&mut ids, 0)?;
        let ids = ids_of(&ids, fp, path)?;
        let key = ids_key(fp, &ids);
        // The K/V: a chunk's header, checked against the ids and the bytes left, then its
        // payload.
        let at = (ids_end + 32) as u64;
        let mut page = vec![0u8; HEADER_PAGE];
        read(&mut page, at)?;
        let header = Header::parse(&page).map_err(|d| damaged(path, &d))?;
        let expect = Expect::default();
        header
            .check(fp, &key, &expect, len - at)
            .map_err(|d| damaged(path, &d))?;
        if header.shape.tokens > ids.len() {
            return Err(bad(path, "damaged (more K/V than token ids)"));
        }
        let mut payload = vec![0u8; header.payload];
        let base = at + HEADER_PAGE as u64;
        let mut read_at = |buf: &mut [u8], off: u64| f.read_exact_at(buf, base + off);
        header
            .read_payload(&mut payload, &mut read_at)
            .map_err(|e| PrefixError::io("cannot read the session", path, e))?
            .map_err(|d| damaged(path, &d))?;
        let kv = ChunkKv::from_payload(&payload, &header.shape).map_err(|d| damaged(path, &d))?;
        Self::checked(fp, ids, kv, path)
    }
}

/// Bytes before a session's token ids: magic, version, fingerprint, their count.
const IDS: usize = 48;

fn damaged(path: &Path, d: &Damage) -> PrefixError {
    bad(
        path,
        format!("damaged ({}); delete it and start a new session", d.0),
    )
}

/// The count of token ids that `head` — a session file's first bytes (up to [`IDS`]), of
/// a file of `len` bytes — announces, checked to fit in it with the K/V's header.
fn prelude(head: &[u8], path: &Path, len: u64) -> Result<usize> {
    if head.len() < IDS || head[..4] != MAGIC {
        return Err(bad(
            path,
            "not a kvpolicy session file (no KVPS header); give a file a run saved its session to",
        ));
    }
    let mut word = [0u8; 4];
    word.copy_from_slice(&head[4..8]);
    let version = u32::from_le_bytes(word);
    if version != SESSION_VERSION {
        return Err(bad(
            path,
            format!(
                "format version {version}; this build reads version {SESSION_VERSION}: save the session again with this build"
            ),
        ));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&head[40..48]);
    let n = u64::from_le_bytes(n);
    let fits = n
        .checked_mul(4)
        .and_then(|b| b.checked_add((IDS + 32 + HEADER_PAGE) as u64))
        .is_some_and(|end| end <= len);
    if !fits {
        return Err(bad(
            path,
            format!("truncated (its header says {n} token ids: more than its length of {len} bytes holds)"),
        ));
    }
    // Fits in the file, so in memory.
    Ok(n as usize)
}

/// The token ids in `bytes` (a session's header, ids and checksum), checked, of model `fp`.
fn ids_of(bytes: &[u8], fp: &Fingerprint, path: &Path) -> Result<Vec<u32>> {
    let ids_end = bytes.len() - 32;
    if Sha256::digest(&bytes[..ids_end]).as_slice() != &bytes[ids_end..] {
        return Err(bad(
            path,
            "damaged (header checksum); delete it and start a new session",
        ));
    }
    let mut theirs = [0u8; 32];
    theirs.copy_from_slice(&bytes[8..40]);
    let theirs = Fingerprint(theirs);
    if theirs != *fp {
        return Err(bad(
            path,
            format!(
                "written by another model, dtype or device (fingerprint {}; this run's is {}): load it with the model and dtype that saved it, or start a new session",
                theirs.short(),
                fp.short()
            ),
        ));
    }
    Ok(bytes[IDS..ids_end]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}
