//! What distinguishes `quest`, `flexicache` and `clo`: which pages each KV head of a
//! global layer attends at a decode step, and which stay on the device after it
//! ([`Selector`]). The runtime ([`crate::SparsePolicy`]) owns everything else — the host
//! tier, the sinks and window, the page summaries, the fetches and the attention — and
//! hands a selector views of what it may decide on ([`PrefillView`], [`DecodeView`]).
use std::ops::Range;

use candle_core::{DType, Tensor};
use kvpolicy_core::{PolicyMetric, Result};

use crate::pages::PageSummaries;

/// A decode step's decision for one KV head.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeadChoice {
    /// Middle pages attended this step, ascending; those not resident are fetched.
    pub attend: Vec<usize>,
    /// Pages kept on the device after the step, ascending (the rest are freed; ignored by
    /// a selector whose pages do not persist).
    pub retain: Vec<usize>,
    /// Pages fetched now besides `attend`, to be resident from this step on, ascending
    /// (a head that keeps every page; ignored by a selector whose pages do not persist).
    pub prefetch: Vec<usize>,
}

/// Per layer and KV head, the device bytes its pages hold and the bytes fetched for it.
#[derive(Clone, Debug, Default)]
pub struct HeadTable {
    /// `[layer][head]` device bytes of the head's resident pages.
    pub device_bytes: Vec<Vec<u64>>,
    /// `[layer][head]` host→device bytes fetched for the head so far.
    pub fetched_bytes: Vec<Vec<u64>>,
}

/// What a selector sees after a dense (prefill) step of a global layer.
#[derive(Debug)]
pub struct PrefillView {
    /// The layer.
    pub layer: usize,
    /// The middle pages (outside the sinks and the window).
    pub candidates: Range<usize>,
    /// Pages a head attends per decode step at this many candidates.
    pub k: usize,
    /// `[head][row][page - candidates.start]`: the scores of the step's last query rows.
    pub row_scores: Vec<Vec<Vec<f32>>>,
}

/// What a selector sees at a decode step of a global layer.
pub struct DecodeView<'a> {
    /// The layer.
    pub layer: usize,
    /// The middle pages (outside the sinks and the window).
    pub candidates: Range<usize>,
    /// Pages a head attends at this many candidates.
    pub k: usize,
    /// Per KV head, its resident pages (ascending; empty for a selector whose pages do not
    /// persist).
    pub resident: Vec<Vec<usize>>,
    summaries: &'a PageSummaries,
    q: &'a Tensor,
    scores: Option<Vec<Vec<f32>>>,
    queries: Option<Vec<Vec<f32>>>,
}

impl<'a> DecodeView<'a> {
    /// A view over `summaries` for the step's queries `q` `(1, n_heads, 1, d)`.
    pub fn new(
        layer: usize,
        candidates: Range<usize>,
        k: usize,
        resident: Vec<Vec<usize>>,
        summaries: &'a PageSummaries,
        q: &'a Tensor,
    ) -> Self {
        Self {
            layer,
            candidates,
            k,
            resident,
            summaries,
            q,
            scores: None,
            queries: None,
        }
    }

    /// Per KV head, the candidates' scores (index `page - candidates.start`), computed on
    /// the device at the first call.
    pub fn scores(&mut self) -> Result<&[Vec<f32>]> {
        if self.scores.is_none() {
            let (first, n) = (self.candidates.start, self.candidates.len());
            let s = self.summaries.scores(self.q, first, n)?;
            let s = s.squeeze(0)?.squeeze(1)?.to_vec2::<f32>()?;
            self.scores = Some(s);
        }
        Ok(self.scores.as_deref().unwrap_or_default())
    }

    /// Per KV head, its group's query heads' queries one after the other (for similarity
    /// tests), fetched from the device at the first call.
    pub fn queries(&mut self, kv_heads: usize) -> Result<&[Vec<f32>]> {
        if self.queries.is_none() {
            let q = self
                .q
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let per = q.len() / kv_heads.max(1);
            self.queries = Some(q.chunks(per.max(1)).map(<[f32]>::to_vec).collect());
        }
        Ok(self.queries.as_deref().unwrap_or_default())
    }
}

/// A page-selection rule (module docs).
pub trait Selector: Send {
    /// Whether a head's pages stay on the device across steps (`false`: the selected
    /// pages are fetched every step into buffers shared by the layers).
    fn persistent(&self) -> bool;

    /// After a dense step of a global layer: per KV head, the middle pages to keep on the
    /// device (ascending; all of them were on the device for the step). Ignored for a
    /// selector whose pages do not persist.
    fn after_prefill(&mut self, view: &PrefillView) -> Result<Vec<Vec<usize>>>;

    /// A decode step of a global layer: per KV head, what it attends and keeps.
    fn decode(&mut self, view: &mut DecodeView<'_>) -> Result<Vec<HeadChoice>>;

    /// What only this selector counts, given the heads' bytes.
    fn metrics(&self, heads: &HeadTable) -> Vec<PolicyMetric>;

    /// Forgets every sequence.
    fn reset(&mut self);
}
