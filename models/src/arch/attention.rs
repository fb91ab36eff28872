//! The one attention layer every model shares: projections, positional encoding, and the
//! call into the [`KvPolicy`] — the only place where a model touches its KV cache.
//!
//! A layer without K/V projections of its own (MLKV, arXiv 2406.09297 §3: only some layers
//! project K/V) reads the cache of the KV layer below it: its queries go to
//! [`KvPolicy::attend_shared`] with that layer's step K/V ([`OwnerKv`]), and the policy
//! stores nothing for it.
//!
//! It also implements [`KvRegen`]: given stored attention inputs `X`, it recomputes K and V
//! exactly as the forward pass does (projection, bias, RoPE at the original positions),
//! which partial recompute (KVPR §3.1) and activation blocks (HybridServe §4.1) rely on.
use candle_core::Tensor;
use kvpolicy_core::{AttnSpec, AttnStep, KvError, KvPolicy, KvRegen};
use kvpolicy_kernels::heads_into;

use crate::arch::layers::{Linear, Norm};
use crate::arch::rope::Rope;
use crate::error::Result;

/// A layer's own key and value projections.
#[derive(Debug, Clone)]
pub struct KvProjections {
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// RMSNorm over each key head before RoPE (Gemma 3).
    pub k_norm: Option<Norm>,
}

/// Projections, RoPE and attention spec of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    /// The KV layer the policy knows it by ([`AttnStep::layer`]): the layer's own index
    /// among the layers that project K/V, or for a layer without projections, its owner's.
    pub layer: usize,
    /// Query projection.
    pub q: Linear,
    /// Key and value projections; `None` for a layer that reads layer `layer`'s cache.
    pub kv: Option<KvProjections>,
    /// Output projection.
    pub o: Linear,
    /// Positional encoding (`None` for learned absolute positions).
    pub rope: Option<Rope>,
    /// RMSNorm over each query head before RoPE (Gemma 3).
    pub q_norm: Option<Norm>,
    /// What the attention computes.
    pub spec: AttnSpec,
}

/// One sequence's K/V as a KV layer's step made them, kept for the layers that read its
/// cache in the same step.
#[derive(Debug, Clone)]
pub struct SegmentKv {
    /// Keys `(1 or b, kv_heads, t, head_dim)`, RoPE applied.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// The KV layer's normalised input.
    pub x: Tensor,
}

/// The last KV layer's step, for the layers that read its cache: the layer itself (it
/// regenerates K/V for the policies that store inputs) and each sequence's K/V.
#[derive(Debug, Clone)]
pub struct OwnerKv<'a> {
    /// The KV layer.
    pub attn: &'a Attention,
    /// Per sequence of the step (one for an unbatched step), in segment order.
    pub segments: Vec<SegmentKv>,
}

fn no_owner(layer: usize) -> crate::error::ModelError {
    crate::error::ModelError::Input(
        format!("a layer reading KV layer {layer}'s cache ran before any KV layer").into(),
    )
}

/// `norm` over the last dimension (one head's width) of `x`, if there is one.
fn per_head(norm: &Option<Norm>, x: Tensor) -> Result<Tensor> {
    match norm {
        Some(n) => n.forward(&x),
        None => Ok(x),
    }
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

    /// Query heads `(b, heads, t, head_dim)`, normalised where the model says so.
    fn queries(&self, x: &Tensor) -> Result<Tensor> {
        per_head(&self.q_norm, self.heads(x, &self.q, self.spec.n_heads)?)
    }

    /// The layer's K/V projections, or an error for a layer that reads another's cache.
    fn own(&self) -> Result<&KvProjections> {
        self.kv.as_ref().ok_or_else(|| {
            crate::error::ModelError::Input(
                format!(
                    "this layer reads KV layer {}'s cache and has no K/V projections",
                    self.layer
                )
                .into(),
            )
        })
    }

    /// Key heads `(b, kv_heads, t, head_dim)`, normalised where the model says so.
    fn keys(&self, x: &Tensor) -> Result<Tensor> {
        let kv = self.own()?;
        per_head(&kv.k_norm, self.heads(x, &kv.k, self.spec.n_kv_heads)?)
    }

    /// Value heads `(b, kv_heads, t, head_dim)`.
    fn values(&self, x: &Tensor) -> Result<Tensor> {
        self.heads(x, &self.own()?.v, self.spec.n_kv_heads)
    }

    /// Attention of one step: `x` `(b, t, hidden)` is the layer's normalised input, its first
    /// token at position `pos`; returns `(b, t, hidden)`. A KV layer leaves its step's K/V
    /// in `owner` for the layers that read its cache; such a layer reads them there.
    pub fn forward<'a>(
        &'a self,
        x: &Tensor,
        pos: usize,
        policy: &mut dyn KvPolicy,
        owner: &mut Option<OwnerKv<'a>>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let mut q = self.queries(x)?;
        let cos_sin = match &self.rope {
            Some(rope) => Some(rope.cos_sin(pos, t, q.dtype(), q.device())?),
            None => None,
        };
        if let (Some(rope), Some((cos, sin))) = (&self.rope, &cos_sin) {
            q = rope.apply_with(&q, cos, sin)?;
        }
        let out = if self.kv.is_some() {
            let mut k = self.keys(x)?;
            let v = self.values(x)?;
            if let (Some(rope), Some((cos, sin))) = (&self.rope, &cos_sin) {
                k = rope.apply_with(&k, cos, sin)?;
            }
            let out = policy.attend(&AttnStep {
                layer: self.layer,
                seq: 0,
                q: &q,
                k: &k,
                v: &v,
                x,
                pos,
                spec: &self.spec,
                regen: self,
            })?;
            *owner = Some(OwnerKv {
                attn: self,
                segments: vec![SegmentKv { k, v, x: x.clone() }],
            });
            out
        } else {
            let o = owner.as_ref().ok_or_else(|| no_owner(self.layer))?;
            let seg = o.segments.first().ok_or_else(|| no_owner(self.layer))?;
            policy.attend_shared(&AttnStep {
                layer: o.attn.layer,
                seq: 0,
                q: &q,
                k: &seg.k,
                v: &seg.v,
                x: &seg.x,
                pos,
                spec: &self.spec,
                regen: o.attn,
            })?
        };
        let out = out
            .transpose(1, 2)?
            .reshape((b, t, self.spec.n_heads * self.spec.head_dim))?;
        self.o.forward(&out)
    }
}

/// One sequence's slice of a packed (ragged) step: `len` rows from row `offset` of the
/// packed tokens, the first at position `pos` of sequence `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The sequence's slot ([`AttnStep::seq`]).
    pub seq: usize,
    /// Position of the segment's first token in its sequence.
    pub pos: usize,
    /// First row in the packed tokens.
    pub offset: usize,
    /// Rows (tokens).
    pub len: usize,
}

impl Attention {
    /// Attention of a packed step of several sequences: `x` `(1, T, hidden)` holds the
    /// segments' tokens back to back. The projections run once over all `T` rows; each
    /// segment gets its own positions and attends only over its own sequence's cache, so
    /// no token sees another sequence and there is no padding to mask.
    pub fn forward_packed<'a>(
        &'a self,
        x: &Tensor,
        segments: &[Segment],
        policy: &mut dyn KvPolicy,
        owner: &mut Option<OwnerKv<'a>>,
    ) -> Result<Tensor> {
        let (_, total, _) = x.dims3()?;
        let (nh, nkv, d) = (self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim);
        let q_all = self.q.forward(x)?;
        let Some(kv) = &self.kv else {
            return self.read_packed(x, &q_all, segments, policy, owner);
        };
        let k_all = kv.k.forward(x)?;
        let v_all = kv.v.forward(x)?;
        let split = |a: &Tensor, seg: &Segment, n: usize| -> Result<Tensor> {
            Ok(a.narrow(1, seg.offset, seg.len)?
                .reshape((1, seg.len, n, d))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let mut outs = Vec::with_capacity(segments.len());
        let mut kept = Vec::with_capacity(segments.len());
        for seg in segments {
            let mut q = per_head(&self.q_norm, split(&q_all, seg, nh)?)?;
            let mut k = per_head(&kv.k_norm, split(&k_all, seg, nkv)?)?;
            let v = split(&v_all, seg, nkv)?;
            if let Some(rope) = &self.rope {
                let (cos, sin) = rope.cos_sin(seg.pos, seg.len, q.dtype(), q.device())?;
                q = rope.apply_with(&q, &cos, &sin)?;
                k = rope.apply_with(&k, &cos, &sin)?;
            }
            let xs = x.narrow(1, seg.offset, seg.len)?;
            let out = policy.attend(&AttnStep {
                layer: self.layer,
                seq: seg.seq,
                q: &q,
                k: &k,
                v: &v,
                x: &xs,
                pos: seg.pos,
                spec: &self.spec,
                regen: self,
            })?;
            outs.push(out.transpose(1, 2)?.reshape((1, seg.len, nh * d))?);
            kept.push(SegmentKv { k, v, x: xs });
        }
        *owner = Some(OwnerKv {
            attn: self,
            segments: kept,
        });
        self.finish_packed(outs, total)
    }

    /// A packed step of a layer that reads `owner`'s cache: each segment's queries attend
    /// over its sequence's cache of that layer.
    fn read_packed(
        &self,
        x: &Tensor,
        q_all: &Tensor,
        segments: &[Segment],
        policy: &mut dyn KvPolicy,
        owner: &Option<OwnerKv<'_>>,
    ) -> Result<Tensor> {
        let (_, total, _) = x.dims3()?;
        let (nh, d) = (self.spec.n_heads, self.spec.head_dim);
        let o = owner.as_ref().ok_or_else(|| no_owner(self.layer))?;
        if o.segments.len() != segments.len() {
            return Err(no_owner(self.layer));
        }
        let mut outs = Vec::with_capacity(segments.len());
        for (seg, kv) in segments.iter().zip(&o.segments) {
            let q = q_all
                .narrow(1, seg.offset, seg.len)?
                .reshape((1, seg.len, nh, d))?
                .transpose(1, 2)?
                .contiguous()?;
            let mut q = per_head(&self.q_norm, q)?;
            if let Some(rope) = &self.rope {
                let (cos, sin) = rope.cos_sin(seg.pos, seg.len, q.dtype(), q.device())?;
                q = rope.apply_with(&q, &cos, &sin)?;
            }
            let out = policy.attend_shared(&AttnStep {
                layer: o.attn.layer,
                seq: seg.seq,
                q: &q,
                k: &kv.k,
                v: &kv.v,
                x: &kv.x,
                pos: seg.pos,
                spec: &self.spec,
                regen: o.attn,
            })?;
            outs.push(out.transpose(1, 2)?.reshape((1, seg.len, nh * d))?);
        }
        self.finish_packed(outs, total)
    }

    /// The segments' outputs joined and projected.
    fn finish_packed(&self, outs: Vec<Tensor>, total: usize) -> Result<Tensor> {
        let out = Tensor::cat(&outs, 1)?;
        if out.dim(1)? != total {
            return Err(crate::error::ModelError::Input(
                format!(
                    "the segments cover {} of the {total} packed tokens",
                    out.dim(1)?
                )
                .into(),
            ));
        }
        self.o.forward(&out)
    }
}

fn kv_error(e: crate::error::ModelError) -> KvError {
    match e {
        crate::error::ModelError::Candle(c) => KvError::Candle(c),
        crate::error::ModelError::Policy(p) => p,
        other => KvError::Regen(other.to_string()),
    }
}

impl KvRegen for Attention {
    fn regen(&self, x: &Tensor, pos: usize) -> kvpolicy_core::Result<(Tensor, Tensor)> {
        let run = || -> Result<(Tensor, Tensor)> {
            let mut k = self.keys(x)?;
            let v = self.values(x)?;
            if let Some(rope) = &self.rope {
                k = rope.apply(&k, pos)?;
            }
            Ok((k, v))
        };
        run().map_err(kv_error)
    }

    fn regen_into(
        &self,
        x: &Tensor,
        pos: usize,
        k_buf: &Tensor,
        v_buf: &Tensor,
        offset: usize,
    ) -> kvpolicy_core::Result<()> {
        // The projections (cuBLAS / gemm through candle), then one pass each that splits
        // the rows into heads, rotates K and writes into the destination range.
        let run = || -> Result<()> {
            let (b, t, _) = x.dims3()?;
            let kv = self.own()?;
            let mut k = kv.k.forward(x)?.contiguous()?;
            if kv.k_norm.is_some() {
                let (nkv, d) = (self.spec.n_kv_heads, self.spec.head_dim);
                let heads = k.reshape((b, t, nkv, d))?;
                k = per_head(&kv.k_norm, heads)?
                    .reshape((b, t, nkv * d))?
                    .contiguous()?;
            }
            let v = kv.v.forward(x)?.contiguous()?;
            let rope = match &self.rope {
                Some(r) => {
                    let (cos, sin) = r.cos_sin(pos, t, k.dtype(), k.device())?;
                    Some((cos, sin, r.rotation()))
                }
                None => None,
            };
            let k_dst = k_buf.narrow(2, offset, t)?;
            let v_dst = v_buf.narrow(2, offset, t)?;
            heads_into(&k_dst, &k, rope.as_ref().map(|(c, s, r)| (c, s, *r)))?;
            heads_into(&v_dst, &v, None)?;
            Ok(())
        };
        run().map_err(kv_error)
    }

    fn regen_at(&self, x: &Tensor, positions: &[usize]) -> kvpolicy_core::Result<(Tensor, Tensor)> {
        let run = || -> Result<(Tensor, Tensor)> {
            if x.dim(1)? != positions.len() {
                return Err(crate::error::ModelError::Input(
                    format!(
                        "{} stored inputs but {} positions to regenerate",
                        x.dim(1)?,
                        positions.len()
                    )
                    .into(),
                ));
            }
            let mut k = self.keys(x)?;
            let v = self.values(x)?;
            if let Some(rope) = &self.rope {
                let (cos, sin) = rope.cos_sin_at(positions, k.dtype(), k.device())?;
                k = rope.apply_with(&k, &cos, &sin)?;
            }
            Ok((k, v))
        };
        run().map_err(kv_error)
    }

    fn flops_per_token(&self) -> u64 {
        self.kv.as_ref().map_or(0, |kv| {
            (2 * kv.k.in_dim() * (kv.k.out_dim() + kv.v.out_dim())) as u64
        })
    }
}
