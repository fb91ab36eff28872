//! `flexicache` (FlexiCache, arXiv 2511.00868): KV heads differ in how stable their
//! critical pages are over time. A *stable* head keeps only its top-K pages on the device
//! — re-ranked at the first decode step and then every `rerank` steps, when only newly
//! promoted pages are fetched — and attends them plus every page that entered the middle
//! since; an *unstable* head keeps every page on the device (those it lacks are fetched
//! once) and attends its fresh top-K each step without moving anything more. APPROXIMATE.
//!
//! Stability follows the authors' measure: the overlap of a head's top-K set with an
//! earlier one, corrected for chance, `RCO = (|A ∩ B| / K − K/N) / (1 − K/N)` floored at 0
//! for `N` candidate pages. It is measured on the last query rows of each prefill chunk
//! (each row's set against the first's; the last chunk's classification is the one decode
//! starts with) and re-evaluated at every re-rank (the new set against the previous one,
//! averaged with the head's score so far). Where this differs from the paper, and why:
//! the paper profiles the heads offline on one task and fixes the count of unstable heads
//! (64 of 256); here each run classifies its own heads online with a threshold, so no
//! profile has to ship with a model. An unstable head that was stable fetches its missing
//! pages as its selections need them instead of all at once.
use kvpolicy_core::{PolicyMetric, Result};

use crate::select::{overlap, top_k, union};
use crate::selector::{DecodeView, HeadChoice, HeadTable, PrefillView, Selector};

/// One KV head's state.
#[derive(Clone, Debug, Default)]
struct Head {
    /// Whether it keeps only its top pages.
    stable: bool,
    /// Its chance-corrected overlap so far.
    score: f64,
    /// Its top pages at the last ranking.
    top: Vec<usize>,
    /// The candidates' end at the last ranking.
    end: usize,
}

/// FlexiCache's classification and re-ranking (module docs).
#[derive(Debug)]
pub struct FlexiCache {
    rerank: usize,
    threshold: f64,
    /// `[layer][head]`.
    heads: Vec<Vec<Head>>,
    /// Per layer, decode steps so far.
    steps: Vec<usize>,
    reranks: u64,
}

/// The chance-corrected overlap of `a` with `b` (each `k` of `n` pages).
fn rco(a: &[usize], b: &[usize], k: usize, n: usize) -> f64 {
    if k == 0 || k >= n {
        return 1.0;
    }
    let chance = k as f64 / n as f64;
    ((overlap(a, b) - chance) / (1.0 - chance)).max(0.0)
}

impl FlexiCache {
    /// Re-ranks every `rerank` decode steps (at least 1); stable above `threshold`.
    pub fn new(rerank: usize, threshold: f64) -> Self {
        Self {
            rerank: rerank.max(1),
            threshold,
            heads: Vec::new(),
            steps: Vec::new(),
            reranks: 0,
        }
    }

    fn layer(&mut self, layer: usize, n: usize) -> &mut Vec<Head> {
        while self.heads.len() <= layer {
            self.heads.push(Vec::new());
            self.steps.push(0);
        }
        self.heads[layer].resize(n, Head::default());
        &mut self.heads[layer]
    }

    /// Per layer and head, whether it is stable (for tests and reports).
    pub fn classes(&self) -> Vec<Vec<bool>> {
        self.heads
            .iter()
            .map(|l| l.iter().map(|h| h.stable).collect())
            .collect()
    }
}

impl Selector for FlexiCache {
    fn persistent(&self) -> bool {
        true
    }

    fn after_prefill(&mut self, view: &PrefillView) -> Result<Vec<Vec<usize>>> {
        let (first, k, n) = (view.candidates.start, view.k, view.candidates.len());
        let threshold = self.threshold;
        let heads = self.layer(view.layer, view.row_scores.len());
        let mut keep = Vec::with_capacity(heads.len());
        for (head, rows) in heads.iter_mut().zip(&view.row_scores) {
            let sets: Vec<Vec<usize>> = rows.iter().map(|r| top_k(r, first, k)).collect();
            let score = match sets.split_first() {
                Some((s0, rest)) if !rest.is_empty() => {
                    rest.iter().map(|s| rco(s0, s, k, n)).sum::<f64>() / rest.len() as f64
                }
                _ => 1.0,
            };
            head.score = score;
            head.stable = score >= threshold;
            head.top = sets.last().cloned().unwrap_or_default();
            head.end = view.candidates.end;
            keep.push(if head.stable {
                head.top.clone()
            } else {
                view.candidates.clone().collect()
            });
        }
        Ok(keep)
    }

    fn decode(&mut self, view: &mut DecodeView<'_>) -> Result<Vec<HeadChoice>> {
        let (first, k, n) = (view.candidates.start, view.k, view.candidates.len());
        let end = view.candidates.end;
        let nkv = view.resident.len();
        self.layer(view.layer, nkv);
        self.steps[view.layer] += 1;
        // The first decode step re-ranks (as the authors' code does), then every `rerank`.
        let step = self.steps[view.layer];
        let rerank = step == 1 || step.is_multiple_of(self.rerank);
        let needs_scores = rerank || self.heads[view.layer].iter().any(|h| !h.stable);
        let scores: Vec<Vec<f32>> = if needs_scores {
            view.scores()?.to_vec()
        } else {
            Vec::new()
        };
        if rerank {
            self.reranks += 1;
        }
        let threshold = self.threshold;
        let all: Vec<usize> = view.candidates.clone().collect();
        let mut out = Vec::with_capacity(nkv);
        for (h, head) in self.heads[view.layer].iter_mut().enumerate() {
            if rerank {
                let new = top_k(&scores[h], first, k);
                head.score = 0.5 * head.score + 0.5 * rco(&head.top, &new, k, n);
                head.stable = head.score >= threshold;
                head.top = new;
                head.end = end;
            }
            out.push(if head.stable {
                let fresh: Vec<usize> = (head.end.max(first)..end).collect();
                let attend = union(&head.top, &fresh);
                HeadChoice {
                    retain: attend.clone(),
                    attend,
                    prefetch: Vec::new(),
                }
            } else {
                HeadChoice {
                    attend: top_k(&scores[h], first, k),
                    retain: all.clone(),
                    prefetch: all.clone(),
                }
            });
        }
        Ok(out)
    }

    fn metrics(&self, heads: &HeadTable) -> Vec<PolicyMetric> {
        let (mut n, mut dev, mut h2d) = ([0u64; 2], [0u64; 2], [0u64; 2]);
        for (l, layer) in self.heads.iter().enumerate() {
            for (h, head) in layer.iter().enumerate() {
                let c = usize::from(head.stable);
                n[c] += 1;
                dev[c] += heads
                    .device_bytes
                    .get(l)
                    .and_then(|r| r.get(h))
                    .copied()
                    .unwrap_or(0);
                h2d[c] += heads
                    .fetched_bytes
                    .get(l)
                    .and_then(|r| r.get(h))
                    .copied()
                    .unwrap_or(0);
            }
        }
        vec![
            PolicyMetric::gauge("stable_heads", n[1] as f64, "heads"),
            PolicyMetric::gauge("unstable_heads", n[0] as f64, "heads"),
            PolicyMetric::gauge("stable_device_kv_bytes", dev[1] as f64, "bytes"),
            PolicyMetric::gauge("unstable_device_kv_bytes", dev[0] as f64, "bytes"),
            PolicyMetric::counter("stable_h2d_bytes", h2d[1] as f64, "bytes"),
            PolicyMetric::counter("unstable_h2d_bytes", h2d[0] as f64, "bytes"),
            PolicyMetric::counter("reranks", self.reranks as f64, "steps"),
        ]
    }

    fn reset(&mut self) {
        self.heads.clear();
        self.steps.clear();
        self.reranks = 0;
    }
}
