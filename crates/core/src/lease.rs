//! K/V shared by reference between sequences: a prefix that several live requests hold
//! once (vLLM's automatic prefix caching with reference-counted blocks, SOSP '23 §4.3;
//! SGLang's RadixAttention, whose tree nodes are pinned while a request uses them). The
//! owner of shared K/V (a prefix cache's chunk) hands a policy the tensors with a
//! [`KvLease`]; the policy keeps a clone of the lease for as long as it reads them, and the
//! owner does not evict what is leased ([`KvLease::holders`]).
use std::sync::Arc;

use candle_core::Tensor;

/// A hold on shared K/V: each clone a policy keeps is one holder.
#[derive(Clone, Debug, Default)]
pub struct KvLease(Arc<()>);

impl KvLease {
    /// A lease no policy holds yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many clones other than this one are alive (the sequences holding the K/V by
    /// reference, when this one is the owner's).
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0) - 1
    }
}

/// K/V of tokens `pos..pos + len` of one layer that a sequence may hold by reference:
/// `(1, n_kv_heads, len, head_dim)` each, as the model handed them to a policy.
#[derive(Clone, Copy, Debug)]
pub struct SharedRun<'a> {
    /// Keys.
    pub k: &'a Tensor,
    /// Values.
    pub v: &'a Tensor,
    /// The position of the first token.
    pub pos: usize,
    /// The owner's lease, cloned by a policy that keeps the run.
    pub lease: &'a KvLease,
}

impl SharedRun<'_> {
    /// The run kept by reference: its tensors and a clone of the lease.
    pub fn keep(&self) -> KeptRun {
        KeptRun {
            k: self.k.clone(),
            v: self.v.clone(),
            pos: self.pos,
            _lease: self.lease.clone(),
        }
    }
}

/// A [`SharedRun`] a policy keeps: the K/V of tokens `pos..end()`, and a holder of the
/// owner's lease for as long as it lives.
#[derive(Debug)]
pub struct KeptRun {
    /// Keys `(1, n_kv_heads, len, head_dim)`.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// The position of the first token.
    pub pos: usize,
    _lease: KvLease,
}

impl KeptRun {
    /// One past the last position.
    pub fn end(&self) -> usize {
        self.pos + self.k.dims().get(2).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holders are the clones besides the owner's, counted while they live.
    #[test]
    fn holders_count_the_clones() {
        let owner = KvLease::new();
        assert_eq!(owner.holders(), 0);
        let a = owner.clone();
        let b = a.clone();
        assert_eq!(owner.holders(), 2);
        drop((a, b));
        assert_eq!(owner.holders(), 0);
    }
}
