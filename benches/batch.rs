//! Criterion bench of batched decoding (HybridServe's setting): decode throughput in
//! tokens per second over the whole batch for `hybrid`, `layer` and `recompute`, at batch
//! sizes 1, 8 and 32, on an OPT-6.7B-shaped multi-head model scaled down
//! (`scripts/configs/opt-6.7b-mini.json`, random weights).
//!
//! Names are `batch/POLICY/BATCH`; criterion's throughput line is tokens/s. Each request
//! has its own context length (128–248 tokens, prefilled once); every iteration is one
//! decode step of every request, planned into mini-batches by the policy. On the CPU the
//! host↔device link is simulated at `KVPOLICY_BENCH_LINK` bytes/s (default 1GB; `none` for
//! plain copies), so that transfers cost what they would over PCIe.
use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpolicy::models::{batch_step, load, resolve, ModelSpec, SeqChunk};
use kvpolicy::{build_policy_batched, CausalLm, KvPolicy, LogitsMode, PolicyOptions};

const POLICIES: [&str; 3] = ["hybrid", "layer", "recompute"];

fn device() -> Device {
    Device::cuda_if_available(0).unwrap_or(Device::Cpu)
}

fn link(dev: &Device) -> Option<f64> {
    let v = std::env::var("KVPOLICY_BENCH_LINK").unwrap_or_else(|_| "1GB".into());
    if !dev.is_cpu() || v == "none" {
        return None;
    }
    Some(kvpolicy::parse_bytes(&v).unwrap_or_else(|e| panic!("KVPOLICY_BENCH_LINK: {e}")) as f64)
}

fn model(dev: &Device) -> Box<dyn CausalLm> {
    let spec = ModelSpec::Random {
        config: Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/configs/opt-6.7b-mini.json"),
        seed: 1,
    };
    let dtype = kvpolicy::models::activation_dtype(None, dev).unwrap_or(DType::F32);
    let files = resolve(&spec).unwrap_or_else(|e| panic!("bench model: {e}"));
    load(&files, dev, dtype, None)
        .unwrap_or_else(|e| panic!("bench model: {e}"))
        .model
}

/// Runs one step of `chunks` (one per sequence) through the policy's plan.
fn step(m: &dyn CausalLm, p: &mut dyn KvPolicy, chunks: &[SeqChunk]) {
    batch_step(m, p, chunks, LogitsMode::Last).unwrap_or_else(|e| panic!("{}: {e}", p.name()));
}

fn batch(c: &mut Criterion) {
    let dev = device();
    let m = model(&dev);
    let vocab = m.info().vocab_size as u32;
    let mut g = c.benchmark_group("batch");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for b in [1usize, 8, 32] {
        g.throughput(Throughput::Elements(b as u64));
        for name in POLICIES {
            let opts = PolicyOptions {
                device: dev.clone(),
                link_bandwidth: link(&dev),
                ..PolicyOptions::default()
            };
            let mut p = build_policy_batched(name, &opts).unwrap_or_else(|e| panic!("{e}"));
            let lens: Vec<usize> = (0..b).map(|i| 128 + (i * 40) % 128).collect();
            let max = lens.iter().max().copied().unwrap_or(0) + 2048;
            p.prepare(&kvpolicy::models::engine::generate::kv_shape(
                m.info(),
                b,
                max,
                0,
            ))
            .unwrap_or_else(|e| panic!("{e}"));
            let prompts: Vec<SeqChunk> = lens
                .iter()
                .enumerate()
                .map(|(seq, &n)| SeqChunk {
                    seq,
                    pos: 0,
                    ids: (0..n as u32)
                        .map(|t| (t * 7919 + seq as u32) % vocab)
                        .collect(),
                })
                .collect();
            step(m.as_ref(), p.as_mut(), &prompts);
            let pos = RefCell::new(lens.clone());
            let p = RefCell::new(p);
            g.bench_with_input(BenchmarkId::new(name, b), &b, |bench, _| {
                bench.iter_custom(|iters| {
                    let mut p = p.borrow_mut();
                    let mut pos = pos.borrow_mut();
                    let start = Instant::now();
                    for _ in 0..iters {
                        let chunks: Vec<SeqChunk> = pos
                            .iter()
                            .enumerate()
                            .map(|(seq, &q)| SeqChunk {
                                seq,
                                pos: q,
                                ids: vec![(q as u32 * 31 + 7) % vocab],
                            })
                            .collect();
                        step(m.as_ref(), p.as_mut(), &chunks);
                        pos.iter_mut().for_each(|q| *q += 1);
                    }
                    let _ = dev.synchronize();
                    start.elapsed()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, batch);
criterion_main!(benches);
