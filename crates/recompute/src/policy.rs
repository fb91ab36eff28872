//! The partial-recompute runtime (KVPR §3.2): per layer and step, X[0:l) and K/V[l:s)
//! cross the link in that order while the device regenerates K/V[0:l) as soon as X has
//! arrived, writing them into the same buffer the transfer fills; one attention then runs
//! over the whole range.
//!
//! Why not attend the regenerated range early and merge with the log-sum-exp (exact in real
//! arithmetic)? The overlap that matters — regeneration against the transfer — is kept
//! either way; the early attention would hide only `l/s` of one decode step's attention,
//! while the merge's rounding (~1e-7) is enough to flip near-tied greedy choices of a
//! 4-bit model. One attention over the assembled buffer is the computation `full` runs, so
//! results are bitwise `full`'s whenever regeneration reproduces the forward pass's K/V.
use crate::settings::RecomputeSettings;
use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial, front_to_drop, round_up, Advice, AttnInputs, AttnSpec, AttnStep, DeviceMeter,
    Knob, KvError, KvPolicy, KvShape, KvStats, PolicyMetric, PolicyOption, PolicyOptions, Profile,
    Result,
};
use kvpolicy_core::{Need, Profiled, ReaderStash, StashedUnit};
use kvpolicy_tiered::{
    grown_host, report_device, tensor_bytes, CopyJob, Direction, HostKv, HostLayers, Link, Loaded,
    PingPong, Probe, TransferEngine,
};

use crate::scheduler::SplitCosts;

/// Tokens the profiler regenerates per probe.
const PROBE_TOKENS: usize = 64;

/// One layer's stored inputs on the host tier: `(b, cap, hidden)` for the tokens below the
/// X limit (K/V for every token are in [`HostLayers`]).
#[derive(Debug)]
struct HostX {
    x: Tensor,
    cap: usize,
    /// The position of row 0 (a sliding-window layer drops what no later query sees).
    base: usize,
}

/// One of the two device buffer sets.
#[derive(Debug, Clone)]
struct DeviceBuf {
    k: Tensor,
    v: Tensor,
    /// `(b, xcap, hidden)` for the recomputed prefix.
    x: Option<Tensor>,
}

/// Where a layer's history is split this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    /// First visible history position (the window's start).
    start: usize,
    /// Visible history tokens.
    hist: usize,
    /// Of those, regenerated from X (the first `l`).
    l: usize,
}

/// What a ping-pong buffer set holds: a layer at a split. Its tickets are X's, then K/V's.
type LayerKey = (usize, Split);

/// What the first step decides.
#[derive(Debug, Clone)]
struct Plan {
    costs: SplitCosts,
    /// X is kept for tokens below this position (`None`: for all tokens).
    x_limit: Option<usize>,
}

/// Partial recompute over an offloaded cache (see the crate docs).
pub struct RecomputePolicy {
    device: Device,
    link: Link,
    grow_tokens: usize,
    forced: Option<usize>,
    profile: Option<Profile>,
    link_bandwidth: Option<f64>,
    prepared_max: Option<usize>,
    plan: Option<Plan>,
    host: HostLayers,
    xs: Vec<Option<HostX>>,
    pingpong: PingPong<DeviceBuf, LayerKey>,
    buf_xcap: usize,
    meter: DeviceMeter,
    stats: KvStats,
    /// The owner layer's assembled K/V (a view of its buffer) for the layers that read it
    /// (MLKV).
    stash: ReaderStash,
}

impl std::fmt::Debug for RecomputePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecomputePolicy")
            .field("forced", &self.forced)
            .field("profile", &self.profile)
            .finish()
    }
}

impl RecomputePolicy {
    /// A `recompute` policy from the options' profile, forced split, budget and link.
    pub fn new(opts: &PolicyOptions, settings: RecomputeSettings) -> Result<Self> {
        if let Some(p) = &opts.profile {
            p.validate("given in the options")?;
        }
        Ok(Self {
            device: opts.device.clone(),
            link: Link::for_device(&opts.device, opts.link_bandwidth)?,
            grow_tokens: opts.grow_tokens.max(1),
            forced: settings.split,
            profile: opts.profile.clone(),
            link_bandwidth: opts.link_bandwidth,
            prepared_max: None,
            plan: None,
            host: HostLayers::new(opts.grow_tokens, None)
                .pooled(opts.pool.clone())
                .dropping_windows(),
            xs: Vec::new(),
            pingpong: PingPong::default(),
            buf_xcap: 0,
            meter: DeviceMeter::for_options(opts),
            stats: KvStats::default(),
            stash: ReaderStash::default(),
        })
    }

    /// Replaces the transfer engine.
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.link = Link::new(engine);
        self
    }

    /// Profile, costs and X limit, decided at the first step (the regeneration handle
    /// is needed to measure).
    fn ensure_plan(&mut self, step: &AttnStep<'_>, shape: &KvShape) -> Result<Plan> {
        if let Some(p) = &self.plan {
            return Ok(p.clone());
        }
        let (b, _, hidden) = step.x.dims3()?;
        let profile = match &self.profile {
            Some(p) => p.clone(),
            None => {
                let max = self
                    .prepared_max
                    .unwrap_or(step.pos + step.k.dim(2)?)
                    .max(1);
                let probe = Probe {
                    device: &self.device,
                    batch: b,
                    hidden,
                    dtype: step.x.dtype(),
                    transfer_bytes: (shape.kv_bytes(shape.n_kv_heads, max) as usize)
                        .clamp(1 << 20, 64 << 20),
                    tokens: PROBE_TOKENS,
                    link: self.link_bandwidth,
                };
                kvpolicy_tiered::probe::measure_cached(&probe, self.link.engine(), step.regen)?
            }
        };
        let costs = SplitCosts::new(
            &profile,
            b,
            hidden,
            shape.n_kv_heads,
            shape.head_dim,
            shape.dtype.size_in_bytes(),
        );
        // Storage policy: X only for the prefix the scheduler can ever recompute.
        let windowed = step.spec.sliding_window.is_some();
        let x_limit = if self.forced.is_none() && costs.x_bytes >= costs.kv_bytes {
            Some(0)
        } else if windowed {
            None
        } else if let Some(n) = self.forced {
            Some(n)
        } else {
            self.prepared_max
                .map(|max| (0..=max).map(|s| costs.best_split(s)).max().unwrap_or(0))
        };
        let plan = Plan { costs, x_limit };
        self.profile = Some(profile);
        self.plan = Some(plan.clone());
        Ok(plan)
    }

    fn split_for(&self, plan: &Plan, spec: &AttnSpec, pos: usize) -> Split {
        let start = spec.window_start(pos);
        let hist = pos - start;
        let want = self.forced.unwrap_or_else(|| plan.costs.best_split(hist));
        let stored = plan
            .x_limit
            .map_or(usize::MAX, |lim| lim.saturating_sub(start));
        Split {
            start,
            hist,
            l: want.min(hist).min(stored),
        }
    }

    /// Grows `layer`'s stored inputs to hold `x_tokens` (queued copies land first).
    /// Positions before `keep_from` (the window's start) are dropped first when keeping
    /// them would make the buffer grow; `held` positions are stored so far.
    fn ensure_x(
        &mut self,
        layer: usize,
        shape: &KvShape,
        (x_tokens, held, keep_from): (usize, usize, usize),
    ) -> Result<()> {
        while self.xs.len() <= layer {
            self.xs.push(None);
        }
        let (have, base) = self.xs[layer].as_ref().map_or((0, 0), |h| (h.cap, h.base));
        if x_tokens.saturating_sub(base) <= have {
            return Ok(());
        }
        self.link.wait_all()?;
        let n = front_to_drop(base..held, keep_from, x_tokens, have);
        if let Some(hx) = self.xs[layer].as_mut().filter(|_| n > 0) {
            // No later query sees them: move the rest to the front instead of growing.
            kvpolicy_core::move_to_front(&hx.x, 1, n, held - base - n)?;
            hx.base = base + n;
            if x_tokens - hx.base <= hx.cap {
                return Ok(());
            }
        }
        let base = self.xs[layer].as_ref().map_or(0, |h| h.base);
        let cap = round_up(x_tokens - base, self.host.chunk());
        let old = self.xs[layer].take();
        let x = grown_host(
            self.link.engine(),
            old.as_ref().map(|o| &o.x),
            (shape.batch, cap, shape.hidden),
            1,
            shape.dtype,
        )?;
        self.xs[layer] = Some(HostX { x, cap, base });
        Ok(())
    }

    /// Device bytes of the two buffer sets.
    fn buffers_bytes(shape: &KvShape, hidden: usize, cap: usize, xcap: usize) -> u64 {
        let x = (shape.batch * xcap * hidden * shape.dtype.size_in_bytes()) as u64;
        2 * (shape.kv_bytes(shape.n_kv_heads, cap) + x)
    }

    fn ensure_buffers(
        &mut self,
        shape: &KvShape,
        hidden: usize,
        tokens: usize,
        x_tokens: usize,
    ) -> Result<()> {
        let have = self.pingpong.cap();
        if tokens <= have && x_tokens <= self.buf_xcap && self.pingpong.is_ready() {
            return Ok(());
        }
        let cap = round_up(tokens, self.grow_tokens).max(have);
        let xcap = if x_tokens == 0 {
            self.buf_xcap
        } else {
            round_up(x_tokens, self.grow_tokens).max(self.buf_xcap)
        };
        let needed = Self::buffers_bytes(shape, hidden, cap, xcap);
        if let Some(budget) = self.meter.budget() {
            let scratch = shape.step_scratch_bytes(shape.n_kv_heads, cap, &self.device);
            if needed + scratch > budget {
                return Err(self.meter.exceeded(
                    format!(
                        "two device buffer sets (K/V at {cap} tokens, X at {xcap} tokens) and a step's scratch ({})",
                        kvpolicy_core::format_bytes(scratch)
                    ),
                    Need::Total(needed + scratch),
                    "recompute keeps one layer's K/V and X on the device twice",
                    vec![
                        Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)),
                        Advice::Lower(Knob::Setting("split")),
                        Advice::UsePolicy("headwise"),
                    ],
                ));
            }
        }
        self.pingpong.release(&mut self.link)?;
        self.meter.free(self.meter.current());
        let dims = (shape.batch, shape.n_kv_heads, cap, shape.head_dim);
        let new_buf = || -> Result<DeviceBuf> {
            let x = (xcap > 0)
                .then(|| Tensor::zeros((shape.batch, xcap, hidden), shape.dtype, &self.device))
                .transpose()?;
            Ok(DeviceBuf {
                k: Tensor::zeros(dims, shape.dtype, &self.device)?,
                v: Tensor::zeros(dims, shape.dtype, &self.device)?,
                x,
            })
        };
        let bufs = [new_buf()?, new_buf()?];
        self.pingpong.install(&mut self.link, bufs, cap)?;
        self.meter.alloc(needed);
        self.buf_xcap = xcap;
        Ok(())
    }

    /// `layer`'s host K/V (this policy keeps its host tier in RAM) and the position of their
    /// first row.
    fn ram(&self, layer: usize) -> Result<(&HostKv, usize)> {
        self.host
            .ram_from(layer)
            .ok_or_else(|| KvError::invariant(format!("layer {layer} has no host storage")))
    }

    /// Queues X[start, start+l) and then K/V[start+l, start+hist) of `layer` into `buf`.
    fn load(&mut self, layer: usize, buf: usize, split: Split) -> Result<Loaded<LayerKey>> {
        let (host, kv_base) = self.ram(layer)?;
        let dev = self.pingpong.buf(buf)?;
        let Split { start, hist, l } = split;
        let mut x_jobs = Vec::new();
        if l > 0 {
            let hx = self.xs.get(layer).and_then(Option::as_ref);
            let (Some(hx), Some(dx)) = (hx, &dev.x) else {
                return Err(KvError::invariant(format!(
                    "layer {layer}: no stored inputs for {l} recomputed tokens"
                )));
            };
            x_jobs.push(CopyJob {
                src: hx.x.narrow(1, start - hx.base, l)?,
                dst: dx.clone(),
                dim: 1,
                offset: 0,
            });
        }
        let mut kv_jobs = Vec::new();
        if hist > l {
            for (src, dst) in [(&host.k, &dev.k), (&host.v, &dev.v)] {
                kv_jobs.push(CopyJob {
                    src: src.narrow(2, start + l - kv_base, hist - l)?,
                    dst: dst.clone(),
                    dim: 2,
                    offset: l,
                });
            }
        }
        let x = self.link.submit(x_jobs, Direction::H2d)?;
        let kv = self.link.submit(kv_jobs, Direction::H2d)?;
        Ok(Loaded {
            key: (layer, split),
            buf,
            tickets: [x, kv],
        })
    }

    /// The layer's history resident (or on its way) in a buffer: the prefetch if it matches.
    fn take(&mut self, layer: usize, split: Split) -> Result<Loaded<LayerKey>> {
        match self.pingpong.take(&(layer, split), &mut self.link)? {
            Some(p) => Ok(p),
            None => self.load(layer, 0, split),
        }
    }

    /// Starts loading the next layer of the same step into the other buffer.
    fn prefetch_next(
        &mut self,
        plan: &Plan,
        layer: usize,
        pos: usize,
        t: usize,
        buf: usize,
    ) -> Result<()> {
        let next = layer + 1;
        let Some(spec) = self.host.ready(next, pos) else {
            return Ok(());
        };
        let split = self.split_for(plan, spec, pos);
        if split.hist + t > self.pingpong.cap() || split.l > self.buf_xcap || split.hist == 0 {
            return Ok(());
        }
        let loaded = self.load(next, buf, split)?;
        self.pingpong.set_prefetched(loaded);
        Ok(())
    }
}

impl KvPolicy for RecomputePolicy {
    fn name(&self) -> &str {
        "recompute"
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        if let Some(n) = self.forced {
            if n > shape.max_tokens {
                return Err(KvError::InvalidOption {
                    policy: "recompute".into(),
                    option: Knob::Setting("split"),
                    message: format!(
                        "{n} is beyond the sequence: at most {} tokens will be cached (prompt + new tokens); use a split in 0..={}",
                        shape.max_tokens, shape.max_tokens
                    ),
                });
            }
        }
        self.prepared_max = Some(shape.max_tokens);
        self.host.set_shape(shape);
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let shape = self.host.shape_for(step)?;
        let plan = self.ensure_plan(step, &shape)?;
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        let hidden = step.x.dim(2)?;
        let x_end = plan.x_limit.map_or(pos + t, |lim| lim.min(pos + t));
        self.host.begin(&mut self.link, step, &shape)?;
        let keep_from = step.spec.window_start(pos);
        self.ensure_x(layer, &shape, (x_end, pos, keep_from))?;
        let split = self.split_for(&plan, step.spec, pos);
        self.ensure_buffers(&shape, hidden, split.hist + t, split.l)?;
        let loaded = self.take(layer, split)?;
        self.prefetch_next(&plan, layer, pos, t, 1 - loaded.buf)?;
        let dev = self.pingpong.buf(loaded.buf)?;
        let [x_ticket, kv_ticket] = loaded.tickets;
        let Split { start, hist, l } = split;
        // Regenerate K/V[0:l) into the buffer as soon as X is in, while K/V[l:s) may
        // still be in flight; then one attention over the whole range, as `full` runs it.
        if l > 0 {
            self.link.wait(x_ticket)?;
            let x = dev
                .x
                .as_ref()
                .ok_or_else(|| KvError::invariant("the device X buffer is missing"))?
                .narrow(1, 0, l)?
                .contiguous()?;
            step.regen.regen_into(&x, start, &dev.k, &dev.v, 0)?;
            let b = shape.batch as u64;
            self.stats.recompute_tokens += l as u64 * b;
            self.stats.recompute_flops += l as u64 * b * step.regen.flops_per_token();
        }
        self.link.wait(kv_ticket)?;
        let k_new = step.k.contiguous()?;
        let v_new = step.v.contiguous()?;
        dev.k.slice_set(&k_new, 2, hist)?;
        dev.v.slice_set(&v_new, 2, hist)?;
        let n = hist + t;
        let (k_all, v_all) = (dev.k.narrow(2, 0, n)?, dev.v.narrow(2, 0, n)?);
        let part = attend_partial(
            AttnInputs {
                q: step.q,
                k: &k_all,
                v: &v_all,
                q_pos: pos,
                k_pos: start,
            },
            step.spec,
        )?;
        self.stash.clear();
        if shape.has_readers(layer) {
            // The buffer stays as it is until the next layer's step prefetches into it.
            self.stash.begin(step);
            self.stash.keep_view(StashedUnit {
                first_head: 0,
                k: k_all,
                v: v_all,
                k_pos: start,
            })?;
        }
        self.stats
            .note_scratch(part.scratch_bytes, shape.activation_bytes(t));
        let out = part.out.to_dtype(step.q.dtype())?;
        // New K/V (and X where it is kept) go back to the host tier behind the compute.
        let (host, kv_base) = self.ram(layer)?;
        let mut jobs = Vec::with_capacity(3);
        for (src, dst) in [(&k_new, &host.k), (&v_new, &host.v)] {
            jobs.push(CopyJob {
                src: src.clone(),
                dst: dst.clone(),
                dim: 2,
                offset: pos - kv_base,
            });
        }
        if let (Some(Some(hx)), true) = (self.xs.get(layer), x_end > pos) {
            jobs.push(CopyJob {
                src: step.x.narrow(1, 0, x_end - pos)?.contiguous()?,
                dst: hx.x.clone(),
                dim: 1,
                offset: pos - hx.base,
            });
        }
        self.link.submit(jobs, Direction::D2h)?;
        self.host.advance(layer, t);
        self.stats
            .set_metric(PolicyMetric::gauge("split", l as f64, "tokens"));
        Ok(out)
    }

    /// A reading layer attends over the owner's assembled K/V, still in its buffer.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let part = self.stash.attend(step)?;
        Ok(part.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.host.seq_len()
    }

    fn reset(&mut self) {
        self.stash.clear();
        self.link.reset();
        self.host.clear(&mut self.link);
        for h in self.xs.drain(..).flatten() {
            let _ = self.link.engine().host_release(&h.x);
        }
        self.pingpong.clear();
        self.buf_xcap = 0;
        self.plan = None;
        self.meter.reset();
        self.stats = KvStats::default();
    }

    fn stats(&self) -> KvStats {
        let x_bytes: u64 = self.xs.iter().flatten().map(|h| tensor_bytes(&h.x)).sum();
        let stats = self.host.report(KvStats {
            kv_tokens: self.seq_len() as u64,
            ..self.stats.clone()
        });
        let stats = KvStats {
            host_kv_bytes: stats.host_kv_bytes + x_bytes,
            ..stats
        };
        self.link.report(report_device(&self.meter, stats))
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        Some(self)
    }
}

impl Profiled for RecomputePolicy {
    fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }
}
