//! The middle of a global layer's cache — between the sinks and the window — attended two
//! ways: densely for a prefill chunk (the whole middle crosses the link once per chunk and
//! layer, as under `layer`; Quest's prefill is dense too), and at a decode step over the
//! pages each KV head selected, fetched page-granularly from the host tier (or the disk
//! tier: page-sized reads) into the head's device slots (Quest §3, FlexiCache §4).
//! Pieces merge with the sinks and the window by log-sum-exp.
use candle_core::Tensor;
use kvpolicy_core::{
    attend_partial, AttnInputs, AttnSpec, HeadRange, KvError, Partial, Result, TokenRange,
};
use kvpolicy_tiered::{CopyJob, Direction, HostLayers, Link, MappedGather};

use crate::cache::{HeadCache, PageShape};

/// The K/V of the middle moved to the device for a dense step, `(b, kv, n × P, d)`.
pub struct DenseMiddle {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// The first middle page.
    pub first: usize,
}

impl DenseMiddle {
    /// Pages `first..first + n` of `layer` from the host tier, over the link (counted).
    pub fn load(
        link: &mut Link,
        host: &mut HostLayers,
        layer: usize,
        pages: (usize, usize),
        shape: &PageShape,
        kv_heads: usize,
    ) -> Result<Self> {
        let (first, n) = pages;
        let p = shape.page;
        // In pieces: a prefix held by reference, then the layer's own store (not joined on
        // the host first).
        let pieces = host.history_pieces(
            layer,
            HeadRange::new(0, kv_heads),
            TokenRange::new(first * p, n * p),
        )?;
        let dims = (shape.b, kv_heads, n * p, shape.d);
        let k = Tensor::zeros(dims, shape.dtype, &shape.device)?;
        let v = Tensor::zeros(dims, shape.dtype, &shape.device)?;
        let mut jobs = Vec::with_capacity(2 * pieces.len());
        for piece in pieces {
            for (src, dst) in [(piece.k, &k), (piece.v, &v)] {
                jobs.push(CopyJob {
                    src,
                    dst: dst.clone(),
                    dim: 2,
                    offset: piece.at,
                });
            }
        }
        let ticket = link.submit(jobs, Direction::H2d)?;
        link.wait(ticket)?;
        Ok(Self { k, v, first })
    }

    /// Device bytes of the loaded middle.
    pub fn bytes(&self) -> u64 {
        2 * (self.k.elem_count() * self.k.dtype().size_in_bytes()) as u64
    }

    /// Attention of the step's queries at `q_pos` over the whole middle.
    pub fn attend(
        &self,
        q: &Tensor,
        q_pos: usize,
        spec: &AttnSpec,
        page: usize,
    ) -> Result<Partial> {
        attend_partial(
            AttnInputs {
                q,
                k: &self.k,
                v: &self.v,
                q_pos,
                k_pos: self.first * page,
            },
            spec,
        )
    }

    /// Places `keep[h]`'s pages not yet resident in head `h`'s cache, copied on the device.
    pub fn keep(
        &self,
        caches: &mut [HeadCache],
        keep: &[Vec<usize>],
        shape: &PageShape,
    ) -> Result<()> {
        for (h, (cache, pages)) in caches.iter_mut().zip(keep).enumerate() {
            cache.retain(pages);
            for &page in pages {
                let first = self.first * shape.page;
                cache.copy_in(page, (&self.k, &self.v), (h, first), shape)?;
            }
            cache.compact(shape)?;
        }
        Ok(())
    }
}

/// One page placed in a head's cache, to be filled: the head, the page, the cache's K and
/// V buffers and the token offset in them.
struct Placed {
    head: usize,
    page: usize,
    k: Tensor,
    v: Tensor,
    at: usize,
}

/// Fetches into each head's cache the pages of `want[h]` it does not hold; returns the pages
/// fetched per head. With `zero_copy` and a RAM layer, a kernel on the device reads them
/// from mapped host memory where the engine can ([`kvpolicy_tiered::MappedGather`], CLO
/// §4); otherwise one copy per run of consecutive pages landing in consecutive slots.
/// Bytes are counted host→device on the link either way.
pub fn fetch(
    link: &mut Link,
    host: &mut HostLayers,
    layer: usize,
    caches: &mut [HeadCache],
    want: &[Vec<usize>],
    shape: &PageShape,
    zero_copy: bool,
) -> Result<Vec<usize>> {
    let mut fetched = vec![0; caches.len()];
    let mut placed = Vec::new();
    for (h, (cache, pages)) in caches.iter_mut().zip(want).enumerate() {
        let missing: Vec<usize> = pages
            .iter()
            .copied()
            .filter(|&pg| !cache.holds(pg))
            .collect();
        // Room for every page first: a growth replaces the buffers the copies target.
        cache.grow(cache.len() + missing.len(), shape)?;
        fetched[h] = missing.len();
        for page in missing {
            let (k, v, at) = cache.place(page, shape)?;
            placed.push(Placed {
                head: h,
                page,
                k,
                v,
                at,
            });
        }
    }
    if placed.is_empty() {
        return Ok(fetched);
    }
    if zero_copy && gather_mapped(link, host, layer, &placed, shape)? {
        return Ok(fetched);
    }
    let p = shape.page;
    let mut jobs = Vec::new();
    let mut run: Option<(usize, usize, &Placed)> = None; // (first page, pages, first placed)
    for pl in &placed {
        let extends = run.is_some_and(|(first, n, r)| {
            r.head == pl.head
                && first + n == pl.page
                && r.at + n * p == pl.at
                && r.k.id() == pl.k.id()
        });
        if extends {
            if let Some(r) = run.as_mut() {
                r.1 += 1;
            }
            continue;
        }
        if let Some(r) = run.take() {
            push_run(host, layer, r, p, &mut jobs)?;
        }
        run = Some((pl.page, 1, pl));
    }
    if let Some(r) = run.take() {
        push_run(host, layer, r, p, &mut jobs)?;
    }
    let ticket = link.submit(jobs, Direction::H2d)?;
    link.wait(ticket)?;
    Ok(fetched)
}

/// The zero-copy gather of `placed` from `layer`'s RAM buffers, one kernel per head and K/V;
/// `false` when the layer is not in RAM or the engine cannot (nothing was gathered).
fn gather_mapped(
    link: &mut Link,
    host: &HostLayers,
    layer: usize,
    placed: &[Placed],
    shape: &PageShape,
) -> Result<bool> {
    // (Offsets count from position 0: not for a layer holding a prefix by reference.)
    let Some(ram) = host.ram(layer).filter(|_| host.first_held(layer) == 0) else {
        return Ok(false);
    };
    let elem = shape.dtype.size_in_bytes() as u64;
    let row = shape.d as u64 * elem;
    let page_bytes = shape.page * shape.d * shape.dtype.size_in_bytes();
    let mut moved = 0;
    let heads: std::collections::BTreeSet<usize> = placed.iter().map(|p| p.head).collect();
    for h in heads {
        let mine: Vec<&Placed> = placed.iter().filter(|p| p.head == h).collect();
        let src_offsets: Vec<u64> = mine
            .iter()
            .map(|p| (h * ram.cap + p.page * shape.page) as u64 * row)
            .collect();
        let dst_offsets: Vec<u64> = mine.iter().map(|p| p.at as u64 * row).collect();
        for (src, dst) in [(&ram.k, &mine[0].k), (&ram.v, &mine[0].v)] {
            let g = MappedGather {
                src,
                dst,
                src_offsets: src_offsets.clone(),
                dst_offsets: dst_offsets.clone(),
                page_bytes,
            };
            if !link.engine().gather_mapped(&g)? {
                if moved == 0 {
                    return Ok(false);
                }
                return Err(KvError::invariant("a zero-copy gather stopped half-way"));
            }
            moved += g.bytes();
        }
    }
    link.count(moved, Direction::H2d);
    Ok(true)
}

/// The copies of one run of `n` pages from `first`, the first of them `pl`.
fn push_run(
    host: &mut HostLayers,
    layer: usize,
    (first, n, pl): (usize, usize, &Placed),
    p: usize,
    jobs: &mut Vec<CopyJob>,
) -> Result<()> {
    let (hk, hv) = host.history(
        layer,
        HeadRange::new(pl.head, 1),
        TokenRange::new(first * p, n * p),
    )?;
    for (src, dst) in [(hk, pl.k.clone()), (hv, pl.v.clone())] {
        jobs.push(CopyJob {
            src,
            dst,
            dim: 2,
            offset: pl.at,
        });
    }
    Ok(())
}

/// Attention of each KV head's query group over the pages it selected (all resident in its
/// cache), concatenated over the heads: `(b, n_heads, t, d)` with log-sum-exp. Selected
/// pages lie before every query, so no mask applies.
pub fn attend_selected(
    q: &Tensor,
    caches: &[HeadCache],
    attend: &[Vec<usize>],
    spec: &AttnSpec,
    page: usize,
) -> Result<Partial> {
    let (b, nh, t, d) = q.dims4()?;
    let g = nh / caches.len().max(1);
    let mut open = spec.clone();
    open.causal = false;
    open.sliding_window = None;
    open.n_heads = g;
    open.n_kv_heads = 1;
    let mut outs = Vec::with_capacity(caches.len());
    let mut lses = Vec::with_capacity(caches.len());
    let mut scratch = 0;
    for (h, (cache, pages)) in caches.iter().zip(attend).enumerate() {
        let qh = q.narrow(1, h * g, g)?;
        let part = match cache.gather(pages, page)? {
            Some((k, v)) => attend_partial(
                AttnInputs {
                    q: &qh,
                    k: &k,
                    v: &v,
                    q_pos: 0,
                    k_pos: 0,
                },
                &open,
            )?,
            None => Partial::empty(b, g, t, d, q.device())?,
        };
        scratch = scratch.max(part.scratch_bytes);
        outs.push(part.out);
        lses.push(part.lse);
    }
    Ok(Partial {
        out: Tensor::cat(&outs, 1)?,
        lse: Tensor::cat(&lses, 1)?,
        scratch_bytes: scratch,
    })
}
