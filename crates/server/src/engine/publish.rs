//! The engine's state in `/metrics` after every step ([`crate::metrics`], vLLM's metric
//! names under `kvpolicy_`): requests running and waiting, the K/V the policy holds per
//! tier, the pools' usage against their budgets, the prefix cache's counters, and the bytes
//! preempted requests have swapped to disk.
use std::sync::atomic::Ordering;

use super::Engine;

impl Engine {
    /// Running and queued requests, and the KV the policy holds per tier.
    pub(super) fn publish(&mut self) {
        let running = self.slots.iter().filter(|s| s.is_some()).count();
        self.free
            .store(self.slots.len() - running, Ordering::SeqCst);
        self.metrics.running.set(running as i64);
        // Submitted and not admitted yet (in the channel or in `waiting`), and preempted.
        self.metrics
            .queued
            .set((self.queued.load(Ordering::SeqCst) + self.preempted.len()) as i64);
        let s = self.policy.stats();
        self.metrics.set_kv(&s);
        if let Some(g) = &self.memory {
            self.metrics.set_pool(g.pool());
        }
        let swapped = self.preempted.iter().filter_map(|a| a.swapped.as_ref());
        self.metrics
            .kv_swapped_bytes
            .set(swapped.map(|s| s.bytes).sum());
        if let Some(r) = &self.reuse {
            self.metrics.set_prefix(&r.stats());
        }
    }
}
