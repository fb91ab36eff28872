//! The eager attention: every score of a call materialised as one `(b, kv_heads, g·t, s)`
//! f32 tensor with a `t × s` mask, as HF transformers' eager attention does. Its memory
//! grows with `t · s`, so the policies do not run it on whole calls; it is the reference
//! the tiled attention is tested against, and the tiled path for devices without a kernel
//! runs it on one tile at a time ([`super::tiled`]).
use candle_core::{DType, Tensor, D};

use super::spec::{AttnInputs, AttnSpec, Partial};
use crate::error::{KvError, Result};

/// The additive mask for queries at `q_pos..q_pos+t` over keys at `k_pos..k_pos+s`, or
/// `None` when every query sees every key.
pub fn mask_values(
    t: usize,
    s: usize,
    q_pos: usize,
    k_pos: usize,
    spec: &AttnSpec,
) -> Option<Vec<f32>> {
    let visible = |i: usize, j: usize| {
        let (qp, kp) = (q_pos + i, k_pos + j);
        if !spec.causal {
            return true;
        }
        kp <= qp && kp >= spec.window_start(qp)
    };
    let all = visible(0, s.saturating_sub(1))
        && (s == 0 || visible(0, 0))
        && (t == 0 || (visible(t - 1, 0) && visible(t - 1, s.saturating_sub(1))));
    // Visibility is monotone along both axes: checking the corners decides "all visible".
    if all {
        return None;
    }
    let mut m = vec![0f32; t * s];
    for i in 0..t {
        for j in 0..s {
            if !visible(i, j) {
                m[i * s + j] = f32::NEG_INFINITY;
            }
        }
    }
    Some(m)
}

struct Scores {
    /// `(b, n_kv, g*t, s)` in f32, masked and capped.
    scores: Tensor,
    dims: (usize, usize, usize, usize, usize, usize),
}

fn scores(q: &Tensor, k: &Tensor, q_pos: usize, k_pos: usize, spec: &AttnSpec) -> Result<Scores> {
    let (b, nh, t, d) = q.dims4()?;
    let (kb, nkv, s, kd) = k.dims4()?;
    if kb != b || kd != d || nkv == 0 || nh % nkv != 0 {
        return Err(KvError::Shape(format!(
            "queries {:?} do not fit keys {:?}",
            q.dims(),
            k.dims()
        )));
    }
    let g = nh / nkv;
    let q = q.contiguous()?.reshape((b, nkv, g * t, d))?;
    let k = k.to_dtype(q.dtype())?.contiguous()?;
    let mut sc = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    sc = (sc * spec.scale)?;
    if let Some(cap) = spec.softcap {
        sc = ((sc / cap)?.tanh()? * cap)?;
    }
    if let Some(m) = mask_values(t, s, q_pos, k_pos, spec) {
        let m = Tensor::from_vec(m, (t, s), q.device())?;
        sc = sc
            .reshape((b, nkv, g, t, s))?
            .broadcast_add(&m)?
            .reshape((b, nkv, g * t, s))?;
    }
    Ok(Scores {
        scores: sc,
        dims: (b, nh, nkv, g, t, d),
    })
}

/// Attention of `q` `(b, n_heads, t, d)` over `k`, `v` `(b, n_kv_heads, s, d)`; returns
/// `(b, n_heads, t, d)` in the dtype of `q`. Queries sit at `q_pos..`, keys at `k_pos..`.
pub fn attend_eager(x: AttnInputs<'_>, spec: &AttnSpec) -> Result<Tensor> {
    let AttnInputs {
        q,
        k,
        v,
        q_pos,
        k_pos,
    } = x;
    let Scores { scores, dims } = scores(q, k, q_pos, k_pos, spec)?;
    let (b, nh, _nkv, _g, t, d) = dims;
    let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    let o = p.matmul(&v.contiguous()?)?;
    Ok(o.reshape((b, nh, t, d))?.to_dtype(q.dtype())?)
}

/// Like [`attend_eager`] but returns the f32 output together with each row's log-sum-exp, so
/// that attentions over disjoint key sets can be merged with [`super::merge_partials`].
pub fn attend_partial_eager(x: AttnInputs<'_>, spec: &AttnSpec) -> Result<Partial> {
    let AttnInputs {
        q,
        k,
        v,
        q_pos,
        k_pos,
    } = x;
    if k.dim(2)? == 0 {
        // No keys: contributes nothing to a merge.
        let (b, nh, t, d) = q.dims4()?;
        return Partial::empty(b, nh, t, d, q.device());
    }
    let Scores { scores, dims } = scores(q, k, q_pos, k_pos, spec)?;
    let (b, nh, _nkv, _g, t, d) = dims;
    // A row that sees no key has max = -inf; clamping keeps exp() at 0 instead of NaN.
    let m = scores.max_keepdim(D::Minus1)?.clamp(f32::MIN, f32::MAX)?;
    let p = scores.broadcast_sub(&m)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    let o = p
        .to_dtype(v.dtype())?
        .matmul(&v.contiguous()?)?
        .to_dtype(DType::F32)?;
    let o = o.broadcast_div(&l.clamp(f32::MIN_POSITIVE, f32::MAX)?)?;
    let lse = (m + l.log()?)?;
    let scratch_bytes = 2 * scores.elem_count() as u64 * 4;
    Ok(Partial {
        out: o.reshape((b, nh, t, d))?,
        lse: lse.reshape((b, nh, t))?,
        scratch_bytes,
    })
}
