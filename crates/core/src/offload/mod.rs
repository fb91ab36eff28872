//! Offloaded K/V with ping-pong device buffers: the machinery shared by layer-wise offload
//! (FlexGen; HF's offloaded cache) and head-wise offload (HeadInfer §3.2).
//!
//! Every layer's keys and values live on the host tier in preallocated `(b, kv_heads, cap,
//! head_dim)` buffers that grow in large chunks, so one KV head's tokens are one contiguous
//! range. The device tier holds only two buffers, each sized for one *unit* — a group of
//! KV heads of one layer at the current capacity. Units are visited in order (layer 0 group
//! 0, layer 0 group 1, …, layer 1 group 0, …). While attention runs on a unit in one buffer,
//! the next unit's history is copied host→device into the other buffer, and the unit's new
//! entries are copied device→host behind it. A unit of all KV heads of a layer is layer-wise
//! offload; smaller units cut device memory by `kv_heads / group` more.
//!
//! Attention per unit is exact: heads are independent, and a unit's query heads are those
//! its KV heads serve under grouped-query attention. Per decode step the whole stored
//! history moves host→device once and only the step's new entries move back. With a sliding
//! window only the window's range moves.
use candle_core::{Device, Tensor};

use crate::attention::{attend_partial, AttnSpec};
use crate::buffer::round_up;
use crate::error::{KvError, Result};
use crate::policy::{AttnStep, KvPolicy, KvShape};
use crate::registry::{HeadGroup, PolicyOptions};
use crate::stats::{DeviceMeter, KvStats};
use crate::transfer::{engine_for, grown_host, CopyJob, Ticket, TransferEngine};

mod plan;
mod resident;

pub use plan::AUTO_ALL_HEADS_BELOW;
use resident::Residency;

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

#[derive(Debug)]
struct HostLayer {
    k: Tensor,
    v: Tensor,
    cap: usize,
}

#[derive(Debug, Clone, Copy)]
struct Prefetch {
    layer: usize,
    group: usize,
    buf: usize,
    start: usize,
    len: usize,
    ticket: Ticket,
}

/// Offloaded KV with a ping-pong pair of device buffers (see the module docs).
pub struct OffloadPolicy {
    name: &'static str,
    grouping: Grouping,
    grow_tokens: usize,
    device: Device,
    engine: Box<dyn TransferEngine>,
    /// `engine.copy_seconds()` at the last reset (stats count from there).
    copy_base: f64,
    shape: Option<KvShape>,
    layers: Vec<Option<HostLayer>>,
    lens: Vec<usize>,
    specs: Vec<Option<AttnSpec>>,
    group: usize,
    bufs: [Option<(Tensor, Tensor)>; 2],
    buf_cap: usize,
    prefetched: Option<Prefetch>,
    /// `auto`'s resident units (`None` for `layer` and `headwise`).
    residency: Option<Residency>,
    meter: DeviceMeter,
    stats: KvStats,
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

/// Copy jobs writing a unit's K/V `(b, heads, t, d)` into the host layer's heads from
/// `first_head` on, at token `offset`.
fn write_back_jobs(
    (k, v): (&Tensor, &Tensor),
    host: &HostLayer,
    first_head: usize,
    offset: usize,
) -> Result<Vec<CopyJob>> {
    let (batch, heads) = (k.dim(0)?, k.dim(1)?);
    let mut jobs = Vec::with_capacity(2 * batch * heads);
    for bi in 0..batch {
        for j in 0..heads {
            for (src, dst) in [(k, &host.k), (v, &host.v)] {
                jobs.push(CopyJob {
                    src: src.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                    dst: dst.narrow(0, bi, 1)?.narrow(1, first_head + j, 1)?,
                    dim: 2,
                    offset,
                });
            }
        }
    }
    Ok(jobs)
}

impl OffloadPolicy {
    /// An offload policy registered as `name`, host tier in CPU memory.
    pub fn new(name: &'static str, grouping: Grouping, opts: &PolicyOptions) -> Result<Self> {
        Ok(Self {
            name,
            grouping,
            grow_tokens: opts.grow_tokens.max(1),
            device: opts.device.clone(),
            engine: engine_for(&opts.device, opts.link_bandwidth)?,
            copy_base: 0.0,
            shape: None,
            layers: Vec::new(),
            lens: Vec::new(),
            specs: Vec::new(),
            group: 0,
            bufs: [None, None],
            buf_cap: 0,
            prefetched: None,
            residency: (grouping == Grouping::Resident).then(Residency::default),
            meter: DeviceMeter::new(opts.device_kv_budget),
            stats: KvStats::default(),
        })
    }

    /// Replaces the transfer engine (e.g. a synchronous or a fault-injecting one).
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.copy_base = engine.copy_seconds();
        self.engine = engine;
        self
    }

    /// KV heads per unit now (0 before the first step).
    pub fn group_size(&self) -> usize {
        self.group
    }

    fn capacity_for(&self, tokens: usize) -> usize {
        round_up(tokens, self.grow_tokens)
    }

    fn bad_option(&self, message: String) -> KvError {
        KvError::InvalidOption {
            policy: self.name.to_string(),
            message,
        }
    }

    fn ensure_buffers(&mut self, shape: &KvShape, tokens: usize, context: usize) -> Result<()> {
        let cap = self.capacity_for(tokens);
        if cap <= self.buf_cap && self.group != 0 {
            return Ok(());
        }
        let group = self.choose_group(shape, cap, context)?;
        if self.group == 0 {
            // The run's first step: plan the resident units for the capacity it will reach.
            let plan_cap = self.capacity_for(shape.max_tokens.max(tokens));
            let target = self.resident_target(shape, group, plan_cap);
            if let Some(r) = self.residency.as_mut() {
                r.target = target;
                r.plan_cap = plan_cap;
            }
        }
        if self
            .residency
            .as_ref()
            .is_some_and(|r| r.target == usize::MAX)
        {
            // No budget: every unit stays resident and nothing ever streams.
            self.group = group;
            self.buf_cap = cap;
            return Ok(());
        }
        self.stats.transfer_wait_s += self.engine.wait_all()?;
        self.prefetched = None;
        let pingpong = Self::buffers_bytes(shape, group, cap);
        // The current streaming buffers (for `layer`/`headwise` all the meter holds; under
        // `auto` the meter also holds resident units).
        let old = if self.residency.is_some() {
            Self::buffers_bytes(shape, self.group, self.buf_cap)
        } else {
            self.meter.current()
        };
        if let (Some(budget), Some(_)) = (self.meter.budget(), &self.residency) {
            // `auto`: the grown streaming buffers come first; resident units make room,
            // the last-decided first.
            let scratch = shape.step_scratch_bytes(group, cap, &self.device);
            while self.meter.current() - old.min(self.meter.current()) + pingpong + scratch > budget
            {
                let Some(unit) = self.residency.as_ref().and_then(Residency::last_resident) else {
                    break;
                };
                let groups = shape.n_kv_heads / self.group.max(1);
                self.demote(unit, unit / groups, unit % groups, self.group)?;
            }
        }
        // The buffers are scratch (refilled from the host every step): free, then allocate.
        self.meter.free(old);
        self.bufs = [None, None];
        let dims = (shape.batch, group, cap, shape.head_dim);
        for b in self.bufs.iter_mut() {
            *b = Some((
                Tensor::zeros(dims, shape.dtype, &self.device)?,
                Tensor::zeros(dims, shape.dtype, &self.device)?,
            ));
        }
        self.meter.alloc(pingpong);
        self.buf_cap = cap;
        self.group = group;
        Ok(())
    }

    fn ensure_host(&mut self, layer: usize, shape: &KvShape, tokens: usize) -> Result<()> {
        while self.layers.len() <= layer {
            self.layers.push(None);
            self.lens.push(0);
            self.specs.push(None);
        }
        let have = self.layers[layer].as_ref().map(|h| h.cap).unwrap_or(0);
        if tokens <= have {
            return Ok(());
        }
        // Pending write-backs target the old buffers: let them land before copying. A
        // completed prefetch stays valid: it copied from the old buffers' unchanged prefix.
        self.stats.transfer_wait_s += self.engine.wait_all()?;
        // Host storage grows in large chunks (8× the device growth step).
        let cap = round_up(tokens, self.grow_tokens * 8);
        let dims = (shape.batch, shape.n_kv_heads, cap, shape.head_dim);
        let old = self.layers[layer].take();
        let engine = self.engine.as_mut();
        let k = grown_host(engine, old.as_ref().map(|o| &o.k), dims, 2, shape.dtype)?;
        let v = grown_host(engine, old.as_ref().map(|o| &o.v), dims, 2, shape.dtype)?;
        self.layers[layer] = Some(HostLayer { k, v, cap });
        Ok(())
    }

    /// Copy jobs bringing tokens `start..start+len` of `group` into buffer `buf`.
    fn load_jobs(
        &self,
        layer: usize,
        group: usize,
        buf: usize,
        start: usize,
        len: usize,
    ) -> Result<Vec<CopyJob>> {
        let (Some(Some(host)), Some((kb, vb))) = (self.layers.get(layer), &self.bufs[buf]) else {
            return Err(KvError::Step(format!(
                "layer {layer} has no stored KV to load"
            )));
        };
        let batch = kb.dim(0)?;
        let mut jobs = Vec::with_capacity(2 * batch * self.group);
        for bi in 0..batch {
            for j in 0..self.group {
                let h = group * self.group + j;
                for (src, dst) in [(&host.k, kb), (&host.v, vb)] {
                    jobs.push(CopyJob {
                        src: src
                            .narrow(0, bi, 1)?
                            .narrow(1, h, 1)?
                            .narrow(2, start, len)?,
                        dst: dst.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                        dim: 2,
                        offset: 0,
                    });
                }
            }
        }
        Ok(jobs)
    }

    fn submit(&mut self, jobs: Vec<CopyJob>, h2d: bool) -> Result<Ticket> {
        let bytes: u64 = jobs.iter().map(CopyJob::bytes).sum();
        if h2d {
            self.stats.h2d_bytes += bytes;
        } else {
            self.stats.d2h_bytes += bytes;
        }
        self.engine.submit(jobs)
    }

    /// Makes unit (layer, group)'s history `start..start+len` resident; returns its buffer.
    fn take_unit(&mut self, layer: usize, group: usize, start: usize, len: usize) -> Result<usize> {
        if let Some(p) = self.prefetched.take() {
            self.stats.transfer_wait_s += self.engine.wait(p.ticket)?;
            if (p.layer, p.group, p.start, p.len) == (layer, group, start, len) {
                return Ok(p.buf);
            }
        }
        if len > 0 {
            let jobs = self.load_jobs(layer, group, 0, start, len)?;
            let t = self.submit(jobs, true)?;
            self.stats.transfer_wait_s += self.engine.wait(t)?;
        }
        Ok(0)
    }

    /// Starts copying the unit after (layer, group) into buffer `buf`, if it is known.
    fn prefetch_next(
        &mut self,
        layer: usize,
        group: usize,
        groups: usize,
        pos: usize,
        buf: usize,
    ) -> Result<()> {
        let next = |l: usize, g: usize| {
            if g + 1 < groups {
                (l, g + 1)
            } else {
                (l + 1, 0)
            }
        };
        let (mut nl, mut ng) = next(layer, group);
        // Resident units need no copy: the next unit to fetch is the next streamed one.
        while self
            .residency
            .as_ref()
            .is_some_and(|r| r.is_resident(nl * groups + ng))
        {
            (nl, ng) = next(nl, ng);
        }
        let (Some(&len_next), Some(Some(spec))) = (self.lens.get(nl), self.specs.get(nl)) else {
            return Ok(());
        };
        if len_next != pos || (nl != layer && self.layers.get(nl).is_none_or(Option::is_none)) {
            return Ok(());
        }
        let start = spec.window_start(pos);
        let len = pos - start;
        if len == 0 {
            return Ok(());
        }
        let jobs = self.load_jobs(nl, ng, buf, start, len)?;
        let ticket = self.submit(jobs, true)?;
        self.prefetched = Some(Prefetch {
            layer: nl,
            group: ng,
            buf,
            start,
            len,
            ticket,
        });
        Ok(())
    }

    fn shape_for(&mut self, step: &AttnStep<'_>) -> Result<KvShape> {
        let shape = KvShape::for_step(self.shape.as_ref(), self.lens.len(), step)?;
        self.shape = Some(shape.clone());
        Ok(shape)
    }
}

impl KvPolicy for OffloadPolicy {
    fn name(&self) -> &str {
        self.name
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        let cap = self.capacity_for(shape.max_tokens);
        self.choose_group(shape, cap, shape.max_tokens)?;
        self.shape = Some(shape.clone());
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let shape = self.shape_for(step)?;
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        self.ensure_host(layer, &shape, pos + t)?;
        if self.lens[layer] != pos {
            return Err(KvError::Step(format!(
                "layer {layer} holds {} tokens but the step starts at position {pos}; call reset() before a new sequence",
                self.lens[layer]
            )));
        }
        self.specs[layer] = Some(step.spec.clone());
        let start = step.spec.window_start(pos);
        let hist = pos - start;
        // Buffers for the widest history of any layer at this position (a global layer's
        // among windowed ones, Gemma 2/3): grown at the step's first layer, not in the middle
        // of it, where growing would discard the unit already prefetched.
        let widest = self
            .specs
            .iter()
            .map(|s| s.as_ref().map_or(pos, |s| pos - s.window_start(pos)))
            .fold(hist, usize::max);
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
            let buf = self.take_unit(layer, g, start, hist)?;
            self.prefetch_next(layer, g, groups, pos, 1 - buf)?;
            let (kb, vb) = self.bufs[buf]
                .clone()
                .ok_or_else(|| KvError::Step("device buffers missing".into()))?;
            kb.slice_set(&kn, 2, hist)?;
            vb.slice_set(&vn, 2, hist)?;
            let k = kb.narrow(2, 0, hist + t)?;
            let v = vb.narrow(2, 0, hist + t)?;
            let part = attend_partial(&q, &k, &v, pos, start, step.spec)?;
            self.stats.note_scratch(part.scratch_bytes, act);
            outs.push(part.out.to_dtype(q.dtype())?);
            // Write the unit's new entries back to the host tier behind the compute.
            let host = self.layers[layer]
                .as_ref()
                .ok_or_else(|| KvError::Step("host layer missing".into()))?;
            let jobs = write_back_jobs((&kn, &vn), host, g * gs, pos)?;
            self.submit(jobs, false)?;
        }
        self.lens[layer] += t;
        Ok(if outs.len() == 1 {
            outs.swap_remove(0)
        } else {
            Tensor::cat(&outs, 1)?
        })
    }

    fn seq_len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    fn reset(&mut self) {
        let _ = self.engine.wait_all();
        for h in self.layers.drain(..).flatten() {
            let _ = self.engine.host_release(&h.k);
            let _ = self.engine.host_release(&h.v);
        }
        self.lens.clear();
        self.specs.clear();
        self.bufs = [None, None];
        self.buf_cap = 0;
        self.group = 0;
        self.prefetched = None;
        if let Some(r) = self.residency.as_mut() {
            r.clear();
        }
        self.meter.reset();
        self.stats = KvStats::default();
        self.copy_base = self.engine.copy_seconds();
        if let Some(s) = &mut self.shape {
            s.n_layers = 0;
        }
    }

    fn stats(&self) -> KvStats {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        KvStats {
            device_kv_bytes: self.meter.current(),
            device_kv_peak_bytes: self.meter.peak(),
            host_kv_bytes: self
                .layers
                .iter()
                .flatten()
                .map(|h| bytes(&h.k) + bytes(&h.v))
                .sum(),
            host_pinned_bytes: self.engine.pinned_bytes(),
            copy_s: self.engine.copy_seconds() - self.copy_base,
            kv_tokens: self.seq_len() as u64,
            resident_units: self.residency.as_ref().map_or(0, |r| r.resident() as u64),
            streamed_units: self.residency.as_ref().map_or(0, |r| r.streamed() as u64),
            demotions: self.residency.as_ref().map_or(0, |r| r.demotions),
            ..self.stats.clone()
        }
    }
}
