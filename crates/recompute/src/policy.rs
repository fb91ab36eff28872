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
use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial, engine_for, grown_host, round_up, AttnSpec, AttnStep, CopyJob, DeviceMeter,
    KvError, KvPolicy, KvShape, KvStats, PolicyOptions, Probe, Profile, Result, Ticket,
    TransferEngine,
};

use crate::scheduler::SplitCosts;

/// Tokens the profiler regenerates per probe.
const PROBE_TOKENS: usize = 64;

/// The host tier of one layer: K/V for every token, X for tokens below the X limit.
#[derive(Debug)]
struct HostLayer {
    k: Tensor,
    v: Tensor,
    cap: usize,
    /// `(b, xcap, hidden)`; `None` while no X is kept.
    x: Option<Tensor>,
    xcap: usize,
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

#[derive(Debug, Clone, Copy)]
struct Loaded {
    layer: usize,
    buf: usize,
    split: Split,
    x: Option<Ticket>,
    kv: Option<Ticket>,
}

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
    engine: Box<dyn TransferEngine>,
    /// `engine.copy_seconds()` at the last reset (stats count from there).
    copy_base: f64,
    grow_tokens: usize,
    forced: Option<usize>,
    profile: Option<Profile>,
    link: Option<f64>,
    shape: Option<KvShape>,
    prepared_max: Option<usize>,
    plan: Option<Plan>,
    layers: Vec<Option<HostLayer>>,
    lens: Vec<usize>,
    specs: Vec<Option<AttnSpec>>,
    bufs: [Option<DeviceBuf>; 2],
    buf_cap: usize,
    buf_xcap: usize,
    prefetched: Option<Loaded>,
    meter: DeviceMeter,
    stats: KvStats,
}

impl std::fmt::Debug for RecomputePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecomputePolicy")
            .field("forced", &self.forced)
            .field("profile", &self.profile)
            .finish()
    }
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

impl RecomputePolicy {
    /// A `recompute` policy from the options' profile, forced split, budget and link.
    pub fn new(opts: &PolicyOptions) -> Result<Self> {
        if let Some(p) = &opts.profile {
            p.validate("given in the options")?;
        }
        Ok(Self {
            device: opts.device.clone(),
            engine: engine_for(&opts.device, opts.link_bandwidth)?,
            copy_base: 0.0,
            grow_tokens: opts.grow_tokens.max(1),
            forced: opts.recompute_split,
            profile: opts.profile.clone(),
            link: opts.link_bandwidth,
            shape: None,
            prepared_max: None,
            plan: None,
            layers: Vec::new(),
            lens: Vec::new(),
            specs: Vec::new(),
            bufs: [None, None],
            buf_cap: 0,
            buf_xcap: 0,
            prefetched: None,
            meter: DeviceMeter::new(opts.device_kv_budget),
            stats: KvStats::default(),
        })
    }

    /// Replaces the transfer engine.
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.copy_base = engine.copy_seconds();
        self.engine = engine;
        self
    }

    fn bad_option(message: String) -> KvError {
        KvError::InvalidOption {
            policy: "recompute".into(),
            message,
        }
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
                    link: self.link,
                };
                Profile::measure_cached(&probe, self.engine.as_mut(), step.regen)?
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

    fn shape_for(&mut self, step: &AttnStep<'_>) -> Result<KvShape> {
        let shape = KvShape::for_step(self.shape.as_ref(), self.lens.len(), step)?;
        self.shape = Some(shape.clone());
        Ok(shape)
    }

    fn ensure_host(
        &mut self,
        layer: usize,
        shape: &KvShape,
        hidden: usize,
        tokens: usize,
        x_tokens: usize,
    ) -> Result<()> {
        while self.layers.len() <= layer {
            self.layers.push(None);
            self.lens.push(0);
            self.specs.push(None);
        }
        let (have, have_x) = self.layers[layer]
            .as_ref()
            .map_or((0, 0), |h| (h.cap, h.xcap));
        if tokens <= have && x_tokens <= have_x {
            return Ok(());
        }
        // Pending write-backs target the old buffers: let them land first.
        self.stats.transfer_wait_s += self.engine.wait_all()?;
        let chunk = self.grow_tokens * 8;
        let cap = round_up(tokens, chunk).max(have);
        let xcap = if x_tokens == 0 {
            have_x
        } else {
            round_up(x_tokens, chunk).max(have_x)
        };
        let dims = (shape.batch, shape.n_kv_heads, cap, shape.head_dim);
        // The old buffers stay in place until the new ones are complete.
        let old = self.layers[layer].take();
        let engine = self.engine.as_mut();
        let (k, v) = match &old {
            Some(o) if o.cap == cap => (o.k.clone(), o.v.clone()),
            old => (
                grown_host(engine, old.as_ref().map(|o| &o.k), dims, 2, shape.dtype)?,
                grown_host(engine, old.as_ref().map(|o| &o.v), dims, 2, shape.dtype)?,
            ),
        };
        let x = match (&old, xcap) {
            (_, 0) => None,
            (Some(o), c) if o.xcap == c => o.x.clone(),
            (old, c) => Some(grown_host(
                engine,
                old.as_ref().and_then(|o| o.x.as_ref()),
                (shape.batch, c, hidden),
                1,
                shape.dtype,
            )?),
        };
        self.layers[layer] = Some(HostLayer { k, v, cap, x, xcap });
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
        if tokens <= self.buf_cap && x_tokens <= self.buf_xcap && self.bufs[0].is_some() {
            return Ok(());
        }
        let cap = round_up(tokens, self.grow_tokens).max(self.buf_cap);
        let xcap = if x_tokens == 0 {
            self.buf_xcap
        } else {
            round_up(x_tokens, self.grow_tokens).max(self.buf_xcap)
        };
        let needed = Self::buffers_bytes(shape, hidden, cap, xcap);
        if let Some(budget) = self.meter.budget() {
            let scratch = shape.step_scratch_bytes(shape.n_kv_heads, cap, &self.device);
            if needed + scratch > budget {
                return Err(KvError::BudgetExceeded {
                    what: format!(
                        "two device buffer sets (K/V at {cap} tokens, X at {xcap} tokens) and a step's scratch ({})",
                        kvpolicy_core::format_bytes(scratch)
                    ),
                    needed: needed + scratch,
                    budget,
                    in_use: 0,
                    hint: "recompute keeps one layer's K/V and X on the device twice; raise --device-kv-budget, force a smaller --recompute-split, or use headwise",
                });
            }
        }
        self.stats.transfer_wait_s += self.engine.wait_all()?;
        self.prefetched = None;
        self.meter.free(self.meter.current());
        self.bufs = [None, None];
        let dims = (shape.batch, shape.n_kv_heads, cap, shape.head_dim);
        for b in self.bufs.iter_mut() {
            let x = if xcap > 0 {
                Some(Tensor::zeros(
                    (shape.batch, xcap, hidden),
                    shape.dtype,
                    &self.device,
                )?)
            } else {
                None
            };
            *b = Some(DeviceBuf {
                k: Tensor::zeros(dims, shape.dtype, &self.device)?,
                v: Tensor::zeros(dims, shape.dtype, &self.device)?,
                x,
            });
        }
        self.meter.alloc(needed);
        self.buf_cap = cap;
        self.buf_xcap = xcap;
        Ok(())
    }

    fn buf(&self, i: usize) -> Result<DeviceBuf> {
        self.bufs[i]
            .clone()
            .ok_or_else(|| KvError::Step("device buffers missing".into()))
    }

    fn submit(&mut self, jobs: Vec<CopyJob>, h2d: bool) -> Result<Option<Ticket>> {
        if jobs.is_empty() {
            return Ok(None);
        }
        let bytes: u64 = jobs.iter().map(CopyJob::bytes).sum();
        if h2d {
            self.stats.h2d_bytes += bytes;
        } else {
            self.stats.d2h_bytes += bytes;
        }
        Ok(Some(self.engine.submit(jobs)?))
    }

    /// Queues X[start, start+l) and then K/V[start+l, start+hist) of `layer` into `buf`.
    fn load(&mut self, layer: usize, buf: usize, split: Split) -> Result<Loaded> {
        let Some(Some(host)) = self.layers.get(layer) else {
            return Err(KvError::Step(format!(
                "layer {layer} has no stored cache to load"
            )));
        };
        let dev = self.buf(buf)?;
        let Split { start, hist, l } = split;
        let mut x_jobs = Vec::new();
        if l > 0 {
            let (Some(hx), Some(dx)) = (&host.x, &dev.x) else {
                return Err(KvError::Step(format!(
                    "layer {layer}: no stored inputs for {l} recomputed tokens"
                )));
            };
            x_jobs.push(CopyJob {
                src: hx.narrow(1, start, l)?,
                dst: dx.clone(),
                dim: 1,
                offset: 0,
            });
        }
        let mut kv_jobs = Vec::new();
        if hist > l {
            for (src, dst) in [(&host.k, &dev.k), (&host.v, &dev.v)] {
                kv_jobs.push(CopyJob {
                    src: src.narrow(2, start + l, hist - l)?,
                    dst: dst.clone(),
                    dim: 2,
                    offset: l,
                });
            }
        }
        let x = self.submit(x_jobs, true)?;
        let kv = self.submit(kv_jobs, true)?;
        Ok(Loaded {
            layer,
            buf,
            split,
            x,
            kv,
        })
    }

    fn wait(&mut self, t: Option<Ticket>) -> Result<()> {
        if let Some(t) = t {
            self.stats.transfer_wait_s += self.engine.wait(t)?;
        }
        Ok(())
    }

    /// The layer's history resident (or on its way) in a buffer: the prefetch if it matches.
    fn take(&mut self, layer: usize, split: Split) -> Result<Loaded> {
        if let Some(p) = self.prefetched.take() {
            if (p.layer, p.split) == (layer, split) {
                return Ok(p);
            }
            self.wait(p.x)?;
            self.wait(p.kv)?;
        }
        self.load(layer, 0, split)
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
        let (Some(&len), Some(Some(spec))) = (self.lens.get(next), self.specs.get(next)) else {
            return Ok(());
        };
        if len != pos || self.layers.get(next).is_none_or(Option::is_none) {
            return Ok(());
        }
        let split = self.split_for(plan, spec, pos);
        if split.hist + t > self.buf_cap || split.l > self.buf_xcap || split.hist == 0 {
            return Ok(());
        }
        self.prefetched = Some(self.load(next, buf, split)?);
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
                return Err(Self::bad_option(format!(
                    "--recompute-split {n} is beyond the sequence: at most {} tokens will be cached (prompt + new tokens); use a split in 0..={}",
                    shape.max_tokens, shape.max_tokens
                )));
            }
        }
        self.prepared_max = Some(shape.max_tokens);
        self.shape = Some(shape.clone());
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let shape = self.shape_for(step)?;
        let plan = self.ensure_plan(step, &shape)?;
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        let hidden = step.x.dim(2)?;
        let x_end = plan.x_limit.map_or(pos + t, |lim| lim.min(pos + t));
        self.ensure_host(layer, &shape, hidden, pos + t, x_end)?;
        if self.lens[layer] != pos {
            return Err(KvError::Step(format!(
                "layer {layer} holds {} tokens but the step starts at position {pos}; call reset() before a new sequence",
                self.lens[layer]
            )));
        }
        self.specs[layer] = Some(step.spec.clone());
        let split = self.split_for(&plan, step.spec, pos);
        self.ensure_buffers(&shape, hidden, split.hist + t, split.l)?;
        let loaded = self.take(layer, split)?;
        self.prefetch_next(&plan, layer, pos, t, 1 - loaded.buf)?;
        let dev = self.buf(loaded.buf)?;
        let Split { start, hist, l } = split;
        // Regenerate K/V[0:l) into the buffer as soon as X is in, while K/V[l:s) may
        // still be in flight; then one attention over the whole range, as `full` runs it.
        if l > 0 {
            self.wait(loaded.x)?;
            let x = dev
                .x
                .as_ref()
                .ok_or_else(|| KvError::Step("device X buffer missing".into()))?
                .narrow(1, 0, l)?
                .contiguous()?;
            step.regen.regen_into(&x, start, &dev.k, &dev.v, 0)?;
            let b = shape.batch as u64;
            self.stats.recompute_tokens += l as u64 * b;
            self.stats.recompute_flops += l as u64 * b * step.regen.flops_per_token();
        }
        self.wait(loaded.kv)?;
        let k_new = step.k.contiguous()?;
        let v_new = step.v.contiguous()?;
        dev.k.slice_set(&k_new, 2, hist)?;
        dev.v.slice_set(&v_new, 2, hist)?;
        let n = hist + t;
        let part = attend_partial(
            step.q,
            &dev.k.narrow(2, 0, n)?,
            &dev.v.narrow(2, 0, n)?,
            pos,
            start,
            step.spec,
        )?;
        self.stats
            .note_scratch(part.scratch_bytes, shape.activation_bytes(t));
        let out = part.out.to_dtype(step.q.dtype())?;
        // New K/V (and X where it is kept) go back to the host tier behind the compute.
        let host = self.layers[layer]
            .as_ref()
            .ok_or_else(|| KvError::Step("host layer missing".into()))?;
        let mut jobs = Vec::with_capacity(3);
        for (src, dst) in [(&k_new, &host.k), (&v_new, &host.v)] {
            jobs.push(CopyJob {
                src: src.clone(),
                dst: dst.clone(),
                dim: 2,
                offset: pos,
            });
        }
        if let (Some(hx), true) = (&host.x, x_end > pos) {
            jobs.push(CopyJob {
                src: step.x.narrow(1, 0, x_end - pos)?.contiguous()?,
                dst: hx.clone(),
                dim: 1,
                offset: pos,
            });
        }
        self.submit(jobs, false)?;
        self.lens[layer] += t;
        self.stats.split = l as u64;
        Ok(out)
    }

    fn seq_len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    fn reset(&mut self) {
        let _ = self.engine.wait_all();
        for h in self.layers.drain(..).flatten() {
            for t in [Some(&h.k), Some(&h.v), h.x.as_ref()].into_iter().flatten() {
                let _ = self.engine.host_release(t);
            }
        }
        self.lens.clear();
        self.specs.clear();
        self.bufs = [None, None];
        self.buf_cap = 0;
        self.buf_xcap = 0;
        self.prefetched = None;
        self.plan = None;
        self.meter.reset();
        self.stats = KvStats::default();
        self.copy_base = self.engine.copy_seconds();
        if let Some(s) = &mut self.shape {
            s.n_layers = 0;
        }
    }

    fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    fn stats(&self) -> KvStats {
        KvStats {
            device_kv_bytes: self.meter.current(),
            device_kv_peak_bytes: self.meter.peak(),
            host_kv_bytes: self
                .layers
                .iter()
                .flatten()
                .map(|h| bytes_of(&h.k) + bytes_of(&h.v) + h.x.as_ref().map_or(0, bytes_of))
                .sum(),
            host_pinned_bytes: self.engine.pinned_bytes(),
            copy_s: self.engine.copy_seconds() - self.copy_base,
            kv_tokens: self.seq_len() as u64,
            ..self.stats.clone()
        }
    }
}
