//! The prefix cache (issue "KV reuse across requests", item 1): chunks of K/V keyed by
//! [`ChunkKey`], in host RAM up to a byte budget ([`RamTier`]) and, when a directory is
//! given, in files up to another ([`DiskTier`]) — written through to the files as they are
//! stored, so that the next process finds them, as LMCache's local-disk backend does; a
//! chunk read from a file is kept in RAM too. A chunk is found only when every field of its
//! header is what the cache expects ([`PrefixCache::expect_layers`]); the budgets keep a
//! prompt's first chunks before its later ones ([`PrefixCache::put_after`],
//! [`PrefixCache::touch_chain`]). [`PrefixStats`] counts hits, misses, tokens restored per
//! tier, bytes per tier, evictions, damaged files and failed writes by cause.
use std::path::PathBuf;

use kvpolicy_core::DiskIo;

use crate::chunk::{ChunkKv, Expect};
use crate::disk::DiskTier;
use crate::error::{PrefixError, Result};
use crate::key::{chunk_keys, ChunkKey, Fingerprint};
use crate::layers::LayerSpecs;
use crate::ram::RamTier;
pub use crate::stats::{PrefixStats, WriteErrorKind, WriteErrors};

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

/// Chunks of K/V of one model (its [`Fingerprint`]) in host RAM and files.
pub struct PrefixCache {
    fp: Fingerprint,
    chunk_tokens: usize,
    ram: RamTier,
    disk: Option<DiskTier>,
    expect: Expect,
    stats: PrefixStats,
}

impl PrefixCache {
    /// A cache for the model `fp` laid out as `cfg` says (its directory created private if
    /// needed; one that cannot be written, or that others can write
    /// ([`PrefixError::Untrusted`]), fails here).
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
            expect: Expect {
                tokens: Some(cfg.chunk_tokens),
                ..Expect::default()
            },
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

    /// Whether `key` is held in RAM (not marked as used).
    pub fn in_ram(&self, key: &ChunkKey) -> bool {
        self.ram.contains(key)
    }

    /// Whether `key` is held in RAM or known on disk (without reading it).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.ram.contains(key) || self.disk.as_ref().is_some_and(|d| d.contains(key))
    }

    /// Expects chunks of the model whose layers are `layers` (their count, KV heads, head
    /// width and dtype) from now on: a chunk of another shape is a miss, its file removed.
    /// [`crate::restore_prefix`] calls this; chunks of `chunk_tokens` tokens are always
    /// expected.
    pub fn expect_layers(&mut self, layers: &LayerSpecs) {
        self.expect = layers.expect(self.chunk_tokens);
    }

    /// The chunk under `key` and its tier: RAM first, then its file (kept in RAM after).
    pub fn get(&mut self, key: &ChunkKey) -> Result<Option<(ChunkKv, Tier)>> {
        self.get_after(&[], key)
    }

    /// [`PrefixCache::get`] of the chunk after `before` in its prompt: keeping it in RAM
    /// evicts none of them.
    pub fn get_after(
        &mut self,
        before: &[ChunkKey],
        key: &ChunkKey,
    ) -> Result<Option<(ChunkKv, Tier)>> {
        if let Some(chunk) = self.ram.get(key) {
            if chunk.shape().is_ok_and(|s| self.expect.check(&s).is_ok()) {
                self.stats.hits += 1;
                return Ok(Some((chunk, Tier::Ram)));
            }
            // Stored for another shape of model than is expected now.
            self.ram.remove(key);
        }
        let found = match &mut self.disk {
            Some(d) => d.get_after(&self.fp, key, &self.expect, before)?,
            None => None,
        };
        match found {
            Some(chunk) => {
                self.stats.hits += 1;
                self.ram.put_after(before, *key, chunk.clone());
                Ok(Some((chunk, Tier::Disk)))
            }
            None => {
                self.stats.misses += 1;
                Ok(None)
            }
        }
    }

    /// Stores `chunk` under `key`: in RAM, and written through to its file. A file that
    /// cannot be written (a full disk, a lost permission, the directory removed) is counted
    /// by cause and its first of each cause logged to stderr, not an error: the request
    /// that computed the chunk goes on. Returns whether it is kept anywhere.
    pub fn put(&mut self, key: ChunkKey, chunk: ChunkKv) -> Result<bool> {
        self.put_after(&[], key, chunk)
    }

    /// [`PrefixCache::put`] of the chunk after `before` in its prompt: in each tier it is
    /// kept only if it fits without evicting any of them (a restore starts at a prompt's
    /// first chunk, so they are worth more than it).
    pub fn put_after(
        &mut self,
        before: &[ChunkKey],
        key: ChunkKey,
        chunk: ChunkKv,
    ) -> Result<bool> {
        let tokens = chunk.shape()?.tokens;
        if tokens != self.chunk_tokens {
            return Err(PrefixError::Invalid(format!(
                "a chunk of {tokens} tokens in a cache of {}-token chunks",
                self.chunk_tokens
            )));
        }
        let on_disk = match &mut self.disk {
            Some(d) => match d.put_after(&self.fp, before, &key, &chunk) {
                Ok(written) => written,
                Err(e) => {
                    let dir = d.dir().to_path_buf();
                    self.write_failed(&dir, &e);
                    false
                }
            },
            None => false,
        };
        let in_ram = self.ram.put_after(before, key, chunk);
        if on_disk || in_ram {
            self.stats.stored += 1;
        }
        Ok(on_disk || in_ram)
    }

    /// Counts a failed write to `dir`, logging the first of its cause.
    fn write_failed(&mut self, dir: &std::path::Path, e: &PrefixError) {
        let kind = WriteErrorKind::of(e);
        self.stats.write_errors += 1;
        let name = kind.name();
        if self.stats.write_error_kinds.count(kind) == 1 {
            eprintln!(
                "kvpolicy-prefix: cannot write chunk files in {} ({name}): {e}; chunks stay in RAM only (if they fit); further {name} errors are counted in write_errors, not logged",
                dir.display()
            );
        } else {
            tracing::debug!("prefix cache: a chunk was not written ({name}): {e}");
        }
    }

    /// Marks `keys` — a prompt's chunks, in order — as just used, the first last: the least
    /// recently used chunks evicted next are then a prompt's later ones, and what stays is a
    /// prefix a restore can use.
    pub fn touch_chain(&mut self, keys: &[ChunkKey]) {
        for key in keys.iter().rev() {
            self.ram.touch(key);
            if let Some(d) = &mut self.disk {
                d.touch(key);
            }
        }
    }

    /// Books the RAM tier's bytes in `pool`'s `tier` ledger — the one the requests' K/V
    /// on the device the chunks are read from draw from — so that the cache and the live
    /// requests share one budget ([`crate::ram`]).
    pub fn pooled(
        mut self,
        pool: std::sync::Arc<kvpolicy_core::KvPool>,
        tier: kvpolicy_core::PoolTier,
    ) -> Self {
        self.ram.pooled(pool, tier);
        self
    }

    /// Evicts the least recently used chunks no live sequence holds from RAM until the pool
    /// ledger has `need` bytes free (a live sequence needs the room); whether it has.
    pub fn evict_for(&mut self, need: u64) -> bool {
        self.ram.evict_for(need, &[])
    }

    /// Whether its chunks may be held by reference by a policy without changing a bit of
    /// its results: their length is a whole number of the attention kernel's key tiles
    /// ([`kvpolicy_core::attention::RUN_ALIGN`], 256; the default chunk). Other chunk sizes
    /// are restored by copying.
    pub fn shares_by_reference(&self) -> bool {
        self.chunk_tokens
            .is_multiple_of(kvpolicy_core::attention::RUN_ALIGN)
    }

    /// `key`'s chunk and its lease when it is held in RAM, where a sequence may hold it by
    /// reference (it stays there while one does); not counted as a lookup.
    pub fn leased(&self, key: &ChunkKey) -> Option<crate::ram::Leased> {
        self.ram.leased(key)
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
            shared_bytes: self.ram.shared_bytes(),
            ram_evictions: self.ram.evictions(),
            disk_bytes: disk.bytes,
            disk_evictions: disk.evictions,
            damaged: disk.damaged,
            ..self.stats
        }
    }
}
