//! The plan of a tiled attention call, shared by the op ([`super::FlashAttn`]) and its CPU
//! kernel: tile sizes, the call's parameters ([`FlashParams`]), the inputs' geometry, how a
//! call splits across threads, and the scratch it allocates ([`scratch_bytes`]).
use std::sync::atomic::{AtomicU64, Ordering};

use super::elem::{Q8_BYTES, Q8_VALUES};
use candle_core::{Layout, Result};

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
    pub(crate) fn first_visible(&self, p: usize) -> usize {
        match self.window {
            Some(w) if self.causal => (p + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// Last key position (inclusive) a query at `p` can see.
    pub(crate) fn last_visible(&self, p: usize) -> usize {
        if self.causal {
            p
        } else {
            usize::MAX
        }
    }

    pub(crate) fn visible(&self, qp: usize, kp: usize) -> bool {
        kp >= self.first_visible(qp) && kp <= self.last_visible(qp)
    }
}

/// Counts scratch bytes alive now and at peak, across threads.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    pub(crate) current: AtomicU64,
    pub(crate) peak: AtomicU64,
}

impl Meter {
    pub(crate) fn take(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    pub(crate) fn give(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }
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
    /// The geometry of queries `q` over keys `k` and values `v` of the same element type.
    pub(crate) fn of(q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        Self::with_width(q, k, v, |d| d)
    }

    /// The geometry of queries `q` over keys `k` and values `v` stored as q8_0 blocks (rows of
    /// `d / 32 · 34` bytes, each row contiguous), with `k` and `v` in block units.
    pub(crate) fn of_q8(q: &Layout, k: &Layout, v: &Layout) -> Result<Self> {
        let bad = |m: String| candle_core::Error::Msg(format!("flash_attn: {m}"));
        let d = q.shape().dims4()?.3;
        if !d.is_multiple_of(Q8_VALUES) {
            return Err(bad(format!(
                "q8_0 keys need a head width that is a multiple of {Q8_VALUES}, not {d}"
            )));
        }
        let mut g = Self::with_width(q, k, v, |d| d / Q8_VALUES * Q8_BYTES)?;
        for view in [&mut g.k, &mut g.v] {
            let (off, st) = *view;
            let whole = |x: usize| x.is_multiple_of(Q8_BYTES);
            if st[3] != 1 || !whole(off) || !st[..3].iter().all(|&x| whole(x)) {
                return Err(bad(format!(
                    "q8_0 keys and values must be views of whole blocks, rows contiguous (offset {off}, strides {st:?})"
                )));
            }
            *view = (
                off / Q8_BYTES,
                [st[0] / Q8_BYTES, st[1] / Q8_BYTES, st[2] / Q8_BYTES, 1],
            );
        }
        Ok(g)
    }

    /// Checked against each other, with `width(d)` the keys' last dimension for queries of
    /// width `d`.
    fn with_width(
        q: &Layout,
        k: &Layout,
        v: &Layout,
        width: impl Fn(usize) -> usize,
    ) -> Result<Self> {
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
        if kb != b || kd != width(d) || nkv == 0 || nh % nkv != 0 {
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

/// How many key ranges each item splits into: enough tasks to keep every thread busy
/// when there are few query tiles (decode), else 1.
pub(crate) fn splits_for(items: usize, threads: usize) -> usize {
    (4 * threads).div_ceil(items.max(1)).max(1)
}

/// Threads the CPU kernel spreads a call over: candle's CPU worker pool and the calling
/// thread.
pub fn threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// f32 values of one task's workspace ([`Workspace`]) for `rows` query rows.
/// `tk` keys per tile (fewer than [`TILE_KEYS`] only when the call has fewer keys).
pub(crate) fn workspace_len(rows: usize, tk: usize, d: usize, widen: bool) -> usize {
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
    /// K/V are stored smaller than f32 — f16/bf16, or q8_0 blocks (tiles are widened into
    /// scratch).
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
