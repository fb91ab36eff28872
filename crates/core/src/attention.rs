//! Exact scaled-dot-product attention, written once for every policy, with scratch bounded
//! by tiles rather than by the context (HeadInfer §3.3: attention memory must not grow with
//! the context, or a million tokens cannot fit however the KV is placed).
//!
//! * Queries of a step sit at absolute positions `q_pos..q_pos + t`; the keys handed in sit
//!   at `k_pos..k_pos + s`. The causal and sliding-window masks are computed from those
//!   absolute positions, so a prefill chunk that starts at an offset, a decode step, and a
//!   piece of the cache (a token range, as in KVPR §3.2) all use the same code.
//! * Grouped-query attention never repeats K/V per query head: the `g = n_heads /
//!   n_kv_heads` query heads of one KV head are folded into the row dimension, so one
//!   batched matmul serves the whole group (query head `h` uses KV head `h / g`, as HF's
//!   `repeat_kv` does).
//! * Logit soft-capping (`cap · tanh(s / cap)`, Gemma 2) is applied before masking.
//! * [`attend_partial`] also returns the log-sum-exp of every query row, so attentions over
//!   disjoint key sets merge exactly ([`merge_partials`]): this is what lets head-wise
//!   offload (HeadInfer §3) and partial recompute (KVPR §3) attend over pieces.
//!
//! * On the CPU every call runs the fused kernel `kvpolicy_kernels::flash_attn`: tiles of
//!   query rows against tiles of keys with an online softmax, tiles outside the visible
//!   range skipped, masks only on diagonal and window-edge tiles, f32 accumulation. On
//!   other devices, [`tiled::attend_partial_tiled`] does the same with candle ops, one
//!   tile's scores at a time. candle-nn's `flash_attn` is not used: it has no sliding
//!   window and returns no log-sum-exp, both of which the policies need.
//! * [`eager`] keeps the whole-call eager attention (every score at once) as the reference
//!   the tests compare against.
use candle_core::{DType, Device, Tensor};
pub use kvpolicy_kernels::CallShape;
pub use kvpolicy_kernels::KvRun;
/// Keys per tile of the CPU kernel: [`attend_partial_runs`] over runs whose lengths (all
/// but the last) are multiples of it gives the result over the runs joined, bit for bit.
pub const RUN_ALIGN: usize = kvpolicy_kernels::TILE_KEYS;
use kvpolicy_kernels::{flash_attn, flash_attn_runs, FlashParams};

use crate::error::{KvError, Result};
use crate::storage::KvCodec;

pub mod eager;
mod spec;
pub mod tiled;

pub use spec::{merge_partials, AttnInputs, AttnSpec, Partial};

pub use eager::{attend_eager, attend_partial_eager, mask_values};

/// Attention of `q` `(b, n_heads, t, d)` over `k`, `v` `(b, n_kv_heads, s, d)`; returns
/// `(b, n_heads, t, d)` in the dtype of `q`. Queries sit at `q_pos..`, keys at `k_pos..`.
/// A query that sees no key gets 0.
pub fn attend(x: AttnInputs<'_>, spec: &AttnSpec) -> Result<Tensor> {
    let AttnInputs {
        q,
        k,
        v,
        q_pos,
        k_pos,
    } = x;
    Ok(attend_partial(
        AttnInputs {
            q,
            k,
            v,
            q_pos,
            k_pos,
        },
        spec,
    )?
    .out
    .to_dtype(q.dtype())?)
}

/// Like [`attend`] but returns the f32 output together with each row's log-sum-exp (so that
/// attentions over disjoint key sets can be merged with [`merge_partials`]) and the scratch
/// the call used.
pub fn attend_partial(x: AttnInputs<'_>, spec: &AttnSpec) -> Result<Partial> {
    let AttnInputs {
        q,
        k,
        v,
        q_pos,
        k_pos,
    } = x;
    let (b, nh, t, d) = q.dims4()?;
    let (kb, nkv, s, kd) = k.dims4()?;
    // A cache stored as q8_0 (`kv_dtype`) holds rows of blocks: u8, the codec's width.
    let q8 = k.dtype() == DType::U8;
    let width = if q8 {
        KvCodec::Q8_0.stored(q.dtype(), d).1
    } else {
        d
    };
    if q8 {
        KvCodec::Q8_0.check(d)?;
    }
    if kb != b || kd != width || nkv == 0 || nh % nkv != 0 || v.dims() != k.dims() {
        return Err(KvError::Shape(format!(
            "queries {:?} do not fit keys {:?} and values {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if s == 0 || t == 0 {
        return Partial::empty(b, nh, t, d, q.device());
    }
    if !q.device().is_cpu() {
        // Candle's ops take one dtype: a cache stored smaller (`kv_dtype`) is widened here.
        let (k, v) = if k.dtype() == q.dtype() {
            (k.clone(), v.clone())
        } else {
            (widen(k, q.dtype(), d)?, widen(v, q.dtype(), d)?)
        };
        return tiled::attend_partial_tiled(
            AttnInputs {
                q,
                k: &k,
                v: &v,
                q_pos,
                k_pos,
            },
            spec,
            tiled::Tiles::for_call(&CallShape {
                b,
                n_kv: nkv,
                group: nh / nkv,
                t,
                s,
                d,
                half: q.dtype() != DType::F32,
            }),
        );
    }
    // Anything the kernel does not read in place is converted to q's dtype first.
    let dt = q.dtype();
    let (k, v) = if read_in_place(dt, k.dtype(), v.dtype()) {
        (k.clone(), v.clone())
    } else {
        (widen(k, dt, d)?, widen(v, dt, d)?)
    };
    let f = flash_attn(q, &k, &v, &flash_params(spec, q_pos, k_pos))?;
    Ok(partial_of(f))
}

/// Whether the CPU kernel reads K/V of dtypes `k` and `v` in place under queries of `q`:
/// K/V of q's dtype, or f16/bf16/q8_0 under f32 queries (a cache stored smaller,
/// `kv_dtype`).
fn read_in_place(q: DType, k: DType, v: DType) -> bool {
    k == q || (q == DType::F32 && matches!(k, DType::F16 | DType::BF16 | DType::U8) && v == k)
}

/// The kernel's parameters for `spec`, queries at `q_pos`, keys at `k_pos`.
fn flash_params(spec: &AttnSpec, q_pos: usize, k_pos: usize) -> FlashParams {
    FlashParams {
        scale: spec.scale as f32,
        softcap: spec.softcap.map(|c| c as f32),
        causal: spec.causal,
        window: spec.sliding_window,
        q_pos,
        k_pos,
    }
}

/// The kernel's result as a [`Partial`].
fn partial_of(f: kvpolicy_kernels::FlashOut) -> Partial {
    Partial {
        out: f.out,
        lse: f.lse,
        scratch_bytes: f.scratch_peak_bytes,
    }
}

/// [`attend_partial`] over keys and values held in several runs of storage, one after
/// another from `k_pos` (a prefix shared by reference, [`crate::lease`], then a sequence's
/// own buffer). On the CPU, with K/V the kernel reads in place, one kernel call walks the
/// runs' tiles ([`kvpolicy_kernels::flash_attn_runs`]): runs of whole tiles give exactly
/// the result over the runs joined. Elsewhere the runs are joined (a copy) and attended as
/// one.
pub fn attend_partial_runs(
    q: &Tensor,
    runs: &[KvRun<'_>],
    q_pos: usize,
    k_pos: usize,
    spec: &AttnSpec,
) -> Result<Partial> {
    let mut kept = Vec::with_capacity(runs.len());
    for r in runs {
        if r.k.dim(2)? > 0 {
            kept.push(*r);
        }
    }
    let runs = kept;
    let one_call = q.device().is_cpu()
        && q.dim(2)? > 0
        && runs.iter().all(|r| {
            r.k.device().is_cpu()
                && read_in_place(q.dtype(), r.k.dtype(), r.v.dtype())
                && r.v.dtype() == r.k.dtype()
        });
    match runs.as_slice() {
        [] => {
            let (b, nh, t, d) = q.dims4()?;
            Partial::empty(b, nh, t, d, q.device())
        }
        [one] => attend_partial(inputs(q, one, q_pos, k_pos), spec),
        _ if one_call => Ok(partial_of(flash_attn_runs(
            q,
            &runs,
            &flash_params(spec, q_pos, k_pos),
        )?)),
        many => {
            let k = Tensor::cat(&many.iter().map(|r| r.k).collect::<Vec<_>>(), 2)?;
            let v = Tensor::cat(&many.iter().map(|r| r.v).collect::<Vec<_>>(), 2)?;
            attend_partial(inputs(q, &KvRun { k: &k, v: &v }, q_pos, k_pos), spec)
        }
    }
}

/// The inputs of one call over one run.
fn inputs<'a>(q: &'a Tensor, run: &KvRun<'a>, q_pos: usize, k_pos: usize) -> AttnInputs<'a> {
    AttnInputs {
        q,
        k: run.k,
        v: run.v,
        q_pos,
        k_pos,
    }
}

/// Stored K or V (`kv_dtype`'s form) as `dt` values of width `d`: q8_0 blocks (u8) are
/// dequantized, a float type converted.
fn widen(t: &Tensor, dt: DType, d: usize) -> Result<Tensor> {
    if t.dtype() == DType::U8 {
        KvCodec::Q8_0.decode(t, dt, d)
    } else {
        Ok(t.to_dtype(dt)?)
    }
}

/// The most attention scratch one call of `call`'s sizes may hold on `device`. On the CPU
/// exact for calls where every query sees every key, an upper bound otherwise; elsewhere an
/// upper bound for any call of at most `call.t` queries. Bounded by the tiles for any
/// context. Policies plan device budgets with it.
pub fn scratch_bound(call: &CallShape, device: &Device) -> u64 {
    if device.is_cpu() {
        return kvpolicy_kernels::flash::scratch_bytes(call, kvpolicy_kernels::flash::threads());
    }
    tiled::scratch_bound(call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn naive(q: &Tensor, k: &Tensor, v: &Tensor, q_pos: usize, spec: &AttnSpec) -> Result<Tensor> {
        // Per query head, repeat KV explicitly, full mask from positions.
        let (_b, nh, t, _d) = q.dims4()?;
        let s = k.dim(2)?;
        let g = spec.group_size();
        let mut outs = Vec::new();
        for h in 0..nh {
            let qh = q.narrow(1, h, 1)?;
            let kh = k.narrow(1, h / g, 1)?;
            let vh = v.narrow(1, h / g, 1)?;
            let mut sc = (qh.matmul(&kh.t()?)? * spec.scale)?;
            if let Some(c) = spec.softcap {
                sc = ((sc / c)?.tanh()? * c)?;
            }
            let mut m = vec![0f32; t * s];
            for i in 0..t {
                for j in 0..s {
                    let qp = q_pos + i;
                    let ok = j <= qp && spec.sliding_window.is_none_or(|w| qp - j < w);
                    if !ok {
                        m[i * s + j] = f32::NEG_INFINITY;
                    }
                }
            }
            let m = Tensor::from_vec(m, (1, 1, t, s), q.device())?;
            let p = candle_nn::ops::softmax_last_dim(&sc.broadcast_add(&m)?)?;
            outs.push(p.matmul(&vh)?);
        }
        Ok(Tensor::cat(&outs, 1)?)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    }

    #[test]
    fn decode_rows_of_every_group_size_match_naive_over_f32_and_half_caches() -> Result<()> {
        // The decode path's register-blocked products (1–8 rows each their own blocking,
        // more through memory), keys in and out of whole blocks of 8, widths with and
        // without a remainder, f32 queries over f32, f16 and bf16 K/V.
        let dev = Device::Cpu;
        for g in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16] {
            for (d, s) in [
                (64usize, 701usize),
                (40, 13),
                (256, 9),
                (256, 40),
                (256, 77),
            ] {
                let spec = AttnSpec::new(2 * g, 2, d);
                let q = Tensor::randn(0f32, 1.0, (1, 2 * g, 1, d), &dev)?;
                let k = Tensor::randn(0f32, 1.0, (1, 2, s, d), &dev)?;
                let v = Tensor::randn(0f32, 1.0, (1, 2, s, d), &dev)?;
                for dt in [DType::F32, DType::F16, DType::BF16] {
                    let (kd, vd) = (k.to_dtype(dt)?, v.to_dtype(dt)?);
                    let want = naive(
                        &q,
                        &kd.to_dtype(DType::F32)?,
                        &vd.to_dtype(DType::F32)?,
                        s - 1,
                        &spec,
                    )?;
                    let got = attend_partial(
                        AttnInputs {
                            q: &q,
                            k: &kd,
                            v: &vd,
                            q_pos: s - 1,
                            k_pos: 0,
                        },
                        &spec,
                    )?;
                    let diff = max_diff(&got.out, &want)?;
                    assert!(diff < 1e-5, "g {g} d {d} s {s} {dt:?}: {diff}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn matches_naive_with_gqa_window_softcap_and_offset() -> Result<()> {
        let dev = Device::Cpu;
        for (window, cap) in [
            (None, None),
            (Some(3), None),
            (None, Some(5.0)),
            (Some(4), Some(2.0)),
        ] {
            let mut spec = AttnSpec::new(6, 2, 8);
            spec.sliding_window = window;
            spec.softcap = cap;
            let (t, s) = (5, 12);
            let q_pos = s - t;
            let q = Tensor::randn(0f32, 2.0, (2, 6, t, 8), &dev)?;
            let k = Tensor::randn(0f32, 2.0, (2, 2, s, 8), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (2, 2, s, 8), &dev)?;
            let want = naive(&q, &k, &v, q_pos, &spec)?;
            let got = attend(
                AttnInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    q_pos,
                    k_pos: 0,
                },
                &spec,
            )?;
            assert!(max_diff(&want, &got)? < 1e-5);
            let part = attend_partial(
                AttnInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    q_pos,
                    k_pos: 0,
                },
                &spec,
            )?;
            assert!(max_diff(&want, &part.out)? < 1e-5);
            // Split the keys at every point and merge: must equal the whole.
            for cut in 0..=s {
                let a = attend_partial(
                    AttnInputs {
                        q: &q,
                        k: &k.narrow(2, 0, cut)?,
                        v: &v.narrow(2, 0, cut)?,
                        q_pos,
                        k_pos: 0,
                    },
                    &spec,
                )?;
                let b = attend_partial(
                    AttnInputs {
                        q: &q,
                        k: &k.narrow(2, cut, s - cut)?,
                        v: &v.narrow(2, cut, s - cut)?,
                        q_pos,
                        k_pos: cut,
                    },
                    &spec,
                )?;
                let m = merge_partials(&[a, b])?;
                assert!(
                    max_diff(&want, &m.out)? < 1e-5,
                    "cut {cut} window {window:?}"
                );
                assert!(max_diff(&part.lse, &m.lse)? < 1e-4);
            }
        }
        Ok(())
    }

    #[test]
    fn mask_is_skipped_only_when_everything_is_visible() {
        let spec = AttnSpec::new(1, 1, 4);
        assert!(mask_values(1, 10, 9, 0, &spec).is_none());
        assert!(mask_values(2, 10, 8, 0, &spec).is_some());
        let mut w = spec.clone();
        w.sliding_window = Some(4);
        assert!(mask_values(1, 4, 9, 6, &w).is_none());
        assert!(mask_values(1, 5, 9, 5, &w).is_some());
    }

    #[test]
    fn q8_0_caches_are_read_as_their_values_under_any_query_dtype() -> Result<()> {
        // u8 K/V are q8_0 blocks: f32 queries read them in place, f16/bf16 queries over
        // their dequantized values; a width that is not the blocks' is refused.
        let dev = Device::Cpu;
        let spec = AttnSpec::new(4, 2, 64);
        let (t, s) = (3, 300);
        let k = Tensor::randn(0f32, 1.0, (1, 2, s, 64), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (1, 2, s, 64), &dev)?;
        let (kq, vq) = (KvCodec::Q8_0.encode(&k)?, KvCodec::Q8_0.encode(&v)?);
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let q = Tensor::randn(0f32, 1.0, (1, 4, t, 64), &dev)?.to_dtype(dt)?;
            let at = |k: &Tensor, v: &Tensor| {
                attend_partial(
                    AttnInputs {
                        q: &q,
                        k,
                        v,
                        q_pos: s - t,
                        k_pos: 0,
                    },
                    &spec,
                )
            };
            let (kd, vd) = (
                KvCodec::Q8_0.decode(&kq, dt, 64)?,
                KvCodec::Q8_0.decode(&vq, dt, 64)?,
            );
            let (got, want) = (at(&kq, &vq)?, at(&kd, &vd)?);
            assert!(max_diff(&got.out, &want.out)? <= 1e-6, "{dt:?}");
            // Rows of 64 bytes are not 64 values' blocks (68 bytes).
            let cut = kq.narrow(3, 0, 64)?;
            assert!(at(&cut, &cut).is_err(), "{dt:?}");
        }
        Ok(())
    }
}
