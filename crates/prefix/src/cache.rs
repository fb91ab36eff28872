//! The prefix cache (issue "KV reuse across requests", item 1): chunks of K/V keyed by
//! [`ChunkKey`], in host RAM up to a byte budget ([`RamTier`]) and, when a directory is
//! given, in files up to another ([`DiskTier`]) — written through to the files as they are
//! stored, so that the next process finds them, as LMCache's local-disk backend does; a
//! chunk read from a file is kept in RAM too. [`PrefixStats`] counts hits, misses, tokens
//! restored per tier, bytes per tier, evictions and damaged files.
use std::path::PathBuf;

use kvpolicy_core::DiskIo;

use crate::chunk::ChunkKv;
use crate::disk::DiskTier;
use crate::error::{PrefixError, Result};
use crate::key::{chunk_keys, ChunkKey, Fingerprint};
use crate::ram::RamTier;

/// Tokens per chunk by default (LMCache's default chunk size).
pub const DEFAULT_CHUNK_TOKENS: usize = 256;

/// How a [`PrefixCache`] is laid out.
#[derive(Clone, Debug)]
pub struct PrefixConfig {
    /// Tokens per chunk (default [`DEFAULT_CHUNK_TOKENS`]).
    pub chunk_tokens: usize,
    /// Bytes of K/V kept in host RAM.
    pub ram_bytes: u64,
    /// The directory of the file tier (`None`: RAM only).
    pub dir: Option<PathBuf>,
    /// Bytes of chunk files kept in `dir`.
    pub disk_bytes: u64,
    /// How chunk files are read.
    pub disk_io: DiskIo,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        Self {
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
            ram_bytes: 2 << 30,
            dir: None,
            disk_bytes: 8 << 30,
            disk_io: DiskIo::Direct,
        }
    }
}

/// Which tier a chunk came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Host RAM.
    Ram,
    /// A file.
    Disk,
}

/// The prefix cache's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixStats {
    /// Chunks found.
    pub hits: u64,
    /// Chunk lookups that found nothing.
    pub misses: u64,
    /// Tokens restored from host RAM (a chunk found but not restored counts as a hit only).
    pub tokens_from_ram: u64,
    /// Tokens restored from files.
    pub tokens_from_disk: u64,
    /// Chunks stored (kept in RAM or written to a file).
    pub stored: u64,
    /// K/V bytes held in host RAM (never above its budget).
    pub ram_bytes: u64,
    /// Bytes of the chunk files known (never above its budget).
    pub disk_bytes: u64,
    /// Chunks evicted from host RAM.
    pub ram_evictions: u64,
    /// Chunk files removed to stay within the budget.
    pub disk_evictions: u64,
    /// Chunk files that failed their checks (removed; misses).
    pub damaged: u64,
    /// Chunk files that could not be written (the chunk stayed in RAM, if it fit).
    pub write_errors: u64,
    /// Seconds spent restoring K/V into policies.
    pub restore_s: f64,
}

/// Chunks of K/V of one model (its [`Fingerprint`]) in host RAM and files.
pub struct PrefixCache {
    fp: Fingerprint,
    chunk_tokens: usize,
    ram: RamTier,
    disk: Option<DiskTier>,
    stats: PrefixStats,
}

impl PrefixCache {
    /// A cache for the model `fp` laid out as `cfg` says (its directory created if needed;
    /// one that cannot be written fails here).
    pub fn open(cfg: &PrefixConfig, fp: Fingerprint) -> Result<Self> {
        if cfg.chunk_tokens == 0 {
            return Err(PrefixError::Invalid(
                "the prefix cache's chunk size is 0 tokens; give at least 1".into(),
            ));
        }
        let disk = cfg
            .dir
            .as_deref()
            .map(|d| DiskTier::open(d, cfg.disk_bytes, cfg.disk_io))
            .transpose()?;
        Ok(Self {
            fp,
            chunk_tokens: cfg.chunk_tokens,
            ram: RamTier::new(cfg.ram_bytes),
            disk,
            stats: PrefixStats::default(),
        })
    }

    /// The model's fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fp
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens
    }

    /// The keys of `ids`' whole chunks.
    pub fn keys(&self, ids: &[u32]) -> Vec<ChunkKey> {
        chunk_keys(&self.fp, ids, self.chunk_tokens)
    }

    /// Whether `key` is held in RAM or known on disk (without reading it).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.ram.contains(key) || self.disk.as_ref().is_some_and(|d| d.contains(key))
    }

    /// The chunk under `key` and its tier: RAM first, then its file (kept in RAM after).
    pub fn get(&mut self, key: &ChunkKey) -> Result<Option<(ChunkKv, Tier)>> {
        if let Some(chunk) = self.ram.get(key) {
            self.stats.hits += 1;
            return Ok(Some((chunk, Tier::Ram)));
        }
        let found = match &mut self.disk {
            Some(d) => d.get(&self.fp, key)?,
            None => None,
        };
        match found {
            Some(chunk) => {
                self.stats.hits += 1;
                self.ram.put(*key, chunk.clone());
                Ok(Some((chunk, Tier::Disk)))
            }
            None => {
                self.stats.misses += 1;
                Ok(None)
            }
        }
    }

    /// Stores `chunk` under `key`: in RAM, and written through to its file. A file that
    /// cannot be written (a full disk, a lost permission) is counted and logged, not an
    /// error: the request that computed the chunk goes on. Returns whether it is kept
    /// anywhere.
    pub fn put(&mut self, key: ChunkKey, chunk: ChunkKv) -> Result<bool> {
        let tokens = chunk.shape()?.tokens;
        if tokens != self.chunk_tokens {
            return Err(PrefixError::Invalid(format!(
                "a chunk of {tokens} tokens in a cache of {}-token chunks",
                self.chunk_tokens
            )));
        }
        let on_disk = match &mut self.disk {
            Some(d) => match d.put(&self.fp, &key, &chunk) {
                Ok(written) => written,
                Err(e) => {
                    tracing::warn!("prefix cache: a chunk was not written: {e}");
                    self.stats.write_errors += 1;
                    false
                }
            },
            None => false,
        };
        let in_ram = self.ram.put(key, chunk);
        if on_disk || in_ram {
            self.stats.stored += 1;
        }
        Ok(on_disk || in_ram)
    }

    /// Counts `tokens` restored from `tier` in `seconds`.
    pub fn count_restored(&mut self, tier: Tier, tokens: usize, seconds: f64) {
        match tier {
            Tier::Ram => self.stats.tokens_from_ram += tokens as u64,
            Tier::Disk => self.stats.tokens_from_disk += tokens as u64,
        }
        self.stats.restore_s += seconds;
    }

    /// The counters.
    pub fn stats(&self) -> PrefixStats {
        let disk = self.disk.as_ref().map(|d| d.counts()).unwrap_or_default();
        PrefixStats {
            ram_bytes: self.ram.bytes(),
            ram_evictions: self.ram.evictions(),
            disk_bytes: disk.bytes,
            disk_evictions: disk.evictions,
            damaged: disk.damaged,
            ..self.stats
        }
    }
}
