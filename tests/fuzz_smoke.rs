//! The fuzz targets' smoke run inside `cargo test`: seeds (the fixtures' configs and
//! weights, small GGUF headers), the inputs `cargo fuzz` found, and a few thousand random
//! mutations of them go through the same bodies as `fuzz/fuzz_targets/*` — errors are fine,
//! a panic fails the test and prints the input. Long runs use `cargo fuzz` (see fuzz/).
mod common;

#[path = "../fuzz/src/lib.rs"]
mod bodies;

use std::time::{Duration, Instant};

use common::Rng;

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = [0, 0xff, 0x7f, 0x80][rng.below(4)];
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            3 => {
                let i = rng.below(v.len() + 1);
                let b = rng.next().to_le_bytes();
                v.splice(i..i, b[..1 + rng.below(8)].iter().copied());
            }
            _ if v.len() >= 8 => {
                // Overwrite a little-endian u64 (a length or count field, often).
                let i = rng.below(v.len() - 7);
                v[i..i + 8].copy_from_slice(&rng.next().to_le_bytes());
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v
}

fn smoke(name: &str, body: fn(&[u8]), seeds: &[Vec<u8>], budget: Duration) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
    let start = Instant::now();
    let mut runs = 0usize;
    let mut run = |input: &[u8]| {
        let r = std::panic::catch_unwind(|| body(input));
        assert!(r.is_ok(), "{name}: panicked on input {:02x?}", input);
        runs += 1;
    };
    for s in seeds {
        run(s);
    }
    while start.elapsed() < budget {
        let s = &seeds[rng.below(seeds.len())];
        run(&mutate(s, &mut rng));
    }
    println!(
        "{name}: {runs} inputs in {:.1}s",
        start.elapsed().as_secs_f64()
    );
}

fn gguf_header(meta: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, ty, v) in meta {
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    b
}

#[test]
fn fuzz_targets_smoke_run() -> anyhow::Result<()> {
    let budget = Duration::from_secs(3);
    let fixtures = common::hf_fixtures();
    let configs: Vec<Vec<u8>> = fixtures
        .iter()
        .map(|f| std::fs::read(common::fixture(f).join("config.json")))
        .collect::<std::io::Result<_>>()?;
    smoke("config", bodies::config, &configs, budget);

    let s = |x: &str| {
        let mut v = (x.len() as u64).to_le_bytes().to_vec();
        v.extend(x.as_bytes());
        v
    };
    let u32v = |x: u32| x.to_le_bytes().to_vec();
    let ggufs = vec![
        std::fs::read(common::fixture("fuzz/gguf-oom-embedding-length.gguf"))?,
        gguf_header(&[("general.alignment", 4, u32v(0))]),
        gguf_header(&[
            ("general.architecture", 8, s("llama")),
            ("llama.attention.head_count", 4, u32v(2)),
            ("llama.block_count", 4, u32v(1)),
            ("llama.embedding_length", 4, u32v(8)),
        ]),
    ];
    smoke("gguf", bodies::gguf, &ggufs, budget);

    let st = vec![std::fs::read(
        common::fixture("llama_gqa").join("model.safetensors"),
    )?];
    smoke("safetensors", bodies::safetensors, &st, budget);

    let ops: Vec<Vec<u8>> = (0u8..16)
        .map(|i| (0..48).map(|j| i.wrapping_mul(37) ^ j).collect())
        .collect();
    smoke("policy_ops", bodies::policy_ops, &ops, budget);
    Ok(())
}
