//! Offloaded K/V with ping-pong device buffers: the runtime of layer-wise offload (FlexGen;
//! HF's offloaded cache), head-wise offload (HeadInfer §3.2) and `auto`.
//!
//! Every layer's keys and values live on the host tier ([`HostLayers`]). The device tier
//! holds two buffers ([`PingPong`]), each sized for one *unit* — a group of KV heads of one
//! layer at the current capacity. Units are visited in order (layer 0 group 0, layer 0
//! group 1, …, layer 1 group 0, …). While attention runs on a unit in one buffer, the next
//! unit's history is copied host→device into the other, and the unit's new entries are
//! copied device→host behind it ([`Link`]). A unit of all KV heads of a layer is layer-wise
//! offload; smaller units cut device memory by `kv_heads / group` more.
//!
//! Attention per unit is exact: heads are independent, and a unit's query heads are those
//! its KV heads serve under grouped-query attention. Per decode step the whole stored
//! history moves host→device once and only the step's new entries move back. With a sliding
//! window only the window's range moves.
use candle_core::{Device, Tensor};
use kvpolicy_core::KvRestore;
use kvpolicy_core::{
    attend_partial, round_up, AttnStep, DeviceMeter, HeadRange, KvError, KvPolicy, KvShape,
    KvStats, PolicyMetric, PolicyOptions, Result, TokenRange,
};
use kvpolicy_tiered::other_buffer;
use kvpolicy_tiered::READ_AHEAD;
use kvpolicy_tiered::{
    report_device, CopyJob, Direction, HostLayers, Link, Loaded, PingPong, TransferEngine,
};

use crate::resident::Residency;
use crate::settings::HeadGroup;

/// How KV heads are grouped into units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// One unit per layer (layer-wise offload).
    Layer,
    /// Units of KV heads (head-wise offload).
    Heads(HeadGroup),
    /// `auto`: as many units as the budget holds stay resident on the device, the rest
    /// stream in head groups (the group chosen as for `headwise:auto`).
    Resident,
}

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
struct StepAt {
    pos: usize,
    tokens: usize,
    layers: usize,
}

/// Offloaded KV with a ping-pong pair of device buffers (see the module docs).
pub struct OffloadPolicy {
    pub(crate) name: &'static str,
    pub(crate) grouping: Grouping,
    pub(crate) grow_tokens: usize,
    pub(crate) device: Device,
    pub(crate) link: Link,
    pub(crate) host: HostLayers,
    /// KV heads per unit (0 before the first step).
    pub(crate) group: usize,
    pingpong: PingPong<(Tensor, Tensor), UnitSpan>,
    /// `auto`'s resident units (`None` for `layer` and `headwise`).
    pub(crate) residency: Option<Residency>,
    pub(crate) meter: DeviceMeter,
    pub(crate) stats: KvStats,
}

impl std::fmt::Debug for OffloadPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadPolicy")
            .field("name", &self.name)
            .field("grouping", &self.grouping)
            .field("group", &self.group)
            .finish()
    }
}

impl OffloadPolicy {
    /// An offload policy registered as `name`, host tier in CPU memory.
    pub fn new(name: &'static str, grouping: Grouping, opts: &PolicyOptions) -> Result<Self> {
        Ok(Self {
            name,
            grouping,
            grow_tokens: opts.grow_tokens.max(1),
            device: opts.device.clone(),
            link: Link::for_device(&opts.device, opts.link_bandwidth)?,
            host: HostLayers::new(
                opts.grow_tokens,
                kvpolicy_tiered::DiskTier::from_options(opts, name)?,
            )
            .with_codec(opts.host_kv_dtype),
            group: 0,
            pingpong: PingPong::default(),
            residency: (grouping == Grouping::Resident).then(Residency::default),
            meter: DeviceMeter::new(opts.device_kv_budget),
            stats: KvStats::default(),
        })
    }

    /// Replaces the transfer engine (e.g. a synchronous or a fault-injecting one).
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.link = Link::new(engine);
        self
    }

    /// KV heads per unit now (0 before the first step).
    pub fn group_size(&self) -> usize {
        self.group
    }

    pub(crate) fn capacity_for(&self, tokens: usize) -> usize {
        round_up(tokens, self.grow_tokens)
    }

    /// Streaming buffers for `tokens` of history plus step (and the unit size for a
    /// `context` of that many tokens); under `auto` the first call plans the resident units.
    fn ensure_buffers(&mut self, shape: &KvShape, tokens: usize, context: usize) -> Result<()> {
        let cap = self.capacity_for(tokens);
        if cap <= self.pingpong.cap() && self.group != 0 {
            return Ok(());
        }
        let group = self.choose_group(shape, cap, context)?;
        if self.group == 0 {
            // The run's first step: plan the resident units for the capacity it will reach.
            let plan_cap = self.capacity_for(shape.max_tokens.max(tokens));
            let avail = self.resident_bytes(shape, group, plan_cap);
            if let Some(r) = self.residency.as_mut() {
                r.plan(shape, (group, self.grow_tokens), plan_cap, avail);
            }
        }
        if self.residency.as_ref().is_some_and(Residency::unbounded) {
            // No budget: every unit stays resident and nothing ever streams.
            self.group = group;
            return Ok(());
        }
        let pingpong = self.buffers_bytes(shape, group, cap);
        // The current streaming buffers (for `layer`/`headwise` all the meter holds; under
        // `auto` the meter also holds resident units).
        let old = if self.residency.is_some() {
            self.buffers_bytes(shape, self.group, self.pingpong.cap())
        } else {
            self.meter.current()
        };
        self.pingpong.release(&mut self.link)?;
        if self.residency.is_some() {
            // `auto`: the grown streaming buffers come first; resident units make room,
            // the last-decided first.
            self.make_room(shape, old, pingpong, (group, cap))?;
        }
        // The buffers are scratch (refilled from the host every step): free, then allocate.
        self.meter.free(old);
        let (stored, w) = self.host.stored(shape);
        let dims = (shape.batch, group, cap, w);
        let zeros = || Tensor::zeros(dims, stored, &self.device);
        let bufs = [(zeros()?, zeros()?), (zeros()?, zeros()?)];
        self.pingpong.install(&mut self.link, bufs, cap)?;
        self.meter.alloc(pingpong);
        self.group = group;
        Ok(())
    }

    /// Copy jobs bringing tokens `start..start+len` of head group `group` into buffer `buf`
    /// (from host memory, or read from the disk tier first).
    fn load_jobs(&mut self, span: UnitSpan, buf: usize) -> Result<Vec<CopyJob>> {
        let gs = self.group;
        let heads = HeadRange::new(span.unit.group * gs, gs);
        let (hk, hv) = self.host.history(span.unit.layer, heads, span.tokens)?;
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
    fn take_unit(&mut self, key: UnitSpan) -> Result<usize> {
        if let Some(p) = self.pingpong.take(&key, &mut self.link)? {
            for t in p.tickets {
                self.link.wait(t)?;
            }
            return Ok(p.buf);
        }
        if key.tokens.len > 0 {
            let jobs = self.load_jobs(key, 0)?;
            let t = self.link.submit(jobs, Direction::H2d)?;
            self.link.wait(t)?;
        }
        Ok(0)
    }

    /// The streamed unit after (layer, group) and the history it attends at `pos`, if
    /// that history is stored (resident units need no copy and are skipped). With `wrap`
    /// (the model's layers, the step's tokens), the unit after the last layer's is the next
    /// step's first, at `pos` + tokens.
    fn next_streamed(
        &self,
        from: Unit,
        groups: usize,
        mut pos: usize,
        wrap: Option<StepAt>,
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
        let mut n = next(from);
        let mut wrapped = false;
        loop {
            if let Some(step) = wrap {
                if n.layer >= step.layers && !wrapped {
                    n = Unit { layer: 0, group: 0 };
                    (pos, wrapped) = (pos + step.tokens, true);
                }
            }
            let resident = self.residency.as_ref();
            if !resident.is_some_and(|r| r.is_resident(n.layer * groups + n.group)) {
                break;
            }
            n = next(n);
        }
        let spec = self.host.ready(n.layer, pos)?;
        let start = spec.window_start(pos);
        (pos > start).then_some(UnitSpan {
            unit: n,
            tokens: TokenRange::new(start, pos - start),
        })
    }

    /// Starts copying the streamed unit after (layer, group) into buffer `buf`, and — for
    /// layers on disk — reading the [`READ_AHEAD`] streamed units after that one from disk,
    /// into the next step's first units once this step's are all read: disk → host →
    /// device, each stage ahead of the compute. (The copy stays within the step: its bytes
    /// are counted, and a step that never comes would have moved them for nothing.)
    fn prefetch_next(&mut self, unit: Unit, groups: usize, step: StepAt, buf: usize) -> Result<()> {
        let copied = self.next_streamed(unit, groups, step.pos, None);
        if let Some(key) = copied {
            let jobs = self.load_jobs(key, buf)?;
            let ticket = self.link.submit(jobs, Direction::H2d)?;
            self.pingpong.set_prefetched(Loaded {
                key,
                buf,
                tickets: [ticket, None],
            });
        }
        let (mut at, mut at_pos, gs) = (unit, step.pos, self.group);
        for _ in 0..=READ_AHEAD {
            let Some(key) = self.next_streamed(at, groups, at_pos, Some(step)) else {
                break;
            };
            (at, at_pos) = (key.unit, key.tokens.end());
            if Some(key) != copied {
                let heads = HeadRange::new(key.unit.group * gs, gs);
                self.host.read_ahead(key.unit.layer, heads, key.tokens)?;
            }
        }
        Ok(())
    }
}

impl KvPolicy for OffloadPolicy {
    fn name(&self) -> &str {
        self.name
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        let cap = self.capacity_for(shape.max_tokens);
        self.choose_group(shape, cap, shape.max_tokens)?;
        self.host.set_shape(shape);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let shape = self.host.shape_for(step)?;
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        self.host.begin(&mut self.link, step, &shape)?;
        let start = step.spec.window_start(pos);
        let hist = pos - start;
        // Buffers for the widest history of any layer at this position: grown at the step's
        // first layer, not in the middle of it, where growing would discard the prefetch.
        let widest = self.host.widest_history(pos, hist);
        self.ensure_buffers(&shape, widest + t, pos + t)?;
        let gs = self.group;
        let groups = shape.n_kv_heads / gs;
        let q_per_group = gs * step.spec.group_size();
        // What a resident unit's growth must leave free, and the step's activations.
        let reserve = shape.step_scratch_bytes(gs, widest + t, &self.device);
        let act = shape.activation_bytes(t);
        let mut outs = Vec::with_capacity(groups);
        for g in 0..groups {
            let kn = step.k.narrow(1, g * gs, gs)?.contiguous()?;
            let vn = step.v.narrow(1, g * gs, gs)?.contiguous()?;
            let q = step.q.narrow(1, g * q_per_group, q_per_group)?;
            let unit = layer * groups + g;
            if let Some(r) = self.residency.as_mut() {
                r.decide(unit, self.grow_tokens);
            }
            if let Some(out) = self.attend_resident(unit, (&q, &kn, &vn), step, reserve, act)? {
                outs.push(out);
                continue;
            }
            let here = Unit { layer, group: g };
            let buf = self.take_unit(UnitSpan {
                unit: here,
                tokens: TokenRange::new(start, hist),
            })?;
            let at = StepAt {
                pos,
                tokens: t,
                layers: shape.n_layers,
            };
            self.prefetch_next(here, groups, at, other_buffer(buf))?;
            let (kb, vb) = self.pingpong.buf(buf)?;
            let (k, v, expanded) = if kb.dtype() == kn.dtype() {
                kb.slice_set(&kn, 2, hist)?;
                vb.slice_set(&vn, 2, hist)?;
                (kb.narrow(2, 0, hist + t)?, vb.narrow(2, 0, hist + t)?, 0)
            } else {
                // LOSSY host form: decode the history, then append the step's exact K/V.
                let (codec, d) = (self.host.codec(), shape.head_dim);
                let wide = |b: &Tensor, n: &Tensor| -> Result<Tensor> {
                    let h = codec.decode(&b.narrow(2, 0, hist)?, n.dtype(), d)?;
                    Ok(Tensor::cat(&[&h, n], 2)?)
                };
                let (k, v) = (wide(&kb, &kn)?, wide(&vb, &vn)?);
                let bytes = 2 * (k.elem_count() * k.dtype().size_in_bytes()) as u64;
                (k, v, bytes)
            };
            let part = attend_partial(&q, &k, &v, pos, start, step.spec)?;
            self.stats.note_scratch(part.scratch_bytes + expanded, act);
            outs.push(part.out.to_dtype(q.dtype())?);
            // Write the unit's new entries back to the host tier behind the compute.
            self.host
                .write(&mut self.link, layer, (&kn, &vn), g * gs, pos)?;
        }
        self.host.advance(layer, t);
        Ok(if outs.len() == 1 {
            outs.swap_remove(0)
        } else {
            Tensor::cat(&outs, 1)?
        })
    }

    fn seq_len(&self) -> usize {
        self.host.seq_len()
    }

    fn reset(&mut self) {
        self.link.reset();
        self.host.clear(&mut self.link);
        self.pingpong.clear();
        self.group = 0;
        if let Some(r) = self.residency.as_mut() {
            r.clear();
        }
        self.meter.reset();
        self.stats = KvStats::default();
    }

    fn stats(&self) -> KvStats {
        let r = self.residency.as_ref();
        let mut stats = KvStats {
            kv_tokens: self.seq_len() as u64,
            ..self.stats.clone()
        };
        if let Some(r) = r {
            stats.set_metric(PolicyMetric::gauge(
                "resident_units",
                r.resident() as f64,
                "units",
            ));
            stats.set_metric(PolicyMetric::gauge(
                "streamed_units",
                r.streamed() as f64,
                "units",
            ));
            stats.set_metric(PolicyMetric::counter(
                "demotions",
                r.demotions as f64,
                "units",
            ));
        }
        self.link
            .report(report_device(&self.meter, self.host.report(stats)))
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }
}

impl KvRestore for OffloadPolicy {
    /// The step's K/V go to the host tier (RAM or disk) as `attend` writes them back;
    /// `auto` places units as they attend, so it refuses.
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        if self.residency.is_some() {
            return Err(KvError::Unsupported(format!(
                "`{}` places each unit on the device or the host as it attends, so it takes \
                 no K/V without attention (append_kv); `layer` and `headwise` do",
                self.name
            )));
        }
        let shape = self.host.shape_for(step)?;
        self.host.begin(&mut self.link, step, &shape)?;
        self.host
            .write(&mut self.link, step.layer, (step.k, step.v), 0, step.pos)?;
        self.host.advance(step.layer, step.k.dim(2)?);
        Ok(())
    }
}
