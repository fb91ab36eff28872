//! [`WindowKv`]: one layer's (or unit's) K/V in a [`KvBuffer`] that holds tokens
//! `base..base + len` of the sequence, so a sliding-window layer (Mistral, Gemma 2/3) keeps
//! what its later queries can see, not the whole context. Before the buffer would grow, the
//! tokens in front of the window are dropped ([`KvBuffer::drop_front`]): its capacity stays
//! at about the window plus the largest step, and each drop moves the window once per
//! `capacity − window` tokens. A global layer (`window_start` always 0) never drops and is a
//! plain growing buffer. How llama.cpp sizes its SWA cache (`n_swa + n_ubatch` cells) and
//! what HF's `SlidingWindowCache` does, on this workspace's growth rule.
use candle_core::Tensor;

use crate::buffer::KvBuffer;
use crate::error::{KvError, Result};
use crate::stats::DeviceMeter;

/// K/V of positions `base..base + len` in a growing buffer (module docs).
#[derive(Debug, Clone)]
pub struct WindowKv {
    buf: KvBuffer,
    base: usize,
}

/// The largest capacity a [`WindowKv`] growing by `grow` tokens reaches for a layer with
/// `window` (`None`: global) over `max_tokens` positions, steps of at most `step` tokens:
/// what a budget check charges it. A windowed buffer holds at most `window − 1` earlier
/// tokens and one step when it would grow.
pub fn window_capacity(
    window: Option<usize>,
    max_tokens: usize,
    step: usize,
    grow: usize,
) -> usize {
    let all = crate::buffer::round_up(max_tokens, grow);
    match window {
        Some(w) => crate::buffer::round_up(w.saturating_sub(1) + step.max(1), grow).min(all),
        None => all,
    }
}

/// How many tokens a buffer holding positions `held` (with room for `capacity` tokens
/// from `held.start`) drops from its front before it holds positions up to `need_end`:
/// those before `keep_from` (no later query sees them), and only when it would otherwise
/// grow; 0 for a global layer (`keep_from` 0) or while the buffer has room. The one rule of
/// every window-sized buffer: [`WindowKv`], the host tier's RAM stores, `recompute`'s
/// stored inputs.
pub fn front_to_drop(
    held: std::ops::Range<usize>,
    keep_from: usize,
    need_end: usize,
    capacity: usize,
) -> usize {
    if need_end.saturating_sub(held.start) <= capacity || keep_from <= held.start {
        return 0;
    }
    keep_from.min(held.end) - held.start
}

impl WindowKv {
    /// An empty buffer growing by `grow_tokens` tokens at a time.
    pub fn new(grow_tokens: usize) -> Self {
        Self {
            buf: KvBuffer::new(grow_tokens),
            base: 0,
        }
    }

    /// Makes an empty buffer hold positions from `pos` on (one rank's share of a sequence,
    /// [`crate::ShardLocal`]); an error once it holds tokens.
    pub fn start_at(&mut self, pos: usize) -> Result<()> {
        if !self.buf.is_empty() {
            return Err(KvError::invariant(
                "a buffer holding tokens cannot move its first position",
            ));
        }
        self.base = pos;
        Ok(())
    }

    /// The first position held (tokens before it were dropped: no later query sees them).
    pub fn base(&self) -> usize {
        self.base
    }

    /// Positions seen: `base + len` (the next position to append).
    pub fn end(&self) -> usize {
        self.base + self.buf.len()
    }

    /// The buffer itself (length, capacity, bytes).
    pub fn buffer(&self) -> &KvBuffer {
        &self.buf
    }

    /// Bytes the next append of `k` would allocate, after [`Self::make_room`].
    pub fn growth_bytes(&self, k: &Tensor) -> Result<u64> {
        self.buf.growth_bytes(k)
    }

    /// Before `t` more tokens are appended: when they would make the buffer grow, drops the
    /// tokens before `keep_from` (the first position a query of the coming step sees).
    /// Nothing for a global layer (`keep_from` 0) or while the buffer has room.
    pub fn make_room(&mut self, keep_from: usize, t: usize) -> Result<()> {
        let n = front_to_drop(
            self.base..self.end(),
            keep_from,
            self.end() + t,
            self.buf.capacity(),
        );
        if n > 0 {
            self.buf.drop_front(n)?;
            self.base += n;
        }
        Ok(())
    }

    /// Appends `k`, `v` `(b, heads, t, head_dim)` at position [`Self::end`], a growth
    /// counted on `meter` ([`KvBuffer::append_metered`]).
    pub fn append_metered(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        meter: &mut DeviceMeter,
    ) -> Result<()> {
        self.buf.append_metered(k, v, meter)
    }

    /// Views of K and V at positions `start..end` (absolute; `start ≥ base`).
    pub fn view(&self, start: usize, end: usize) -> Result<(Tensor, Tensor)> {
        if start < self.base || end < start {
            return Err(KvError::Shape(format!(
                "asked for positions {start}..{end} of a buffer holding {}..{}",
                self.base,
                self.end()
            )));
        }
        self.buf.view(start - self.base, end - start)
    }

    /// Everything held, with the position of its first token; `None` when empty.
    pub fn history(&self) -> Result<Option<((Tensor, Tensor), usize)>> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        Ok(Some((self.view(self.base, self.end())?, self.base)))
    }

    /// Bytes held by the K and V buffers (capacity).
    pub fn allocated_bytes(&self) -> u64 {
        self.buf.allocated_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_window_stays_within_its_capacity_and_keeps_what_queries_see() -> Result<()> {
        let dev = Device::Cpu;
        let (window, grow, step) = (5usize, 4usize, 3usize);
        let all = Tensor::arange(0f32, 40., &dev)?.reshape((1, 1, 40, 1))?;
        let mut w = WindowKv::new(grow);
        let mut meter = DeviceMeter::new(None);
        let cap = window_capacity(Some(window), 40, step, grow);
        let mut pos = 0;
        for t in [3, 3, 1, 1, 3, 1, 2, 3, 1, 1, 1, 3, 2, 1, 3, 3, 1, 1, 1, 3] {
            let keep_from = (pos + 1usize).saturating_sub(window);
            w.make_room(keep_from, t)?;
            let piece = all.narrow(2, pos, t)?;
            w.append_metered(&piece, &piece, &mut meter)?;
            pos += t;
            assert_eq!(w.end(), pos);
            assert!(w.buffer().capacity() <= cap, "capacity past {cap}");
            let (k, _) = w.view(keep_from, pos)?;
            let want: Vec<f32> = (keep_from..pos).map(|p| p as f32).collect();
            assert_eq!(k.flatten_all()?.to_vec1::<f32>()?, want);
        }
        assert!(w.base() > 0);
        assert!(w.view(0, pos).is_err());
        Ok(())
    }

    #[test]
    fn a_global_buffer_never_drops() -> Result<()> {
        let dev = Device::Cpu;
        let all = Tensor::arange(0f32, 10., &dev)?.reshape((1, 1, 10, 1))?;
        let mut w = WindowKv::new(2);
        let mut meter = DeviceMeter::new(None);
        for p in 0..10 {
            w.make_room(0, 1)?;
            let piece = all.narrow(2, p, 1)?;
            w.append_metered(&piece, &piece, &mut meter)?;
        }
        assert_eq!((w.base(), w.end()), (0, 10));
        assert_eq!(window_capacity(None, 10, 1, 2), 10);
        Ok(())
    }
}
