//! How an offload policy lays its units out on the device ([`Plan`]): the head group of a
//! unit, and under `auto` the bytes resident units may take (HeadInfer §3.3's adaptive
//! head grouping, and the resident/streamed split of the `auto` policy). The plan holds
//! the policy's fixed choices (its name, its [`Grouping`], the device, the growth step) and
//! answers from them, the host tier's stored form and the device budget, returning values:
//! it changes nothing.
use candle_core::Device;
use kvpolicy_core::{round_up, Advice, DeviceMeter, Knob, KvError, KvShape, Need, PolicyOption};
use kvpolicy_core::{KvCodec, Result};
use kvpolicy_tiered::HostLayers;

use crate::settings::HeadGroup;

/// Contexts below this keep all heads of a layer in one unit under `auto` without a budget;
/// each doubling beyond halves the unit (HeadInfer §3.3's adaptive head grouping).
pub const AUTO_ALL_HEADS_BELOW: usize = 500_000;

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

fn divisors_desc(n: usize) -> Vec<usize> {
    (1..=n).rev().filter(|d| n.is_multiple_of(*d)).collect()
}

/// An offload policy's fixed layout choices (module docs).
#[derive(Debug)]
pub(crate) struct Plan {
    name: &'static str,
    grouping: Grouping,
    /// The compute device: a step's scratch is sized for it, and the streaming buffers live
    /// on it.
    device: Device,
    /// Tokens by which device buffers grow.
    grow_tokens: usize,
    /// How the device stores K/V (`kv_dtype`): attention reads streaming buffers of that
    /// form in place (on the CPU; elsewhere widened per call), with no expanded copy.
    device_codec: KvCodec,
}

impl Plan {
    /// The plan of the policy registered as `name`, grouping its units as `grouping`, on
    /// `device`, its device buffers growing `grow_tokens` at a time (at least 1).
    pub(crate) fn new(
        name: &'static str,
        grouping: Grouping,
        device: Device,
        grow_tokens: usize,
    ) -> Self {
        Self {
            name,
            grouping,
            device,
            grow_tokens: grow_tokens.max(1),
            device_codec: KvCodec::Model,
        }
    }

    /// Attention reads streaming buffers stored as `codec` (the device's form,
    /// [`PolicyOptions::device_codec`](kvpolicy_core::PolicyOptions::device_codec)) in
    /// place: no expanded copy is charged for them.
    pub(crate) fn reading_in_place(mut self, codec: KvCodec) -> Self {
        self.device_codec = codec;
        self
    }

    /// The policy's registry name.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// How KV heads are grouped into units.
    pub(crate) fn grouping(&self) -> Grouping {
        self.grouping
    }

    /// The compute device.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// Tokens by which device buffers grow.
    pub(crate) fn grow_tokens(&self) -> usize {
        self.grow_tokens
    }

    /// Device buffer capacity for `tokens`: whole growth steps.
    pub(crate) fn capacity_for(&self, tokens: usize) -> usize {
        round_up(tokens, self.grow_tokens)
    }

    /// Device bytes a step holds besides the KV when attending `heads` KV heads at a time
    /// over `context` keys ([`KvShape::step_scratch_bytes`] on this device).
    pub(crate) fn scratch_bytes(&self, shape: &KvShape, heads: usize, context: usize) -> u64 {
        let kept = if shape.readers.iter().any(|&n| n > 0) {
            // MLKV: a layer's K/V kept on the device for the layers that read its cache.
            shape.kv_bytes(shape.n_kv_heads, context)
        } else {
            0
        };
        // Attention reads the device's stored form: smaller forms are widened into tiles.
        let reading = KvShape {
            dtype: self.device_codec.stored(shape.dtype, shape.head_dim).0,
            ..shape.clone()
        };
        reading.step_scratch_bytes(heads, context, &self.device) + kept
    }

    /// Device bytes of the two streaming buffers for `group` heads at capacity `cap`, as
    /// `host` stores them; with a smaller host dtype (lossy) plus the unit expanded to the
    /// model's dtype before attention (the expanded history and its concatenation with the
    /// step).
    pub(crate) fn buffers_bytes(
        &self,
        host: &HostLayers,
        shape: &KvShape,
        group: usize,
        cap: usize,
    ) -> u64 {
        let stored = 2 * host.stored_bytes(shape, group, cap);
        let in_place = host.stored(shape) == self.device_codec.stored(shape.dtype, shape.head_dim);
        if in_place {
            stored
        } else {
            stored + 2 * shape.kv_bytes(group, cap)
        }
    }

    /// The unit size for a context needing `cap` tokens of buffer, under `meter`'s budget.
    pub(crate) fn choose_group(
        &self,
        host: &HostLayers,
        meter: &DeviceMeter,
        shape: &KvShape,
        cap: usize,
        context: usize,
    ) -> Result<usize> {
        let nkv = shape.n_kv_heads;
        let budget = meter.budget();
        // The two buffers plus what a step holds besides them (attention scratch for one
        // unit, the model's activations).
        let need =
            |g: usize| self.buffers_bytes(host, shape, g, cap) + self.scratch_bytes(shape, g, cap);
        let fits = |g: usize| budget.is_none_or(|b| need(g) <= b);
        let too_small = |g: usize| {
            meter.exceeded(
            format!(
                "two device buffers for {g} KV head(s) at {cap} tokens ({} layer(s), {} head(s) each) and a step's scratch",
                shape.n_layers, nkv
            ),
            Need::Total(need(g)),
            match self.grouping {
                Grouping::Layer => "the budget is smaller than one layer's double buffer (`headwise` streams a group of KV heads at a time)",
                Grouping::Heads(_) | Grouping::Resident => "the budget is smaller than one head group's buffers",
            },
            match self.grouping {
                Grouping::Layer => vec![Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)), Advice::UsePolicy("headwise")],
                // A group of one head is as small as a group gets: only the budget can change.
                // `auto` chooses its group itself: only the budget and the chunk can change.
                Grouping::Resident => vec![Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)), Advice::SmallerPrefillChunk],
                Grouping::Heads(_) if g <= 1 => vec![Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)), Advice::SmallerPrefillChunk],
                Grouping::Heads(_) => vec![Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)), Advice::Lower(Knob::Setting("group"))],
            },
        )
        };
        let group = match self.grouping {
            Grouping::Layer => nkv,
            Grouping::Heads(HeadGroup::Fixed(n)) => {
                if n > nkv || !nkv.is_multiple_of(n) {
                    let ok: Vec<String> = divisors_desc(nkv)
                        .iter()
                        .rev()
                        .map(usize::to_string)
                        .collect();
                    return Err(KvError::InvalidOption {
                        policy: self.name.to_string(),
                        option: Knob::Setting("group"),
                        message: format!(
                            "{n} does not divide the model's {nkv} KV heads; use one of {} or auto",
                            ok.join(", ")
                        ),
                    });
                }
                n
            }
            Grouping::Heads(HeadGroup::Auto) | Grouping::Resident => match budget {
                Some(_) => divisors_desc(nkv)
                    .into_iter()
                    .find(|&g| fits(g))
                    .ok_or_else(|| too_small(1))?,
                None => {
                    let mut target = nkv;
                    let mut limit = AUTO_ALL_HEADS_BELOW;
                    while context >= limit && target > 1 {
                        target /= 2;
                        limit = limit.saturating_mul(2);
                    }
                    divisors_desc(nkv)
                        .into_iter()
                        .find(|&g| g <= target.max(1))
                        .unwrap_or(1)
                }
            },
        };
        if !fits(group) {
            return Err(too_small(group));
        }
        Ok(group)
    }

    /// Under `auto`, the bytes resident units may take: what `meter`'s budget leaves after
    /// the two streaming buffers of `group` KV heads and a step's scratch at capacity `cap`
    /// (the capacity the run will reach, when `prepare` said it); `None` without a budget.
    pub(crate) fn resident_bytes(
        &self,
        host: &HostLayers,
        meter: &DeviceMeter,
        shape: &KvShape,
        group: usize,
        cap: usize,
    ) -> Option<u64> {
        let budget = meter.plannable()?;
        let streaming =
            self.buffers_bytes(host, shape, group, cap) + self.scratch_bytes(shape, group, cap);
        Some(budget.saturating_sub(streaming))
    }
}
