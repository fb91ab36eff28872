//! The CPU side of [`super::flash_attn_runs`]: the attention of [`super::flash_attn`] over
//! keys and values held in several runs of storage — a prefix shared by reference between sequences (vLLM's
//! PagedAttention blocks, SOSP '23 §4.3; SGLang's radix cache) followed by a sequence's own
//! buffer — without joining them. On the CPU the kernel walks the runs' tiles in order, a
//! tile never crossing from one run to the next: runs whose lengths are whole tiles
//! ([`super::TILE_KEYS`]) give the tiles of one joined buffer, so the result is that of
//! [`super::flash_attn`] over the joined keys, bit for bit. On other devices the runs are
//! joined (a copy) and attended as one.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Tensor};

use super::cpu::{compute_runs, Seg};
use super::elem::{Elem, Q8Block};
use super::plan::{FlashParams, Geometry, Meter};

/// One run of keys and values `(b, n_kv_heads, len, d)`, any strides.
#[derive(Clone, Copy, Debug)]
pub struct KvRun<'a> {
    /// Keys.
    pub k: &'a Tensor,
    /// Values.
    pub v: &'a Tensor,
}

/// One run's storages and layouts on the CPU.
pub(super) struct CpuRun<'a> {
    pub k: &'a CpuStorage,
    pub kl: &'a Layout,
    pub v: &'a CpuStorage,
    pub vl: &'a Layout,
}

/// An element type's slice of a CPU storage, when it holds that type.
trait FromCpu: Elem {
    fn of(s: &CpuStorage) -> Option<&[Self]>;
}

impl FromCpu for f32 {
    fn of(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F32(x) => Some(x),
            _ => None,
        }
    }
}

impl FromCpu for half::f16 {
    fn of(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F16(x) => Some(x),
            _ => None,
        }
    }
}

impl FromCpu for half::bf16 {
    fn of(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::BF16(x) => Some(x),
            _ => None,
        }
    }
}

impl FromCpu for Q8Block {
    fn of(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::U8(x) => Some(Q8Block::slice(x)),
            _ => None,
        }
    }
}

/// The kernel over `runs`: `(b, n_heads, t, d + 1)` f32, each row's output then its
/// log-sum-exp. Every run's keys and values share one dtype; queries are in it or f32.
pub(super) fn attend_cpu(
    q: &CpuStorage,
    ql: &Layout,
    runs: &[CpuRun<'_>],
    p: FlashParams,
    m: &Meter,
) -> Result<Vec<f32>> {
    let first = runs
        .first()
        .ok_or_else(|| candle_core::Error::Msg("flash_attn: no keys given".into()))?;
    match (q, first.k) {
        (CpuStorage::F32(q), CpuStorage::U8(_)) => over::<f32, Q8Block>(q, ql, runs, p, m),
        (CpuStorage::F32(q), CpuStorage::F32(_)) => over::<f32, f32>(q, ql, runs, p, m),
        (CpuStorage::F16(q), CpuStorage::F16(_)) => over::<half::f16, half::f16>(q, ql, runs, p, m),
        (CpuStorage::BF16(q), CpuStorage::BF16(_)) => {
            over::<half::bf16, half::bf16>(q, ql, runs, p, m)
        }
        (CpuStorage::F32(q), CpuStorage::F16(_)) => over::<f32, half::f16>(q, ql, runs, p, m),
        (CpuStorage::F32(q), CpuStorage::BF16(_)) => over::<f32, half::bf16>(q, ql, runs, p, m),
        _ => Err(mixed(q, first)),
    }
}

/// The error for dtypes the kernel does not take together.
fn mixed(q: &CpuStorage, run: &CpuRun<'_>) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flash_attn: keys and values must share a dtype, and queries be in it or f32 (u8 keys and values: q8_0 blocks under f32 queries; got {:?}, {:?}, {:?})",
        q.dtype(),
        run.k.dtype(),
        run.v.dtype()
    ))
}

/// The kernel for queries of type `Q` over runs of type `T`, each run's geometry checked
/// against the queries and the first run's.
fn over<Q: Elem, T: FromCpu>(
    q: &[Q],
    ql: &Layout,
    runs: &[CpuRun<'_>],
    p: FlashParams,
    m: &Meter,
) -> Result<Vec<f32>> {
    let q8 = T::VALUES > 1;
    let mut segs = Vec::with_capacity(runs.len());
    let mut total: Option<Geometry> = None;
    for r in runs {
        let g = if q8 {
            Geometry::of_q8(ql, r.kl, r.vl)?
        } else {
            Geometry::of(ql, r.kl, r.vl)?
        };
        let (Some(k), Some(v)) = (T::of(r.k), T::of(r.v)) else {
            return Err(candle_core::Error::Msg(format!(
                "flash_attn: every run's keys and values must share one dtype (got {:?} and {:?} after a run of another)",
                r.k.dtype(),
                r.v.dtype()
            )));
        };
        let start = total.map_or(0, |t| t.s);
        if let Some(t) = total.as_mut() {
            if (t.b, t.nkv, t.d) != (g.b, g.nkv, g.d) {
                return Err(candle_core::Error::Msg(format!(
                    "flash_attn: a run of {} sequences × {} KV heads of width {} after runs of {} × {} of width {}",
                    g.b, g.nkv, g.d, t.b, t.nkv, t.d
                )));
            }
            t.s += g.s;
        } else {
            total = Some(g);
        }
        segs.push(Seg {
            k,
            v,
            kview: g.k,
            vview: g.v,
            start,
            len: g.s,
        });
    }
    let g = total.ok_or_else(|| candle_core::Error::Msg("flash_attn: no keys given".into()))?;
    segs.retain(|s| s.len > 0);
    Ok(compute_runs(g, p, q, &segs, m))
}
