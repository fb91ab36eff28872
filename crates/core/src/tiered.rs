//! The tiered-cache toolkit every offloading policy is built from.
//!
//! * [`Link`]: the wire between the host and the device tier — a [`TransferEngine`] with
//!   its copy accounting (bytes each way, time spent waiting, copy time since the last
//!   reset).
//! * [`HostLayers`]: each layer's K/V on the host tier in `(b, kv_heads, cap, head_dim)`
//!   buffers that grow in large chunks through the engine (so the CUDA one page-locks
//!   them), with the tokens each layer holds, the attention spec it last ran with and the
//!   run's [`KvShape`].
//! * [`PingPong`]: two device buffers and at most one keyed prefetch — while a unit is
//!   attended in one buffer the next fills the other (HeadInfer §3.2's ping-pong, KVPR
//!   §3.3's transfer ∥ regeneration, FlexGen's layer-wise overlap).
//!
//! `layer`, `headwise` and `auto` (crate `kvpolicy-offload`), `recompute` and `hybrid` keep
//! only what is theirs next to these.
use candle_core::{Device, Tensor};

use crate::attention::AttnSpec;
use crate::buffer::round_up;
use crate::error::{KvError, Result};
use crate::policy::{AttnStep, KvShape};
use crate::stats::{DeviceMeter, KvStats};
use crate::transfer::{engine_for, grown_host, CopyJob, Ticket, TransferEngine};

/// Which way a batch of copies goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host tier to device tier (loads, prefetches).
    H2d,
    /// Device tier to host tier (write-backs, demotions).
    D2h,
}

/// A transfer engine with the accounting every policy reports (see the module docs).
pub struct Link {
    engine: Box<dyn TransferEngine>,
    /// `engine.copy_seconds()` at the last reset (reports count from there).
    copy_base: f64,
    h2d_bytes: u64,
    d2h_bytes: u64,
    wait_s: f64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("h2d_bytes", &self.h2d_bytes)
            .field("d2h_bytes", &self.d2h_bytes)
            .finish()
    }
}

impl Link {
    /// The engine suited to `device` ([`engine_for`]), optionally a simulated link of
    /// `bytes_per_s` on the CPU.
    pub fn for_device(device: &Device, bytes_per_s: Option<f64>) -> Result<Self> {
        Ok(Self::new(engine_for(device, bytes_per_s)?))
    }

    /// A link over `engine`.
    pub fn new(engine: Box<dyn TransferEngine>) -> Self {
        Self {
            copy_base: engine.copy_seconds(),
            engine,
            h2d_bytes: 0,
            d2h_bytes: 0,
            wait_s: 0.0,
        }
    }

    /// The engine, e.g. to allocate host buffers through it.
    pub fn engine(&mut self) -> &mut dyn TransferEngine {
        self.engine.as_mut()
    }

    /// Queues `jobs` and counts their bytes; `None` when there is nothing to copy.
    pub fn submit(&mut self, jobs: Vec<CopyJob>, dir: Direction) -> Result<Option<Ticket>> {
        if jobs.is_empty() {
            return Ok(None);
        }
        self.count(jobs.iter().map(CopyJob::bytes).sum(), dir);
        Ok(Some(self.engine.submit(jobs)?))
    }

    /// Counts `bytes` copied outside the engine (a synchronous write-back).
    pub fn count(&mut self, bytes: u64, dir: Direction) {
        match dir {
            Direction::H2d => self.h2d_bytes += bytes,
            Direction::D2h => self.d2h_bytes += bytes,
        }
    }

    /// Waits for a batch (nothing for `None`), counting the time blocked.
    pub fn wait(&mut self, ticket: Option<Ticket>) -> Result<()> {
        if let Some(t) = ticket {
            self.wait_s += self.engine.wait(t)?;
        }
        Ok(())
    }

    /// Waits for every queued batch, counting the time blocked.
    pub fn wait_all(&mut self) -> Result<()> {
        self.wait_s += self.engine.wait_all()?;
        Ok(())
    }

    /// Drains the queue and zeroes the accounting. A copy that failed here belonged to the
    /// sequence being dropped, so its error is not reported again.
    pub fn reset(&mut self) {
        let _ = self.engine.wait_all();
        self.h2d_bytes = 0;
        self.d2h_bytes = 0;
        self.wait_s = 0.0;
        self.copy_base = self.engine.copy_seconds();
    }

    /// `stats` with this link's traffic, waits, copy time and pinned bytes filled in.
    pub fn report(&self, stats: KvStats) -> KvStats {
        KvStats {
            h2d_bytes: self.h2d_bytes,
            d2h_bytes: self.d2h_bytes,
            transfer_wait_s: self.wait_s,
            copy_s: self.engine.copy_seconds() - self.copy_base,
            host_pinned_bytes: self.engine.pinned_bytes(),
            ..stats
        }
    }
}

/// `stats` with the device tier's bytes now and at peak filled in from `meter`.
pub fn report_device(meter: &DeviceMeter, stats: KvStats) -> KvStats {
    KvStats {
        device_kv_bytes: meter.current(),
        device_kv_peak_bytes: meter.peak(),
        ..stats
    }
}

/// One layer's K/V on the host tier: `(b, kv_heads, cap, head_dim)` each.
#[derive(Debug)]
pub struct HostKv {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// Tokens the buffers hold room for.
    pub cap: usize,
}

/// Bytes a tensor's elements take.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Every layer's host-tier K/V with its length and last attention spec (module docs).
#[derive(Debug)]
pub struct HostLayers {
    /// Host buffers grow in chunks of this many tokens.
    chunk: usize,
    shape: Option<KvShape>,
    layers: Vec<Option<HostKv>>,
    lens: Vec<usize>,
    specs: Vec<Option<AttnSpec>>,
}

impl HostLayers {
    /// Host storage growing in chunks of 8 × the device growth step `grow_tokens` (host
    /// memory is plentiful, and each growth copies the layer).
    pub fn new(grow_tokens: usize) -> Self {
        Self {
            chunk: grow_tokens.max(1) * 8,
            shape: None,
            layers: Vec::new(),
            lens: Vec::new(),
            specs: Vec::new(),
        }
    }

    /// Tokens per growth chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Records the run's shape (from [`KvPolicy::prepare`](crate::KvPolicy::prepare)).
    pub fn set_shape(&mut self, shape: &KvShape) {
        self.shape = Some(shape.clone());
    }

    /// The shape `step` implies ([`KvShape::for_step`]), remembered for the next step.
    pub fn shape_for(&mut self, step: &AttnStep<'_>) -> Result<KvShape> {
        let shape = KvShape::for_step(self.shape.as_ref(), self.lens.len(), step)?;
        self.shape = Some(shape.clone());
        Ok(shape)
    }

    /// Makes `step.layer` hold room for the step's tokens, checks that the step continues
    /// the layer's sequence, and records its attention spec.
    pub fn begin(&mut self, link: &mut Link, step: &AttnStep<'_>, shape: &KvShape) -> Result<()> {
        let (layer, pos) = (step.layer, step.pos);
        self.ensure(link, layer, shape, pos + step.k.dim(2)?)?;
        if self.lens[layer] != pos {
            return Err(KvError::OutOfOrder {
                seq: step.seq,
                layer,
                held: self.lens[layer],
                pos,
            });
        }
        self.specs[layer] = Some(step.spec.clone());
        Ok(())
    }

    /// Grows `layer`'s buffers to hold `tokens`. Queued copies may target the old buffers,
    /// so they land first; a completed prefetch stays valid (it read the unchanged prefix).
    pub fn ensure(
        &mut self,
        link: &mut Link,
        layer: usize,
        shape: &KvShape,
        tokens: usize,
    ) -> Result<()> {
        while self.layers.len() <= layer {
            self.layers.push(None);
            self.lens.push(0);
            self.specs.push(None);
        }
        let have = self.layers[layer].as_ref().map_or(0, |h| h.cap);
        if tokens <= have {
            return Ok(());
        }
        link.wait_all()?;
        let cap = round_up(tokens, self.chunk);
        let dims = (shape.batch, shape.n_kv_heads, cap, shape.head_dim);
        let old = self.layers[layer].take();
        let engine = link.engine();
        let k = grown_host(engine, old.as_ref().map(|o| &o.k), dims, 2, shape.dtype)?;
        let v = grown_host(engine, old.as_ref().map(|o| &o.v), dims, 2, shape.dtype)?;
        self.layers[layer] = Some(HostKv { k, v, cap });
        Ok(())
    }

    /// Counts the step's `t` tokens as stored at `layer`.
    pub fn advance(&mut self, layer: usize, t: usize) {
        if let Some(l) = self.lens.get_mut(layer) {
            *l += t;
        }
    }

    /// `layer`'s host buffers.
    pub fn get(&self, layer: usize) -> Result<&HostKv> {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| KvError::invariant(format!("layer {layer} has no host storage")))
    }

    /// The spec of `layer` if it holds exactly `pos` tokens in host storage: a layer whose
    /// history a prefetch for position `pos` may read.
    pub fn ready(&self, layer: usize, pos: usize) -> Option<&AttnSpec> {
        let stored = self.layers.get(layer).is_some_and(Option::is_some);
        match (self.lens.get(layer), self.specs.get(layer)) {
            (Some(&len), Some(Some(spec))) if len == pos && stored => Some(spec),
            _ => None,
        }
    }

    /// The widest visible history at `pos` over the layers seen (a global layer's among
    /// windowed ones, Gemma 2/3), at least `hist`.
    pub fn widest_history(&self, pos: usize, hist: usize) -> usize {
        self.specs
            .iter()
            .map(|s| s.as_ref().map_or(pos, |s| pos - s.window_start(pos)))
            .fold(hist, usize::max)
    }

    /// Tokens of the sequence (layer 0's count).
    pub fn seq_len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    /// Layers seen so far.
    pub fn layers_seen(&self) -> usize {
        self.lens.len()
    }

    /// Host bytes allocated.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|h| tensor_bytes(&h.k) + tensor_bytes(&h.v))
            .sum()
    }

    /// Hands every buffer back to the engine and forgets the sequence (the shape stays,
    /// with its layer count restarted).
    pub fn clear(&mut self, link: &mut Link) {
        for h in self.layers.drain(..).flatten() {
            let _ = link.engine().host_release(&h.k);
            let _ = link.engine().host_release(&h.v);
        }
        self.lens.clear();
        self.specs.clear();
        if let Some(s) = &mut self.shape {
            s.n_layers = 0;
        }
    }
}

/// What a [`PingPong`] buffer was (or is being) filled with.
#[derive(Debug, Clone, Copy)]
pub struct Loaded<K> {
    /// What it holds: the policy's unit key (layer, head group, range …).
    pub key: K,
    /// Which of the two buffers.
    pub buf: usize,
    /// The batches filling it, in submission order (at most two: KVPR queues X, then K/V).
    pub tickets: [Option<Ticket>; 2],
}

/// Two device buffers of type `B` and at most one prefetch keyed by `K` (module docs).
#[derive(Debug)]
pub struct PingPong<B, K> {
    bufs: [Option<B>; 2],
    cap: usize,
    prefetched: Option<Loaded<K>>,
}

impl<B, K> Default for PingPong<B, K> {
    fn default() -> Self {
        Self {
            bufs: [None, None],
            cap: 0,
            prefetched: None,
        }
    }
}

impl<B: Clone, K: Copy + PartialEq> PingPong<B, K> {
    /// Tokens the buffers hold (0 before the first [`install`](Self::install)).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Whether buffers are installed.
    pub fn is_ready(&self) -> bool {
        self.bufs[0].is_some()
    }

    /// Replaces both buffers with `bufs` of `cap` tokens. Queued copies may use the old
    /// ones, so they land first; any prefetch is dropped.
    pub fn install(&mut self, link: &mut Link, bufs: [B; 2], cap: usize) -> Result<()> {
        self.release(link)?;
        let [a, b] = bufs;
        self.bufs = [Some(a), Some(b)];
        self.cap = cap;
        Ok(())
    }

    /// Frees both buffers once the copies using them have landed.
    pub fn release(&mut self, link: &mut Link) -> Result<()> {
        link.wait_all()?;
        self.clear();
        Ok(())
    }

    /// Forgets the buffers and the prefetch without waiting (after a [`Link::reset`]).
    pub fn clear(&mut self) {
        self.bufs = [None, None];
        self.cap = 0;
        self.prefetched = None;
    }

    /// Buffer `i` (a cheap handle: tensors share storage).
    pub fn buf(&self, i: usize) -> Result<B> {
        self.bufs
            .get(i)
            .and_then(Clone::clone)
            .ok_or_else(|| KvError::invariant("the ping-pong buffers are not allocated"))
    }

    /// The prefetch of `key` if that is what was prefetched (its batches may still be in
    /// flight); any other prefetch is waited for and dropped, and `None` returned.
    pub fn take(&mut self, key: &K, link: &mut Link) -> Result<Option<Loaded<K>>> {
        match self.prefetched.take() {
            Some(p) if p.key == *key => Ok(Some(p)),
            Some(p) => {
                for t in p.tickets {
                    link.wait(t)?;
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Records what the other buffer is being filled with.
    pub fn set_prefetched(&mut self, loaded: Loaded<K>) {
        self.prefetched = Some(loaded);
    }
}
