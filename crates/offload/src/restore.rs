//! `layer`, `headwise` and `auto` taking K/V computed elsewhere ([`KvRestore`]: a restored
//! session or shared prefix, a synthetic history) where `attend` would put them — or, for a
//! prefix shared with other live sequences, holding it by reference on the host tier
//! (SGLang HiCache's host-memory L2 shared by every request; PagedAttention SOSP '23 §4.3's
//! reference-counted blocks): every unit of a global layer streams its prefix from the one
//! copy, so `auto` streams those units rather than copy the prefix to the device per
//! sequence.
use candle_core::Device;
use kvpolicy_core::SharedRun;
use kvpolicy_core::{AttnStep, KvCodec, KvLease, KvRestore, LayerKv, PoolTier, Result};

use crate::resident::Placed;
use crate::runtime::OffloadPolicy;

impl KvRestore for OffloadPolicy {
    /// The step's K/V go where `attend` would put them: to the host tier (RAM or disk) for
    /// `layer`, `headwise` and `auto`'s streamed units, into the device buffer of each of
    /// `auto`'s resident units (decided, and demoted when their growth no longer fits, as
    /// when they attend).
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let shape = self.host.shape_for(step)?;
        self.host.begin(&mut self.link, step, &shape)?;
        let (layer, pos, t) = (step.layer, step.pos, step.k.dim(2)?);
        if self.residency.is_none() {
            self.write_new(layer, 0, pos, (step.k, step.v))?;
            self.host.advance(layer, t);
            return Ok(());
        }
        let hist = pos - step.spec.window_start(pos);
        let widest = self.host.widest_history(pos, hist);
        self.ensure_buffers(&shape, widest + t, pos + t)?;
        let gs = self.stream.group();
        let groups = shape.n_kv_heads / gs;
        let reserve = self.plan.scratch_bytes(&shape, gs, widest + t);
        for g in 0..groups {
            let kn = step.k.narrow(1, g * gs, gs)?.contiguous()?;
            let vn = step.v.narrow(1, g * gs, gs)?.contiguous()?;
            let unit = layer * groups + g;
            if let Some(r) = self.residency.as_mut() {
                r.decide(unit, self.plan.grow_tokens());
                let (kd, vd) = (
                    self.device_codec.encode(&kn)?,
                    self.device_codec.encode(&vn)?,
                );
                let keep_from = step.spec.window_start(pos);
                match r.append(unit, (&kd, &vd), keep_from, reserve, &mut self.meter)? {
                    Placed::Appended => continue,
                    Placed::Streams => {}
                    Placed::Demote => self.demote(unit, layer, g, gs)?,
                }
            }
            self.write_new(layer, g * gs, pos, (&kn, &vn))?;
        }
        self.host.advance(layer, t);
        Ok(())
    }

    /// On the CPU, with K/V stored as given on the host tier, for a whole sequence (not a
    /// `helix` share); `auto` only under a device budget (without one every unit is
    /// resident and nothing streams).
    fn attaches_kv(&mut self, _seq: usize) -> bool {
        let streams = self.residency.is_none() || self.meter.budget().is_some();
        self.plan.device().is_cpu()
            && self.host.codec() == KvCodec::Model
            && self.shard_base.is_none()
            && streams
    }

    /// Streamed from the host tier.
    fn attach_tier(&mut self) -> Option<PoolTier> {
        self.attaches_kv(0).then_some(PoolTier::Host)
    }

    /// A global layer's run is kept by reference on the host tier while the layer holds no
    /// token of its own (a prefix restored before the prefill), and the layer's units stream
    /// from it; anything else is copied ([`Self::append_kv`]). A sliding-window layer copies:
    /// its window starts anywhere in a chunk.
    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        if self.attaches_kv(step.seq) && step.spec.sliding_window.is_none() {
            self.host.shape_for(step)?;
            let run = SharedRun {
                k: step.k,
                v: step.v,
                pos: step.pos,
                lease,
            };
            if self
                .host
                .attach(&mut self.link, step.layer, &run, step.spec)?
            {
                self.stream_layer(step.layer)?;
                return Ok(());
            }
        }
        self.append_kv(step)
    }

    /// The host tier's copy of a global layer's prefix given up for the stored runs; under
    /// `auto` the layer's resident units go to the host tier (their tokens after the runs)
    /// and stream from then on.
    fn adopt_kv(&mut self, seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        let windowed = self
            .host
            .known_shape()
            .is_none_or(|s| s.windows.get(layer).copied().flatten().is_some());
        if windowed || runs.is_empty() || !self.attaches_kv(seq) {
            return Ok(false);
        }
        if !self.host.adopt(&mut self.link, layer, runs)? {
            return Ok(false);
        }
        self.stream_layer(layer)?;
        Ok(true)
    }

    /// From the host tier, stored as given (not a `helix` share); under `auto` the layer's
    /// resident units go there first (the sequence is leaving; with K/V stored as given on
    /// the device too, so nothing is converted on the way).
    fn export_kv(&mut self, _seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        let as_given = self.host.codec() == KvCodec::Model
            && (self.residency.is_none() || self.device_codec == KvCodec::Model);
        if !as_given || self.shard_base.is_some() {
            return Ok(None);
        }
        self.stream_layer(layer)?;
        self.link.wait_all()?;
        let Some(whole) = self.host.whole_layer(layer)? else {
            return Ok(None);
        };
        let cpu = Device::Cpu;
        Ok(Some(LayerKv {
            k: whole.k.to_device(&cpu)?.contiguous()?,
            v: whole.v.to_device(&cpu)?.contiguous()?,
        }))
    }
}

impl OffloadPolicy {
    /// `layer`'s units stream from now on (`auto`: those resident go to the host tier; those
    /// not decided yet will stream). Nothing for `layer` and `headwise`.
    fn stream_layer(&mut self, layer: usize) -> Result<()> {
        let Some(r) = self.residency.as_mut() else {
            return Ok(());
        };
        r.stream_layer(layer);
        let gs = self.stream.group();
        let Some(shape) = self.host.known_shape().filter(|_| gs > 0) else {
            // Not planned yet: its units stream from their first run.
            return Ok(());
        };
        let groups = shape.n_kv_heads / gs;
        for g in 0..groups {
            let unit = layer * groups + g;
            if self.residency.as_ref().is_some_and(|r| r.is_resident(unit)) {
                self.demote(unit, layer, g, gs)?;
            }
        }
        Ok(())
    }
}
