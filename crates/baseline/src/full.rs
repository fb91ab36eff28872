//! `full`: all K/V of all layers on the device tier — the reference policy.
//!
//! Each layer owns a [`KvBuffer`] that grows by whole chunks, so a decode step writes its
//! new entries in place and attends over a strided view of the buffer. With a device
//! budget the policy fails before allocating past it and points to the offload policies.
use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial, round_up, Advice, AttnInputs, AttnStep, DeviceMeter, Knob, KvBuffer, KvError,
    KvPolicy, KvShape, KvStats, PolicyOption, PolicyOptions, Result,
};
use kvpolicy_core::{KvRestore, Need};

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
    layers: Vec<KvBuffer>,
    grow_tokens: usize,
    meter: DeviceMeter,
    device: Device,
    shape: Option<KvShape>,
    stats: KvStats,
}

impl FullPolicy {
    /// A `full` policy with the options' growth chunk and device budget.
    pub fn new(opts: &PolicyOptions) -> Self {
        Self {
            layers: Vec::new(),
            grow_tokens: opts.grow_tokens,
            meter: DeviceMeter::new(opts.device_kv_budget),
            device: opts.device.clone(),
            shape: None,
            stats: KvStats::default(),
        }
    }
}

impl KvPolicy for FullPolicy {
    fn name(&self) -> &str {
        "full"
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        self.shape = Some(shape.clone());
        if let Some(budget) = self.meter.budget() {
            let cap = round_up(shape.max_tokens, self.grow_tokens);
            let scratch =
                shape.step_scratch_bytes(shape.n_kv_heads, shape.max_tokens, &self.device);
            let need = shape.n_layers as u64 * shape.kv_bytes(shape.n_kv_heads, cap) + scratch;
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
        let buf = &self.layers[step.layer];
        let (k, v) = buf.view(0, buf.len())?;
        let out = attend_partial(
            AttnInputs {
                q: step.q,
                k: &k,
                v: &v,
                q_pos: step.pos,
                k_pos: 0,
            },
            step.spec,
        )?;
        let t = step.q.dim(2)?;
        let act = self.shape.as_ref().map_or(0, |s| s.activation_bytes(t));
        self.stats.note_scratch(out.scratch_bytes, act);
        Ok(out.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.layers.first().map(KvBuffer::len).unwrap_or(0)
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
            ..self.stats.clone()
        }
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        Some(self)
    }
}

impl KvRestore for FullPolicy {
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        while self.layers.len() <= step.layer {
            self.layers.push(KvBuffer::new(self.grow_tokens));
        }
        let buf = &mut self.layers[step.layer];
        if step.pos != buf.len() {
            return Err(KvError::OutOfOrder {
                seq: step.seq,
                layer: step.layer,
                held: buf.len(),
                pos: step.pos,
            });
        }
        let grow = buf.growth_bytes(step.k)?;
        if grow > 0 && !self.meter.fits(grow) {
            return Err(self.meter.exceeded(
                format!(
                    "growing layer {} to {} tokens",
                    step.layer,
                    buf.capacity_for(buf.len() + step.k.dim(2)?)
                ),
                Need::More(grow),
                NOTE,
                advice(),
            ));
        }
        buf.append_metered(step.k, step.v, &mut self.meter)
    }
}
