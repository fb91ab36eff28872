//! The device's two staging buffers as places for several units at once ([`Staging`]).
//!
//! HeadInfer §3.2 overlaps one unit's copy with the previous unit's attention (ping-pong).
//! That keeps the link busy only while every unit costs about as much to copy as to attend:
//! a small unit (a sliding-window layer's, a single head's) copies faster than the compute
//! around it, the link goes idle, and the next large unit starts late. So units are staged
//! as far ahead as the buffers have room: each buffer is filled front to back with units in
//! the order they will be attended (a unit's history and the step's new tokens contiguous
//! along the token axis), and a unit that no longer fits the rest of its buffer goes to the
//! front of the other once every unit there has been attended. The device holds the same
//! two buffers as before; only what fills them runs further ahead.
use std::collections::VecDeque;

use candle_core::Tensor;
use kvpolicy_core::{KvError, Result};
use kvpolicy_tiered::transfer::Ticket;
use kvpolicy_tiered::{other_buffer, Direction, Link};

/// Where a unit sits: tokens `offset..offset + len` of buffer `buf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    buf: usize,
    offset: usize,
    len: usize,
}

impl Place {
    /// Its first token in the buffer.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// The place after this one in the same buffer, if `len` tokens fit before `cap`.
    fn after(&self, len: usize, cap: usize) -> Option<Self> {
        let offset = self.offset + self.len;
        (offset + len <= cap).then_some(Self {
            buf: self.buf,
            offset,
            len,
        })
    }
}

/// A unit whose history is being (or has been) copied into its place.
#[derive(Debug)]
struct Staged<K> {
    key: K,
    place: Place,
    tickets: [Option<Ticket>; 2],
    /// Bytes queued without being counted (staged for the next step): counted when the
    /// unit is taken, or dropped.
    uncounted: u64,
}

/// What [`Staging::take`] hands back: the unit's place and the batches filling it.
#[derive(Debug)]
pub(crate) struct Taken {
    /// Where the unit is.
    pub(crate) place: Place,
    /// The batches to wait for before reading it.
    pub(crate) tickets: [Option<Ticket>; 2],
    /// Host→device bytes of its copy not counted yet.
    pub(crate) uncounted: u64,
}

/// Two device buffers of K and V and the units staged in them (module docs).
#[derive(Debug)]
pub(crate) struct Staging<K> {
    bufs: [Option<(Tensor, Tensor)>; 2],
    cap: usize,
    /// Units staged ahead, in the order they will be attended.
    ahead: VecDeque<Staged<K>>,
    /// The unit being attended: its place stays taken until the next one is taken.
    current: Option<Place>,
}

impl<K> Default for Staging<K> {
    fn default() -> Self {
        Self {
            bufs: [None, None],
            cap: 0,
            ahead: VecDeque::new(),
            current: None,
        }
    }
}

impl<K: Copy + PartialEq> Staging<K> {
    /// Tokens each buffer holds (0 before the first [`install`](Self::install)).
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Replaces both buffers with `bufs` of `cap` tokens, once the copies that may use the
    /// old ones have landed; nothing stays staged.
    pub(crate) fn install(
        &mut self,
        link: &mut Link,
        bufs: [(Tensor, Tensor); 2],
        cap: usize,
    ) -> Result<()> {
        self.release(link)?;
        let [a, b] = bufs;
        self.bufs = [Some(a), Some(b)];
        self.cap = cap;
        Ok(())
    }

    /// Frees both buffers once the copies using them have landed (the bytes of units
    /// staged uncounted are counted: they crossed the link).
    pub(crate) fn release(&mut self, link: &mut Link) -> Result<()> {
        link.wait_all()?;
        let dropped = self.ahead.iter().map(|s| s.uncounted).sum();
        link.count(dropped, Direction::H2d);
        self.clear();
        Ok(())
    }

    /// Forgets the buffers and what was staged without waiting (after a [`Link::reset`]).
    pub(crate) fn clear(&mut self) {
        self.bufs = [None, None];
        self.cap = 0;
        self.ahead.clear();
        self.current = None;
    }

    /// The K and V buffers holding `place` (cheap handles: tensors share storage).
    pub(crate) fn buffers(&self, place: Place) -> Result<(Tensor, Tensor)> {
        self.bufs
            .get(place.buf)
            .and_then(Clone::clone)
            .ok_or_else(|| KvError::invariant("the staging buffers are not allocated"))
    }

    /// The unit being attended is done: its place is free for what comes after.
    pub(crate) fn finish_current(&mut self) {
        self.current = None;
    }

    /// The next staged unit if it is `key` and its place holds `len` tokens. Otherwise
    /// whatever was staged is waited for and dropped (the order changed: `auto` demoted a
    /// unit mid-step, or a step is longer than the one its units were staged for), its
    /// uncounted bytes counted, and `None` returned.
    pub(crate) fn take(&mut self, key: &K, len: usize, link: &mut Link) -> Result<Option<Taken>> {
        match self.ahead.front() {
            Some(s) if s.key == *key && s.place.len >= len => {
                Ok(self.ahead.pop_front().map(|s| Taken {
                    place: s.place,
                    tickets: s.tickets,
                    uncounted: s.uncounted,
                }))
            }
            Some(_) => {
                for s in self.ahead.drain(..) {
                    for t in s.tickets {
                        link.wait(t)?;
                    }
                    link.count(s.uncounted, Direction::H2d);
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Marks `place` as the unit being attended.
    pub(crate) fn hold(&mut self, place: Place) {
        self.current = Some(place);
    }

    /// A free place for `len` tokens after every unit held or staged, if the buffers have
    /// room: after the last one in its buffer, else at the front of the other buffer when
    /// nothing there is still to be attended.
    pub(crate) fn place_for(&self, len: usize) -> Option<Place> {
        if len > self.cap {
            return None;
        }
        let live: Vec<Place> = self
            .current
            .iter()
            .copied()
            .chain(self.ahead.iter().map(|s| s.place))
            .collect();
        let Some(last) = live.last() else {
            return Some(Place {
                buf: 0,
                offset: 0,
                len,
            });
        };
        if let Some(p) = last.after(len, self.cap) {
            return Some(p);
        }
        let other = other_buffer(last.buf);
        (!live.iter().any(|p| p.buf == other)).then_some(Place {
            buf: other,
            offset: 0,
            len,
        })
    }

    /// Records that `key` is being copied into `place` by `tickets`, `uncounted` bytes of
    /// it not counted yet.
    pub(crate) fn stage(
        &mut self,
        key: K,
        place: Place,
        tickets: [Option<Ticket>; 2],
        uncounted: u64,
    ) {
        self.ahead.push_back(Staged {
            key,
            place,
            tickets,
            uncounted,
        });
    }

    /// The last unit staged, if any.
    pub(crate) fn last_staged(&self) -> Option<&K> {
        self.ahead.back().map(|s| &s.key)
    }

    /// How many units are staged ahead.
    pub(crate) fn staged(&self) -> usize {
        self.ahead.len()
    }

    /// Whether `key` is staged.
    pub(crate) fn is_staged(&self, key: &K) -> bool {
        self.ahead.iter().any(|s| s.key == *key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staging(cap: usize) -> Staging<u32> {
        Staging {
            cap,
            ..Staging::default()
        }
    }

    /// Units fill a buffer front to back, then the other once it is empty; a place is free
    /// again only when its unit is no longer held.
    fn place(s: &Staging<u32>, len: usize) -> Result<Place> {
        s.place_for(len)
            .ok_or_else(|| KvError::invariant("no place"))
    }

    #[test]
    fn places_fill_one_buffer_then_the_other() -> Result<()> {
        let mut s = staging(10);
        let a = place(&s, 4)?;
        assert_eq!((a.buf, a.offset), (0, 0));
        s.hold(a);
        let b = place(&s, 5)?;
        assert_eq!((b.buf, b.offset), (0, 4));
        s.stage(1, b, [None, None], 0);
        // 2 tokens no longer fit buffer 0: buffer 1 is empty.
        let c = place(&s, 2)?;
        assert_eq!((c.buf, c.offset), (1, 0));
        s.stage(2, c, [None, None], 0);
        // Buffer 1 has room after c.
        let d = place(&s, 8)?;
        assert_eq!((d.buf, d.offset), (1, 2));
        s.stage(3, d, [None, None], 0);
        // Full: buffer 1 has no room left and buffer 0 still holds a and b.
        assert_eq!(s.place_for(1), None);
        // Nothing longer than a buffer ever fits.
        assert_eq!(staging(10).place_for(11), None);
        Ok(())
    }

    /// Taking the next staged unit frees the places before it once the held one finishes.
    #[test]
    fn taking_in_order_frees_places() -> Result<()> {
        let mut link = Link::new(Box::new(kvpolicy_tiered::SyncTransferEngine::default()));
        let mut s = staging(10);
        let a = place(&s, 6)?;
        s.stage(1, a, [None, None], 0);
        let b = place(&s, 6)?;
        assert_eq!(b.buf, 1);
        s.stage(2, b, [None, None], 0);
        assert_eq!(s.place_for(6), None);
        let t = s
            .take(&1, 6, &mut link)?
            .ok_or_else(|| KvError::invariant("not staged"))?;
        assert_eq!(t.place, a);
        s.hold(t.place);
        assert_eq!(s.place_for(6), None, "a is held, b staged");
        s.finish_current();
        let t = s
            .take(&2, 6, &mut link)?
            .ok_or_else(|| KvError::invariant("not staged"))?;
        s.hold(t.place);
        // Buffer 0 is free again.
        assert_eq!(s.place_for(6).map(|p| (p.buf, p.offset)), Some((0, 0)));
        // A key out of order drops what was staged.
        let c = place(&s, 3)?;
        s.stage(3, c, [None, None], 0);
        assert!(s.take(&4, 1, &mut link)?.is_none());
        assert_eq!(s.staged(), 0);
        Ok(())
    }
}
