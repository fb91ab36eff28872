//! `layer`, `headwise` and `auto` taking K/V computed elsewhere ([`KvRestore`]: a restored
//! session or shared prefix, a synthetic history) where `attend` would put them.
use kvpolicy_core::{AttnStep, KvRestore, Result};

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
}
