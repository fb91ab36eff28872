//! The CPU kernel of [`super::FlashAttn`]: work items (a tile of query rows of one KV
//! head), their key ranges split into tasks when items alone leave threads idle, one
//! workspace per thread, tile products through `gemm`, the online softmax per tile, and the
//! merge of split ranges by their running maxima (FlashAttention §3.1; FlashDecoding's
//! split-K for decode).
use std::sync::Mutex;

use super::elem::Elem;
use super::plan::{splits_for, threads, FlashParams, Geometry, Meter, TILE_KEYS};
use super::small;
use super::workspace::{Pool, Scratch, Sink, Workspace};

/// A key or value tile: element (key j, value c) at element `ptr + j·rs + c·cs`, of lane
/// kind `lane` — f32 as gemm reads it, or f16/bf16 read in place by the small path.
struct Tile {
    ptr: *const u8,
    rs: isize,
    cs: isize,
    lane: u8,
}

/// One work item: the rows of query positions `i0..i1` of the query heads of KV head
/// `kvh`, in batch `bi`.
#[derive(Clone, Copy, Debug)]
struct Item {
    bi: usize,
    kvh: usize,
    i0: usize,
    i1: usize,
}

/// One task: an item's keys `lo..hi`; with several tasks per item (`slot` is `Some`), its
/// unnormalised result goes to the partial-result buffer at `slot` to be merged.
#[derive(Clone, Copy, Debug)]
struct Task {
    item: usize,
    lo: usize,
    hi: usize,
    slot: Option<usize>,
}

/// One run of the call's keys, `start..start + len`, in storage of its own (a shared
/// prefix chunk, a sequence's own buffer): its keys and values and their views (offset and
/// strides, in elements of `T`). A call's runs follow each other; a tile never crosses
/// from one to the next, so runs of whole tiles give the tiles of one buffer, bit for bit.
#[derive(Clone, Copy)]
pub(super) struct Seg<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub kview: (usize, [usize; 4]),
    pub vview: (usize, [usize; 4]),
    pub start: usize,
    pub len: usize,
}

/// Queries of type `Q`, keys and values of type `T` (f32 queries over a cache stored in
/// f16/bf16 or q8_0 blocks: `--kv-dtype`), the keys in one or more runs.
struct Kernel<'a, Q, T> {
    g: Geometry,
    p: FlashParams,
    q: &'a [Q],
    segs: &'a [Seg<'a, T>],
}

impl<Q: Elem, T: Elem> Kernel<'_, Q, T> {
    /// The run holding key `j`.
    fn seg(&self, j: usize) -> &Seg<'_, T> {
        let at = self.segs.partition_point(|s| s.start <= j).max(1) - 1;
        &self.segs[at]
    }

    /// Key indices `lo..hi` the rows of `item` can see at all.
    fn key_range(&self, item: &Item) -> (usize, usize) {
        let (qa, qb) = (self.p.q_pos + item.i0, self.p.q_pos + item.i1 - 1);
        let lo = self.p.first_visible(qa).max(self.p.k_pos) - self.p.k_pos;
        let last = self.p.last_visible(qb);
        let hi = if last < self.p.k_pos {
            0
        } else {
            (last - self.p.k_pos).saturating_add(1).min(self.g.s)
        };
        (lo.min(hi), hi)
    }

    /// Writes `item`'s query rows into `qs`: row `h·n + i` is query head
    /// `kvh·g + h` at position `i0 + i`.
    fn load_q(&self, item: &Item, qs: &mut [f32]) {
        let (g, d, n) = (self.g.group(), self.g.d, item.i1 - item.i0);
        let (off, st) = self.g.q;
        for h in 0..g {
            for i in 0..n {
                let src =
                    off + item.bi * st[0] + (item.kvh * g + h) * st[1] + (item.i0 + i) * st[2];
                let row = &mut qs[(h * n + i) * d..(h * n + i + 1) * d];
                for (c, x) in row.iter_mut().enumerate() {
                    *x = Q::at(self.q, src + c * st[3]);
                }
            }
        }
    }

    /// Keys (or values) `j0..j0+n` of `item`'s KV head: in place for f32 inputs, or for
    /// f16/bf16 ones when `raw` (the small path widens them in registers), else widened
    /// into `conv` (`n × d`; q8_0 blocks always are). `view` is in elements of `T` (blocks
    /// for q8_0).
    fn kv_tile(
        &self,
        src: &[T],
        view: (usize, [usize; 4]),
        (item, j0, n): (&Item, usize, usize),
        raw: bool,
        conv: Option<&mut Scratch<'_>>,
    ) -> Tile {
        let (off, st) = view;
        let base = off + item.bi * st[0] + item.kvh * st[1] + j0 * st[2];
        if let (true, 1, Some(lane)) = (raw, st[3], T::LANE) {
            return Tile {
                ptr: src[base..].as_ptr() as *const u8,
                rs: st[2] as isize,
                cs: 1,
                lane,
            };
        }
        match (T::as_f32(src), conv) {
            (Some(f), _) => Tile {
                ptr: f[base..].as_ptr() as *const u8,
                rs: st[2] as isize,
                cs: st[3] as isize,
                lane: small::F32,
            },
            (None, Some(conv)) => {
                let d = self.g.d;
                for j in 0..n {
                    let row = base + j * st[2];
                    let dst = &mut conv.buf[j * d..(j + 1) * d];
                    // q8_0 views have contiguous rows (`Geometry::of_q8`).
                    debug_assert!(T::VALUES == 1 || st[3] == 1);
                    if st[3] == 1 {
                        T::widen(&src[row..row + d / T::VALUES], dst);
                    } else {
                        for (c, x) in dst.iter_mut().enumerate() {
                            *x = T::at(&src[row..], c * st[3]);
                        }
                    }
                }
                Tile {
                    ptr: conv.buf.as_ptr() as *const u8,
                    rs: d as isize,
                    cs: 1,
                    lane: small::F32,
                }
            }
            (None, None) => Tile {
                ptr: std::ptr::null(),
                rs: 0,
                cs: 0,
                lane: small::F32,
            },
        }
    }

    /// Folds keys `lo..hi` into the workspace's accumulator (reset first) for `item`'s rows.
    fn attend_range(&self, item: &Item, ws: &mut Workspace<'_>, lo: usize, hi: usize) {
        let (g, d, n) = (self.g.group(), self.g.d, item.i1 - item.i0);
        let rows = g * n;
        self.load_q(item, &mut ws.qs.buf);
        ws.o.buf[..rows * d].fill(0.0);
        ws.m.buf[..rows].fill(f32::NEG_INFINITY);
        ws.l.buf[..rows].fill(0.0);
        let (qa, qb) = (self.p.q_pos + item.i0, self.p.q_pos + item.i1 - 1);
        let small_rows = small::applies(rows, d);
        let mut j0 = lo;
        while j0 < hi {
            let seg = *self.seg(j0);
            // Half K/V whose rows are contiguous are read in place by the small path.
            let raw = small_rows && seg.kview.1[3] == 1 && seg.vview.1[3] == 1;
            let nk = TILE_KEYS.min(hi - j0).min(seg.start + seg.len - j0);
            let (ka, kb) = (self.p.k_pos + j0, self.p.k_pos + j0 + nk - 1);
            let at = (item, j0 - seg.start, nk);
            let kt = self.kv_tile(seg.k, seg.kview, at, raw, ws.kt.as_mut());
            let vt = self.kv_tile(seg.v, seg.vview, at, raw, ws.vt.as_mut());
            let s = &mut ws.sc.buf[..rows * nk];
            // S (rows × nk) = Qs (rows × d) · K^T (d × nk): K^T's element (c, j) is key j's
            // value c.
            let small = small::applies(rows, d) && kt.cs == 1 && vt.cs == 1;
            if small {
                // SAFETY: `applies` checked the CPU (AVX2, FMA, F16C) and sizes; the tile
                // addresses nk rows of d contiguous values (cs = 1) of its lane kind; `s`
                // holds rows·nk.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    let (q, p) = (&ws.qs.buf, kt.ptr);
                    match kt.lane {
                        small::F16 => small::scores::<{ small::F16 }>(q, rows, d, p, kt.rs, nk, s),
                        small::BF16 => {
                            small::scores::<{ small::BF16 }>(q, rows, d, p, kt.rs, nk, s)
                        }
                        _ => small::scores::<{ small::F32 }>(q, rows, d, p, kt.rs, nk, s),
                    }
                };
            } else {
                // SAFETY: `s` holds rows·nk, `qs` rows·d; the key tile addresses nk rows of d
                // values inside the input storage (its layout was checked by candle) or inside
                // the widened tile; the destination overlaps neither source.
                unsafe {
                    gemm::gemm(
                        rows,
                        nk,
                        d,
                        s.as_mut_ptr(),
                        1,
                        nk as isize,
                        false,
                        ws.qs.buf.as_ptr(),
                        1,
                        d as isize,
                        kt.ptr as *const f32,
                        kt.rs,
                        kt.cs,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
            // Scaled after the product, as HF's eager attention and llama.cpp do.
            let scale = self.p.scale;
            match self.p.softcap {
                Some(cap) => s
                    .iter_mut()
                    .for_each(|x| *x = cap * (*x * scale / cap).tanh()),
                None => s.iter_mut().for_each(|x| *x *= scale),
            }
            let whole =
                !self.p.causal || (kb <= self.p.last_visible(qa) && ka >= self.p.first_visible(qb));
            if !whole {
                for r in 0..rows {
                    let qp = self.p.q_pos + item.i0 + r % n;
                    for (j, x) in s[r * nk..(r + 1) * nk].iter_mut().enumerate() {
                        if !self.p.visible(qp, ka + j) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            // Online softmax: rescale what was accumulated to the new running max.
            for r in 0..rows {
                let row = &mut s[r * nk..(r + 1) * nk];
                let tile_max = super::softmax::max_or_nan(row);
                let m_old = ws.m.buf[r];
                let m_new = nan_max(m_old, tile_max);
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                let sum = super::softmax::exp_shifted(row, m_new);
                let corr = (m_old - m_new).exp();
                ws.l.buf[r] = ws.l.buf[r] * corr + sum;
                ws.m.buf[r] = m_new;
                if corr != 1.0 {
                    for x in &mut ws.o.buf[r * d..(r + 1) * d] {
                        *x *= corr;
                    }
                }
            }
            // O (rows × d) += P (rows × nk) · V (nk × d)
            if small {
                // SAFETY: as for the scores; `o` holds rows·d.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    let (o, p) = (&mut ws.o.buf, vt.ptr);
                    match vt.lane {
                        small::F16 => {
                            small::accumulate::<{ small::F16 }>(s, rows, nk, p, vt.rs, d, o)
                        }
                        small::BF16 => {
                            small::accumulate::<{ small::BF16 }>(s, rows, nk, p, vt.rs, d, o)
                        }
                        _ => small::accumulate::<{ small::F32 }>(s, rows, nk, p, vt.rs, d, o),
                    }
                };
            } else {
                // SAFETY: `o` holds rows·d, `s` rows·nk; the value tile addresses nk rows of d
                // values as the key tile does.
                unsafe {
                    gemm::gemm(
                        rows,
                        d,
                        nk,
                        ws.o.buf.as_mut_ptr(),
                        1,
                        d as isize,
                        true,
                        s.as_ptr(),
                        1,
                        nk as isize,
                        vt.ptr as *const f32,
                        vt.cs,
                        vt.rs,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
            j0 += nk;
        }
    }

    /// Where row `r` of `item` starts in the output `(b, n_heads, t, d + 1)`.
    fn out_at(&self, item: &Item, r: usize) -> usize {
        let (g, n) = (self.g.group(), item.i1 - item.i0);
        let (h, i) = (r / n, item.i0 + r % n);
        ((item.bi * self.g.nh + item.kvh * g + h) * self.g.t + i) * (self.g.d + 1)
    }
}

/// The larger of `a` and `b`, NaN when either is (`f32::max` returns the other, so a score
/// row that is all NaN — a NaN weight upstream — would look like a row that saw no key and
/// be zeroed, hiding it from the non-finite check on the logits).
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// Normalises one row's accumulated `o` (d values) by its sum `l`, appending the
/// log-sum-exp; a row that saw no key is 0 with log-sum-exp `-inf`.
fn finish_row(o: &[f32], m: f32, l: f32, row: &mut [f32]) {
    let d = o.len();
    if m.is_nan() || l.is_nan() {
        // A NaN upstream stays NaN: the non-finite check on the logits reports it.
        row.fill(f32::NAN);
    } else if m == f32::NEG_INFINITY || l <= 0.0 {
        row[..d].fill(0.0);
        row[d] = f32::NEG_INFINITY;
    } else {
        for (x, v) in row[..d].iter_mut().zip(o) {
            *x = v / l;
        }
        row[d] = m + l.ln();
    }
}

/// The attention of `q` over keys and values in the runs `segs` (`g.s` keys in all; `g.k`
/// and `g.v` unused): the tiles of each run, in order, as if they were one buffer.
pub(super) fn compute_runs<Q: Elem, T: Elem>(
    g: Geometry,
    p: FlashParams,
    q: &[Q],
    segs: &[Seg<'_, T>],
    meter: &Meter,
) -> Vec<f32> {
    let d = g.d;
    let mut out = vec![0f32; g.b * g.nh * g.t * (d + 1)];
    let tp = g.tile_positions();
    let mut items = Vec::new();
    for bi in 0..g.b {
        for kvh in 0..g.nkv {
            let mut i0 = 0;
            while i0 < g.t {
                let i1 = (i0 + tp).min(g.t);
                items.push(Item { bi, kvh, i0, i1 });
                i0 = i1;
            }
        }
    }
    let threads = threads();
    let kernel = Kernel { g, p, q, segs };
    // Tasks: each item's visible keys, split into ranges of whole tiles when items alone
    // would leave threads idle.
    let splits = splits_for(items.len(), threads);
    let rows_max = g.group() * tp.min(g.t);
    let mut tasks = Vec::new();
    let mut slots = 0;
    let mut split_items = Vec::new();
    for (ii, it) in items.iter().enumerate() {
        let (lo, hi) = kernel.key_range(it);
        let tiles = (hi - lo).div_ceil(TILE_KEYS).max(1);
        let n = splits.min(tiles);
        if n == 1 {
            tasks.push(Task {
                item: ii,
                lo,
                hi,
                slot: None,
            });
            continue;
        }
        let first = slots;
        for i in 0..n {
            // Whole tiles, spread evenly: range i holds tiles i·tiles/n .. (i+1)·tiles/n.
            let a = lo + i * tiles / n * TILE_KEYS;
            let b = (lo + (i + 1) * tiles / n * TILE_KEYS).min(hi);
            tasks.push(Task {
                item: ii,
                lo: a,
                hi: b,
                slot: Some(slots),
            });
            slots += 1;
        }
        split_items.push((ii, first, slots));
    }
    let slot_len = rows_max * (d + 2);
    let mut partial = Scratch::new(slots * slot_len, 0.0, meter);
    let widen = T::as_f32(&[]).is_none();
    let pool = Pool(
        (0..threads.min(tasks.len()))
            .map(|_| {
                Mutex::new(Workspace::new(
                    rows_max,
                    TILE_KEYS.min(g.s),
                    d,
                    widen,
                    meter,
                ))
            })
            .collect(),
    );
    let sink = Sink::of(&mut out);
    let parts = Sink::of(&mut partial.buf);
    // On candle's CPU worker pool, which the quantized matmuls use too: one pool, so
    // workers spinning for the next matmul never take the cores attention runs on.
    let run = |task: &Task| {
        let it = &items[task.item];
        let mut ws = pool.take();
        kernel.attend_range(it, &mut ws, task.lo, task.hi);
        let rows = g.group() * (it.i1 - it.i0);
        match task.slot {
            Some(slot) => {
                // o (rows·d), then m (rows), then l (rows).
                let base = slot * slot_len;
                parts.write(base, &ws.o.buf[..rows * d]);
                parts.write(base + rows * d, &ws.m.buf[..rows]);
                parts.write(base + rows * d + rows, &ws.l.buf[..rows]);
            }
            None => {
                let ws = &mut *ws;
                for r in 0..rows {
                    let o = &ws.o.buf[r * d..(r + 1) * d];
                    finish_row(o, ws.m.buf[r], ws.l.buf[r], &mut ws.line.buf);
                    sink.write(kernel.out_at(it, r), &ws.line.buf);
                }
            }
        }
    };
    candle_core::utils::barrier_pool()
        .execute_chunked(tasks.len(), |range| tasks[range].iter().for_each(run));
    // Items split over several tasks: merge their ranges by the running maxima. Splits only
    // happen when items are few (decode) and a merge is rows·d·splits additions, so it runs
    // here rather than waking the pool again.
    let partial = &partial.buf;
    split_items.iter().for_each(|&(ii, first, end)| {
        let it = &items[ii];
        let rows = g.group() * (it.i1 - it.i0);
        let mut guard = pool.take();
        let ws = &mut *guard;
        let (o, line) = (&mut ws.o.buf[..d], &mut ws.line.buf);
        for r in 0..rows {
            let at = |slot: usize| slot * slot_len;
            let m = (first..end)
                .map(|sl| partial[at(sl) + rows * d + r])
                .fold(f32::NEG_INFINITY, nan_max);
            o.fill(0.0);
            let mut l = 0f32;
            if m > f32::NEG_INFINITY || m.is_nan() {
                for sl in first..end {
                    let w = (partial[at(sl) + rows * d + r] - m).exp();
                    if w == 0.0 {
                        continue;
                    }
                    l += partial[at(sl) + rows * d + rows + r] * w;
                    for (x, v) in o
                        .iter_mut()
                        .zip(&partial[at(sl) + r * d..at(sl) + (r + 1) * d])
                    {
                        *x += v * w;
                    }
                }
            }
            finish_row(o, m, l, line);
            sink.write(kernel.out_at(it, r), line);
        }
    });
    out
}
