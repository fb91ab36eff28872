//! `auto`'s resident units: the (layer, head group) units that stay on the device, each in a
//! growing [`KvBuffer`] attended in place, while the others stream through the ping-pong
//! buffers. A sliding-window layer's units are planned first, at the run's first step:
//! their buffers hold the window and one step, not the context (what no later query sees
//! is dropped before a buffer would grow), so they are the cheapest to keep. The other
//! units are decided in the order they first run (layer 0 group 0, layer 0 group 1, …):
//! resident while the budget's bytes allow, streamed after. A resident unit whose growth no
//! longer fits is demoted once — the last-decided first: its history is copied to the host
//! tier (counted) and it streams from then on — so the device never holds more than the
//! budget.
use std::collections::HashMap;

use kvpolicy_core::{round_up, KvBuffer, KvShape};

/// One resident unit's device K/V: tokens `base..base + buf.len()`.
#[derive(Debug)]
pub(crate) struct ResidentKv {
    pub(crate) buf: KvBuffer,
    pub(crate) base: usize,
}

/// Which units stay on the device, and their buffers.
#[derive(Debug, Default)]
pub(crate) struct Residency {
    /// Per unit (`layer · groups + group`), in first-run order: its device buffer while
    /// resident, `None` for a streamed (or demoted) unit.
    units: Vec<Option<ResidentKv>>,
    /// Whether the run's first step has planned.
    planned: bool,
    /// Bytes left for units not decided yet (`None`: no budget, every unit resident).
    remaining: Option<u64>,
    /// Bytes of a global unit's buffer at the planned capacity.
    unit_bytes: u64,
    /// The capacity the plan sized a global unit for: a resident unit allocates it at once
    /// (and grows by as much beyond it), so within the plan it never grows, and a growth copy
    /// never needs old and new buffers at once.
    plan_cap: usize,
    /// Windowed units decided by the plan: their buffer's tokens, or `None` (streamed).
    preset: HashMap<usize, Option<usize>>,
    /// Resident units in the order they were decided (demotion takes the last).
    order: Vec<usize>,
    /// Units demoted to the host since the last reset.
    pub demotions: u64,
}

impl Residency {
    /// Resident `unit`'s device K/V; `None` when it streams (or was never decided).
    pub(crate) fn resident_mut(&mut self, unit: usize) -> Option<&mut ResidentKv> {
        self.units.get_mut(unit).and_then(Option::as_mut)
    }

    /// Plans the run at its first step with `avail` bytes for resident units (`None`: no
    /// budget) of `group` KV heads: a global unit holds `plan_cap` tokens, a windowed
    /// layer's unit its window and one step (rounded up to `grow` tokens). Windowed units
    /// are decided here, first; the others when they first run, while bytes remain.
    pub fn plan(
        &mut self,
        shape: &KvShape,
        (group, grow): (usize, usize),
        plan_cap: usize,
        avail: Option<u64>,
    ) {
        self.clear();
        self.planned = true;
        self.plan_cap = plan_cap;
        self.unit_bytes = shape.kv_bytes(group, plan_cap).max(1);
        self.remaining = avail;
        let groups = shape.n_kv_heads / group.max(1);
        for (layer, w) in shape.windows.iter().enumerate() {
            let Some(w) = *w else { continue };
            let cap = round_up(w + shape.largest_step(), grow).min(plan_cap.max(grow));
            let bytes = shape.kv_bytes(group, cap);
            for unit in layer * groups..(layer + 1) * groups {
                let fits = self.take_room(unit, bytes);
                self.preset.insert(unit, fits.then_some(cap));
            }
        }
    }

    /// Whether `unit`'s `bytes` fit what the budget has left; if so they are charged and the
    /// unit joins the decision order (no budget: everything fits).
    fn take_room(&mut self, unit: usize, bytes: u64) -> bool {
        let fits = match &mut self.remaining {
            None => true,
            Some(r) if bytes <= *r => {
                *r -= bytes;
                true
            }
            Some(_) => false,
        };
        if fits {
            self.order.push(unit);
        }
        fits
    }

    /// Whether the plan keeps every unit resident (no budget): nothing ever streams.
    pub fn unbounded(&self) -> bool {
        self.planned && self.remaining.is_none()
    }

    /// Decides `unit` on its first run (a windowed unit as planned; another resident while
    /// the bytes left hold one); a unit already decided keeps its decision.
    pub fn decide(&mut self, unit: usize, grow_tokens: usize) {
        while self.units.len() <= unit {
            let u = self.units.len();
            let tokens = match self.preset.get(&u) {
                Some(planned) => *planned,
                // Under a budget a resident unit is allocated at its planned capacity once
                // (growth would hold old and new buffers at once, past the charge); without
                // one it grows as `full`'s layers do, never reserving the whole run ahead
                // (a `--max-new-tokens` of 10^9 must not allocate for 10^9 tokens).
                None if self.remaining.is_none() => {
                    self.take_room(u, self.unit_bytes);
                    Some(grow_tokens)
                }
                None => self
                    .take_room(u, self.unit_bytes)
                    .then_some(self.plan_cap.max(grow_tokens)),
            };
            self.units.push(tokens.map(|t| ResidentKv {
                buf: KvBuffer::new(t),
                base: 0,
            }));
        }
    }

    /// Whether `unit` is decided (or planned) and resident.
    pub fn is_resident(&self, unit: usize) -> bool {
        match self.units.get(unit) {
            Some(u) => u.is_some(),
            None => self.preset.get(&unit).is_some_and(Option::is_some),
        }
    }

    /// Takes `unit` off the device for good, returning its buffer (counted as a demotion).
    pub(crate) fn demote(&mut self, unit: usize) -> Option<ResidentKv> {
        let buf = self.units.get_mut(unit).and_then(Option::take);
        if buf.is_some() {
            self.demotions += 1;
        }
        buf
    }

    /// The last-decided unit still resident.
    pub fn last_resident(&self) -> Option<usize> {
        self.order
            .iter()
            .rev()
            .copied()
            .find(|&u| self.units.get(u).is_some_and(Option::is_some))
    }

    /// Units resident now.
    pub fn resident(&self) -> usize {
        self.units.iter().filter(|u| u.is_some()).count()
    }

    /// Units decided so far that stream.
    pub fn streamed(&self) -> usize {
        self.units.len() - self.resident()
    }

    /// Forgets every unit and the plan (a new sequence plans again at its first step).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}
