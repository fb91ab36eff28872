//! Rebuilding a layer's keys and values from its stored attention inputs (KVPR §3.1):
//! what activation-storing policies (`recompute`, `hybrid`) ask the model for through
//! [`KvRegen`], and [`NoRegen`] for steps built outside a model.
use candle_core::Tensor;

use crate::error::Result;

/// Rebuilds a layer's keys and values from its stored attention inputs (KVPR §3.1):
/// `K = X·Wk (+b)`, `V = X·Wv (+b)`, then the positional encoding of K.
pub trait KvRegen {
    /// K and V, each `(b, n_kv_heads, t, head_dim)`, for inputs `x` `(b, t, hidden)` whose
    /// first token sits at position `pos`.
    fn regen(&self, x: &Tensor, pos: usize) -> Result<(Tensor, Tensor)>;
    /// Floating-point operations that regenerating one token costs.
    fn flops_per_token(&self) -> u64;
    /// Regenerates K and V of inputs `x` `(b, t, hidden)` at positions `pos..` straight
    /// into tokens `offset..offset+t` of `k_buf` and `v_buf`, contiguous
    /// `(b, n_kv_heads, capacity, head_dim)` device buffers. The default writes
    /// [`KvRegen::regen`]'s tensors; models write the projections through one fused kernel
    /// instead (`kvpolicy-kernels`).
    fn regen_into(
        &self,
        x: &Tensor,
        pos: usize,
        k_buf: &Tensor,
        v_buf: &Tensor,
        offset: usize,
    ) -> Result<()> {
        let (k, v) = self.regen(x, pos)?;
        k_buf.slice_set(&k.contiguous()?, 2, offset)?;
        v_buf.slice_set(&v.contiguous()?, 2, offset)?;
        Ok(())
    }
    /// K and V for inputs `x` `(b, t, hidden)` whose row `i` sits at position
    /// `positions[i]` (rows need not be contiguous; HybridServe's activation blocks). The
    /// default regenerates each run of consecutive positions with [`KvRegen::regen`].
    fn regen_at(&self, x: &Tensor, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut start = 0;
        while start < positions.len() {
            let mut end = start + 1;
            while end < positions.len() && positions[end] == positions[end - 1] + 1 {
                end += 1;
            }
            let (k, v) = self.regen(&x.narrow(1, start, end - start)?, positions[start])?;
            ks.push(k);
            vs.push(v);
            start = end;
        }
        if ks.is_empty() {
            return Err(crate::error::KvError::Regen(
                "nothing to regenerate: no positions given".into(),
            ));
        }
        Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
    }
}

/// A [`KvRegen`] with nothing to regenerate from, for steps built outside a model — K/V
/// restored with [`KvRestore::append_kv`](crate::KvRestore::append_kv), policies driven directly — whose policy stores
/// K/V: asking it to regenerate is a [`KvError::Regen`](crate::KvError::Regen).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoRegen;

impl KvRegen for NoRegen {
    fn regen(&self, _x: &Tensor, _pos: usize) -> Result<(Tensor, Tensor)> {
        Err(crate::error::KvError::Regen(
            "this step has no layer inputs to regenerate K/V from (it was built outside a \
             model); use a policy that stores K/V"
                .into(),
        ))
    }

    fn flops_per_token(&self) -> u64 {
        0
    }
}
