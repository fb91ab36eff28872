//! Tiled attention from candle ops, for devices without a fused kernel: queries in tiles of
//! [`TILE_QUERIES`] positions, keys in tiles of [`TILE_KEYS`], each tile attended eagerly
//! ([`super::eager`]) and folded into a running result by its log-sum-exp (the online
//! softmax of FlashAttention §3.1, one tile at a time). Key tiles a query tile cannot see
//! (in its future, or before its sliding window) are skipped; wholly visible tiles need no
//! mask. Scratch is bounded by one tile's scores, whatever the context. A call of few queries
//! (decode) takes proportionally more keys per tile ([`Tiles::for_queries`]): the same scratch
//! bound as a full tile, in far fewer passes — each tile is some twenty kernel launches, and
//! a decode step over 32K keys in 2,048-key tiles was launch-bound (H200: 4.98 tok/s at the
//! Llama-3-8B shape, bench-results/2026-11-27-gpu-h200-first-run.md).
use candle_core::Tensor;

use super::eager;
use super::spec::{merge_partials, AttnInputs, AttnSpec, Partial};
use crate::error::Result;

/// Query positions per tile.
pub const TILE_QUERIES: usize = 512;
/// Keys per tile.
pub const TILE_KEYS: usize = 2048;

/// Tile sizes: query positions and keys per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Query positions per tile.
    pub queries: usize,
    /// Keys per tile.
    pub keys: usize,
}

impl Default for Tiles {
    /// [`TILE_QUERIES`] × [`TILE_KEYS`].
    fn default() -> Self {
        Self {
            queries: TILE_QUERIES,
            keys: TILE_KEYS,
        }
    }
}

impl Tiles {
    /// The tiles for a call of `t` query positions: [`TILE_QUERIES`] queries, and keys so that
    /// a tile holds at most [`TILE_QUERIES`] × [`TILE_KEYS`] scores per head — `TILE_KEYS`
    /// for `t` ≥ `TILE_QUERIES`, 512 × as many for one query.
    pub fn for_queries(t: usize) -> Self {
        let rows = t.clamp(1, TILE_QUERIES);
        Self {
            queries: TILE_QUERIES,
            keys: TILE_KEYS * (TILE_QUERIES / rows),
        }
    }
}

/// Scratch of one tile of `rows` query rows (all heads) against `keys` keys of width `d`:
/// its scores and probabilities, and the running and the tile's results.
pub(crate) fn tile_scratch_bytes(rows: usize, keys: usize, d: usize) -> u64 {
    (4 * (2 * rows * keys + 2 * rows * (d + 1))) as u64
}

/// Key indices `lo..hi` that queries at positions `qa..=qb` can see among `s` keys at
/// `k_pos..`.
pub(crate) fn key_range(
    spec: &AttnSpec,
    qa: usize,
    qb: usize,
    k_pos: usize,
    s: usize,
) -> (usize, usize) {
    let lo = spec.window_start(qa).max(k_pos) - k_pos;
    let hi = if !spec.causal {
        s
    } else if qb < k_pos {
        0
    } else {
        (qb - k_pos + 1).min(s)
    };
    (lo.min(hi), hi)
}

/// [`super::attend_partial`] through candle ops in tiles of `tiles`.
pub fn attend_partial_tiled(x: AttnInputs<'_>, spec: &AttnSpec, tiles: Tiles) -> Result<Partial> {
    let AttnInputs {
        q,
        k,
        v,
        q_pos,
        k_pos,
    } = x;
    let (b, nh, t, d) = q.dims4()?;
    let s = k.dim(2)?;
    if t == 0 {
        return Partial::empty(b, nh, t, d, q.device());
    }
    let (tq, tk) = (tiles.queries.max(1), tiles.keys.max(1));
    let mut outs = Vec::with_capacity(t.div_ceil(tq));
    let mut lses = Vec::with_capacity(t.div_ceil(tq));
    let mut scratch = 0u64;
    let mut i0 = 0;
    while i0 < t {
        let n = tq.min(t - i0);
        let qt = q.narrow(2, i0, n)?;
        let (lo, hi) = key_range(spec, q_pos + i0, q_pos + i0 + n - 1, k_pos, s);
        let mut acc = Partial::empty(b, nh, n, d, q.device())?;
        let mut j0 = lo;
        while j0 < hi {
            let nk = tk.min(hi - j0);
            let part = eager::attend_partial_eager(
                AttnInputs {
                    q: &qt,
                    k: &k.narrow(2, j0, nk)?,
                    v: &v.narrow(2, j0, nk)?,
                    q_pos: q_pos + i0,
                    k_pos: k_pos + j0,
                },
                spec,
            )?;
            scratch = scratch.max(tile_scratch_bytes(b * nh * n, nk, d));
            acc = merge_partials(&[acc, part])?;
            j0 += nk;
        }
        outs.push(acc.out);
        lses.push(acc.lse);
        i0 += n;
    }
    Ok(Partial {
        out: Tensor::cat(&outs, 2)?,
        lse: Tensor::cat(&lses, 2)?,
        scratch_bytes: scratch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_queries_take_more_keys_within_one_tiles_scores() {
        for t in [1, 2, 5, 100, 511, 512, 513, 4096] {
            let tiles = Tiles::for_queries(t);
            let rows = t.min(tiles.queries);
            assert!(rows * tiles.keys <= TILE_QUERIES * TILE_KEYS, "t = {t}");
            assert!(tiles.keys >= TILE_KEYS, "t = {t}");
        }
        assert_eq!(Tiles::for_queries(1).keys, TILE_KEYS * TILE_QUERIES);
        assert_eq!(Tiles::for_queries(600), Tiles::default());
    }
}
