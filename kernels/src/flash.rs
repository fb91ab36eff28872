//! [`FlashAttn`]: exact attention whose scratch is bounded by tiles, not by the context
//! (FlashAttention's online softmax, Dao et al. 2022 §3.1, with FlashDecoding's split of
//! long key ranges across threads and HeadInfer §3.3's requirement that attention memory
//! not grow with the context).
//!
//! Queries `(b, n_heads, t, d)` sit at positions `q_pos..`, keys and values
//! `(b, n_kv_heads, s, d)` at `k_pos..`; any strides (a narrow of a preallocated buffer is
//! read in place). The `g = n_heads / n_kv_heads` query heads of one KV head are folded
//! into the rows of a tile, so K/V are never repeated. For each tile of query rows the
//! kernel walks only the key tiles those queries can see: a tile wholly in the future or
//! before the sliding window is never visited, a wholly visible tile is scored without a
//! mask, and only diagonal or window-edge tiles test positions — there is no `t × s`
//! buffer of any kind. Scores are scaled, soft-capped (`cap·tanh(x/cap)`, Gemma 2), masked,
//! and folded into a running max and sum per row; the output is the normalised result and
//! each row's log-sum-exp, so attentions over disjoint key sets still merge exactly.
//!
//! The CPU implementation (`cpu_fwd`) is the reference: f32/f16/bf16 inputs, f32
//! accumulation, the tile products through the `gemm` crate (candle's own matmul backend,
//! SIMD dispatched at run time), rayon across (batch, KV head, query tile) items and, when
//! those are fewer than the threads (decode), across ranges of keys merged by their
//! log-sum-exp. Every scratch buffer is counted while it lives; [`flash_attn`] reports the
//! peak.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Query rows (query heads of one KV head × positions) per tile.
pub const TILE_ROWS: usize = 64;
/// Keys per tile.
pub const TILE_KEYS: usize = 256;

/// What one attention call computes: scale, soft-cap, causality and window, and where the
/// queries and keys sit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashParams {
    /// Factor applied to `q·k`.
    pub scale: f32,
    /// Logit soft-cap (`cap · tanh(x / cap)`), applied before masking.
    pub softcap: Option<f32>,
    /// Whether a query sees only keys at or before its own position.
    pub causal: bool,
    /// Sliding window (causal only): a query at `p` sees keys at positions `> p - window`.
    pub window: Option<usize>,
    /// Position of the first query.
    pub q_pos: usize,
    /// Position of the first key.
    pub k_pos: usize,
}

impl FlashParams {
    /// First key position a query at `p` can see.
    fn first_visible(&self, p: usize) -> usize {
        match self.window {
            Some(w) if self.causal => (p + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// Last key position (inclusive) a query at `p` can see.
    fn last_visible(&self, p: usize) -> usize {
        if self.causal {
            p
        } else {
            usize::MAX
        }
    }

    fn visible(&self, qp: usize, kp: usize) -> bool {
        kp >= self.first_visible(qp) && kp <= self.last_visible(qp)
    }
}

/// The result of [`flash_attn`].
#[derive(Clone, Debug)]
pub struct FlashOut {
    /// `(b, n_heads, t, d)`, f32, normalised.
    pub out: Tensor,
    /// `(b, n_heads, t)`, f32; `-inf` for a row that saw no key (its output is 0).
    pub lse: Tensor,
    /// Most bytes of scratch alive at once during the call (tiles, partial results),
    /// counted as they were allocated; the output is not scratch.
    pub scratch_peak_bytes: u64,
}

/// Attention of `q` over `k`, `v` as [`FlashParams`] says, with bounded scratch. The CPU
/// kernel is this module's `cpu_fwd`; on CUDA the kernel in `cuda/flash_attn.cu`.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, params: &FlashParams) -> Result<FlashOut> {
    let (b, nh, t, d) = q.dims4()?;
    let meter = Arc::new(Meter::default());
    let op = FlashAttn {
        params: *params,
        meter: meter.clone(),
    };
    let both = q.apply_op3_no_bwd(k, v, &op)?;
    let out = both.narrow(3, 0, d)?.contiguous()?;
    let lse = both.narrow(3, d, 1)?.reshape((b, nh, t))?;
    Ok(FlashOut {
        out,
        lse,
        scratch_peak_bytes: meter.peak.load(Ordering::Relaxed),
    })
}

/// Counts scratch bytes alive now and at peak, across threads.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    current: AtomicU64,
    peak: AtomicU64,
}

impl Meter {
    fn take(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn give(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// An f32 scratch buffer counted by a [`Meter`] while it lives.
struct Scratch<'m> {
    buf: Vec<f32>,
    meter: &'m Meter,
}

impl<'m> Scratch<'m> {
    fn new(len: usize, fill: f32, meter: &'m Meter) -> Self {
        meter.take((len * 4) as u64);
        Self {
            buf: vec![fill; len],
            meter,
        }
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        self.meter.give((self.buf.len() * 4) as u64);
    }
}

/// The op: `q.apply_op3_no_bwd(k, v, &op)` gives `(b, n_heads, t, d + 1)` f32, each row's
/// output followed by its log-sum-exp. Use [`flash_attn`].
#[derive(Debug, Clone)]
pub struct FlashAttn {
    /// What the call computes.
    pub params: FlashParams,
    pub(crate) meter: Arc<Meter>,
}

/// Dimensions and element offsets of the three inputs, checked against each other.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub b: usize,
    pub nh: usize,
    pub nkv: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub q: (usize, [usize; 4]),
    pub k: (usize, [usize; 4]),
    pub v: (usize, [usize; 4]),
}

impl Geometry {
    pub(crate) fn of(q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        let bad = |m: String| candle_core::Error::Msg(format!("flash_attn: {m}"));
        let (b, nh, t, d) = q.shape().dims4()?;
        let (kb, nkv, s, kd) = k.shape().dims4()?;
        if k.dims() != v.dims() {
            return Err(bad(format!(
                "keys {:?} and values {:?} differ in shape",
                k.dims(),
                v.dims()
            )));
        }
        if kb != b || kd != d || nkv == 0 || nh % nkv != 0 {
            return Err(bad(format!(
                "queries {:?} do not fit keys {:?}",
                q.dims(),
                k.dims()
            )));
        }
        let at = |l: &Layout| {
            let st = l.stride();
            (l.start_offset(), [st[0], st[1], st[2], st[3]])
        };
        Ok(Self {
            b,
            nh,
            nkv,
            t,
            s,
            d,
            q: at(q),
            k: at(k),
            v: at(v),
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.nh / self.nkv
    }

    /// Query positions per tile.
    pub fn tile_positions(&self) -> usize {
        (TILE_ROWS / self.group()).max(1)
    }
}

/// Element types read by the kernel, widened to f32.
trait Elem: Copy + Send + Sync + 'static {
    fn f(self) -> f32;
    /// The slice itself when it already holds f32 (read in place, no tile copy).
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
}

impl Elem for f32 {
    fn f(self) -> f32 {
        self
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Elem for half::f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
}

impl Elem for half::bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
}

/// A key or value tile as gemm reads it: element (key j, value c) at
/// `ptr + j·rs + c·cs`.
struct Tile {
    ptr: *const f32,
    rs: isize,
    cs: isize,
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

/// The scratch one running task uses: scaled queries, the accumulator (output rows,
/// running max and sum), a score tile and, for half-precision inputs, widened K/V tiles.
struct Workspace<'m> {
    qs: Scratch<'m>,
    o: Scratch<'m>,
    m: Scratch<'m>,
    l: Scratch<'m>,
    sc: Scratch<'m>,
    kt: Option<Scratch<'m>>,
    vt: Option<Scratch<'m>>,
    /// One finished output row (d values and the log-sum-exp).
    line: Scratch<'m>,
}

impl<'m> Workspace<'m> {
    /// Scratch for `rows` query rows against tiles of `tk` keys of width `d`.
    fn new(rows: usize, tk: usize, d: usize, widen: bool, meter: &'m Meter) -> Self {
        Self {
            qs: Scratch::new(rows * d, 0.0, meter),
            o: Scratch::new(rows * d, 0.0, meter),
            m: Scratch::new(rows, 0.0, meter),
            l: Scratch::new(rows, 0.0, meter),
            sc: Scratch::new(rows * tk, 0.0, meter),
            kt: widen.then(|| Scratch::new(tk * d, 0.0, meter)),
            vt: widen.then(|| Scratch::new(tk * d, 0.0, meter)),
            line: Scratch::new(d + 1, 0.0, meter),
        }
    }
}

/// Workspaces shared by the tasks: as many as can run at once, each taken by one task at a
/// time, so a call's scratch is fixed by the tiles and the thread count.
struct Pool<'m>(Vec<Mutex<Workspace<'m>>>);

impl<'m> Pool<'m> {
    fn take(&self) -> MutexGuard<'_, Workspace<'m>> {
        // At most `len` tasks run at once, so a free workspace always exists; a task that
        // races another for the same one moves on to the next.
        let start = rayon::current_thread_index().unwrap_or(0);
        let n = self.0.len();
        loop {
            for i in 0..n {
                if let Ok(ws) = self.0[(start + i) % n].try_lock() {
                    return ws;
                }
            }
            std::thread::yield_now();
        }
    }
}

struct Kernel<'a, T> {
    g: Geometry,
    p: FlashParams,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

impl<T: Elem> Kernel<'_, T> {
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
                    *x = self.q[src + c * st[3]].f();
                }
            }
        }
    }

    /// Keys (or values) `j0..j0+n` of `item`'s KV head as gemm reads them: in place for f32
    /// inputs, else widened into `conv` (`n × d`).
    fn kv_tile(
        &self,
        src: &[T],
        view: (usize, [usize; 4]),
        item: &Item,
        j0: usize,
        n: usize,
        conv: Option<&mut Scratch<'_>>,
    ) -> Tile {
        let (off, st) = view;
        let base = off + item.bi * st[0] + item.kvh * st[1] + j0 * st[2];
        match (T::as_f32(src), conv) {
            (Some(f), _) => Tile {
                ptr: f[base..].as_ptr(),
                rs: st[2] as isize,
                cs: st[3] as isize,
            },
            (None, Some(conv)) => {
                let d = self.g.d;
                for j in 0..n {
                    let row = base + j * st[2];
                    for c in 0..d {
                        conv.buf[j * d + c] = src[row + c * st[3]].f();
                    }
                }
                Tile {
                    ptr: conv.buf.as_ptr(),
                    rs: d as isize,
                    cs: 1,
                }
            }
            (None, None) => Tile {
                ptr: std::ptr::null(),
                rs: 0,
                cs: 0,
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
        let mut j0 = lo;
        while j0 < hi {
            let nk = TILE_KEYS.min(hi - j0);
            let (ka, kb) = (self.p.k_pos + j0, self.p.k_pos + j0 + nk - 1);
            let kt = self.kv_tile(self.k, self.g.k, item, j0, nk, ws.kt.as_mut());
            let vt = self.kv_tile(self.v, self.g.v, item, j0, nk, ws.vt.as_mut());
            let s = &mut ws.sc.buf[..rows * nk];
            // S (rows × nk) = Qs (rows × d) · K^T (d × nk): K^T's element (c, j) is key j's
            // value c.
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
                    kt.ptr,
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
                let tile_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let m_old = ws.m.buf[r];
                let m_new = m_old.max(tile_max);
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                let mut sum = 0f32;
                for x in row.iter_mut() {
                    *x = (*x - m_new).exp();
                    sum += *x;
                }
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
                    vt.ptr,
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

/// A buffer written at disjoint ranges from several threads.
struct Sink {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: writers touch disjoint ranges (each output row belongs to one item, each partial
// slot to one task) and the buffer outlives the parallel loops that write it.
unsafe impl Sync for Sink {}

impl Sink {
    fn of(buf: &mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    fn write(&self, at: usize, vals: &[f32]) {
        assert!(
            at + vals.len() <= self.len,
            "flash_attn: write out of range"
        );
        // SAFETY: in bounds (checked above) and no other writer touches these elements.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), self.ptr.add(at), vals.len()) }
    }
}

/// How many key ranges each item splits into: enough tasks to keep every thread busy
/// when there are few query tiles (decode), else 1.
pub(crate) fn splits_for(items: usize, threads: usize) -> usize {
    (4 * threads).div_ceil(items.max(1)).max(1)
}

/// Threads the CPU kernel spreads a call over (rayon's pool).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// f32 values of one task's workspace ([`Workspace`]) for `rows` query rows.
/// `tk` keys per tile (fewer than [`TILE_KEYS`] only when the call has fewer keys).
fn workspace_len(rows: usize, tk: usize, d: usize, widen: bool) -> usize {
    2 * rows * d + 2 * rows + rows * tk + if widen { 2 * tk * d } else { 0 } + d + 1
}

/// The sizes of one attention call, for planning its scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// Sequences.
    pub b: usize,
    /// KV heads.
    pub n_kv: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Queries per head.
    pub t: usize,
    /// Keys per head.
    pub s: usize,
    /// Head width.
    pub d: usize,
    /// Inputs are f16/bf16 (tiles are widened into scratch).
    pub half: bool,
}

/// The scratch bytes a call of `shape` allocates on `threads` threads when every query sees
/// all the keys (non-causal, or a decode step), and an upper bound otherwise. Depends on the
/// context only through the number of key tiles until it reaches the split count; constant
/// beyond.
pub fn scratch_bytes(shape: &CallShape, threads: usize) -> u64 {
    let CallShape {
        b,
        n_kv,
        group,
        t,
        s,
        d,
        half,
    } = *shape;
    if t == 0 || s == 0 || b * n_kv == 0 {
        return 0;
    }
    let threads = threads.max(1);
    let tp = (TILE_ROWS / group.max(1)).max(1);
    let items = b * n_kv * t.div_ceil(tp);
    let rows = group * tp.min(t);
    let n = splits_for(items, threads).min(s.div_ceil(TILE_KEYS).max(1));
    let tasks = items * n;
    let partial = if n > 1 { tasks * rows * (d + 2) } else { 0 };
    let pool = threads.min(tasks) * workspace_len(rows, TILE_KEYS.min(s), d, half);
    (4 * (partial + pool)) as u64
}

/// Normalises one row's accumulated `o` (d values) by its sum `l`, appending the
/// log-sum-exp; a row that saw no key is 0 with log-sum-exp `-inf`.
fn finish_row(o: &[f32], m: f32, l: f32, row: &mut [f32]) {
    let d = o.len();
    if m == f32::NEG_INFINITY || l <= 0.0 {
        row[..d].fill(0.0);
        row[d] = f32::NEG_INFINITY;
    } else {
        for (x, v) in row[..d].iter_mut().zip(o) {
            *x = v / l;
        }
        row[d] = m + l.ln();
    }
}

fn compute<T: Elem>(
    g: Geometry,
    p: FlashParams,
    q: &[T],
    k: &[T],
    v: &[T],
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
    let threads = rayon::current_num_threads().max(1);
    let kernel = Kernel { g, p, q, k, v };
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
    let widen = T::as_f32(k).is_none();
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
    tasks.par_iter().for_each(|task| {
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
    });
    // Items split over several tasks: merge their ranges by the running maxima.
    let partial = &partial.buf;
    split_items.par_iter().for_each(|&(ii, first, end)| {
        let it = &items[ii];
        let rows = g.group() * (it.i1 - it.i0);
        let mut guard = pool.take();
        let ws = &mut *guard;
        let (o, line) = (&mut ws.o.buf[..d], &mut ws.line.buf);
        for r in 0..rows {
            let at = |slot: usize| slot * slot_len;
            let m = (first..end)
                .map(|sl| partial[at(sl) + rows * d + r])
                .fold(f32::NEG_INFINITY, f32::max);
            o.fill(0.0);
            let mut l = 0f32;
            if m > f32::NEG_INFINITY {
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

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(ql, kl, vl)?;
        let shape = Shape::from((g.b, g.nh, g.t, g.d + 1));
        let p = self.params;
        let m = &self.meter;
        let out = match (q, k, v) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => compute(g, p, q, k, v, m),
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => compute(g, p, q, k, v, m),
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => compute(g, p, q, k, v, m),
            _ => {
                return Err(candle_core::Error::Msg(format!(
                    "flash_attn: queries, keys and values must share one of f32, f16, bf16 (got {:?}, {:?}, {:?})",
                    q.dtype(),
                    k.dtype(),
                    v.dtype()
                )))
            }
        };
        Ok((CpuStorage::F32(out), shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// What a call allocates is what [`scratch_bytes`] says, for decode steps and chunks,
    /// with and without splits, f32 and half inputs.
    #[test]
    fn scratch_matches_the_formula() -> Result<()> {
        let dev = Device::Cpu;
        let threads = rayon::current_num_threads();
        for (b, nkv, g, t, s, d) in [
            (1, 3, 3, 1, 4096, 64),
            (1, 1, 3, 1, 600, 64),
            (2, 2, 4, 70, 300, 16),
            (1, 3, 3, 512, 2048, 64),
        ] {
            for dt in [candle_core::DType::F32, candle_core::DType::BF16] {
                let q = Tensor::ones((b, nkv * g, t, d), dt, &dev)?;
                let k = Tensor::ones((b, nkv, s, d), dt, &dev)?;
                let p = FlashParams {
                    scale: 0.1,
                    softcap: None,
                    causal: false,
                    window: None,
                    q_pos: s,
                    k_pos: 0,
                };
                let got = flash_attn(&q, &k, &k, &p)?.scratch_peak_bytes;
                let half = dt != candle_core::DType::F32;
                let call = CallShape {
                    b,
                    n_kv: nkv,
                    group: g,
                    t,
                    s,
                    d,
                    half,
                };
                let want = scratch_bytes(&call, threads);
                assert_eq!(got, want, "b={b} nkv={nkv} g={g} t={t} s={s} d={d} {dt:?}");
            }
        }
        Ok(())
    }
}
