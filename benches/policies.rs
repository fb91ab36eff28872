//! Criterion benches for choosing a policy: per policy, one decode step and a prefill at
//! several context lengths on a SmolLM2-135M-shaped model, plus transfer-engine throughput.
//!
//! `cargo bench` runs everything; `cargo bench -- decode/headwise` a subset. Names are
//! `decode/POLICY/CONTEXT`, `prefill/POLICY/CONTEXT` and `transfer/ENGINE/BYTES`.
//!
//! The model is SmolLM2-135M's shape with random f32 weights (speed does not depend on the
//! values, and the prompt of a 4K context fills in seconds instead of minutes with the Q4_1
//! file's quantized matmuls); set `KVPOLICY_BENCH_MODEL=default` for the real GGUF weights.
//! A decode bench prefills its context once and then times consecutive steps, so the
//! context grows by the steps measured (a few dozen tokens).
use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use kvpolicy::models::{load, prefill, resolve, ModelSpec};
use kvpolicy::tiered::{
    engine_for, CopyJob, CpuTransferEngine, SyncTransferEngine, TransferEngine,
};
use kvpolicy::{build_policy, CausalLm, KvPolicy, LogitsMode, PolicyOptions};

const POLICIES: [&str; 4] = ["full", "layer", "headwise:1", "recompute"];
const CHUNK: usize = 256;

fn device() -> Device {
    Device::cuda_if_available(0).unwrap_or(Device::Cpu)
}

fn model(dev: &Device) -> Box<dyn CausalLm> {
    let spec = if std::env::var("KVPOLICY_BENCH_MODEL").as_deref() == Ok("default") {
        ModelSpec::Default
    } else {
        ModelSpec::Random {
            config: Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/configs/smollm2-135m.json"),
            seed: 1,
        }
    };
    let dtype = kvpolicy::models::activation_dtype(None, dev).unwrap_or(DType::F32);
    let files = resolve(&spec).unwrap_or_else(|e| panic!("bench model: {e}"));
    load(&files, dev, dtype, None)
        .unwrap_or_else(|e| panic!("bench model: {e}"))
        .model
}

fn policy(label: &str, dev: &Device) -> Box<dyn KvPolicy> {
    let opts = PolicyOptions {
        device: dev.clone(),
        ..PolicyOptions::default()
    };
    build_policy(label, &opts).unwrap_or_else(|e| panic!("{label}: {e}"))
}

fn ids(n: usize, offset: usize, vocab: u32) -> Vec<u32> {
    (0..n)
        .map(|i| ((i + offset) as u32 * 7919 + 13) % vocab)
        .collect()
}

fn decode(c: &mut Criterion) {
    let dev = device();
    let m = model(&dev);
    let vocab = m.info().vocab_size as u32;
    let mut g = c.benchmark_group("decode");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for ctx in [256usize, 1024, 4096] {
        for label in POLICIES {
            let p = RefCell::new(policy(label, &dev));
            prefill(
                m.as_ref(),
                p.borrow_mut().as_mut(),
                &ids(ctx, 0, vocab),
                CHUNK,
                false,
            )
            .unwrap_or_else(|e| panic!("{label} prefill: {e}"));
            g.bench_with_input(BenchmarkId::new(label, ctx), &ctx, |b, _| {
                b.iter_custom(|iters| {
                    let mut p = p.borrow_mut();
                    let start = Instant::now();
                    for _ in 0..iters {
                        let pos = p.seq_len();
                        let x = Tensor::new(&[(pos as u32 * 31 + 7) % vocab], &dev)
                            .and_then(|t| t.unsqueeze(0))
                            .unwrap_or_else(|e| panic!("{e}"));
                        m.forward(&x, pos, p.as_mut(), LogitsMode::Last)
                            .unwrap_or_else(|e| panic!("{label} decode: {e}"));
                    }
                    let _ = dev.synchronize();
                    start.elapsed()
                })
            });
        }
    }
    g.finish();
}

fn prefill_bench(c: &mut Criterion) {
    let dev = device();
    let m = model(&dev);
    let vocab = m.info().vocab_size as u32;
    let mut g = c.benchmark_group("prefill");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1));
    for ctx in [256usize, 1024] {
        let prompt = ids(ctx, 0, vocab);
        g.throughput(Throughput::Elements(ctx as u64));
        for label in POLICIES {
            g.bench_with_input(BenchmarkId::new(label, ctx), &ctx, |b, _| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let mut p = policy(label, &dev);
                        let start = Instant::now();
                        prefill(m.as_ref(), p.as_mut(), &prompt, CHUNK, false)
                            .unwrap_or_else(|e| panic!("{label} prefill: {e}"));
                        let _ = dev.synchronize();
                        total += start.elapsed();
                    }
                    total
                })
            });
        }
    }
    g.finish();
}

type MakeEngine = Box<dyn Fn() -> Box<dyn TransferEngine>>;

/// Host→device copies through each engine, from a host buffer of that engine: `sync` copies
/// pageable memory at submission; `worker` (CPU) on a thread; `cuda` (feature `cuda` on a
/// GPU) on its copy stream from page-locked memory.
fn transfer(c: &mut Criterion) {
    let dev = device();
    let mut g = c.benchmark_group("transfer");
    g.sample_size(20);
    for mib in [1usize, 16] {
        let n = mib << 20;
        let dst = Tensor::zeros(n, DType::U8, &dev).unwrap_or_else(|e| panic!("{e}"));
        g.throughput(Throughput::Bytes(n as u64));
        let own: (&str, MakeEngine) = if dev.is_cpu() {
            (
                "worker",
                Box::new(|| Box::new(CpuTransferEngine::new().unwrap_or_else(|e| panic!("{e}")))),
            )
        } else {
            let d = dev.clone();
            (
                "cuda",
                Box::new(move || engine_for(&d, None).unwrap_or_else(|e| panic!("{e}"))),
            )
        };
        let engines: [(&str, MakeEngine); 2] = [
            own,
            ("sync", Box::new(|| Box::new(SyncTransferEngine::default()))),
        ];
        for (name, make) in engines {
            let mut e = make();
            let src = e
                .host_zeros(n.into(), DType::U8)
                .unwrap_or_else(|e| panic!("{e}"));
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    let job = CopyJob {
                        src: src.clone(),
                        dst: dst.clone(),
                        dim: 0,
                        offset: 0,
                    };
                    let t = e.submit(vec![job]).unwrap_or_else(|e| panic!("{e}"));
                    e.wait(t).unwrap_or_else(|e| panic!("{e}"));
                    let _ = dev.synchronize();
                })
            });
            e.host_release(&src).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    g.finish();
}

criterion_group!(benches, transfer, decode, prefill_bench);
criterion_main!(benches);
