//! Helpers shared by the kernels' tests: reproducible random values, and how far our
//! quantized matmul is from candle's on the same weight.
#![allow(dead_code)] // not every test file uses every helper
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use kvpolicy_kernels::quant::QuantMatMul;

/// `len` values uniform in ±`scale`, from a small LCG so that cases reproduce from a seed.
pub fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

/// Max over outputs of |ours − candle's| ÷ Σ|x·w| (the terms' magnitudes, the weight as
/// quantized) for `x·qᵀ`: our `QuantMatMul` against candle's `QMatMul`. Candle is first set
/// to the activation quantization ggml and our kernels use (`MISTRALRS_FORCE_AVX2`, read once
/// at its first quantized matmul: on AVX-512 VNNI it would otherwise quantize Q8_0 weights'
/// activations per 256 values).
pub fn deviation_from_candle(q: &Arc<QTensor>, x: &Tensor) -> Result<f32> {
    std::env::set_var("MISTRALRS_FORCE_AVX2", "1");
    let want = QMatMul::QTensor(q.clone()).forward(x)?;
    let op = QuantMatMul::new(q.clone()).ok_or_else(|| anyhow!("{:?} not handled", q.dtype()))?;
    let got = op.forward(x)?;
    anyhow::ensure!(
        got.dims() == want.dims(),
        "{:?} vs {:?}",
        got.dims(),
        want.dims()
    );
    let terms = x
        .abs()?
        .matmul(&q.dequantize(&Device::Cpu)?.abs()?.t()?)?
        .clamp(1e-3, f32::MAX)?;
    let diff = (&got - &want)?.abs()?;
    Ok((diff / terms)?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}
