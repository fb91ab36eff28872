//! The boundary every model's attention layer calls: one [`AttnStep`] per layer and
//! forward step, handed to a [`KvPolicy`]. The trait holds what every policy does; what
//! only some do are optional traits ([`crate::capabilities`]) discovered from it.
use candle_core::Tensor;

use crate::capabilities::{Batched, KvRestore, Profiled, ShardLocal};
use crate::error::Result;
use crate::stats::KvStats;
use crate::step::{AttnStep, KvShape};

/// A KV-cache policy: stores each step's new K/V (or activations) where it decides and
/// returns the attention output (exact, for every policy of this workspace but the
/// approximate ones, which say so).
///
/// # Call protocol
///
/// A model calls a policy in this order, and a policy may rely on it
/// ([`Checked`](crate::protocol::Checked) verifies it, and the tests run every policy under
/// it):
///
/// 1. [`prepare`](Self::prepare), optionally, before the first step (and again after
///    [`reset`](Self::reset)): the shape the run will have, so that what cannot work fails
///    before any compute.
/// 2. Forward steps. A step of a sequence ([`AttnStep::seq`]) calls
///    [`attend`](Self::attend) (or [`KvRestore::append_kv`]) once per layer, layers
///    `0..n_layers` in order, each with the same position and token count; layer 0 begins
///    a step. The step's position is the number of tokens the sequence already holds:
///    a prompt is prefilled in chunks, then decode steps bring one token each.
/// 3. In a ragged batch ([`Batched`] policies) the steps of different sequences
///    interleave layer by layer, in the order [`Batched::plan`] gave, each sequence keeping
///    the order above; [`Batched::release`] ends one sequence, whose slot may start again
///    at position 0.
/// 4. [`reset`](Self::reset) forgets every sequence: the next step starts at position 0.
///
/// [`stats`](Self::stats), [`seq_len`](Self::seq_len) and [`name`](Self::name) may be called
/// at any time.
pub trait KvPolicy: Send {
    /// The registry name of the policy (`"full"`, `"headwise"`, …).
    fn name(&self) -> &str;
    /// Checks the options against the model and sizes what can be sized before the first
    /// step, so that a budget or option that cannot work fails before any compute.
    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        let _ = shape;
        Ok(())
    }
    /// Stores the step's new entries and returns the attention output `(b, n_heads, t, head_dim)`.
    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor>;
    /// The attention of a layer that projects no K/V of its own (MLKV, [`crate::shared`])
    /// over the cache of KV layer `step.layer`, whose `attend` this step has just run:
    /// `step.q` and `step.spec` are the reading layer's, `step.k`, `step.v`, `step.x` and
    /// `step.regen` the owner's (as its `attend` got them). Stores nothing. Comes after the
    /// owner's `attend` and before the next layer's (any number of readers, in order), for
    /// the layers [`KvShape::readers`] announced. The default: an error saying the policy
    /// cannot serve such a model.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let _ = step;
        Err(crate::shared::not_shareable(self.name()))
    }
    /// Tokens cached (per layer).
    fn seq_len(&self) -> usize;
    /// Forgets every cached token and frees the buffers; counters restart.
    fn reset(&mut self);
    /// Memory and traffic counters.
    fn stats(&self) -> KvStats;
    /// The policy as a [`KvRestore`]: it stores K/V given without attention. `None` (the
    /// default) for policies that store something else (inputs to regenerate from).
    fn as_restore(&mut self) -> Option<&mut dyn KvRestore> {
        None
    }
    /// The policy as [`Batched`]: it keeps one cache per sequence. `None` (the default):
    /// one sequence at a time, batched through [`crate::PerSequence`].
    fn as_batched(&mut self) -> Option<&mut dyn Batched> {
        None
    }
    /// The policy as [`Profiled`]: it plans with a cost profile (`recompute`, `hybrid`).
    fn as_profiled(&self) -> Option<&dyn Profiled> {
        None
    }
    /// The policy as [`ShardLocal`]: it can hold one rank's share of a sequence (the
    /// `helix` policy's local policy). `None` (the default) for policies that cannot.
    fn as_shard(&mut self) -> Option<&mut dyn ShardLocal> {
        None
    }
}
