//! Offloaded K/V with ping-pong device buffers: the runtime of layer-wise offload (FlexGen;
//! HF's offloaded cache), head-wise offload (HeadInfer §3.2) and `auto`.
//!
//! Every layer's keys and values live on the host tier ([`HostLayers`]). The device tier
//! holds two buffers, each sized for one *unit* — a group of KV heads of one layer at the
//! current capacity ([`Streaming`]). Units are visited in order (layer 0 group 0, layer 0
//! group 1, …, layer 1 group 0, …). While attention runs on a unit, the next units' history
//! is copied host→device into the room the buffers have left, and the unit's new entries
//! are copied device→host behind it ([`Link`]). A unit of all KV heads of a layer is layer-wise
//! offload; smaller units cut device memory by `kv_heads / group` more.
//!
//! Attention per unit is exact: heads are independent, and a unit's query heads are those
//! its KV heads serve under grouped-query attention. Per decode step the whole stored
//! history moves host→device once and only the step's new entries move back. With a sliding
//! window only the window's range moves.
//!
//! [`OffloadPolicy`] composes the parts, each in its own file: the [`Plan`] (the head
//! group, the resident bytes), the [`Streaming`] buffers, `auto`'s [`Residency`]; it owns
//! what they share — the link, the host tier, the device meter, the stats — and lends it to
//! their methods.
use candle_core::Tensor;
use kvpolicy_core::{
    attend_partial, AttnInputs, AttnStep, DeviceMeter, KvPolicy, KvShape, KvStats, Partial,
    PolicyMetric, PolicyOptions, ReaderStash, Result, StashedUnit, TokenRange,
};
use kvpolicy_core::{KvCodec, KvRestore};
use kvpolicy_tiered::{report_device, DiskTier, HostLayers, Link, TransferEngine, WriteAt};

use crate::plan::{Grouping, Plan};
use crate::resident::{Residency, UnitAt, UnitId};
use crate::stream::{StepAt, Streaming, UnitBuffers};

/// Offloaded KV with a ping-pong pair of device buffers (see the module docs).
pub struct OffloadPolicy {
    pub(crate) plan: Plan,
    pub(crate) link: Link,
    pub(crate) host: HostLayers,
    /// The streaming buffers and the unit size.
    pub(crate) stream: Streaming,
    /// `auto`'s resident units (`None` for `layer` and `headwise`).
    pub(crate) residency: Option<Residency>,
    pub(crate) meter: DeviceMeter,
    /// How the device holds K/V (`kv_dtype`; the model's dtype unless given):
    /// `auto`'s resident units, and the streaming buffers when they hold that type too.
    pub(crate) device_codec: KvCodec,
    pub(crate) stats: KvStats,
    /// The first position of this policy's share of the sequence (`helix`'s local policy;
    /// [`crate::shard`]): the host tier holds positions from it on. `None`: not a share.
    pub(crate) shard_base: Option<usize>,
    /// The K/V of the layer attended last, for the layers that read its cache (MLKV):
    /// copies of its streamed units (their buffers are refilled), views of resident ones;
    /// each owner layer crosses the link once per step, whatever reads it.
    pub(crate) stash: ReaderStash,
}

/// One streamed unit of a step, for [`OffloadPolicy::attend_streamed`].
pub(crate) struct StreamedUnit<'a> {
    pub(crate) layer: usize,
    pub(crate) group: usize,
    pub(crate) groups: usize,
    /// The unit's queries.
    pub(crate) q: &'a Tensor,
    /// The step's new K and V of the unit's heads (possibly no tokens).
    pub(crate) new: (&'a Tensor, &'a Tensor),
    /// The history it attends, in host-tier positions.
    pub(crate) history: TokenRange,
    pub(crate) at: StepAt,
    /// Position of the first query.
    pub(crate) q_pos: usize,
    /// Position of the first key (the history's first).
    pub(crate) k_pos: usize,
    pub(crate) spec: &'a kvpolicy_core::AttnSpec,
    /// The step's activation bytes.
    pub(crate) act: u64,
    /// Whether layers read this one's cache: the unit's K/V are kept for them.
    pub(crate) keep: bool,
}

impl std::fmt::Debug for OffloadPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadPolicy")
            .field("name", &self.plan.name())
            .field("grouping", &self.plan.grouping())
            .field("group", &self.stream.group())
            .finish()
    }
}

impl OffloadPolicy {
    /// An offload policy registered as `name`, host tier in CPU memory.
    pub fn new(name: &'static str, grouping: Grouping, opts: &PolicyOptions) -> Result<Self> {
        Ok(Self {
            plan: Plan::new(name, grouping, opts.device.clone(), opts.grow_tokens)
                .reading_in_place(opts.device_codec()),
            link: Link::for_device(&opts.device, opts.link_bandwidth)?,
            host: HostLayers::new(opts.grow_tokens, DiskTier::from_options(opts, name)?)
                .with_codec(opts.host_codec())
                .pooled(opts.pool.clone())
                .dropping_windows(),
            stream: Streaming::default(),
            residency: (grouping == Grouping::Resident).then(Residency::default),
            meter: DeviceMeter::for_options(opts),
            device_codec: opts.device_codec(),
            stats: KvStats::default(),
            shard_base: None,
            stash: ReaderStash::default(),
        })
    }

    /// Replaces the transfer engine (e.g. a synchronous or a fault-injecting one).
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.link = Link::new(engine);
        self
    }

    /// KV heads per unit now (0 before the first step).
    pub fn group_size(&self) -> usize {
        self.stream.group()
    }

    /// Streaming buffers for `tokens` of history plus step (and the unit size for a
    /// `context` of that many tokens); under `auto` the first call plans the resident units.
    pub(crate) fn ensure_buffers(
        &mut self,
        shape: &KvShape,
        tokens: usize,
        context: usize,
    ) -> Result<()> {
        let cap = self.plan.capacity_for(tokens);
        if cap <= self.stream.cap() && self.stream.group() != 0 {
            return Ok(());
        }
        if self.stream.group() != 0 && self.residency.as_ref().is_some_and(Residency::unbounded) {
            // No budget: every unit is resident and nothing streams, whatever the group.
            return Ok(());
        }
        let group = self
            .plan
            .choose_group(&self.host, &self.meter, shape, cap, context)?;
        let now = self.stream.group();
        let regroup = now != 0 && now != group && self.residency.is_some();
        if regroup {
            // `auto` changing its head group (a run past the length it planned for, whose
            // buffers no longer fit at the old group): units are numbered by head group, so
            // the resident ones go to the host tier under the old numbering.
            self.demote_all(shape, now)?;
        }
        if now == 0 || regroup {
            // The run's first step: plan the resident units for the capacity it will reach.
            // After a new head group every unit streams: a unit made resident now would start
            // empty, its history on the host tier.
            let plan_cap = self.plan.capacity_for(shape.max_tokens.max(tokens));
            let avail = if regroup {
                Some(0)
            } else {
                self.plan
                    .resident_bytes(&self.host, &self.meter, shape, group, plan_cap)
            };
            // Resident units hold K/V as the device stores them (`kv_dtype`).
            let stored = shape.stored_as(self.device_codec);
            if let Some(r) = self.residency.as_mut() {
                r.plan(&stored, (group, self.plan.grow_tokens()), plan_cap, avail);
            }
        }
        if self.residency.as_ref().is_some_and(Residency::unbounded) {
            // No budget: every unit stays resident and nothing ever streams.
            self.stream.set_group(group);
            return Ok(());
        }
        let pingpong = self.plan.buffers_bytes(&self.host, shape, group, cap);
        // The current streaming buffers (for `layer`/`headwise` all the meter holds; under
        // `auto` the meter also holds resident units).
        let old = if self.residency.is_some() {
            let (now, cap_now) = (self.stream.group(), self.stream.cap());
            self.plan.buffers_bytes(&self.host, shape, now, cap_now)
        } else {
            self.meter.current()
        };
        self.stream.release(&mut self.link)?;
        if self.residency.is_some() {
            // `auto`: the grown streaming buffers come first; resident units make room,
            // the last-decided first.
            self.make_room(shape, old, pingpong, (group, cap))?;
        }
        // The buffers are scratch (refilled from the host every step): free, then allocate.
        self.meter.free(old);
        let (stored, w) = self.host.stored(shape);
        let dims = (shape.batch, group, cap, w);
        let zeros = || Tensor::zeros(dims, stored, self.plan.device());
        let bufs = [(zeros()?, zeros()?), (zeros()?, zeros()?)];
        self.stream.install(&mut self.link, bufs, cap)?;
        self.meter.alloc(pingpong);
        self.stream.set_group(group);
        Ok(())
    }

    /// Writes a step's new entries of heads `first_head..` of `layer` (tokens from `pos`)
    /// to the host tier.
    pub(crate) fn write_new(
        &mut self,
        layer: usize,
        first_head: usize,
        pos: usize,
        (k, v): (&Tensor, &Tensor),
    ) -> Result<()> {
        let at = WriteAt {
            layer,
            first_head,
            offset: pos,
        };
        self.host.write(&mut self.link, at, k, v)
    }

    /// One streamed unit (`layer`, `group`): its `history` (host-tier positions) loaded
    /// into a streaming buffer, the step's `new` entries appended behind it and written back
    /// to the host tier, and its queries (at `q_pos`) attended over the keys (at `k_pos`).
    pub(crate) fn attend_streamed(&mut self, u: StreamedUnit<'_>) -> Result<Partial> {
        let (kn, vn) = u.new;
        let (hist, t) = (u.history.len, kn.dim(2)?);
        let head_dim = kn.dim(3)?;
        let UnitBuffers {
            k: kb,
            v: vb,
            offset,
        } = self.stream.unit_buffers(
            (&mut self.host, &mut self.link),
            self.residency.as_ref(),
            (u.layer, u.group),
            u.groups,
            u.history,
            u.at,
        )?;
        // The buffers hold the model's dtype, or `kv_dtype`'s (the step's K/V are
        // converted as they are stored and everything is read in place).
        let stored = self.device_codec.stored(kn.dtype(), head_dim).0;
        let (k, v, expanded) = if kb.dtype() == stored || kb.dtype() == kn.dtype() {
            let codec = if kb.dtype() == stored {
                self.device_codec
            } else {
                KvCodec::Model
            };
            if t > 0 {
                kb.slice_set(&codec.encode(kn)?, 2, offset + hist)?;
                vb.slice_set(&codec.encode(vn)?, 2, offset + hist)?;
            }
            (
                kb.narrow(2, offset, hist + t)?,
                vb.narrow(2, offset, hist + t)?,
                0,
            )
        } else {
            // LOSSY host form: decode the history, then append the step's exact K/V.
            let codec = self.host.codec();
            let wide = |b: &Tensor, n: &Tensor| -> Result<Tensor> {
                let h = codec.decode(&b.narrow(2, offset, hist)?, n.dtype(), head_dim)?;
                Ok(Tensor::cat(&[&h, n], 2)?)
            };
            let (k, v) = (wide(&kb, kn)?, wide(&vb, vn)?);
            let bytes = 2 * (k.elem_count() * k.dtype().size_in_bytes()) as u64;
            (k, v, bytes)
        };
        let part = attend_partial(
            AttnInputs {
                q: u.q,
                k: &k,
                v: &v,
                q_pos: u.q_pos,
                k_pos: u.k_pos,
            },
            u.spec,
        )?;
        self.stats
            .note_scratch(part.scratch_bytes + expanded, u.act);
        if u.keep {
            let kept = StashedUnit {
                first_head: u.group * kn.dim(1)?,
                k,
                v,
                k_pos: u.k_pos,
            };
            let bytes = self.stash.keep_copy(kept)?;
            self.meter.alloc(bytes);
        }
        // Write the unit's new entries back to the host tier behind the compute.
        if t > 0 {
            let gs = kn.dim(1)?;
            let at = u.history.start + hist;
            self.write_new(u.layer, u.group * gs, at, (kn, vn))?;
        }
        self.stream.done(
            (&mut self.host, &mut self.link),
            self.residency.as_ref(),
            (u.layer, u.group),
            u.groups,
            u.at,
        )?;
        Ok(part)
    }
}

impl KvPolicy for OffloadPolicy {
    fn name(&self) -> &str {
        self.plan.name()
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        // Both forms up front (q8_0 needs whole blocks), not at the first store.
        self.device_codec.check(shape.head_dim)?;
        self.host.codec().check(shape.head_dim)?;
        let cap = self.plan.capacity_for(shape.max_tokens);
        self.plan
            .choose_group(&self.host, &self.meter, shape, cap, shape.max_tokens)?;
        self.host.set_shape(shape);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let shape = self.host.shape_for(step)?;
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        let freed = self.stash.clear();
        self.meter.free(freed);
        let keep = shape.has_readers(layer);
        if keep {
            self.stash.begin(step);
        }
        self.host.begin(&mut self.link, step, &shape)?;
        let start = step.spec.window_start(pos);
        let hist = pos - start;
        // Buffers for the widest history of any layer at this position: grown at the step's
        // first layer, not in the middle of it, where growing would discard the prefetch.
        let widest = self.host.widest_history(pos, hist);
        self.ensure_buffers(&shape, widest + t, pos + t)?;
        let gs = self.stream.group();
        let groups = shape.n_kv_heads / gs;
        let q_per_group = gs * step.spec.group_size();
        // Units of the next step are staged during this one only when that step will come
        // and use them: not in a sequence's first step (after a `reset` without `prepare`
        // the layer count is still being learned), not before a step that grows the
        // buffers (growing drops what was staged), and not for the step at `max_tokens - 1`:
        // the generation loop feeds its last sampled token to no step, so staging for it
        // would move bytes for nothing (a teacher-forced run's last step goes unstaged).
        let next = pos + t;
        let next_widest = self.host.widest_history(next, 0);
        let stage_next = pos > 0
            && next + 1 < shape.max_tokens
            && self.plan.capacity_for(next_widest + t) <= self.stream.cap();
        let at = StepAt::new(pos, t, shape.n_layers, stage_next);
        // What a resident unit's growth must leave free, and the step's activations.
        let reserve = self.plan.scratch_bytes(&shape, gs, widest + t);
        let act = shape.activation_bytes(t);
        let mut outs = Vec::with_capacity(groups);
        for g in 0..groups {
            let kn = step.k.narrow(1, g * gs, gs)?.contiguous()?;
            let vn = step.v.narrow(1, g * gs, gs)?.contiguous()?;
            let q = step.q.narrow(1, g * q_per_group, q_per_group)?;
            let unit = UnitId {
                layer,
                group: g,
                groups,
            };
            let whole = UnitAt::whole(step);
            let resident = (&q, &kn, &vn);
            if let Some(part) =
                self.attend_resident(unit, resident, &whole, (reserve, act), keep)?
            {
                outs.push(part.out.to_dtype(q.dtype())?);
                continue;
            }
            let part = self.attend_streamed(StreamedUnit {
                layer,
                group: g,
                groups,
                q: &q,
                new: (&kn, &vn),
                history: TokenRange::new(start, hist),
                at,
                q_pos: pos,
                k_pos: start,
                spec: step.spec,
                act,
                keep,
            })?;
            outs.push(part.out.to_dtype(q.dtype())?);
        }
        self.host.advance(layer, t);
        Ok(if outs.len() == 1 {
            outs.swap_remove(0)
        } else {
            Tensor::cat(&outs, 1)?
        })
    }

    /// A reading layer attends over what its owner's step kept on the device: no byte
    /// crosses the link again.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let part = self.stash.attend(step)?;
        let act = self
            .host
            .known_shape()
            .map_or(0, |s| s.activation_bytes(step.q.dim(2).unwrap_or(0)));
        self.stats.note_scratch(part.scratch_bytes, act);
        Ok(part.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.host.seq_len()
    }

    fn reset(&mut self) {
        self.link.reset();
        self.host.clear(&mut self.link);
        self.stream.clear();
        if let Some(r) = self.residency.as_mut() {
            r.clear();
        }
        self.meter.reset();
        self.stats = KvStats::default();
        self.shard_base = None;
        self.stash.clear();
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
                r.demotions() as f64,
                "units",
            ));
        }
        let mut stats = self.host.report(stats);
        if let Some(shape) = self.host.known_shape() {
            stats.lossy |= self.device_codec.lossy(shape.dtype);
        }
        self.link.report(report_device(&self.meter, stats))
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }

    fn as_shard(&mut self) -> Option<&mut dyn kvpolicy_core::ShardLocal> {
        Some(self)
    }
}
