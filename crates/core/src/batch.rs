//! Ragged batches for every policy: [`PerSequence`] keeps one instance of a
//! single-sequence policy per request slot ([`AttnStep::seq`]), so requests of different
//! lengths share forward passes (their projections and MLPs run packed; each attends only
//! over its own cache). `hybrid` keeps its sequences natively (HybridServe §4.3) and does
//! not need it.
use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::capabilities::{Batched, KvRestore, LayerKv, Profiled, SeqHeld};
use crate::error::Result;
use crate::lease::{KvLease, SharedRun};
use crate::policy::KvPolicy;
use crate::pool::PoolTier;
use crate::profile::Profile;
use crate::restore::not_restorable;
use crate::stats::KvStats;
use crate::step::{AttnStep, KvShape};

/// Builds a fresh single-sequence policy for a new request.
pub type PolicyFactory = Box<dyn Fn() -> Result<Box<dyn KvPolicy>> + Send>;

/// One single-sequence policy per request slot, created on the slot's first step and
/// dropped by [`Batched::release`]. Stats are summed over the live sequences (peaks over
/// the run: the sum of the live instances' current bytes at its highest).
pub struct PerSequence {
    name: String,
    factory: PolicyFactory,
    shape: Option<KvShape>,
    seqs: BTreeMap<usize, Box<dyn KvPolicy>>,
    /// The most tokens a sequence not started yet will hold ([`Batched::expect`]).
    expected: BTreeMap<usize, usize>,
    /// Counters of released sequences, kept so cumulative stats do not drop.
    retired: KvStats,
    /// Whether the policy is LOSSY, as an instance prepared for the run says (known before
    /// any sequence runs: a server prints it when it starts).
    lossy: bool,
    /// Where an instance prepared for the run holds K/V by reference
    /// ([`KvRestore::attach_tier`]).
    attach_tier: Option<PoolTier>,
    device_peak: u64,
}

impl PerSequence {
    /// Wraps `factory`, which must build the same policy each call; `name` is its name.
    pub fn new(name: &str, factory: PolicyFactory) -> Self {
        Self {
            name: name.to_string(),
            factory,
            shape: None,
            seqs: BTreeMap::new(),
            expected: BTreeMap::new(),
            retired: KvStats::default(),
            lossy: false,
            attach_tier: None,
            device_peak: 0,
        }
    }

    fn live_device_bytes(&self) -> u64 {
        self.seqs.values().map(|p| p.stats().device_kv_bytes).sum()
    }

    /// The cache of sequence `seq`, made (and prepared) at its first step.
    fn cache(&mut self, seq: usize) -> Result<&mut Box<dyn KvPolicy>> {
        if !self.seqs.contains_key(&seq) {
            let mut p = (self.factory)()?;
            if let Some(s) = &self.shape {
                // Sized for what the sequence will hold, when that is known and less.
                let max_tokens = self
                    .expected
                    .remove(&seq)
                    .map_or(s.max_tokens, |n| n.clamp(1, s.max_tokens));
                p.prepare(&KvShape {
                    max_tokens,
                    ..s.clone()
                })?;
            }
            self.seqs.insert(seq, p);
        }
        self.seqs.get_mut(&seq).ok_or_else(|| {
            crate::error::KvError::invariant(format!(
                "sequence {seq} has no cache after it was created"
            ))
        })
    }
}

impl KvPolicy for PerSequence {
    fn name(&self) -> &str {
        &self.name
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        // Each instance serves one sequence of up to `max_tokens` tokens.
        let one = KvShape {
            batch: 1,
            ..shape.clone()
        };
        // Check the options once, before any request starts.
        let mut probe = (self.factory)()?;
        probe.prepare(&one)?;
        self.lossy = probe.stats().lossy;
        self.attach_tier = probe.as_restore().and_then(|r| r.attach_tier());
        for p in self.seqs.values_mut() {
            p.prepare(&one)?;
        }
        self.shape = Some(one);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let out = self.cache(step.seq)?.attend(step)?;
        self.device_peak = self.device_peak.max(self.live_device_bytes());
        Ok(out)
    }

    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let out = self.cache(step.seq)?.attend_shared(step)?;
        self.device_peak = self.device_peak.max(self.live_device_bytes());
        Ok(out)
    }

    fn seq_len(&self) -> usize {
        self.seqs.values().map(|p| p.seq_len()).max().unwrap_or(0)
    }

    fn reset(&mut self) {
        self.seqs.clear();
        self.expected.clear();
        self.retired = KvStats::default();
        self.device_peak = 0;
    }

    fn stats(&self) -> KvStats {
        let mut s = self.retired.clone();
        for p in self.seqs.values() {
            let q = p.stats();
            s.device_kv_bytes += q.device_kv_bytes;
            s.host_kv_bytes += q.host_kv_bytes;
            s.host_pinned_bytes += q.host_pinned_bytes;
            s.disk_kv_bytes += q.disk_kv_bytes;
            add_cumulative(&mut s, &q);
            s.add_metrics(&q.policy_metrics, true);
            s.kv_tokens = s.kv_tokens.max(q.kv_tokens);
            // An approximate policy (or a lossy host form) is lossy for the whole batch.
            s.lossy |= q.lossy;
        }
        s.lossy |= self.lossy;
        s.device_kv_peak_bytes = self.device_peak;
        s.sequences = self.seqs.len() as u64;
        s
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }

    fn as_batched(&mut self) -> Option<&mut dyn Batched> {
        Some(self)
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        Some(self)
    }
}

impl KvRestore for PerSequence {
    /// Each sequence's policy takes its K/V, where it is a [`KvRestore`].
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let p = self.cache(step.seq)?;
        let name = p.name().to_string();
        p.as_restore()
            .ok_or_else(|| not_restorable(&name, step.layer))?
            .append_kv(step)?;
        self.device_peak = self.device_peak.max(self.live_device_bytes());
        Ok(())
    }

    fn attaches_kv(&mut self, seq: usize) -> bool {
        self.cache(seq)
            .ok()
            .and_then(|p| p.as_restore().map(|r| r.attaches_kv(seq)))
            .unwrap_or(false)
    }

    fn attach_tier(&mut self) -> Option<PoolTier> {
        self.attach_tier
    }

    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        let p = self.cache(step.seq)?;
        let name = p.name().to_string();
        p.as_restore()
            .ok_or_else(|| not_restorable(&name, step.layer))?
            .attach_kv(step, lease)?;
        self.device_peak = self.device_peak.max(self.live_device_bytes());
        Ok(())
    }

    fn adopt_kv(&mut self, seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        match self.seqs.get_mut(&seq).and_then(|p| p.as_restore()) {
            Some(r) => r.adopt_kv(seq, layer, runs),
            None => Ok(false),
        }
    }

    fn export_kv(&mut self, seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        match self.seqs.get_mut(&seq).and_then(|p| p.as_restore()) {
            Some(r) => r.export_kv(seq, layer),
            None => Ok(None),
        }
    }
}

impl Profiled for PerSequence {
    fn profile(&self) -> Option<&Profile> {
        self.seqs
            .values()
            .find_map(|p| p.as_profiled().and_then(Profiled::profile))
    }
}

impl Batched for PerSequence {
    fn expect(&mut self, seq: usize, tokens: usize) {
        self.expected.insert(seq, tokens);
    }

    fn release(&mut self, seq: usize) {
        self.expected.remove(&seq);
        if let Some(p) = self.seqs.remove(&seq) {
            let q = p.stats();
            add_cumulative(&mut self.retired, &q);
            self.retired.add_metrics(&q.policy_metrics, false);
            self.retired.lossy |= q.lossy;
        }
    }

    /// Always says: a sequence without a cache yet holds nothing.
    fn held(&mut self, seq: usize) -> Option<SeqHeld> {
        Some(self.seqs.get(&seq).map_or_else(SeqHeld::default, |p| {
            let s = p.stats();
            SeqHeld {
                tokens: (p.seq_len() as u64).saturating_sub(s.shared_kv_tokens),
                device_bytes: s.device_kv_bytes,
                host_bytes: s.host_kv_bytes,
            }
        }))
    }
}

/// Adds the cumulative counters of `q` to `s` (sums; the scratch peaks are the larger, as
/// sequences attend one at a time; direct I/O if any sequence's disk tier used it).
fn add_cumulative(s: &mut KvStats, q: &KvStats) {
    s.h2d_bytes += q.h2d_bytes;
    s.d2h_bytes += q.d2h_bytes;
    s.recompute_flops += q.recompute_flops;
    s.recompute_tokens += q.recompute_tokens;
    s.transfer_wait_s += q.transfer_wait_s;
    s.copy_s += q.copy_s;
    s.link_busy_s += q.link_busy_s;
    s.disk_read_bytes += q.disk_read_bytes;
    s.disk_write_bytes += q.disk_write_bytes;
    s.disk_wait_s += q.disk_wait_s;
    s.disk_direct_io |= q.disk_direct_io;
    s.attn_scratch_peak_bytes = s.attn_scratch_peak_bytes.max(q.attn_scratch_peak_bytes);
    s.device_scratch_peak_bytes = s.device_scratch_peak_bytes.max(q.device_scratch_peak_bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy that only reports fixed disk and scratch counters.
    struct Fixed;

    impl KvPolicy for Fixed {
        fn name(&self) -> &str {
            "fixed"
        }
        fn prepare(&mut self, _: &KvShape) -> Result<()> {
            Ok(())
        }
        fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
            Ok(step.q.clone())
        }
        fn seq_len(&self) -> usize {
            0
        }
        fn reset(&mut self) {}
        fn stats(&self) -> KvStats {
            KvStats {
                disk_kv_bytes: 100,
                disk_read_bytes: 10,
                disk_write_bytes: 7,
                disk_direct_io: true,
                attn_scratch_peak_bytes: 5,
                ..KvStats::default()
            }
        }
    }

    /// Disk bytes are summed over live and released sequences like every other counter.
    #[test]
    fn disk_counters_add_up_over_sequences() -> Result<()> {
        let mut b = PerSequence::new("fixed", Box::new(|| Ok(Box::new(Fixed))));
        for seq in 0..3 {
            b.cache(seq)?;
        }
        b.release(2);
        let s = b.stats();
        assert_eq!(s.disk_kv_bytes, 200, "live sequences' files");
        assert_eq!(s.disk_read_bytes, 30);
        assert_eq!(s.disk_write_bytes, 21);
        assert!(s.disk_direct_io);
        assert_eq!(s.attn_scratch_peak_bytes, 5);
        Ok(())
    }
}
