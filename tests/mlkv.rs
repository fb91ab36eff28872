//! MLKV (cross-layer KV sharing, arXiv 2406.09297 §3) under every lossless policy: logits
//! equal the independent reference (HF's modules, `scripts/make_mlkv_fixtures.py`) within the
//! fixtures' tolerance, with prefill chunks straddling the owner layers' caches; and what a
//! policy stores and moves is exactly `m / L` of the same model unshared (a twin whose
//! reading layers have K/V projections of their own).
mod common;

use std::path::Path;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use kvpolicy::models::{load, resolve, ModelSpec};
use kvpolicy::{build_policy, KvStats, PolicyOptions};

const TOL: f32 = 1e-4;

/// Lossless policies as the tests build them (one KV head per `headwise` unit).
const POLICIES: &[&str] = &["full", "layer", "headwise:1", "auto", "recompute", "hybrid"];

const FIXTURES: &[&str] = &["mlkv_llama", "mlkv_mistral", "mlkv_qwen2"];

fn stats_and_logits(
    dir: &Path,
    name: &str,
    policy: &str,
    chunk: usize,
) -> Result<(KvStats, candle_core::Tensor)> {
    let loaded = load(
        &resolve(&ModelSpec::Dir(dir.to_path_buf()))?,
        &Device::Cpu,
        DType::F32,
        None,
    )?;
    let (prompt, decode) = common::fixture_ids(name)?;
    let mut p = build_policy(policy, &PolicyOptions::default())?;
    let logits =
        common::teacher_forced_logits(loaded.model.as_ref(), p.as_mut(), &prompt, &decode, chunk)?;
    Ok((p.stats(), logits))
}

#[test]
fn every_lossless_policy_matches_the_reference() -> Result<()> {
    for name in FIXTURES {
        let want = common::fixture_logits(name)?;
        for policy in POLICIES {
            for chunk in [1, 5, 0] {
                let (_, got) = stats_and_logits(&common::fixture(name), name, policy, chunk)?;
                let d = common::max_abs_diff(&got, &want)?;
                ensure!(
                    d <= TOL,
                    "{name} {policy} chunk {chunk}: max |Δlogit| = {d}"
                );
            }
        }
    }
    Ok(())
}

/// The fixture with every reading layer given K/V projections (its owner's) and
/// `num_key_value_layers` removed: the same shapes, every layer a KV layer.
fn unshared_twin(name: &str, out: &Path) -> Result<()> {
    let src = common::fixture(name);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    let m = cfg["num_key_value_layers"].as_u64().unwrap_or(0) as usize;
    let l = cfg["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    ensure!(m > 0 && m < l, "{name} shares no KV layer");
    if let Some(o) = cfg.as_object_mut() {
        o.remove("num_key_value_layers");
    }
    std::fs::write(out.join("config.json"), serde_json::to_string(&cfg)?)?;
    let mut ts = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    let mut owner = 0;
    for i in 0..l {
        let key = |j: usize, p: &str, t: &str| format!("model.layers.{j}.self_attn.{p}.{t}");
        if ts.contains_key(&key(i, "k_proj", "weight")) {
            owner = i;
            continue;
        }
        for p in ["k_proj", "v_proj"] {
            for t in ["weight", "bias"] {
                if let Some(w) = ts.get(&key(owner, p, t)).cloned() {
                    ts.insert(key(i, p, t), w);
                }
            }
        }
    }
    candle_core::safetensors::save(&ts, out.join("model.safetensors"))?;
    Ok(())
}

#[test]
fn stored_and_moved_bytes_are_m_over_l_of_the_unshared_model() -> Result<()> {
    for name in FIXTURES {
        let twin = tempfile::tempdir()?;
        unshared_twin(name, twin.path())?;
        let info = common::load_fixture(name)?.model.info().clone();
        let (m, l) = (info.kv_layers() as u64, info.n_layers as u64);
        ensure!(m < l, "{name}: {m} of {l} layers");
        for policy in POLICIES {
            let (shared, _) = stats_and_logits(&common::fixture(name), name, policy, 5)?;
            let (plain, _) = stats_and_logits(twin.path(), name, policy, 5)?;
            // What the policy stores: the device tier for `full` and `auto` (resident), the
            // host tier (K/V, and layer inputs for `recompute`/`hybrid`) for the others.
            let stored = |s: &KvStats| match *policy {
                "full" | "auto" => s.device_kv_bytes,
                _ => s.host_kv_bytes + s.disk_kv_bytes,
            };
            ensure!(
                stored(&shared) * l == stored(&plain) * m && stored(&shared) > 0,
                "{name} {policy}: stores {} bytes, unshared {} ({m} of {l} layers)",
                stored(&shared),
                stored(&plain)
            );
            // Host→device traffic: each owner layer crosses the link once per step,
            // whatever reads it. (`hybrid` splits its blocks between K/V and layer inputs
            // by costs it measures in the run, so its traffic is no fixed fraction.)
            ensure!(
                *policy == "hybrid" || shared.h2d_bytes * l == plain.h2d_bytes * m,
                "{name} {policy}: moved {} bytes host→device, unshared {}",
                shared.h2d_bytes,
                plain.h2d_bytes
            );
        }
    }
    Ok(())
}

/// The approximate policies serve readers too: with a budget covering the context they
/// give the reference's logits, their stored bytes are `m / L` of the unshared twin's, and
/// with a small budget (each reader selecting its own pages) they run and say they are lossy.
#[test]
fn approximate_policies_serve_readers() -> Result<()> {
    for name in FIXTURES {
        let want = common::fixture_logits(name)?;
        let twin = tempfile::tempdir()?;
        unshared_twin(name, twin.path())?;
        let info = common::load_fixture(name)?.model.info().clone();
        let (m, l) = (info.kv_layers() as u64, info.n_layers as u64);
        for policy in ["quest", "flexicache", "clo"] {
            let wide = format!("{policy}:page=8,sinks=8,window=16,budget=4096");
            for chunk in [1, 5] {
                let (st, got) = stats_and_logits(&common::fixture(name), name, &wide, chunk)?;
                let d = common::max_abs_diff(&got, &want)?;
                ensure!(d <= TOL, "{name} {wide} chunk {chunk}: max |Δlogit| = {d}");
                ensure!(st.lossy, "{name} {wide}: not labeled lossy");
            }
            let small = format!("{policy}:page=4,sinks=4,window=8,budget=8");
            let (shared, _) = stats_and_logits(&common::fixture(name), name, &small, 5)?;
            let (plain, _) = stats_and_logits(twin.path(), name, &small, 5)?;
            ensure!(shared.lossy, "{name} {small}: not labeled lossy");
            // What they store on the host (a model whose every layer slides, Mistral here,
            // keeps its windows on the device and stores nothing there).
            let stored = |s: &KvStats| s.host_kv_bytes + s.disk_kv_bytes;
            let windowed = info.kv_windows().iter().all(Option::is_some);
            ensure!(
                stored(&shared) * l == stored(&plain) * m && (windowed || stored(&shared) > 0),
                "{name} {small}: stores {} bytes, unshared {}",
                stored(&shared),
                stored(&plain)
            );
        }
    }
    Ok(())
}

#[test]
fn a_policy_that_cannot_serve_readers_says_so() -> Result<()> {
    let loaded = common::load_fixture("mlkv_llama")?;
    let (prompt, decode) = common::fixture_ids("mlkv_llama")?;
    // A user's policy without `attend_shared` (the example's `sinks`).
    let mut sinks = kvpolicy_custom_policy::SinkWindow::new(4, 8);
    let err = common::teacher_forced_logits(loaded.model.as_ref(), &mut sinks, &prompt, &decode, 5)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    ensure!(
        err.contains("cannot serve a model whose layers share K/V"),
        "unexpected: {err}"
    );
    Ok(())
}
