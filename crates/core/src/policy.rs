//! The boundary every model's attention layer calls: one [`AttnStep`] per layer and
//! forward step, handed to a [`KvPolicy`].
use candle_core::{DType, Device, Tensor};

use crate::attention::AttnSpec;
use crate::error::Result;
use crate::profile::Profile;
use crate::regen::KvRegen;
use crate::stats::KvStats;

/// One attention evaluation of one layer for one forward step.
pub struct AttnStep<'a> {
    /// Layer index, from 0.
    pub layer: usize,
    /// The sequence this step belongs to: 0 for single-sequence runs; in a ragged batch,
    /// the slot the caller gave the request (see [`KvPolicy::batched`]).
    pub seq: usize,
    /// Queries `(b, n_heads, t, head_dim)`, positional encoding applied.
    pub q: &'a Tensor,
    /// The step's new keys `(b, n_kv_heads, t, head_dim)`, positional encoding applied.
    pub k: &'a Tensor,
    /// The step's new values `(b, n_kv_heads, t, head_dim)`.
    pub v: &'a Tensor,
    /// The layer's attention input `(b, t, hidden)` (after the input norm).
    pub x: &'a Tensor,
    /// Position of the step's first token.
    pub pos: usize,
    /// What the attention computes.
    pub spec: &'a AttnSpec,
    /// Rebuilds this layer's K/V from stored inputs.
    pub regen: &'a dyn KvRegen,
}

/// The cache shape a policy will serve, known before the first step.
#[derive(Clone, Debug, PartialEq)]
pub struct KvShape {
    /// Decoder layers.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Width of one token's layer input (what activation-storing policies keep).
    pub hidden: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Dtype of K/V.
    pub dtype: DType,
    /// Most tokens the run will cache (prompt + generation).
    pub max_tokens: usize,
    /// Most tokens one forward step brings (the prefill chunk; 0: `max_tokens`).
    pub step_tokens: usize,
    /// Device bytes of the model's activations per token of a step (the tensors one layer
    /// holds at once besides the KV and attention scratch; 0 when unknown).
    pub activation_bytes_per_token: u64,
    /// Per layer, its sliding window in tokens (`None`: global attention); empty when not
    /// known (a shape read off a step).
    pub windows: Vec<Option<usize>>,
}

impl KvShape {
    /// The shape a step implies: `known` (from `prepare` or an earlier step) with the layer
    /// count raised to cover `layers_seen` and this step's layer, or — when the step's K/V do
    /// not fit `known` — a shape read off the step.
    pub fn for_step(
        known: Option<&KvShape>,
        layers_seen: usize,
        step: &AttnStep<'_>,
    ) -> Result<Self> {
        let (b, nkv, t, d) = step.k.dims4()?;
        let hidden = step.x.dim(2)?;
        let n_layers = layers_seen.max(step.layer + 1);
        Ok(match known {
            Some(s)
                if (s.batch, s.n_kv_heads, s.head_dim, s.hidden, s.dtype)
                    == (b, nkv, d, hidden, step.k.dtype()) =>
            {
                KvShape {
                    n_layers: s.n_layers.max(n_layers),
                    ..s.clone()
                }
            }
            _ => KvShape {
                n_layers,
                n_heads: step.spec.n_heads,
                n_kv_heads: nkv,
                head_dim: d,
                hidden,
                batch: b,
                dtype: step.k.dtype(),
                max_tokens: step.pos + t,
                step_tokens: t,
                activation_bytes_per_token: 0,
                windows: Vec::new(),
            },
        })
    }

    /// Tokens of the largest step.
    pub fn largest_step(&self) -> usize {
        match self.step_tokens {
            0 => self.max_tokens,
            n => n.min(self.max_tokens.max(1)),
        }
    }

    /// Device bytes a step holds besides the KV, planned before the run: the attention
    /// scratch of the largest step over `context` keys, attended `heads` KV heads at a time
    /// ([`crate::attention::scratch_bound`]), plus the model's activations for that step.
    pub fn step_scratch_bytes(&self, heads: usize, context: usize, device: &Device) -> u64 {
        let t = self.largest_step();
        let group = self.n_heads / self.n_kv_heads.max(1);
        let call = crate::attention::CallShape {
            b: self.batch,
            n_kv: heads,
            group,
            t,
            s: context,
            d: self.head_dim,
            half: self.dtype != DType::F32,
        };
        crate::attention::scratch_bound(&call, device) + self.activation_bytes(t)
    }

    /// The model's activation bytes for a step of `t` tokens per sequence.
    pub fn activation_bytes(&self, t: usize) -> u64 {
        (self.batch as u64)
            .saturating_mul(t as u64)
            .saturating_mul(self.activation_bytes_per_token)
    }

    /// Bytes of K and V for `tokens` tokens of `heads` heads (one layer); saturating, so
    /// that a run declared absurdly long (`--max-new-tokens` 10^18) compares as too large
    /// against a budget instead of wrapping around to a small number.
    pub fn kv_bytes(&self, heads: usize, tokens: usize) -> u64 {
        [
            self.batch,
            heads,
            tokens,
            self.head_dim,
            self.dtype.size_in_bytes(),
        ]
        .iter()
        .fold(2u64, |acc, &x| acc.saturating_mul(x as u64))
    }
}

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
///    [`attend`](Self::attend) (or [`append_kv`](Self::append_kv)) once per layer, layers
///    `0..n_layers` in order, each with the same position and token count; layer 0 begins
///    a step. The step's position is the number of tokens the sequence already holds:
///    a prompt is prefilled in chunks, then decode steps bring one token each.
/// 3. In a ragged batch ([`batched`](Self::batched) policies) the steps of different
///    sequences interleave layer by layer, in the order [`plan`](Self::plan) gave, each
///    sequence keeping the order above; [`release`](Self::release) ends one sequence,
///    whose slot may start again at position 0.
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
    /// Stores the step's new K/V where [`attend`](Self::attend) would, without computing
    /// the attention (`step.q` is not read): K/V computed elsewhere — a restored session, a
    /// shared prefix — or a synthetic history for timing decode at contexts whose prefill
    /// would take hours (`kvbench --synthetic-history`). Later steps continue the sequence
    /// as after a prefill. Policies that store something else (inputs to regenerate from)
    /// say so with [`KvError::Unsupported`](crate::KvError::Unsupported), the default.
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        Err(crate::error::KvError::Unsupported(format!(
            "`{}` does not take K/V without computing attention (append_kv; layer {}); \
             `full`, `layer` and `headwise` do",
            self.name(),
            step.layer
        )))
    }
    /// Tokens cached (per layer).
    fn seq_len(&self) -> usize;
    /// Forgets every cached token and frees the buffers; counters restart.
    fn reset(&mut self);
    /// Memory and traffic counters.
    fn stats(&self) -> KvStats;
    /// The cost profile the policy plans with, once known (`recompute`, `hybrid`).
    fn profile(&self) -> Option<&Profile> {
        None
    }
    /// Whether the policy keeps one cache per [`AttnStep::seq`], so that requests of
    /// different lengths can share forward passes. Policies that do not are served in
    /// batches through [`crate::PerSequence`].
    fn batched(&self) -> bool {
        false
    }
    /// Frees the cache of sequence `seq` (a finished request); the others go on. A
    /// single-sequence policy forgets everything, as [`KvPolicy::reset`].
    fn release(&mut self, seq: usize) {
        let _ = seq;
        self.reset();
    }
    /// Splits the sequences of the next step into mini-batches, in the order the model
    /// should run them (layer by layer across mini-batches); each inner list holds indices
    /// into `loads`. The default is one mini-batch holding every sequence.
    fn plan(&mut self, loads: &[SeqLoad]) -> Result<Vec<Vec<usize>>> {
        Ok(vec![(0..loads.len()).collect()])
    }
}

/// What one sequence brings to the next forward step, for [`KvPolicy::plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqLoad {
    /// The sequence's slot ([`AttnStep::seq`]).
    pub seq: usize,
    /// Tokens it has cached.
    pub cached: usize,
    /// Tokens the step adds.
    pub new: usize,
}
