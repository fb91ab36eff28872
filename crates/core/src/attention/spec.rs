//! What an attention call takes ([`AttnInputs`]) and computes ([`AttnSpec`]), and a partial
//! result over some of the keys, with its log-sum-exp ([`Partial`]), merged exactly by
//! [`merge_partials`].
use candle_core::{DType, Device, Tensor, D};

use crate::error::{KvError, Result};

/// One attention call's inputs: queries `q` `(b, n_heads, t, d)` at absolute positions
/// `q_pos..q_pos + t`, and keys `k` and values `v` `(b, n_kv_heads, s, d)` at
/// `k_pos..k_pos + s` (a piece of the cache starts at its first token's position).
#[derive(Clone, Copy, Debug)]
pub struct AttnInputs<'a> {
    /// Queries.
    pub q: &'a Tensor,
    /// Keys.
    pub k: &'a Tensor,
    /// Values.
    pub v: &'a Tensor,
    /// Position of the first query.
    pub q_pos: usize,
    /// Position of the first key.
    pub k_pos: usize,
}

/// What a layer's attention computes: head counts, scale, causality, window and soft-cap.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnSpec {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Factor applied to `q·k` before the softmax (usually `1/sqrt(head_dim)`).
    pub scale: f64,
    /// Whether a query sees only keys at or before its own position.
    pub causal: bool,
    /// Sliding window: a query at position `p` sees keys at positions `> p - window`.
    pub sliding_window: Option<usize>,
    /// Attention-logit soft-cap (Gemma 2).
    pub softcap: Option<f64>,
}

impl AttnSpec {
    /// A causal attention with the usual `1/sqrt(head_dim)` scale, no window, no cap.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f64).sqrt(),
            causal: true,
            sliding_window: None,
            softcap: None,
        }
    }

    /// Query heads served by one KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads.max(1)
    }

    /// First key position a query at `q_pos` can see (0 without a window).
    pub fn window_start(&self, q_pos: usize) -> usize {
        match self.sliding_window {
            Some(w) if self.causal => (q_pos + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// Checks that the spec is self-consistent.
    pub fn validate(&self) -> Result<()> {
        if self.n_kv_heads == 0
            || self.n_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(KvError::Shape(format!(
                "{} query heads cannot be grouped over {} KV heads",
                self.n_heads, self.n_kv_heads
            )));
        }
        if self.sliding_window == Some(0) {
            return Err(KvError::Shape("a sliding window of 0 tokens".into()));
        }
        Ok(())
    }
}

/// An attention over part of the keys: its normalised output and per-row log-sum-exp.
#[derive(Clone, Debug)]
pub struct Partial {
    /// `(b, heads, t, head_dim)`, f32.
    pub out: Tensor,
    /// `(b, heads, t)`, f32; `-inf` where the row saw no key.
    pub lse: Tensor,
    /// Most bytes of attention scratch (score tiles, running results) alive at once while
    /// computing it; not the output.
    pub scratch_bytes: u64,
}

impl Partial {
    /// The attention over no keys: output 0, log-sum-exp `-inf` (contributes nothing to a
    /// merge).
    pub fn empty(b: usize, heads: usize, t: usize, d: usize, dev: &Device) -> Result<Self> {
        Ok(Partial {
            out: Tensor::zeros((b, heads, t, d), DType::F32, dev)?,
            lse: Tensor::full(f32::NEG_INFINITY, (b, heads, t), dev)?,
            scratch_bytes: 0,
        })
    }
}

/// Merges attentions over disjoint key sets into the attention over their union.
pub fn merge_partials(parts: &[Partial]) -> Result<Partial> {
    let Some(first) = parts.first() else {
        return Err(KvError::invariant("no partial attention to merge"));
    };
    if parts.len() == 1 {
        return Ok(first.clone());
    }
    let mut max = first.lse.clone();
    for p in &parts[1..] {
        max = max.maximum(&p.lse)?;
    }
    let max = max.clamp(f32::MIN, f32::MAX)?;
    let mut num: Option<Tensor> = None;
    let mut den: Option<Tensor> = None;
    for p in parts {
        let w = (&p.lse - &max)?.exp()?;
        let contrib = p.out.broadcast_mul(&w.unsqueeze(D::Minus1)?)?;
        num = Some(match num {
            None => contrib,
            Some(n) => (n + contrib)?,
        });
        den = Some(match den {
            None => w,
            Some(d) => (d + w)?,
        });
    }
    let (Some(num), Some(den)) = (num, den) else {
        return Err(KvError::invariant("no partial attention to merge"));
    };
    let out = num.broadcast_div(
        &den.clamp(f32::MIN_POSITIVE, f32::MAX)?
            .unsqueeze(D::Minus1)?,
    )?;
    let lse = (max + den.log()?)?;
    let scratch_bytes = parts.iter().map(|p| p.scratch_bytes).max().unwrap_or(0);
    Ok(Partial {
        out,
        lse,
        scratch_bytes,
    })
}
