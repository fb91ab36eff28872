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
//! The CPU implementation (`cpu_fwd`) is the reference: f32/f16/bf16 inputs (and K/V as
//! q8_0 blocks under f32 queries), f32 accumulation, the tile products through the `gemm`
//! crate (candle's own matmul backend, SIMD dispatched at run time), candle's CPU worker
//! pool across (batch, KV head, query tile) items and, when those are fewer than the
//! threads (decode), across ranges of keys merged by their log-sum-exp. Every scratch
//! buffer is counted while it lives; [`flash_attn`] reports the peak.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

mod cpu;
mod elem;
mod plan;
mod runs;
mod small;
pub mod softmax;
mod workspace;
pub use elem::{Q8_BYTES, Q8_VALUES};
use plan::Meter;
pub use plan::{scratch_bytes, threads, CallShape, FlashParams, TILE_KEYS, TILE_ROWS};
pub use runs::KvRun;

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

/// Attention of `q` over the keys and values of `runs`, one after another (the first key
/// of run 0 at `params.k_pos`), as [`flash_attn`] over them joined would compute it.
pub fn flash_attn_runs(q: &Tensor, runs: &[KvRun<'_>], params: &FlashParams) -> Result<FlashOut> {
    match runs {
        [] => Err(candle_core::Error::Msg(
            "flash_attn_runs: no keys given (at least one run)".into(),
        )),
        [one] => flash_attn(q, one.k, one.v, params),
        _ if !on_cpu(q, runs) => {
            let ks = runs.iter().map(|r| r.k).collect::<Vec<_>>();
            let vs = runs.iter().map(|r| r.v).collect::<Vec<_>>();
            flash_attn(q, &Tensor::cat(&ks, 2)?, &Tensor::cat(&vs, 2)?, params)
        }
        _ => {
            let (b, nh, t, d) = q.dims4()?;
            let meter = Arc::new(Meter::default());
            let (qs, ql) = q.storage_and_layout();
            let held = runs
                .iter()
                .map(|r| (r.k.storage_and_layout(), r.v.storage_and_layout()))
                .collect::<Vec<_>>();
            let parts = held
                .iter()
                .map(|((ks, kl), (vs, vl))| match (&**ks, &**vs) {
                    (Storage::Cpu(k), Storage::Cpu(v)) => Ok(runs::CpuRun { k, kl, v, vl }),
                    _ => Err(candle_core::Error::Msg(
                        "flash_attn_runs: keys moved off the CPU".into(),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            let Storage::Cpu(qc) = &*qs else {
                return Err(candle_core::Error::Msg(
                    "flash_attn_runs: queries moved off the CPU".into(),
                ));
            };
            let out = runs::attend_cpu(qc, ql, &parts, *params, &meter)?;
            let both = Tensor::from_vec(out, (b, nh, t, d + 1), q.device())?;
            Ok(FlashOut {
                out: both.narrow(3, 0, d)?.contiguous()?,
                lse: both.narrow(3, d, 1)?.reshape((b, nh, t))?,
                scratch_peak_bytes: meter.peak.load(Ordering::Relaxed),
            })
        }
    }
}

/// Whether the queries and every run are on the CPU.
fn on_cpu(q: &Tensor, runs: &[KvRun<'_>]) -> bool {
    q.device().is_cpu()
        && runs
            .iter()
            .all(|r| r.k.device().is_cpu() && r.v.device().is_cpu())
}

/// The op: `q.apply_op3_no_bwd(k, v, &op)` gives `(b, n_heads, t, d + 1)` f32, each row's
/// output followed by its log-sum-exp. Use [`flash_attn`].
#[derive(Debug, Clone)]
pub struct FlashAttn {
    /// What the call computes.
    pub params: FlashParams,
    pub(crate) meter: Arc<Meter>,
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
        let (b, nh, t, d) = ql.shape().dims4()?;
        let run = [runs::CpuRun { k, kl, v, vl }];
        let out = runs::attend_cpu(q, ql, &run, self.params, &self.meter)?;
        Ok((CpuStorage::F32(out), Shape::from((b, nh, t, d + 1))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// What a call allocates is what [`scratch_bytes`] says, for decode steps and chunks,
    /// with and without splits, f32, half and q8_0 inputs.
    #[test]
    fn scratch_matches_the_formula() -> Result<()> {
        let dev = Device::Cpu;
        let threads = threads();
        for (b, nkv, g, t, s, d) in [
            (1, 3, 3, 1, 4096, 64),
            (1, 1, 3, 1, 600, 64),
            (2, 2, 4, 70, 300, 16),
            (1, 3, 3, 512, 2048, 64),
        ] {
            // u8: q8_0 blocks under f32 queries, widened per tile as halves are.
            for dt in [
                candle_core::DType::F32,
                candle_core::DType::BF16,
                candle_core::DType::U8,
            ] {
                let (qt, w) = match dt {
                    candle_core::DType::U8 if d % Q8_VALUES != 0 => continue,
                    candle_core::DType::U8 => (candle_core::DType::F32, d / Q8_VALUES * Q8_BYTES),
                    _ => (dt, d),
                };
                let q = Tensor::ones((b, nkv * g, t, d), qt, &dev)?;
                let k = Tensor::ones((b, nkv, s, w), dt, &dev)?;
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
