//! The quantized matmul against candle's own path for the same formats (its `vec_dot`:
//! scalar for Q4_1/Q5_0/Q5_1, AVX for Q4_0/Q8_0, on the same quantized weights and the same Q8 activation quantization):
//! random shapes and values, proptest. The integer sums are exact on both sides, so the
//! results differ only by f32 summation order, whose error is bounded relative to the sum
//! of the terms' magnitudes (Σ|x·w|), not to the result (a result near 0 from cancelling
//! terms carries the terms' rounding): ≤ 1e-4 of Σ|x·w| per output.
//! The portable and the AVX2 dot products are also compared with each other block by block.
//! Row counts stay below `GEMM_MIN_ROWS`: from there a call is the integer GEMM, whose
//! offset term is not rounded through f16 as candle's Q8_1 is (tests/gemm.rs holds it to
//! the exact product instead).
//!
//! On CPUs with AVX-512 VNNI, candle 0.11.1 repacks Q8_0 weights whose shape allows it
//! (rows a multiple of 16, width of 256) and quantizes the activations per 256 values (Q8K)
//! instead of per 32 (Q8_0): a different rounding, 5e-3 apart on SmolLM2's shapes. Every
//! test here first sets candle's own switch back to its AVX2 path (`MISTRALRS_FORCE_AVX2`,
//! read once, at the first quantized matmul), which quantizes as ggml and these kernels do.
use std::sync::Arc;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvpolicy_kernels::quant::{blocks, GEMM_MIN_ROWS, QK};
use proptest::prelude::*;

const FORMATS: [GgmlDType; 5] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
];

mod common;

fn random(shape: (usize, usize), seed: u64, scale: f32) -> Result<Tensor> {
    let v = common::random(shape.0 * shape.1, seed, scale);
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Max over outputs of |ours − candle's| ÷ Σ|x·w| ([`common::deviation_from_candle`]).
fn compare(fmt: GgmlDType, m: usize, n: usize, k: usize, seed: u64) -> Result<f32> {
    let w = random((n, k), seed, 1.0)?;
    let x = random((m, k), seed ^ 0x9e37, 3.0)?;
    common::deviation_from_candle(&Arc::new(QTensor::quantize(&w, fmt)?), &x)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn equals_candle_on_random_blocks(
        fmt in 0usize..5, m in 1usize..GEMM_MIN_ROWS, n in 1usize..70, kb in 1usize..12,
        seed in any::<u64>()
    ) {
        let rel = compare(FORMATS[fmt], m, n, kb * QK, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(rel <= 1e-4, "{:?} m={m} n={n} k={}: relative {rel}", FORMATS[fmt], kb * QK);
    }
}

#[test]
fn model_shapes_equal_candle() -> Result<()> {
    // SmolLM2-135M's and Gemma 3 270M's projection shapes, decode and a short chunk.
    for fmt in FORMATS {
        for (n, k) in [
            (576, 576),
            (1536, 576),
            (576, 1536),
            (1024, 640),
            (640, 2048),
        ] {
            for m in [1, 7] {
                let rel = compare(fmt, m, n, k, (n * k + m) as u64)?;
                assert!(rel <= 1e-4, "{fmt:?} ({m}, {k})·({n}, {k})ᵀ: {rel}");
            }
        }
    }
    Ok(())
}

#[test]
fn simd_and_portable_dots_agree() -> Result<()> {
    for fmt in FORMATS {
        let w = random((4, 8 * QK), 7, 1.0)?;
        let q = QTensor::quantize(&w, fmt)?;
        let data = q.data()?;
        let f =
            kvpolicy_kernels::quant::format_of(fmt).ok_or_else(|| anyhow::anyhow!("{fmt:?}"))?;
        let row_bytes = 8 * f.block_bytes();
        let x = random((1, 8 * QK), 11, 2.0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut xq = vec![blocks::ActBlock::ZERO; 8];
        blocks::quantize_row(&x, &mut xq);
        for r in 0..4 {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            let a = blocks::dot_scalar(f, row, &xq);
            let b = kvpolicy_kernels::quant::dot(f, row, &xq);
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{fmt:?} row {r}: {a} vs {b}"
            );
            // Each SIMD path this CPU has, not only the one `dot` picks (AVX-VNNI's
            // `vpdpbusd` where present, AVX2's `maddubs` + `madd`).
            #[cfg(target_arch = "x86_64")]
            {
                use kvpolicy_kernels::quant::avx2;
                if avx2::available() {
                    // SAFETY: `available` checked AVX2, FMA and F16C.
                    let c = unsafe { avx2::dot(f, row, &xq) };
                    assert!(
                        (a - c).abs() <= 1e-5 * a.abs().max(1.0),
                        "{fmt:?} AVX2: {a} vs {c}"
                    );
                }
                if avx2::vnni() {
                    // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI.
                    let c = unsafe { avx2::dot_vnni(f, row, &xq) };
                    assert!(
                        (a - c).abs() <= 1e-5 * a.abs().max(1.0),
                        "{fmt:?} VNNI: {a} vs {c}"
                    );
                }
            }
            // And the dequantized row agrees with candle's dequantization.
            let mut deq = vec![0f32; 8 * QK];
            blocks::dequantize_row(f, row, &mut deq);
            let theirs = q.dequantize(&Device::Cpu)?.get(r)?.to_vec1::<f32>()?;
            assert_eq!(deq, theirs, "{fmt:?} row {r}: dequantization");
        }
    }
    Ok(())
}

/// The decode path's multi-row kernel: for every format and row counts around its
/// four-row step, each result is bit for bit the one-row dot product's — on every SIMD path
/// this CPU has and the portable one.
#[test]
fn row_ranges_equal_single_rows_bit_for_bit() -> Result<()> {
    use kvpolicy_kernels::quant::dot_rows;
    for fmt in FORMATS {
        let f =
            kvpolicy_kernels::quant::format_of(fmt).ok_or_else(|| anyhow::anyhow!("{fmt:?}"))?;
        for (rows, blocks_per_row) in [(1, 1), (3, 5), (4, 2), (7, 20), (9, 3)] {
            let k = blocks_per_row * QK;
            let q = QTensor::quantize(&random((rows, k), 5 + rows as u64, 1.0)?, fmt)?;
            let data = q.data()?;
            let x = random((1, k), 13, 2.0)?.flatten_all()?.to_vec1::<f32>()?;
            let mut xq = vec![blocks::ActBlock::ZERO; blocks_per_row];
            blocks::quantize_row(&x, &mut xq);
            let row_bytes = blocks_per_row * f.block_bytes();
            let row = |r: usize| &data[r * row_bytes..(r + 1) * row_bytes];
            let mut got = vec![0f32; rows];
            dot_rows(f, &data, &xq, &mut got);
            for (r, g) in got.iter().enumerate() {
                let want = kvpolicy_kernels::quant::dot(f, row(r), &xq);
                assert_eq!(g.to_bits(), want.to_bits(), "{fmt:?} {rows}×{k} row {r}");
            }
            #[cfg(target_arch = "x86_64")]
            {
                use kvpolicy_kernels::quant::avx2;
                let mut got = vec![0f32; rows];
                if avx2::available() {
                    // SAFETY: `available` checked AVX2, FMA and F16C; `data` holds the rows.
                    unsafe { avx2::dot_rows(f, &data, &xq, &mut got) };
                    for (r, g) in got.iter().enumerate() {
                        // SAFETY: as above.
                        let want = unsafe { avx2::dot(f, row(r), &xq) };
                        assert_eq!(g.to_bits(), want.to_bits(), "{fmt:?} AVX2 row {r}");
                    }
                }
                if avx2::vnni() {
                    // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI.
                    unsafe { avx2::dot_rows_vnni(f, &data, &xq, &mut got) };
                    for (r, g) in got.iter().enumerate() {
                        // SAFETY: as above.
                        let want = unsafe { avx2::dot_vnni(f, row(r), &xq) };
                        assert_eq!(g.to_bits(), want.to_bits(), "{fmt:?} VNNI row {r}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The activation side bit for bit candle's `BlockQ8_0` and `BlockQ8_1` (its `from_float`,
/// `round` ties away from zero): random blocks, a block scaled so that `1/d` is exactly 1
/// (every half-integer a tie, and the float just below ±0.5), an all-zero block, a block of
/// tiny values whose `1/d` overflows to infinity (values saturate; `0·∞` is NaN, then 0), one
/// holding a NaN, and one holding an infinity (`1/d` is 0).
#[test]
fn activations_are_candles_q8_0_and_q8_1() -> Result<()> {
    let mut x = random((1, 7 * QK), 3, 3.0)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let below_half = f32::from_bits(0.5f32.to_bits() - 1);
    for (e, v) in x[2 * QK..3 * QK].iter_mut().enumerate() {
        // amax 127: d = 1.
        *v = match e {
            0 => 127.0,
            1 => below_half,
            2 => -below_half,
            _ => e as f32 * 2.5 - 40.0,
        };
    }
    x[3 * QK..4 * QK].fill(0.0);
    for (e, v) in x[4 * QK..5 * QK].iter_mut().enumerate() {
        *v = (e as f32 - 16.0) * 1e-40;
    }
    x[5 * QK + 7] = f32::NAN;
    x[6 * QK + 3] = f32::INFINITY;
    let mut ours = vec![blocks::ActBlock::ZERO; x.len() / QK];
    blocks::quantize_row(&x, &mut ours);
    let t = Tensor::from_vec(x.clone(), (1, x.len()), &Device::Cpu)?;
    // BlockQ8_0: d (f16), 32 values; BlockQ8_1: d, s (f16), 32 values.
    for (dtype, head) in [(GgmlDType::Q8_0, 2), (GgmlDType::Q8_1, 4)] {
        let bytes = QTensor::quantize(&t, dtype)?.data()?.to_vec();
        for (i, (theirs, b)) in bytes.chunks_exact(head + QK).zip(&ours).enumerate() {
            let d = half::f16::from_le_bytes([theirs[0], theirs[1]]).to_f32();
            assert_eq!(b.d.to_bits(), d.to_bits(), "{dtype:?} block {i}: d");
            if dtype == GgmlDType::Q8_1 {
                let s = half::f16::from_le_bytes([theirs[2], theirs[3]]).to_f32();
                assert_eq!(b.s.to_bits(), s.to_bits(), "{dtype:?} block {i}: s");
            }
            let qs: Vec<i8> = theirs[head..].iter().map(|q| *q as i8).collect();
            assert_eq!(
                b.qs.as_slice(),
                qs.as_slice(),
                "{dtype:?} block {i}: values"
            );
        }
    }
    Ok(())
}
