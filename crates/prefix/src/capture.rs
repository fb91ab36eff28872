//! [`Capture`]: a policy wrapper that keeps a copy, on the host, of the K/V a run hands its
//! policy from a given position on — the chunks a request adds to the prefix cache, and the
//! history a saved session holds — and forwards every call unchanged. Holding the step's
//! tensors costs nothing on the CPU (they are shared); on an accelerator the copy goes to
//! host RAM, not the device.
use candle_core::{Device, Tensor};
use kvpolicy_core::{AttnStep, KvPolicy, KvRestore, KvShape, KvStats, Profiled, Result};

use crate::chunk::{ChunkKv, LayerKv};

/// Forwards to `inner`, keeping sequence 0's K/V of positions `from..` per layer while
/// [`Capture::keeping`].
pub struct Capture<'a> {
    inner: &'a mut dyn KvPolicy,
    from: usize,
    keep: bool,
    /// Per layer, the pieces seen, in order.
    layers: Vec<Vec<LayerKv>>,
}

impl<'a> Capture<'a> {
    /// Wraps `inner`, keeping K/V from position `from` on.
    pub fn new(inner: &'a mut dyn KvPolicy, from: usize) -> Self {
        Self {
            inner,
            from,
            keep: true,
            layers: Vec::new(),
        }
    }

    /// Whether later steps are kept (they are from the start).
    pub fn keeping(&mut self, keep: bool) {
        self.keep = keep;
    }

    /// Forgets what was kept so far.
    pub fn clear(&mut self) {
        self.layers.clear();
    }

    fn keep(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let t = step.k.dim(2)?;
        if !self.keep || step.seq != 0 || step.pos + t <= self.from {
            return Ok(());
        }
        let skip = self.from.saturating_sub(step.pos);
        let piece = |x: &Tensor| x.narrow(2, skip, t - skip)?.to_device(&Device::Cpu);
        if self.layers.len() <= step.layer {
            self.layers.resize_with(step.layer + 1, Vec::new);
        }
        self.layers[step.layer].push(LayerKv {
            k: piece(step.k)?,
            v: piece(step.v)?,
        });
        Ok(())
    }

    /// Everything kept so far, from position `from` on, joined per layer (`None`: nothing).
    pub fn kv(&self) -> Result<Option<ChunkKv>> {
        if self.layers.iter().all(Vec::is_empty) {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for pieces in &self.layers {
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

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn reset(&mut self) {
        self.layers.clear();
        self.inner.reset();
    }

    fn stats(&self) -> KvStats {
        self.inner.stats()
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        self.inner.as_restore()
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        self.inner.as_profiled()
    }
}
