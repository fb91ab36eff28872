//! What only some policies do, as traits a policy opts into and a caller discovers from
//! the trait object ([`KvPolicy::as_restore`](crate::KvPolicy::as_restore),
//! [`as_batched`](crate::KvPolicy::as_batched), [`as_profiled`](crate::KvPolicy::as_profiled)):
//! taking K/V without attention, one cache per sequence of a ragged batch, a cost profile,
//! one rank's share of a sequence ([`ShardLocal`], [`as_shard`](crate::KvPolicy::as_shard)).
use std::ops::Range;

use candle_core::Tensor;

use crate::attention::Partial;
use crate::error::Result;
use crate::lease::{KvLease, SharedRun};
use crate::pool::PoolTier;
use crate::profile::Profile;
use crate::step::AttnStep;

/// A policy that stores K/V computed elsewhere — a restored session, a shared prefix, or a
/// synthetic history for timing decode at contexts whose prefill would take hours
/// (`kvbench --synthetic-history`) — where `attend` would, without computing attention.
pub trait KvRestore {
    /// Stores the step's K/V (`step.q` is not read); later steps continue the sequence as
    /// after a prefill. The step follows the same call protocol as `attend`.
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()>;

    /// Whether [`attach_kv`](Self::attach_kv) keeps sequence `seq`'s K/V by reference
    /// (the default: no, it copies them as [`append_kv`](Self::append_kv) does).
    fn attaches_kv(&mut self, seq: usize) -> bool {
        let _ = seq;
        false
    }

    /// Whose ledger the K/V this policy holds by reference belong to: the memory it reads
    /// them from — [`PoolTier::Device`] for a policy attending them in place,
    /// [`PoolTier::Host`] for one streaming them from its host tier. `None` (the default)
    /// when it never holds K/V by reference. A prefix cache sharing its chunks books them
    /// there.
    fn attach_tier(&mut self) -> Option<PoolTier> {
        None
    }

    /// [`append_kv`](Self::append_kv) of K/V shared with other sequences (a prefix cache's
    /// chunk, immutable): a policy that can keeps the step's tensors by reference, holding a
    /// clone of `lease` while it does, instead of copying them. The default copies.
    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        let _ = lease;
        self.append_kv(step)
    }

    /// Sequence `seq` computed the K/V of `runs` at their positions in layer `layer` (one
    /// after another from position 0 or from the first it holds by itself), and they are
    /// now shared: it may hold the runs by reference instead and free its own copy. (Under
    /// a batch-invariant schedule the runs are what it computed, bit for bit; otherwise a
    /// run another sequence stored first may differ from its copy in the last bits.)
    /// Returns whether it did (the default: it keeps its copy).
    fn adopt_kv(&mut self, seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        let _ = (seq, layer, runs);
        Ok(false)
    }

    /// Sequence `seq`'s K/V of `layer`, every position from 0 to what it holds, on the CPU,
    /// bit for bit what it took (computed, appended or attached) — for a scheduler that
    /// swaps the sequence out before releasing it and appends them back when it resumes
    /// (vLLM's swap preemption, PagedAttention SOSP '23 §4.5). `None` when it cannot hand
    /// every position back exactly: a window dropped the layer's front, K/V stored in another
    /// form, nothing held (the default: it cannot).
    fn export_kv(&mut self, seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        let _ = (seq, layer);
        Ok(None)
    }
}

/// One layer's K and V: `(1, n_kv_heads, tokens, head_dim)` each, positional encoding
/// applied (as the model hands them to a policy) — a prefix cache's chunk of a layer, or
/// what [`KvRestore::export_kv`] hands back (positions `0..tokens`, on the CPU).
#[derive(Clone, Debug)]
pub struct LayerKv {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

/// A policy that keeps one cache per [`AttnStep::seq`], so that requests of different
/// lengths share forward passes. Policies without it are served in batches through
/// [`crate::PerSequence`].
pub trait Batched {
    /// Frees the cache of sequence `seq` (a finished request); the others go on.
    fn release(&mut self, seq: usize);
    /// Splits the sequences of the next step into mini-batches, in the order the model
    /// should run them (layer by layer across mini-batches); each inner list holds indices
    /// into `loads`. The default is one mini-batch holding every sequence.
    fn plan(&mut self, loads: &[SeqLoad]) -> Result<Vec<Vec<usize>>> {
        Ok(vec![(0..loads.len()).collect()])
    }
    /// Sequence `seq` (not started yet) will hold at most `tokens` tokens — its prompt and
    /// the most it may generate — so a policy may size its buffers for that rather than for
    /// the whole context it was prepared for. The default ignores it.
    fn expect(&mut self, seq: usize, tokens: usize) {
        let _ = (seq, tokens);
    }
    /// What sequence `seq` holds now, per tier, for a scheduler sharing one memory pool
    /// between sequences ([`crate::KvPool`]; a sequence that has not run holds nothing);
    /// `None` when the policy does not say (the default).
    fn held(&mut self, seq: usize) -> Option<SeqHeld> {
        let _ = seq;
        None
    }
}

/// What one sequence's cache holds ([`Batched::held`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqHeld {
    /// Tokens held whose bytes it counts (not those it holds by reference, a shared
    /// prefix: their owner counts them).
    pub tokens: u64,
    /// Bytes on the device tier.
    pub device_bytes: u64,
    /// Bytes in host RAM.
    pub host_bytes: u64,
}

/// A policy that plans with a cost profile (transfer and recompute rates).
pub trait Profiled {
    /// The profile, once known (given, or measured at the first step).
    fn profile(&self) -> Option<&Profile>;
}

/// What one sequence brings to the next forward step, for [`Batched::plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqLoad {
    /// The sequence's slot ([`AttnStep::seq`]).
    pub seq: usize,
    /// Tokens it has cached.
    pub cached: usize,
    /// Tokens the step adds.
    pub new: usize,
}

/// A policy that can hold one rank's share of a sequence in KV-parallel decoding (Helix,
/// arXiv 2507.07120 §3: the KV cache sharded along the sequence, each rank attending over
/// its shard, the partial results merged exactly by their log-sum-exp): a contiguous range
/// of positions that need not start at 0, and the attention of any step's queries over
/// what it holds, returned unmerged.
///
/// Calls follow [`KvPolicy`](crate::KvPolicy)'s protocol (layers in order, every layer of a
/// step with the same `store`), except that a step's position is the sequence's, not the
/// share's: a share starts where its first store does, and a step may store nothing.
pub trait ShardLocal {
    /// Stores the step's tokens at the absolute positions `store` (a sub-range of
    /// `step.pos..step.pos + t`; it begins where the share ends, or anywhere while the share
    /// is empty; empty: nothing stored) and returns the attention of every query of the step
    /// over every token held, masked by their absolute positions (causal, sliding window):
    /// output `(b, n_heads, t, head_dim)` f32 and log-sum-exp (`-inf` for a row that sees no
    /// token held).
    fn attend_shard(&mut self, step: &AttnStep<'_>, store: Range<usize>) -> Result<Partial>;

    /// The partial attention of a layer that reads KV layer `step.layer`'s cache (MLKV,
    /// [`crate::shared`]) over what the share holds of it, stored nothing; comes after that
    /// layer's `attend_shard` in the same step. The default: not supported.
    fn attend_shard_shared(&mut self, step: &AttnStep<'_>) -> Result<Partial> {
        let _ = step;
        Err(crate::shared::not_shareable("this local policy"))
    }
}

/// Checks that `store` (positions a [`ShardLocal`] policy is asked to store) lies within
/// `step`'s positions.
pub fn check_store(step: &AttnStep<'_>, store: &Range<usize>) -> Result<()> {
    let t = step.k.dim(2)?;
    if store.start < step.pos || store.end > step.pos + t {
        return Err(crate::error::KvError::invariant(format!(
            "a share asked to store positions {store:?} of a step at {}..{}",
            step.pos,
            step.pos + t
        )));
    }
    Ok(())
}
