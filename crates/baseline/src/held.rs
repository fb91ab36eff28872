//! What one layer of `full` holds: runs of K/V shared by reference with other sequences
//! (a prefix cache's chunks, [`kvpolicy_core::lease`]; vLLM's shared prefix blocks,
//! PagedAttention SOSP '23 §4.3), then its own growing buffer ([`WindowKv`]) from the
//! first position they do not cover. Attention reads both in one kernel call
//! ([`kvpolicy_core::attend_partial_runs`]); the shared runs are never written, and only
//! the own buffer is counted on the device meter (the runs' owner counts them once).
use candle_core::Tensor;
use kvpolicy_core::{DeviceMeter, KeptRun, KvRun, Result, SharedRun, WindowKv};

/// A layer's K/V: shared runs, then its own buffer.
#[derive(Debug)]
pub struct LayerHeld {
    shared: Vec<KeptRun>,
    /// The layer's own tokens, from the end of the shared runs.
    pub own: WindowKv,
    grow_tokens: usize,
}

/// Keys and values of a layer visible from some position: runs in order and the position
/// of the first key.
pub struct Visible {
    /// Keys and values, one run after another.
    pub runs: Vec<(Tensor, Tensor)>,
    /// The first key's position.
    pub k_pos: usize,
}

impl Visible {
    /// The runs as the kernel takes them.
    pub fn as_runs(&self) -> Vec<KvRun<'_>> {
        self.runs.iter().map(|(k, v)| KvRun { k, v }).collect()
    }
}

impl LayerHeld {
    /// Nothing held; the own buffer grows by `grow_tokens`.
    pub fn new(grow_tokens: usize) -> Self {
        Self {
            shared: Vec::new(),
            own: WindowKv::new(grow_tokens),
            grow_tokens,
        }
    }

    /// Tokens held by reference.
    pub fn shared_tokens(&self) -> u64 {
        self.shared.iter().map(|r| r.end() - r.pos).sum::<usize>() as u64
    }

    /// Keeps `run` by reference when it continues the layer and the layer holds no token of
    /// its own yet; returns whether it did (else the caller copies it).
    pub fn attach(&mut self, run: &SharedRun<'_>) -> Result<bool> {
        if !self.own.buffer().is_empty() || run.pos != self.own.end() {
            return Ok(false);
        }
        let held = run.keep();
        self.own.start_at(held.end())?;
        self.shared.push(held);
        Ok(true)
    }

    /// Holds `runs` — equal to its own tokens at their positions — by reference instead,
    /// moving the own tokens after them into a buffer of their own (the old one freed on
    /// `meter`). Runs that end before the own buffer's first position (held by reference
    /// already) are skipped. Returns whether it did: not when the rest do not start where
    /// the own buffer does, are not one after another, or pass its end.
    pub fn adopt(&mut self, runs: &[SharedRun<'_>], meter: &mut DeviceMeter) -> Result<bool> {
        let base = self.own.base();
        let mut rest = Vec::with_capacity(runs.len());
        for r in runs {
            if r.pos + r.k.dim(2)? > base {
                rest.push(*r);
            }
        }
        let runs = rest.as_slice();
        let Some(first) = runs.first() else {
            return Ok(false);
        };
        let mut end = first.pos;
        for r in runs {
            if r.pos != end {
                return Ok(false);
            }
            end += r.k.dim(2)?;
        }
        if first.pos != self.own.base() || end > self.own.end() {
            return Ok(false);
        }
        let mut own = WindowKv::new(self.grow_tokens);
        own.start_at(end)?;
        if end < self.own.end() {
            let (k, v) = self.own.view(end, self.own.end())?;
            own.append_metered(&k, &v, meter)?;
        }
        meter.free(self.own.allocated_bytes());
        self.own = own;
        for r in runs {
            self.shared.push(r.keep());
        }
        Ok(true)
    }

    /// What a query sees from position `start` on: the shared runs that end after it (cut
    /// at it) and the own tokens from it; `None` when nothing is held there.
    pub fn visible(&self, start: usize) -> Result<Option<Visible>> {
        let mut runs = Vec::new();
        let mut k_pos = None;
        for r in self.shared.iter().filter(|r| r.end() > start) {
            let from = start.max(r.pos);
            let n = r.end() - from;
            let (k, v) = if from == r.pos {
                (r.k.clone(), r.v.clone())
            } else {
                (
                    r.k.narrow(2, from - r.pos, n)?,
                    r.v.narrow(2, from - r.pos, n)?,
                )
            };
            k_pos.get_or_insert(from);
            runs.push((k, v));
        }
        let from = start.max(self.own.base());
        if from < self.own.end() {
            k_pos.get_or_insert(from);
            runs.push(self.own.view(from, self.own.end())?);
        }
        Ok(k_pos.map(|k_pos| Visible { runs, k_pos }))
    }
}
