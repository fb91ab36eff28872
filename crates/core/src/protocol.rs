//! The order in which a model calls a [`KvPolicy`], checked: [`Checked`] wraps a policy,
//! forwards every call, and turns a call out of order into [`KvError::Protocol`] naming
//! what was expected — so a policy (or a model) that sees calls in another order learns it
//! from a clear error rather than from wrong logits. The protocol itself is stated in
//! [`KvPolicy`]'s documentation; the tests run every policy under this wrapper.
use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::capabilities::{Batched, KvRestore, LayerKv, Profiled, SeqLoad};
use crate::error::{KvError, Result};
use crate::lease::{KvLease, SharedRun};
use crate::policy::KvPolicy;
use crate::restore::not_restorable;
use crate::stats::KvStats;
use crate::step::{AttnStep, KvShape};

/// Where one sequence stands in the protocol.
#[derive(Clone, Copy, Debug, Default)]
struct SeqState {
    /// Tokens of completed steps.
    cached: usize,
    /// The next layer the current step expects (0: between steps).
    next_layer: usize,
    /// The current step's first position and tokens.
    pos: usize,
    tokens: usize,
}

/// A policy whose calls are checked against the protocol (see the module docs).
pub struct Checked<'a> {
    inner: &'a mut dyn KvPolicy,
    /// Layers per step: from `prepare`, or learned when the first step ends.
    layers: Option<usize>,
    seqs: BTreeMap<usize, SeqState>,
}

impl<'a> Checked<'a> {
    /// Wraps `inner` (its calls from here on: wrap it before its first step).
    pub fn new(inner: &'a mut dyn KvPolicy) -> Self {
        Self {
            inner,
            layers: None,
            seqs: BTreeMap::new(),
        }
    }

    /// Checks that `step` comes next, and records it.
    fn admit(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let t = step.k.dim(2)?;
        let err = |what: String| {
            Err(KvError::Protocol(format!(
                "layer {} of sequence {} at position {} ({t} tokens): {what}",
                step.layer, step.seq, step.pos
            )))
        };
        if step.seq != 0 && self.inner.as_batched().is_none() {
            return err(format!(
                "`{}` keeps one sequence (slot 0); a ragged batch needs a policy built with \
                 build_policy_batched (or wrapped in PerSequence)",
                self.inner.name()
            ));
        }
        let layers = self.layers;
        let s = self.seqs.entry(step.seq).or_default();
        // A step that reached the last layer is complete.
        if layers.is_some_and(|n| s.next_layer == n) {
            s.cached += s.tokens;
            s.next_layer = 0;
        }
        if step.layer == 0 && s.next_layer > 0 {
            match layers {
                // The first step ends where the next begins: its layer count is learned.
                None => {
                    self.layers = Some(s.next_layer);
                    s.cached += s.tokens;
                    s.next_layer = 0;
                }
                Some(n) => {
                    return err(format!(
                        "a new step began after layer {} of {n}; every step calls layers 0..{n} in order",
                        s.next_layer - 1
                    ))
                }
            }
        }
        if step.layer != s.next_layer {
            return err(format!(
                "expected layer {} (layers come in order, 0 first, within each step)",
                s.next_layer
            ));
        }
        if layers.is_some_and(|n| step.layer >= n) {
            return err(format!(
                "the model has {} layers",
                layers.unwrap_or_default()
            ));
        }
        if step.layer == 0 {
            if step.pos != s.cached {
                return err(format!(
                    "the sequence holds {} tokens, so its next step starts there (prefill chunks, then decode steps, continue it; reset or release it to start again)",
                    s.cached
                ));
            }
            s.pos = step.pos;
            s.tokens = t;
        } else if (step.pos, t) != (s.pos, s.tokens) {
            return err(format!(
                "layer 0 of this step was at position {} with {} tokens; every layer of a step sees the same",
                s.pos, s.tokens
            ));
        }
        s.next_layer += 1;
        Ok(())
    }

    /// Checks that reader `step` of layer `step.layer` comes right after that layer's
    /// `attend` (or another reader of it), in the same step.
    fn admit_reader(&self, step: &AttnStep<'_>) -> Result<()> {
        let t = step.k.dim(2)?;
        let s = self.seqs.get(&step.seq).copied().unwrap_or_default();
        if s.next_layer != step.layer + 1 || (step.pos, t) != (s.pos, s.tokens) {
            return Err(KvError::Protocol(format!(
                "a layer reading layer {} of sequence {} at position {} ({t} tokens) came {}; \
                 readers follow their owner's attend in the same step, before the next layer's",
                step.layer,
                step.seq,
                step.pos,
                match s.next_layer {
                    0 => "before that layer's attend".to_string(),
                    n => format!("after layer {}'s attend at position {}", n - 1, s.pos),
                }
            )));
        }
        Ok(())
    }
}

impl KvPolicy for Checked<'_> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        if self.seqs.values().any(|s| s.cached > 0 || s.next_layer > 0) {
            return Err(KvError::Protocol(
                "prepare came after steps; call it before the first step (or after reset)".into(),
            ));
        }
        self.layers = Some(shape.n_layers);
        self.inner.prepare(shape)
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        self.admit(step)?;
        self.inner.attend(step)
    }

    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        self.admit_reader(step)?;
        self.inner.attend_shared(step)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn reset(&mut self) {
        self.seqs.clear();
        self.inner.reset();
    }

    fn stats(&self) -> KvStats {
        self.inner.stats()
    }

    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        self.inner.as_restore()?;
        Some(self)
    }

    fn as_batched(&mut self) -> Option<&mut dyn Batched> {
        self.inner.as_batched()?;
        Some(self)
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        self.inner.as_profiled()
    }
}

impl KvRestore for Checked<'_> {
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        self.admit(step)?;
        let name = self.inner.name().to_string();
        self.inner
            .as_restore()
            .ok_or_else(|| not_restorable(&name, step.layer))?
            .append_kv(step)
    }

    fn attaches_kv(&mut self, seq: usize) -> bool {
        self.inner.as_restore().is_some_and(|r| r.attaches_kv(seq))
    }

    fn attach_tier(&mut self) -> Option<crate::pool::PoolTier> {
        self.inner.as_restore().and_then(|r| r.attach_tier())
    }

    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        self.admit(step)?;
        let name = self.inner.name().to_string();
        self.inner
            .as_restore()
            .ok_or_else(|| not_restorable(&name, step.layer))?
            .attach_kv(step, lease)
    }

    /// Holds no new tokens: the protocol's positions are unchanged.
    fn adopt_kv(&mut self, seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        crate::restore::adopt_kv(self.inner, seq, layer, runs)
    }

    /// Hands back what was stored: the protocol's positions are unchanged.
    fn export_kv(&mut self, seq: usize, layer: usize) -> Result<Option<LayerKv>> {
        crate::restore::export_kv(self.inner, seq, layer)
    }
}

impl Batched for Checked<'_> {
    fn release(&mut self, seq: usize) {
        self.seqs.remove(&seq);
        if let Some(b) = self.inner.as_batched() {
            b.release(seq);
        }
    }

    fn plan(&mut self, loads: &[SeqLoad]) -> Result<Vec<Vec<usize>>> {
        match self.inner.as_batched() {
            Some(b) => b.plan(loads),
            None => Ok(vec![(0..loads.len()).collect()]),
        }
    }

    fn expect(&mut self, seq: usize, tokens: usize) {
        if let Some(b) = self.inner.as_batched() {
            b.expect(seq, tokens);
        }
    }

    fn held(&mut self, seq: usize) -> Option<crate::capabilities::SeqHeld> {
        self.inner.as_batched().and_then(|b| b.held(seq))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::attention::AttnSpec;
    use crate::regen::NoRegen;

    /// A policy that attends nothing: the protocol is all that is tested.
    struct Nothing;

    impl KvPolicy for Nothing {
        fn name(&self) -> &str {
            "nothing"
        }
        fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
            Ok(step.q.clone())
        }
        fn seq_len(&self) -> usize {
            0
        }
        fn reset(&mut self) {}
        fn stats(&self) -> KvStats {
            KvStats::default()
        }
    }

    fn call(p: &mut Checked<'_>, layer: usize, pos: usize, t: usize) -> Result<()> {
        call_seq(p, 0, layer, pos, t)
    }

    fn call_seq(p: &mut Checked<'_>, seq: usize, layer: usize, pos: usize, t: usize) -> Result<()> {
        let x = Tensor::zeros((1, 1, t, 2), DType::F32, &Device::Cpu)?;
        let spec = AttnSpec::new(1, 1, 2);
        p.attend(&AttnStep {
            layer,
            seq,
            q: &x,
            k: &x,
            v: &x,
            x: &x.squeeze(1)?,
            pos,
            spec: &spec,
            regen: &NoRegen,
        })
        .map(|_| ())
    }

    fn protocol_error(r: Result<()>, needle: &str) {
        let message = match r {
            Err(KvError::Protocol(m)) => m,
            other => format!("not a protocol error: {other:?}"),
        };
        assert!(message.contains(needle), "{message} lacks {needle:?}");
    }

    #[test]
    fn calls_in_order_pass_and_out_of_order_are_named() -> Result<()> {
        let mut nothing = Nothing;
        let mut p = Checked::new(&mut nothing);
        // A prefill of 3 then 2 tokens and a decode step, over 2 layers (learned).
        for (pos, t) in [(0, 3), (3, 2), (5, 1)] {
            call(&mut p, 0, pos, t)?;
            call(&mut p, 1, pos, t)?;
        }
        protocol_error(call(&mut p, 1, 6, 1), "expected layer 0");
        protocol_error(call(&mut p, 0, 7, 1), "holds 6 tokens");
        call(&mut p, 0, 6, 1)?;
        protocol_error(call(&mut p, 1, 6, 2), "every layer of a step sees the same");
        protocol_error(call(&mut p, 0, 7, 1), "a new step began after layer 0 of 2");
        call(&mut p, 1, 6, 1)?;
        protocol_error(call(&mut p, 2, 7, 1), "expected layer 0");
        // Reset starts the sequence again.
        p.reset();
        call(&mut p, 0, 0, 4)?;
        Ok(())
    }

    #[test]
    fn a_second_sequence_needs_a_batched_policy() -> Result<()> {
        let mut nothing = Nothing;
        let mut p = Checked::new(&mut nothing);
        call(&mut p, 0, 0, 2)?;
        protocol_error(call_seq(&mut p, 1, 0, 0, 2), "keeps one sequence (slot 0)");
        Ok(())
    }
}
