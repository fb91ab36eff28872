//! The one attention layer every model shares: projections, positional encoding, and the
//! call into the [`KvPolicy`] — the only place where a model touches its KV cache.
//!
//! It also implements [`KvRegen`]: given stored attention inputs `X`, it recomputes K and V
//! exactly as the forward pass does (projection, bias, RoPE at the original positions),
//! which partial recompute (KVPR §3.1) and activation blocks (HybridServe §4.1) rely on.
use candle_core::Tensor;
use kvpolicy_core::{AttnSpec, AttnStep, KvError, KvPolicy, KvRegen};

use crate::error::Result;
use crate::layers::Linear;
use crate::rope::Rope;

/// Projections, RoPE and attention spec of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    /// Layer index.
    pub layer: usize,
    /// Query projection.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Output projection.
    pub o: Linear,
    /// Positional encoding (`None` for learned absolute positions).
    pub rope: Option<Rope>,
    /// What the attention computes.
    pub spec: AttnSpec,
}

impl Attention {
    fn heads(&self, x: &Tensor, proj: &Linear, n: usize) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        Ok(proj
            .forward(x)?
            .reshape((b, t, n, self.spec.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// Attention of one step: `x` `(b, t, hidden)` is the layer's normalised input, its first
    /// token at position `pos`; returns `(b, t, hidden)`.
    pub fn forward(&self, x: &Tensor, pos: usize, policy: &mut dyn KvPolicy) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let mut q = self.heads(x, &self.q, self.spec.n_heads)?;
        let mut k = self.heads(x, &self.k, self.spec.n_kv_heads)?;
        let v = self.heads(x, &self.v, self.spec.n_kv_heads)?;
        if let Some(rope) = &self.rope {
            let (cos, sin) = rope.cos_sin(pos, t, q.dtype(), q.device())?;
            q = rope.apply_with(&q, &cos, &sin)?;
            k = rope.apply_with(&k, &cos, &sin)?;
        }
        let out = policy.attend(&AttnStep {
            layer: self.layer,
            q: &q,
            k: &k,
            v: &v,
            x,
            pos,
            spec: &self.spec,
            regen: self,
        })?;
        let out = out
            .transpose(1, 2)?
            .reshape((b, t, self.spec.n_heads * self.spec.head_dim))?;
        self.o.forward(&out)
    }
}

impl KvRegen for Attention {
    fn regen(&self, x: &Tensor, pos: usize) -> kvpolicy_core::Result<(Tensor, Tensor)> {
        let run = || -> Result<(Tensor, Tensor)> {
            let mut k = self.heads(x, &self.k, self.spec.n_kv_heads)?;
            let v = self.heads(x, &self.v, self.spec.n_kv_heads)?;
            if let Some(rope) = &self.rope {
                k = rope.apply(&k, pos)?;
            }
            Ok((k, v))
        };
        run().map_err(|e| match e {
            crate::error::ModelError::Candle(c) => KvError::Candle(c),
            crate::error::ModelError::Policy(p) => p,
            other => KvError::Step(other.to_string()),
        })
    }

    fn flops_per_token(&self) -> u64 {
        (2 * self.k.in_dim() * (self.k.out_dim() + self.v.out_dim())) as u64
    }
}
