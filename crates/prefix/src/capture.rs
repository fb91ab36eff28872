//! [`Capture`]: a policy wrapper that keeps a copy, on the host, of the K/V a run hands its
//! policy from a given position on — the chunks a request adds to the prefix cache, and the
//! history a saved session holds — and forwards every call unchanged. Holding the step's
//! tensors costs nothing on the CPU (they are shared); on an accelerator the copy goes to
//! host RAM, not the device.
use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use kvpolicy_core::{AttnStep, Batched, KvLease, KvPolicy, KvRestore, KvShape, LayerKv};
use kvpolicy_core::{KvStats, PoolTier, Profiled, Result, SharedRun};

use crate::chunk::ChunkKv;

/// What a [`Capture`] keeps: for each watched sequence, its K/V from a position on, per
/// layer (a batched run watches several requests at once).
#[derive(Default)]
pub struct Recordings {
    seqs: BTreeMap<usize, Recording>,
}

/// One sequence's kept K/V.
struct Recording {
    from: usize,
    /// Per layer, the pieces seen, in order.
    layers: Vec<Vec<LayerKv>>,
}

impl Recordings {
    /// Keeps sequence `seq`'s K/V from position `from` on (what it kept so far is dropped).
    pub fn watch(&mut self, seq: usize, from: usize) {
        self.seqs.insert(
            seq,
            Recording {
                from,
                layers: Vec::new(),
            },
        );
    }

    /// Stops keeping sequence `seq`, dropping what was kept.
    pub fn forget(&mut self, seq: usize) {
        self.seqs.remove(&seq);
    }

    /// Drops what was kept for every sequence, still watching them.
    pub fn clear(&mut self) {
        for r in self.seqs.values_mut() {
            r.layers.clear();
        }
    }

    fn keep(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let Some(r) = self.seqs.get_mut(&step.seq) else {
            return Ok(());
        };
        let t = step.k.dim(2)?;
        if step.pos + t <= r.from {
            return Ok(());
        }
        let skip = r.from.saturating_sub(step.pos);
        let piece = |x: &Tensor| x.narrow(2, skip, t - skip)?.to_device(&Device::Cpu);
        if r.layers.len() <= step.layer {
            r.layers.resize_with(step.layer + 1, Vec::new);
        }
        r.layers[step.layer].push(LayerKv {
            k: piece(step.k)?,
            v: piece(step.v)?,
        });
        Ok(())
    }

    /// Everything kept for `seq`, from its position on, joined per layer (`None`: nothing).
    pub fn kv(&self, seq: usize) -> Result<Option<ChunkKv>> {
        let Some(r) = self.seqs.get(&seq) else {
            return Ok(None);
        };
        if r.layers.iter().all(Vec::is_empty) {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(r.layers.len());
        for pieces in &r.layers {
            let ks: Vec<&Tensor> = pieces.iter().map(|p| &p.k).collect();
            let vs: Vec<&Tensor> = pieces.iter().map(|p| &p.v).collect();
            layers.push(LayerKv {
                k: Tensor::cat(&ks, 2)?,
                v: Tensor::cat(&vs, 2)?,
            });
        }
        Ok(Some(ChunkKv { layers }))
    }
}

/// Forwards to `inner`, keeping the K/V of the watched sequences ([`Recordings`]) while
/// [`Capture::keeping`].
pub struct Capture<'a> {
    inner: &'a mut dyn KvPolicy,
    rec: Recordings,
    keep: bool,
}

impl<'a> Capture<'a> {
    /// Wraps `inner`, keeping sequence 0's K/V from position `from` on (one request).
    pub fn new(inner: &'a mut dyn KvPolicy, from: usize) -> Self {
        let mut rec = Recordings::default();
        rec.watch(0, from);
        Self::over(inner, rec)
    }

    /// Wraps `inner`, keeping what `rec` watches (a batched run's requests); take them
    /// back with [`Capture::into_recordings`].
    pub fn over(inner: &'a mut dyn KvPolicy, rec: Recordings) -> Self {
        Self {
            inner,
            rec,
            keep: true,
        }
    }

    /// The recordings, for the next step's capture.
    pub fn into_recordings(self) -> Recordings {
        self.rec
    }

    /// Whether later steps are kept (they are from the start).
    pub fn keeping(&mut self, keep: bool) {
        self.keep = keep;
    }

    /// Forgets what was kept so far.
    pub fn clear(&mut self) {
        self.rec.clear();
    }

    fn keep(&mut self, step: &AttnStep<'_>) -> Result<()> {
        if self.keep {
            self.rec.keep(step)?;
        }
        Ok(())
    }

    /// Everything kept of sequence 0 so far, joined per layer (`None`: nothing).
    pub fn kv(&self) -> Result<Option<ChunkKv>> {
        self.rec.kv(0)
    }
}

impl KvPolicy for Capture<'_> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        self.inner.prepare(shape)
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<candle_core::Tensor> {
        self.keep(step)?;
        self.inner.attend(step)
    }

    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<candle_core::Tensor> {
        // The owner's K/V were kept when it attended; a reader adds none.
        self.inner.attend_shared(step)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn reset(&mut self) {
        self.rec.clear();
        self.inner.reset();
    }

    fn stats(&self) -> KvStats {
        self.inner.stats()
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        self.inner.as_restore()?;
        Some(self)
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        self.inner.as_profiled()
    }

    fn as_batched(&mut self) -> Option<&mut dyn Batched> {
        self.inner.as_batched()
    }
}

/// K/V given without attention are kept as those attended (a swapped-out request's prompt
/// coming back while its prefill is recorded); the rest is forwarded.
impl KvRestore for Capture<'_> {
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        self.keep(step)?;
        kvpolicy_core::append_kv(self.inner, step)
    }

    fn attaches_kv(&mut self, seq: usize) -> bool {
        self.inner.as_restore().is_some_and(|r| r.attaches_kv(seq))
    }

    fn attach_tier(&mut self) -> Option<PoolTier> {
        self.inner.as_restore().and_then(|r| r.attach_tier())
    }

    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        self.keep(step)?;
        kvpolicy_core::attach_kv(self.inner, step, lease)
    }

    fn adopt_kv(&mut self, seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        kvpolicy_core::adopt_kv(self.inner, seq, layer, runs)
    }

    fn export_kv(&mut self, seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        kvpolicy_core::export_kv(self.inner, seq, layer)
    }
}
