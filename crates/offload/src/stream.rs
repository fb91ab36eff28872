//! The streamed side of the offload runtime ([`Streaming`]): two device buffers each sized
//! for one *unit* — a group of KV heads of one layer at the current capacity — and the
//! units visited in order (layer 0 group 0, layer 0 group 1, …, layer 1 group 0, …). While
//! a unit attends, the streamed units after it are copied host→device into the room the
//! buffers have left ([`Staging`]: HeadInfer §3.2's ping-pong, run as far ahead as the two
//! buffers allow, so the link goes from one copy to the next), and — for layers on the disk
//! tier — the few streamed units after those are read from disk ahead (disk → host →
//! device). `auto`'s resident units need no copy and are skipped.
use candle_core::Tensor;
use kvpolicy_core::{HeadRange, Result, TokenRange};
use kvpolicy_tiered::READ_AHEAD;
use kvpolicy_tiered::{CopyJob, Direction, HostLayers, Link};

use crate::resident::Residency;
use crate::staging::{Place, Staging};

/// One (layer, head group) unit: the piece of the cache the runtime streams or keeps,
/// ordered as a step visits them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Unit {
    layer: usize,
    group: usize,
}

/// What a ping-pong buffer holds: a unit's history of `tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UnitSpan {
    unit: Unit,
    tokens: TokenRange,
}

/// Where a step stands: its first position, its tokens, the model's layers (for a
/// prefetch that wraps into the next step), and whether units may be staged for the next
/// step now.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepAt {
    pos: usize,
    tokens: usize,
    layers: usize,
    stage_next: bool,
}

impl StepAt {
    /// A step of `tokens` tokens from position `pos` on, in a model of `layers` layers;
    /// `stage_next`: a next step of as many tokens is expected and fits the buffers as they
    /// are (one that grows them would drop what was staged, its bytes moved for nothing).
    pub(crate) fn new(pos: usize, tokens: usize, layers: usize, stage_next: bool) -> Self {
        Self {
            pos,
            tokens,
            layers,
            stage_next,
        }
    }

    /// Where the next step starts, if units may be staged for it.
    fn next(&self) -> Option<usize> {
        self.stage_next.then_some(self.pos + self.tokens)
    }
}

impl Unit {
    /// The streamed unit after this one and the history it attends at `pos`, if that
    /// history is stored in `host` (units `residency` keeps resident need no copy and are
    /// skipped); `groups` units per layer. With `wrap` (the model's layers, the step's
    /// tokens), the unit after the last layer's is the next step's first, at `pos` +
    /// tokens.
    fn next_streamed(
        self,
        groups: usize,
        mut pos: usize,
        wrap: Option<StepAt>,
        host: &HostLayers,
        residency: Option<&Residency>,
    ) -> Option<UnitSpan> {
        let next = |u: Unit| {
            if u.group + 1 < groups {
                Unit {
                    group: u.group + 1,
                    ..u
                }
            } else {
                Unit {
                    layer: u.layer + 1,
                    group: 0,
                }
            }
        };
        let mut n = next(self);
        let mut wrapped = false;
        loop {
            if let Some(step) = wrap {
                if n.layer >= step.layers && !wrapped {
                    n = Unit { layer: 0, group: 0 };
                    (pos, wrapped) = (pos + step.tokens, true);
                }
            }
            if !residency.is_some_and(|r| r.is_resident(n.layer * groups + n.group)) {
                break;
            }
            n = next(n);
        }
        let spec = host.ready(n.layer, pos)?;
        let start = spec.window_start(pos);
        (pos > start).then_some(UnitSpan {
            unit: n,
            tokens: TokenRange::new(start, pos - start),
        })
    }
}

/// A streamed unit's buffers: K and V `(b, group, cap, width)`, its history at tokens
/// `offset..offset + history`, the step's tokens to be written right after.
#[derive(Debug)]
pub(crate) struct UnitBuffers {
    /// Keys.
    pub(crate) k: Tensor,
    /// Values.
    pub(crate) v: Tensor,
    /// Where the unit starts along the token axis.
    pub(crate) offset: usize,
}

/// The staging buffers and the unit size (module docs).
#[derive(Debug, Default)]
pub(crate) struct Streaming {
    /// KV heads per unit (0 before the first step).
    group: usize,
    staging: Staging<UnitSpan>,
}

impl Streaming {
    /// KV heads per unit now (0 before the first step).
    pub(crate) fn group(&self) -> usize {
        self.group
    }

    /// Sets the KV heads per unit.
    pub(crate) fn set_group(&mut self, group: usize) {
        self.group = group;
    }

    /// Tokens the buffers hold (0 before any are installed).
    pub(crate) fn cap(&self) -> usize {
        self.staging.cap()
    }

    /// Frees the buffers once the copies using them have landed.
    pub(crate) fn release(&mut self, link: &mut Link) -> Result<()> {
        self.staging.release(link)
    }

    /// Replaces the buffers with `bufs` of `cap` tokens.
    pub(crate) fn install(
        &mut self,
        link: &mut Link,
        bufs: [(Tensor, Tensor); 2],
        cap: usize,
    ) -> Result<()> {
        self.staging.install(link, bufs, cap)
    }

    /// Forgets the buffers, what was staged and the unit size (after a [`Link::reset`]).
    pub(crate) fn clear(&mut self) {
        self.staging.clear();
        self.group = 0;
    }

    /// Brings unit (`layer`, `group`) of `groups` per layer, its history `history`, into
    /// the buffers (staged ahead, or copied now), and stages the streamed units after it
    /// while the buffers have room, then starts the disk reads after those (`at`: the step;
    /// units `residency` keeps are skipped). Returns where the unit is.
    pub(crate) fn unit_buffers(
        &mut self,
        (host, link): (&mut HostLayers, &mut Link),
        residency: Option<&Residency>,
        (layer, group): (usize, usize),
        groups: usize,
        history: TokenRange,
        at: StepAt,
    ) -> Result<UnitBuffers> {
        let here = Unit { layer, group };
        let key = UnitSpan {
            unit: here,
            tokens: history,
        };
        // The unit before this one has been attended.
        self.staging.finish_current();
        let (place, landing) = match self.staging.take(&key, key.tokens.len + at.tokens, link)? {
            Some(t) => {
                // Staged during the step before: its bytes count in the step that uses them.
                link.count(t.uncounted, Direction::H2d);
                (t.place, t.tickets)
            }
            None => {
                let place = self.place_for(key, at)?;
                let ticket = if key.tokens.len > 0 {
                    let jobs = self.load_jobs(host, key, place)?;
                    link.submit(jobs, Direction::H2d)?
                } else {
                    None
                };
                (place, [ticket, None])
            }
        };
        self.staging.hold(place);
        // The next units' copies are queued before this one's is waited for: the link goes
        // from one copy to the next without waiting for the compute thread to wake.
        self.stage_ahead((&mut *host, &mut *link), residency, here, groups, at)?;
        for t in landing {
            link.wait(t)?;
        }
        let (k, v) = self.staging.buffers(place)?;
        Ok(UnitBuffers {
            k,
            v,
            offset: place.offset(),
        })
    }

    /// Unit (`layer`, `group`) has been attended and its new entries queued back: its place
    /// is free, so the streamed units after the last staged one are staged into it now —
    /// before the compute between units (the MLP, the next layer's projections; at the
    /// step's end the LM head and sampling) rather than after it.
    pub(crate) fn done(
        &mut self,
        io: (&mut HostLayers, &mut Link),
        residency: Option<&Residency>,
        (layer, group): (usize, usize),
        groups: usize,
        at: StepAt,
    ) -> Result<()> {
        self.staging.finish_current();
        self.stage_ahead(io, residency, Unit { layer, group }, groups, at)
    }

    /// A place for `key`'s history and the step's tokens.
    fn place_for(&self, key: UnitSpan, at: StepAt) -> Result<Place> {
        self.staging
            .place_for(key.tokens.len + at.tokens)
            .ok_or_else(|| {
                kvpolicy_core::KvError::invariant(format!(
                    "a unit of {} tokens does not fit the staging buffers of {}",
                    key.tokens.len + at.tokens,
                    self.staging.cap()
                ))
            })
    }

    /// Copy jobs bringing `span`'s history into `place` (from host memory — its own store
    /// and the runs it holds by reference, each piece to its place — or read from the disk
    /// tier first).
    fn load_jobs(
        &self,
        host: &mut HostLayers,
        span: UnitSpan,
        place: Place,
    ) -> Result<Vec<CopyJob>> {
        let gs = self.group;
        let heads = HeadRange::new(span.unit.group * gs, gs);
        let pieces = host.history_pieces(span.unit.layer, heads, span.tokens)?;
        let (kb, vb) = self.staging.buffers(place)?;
        let batch = kb.dim(0)?;
        let mut jobs = Vec::with_capacity(2 * batch * gs * pieces.len());
        for p in &pieces {
            for bi in 0..batch {
                for j in 0..gs {
                    for (src, dst) in [(&p.k, &kb), (&p.v, &vb)] {
                        jobs.push(CopyJob {
                            src: src.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                            dst: dst.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                            dim: 2,
                            offset: place.offset() + p.at,
                        });
                    }
                }
            }
        }
        Ok(jobs)
    }

    /// Stages the streamed units after `unit` while the buffers have room — into the next
    /// step's first units once this step's are all staged, as far as their layers are
    /// already written for it (so the link does not idle across the step's end: the LM
    /// head, sampling, the next step's first projections); for layers on the disk tier one
    /// unit ahead only, since their history is read on this thread — and then reads the
    /// [`READ_AHEAD`] streamed units after the last staged one from disk, into the next
    /// step's first units once this step's are all read: disk → host → device, each stage
    /// ahead of the compute. A unit staged for the next step is counted in that step; one
    /// that a run never takes (a sampled run stopped early at an end-of-sequence token)
    /// moved over the link uncounted.
    fn stage_ahead(
        &mut self,
        (host, link): (&mut HostLayers, &mut Link),
        residency: Option<&Residency>,
        unit: Unit,
        groups: usize,
        step: StepAt,
    ) -> Result<()> {
        let (mut last, mut last_pos) = self
            .staging
            .last_staged()
            .map_or((unit, step.pos), |k| (k.unit, k.tokens.end()));
        let wrap = step.next().map(|_| step);
        while let Some(key) = last.next_streamed(groups, last_pos, wrap, host, residency) {
            let next_step = key.tokens.end() > step.pos;
            // The next step's units whose layers this step has written (`ready` only
            // yields those), and no further than that step.
            if next_step && (key.unit >= unit || Some(key.tokens.end()) != step.next()) {
                break;
            }
            let on_disk = host.ram(key.unit.layer).is_none();
            if on_disk && self.staging.staged() > 0 {
                break;
            }
            let Some(place) = self.staging.place_for(key.tokens.len + step.tokens) else {
                break;
            };
            let jobs = self.load_jobs(host, key, place)?;
            let (ticket, uncounted) = if next_step {
                link.submit_uncounted(jobs)?
            } else {
                (link.submit(jobs, Direction::H2d)?, 0)
            };
            self.staging.stage(key, place, [ticket, None], uncounted);
            (last, last_pos) = (key.unit, key.tokens.end());
        }
        let (mut at, mut at_pos, gs) = (last, last_pos, self.group);
        for _ in 0..READ_AHEAD {
            let Some(key) = at.next_streamed(groups, at_pos, Some(step), host, residency) else {
                break;
            };
            (at, at_pos) = (key.unit, key.tokens.end());
            if !self.staging.is_staged(&key) {
                let heads = HeadRange::new(key.unit.group * gs, gs);
                host.read_ahead(key.unit.layer, heads, key.tokens)?;
            }
        }
        Ok(())
    }
}
