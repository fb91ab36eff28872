//! Two device buffers and at most one keyed prefetch: while a unit is attended in one
//! buffer, the next fills the other (HeadInfer §3.2's ping-pong; KVPR §3.3's transfer ∥
//! regeneration; FlexGen's layer-wise overlap).
use crate::link::Link;
use crate::transfer::Ticket;
use kvpolicy_core::{KvError, Result};

/// The other of a [`PingPong`]'s two buffers (where the next unit is prefetched while
/// `buf` is attended).
pub fn other_buffer(buf: usize) -> usize {
    1 - buf.min(1)
}

/// What a [`PingPong`] buffer was (or is being) filled with.
#[derive(Debug, Clone, Copy)]
pub struct Loaded<K> {
    /// What it holds: the policy's unit key (layer, head group, range …).
    pub key: K,
    /// Which of the two buffers.
    pub buf: usize,
    /// The batches filling it, in submission order (at most two: KVPR queues X, then K/V).
    pub tickets: [Option<Ticket>; 2],
}

/// Two device buffers of type `B` and at most one prefetch keyed by `K` (module docs).
#[derive(Debug)]
pub struct PingPong<B, K> {
    bufs: [Option<B>; 2],
    cap: usize,
    prefetched: Option<Loaded<K>>,
}

impl<B, K> Default for PingPong<B, K> {
    fn default() -> Self {
        Self {
            bufs: [None, None],
            cap: 0,
            prefetched: None,
        }
    }
}

impl<B: Clone, K: Copy + PartialEq> PingPong<B, K> {
    /// Tokens the buffers hold (0 before the first [`install`](Self::install)).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Whether buffers are installed.
    pub fn is_ready(&self) -> bool {
        self.bufs[0].is_some()
    }

    /// Replaces both buffers with `bufs` of `cap` tokens. Queued copies may use the old
    /// ones, so they land first; any prefetch is dropped.
    pub fn install(&mut self, link: &mut Link, bufs: [B; 2], cap: usize) -> Result<()> {
        self.release(link)?;
        let [a, b] = bufs;
        self.bufs = [Some(a), Some(b)];
        self.cap = cap;
        Ok(())
    }

    /// Frees both buffers once the copies using them have landed.
    pub fn release(&mut self, link: &mut Link) -> Result<()> {
        link.wait_all()?;
        self.clear();
        Ok(())
    }

    /// Forgets the buffers and the prefetch without waiting (after a [`Link::reset`]).
    pub fn clear(&mut self) {
        self.bufs = [None, None];
        self.cap = 0;
        self.prefetched = None;
    }

    /// Buffer `i` (a cheap handle: tensors share storage).
    pub fn buf(&self, i: usize) -> Result<B> {
        self.bufs
            .get(i)
            .and_then(Clone::clone)
            .ok_or_else(|| KvError::invariant("the ping-pong buffers are not allocated"))
    }

    /// The prefetch of `key` if that is what was prefetched (its batches may still be in
    /// flight); any other prefetch is waited for and dropped, and `None` returned.
    pub fn take(&mut self, key: &K, link: &mut Link) -> Result<Option<Loaded<K>>> {
        match self.prefetched.take() {
            Some(p) if p.key == *key => Ok(Some(p)),
            Some(p) => {
                for t in p.tickets {
                    link.wait(t)?;
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Records what the other buffer is being filled with.
    pub fn set_prefetched(&mut self, loaded: Loaded<K>) {
        self.prefetched = Some(loaded);
    }
}
