//! How the runtime attends and makes room with `auto`'s resident units ([`Residency`]): a
//! resident unit attended in place in its device buffer, demotion to the host when its
//! growth no longer fits the budget, room made for grown streaming buffers.
use candle_core::Tensor;
use kvpolicy_core::{attend_partial, AttnStep, KvShape, Result};

use crate::resident::{Residency, ResidentKv};
use crate::runtime::OffloadPolicy;

impl OffloadPolicy {
    /// `auto`: attends resident `unit` in place, its new entries appended to its device
    /// buffer. `None` when the unit streams — also when it was resident but its growth (and
    /// a step's scratch, `reserve`) no longer fits the budget: it is demoted here.
    pub(crate) fn attend_resident(
        &mut self,
        unit: usize,
        (q, kn, vn): (&Tensor, &Tensor, &Tensor),
        step: &AttnStep<'_>,
        reserve: u64,
        act: u64,
    ) -> Result<Option<Tensor>> {
        let (layer, pos, t) = (step.layer, step.pos, kn.dim(2)?);
        let Some(res) = self.residency.as_mut().and_then(|r| r.resident_mut(unit)) else {
            return Ok(None);
        };
        let start = step.spec.window_start(pos);
        if res.buf.len() + t > res.buf.capacity() && start > res.base {
            // No later query sees the tokens before the window: drop them, not grow.
            res.buf.drop_front(start - res.base)?;
            res.base = start;
        }
        let buf = &mut res.buf;
        let grow = buf.growth_bytes(kn)?;
        if grow > 0 && !self.meter.fits(grow + reserve) {
            let gs = kn.dim(1)?;
            let groups = step.k.dim(1)? / gs;
            self.demote(unit, layer, unit % groups, gs)?;
            return Ok(None);
        }
        buf.append_metered(kn, vn, &mut self.meter)?;
        let (k, v) = buf.view(start - res.base, pos + t - start)?;
        let part = attend_partial(q, &k, &v, pos, start, step.spec)?;
        self.stats.note_scratch(part.scratch_bytes, act);
        Ok(Some(part.out.to_dtype(q.dtype())?))
    }

    /// Takes resident `unit` (group `g` of `layer`, `gs` heads) off the device: its history
    /// is copied to the host tier (counted device→host) and it streams from now on.
    pub(crate) fn demote(&mut self, unit: usize, layer: usize, g: usize, gs: usize) -> Result<()> {
        let Some(ResidentKv { buf, base }) = self.residency.as_mut().and_then(|r| r.demote(unit))
        else {
            return Ok(());
        };
        if !buf.is_empty() {
            // Tokens before `base` were dropped from a window: no query reads them again.
            let (k, v) = buf.view(0, buf.len())?;
            self.host
                .write(&mut self.link, layer, (&k, &v), g * gs, base)?;
            self.link.wait_all()?;
        }
        self.meter.free(buf.allocated_bytes());
        Ok(())
    }

    /// `auto` growing its streaming buffers from `old` to `pingpong` bytes (at `group`
    /// heads, `cap` tokens): resident units make room, the last-decided first, until the
    /// buffers and a step's scratch fit the budget.
    pub(crate) fn make_room(
        &mut self,
        shape: &KvShape,
        old: u64,
        pingpong: u64,
        (group, cap): (usize, usize),
    ) -> Result<()> {
        let Some(budget) = self.meter.budget() else {
            return Ok(());
        };
        let scratch = shape.step_scratch_bytes(group, cap, &self.device);
        while self.meter.current() - old.min(self.meter.current()) + pingpong + scratch > budget {
            let Some(unit) = self.residency.as_ref().and_then(Residency::last_resident) else {
                break;
            };
            let groups = shape.n_kv_heads / self.group.max(1);
            self.demote(unit, unit / groups, unit % groups, self.group)?;
        }
        Ok(())
    }
}
