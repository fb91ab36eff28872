//! Q4_0 and Q4_K interleaved eight rows at a time (`quant::rows8`, `quant::rows8_k`): the layout holds every block
//! (row-major blocks reassemble byte for byte), the decode kernel's results are bit for bit
//! the portable row dot product's (`blocks::dot_scalar`) on every integer path this CPU
//! has (`maddubs`, AVX-VNNI, AVX-512 VNNI), and a `QuantMatMul` holding the interleaved
//! weight gives the row-major op's GEMM results exactly and the portable results for a
//! few rows. Random weights (candle's Q4_0 quantizer over random values, and raw random
//! bytes, whose nibbles reach 0 and 15) and activations, proptest.
use std::sync::Arc;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvpolicy_kernels::quant::{blocks, rows8, ActBlock, QuantMatMul, WeightFormat, QK};
use proptest::prelude::*;

mod common;

/// `anyhow::ensure!` of an equality, both sides printed.
macro_rules! ensure_eq {
    ($a:expr, $b:expr, $($fmt:tt)*) => {
        anyhow::ensure!($a == $b, "{}: {:?} != {:?}", format!($($fmt)*), $a, $b)
    };
}

/// An `(n, k)` Q4_0 weight: candle's quantization of random values.
fn weight(n: usize, k: usize, seed: u64) -> Result<Arc<QTensor>> {
    let w = Tensor::from_vec(common::random(n * k, seed, 1.0), (n, k), &Device::Cpu)?;
    Ok(Arc::new(QTensor::quantize(&w, GgmlDType::Q4_0)?))
}

/// Raw random Q4_0 bytes for `(n, k)`, scales in 1e-3 … 5e-3 (finite f16).
fn raw_bytes(n: usize, k: usize, seed: u64) -> Vec<u8> {
    let v = common::random(n * k / QK * 18, seed, 1.0);
    let mut bytes: Vec<u8> = v.iter().map(|f| ((f + 1.0) * 127.9) as u8).collect();
    for (i, b) in bytes.chunks_exact_mut(18).enumerate() {
        let d = half::f16::from_f32(1e-3 + (i % 5) as f32 * 1e-3);
        b[..2].copy_from_slice(&d.to_le_bytes());
    }
    bytes
}

fn acts(k: usize, seed: u64) -> Vec<ActBlock> {
    let x = common::random(k, seed, 3.0);
    let mut out = vec![ActBlock::ZERO; k / QK];
    blocks::quantize_row(&x, &mut out);
    out
}

/// The interleaved kernel against `dot_scalar` on the row-major rows, bit for bit, on
/// every path this CPU has.
fn check_rows(plain: &[u8], n: usize, k: usize, seed: u64) -> Result<()> {
    let packed = rows8::interleave(plain, n, k).expect("fits");
    let row_bytes = k / QK * 18;
    for r in 0..n {
        for b in 0..k / QK {
            let want = &plain[r * row_bytes + b * 18..][..18];
            ensure_eq!(
                &rows8::plain_block(&packed, k, r, b)[..],
                want,
                "row {} block {}",
                r,
                b
            );
        }
    }
    let x = acts(k, seed);
    let sums = rows8::block_sums(&x);
    let want: Vec<u32> = (0..n)
        .map(|r| {
            blocks::dot_scalar(
                WeightFormat::Q4_0,
                &plain[r * row_bytes..(r + 1) * row_bytes],
                &x,
            )
            .to_bits()
        })
        .collect();
    let mut got = vec![0f32; n];
    kvpolicy_kernels::quant::dot_rows8(&packed, &x, &sums, 0, &mut got);
    ensure_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.clone(),
        "dispatched"
    );
    #[cfg(target_arch = "x86_64")]
    for path in 0..3u8 {
        if !kvpolicy_kernels::quant::avx2::available() {
            break;
        }
        let mut got = vec![0f32; n];
        // SAFETY: AVX2 checked; `packed` holds n / 8 groups of x.len() blocks.
        let ran = unsafe {
            kvpolicy_kernels::quant::avx2_rows8::dot_groups_on(path, &packed, &x, &sums, &mut got)
        };
        if ran.is_some() {
            ensure_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.clone(),
                "path {}",
                path
            );
        }
    }
    // An activation block whose f16 sum overflows (`s` infinite): the portable dot stays
    // finite (no `0·s` for Q4_0), and the kernel equals it.
    let mut big = common::random(k, seed + 7, 3.0);
    big[..QK].iter_mut().for_each(|v| *v = 4000.0 + v.abs());
    let mut xb = vec![ActBlock::ZERO; k / QK];
    blocks::quantize_row(&big, &mut xb);
    ensure_eq!(
        xb[0].s.is_infinite(),
        true,
        "the first block's f16 sum overflows"
    );
    let want_big: Vec<u32> = (0..n)
        .map(|r| {
            blocks::dot_scalar(
                WeightFormat::Q4_0,
                &plain[r * row_bytes..(r + 1) * row_bytes],
                &xb,
            )
            .to_bits()
        })
        .collect();
    ensure_eq!(
        want_big.iter().all(|b| f32::from_bits(*b).is_finite()),
        true,
        "finite"
    );
    // The row-major SIMD path too (it added `0·s` before).
    for r in 0..n {
        let v = kvpolicy_kernels::quant::dot(
            WeightFormat::Q4_0,
            &plain[r * row_bytes..(r + 1) * row_bytes],
            &xb,
        );
        ensure_eq!(v.is_finite(), true, "row-major row {}", r);
    }
    let mut got = vec![0f32; n];
    kvpolicy_kernels::quant::dot_rows8(&packed, &xb, &rows8::block_sums(&xb), 0, &mut got);
    ensure_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want_big,
        "overflowing block"
    );
    // A group range from the middle.
    if n >= 16 {
        let mut got = vec![0f32; 8];
        kvpolicy_kernels::quant::dot_rows8(&packed, &x, &sums, 8, &mut got);
        ensure_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want[8..16].to_vec(),
            "rows 8..16"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn interleaved_rows_are_the_portable_dot_bit_for_bit(groups in 1usize..5, blocks in 1usize..20, seed in 0u64..1000) {
        let (n, k) = (groups * 8, blocks * QK);
        let w = weight(n, k, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let plain = w.data().map_err(|e| TestCaseError::fail(e.to_string()))?.to_vec();
        check_rows(&plain, n, k, seed + 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_rows(&raw_bytes(n, k, seed), n, k, seed + 2).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn only_q4_0_in_whole_groups_is_interleaved() {
    assert!(rows8::fits(WeightFormat::Q4_0, 16, 64));
    assert!(!rows8::fits(WeightFormat::Q4_0, 12, 64));
    assert!(!rows8::fits(WeightFormat::Q8_0, 16, 64));
    assert!(rows8::interleave(&[0u8; 18 * 8], 8, 32).is_some());
    assert!(rows8::interleave(&[0u8; 18 * 7], 8, 32).is_none());
}

/// The op with the interleaved weight: a decode step and a few rows bit for bit the
/// portable dot, a prefill chunk exactly the row-major op's GEMM, a tied-embedding lookup
/// the row-major bytes.
#[test]
fn interleaved_op_matches_the_row_major_one() -> Result<()> {
    let (n, k) = (40, 256);
    let w = weight(n, k, 7)?;
    let plain_op = QuantMatMul::new(w.clone()).expect("Q4_0 handled");
    let Some(op) = plain_op.interleaved() else {
        // No AVX2 (or no GEMM kernel): the weight stays row-major.
        assert!(!plain_op.is_interleaved());
        return Ok(());
    };
    assert!(op.is_interleaved());
    let plain = w.data()?.to_vec();
    let row_bytes = k / QK * 18;
    for m in [1usize, 3, 40] {
        let xv = common::random(m * k, m as u64, 2.0);
        let x = Tensor::from_vec(xv.clone(), (m, k), &Device::Cpu)?;
        let got = op.forward(&x)?.to_vec2::<f32>()?;
        if m < kvpolicy_kernels::quant::GEMM_MIN_ROWS {
            for (i, row) in got.iter().enumerate() {
                let mut a = vec![ActBlock::ZERO; k / QK];
                blocks::quantize_row(&xv[i * k..(i + 1) * k], &mut a);
                for (r, v) in row.iter().enumerate() {
                    let want = blocks::dot_scalar(
                        WeightFormat::Q4_0,
                        &plain[r * row_bytes..(r + 1) * row_bytes],
                        &a,
                    );
                    assert_eq!(v.to_bits(), want.to_bits(), "m {m} row {i} col {r}");
                }
            }
        } else {
            assert_eq!(got, plain_op.forward(&x)?.to_vec2::<f32>()?, "m {m}");
        }
    }
    let ids = [0u32, 39, 17];
    let rows = op.plain_rows(&ids)?;
    for (i, id) in ids.iter().enumerate() {
        let r = *id as usize;
        assert_eq!(
            &rows[i * row_bytes..(i + 1) * row_bytes],
            &plain[r * row_bytes..(r + 1) * row_bytes]
        );
    }
    assert!(
        op.plain_rows(&[40]).is_err(),
        "an id past the table is an error"
    );
    Ok(())
}

/// Raw random Q4_K bytes for `(n, k)`: every scale, min and nibble pattern; `d` and `dmin`
/// finite f16 (2⁻⁸ … 2, either sign).
fn raw_q4k(n: usize, k: usize, seed: u64) -> Vec<u8> {
    let v = common::random(n * k / 256 * 144, seed, 1.0);
    let mut bytes: Vec<u8> = v.iter().map(|f| ((f + 1.0) * 127.9) as u8).collect();
    for (i, b) in bytes.chunks_exact_mut(144).enumerate() {
        for (j, at) in [0usize, 2].into_iter().enumerate() {
            let mag = 2f32.powi((i * 3 + j) as i32 % 9 - 8) * 1.37;
            let d = half::f16::from_f32(if (i + j) % 3 == 0 { -mag } else { mag });
            b[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    bytes
}

/// The Q4_K kernel against `kquants::dot_scalar` on the row-major rows, bit for bit, on
/// every path this CPU has; the layout reassembles every super-block.
fn check_rows_k(plain: &[u8], n: usize, k: usize, seed: u64) -> Result<()> {
    use kvpolicy_kernels::quant::kquants::{self, KQuant, Q8KRow};
    use kvpolicy_kernels::quant::rows8_k;
    let mut packed = plain.to_vec();
    anyhow::ensure!(rows8_k::interleave_in_place(&mut packed, n, k), "fits");
    let row_bytes = k / 256 * 144;
    for r in 0..n {
        for b in 0..k / 256 {
            let want = &plain[r * row_bytes + b * 144..][..144];
            ensure_eq!(
                &rows8_k::plain_block(&packed, k, r, b)[..],
                want,
                "row {} super-block {}",
                r,
                b
            );
        }
    }
    let mut xv = common::random(k, seed, 3.0);
    // A super-block at the activations' extremes (−127 sets the scale; +127).
    if k >= 512 {
        for (e, v) in xv[256..512].iter_mut().enumerate() {
            *v = [-127.0, 127.0, 0.0, -126.0][e % 4];
        }
    }
    let x = Q8KRow::new(&xv);
    let want: Vec<u32> = (0..n)
        .map(|r| {
            kquants::dot_scalar(KQuant::Q4K, &plain[r * row_bytes..(r + 1) * row_bytes], &x)
                .to_bits()
        })
        .collect();
    let mut got = vec![0f32; n];
    kvpolicy_kernels::quant::dot_rows8_k(&packed, &x, 0, &mut got);
    ensure_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.clone(),
        "dispatched"
    );
    #[cfg(target_arch = "x86_64")]
    for path in 0..3u8 {
        if !kvpolicy_kernels::quant::avx2::available() {
            break;
        }
        let mut got = vec![0f32; n];
        // SAFETY: AVX2 checked; `packed` holds n / 8 groups of x's super-blocks.
        let ran = unsafe {
            kvpolicy_kernels::quant::avx2_rows8_k::dot_groups_on(path, &packed, &x, &mut got)
        };
        if ran.is_some() {
            ensure_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.clone(),
                "path {}",
                path
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn interleaved_q4k_rows_are_the_portable_dot_bit_for_bit(groups in 1usize..4, supers in 1usize..5, seed in 0u64..1000) {
        let (n, k) = (groups * 8, supers * 256);
        let fail = |e: anyhow::Error| TestCaseError::fail(e.to_string());
        let w = Tensor::from_vec(common::random(n * k, seed, 1.0), (n, k), &Device::Cpu).map_err(|e| fail(e.into()))?;
        let q = QTensor::quantize(&w, GgmlDType::Q4K).map_err(|e| fail(e.into()))?;
        let plain = q.data().map_err(|e| fail(e.into()))?.to_vec();
        check_rows_k(&plain, n, k, seed + 1).map_err(fail)?;
        check_rows_k(&raw_q4k(n, k, seed), n, k, seed + 2).map_err(fail)?;
    }
}

/// The Q4_K op with the interleaved weight: a few rows bit for bit the portable dot, a
/// prefill chunk exactly the row-major op's GEMM, rows for a lookup the row-major bytes.
#[test]
fn interleaved_q4k_op_matches_the_row_major_one() -> Result<()> {
    use kvpolicy_kernels::quant::kquants::{self, KQuant, Q8KRow};
    let (n, k) = (24, 512);
    let w = Tensor::from_vec(common::random(n * k, 9, 1.0), (n, k), &Device::Cpu)?;
    let w = Arc::new(QTensor::quantize(&w, GgmlDType::Q4K)?);
    let plain_op = QuantMatMul::new(w.clone()).expect("Q4_K handled");
    let Some(op) = plain_op.interleaved() else {
        // No AVX2 (or no GEMM kernel): the weight stays row-major.
        assert!(QuantMatMul::interleaves(GgmlDType::Q4K, n, k).is_none());
        return Ok(());
    };
    assert!(op.is_interleaved());
    let plain = w.data()?.to_vec();
    let row_bytes = k / 256 * 144;
    for m in [1usize, 2, 33] {
        let xv = common::random(m * k, 50 + m as u64, 2.0);
        let x = Tensor::from_vec(xv.clone(), (m, k), &Device::Cpu)?;
        let got = op.forward(&x)?.to_vec2::<f32>()?;
        if m < kvpolicy_kernels::quant::GEMM_MIN_ROWS {
            for (i, row) in got.iter().enumerate() {
                let a = Q8KRow::new(&xv[i * k..(i + 1) * k]);
                for (r, v) in row.iter().enumerate() {
                    let want = kquants::dot_scalar(
                        KQuant::Q4K,
                        &plain[r * row_bytes..(r + 1) * row_bytes],
                        &a,
                    );
                    assert_eq!(v.to_bits(), want.to_bits(), "m {m} row {i} col {r}");
                }
            }
        } else {
            assert_eq!(got, plain_op.forward(&x)?.to_vec2::<f32>()?, "m {m}");
        }
    }
    let rows = op.plain_rows(&[23, 0])?;
    assert_eq!(&rows[..row_bytes], &plain[23 * row_bytes..24 * row_bytes]);
    assert_eq!(&rows[row_bytes..], &plain[..row_bytes]);
    Ok(())
}
