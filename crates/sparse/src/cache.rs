//! One KV head's pages on the device (FlexiCache §4's per-head resident set, CLO §4's
//! on-device cache): `(b, 1, slots × P, d)` K and V buffers whose slots each hold one page
//! of the middle, with the page each slot holds. Pages arrive over the link
//! ([`HeadCache::place`] gives the slot a copy fills) or from the device's own recent
//! window; a head attends the slots of the pages it selected ([`HeadCache::gather`]).
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use kvpolicy_core::{KvError, Result};

/// A head's resident pages (module docs).
#[derive(Debug, Default)]
pub struct HeadCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// Per slot, the page it holds.
    slots: Vec<Option<usize>>,
    /// Page → slot.
    at: BTreeMap<usize, usize>,
}

/// The buffers' shape: sequences, tokens per page, head width, dtype and device.
#[derive(Clone, Debug)]
pub struct PageShape {
    /// Sequences.
    pub b: usize,
    /// Tokens per page.
    pub page: usize,
    /// Head width.
    pub d: usize,
    /// Dtype of K/V.
    pub dtype: DType,
    /// The device.
    pub device: Device,
}

impl HeadCache {
    /// Pages held, ascending.
    pub fn pages(&self) -> Vec<usize> {
        self.at.keys().copied().collect()
    }

    /// Whether `page` is held.
    pub fn holds(&self, page: usize) -> bool {
        self.at.contains_key(&page)
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether no page is held.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Device bytes of the buffers.
    pub fn bytes(&self) -> u64 {
        [&self.k, &self.v]
            .iter()
            .map(|t| {
                t.as_ref()
                    .map_or(0, |t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            })
            .sum()
    }

    /// Frees every slot whose page is not in `keep` (ascending).
    pub fn retain(&mut self, keep: &[usize]) {
        let drop: Vec<usize> = self
            .at
            .keys()
            .copied()
            .filter(|p| keep.binary_search(p).is_err())
            .collect();
        for p in drop {
            if let Some(s) = self.at.remove(&p) {
                self.slots[s] = None;
            }
        }
    }

    /// Repacks the held pages into buffers of about their size, ascending by page (so a
    /// selection of every held page is a view), when at least half the slots are free:
    /// a head that kept few pages gives the rest of its device bytes back.
    pub fn compact(&mut self, shape: &PageShape) -> Result<()> {
        let held = self.at.len();
        if self.slots.len() < 8 || 2 * held > self.slots.len() {
            return Ok(());
        }
        let pages = self.pages();
        let kept = self.gather(&pages, shape.page)?;
        *self = Self::default();
        if let Some((k, v)) = kept {
            self.grow(held, shape)?;
            let (kb, vb) = self.buffers()?;
            kb.slice_set(&k.contiguous()?, 2, 0)?;
            vb.slice_set(&v.contiguous()?, 2, 0)?;
            for (slot, p) in pages.into_iter().enumerate() {
                self.slots[slot] = Some(p);
                self.at.insert(p, slot);
            }
        }
        Ok(())
    }

    /// Frees every slot.
    pub fn clear(&mut self) {
        self.at.clear();
        self.slots.iter_mut().for_each(|s| *s = None);
    }

    /// Drops the buffers.
    pub fn release(&mut self) {
        *self = Self::default();
    }

    /// A slot for `page` (a free one, the buffers grown when none is), recorded as holding
    /// it; returns the K and V buffers and the token offset the page goes to.
    pub fn place(&mut self, page: usize, shape: &PageShape) -> Result<(Tensor, Tensor, usize)> {
        if let Some(&s) = self.at.get(&page) {
            return Err(KvError::invariant(format!(
                "page {page} placed twice (slot {s})"
            )));
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                self.grow(self.slots.len() + 1, shape)?;
                self.slots.len() - 1
            }
        };
        self.slots[slot] = Some(page);
        self.at.insert(page, slot);
        let (k, v) = self.buffers()?;
        Ok((k.clone(), v.clone(), slot * shape.page))
    }

    /// Places `page`, unless held, copied on the device from `k`, `v` `(b, kv_heads, n, d)`
    /// — head `head`'s tokens from `first` on (the page must lie inside them).
    pub fn copy_in(
        &mut self,
        page: usize,
        (k, v): (&Tensor, &Tensor),
        (head, first): (usize, usize),
        shape: &PageShape,
    ) -> Result<()> {
        if self.holds(page) {
            return Ok(());
        }
        let (kb, vb, at) = self.place(page, shape)?;
        let src = |t: &Tensor| -> Result<Tensor> {
            Ok(t.narrow(1, head, 1)?
                .narrow(2, page * shape.page - first, shape.page)?
                .contiguous()?)
        };
        kb.slice_set(&src(k)?, 2, at)?;
        vb.slice_set(&src(v)?, 2, at)?;
        Ok(())
    }

    /// Room for at least `slots` slots (doubling), the pages held copied over.
    pub fn grow(&mut self, slots: usize, shape: &PageShape) -> Result<()> {
        if slots <= self.slots.len() {
            return Ok(());
        }
        let n = slots.max(2 * self.slots.len()).max(4).next_power_of_two();
        let dims = (shape.b, 1, n * shape.page, shape.d);
        let grown = |old: &Option<Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros(dims, shape.dtype, &shape.device)?;
            if let Some(o) = old {
                t.slice_set(o, 2, 0)?;
            }
            Ok(t)
        };
        self.k = Some(grown(&self.k)?);
        self.v = Some(grown(&self.v)?);
        self.slots.resize(n, None);
        Ok(())
    }

    fn buffers(&self) -> Result<(&Tensor, &Tensor)> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(KvError::invariant("a head cache read before any page")),
        }
    }

    /// The K and V of `pages` (each held), `(b, 1, n × P, d)`: a view when they fill the
    /// first slots in order, else gathered on the device. `None` for no page.
    pub fn gather(&self, pages: &[usize], page: usize) -> Result<Option<(Tensor, Tensor)>> {
        if pages.is_empty() {
            return Ok(None);
        }
        let slots: Vec<usize> = pages
            .iter()
            .map(|p| {
                self.at
                    .get(p)
                    .copied()
                    .ok_or_else(|| KvError::invariant(format!("page {p} is not resident")))
            })
            .collect::<Result<_>>()?;
        let (k, v) = self.buffers()?;
        if slots.iter().enumerate().all(|(i, &s)| i == s) {
            let n = slots.len() * page;
            return Ok(Some((k.narrow(2, 0, n)?, v.narrow(2, 0, n)?)));
        }
        let idx: Vec<u32> = slots
            .iter()
            .flat_map(|&s| (s * page..(s + 1) * page).map(|t| t as u32))
            .collect();
        let idx = Tensor::from_vec(idx, pages.len() * page, k.device())?;
        Ok(Some((k.index_select(&idx, 2)?, v.index_select(&idx, 2)?)))
    }
}
