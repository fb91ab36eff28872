//! The prefix cache behind the server (`--prefix-cache DIR`, `--prefix-cache-ram SIZE`; the
//! docs/reuse.md): a request admitted to slot `seq` first gets the
//! longest cached run of its prompt's chunks restored into that slot's cache
//! (`restore_prefix`), so its prefill starts after them; the prompt K/V its prefill
//! computes are recorded (`Capture` over `Recordings`, per slot) and stored as new chunks
//! when it finishes, for the requests after it.
//!
//! With a policy that holds K/V by reference (`full` on the CPU, [`KvRestore::attaches_kv`])
//! and chunks of whole kernel tiles (256 tokens, the default) live requests share prefixes (issue 54, item 4): restored chunks are the cache's own
//! tensors, and a request's prompt chunks are stored as soon as its prompt is in — the
//! request then holds them by reference too ([`adopt_prefix`]) — so that requests sharing
//! a prefix hold it once, in the cache's RAM, leased there while any reads it.
use kvpolicy::core::{KvRestore, PoolTier};
use kvpolicy::models::engine::reuse::resumable;
use kvpolicy::models::ModelInfo;
use kvpolicy::prefix::{
    adopt_prefix, restore_prefix, store_new, Capture, ChunkKv, LayerSpecs, PrefixCache,
    PrefixStats, Recordings, Resume,
};
use kvpolicy::KvPolicy;

/// The cache and what the running requests' prefills computed.
pub struct Reuse {
    cache: PrefixCache,
    layers: LayerSpecs,
    rec: Recordings,
    /// Whether the policy holds restored chunks by reference, once an admission asked.
    sharing: Option<bool>,
    /// The pool's ledger its RAM chunks are booked in.
    ledger: PoolTier,
}

impl Reuse {
    /// Serves `cache` for a model whose layers are `layers`, its RAM chunks booked in the
    /// pool's `ledger` ([`PrefixCache::pooled`]).
    pub fn new(cache: PrefixCache, layers: LayerSpecs, ledger: PoolTier) -> Self {
        Self {
            cache,
            layers,
            rec: Recordings::default(),
            sharing: None,
            ledger,
        }
    }

    /// The pool's ledger its RAM chunks are booked in: evicting them makes room there only.
    pub fn ledger(&self) -> PoolTier {
        self.ledger
    }

    /// Restores the longest cached prefix of `prompt` into slot `seq` of `policy` (in
    /// pieces of `piece` tokens, ending where a prefill in such pieces can resume) and
    /// records the slot's K/V from there on. Returns the tokens restored.
    pub fn restore(
        &mut self,
        policy: &mut dyn KvPolicy,
        info: &ModelInfo,
        seq: usize,
        prompt: &[u32],
        piece: usize,
    ) -> anyhow::Result<usize> {
        let usable = |from| resumable(info, from, prompt.len(), piece);
        let resume = Resume {
            usable: &usable,
            piece,
            seq,
        };
        let restored = restore_prefix(&mut self.cache, policy, prompt, &self.layers, resume)?;
        let tokens = restored.reuse.tokens;
        self.rec.watch(seq, tokens);
        Ok(tokens)
    }

    /// Runs `step` on `policy` with the watched slots' K/V recorded.
    pub fn recording<R>(
        &mut self,
        policy: &mut dyn KvPolicy,
        step: impl FnOnce(&mut dyn KvPolicy) -> R,
    ) -> R {
        let mut capture = Capture::over(policy, std::mem::take(&mut self.rec));
        let out = step(&mut capture);
        self.rec = capture.into_recordings();
        out
    }

    /// What slot `seq` recorded, its recording ended.
    pub fn take(&mut self, seq: usize) -> anyhow::Result<Option<ChunkKv>> {
        let kv = self.rec.kv(seq)?;
        self.rec.forget(seq);
        Ok(kv)
    }

    /// Ends slot `seq`'s recording, keeping nothing.
    pub fn forget(&mut self, seq: usize) {
        self.rec.forget(seq);
    }

    /// Stores the whole chunks of `kv`, the K/V of `prompt[from..]`. Returns how many.
    pub fn store(&mut self, prompt: &[u32], from: usize, kv: &ChunkKv) -> anyhow::Result<usize> {
        Ok(store_new(&mut self.cache, prompt, from, kv)?)
    }

    /// Whether slot `seq` of `policy` holds restored chunks by reference (then prefixes are
    /// shared between live requests).
    pub fn shares(&mut self, policy: &mut dyn KvPolicy, seq: usize) -> bool {
        let shares = self.cache.shares_by_reference()
            && policy
                .as_restore()
                .is_some_and(|r: &mut dyn KvRestore| r.attaches_kv(seq));
        self.sharing = Some(shares);
        shares
    }

    /// The prompt tokens a request admitted now would hold by reference rather than in its
    /// own device buffers: the whole chunks at `prompt`'s start held in RAM, where the policy
    /// shares them in place on the device (0 until an admission has said it does; 0 for a
    /// policy streaming them from the host tier, whose device buffers hold every token).
    pub fn shared_prefix_tokens(&self, prompt: &[u32]) -> usize {
        if self.sharing != Some(true) || self.ledger != PoolTier::Device {
            return 0;
        }
        let c = self.cache.chunk_tokens();
        // A restore leaves the last token to prefill.
        let whole = prompt.len().saturating_sub(1) / c;
        let keys = self.cache.keys(&prompt[..whole * c]);
        keys.iter().take_while(|k| self.cache.in_ram(k)).count() * c
    }

    /// Evicts unleased chunks until the pool has `need` bytes free (a cache in the pool).
    pub fn evict_for(&mut self, need: u64) -> bool {
        self.cache.evict_for(need)
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.cache.chunk_tokens()
    }

    /// Stores the whole chunks of `kv` (the K/V of `prompt[from..]`, computed by slot `seq`)
    /// now, while the request runs, and has the slot hold the prompt's stored chunks by
    /// reference instead of its copy. Returns the chunks stored.
    pub fn share(
        &mut self,
        policy: &mut dyn KvPolicy,
        seq: usize,
        prompt: &[u32],
        from: usize,
        kv: &ChunkKv,
    ) -> anyhow::Result<usize> {
        // In a pool, only the chunks that fit beside its own copy are kept (the pool is
        // never passed, even for the moment before it gives the copy up).
        let stored = store_new(&mut self.cache, prompt, from, kv)?;
        adopt_prefix(&self.cache, policy, seq, prompt)?;
        Ok(stored)
    }

    /// The cache's counters.
    pub fn stats(&self) -> PrefixStats {
        self.cache.stats()
    }
}
