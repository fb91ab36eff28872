//! `clo` (CLO, arXiv 2511.14510): a coarse-grained, head-wise approximate cache on the
//! device. A KV head whose queries stay close to those of its last selection reuses that
//! selection — no scoring, no transfer; otherwise it selects afresh and fetches only the
//! pages its device cache lacks. Pages that keep being selected persist on the device.
//! APPROXIMATE.
//!
//! * Reuse: cosine similarity of the head's queries (its group's query heads, one after
//!   the other) to those at its last selection, against a threshold adapted to the head's
//!   importance `s ∈ [0, 1]`: `τ = cos(s · arccos(η) + (1 − s) · π)` (the paper's rule with
//!   exponent 1; `η` is the `similarity` setting): the most important head needs `η`, the
//!   least important one always reuses. A reused selection also attends every page that
//!   entered the middle since (they were in the window, so on the device).
//! * Importance (the paper's definition was not available to us): the spread of the head's
//!   page scores at the prefill's last query, top minus mean, over the largest spread among
//!   the layer's heads.
//! * Persistence: each page counts the fresh selections it was in; after a step a head
//!   keeps what it attended plus its most often selected resident pages, up to `persist`
//!   tokens.
//!
//! * Zero-copy (`zero_copy`, on by default; CUDA only): the fetched pages are gathered by a
//!   kernel reading the page-locked host tier mapped into the device's address space, on
//!   the compute stream, ordered after the host tier's write-backs on the device (GPU-side
//!   synchronization): `kvpolicy_tiered::MappedGather`, `kvpolicy_kernels::gather`. On the
//!   CPU the pages cross through the transfer engine's copies; the bytes counted are the
//!   same either way.
//!
//! Where this differs from the paper, and why: there is no speculative prefetch of the
//! next layer's pages (the pages a head keeps are what the next step reuses); importance
//! is our own measure (above); under grouped-query attention a KV head reuses or selects
//! for its whole group.
use std::collections::BTreeMap;

use kvpolicy_core::{PolicyMetric, Result};

use crate::select::{top_k, union};
use crate::selector::{DecodeView, HeadChoice, HeadTable, PrefillView, Selector};

/// One KV head's state.
#[derive(Clone, Debug, Default)]
struct Head {
    /// Reuse threshold.
    tau: f64,
    /// The queries at the last fresh selection.
    query: Option<Vec<f32>>,
    /// The pages of the last selection.
    chosen: Vec<usize>,
    /// The candidates' end at the last selection.
    end: usize,
    /// Page → fresh selections it was in.
    hits: BTreeMap<usize, u32>,
}

/// CLO's reuse and persistent cache (module docs).
#[derive(Debug)]
pub struct Clo {
    eta: f64,
    persist_pages: usize,
    heads: Vec<Vec<Head>>,
    reused: u64,
    selected: u64,
}

/// Cosine similarity of `a` and `b` (0 for a zero vector).
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += f64::from(x) * f64::from(y);
        aa += f64::from(x) * f64::from(x);
        bb += f64::from(y) * f64::from(y);
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// CLO's threshold for a head of importance `s` under the limit `eta`.
pub fn threshold(s: f64, eta: f64) -> f64 {
    let s = s.clamp(0.0, 1.0);
    (s * eta.clamp(-1.0, 1.0).acos() + (1.0 - s) * std::f64::consts::PI).cos()
}

impl Clo {
    /// Reuses above the threshold of limit `eta`; keeps `persist_pages` extra pages.
    pub fn new(eta: f64, persist_pages: usize) -> Self {
        Self {
            eta,
            persist_pages,
            heads: Vec::new(),
            reused: 0,
            selected: 0,
        }
    }

    fn layer(&mut self, layer: usize, n: usize) -> &mut Vec<Head> {
        while self.heads.len() <= layer {
            self.heads.push(Vec::new());
        }
        self.heads[layer].resize(n, Head::default());
        &mut self.heads[layer]
    }

    /// What head `head` keeps: `attend` and its most often selected resident pages.
    fn kept(head: &Head, attend: &[usize], resident: &[usize], extra: usize) -> Vec<usize> {
        let mut others: Vec<(u32, usize)> = resident
            .iter()
            .filter(|p| attend.binary_search(p).is_err())
            .map(|&p| (head.hits.get(&p).copied().unwrap_or(0), p))
            .filter(|&(n, _)| n > 0)
            .collect();
        others.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut persist: Vec<usize> = others.iter().take(extra).map(|o| o.1).collect();
        persist.sort_unstable();
        union(attend, &persist)
    }
}

impl Selector for Clo {
    fn persistent(&self) -> bool {
        true
    }

    fn after_prefill(&mut self, view: &PrefillView) -> Result<Vec<Vec<usize>>> {
        let (first, k) = (view.candidates.start, view.k);
        let spreads: Vec<f64> = view
            .row_scores
            .iter()
            .map(|rows| {
                let last = rows.last().map(Vec::as_slice).unwrap_or_default();
                let n = last.len().max(1) as f64;
                let top = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mean = last.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
                (f64::from(top) - mean).max(0.0)
            })
            .collect();
        let widest = spreads.iter().copied().fold(0.0, f64::max);
        let eta = self.eta;
        let heads = self.layer(view.layer, view.row_scores.len());
        let mut keep = Vec::with_capacity(heads.len());
        for ((head, rows), spread) in heads.iter_mut().zip(&view.row_scores).zip(spreads) {
            let s = if widest > 0.0 { spread / widest } else { 1.0 };
            head.tau = threshold(s, eta);
            head.query = None;
            head.chosen = rows.last().map(|r| top_k(r, first, k)).unwrap_or_default();
            head.end = view.candidates.end;
            keep.push(head.chosen.clone());
        }
        Ok(keep)
    }

    fn decode(&mut self, view: &mut DecodeView<'_>) -> Result<Vec<HeadChoice>> {
        let (first, k, end) = (view.candidates.start, view.k, view.candidates.end);
        let nkv = view.resident.len();
        let queries = view.queries(nkv)?.to_vec();
        let reuse: Vec<bool> = {
            let heads = self.layer(view.layer, nkv);
            heads
                .iter()
                .zip(&queries)
                .map(|(h, q)| h.query.as_ref().is_some_and(|p| cosine(q, p) >= h.tau))
                .collect()
        };
        let scores: Vec<Vec<f32>> = if reuse.iter().all(|&r| r) {
            Vec::new()
        } else {
            view.scores()?.to_vec()
        };
        let extra = self.persist_pages;
        let mut out = Vec::with_capacity(nkv);
        let (mut reused, mut selected) = (0, 0);
        for (h, head) in self.heads[view.layer].iter_mut().enumerate() {
            let attend = if reuse[h] {
                reused += 1;
                let fresh: Vec<usize> = (head.end.max(first)..end).collect();
                union(&head.chosen, &fresh)
            } else {
                selected += 1;
                let chosen = top_k(&scores[h], first, k);
                for &p in &chosen {
                    *head.hits.entry(p).or_default() += 1;
                }
                head.query = Some(queries[h].clone());
                chosen
            };
            head.chosen = attend.clone();
            head.end = end;
            let retain = Self::kept(head, &attend, &view.resident[h], extra);
            out.push(HeadChoice {
                attend,
                retain,
                prefetch: Vec::new(),
            });
        }
        self.reused += reused;
        self.selected += selected;
        Ok(out)
    }

    fn metrics(&self, _: &HeadTable) -> Vec<PolicyMetric> {
        vec![
            PolicyMetric::counter("reused_selections", self.reused as f64, "head-steps"),
            PolicyMetric::counter("fresh_selections", self.selected as f64, "head-steps"),
        ]
    }

    fn reset(&mut self) {
        self.heads.clear();
        self.reused = 0;
        self.selected = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_runs_from_always_reuse_to_eta() {
        assert!((threshold(0.0, 0.9) + 1.0).abs() < 1e-12);
        assert!((threshold(1.0, 0.9) - 0.9).abs() < 1e-12);
        assert!(threshold(0.5, 0.9) < 0.9);
    }
}
