//! Which positions of a sequence each rank holds (Helix §3.1, KV parallelism: the cache
//! sharded along the sequence). Shares are contiguous, so that a rank's keys are one range
//! of absolute positions and the causal and sliding-window masks apply to them unchanged:
//! rank `r` holds positions `r·S..(r + 1)·S` with `S = ⌈max_tokens / ranks⌉` from the run's
//! declared length (prompt and generation), the last rank also whatever comes past it. A
//! step (a prefill chunk or a decode token) is stored by the rank whose share its positions
//! fall in; a chunk that straddles a boundary is split between the two ranks.
use std::ops::Range;

/// The shares of one sequence over `ranks` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    ranks: usize,
    share: usize,
}

impl Shares {
    /// Shares for a run of at most `max_tokens` tokens over `ranks` ranks (at least 1 each).
    pub fn for_run(max_tokens: usize, ranks: usize) -> Self {
        let ranks = ranks.max(1);
        Self {
            ranks,
            share: max_tokens.div_ceil(ranks).max(1),
        }
    }

    /// Tokens of every share but possibly the last.
    pub fn share_tokens(&self) -> usize {
        self.share
    }

    /// The positions rank `rank` holds (the last rank's share is open-ended).
    pub fn range(&self, rank: usize) -> Range<usize> {
        let start = rank.saturating_mul(self.share);
        let end = if rank + 1 >= self.ranks {
            usize::MAX
        } else {
            start.saturating_add(self.share)
        };
        start..end
    }

    /// The positions of `step` that rank `rank` stores: `step` ∩ its share (empty: none).
    pub fn store(&self, rank: usize, step: Range<usize>) -> Range<usize> {
        let share = self.range(rank);
        let start = step.start.max(share.start);
        let end = step.end.min(share.end);
        if start >= end {
            step.end..step.end
        } else {
            start..end
        }
    }

    /// Tokens rank `rank` holds once the sequence has `len` tokens.
    pub fn held(&self, rank: usize, len: usize) -> usize {
        let share = self.range(rank);
        len.min(share.end).saturating_sub(share.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_is_stored_exactly_once_in_order() {
        for ranks in 1..5 {
            for max in [1usize, 7, 20, 33] {
                let s = Shares::for_run(max, ranks);
                // Steps of varied sizes past the declared length too.
                let mut pos = 0;
                for t in [3usize, 5, 1, 1, 8, 2, 1, 9, 1, 1, 4] {
                    let step = pos..pos + t;
                    let mut covered = Vec::new();
                    for r in 0..ranks {
                        let st = s.store(r, step.clone());
                        covered.extend(st.clone());
                        assert!(st.is_empty() || st.end == step.end || st.end == s.range(r).end);
                    }
                    covered.sort_unstable();
                    assert_eq!(covered, step.clone().collect::<Vec<_>>());
                    pos += t;
                }
                let total: usize = (0..ranks).map(|r| s.held(r, pos)).sum();
                assert_eq!(total, pos);
                // Every share but the last holds ⌈max / ranks⌉ tokens of the declared run
                // (fewer where the run ends first); the last takes the rest.
                let share = max.div_ceil(ranks);
                for r in 0..ranks - 1 {
                    assert_eq!(s.held(r, max), share.min(max.saturating_sub(r * share)));
                }
            }
        }
    }
}
