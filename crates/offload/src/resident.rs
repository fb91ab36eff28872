//! `auto`'s resident units: the (layer, head group) units that stay on the device, each in a
//! growing [`KvBuffer`] attended in place, while the others stream through the ping-pong
//! buffers. Units are decided in the order they first run (layer 0 group 0, layer 0 group
//! 1, …): resident while the budget's count allows, streamed after. A resident unit whose
//! growth no longer fits is demoted once: its history is copied to the host tier (counted)
//! and it streams from then on — the device never holds more than the budget.
use candle_core::Tensor;

use kvpolicy_core::{attend_partial, AttnStep, Direction, KvBuffer, KvShape, Result};

use crate::runtime::{write_back_jobs, OffloadPolicy};

/// Which units stay on the device, and their buffers.
#[derive(Debug, Default)]
pub(crate) struct Residency {
    /// Per unit (`layer · groups + group`), in first-run order: its device buffer while
    /// resident, `None` for a streamed (or demoted) unit.
    units: Vec<Option<KvBuffer>>,
    /// How many units may be resident (from the budget; `usize::MAX` without one).
    pub target: usize,
    /// The capacity the plan sized a unit for: a resident unit allocates it at once (and
    /// grows by as much beyond it), so within the plan it never grows, and a growth copy
    /// never needs old and new buffers at once.
    pub plan_cap: usize,
    /// Units demoted to the host since the last reset.
    pub demotions: u64,
}

impl Residency {
    /// Decides `unit` on its first run (resident while fewer than `target` are); a unit
    /// already decided keeps its decision.
    pub fn decide(&mut self, unit: usize, grow_tokens: usize) {
        let chunk = self.plan_cap.max(grow_tokens);
        while self.units.len() <= unit {
            let resident = self.resident() < self.target;
            self.units.push(resident.then(|| KvBuffer::new(chunk)));
        }
    }

    /// Whether `unit` is decided and resident.
    pub fn is_resident(&self, unit: usize) -> bool {
        self.units.get(unit).is_some_and(Option::is_some)
    }

    /// `unit`'s buffer, if resident.
    pub fn buffer(&mut self, unit: usize) -> Option<&mut KvBuffer> {
        self.units.get_mut(unit).and_then(Option::as_mut)
    }

    /// Takes `unit` off the device for good, returning its buffer (counted as a demotion).
    pub fn demote(&mut self, unit: usize) -> Option<KvBuffer> {
        let buf = self.units.get_mut(unit).and_then(Option::take);
        if buf.is_some() {
            self.demotions += 1;
        }
        buf
    }

    /// The last-decided unit still resident.
    pub fn last_resident(&self) -> Option<usize> {
        self.units.iter().rposition(Option::is_some)
    }

    /// Units resident now.
    pub fn resident(&self) -> usize {
        self.units.iter().filter(|u| u.is_some()).count()
    }

    /// Units decided so far that stream.
    pub fn streamed(&self) -> usize {
        self.units.len() - self.resident()
    }

    /// Forgets every unit (a new sequence); the target is re-planned at the next step.
    pub fn clear(&mut self) {
        self.units.clear();
        self.demotions = 0;
        self.target = 0;
        self.plan_cap = 0;
    }
}

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
        let Some(buf) = self.residency.as_mut().and_then(|r| r.buffer(unit)) else {
            return Ok(None);
        };
        let grow = buf.growth_bytes(kn)?;
        if grow > 0 && !self.meter.fits(grow + reserve) {
            let gs = kn.dim(1)?;
            let groups = step.k.dim(1)? / gs;
            self.demote(unit, layer, unit % groups, gs)?;
            return Ok(None);
        }
        buf.append_metered(kn, vn, &mut self.meter)?;
        let start = step.spec.window_start(pos);
        let (k, v) = buf.view(start, pos + t - start)?;
        let part = attend_partial(q, &k, &v, pos, start, step.spec)?;
        self.stats.note_scratch(part.scratch_bytes, act);
        Ok(Some(part.out.to_dtype(q.dtype())?))
    }

    /// Takes resident `unit` (group `g` of `layer`, `gs` heads) off the device: its history
    /// is copied to the host tier (counted device→host) and it streams from now on.
    pub(crate) fn demote(&mut self, unit: usize, layer: usize, g: usize, gs: usize) -> Result<()> {
        let Some(buf) = self.residency.as_mut().and_then(|r| r.demote(unit)) else {
            return Ok(());
        };
        if !buf.is_empty() {
            let (k, v) = buf.view(0, buf.len())?;
            let jobs = write_back_jobs((&k, &v), self.host.get(layer)?, g * gs, 0)?;
            let ticket = self.link.submit(jobs, Direction::D2h)?;
            self.link.wait(ticket)?;
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
