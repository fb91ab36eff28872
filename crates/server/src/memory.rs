//! Admission and preemption by memory: one device budget for the whole server
//! ([`kvpolicy::KvPool`]), as vLLM's scheduler governs its block pool (Kwon et al.,
//! PagedAttention, SOSP '23, §4.5 "Scheduling and preemption").
//!
//! **The rules.** A sequence's device bytes per token are what it holds over its tokens
//! rounded up to the growth step (`grow_tokens`, the unit the device buffers grow by);
//! a sequence holding nothing yet is taken at the highest rate the others show, or, when
//! none holds anything, at the model's whole K/V per token (no policy keeps more of a token
//! on the device). (1) *Admission*: a waiting request is admitted when nothing runs, or
//! when the device pool has room for what the running requests' prompts still add and its
//! own prompt plus a token, at those rates; otherwise it waits, oldest first (the queue
//! bound still answers 429). (2) *Preemption*:
//! before each step, the pool's bytes plus every sequence's growth this step (its new
//! capacity at its rate) plus one layer's worth of the largest sequence (a buffer grows
//! while the old one still exists) must fit the budget; while they do not, the most
//! recently admitted running request is preempted — its K/V swapped to the disk tier
//! ([`crate::swap`]) or dropped, to be read back or recomputed from its tokens when it is
//! admitted again ([`crate::engine`] replays them in the passes they first ran in; either
//! way it produces exactly the tokens it would have alone). The oldest
//! request is never preempted: it always makes progress. The policies' own meters ask the
//! pool before every growth, so a misjudged step fails that request (a budget error)
//! rather than exceed the budget. (3) *The host tier* (a host budget, with a disk tier): a
//! host store never holds more than its sequence's planned tokens (prompt and `max_tokens`,
//! [`Batched::expect`](kvpolicy::core::Batched::expect)), so a request is admitted only when
//! the host pool holds what every running request may still take at the model's whole K/V
//! per token and the newcomer's whole reservation; the host tier then never needs a
//! preemption, and a store that would pass the budget anyway goes to the disk tier.
//! (4) *Units kept by choice* (`auto`'s resident units): each request plans them within an
//! equal share of the device budget (budget ÷ `--max-batch`, or what the pool has free if
//! less: [`KvPool::device_share`]), so the first request does not take what the others
//! grow into.
use std::sync::Arc;

use kvpolicy::core::SeqHeld;
use kvpolicy::KvPool;

/// A running request as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct Running {
    /// Its slot.
    pub seq: usize,
    /// When it was (last) admitted: larger is more recent.
    pub admitted: u64,
    /// What its cache holds.
    pub held: SeqHeld,
    /// Tokens this step adds to it (0 when it does not run this step).
    pub adding: usize,
    /// Tokens its prompt (or a replay) will still add before it samples again.
    pub pending: usize,
    /// The most tokens it will hold: its prompt and the most it may generate.
    pub planned: usize,
}

/// The rules over one pool (module docs).
pub struct Governor {
    pool: Arc<KvPool>,
    grow_tokens: u64,
    n_layers: u64,
    /// The model's whole K/V per token, in bytes.
    kv_per_token: f64,
}

impl Governor {
    /// Rules over `pool`, for buffers growing `grow_tokens` at a time in a model of
    /// `n_layers` layers whose whole K/V takes `kv_per_token` bytes a token.
    pub fn new(pool: Arc<KvPool>, grow_tokens: usize, n_layers: usize, kv_per_token: u64) -> Self {
        Self {
            pool,
            grow_tokens: grow_tokens.max(1) as u64,
            n_layers: n_layers.max(1) as u64,
            kv_per_token: kv_per_token as f64,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Tokens rounded up to the growth step.
    fn capacity(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.grow_tokens) * self.grow_tokens
    }

    /// Device bytes per token of `held`; `None` when it holds no token yet.
    fn rate(&self, held: &SeqHeld) -> Option<f64> {
        match self.capacity(held.tokens) {
            0 => None,
            cap => Some(held.device_bytes as f64 / cap as f64),
        }
    }

    /// The highest rate among `running`, or the model's whole K/V per token when none
    /// holds a token yet.
    fn top_rate(&self, running: &[Running]) -> f64 {
        running
            .iter()
            .filter_map(|r| self.rate(&r.held))
            .reduce(f64::max)
            .unwrap_or(self.kv_per_token)
    }

    /// The device bytes `r` grows by when `tokens` more join it.
    fn growth(&self, r: &Running, tokens: usize, top: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let rate = self.rate(&r.held).unwrap_or(top);
        let now = self.capacity(r.held.tokens);
        let then = self.capacity(r.held.tokens + tokens as u64);
        rate * then.saturating_sub(now) as f64
    }

    /// Whether a request of `tokens` prompt tokens that will hold at most `planned` may join
    /// `running` (rule 1, and rule 3 for the host tier).
    pub fn admits(&self, running: &[Running], tokens: usize, planned: usize) -> bool {
        if running.is_empty() {
            return true;
        }
        self.device_admits(running, tokens) && self.host_admits(running, planned)
    }

    /// Rule 1 on the device tier.
    fn device_admits(&self, running: &[Running], tokens: usize) -> bool {
        self.admission_need(running, tokens)
            .is_none_or(|need| self.pool.device.fits(need))
    }

    /// The device bytes rule 1 needs free to admit a request of `tokens` prompt tokens
    /// beside `running` (`None` without a device budget): what the running prompts still
    /// add and its own prompt and a token. A prefix cache in the pool evicts for it.
    pub fn admission_need(&self, running: &[Running], tokens: usize) -> Option<u64> {
        self.pool.device.budget()?;
        let top = self.top_rate(running);
        let promised: f64 = running.iter().map(|r| self.growth(r, r.pending, top)).sum();
        Some((promised + top * self.capacity(tokens as u64 + 1) as f64).ceil() as u64)
    }

    /// The device bytes this step's growth needs free (`None` without a device budget): each
    /// growing request's growth and one layer of overlap. A prefix cache in the pool evicts
    /// for it before any request is preempted.
    pub fn step_need(&self, running: &[Running]) -> Option<u64> {
        self.pool.device.budget()?;
        let top = self.top_rate(running);
        let growth: f64 = running.iter().map(|r| self.growth(r, r.adding, top)).sum();
        Some((growth + self.overlap(running, top)).ceil() as u64)
    }

    /// A growing buffer and the one it replaces exist together for a moment: the largest
    /// layer of a growing request.
    fn overlap(&self, live: &[Running], top: f64) -> f64 {
        live.iter()
            .filter(|r| self.growth(r, r.adding, top) > 0.0)
            .map(|r| r.held.device_bytes as f64 / self.n_layers as f64)
            .fold(0.0, f64::max)
    }

    /// Rule 3: the host RAM every running request may still take, and the newcomer's whole
    /// reservation, fit the host budget.
    fn host_admits(&self, running: &[Running], planned: usize) -> bool {
        self.host_admission_need(running, planned)
            .is_none_or(|need| self.pool.host.fits(need))
    }

    /// The host bytes rule 3 needs free to admit a request that will hold at most `planned`
    /// tokens beside `running` (`None` without a host budget). A prefix cache in the host
    /// ledger evicts for it.
    pub fn host_admission_need(&self, running: &[Running], planned: usize) -> Option<u64> {
        self.pool.host.budget()?;
        // Host stores never hold more than a sequence's planned tokens; 0 for a policy that
        // keeps nothing on the host (seen once a request holds tokens and no host bytes).
        let uses_host = running.iter().any(|r| r.held.host_bytes > 0)
            || running.iter().all(|r| r.held.tokens == 0);
        let rate = if uses_host { self.kv_per_token } else { 0.0 };
        let promised: f64 = running
            .iter()
            .map(|r| (rate * r.planned as f64 - r.held.host_bytes as f64).max(0.0))
            .sum();
        Some((promised + rate * planned as f64).ceil() as u64)
    }

    /// The requests to preempt before this step, most recently admitted first (rule 2).
    pub fn to_preempt(&self, running: &[Running]) -> Vec<usize> {
        let Some(budget) = self.pool.device.budget() else {
            return Vec::new();
        };
        let top = self.top_rate(running);
        let mut live: Vec<Running> = running.to_vec();
        live.sort_by_key(|r| r.admitted);
        let mut used = self.pool.device.used() as f64;
        let mut out = Vec::new();
        loop {
            let growth: f64 = live.iter().map(|r| self.growth(r, r.adding, top)).sum();
            let overlap = self.overlap(&live, top);
            if used + growth + overlap <= budget as f64 || live.len() <= 1 {
                return out;
            }
            let Some(newest) = live.pop() else {
                return out;
            };
            used -= newest.held.device_bytes as f64;
            out.push(newest.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(seq: usize, admitted: u64, tokens: u64, bytes: u64, adding: usize) -> Running {
        Running {
            seq,
            admitted,
            held: SeqHeld {
                tokens,
                device_bytes: bytes,
                host_bytes: 0,
            },
            adding,
            pending: 0,
            planned: 0,
        }
    }

    /// Admission waits for room; preemption takes the newest first and never the oldest.
    #[test]
    fn admits_by_room_and_preempts_the_newest() {
        // 10 bytes per token, growth step 16 tokens, one layer.
        let pool = KvPool::new(Some(1000), None);
        let g = Governor::new(pool.clone(), 16, 1, 10);
        assert!(
            g.admits(&[], 10_000, 10_000),
            "nothing runs: always admitted"
        );
        pool.device.add(480);
        let a = running(0, 1, 16, 160, 1);
        let b = running(1, 2, 32, 320, 1);
        // A 16-token prompt takes 2 steps of 16 tokens at 10 bytes: 320 ≤ 520.
        assert!(g.admits(&[a, b], 16, 0));
        // 48 tokens: 4 steps, 640 > 520.
        assert!(!g.admits(&[a, b], 48, 0));
        // Both grow by a step (160 + 160) and the largest old layer overlaps its new one
        // (320): 480 + 320 + 320 = 1120 > 1000, so the newest goes; then 160 + 160 + 160 fit.
        assert_eq!(g.to_preempt(&[a, b]), vec![1]);
        // Not growing: nothing to do.
        let (a0, b0) = (running(0, 1, 16, 160, 0), running(1, 2, 20, 320, 0));
        assert!(g.to_preempt(&[a0, b0]).is_empty());
        // A request still prefilling 17 more tokens has two steps (320) promised.
        let c = Running {
            pending: 17,
            ..running(2, 3, 16, 160, 0)
        };
        assert!(!g.admits(&[a, b, c], 16, 0));
        // Nothing held yet: the model's whole K/V per token (10) stands in.
        // (48 + 32 tokens at 10: 800 > 520; 16 + 32: 480 fits.)
        let fresh = |pending| Running {
            pending,
            ..running(0, 1, 0, 0, 0)
        };
        assert!(!g.admits(&[fresh(40)], 16, 0));
        assert!(g.admits(&[fresh(10)], 16, 0));
        // The host tier: 10 bytes a token, 1000 in all, 400 held.
        let pool = KvPool::new(None, Some(1000));
        let g = Governor::new(pool.clone(), 16, 1, 10);
        pool.host.add(400);
        let r = |planned, host| Running {
            planned,
            held: SeqHeld {
                tokens: 8,
                device_bytes: 0,
                host_bytes: host,
            },
            ..running(0, 1, 8, 0, 0)
        };
        // One planned for 50 holding 400 of its 500: 100 promised; a newcomer of 50 fits.
        assert!(g.admits(&[r(50, 400)], 8, 50));
        assert!(!g.admits(&[r(50, 400)], 8, 51));
        // A policy holding nothing on the host reserves nothing there.
        assert!(g.admits(&[r(50, 0)], 8, 1000));
        // The oldest alone is never preempted.
        assert!(g.to_preempt(&[running(0, 1, 16, 5000, 64)]).is_empty());
    }
}
