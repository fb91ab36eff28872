//! One KV memory pool per tier, shared by every sequence a server (or any crate that
//! batches) runs, so that `--device-kv-budget` and `--host-kv-budget` bound the *sum* over
//! the live sequences rather than each one: vLLM's block manager (one
//! `gpu_memory_utilization` for every request, PagedAttention, SOSP '23, §4.2) and
//! HybridServe's device pool shared by its mini-batches (§4.3). [`KvPool`] only keeps the
//! books: each policy's [`DeviceMeter`](crate::DeviceMeter) asks the device ledger before
//! it grows and records what it holds, and the host tier's RAM stores ask the host ledger
//! before they grow (past it, a layer goes to the disk tier). What to do when a ledger is
//! short — wait, preempt, spill — is the scheduler's and the policies' decision.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The books of one tier: its budget and the bytes every member holds now.
#[derive(Debug, Default)]
pub struct TierPool {
    budget: Option<u64>,
    used: AtomicU64,
    peak: AtomicU64,
}

impl TierPool {
    /// A ledger of `budget` bytes (`None`: unlimited, only counted).
    pub fn new(budget: Option<u64>) -> Self {
        Self {
            budget,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Bytes held now, over every member.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// Bytes left under the budget (`u64::MAX` without one).
    pub fn free(&self) -> u64 {
        self.budget
            .map_or(u64::MAX, |b| b.saturating_sub(self.used()))
    }

    /// Whether `extra` more bytes would stay within the budget.
    pub fn fits(&self, extra: u64) -> bool {
        self.budget
            .is_none_or(|b| self.used().saturating_add(extra) <= b)
    }

    /// Records that a member now holds `bytes` more.
    pub fn add(&self, bytes: u64) {
        let now = self.used.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    /// Records that a member now holds `bytes` fewer.
    pub fn sub(&self, bytes: u64) {
        // Never below zero, whatever a member misreports.
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Moves a member's share from `old` bytes to `new` bytes.
    pub fn change(&self, old: u64, new: u64) {
        if new >= old {
            self.add(new - old);
        } else {
            self.sub(old - new);
        }
    }
}

/// The pools of the device tier and of the host tier's RAM, shared through
/// [`PolicyOptions::pool`](crate::PolicyOptions::pool) by every policy instance built
/// from the same options.
#[derive(Debug, Default)]
pub struct KvPool {
    /// The device tier (every policy's [`DeviceMeter`](crate::DeviceMeter)).
    pub device: TierPool,
    /// Host RAM of the host tier's stores that may spill to a disk tier.
    pub host: TierPool,
    /// How many sequences may run at once (1: one).
    sequences: usize,
}

/// Which of a [`KvPool`]'s ledgers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolTier {
    /// The device tier's.
    Device,
    /// The host tier's RAM.
    Host,
}

impl KvPool {
    /// The ledger of `tier`.
    pub fn tier(&self, tier: PoolTier) -> &TierPool {
        match tier {
            PoolTier::Device => &self.device,
            PoolTier::Host => &self.host,
        }
    }

    /// Pools of `device` and `host` bytes (`None`: unlimited, only counted).
    pub fn new(device: Option<u64>, host: Option<u64>) -> Arc<Self> {
        Self::shared_by(device, host, 1)
    }

    /// Pools that up to `sequences` sequences share at once.
    pub fn shared_by(device: Option<u64>, host: Option<u64>, sequences: usize) -> Arc<Self> {
        Arc::new(Self {
            device: TierPool::new(device),
            host: TierPool::new(host),
            sequences: sequences.max(1),
        })
    }

    /// The device bytes one sequence may plan to keep for itself, holding `held` now: what
    /// the pool has free and it holds, at most an equal share of the budget (`None`:
    /// unlimited). The rule a policy that fills its budget by choice (`auto`'s resident
    /// units) plans with, so that one sequence does not take what the others grow into.
    pub fn device_share(&self, held: u64) -> Option<u64> {
        let budget = self.device.budget()?;
        let share = budget / self.sequences as u64;
        Some(share.min(held.saturating_add(self.device.free())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The books add up over members, never go below zero, and keep the peak.
    #[test]
    fn ledger_adds_up_and_keeps_its_peak() {
        let p = TierPool::new(Some(100));
        p.add(60);
        assert!(p.fits(40));
        assert!(!p.fits(41));
        p.change(60, 90);
        assert_eq!(p.used(), 90);
        assert_eq!(p.free(), 10);
        p.sub(200);
        assert_eq!(p.used(), 0);
        assert_eq!(p.peak(), 90);
        assert_eq!(TierPool::new(None).free(), u64::MAX);
    }

    /// A meter in a pool asks it before growing, names what every member holds when it
    /// refuses, and gives its bytes back when it is dropped.
    #[test]
    fn meters_share_the_pool_and_give_back_what_they_held() {
        let pool = KvPool::new(Some(100), None);
        let opts = crate::options::PolicyOptions {
            device_kv_budget: Some(100),
            pool: Some(pool.clone()),
            ..Default::default()
        };
        let mut a = crate::stats::DeviceMeter::for_options(&opts);
        let mut b = crate::stats::DeviceMeter::for_options(&opts);
        a.alloc(70);
        assert!(b.fits(30));
        assert!(!b.fits(31), "its own budget has room; the pool has not");
        let e = b.exceeded("a layer", crate::stats::Need::More(31), "", Vec::new());
        assert!(
            matches!(e, crate::error::KvError::BudgetExceeded { in_use: 70, .. }),
            "{e}"
        );
        b.alloc(20);
        assert_eq!(pool.device.used(), 90);
        drop(a);
        assert_eq!(pool.device.used(), 20);
        b.reset();
        assert_eq!((pool.device.used(), pool.device.peak()), (0, 90));
    }
}
