//! How an offload policy lays its units out on the device: the head group of a unit, and
//! under `auto` how many units stay resident (HeadInfer §3.3's adaptive head grouping, and
//! the resident/streamed split of the `auto` policy).
use kvpolicy_core::{Advice, Knob, KvError, KvShape, Need, PolicyOption, Result};

use crate::settings::HeadGroup;

use crate::runtime::{Grouping, OffloadPolicy};

/// Contexts below this keep all heads of a layer in one unit under `auto` without a budget;
/// each doubling beyond halves the unit (HeadInfer §3.3's adaptive head grouping).
pub const AUTO_ALL_HEADS_BELOW: usize = 500_000;

pub(crate) fn divisors_desc(n: usize) -> Vec<usize> {
    (1..=n).rev().filter(|d| n % d == 0).collect()
}

impl OffloadPolicy {
    /// Device bytes of the two streaming buffers for `group` heads at capacity `cap`, as
    /// stored; with a smaller host dtype (lossy) plus the unit expanded to the model's
    /// dtype before attention (the expanded history and its concatenation with the step).
    pub(crate) fn buffers_bytes(&self, shape: &KvShape, group: usize, cap: usize) -> u64 {
        let model = shape.kv_bytes(group, cap);
        if self.host.codec().lossy(shape.dtype) {
            2 * self.host.stored_bytes(shape, group, cap) + 2 * model
        } else {
            2 * model
        }
    }

    /// The unit size for a context needing `cap` tokens of buffer.
    pub(crate) fn choose_group(
        &self,
        shape: &KvShape,
        cap: usize,
        context: usize,
    ) -> Result<usize> {
        let nkv = shape.n_kv_heads;
        let budget = self.meter.budget();
        // The two buffers plus what a step holds besides them (attention scratch for one
        // unit, the model's activations).
        let need = |g: usize| {
            self.buffers_bytes(shape, g, cap) + shape.step_scratch_bytes(g, cap, &self.device)
        };
        let fits = |g: usize| budget.is_none_or(|b| need(g) <= b);
        let too_small = |g: usize| {
            self.meter.exceeded(
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
                if n > nkv || nkv % n != 0 {
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

    /// Under `auto`, the bytes resident units may take: what the budget leaves after the two
    /// streaming buffers of `group` KV heads and a step's scratch at capacity `cap` (the
    /// capacity the run will reach, when `prepare` said it); `None` without a budget.
    pub(crate) fn resident_bytes(&self, shape: &KvShape, group: usize, cap: usize) -> Option<u64> {
        let budget = self.meter.budget()?;
        let streaming = self.buffers_bytes(shape, group, cap)
            + shape.step_scratch_bytes(group, cap, &self.device);
        Some(budget.saturating_sub(streaming))
    }
}
