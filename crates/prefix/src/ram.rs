//! The host-RAM tier of the prefix cache: chunks held as tensors up to a byte budget,
//! least recently used evicted first — never the chunks before a new one in its prompt
//! ([`RamTier::put_after`]), so that what the budget keeps is a prefix a restore can use.
//! Its byte count is exact (the K/V bytes of the chunks it holds) and never exceeds the
//! budget: a chunk larger than the whole budget is not kept. Each chunk has a
//! [`KvLease`]: while a live sequence holds the chunk by reference (its policy keeps a
//! clone of the lease), the chunk is not evicted — its bytes are counted here, once, for
//! every sequence that reads it (SGLang's radix cache pins the nodes a request uses).
//!
//! In a server's memory pool ([`RamTier::pooled`]) its bytes are also booked in one ledger
//! of the [`KvPool`] the requests' policies draw from: a chunk is kept only where the pool
//! has room (evicting older unleased chunks for it), and a live sequence that needs the room
//! gets it by evicting them ([`RamTier::evict_for`]) — the prefix cache and the live K/V are
//! one pool, as SGLang's radix cache and vLLM's free block queue are.
use std::collections::HashMap;
use std::sync::Arc;

use kvpolicy_core::{KvLease, KvPool, PoolTier};

use crate::chunk::ChunkKv;
use crate::key::ChunkKey;
use crate::lru::Lru;

/// Chunks in host RAM under a byte budget (LRU).
pub struct RamTier {
    lru: Lru,
    evictions: u64,
    chunks: HashMap<ChunkKey, Held>,
    /// The pool ledger its bytes are booked in, if any.
    pool: Option<(Arc<KvPool>, PoolTier)>,
}

/// A chunk and its lease.
struct Held {
    kv: ChunkKv,
    lease: KvLease,
}

/// A chunk held in RAM, with a clone of its lease ([`RamTier::leased`]).
pub struct Leased {
    /// The chunk's K/V (the tensors the tier holds, not a copy).
    pub kv: ChunkKv,
    /// Its lease: a sequence that reads `kv` by reference keeps a clone.
    pub lease: KvLease,
}

impl RamTier {
    /// An empty tier of `budget` bytes (0: keeps nothing).
    pub fn new(budget: u64) -> Self {
        Self {
            lru: Lru::new(budget),
            evictions: 0,
            chunks: HashMap::new(),
            pool: None,
        }
    }

    /// Books its bytes in `pool`'s `tier` ledger from now on (what it holds already too).
    pub fn pooled(&mut self, pool: Arc<KvPool>, tier: PoolTier) {
        pool.tier(tier).add(self.lru.bytes());
        self.pool = Some((pool, tier));
    }

    /// Whether its pool ledger has `need` bytes free (always outside a pool).
    fn pool_fits(&self, need: u64) -> bool {
        self.pool
            .as_ref()
            .is_none_or(|(p, t)| p.tier(*t).fits(need))
    }

    /// Evicts least recently used chunks, none leased nor in `keep`, until its pool ledger
    /// has `need` bytes free; whether it has.
    /// Outside a pool it always has.
    pub fn evict_for(&mut self, need: u64, keep: &[ChunkKey]) -> bool {
        for (key, _) in self.lru.oldest(keep) {
            if self.pool_fits(need) {
                break;
            }
            if self
                .chunks
                .get(&key)
                .is_some_and(|h| h.lease.holders() == 0)
            {
                self.drop_chunk(&key);
                self.evictions += 1;
            }
        }
        self.pool_fits(need)
    }

    /// Forgets `key`'s chunk and its bytes.
    fn drop_chunk(&mut self, key: &ChunkKey) {
        if let Some(bytes) = self.lru.remove(key) {
            if let Some((p, t)) = &self.pool {
                p.tier(*t).sub(bytes);
            }
        }
        self.chunks.remove(key);
    }

    /// The chunk under `key`, marked as just used.
    pub fn get(&mut self, key: &ChunkKey) -> Option<ChunkKv> {
        self.lru.touch(key);
        self.chunks.get(key).map(|h| h.kv.clone())
    }

    /// The chunk under `key` and its lease, if held (not marked as used): a policy that
    /// keeps the chunk by reference keeps a clone of the lease, and the chunk stays until
    /// every clone is dropped.
    pub fn leased(&self, key: &ChunkKey) -> Option<Leased> {
        self.chunks.get(key).map(|h| Leased {
            kv: h.kv.clone(),
            lease: h.lease.clone(),
        })
    }

    /// Bytes of the chunks held by reference now.
    pub fn shared_bytes(&self) -> u64 {
        self.chunks
            .values()
            .filter(|h| h.lease.holders() > 0)
            .map(|h| h.kv.bytes())
            .sum()
    }

    /// Whether `key` is held (not marked as used).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.chunks.contains_key(key)
    }

    /// Marks `key`, if held, as just used.
    pub fn touch(&mut self, key: &ChunkKey) {
        self.lru.touch(key);
    }

    /// Drops the chunk under `key`, if held (not counted as an eviction); a chunk held by
    /// reference stays (it is replaced only once no sequence reads it).
    pub fn remove(&mut self, key: &ChunkKey) {
        if self.chunks.get(key).is_some_and(|h| h.lease.holders() > 0) {
            return;
        }
        self.drop_chunk(key);
    }

    /// Keeps `chunk` under `key`, evicting the least recently used chunks to stay within the
    /// budget; returns whether it is kept (a chunk larger than the budget is not).
    pub fn put(&mut self, key: ChunkKey, chunk: ChunkKv) -> bool {
        self.put_after(&[], key, chunk)
    }

    /// [`RamTier::put`], evicting none of `before` (the chunks before `key` in its prompt)
    /// nor a chunk held by reference: when `chunk` fits only by evicting one of them it is
    /// not kept, and nothing is evicted. A chunk already held under `key` and held by
    /// reference is kept as it is.
    pub fn put_after(&mut self, before: &[ChunkKey], key: ChunkKey, chunk: ChunkKv) -> bool {
        if self.chunks.get(&key).is_some_and(|h| h.lease.holders() > 0) {
            self.lru.touch(&key);
            return true;
        }
        // (Equal keys, equal K/V: the one held gives its bytes back first.)
        self.drop_chunk(&key);
        let bytes = chunk.bytes();
        let mut keep = before.to_vec();
        keep.extend(
            self.chunks
                .iter()
                .filter(|(_, h)| h.lease.holders() > 0)
                .map(|(k, _)| *k),
        );
        let Some(victims) = self.lru.victims(Some(&key), bytes, &keep) else {
            return false;
        };
        for k in victims {
            self.remove(&k);
            self.evictions += 1;
        }
        // In a pool: room there too, from the oldest unleased chunks but `before`.
        if !self.evict_for(bytes, &[before, &[key]].concat()) {
            return false;
        }
        if let Some((p, t)) = &self.pool {
            p.tier(*t).add(bytes);
        }
        self.lru.insert(key, bytes);
        self.chunks.insert(
            key,
            Held {
                kv: chunk,
                lease: KvLease::new(),
            },
        );
        true
    }

    /// K/V bytes held.
    pub fn bytes(&self) -> u64 {
        self.lru.bytes()
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Chunks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

impl Drop for RamTier {
    /// Gives its bytes back to its pool.
    fn drop(&mut self) {
        if let Some((p, t)) = &self.pool {
            p.tier(*t).sub(self.lru.bytes());
        }
    }
}
