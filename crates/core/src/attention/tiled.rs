//! Tiled attention from candle ops, for devices without a fused kernel: queries in tiles of
//! [`TILE_QUERIES`] positions, keys in tiles of [`TILE_KEYS`], each tile attended eagerly
//! ([`super::eager`]) and folded into a running result by its log-sum-exp (the online
//! softmax of FlashAttention §3.1, one tile at a time). Key tiles a query tile cannot see
//! (in its future, or before its sliding window) are skipped; wholly visible tiles need no
//! mask. Scratch is bounded by one tile's (its scores, results and contiguous K/V), whatever
//! the context. A call of few queries (decode) takes more keys per tile ([`Tiles::for_call`]),
//! within a full tile's scratch, in far fewer passes — each tile is some twenty kernel
//! launches, and a decode step over 32K keys in 2,048-key tiles was launch-bound (H200: 4.98
//! tok/s at the Llama-3-8B shape, bench-results/2026-11-27-gpu-h200-first-run.md).
use candle_core::{DType, Tensor};
use kvpolicy_kernels::CallShape;

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
    /// The tiles for `call`: [`TILE_QUERIES`] queries, and keys — a multiple of
    /// [`TILE_KEYS`] — as many as keep one tile's scratch (scores, results, contiguous K/V)
    /// within a full tile's ([`TILE_QUERIES`] × [`TILE_KEYS`]): `TILE_KEYS` for `t` ≥ `TILE_QUERIES`,
    /// more for fewer queries (at the Llama-3-8B shape in bf16, 65,536 for one query: a
    /// decode step over 32K keys is one tile).
    pub fn for_call(call: &CallShape) -> Self {
        let rows = call.t.clamp(1, TILE_QUERIES);
        let one = CallShape { t: rows, ..*call };
        let fixed = tile_scratch_bytes(&one, rows, 0);
        let per_key = tile_scratch_bytes(&one, rows, 1) - fixed;
        let full = tile_scratch_bytes(&one, TILE_QUERIES, TILE_KEYS);
        let keys = match per_key {
            0 => TILE_KEYS,
            n => ((full.saturating_sub(fixed) / n) as usize / TILE_KEYS).max(1) * TILE_KEYS,
        };
        Self {
            queries: TILE_QUERIES,
            keys,
        }
    }
}

/// Scratch of one tile of `rows` query positions of `call` (all its sequences and heads)
/// against `keys` keys: the scores and probabilities (f32), the running and the tile's
/// results with their log-sum-exps, and the tile's K and V made contiguous in the queries'
/// dtype (16-bit when `call.half`).
pub(crate) fn tile_scratch_bytes(call: &CallShape, rows: usize, keys: usize) -> u64 {
    let heads = call.b * call.n_kv * call.group;
    let kv = if call.half { 2 } else { 4 };
    (4 * (2 * heads * rows * keys + 2 * heads * rows * (call.d + 1))
        + 2 * call.b * call.n_kv * keys * call.d * kv) as u64
}

/// The most scratch the tiles of any call of `call`'s shape with at most `call.t` queries
/// hold: a bound for every step up to the one planned (fewer queries take more keys, so
/// the bound is the largest over every query count, not the planned one's).
pub(crate) fn scratch_bound(call: &CallShape) -> u64 {
    if call.t == 0 || call.s == 0 {
        return 0;
    }
    (1..=call.t.min(TILE_QUERIES))
        .map(|rows| {
            let c = CallShape { t: rows, ..*call };
            tile_scratch_bytes(&c, rows, call.s.min(Tiles::for_call(&c).keys))
        })
        .max()
        .unwrap_or(0)
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
    let nkv = k.dim(1)?.max(1);
    let shape = CallShape {
        b,
        n_kv: nkv,
        group: nh / nkv,
        t,
        s,
        d,
        half: q.dtype() != DType::F32,
    };
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
            scratch = scratch.max(tile_scratch_bytes(&shape, n, nk));
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
    use candle_core::Device;

    fn shape(b: usize, n_kv: usize, group: usize, t: usize, s: usize, d: usize) -> CallShape {
        CallShape {
            b,
            n_kv,
            group,
            t,
            s,
            d,
            half: true,
        }
    }

    #[test]
    fn few_queries_take_more_keys_within_a_full_tiles_scratch() {
        // Llama-3-8B in bf16, a small GQA model, and MHA with a batch.
        for (b, n_kv, group, d) in [(1, 8, 4, 128), (1, 1, 9, 64), (3, 12, 1, 64)] {
            let full = tile_scratch_bytes(&shape(b, n_kv, group, 512, 0, d), 512, TILE_KEYS);
            for t in (1..=1100).step_by(7).chain([256, 257, 512, 513]) {
                let call = shape(b, n_kv, group, t, 1 << 20, d);
                let tiles = Tiles::for_call(&call);
                assert_eq!(tiles.keys % TILE_KEYS, 0, "t = {t}");
                assert!(tiles.keys >= TILE_KEYS, "t = {t}");
                let rows = t.min(TILE_QUERIES);
                assert!(
                    tile_scratch_bytes(&call, rows, tiles.keys) <= full,
                    "t = {t}"
                );
            }
        }
        let decode = Tiles::for_call(&shape(1, 8, 4, 1, 32768, 128));
        assert!(decode.keys >= 32768, "{decode:?}");
        assert_eq!(
            Tiles::for_call(&shape(1, 8, 4, 600, 1, 128)),
            Tiles::default()
        );
    }

    /// The planned bound (the largest step's) covers every smaller step's tiles, and every
    /// call's own reported scratch — for any query count, batch and context.
    #[test]
    fn the_bound_covers_every_step_up_to_the_planned_one() -> Result<()> {
        for (b, n_kv, group, d, s) in [(2, 2, 2, 8, 300), (1, 1, 3, 4, 9000)] {
            let spec = AttnSpec::new(n_kv * group, n_kv, d);
            let mut bounds = Vec::new();
            for t in [1, 2, 5, 64, 257, 512, 700] {
                let call = shape(b, n_kv, group, t, s, d);
                bounds.push(scratch_bound(&CallShape {
                    half: false,
                    ..call
                }));
            }
            assert!(bounds.windows(2).all(|w| w[0] <= w[1]), "{bounds:?}");
            for t in [1, 5, 64] {
                let dev = Device::Cpu;
                let q = Tensor::ones((b, n_kv * group, t, d), DType::F32, &dev)?;
                let k = Tensor::ones((b, n_kv, s, d), DType::F32, &dev)?;
                let call = CallShape {
                    half: false,
                    ..shape(b, n_kv, group, t, s, d)
                };
                let p = attend_partial_tiled(
                    AttnInputs {
                        q: &q,
                        k: &k,
                        v: &k,
                        q_pos: s - t,
                        k_pos: 0,
                    },
                    &spec,
                    Tiles::for_call(&call),
                )?;
                assert!(p.scratch_bytes <= scratch_bound(&call), "t = {t}, s = {s}");
                let planned = CallShape { t: 700, ..call };
                assert!(
                    p.scratch_bytes <= scratch_bound(&planned),
                    "t = {t}, s = {s}"
                );
            }
        }
        Ok(())
    }
}
