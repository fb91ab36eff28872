//! What preemption by swapping rests on (issue 54; `kvpolicy-server --preemption-mode
//! swap`): `KvRestore::export_kv` hands a sequence's K/V back bit for bit — from `full`'s
//! buffers and its runs held by reference, from the host tier of `layer`, `headwise` and
//! `auto` (its resident units demoted first) — so that a fresh policy given them with
//! `append_kv` goes on exactly as the one that computed them; a layer whose front a window
//! dropped is not handed back (the server then recomputes); and K/V appended through a
//! `Capture` are recorded as those attended (a swapped request's prompt coming back while its
//! prefill is recorded for the prefix cache).
mod common;

use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};
use common::synthetic::{kv, Synthetic, DIM, HEADS, LAYERS};
use kvpolicy::prefix::{
    restore_kv, restore_prefix, store_new, Capture, ChunkKv, FingerprintBuilder, LayerKv,
    LayerSpecs, Placement, PrefixCache, PrefixConfig, Resume,
};
use kvpolicy::{KvPolicy, PolicyOptions};

const PIECE: usize = 64;
const WINDOW: usize = 100;

/// Both layers global, or layer 1 a sliding window of `WINDOW` tokens; steps of `PIECE`.
fn model(windowed: bool) -> Synthetic {
    Synthetic {
        window: windowed.then_some(WINDOW),
        step_tokens: PIECE,
    }
}

fn specs(windowed: bool) -> LayerSpecs {
    model(windowed).specs()
}

fn prepared(name: &str, opts: &PolicyOptions, windowed: bool) -> Result<Box<dyn KvPolicy>> {
    model(windowed).prepared(name, opts)
}

fn step(
    p: &mut dyn KvPolicy,
    q: &Tensor,
    kv: &ChunkKv,
    pos: usize,
    w: bool,
) -> Result<Vec<Tensor>> {
    model(w).step(p, q, kv, pos)
}

/// `history` from position `from` on, prefilled into `p` in pieces of `PIECE`, with
/// attention (random queries).
fn prefill(p: &mut dyn KvPolicy, history: &ChunkKv, from: usize, windowed: bool) -> Result<()> {
    let n = history.shape()?.tokens;
    let mut at = from;
    while at < n {
        let len = PIECE.min(n - at);
        let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, len, DIM), &Device::Cpu)?;
        step(p, &q, &history.narrow(at, len)?, at, windowed)?;
        at += len;
    }
    Ok(())
}

/// Every layer `p` hands back, or `None` where one is not.
fn exported(p: &mut dyn KvPolicy) -> Result<Vec<Option<LayerKv>>> {
    let r = p.as_restore().context("a policy taking K/V")?;
    (0..LAYERS)
        .map(|l| Ok(r.export_kv(0, l)?))
        .collect::<Result<Vec<_>>>()
}

/// Equal bit for bit.
fn same(a: &Tensor, b: &Tensor) -> Result<bool> {
    Ok(a.dims() == b.dims() && (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? == 0.0)
}

/// The policies that hand K/V back, with their options (`auto` under a budget of a few
/// units: some resident, the rest streamed).
fn exporting() -> Vec<(&'static str, PolicyOptions)> {
    let unit = (1024 * DIM * 4 * 2) as u64;
    let budget = |b| PolicyOptions {
        device_kv_budget: Some(b),
        ..PolicyOptions::default()
    };
    vec![
        ("full", PolicyOptions::default()),
        ("layer", PolicyOptions::default()),
        ("headwise", PolicyOptions::default()),
        ("auto", budget(5 * unit)),
    ]
}

#[test]
fn exported_kv_continue_a_fresh_policy_bit_for_bit() -> Result<()> {
    let history = kv(300)?;
    for (name, opts) in exporting() {
        let mut first = prepared(name, &opts, false)?;
        prefill(first.as_mut(), &history, 0, false)?;
        let layers = exported(first.as_mut())?;
        let mut back = Vec::new();
        for (l, got) in layers.into_iter().enumerate() {
            let got = got.with_context(|| format!("{name}: layer {l} not handed back"))?;
            ensure!(
                same(&got.k, &history.layers[l].k)? && same(&got.v, &history.layers[l].v)?,
                "{name}: layer {l}'s K/V are not what was stored"
            );
            back.push(got);
        }
        // A fresh policy given them in pieces goes on as the first, bit for bit.
        let mut second = prepared(name, &opts, false)?;
        let at = Placement {
            seq: 0,
            pos: 0,
            piece: PIECE,
        };
        restore_kv(
            second.as_mut(),
            &ChunkKv { layers: back },
            at,
            &specs(false),
        )?;
        ensure!(second.seq_len() == 300, "{name}");
        for pos in 300..303 {
            let q = Tensor::randn(0f32, 1.0, (1, 2 * HEADS, 1, DIM), &Device::Cpu)?;
            let t = kv(1)?;
            let a = step(first.as_mut(), &q, &t, pos, false)?;
            let b = step(second.as_mut(), &q, &t, pos, false)?;
            for (x, y) in a.iter().zip(&b) {
                ensure!(
                    same(x, y)?,
                    "{name}: decode at {pos} differs after the swap"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn a_prefix_held_by_reference_is_handed_back_with_the_rest() -> Result<()> {
    let prompt: Vec<u32> = (0..600).collect();
    let history = kv(600)?;
    let chunk = 256;
    let cfg = PrefixConfig {
        chunk_tokens: chunk,
        ram_bytes: 4 * kv(chunk)?.bytes(),
        dir: None,
        ..PrefixConfig::default()
    };
    for (name, opts) in [
        ("full", PolicyOptions::default()),
        ("headwise", PolicyOptions::default()),
    ] {
        let fp = FingerprintBuilder::new().field("m", b"swap").finish();
        let mut cache = PrefixCache::open(&cfg, fp)?;
        ensure!(store_new(&mut cache, &prompt, 0, &history)? == 2);
        let mut p = prepared(name, &opts, false)?;
        let usable = |_| true;
        let resume = Resume {
            usable: &usable,
            piece: chunk,
            seq: 0,
        };
        let r = restore_prefix(&mut cache, p.as_mut(), &prompt, &specs(false), resume)?;
        ensure!(r.reuse.tokens == 2 * chunk, "{name}");
        ensure!(
            cache.stats().shared_bytes > 0,
            "{name}: not held by reference"
        );
        prefill(p.as_mut(), &history, 2 * chunk, false)?;
        for (l, got) in exported(p.as_mut())?.into_iter().enumerate() {
            let got = got.with_context(|| format!("{name}: layer {l} not handed back"))?;
            ensure!(
                same(&got.k, &history.layers[l].k)? && same(&got.v, &history.layers[l].v)?,
                "{name}: layer {l}'s K/V are not the prefix and the rest"
            );
        }
    }
    Ok(())
}

#[test]
fn a_layer_whose_window_dropped_its_front_is_not_handed_back() -> Result<()> {
    let history = kv(300)?;
    let mut p = prepared("full", &PolicyOptions::default(), true)?;
    prefill(p.as_mut(), &history, 0, true)?;
    let layers = exported(p.as_mut())?;
    ensure!(layers[0].is_some(), "the global layer is handed back");
    ensure!(
        layers[1].is_none(),
        "a sliding window of {WINDOW} over 300 tokens dropped its front: not handed back"
    );
    Ok(())
}

#[test]
fn kv_appended_through_a_capture_are_recorded() -> Result<()> {
    let history = kv(200)?;
    let mut p = prepared("full", &PolicyOptions::default(), false)?;
    let mut capture = Capture::new(p.as_mut(), 64);
    let at = Placement {
        seq: 0,
        pos: 0,
        piece: PIECE,
    };
    restore_kv(&mut capture, &history, at, &specs(false))?;
    let kept = capture.kv()?.context("nothing recorded")?;
    let want = history.narrow(64, 136)?;
    for (l, (got, want)) in kept.layers.iter().zip(&want.layers).enumerate() {
        ensure!(
            same(&got.k, &want.k)? && same(&got.v, &want.v)?,
            "layer {l}: the recording is not the K/V appended from position 64"
        );
    }
    drop(capture);
    ensure!(p.seq_len() == 200, "the policy took them too");
    Ok(())
}
