//! The host-RAM tier of the prefix cache: chunks held as tensors up to a byte budget,
//! least recently used evicted first — never the chunks before a new one in its prompt
//! ([`RamTier::put_after`]), so that what the budget keeps is a prefix a restore can use.
//! Its byte count is exact (the K/V bytes of the chunks it holds) and never exceeds the
//! budget: a chunk larger than the whole budget is not kept.
use std::collections::HashMap;

use crate::chunk::ChunkKv;
use crate::key::ChunkKey;
use crate::lru::Lru;

/// Chunks in host RAM under a byte budget (LRU).
pub struct RamTier {
    lru: Lru,
    evictions: u64,
    chunks: HashMap<ChunkKey, ChunkKv>,
}

impl RamTier {
    /// An empty tier of `budget` bytes (0: keeps nothing).
    pub fn new(budget: u64) -> Self {
        Self {
            lru: Lru::new(budget),
            evictions: 0,
            chunks: HashMap::new(),
        }
    }

    /// The chunk under `key`, marked as just used.
    pub fn get(&mut self, key: &ChunkKey) -> Option<ChunkKv> {
        self.lru.touch(key);
        self.chunks.get(key).cloned()
    }

    /// Whether `key` is held (not marked as used).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.chunks.contains_key(key)
    }

    /// Marks `key`, if held, as just used.
    pub fn touch(&mut self, key: &ChunkKey) {
        self.lru.touch(key);
    }

    /// Drops the chunk under `key`, if held (not counted as an eviction).
    pub fn remove(&mut self, key: &ChunkKey) {
        self.lru.remove(key);
        self.chunks.remove(key);
    }

    /// Keeps `chunk` under `key`, evicting the least recently used chunks to stay within the
    /// budget; returns whether it is kept (a chunk larger than the budget is not).
    pub fn put(&mut self, key: ChunkKey, chunk: ChunkKv) -> bool {
        self.put_after(&[], key, chunk)
    }

    /// [`RamTier::put`], evicting none of `before` (the chunks before `key` in its prompt):
    /// when `chunk` fits only by evicting one of them it is not kept, and nothing is evicted.
    pub fn put_after(&mut self, before: &[ChunkKey], key: ChunkKey, chunk: ChunkKv) -> bool {
        let bytes = chunk.bytes();
        let Some(victims) = self.lru.victims(Some(&key), bytes, before) else {
            return false;
        };
        for k in victims {
            self.remove(&k);
            self.evictions += 1;
        }
        self.lru.insert(key, bytes);
        self.chunks.insert(key, chunk);
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
