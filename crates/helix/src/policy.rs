//! `helix`: KV-parallel decoding (Helix, arXiv 2507.07120 §3). Each rank keeps a contiguous
//! share of the sequence's K/V ([`crate::shares`]) under a local lossless policy that can
//! hold a share ([`ShardLocal`](kvpolicy_core::ShardLocal)); every rank runs the whole model on the same tokens, so
//! every rank has every step's queries; each attends them over its share and one
//! all-gather per layer of (output, log-sum-exp) lets every rank merge the partials
//! exactly, in rank order, into the same output. Decode sends `ranks × heads × (head_dim +
//! 1)` values per layer and token whatever the context — what does grow with the context,
//! the KV reads, is split `ranks` ways.
//!
//! Where this differs from the paper: the FFN is replicated on every rank instead of
//! tensor-parallel (the models here are small; replication needs no second collective),
//! and shares are sized from the run's declared length rather than filled round-robin, so
//! that each rank's keys are one range of positions and sliding windows need no special
//! case.
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor, D};
use kvpolicy_core::{
    merge_partials, AttnStep, KvError, KvPolicy, KvShape, KvStats, Partial, PolicyMetric, Result,
};

use crate::collective::Collective;
use crate::shares::Shares;

/// What the collectives of a run cost.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct CollectiveCounters {
    /// All-gathers run (one per layer and step).
    pub calls: u64,
    /// f32 values every rank received (`ranks ×` each rank's part), summed over calls.
    pub values: u64,
    /// Values received by decode steps' all-gathers.
    pub decode_values: u64,
    /// Decode steps' all-gathers.
    pub decode_calls: u64,
    /// Time in collectives (waiting for the slowest rank included).
    pub time: Duration,
    /// Time in decode steps' collectives.
    pub decode_time: Duration,
}

/// The `helix` policy (module docs).
pub struct HelixPolicy {
    local: Box<dyn KvPolicy>,
    comm: Arc<dyn Collective>,
    shares: Option<Shares>,
    /// Tokens of the sequence once the current step is done.
    len: usize,
    counters: CollectiveCounters,
}

impl HelixPolicy {
    /// A rank of a KV-parallel group over `comm`, keeping its share under `local`; an error
    /// when `local` cannot hold a share.
    pub fn new(mut local: Box<dyn KvPolicy>, comm: Arc<dyn Collective>) -> Result<Self> {
        if local.as_shard().is_none() {
            return Err(KvError::Unsupported(format!(
                "`helix` keeps each rank's share under a policy that can hold part of a sequence; `{}` cannot (use local=full, layer, headwise, headwise:N or auto)",
                local.name()
            )));
        }
        Ok(Self {
            local,
            comm,
            shares: None,
            len: 0,
            counters: CollectiveCounters::default(),
        })
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.comm.size()
    }

    /// The shares of the run (after [`KvPolicy::prepare`]).
    pub fn shares(&self) -> Option<Shares> {
        self.shares
    }

    /// The local policy holding this rank's share.
    pub fn local(&self) -> &dyn KvPolicy {
        self.local.as_ref()
    }

    /// What the collectives cost so far.
    pub fn counters(&self) -> CollectiveCounters {
        self.counters
    }

    /// Tokens this rank holds.
    pub fn held(&self) -> usize {
        self.shares
            .map_or(0, |s| s.held(self.comm.rank(), self.len))
    }

    /// Gathers every rank's partial and merges them in rank order (the same on every rank).
    fn merge(&mut self, part: Partial, decode: bool) -> Result<Tensor> {
        let d = part.out.dim(D::Minus1)?;
        let packed = Tensor::cat(&[&part.out, &part.lse.unsqueeze(D::Minus1)?], D::Minus1)?;
        let started = Instant::now();
        let all = self
            .comm
            .all_gather(&packed)
            .map_err(|e| KvError::Unsupported(format!("helix: {e}")))?;
        let spent = started.elapsed();
        self.counters.time += spent;
        let n = all.elem_count() as u64;
        self.counters.calls += 1;
        self.counters.values += n;
        if decode {
            self.counters.decode_calls += 1;
            self.counters.decode_values += n;
            self.counters.decode_time += spent;
        }
        let parts = (0..self.comm.size())
            .map(|r| {
                let p = all.get(r)?;
                Ok(Partial {
                    out: p.narrow(D::Minus1, 0, d)?.contiguous()?,
                    lse: p
                        .narrow(D::Minus1, d, 1)?
                        .squeeze(D::Minus1)?
                        .contiguous()?,
                    scratch_bytes: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(merge_partials(&parts)?.out)
    }
}

impl KvPolicy for HelixPolicy {
    fn name(&self) -> &str {
        "helix"
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        let shares = Shares::for_run(shape.max_tokens, self.comm.size());
        // The local policy sizes (and checks its budgets against) this rank's share.
        let mine = shares.range(self.comm.rank());
        let local = KvShape {
            max_tokens: shape
                .max_tokens
                .min(mine.end)
                .saturating_sub(mine.start)
                .max(1),
            ..shape.clone()
        };
        self.local.prepare(&local)?;
        self.shares = Some(shares);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let Some(shares) = self.shares else {
            return Err(KvError::Unsupported(
                "`helix` sizes the ranks' shares from the run's length: call prepare before the first step".into(),
            ));
        };
        let t = step.q.dim(2)?;
        if step.layer == 0 {
            if step.pos != self.len {
                return Err(KvError::OutOfOrder {
                    seq: step.seq,
                    layer: step.layer,
                    held: self.len,
                    pos: step.pos,
                });
            }
            self.len = step.pos + t;
        }
        let store = shares.store(self.comm.rank(), step.pos..step.pos + t);
        let local = self
            .local
            .as_shard()
            .ok_or_else(|| KvError::invariant("the local policy stopped holding a share"))?;
        let part = local.attend_shard(step, store)?;
        let out = self.merge(part, t == 1 && step.pos > 0)?;
        Ok(out.to_dtype(step.q.dtype())?)
    }

    /// A layer reading KV layer `step.layer`'s cache (MLKV): every rank attends over its
    /// share of that layer, and the partials merge as for the owner.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let t = step.q.dim(2)?;
        let local = self
            .local
            .as_shard()
            .ok_or_else(|| KvError::invariant("the local policy stopped holding a share"))?;
        let part = local.attend_shard_shared(step)?;
        let out = self.merge(part, t == 1 && step.pos > 0)?;
        Ok(out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.len
    }

    fn reset(&mut self) {
        self.local.reset();
        self.len = 0;
        self.counters = CollectiveCounters::default();
    }

    fn stats(&self) -> KvStats {
        let mut stats = self.local.stats();
        stats.kv_tokens = self.len as u64;
        let c = self.counters;
        let per_decode = if c.decode_calls == 0 {
            0.0
        } else {
            c.decode_values as f64 * 4.0 / c.decode_calls as f64
        };
        stats.policy_metrics.extend([
            PolicyMetric::gauge("rank", self.comm.rank() as f64, "rank"),
            PolicyMetric::gauge("ranks", self.comm.size() as f64, "ranks"),
            PolicyMetric::gauge("share_tokens", self.held() as f64, "tokens"),
            PolicyMetric::counter("collective_bytes", c.values as f64 * 4.0, "bytes"),
            PolicyMetric::gauge("decode_bytes_per_layer_token", per_decode, "bytes"),
            PolicyMetric::counter("collective_s", c.time.as_secs_f64(), "s"),
            PolicyMetric::counter("decode_collective_s", c.decode_time.as_secs_f64(), "s"),
        ]);
        stats
    }
}

/// Bytes one decode token's all-gather brings every rank, per layer: `ranks × heads ×
/// (head_dim + 1)` f32 values (every rank's output row and log-sum-exp per query head).
pub fn decode_bytes_per_layer(ranks: usize, n_heads: usize, head_dim: usize) -> u64 {
    (ranks * n_heads * (head_dim + 1) * DType::F32.size_in_bytes()) as u64
}
