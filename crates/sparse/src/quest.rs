//! `quest` (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
//! Inference", ICML 2024, §3): at every decode step each KV head scores the middle's pages
//! against its group's queries from the page summaries and attends its top-K pages, plus
//! the sinks and the recent window. APPROXIMATE.
//!
//! Where this differs from the paper, and why: Quest keeps the whole cache on the GPU and
//! only reads less of it; here the cache lives on the host tier and the selected pages are
//! fetched every step (nothing persists — `clo` and `flexicache` add that), so the bytes
//! moved per token are exactly the selected pages. Under grouped-query attention a KV head
//! selects once for its group (the largest score over its query heads, as FlexiCache
//! does): what moves is a KV head's pages. The sinks and the recent window are always
//! attended (Quest always keeps the last page). The paper's first two dense layers are
//! not applied: every global layer selects.
use kvpolicy_core::{PolicyMetric, Result};

use crate::select::top_k;
use crate::selector::{DecodeView, HeadChoice, HeadTable, PrefillView, Selector};

/// Quest's selection: fresh top-K every step, nothing kept.
#[derive(Debug, Default)]
pub struct Quest;

impl Selector for Quest {
    fn persistent(&self) -> bool {
        false
    }

    fn after_prefill(&mut self, _: &PrefillView) -> Result<Vec<Vec<usize>>> {
        Ok(Vec::new())
    }

    fn decode(&mut self, view: &mut DecodeView<'_>) -> Result<Vec<HeadChoice>> {
        let (first, k) = (view.candidates.start, view.k);
        Ok(view
            .scores()?
            .iter()
            .map(|s| HeadChoice {
                attend: top_k(s, first, k),
                retain: Vec::new(),
                prefetch: Vec::new(),
            })
            .collect())
    }

    fn metrics(&self, _: &HeadTable) -> Vec<PolicyMetric> {
        Vec::new()
    }

    fn reset(&mut self) {}
}
