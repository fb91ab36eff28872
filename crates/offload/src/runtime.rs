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
use kvpolicy_core::{
    attend_partial, report_device, round_up, AttnStep, CopyJob, DeviceMeter, Direction, HeadGroup,
    HostLayers, KvPolicy, KvShape, KvStats, Link, Loaded, PingPong, PolicyOptions, Result,
    TransferEngine,
};

use crate::resident::Residency;

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

/// What a ping-pong buffer holds: (layer, head group, first token, tokens).
type UnitKey = (usize, usize, usize, usize);

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
    pingpong: PingPong<(Tensor, Tensor), UnitKey>,
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
            host: HostLayers::new(opts.grow_tokens, opts.disk_tier(name)?)
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
    fn load_jobs(
        &mut self,
        (layer, group, start, len): UnitKey,
        buf: usize,
    ) -> Result<Vec<CopyJob>> {
        let gs = self.group;
        let (hk, hv) = self.host.history(layer, (group * gs, gs), start, len)?;
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
    fn take_unit(&mut self, key: UnitKey) -> Result<usize> {
        if let Some(p) = self.pingpong.take(&key, &mut self.link)? {
            for t in p.tickets {
                self.link.wait(t)?;
            }
            return Ok(p.buf);
        }
        if key.3 > 0 {
            let jobs = self.load_jobs(key, 0)?;
            let t = self.link.submit(jobs, Direction::H2d)?;
            self.link.wait(t)?;
        }
        Ok(0)
    }

    /// The streamed unit after (layer, group) and the history it attends at `pos`, if
    /// that history is stored (resident units need no copy and are skipped).
    fn next_streamed(
        &self,
        (layer, group): (usize, usize),
        groups: usize,
        pos: usize,
    ) -> Option<UnitKey> {
        let next = |l: usize, g: usize| {
            if g + 1 < groups {
                (l, g + 1)
            } else {
                (l + 1, 0)
            }
        };
        let (mut nl, mut ng) = next(layer, group);
        while self
            .residency
            .as_ref()
            .is_some_and(|r| r.is_resident(nl * groups + ng))
        {
            (nl, ng) = next(nl, ng);
        }
        let spec = self.host.ready(nl, pos)?;
        let start = spec.window_start(pos);
        (pos > start).then_some((nl, ng, start, pos - start))
    }

    /// Starts copying the streamed unit after (layer, group) into buffer `buf`, and — for a
    /// layer on disk — reading the one after it from disk: disk → host → device, each stage
    /// a unit ahead of the compute.
    fn prefetch_next(
        &mut self,
        unit: (usize, usize),
        groups: usize,
        pos: usize,
        buf: usize,
    ) -> Result<()> {
        let Some(key) = self.next_streamed(unit, groups, pos) else {
            return Ok(());
        };
        let jobs = self.load_jobs(key, buf)?;
        let ticket = self.link.submit(jobs, Direction::H2d)?;
        self.pingpong.set_prefetched(Loaded {
            key,
            buf,
            tickets: [ticket, None],
        });
        if let Some((l, g, start, len)) = self.next_streamed((key.0, key.1), groups, pos) {
            let gs = self.group;
            self.host.read_ahead(l, (g * gs, gs), start, len)?;
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
            let buf = self.take_unit((layer, g, start, hist))?;
            self.prefetch_next((layer, g), groups, pos, 1 - buf)?;
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
        let stats = KvStats {
            kv_tokens: self.seq_len() as u64,
            resident_units: r.map_or(0, |r| r.resident() as u64),
            streamed_units: r.map_or(0, |r| r.streamed() as u64),
            demotions: r.map_or(0, |r| r.demotions),
            ..self.stats.clone()
        };
        self.link
            .report(report_device(&self.meter, self.host.report(stats)))
    }
}
