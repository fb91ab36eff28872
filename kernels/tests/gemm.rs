//! The integer GEMM of quantized prefill (`quant::gemm`):
//! - every panel holds exactly candle's dequantized weight (`scale·(q − z) + offset` at
//!   each column and element), for the seven formats it packs;
//! - the scalar reference and every SIMD kernel this CPU runs equal the exact
//!   product of the dequantized weight and the quantized activations, computed in f64 from
//!   candle's dequantization: ≤ 1e-5 of Σ|w·x| per output (only f32 rounding differs);
//! - `QuantMatMul` on a chunk of rows gives the GEMM's result (its dispatch), K-quants too.
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvpolicy_kernels::quant::gemm::{self, Kernel, QuantizedRows};
use kvpolicy_kernels::quant::panel::{Panel, NR};
use kvpolicy_kernels::quant::{panel_format_of, QuantMatMul, GEMM_MIN_ROWS, QK};
use proptest::prelude::*;

const FORMATS: [GgmlDType; 7] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

mod common;
use common::random;

/// A quantized `(n, k)` weight of `dtype`, its bytes and candle's dequantization.
struct Weight {
    q: Arc<QTensor>,
    data: Vec<u8>,
    deq: Vec<f32>,
}

fn weight(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> Result<Weight> {
    // Every 32 values scaled and shifted at random, so that block scales (and Q4_K's 6-bit
    // sub-block scales and mins, Q6_K's 8-bit ones) span their ranges instead of
    // clustering near the top.
    let spread = random(2 * n * k / QK, seed ^ 0x51, 1.0);
    let mut v = random(n * k, seed, 1.0);
    for (i, chunk) in v.chunks_mut(QK).enumerate() {
        let (scale, shift) = (spread[2 * i].abs() * 4.0 + 0.01, spread[2 * i + 1]);
        chunk.iter_mut().for_each(|x| *x = *x * scale + shift);
    }
    let w = Tensor::from_vec(v, (n, k), &Device::Cpu)?;
    let q = Arc::new(QTensor::quantize(&w, dtype)?);
    let data = q.data()?.to_vec();
    let deq = q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(Weight { q, data, deq })
}

/// Max over outputs of |got − exact| ÷ Σ|w·x| (x as quantized), exact in f64.
fn deviation(w: &Weight, n: usize, k: usize, x: &[f32], rows: &QuantizedRows, got: &[f32]) -> f64 {
    let m = x.len() / k;
    let mut worst = 0f64;
    for r in 0..m {
        let xq: Vec<f64> = (0..k)
            .map(|e| {
                let b = &rows.x[r * (k / QK) + e / QK];
                b.d as f64 * b.qs[e % QK] as f64
            })
            .collect();
        for c in 0..n {
            let wr = &w.deq[c * k..(c + 1) * k];
            let exact: f64 = wr.iter().zip(&xq).map(|(a, b)| *a as f64 * b).sum();
            let terms: f64 = wr.iter().zip(&xq).map(|(a, b)| (*a as f64 * b).abs()).sum();
            worst = worst.max((got[r * n + c] as f64 - exact).abs() / terms.max(1e-3));
        }
    }
    worst
}

#[test]
fn panels_hold_candles_dequantized_values() -> Result<()> {
    for dtype in FORMATS {
        let fmt = panel_format_of(dtype).ok_or_else(|| anyhow!("{dtype:?}"))?;
        let (n, k) = (37, 512);
        let w = weight(dtype, n, k, 3)?;
        let mut panel = Panel::default();
        for p in 0..n.div_ceil(NR) {
            panel.pack(fmt, &w.data, n, k, p);
            for c in 0..NR.min(n - NR * p) {
                for e in 0..k {
                    let (b, i) = (e / QK, e % QK);
                    let q = panel.qs[b * QK * NR + (i / 4) * 4 * NR + 4 * c + i % 4];
                    let s = fmt.subs();
                    let scale = panel.scales[(b * s + i / (QK / s)) * NR + c];
                    let offset = if fmt.has_offset() {
                        panel.offsets[b * NR + c]
                    } else {
                        0.0
                    };
                    let v = scale * (q as i32 - fmt.zero()) as f32 + offset;
                    let want = w.deq[(NR * p + c) * k + e];
                    assert_eq!(v, want, "{dtype:?} column {} element {e}", NR * p + c);
                }
            }
        }
    }
    Ok(())
}

fn check(dtype: GgmlDType, m: usize, n: usize, k: usize, seed: u64) -> Result<()> {
    let fmt = panel_format_of(dtype).ok_or_else(|| anyhow!("{dtype:?}"))?;
    let w = weight(dtype, n, k, seed)?;
    let x = random(m * k, seed ^ 0x9e37, 3.0);
    let rows = QuantizedRows::new(fmt, &x, k);
    let reference = gemm::reference(fmt, &w.data, n, k, &x);
    let dev = deviation(&w, n, k, &x, &rows, &reference);
    anyhow::ensure!(
        dev <= 1e-5,
        "{dtype:?} ({m}, {k})·({n}, {k})ᵀ reference: {dev}"
    );
    for kernel in Kernel::ALL.into_iter().filter(|k| k.runs(fmt)) {
        let got = gemm::gemm(kernel, fmt, &w.data, n, k, &x);
        let dev = deviation(&w, n, k, &x, &rows, &got);
        anyhow::ensure!(
            dev <= 1e-5,
            "{dtype:?} ({m}, {k})·({n}, {k})ᵀ {kernel:?}: {dev}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn gemm_equals_exact_math_on_random_shapes(
        f in 0usize..7, m in 1usize..20, n in 1usize..50, kb in 1usize..10, seed in any::<u64>()
    ) {
        // K-quants come in 256-element blocks.
        let k = if f >= 5 { kb.div_ceil(4) * 256 } else { kb * QK };
        check(FORMATS[f], m, n, k, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn kernels_this_cpu_runs() {
    // Which SIMD kernels the tests above checked on this machine (the others are not
    // exercised here: runtime detection picks by CPU).
    for dtype in FORMATS {
        let kernels = panel_format_of(dtype).map(|f| {
            Kernel::ALL
                .into_iter()
                .filter(|k| k.runs(f))
                .collect::<Vec<_>>()
        });
        println!("{dtype:?}: {kernels:?}");
        assert!(kernels.is_some(), "{dtype:?} has no panel format");
    }
}

#[test]
fn model_shapes_equal_exact_math() -> Result<()> {
    // SmolLM2-135M's and Gemma 3 270M's projection shapes (those a format's blocks
    // divide), a chunk with a row tail.
    for dtype in FORMATS {
        for (n, k) in [
            (192, 576),
            (1536, 576),
            (576, 1536),
            (640, 1024),
            (640, 2048),
        ] {
            if k % dtype.block_size() == 0 {
                check(dtype, 35, n, k, (n + k) as u64)?;
            }
        }
    }
    Ok(())
}

#[test]
fn quant_matmul_runs_a_chunk_as_the_gemm() -> Result<()> {
    let (m, n, k) = (GEMM_MIN_ROWS + 3, 40, 512);
    for dtype in FORMATS {
        let fmt = panel_format_of(dtype).ok_or_else(|| anyhow!("{dtype:?}"))?;
        let w = weight(dtype, n, k, 9)?;
        let op = QuantMatMul::new(w.q.clone()).ok_or_else(|| anyhow!("{dtype:?} not handled"))?;
        let kernel = gemm::kernel_for(fmt);
        assert_eq!(op.handles(m), kernel.is_some(), "{dtype:?}");
        let Some(kernel) = kernel else {
            continue;
        };
        let x = random(m * k, 21, 2.0);
        let got = op
            .forward(&Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(got, gemm::gemm(kernel, fmt, &w.data, n, k, &x), "{dtype:?}");
    }
    Ok(())
}

#[test]
fn k_quant_activations_are_candles_q8k() -> Result<()> {
    use kvpolicy_kernels::quant::blocks::{quantize_row_q8k, ActBlock};
    let k = 1536;
    let mut x = random(k, 5, 4.0);
    // An all-zero block; a block whose scale is exactly 1 (its largest magnitude −127, first
    // at 3; a later +127 is not the one kept), every half-integer a tie; a NaN in the fourth
    // block; a block of tiny values (the inverse scale −∞, the scale −0); one holding −∞.
    x[256..512].fill(0.0);
    for (e, v) in x[512..768].iter_mut().enumerate() {
        *v = match e {
            3 => -127.0,
            9 => 127.0,
            _ => (e % 100) as f32 * 1.5 - 70.0,
        };
    }
    x[800] = f32::NAN;
    for (e, v) in x[1024..1280].iter_mut().enumerate() {
        *v = f32::from_bits(1 + e as u32 % 7);
    }
    x[1300] = f32::NEG_INFINITY;
    let theirs = QTensor::quantize(
        &Tensor::from_vec(x.clone(), (1, k), &Device::Cpu)?,
        GgmlDType::Q8K,
    )?;
    let bytes = theirs.data()?;
    let mut ours = vec![ActBlock::ZERO; k / QK];
    quantize_row_q8k(&x, &mut ours);
    // BlockQ8K: d (f32), 256 values, 16 sums (i16).
    for (sb, block) in bytes.chunks_exact(4 + 256 + 32).enumerate() {
        let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        for (j, b) in ours[sb * 8..(sb + 1) * 8].iter().enumerate() {
            assert_eq!(b.d.to_bits(), d.to_bits(), "super-block {sb}");
            for (e, q) in b.qs.iter().enumerate() {
                assert_eq!(
                    *q,
                    block[4 + 32 * j + e] as i8,
                    "super-block {sb} element {}",
                    32 * j + e
                );
            }
        }
    }
    Ok(())
}
