//! One layer's device tier under a page-selecting policy: the sink pages and the recent
//! window, always attended (StreamingLLM §3.2; Quest keeps the recent tokens too), the
//! page summaries of a global layer (Quest §3.2), and each KV head's resident pages
//! ([`HeadCache`]). A sliding-window layer (Gemma 2/3, Mistral) keeps its window resident
//! and selects nothing: its window covers every key its queries see, as under `auto`.
use candle_core::Tensor;
use kvpolicy_core::{KvBuffer, Result};

use crate::cache::{HeadCache, PageShape};
use crate::pages::PageSummaries;
use crate::settings::Pages;

/// A layer's device tier (module docs).
#[derive(Debug)]
pub struct LayerState {
    /// Tokens `0..sink_end`.
    pub sinks: KvBuffer,
    /// Tokens `recent_start..len`.
    pub recent: KvBuffer,
    /// The first token of `recent` (a page boundary, at least the sinks' end).
    pub recent_start: usize,
    /// The layer's sliding window (`None`: global; pages are selected).
    pub window: Option<usize>,
    /// The page summaries (global layers).
    pub summaries: PageSummaries,
    /// Per KV head, its resident middle pages.
    pub heads: Vec<HeadCache>,
}

impl LayerState {
    /// An empty layer of `kv_heads` heads with the given sliding window.
    pub fn new(pages: &Pages, kv_heads: usize, window: Option<usize>) -> Self {
        Self {
            sinks: KvBuffer::new(pages.sink_end().max(1)),
            recent: KvBuffer::new(256),
            recent_start: pages.sink_end(),
            window,
            summaries: PageSummaries::default(),
            heads: (0..kv_heads).map(|_| HeadCache::default()).collect(),
        }
    }

    /// Whether the layer holds no token yet.
    pub fn is_fresh(&self, pages: &Pages) -> bool {
        self.sinks.is_empty() && self.recent.is_empty() && self.recent_start == pages.sink_end()
    }

    /// Whether pages are selected in this layer.
    pub fn global(&self) -> bool {
        self.window.is_none()
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.sinks.allocated_bytes()
            + self.recent.allocated_bytes()
            + self.summaries.bytes()
            + self.heads.iter().map(HeadCache::bytes).sum::<u64>()
    }

    /// Stores the step's keys `k` and values `v` `(b, kv, t, d)` of tokens `pos..`: those
    /// below the sinks' end in the sinks, the rest in the window; a global layer's keys
    /// also in its page summaries.
    pub fn append(&mut self, pages: &Pages, k: &Tensor, v: &Tensor, pos: usize) -> Result<()> {
        let t = k.dim(2)?;
        let to_sinks = pages.sink_end().saturating_sub(pos).min(t);
        if to_sinks > 0 {
            self.sinks
                .append(&k.narrow(2, 0, to_sinks)?, &v.narrow(2, 0, to_sinks)?)?;
        }
        if to_sinks < t {
            let n = t - to_sinks;
            self.recent
                .append(&k.narrow(2, to_sinks, n)?, &v.narrow(2, to_sinks, n)?)?;
        }
        if self.global() {
            self.summaries.update(k, pos, pages.page)?;
        }
        Ok(())
    }

    /// The middle pages: whole pages between the sinks and the window.
    pub fn middle(&self, pages: &Pages) -> std::ops::Range<usize> {
        pages.sink_end() / pages.page..self.recent_start / pages.page
    }

    /// After a step that left `len` tokens: moves the window's start up to the page
    /// boundary that keeps at least `window` recent tokens (the layer's own window for a
    /// sliding-window layer, if larger). The pages leaving it go to the heads' caches when
    /// `persist` (a device-side copy: they are on the device already), else they are
    /// dropped (the host tier holds them).
    pub fn trim(
        &mut self,
        pages: &Pages,
        len: usize,
        persist: bool,
        shape: &PageShape,
    ) -> Result<()> {
        let keep = self.window.map_or(pages.window, |w| w.max(pages.window));
        let target = (len.saturating_sub(keep) / pages.page * pages.page).max(pages.sink_end());
        if target <= self.recent_start {
            return Ok(());
        }
        let n = target - self.recent_start;
        if persist && self.global() {
            let (k, v) = self.recent.view(0, n)?;
            for p in 0..n / pages.page {
                let page = self.recent_start / pages.page + p;
                for (h, cache) in self.heads.iter_mut().enumerate() {
                    cache.copy_in(page, (&k, &v), (h, self.recent_start), shape)?;
                }
            }
        }
        self.recent.drop_front(n)?;
        self.recent_start = target;
        // After a prefill chunk the window's buffer holds room for the chunk: give it back.
        if self.recent.capacity() > 2 * (keep + 256) {
            let (k, v) = self.recent.view(0, self.recent.len())?;
            let (k, v) = (k.contiguous()?, v.contiguous()?);
            self.recent = KvBuffer::new(256);
            self.recent.append(&k, &v)?;
        }
        Ok(())
    }
}
