//! A growable, preallocated K/V store for one layer (or one head range of a layer).
//!
//! Keys and values live in `(b, heads, capacity, head_dim)` tensors. New tokens are written
//! in place with `slice_set`; when the capacity runs out it grows by whole chunks of
//! `grow_tokens`, so a decode step never re-copies the cache (the stock candle models
//! `cat` the whole cache every step). Views of the stored prefix are strided narrows of the
//! buffers, which candle's matmul consumes without copying.
use candle_core::{DType, Device, Tensor};

use crate::error::{KvError, Result};
use crate::stats::DeviceMeter;

/// `tokens` rounded up to a whole number of `step`-token chunks: the capacity rule of every
/// preallocated buffer in this workspace (device and host tiers alike).
pub fn round_up(tokens: usize, step: usize) -> usize {
    let step = step.max(1);
    tokens.div_ceil(step) * step
}

/// A zero buffer of `dims` whose leading part along `dim` holds a copy of `old` (when
/// given): how every preallocated buffer of this workspace grows.
pub fn grown(
    old: Option<&Tensor>,
    dims: impl Into<candle_core::Shape>,
    dim: usize,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let t = Tensor::zeros(dims, dtype, dev)?;
    if let Some(o) = old {
        t.slice_set(o, dim, 0)?;
    }
    Ok(t)
}

/// Moves elements `from..from + len` of `t` along `dim` to its front, in place: how a
/// buffer drops tokens no later query sees (sliding windows) without reallocating. The
/// moved part passes through one temporary copy (`slice_set` takes neither a strided nor an
/// aliased source).
pub fn move_to_front(t: &Tensor, dim: usize, from: usize, len: usize) -> Result<()> {
    if len == 0 || from == 0 {
        return Ok(());
    }
    let rest = t.narrow(dim, from, len)?;
    let rest = if rest.is_contiguous() {
        rest.copy()?
    } else {
        rest.contiguous()?
    };
    t.slice_set(&rest, dim, 0)?;
    Ok(())
}

/// Growable K/V storage with amortised in-place appends.
#[derive(Debug, Clone)]
pub struct KvBuffer {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    capacity: usize,
    grow_tokens: usize,
}

impl KvBuffer {
    /// An empty buffer that grows by `grow_tokens` tokens at a time (at least 1).
    pub fn new(grow_tokens: usize) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            capacity: 0,
            grow_tokens: grow_tokens.max(1),
        }
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens that fit without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The capacity needed to hold `tokens` tokens under this buffer's growth rule.
    pub fn capacity_for(&self, tokens: usize) -> usize {
        round_up(tokens, self.grow_tokens)
    }

    /// Bytes held by the K and V buffers (capacity, not length).
    pub fn allocated_bytes(&self) -> u64 {
        let one = |t: &Option<Tensor>| {
            t.as_ref()
                .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
                .unwrap_or(0)
        };
        one(&self.k) + one(&self.v)
    }

    /// Bytes that holding `tokens` tokens of `(b, heads, _, head_dim)` in `dtype` needs.
    pub fn bytes_for(
        &self,
        tokens: usize,
        b: usize,
        heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> u64 {
        (2 * self.capacity_for(tokens) * b * heads * head_dim * dtype.size_in_bytes()) as u64
    }

    /// Bytes the next `append` of `t` tokens shaped like `k` would allocate while it grows
    /// (the new buffers; the old ones are freed after the copy). 0 when no growth is needed.
    pub fn growth_bytes(&self, k: &Tensor) -> Result<u64> {
        let (b, h, t, d) = k.dims4()?;
        if self.len + t <= self.capacity {
            return Ok(0);
        }
        Ok(self.bytes_for(self.len + t, b, h, d, k.dtype()))
    }

    /// Appends `k`, `v` of shape `(b, heads, t, head_dim)` at the end.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (b, h, t, d) = k.dims4()?;
        if v.dims4()? != (b, h, t, d) {
            return Err(KvError::Shape(format!(
                "keys {:?} and values {:?} differ in shape",
                k.dims(),
                v.dims()
            )));
        }
        if let Some(old) = &self.k {
            let (ob, oh, _, od) = old.dims4()?;
            if (ob, oh, od) != (b, h, d) || old.dtype() != k.dtype() {
                return Err(KvError::Shape(format!(
                    "new keys {:?} ({:?}) do not fit the stored {:?} ({:?})",
                    k.dims(),
                    k.dtype(),
                    old.dims(),
                    old.dtype()
                )));
            }
        }
        if self.len + t > self.capacity {
            self.grow(self.len + t, (b, h, d), k.dtype(), k.device())?;
        }
        let (Some(kb), Some(vb)) = (&self.k, &self.v) else {
            return Err(KvError::invariant("buffer missing after growth"));
        };
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok(())
    }

    fn grow(
        &mut self,
        needed: usize,
        (b, h, d): (usize, usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> Result<()> {
        let cap = self.capacity_for(needed);
        self.k = Some(grown(self.k.as_ref(), (b, h, cap, d), 2, dtype, dev)?);
        self.v = Some(grown(self.v.as_ref(), (b, h, cap, d), 2, dtype, dev)?);
        self.capacity = cap;
        Ok(())
    }

    /// [`Self::append`], counting a growth on `meter` as it happens: the new buffers are
    /// allocated while the old ones still exist (the peak holds both), then the old ones
    /// are freed. Whether the growth fits is the caller's decision ([`Self::growth_bytes`]).
    pub fn append_metered(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        meter: &mut DeviceMeter,
    ) -> Result<()> {
        let grow = self.growth_bytes(k)?;
        if grow == 0 {
            return self.append(k, v);
        }
        let old = self.allocated_bytes();
        meter.alloc(grow);
        self.append(k, v)?;
        meter.free(old);
        Ok(())
    }

    /// Views of keys and values at token positions `start..start+len` of the buffer.
    pub fn view(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) if start + len <= self.len => {
                Ok((k.narrow(2, start, len)?, v.narrow(2, start, len)?))
            }
            _ => Err(KvError::Shape(format!(
                "asked for tokens {start}..{} but {} are stored",
                start + len,
                self.len
            ))),
        }
    }

    /// Drops the first `n` stored tokens, moving the rest to the front in place (the
    /// capacity stays): how a sliding-window layer's buffer keeps only what later queries
    /// can see. The moved tokens pass through one temporary copy.
    pub fn drop_front(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let keep = self.len.checked_sub(n).ok_or_else(|| {
            KvError::Shape(format!("cannot drop {n} of {} stored tokens", self.len))
        })?;
        if let (Some(k), Some(v)) = (&self.k, &self.v) {
            move_to_front(k, 2, n, keep)?;
            move_to_front(v, 2, n, keep)?;
        }
        self.len = keep;
        Ok(())
    }

    /// Drops everything stored and frees the buffers.
    pub fn clear(&mut self) {
        self.k = None;
        self.v = None;
        self.len = 0;
        self.capacity = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_front_keeps_the_tail_in_place() -> Result<()> {
        let dev = Device::Cpu;
        let mut b = KvBuffer::new(8);
        let k = Tensor::arange(0f32, 6., &dev)?.reshape((1, 1, 6, 1))?;
        b.append(&k, &(&k * 2.)?)?;
        let cap = b.capacity();
        b.drop_front(4)?;
        assert_eq!((b.len(), b.capacity()), (2, cap));
        let (k2, v2) = b.view(0, 2)?;
        assert_eq!(k2.flatten_all()?.to_vec1::<f32>()?, [4., 5.]);
        assert_eq!(v2.flatten_all()?.to_vec1::<f32>()?, [8., 10.]);
        b.append(&k.narrow(2, 0, 1)?, &k.narrow(2, 0, 1)?)?;
        assert_eq!(
            b.view(0, 3)?.0.flatten_all()?.to_vec1::<f32>()?,
            [4., 5., 0.]
        );
        assert!(b.drop_front(4).is_err());
        Ok(())
    }

    #[test]
    fn grows_in_chunks_and_keeps_contents() -> Result<()> {
        let dev = Device::Cpu;
        let mut buf = KvBuffer::new(4);
        let all = Tensor::arange(0f32, 2.0 * 3.0 * 11.0 * 2.0, &dev)?.reshape((2, 3, 11, 2))?;
        let mut at = 0;
        for t in [3, 1, 1, 5, 1] {
            let piece = all.narrow(2, at, t)?;
            buf.append(&piece, &piece)?;
            at += t;
            assert_eq!(buf.capacity(), at.div_ceil(4) * 4);
        }
        let (k, _) = buf.view(0, 11)?;
        let diff = (k - &all)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        assert_eq!(buf.allocated_bytes(), 2 * 2 * 3 * 12 * 2 * 4);
        assert!(buf.view(5, 7).is_err());
        Ok(())
    }
}
