//! The bookkeeping both tiers share: the bytes of each chunk held and when it was last used,
//! within a byte budget. [`Lru::victims`] names what to evict for a new chunk — least
//! recently used first, never a chunk the caller keeps (the chunks before the new one in its
//! prompt: a restore starts at a prompt's first chunk, so evicting them would leave the new
//! one unreachable), and nothing at all when the new chunk fits only by evicting those.
use std::collections::{HashMap, HashSet};

use crate::key::ChunkKey;

#[derive(Clone, Copy)]
struct Slot {
    bytes: u64,
    used: u64,
}

/// Chunks' bytes and last uses under a byte budget.
pub(crate) struct Lru {
    budget: u64,
    bytes: u64,
    tick: u64,
    slots: HashMap<ChunkKey, Slot>,
}

impl Lru {
    /// Nothing held, within `budget` bytes.
    pub(crate) fn new(budget: u64) -> Self {
        Self {
            budget,
            bytes: 0,
            tick: 0,
            slots: HashMap::new(),
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Chunks held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The budget.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Whether `key` is held.
    pub(crate) fn contains(&self, key: &ChunkKey) -> bool {
        self.slots.contains_key(key)
    }

    /// Marks `key` as just used; whether it is held.
    pub(crate) fn touch(&mut self, key: &ChunkKey) -> bool {
        self.tick += 1;
        match self.slots.get_mut(key) {
            Some(s) => {
                s.used = self.tick;
                true
            }
            None => false,
        }
    }

    /// Holds `key` with `bytes`, just used (replacing what it held).
    pub(crate) fn insert(&mut self, key: ChunkKey, bytes: u64) {
        self.remove(&key);
        self.tick += 1;
        self.bytes += bytes;
        self.slots.insert(
            key,
            Slot {
                bytes,
                used: self.tick,
            },
        );
    }

    /// Stops holding `key`; its bytes, if it was held.
    pub(crate) fn remove(&mut self, key: &ChunkKey) -> Option<u64> {
        let s = self.slots.remove(key)?;
        self.bytes -= s.bytes;
        Some(s.bytes)
    }

    /// Every chunk held but `keep`, least recently used first, with its bytes.
    pub(crate) fn oldest(&self, keep: &[ChunkKey]) -> Vec<(ChunkKey, u64)> {
        let keep: HashSet<&ChunkKey> = keep.iter().collect();
        let mut all: Vec<(u64, ChunkKey, u64)> = self
            .slots
            .iter()
            .filter(|(k, _)| !keep.contains(k))
            .map(|(k, s)| (s.used, *k, s.bytes))
            .collect();
        all.sort_unstable();
        all.into_iter().map(|(_, k, b)| (k, b)).collect()
    }

    /// The chunks to evict, least recently used first, so that `key` (if any) can hold
    /// `incoming` bytes (what it holds now counted as freed) — none of `keep`. `None` when
    /// that cannot be: `incoming` above the budget, or room only by evicting some of `keep`.
    pub(crate) fn victims(
        &self,
        key: Option<&ChunkKey>,
        incoming: u64,
        keep: &[ChunkKey],
    ) -> Option<Vec<ChunkKey>> {
        if incoming > self.budget {
            return None;
        }
        let freed = key.and_then(|k| self.slots.get(k)).map_or(0, |s| s.bytes);
        let after = self.bytes - freed + incoming;
        let Some(mut need) = after.checked_sub(self.budget).filter(|&n| n > 0) else {
            return Some(Vec::new());
        };
        let keep: Vec<ChunkKey> = keep.iter().chain(key).copied().collect();
        let mut out = Vec::new();
        for (k, bytes) in self.oldest(&keep) {
            out.push(k);
            need = need.saturating_sub(bytes);
            if need == 0 {
                return Some(out);
            }
        }
        None
    }
}
