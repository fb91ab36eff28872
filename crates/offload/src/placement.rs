//! `auto`'s resident units as the runtime places them ([`OffloadPolicy`]'s side of
//! [`crate::resident`]): a unit attended in place, a unit demoted to the host tier when its
//! growth no longer fits the budget (its history copied back, counted), and room made for
//! grown streaming buffers by demoting the last-decided units first.
use candle_core::Tensor;
use kvpolicy_core::{KvShape, Partial, Result, StashedUnit};
use kvpolicy_tiered::WriteAt;

use crate::resident::{InPlace, KeptView, Residency, UnitAt, UnitId};
use crate::runtime::OffloadPolicy;

impl OffloadPolicy {
    /// `auto`: decides `unit` on its first run and attends it in place if it is resident
    /// (its new entries appended to its device buffer), returning its partial. `None` when
    /// the unit streams — also when it was resident but its growth (and a step's scratch,
    /// `reserve`) no longer fits the budget: it is demoted here. When layers read this one's
    /// cache (`keep`), what the unit attended is kept for them (a view, nothing copied).
    pub(crate) fn attend_resident(
        &mut self,
        unit: UnitId,
        (q, kn, vn): (&Tensor, &Tensor, &Tensor),
        at: &UnitAt<'_>,
        (reserve, act): (u64, u64),
        keep: bool,
    ) -> Result<Option<Partial>> {
        let Some(r) = self.residency.as_mut() else {
            return Ok(None);
        };
        let (layer, g, gs) = (unit.layer, unit.group, kn.dim(1)?);
        let id = layer * unit.groups + g;
        r.decide(id, self.plan.grow_tokens());
        let (kd, vd) = (self.device_codec.encode(kn)?, self.device_codec.encode(vn)?);
        match r.attend(id, (q, &kd, &vd), at, reserve, &mut self.meter)? {
            InPlace::Streams => Ok(None),
            InPlace::Demote => {
                self.demote(id, layer, g, gs)?;
                Ok(None)
            }
            InPlace::Attended(part) => {
                self.stats.note_scratch(part.scratch_bytes, act);
                if keep {
                    // What the unit attended (nothing, for a share that holds none of the
                    // window: the readers' view of these heads is then empty too).
                    let kept = match r.view(id, at)? {
                        Some(kept) => kept,
                        None => KeptView {
                            k: kd.narrow(2, 0, 0)?,
                            v: vd.narrow(2, 0, 0)?,
                            k_pos: at.base + at.keep_from,
                        },
                    };
                    self.stash.keep_view(StashedUnit {
                        first_head: g * gs,
                        k: kept.k,
                        v: kept.v,
                        k_pos: kept.k_pos,
                    })?;
                }
                Ok(Some(part))
            }
        }
    }

    /// Takes resident `unit` (group `g` of `layer`, `gs` heads) off the device: its history
    /// is copied to the host tier (counted device→host) and it streams from now on.
    pub(crate) fn demote(&mut self, unit: usize, layer: usize, g: usize, gs: usize) -> Result<()> {
        let Some(kv) = self.residency.as_mut().and_then(|r| r.demote(unit)) else {
            return Ok(());
        };
        if let Some(((k, v), base)) = kv.history()? {
            // The host tier may have dropped the front of a windowed layer further than the
            // unit did: those tokens no later query sees.
            let from = self.host.first_held(layer).max(base);
            let len = k.dim(2)?.saturating_sub(from - base);
            if len > 0 {
                let (k, v) = (
                    k.narrow(2, from - base, len)?,
                    v.narrow(2, from - base, len)?,
                );
                self.host.write_from(
                    &mut self.link,
                    WriteAt {
                        layer,
                        first_head: g * gs,
                        offset: from,
                    },
                    (&k, &v),
                    self.device_codec,
                )?;
                self.link.wait_all()?;
            }
        }
        self.meter.free(kv.allocated_bytes());
        Ok(())
    }

    /// Takes every resident unit off the device, numbered by a head group of `gs` heads (a
    /// new group size renumbers the units, so none may stay under the old numbering).
    pub(crate) fn demote_all(&mut self, shape: &KvShape, gs: usize) -> Result<()> {
        while self.demote_last(shape, gs)? {}
        Ok(())
    }

    /// Takes the last-decided resident unit (numbered by a head group of `gs` heads) off
    /// the device; `false` when none is left.
    fn demote_last(&mut self, shape: &KvShape, gs: usize) -> Result<bool> {
        let Some(unit) = self.residency.as_ref().and_then(Residency::last_resident) else {
            return Ok(false);
        };
        let groups = shape.n_kv_heads / gs.max(1);
        self.demote(unit, unit / groups, unit % groups, gs)?;
        Ok(true)
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
        let scratch = self.plan.scratch_bytes(shape, group, cap);
        while self.meter.current() - old.min(self.meter.current()) + pingpong + scratch > budget {
            if !self.demote_last(shape, self.stream.group())? {
                break;
            }
        }
        Ok(())
    }
}
