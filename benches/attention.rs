//! Criterion benches of one attention call, the tiled kernel every policy runs
//! (`attend_partial`) against the eager reference that materialises every score
//! (`attend_partial_eager`), on SmolLM2-135M's head shape (9 query heads over 3 KV heads of
//! 64): a decode step (`decode/IMPL/CONTEXT`) and a 256-token prefill chunk at the end of
//! the context (`chunk/IMPL/CONTEXT`). `cargo bench --bench attention`.
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvpolicy::core::attention::attend_partial_eager;
use kvpolicy::{attend_partial, AttnInputs, AttnSpec};

fn inputs(t: usize, s: usize) -> (Tensor, Tensor, Tensor) {
    let dev = Device::Cpu;
    let r = |shape: (usize, usize, usize, usize)| {
        Tensor::randn(0f32, 1.0, shape, &dev).unwrap_or_else(|e| panic!("inputs: {e}"))
    };
    (r((1, 9, t, 64)), r((1, 3, s, 64)), r((1, 3, s, 64)))
}

fn bench(c: &mut Criterion) {
    let spec = AttnSpec::new(9, 3, 64);
    for (group, t) in [("decode", 1usize), ("chunk", 256)] {
        let mut g = c.benchmark_group(group);
        g.sample_size(20);
        for s in [512usize, 2048, 8192] {
            let (q, k, v) = inputs(t, s);
            let pos = s - t;
            g.bench_with_input(BenchmarkId::new("tiled", s), &s, |b, _| {
                b.iter(|| {
                    attend_partial(
                        AttnInputs {
                            q: &q,
                            k: &k,
                            v: &v,
                            q_pos: pos,
                            k_pos: 0,
                        },
                        &spec,
                    )
                    .map(|p| p.out)
                })
            });
            g.bench_with_input(BenchmarkId::new("eager", s), &s, |b, _| {
                b.iter(|| {
                    attend_partial_eager(
                        AttnInputs {
                            q: &q,
                            k: &k,
                            v: &v,
                            q_pos: pos,
                            k_pos: 0,
                        },
                        &spec,
                    )
                    .map(|p| p.out)
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
