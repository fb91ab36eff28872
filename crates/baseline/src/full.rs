//! `full`: all K/V of all layers on the device tier — the reference policy.
//!
//! Each layer owns a [`WindowKv`](kvpolicy_core::WindowKv) that grows by whole chunks, so a
//! decode step writes its new entries in place and attends over a strided view of the
//! buffer. A sliding-window layer (Mistral, Gemma 2/3) keeps only its window and a step: the
//! tokens no later query sees are dropped before its buffer would grow (Gemma 3 holds 3
//! histories and 15 windows, not 18 histories). With `kv_dtype` f16, bf16 or q8_0 (LOSSY,
//! opt-in) the buffers hold that form: a step's K/V are converted as they are stored and the
//! attention kernel reads the stored form in place, accumulating in f32 — llama.cpp's
//! `--cache-type-k f16` / `q8_0`.
//! With a device budget the policy fails before allocating past it and points to the
//! offload policies.
//!
//! On the CPU, with K/V stored as the model gives them, a prefix restored from the prefix
//! cache's RAM is held by reference ([`crate::held`]: the cache's own tensors, leased;
//! vLLM's shared prefix blocks, PagedAttention §4.3), before the layer's own buffer, and a
//! sequence that computed a stored prefix may give its copy up for it (`adopt_kv`).
use std::ops::Range;

use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial_runs, window_capacity, Advice, AttnStep, DeviceMeter, Knob, KvError, KvPolicy,
    KvShape, KvStats, PolicyOption, PolicyOptions, Result,
};
use kvpolicy_core::{KvCodec, KvLease, KvRestore, LayerKv, Need, Partial, PoolTier};
use kvpolicy_core::{ShardLocal, SharedRun};

use crate::held::LayerHeld;

/// Why `full` cannot shrink to a device budget.
const NOTE: &str = "`full` keeps every layer's KV on the device";

/// What to do when `full` does not fit the device budget: a policy that keeps the cache in
/// host memory.
fn advice() -> Vec<Advice> {
    vec![
        Advice::UsePolicy("headwise"),
        Advice::UsePolicy("auto"),
        Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)),
    ]
}

/// Everything on the device: the reference policy.
#[derive(Debug)]
pub struct FullPolicy {
    layers: Vec<LayerHeld>,
    grow_tokens: usize,
    meter: DeviceMeter,
    device: Device,
    shape: Option<KvShape>,
    /// The form K/V are stored in (`kv_dtype`).
    codec: KvCodec,
    stats: KvStats,
}

impl FullPolicy {
    /// A `full` policy with the options' growth chunk, device budget and KV dtype.
    pub fn new(opts: &PolicyOptions) -> Result<Self> {
        Ok(Self {
            layers: Vec::new(),
            grow_tokens: opts.grow_tokens,
            meter: DeviceMeter::for_options(opts),
            device: opts.device.clone(),
            shape: None,
            codec: opts.kv_dtype,
            stats: KvStats::default(),
        })
    }
}

impl KvPolicy for FullPolicy {
    fn name(&self) -> &str {
        "full"
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        self.shape = Some(shape.clone());
        self.stats.lossy = self.codec.lossy(shape.dtype);
        self.codec.check(shape.head_dim)?;
        if let Some(budget) = self.meter.budget() {
            // Scratch for the attention reading the stored form; KV bytes as stored.
            let reading = KvShape {
                dtype: self.codec.stored(shape.dtype, shape.head_dim).0,
                ..shape.clone()
            };
            let scratch =
                reading.step_scratch_bytes(shape.n_kv_heads, shape.max_tokens, &self.device);
            let shape = &shape.stored_as(self.codec);
            let step = shape.largest_step();
            let window = |l: usize| shape.windows.get(l).copied().flatten();
            let need = (0..shape.n_layers)
                .map(|l| {
                    let cap = window_capacity(window(l), shape.max_tokens, step, self.grow_tokens);
                    shape.kv_bytes(shape.n_kv_heads, cap)
                })
                .fold(scratch, u64::saturating_add);
            if need > budget {
                return Err(self.meter.exceeded(
                    format!(
                        "all {} layers' KV for {} tokens and a step's scratch ({})",
                        shape.n_layers,
                        shape.max_tokens,
                        kvpolicy_core::format_bytes(scratch)
                    ),
                    Need::Total(need),
                    NOTE,
                    advice(),
                ));
            }
        }
        Ok(())
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        self.append_kv(step)?;
        Ok(self.attend_held(step)?.out.to_dtype(step.q.dtype())?)
    }

    /// A reading layer attends over its owner's buffer, which holds the step already.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        Ok(self.attend_held(step)?.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.layers.first().map(|l| l.own.end()).unwrap_or(0)
    }

    fn reset(&mut self) {
        self.layers.clear();
        self.meter.reset();
        self.stats = KvStats::default();
    }

    fn stats(&self) -> KvStats {
        KvStats {
            device_kv_bytes: self.meter.current(),
            device_kv_peak_bytes: self.meter.peak(),
            kv_tokens: self.seq_len() as u64,
            // A global layer's (windowed ones hold none by reference).
            shared_kv_tokens: self
                .layers
                .iter()
                .map(LayerHeld::shared_tokens)
                .max()
                .unwrap_or(0),
            ..self.stats.clone()
        }
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }

    fn as_shard(&mut self) -> Option<&mut dyn ShardLocal> {
        Some(self)
    }
}

impl FullPolicy {
    /// The step's queries attended over what `step.layer` holds in their window: output and
    /// log-sum-exp (nothing held in it: the attention over no key).
    fn attend_held(&mut self, step: &AttnStep<'_>) -> Result<Partial> {
        let (b, nh, t, d) = step.q.dims4()?;
        let Some(held) = self.layers.get(step.layer) else {
            return Partial::empty(b, nh, t, d, step.q.device());
        };
        let Some(seen) = held.visible(step.spec.window_start(step.pos))? else {
            return Partial::empty(b, nh, t, d, step.q.device());
        };
        let out = attend_partial_runs(step.q, &seen.as_runs(), step.pos, seen.k_pos, step.spec)?;
        let act = self.shape.as_ref().map_or(0, |s| s.activation_bytes(t));
        self.stats.note_scratch(out.scratch_bytes, act);
        Ok(out)
    }

    /// Stores the step's K/V at the absolute positions `range` in its layer's buffer, after
    /// dropping what no query from `keep_from` on sees (a sliding window).
    fn store(&mut self, step: &AttnStep<'_>, range: Range<usize>, keep_from: usize) -> Result<()> {
        let (pos, t) = (range.start, range.len());
        let (k, v) = if t == step.k.dim(2)? {
            (step.k.clone(), step.v.clone())
        } else {
            (
                step.k.narrow(2, pos - step.pos, t)?,
                step.v.narrow(2, pos - step.pos, t)?,
            )
        };
        self.grow_to(step.layer);
        let buf = &mut self.layers[step.layer].own;
        if pos != buf.end() {
            return Err(KvError::OutOfOrder {
                seq: step.seq,
                layer: step.layer,
                held: buf.end(),
                pos,
            });
        }
        buf.make_room(keep_from, t)?;
        // Converted as they are stored (nothing to do in the model's dtype).
        let (k, v) = (self.codec.encode(&k)?, self.codec.encode(&v)?);
        if self.codec.lossy(step.k.dtype()) {
            self.stats.lossy = true;
        }
        let grow = buf.growth_bytes(&k)?;
        if grow > 0 && !self.meter.fits(grow) {
            return Err(self.meter.exceeded(
                format!(
                    "growing layer {} to {} tokens",
                    step.layer,
                    buf.buffer().capacity_for(buf.buffer().len() + t)
                ),
                Need::More(grow),
                NOTE,
                advice(),
            ));
        }
        buf.append_metered(&k, &v, &mut self.meter)
    }
}

impl FullPolicy {
    /// Layers up to `layer` exist.
    fn grow_to(&mut self, layer: usize) {
        while self.layers.len() <= layer {
            self.layers.push(LayerHeld::new(self.grow_tokens));
        }
    }

    /// Whether K/V of `dtype` are stored as they are (so a shared run can be read as its
    /// owner keeps it), on the CPU (elsewhere a run restored from host RAM is a copy on the
    /// device anyway).
    fn stores_as_given(&self, dtype: candle_core::DType, d: usize) -> bool {
        self.device.is_cpu() && self.codec.stored(dtype, d) == (dtype, d)
    }
}

impl KvRestore for FullPolicy {
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let t = step.k.dim(2)?;
        self.store(
            step,
            step.pos..step.pos + t,
            step.spec.window_start(step.pos),
        )
    }

    /// On the CPU, when K/V are stored in the model's dtype.
    fn attaches_kv(&mut self, _seq: usize) -> bool {
        self.shape
            .as_ref()
            .is_some_and(|s| self.stores_as_given(s.dtype, s.head_dim))
    }

    /// In place: the CPU is its device.
    fn attach_tier(&mut self) -> Option<PoolTier> {
        self.attaches_kv(0).then_some(PoolTier::Device)
    }

    /// Kept by reference while a global layer holds no token of its own (a prefix restored
    /// before the prefill); copied otherwise. A sliding-window layer copies: its window
    /// starts anywhere in a chunk, and the tiles of a cut chunk would change the attention's
    /// summation order (its buffer is a window, small anyway).
    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        let (dt, d) = (step.k.dtype(), step.k.dim(3)?);
        let global = step.spec.sliding_window.is_none();
        if global && self.stores_as_given(dt, d) && step.k.device().same_device(&self.device) {
            self.grow_to(step.layer);
            let run = SharedRun {
                k: step.k,
                v: step.v,
                pos: step.pos,
                lease,
            };
            if self.layers[step.layer].attach(&run)? {
                return Ok(());
            }
        }
        self.append_kv(step)
    }

    fn adopt_kv(&mut self, _seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        let Some(first) = runs.first() else {
            return Ok(false);
        };
        let (dt, d) = (first.k.dtype(), first.k.dim(3)?);
        // Global layers only (see `attach_kv`).
        let windowed = self
            .shape
            .as_ref()
            .is_none_or(|s| s.windows.get(layer).copied().flatten().is_some());
        if windowed || !self.stores_as_given(dt, d) {
            return Ok(false);
        }
        match self.layers.get_mut(layer) {
            Some(held) => held.adopt(runs, &mut self.meter),
            None => Ok(false),
        }
    }

    /// The shared runs and the own buffer joined, when stored as given and no window
    /// dropped the front.
    fn export_kv(&mut self, _seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        let Some(shape) = self.shape.as_ref() else {
            return Ok(None);
        };
        if self.codec.stored(shape.dtype, shape.head_dim) != (shape.dtype, shape.head_dim) {
            return Ok(None);
        }
        let Some(seen) = self.layers.get(layer).map(|h| h.visible(0)).transpose()? else {
            return Ok(None);
        };
        let Some(seen) = seen.filter(|s| s.k_pos == 0) else {
            return Ok(None);
        };
        // Each run to the host first: nothing more is allocated on the device (a scheduler
        // swaps a sequence out when the device is full).
        let host = |t: &Tensor| t.to_device(&Device::Cpu)?.contiguous();
        let mut ks = Vec::with_capacity(seen.runs.len());
        let mut vs = Vec::with_capacity(seen.runs.len());
        for (k, v) in &seen.runs {
            ks.push(host(k)?);
            vs.push(host(v)?);
        }
        Ok(Some(LayerKv {
            k: Tensor::cat(&ks, 2)?,
            v: Tensor::cat(&vs, 2)?,
        }))
    }
}

impl ShardLocal for FullPolicy {
    fn attend_shard_shared(&mut self, step: &AttnStep<'_>) -> Result<Partial> {
        self.attend_held(step)
    }

    fn attend_shard(&mut self, step: &AttnStep<'_>, store: Range<usize>) -> Result<Partial> {
        if !store.is_empty() {
            kvpolicy_core::check_store(step, &store)?;
            self.grow_to(step.layer);
            let held = &mut self.layers[step.layer];
            // (Never past runs held by reference: the positions must follow them.)
            if held.own.buffer().is_empty() && held.shared_tokens() == 0 {
                held.own.start_at(store.start)?;
            }
            self.store(step, store, step.spec.window_start(step.pos))?;
        }
        self.attend_held(step)
    }
}
