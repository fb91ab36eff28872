//! Attention over keys in several runs of storage (`flash_attn_runs`: a prefix shared by
//! reference, then a sequence's own buffer) equals the attention over the same keys joined
//! in one buffer: bit for bit when every run but the last is whole tiles (`TILE_KEYS`), as
//! a prefix cache's chunks are, and no window cuts the first tile; to rounding otherwise.
//! For decode rows and chunks, GQA groups, f32, f16 and f32 queries over f16 keys, the last
//! run a view into a larger buffer (a policy's preallocated cache).
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy_kernels::flash::{flash_attn, flash_attn_runs, FlashParams, KvRun, TILE_KEYS};
use proptest::prelude::*;

/// One case: the runs' lengths, the queries and the dtypes.
#[derive(Debug, Clone)]
struct Case {
    n_kv: usize,
    group: usize,
    t: usize,
    d: usize,
    /// Keys per run (the last may be any length).
    runs: Vec<usize>,
    window: Option<usize>,
    /// Query dtype, key/value dtype.
    dtypes: (DType, DType),
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?;
    Ok(d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The runs' result and the joined buffer's, and their largest difference.
fn check(c: &Case) -> Result<(f32, f32)> {
    let dev = Device::Cpu;
    let s: usize = c.runs.iter().sum();
    let (qd, kd) = c.dtypes;
    let q = Tensor::randn(0f32, 1.0, (1, c.n_kv * c.group, c.t, c.d), &dev)?.to_dtype(qd)?;
    // The last run is a view of a buffer with room to spare, as a policy's own buffer is.
    let spare = 7;
    let k = Tensor::randn(0f32, 1.0, (1, c.n_kv, s + spare, c.d), &dev)?.to_dtype(kd)?;
    let v = Tensor::randn(0f32, 1.0, (1, c.n_kv, s + spare, c.d), &dev)?.to_dtype(kd)?;
    let joined = (k.narrow(2, 0, s)?, v.narrow(2, 0, s)?);
    let mut parts = Vec::new();
    let mut at = 0;
    for (i, &n) in c.runs.iter().enumerate() {
        let last = i + 1 == c.runs.len();
        let part = |x: &Tensor| -> Result<Tensor> {
            let p = x.narrow(2, at, n)?;
            // Every run but the last in storage of its own, as a shared chunk is.
            Ok(if last { p } else { p.copy()? })
        };
        parts.push((part(&k)?, part(&v)?));
        at += n;
    }
    let runs = parts
        .iter()
        .map(|(k, v)| KvRun { k, v })
        .collect::<Vec<_>>();
    let p = FlashParams {
        scale: 1.0 / (c.d as f32).sqrt(),
        softcap: None,
        causal: true,
        window: c.window,
        q_pos: s - c.t,
        k_pos: 0,
    };
    let got = flash_attn_runs(&q, &runs, &p)?;
    let want = flash_attn(&q, &joined.0, &joined.1, &p)?;
    Ok((
        max_diff(&got.out, &want.out)?,
        max_diff(&got.lse, &want.lse)?,
    ))
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..3,
        prop::sample::select(vec![1usize, 3, 8]),
        prop::sample::select(vec![1usize, 2, 17, 64]),
        prop::sample::select(vec![32usize, 64]),
        (0usize..4, 1usize..300),
        prop::sample::select(vec![
            (DType::F32, DType::F32),
            (DType::F16, DType::F16),
            (DType::F32, DType::F16),
        ]),
    )
        .prop_map(|(n_kv, group, t, d, (whole, tail), dtypes)| {
            let mut runs = vec![TILE_KEYS; whole];
            runs.push(tail.max(t));
            Case {
                n_kv,
                group,
                t,
                d,
                runs,
                window: None,
                dtypes,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Runs of whole tiles then any tail: the joined buffer's result, bit for bit.
    #[test]
    fn whole_tile_runs_equal_one_buffer(c in cases()) {
        let (out, lse) = check(&c).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(out, 0.0, "{:?}", c);
        prop_assert_eq!(lse, 0.0, "{:?}", c);
    }
}

/// Runs that cut tiles (a chunk size that is not a multiple of the tile, or a window
/// starting inside a run) are the same attention, to rounding.
#[test]
fn ragged_runs_agree_to_rounding() -> Result<()> {
    let shapes = [vec![100, 100, 57], vec![1, 300, 3], vec![255, 257, 1]];
    for (runs, window) in shapes.into_iter().zip([None, None, Some(100)]) {
        let c = Case {
            n_kv: 2,
            group: 3,
            t: 1,
            d: 64,
            runs,
            window,
            dtypes: (DType::F32, DType::F32),
        };
        let (out, lse) = check(&c)?;
        assert!(out < 1e-5 && lse < 1e-5, "{c:?}: {out} {lse}");
    }
    Ok(())
}

/// Runs must agree in heads and width, and at least one is needed.
#[test]
fn mismatched_runs_are_refused() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 4, 1, 32), DType::F32, &dev)?;
    let a = Tensor::zeros((1, 2, 8, 32), DType::F32, &dev)?;
    let b = Tensor::zeros((1, 1, 8, 32), DType::F32, &dev)?;
    let p = FlashParams {
        scale: 1.0,
        softcap: None,
        causal: false,
        window: None,
        q_pos: 0,
        k_pos: 0,
    };
    let runs = [KvRun { k: &a, v: &a }, KvRun { k: &b, v: &b }];
    let e = flash_attn_runs(&q, &runs, &p).unwrap_err().to_string();
    assert!(e.contains("KV heads"), "{e}");
    assert!(flash_attn_runs(&q, &[], &p).is_err());
    Ok(())
}
