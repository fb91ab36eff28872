//! `auto`'s resident units: the (layer, head group) units that stay on the device, each in a
//! growing [`KvBuffer`] attended in place, while the others stream through the ping-pong
//! buffers. A sliding-window layer's units are planned first, at the run's first step:
//! their buffers hold the window and one step, not the context (what no later query sees
//! is dropped before a buffer would grow), so they are the cheapest to keep. The other
//! units are decided in the order they first run (layer 0 group 0, layer 0 group 1, …):
//! resident while the budget's bytes allow, streamed after. A resident unit whose growth no
//! longer fits is demoted once — the last-decided first: its history is copied to the host
//! tier (counted) and it streams from then on — so the device never holds more than the
//! budget. A resident unit is attended in place ([`Residency::attend`]): its new entries
//! appended to its buffer, what no later query sees dropped before it would grow; when its
//! growth no longer fits it says so, and the runtime demotes it.
use std::collections::{BTreeSet, HashMap};

use candle_core::Tensor;
use kvpolicy_core::Result;
use kvpolicy_core::{
    attend_partial, round_up, AttnInputs, AttnSpec, AttnStep, DeviceMeter, KvShape, Partial,
    WindowKv,
};

/// What became of a unit attended in place ([`Residency::attend`]).
pub(crate) enum InPlace {
    /// It streams: attend it from the streaming buffers.
    Streams,
    /// It is resident, but its growth (and a step's scratch) no longer fits the budget: it
    /// is to be demoted, and streams from now on.
    Demote,
    /// Attended in its device buffer.
    Attended(Partial),
}

/// What became of a unit's new entries ([`Residency::append`]).
pub(crate) enum Placed {
    /// It streams: its entries go to the host tier.
    Streams,
    /// It is resident, but its growth no longer fits the budget: to be demoted.
    Demote,
    /// Appended to its device buffer.
    Appended,
}

/// One (layer, head group) unit of a step, of `groups` per layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnitId {
    pub(crate) layer: usize,
    pub(crate) group: usize,
    pub(crate) groups: usize,
}

/// Where a step's queries and keys sit for a resident unit: its buffer holds positions
/// counted from `base` (0, or the first of one rank's share under `helix`).
#[derive(Clone, Copy)]
pub(crate) struct UnitAt<'a> {
    /// Absolute position of the step's first query.
    pub(crate) q_pos: usize,
    /// The first buffer position the step's first query sees (its window's start, counted
    /// from `base`): nothing before it is attended, and it may be dropped.
    pub(crate) keep_from: usize,
    /// The absolute position of the buffer's position 0.
    pub(crate) base: usize,
    pub(crate) spec: &'a AttnSpec,
}

impl<'a> UnitAt<'a> {
    /// A step of a whole sequence (not a share): buffer positions are absolute.
    pub(crate) fn whole(step: &AttnStep<'a>) -> Self {
        Self {
            q_pos: step.pos,
            keep_from: step.spec.window_start(step.pos),
            base: 0,
            spec: step.spec,
        }
    }
}

/// Keys and values a resident unit holds for a step ([`Residency::view`]).
pub(crate) struct KeptView {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    /// Absolute position of the first key.
    pub(crate) k_pos: usize,
}

/// Which units stay on the device, and their buffers.
#[derive(Debug, Default)]
pub(crate) struct Residency {
    /// Per unit (`layer · groups + group`), in first-run order: its device buffer while
    /// resident, `None` for a streamed (or demoted) unit.
    units: Vec<Option<WindowKv>>,
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
    demotions: u64,
    /// Layers whose units stream whatever the budget: they hold a prefix shared with other
    /// sequences on the host tier, which a resident unit would copy per sequence.
    streamed_layers: BTreeSet<usize>,
    /// Units per layer (the plan's).
    groups: usize,
}

impl Residency {
    /// Appends the step's new entries `kn`, `vn` to `unit`'s device buffer if it is
    /// resident (charged to `meter`). A buffer about to grow first drops the tokens no later
    /// query sees (before `keep_from`, the window's first position in the buffer's). When the growth and a step's scratch (`reserve`) no
    /// longer fit `meter`'s budget nothing is appended: the unit is to be demoted.
    pub(crate) fn append(
        &mut self,
        unit: usize,
        (kn, vn): (&Tensor, &Tensor),
        keep_from: usize,
        reserve: u64,
        meter: &mut DeviceMeter,
    ) -> Result<Placed> {
        let t = kn.dim(2)?;
        let Some(res) = self.units.get_mut(unit).and_then(Option::as_mut) else {
            return Ok(Placed::Streams);
        };
        if t == 0 {
            return Ok(Placed::Appended);
        }
        // No later query sees the tokens before the window: drop them, not grow.
        res.make_room(keep_from, t)?;
        let grow = res.growth_bytes(kn)?;
        if grow > 0 && !meter.fits(grow + reserve) {
            return Ok(Placed::Demote);
        }
        res.append_metered(kn, vn, meter)?;
        Ok(Placed::Appended)
    }

    /// Attends `unit` in place if it is resident: the step's new entries appended first
    /// ([`Residency::append`]), then queries `q` over what the buffer holds from
    /// `at.keep_from` on.
    pub(crate) fn attend(
        &mut self,
        unit: usize,
        (q, kn, vn): (&Tensor, &Tensor, &Tensor),
        at: &UnitAt<'_>,
        reserve: u64,
        meter: &mut DeviceMeter,
    ) -> Result<InPlace> {
        match self.append(unit, (kn, vn), at.keep_from, reserve, meter)? {
            Placed::Streams => return Ok(InPlace::Streams),
            Placed::Demote => return Ok(InPlace::Demote),
            Placed::Appended => {}
        }
        let Some(kept) = self.view(unit, at)? else {
            let (b, nh, t, _) = q.dims4()?;
            // The queries' width: `vn` is stored (q8_0's rows are bytes of blocks).
            let d = q.dim(3)?;
            return Ok(InPlace::Attended(Partial::empty(b, nh, t, d, q.device())?));
        };
        Ok(InPlace::Attended(attend_partial(
            AttnInputs {
                q,
                k: &kept.k,
                v: &kept.v,
                q_pos: at.q_pos,
                k_pos: kept.k_pos,
            },
            at.spec,
        )?))
    }

    /// What resident `unit`'s buffer holds from `at.keep_from` on, with its first key's
    /// absolute position: what a step attends, and what the layers reading this one's cache
    /// read. `None` if it holds nothing there; an error if the unit streams.
    pub(crate) fn view(&self, unit: usize, at: &UnitAt<'_>) -> Result<Option<KeptView>> {
        let res = self
            .units
            .get(unit)
            .and_then(Option::as_ref)
            .ok_or_else(|| kvpolicy_core::KvError::invariant("a streamed unit has no view"))?;
        let start = at.keep_from.max(res.base());
        if start >= res.end() {
            return Ok(None);
        }
        let (k, v) = res.view(start, res.end())?;
        Ok(Some(KeptView {
            k,
            v,
            k_pos: start + at.base,
        }))
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
        // Demotions count since the last reset, across plans (a new head group plans again);
        // layers held by reference stay streamed.
        let (demotions, streamed) = (self.demotions, std::mem::take(&mut self.streamed_layers));
        self.clear();
        self.demotions = demotions;
        self.streamed_layers = streamed;
        self.planned = true;
        self.plan_cap = plan_cap;
        self.unit_bytes = shape.kv_bytes(group, plan_cap).max(1);
        self.remaining = avail;
        let groups = shape.n_kv_heads / group.max(1);
        self.groups = groups;
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
            let shared = self.groups > 0 && self.streamed_layers.contains(&(u / self.groups));
            let tokens = match self.preset.get(&u) {
                _ if shared => None,
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
            self.units.push(tokens.map(WindowKv::new));
        }
    }

    /// `layer`'s units stream from now on, whatever the budget (those not decided yet; the
    /// caller demotes those resident).
    pub(crate) fn stream_layer(&mut self, layer: usize) {
        self.streamed_layers.insert(layer);
    }

    /// Whether `unit` is decided (or planned) and resident.
    pub fn is_resident(&self, unit: usize) -> bool {
        match self.units.get(unit) {
            Some(u) => u.is_some(),
            None => self.preset.get(&unit).is_some_and(Option::is_some),
        }
    }

    /// Takes `unit` off the device for good, returning its buffer (counted as a demotion).
    pub(crate) fn demote(&mut self, unit: usize) -> Option<WindowKv> {
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

    /// Units demoted to the host since the last reset.
    pub fn demotions(&self) -> u64 {
        self.demotions
    }

    /// Forgets every unit and the plan (a new sequence plans again at its first step).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}
