//! What a model hands a policy: one [`AttnStep`] per layer and forward step, and the
//! [`KvShape`] of the cache it will need, known before the first step.
use candle_core::{DType, Device, Tensor};

use crate::attention::AttnSpec;
use crate::error::Result;
use crate::regen::KvRegen;
use crate::storage::KvCodec;

/// One attention evaluation of one layer for one forward step.
pub struct AttnStep<'a> {
    /// Layer index, from 0.
    pub layer: usize,
    /// The sequence this step belongs to: 0 for single-sequence runs; in a ragged batch,
    /// the slot the caller gave the request (see [`Batched`](crate::Batched)).
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
    /// Per layer, how many other layers of the model read its cache through
    /// [`KvPolicy::attend_shared`](crate::KvPolicy::attend_shared) (MLKV, [`crate::shared`]);
    /// empty when no layer does. `n_layers` counts the KV layers only.
    pub readers: Vec<usize>,
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
                readers: Vec::new(),
            },
        })
    }

    /// The shape as K/V are stored in `codec`: its dtype, and a row's width in that dtype's
    /// elements (q8_0: bytes of blocks), so that [`Self::kv_bytes`] counts stored bytes.
    /// For byte counts only: its `head_dim` is not the heads' width, so plan attention
    /// scratch on the model's shape (with the stored dtype).
    pub fn stored_as(&self, codec: KvCodec) -> KvShape {
        let (dtype, head_dim) = codec.stored(self.dtype, self.head_dim);
        KvShape {
            dtype,
            head_dim,
            ..self.clone()
        }
    }

    /// Whether another layer reads layer `layer`'s cache.
    pub fn has_readers(&self, layer: usize) -> bool {
        self.readers.get(layer).is_some_and(|&n| n > 0)
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
