//! The streamed side of the offload runtime ([`Streaming`]): two device buffers
//! ([`PingPong`]) each sized for one *unit* — a group of KV heads of one layer at the
//! current capacity — visited in order (layer 0 group 0, layer 0 group 1, …, layer 1
//! group 0, …). While a unit attends in one buffer, the next streamed unit's history is
//! copied host→device into the other (HeadInfer §3.2's ping-pong), and — for layers on the
//! disk tier — the few streamed units after it are read from disk ahead (disk → host →
//! device). `auto`'s resident units need no copy and are skipped.
use candle_core::Tensor;
use kvpolicy_core::{HeadRange, Result, TokenRange};
use kvpolicy_tiered::READ_AHEAD;
use kvpolicy_tiered::{other_buffer, CopyJob, Direction, HostLayers, Link, Loaded, PingPong};

use crate::resident::Residency;

/// One (layer, head group) unit: the piece of the cache the runtime streams or keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// Where a step stands: its first position, its tokens, and the model's layers (for a
/// prefetch that wraps into the next step).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepAt {
    pos: usize,
    tokens: usize,
    layers: usize,
}

impl StepAt {
    /// A step of `tokens` tokens from position `pos` on, in a model of `layers` layers.
    pub(crate) fn new(pos: usize, tokens: usize, layers: usize) -> Self {
        Self {
            pos,
            tokens,
            layers,
        }
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

/// The ping-pong pair and the unit size (module docs).
#[derive(Debug, Default)]
pub(crate) struct Streaming {
    /// KV heads per unit (0 before the first step).
    group: usize,
    pingpong: PingPong<(Tensor, Tensor), UnitSpan>,
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
        self.pingpong.cap()
    }

    /// Frees the buffers once the copies using them have landed.
    pub(crate) fn release(&mut self, link: &mut Link) -> Result<()> {
        self.pingpong.release(link)
    }

    /// Replaces the buffers with `bufs` of `cap` tokens.
    pub(crate) fn install(
        &mut self,
        link: &mut Link,
        bufs: [(Tensor, Tensor); 2],
        cap: usize,
    ) -> Result<()> {
        self.pingpong.install(link, bufs, cap)
    }

    /// Forgets the buffers, the prefetch and the unit size (after a [`Link::reset`]).
    pub(crate) fn clear(&mut self) {
        self.pingpong.clear();
        self.group = 0;
    }

    /// Brings unit (`layer`, `group`) of `groups` per layer, its history `history`, into a
    /// buffer (its prefetch, or a copy now), and starts the next streamed unit's copy into
    /// the other and the disk reads after it (`at`: the step; units `residency` keeps are
    /// skipped). Returns the buffer's K and V, the history in front.
    pub(crate) fn unit_buffers(
        &mut self,
        (host, link): (&mut HostLayers, &mut Link),
        residency: Option<&Residency>,
        (layer, group): (usize, usize),
        groups: usize,
        history: TokenRange,
        at: StepAt,
    ) -> Result<(Tensor, Tensor)> {
        let here = Unit { layer, group };
        let key = UnitSpan {
            unit: here,
            tokens: history,
        };
        let buf = self.take_unit((&mut *host, &mut *link), key)?;
        self.prefetch_next((host, link), residency, here, groups, at, other_buffer(buf))?;
        self.pingpong.buf(buf)
    }

    /// Copy jobs bringing `span`'s history into buffer `buf` (from host memory, or read
    /// from the disk tier first).
    fn load_jobs(&self, host: &mut HostLayers, span: UnitSpan, buf: usize) -> Result<Vec<CopyJob>> {
        let gs = self.group;
        let heads = HeadRange::new(span.unit.group * gs, gs);
        let (hk, hv) = host.history(span.unit.layer, heads, span.tokens)?;
        let (kb, vb) = self.pingpong.buf(buf)?;
        let batch = kb.dim(0)?;
        let mut jobs = Vec::with_capacity(2 * batch * gs);
        for bi in 0..batch {
            for j in 0..gs {
                for (src, dst) in [(&hk, &kb), (&hv, &vb)] {
                    jobs.push(CopyJob {
                        src: src.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                        dst: dst.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                        dim: 2,
                        offset: 0,
                    });
                }
            }
        }
        Ok(jobs)
    }

    /// Makes the unit's history resident; returns its buffer.
    fn take_unit(
        &mut self,
        (host, link): (&mut HostLayers, &mut Link),
        key: UnitSpan,
    ) -> Result<usize> {
        if let Some(p) = self.pingpong.take(&key, link)? {
            for t in p.tickets {
                link.wait(t)?;
            }
            return Ok(p.buf);
        }
        if key.tokens.len > 0 {
            let jobs = self.load_jobs(host, key, 0)?;
            let t = link.submit(jobs, Direction::H2d)?;
            link.wait(t)?;
        }
        Ok(0)
    }

    /// Starts copying the streamed unit after `unit` into buffer `buf`, and — for layers on
    /// disk — reading the [`READ_AHEAD`] streamed units after that one from disk, into the
    /// next step's first units once this step's are all read: disk → host → device, each
    /// stage ahead of the compute. (The copy stays within the step: its bytes are counted,
    /// and a step that never comes would have moved them for nothing.)
    fn prefetch_next(
        &mut self,
        (host, link): (&mut HostLayers, &mut Link),
        residency: Option<&Residency>,
        unit: Unit,
        groups: usize,
        step: StepAt,
        buf: usize,
    ) -> Result<()> {
        let copied = unit.next_streamed(groups, step.pos, None, host, residency);
        if let Some(key) = copied {
            let jobs = self.load_jobs(host, key, buf)?;
            let ticket = link.submit(jobs, Direction::H2d)?;
            self.pingpong.set_prefetched(Loaded {
                key,
                buf,
                tickets: [ticket, None],
            });
        }
        let (mut at, mut at_pos, gs) = (unit, step.pos, self.group);
        for _ in 0..=READ_AHEAD {
            let Some(key) = at.next_streamed(groups, at_pos, Some(step), host, residency) else {
                break;
            };
            (at, at_pos) = (key.unit, key.tokens.end());
            if Some(key) != copied {
                let heads = HeadRange::new(key.unit.group * gs, gs);
                host.read_ahead(key.unit.layer, heads, key.tokens)?;
            }
        }
        Ok(())
    }
}
