//! Criterion benches of a decode step's quantized matrix–vector products: this workspace's
//! `QuantMatMul` (`kernels/src/quant`) against candle's own `QMatMul` on the same weights,
//! for Gemma 3 270M's K-quant shapes — Q4_K attention output (640 × 1024) and Q6_K MLP down
//! (640 × 2048) — and its Q5_0 MLP up (2048 × 640). Each iteration multiplies one activation
//! row through 18 distinct weights (one per layer, as a decode step does), so the weights
//! come from L3 or memory, not L1/L2. `cargo bench --bench quant_matmul`; names
//! `decode/IMPL/FORMAT`.
use std::hint::black_box;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvpolicy_kernels::quant::QuantMatMul;

/// Layers of Gemma 3 270M: distinct weights per iteration.
const LAYERS: usize = 18;

fn weights(dtype: GgmlDType, n: usize, k: usize) -> Vec<Arc<QTensor>> {
    (0..LAYERS)
        .map(|_| {
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)
                .and_then(|w| QTensor::quantize(&w, dtype))
                .unwrap_or_else(|e| panic!("weights: {e}"));
            Arc::new(w)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    g.sample_size(30);
    for (dtype, n, k) in [
        (GgmlDType::Q4K, 640, 1024),
        (GgmlDType::Q6K, 640, 2048),
        (GgmlDType::Q5_0, 2048, 640),
    ] {
        let ws = weights(dtype, n, k);
        let x = Tensor::randn(0f32, 1.0, (1, k), &Device::Cpu)
            .unwrap_or_else(|e| panic!("activations: {e}"));
        let ours: Vec<QuantMatMul> = ws
            .iter()
            .map(|w| QuantMatMul::new(w.clone()).unwrap_or_else(|| panic!("{dtype:?}")))
            .collect();
        let theirs: Vec<QMatMul> = ws.iter().map(|w| QMatMul::QTensor(w.clone())).collect();
        let name = format!("{dtype:?}");
        g.bench_function(BenchmarkId::new("ours", &name), |b| {
            b.iter(|| {
                for op in &ours {
                    black_box(
                        op.forward(black_box(&x))
                            .unwrap_or_else(|e| panic!("ours: {e}")),
                    );
                }
            })
        });
        g.bench_function(BenchmarkId::new("candle", &name), |b| {
            b.iter(|| {
                for op in &theirs {
                    black_box(
                        op.forward(black_box(&x))
                            .unwrap_or_else(|e| panic!("candle: {e}")),
                    );
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
