//! The K-quants' decode path (`quant::kquants`, `quant::avx2_kquants`): Gemma 3's Q4_K and
//! Q6_K weights dotted with Q8_K activations for fewer rows than the GEMM takes.
//! - `QuantMatMul` equals candle's own K-quant matmul on the same quantized weights and the
//!   same Q8_K activations (`BlockQ8K::from_float`; candle 0.11.1 runs Q4_K, and Q6_K for
//!   several rows, through its repacked x86 tiles, else `vec_dot`): integer sums exact on
//!   both sides, so only f32 summation order differs, ≤ 1e-4 of Σ|x·w| per output as in
//!   tests/quant.rs;
//! - on raw random super-blocks (every scale, min and value bit pattern, the activations'
//!   extremes), the portable dot product equals the exact sum over candle's dequantization
//!   of the same bytes, ≤ 1e-5 of Σ|x·w|;
//! - every SIMD path this CPU has equals the portable dot product bit for bit (the integer
//!   sum of each super-block is exact and its f32 part is one shared function);
//! - the activations' 16-element sums are candle's `BlockQ8K::bsums`.
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvpolicy_kernels::quant::kquants::{self, KQuant, Q8KRow, QK_K};
use kvpolicy_kernels::quant::{dot_rows_k, QuantMatMul, GEMM_MIN_ROWS};
use proptest::prelude::*;

const FORMATS: [(GgmlDType, KQuant); 2] =
    [(GgmlDType::Q4K, KQuant::Q4K), (GgmlDType::Q6K, KQuant::Q6K)];

mod common;
use common::random;

/// A quantized `(n, k)` weight: every 16 values scaled and shifted at random, so that the
/// sub-block scales (and Q4_K's mins, Q6_K's signed scales) span their ranges.
fn weight(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> Result<Arc<QTensor>> {
    let spread = random(2 * n * k / 16, seed ^ 0x51, 1.0);
    let mut v = random(n * k, seed, 1.0);
    for (i, chunk) in v.chunks_mut(16).enumerate() {
        let (scale, shift) = (spread[2 * i].abs() * 4.0 + 0.01, spread[2 * i + 1]);
        chunk.iter_mut().for_each(|x| *x = *x * scale + shift);
    }
    let w = Tensor::from_vec(v, (n, k), &Device::Cpu)?;
    Ok(Arc::new(QTensor::quantize(&w, dtype)?))
}

/// Max over outputs of |ours − candle's| ÷ Σ|x·w| ([`common::deviation_from_candle`]),
/// checking first that `m` rows run here.
fn compare(dtype: GgmlDType, m: usize, n: usize, k: usize, seed: u64) -> Result<f32> {
    let q = weight(dtype, n, k, seed)?;
    let x = Tensor::from_vec(random(m * k, seed ^ 0x9e37, 3.0), (m, k), &Device::Cpu)?;
    let op = QuantMatMul::new(q.clone()).ok_or_else(|| anyhow!("{dtype:?} not handled"))?;
    anyhow::ensure!(op.handles(m), "{dtype:?}: {m} rows not run here");
    common::deviation_from_candle(&q, &x)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn decode_equals_candle_on_random_shapes(
        f in 0usize..2, m in 1usize..GEMM_MIN_ROWS, n in 1usize..40, kb in 1usize..5,
        seed in any::<u64>()
    ) {
        let (dtype, _) = FORMATS[f];
        let rel = compare(dtype, m, n, kb * QK_K, seed)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(rel <= 1e-4, "{dtype:?} m={m} n={n} k={}: relative {rel}", kb * QK_K);
    }
}

proptest! {
    #[test]
    fn scales_unpacked_at_once_are_ggmls(s in proptest::array::uniform12(any::<u8>())) {
        let all = kquants::q4k_scales_mins(&s);
        for j in 0..8 {
            prop_assert_eq!((all.scales[j], all.mins[j]), kquants::q4k_scale_min(j, &s), "sub-block {}", j);
        }
    }
}

#[test]
fn gemma3_shapes_equal_candle() -> Result<()> {
    // Gemma 3 270M's Q4_K (attention output) and Q6_K (MLP down) shapes: decode, a short
    // chunk.
    for (dtype, _) in FORMATS {
        for (n, k) in [(640, 1024), (640, 2048)] {
            for m in [1, 7] {
                let rel = compare(dtype, m, n, k, (n * k + m) as u64)?;
                assert!(rel <= 1e-4, "{dtype:?} ({m}, {k})·({n}, {k})ᵀ: {rel}");
            }
        }
    }
    Ok(())
}

/// Row counts around the prefetch distance, several super-blocks: every path bit for bit
/// the portable dot product of each row.
#[test]
fn simd_paths_equal_portable_bit_for_bit() -> Result<()> {
    for (dtype, fmt) in FORMATS {
        for (rows, k) in [(1, 256), (9, 512), (20, 1024), (3, 2048)] {
            let q = weight(dtype, rows, k, 17 + rows as u64)?;
            let data = q.data()?;
            let mut x = random(k, 23, 2.0);
            // A super-block of zeros (scale 0) among the others.
            if k > 256 {
                x[256..512].fill(0.0);
            }
            let x = Q8KRow::new(&x);
            let row_bytes = k / QK_K * fmt.block_bytes();
            let want: Vec<u32> = (0..rows)
                .map(|r| kquants::dot_scalar(fmt, &data[r * row_bytes..(r + 1) * row_bytes], &x))
                .map(f32::to_bits)
                .collect();
            let mut got = vec![f32::NAN; rows];
            dot_rows_k(fmt, &data, &x, &mut got);
            let bits = |v: &[f32]| v.iter().map(|g| g.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), want, "{fmt:?} {rows}×{k} dispatched");
            #[cfg(target_arch = "x86_64")]
            {
                use kvpolicy_kernels::quant::{avx2, avx2_kquants};
                if avx2::available() {
                    got.fill(f32::NAN);
                    // SAFETY: `available` checked AVX2, FMA and F16C.
                    unsafe { avx2_kquants::dot_rows(fmt, &data, &x, &mut got) };
                    assert_eq!(bits(&got), want, "{fmt:?} {rows}×{k} AVX2");
                }
                if avx2::vnni() {
                    got.fill(f32::NAN);
                    // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI.
                    unsafe { avx2_kquants::dot_rows_vnni(fmt, &data, &x, &mut got) };
                    assert_eq!(bits(&got), want, "{fmt:?} {rows}×{k} AVX-VNNI");
                }
            }
        }
    }
    Ok(())
}

/// `rows` rows of `blocks` super-blocks of raw random bytes, each `d` (and Q4_K's `dmin`)
/// a finite f16 in ±[2⁻⁸, 2) so that the sums stay finite.
fn raw_weight(fmt: KQuant, rows: usize, blocks: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut byte = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 24) as u8
    };
    let mut data: Vec<u8> = (0..rows * blocks * fmt.block_bytes())
        .map(|_| byte())
        .collect();
    for b in data.chunks_exact_mut(fmt.block_bytes()) {
        let at: &[usize] = match fmt {
            KQuant::Q4K => &[0, 2],
            KQuant::Q6K => &[208],
        };
        for &at in at {
            // Sign bit random, exponent 7..=15 (2⁻⁸ ≤ |d| < 2), mantissa random.
            let exp = 7 + (b[at + 1] as u16 >> 2) % 9;
            let h = (b[at + 1] as u16 & 0x80) << 8
                | exp << 10
                | (b[at] as u16 | (b[at + 1] as u16 & 3) << 8);
            b[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    data
}

#[test]
fn raw_blocks_equal_exact_math() -> Result<()> {
    for (dtype, fmt) in FORMATS {
        let (rows, k) = (6, 768);
        let data = raw_weight(fmt, rows, k / QK_K, 41);
        let deq = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &data,
            vec![rows, k],
            &Device::Cpu,
        )?
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
        // Activations: random, then a super-block whose scale is exactly 1 with values at
        // both ends (−127 first, so it sets the scale; +127), and one of tiny positive
        // values whose inverse scale overflows to −∞: every value −128 (its scale −0).
        let mut x = random(k, 43, 3.0);
        for (e, v) in x[256..512].iter_mut().enumerate() {
            *v = [-127.0, 127.0, 0.0, -126.0][e % 4];
        }
        for (e, v) in x[512..768].iter_mut().enumerate() {
            *v = f32::from_bits(1 + e as u32 % 5);
        }
        let xq = Q8KRow::new(&x);
        assert!(
            xq.blocks[16].qs.contains(&-128),
            "no −128 among the activations"
        );
        let xs: Vec<f64> = xq
            .blocks
            .iter()
            .flat_map(|b| b.qs.iter().map(move |q| b.d as f64 * *q as f64))
            .collect();
        let row_bytes = k / QK_K * fmt.block_bytes();
        for r in 0..rows {
            let w = &deq[r * k..(r + 1) * k];
            let exact: f64 = w.iter().zip(&xs).map(|(a, b)| *a as f64 * b).sum();
            let terms: f64 = w.iter().zip(&xs).map(|(a, b)| (*a as f64 * b).abs()).sum();
            let got = kquants::dot_scalar(fmt, &data[r * row_bytes..(r + 1) * row_bytes], &xq);
            let dev = (got as f64 - exact).abs() / terms.max(1e-3);
            assert!(dev <= 1e-5, "{fmt:?} row {r}: {got} vs {exact} ({dev})");
            let mut simd = [f32::NAN];
            dot_rows_k(
                fmt,
                &data[r * row_bytes..(r + 1) * row_bytes],
                &xq,
                &mut simd,
            );
            assert_eq!(
                simd[0].to_bits(),
                got.to_bits(),
                "{fmt:?} row {r}: dispatched path"
            );
        }
    }
    Ok(())
}

#[test]
fn activation_sums_are_candles_bsums() -> Result<()> {
    let k = 1024;
    let mut x = random(k, 5, 4.0);
    x[300] = -200.0;
    x[600..620].fill(0.0);
    let theirs = QTensor::quantize(
        &Tensor::from_vec(x.clone(), (1, k), &Device::Cpu)?,
        GgmlDType::Q8K,
    )?;
    let bytes = theirs.data()?;
    let ours = Q8KRow::new(&x);
    // BlockQ8K: d (f32), 256 values, 16 sums (i16).
    for (sb, block) in bytes.chunks_exact(4 + 256 + 32).enumerate() {
        for s in 0..16 {
            let at = 4 + 256 + 2 * s;
            let want = i16::from_le_bytes([block[at], block[at + 1]]);
            assert_eq!(ours.sums[16 * sb + s], want, "super-block {sb} sum {s}");
        }
    }
    Ok(())
}
