//! Prefixes shared by reference (issue 54, item 4): `full` holds a prefix restored from the
//! cache's RAM as the cache's own tensors — its device bytes count none of it, the cache
//! counts it once as shared and never evicts it while a sequence reads it — and a sequence
//! that computed a prefix gives its own copy up for the stored chunks (`adopt_prefix`).
//! Either way its attention is the attention over one buffer holding the same K/V, bit for
//! bit (chunks of whole kernel tiles). A sliding-window layer copies (its window starts
//! inside a chunk), with the same outputs.
mod common;

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use common::synthetic::{kv, Synthetic, DIM, HEADS};
use kvpolicy::prefix::{
    adopt_prefix, restore_kv, restore_prefix, store_new, ChunkKv, FingerprintBuilder, Placement,
    PrefixCache, PrefixConfig, Resume,
};
use kvpolicy::{KvPolicy, PolicyOptions};

/// Tokens per chunk: one kernel tile.
const CHUNK: usize = 256;
const WINDOW: usize = 300;

/// Layer 0 global, layer 1 a sliding window of `WINDOW` tokens (copied, never shared: a
/// window starts inside a chunk).
const MODEL: Synthetic = Synthetic {
    window: Some(WINDOW),
    step_tokens: CHUNK,
};

/// A prepared `full` policy for one sequence of up to 1,024 tokens.
fn full() -> Result<Box<dyn KvPolicy>> {
    prepared("full", &PolicyOptions::default())
}

/// Policy `name` built with `opts`, prepared for one sequence of up to 1,024 tokens.
fn prepared(name: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
    MODEL.prepared(name, opts)
}

/// One step of `kv` at `pos` through every layer (`attend`), with queries `q`; the
/// outputs.
fn step(p: &mut dyn KvPolicy, q: &Tensor, kv: &ChunkKv, pos: usize) -> Result<Vec<Tensor>> {
    MODEL.step(p, q, kv, pos)
}

/// `kv` stored in `p` without attention (a copy), from position 0.
fn append(p: &mut dyn KvPolicy, kv: &ChunkKv) -> Result<()> {
    let at = Placement {
        seq: 0,
        pos: 0,
        piece: 0,
    };
    Ok(restore_kv(p, kv, at, &MODEL.specs())?)
}

fn cache(ram_chunks: u64) -> Result<PrefixCache> {
    let cfg = PrefixConfig {
        chunk_tokens: CHUNK,
        ram_bytes: ram_chunks * kv(CHUNK)?.bytes(),
        dir: None,
        ..PrefixConfig::default()
    };
    let fp = FingerprintBuilder::new().field("m", b"share").finish();
    Ok(PrefixCache::open(&cfg, fp)?)
}

fn same(a: &[Tensor], b: &[Tensor]) -> Result<()> {
    within(a, b, 0.0)
}

/// Outputs that differ by at most `tol`.
fn within(a: &[Tensor], b: &[Tensor], tol: f32) -> Result<()> {
    for (x, y) in a.iter().zip(b) {
        let d = (x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        ensure!(d <= tol, "outputs differ by {d} (tolerance {tol})");
    }
    Ok(())
}

/// The longest cached run of `prompt` restored into `p` (one sequence, pieces of a chunk):
/// the tokens restored.
fn restored(cache: &mut PrefixCache, p: &mut dyn KvPolicy, prompt: &[u32]) -> Result<usize> {
    let usable = |_| true;
    let resume = Resume {
        usable: &usable,
        piece: CHUNK,
        seq: 0,
    };
    Ok(restore_prefix(cache, p, prompt, &MODEL.specs(), resume)?
        .reuse
        .tokens)
}

/// Bytes `p` holds on the device and the host tier.
fn held(p: &dyn KvPolicy) -> u64 {
    let s = p.stats();
    s.host_kv_bytes + s.device_kv_bytes
}

#[test]
fn a_restored_prefix_is_held_by_reference_and_pinned() -> Result<()> {
    let prompt: Vec<u32> = (0..600).collect();
    let history = kv(600)?;
    let mut cache = cache(3)?;
    ensure!(store_new(&mut cache, &prompt, 0, &history)? == 2);
    let mut shared = full()?;
    ensure!(restored(&mut cache, shared.as_mut(), &prompt)? == 2 * CHUNK);
    ensure!(shared.seq_len() == 2 * CHUNK);
    let chunk_bytes = kv(CHUNK)?.bytes();
    let mut copied = full()?;
    append(copied.as_mut(), &history.narrow(0, 2 * CHUNK)?)?;
    // The global layer counts none of the prefix: the policy holds half of the copy's bytes
    // or less (the windowed layer's copy, at most).
    let (by_ref, by_copy) = (
        shared.stats().device_kv_bytes,
        copied.stats().device_kv_bytes,
    );
    ensure!(
        by_ref > 0 && 2 * by_ref <= by_copy,
        "{by_ref} bytes held against a copy's {by_copy}"
    );
    ensure!(cache.stats().shared_bytes == 2 * chunk_bytes);
    // What a scheduler sees it hold of its own: none of the prefix's tokens.
    ensure!(shared.stats().shared_kv_tokens == 2 * CHUNK as u64);

    // Another prompt's chunks do not evict the leased ones: the RAM has room for one more.
    let other: Vec<u32> = (1000..1600).collect();
    store_new(&mut cache, &other, 0, &kv(600)?)?;
    let s = cache.stats();
    ensure!(
        s.ram_bytes == 3 * chunk_bytes && s.ram_evictions == 0,
        "{s:?}"
    );
    for k in cache.keys(&prompt[..2 * CHUNK]) {
        ensure!(cache.contains(&k), "a leased chunk was evicted");
    }

    // The rest of the prompt, then a decode step: the outputs of a policy holding the
    // whole history in its own buffer, bit for bit.
    let rest = history.narrow(2 * CHUNK, 600 - 2 * CHUNK)?;
    let q = Tensor::randn(
        0f32,
        1.0,
        (1, 2 * HEADS, rest.shape()?.tokens, DIM),
        &Device::Cpu,
    )?;
    same(
        &step(shared.as_mut(), &q, &rest, 2 * CHUNK)?,
        &step(copied.as_mut(), &q, &rest, 2 * CHUNK)?,
    )?;
    let (q1, t1) = (
        Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 1, DIM), &Device::Cpu)?,
        kv(1)?,
    );
    same(
        &step(shared.as_mut(), &q1, &t1, 600)?,
        &step(copied.as_mut(), &q1, &t1, 600)?,
    )?;
    ensure!(shared.stats().device_kv_bytes < copied.stats().device_kv_bytes);

    // Released: the chunks are the cache's again, evictable.
    drop(shared);
    ensure!(cache.stats().shared_bytes == 0);
    Ok(())
}

#[test]
fn the_sequence_that_computed_a_prefix_adopts_the_stored_chunks() -> Result<()> {
    let prompt: Vec<u32> = (0..600).collect();
    let history = kv(600)?;
    let (mut adopting, mut keeping) = (full()?, full()?);
    append(adopting.as_mut(), &history)?;
    append(keeping.as_mut(), &history)?;
    let before = adopting.stats().device_kv_bytes;
    let mut cache = cache(4)?;
    ensure!(store_new(&mut cache, &prompt, 0, &history)? == 2);
    ensure!(adopt_prefix(&cache, adopting.as_mut(), 0, &prompt)? == 2);
    let after = adopting.stats().device_kv_bytes;
    ensure!(
        after < before && adopting.seq_len() == 600,
        "{before} → {after} bytes, {} tokens",
        adopting.seq_len()
    );
    ensure!(cache.stats().shared_bytes == 2 * kv(CHUNK)?.bytes());
    ensure!(adopting.stats().shared_kv_tokens == 2 * CHUNK as u64);
    // Adopting again changes nothing.
    ensure!(adopt_prefix(&cache, adopting.as_mut(), 0, &prompt)? == 0);
    for _ in 0..3 {
        let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 1, DIM), &Device::Cpu)?;
        let t = kv(1)?;
        let at = adopting.seq_len();
        same(
            &step(adopting.as_mut(), &q, &t, at)?,
            &step(keeping.as_mut(), &q, &t, at)?,
        )?;
    }
    Ok(())
}

/// The offload policies that stream from the host tier, with their options: `headwise`
/// (one head per unit) and `auto` under a device budget of one global unit (the rest
/// stream).
fn streaming() -> Vec<(&'static str, PolicyOptions)> {
    let unit = (2 * 1024 * DIM * 4) as u64;
    vec![
        ("headwise", PolicyOptions::default()),
        (
            "auto",
            PolicyOptions {
                device_kv_budget: Some(8 * unit),
                ..PolicyOptions::default()
            },
        ),
    ]
}

/// `headwise` and `auto` hold a restored prefix by reference on their host tier: the host
/// bytes count none of the global layer's prefix, the cache counts it as shared, and the
/// outputs are those of the same policy holding a copy, bit for bit, and `full`'s within
/// 1e-5 — through the rest of the prompt and decode steps. Released, the chunks are the
/// cache's again.
#[test]
fn streaming_policies_hold_a_restored_prefix_on_the_host_by_reference() -> Result<()> {
    let prompt: Vec<u32> = (0..600).collect();
    let history = kv(600)?;
    let chunk_bytes = kv(CHUNK)?.bytes();
    for (name, opts) in streaming() {
        let mut cache = cache(3)?;
        ensure!(store_new(&mut cache, &prompt, 0, &history)? == 2);
        let mut shared = prepared(name, &opts)?;
        ensure!(restored(&mut cache, shared.as_mut(), &prompt)? == 2 * CHUNK);
        ensure!(shared.seq_len() == 2 * CHUNK);
        ensure!(
            cache.stats().shared_bytes == 2 * chunk_bytes,
            "{name}: {:?}",
            cache.stats()
        );
        ensure!(
            shared.stats().shared_kv_tokens == 2 * CHUNK as u64,
            "{name}"
        );
        let (mut copied, mut reference) = (prepared(name, &opts)?, full()?);
        append(copied.as_mut(), &history.narrow(0, 2 * CHUNK)?)?;
        append(reference.as_mut(), &history.narrow(0, 2 * CHUNK)?)?;
        // At least the global layer's prefix (a chunk's bytes: half of each of two) fewer
        // bytes held over the tiers than with a copy.
        let (by_ref, by_copy) = (held(shared.as_ref()), held(copied.as_ref()));
        ensure!(
            by_ref > 0 && by_ref + chunk_bytes <= by_copy,
            "{name}: {by_ref} bytes held against a copy's {by_copy}"
        );
        let rest = history.narrow(2 * CHUNK, 600 - 2 * CHUNK)?;
        let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 88, DIM), &Device::Cpu)?;
        let outs = step(shared.as_mut(), &q, &rest, 2 * CHUNK)?;
        same(&outs, &step(copied.as_mut(), &q, &rest, 2 * CHUNK)?)?;
        within(
            &outs,
            &step(reference.as_mut(), &q, &rest, 2 * CHUNK)?,
            1e-5,
        )?;
        for at in 600..603 {
            let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 1, DIM), &Device::Cpu)?;
            let t = kv(1)?;
            let outs = step(shared.as_mut(), &q, &t, at)?;
            same(&outs, &step(copied.as_mut(), &q, &t, at)?)?;
            within(&outs, &step(reference.as_mut(), &q, &t, at)?, 1e-5)?;
        }
        ensure!(held(shared.as_ref()) < held(copied.as_ref()), "{name}");
        drop(shared);
        ensure!(cache.stats().shared_bytes == 0, "{name}");
    }
    Ok(())
}

/// A `headwise` or `auto` sequence that computed a prefix gives its host copy up for the
/// stored chunks (`auto`'s resident units of the layer go to the host tier), holds fewer
/// bytes, and decodes as the one that kept its copy, bit for bit.
#[test]
fn streaming_policies_adopt_the_stored_chunks() -> Result<()> {
    let prompt: Vec<u32> = (0..600).collect();
    let history = kv(600)?;
    for (name, opts) in streaming() {
        let (mut adopting, mut keeping) = (prepared(name, &opts)?, prepared(name, &opts)?);
        append(adopting.as_mut(), &history)?;
        append(keeping.as_mut(), &history)?;
        let before = held(adopting.as_ref());
        let mut cache = cache(4)?;
        ensure!(store_new(&mut cache, &prompt, 0, &history)? == 2);
        ensure!(
            adopt_prefix(&cache, adopting.as_mut(), 0, &prompt)? == 2,
            "{name}"
        );
        let after = held(adopting.as_ref());
        ensure!(
            after < before && adopting.seq_len() == 600,
            "{name}: {before} → {after} bytes, {} tokens",
            adopting.seq_len()
        );
        ensure!(
            adopting.stats().shared_kv_tokens == 2 * CHUNK as u64,
            "{name}"
        );
        ensure!(
            adopt_prefix(&cache, adopting.as_mut(), 0, &prompt)? == 0,
            "{name}"
        );
        for at in 600..603 {
            let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 1, DIM), &Device::Cpu)?;
            let t = kv(1)?;
            same(
                &step(adopting.as_mut(), &q, &t, at)?,
                &step(keeping.as_mut(), &q, &t, at)?,
            )?;
        }
    }
    Ok(())
}
