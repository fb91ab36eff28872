//! The engine's side of the prefix cache ([`crate::reuse`]): what a request's prefill
//! computed goes to the cache when the request finishes — or, when requests share prefixes
//! by reference, as soon as its prompt is in, the request then holding the stored chunks
//! from the cache (vLLM's automatic prefix caching caches a block once it is full; SGLang's
//! radix cache inserts a request's prefix as it is computed).
use super::{Active, Engine};

impl Engine {
    /// Slot `seq`'s prompt is in: its recording ends, and under sharing its chunks are
    /// stored and adopted now (the requests waiting for them can start). Chunks that cannot
    /// be stored or shared cost only their reuse: the request keeps its own copy.
    pub(super) fn prompt_in(&mut self, seq: usize) -> anyhow::Result<()> {
        let (Some(r), Some(a)) = (self.reuse.as_mut(), self.slots[seq].as_mut()) else {
            return Ok(());
        };
        a.computed = r.take(seq)?;
        if let Some(kv) = a.computed.take_if(|_| a.sharing) {
            match r.share(self.policy.as_mut(), seq, &a.job.prompt, a.restored, &kv) {
                Ok(n) => {
                    self.metrics.prefix_stored_chunks.inc_by(n as u64);
                }
                Err(e) => eprintln!("prefix cache: a request's chunks were not shared: {e:#}"),
            }
        }
        Ok(())
    }

    /// Stores what finished request `a` computed and has not stored yet — after its answer
    /// (the client does not wait for the writes) and after its slot is free: a chunk that
    /// cannot be stored costs only its reuse.
    pub(super) fn store_finished(&mut self, a: &Active) {
        let (Some(r), Some(kv)) = (self.reuse.as_mut(), &a.computed) else {
            return;
        };
        match r.store(&a.job.prompt, a.restored, kv) {
            Ok(n) => {
                self.metrics.prefix_stored_chunks.inc_by(n as u64);
            }
            Err(e) => eprintln!("prefix cache: a request's chunks were not stored: {e:#}"),
        }
    }
}
