//! The runtime the three page-selecting policies share ([`SparsePolicy`]): every global
//! layer's K/V on the host tier, and on the device the sinks, the recent window, the page
//! summaries and each KV head's resident pages; at a decode step a [`Selector`] picks each
//! head's pages, the missing ones cross the link, and the head attends sinks + pages +
//! window, merged by log-sum-exp. APPROXIMATE once the middle holds more pages than a head
//! attends; exact (≤ 1e-5 of `full`) when the budget covers the context.
use candle_core::{DType, Tensor};
use kvpolicy_core::{
    merge_partials, AttnInputs, AttnStep, KvBuffer, KvCodec, KvError, KvLease, KvPolicy, KvRestore,
    KvShape, KvStats, Partial, PolicyMetric, PolicyOptions, Result, SharedRun,
};
use kvpolicy_tiered::{DiskTier, HostLayers, Link, WriteAt};

use crate::cache::{HeadCache, PageShape};
use crate::layers::LayerState;
use crate::middle::{attend_selected, fetch, DenseMiddle};
use crate::selector::{DecodeView, HeadChoice, HeadTable, PrefillView, Selector};
use crate::settings::Pages;

/// Query rows of a prefill chunk scored for the selector (FlexiCache's 16-step windows).
pub const PREFILL_ROWS: usize = 16;

/// A page-selecting policy: the shared runtime around a [`Selector`] (module docs).
pub struct SparsePolicy<S: Selector> {
    name: &'static str,
    pub(crate) pages: Pages,
    selector: S,
    pub(crate) link: Link,
    pub(crate) host: HostLayers,
    pub(crate) layers: Vec<LayerState>,
    /// Per KV head, the buffers a non-persistent selector's pages are fetched into.
    shared: Vec<HeadCache>,
    pub(crate) device: candle_core::Device,
    pub(crate) len: usize,
    peak: u64,
    /// Per layer and head, host→device bytes fetched for it.
    fetched: Vec<Vec<u64>>,
    attended_pages: u64,
    fetched_pages: u64,
    /// Gather pages with the engine's zero-copy kernel where it has one (CLO §4).
    zero_copy: bool,
    stats: KvStats,
}

impl<S: Selector> std::fmt::Debug for SparsePolicy<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparsePolicy")
            .field("name", &self.name)
            .field("pages", &self.pages)
            .finish()
    }
}

impl<S: Selector> SparsePolicy<S> {
    /// The policy `name` selecting with `selector` under `pages`; the host tier in RAM, or
    /// on disk as the options say.
    pub fn new(
        name: &'static str,
        pages: Pages,
        selector: S,
        opts: &PolicyOptions,
    ) -> Result<Self> {
        Ok(Self {
            name,
            pages: pages.checked(name)?,
            selector,
            link: Link::for_device(&opts.device, opts.link_bandwidth)?,
            host: HostLayers::new(opts.grow_tokens, DiskTier::from_options(opts, name)?)
                .pooled(opts.pool.clone()),
            layers: Vec::new(),
            shared: Vec::new(),
            device: opts.device.clone(),
            len: 0,
            peak: 0,
            fetched: Vec::new(),
            attended_pages: 0,
            fetched_pages: 0,
            zero_copy: false,
            stats: KvStats::default(),
        })
    }

    /// Gathers pages with the transfer engine's zero-copy kernel where it has one (the
    /// CUDA engine; CLO §4) instead of copies.
    pub fn with_zero_copy(mut self, on: bool) -> Self {
        self.zero_copy = on;
        self
    }

    /// The selector.
    pub fn selector(&self) -> &S {
        &self.selector
    }

    pub(crate) fn page_shape(&self, step: &AttnStep<'_>) -> Result<PageShape> {
        let (b, _, _, d) = step.k.dims4()?;
        Ok(PageShape {
            b,
            page: self.pages.page,
            d,
            dtype: step.k.dtype(),
            device: self.device.clone(),
        })
    }

    /// Device bytes held now.
    fn device_bytes(&self) -> u64 {
        self.layers.iter().map(LayerState::bytes).sum::<u64>()
            + self.shared.iter().map(HeadCache::bytes).sum::<u64>()
    }

    /// Records the bytes held now plus `transient` as a candidate peak.
    pub(crate) fn note_device(&mut self, transient: u64) {
        self.peak = self.peak.max(self.device_bytes() + transient);
    }

    /// Stores the step's K/V: a global layer's on the host tier (held by reference when
    /// `lease` comes with them and the host tier can), and on the device the sinks, the
    /// window and the page summaries ([`LayerState::append`]).
    pub(crate) fn store(
        &mut self,
        step: &AttnStep<'_>,
        shape: &KvShape,
        lease: Option<&KvLease>,
    ) -> Result<()> {
        let (_, nkv, t, _) = step.k.dims4()?;
        let (layer, pos) = (step.layer, step.pos);
        while self.layers.len() <= layer {
            self.layers.push(LayerState::new(&self.pages, nkv, None));
        }
        if self.layers[layer].is_fresh(&self.pages) {
            // A layer's first step says whether it slides a window.
            self.layers[layer] = LayerState::new(&self.pages, nkv, step.spec.sliding_window);
        }
        if self.layers[layer].global() {
            let run = lease.map(|lease| SharedRun {
                k: step.k,
                v: step.v,
                pos,
                lease,
            });
            let attached = match run {
                Some(r) if self.attaches() => {
                    self.host.attach(&mut self.link, layer, &r, step.spec)?
                }
                _ => false,
            };
            if !attached {
                self.host.begin(&mut self.link, step, shape)?;
                let at = WriteAt {
                    layer,
                    first_head: 0,
                    offset: pos,
                };
                self.host.write(&mut self.link, at, step.k, step.v)?;
                self.host.advance(layer, t);
            }
        }
        self.layers[layer].append(&self.pages, step.k, step.v, pos)
    }

    /// Whether a prefix shared with other sequences is held by reference on the host tier:
    /// on the CPU, with K/V stored as given.
    pub(crate) fn attaches(&self) -> bool {
        self.device.is_cpu() && self.host.codec() == KvCodec::Model
    }

    /// The middle of a global layer at a prefill chunk: all of it, moved over the link;
    /// the selector then says what each head keeps (not for a `reader`: a layer reading
    /// another's cache leaves that layer's pages and selector as they are).
    fn dense(
        &mut self,
        step: &AttnStep<'_>,
        shape: &PageShape,
        middle: std::ops::Range<usize>,
        reader: bool,
    ) -> Result<Partial> {
        let layer = step.layer;
        let nkv = step.k.dim(1)?;
        let dense = DenseMiddle::load(
            &mut self.link,
            &mut self.host,
            layer,
            (middle.start, middle.len()),
            shape,
            nkv,
        )?;
        self.note_device(dense.bytes());
        let part = dense.attend(step.q, step.pos, step.spec, self.pages.page)?;
        if self.selector.persistent() && !reader {
            let t = step.q.dim(2)?;
            let rows = t.min(PREFILL_ROWS);
            let q = step.q.narrow(2, t - rows, rows)?;
            let s = self.layers[layer]
                .summaries
                .scores(&q, middle.start, middle.len())?
                .squeeze(0)?
                .to_dtype(DType::F32)?;
            let view = PrefillView {
                layer,
                candidates: middle.clone(),
                k: self.pages.pages_for(middle.len()),
                row_scores: s.to_vec3::<f32>()?,
            };
            let keep = self.selector.after_prefill(&view)?;
            dense.keep(&mut self.layers[layer].heads, &keep, shape)?;
            self.note_device(dense.bytes());
        }
        Ok(part)
    }

    /// The middle of a global layer at a decode step: each head's selected pages. A
    /// `reader` (a layer reading another's cache) selects by Quest's page bounds with its
    /// own queries into the scratch caches: the owner's resident pages and its selector's
    /// state (FlexiCache's re-rank clock, CLO's reuse) stay as the owner left them.
    fn sparse(
        &mut self,
        step: &AttnStep<'_>,
        shape: &PageShape,
        middle: std::ops::Range<usize>,
        reader: bool,
    ) -> Result<Partial> {
        let layer = step.layer;
        let persistent = self.selector.persistent() && !reader;
        let resident = if persistent {
            self.layers[layer]
                .heads
                .iter()
                .map(HeadCache::pages)
                .collect()
        } else {
            vec![Vec::new(); self.layers[layer].heads.len()]
        };
        let k = self.pages.pages_for(middle.len());
        let choices: Vec<HeadChoice> = {
            let l = &self.layers[layer];
            let mut view = DecodeView::new(layer, middle, k, resident, &l.summaries, step.q);
            if reader {
                crate::quest::Quest.decode(&mut view)?
            } else {
                self.selector.decode(&mut view)?
            }
        };
        let nkv = self.layers[layer].heads.len();
        if choices.len() != nkv {
            return Err(KvError::invariant(format!(
                "{} chose for {} heads of {nkv}",
                self.name,
                choices.len()
            )));
        }
        let attend: Vec<Vec<usize>> = choices.iter().map(|c| c.attend.clone()).collect();
        let want: Vec<Vec<usize>> = choices
            .iter()
            .map(|c| crate::select::union(&c.attend, &c.prefetch))
            .collect();
        let caches = if persistent {
            &mut self.layers[layer].heads
        } else {
            while self.shared.len() < nkv {
                self.shared.push(HeadCache::default());
            }
            self.shared.iter_mut().for_each(HeadCache::clear);
            &mut self.shared[..nkv]
        };
        let fetched = fetch(
            &mut self.link,
            &mut self.host,
            layer,
            caches,
            &want,
            shape,
            self.zero_copy,
        )?;
        let page_bytes = 2 * (shape.b * shape.page * shape.d * shape.dtype.size_in_bytes()) as u64;
        while self.fetched.len() <= layer {
            self.fetched.push(Vec::new());
        }
        self.fetched[layer].resize(nkv, 0);
        for (h, n) in fetched.iter().enumerate() {
            self.fetched[layer][h] += *n as u64 * page_bytes;
            self.fetched_pages += *n as u64;
        }
        self.attended_pages += attend.iter().map(Vec::len).sum::<usize>() as u64;
        let caches: &[HeadCache] = if persistent {
            &self.layers[layer].heads
        } else {
            &self.shared[..nkv]
        };
        let part = attend_selected(step.q, caches, &attend, step.spec, self.pages.page)?;
        self.note_device(0);
        if persistent {
            for (cache, c) in self.layers[layer].heads.iter_mut().zip(&choices) {
                cache.retain(&c.retain);
                cache.compact(shape)?;
            }
        }
        Ok(part)
    }

    fn head_table(&self) -> HeadTable {
        HeadTable {
            device_bytes: self
                .layers
                .iter()
                .map(|l| l.heads.iter().map(HeadCache::bytes).collect())
                .collect(),
            fetched_bytes: self.fetched.clone(),
        }
    }
}

/// The error for `batch` sequences in one step: selection is per sequence.
fn one_sequence(name: &str, batch: usize) -> Result<()> {
    if batch == 1 {
        return Ok(());
    }
    Err(KvError::Unsupported(format!(
        "{name} selects pages for one sequence per step; batches go through one policy per sequence"
    )))
}

/// The step's attention over all of `buf`, whose first token sits at `first`; `None` when
/// it holds nothing.
fn attend_buffer(buf: &KvBuffer, first: usize, step: &AttnStep<'_>) -> Result<Option<Partial>> {
    if buf.is_empty() {
        return Ok(None);
    }
    let (k, v) = buf.view(0, buf.len())?;
    let inputs = AttnInputs {
        q: step.q,
        k: &k,
        v: &v,
        q_pos: step.pos,
        k_pos: first,
    };
    Ok(Some(kvpolicy_core::attend_partial(inputs, step.spec)?))
}

impl<S: Selector> SparsePolicy<S> {
    /// `step`'s queries over its layer's pieces, unmerged: the sinks and the recent window
    /// (on the device) and the middle pages (dense for a prefill chunk, the selected pages
    /// for a decode step; global layers only).
    fn attend_pieces(
        &mut self,
        step: &AttnStep<'_>,
        ps: &PageShape,
        reader: bool,
    ) -> Result<Vec<Partial>> {
        let t = step.q.dim(2)?;
        let layer = step.layer;
        let mut parts = Vec::with_capacity(3);
        let l = &self.layers[layer];
        let global = l.global();
        if let Some(p) = attend_buffer(&l.sinks, 0, step)? {
            parts.push(p);
        }
        let middle = l.middle(&self.pages);
        if global && !middle.is_empty() {
            parts.push(if t > 1 {
                self.dense(step, ps, middle, reader)?
            } else {
                self.sparse(step, ps, middle, reader)?
            });
        }
        let l = &self.layers[layer];
        if let Some(p) = attend_buffer(&l.recent, l.recent_start, step)? {
            parts.push(p);
        }
        Ok(parts)
    }
}

impl<S: Selector> KvPolicy for SparsePolicy<S> {
    fn name(&self) -> &str {
        self.name
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        one_sequence(self.name, shape.batch)?;
        self.host.set_shape(shape);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let (b, _, t, _) = step.k.dims4()?;
        one_sequence(self.name, b)?;
        let (layer, pos) = (step.layer, step.pos);
        let shape = self.host.shape_for(step)?;
        let ps = self.page_shape(step)?;
        self.store(step, &shape, None)?;
        let parts = self.attend_pieces(step, &ps, false)?;
        let scratch = parts.iter().map(|p| p.scratch_bytes).max().unwrap_or(0);
        self.stats.note_scratch(scratch, shape.activation_bytes(t));
        let out = merge_partials(&parts)?;
        self.note_device(0);
        // At a decode step the page leaving the window stays with the heads (it is on the
        // device already); after a prefill chunk a head's next selection fetches what it
        // wants of the chunk's pages (a chunk's worth for every head would outgrow `full`).
        let persist = self.selector.persistent() && t == 1;
        self.layers[layer].trim(&self.pages, pos + t, persist, &ps)?;
        self.note_device(0);
        if layer == 0 || pos + t > self.len {
            self.len = pos + t;
        }
        Ok(out.out.to_dtype(step.q.dtype())?)
    }

    /// A layer reading KV layer `step.layer`'s cache (MLKV) attends with its own queries:
    /// sinks and the recent window on the device, and the middle pages its queries select
    /// by Quest's bounds (fetched for it into scratch and counted; whatever the policy, the
    /// owner's resident pages and selector state are left alone), storing nothing.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let t = step.q.dim(2)?;
        let layer = step.layer;
        let ps = self.page_shape(step)?;
        if self.layers.get(layer).is_none() {
            return Err(kvpolicy_core::KvError::Protocol(format!(
                "a layer reading layer {layer}'s cache came before that layer's first step"
            )));
        }
        let parts = self.attend_pieces(step, &ps, true)?;
        let shape = self.host.shape_for(step)?;
        let scratch = parts.iter().map(|p| p.scratch_bytes).max().unwrap_or(0);
        self.stats.note_scratch(scratch, shape.activation_bytes(t));
        self.note_device(0);
        Ok(merge_partials(&parts)?.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.len
    }

    fn reset(&mut self) {
        self.link.reset();
        self.host.clear(&mut self.link);
        self.layers.clear();
        self.shared.clear();
        self.selector.reset();
        self.len = 0;
        self.peak = 0;
        self.fetched.clear();
        self.attended_pages = 0;
        self.fetched_pages = 0;
        self.stats = KvStats::default();
    }

    fn stats(&self) -> KvStats {
        let stats = KvStats {
            kv_tokens: self.len as u64,
            device_kv_bytes: self.device_bytes(),
            device_kv_peak_bytes: self.peak,
            ..self.stats.clone()
        };
        let mut stats = self.link.report(self.host.report(stats));
        // Approximate by design: a head attends only its selected pages of the middle.
        stats.lossy = true;
        stats.set_metric(PolicyMetric::counter(
            "attended_pages",
            self.attended_pages as f64,
            "pages",
        ));
        stats.set_metric(PolicyMetric::counter(
            "fetched_pages",
            self.fetched_pages as f64,
            "pages",
        ));
        for m in self.selector.metrics(&self.head_table()) {
            stats.set_metric(m);
        }
        stats
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }
}
