//! The host-RAM tier of the prefix cache: chunks held as tensors up to a byte budget,
//! least recently used evicted first. Its byte count is exact (the K/V bytes of the chunks
//! it holds) and never exceeds the budget: a chunk larger than the whole budget is not kept.
use std::collections::HashMap;

use crate::chunk::ChunkKv;
use crate::key::ChunkKey;

struct Entry {
    chunk: ChunkKv,
    bytes: u64,
    used: u64,
}

/// Chunks in host RAM under a byte budget (LRU).
pub struct RamTier {
    budget: u64,
    bytes: u64,
    tick: u64,
    evictions: u64,
    entries: HashMap<ChunkKey, Entry>,
}

impl RamTier {
    /// An empty tier of `budget` bytes (0: keeps nothing).
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            bytes: 0,
            tick: 0,
            evictions: 0,
            entries: HashMap::new(),
        }
    }

    /// The chunk under `key`, marked as just used.
    pub fn get(&mut self, key: &ChunkKey) -> Option<ChunkKv> {
        self.tick += 1;
        let e = self.entries.get_mut(key)?;
        e.used = self.tick;
        Some(e.chunk.clone())
    }

    /// Whether `key` is held (not marked as used).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Keeps `chunk` under `key`, evicting the least recently used chunks to stay within the
    /// budget; returns whether it is kept (a chunk larger than the budget is not).
    pub fn put(&mut self, key: ChunkKey, chunk: ChunkKv) -> bool {
        let bytes = chunk.bytes();
        if bytes > self.budget {
            return false;
        }
        if let Some(old) = self.entries.remove(&key) {
            self.bytes -= old.bytes;
        }
        while self.bytes + bytes > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| *k)
            else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
                self.evictions += 1;
            }
        }
        self.tick += 1;
        self.bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                chunk,
                bytes,
                used: self.tick,
            },
        );
        true
    }

    /// K/V bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Chunks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}
