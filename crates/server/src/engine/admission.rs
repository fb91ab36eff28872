//! The engine's admissions: waiting and preempted requests into free slots while memory
//! allows, a step's preemptions ([`crate::memory`]: vLLM's scheduler, PagedAttention,
//! SOSP '23, §4.5), prompt prefixes restored from the prefix cache, and requests whose
//! client went away dropped.
use std::sync::atomic::Ordering;

use kvpolicy::core::PoolTier;
use kvpolicy::models::{SeqChunk, TextStream};

use super::{Active, Engine};
use crate::error::internal_message;
use crate::events::Event;
use crate::memory::Running;
use crate::sampler::Chooser;
use crate::swap::PreemptionMode;

impl Engine {
    /// Preempted requests, then waiting ones, oldest first, into free slots while memory
    /// allows ([`crate::memory`]); those whose client left are dropped.
    pub(super) fn admit(&mut self) {
        while let Some(free) = self.slots.iter().position(Option::is_none) {
            // The oldest waiting request that is not waiting for a running request to store
            // chunks of its prompt (it then holds them by reference instead of computing
            // them again); those behind it go ahead meanwhile.
            let next = (0..self.waiting.len())
                .find(|&i| !self.awaits_shared_prefix(&self.waiting[i].prompt));
            let (prompt, tokens, planned) = match (self.preempted.front(), next) {
                (Some(a), _) => (
                    &a.job.prompt,
                    a.job.prompt.len() + a.generated.len(),
                    a.planned(),
                ),
                (None, Some(i)) => {
                    let job = &self.waiting[i];
                    (
                        &job.prompt,
                        job.prompt.len(),
                        job.prompt.len() + job.max_tokens,
                    )
                }
                (None, None) => break,
            };
            // What it will hold by reference (a shared prefix in the cache) takes no room of
            // its own on the device.
            let shared = self
                .reuse
                .as_ref()
                .map_or(0, |r| r.shared_prefix_tokens(prompt));
            let tokens = tokens - shared.min(tokens);
            if self.hold_resumes && !self.preempted.is_empty() {
                // Nothing has left since the last preemption: its room is not back yet.
                break;
            }
            if let Some(running) = self.running(&[]) {
                let refused = |e: &Self| {
                    e.memory
                        .as_ref()
                        .is_some_and(|g| !g.admits(&running, tokens, planned))
                };
                if refused(self) {
                    // The prefix cache's unleased chunks make room first, when it is in the pool.
                    // (The need in the ledger its chunks are booked in.)
                    let need = |ledger| {
                        let g = self.memory.as_ref()?;
                        match ledger {
                            PoolTier::Device => g.admission_need(&running, tokens),
                            PoolTier::Host => g.host_admission_need(&running, planned),
                        }
                    };
                    let need = self.reuse.as_ref().and_then(|r| need(r.ledger()));
                    if let (Some(r), Some(need)) = (self.reuse.as_mut(), need) {
                        r.evict_for(need);
                    }
                    if refused(self) {
                        break;
                    }
                }
            }
            let mut a = match self.preempted.pop_front() {
                Some(a) => a,
                None => {
                    let Some(job) = next.and_then(|i| self.waiting.remove(i)) else {
                        break;
                    };
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    Active {
                        chooser: Chooser::new(&job.params, job.seed),
                        detok: TextStream::new(job.params.stop.clone()),
                        job,
                        pos: 0,
                        restored: 0,
                        computed: None,
                        sharing: false,
                        swapped: None,
                        generated: Vec::new(),
                        last_token_at: None,
                        admitted: 0,
                    }
                }
            };
            if a.job.events.is_closed() {
                self.metrics.cancelled.inc();
                continue;
            }
            if let Err(e) = self.start_in(free, &mut a) {
                a.job
                    .events
                    .send(Event::Failed(internal_message(&format!("{e:#}"))));
                self.release(free);
                self.metrics.failed.inc();
                continue;
            }
            a.sharing = self
                .reuse
                .as_mut()
                .is_some_and(|r| r.shares(self.policy.as_mut(), free));
            self.admissions += 1;
            a.admitted = self.admissions;
            self.slots[free] = Some(a);
        }
    }

    /// Slot `seq` made ready for request `a`: its cache sized for its prompt and the most it
    /// may generate, the longest cached prefix of its prompt restored, then, when it was
    /// swapped out, its K/V read back — a read that fails costs a recomputation (said on
    /// stderr) — or else its cache computed again from where the prefix ends.
    fn start_in(&mut self, seq: usize, a: &mut Active) -> anyhow::Result<()> {
        if let Some(b) = self.policy.as_batched() {
            b.expect(seq, a.planned());
        }
        let restored = self.restore(seq, &a.job.prompt)?;
        if let Some(s) = a.swapped.take() {
            match self.swap_in(seq, a, s, restored) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    eprintln!("swap: {e:#}; the request is recomputed instead");
                    self.release(seq);
                    a.computed = None;
                    return self.start_in(seq, a);
                }
            }
        }
        // (A resumed request records its prompt's K/V again from here.)
        a.restored = restored;
        a.pos = restored;
        Ok(())
    }

    /// Whether `prompt` shares whole chunks with the prompt of a running request that is
    /// still computing them (in its prefill, past what it restored), when requests share
    /// prefixes by reference: then it had better wait for them than compute them again.
    fn awaits_shared_prefix(&self, prompt: &[u32]) -> bool {
        let Some(c) = self.reuse.as_ref().map(|r| r.chunk_tokens()) else {
            return false;
        };
        self.slots.iter().flatten().any(|a| {
            let theirs = &a.job.prompt;
            if !a.sharing || a.pos >= theirs.len() {
                return false;
            }
            // Whole chunks both prompts hold (a restore leaves a prompt's last token).
            let common = prompt
                .iter()
                .zip(theirs)
                .take_while(|(x, y)| x == y)
                .count();
            let whole = common.min(prompt.len().saturating_sub(1)).min(theirs.len()) / c;
            whole * c > a.restored
        })
    }

    /// The running requests as the memory rules see them; `adding` says how many tokens
    /// this step gives each slot. `None` without rules, or when the policy does not say
    /// what a sequence holds (`hybrid` keeps its own pool): then the rules stand aside.
    fn running(&mut self, chunks: &[SeqChunk]) -> Option<Vec<Running>> {
        self.memory.as_ref()?;
        let mut out = Vec::new();
        for seq in 0..self.slots.len() {
            let Some(admitted) = self.slots[seq].as_ref().map(|a| a.admitted) else {
                continue;
            };
            let held = self.policy.as_batched().and_then(|b| b.held(seq))?;
            let adding = chunks
                .iter()
                .filter(|c| c.seq == seq)
                .map(|c| c.ids.len())
                .sum();
            let pending = self.slots[seq].as_ref().map_or(0, |a| {
                (a.job.prompt.len() + a.generated.len().saturating_sub(1)).saturating_sub(a.pos)
            });
            let planned = self.slots[seq].as_ref().map_or(0, Active::planned);
            out.push(Running {
                seq,
                admitted,
                held,
                adding,
                pending,
                planned,
            });
        }
        Some(out)
    }

    /// Preempts what the memory rules say this step cannot hold, and drops their pieces;
    /// whether it preempted any.
    pub(super) fn make_room(&mut self, chunks: &mut Vec<SeqChunk>) -> bool {
        let Some(running) = self.running(chunks) else {
            return false;
        };
        // The prefix cache's unleased chunks make room before any request is preempted,
        // when they are in the device ledger.
        let need = self.memory.as_ref().and_then(|g| g.step_need(&running));
        let reuse = self
            .reuse
            .as_mut()
            .filter(|r| r.ledger() == PoolTier::Device);
        if let (Some(r), Some(need)) = (reuse, need) {
            r.evict_for(need);
        }
        let out = self
            .memory
            .as_ref()
            .map_or_else(Vec::new, |g| g.to_preempt(&running));
        let any = !out.is_empty();
        for seq in out {
            if let Some(mut a) = self.slots[seq].take() {
                let mode = self.swap_out(seq, &mut a);
                self.release(seq);
                if mode == PreemptionMode::Recompute {
                    a.computed = None;
                }
                self.metrics.preempted(mode.label());
                // Resumed oldest first.
                let at = self
                    .preempted
                    .iter()
                    .position(|p| p.job.received > a.job.received)
                    .unwrap_or(self.preempted.len());
                self.preempted.insert(at, a);
            }
            chunks.retain(|c| c.seq != seq);
        }
        // Not admitted again until a request leaves (`release`): what it was preempted for
        // is still there.
        self.hold_resumes |= any;
        any
    }

    /// The longest cached prefix of `prompt` restored into slot `seq` (0 without a cache).
    fn restore(&mut self, seq: usize, prompt: &[u32]) -> anyhow::Result<usize> {
        let Some(reuse) = self.reuse.as_mut() else {
            return Ok(0);
        };
        let n = reuse.restore(
            self.policy.as_mut(),
            self.model.info(),
            seq,
            prompt,
            self.cfg.prefill_chunk,
        )?;
        self.metrics.prefix_lookups.inc();
        self.metrics.prefix_queries.inc_by(prompt.len() as u64);
        if n > 0 {
            self.metrics.prefix_hits.inc();
            self.metrics.prefix_restored_tokens.inc_by(n as u64);
        }
        Ok(n)
    }

    /// Forgets waiting and preempted requests whose client has gone.
    pub(super) fn drop_waiting_departed(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.queued.fetch_sub(gone, Ordering::SeqCst);
            self.metrics.cancelled.inc_by(gone as u64);
        }
        // Preempted ones hold no queue place.
        let before = self.preempted.len();
        self.preempted.retain(|a| !a.job.events.is_closed());
        self.metrics
            .cancelled
            .inc_by((before - self.preempted.len()) as u64);
    }

    /// Frees the cache of every request whose client has gone.
    pub(super) fn drop_departed(&mut self) {
        for seq in 0..self.slots.len() {
            if self.slots[seq]
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed())
            {
                self.slots[seq] = None;
                self.release(seq);
                self.metrics.cancelled.inc();
            }
        }
    }
}
