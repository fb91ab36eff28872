//! [`HostLayers`] holding a layer's first positions by reference — a prefix cache's chunks
//! shared with other live sequences ([`kvpolicy_core::lease`]; PagedAttention SOSP '23
//! §4.3's shared blocks, SGLang HiCache's host-memory tier) — and reading them: a
//! sequence restoring a prefix attaches the chunks instead of copying them
//! ([`HostLayers::attach`]); one that computed a prefix gives its copy up for the stored
//! chunks ([`HostLayers::adopt`]); reads come in pieces, the runs' views then the store's
//! part ([`HostLayers::history_pieces`]).
use candle_core::Tensor;
use kvpolicy_core::{AttnSpec, HeadRange, KvCodec, Result, SharedRun, TokenRange};

use super::disk_traffic::ReadSpan;
use super::shared::{adoptable, HistoryPiece};
use super::store::WriteAt;
use super::{no_storage, HostLayers};
use crate::link::Link;

impl HostLayers {
    /// Keeps `run` of `layer` (a global layer: `spec` has no window) by reference when the
    /// layer holds nothing of its own yet and the run continues it, with K/V stored as
    /// given; returns whether it did (else the caller writes it as usual). The layer's store
    /// then holds the positions after its runs.
    pub fn attach(
        &mut self,
        link: &mut Link,
        layer: usize,
        run: &SharedRun<'_>,
        spec: &AttnSpec,
    ) -> Result<bool> {
        let Some(shape) = self.shape.clone() else {
            return Ok(false);
        };
        let as_given = self.codec == KvCodec::Model && run.k.dtype() == shape.dtype;
        if !as_given || spec.sliding_window.is_some() || !run.k.device().is_cpu() {
            return Ok(false);
        }
        self.ensure(link, layer, &shape, run.pos)?;
        let (len, base) = (self.lens[layer], self.bases[layer]);
        if len != run.pos || base != len || self.shared[layer].end() != base {
            return Ok(false);
        }
        if !self.shared[layer].push(run) {
            return Ok(false);
        }
        let end = self.shared[layer].end();
        self.lens[layer] = end;
        self.bases[layer] = end;
        self.specs[layer] = Some(spec.clone());
        Ok(true)
    }

    /// Holds `runs` of `layer` — equal to its own tokens at their positions — by reference
    /// instead, the store's tokens after them moved into a store of their own (the old one
    /// freed). Runs that end before the store's first position are skipped. Returns whether
    /// it did: not when the rest do not start where the store does, are not one after
    /// another, or pass the tokens held; nor for a layer on the disk tier or one that
    /// dropped a window's front.
    pub fn adopt(&mut self, link: &mut Link, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        let Some(shape) = self.shape.clone() else {
            return Ok(false);
        };
        let (Some(&len), Some(&base)) = (self.lens.get(layer), self.bases.get(layer)) else {
            return Ok(false);
        };
        let as_given = runs.iter().all(|r| r.k.dtype() == shape.dtype);
        if self.codec != KvCodec::Model || !as_given || self.shared[layer].end() != base {
            return Ok(false);
        }
        let Some(end) = adoptable(runs, base, len)? else {
            return Ok(false);
        };
        if self.ram(layer).is_none() {
            return Ok(false);
        }
        // Queued writes may target the old store; the tail is copied out before it goes.
        link.wait_all()?;
        let all = HeadRange::new(0, shape.n_kv_heads);
        let tail = match end < len {
            true => {
                let p = self.history_pieces(layer, all, TokenRange::new(end, len - end))?;
                let p = p.into_iter().next().ok_or_else(|| no_storage(layer))?;
                Some((p.k.contiguous()?, p.v.contiguous()?))
            }
            false => None,
        };
        if let Some(old) = self.layers[layer].take() {
            old.release(link.engine());
        }
        for r in runs.iter().filter(|r| r.pos >= base) {
            self.shared[layer].push(r);
        }
        self.bases[layer] = end;
        self.ensure(link, layer, &shape, len)?;
        let Some((k, v)) = tail else {
            return Ok(true);
        };
        if let Some(ram) = self.ram(layer) {
            ram.k.slice_set(&k, 2, 0)?;
            ram.v.slice_set(&v, 2, 0)?;
            return Ok(true);
        }
        // The new store went to the disk tier (past the host budget): written through it.
        let at = WriteAt {
            layer,
            first_head: 0,
            offset: 0,
        };
        match self.layers[layer].as_mut() {
            Some(store) => store.write(link, &mut self.traffic, at, &k, &v)?,
            None => return Err(no_storage(layer)),
        }
        Ok(true)
    }

    /// [`Self::history`] in pieces, in order: views of the runs `layer` holds by reference,
    /// then its store's part (a view of RAM buffers, or read from disk).
    pub fn history_pieces(
        &mut self,
        layer: usize,
        heads: HeadRange,
        tokens: TokenRange,
    ) -> Result<Vec<HistoryPiece>> {
        let runs = self.shared.get(layer).ok_or_else(|| no_storage(layer))?;
        let mut pieces = runs.pieces(heads, tokens)?;
        let from = tokens.start.max(runs.end());
        if from < tokens.end() || pieces.is_empty() {
            let own = TokenRange::new(from, tokens.end().saturating_sub(from));
            let span = ReadSpan::new(layer, heads, self.held(layer, own)?);
            let (k, v): (Tensor, Tensor) = match self.layers.get(layer).and_then(Option::as_ref) {
                Some(store) => store.history(span, &mut self.traffic)?,
                None => return Err(no_storage(layer)),
            };
            let at = from - tokens.start;
            pieces.push(HistoryPiece { at, k, v });
        }
        Ok(pieces)
    }

    /// Every position `layer` holds from 0, every head, on the host (the runs then the
    /// store, joined): what a sequence swapped out hands back. `None` when it holds nothing
    /// or a window dropped the layer's front.
    pub fn whole_layer(&mut self, layer: usize) -> Result<Option<HistoryPiece>> {
        let len = self.lens.get(layer).copied().unwrap_or(0);
        let runs = self.shared.get(layer).map_or(0, |r| r.tokens());
        let Some(heads) = self.shape.as_ref().map(|s| s.n_kv_heads) else {
            return Ok(None);
        };
        if len == 0 || (runs == 0 && self.first_held(layer) > 0) {
            return Ok(None);
        }
        let (k, v) = self.history(layer, HeadRange::new(0, heads), TokenRange::new(0, len))?;
        Ok(Some(HistoryPiece { at: 0, k, v }))
    }
}
